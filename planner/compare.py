"""`hpipe plan --compare`: the plan against the baselines of the HPipe paper (§4), all predicted by
the same cost model and simulator, for one batch of `batch` prompts of `seq_len` tokens.

- Base: uniform cuts, one device at a time (no pipelining), no slicing;
- GPipe: uniform cuts, the prompts of the batch as micro-batches, no slicing;
- GP-B: HPipe's partition for whole prompts, micro-batches, no slicing;
- TeraPipe: uniform cuts, the best uniform slice count;
- HPipe-paper: the paper's two steps as written: Algorithm 1 on the whole-prompt workload, then
  Algorithm 2 for that partition; fixed device order; no memory model;
- HPipe: this plan (cuts searched against the simulated makespan from Algorithm 1's, slicing iterated,
  memory-aware); never predicted slower than the rows above that fit (they are among its starts).
"""

from __future__ import annotations

import numpy as np

from hpipe import memory
from hpipe.planner.profiled import PlanResult, baseline_plans, predict
from hpipe.planner.uniform import uniform_cuts


def compare(result: PlanResult, granularity: int) -> list[dict]:
    """One row per method: cuts, slices, predicted makespan and throughput, memory per stage (the
    planner's memory model) and whether it fits, and the ratio to this plan."""
    cost, pr = result.cost, result.plan.predicted
    seq_len, batch = pr.seq_len, pr.batch
    d, n_units = len(cost.entries), len(cost.kinds)
    uniform = [0, *uniform_cuts(n_units, d), n_units]
    free = [e.free_bytes for e in cost.entries]
    rows = []

    def row(name, cuts, slices, makespan=None):
        mem = [memory.stage_memory(cost.bytes, range(a, e), seq_len * batch, memory.microbatch_tokens(slices)).total
               for a, e in zip(cuts, cuts[1:])]
        if makespan is None:
            makespan = predict(cost, cuts, slices, batch).makespan
        rows.append({"method": name, "cuts": cuts, "slices": slices, "makespan_s": makespan,
                     "throughput_tokens_per_s": seq_len * batch / makespan, "memory_bytes": mem,
                     "fits": all(m <= f for m, f in zip(mem, free))})

    # Base: every prompt through every stage, one device busy at a time
    base = sum(float(cost.stage_time(j, uniform[j], uniform[j + 1], np.array([seq_len]), np.array([0.0]),
                                     last=(j == d - 1))[0]) for j in range(d)) * batch
    row("Base", uniform, [seq_len], base)
    for name, (cuts, slices) in baseline_plans(cost, seq_len, batch, granularity).items():
        row(name, cuts, slices)
    row("HPipe (this plan)", result.cuts, result.slices, pr.makespan_s)
    ours = rows[-1]["makespan_s"]
    for r in rows:
        r["ratio_to_hpipe"] = r["makespan_s"] / ours
    return rows
