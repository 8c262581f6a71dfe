"""The pipeline as the planner predicts it: slices in order on every stage, each stage computing
one slice at a time, sends overlapping compute (a stage starts its next slice while the last one
is on the wire; one send at a time per link).

`simulate(t, comm=None)`: t[i][j] is the compute time of slice i on stage j, comm[i][j] the time
to send slice i from stage j to j+1. Without comm this is the flow-shop recurrence
C[i][j] = max(C[i-1][j], C[i][j-1]) + t[i][j].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Timeline:
    start: np.ndarray      # [slices, stages]
    end: np.ndarray
    send_end: np.ndarray   # when slice i has reached stage j+1
    makespan: float

    def busy(self) -> np.ndarray:
        return (self.end - self.start).sum(axis=0)


def simulate(t, comm=None) -> Timeline:
    t = np.asarray(t, dtype=float)
    m, d = t.shape
    comm = np.zeros_like(t) if comm is None else np.asarray(comm, dtype=float)
    start, end, sent = np.zeros_like(t), np.zeros_like(t), np.zeros_like(t)
    for i in range(m):
        for j in range(d):
            ready = sent[i, j - 1] if j else 0.0
            free = end[i - 1, j] if i else 0.0
            start[i, j] = max(ready, free)
            end[i, j] = start[i, j] + t[i, j]
            link_free = sent[i - 1, j] if i else 0.0
            sent[i, j] = max(end[i, j], link_free) + (comm[i, j] if j < d - 1 else 0.0)
    return Timeline(start, end, sent, float(end[-1, -1]) if m else 0.0)


@dataclass(frozen=True)
class Sharing:
    """Stages that compete for one machine's cores: `machine[j]` names stage j's machine (None: a
    device with its own compute, a GPU), `threads[j]` the threads it runs, `cores[name]` what the
    machine has. While the running stages of a machine ask for more threads than it has cores,
    each runs at cores / threads asked (processor sharing)."""
    machine: tuple[str | None, ...]
    threads: tuple[int, ...]
    cores: dict[str, int]

    @property
    def oversubscribed(self) -> bool:
        asked: dict[str, int] = {}
        for m, n in zip(self.machine, self.threads):
            if m is not None:
                asked[m] = asked.get(m, 0) + n
        return any(n > self.cores[m] for m, n in asked.items())


def simulate_shared(t, comm, sharing: Sharing) -> Timeline:
    """`simulate` with stages that share cores: event by event, a running stage progresses at the
    rate its machine's cores allow given the stages running there at that moment. The same order
    and links as `simulate` (which this is when no machine is oversubscribed)."""
    t = np.asarray(t, dtype=float)
    m, d = t.shape
    comm = np.zeros_like(t) if comm is None else np.asarray(comm, dtype=float)
    start, end, sent = np.full((m, d), np.nan), np.full((m, d), np.nan), np.full((m, d), np.nan)
    nxt = [0] * d                       # the next slice of each stage
    left = [0.0] * d                    # the running slice's work left (seconds at full speed)
    running = [False] * d
    now = 0.0
    while min(nxt) < m or any(running):
        for j in range(d):              # start what can start now
            i = nxt[j]
            if running[j] or i >= m:
                continue
            arrived = 0.0 if j == 0 else sent[i, j - 1]
            if not np.isnan(arrived) and arrived <= now + 1e-15:
                running[j], left[j], start[i, j] = True, t[i, j], now
        asked: dict[str, int] = {}
        for j in range(d):
            if running[j] and sharing.machine[j] is not None:
                asked[sharing.machine[j]] = asked.get(sharing.machine[j], 0) + sharing.threads[j]
        rate = [min(1.0, sharing.cores[sharing.machine[j]] / asked[sharing.machine[j]])
                if running[j] and sharing.machine[j] is not None else 1.0 for j in range(d)]
        events = [now + left[j] / rate[j] for j in range(d) if running[j]]
        events += [sent[nxt[j], j - 1] for j in range(1, d)
                   if not running[j] and nxt[j] < m and not np.isnan(sent[nxt[j], j - 1])
                   and sent[nxt[j], j - 1] > now]
        step = min(events) - now
        now += step
        for j in range(d):
            if not running[j]:
                continue
            left[j] -= rate[j] * step
            if left[j] <= 1e-12 * max(1.0, t[nxt[j], j]):
                i = nxt[j]
                running[j], end[i, j] = False, now
                link_free = sent[i - 1, j] if i else 0.0
                sent[i, j] = max(now, link_free) + (comm[i, j] if j < d - 1 else 0.0)
                nxt[j] += 1
    return Timeline(start, end, sent, float(end[-1, -1]) if m else 0.0)


def decode_round(step_s, back_s: float, groups: int):
    """One round of decode (a token for every sequence): `groups` steps of the slowest stage, but
    never less than one group's trip (every stage's step, then the way back to stage 0). step_s:
    [..., D] (any leading axes: the cut search passes thousands of candidates at once)."""
    step = np.asarray(step_s, dtype=float)
    return np.maximum(np.maximum(groups * step.max(axis=-1), step.sum(axis=-1) + back_s), 1e-12)
