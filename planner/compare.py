"""`hpipe plan --compare`: the plan against the baselines of the HPipe paper (§4), all predicted by
the same cost model and simulator, for one batch of `batch` prompts of `seq_len` tokens.

- Base: uniform cuts, one device at a time (no pipelining), no slicing;
- GPipe: uniform cuts, the prompts of the batch as micro-batches, no slicing;
- GP-B: HPipe's partition for whole prompts, micro-batches, no slicing;
- TeraPipe: uniform cuts, the best uniform slice count;
- HPipe-paper: the paper's two steps as written: Algorithm 1 on the whole-prompt workload, then
  Algorithm 2 for that partition; fixed device order; no memory model;
- HPipe: this plan (partition <-> slicing iterated, memory-aware).
"""

from __future__ import annotations

import numpy as np

from hpipe.planner.partition import Infeasible, partition_layers
from hpipe.planner.profiled import CostModel, _predict, _tau, _workload
from hpipe.planner.slicing import slice_sequence
from hpipe.planner.uniform import uniform_cuts


def _memory(cost: CostModel, cuts: list[int], seq_len: int, batch: int, slices: list[int]) -> list[float]:
    b = cost.bytes
    unit_mem = np.array(b["weights_per_unit"], dtype=float) + np.array(b["kv_per_token_per_unit"]) * seq_len * batch
    act = 4 * max(slices) * max(b["activation_per_token_at_cut"])
    return [float(unit_mem[a:e].sum() + act) for a, e in zip(cuts, cuts[1:])]


def _tokens(units: list[int], g: int, seq_len: int) -> list[int]:
    out, done = [], 0
    for u in units:
        out.append(min(u * g, seq_len - done))
        done += out[-1]
    return out


def compare(cost: CostModel, n_units: int, seq_len: int, batch: int, granularity: int, plan_cuts: list[int],
            plan_slices: list[int]) -> list[dict]:
    d = len(cost.entries)
    uniform = [0, *uniform_cuts(n_units, d), n_units]
    whole = [seq_len]
    free = [e["memory"]["free_bytes"] for e in cost.entries]
    rows = []

    def row(name, cuts, slices, makespan=None):
        mem = _memory(cost, cuts, seq_len, batch, slices)
        if makespan is None:
            makespan = _predict(cost, cuts, slices, batch).makespan
        rows.append({"method": name, "cuts": cuts, "slices": slices, "makespan_s": makespan,
                     "throughput_tokens_per_s": seq_len * batch / makespan, "memory_bytes": mem,
                     "fits": all(m <= f for m, f in zip(mem, free))})

    # Base: every prompt through every stage, one device busy at a time
    base = sum(float(cost.stage_time(j, uniform[j], uniform[j + 1], np.array([seq_len]), np.array([0.0]),
                                     last=(j == d - 1))[0]) for j in range(d)) * batch
    row("Base", uniform, whole, base)
    row("GPipe", uniform, whole)
    try:
        gpb = partition_layers(*_workload(cost, whole, batch, d, n_units)).cuts
    except Infeasible:
        gpb = uniform
    row("GP-B", gpb, whole)
    best_tera = None
    for count in range(1, 65):
        slices = [seq_len // count + (1 if i < seq_len % count else 0) for i in range(count)]
        if min(slices) < 1:
            break
        makespan = _predict(cost, uniform, slices, batch).makespan
        if best_tera is None or makespan < best_tera[0]:
            best_tera = (makespan, slices)
    row(f"TeraPipe ({len(best_tera[1])} slices)", uniform, best_tera[1], best_tera[0])
    paper_cuts = partition_layers(*_workload(cost, whole, batch, d, n_units)).cuts
    paper_slices = _tokens(slice_sequence(_tau(cost, paper_cuts, seq_len, granularity), d).lengths, granularity,
                           seq_len)
    row("HPipe-paper", paper_cuts, paper_slices)
    row("HPipe (this plan)", plan_cuts, plan_slices)
    ours = rows[-1]["makespan_s"]
    for r in rows:
        r["ratio_to_hpipe"] = r["makespan_s"] / ours
    return rows
