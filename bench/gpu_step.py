"""Where one decode step of a GPU stage spends its time: the stage of bench/decode.py's gpu setup
(a random-init Llama, hidden 1024, 16 blocks, V=151,643, bf16, all units on one stage), 8 rows
after 64-token prompts, in one process with no pipeline around it: the step eager, its input
preparation alone, the static step replayed from a CUDA graph, and torch.profiler's table of an
eager step (host time per op against device time). Writes bench/results/gpu_step-<device>.json.

    python bench/gpu_step.py [--device cuda:0] [--rows 8] [--steps 30]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402


def timed(fn, steps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.common import random_llama
    from hpipe import models
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner
    from hpipe.runtime.static_decode import StaticDecode

    args = bench_arguments(device="cuda:0", rows=8, steps=30)
    n, prompt = args.rows, 64
    with tempfile.TemporaryDirectory() as tmp:
        path = random_llama(Path(tmp) / "m", 151643, layers=16, dtype="bfloat16")
        config = models.load_config(path)
        runner = StageRunner(path, config, range(models.num_units(config)), device=args.device, dtype="bfloat16")
    pages = -(-(prompt + args.steps * 4) // runner.kv.page_size) * n + 1
    runner.kv.allocate(pages)
    ids = torch.arange(3, 3 + prompt)
    with torch.no_grad():
        for s in range(n):
            runner.forward(runner.prepare_inputs([Segment(s, s, 0, prompt, True, True)]), ids)
        segs = [Segment(s, s, prompt, 1, True) for s in range(n)]
        x = torch.arange(10, 10 + n)
        eager = timed(lambda: runner.forward(runner.prepare_inputs(segs), x), args.steps)
        prepare = timed(lambda: runner.prepare_inputs(segs), args.steps)
        static = StaticDecode(runner, n, graphs=True, max_len=prompt + 8)
        static.capture()
        replay = timed(lambda: static.run(static.prepare(segs, 0), x), args.steps)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.forward(runner.prepare_inputs(segs), x)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    events = prof.key_averages()
    cpu_us = sum(e.self_cpu_time_total for e in events) / 3
    dev_us = sum(getattr(e, "self_device_time_total", 0) for e in events) / 3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")) / 3
    name = torch.cuda.get_device_name(args.device).replace(" ", "-")
    report = {"device": torch.cuda.get_device_name(args.device), "rows": n, "context": prompt,
              "eager_step_ms": round(1000 * eager, 3), "prepare_inputs_ms": round(1000 * prepare, 3),
              "graph_replay_step_ms": round(1000 * replay, 3),
              "profile_per_step": {"host_op_ms": round(cpu_us / 1000, 3), "device_kernel_ms": round(dev_us / 1000, 3),
                                   "kernel_launches": launches},
              "top_ops_by_host_time": table.splitlines()}
    out = ROOT / "bench" / "results" / f"gpu_step-{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table)
    print(json.dumps({k: v for k, v in report.items() if k != "top_ops_by_host_time"}, indent=2))


if __name__ == "__main__":
    main()
