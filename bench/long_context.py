"""Long prompts against llama.cpp on the same GGUF file and threads: the prefill of an N-token prompt
and the decode after it (the time per output token of 32 tokens at that context), for N in
--contexts, hpipe with default flags after `hpipe warmup` (one local stage, `hpipe launch`: the
user's path) against `llama-bench -p N -n 0` and `llama-bench -p 0 -n 32 -d N` (decode after N
tokens of context, llama.cpp's f16 cache). hpipe's cache is the plan's `--kv-dtype` (--kv-dtypes:
each gets its plan and its warmup; float32 shows what the 16-bit default gives).

    python bench/long_context.py [--model smollm2] [--contexts 1024,4096,8000] [--threads 2]
                                 [--kv-dtypes float16,float32]

Writes bench/results/long_context.json (--out), the CPU's flags with it.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, cpu_flags, cpu_name, hpipe, prompt_ids, results_path  # noqa: E402

NEW = 32
LLAMA_BENCH = Path("/opt/llama.cpp/build/bin/llama-bench")


def model_file(model: str) -> Path:
    from hpipe import models

    return models.smollm2_gguf_path() if model == "smollm2" else Path(model).expanduser().resolve()


def ours(model: str, kv_dtype: str, contexts: list[int], work: Path) -> dict:
    """Per context: prefill seconds (TTFT of the launch) and decode ms/token after it (TPOT)."""
    plan = work / f"plan-{kv_dtype}.json"
    spec = "smollm2" if model == "smollm2" else str(model_file(model))
    hpipe("plan", "--model", spec, "--stages", "1", "--kv-dtype", kv_dtype, "-o", plan, cwd=work)
    t = time.perf_counter()
    hpipe("warmup", "--model", spec, "--kv-dtype", kv_dtype, cwd=work)
    out = {"warmup_s": round(time.perf_counter() - t, 1)}
    for n in contexts:
        prompts, results = work / f"prompt-{n}.jsonl", work / f"out-{kv_dtype}-{n}.jsonl"
        prompts.write_text(json.dumps({"id": f"c{n}", "input_ids": prompt_ids(n)}) + "\n")
        results.unlink(missing_ok=True)
        hpipe("launch", plan, "--local", "--prompts", prompts, "--out", results, "--max-new-tokens", NEW, "--quiet",
              "--max-model-len", n + NEW + 16, cwd=work)
        r = json.loads(results.read_text().splitlines()[0])
        out[str(n)] = {"prefill_s": r["ttft_s"], "decode_ms": 1000 * r["tpot_s"]}
        print(kv_dtype, n, out[str(n)], flush=True)
    return out


def theirs(model: str, contexts: list[int], threads: int) -> dict:
    """llama-bench's prefill of N tokens and decode of NEW after N, each the mean of its repetitions."""
    out = {}
    for n in contexts:
        def run(*args) -> float:
            done = subprocess.run([str(LLAMA_BENCH), "-m", str(model_file(model)), "-t", str(threads), "-r", "2",
                                   "-o", "json", *map(str, args)], check=True, capture_output=True, text=True)
            return json.loads(done.stdout)[0]["avg_ts"]
        out[str(n)] = {"prefill_s": n / run("-p", n, "-n", 0), "decode_ms": 1000 / run("-p", 0, "-n", NEW, "-d", n)}
        print("llama.cpp", n, out[str(n)], flush=True)
    return out


def main() -> None:
    args = bench_arguments(__doc__, model=("smollm2", "smollm2 or a GGUF file"), contexts="1024,4096,8000", threads=2,
                           kv_dtypes="float16,float32", work="/tmp/hpipe-long-context",
                           out=results_path("long_context"))
    contexts = [int(c) for c in args.contexts.split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs = {"llama.cpp": theirs(args.model, contexts, args.threads)}
    for kv in args.kv_dtypes.split(","):
        runs[f"hpipe kv {kv}"] = ours(args.model, kv, contexts, work)
    ref = runs["llama.cpp"]
    ratio = {name: {c: {k: round(v[c][k] / ref[c][k], 3) for k in ref[c]} for c in ref}
             for name, v in runs.items() if name != "llama.cpp"}
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_flags": cpu_flags(), "threads": args.threads,
              "model": args.model, "new_tokens": NEW, "runs": runs, "ratio_to_llama_cpp": ratio}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(ratio, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
