"""The schedule: one message per micro-batch, decided by stage 0's scheduler and read the same way by
every stage (vLLM v1's SchedulerOutput, for a pipeline).

A `Schedule` holds
- its micro-batch's id and segments (prefill chunks and decode tokens, with their KV pages);
- the requests admitted since the last schedule: the last stage's sampler learns a request's
  parameters, seed and prompt before the first row of it it samples;
- the requests released since the last schedule, each with the number of tokens it generated:
  stage 0 alone decides that a sequence has ended (EOS, a stop id, its length, an abort); a release
  goes out in the first schedule committed after that decision, so it follows every schedule that
  can still hold a leftover row of it, and since every stage reads schedules in order, the last
  stage frees the sequence's sampler state (and trims its logits) exactly when nothing of it can
  come any more;
- or the stop (`stop`): nothing follows.

Encoding, in one place (`encode` / `decode`): a header of HEADER_LEN integers, a body of integers
(the segments' fields, the pages they add, the released pairs, the admitted indices) and, when the
receivers do not hold the job's requests (serving), a payload of the admitted requests as JSON.
The transport (`hpipe.runtime.comm`) sends header and body as one fixed-size message on the control
plane (SAT) or as two messages on every hop (without SAT); the payload goes from stage 0 to the
last stage alone, whose sampler is the only reader of a request's parameters, grammar and prompt
(a middle stage keeps the admitted indices and passes the payload's length on).

Pure Python (no torch).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

from hpipe.request import Request
from hpipe.runtime.pages import PageTable, Segment, added_pages, microbatch_kind, pages_needed

__all__ = ["FRESH_PER_SCHEDULE", "HEADER_LEN", "SEGMENT_FIELDS", "Schedule", "body_capacity", "decode", "encode"]

HEADER_LEN = 9
SEGMENT_FIELDS = 11
FRESH_PER_SCHEDULE = 2      # segments that carry a whole page table (after a cached prefix) per schedule
OP_WORK, OP_STOP = 1, 2


@dataclass
class Schedule:
    id: int
    segments: list[Segment]
    admitted: list[Request] = field(default_factory=list)
    released: list[tuple[int, int]] = field(default_factory=list)   # (request index, tokens it generated)
    stop: bool = False
    passed: tuple[int, ...] = ()      # a stage without the payload: the admitted indices, passed on
    passed_bytes: int = 0             # ... and the length of the payload that goes round it
    tokens: list[int] | None = None   # stage 0 only, not sent: the input ids (None while a decode token is out)
    prompt_ids: list[int] = field(default_factory=list)   # stage 0 only: its prefill segments' ids, in order
    t: float = 0.0                    # stage 0 only: when it was committed
    underfilled: bool = False         # fewer micro-batches ran in the pipeline than it has stages when this
                                      # was committed: every stage waits between its forwards

    # its segments never change once decided: what follows from them is computed once
    @cached_property
    def kind(self) -> str:
        return microbatch_kind(self.segments)

    @cached_property
    def n_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    @cached_property
    def sampled(self) -> list[int]:
        """The request index of each row that is sampled, in order (a segment with a draft has
        one row per proposed token more)."""
        return [s.seq for s in self.segments for _ in range(s.sampled_rows)]

    @cached_property
    def expected(self) -> list[int]:
        """For each sampled row, the proposed token its sample must equal for the next row to be
        sampled too, or -1 (the segment's last row)."""
        return [t for s in self.segments if s.sample for t in (*s.draft, -1)]

    @cached_property
    def scored_rows(self) -> int:
        """Rows of logits beyond the sampled ones: every other row of its scored segments."""
        return sum(s.length - s.sample for s in self.segments if s.scored)

    @classmethod
    def end(cls) -> Schedule:
        """The stop: nothing follows it."""
        return cls(-1, [], stop=True)


def body_capacity(max_segments: int, max_tokens: int, page_size: int, max_len: int = 0) -> int:
    """The most body integers one schedule takes: its segments, the pages they add (each segment at
    most ceil(length / size) + 1; a fresh one, at most FRESH_PER_SCHEDULE of them, every page of a
    sequence of max_len tokens), their proposed tokens (at most one per token), and as many released
    pairs and admitted indices as segments."""
    max_pages = max_tokens // page_size + 2 * max_segments + FRESH_PER_SCHEDULE * pages_needed(max_len, page_size)
    return SEGMENT_FIELDS * max_segments + max_pages + max_tokens + 3 * max_segments


def encode(schedule: Schedule, page_size: int, with_requests: bool) -> tuple[list[int], list[int], bytes]:
    """(header, body, payload). The payload holds the admitted requests when `with_requests`."""
    if schedule.stop:
        op, mb_id = OP_STOP, -1
    else:
        op, mb_id = OP_WORK, schedule.id
    added = [added_pages(s, page_size) for s in schedule.segments]
    body = [v for s, a in zip(schedule.segments, added)
            for v in (s.seq, s.slot, s.start, s.length, int(s.sample), int(s.prefill), int(s.fresh), int(s.scored),
                      s.prompt, len(a), len(s.draft))]
    body += [p for a in added for p in a]
    body += [t for s in schedule.segments for t in s.draft]
    body += [v for pair in schedule.released for v in pair]
    if schedule.passed:            # a middle stage: the indices it read, the payload's length (it never had it)
        body += schedule.passed
        payload, n_admitted, n_payload = b"", len(schedule.passed), schedule.passed_bytes
    else:
        body += [r.index for r in schedule.admitted]
        payload = json.dumps([r.to_json() for r in schedule.admitted]).encode() \
            if with_requests and schedule.admitted else b""
        n_admitted, n_payload = len(schedule.admitted), len(payload)
    n_pages = sum(len(a) for a in added)
    header = [op, mb_id, len(schedule.segments), n_pages, len(schedule.released), n_admitted, n_payload, len(body),
              int(schedule.underfilled)]
    return header, body, payload


def payload_len(header: list[int]) -> int:
    return header[6]


def body_len(header: list[int]) -> int:
    return header[7]


def decode(header: list[int], body: list[int], payload: bytes, table: PageTable,
           requests: Callable[[int], Request] | None) -> Schedule:
    """The inverse of `encode`: each segment's whole page list rebuilt by this stage's page table
    (in the schedule's order); admitted requests from the payload (the last stage, serving), by
    index from `requests` (a batch job's stages all read the job's requests file), or neither (a
    middle stage while serving: their indices and the payload's length, passed on)."""
    op, mb_id, n, n_pages, n_released, n_admitted = header[:6]
    segments, at = [], SEGMENT_FIELDS * n
    drafts = []
    for i in range(n):
        seq, slot, start, length, sample, prefill, fresh, scored, prompt, k, d = \
            body[SEGMENT_FIELDS * i:SEGMENT_FIELDS * (i + 1)]
        seg = Segment(seq, slot, start, length, bool(sample), bool(prefill), fresh=bool(fresh), scored=bool(scored),
                      prompt=prompt)
        segments.append(table.resolve(seg, body[at:at + k]) if k or start else seg)
        drafts.append(d)
        at += k
    for i, d in enumerate(drafts):
        if d:
            segments[i] = replace(segments[i], draft=tuple(body[at:at + d]))
            at += d
    released = [(body[at + 2 * i], body[at + 2 * i + 1]) for i in range(n_released)]
    at += 2 * n_released
    indices = body[at:at + n_admitted]
    stop, underfilled = op == OP_STOP, bool(header[8])
    if payload:
        return Schedule(mb_id, segments, [Request.from_json(d) for d in json.loads(payload.decode())], released,
                        stop=stop, underfilled=underfilled)
    if requests is not None:
        return Schedule(mb_id, segments, [requests(i) for i in indices], released, stop=stop, underfilled=underfilled)
    return Schedule(mb_id, segments, [], released, stop=stop, passed=tuple(indices),
                    passed_bytes=payload_len(header), underfilled=underfilled)
