"""A lone stream's decode at a long context: attention reading its KV pages in place (a view, when
its pages lie in order) against the gathered copy per layer (`index_select`), in one run. The
default model (Q4_1 GGUF kept quantized), one process, one thread (a host's share here), a prompt of
--context tokens; decode ms/token = (time for 1 + --new tokens - time for 1) / --new, the median of
--repeats interleaved rounds. Writes bench/results/kv_read.json.

    python bench/kv_read.py [--context 1700] [--new 64] [--repeats 3]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402


def main() -> None:
    import torch

    from hpipe import models, quant
    from hpipe.formats import Slicing
    from hpipe.request import Request
    from hpipe.runtime import kv
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.runtime.stage import StageRunner

    args = bench_arguments(context=1700, new=64, repeats=3)
    torch.set_num_threads(1)
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    runners = [StageRunner(source, config, range(models.num_units(config)), weights=quant.WeightFormat("gguf"), compile="off")]
    prompt = tuple((i * 7919) % 40000 + 100 for i in range(args.context))
    in_place = kv.BatchCache.__init__

    def gathered(self, store, segments):
        in_place(self, store, segments)
        self._span = None

    def run(init, new: int) -> tuple[float, list[int]]:
        kv.BatchCache.__init__ = init
        try:
            t = time.perf_counter()
            out = run_inprocess(runners, [Request(0, "a", prompt, max_new_tokens=new)], Slicing(count=1).slices_for,
                                max_batch=1)
            return time.perf_counter() - t, out["a"]["output_ids"]
        finally:
            kv.BatchCache.__init__ = in_place

    ms = {"gathered": [], "in place": []}
    outputs = {}
    for _ in range(args.repeats):
        for name, init in (("gathered", gathered), ("in place", in_place)):
            t1, _ = run(init, 1)
            t2, outputs[name] = run(init, 1 + args.new)
            ms[name].append(round(1000 * (t2 - t1) / args.new, 2))
    report = {"date": time.strftime("%Y-%m-%d"), "machine_cores": os.cpu_count(), "threads": 1, "model": "smollm2",
              "context": args.context, "new_tokens": args.new, "decode_ms_per_token": ms,
              "median_ratio_in_place_to_gathered": round(statistics.median(ms["in place"])
                                                         / statistics.median(ms["gathered"]), 3),
              "same_tokens": outputs["gathered"] == outputs["in place"]}
    out = ROOT / "bench" / "results" / "kv_read.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
