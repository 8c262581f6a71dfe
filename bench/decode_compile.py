"""Where a single-stream decode step goes on one CPU stage (SmolLM2-135M, the GGUF file's own
quantized weights, after a 256-token prompt), and what `--compile on` takes off it:
- the dynamic eager step (the runtime's default), the static-shape step eager (the CUDA-graph
  path), and the dynamic step with the halves compiled (`StageRunner(compile="on")`: one graph
  per half shared by every block, as the runtime runs it), each the median of --steps; the compile
  time (cold, or warm from inductor's cache under hpipe's cache directory) is what the first one-row
  and two-row steps took, as the runtime's warm-up;
- a profile of the compiled step, by kind: the int4 weight-only kernel (the blocks' projections),
  the int8 kernel (the head), SDPA, the fused inductor kernels (norms, rotary, residuals, casts,
  the KV writes), the graphs' C++ wrappers, and dynamo's own overhead;
- the memory-bandwidth floor: the step's packed weight bytes over the matrix-vector bandwidth
  measured here.

    python bench/decode_compile.py [--threads 2] [--steps 64] [--prompt 256] [--out ...]

Writes bench/results/decode_compile.json (--out).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_parser  # noqa: E402

PROMPT = 256
# profiler events by kind: hpipe's kernels or torch's weight-only ops (HPIPE_CPU_KERNELS=torch), the
# attention kernel (an aten op, or its AOT shim inside a cpp_wrapper graph), the rest of the graphs
KINDS = {"int4 kernel": ("hpipe::int4_mm", "aten::_weight_int4pack_mm"),
         "int8 kernel (head)": ("hpipe::int8_mm", "aten::_weight_int8pack_mm"),
         "sdpa": ("aten::_scaled_dot_product", "aoti_torch_cpu__scaled_dot_product"),
         "fused inductor kernels": ("graph_",),
         "graph wrappers (C++: allocations, argument checks, op dispatch)": ("## Call CompiledFxGraph",),
         "dynamo overhead": ("TorchDynamo Cache Lookup", "Pregraph bytecode", "AOTDispatcher", "Torch-Compiled Region")}


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hpipe import models, quant
    from hpipe.runtime.pages import Segment, pages_needed
    from hpipe.runtime.stage import StageRunner
    from hpipe.runtime.static_decode import StaticDecode

    ap = bench_parser(threads=2, steps=64)
    ap.add_argument("--prompt", type=int, default=PROMPT, help="context before the timed steps")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_compile.json"))
    args = ap.parse_args()
    prompt = args.prompt
    torch.set_num_threads(args.threads)
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    weights = quant.WeightFormat.parse("gguf")
    runner = StageRunner(source, config, range(models.num_units(config)), weights=weights, compile="off")
    # two sequences (the warm-up's second row), each up to the profiled steps' last position
    pages = 2 * pages_needed(prompt + args.steps + 20 + 1, runner.kv.page_size)
    runner.kv.allocate(pages)
    runner.forward(runner.prepare_inputs([Segment(0, 0, 0, prompt, True)]), torch.arange(3, 3 + prompt))
    report: dict = {"threads": args.threads, "weights": str(weights), "prompt": prompt, "steps": args.steps}

    def timed(step) -> tuple[float, list]:
        times, outs = [], []
        for k in range(args.steps):
            t = time.perf_counter()
            outs.append(step(k))
            times.append(time.perf_counter() - t)
        return round(1000 * sorted(times)[args.steps // 2], 2), outs

    def dynamic(k):
        return runner.forward(runner.prepare_inputs([Segment(0, 0, prompt + k, 1, True)]), torch.tensor([5 + k]))

    def static_path(static):
        return lambda k: static.run(static.prepare([Segment(0, 0, prompt + k, 1, True)], k % 2), torch.tensor([5 + k]))

    with torch.inference_mode():
        report["dynamic_eager_ms"], ref = timed(dynamic)
        report["static_eager_ms"], _ = timed(static_path(StaticDecode(runner, 1, False, prompt + args.steps + 8)))
        # each kernel of the graphs (inductor's fused loops, the attention's AOT shim) its own profiler
        # event: without it they are one "## Call CompiledFxGraph" (a check when no profiler runs)
        torch._inductor.config.cpp.enable_kernel_profile = True
        runner = StageRunner(source, config, range(models.num_units(config)), weights=weights, compile="on")
        runner.kv.allocate(pages)
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, prompt, True)]), torch.arange(3, 3 + prompt))
        t = time.time()
        # positions the timed steps write before they read them
        for rows in ([Segment(0, 0, prompt, 1, True)], [Segment(0, 0, prompt + 1, 1, True), Segment(1, 0, prompt, 1, True)]):
            runner.forward(runner.prepare_inputs(rows), torch.zeros(len(rows), dtype=torch.long))
        report["compile_s"] = round(time.time() - t, 1)
        report["compiled_halves_ms"], outs = timed(dynamic)
    report["compiled_max_logit_diff"] = round(max(float((a - b).abs().max()) for a, b in zip(ref, outs)), 4)
    report["compiled_same_argmax"] = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(ref, outs)) / len(ref)
    step = dynamic
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        for k in range(20):
            step(args.steps + k)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 20 / 1000
    where = {kind: round(sum(e.self_cpu_time_total for e in events if e.key.startswith(keys)) / 20 / 1000, 2)
             for kind, keys in KINDS.items()}
    where["other"] = round(total - sum(where.values()), 2)
    report["compiled_step_ms_by_kind"] = {"total (profiled)": round(total, 2), **where}
    report["int4_calls_per_step"] = sum(e.count for e in events if e.key.startswith(KINDS["int4 kernel"])) // 20

    weight_bytes = sum(models.unit_bytes(config, "float32", str(weights)).weights_per_unit[1:])
    rows = 64 * 1024 * 1024 // 4 // 4096
    m, v = torch.randn(rows, 4096), torch.randn(4096)
    best = min((lambda t0: (m.mv(v), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(9))
    bandwidth = rows * 4096 * 4 / best
    report.update(weight_mb=round(weight_bytes / 1e6, 1), bandwidth_gb_s=round(bandwidth / 1e9, 1),
                  floor_ms=round(weight_bytes / bandwidth * 1000, 2))
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
