"""A lower bound on the makespan of a batch: what no plan on the same devices can beat for the
same work (the same slices of the same prompts), so that a plan can state its own quality.

- Compute, perfect balance: the work of every unit kind (embedding, attention halves, MLP halves,
  head; every slice of the batch) may be split among the devices in any fractions; the least time
  in which the devices can then finish it all is a linear program,
      min M  s.t.  sum_j x[k, j] = 1 for every kind k,  sum_k x[k, j] W[k, j] <= M for every device j,
  W[k, j] being device j's time for all of kind k's work. No partition into contiguous stages, and
  no pipeline with fill and drain, does better. (When every device is equally fast at every kind
  this is the even split 1 / sum_j 1 / T_j of the devices' total times T_j; where devices differ
  in kind, the LP lets each take what it is relatively good at and is lower.)
- Links: every token's hidden state crosses every link of the pipeline once, and a link carries
  one transfer at a time, so each link's total transfer time (alpha per slice, the hidden bytes /
  beta per token) is a bound too.

The plan's makespan minus the bound splits into pipeline fill and drain (the bottleneck stage
idle, waiting for its first slice or after its last) and imbalance (the bottleneck stage busier
than perfect balance: units are indivisible, cuts are contiguous, memory limits, the slow link's
transfers); `gap` reports both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["LowerBound", "gap", "lower_bound"]


@dataclass(frozen=True)
class LowerBound:
    makespan_s: float        # the larger of the two bounds below
    compute_s: float         # perfect balance of the compute (the LP)
    link_s: float            # the busiest link's transfers
    even_split_s: float      # 1 / sum_j 1 / T_j: the devices' total times, work split in proportion
    binding: str             # "compute" or "link j -> j+1"

    def as_dict(self) -> dict:
        return asdict(self)


def balanced_compute(work: np.ndarray) -> float:
    """work[k, j]: device j's time for all of kind k's work. The LP's optimum M."""
    from scipy.optimize import linprog      # here: importing it costs ~0.9 s, every `hpipe` command paid it

    n_kinds, n_dev = work.shape
    # variables: x[k, j] (row-major), then M
    c = np.zeros(n_kinds * n_dev + 1)
    c[-1] = 1.0
    a_eq = np.zeros((n_kinds, n_kinds * n_dev + 1))
    for k in range(n_kinds):
        a_eq[k, k * n_dev:(k + 1) * n_dev] = 1.0
    a_ub = np.zeros((n_dev, n_kinds * n_dev + 1))
    for j in range(n_dev):
        for k in range(n_kinds):
            a_ub[j, k * n_dev + j] = work[k, j]
        a_ub[j, -1] = -1.0
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(n_dev), A_eq=a_eq, b_eq=np.ones(n_kinds), bounds=(0, None),
                  method="highs")
    if not res.success:
        raise RuntimeError(f"the balance LP failed: {res.message}")
    return float(res.x[-1])


def lower_bound(cost, unit_time: np.ndarray, slices: list[int], batch: int) -> LowerBound:
    """cost: a planner CostModel for the devices in pipeline order; unit_time [D, U]: every unit's
    time on every device for all slices of the batch (profiled.unit_work)."""
    d, n_units = unit_time.shape
    kinds = sorted(set(cost.kinds))
    work = np.array([[unit_time[j, [u for u in range(n_units) if cost.kinds[u] == k]].sum() for j in range(d)]
                     for k in kinds])
    compute = balanced_compute(work)
    even = 1.0 / float(np.sum(1.0 / work.sum(axis=0)))
    hidden = min(cost.bytes.activation_per_token_at_cut[1:-1] or [0])
    links = []
    for j in range(d - 1):
        alpha, beta = cost.link(j)
        links.append(batch * (len(slices) * alpha + sum(slices) * hidden / beta))
    link = max(links, default=0.0)
    binding = "compute" if compute >= link else f"link {int(np.argmax(links))} -> {int(np.argmax(links)) + 1}"
    return LowerBound(max(compute, link), compute, link, even, binding)


def gap(makespan_s: float, stage_busy_s: list[float], bound: LowerBound, contiguous_s: float | None = None) -> dict:
    """Where the plan's time above the bound goes: fill/drain (the busiest stage idle, waiting for
    its first slice or after its last), and the busiest stage above perfect balance, split into
    granularity (`contiguous_s`: the least busiest-stage time any cuts between whole units can reach,
    Algorithm 1 without sends, above perfect balance) and the rest (the cuts trading balance for a
    shorter fill/drain, the links, memory limits)."""
    busiest = max(stage_busy_s)
    out = {"fill_drain_s": makespan_s - busiest, "imbalance_s": busiest - bound.compute_s,
           "above_bound_s": makespan_s - bound.makespan_s}
    if contiguous_s is not None:
        out["granularity_s"] = contiguous_s - bound.compute_s
        out["balance_traded_s"] = busiest - contiguous_s
    return out
