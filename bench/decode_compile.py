"""Single-stream decode on one CPU stage (SmolLM2-135M, fp32, after a 256-token prompt): the
dynamic eager step, the static-shape step (the CUDA-graph path) eager, and the static step under
torch.compile (inductor, static shapes, as gpt-fast compiles `decode_one_token`); where the time
goes (aten::mm's share); and the memory-bandwidth floor (the step's weight bytes / matrix-vector
bandwidth measured here). Writes bench/results/decode_compile.json.

    python bench/decode_compile.py [--threads 2] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))


def median_ms(fn, steps: int, first: int) -> tuple[float, list]:
    times, outs = [], []
    for k in range(steps):
        t = time.perf_counter()
        outs.append(fn(first + k))
        times.append(time.perf_counter() - t)
    return round(1000 * sorted(times)[steps // 2], 2), outs


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hpipe import models
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner
    from hpipe.runtime.static_decode import StaticDecode

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    runner = StageRunner(source.path, config, range(models.num_units(config)), "cpu", "float32", "sdpa")
    # torch.compile cannot trace inference tensors: the whole probe runs under no_grad instead
    runner.forward = types.MethodType(StageRunner.forward.__wrapped__, runner)
    runner.kv.allocate(64)
    weight_bytes = sum(models.unit_bytes(config, "float32")["weights_per_unit"][1:])
    report: dict = {"threads": args.threads, "weight_mb": round(weight_bytes / 1e6, 1)}
    with torch.no_grad():
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, 256, True, True)]), torch.arange(3, 259))
        static = StaticDecode(runner, 1, graphs=False, max_len=512)

        def dynamic(k):
            return runner.forward(runner.prepare_inputs([Segment(0, 0, 256 + k, 1, True)]), torch.tensor([5 + k]))

        def static_step(k):
            return static.run(static.prepare([Segment(0, 0, 256 + k, 1, True)], k % 2), torch.tensor([5 + k]))

        report["dynamic_eager_ms"], ref = median_ms(dynamic, args.steps, 0)
        report["static_eager_ms"], outs = median_ms(static_step, args.steps, 0)
        report["static_eager_max_logit_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, outs))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for k in range(5):
                dynamic(k)
        mm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))
        report["dynamic_mm_ms_per_step"] = round(mm / 5 / 1000, 2)
        t = time.time()
        static._step = torch.compile(static._step, dynamic=False)
        static_step(0), static_step(1)
        report["compile_s"] = round(time.time() - t, 1)
        report["static_compiled_ms"], outs = median_ms(static_step, args.steps, 0)
        report["static_compiled_max_logit_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, outs))
        report["static_compiled_same_tokens"] = all(int(a.argmax()) == int(b.argmax()) for a, b in zip(ref, outs))
    rows = weight_bytes // 4 // 4096
    m, v = torch.randn(rows, 4096), torch.randn(4096)
    best = min((lambda t0: (m.mv(v), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(7))
    report["bandwidth_gb_s"] = round(rows * 4096 * 4 / best / 1e9, 2)
    floor = weight_bytes / (rows * 4096 * 4 / best) * 1000
    report["floor_ms"] = round(floor, 2)
    for k in ("dynamic_eager", "static_eager", "static_compiled"):
        report[f"{k}_of_floor"] = round(floor / report[f"{k}_ms"], 3)
    report["mm_of_floor"] = round(floor / report["dynamic_mm_ms_per_step"], 3)
    out = ROOT / "bench" / "results" / "decode_compile.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
