"""Prefill latency of a 2,048-token prompt on the default model: one process without slicing,
against the 2-stage local pipeline (separate processes, gloo) with 1, 2, 4, 8 and 16 uniform
slices, and the busy fraction of each stage. Writes bench/results/prefill.json.

    python bench/prefill.py [--repeats 3] [--tokens 2048]

On a 2-core machine each pipeline stage gets one core and the single process gets both: at most
two stages truly overlap.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402


def prompt_ids(n: int) -> list[int]:
    from hpipe import models

    tok = models.load_tokenizer(models.resolve_model("smollm2").path)
    text = (ROOT / "hpipe" / "data" / "demo_document.md").read_text()
    ids = tok(text)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def single_process(ids: list[int], repeats: int, n_slices: int = 1) -> dict:
    import torch

    from hpipe import formats, models
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner

    src = models.resolve_model("smollm2")
    config = models.load_config(src.path)
    runner = StageRunner(src.path, config, range(models.num_units(config)))
    slices = formats.Slicing(count=n_slices, granularity=16).slices_for(len(ids))
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        start = 0
        for n in slices:  # the slices one after another in the same process (chunked prefill)
            seg = Segment(0, 0, start, n, start + n == len(ids))
            runner.forward(runner.prepare_inputs([seg]), torch.tensor(ids[start:start + n]))
            start += n
        if i:  # the first run warms up
            times.append(time.perf_counter() - t)
    return {"threads": torch.get_num_threads(), "slices": slices, "latency_s": statistics.median(times),
            "runs_s": times}


def pipeline(ids: list[int], slices: int, repeats: int) -> dict:
    from hpipe import formats, models
    from hpipe.config import RuntimeConfig
    from hpipe.launcher.jobs import LaunchSettings, busy_fractions, prepare
    from hpipe.launcher.local import launch_local
    from hpipe.planner import make_plan

    src = models.resolve_model("smollm2")
    config = models.load_config(src.path)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plan = make_plan("smollm2", config, [("local", "cpu")] * 2, num_slices=slices, granularity=16)
        formats.write_plan(plan, tmp / "plan.json")
        # warm-up prompt first (same length), then the measured ones, all in one launch
        lines = [{"id": f"r{i}", "input_ids": ids} for i in range(repeats + 1)]
        (tmp / "p.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        settings = LaunchSettings(runtime=RuntimeConfig(max_batch=1), max_new_tokens=1)
        job = prepare(str(tmp / "plan.json"), str(tmp / "p.jsonl"), str(tmp / "o.jsonl"), settings)
        report = launch_local(job, str(tmp / "plan.json"), str(tmp / "o.jsonl"), settings, quiet=True)
        # per request: prefill latency = its first token time minus the previous one's (requests run one by one)
        done = sorted(r["ttft_s"] for r in report.output.results)
        lat = [b - a for a, b in zip(done, done[1:])]
        busy = busy_fractions(report.output.timelines)
    return {"slices": plan.slicing.slices_for(len(ids)), "latency_s": statistics.median(lat), "runs_s": lat,
            "busy_fraction": {f"stage{r}": round(b, 3) for r, b in busy.items()}}


def main() -> None:
    args = bench_arguments(repeats=3, tokens=2048)
    ids = prompt_ids(args.tokens)
    report = {"model": "smollm2 (SmolLM2-135M-Instruct, float32)", "prompt_tokens": len(ids),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "single_process_no_slicing": single_process(ids, args.repeats),
              "single_process_8_slices": single_process(ids, args.repeats, 8), "pipeline_2_stages": {}}
    for n in (1, 2, 4, 8, 16):
        report["pipeline_2_stages"][str(n)] = pipeline(ids, n, args.repeats)
        print(f"{n:2d} slices: {report['pipeline_2_stages'][str(n)]['latency_s']:.3f} s", flush=True)
    base = report["single_process_no_slicing"]["latency_s"]
    report["speedup_vs_single_process"] = {n: round(base / r["latency_s"], 3)
                                           for n, r in report["pipeline_2_stages"].items()}
    out = ROOT / "bench" / "results" / "prefill.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "pipeline_2_stages"}, indent=2))
    for n, r in report["pipeline_2_stages"].items():
        print(f"{n:>2} slices: {r['latency_s']:.3f} s, busy {r['busy_fraction']}")


if __name__ == "__main__":
    main()
