"""`hpipe profile --quick` on the default model on this machine's CPU: wall time, the fit's
held-out median error per unit kind, the measured links; then a 2-stage plan from that profile
(one thread per stage, as `hpipe launch --local` gives two stages on 2 cores) and its predicted
prefill makespan against the measured one. Writes bench/results/profile.json.

    python bench/profile.py [--tokens 2048] [--slices 8]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this file's name shadows the standard library's `profile` module: keep bench/ off the path
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402


def main() -> None:
    from bench.prefill import prompt_ids
    from hpipe import formats
    from hpipe.config import RuntimeConfig
    from hpipe.launcher.jobs import LaunchSettings, busy_fractions, prepare
    from hpipe.launcher.local import launch_local

    args = bench_arguments(tokens=2048, slices=8)
    report = {"machine": {"cpus": os.cpu_count()}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = {}
        for threads in (0, 1):
            out = tmp / f"profile-{threads}.json"
            t = time.time()
            subprocess.run([sys.executable, "-m", "hpipe", "profile", "--model", "smollm2", "--local", "--quick",
                            "--threads", str(threads), "-o", str(out)], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.time() - t
            prof = formats.load_profile(out)
            dev = prof.devices[0]
            errors = {k: v for k, v in dev.fit_error.items() if v is not None and k != "all"}
            runs["all_cores" if threads == 0 else f"{threads}_thread"] = {
                "wall_s": round(wall, 2), "threads": dev.identity["threads"],
                "fit_heldout_median_rel_error": errors,
                "fit_error_median_over_kinds": statistics.median(errors.values()),
                "fit_error_all_heldout_points": dev.fit_error.get("all"),
                "links": [{"src": x.src, "dst": x.dst, "alpha_s": x.alpha_s, "beta_bytes_per_s": x.beta_bytes_per_s}
                          for x in prof.links],
            }
        report["quick_profile"] = runs
        plan = tmp / "plan.json"
        subprocess.run([sys.executable, "-m", "hpipe", "plan", "--model", "smollm2", "--stages", "2", "--profile",
                        str(tmp / "profile-1.json"), "--seq-len", str(args.tokens), "--num-slices", str(args.slices),
                        "-o", str(plan)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        predicted = formats.load_plan(plan).pipeline_prediction
        ids = prompt_ids(args.tokens)
        lines = [{"id": f"r{i}", "input_ids": ids} for i in range(4)]
        (tmp / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        settings = LaunchSettings(runtime=RuntimeConfig(max_batch=1), max_new_tokens=1)
        job = prepare(str(plan), str(tmp / "p.jsonl"), str(tmp / "o.jsonl"), settings)
        launched = launch_local(job, str(plan), str(tmp / "o.jsonl"), settings, quiet=True)
        done = sorted(r["ttft_s"] for r in launched.output.results)
        measured = statistics.median([b - a for a, b in zip(done, done[1:])])
        report["plan_from_profile"] = {
            "stages": [s.units for s in formats.load_plan(plan).stages], "slices": list(predicted.slices),
            "predicted_makespan_s": predicted.makespan_s, "measured_makespan_s": measured,
            "relative_difference": (measured - predicted.makespan_s) / predicted.makespan_s,
            "predicted_utilization": list(predicted.utilization),
            "measured_busy_fraction": list(busy_fractions(launched.output.timelines).values()),
        }
    out = ROOT / "bench" / "results" / "profile.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
