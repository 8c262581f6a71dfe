"""`hpipe launch`'s progress while it runs: prompts done of the total, output tokens a second, the
time left, each stage's busy fraction, and the hosts lost on the way.

The time left weighs the work left against the work done, in decode tokens: a prompt's token
costs `ratio` of a decode token (the plan's predicted decode rate over its prefill rate, else the
busiest stage's measured compute per token of each kind); a request's first token comes with its
prefill, and a request not finished is expected to generate the share of its `max_new_tokens`
the finished ones did (all of it before any finished). The work done is stage 0's prefilled and
decoded tokens (its pulses, launcher/pulses.py) since this pipeline started; the rate is that
work over the seconds since its stages first computed, started from the plan's predicted decode
rate as if it had been seen for PRIOR_S seconds. After a lost host the job goes on, on a new
plan, with the prompts left: the count starts again there (`restart`).

The display is chosen once: a rich live bar on a terminal; plain lines (every PLAIN_EVERY_S and at
the end) when stderr is not a terminal or with --quiet.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from hpipe import formats

__all__ = ["JobProgress", "Progress"]

PRIOR_S = 3.0            # the plan's predicted rate counts as this many seconds of the run
PLAIN_EVERY_S = 10.0     # a plain progress line at most this often
BAR_EVERY_S = 0.25       # the bar's refresh
RATE_WINDOW_S = 10.0     # output tokens/s over the last seconds
PREFILLED = ("prefill", "mixed")   # micro-batch kinds whose tokens are (mostly) prompt tokens


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    tokens_per_s: float | None
    eta_s: float | None
    elapsed_s: float
    busy: tuple[float | None, ...]
    lost: tuple[str, ...]            # hosts lost so far

    def line(self) -> str:
        eta = "–" if self.eta_s is None else duration(self.eta_s)
        rate = "–" if self.tokens_per_s is None else f"{self.tokens_per_s:.0f}"
        busy = ", ".join("–" if b is None else f"{b:.0%}" for b in self.busy)
        lost = f"; hosts lost: {', '.join(self.lost)}" if self.lost else ""
        return (f"{self.done}/{self.total} prompts, {rate} tokens/s out, {duration(self.elapsed_s)} elapsed, "
                f"ETA {eta}; stages busy {busy}{lost}")


def duration(s: float) -> str:
    s = max(0, round(s))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class JobProgress:
    """The job's progress from its requests, its plan, the finished results and the stages' pulses."""

    def __init__(self, requests: list, plan: formats.Plan, display):
        self.prompt_tokens = {r.id: len(r.input_ids) for r in requests}      # by id: a re-plan renumbers them
        self.max_new = {r.id: r.max_new_tokens - len(r.output_ids) for r in requests}
        self.outputs: dict[str, int] = {}
        self.display = display
        self.t0 = time.time()
        self._run_on(plan, set(self.max_new), (0, 0))

    def _run_on(self, plan: formats.Plan, running: set[str], baseline: tuple[int, int]) -> None:
        self.stages = len(plan.stages)
        self.running = running             # the ids this pipeline was given
        self.baseline = baseline           # stage 0's (prefilled, decoded) tokens when it started
        pr = plan.predicted or {}
        decode_rate, prefill_rate = (pr.get("decode") or {}).get("tokens_per_s"), pr.get("throughput_tokens_per_s")
        self.predicted_rate = decode_rate
        self.predicted_ratio = decode_rate / prefill_rate if decode_rate and prefill_rate else None

    def restart(self, pulses, requests: list, plan: formats.Plan) -> None:
        """A lost host's stages were planned again: `requests` run on `plan` from their start."""
        self._run_on(plan, {r.id for r in requests}, self.stage0_tokens(pulses))

    def finished(self, request_id: str, output_tokens: int) -> None:
        self.outputs[request_id] = output_tokens

    @staticmethod
    def stage0_tokens(pulses) -> tuple[int, int]:
        return sum(pulses.total(0, k)[1] for k in PREFILLED), pulses.total(0, "decode")[1]

    def ratio(self, pulses) -> float | None:
        """What one prompt token costs in decode tokens: the plan's, else the busiest stage's measured."""
        if self.predicted_ratio is not None:
            return self.predicted_ratio
        busiest = max(range(self.stages), key=lambda r: sum(pulses.total(r, k)[0] for k in (*PREFILLED, "decode")))
        prefill = [pulses.total(busiest, k) for k in PREFILLED]
        p_s, p_n = sum(s for s, _ in prefill), sum(n for _, n in prefill)
        d_s, d_n = pulses.total(busiest, "decode")
        return (p_s / p_n) / (d_s / d_n) if p_n and d_n and d_s > 0 else None

    def eta_s(self, pulses, now: float) -> float | None:
        if len(self.outputs) == len(self.max_new):
            return 0.0
        ratio = self.ratio(pulses)
        if ratio is None:
            return None
        used = [n / max(1, self.max_new[i]) for i, n in self.outputs.items()]
        share = sum(used) / len(used) if used else 1.0
        work = sum(ratio * self.prompt_tokens[i] + max(0.0, self.outputs.get(i, self.max_new[i] * share) - 1)
                   for i in self.running)
        prefilled, decoded = self.stage0_tokens(pulses)
        done = ratio * (prefilled - self.baseline[0]) + decoded - self.baseline[1]
        elapsed = now - pulses.first_busy if pulses.first_busy is not None else 0.0
        prior = PRIOR_S if self.predicted_rate else 0.0
        seconds = elapsed + prior
        rate = (done + prior * (self.predicted_rate or 0.0)) / seconds if seconds > 0 else 0.0
        return max(0.0, work - done) / rate if rate > 0 else None

    def snapshot(self, pulses, lost: tuple[str, ...] = (), now: float | None = None) -> Progress:
        now = time.time() if now is None else now
        return Progress(len(self.outputs), len(self.max_new), pulses.rate(0, "decode", RATE_WINDOW_S),
                        self.eta_s(pulses, now), now - self.t0, tuple(pulses.busy(r) for r in range(self.stages)),
                        lost)

    def update(self, pulses, lost: tuple[str, ...] = ()) -> None:
        if self.display.due():             # (a snapshot walks the requests: only when it is shown)
            self.display.show(self.snapshot(pulses, lost))

    def close(self, pulses, lost: tuple[str, ...] = ()) -> None:
        self.display.close(self.snapshot(pulses, lost))

    @staticmethod
    def display_for(log, quiet: bool):
        """The display, chosen once: rich on a terminal, else plain lines through `log`."""
        return LiveBar() if not quiet and sys.stderr.isatty() else PlainLines(log)


class PlainLines:
    def __init__(self, log, every_s: float = PLAIN_EVERY_S):
        self.log, self.every_s, self.last = log, every_s, 0.0

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.every_s

    def show(self, p: Progress) -> None:
        self.last = time.monotonic()
        self.log(f"hpipe: {p.line()}")

    def close(self, p: Progress) -> None:
        self.log(f"hpipe: {p.line()}")


class LiveBar:
    """A rich progress bar on stderr; the workers' and the launcher's lines print above it."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn

        self.bar = Bar(TextColumn("prompts"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rest]}"),
                       console=Console(stderr=True), refresh_per_second=4)
        self.task = None
        self.last = 0.0

    def due(self) -> bool:
        return time.monotonic() - self.last >= BAR_EVERY_S

    def show(self, p: Progress) -> None:
        self.last = time.monotonic()
        rest = p.line().split(" prompts, ", 1)[1]
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task("job", total=p.total, rest=rest)
        self.bar.update(self.task, completed=p.done, rest=rest)

    def close(self, p: Progress) -> None:
        self.show(p)
        self.bar.stop()
