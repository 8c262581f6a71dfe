"""Cuts chosen by the simulated makespan itself, not by a proxy of it.

Algorithm 1 (partition.py) minimizes the busiest stage's total time (HPipe eq. 1). The makespan of
a sliced pipeline also depends on where the fill and the drain fall (a slow first or last stage is
paid once more per slice than a slow middle one) and on the links, so the balanced cuts can be
predicted slower than equal ones. Here the cuts are searched against the simulator's own
recurrence (simulate.py), for thousands of candidates at once:

- exhaustively, when the model's cut positions give at most EXHAUSTIVE candidates (every plan of
  up to 4 stages of a 30-block model): the optimum for the simulator;
- otherwise by local search from the given starts (Algorithm 1's cuts, uniform cuts): every move
  of one cut, and every joint move of 2 neighbouring cuts within their neighbours, until no
  move improves.

Among cuts whose objective is within 0.1 % of the least, the most balanced are kept (a single
slice, or a link that dominates, can make many cuts tie). What is minimized is the planner's objective: the prefill makespan of the batch, plus the decode
of every sequence's new tokens (rounds of the slowest stage's step, or of one trip through every
stage, whichever binds) when the plan balances decode too.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from hpipe.planner.simulate import decode_round

__all__ = ["EXHAUSTIVE", "CutCosts", "CutSearch", "objective_values", "search_cuts"]

EXHAUSTIVE = 300_000     # at most this many candidates: all of them, simulated CHUNK at a time
CHUNK = 20_000
WIDTH = 2                # local search: joint moves of up to WIDTH neighbouring cuts
TIE = 1e-3               # objectives this close count as equal: the more balanced cuts are kept


@dataclass(frozen=True)
class CutCosts:
    """What the objective of a cut depends on, per cut position (prefix sums over units), so that a
    candidate's stage times are two lookups. m = slices x batch, in the order they enter stage 0."""
    compute: np.ndarray        # [D, m, U+1]: slice i's time on device j for units [0, u)
    send: np.ndarray           # [D-1, m, U+1]: device j sending slice i when cut after unit u-1
    memory: np.ndarray         # [U+1]: the units' bytes for units [0, u)
    capacity: np.ndarray       # [D]: the bytes each device has for units
    prefill_weight: float      # 1 when the prefill makespan counts, else 0
    decode_tokens: float = 0.0              # decode rounds that count (the new tokens), 0 for none
    decode_groups: int = 1
    decode_compute: np.ndarray | None = None  # [D, U+1]: one decode step of a group, units [0, u)
    decode_send: np.ndarray | None = None     # [D-1, U+1]
    decode_back: float = 0.0                  # the way back to stage 0 after a group's last stage
    prefill_back: float = 0.0                 # the same after the last slice: part of the makespan

    @property
    def n_units(self) -> int:
        return self.memory.shape[0] - 1

    @property
    def n_stages(self) -> int:
        return self.capacity.shape[0]


@dataclass(frozen=True)
class CutSearch:
    cuts: list[int]
    value: float             # the objective of these cuts
    method: str              # "exhaustive" or "local search"
    evaluated: int           # candidates simulated


def _stage_times(costs: CutCosts, cuts: np.ndarray):
    """[m, D, K] compute and [m, D-1, K] sends of K candidates (the candidate axis last: every step
    of the recurrence below reads contiguous rows)."""
    d = costs.n_stages
    m = costs.compute.shape[1]
    t = np.empty((m, d, cuts.shape[0]))
    for j in range(d):
        t[:, j] = costs.compute[j][:, cuts[:, j + 1]] - costs.compute[j][:, cuts[:, j]]
    send = np.empty((m, max(d - 1, 0), cuts.shape[0]))
    for j in range(d - 1):
        send[:, j] = costs.send[j][:, cuts[:, j + 1]]
    return t, send


def _makespans(t: np.ndarray, send: np.ndarray) -> np.ndarray:
    """simulate.py's recurrence for K candidates at once: a stage starts slice i when it has finished
    slice i-1 and slice i has arrived; a link carries one slice at a time."""
    m, d, k = t.shape
    end = np.zeros((d, k))
    sent = np.zeros((max(d - 1, 0), k))
    ready = np.empty(k)
    for i in range(m):
        ready.fill(0.0)
        for j in range(d):
            np.maximum(ready, end[j], out=end[j])
            end[j] += t[i, j]
            if j < d - 1:
                np.maximum(end[j], sent[j], out=sent[j])
                sent[j] += send[i, j]
                ready[:] = sent[j]
    return end[d - 1].copy()


def _decode_round(costs: CutCosts, cuts: np.ndarray) -> np.ndarray:
    """One round of decode (a token for every sequence) of K candidates (simulate.decode_round)."""
    d = costs.n_stages
    step = np.stack([costs.decode_compute[j][cuts[:, j + 1]] - costs.decode_compute[j][cuts[:, j]]
                     + (costs.decode_send[j][cuts[:, j + 1]] if j < d - 1 else 0.0) for j in range(d)], axis=1)
    return decode_round(step, costs.decode_back, costs.decode_groups)


def objective_values(costs: CutCosts, cuts) -> np.ndarray:
    """[K]: the objective of each row of cuts ([K, D+1], 0 = c_0 < ... < c_D = U); inf where a stage
    does not fit its device's memory."""
    cuts = np.atleast_2d(np.asarray(cuts, dtype=np.int64))
    value = np.zeros(cuts.shape[0])
    if costs.prefill_weight:
        value += costs.prefill_weight * (_makespans(*_stage_times(costs, cuts)) + costs.prefill_back)
    if costs.decode_tokens:
        value += costs.decode_tokens * _decode_round(costs, cuts)
    used = costs.memory[cuts[:, 1:]] - costs.memory[cuts[:, :-1]]
    fits = np.all(used <= costs.capacity * (1 + 1e-12), axis=1)
    return np.where(fits, value, np.inf)


def _with_ends(interior: np.ndarray, n_units: int) -> np.ndarray:
    k = interior.shape[0]
    return np.concatenate([np.zeros((k, 1), np.int64), interior, np.full((k, 1), n_units, np.int64)], axis=1)


def _busiest(costs: CutCosts, cuts: np.ndarray) -> np.ndarray:
    """[K]: the busiest stage's compute over all slices (what a decode step's pace follows too)."""
    return np.max(np.stack([(costs.compute[j][:, cuts[:, j + 1]] - costs.compute[j][:, cuts[:, j]]).sum(axis=0)
                            for j in range(costs.n_stages)]), axis=0)


def _pick(costs: CutCosts, cand: np.ndarray, values: np.ndarray, ceiling: float) -> int:
    """The least objective; among the candidates within TIE of it (and no worse than `ceiling`, the
    best start's), the most balanced. A single slice (a short prompt) makes every cut the same
    makespan: then the balanced cuts, not the first ones, are kept."""
    best = float(np.min(values))
    if not np.isfinite(best):
        return int(np.argmin(values))
    near = np.flatnonzero(values <= max(best, min(best * (1 + TIE), ceiling)))
    return int(near[np.argmin(_busiest(costs, cand[near]))])


def _exhaustive(costs: CutCosts, ceiling: float) -> CutSearch:
    u, d = costs.n_units, costs.n_stages
    combos = itertools.combinations(range(1, u), d - 1)
    cands, values = [], []
    while True:
        chunk = np.fromiter(itertools.chain.from_iterable(itertools.islice(combos, CHUNK)), dtype=np.int64)
        if chunk.size == 0:
            break
        cands.append(_with_ends(chunk.reshape(-1, d - 1), u))
        values.append(objective_values(costs, cands[-1]))
    cand, value = np.concatenate(cands), np.concatenate(values)
    k = _pick(costs, cand, value, ceiling)
    return CutSearch(cand[k].tolist(), float(value[k]), "exhaustive", len(cand))


def _moves(cuts: list[int], width: int) -> np.ndarray:
    """Every placement of `width` neighbouring interior cuts strictly between their neighbours, for
    every run of them; the other cuts stay."""
    d = len(cuts) - 1
    out = []
    for k in range(1, d - width + 1):              # cuts[k .. k+width-1] move
        lo, hi = cuts[k - 1], cuts[k + width]
        placed = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(lo + 1, hi), width)),
                             dtype=np.int64).reshape(-1, width)
        block = np.repeat(np.asarray([cuts], dtype=np.int64), len(placed), axis=0)
        block[:, k:k + width] = placed
        out.append(block)
    return np.concatenate(out) if out else np.zeros((0, d + 1), np.int64)


def _local(costs: CutCosts, starts: list[list[int]], ceiling: float) -> CutSearch:
    d = costs.n_stages
    ends, seen = [], 0
    for start in dict.fromkeys(tuple(x) for x in starts):
        cuts = list(start)
        value = float(objective_values(costs, [cuts])[0])
        seen += 1
        while True:
            cand = np.concatenate([_moves(cuts, w) for w in range(1, min(WIDTH, d - 1) + 1)])
            values = objective_values(costs, cand)
            seen += len(cand)
            k = int(np.argmin(values))
            if not values[k] < value * (1 - 1e-12):
                break
            cuts, value = cand[k].tolist(), float(values[k])
        ends.append(cuts)
    ends = np.array(ends, dtype=np.int64)
    k = _pick(costs, ends, objective_values(costs, ends), ceiling)
    return CutSearch(ends[k].tolist(), float(objective_values(costs, ends[k:k + 1])[0]), "local search", seen)


def search_cuts(costs: CutCosts, starts: list[list[int]], exhaustive: int = EXHAUSTIVE) -> CutSearch:
    """The cuts with the least objective: every candidate when there are at most `exhaustive`, else
    local search from each of `starts` (full cut lists, 0 ... U). The result is never worse than
    any start."""
    u, d = costs.n_units, costs.n_stages
    if d == 1:
        cuts = [0, u]
        return CutSearch(cuts, float(objective_values(costs, [cuts])[0]), "exhaustive", 1)
    ceiling = float(np.min(objective_values(costs, starts))) if starts else np.inf
    if math.comb(u - 1, d - 1) <= exhaustive:
        return _exhaustive(costs, ceiling)
    return _local(costs, starts, ceiling)
