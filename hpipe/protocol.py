"""The seam between the stage workers and what launched them: typed records, one encoding.

Into stage 0 (serving: one JSON object a line on its stdin):
    Add(request)      a request joins (its index is its one key, from the server's handler to the sampler)
    Abort(index)      a request ends now (its client went away, or a stop string matched)
    Close()           finish what runs, then stop (as the end of stdin does)

Out of every worker (report lines `@@hpipe {json}` on stdout, `hpipe.reports`' encoding):
    Ready      stage 0 is serving: the KV pool, the longest sequence, the batch, the policy
    Tokens     (index, token) pairs as they are sampled (serving)
    Result     one finished request: its tokens, why it ended, its timing
    Rejected   a request stage 0 cannot take (it does not fit the KV pool)
    Stats      queue, KV pages, preemptions and the recent micro-batches (serving, a few times a second)
    Error      the stage's one-line cause, before it exits non-zero
    Notice     a line for the user even from a quiet launch (a server's stage compiling in the background)
    Pulse      a stage's last second while it runs: its compute seconds, its memory, its micro-batches
    IntervalsReport  the stage's measured intervals and figures, at its end (kind "timeline")
    Summary    stage 0's run figures and the config it ran with, at its end

`send(record)` writes a report, `read_report(line)` reads one back (None for a log line; a plain
dict for the profiler's own reports); `op_line(op)` / `read_op(line)` do the same for the ops.
The worker, the batch job (`hpipe.launcher.jobs`) and the server (`hpipe.launcher.serving`) all go
through here. Pure Python.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import ClassVar

from hpipe.reports import emit, parse
from hpipe.request import Request

__all__ = ["Abort", "Add", "Close", "Error", "Notice", "Pulse", "Ready", "Rejected", "Result", "SinceStart", "Stats", "Summary",
           "IntervalsReport",
           "Tokens", "op_line", "read_op", "read_report", "send"]


# ---------------------------------------------------------------------------------------- ops in
@dataclass(frozen=True)
class Add:
    request: Request


@dataclass(frozen=True)
class Abort:
    index: int


@dataclass(frozen=True)
class Close:
    pass


def op_line(op: Add | Abort | Close) -> str:
    if isinstance(op, Add):
        return json.dumps({"op": "add", "request": op.request.to_json()})
    if isinstance(op, Abort):
        return json.dumps({"op": "abort", "index": op.index})
    return json.dumps({"op": "close"})


def read_op(line: str) -> Add | Abort | Close:
    """Raises ValueError (with what is wrong) for a line that is not an op."""
    try:
        msg = json.loads(line)
        op = msg.get("op") if isinstance(msg, dict) else None
        if op == "add":
            return Add(Request.from_json(msg["request"]))
        if op == "abort":
            return Abort(int(msg["index"]))
        if op == "close":
            return Close()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"bad op line ({e})") from None
    raise ValueError(f"unknown op {op!r}")


# ---------------------------------------------------------------------------------------- reports out
@dataclass(frozen=True)
class Ready:
    KIND: ClassVar[str] = "ready"
    kv_pages: int
    page_size: int
    max_model_len: int
    max_batch: int
    policy: dict
    deterministic: bool             # --deterministic as the stages resolved it


@dataclass(frozen=True)
class Tokens:
    KIND: ClassVar[str] = "tokens"
    items: list                 # [index, token] pairs, in sampling order


@dataclass(frozen=True)
class Result:
    KIND: ClassVar[str] = "result"
    index: int
    output_ids: list
    finish_reason: str | None
    prompt_tokens: int
    ttft_s: float | None
    tpot_s: float
    e2e_s: float | None
    tokens_per_s: float | None


@dataclass(frozen=True)
class Rejected:
    KIND: ClassVar[str] = "rejected"
    index: int
    message: str


@dataclass(frozen=True, kw_only=True)
class SinceStart:
    """Stage 0's counters since the run's start, as `Stats` (while it runs) and `Summary` (at its
    end) both carry them, flat in their JSON: `Scheduler.since_start` fills them."""
    preemptions: int = 0
    prefix_hit_tokens: int = 0         # prompt tokens found in the prefix cache (started after a cached prefix)
    prefix_query_tokens: int = 0       # prompt tokens looked up (a hit rate's denominator)
    spec_proposed_tokens: int = 0      # speculative decoding: tokens proposed, and of them accepted
    spec_accepted_tokens: int = 0


@dataclass(frozen=True)
class Stats(SinceStart):
    KIND: ClassVar[str] = "stats"
    waiting: int
    running: int
    pages_used: int
    pages_free: int
    inflight: int
    pages_cached: int = 0              # pages holding a cached prefix (in use or evictable)
    microbatches: list = field(default_factory=list)   # (time, decode tokens, prefill tokens) since the last


@dataclass(frozen=True)
class Logprobs:
    """The last stage: for each sampled row of a request that asks, [index, token, its raw
    log-probability, [[id, log-probability] of the top ones]], in sampling order (a request's k-th
    entry is its k-th token; entries past its end are leftover rows); and in `prompt`, for the
    requests that ask for their prompt's, [index, position, token, log-probability, top] of each
    prompt token after the first, once each, in order."""
    KIND: ClassVar[str] = "logprobs"
    entries: list
    prompt: list = field(default_factory=list)


@dataclass(frozen=True)
class Error:
    KIND: ClassVar[str] = "error"
    message: str
    rank: int | None = None
    peer_lost: bool = False      # the stage fell because a neighbour died (hpipe.runtime.comm.lost_peer)


@dataclass(frozen=True)
class Notice:
    KIND: ClassVar[str] = "notice"
    text: str


@dataclass(frozen=True)
class Pulse:
    """Every stage, every PULSE_S while it runs (a batch job or a server): the window's compute
    seconds (its busy time, as the run chart counts it), tokens and micro-batches by kind, the
    memory it holds of its device's, and the window's compute intervals [what, start, end, mb,
    kind, tokens] (the latest PULSE_INTERVALS) for the live run chart. Times are the stage's
    clock; the launcher moves them onto its own as they arrive (launcher/pulses.py)."""
    KIND: ClassVar[str] = "pulse"
    rank: int
    t: float                   # wall-clock end of the window
    window_s: float
    busy_s: float
    kinds: dict                # kind -> [compute seconds, tokens, micro-batches] in the window
    held_bytes: int            # what the stage holds: resident memory on a CPU, the allocator's on a GPU
    device_bytes: int          # its device's memory (a host's RAM; a GPU's)
    kv_bytes: int
    intervals: list = field(default_factory=list)


PULSE_S = 1.0
PULSE_INTERVALS = 256


@dataclass(frozen=True)
class IntervalsReport:
    """Every stage, once, at its end: where it ran, what it held and each interval of its work."""
    KIND: ClassVar[str] = "timeline"
    rank: int
    host: str
    device: str
    units: list                # the plan's units this stage ran
    start: float               # wall clock (the stage's) when its compute loop started, and when it ended
    end: float
    load_s: float              # the model's load, before `start`
    peak_rss_bytes: int
    kv_bytes: int              # its KV pool
    intervals: list            # {what, start, end (, mb, kind, tokens)}: its computes, sends, waits (runtime.pipeline.Timeline)
    links: dict                # messages and bytes it sent per link and kind (runtime.comm.Counters)
    cuda_graphs: int           # CUDA graphs captured for its decode steps


@dataclass(frozen=True)
class Summary(SinceStart):
    KIND: ClassVar[str] = "summary"
    wall_s: float
    generated_tokens: int
    tokens_per_s: float | None
    t0_wall: float
    requests: int
    prompt_tokens: int
    options: dict               # the modes each switch resolved to on stage 0
    policy: dict
    kv_pages: int
    page_size: int
    config: dict                # the RuntimeConfig the stages ran with
    sidp: dict | None = None    # a SiDP replica's figures: steps per mode, fetches, CaS rows, the step trace


REPORTS = {cls.KIND: cls for cls in (Ready, Tokens, Result, Rejected, Stats, Logprobs, Error, Notice, Pulse,
                                     IntervalsReport, Summary)}


def send(record) -> None:
    """One report on stdout (whole lines, from any thread)."""
    emit(record.KIND, **as_dict(record))


def read_report(line: str):
    """The report on this line as its record (a dict for reports not defined here), or None for a log line."""
    msg = parse(line)
    if msg is None:
        return None
    cls = REPORTS.get(msg.pop("type", None))
    if cls is None:
        return msg
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in msg.items() if k in names})


def as_dict(record) -> dict:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
