"""Where to cut the model: HPipe's Algorithm 1 (§3.3, eq. 3-4), exact, with memory limits.

`partition_layers(unit_time, out_comm, unit_mem, device_mem)`: unit_time[j, u] is the time of
unit u on the j-th device in pipeline order; out_comm[j, u] the time for device j to send the
activation after unit u to device j+1. Stage j holds units [c_j, c_{j+1}), never empty, and takes
sum(unit_time[j, c_j:c_{j+1}]) + out_comm[j, c_{j+1} - 1]. The result minimizes the largest stage
time subject to sum(unit_mem[c_j:c_{j+1}]) <= device_mem[j].

A[j][b] = min over a < b of max(A[j-1][a], T(j, a, b)), O(D U^2) with prefix sums, vectorized
over a.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpipe.errors import HpipeError


class Infeasible(HpipeError):
    """No partition fits the devices' memory."""


@dataclass(frozen=True)
class Partition:
    cuts: list[int]            # D + 1 positions, 0 = c_0 < ... < c_D = U
    bottleneck: float          # the largest stage time
    stage_times: list[float]


def stage_time(unit_time, out_comm, j: int, a: int, b: int, overlap: bool = False) -> float:
    compute, send = float(np.sum(unit_time[j, a:b])), float(out_comm[j, b - 1])
    return max(compute, send) if overlap else compute + send


def partition_layers(unit_time, out_comm, unit_mem=None, device_mem=None, device_names=None,
                     overlap: bool = False) -> Partition:
    """overlap=True: a stage's send overlaps its compute (hpipe's runtime sends without blocking), so
    its time is max(compute, send) instead of HPipe's sum (eq. 3)."""
    unit_time = np.asarray(unit_time, dtype=float)
    out_comm = np.asarray(out_comm, dtype=float)
    n_dev, n_units = unit_time.shape
    if out_comm.shape != unit_time.shape:
        raise ValueError(f"out_comm has shape {out_comm.shape}, unit_time {unit_time.shape}")
    if n_dev > n_units:
        raise Infeasible(f"{n_dev} devices but only {n_units} units: every stage needs at least one unit")
    mem = np.zeros(n_units) if unit_mem is None else np.asarray(unit_mem, dtype=float)
    cap = np.full(n_dev, np.inf) if device_mem is None else np.asarray(device_mem, dtype=float)
    names = device_names or [f"device {j}" for j in range(n_dev)]
    prefix_t = np.concatenate([np.zeros((n_dev, 1)), np.cumsum(unit_time, axis=1)], axis=1)
    prefix_m = np.concatenate([[0.0], np.cumsum(mem)])
    inf = np.inf
    best = np.full((n_dev + 1, n_units + 1), inf)
    arg = np.zeros((n_dev + 1, n_units + 1), dtype=int)
    best[0, 0] = 0.0
    for j in range(1, n_dev + 1):
        d = j - 1
        # stage j ends at b (exclusive) and starts at a, with j-1 <= a < b and b <= U - (D - j)
        for b in range(j, n_units - (n_dev - j) + 1):
            a = np.arange(j - 1, b)
            compute = prefix_t[d, b] - prefix_t[d, a]
            t = np.maximum(compute, out_comm[d, b - 1]) if overlap else compute + out_comm[d, b - 1]
            fits = prefix_m[b] - prefix_m[a] <= cap[d] * (1 + 1e-12)
            cand = np.where(fits, np.maximum(best[j - 1, a], t), inf)
            k = int(np.argmin(cand))
            best[j, b] = cand[k]
            arg[j, b] = a[k]
    if not np.isfinite(best[n_dev, n_units]):
        raise Infeasible(_shortfall(mem, cap, names))
    cuts = [n_units]
    for j in range(n_dev, 0, -1):
        cuts.append(int(arg[j, cuts[-1]]))
    cuts.reverse()
    times = [stage_time(unit_time, out_comm, j, cuts[j], cuts[j + 1], overlap) for j in range(n_dev)]
    return Partition(cuts=cuts, bottleneck=float(best[n_dev, n_units]), stage_times=times)


def _shortfall(mem: np.ndarray, cap: np.ndarray, names: list[str]) -> str:
    """Names the device where a greedy fill (each device takes all it can, in order, leaving one unit
    for every later device) runs out, and by how much."""
    n_dev, n_units = len(cap), len(mem)
    pos = 0
    for j in range(n_dev):
        limit = n_units - (n_dev - 1 - j)
        start = pos
        while pos < limit and mem[start:pos + 1].sum() <= cap[j]:
            pos += 1
        if pos == start:
            return (f"{names[j]} cannot hold even unit {start} ({mem[start] / 2**30:.2f} GiB needed, "
                    f"{cap[j] / 2**30:.2f} GiB free): short by {(mem[start] - cap[j]) / 2**30:.2f} GiB")
    if pos < n_units:
        rest = mem[pos:].sum()
        return (f"the devices' memory is full at unit {pos}: {names[-1]} would need {rest / 2**30:.2f} GiB more "
                f"(short by {rest / 2**30:.2f} GiB); add a device, lower --seq-len/--batch or use a smaller dtype")
    return "no partition fits the memory limits"
