"""What a speculative verification step costs against a one-token step: the whole default model
(SmolLM2 Q4_1 GGUF) in one stage, compiled (`--compile on`, graphs for up to 5 rows a step),
one sequence after a --context-token prompt, steps of 1, 3 and 5 rows (the fed token and 0, 2, 4
proposals) at that position, interleaved, the median of --repeats each. Issue 68 asks for a step of
k + 1 rows at <= 1.25x a one-row step, so that speculation reaches 0.8 of its tokens-per-step
bound (`bench/speculative.py`'s `of_bound`).

    python bench/verify_step.py [--context 1700] [--threads 2] [--repeats 15] [--out F.json]

Writes bench/results/verify_step.json. To compare two versions on one machine, run each checkout's
copy of this script in turn (it imports the hpipe beside it).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, cpu_flags, cpu_name, results_path  # noqa: E402

ROWS = (1, 3, 5)


def main() -> None:
    import torch

    from hpipe import models, quant
    from hpipe.runtime.pages import Segment, pages_needed
    from hpipe.runtime.stage import StageRunner

    args = bench_arguments(context=1700, threads=2, repeats=15, out=results_path("verify_step"))
    torch.set_num_threads(args.threads)
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    runner = StageRunner(source, config, range(models.num_units(config)), weights=quant.WeightFormat.parse("gguf"),
                         compile="on", step_tokens=max(ROWS))
    runner.kv.allocate(2 * pages_needed(args.context + 64, runner.kv.page_size))

    def step(rows: int) -> float:
        seg = Segment(0, 0, args.context, rows, True, draft=tuple(range(7, 6 + rows)))
        t = time.perf_counter()
        runner.forward(runner.prepare_inputs([seg]), torch.arange(5, 5 + rows))
        return time.perf_counter() - t

    with torch.inference_mode():
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, args.context, True)]),
                       torch.arange(3, 3 + args.context))
        for rows in ROWS:           # compiles each graph form, then warms it
            for _ in range(3):
                step(rows)
        times = {rows: [] for rows in ROWS}
        for _ in range(args.repeats):
            for rows in ROWS:
                times[rows].append(step(rows))
    ms = {rows: 1000 * statistics.median(t) for rows, t in times.items()}
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_flags": cpu_flags(),
              "threads": args.threads, "context": args.context, "repeats": args.repeats,
              "hpipe": str(Path(models.__file__).resolve().parent.parent),
              "ms_per_step": {str(r): round(v, 2) for r, v in ms.items()},
              "vs_one_row": {str(r): round(v / ms[1], 3) for r, v in ms.items()}}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
