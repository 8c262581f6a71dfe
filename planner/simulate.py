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
