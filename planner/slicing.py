"""How to slice a prompt: HPipe's Algorithm 2 (§3.4, eq. 2), exact and fast.

`slice_sequence(tau, n_stages)`: tau[s, c] is the time of one slice of s units after c units of
context on the bottleneck stage, its send included (s >= 1, s + c <= N). Among all slicings
s_1, ..., s_M of N units (c_i = s_1 + ... + s_{i-1}) it finds one minimizing

    J = sum_i tau(s_i, c_i) + (n_stages - 1) * max_i tau(s_i, c_i).

The paper enumerates every candidate t_max (every value of tau) and runs a full DP for each.
Here J = g(M) + (n_stages - 1) M is minimized over the caps M by branch and bound: g(M), the least
sum of slice costs with every cost <= M, is one DP (O(N^2), vectorized per row); an interval of
caps (a, b] is bounded below by g(b) + (n_stages - 1) a, since g does not increase with the cap;
a DP at cap M also settles every cap between its slicing's largest cost and M. Intervals are
split best bound first and dropped once their bound cannot beat the best slicing found, which
keeps the result exact for any tau, monotone or not, while typically running a few dozen DPs
instead of one per value of tau.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SliceSearch:
    """Algorithm 2's answer for one prompt: the slice lengths, the objective they reach and what the
    search took (the plan keeps the lengths in its `formats.Slicing`)."""

    lengths: list[int]
    objective: float
    sum_s: float = 0.0        # sum of the slices' costs
    max_s: float = 0.0        # the largest slice cost
    steps: int = 0            # DPs run (the Pareto walk's length)


def _least_sum(tau_t: np.ndarray, n: int, cap: float, monotone: bool):
    """Least sum of slice costs, every cost <= cap; and the slicing. tau_t[c, s] = tau[s, c].
    When every row is non-decreasing in s (`monotone`), the slices allowed after c are a prefix."""
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    if monotone:
        reach = _reach(tau_t, n, cap)  # the longest slice allowed after each c
        tmp = np.empty(n + 1)
        inf = np.inf
        add, minimum = np.add, np.minimum
        for c, k in enumerate(reach):
            b = float(best[c])
            if k and b < inf:
                seg = best[c + 1:c + 1 + k]
                t = add(tau_t[c, 1:k + 1], b, out=tmp[:k])
                minimum(seg, t, out=seg)
    else:
        capped = np.where(tau_t <= cap, tau_t, np.inf)
        for c in range(n):
            if best[c] < np.inf:
                np.minimum(best[c + 1:], best[c] + capped[c, 1:n - c + 1], out=best[c + 1:])
    if not np.isfinite(best[n]):
        return np.inf, None
    lengths, x = [], n  # walk back: the same sums, so an exact match marks the chosen slice
    every = np.arange(n)
    while x > 0:
        c = every[:x]
        cost = tau_t[c, x - c]
        c = int(np.flatnonzero((cost <= cap) & (best[:x] + cost == best[x]))[-1])
        lengths.append(x - c)
        x = c
    return float(best[n]), lengths[::-1]


def _reach(tau_t: np.ndarray, n: int, cap: float) -> list[int]:
    """For rows non-decreasing in s: how many s >= 1 have tau_t[c, s] <= cap, for every c at once
    (a vectorized binary search)."""
    lo = np.zeros(n, dtype=np.int64)            # count known to be <= answer
    hi = np.arange(n, 0, -1, dtype=np.int64)    # row c has n - c valid entries
    rows = np.arange(n)
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo.tolist()
        mid = (lo + hi + 1) // 2
        ok = open_ & (tau_t[rows, np.maximum(mid, 1)] <= cap)
        lo = np.where(ok, mid, lo)
        hi = np.where(open_ & ~ok, mid - 1, hi)


def _minimax(tau_t: np.ndarray, n: int) -> float:
    """The least possible largest slice cost over all slicings."""
    best = np.full(n + 1, np.inf)
    best[0] = -np.inf
    for c in range(n):
        if best[c] < np.inf:
            np.minimum(best[c + 1:], np.maximum(best[c], tau_t[c, 1:n - c + 1]), out=best[c + 1:])
    return float(best[n])


def _by_context(tau: np.ndarray):
    """tau's valid entries (a slice of s >= 1 tokens after c, s + c <= N), tau as [c, s] with the
    invalid ones inf (never chosen), and whether every context's cost grows with the slice."""
    n = tau.shape[0] - 1
    if n < 1 or tau.shape != (n + 1, n + 1):
        raise ValueError(f"tau must be (N+1) x (N+1) with N >= 1, got {tau.shape}")
    s_idx, c_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = (s_idx >= 1) & (s_idx + c_idx <= n)
    tau_t = np.ascontiguousarray(np.where(valid, tau, np.inf).T)
    with np.errstate(invalid="ignore"):  # inf - inf past each row's end: nan, no order to keep
        steps_in_s = np.diff(tau_t[:, 1:], axis=1)
    return valid, tau_t, bool(np.all((steps_in_s >= 0) | np.isnan(steps_in_s)))


def slice_sequence(tau, n_stages: int) -> SliceSearch:
    tau = np.asarray(tau, dtype=float)
    n = tau.shape[0] - 1
    valid, tau_t, monotone = _by_context(tau)
    weight = float(n_stages - 1)
    values = np.unique(tau[valid])                       # every possible largest slice cost
    steps = 0
    known: dict[int, tuple[float, list[int]]] = {}

    def least(k: int):
        nonlocal steps
        if k not in known:
            steps += 1
            known[k] = _least_sum(tau_t, n, values[k], monotone)
        return known[k]

    def evaluate(lengths: list[int]) -> tuple[float, float, float]:
        starts = np.cumsum([0] + lengths[:-1])
        costs = tau[lengths, starts]
        return float(costs.sum()) + weight * float(costs.max()), float(costs.sum()), float(costs.max())

    top_sum, top_lengths = least(len(values) - 1)        # no cap: the least sum
    best = (*evaluate(top_lengths), top_lengths)
    if weight == 0:
        return SliceSearch(best[3], best[0], best[1], best[2], steps)
    floor_k = int(np.searchsorted(values, _minimax(tau_t, n)))
    # branch and bound over caps: an interval (lo, hi] of value indices holds the slicings whose
    # largest cost is in (values[lo], values[hi]]; their sums are >= g_hi (the least sum under
    # cap values[hi], or a lower bound of it) and their J >= g_hi + weight x values[lo + 1]
    top_k = int(np.searchsorted(values, best[2]))
    intervals = [(top_sum + weight * values[floor_k], floor_k - 1, top_k, top_sum)]
    while intervals:
        intervals.sort()
        bound, lo, hi, g_hi = intervals.pop(0)
        if bound >= best[0] or lo >= hi:
            if bound >= best[0]:
                break
            continue
        # split where the interval's values are halved: the bound's gap, weight x (value range), halves
        mid = int(np.searchsorted(values, (values[lo + 1] + values[hi]) / 2))
        mid = min(max(mid, lo + 1), hi)
        total, lengths = least(mid)
        if lengths is None:          # nothing fits under values[mid]: only (mid, hi] is left
            intervals.append((g_hi + weight * values[mid + 1], mid, hi, g_hi))
            continue
        cand = evaluate(lengths)
        if cand[0] < best[0]:
            best = (*cand, lengths)
        reached = int(np.searchsorted(values, cand[2]))  # caps in [reached, mid] all give this slicing
        if mid < hi:
            intervals.append((g_hi + weight * values[mid + 1], mid, hi, g_hi))
        if reached - 1 > lo:
            intervals.append((total + weight * values[lo + 1], lo, reached - 1, total))
    return SliceSearch(best[3], best[0], best[1], best[2], steps)
