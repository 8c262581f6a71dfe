"""What keeping freed activations in the C heap (`hpipe.heap`) is worth: `hpipe launch` of the
default model on one local stage, one prompt of N token ids, glibc's default thresholds
(HPIPE_GLIBC_HEAP=default) against hpipe's, alternated round by round in one run (this machine is
shared and noisy: compare the ratio of medians, not the seconds across runs).

    python bench/heap.py [--lengths 512,2048] [--rounds 3] [--new-tokens 32] [--out bench/results/heap.json]
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, hpipe, prompt_ids, results_path  # noqa: E402

VARIANTS = {"glibc defaults": "default", "hpipe.heap": ""}


def main() -> None:
    args = bench_arguments(lengths="512,2048", rounds=3, new_tokens=32, out=results_path("heap"))
    lengths = [int(x) for x in args.lengths.split(",")]
    base = dict(os.environ, PYTHONPATH=str(ROOT))
    runs = {(v, n): {"ttft_s": [], "tpot_ms": []} for v in VARIANTS for n in lengths}
    with tempfile.TemporaryDirectory(prefix="hpipe-heap-") as tmp:
        work = Path(tmp)
        plan = work / "plan.json"
        hpipe("plan", "--model", "smollm2", "--stages", "1", "-o", plan, cwd=work, env=base)
        for n in lengths:
            (work / f"p{n}.jsonl").write_text(json.dumps({"id": f"n{n}", "input_ids": prompt_ids(n)}) + "\n")
        for r in range(args.rounds):
            for variant, value in VARIANTS.items():
                env = dict(base, HPIPE_GLIBC_HEAP=value)
                for n in lengths:
                    out = work / f"r{n}.jsonl"
                    for f in work.glob(f"r{n}.jsonl*"):
                        f.unlink()
                    hpipe("launch", plan, "--local", "--prompts", work / f"p{n}.jsonl", "--out", out,
                          "--max-new-tokens", args.new_tokens, "--quiet", cwd=work, env=env)
                    rec = json.loads(out.read_text().splitlines()[0])
                    runs[(variant, n)]["ttft_s"].append(rec["ttft_s"])
                    runs[(variant, n)]["tpot_ms"].append(1e3 * rec["tpot_s"])
                    print(f"round {r} {variant} {n}: ttft {rec['ttft_s']:.3f} s, tpot {1e3 * rec['tpot_s']:.2f} ms",
                          flush=True)
    report = {"date": datetime.date.today().isoformat(), "machine_cores": os.cpu_count(),
              "model": "smollm2 (Q4_1 GGUF), 1 local stage", "new_tokens": args.new_tokens, "rounds": args.rounds,
              "runs": [{"variant": v, "prompt_tokens": n, **vals} for (v, n), vals in runs.items()], "ratios": {}}
    for n in lengths:
        med = {v: {k: statistics.median(runs[(v, n)][k]) for k in ("ttft_s", "tpot_ms")} for v in VARIANTS}
        report["ratios"][str(n)] = {k: round(med["hpipe.heap"][k] / med["glibc defaults"][k], 3)
                                    for k in ("ttft_s", "tpot_ms")}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratios"]))


if __name__ == "__main__":
    main()
