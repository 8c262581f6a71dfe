"""What `--deterministic on` costs: the default model (its GGUF file kept quantized) on one CPU
stage, with and without the setting, interleaved (this machine is shared and noisy), compared as
ratios within the run.

The stage's own steps, in one process (`steps`: the median of --rounds rounds of 8 steps each):
a decode step of 1 and of 8 rows after 512-token prompts, and a prefill micro-batch of one
512-token prompt and of 8 prompts of 64 tokens.

Jobs through `hpipe launch` (`jobs`: the best of --repeats):
- batch 1: one 512-token prompt (prefill: its time to first token) and 64 greedy tokens (decode:
  its time per output token);
- batch 8: eight 512-token prompts at once (prefill: the time until the last one's first token;
  decode: the requests' mean time per output token);
- one 2,048-token prompt (prefill).
Writes bench/results/determinism.json.

    python bench/determinism.py [--repeats 2] [--out bench/results/determinism.json]
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, cpu_flags, cpu_name, results_path  # noqa: E402

CASES = {"batch 1": (1, 512, 64), "batch 8": (8, 512, 64), "prefill 2048": (1, 2048, 1)}


def prompts(path: Path, n: int, length: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": [rng.randrange(3, 49152) for _ in range(length)],
                                        "sampling": {"temperature": 0}}) + "\n" for i in range(n)))
    return path


def measure(out: Path) -> dict:
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    # (tokens per second after the last first token would count what the others generated during the
    # prefill: it flatters the slower prefill; the requests' own time per token does not)
    return {"prefill_s": round(max(r["ttft_s"] for r in rows), 4),
            "tpot_ms": round(1000 * sum(r["tpot_s"] for r in rows) / len(rows), 3)}


def stage_steps(rounds: int) -> dict:
    import statistics

    import torch

    from hpipe import models, quant
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner

    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    units = range(models.num_units(config))
    runners = {s: StageRunner(source, config, units, weights=quant.WeightFormat("gguf"), deterministic=s == "on",
                                compile="off")
               for s in ("off", "on")}
    ids = torch.arange(3, 515)
    for r in runners.values():
        r.kv.allocate(16 * 40 + 1)
        for slot in range(8):
            r.forward(r.prepare_inputs([Segment(slot, slot, 0, 512, True, True, prompt=512)]), ids)
    cases = {"decode, 1 row": [Segment(0, 0, 512, 1, True)],
             "decode, 8 rows": [Segment(s, s, 512, 1, True) for s in range(8)],
             "prefill, one 512-token prompt": [Segment(8, 8, 0, 512, True, True, prompt=512)],
             "prefill, 8 prompts of 64 tokens": [Segment(8 + s, 8 + s, 0, 64, True, True, prompt=64) for s in range(8)]}
    out = {}
    for name, segments in cases.items():
        x = torch.arange(3, 3 + sum(s.length for s in segments))
        times = {s: [] for s in runners}
        for _ in range(rounds):
            for setting, r in runners.items():
                t = time.perf_counter()
                for _ in range(8):
                    r.forward(r.prepare_inputs(segments), x)
                times[setting].append((time.perf_counter() - t) / 8)
        med = {s: statistics.median(v) for s, v in times.items()}
        out[name] = {"off_ms": round(1000 * med["off"], 3), "on_ms": round(1000 * med["on"], 3),
                     "on_over_off": round(med["on"] / med["off"], 3)}
        print(f"  {name}: {out[name]}", flush=True)
    return out


def main() -> None:
    from bench.common import hpipe

    args = bench_arguments(repeats=2, rounds=15, out=results_path("determinism"))
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_name()}, {os.cpu_count()} CPU cores (the stage "
                                                               f"takes them all)", "cpu_flags": cpu_flags(),
              "model": "SmolLM2-135M-Instruct Q4_1 (GGUF kept quantized), one local stage",
              "steps": stage_steps(args.rounds), "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="hpipe-bench-det-") as tmp:
        work = Path(tmp)
        plan = work / "plan.json"
        hpipe("plan", "--model", "smollm2", "--stages", "1", "-o", plan, cwd=work)
        for name, (n, length, new) in CASES.items():
            source = prompts(work / f"{name.replace(' ', '-')}.jsonl", n, length, seed=n * length)
            runs: dict[str, list] = {"off": [], "on": []}
            for k in range(args.repeats):
                for setting in runs:
                    out = work / f"o-{name.replace(' ', '-')}-{setting}-{k}.jsonl"
                    hpipe("launch", plan, "--local", "--prompts", source, "--out", out, "--max-new-tokens", new,
                          "--max-batch", n, "--deterministic", setting, "--quiet", cwd=work)
                    runs[setting].append(measure(out))
                    print(f"  {name}, deterministic {setting}: {runs[setting][-1]}", flush=True)
            best = {s: {"prefill_s": min(r["prefill_s"] for r in rs), "tpot_ms": min(r["tpot_ms"] for r in rs),
                        "runs": rs} for s, rs in runs.items()}
            cost = {"prefill": round(best["on"]["prefill_s"] / best["off"]["prefill_s"], 3)}
            if new > 1:
                cost["decode_tpot"] = round(best["on"]["tpot_ms"] / best["off"]["tpot_ms"], 3)
            report["jobs"][name] = {"requests": n, "prompt_tokens": length, "new_tokens": new, **best,
                                     "on_over_off": cost}
            print(f"{name}: on/off {cost}", flush=True)
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"steps": {k: v["on_over_off"] for k, v in report["steps"].items()},
                      "jobs": {k: v["on_over_off"] for k, v in report["jobs"].items()}}, indent=2))


if __name__ == "__main__":
    main()
