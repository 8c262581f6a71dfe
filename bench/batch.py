"""A batch of concurrent requests through a pipeline of stages, and llama.cpp's RPC split beside it.

hpipe: `hpipe launch --local` of `hpipe plan --stages N` (default flags, after `hpipe warmup
--threads` of the stages' thread count: one thread a stage on this 2-core machine, as emulated
hosts get), --batch requests of a 256-token prompt each arriving at once (`--max-batch` the same),
128 greedy tokens each. Output tokens/s of the decode: the sum over requests of 1 / TPOT (the
requests decode side by side), and the run's own generated tokens over its wall time, prefills
included; each stage's busy fraction (the run summary's).

llama.cpp: `llama-batched-bench -npp 256 -ntg 128 -npl --batch` on the same file, one thread, its
blocks split evenly over this process and --stages - 1 one-thread `ggml-rpc-server`s on 127.0.0.1
(bench/trip.py's split): `speed_tg`, the text generation's tokens/s over all sequences, and
`speed`, every token (prompt and generated) over the whole time.

Rounds alternate which goes first (this machine's speed drifts); the report gives each round and
the median of the rounds' ratios.

    python bench/batch.py [--batch 8] [--stages 3] [--rounds 3]

Writes bench/results/batch.json (or --out).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import (bench_arguments, cpu_flags, cpu_name, hpipe, kernels_line, prompt_ids,  # noqa: E402
                          results_path)
from bench.trip import LlamaRpc, prepare_hpipe  # noqa: E402

PROMPT, NEW = 256, 128


def hpipe_batch(plan: Path, batch: int, work: Path) -> dict:
    """One `hpipe launch --local` of `batch` requests at once: decode tokens/s, end-to-end output
    tokens/s, the stages' busy fractions."""
    prompts, results = work / "batch.jsonl", work / "batch-out.jsonl"
    # each request its own prompt: no cached prefix shared between them (llama.cpp's -pps is off too)
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": prompt_ids(PROMPT + i)[i:]}) + "\n"
                               for i in range(batch)))
    results.unlink(missing_ok=True)
    hpipe("launch", plan, "--local", "--prompts", prompts, "--out", results, "--max-new-tokens", NEW,
          "--max-batch", batch, "--quiet", cwd=work)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    summary = json.loads(Path(f"{results}.summary.json").read_text())
    assert len(rows) == batch and all(len(r["output_ids"]) == NEW for r in rows), "a request stopped early"
    return {"decode_tokens_per_s": round(sum(1 / r["tpot_s"] for r in rows), 2),
            "output_tokens_per_s": round(summary["run"]["tokens_per_s"], 2),
            "busy": [round(summary["busy_fraction"][k], 3) for k in sorted(summary["busy_fraction"], key=int)]}


def llama_batch(rpc: LlamaRpc, batch: int) -> dict:
    """`llama-batched-bench` through the RPC split: text generation tokens/s, and all tokens/s."""
    from bench.shapes import llama_cpp_bin

    cmd = [str(llama_cpp_bin("llama-batched-bench")), *rpc.split_args,
           "-c", str(batch * (PROMPT + NEW) + 64), "-npp", str(PROMPT), "-ntg", str(NEW), "-npl", str(batch),
           "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {"decode_tokens_per_s": round(row["speed_tg"], 2),
            "all_tokens_per_s": round(row["speed"], 2), "generated_over_all_time": round(batch * NEW / row["t"], 2)}


def main() -> None:
    from hpipe import models

    args = bench_arguments(batch=(8, "concurrent requests"), stages=3, model="smollm2",
                           rounds=(3, "rounds of the two, alternated (this machine is shared)"),
                           out=results_path("batch"))
    path = models.smollm2_gguf_path() if args.model == "smollm2" else Path(args.model)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        plan, ours = prepare_hpipe(args.model, args.stages, [], Path(tmp))
        theirs = LlamaRpc(path, args.stages)
        try:
            for r in range(args.rounds):
                row = {}
                for who in (("hpipe", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "hpipe")):
                    row[who] = hpipe_batch(plan, args.batch, Path(tmp)) if who == "hpipe" else \
                        llama_batch(theirs, args.batch)
                rounds.append(row)
                print(json.dumps(row), flush=True)
        finally:
            theirs.close()

    def ratio(ours_key: str, theirs_key: str) -> float:
        return round(statistics.median(row["hpipe"][ours_key] / row["llama.cpp"][theirs_key] for row in rounds), 3)

    report = {"date": time.strftime("%Y-%m-%d"), "machine_cores": os.cpu_count(), "cpu": cpu_name(),
              "cpu_flags": cpu_flags(), "kernels": kernels_line(), "file": path.name, "stages": args.stages,
              "batch": args.batch, "prompt": PROMPT, "new_tokens": NEW, "hpipe_flags": "(defaults)", "hpipe": ours,
              "llama.cpp rpc split": theirs.split,
              "decode_tokens_per_s_vs_llama_cpp": ratio("decode_tokens_per_s", "decode_tokens_per_s"),
              "output_tokens_per_s_vs_llama_cpp": ratio("output_tokens_per_s", "generated_over_all_time"),
              "rounds": rounds}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
