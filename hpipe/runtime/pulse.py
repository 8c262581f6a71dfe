"""A stage's pulse: every `protocol.PULSE_S` while it runs, what the last second was (its compute
seconds, the memory it holds of its device's, its micro-batch intervals), as one `protocol.Pulse`
report. The launcher keeps the last minute of them (`hpipe.launcher.pulses`): the live page of
`hpipe serve` and the progress of `hpipe launch` read the stages' busy fractions there.

A daemon thread reads what the executors' threads write (`Intervals.computed`, a small dict
replaced at each change, and `Intervals.recent`, a short deque copied whole); it takes nothing from the forward but a report
line a second."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from hpipe import protocol

__all__ = ["StagePulse"]


def held_bytes(device: torch.device) -> int:
    """What this process holds: the CUDA allocator's reservation on a GPU, resident memory on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def device_bytes(device: torch.device) -> int:
    """The device's memory: a GPU's, or the host's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0


def interval_row(rec: dict) -> list:
    return [rec["what"], round(rec["start"], 5), round(rec["end"], 5), rec.get("mb"), rec.get("kind"),
            rec.get("tokens")]


class StagePulse:
    def __init__(self, rank: int, timeline, device: torch.device, kv_bytes, every_s: float = protocol.PULSE_S):
        self.rank, self.timeline, self.device, self.kv_bytes = rank, timeline, device, kv_bytes
        self.every_s = every_s
        self.total = device_bytes(device)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"hpipe-pulse-{rank}", daemon=True)
        self.t, self.before = time.time(), timeline.computed

    def start(self) -> StagePulse:
        self.thread.start()
        return self

    def stop(self) -> None:
        """The run ended: its last part goes in one more pulse (a job shorter than a pulse has one)."""
        self.stopped.set()
        self.thread.join(timeout=2 * self.every_s)

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            self._send()
        self._send()

    def _send(self) -> None:
        try:
            now, computed = time.time(), self.timeline.computed      # (a new dict at each change)
            zero = (0.0, 0, 0)
            kinds = {k: [round(s - self.before.get(k, zero)[0], 5), n - self.before.get(k, zero)[1],
                         m - self.before.get(k, zero)[2]] for k, (s, n, m) in computed.items()}
            recent = [interval_row(r) for r in list(self.timeline.recent) if r["end"] > self.t]
            protocol.send(protocol.Pulse(self.rank, round(now, 5), round(now - self.t, 5),
                                         round(sum(s for s, _, _ in kinds.values()), 5), kinds,
                                         held_bytes(self.device), self.total, int(self.kv_bytes()), recent))
            self.t, self.before = now, computed
        except Exception as e:  # noqa: BLE001 - a figure the page shows is not worth the stage
            print(f"stage {self.rank}: a pulse was not sent: {e!r}", file=sys.stderr, flush=True)
