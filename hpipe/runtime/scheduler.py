"""The scheduler: the one place that decides what every micro-batch holds.

It runs on stage 0. Each call to `next_microbatch()` returns the segments of the next micro-batch
(which prompt slices, which decode tokens) or None when nothing may start now; `on_sampled()`
takes the ids the last stage sampled for a micro-batch. It knows nothing of torch or processes,
so it can be tested alone and its policy replaced (gLLM's token throttling goes here).

The policy of this first version:
- at most `max_batch` sequences are active at once; each gets a KV-cache slot;
- prefill first: a prompt's slices (the plan's slicing) go out one per micro-batch, back to back,
  so slice i+1 enters stage 0 while slice i runs on stage 1 (HPipe's token-dimension pipeline);
- decode: sequences whose last token came back are grouped, at most ceil(decoding / stages) per
  micro-batch, so that as many micro-batches as stages are in flight and every stage works;
- at most `max_inflight` micro-batches are in the pipeline at once;
- with `lookahead` (the asynchronous runtime), a sequence's next decode step is committed while its
  previous token is still in flight, so that every stage knows (and prepares) a micro-batch before
  its data arrives; its input ids are filled in by `input_ids()` once they are back. A sequence that
  stops (EOS, a stop id) with such a step committed lets it run on a dummy id; the id sampled for it
  is dropped (its sampler state no longer matters, and its KV slot is rewritten from position 0 by
  whichever sequence takes it next, later in every stage's FIFO order).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hpipe.request import Request
from hpipe.runtime.kv import Segment, microbatch_kind


@dataclass
class MicroBatch:
    id: int
    segments: list[Segment]
    tokens: list[int] | None   # the input token ids of all segments, concatenated (None: not all back yet)

    @property
    def kind(self) -> str:
        return microbatch_kind(self.segments)


@dataclass
class SequenceState:
    request: Request
    slot: int
    slices: list[int]
    pos: int = 0                               # tokens of this sequence already sent into the pipeline
    output: list[int] = field(default_factory=list)
    in_flight: int = 0                         # committed steps whose token has not come back
    committed: int = 0                         # tokens it will have once every committed step is back
    last_mb: int = -1                          # the micro-batch of its latest step (round-robin order)
    finish_reason: str | None = None
    t_admit: float = 0.0
    t_first: float | None = None
    t_last: float | None = None

    @property
    def prefilled(self) -> bool:
        return not self.slices

    @property
    def waiting(self) -> bool:
        return self.in_flight > 0


class Scheduler:
    def __init__(self, requests: list[Request], slices_for: Callable[[int], list[int]], n_stages: int,
                 max_batch: int = 16, max_inflight: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 lookahead: bool = False):
        self.queue = list(requests)
        self.slices_for = slices_for
        self.n_stages = n_stages
        self.max_batch = max(1, max_batch)
        self.max_inflight = max_inflight or 2 * n_stages
        self.clock = clock
        self.lookahead = lookahead
        self.active: list[SequenceState] = []
        self.free_slots: list[int] = []
        self.n_slots = 0
        self.inflight: dict[int, MicroBatch] = {}
        self.next_id = 0
        self.generated = 0                     # tokens appended to outputs (leftover steps' ids not counted)
        self.t0 = clock()

    @property
    def done(self) -> bool:
        return not self.queue and not self.active and not self.inflight

    def _admit(self) -> None:
        while self.queue and len(self.active) < self.max_batch:
            req = self.queue.pop(0)
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                slot, self.n_slots = self.n_slots, self.n_slots + 1
            slices = self.slices_for(len(req.input_ids))
            assert sum(slices) == len(req.input_ids), (slices, len(req.input_ids))
            self.active.append(SequenceState(req, slot, list(slices), t_admit=self.clock()))

    def _emit(self, segments: list[Segment], tokens: list[int]) -> MicroBatch:
        mb = MicroBatch(self.next_id, segments, tokens)
        self.next_id += 1
        self.inflight[mb.id] = mb
        return mb

    def next_microbatch(self) -> MicroBatch | None:
        if len(self.inflight) >= self.max_inflight:
            return None
        self._admit()
        for st in self.active:  # prefill first, in admission order
            if st.slices:
                n = st.slices.pop(0)
                seg = Segment(st.request.index, st.slot, st.pos, n, sample=not st.slices, prefill=True)
                tokens = list(st.request.input_ids[st.pos:st.pos + n])
                st.pos += n
                if seg.sample:
                    st.in_flight, st.committed = 1, 1
                mb = self._emit([seg], tokens)
                st.last_mb = mb.id
                return mb
        decoding = [st for st in self.active if st.prefilled and st.finish_reason is None]
        ahead = 2 if self.lookahead else 1
        ready = sorted((st for st in decoding if st.in_flight < ahead and st.committed < st.request.max_new_tokens),
                       key=lambda st: st.last_mb)
        if not ready:
            return None
        cap = math.ceil(len(decoding) / self.n_stages)
        group = ready[:cap]
        segments = []
        known = all(st.in_flight == 0 for st in group)
        for st in group:
            segments.append(Segment(st.request.index, st.slot, st.pos, 1, sample=True))
            st.pos += 1
            st.in_flight += 1
            st.committed += 1
        mb = self._emit(segments, [st.output[-1] for st in group] if known else None)
        for st in group:
            st.last_mb = mb.id
        return mb

    def input_ids(self, mb: MicroBatch) -> list[int] | None:
        """The micro-batch's input ids, or None while a decode step's token is still in flight. A
        sequence that stopped in the meantime gets a dummy id (its step's output is dropped)."""
        if mb.tokens is not None:
            return mb.tokens
        by_seq = {st.request.index: st for st in self.active}
        ids = []
        for seg in mb.segments:
            st = by_seq.get(seg.seq)
            if st is None:             # finished: this step is a leftover
                ids.append(0)
                continue
            k = seg.start - len(st.request.input_ids)    # index of the generated token it feeds
            if k >= len(st.output):
                return None
            ids.append(st.output[k])
        mb.tokens = ids
        return ids

    def on_sampled(self, mb_id: int, ids: list[int]) -> list[SequenceState]:
        """Takes the ids sampled for micro-batch `mb_id` (one per sampling segment, in order) and
        returns the sequences that finished."""
        mb = self.inflight.pop(mb_id)
        sampled = [s for s in mb.segments if s.sample]
        if len(sampled) != len(ids):
            raise RuntimeError(f"micro-batch {mb_id}: {len(ids)} ids for {len(sampled)} sampling segments")
        by_seq = {st.request.index: st for st in self.active}
        now = self.clock()
        finished = []
        for seg, token in zip(sampled, ids):
            st = by_seq.get(seg.seq)
            if st is None or st.finish_reason is not None:   # a step committed after its sequence stopped
                continue
            st.output.append(token)
            self.generated += 1
            st.in_flight -= 1
            st.t_first = now if st.t_first is None else st.t_first
            st.t_last = now
            st.finish_reason = st.request.finish_reason(token, len(st.output))
            if st.finish_reason:
                finished.append(st)
        for st in finished:
            self.active.remove(st)
            self.free_slots.append(st.slot)
        return finished
