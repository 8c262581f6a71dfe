"""`hpipe launch`'s progress while it runs: prompts done of the total, output tokens a second, the
time left, each stage's busy fraction, and the hosts lost on the way.

The time left is the prompts left over the rate at which this pipeline finishes them (since its
stages first computed), started from the plan's prediction as if it had been seen for PRIOR_S
seconds: a prompt's predicted seconds are its prompt tokens at the plan's prefill rate and its
`max_new_tokens` at its decode rate. The prompts under way count for what they decoded (stage 0's
decode tokens not yet in a finished answer, over the longest answer one may still give): the
answers end in waves, and the count alone would jump with them. Prompts, not tokens: a job's first
answers to end are its short ones, so the tokens the finished ones used would promise the rest too
little. And the job's last answers do not end at the rate so far: the batch in flight (stage 0's
mean decode rows) drains over about one answer's time, its longest answer last, so the time left
counts DRAIN of a batch more. Measured (bench/launch_progress.py, 64 prompts over 3 emulated
hosts, the ETA's error after a quarter of them): by the finished answers' tokens -45 %, by the
prompts alone +20 %, by the prompts with those under way counted -18 % and -28 % (two runs), with
the drain too: see docs/benchmarks.md. After a lost host the job goes on, on a new plan, with the prompts
left: the count starts again there (`restart`).

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
DRAIN = 0.5              # the last answers in flight end over about one answer's time (Little's law: as many
                         # as are in flight over the rate), the longest of them later: half a batch more


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
        return f"{self.done}/{self.total} prompts, {self.rest()}"

    def rest(self) -> str:
        """All but the count (the bar draws that)."""
        eta = "–" if self.eta_s is None else duration(self.eta_s)
        rate = "–" if self.tokens_per_s is None else f"{self.tokens_per_s:.0f}"
        busy = ", ".join("–" if b is None else f"{b:.0%}" for b in self.busy)
        lost = f"; hosts lost: {', '.join(self.lost)}" if self.lost else ""
        return f"{rate} tokens/s out, {duration(self.elapsed_s)} elapsed, ETA {eta}; stages busy {busy}{lost}"


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
        self._run_on(plan, set(self.max_new))

    def _run_on(self, plan: formats.Plan, running: set[str], decoded: int = 0) -> None:
        self.stages = len(plan.stages)
        self.running = running             # the ids this pipeline was given
        self.decoded = decoded             # stage 0's decode tokens before it
        pr = plan.pipeline_prediction
        decode = pr.decode.tokens_per_s if pr is not None and pr.decode is not None else None
        prefill = pr.throughput_tokens_per_s if pr is not None else None
        seconds = sum(self.prompt_tokens[i] / prefill + self.max_new[i] / decode for i in running) \
            if decode and prefill and running else None
        self.predicted_rate = len(running) / seconds if seconds else None       # prompts a second

    def restart(self, pulses, requests: list, plan: formats.Plan) -> None:
        """A lost host's stages were planned again: `requests` run on `plan` from their start."""
        self._run_on(plan, {r.id for r in requests}, pulses.computed(0, "decode"))

    def finished(self, request_id: str, output_tokens: int) -> None:
        self.outputs[request_id] = output_tokens

    def eta_s(self, pulses, now: float) -> float | None:
        answers = [self.outputs[i] for i in self.running if i in self.outputs]
        left = len(self.running) - len(answers)
        if left == 0:
            return 0.0
        under_way = pulses.computed(0, "decode") - self.decoded - sum(n - 1 for n in answers)
        longest = max(self.max_new[i] for i in self.running if i not in self.outputs)
        partial = min(0.9 * left, max(0, under_way) / longest)
        elapsed = now - pulses.first_busy if pulses.first_busy is not None else 0.0
        prior = PRIOR_S if self.predicted_rate else 0.0
        seconds = elapsed + prior
        rate = (len(answers) + partial + prior * (self.predicted_rate or 0.0)) / seconds if seconds > 0 else 0.0
        in_flight = min(left, pulses.rows(0, "decode", RATE_WINDOW_S) or 0.0)
        return (left - partial + DRAIN * in_flight) / rate if rate > 0 else None

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
        rest = p.rest()
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task("job", total=p.total, rest=rest)
        self.bar.update(self.task, completed=p.done, rest=rest)

    def close(self, p: Progress) -> None:
        self.show(p)
        self.bar.stop()
