"""What a CPU stage's compiled decode graphs cost at its start and at every call: saved as code and
loaded (`hpipe.runtime.graphs`, `aot_compile`), against traced again by dynamo from inductor's warm
cache at every start (`torch.compile`, as hpipe ran them before).

One stage of SmolLM2 (the GGUF file's weights; default units 20-41: a cut block's MLP half, 10
whole blocks, a cut block's attention half: three graph functions), --threads threads, in a fresh
inductor cache of its own:
- `compile_s`: a cold start's compile (the first process);
- `start_s`: a warm start, building the stage and its warm-up's decode steps, in a process of its
  own each: `saved` loads the graphs, `traced` re-traces them (after one start of its own that
  filled inductor's cache for that path); --rounds alternated;
- `step_ms`: one decode step (one row, after a --prompt-token context), the two paths alternated
  --rounds times in one process, --steps steps each (the median).

    python bench/graph_load.py [--units 20-41] [--threads 1] [--rounds 4] [--steps 100] [--out ...]

Writes bench/results/graph_load.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_parser, cpu_flags, cpu_name, results_path  # noqa: E402


def stage(units: str, threads: int, path: str):
    """The stage, built (`path`: "saved" or "traced") and warmed up; the seconds each took."""
    import torch

    from hpipe import models, quant
    from hpipe.runtime import stage as S

    torch.set_num_threads(threads)
    if path == "traced":
        S.graphs.Graph = Traced
    a, b = map(int, units.split("-"))
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    t = time.perf_counter()
    runner = S.StageRunner(source, config, range(a, b + 1), weights=quant.WeightFormat.parse("gguf"), compile="on")
    built = time.perf_counter() - t
    runner.kv.allocate(64)
    t = time.perf_counter()
    S.warm_up(runner, 16, lambda _: None)
    return runner, built, time.perf_counter() - t


class Traced:
    """A graph function as hpipe ran it before its graphs were saved: `torch.compile`, dynamo's frame
    hook and guards at every call, traced again at every start."""

    def __init__(self, fn, directory, settings, tracing):
        import torch

        for name, value in settings.items():
            setattr(torch._dynamo.config, name, value)
        self.tracing = tracing
        self.compiled = torch.compile(fn, dynamic=True, options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "cpp_wrapper": True})

    marking = True          # the pool's dims marked while its graphs are traced (a trace reads them)

    def __call__(self, *args):
        if not Traced.marking:
            return self.compiled(*args)
        with self.tracing(args):
            return self.compiled(*args)


def child(args) -> None:
    """One start in this process: prints its seconds as JSON."""
    _, built, warm = stage(args.units, args.threads, args.child)
    print(json.dumps({"build_s": round(built, 2), "warm_up_s": round(warm, 2)}))


def steps(args) -> dict:
    """The two paths' decode steps, alternated in one process."""
    import torch

    from hpipe.runtime import graphs
    from hpipe.runtime.pages import Segment

    runner, _, _ = stage(args.units, args.threads, "saved")
    saved = dict(runner.decode_halves.fns)
    traced = {}
    for u, g in saved.items():
        traced.setdefault(id(g), Traced(g.fn, None, {"specialize_float": True}, g.tracing))
    traced = {u: traced[id(g)] for u, g in saved.items()}
    first = runner.first
    position = [args.prompt]

    @torch.inference_mode()        # as the runtime prepares and computes (a guard tells the two apart)
    def step():
        x = torch.zeros(1, dtype=torch.long) if first else torch.zeros(1, runner.hidden_size)
        runner.forward(runner.prepare_inputs([Segment(0, 0, position[0], 1, True)]), x)
        position[0] += 1

    with torch.inference_mode():
        x = torch.zeros(args.prompt, dtype=torch.long) if first else torch.zeros(args.prompt, runner.hidden_size)
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, args.prompt, True)]), x)
    runner.decode_halves.fns = traced
    for _ in range(3):
        step()                             # the traced path's graphs (inductor's cache is warm)
    Traced.marking = False
    out = {"saved": [], "traced": []}
    for _ in range(args.rounds):
        for name, fns in (("saved", saved), ("traced", traced)):
            runner.decode_halves.fns = fns
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            out[name].append(round(1000 * statistics.median(times), 3))
    assert graphs.compiled() == 0, "a step compiled a graph the warm-up had not"
    return out


def main() -> None:
    ap = bench_parser(units="20-41", threads=1, rounds=4, steps=100, prompt=256)
    ap.add_argument("--child", choices=("saved", "traced"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=results_path("graph_load"))
    args = ap.parse_args()
    if args.child:
        return child(args)
    cache = tempfile.mkdtemp(prefix="hpipe-graph-load-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)

    def start(path: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--child", path, "--units", args.units, "--threads",
                              str(args.threads)], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold = start("saved")
    start("traced")                        # the traced path's own first start: its cache filled
    starts: dict[str, list] = {"saved": [], "traced": []}
    for r in range(args.rounds):
        for path in (("saved", "traced") if r % 2 == 0 else ("traced", "saved")):
            starts[path].append(start(path))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    step_ms = steps(args)
    total = {k: [s["build_s"] + s["warm_up_s"] for s in v] for k, v in starts.items()}
    report = {
        "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
        "model": "smollm2 (GGUF Q4_1)", "units": args.units, "threads": args.threads,
        "compile_s": round(cold["build_s"] + cold["warm_up_s"], 1),
        "start_s": {k: round(statistics.median(v), 2) for k, v in total.items()},
        "starts": starts,
        "step_ms": {k: round(statistics.median(v), 3) for k, v in step_ms.items()},
        "step_rounds": step_ms,
        "step_saved_vs_traced": round(statistics.median(a / b for a, b in zip(step_ms["saved"], step_ms["traced"])), 3),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
