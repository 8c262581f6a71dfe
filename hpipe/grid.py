"""The fitted cost model of a unit kind: t(s, c) anywhere in range from a measured grid.

Rows of the grid are context lengths c_j; along each row the measured times (made non-decreasing
in s) are interpolated linearly in s, and beyond a row's last point (a short row: s + c <= N cuts
the grid to a triangle) extended with its last non-negative slope. Across rows the values are made
non-decreasing in c (a running maximum) and interpolated linearly in c; below the first row they
are the first row's, beyond the last they grow by a factor that does not depend on s. Every step
keeps monotonicity, so t is non-decreasing in s and in c everywhere. Vectorized: the planner asks for
millions of points.
"""

from __future__ import annotations

import numpy as np


class GridModel:
    def __init__(self, s: list[int], c: list[int], t: list[list[float | None]]):
        self.s = np.asarray(s, dtype=float)
        self.c = np.asarray(c, dtype=float)
        self.rows = []  # per context c_j: (xs, ys, tail slope)
        for j in range(len(c)):
            pts = [(s[i], t[i][j]) for i in range(len(s)) if t[i][j] is not None]
            if not pts:
                continue
            xs = np.array([p[0] for p in pts], dtype=float)
            ys = np.maximum.accumulate(np.array([p[1] for p in pts], dtype=float))
            if len(xs) >= 2:
                slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            else:
                slope = ys[-1] / xs[-1]
            self.rows.append((float(c[j]), xs, ys, slope))
        if not self.rows:
            raise ValueError("no measured point")
        self.row_c = np.array([r[0] for r in self.rows])
        # beyond the last row, t grows by the factor (1 + rho (c - c_last)), rho from the last two rows:
        # a factor that does not depend on s keeps t monotone in s there too
        self.rho = 0.0
        if len(self.rows) >= 2:
            xs = self.rows[-1][1]
            v = self._row_values(xs)
            rel = (v[-1] - v[-2]) / np.maximum(v[-2], 1e-12) / (self.row_c[-1] - self.row_c[-2])
            self.rho = max(0.0, float(np.median(rel)))

    def _row_values(self, s: np.ndarray) -> np.ndarray:
        """[rows, len(s)]: each row's interpolation at s, then a running max over rows (c)."""
        out = np.empty((len(self.rows), s.size))
        for k, (_, xs, ys, slope) in enumerate(self.rows):
            v = np.interp(s, xs, ys)
            beyond = s > xs[-1]
            v[beyond] = ys[-1] + slope * (s[beyond] - xs[-1])
            out[k] = v
        return np.maximum.accumulate(out, axis=0)

    def __call__(self, s, c=0) -> np.ndarray:
        s = np.asarray(s, dtype=float)
        c = np.broadcast_to(np.asarray(c, dtype=float), s.shape)
        flat_s, flat_c = s.ravel(), c.ravel()
        values = self._row_values(flat_s)
        if len(self.rows) == 1:
            return values[0].reshape(s.shape)
        rc = self.row_c
        idx = np.clip(np.searchsorted(rc, flat_c, side="right") - 1, 0, len(rc) - 2)
        lo, hi = rc[idx], rc[idx + 1]
        w = np.clip((flat_c - lo) / (hi - lo), 0.0, 1.0)
        cols = np.arange(flat_s.size)
        v_lo, v_hi = values[idx, cols], values[idx + 1, cols]
        out = (1.0 - w) * v_lo + w * v_hi   # a sum of two non-decreasing terms: monotone in s after rounding
        beyond = flat_c > rc[-1]
        out[beyond] *= 1.0 + self.rho * (flat_c[beyond] - rc[-1])
        return out.reshape(s.shape)


def heldout_error(s: list[int], c: list[int], t: list[list[float | None]], every: int = 3) -> float | None:
    """Median relative error on grid points left out of the fit: every `every`-th interior point of
    each row (never a row's first or last point, which bound the interpolation)."""
    errors = heldout_errors(s, c, t, every)
    return float(np.median(errors)) if errors.size else None


def heldout_errors(s: list[int], c: list[int], t: list[list[float | None]], every: int = 3) -> np.ndarray:
    """The relative errors of `heldout_error`, one per held-out point."""
    held, kept = [], [list(row) for row in t]
    for j in range(len(c)):
        idx = [i for i in range(len(s)) if t[i][j] is not None]
        for n, i in enumerate(idx[1:-1], start=1):
            if n % every == 0:
                held.append((s[i], c[j], t[i][j]))
                kept[i][j] = None
    if not held:
        return np.array([])
    model = GridModel(s, c, kept)
    pred = model(np.array([h[0] for h in held]), np.array([h[1] for h in held]))
    true = np.array([h[2] for h in held])
    return np.abs(pred - true) / np.maximum(true, 1e-12)
