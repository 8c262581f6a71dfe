"""The stages' pulses of the last minute (`hpipe.protocol.Pulse`, one a second from every stage),
kept by the launch's report reader and read by the live page of `hpipe serve` and by the progress
of `hpipe launch`: each stage's busy fraction, the memory it holds, its latest micro-batches.

A host's clock is not the launcher's: each pulse is moved onto the launcher's clock as it arrives
(its end is when it came, its intervals shifted by as much), so figures from several hosts line up
on one time axis (a pulse's trip, milliseconds, is the error). Reports arrive on the launch's
reader thread and are read from the server's: one lock."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from hpipe import protocol

__all__ = ["Pulses", "WINDOW_S"]

WINDOW_S = 60.0          # "busy over the last minute"


class Pulses:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_rank: dict[int, collections.deque] = {}
        self.tokens: dict[int, dict[str, int]] = {}       # since the start: kind -> tokens
        self.first_busy: float | None = None              # when a stage of this pipeline first computed

    def take(self, pulse: protocol.Pulse, received: float | None = None) -> None:
        received = time.time() if received is None else received
        shift = received - pulse.t
        pulse = dataclasses.replace(pulse, t=received, intervals=[
            [what, start + shift, end + shift, *rest] for what, start, end, *rest in pulse.intervals])
        with self.lock:
            kept = self.by_rank.setdefault(pulse.rank, collections.deque())
            kept.append(pulse)
            while kept and kept[0].t < pulse.t - WINDOW_S:
                kept.popleft()
            tokens = self.tokens.setdefault(pulse.rank, {})
            for kind, (_, n, _) in pulse.kinds.items():
                tokens[kind] = tokens.get(kind, 0) + n
            if pulse.busy_s > 0 and self.first_busy is None:
                self.first_busy = pulse.t - pulse.window_s

    def clear(self) -> None:
        """Another pipeline starts (a recovery): its stages are not the last one's. The tokens
        computed stay (a batch job's progress takes its baseline there: launcher/progress.py)."""
        with self.lock:
            self.by_rank.clear()
            self.first_busy = None

    def computed(self, rank: int, kind: str) -> int:
        """Tokens of the stage's micro-batches of `kind` since the start."""
        with self.lock:
            return self.tokens.get(rank, {}).get(kind, 0)

    def _kept(self, rank: int, window_s: float) -> list[protocol.Pulse]:
        with self.lock:
            kept = list(self.by_rank.get(rank, ()))
        return [p for p in kept if p.t > kept[-1].t - window_s] if kept else []

    def _per_second(self, rank: int, window_s: float, figure) -> float | None:
        """figure(pulse) summed over the stage's pulses in the window, per wall second (None: none came)."""
        kept = self._kept(rank, window_s)
        span = sum(p.window_s for p in kept)
        return sum(map(figure, kept)) / span if span > 0 else None

    def busy(self, rank: int, window_s: float = WINDOW_S) -> float | None:
        """Compute seconds over wall seconds of the stage's pulses in the window (None: none came yet)."""
        busy = self._per_second(rank, window_s, lambda p: p.busy_s)
        return None if busy is None else min(1.0, busy)

    def _kind(self, rank: int, kind: str, window_s: float) -> tuple[float, int, int]:
        rows = [p.kinds[kind] for p in self._kept(rank, window_s) if kind in p.kinds]
        return sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows)

    def step_s(self, rank: int, kind: str, window_s: float = WINDOW_S) -> float | None:
        """The mean compute seconds of the stage's micro-batches of `kind` in the window (None: none)."""
        seconds, _, mbs = self._kind(rank, kind, window_s)
        return seconds / mbs if mbs else None

    def rows(self, rank: int, kind: str, window_s: float = WINDOW_S) -> float | None:
        """The mean tokens of the stage's micro-batches of `kind` in the window (a decode step's rows)."""
        _, tokens, mbs = self._kind(rank, kind, window_s)
        return tokens / mbs if mbs else None

    def tokens_per_s(self, rank: int, kind: str, window_s: float = WINDOW_S) -> float | None:
        """Tokens per compute second of the stage's micro-batches of `kind` in the window (None: none)."""
        seconds, tokens, _ = self._kind(rank, kind, window_s)
        return tokens / seconds if seconds > 0 else None

    def rate(self, rank: int, kind: str, window_s: float) -> float | None:
        """Tokens of `kind` the stage computed per wall second in the window (None: no pulse yet)."""
        return self._per_second(rank, window_s, lambda p: p.kinds.get(kind, (0.0, 0, 0))[1])

    def intervals(self, rank: int, window_s: float) -> list[list]:
        return [row for p in self._kept(rank, window_s) for row in p.intervals]

    def latest(self, rank: int) -> protocol.Pulse | None:
        with self.lock:
            kept = self.by_rank.get(rank)
            return kept[-1] if kept else None
