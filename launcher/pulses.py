"""The stages' pulses of the last minute (`hpipe.protocol.Pulse`, one a second from every stage),
kept by the launch's report reader and read by the live page of `hpipe serve` and by the progress
of `hpipe launch`: each stage's busy fraction, the memory it holds, its latest micro-batches."""

from __future__ import annotations

import collections
import threading

from hpipe import protocol

__all__ = ["Pulses", "WINDOW_S"]

WINDOW_S = 60.0          # "busy over the last minute"


class Pulses:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_rank: dict[int, collections.deque] = {}

    def take(self, pulse: protocol.Pulse) -> None:
        with self.lock:
            kept = self.by_rank.setdefault(pulse.rank, collections.deque())
            kept.append(pulse)
            while kept and kept[0].t < pulse.t - WINDOW_S:
                kept.popleft()

    def clear(self) -> None:
        """Another pipeline starts (a recovery): its stages are not the last one's."""
        with self.lock:
            self.by_rank.clear()

    def _kept(self, rank: int, window_s: float) -> list[protocol.Pulse]:
        with self.lock:
            kept = list(self.by_rank.get(rank, ()))
        return [p for p in kept if p.t > kept[-1].t - window_s] if kept else []

    def busy(self, rank: int, window_s: float = WINDOW_S) -> float | None:
        """Compute seconds over wall seconds of the stage's pulses in the window (None: none came yet)."""
        kept = self._kept(rank, window_s)
        span = sum(p.window_s for p in kept)
        return min(1.0, sum(p.busy_s for p in kept) / span) if span > 0 else None

    def step_s(self, rank: int, kind: str, window_s: float = WINDOW_S) -> float | None:
        """The mean compute seconds of the stage's micro-batches of `kind` in the window (None: none)."""
        times = [end - start for p in self._kept(rank, window_s)
                 for what, start, end, _mb, k, _tokens in p.intervals if what == "compute" and k == kind]
        return sum(times) / len(times) if times else None

    def tokens_per_s(self, rank: int, kind: str, window_s: float = WINDOW_S) -> float | None:
        """Tokens per compute second of the stage's micro-batches of `kind` in the window (None: none)."""
        rows = [(end - start, tokens or 0) for p in self._kept(rank, window_s)
                for what, start, end, _mb, k, tokens in p.intervals if what == "compute" and k == kind]
        seconds = sum(t for t, _ in rows)
        return sum(n for _, n in rows) / seconds if seconds > 0 else None

    def intervals(self, rank: int, window_s: float) -> list[list]:
        return [row for p in self._kept(rank, window_s) for row in p.intervals]

    def latest(self, rank: int) -> protocol.Pulse | None:
        with self.lock:
            kept = self.by_rank.get(rank)
            return kept[-1] if kept else None
