"""What cutting a model into stages costs a decode step before any process or link: in one process,
one thread, a step through the plan's stage runners in a row against one runner of every unit.

Both compiled (`--compile on`, the GGUF file's weights), after a --prompt-token context, the two
alternated --rounds times (--steps steps each, the median). With `--join-halves off` the stages
call the graphs any layout can use (`stage_calls`) instead of their own (`stage_runs`).

    python bench/split_cost.py PLAN.json [--model M] [--rounds 6] [--steps 80] [--join-halves on|off] [--out ...]

Writes bench/results/split_cost.json (--out).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_parser, cpu_flags, cpu_name, results_path  # noqa: E402

PROMPT = 256


def main() -> None:
    import torch

    from hpipe import formats, models, quant
    from hpipe.runtime import stage as S
    from hpipe.runtime.pages import Segment, pages_needed

    ap = bench_parser(rounds=6, steps=80, join_halves="on")
    ap.add_argument("plan")
    ap.add_argument("--out", default=results_path("split_cost"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = formats.load_plan(args.plan)
    source = models.resolve_model(plan.model.name)
    config = models.load_config(source.path)
    ranges = [range(*s.units) for s in plan.stages]

    def built(units: list[range], join: bool) -> list:
        runners = []
        for r in units:
            runner = S.StageRunner(source, config, r, weights=quant.WeightFormat.parse("gguf"), compile="on",
                                   join_halves=join)
            runner.kv.allocate(2 * pages_needed(PROMPT + 2 * args.rounds * args.steps + 40, runner.kv.page_size))
            S.warm_up(runner, 16, lambda _: None)
            runners.append(runner)
        return runners

    sides = {"split": built(ranges, args.join_halves == "on"), "whole": built([range(models.num_units(config))], True)}
    position = dict.fromkeys(sides, PROMPT)

    @torch.inference_mode()
    def step(name: str, n: int, start: int):
        x = torch.arange(3, 3 + n) if n > 1 else torch.tensor([5])
        for r in sides[name]:
            x = r.forward(r.prepare_inputs([Segment(0, 0, start, n, True)]), x)

    for name in sides:
        step(name, PROMPT, 0)
    times: dict[str, list] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name in sides:
            each = []
            for _ in range(args.steps):
                t = time.perf_counter()
                step(name, 1, position[name])
                position[name] += 1
                each.append(time.perf_counter() - t)
            times[name].append(round(1000 * statistics.median(each), 3))
    report = {
        "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
        "model": str(source.path.name), "stages": [[r.start, r.stop - 1] for r in ranges],
        "join_halves": args.join_halves, "threads": 1, "prompt": PROMPT,
        "calls": [r.calls for r in sides["split"]], "whole_calls": sides["whole"][0].calls,
        "step_ms": {k: round(statistics.median(v), 3) for k, v in times.items()}, "rounds": times,
        "split_vs_whole": round(statistics.median(a / b for a, b in zip(times["split"], times["whole"])), 3),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
