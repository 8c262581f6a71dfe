"""The scheduler: the one place that decides what every micro-batch holds (stage 0).

Each call to `next_microbatch()` returns the segments of the next micro-batch (prefill chunks of
some sequences, decode tokens of others) or None when nothing may start now; `on_sampled()` takes
the ids the last stage sampled for a micro-batch. Requests enter with `add()` (continuous batching:
the batch job adds them all at once, the server as they come), leave when they finish or with
`abort()`. It knows nothing of torch or processes, so it can be tested alone.

Memory: every sequence's KV lives in pages of one pool (`hpipe.runtime.kv.PagePool`), allocated here
as its tokens are scheduled and carried in the segments, so every stage applies the same page table.
When a decode step needs a page and none is free, the most recently admitted sequence is preempted:
it takes no new steps, and once its steps in flight are back its pages return to the pool and it is
recomputed later from its prompt and the tokens it has (vLLM's recompute preemption); its sampler
state lives on, so it goes on exactly where it stopped.

How many tokens a micro-batch takes is the policy's (`Policy`):
- "throttle" (gLLM §3.1-3.2): decode tokens #D = ceil(#RD / pipeline depth) (#RD: running decode
  sequences), so that as many balanced micro-batches as stages are in flight; prefill tokens
  #P = max(min(#WP / #T, #MaxP · (KVfree − thresh) / (1 − thresh)), #MinP) (#WP: prompt tokens
  waiting), none while KVfree < thresh;
- "sarathi" (Sarathi-Serve): a fixed token budget, every ready decode token first, then prefill.
In both, a prompt alone in the pipeline (nothing decoding, nothing else waiting) is cut where the
plan's slicing cuts it (HPipe's Algorithm 2: longer slices first, shorter later), which gives the
plan's TTFT; under load the policy decides the amounts.

With `lookahead` (the asynchronous runtime), a sequence's next decode step is committed while its
previous token is still in flight, so that every stage knows (and prepares) a micro-batch before its
data arrives; its input ids are filled in by `input_ids()` once they are back. A sequence that stops
(EOS, a stop id, an abort) with such a step committed lets it run on a dummy id; the id sampled for
it is dropped, and its pages may already belong to another sequence: harmless, because every stage
runs micro-batches in the schedule's order and a sequence writes its positions before it reads them.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hpipe.request import Request
from hpipe.runtime.kv import PAGE_SIZE, PagePool, Segment, microbatch_kind, pages_needed

__all__ = ["POLICIES", "MicroBatch", "Policy", "Scheduler", "SequenceState"]

POLICIES = ("throttle", "sarathi")


@dataclass(frozen=True)
class Policy:
    name: str = "throttle"
    iterations: int = 8          # throttle #T: spread waiting prompt tokens over this many micro-batches
    max_prefill: int = 2048      # throttle #MaxP
    min_prefill: int = 32        # throttle #MinP
    kv_thresh: float = 0.05      # throttle: no new prefill below this KV-free rate
    budget: int = 512            # sarathi: tokens per micro-batch

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"policy {self.name!r}: use {' or '.join(POLICIES)}")
        if min(self.iterations, self.max_prefill, self.min_prefill, self.budget) < 1 or \
                not 0 <= self.kv_thresh < 1 or self.min_prefill > self.max_prefill:
            raise ValueError(f"policy {self}: token counts must be >= 1 (#MinP <= #MaxP), kv_thresh in [0, 1)")

    @property
    def max_tokens(self) -> int:
        """The most prefill tokens one micro-batch can take under this policy."""
        return self.max_prefill if self.name == "throttle" else self.budget

    def prefill_tokens(self, waiting: int, kv_free: float, decode_tokens: int) -> int:
        if self.name == "sarathi":
            return max(0, self.budget - decode_tokens)
        if kv_free < self.kv_thresh:
            return 0
        by_kv = self.max_prefill * (kv_free - self.kv_thresh) / (1 - self.kv_thresh)
        return int(max(min(math.ceil(waiting / self.iterations), by_kv), self.min_prefill))


@dataclass
class MicroBatch:
    id: int
    segments: list[Segment]
    tokens: list[int] | None   # the input token ids of all segments, concatenated (None: not all back yet)
    t: float = 0.0             # when it was committed (the scheduler's clock)

    @property
    def kind(self) -> str:
        return microbatch_kind(self.segments)


@dataclass
class SequenceState:
    request: Request
    slot: int
    order: int                                 # admission order (preemption takes the latest)
    tokens: list[int]                          # what its prefill feeds: the prompt (+ its output, after a preemption)
    cuts: list[int]                            # the plan's slice ends for `tokens`, when it runs alone
    pos: int = 0                               # tokens of this sequence already sent into the pipeline
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    in_flight: int = 0                         # committed sampling steps whose token has not come back
    committed: int = 0                         # tokens it will have once every committed step is back
    last_mb: int = -1                          # the micro-batch of its latest step (round-robin order)
    preempting: bool = False                   # its pages go back once its steps in flight are back
    preemptions: int = 0
    finish_reason: str | None = None
    t_admit: float = 0.0
    t_first: float | None = None
    t_last: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.tokens)

    @property
    def prefilled(self) -> bool:
        return not self.prefilling

    @property
    def waiting(self) -> bool:
        return self.in_flight > 0


class Scheduler:
    def __init__(self, requests: list[Request], slices_for: Callable[[int], list[int]], n_stages: int,
                 max_batch: int = 16, max_inflight: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 lookahead: bool = False, policy: Policy | None = None, pages: int | None = None,
                 page_size: int = PAGE_SIZE, max_tokens: int | None = None, serving: bool = False):
        """pages: the KV pool (page 0 is scratch); None sizes it for `max_batch` of the longest
        request. max_tokens: the most tokens of one micro-batch (the stages' receive buffers).
        serving: requests keep coming (`add`) until `close()`."""
        self.slices_for = slices_for
        self.n_stages = n_stages
        self.max_batch = max(1, max_batch)
        self.max_inflight = max_inflight or 2 * n_stages
        self.clock = clock
        self.lookahead = lookahead
        self.policy = policy or Policy()
        if pages is None:
            longest = max((len(r.input_ids) + r.max_new_tokens for r in requests), default=1)
            pages = min(self.max_batch, max(1, len(requests))) * pages_needed(longest, page_size) + 1
        self.pool = PagePool(pages, page_size)
        self.max_tokens = max_tokens or (self.policy.max_tokens + self.max_batch)
        self.queue: deque[Request] = deque()
        self.active: list[SequenceState] = []
        self.free_slots = list(range(self.max_batch - 1, -1, -1))
        self.inflight: dict[int, MicroBatch] = {}
        self.next_id = 0
        self.order = itertools.count()
        self.generated = 0                     # tokens appended to outputs (leftover steps' ids not counted)
        self.preemptions = 0
        self.closed = not serving
        self.on_token: Callable | None = None  # (state, token) for every token appended to an output
        self.t0 = clock()
        for r in requests:
            self.add(r)

    # ------------------------------------------------------------------ requests in and out
    def add(self, request: Request) -> None:
        need = pages_needed(len(request.input_ids) + request.max_new_tokens, self.pool.page_size)
        if need > self.pool.usable:
            raise ValueError(f"request {request.id!r}: {len(request.input_ids)} prompt + {request.max_new_tokens} "
                             f"new tokens need {need} KV pages; the pool has {self.pool.usable}")
        self.queue.append(request)

    def abort(self, index: int) -> SequenceState | Request | None:
        """Ends a request now (a client went away): its pages return to the pool at once; steps of it
        still in flight run as leftovers. Returns its state (or the queued request), None if unknown."""
        for r in self.queue:
            if r.index == index:
                self.queue.remove(r)
                return r
        for st in self.active:
            if st.request.index == index:
                st.finish_reason = "abort"
                self._retire(st)
                return st
        return None

    def close(self) -> None:
        self.closed = True

    @property
    def done(self) -> bool:
        return self.closed and not self.queue and not self.active and not self.inflight

    def stats(self) -> dict:
        return {"waiting": len(self.queue), "running": len(self.active), "pages_used": self.pool.usable -
                len(self.pool.free), "pages_free": len(self.pool.free), "preemptions": self.preemptions,
                "inflight": len(self.inflight)}

    def _admit(self) -> None:
        while self.queue and self.free_slots:
            req = self.queue.popleft()
            tokens = list(req.input_ids)
            self.active.append(SequenceState(req, self.free_slots.pop(), next(self.order), tokens,
                                             _cuts(self.slices_for, len(tokens)), t_admit=self.clock()))

    def _retire(self, st: SequenceState) -> None:
        self.active.remove(st)
        self.pool.give_back(st.pages)
        st.pages = []
        self.free_slots.append(st.slot)

    # ------------------------------------------------------------------ pages
    def _release_pages(self, st: SequenceState) -> None:
        """Preemption, once nothing of `st` is in flight: pages back, recomputed from its tokens."""
        self.pool.give_back(st.pages)
        st.pages, st.preempting = [], False
        st.tokens = list(st.request.input_ids) + st.output
        st.cuts = _cuts(self.slices_for, len(st.tokens))
        st.pos = 0

    def _preempt_for(self, needy: SequenceState) -> None:
        victims = [st for st in self.active if st is not needy and not st.preempting and st.pages
                   and st.finish_reason is None]
        if not victims:
            return
        victim = max(victims, key=lambda st: st.order)
        victim.preempting = True
        victim.preemptions += 1
        self.preemptions += 1
        if victim.in_flight == 0:
            self._release_pages(victim)

    def _grow(self, st: SequenceState, end: int) -> bool:
        """Pages for positions [0, end) of `st`; False if the pool has not enough free now."""
        more = pages_needed(end, self.pool.page_size) - len(st.pages)
        if more <= 0:
            return True
        got = self.pool.take(more)
        if got is None:
            return False
        st.pages += got
        return True

    # ------------------------------------------------------------------ the next micro-batch
    def _emit(self, segments: list[Segment], tokens: list[int] | None) -> MicroBatch:
        mb = MicroBatch(self.next_id, segments, tokens, self.clock())
        self.next_id += 1
        self.inflight[mb.id] = mb
        return mb

    def next_microbatch(self) -> MicroBatch | None:
        if len(self.inflight) >= self.max_inflight:
            return None
        self._admit()
        decode, decode_ids = self._decode_part()
        prefill, prefill_ids = self._prefill_part(len(decode))
        segments = decode + prefill
        if not segments:
            return None
        known = decode_ids is not None
        mb = self._emit(segments, decode_ids + prefill_ids if known else None)
        by_seq = {st.request.index: st for st in self.active}
        for seg in segments:
            by_seq[seg.seq].last_mb = mb.id
        return mb

    def _decode_part(self) -> tuple[list[Segment], list[int] | None]:
        decoding = [st for st in self.active if st.prefilled and st.finish_reason is None and not st.preempting]
        ahead = 2 if self.lookahead else 1
        ready = sorted((st for st in decoding if st.in_flight < ahead and st.committed < st.request.max_new_tokens),
                       key=lambda st: st.last_mb)
        if self.policy.name == "throttle":
            cap = math.ceil(len(decoding) / self.n_stages)
        else:
            cap = self.policy.budget
        segments, ids, known = [], [], True
        for st in ready[:min(cap, self.max_tokens)]:
            if st.preempting or st.prefilling:    # preempted by an earlier row of this loop
                continue
            if not self._grow(st, st.pos + 1):
                self._preempt_for(st)              # a victim with nothing in flight frees its pages now
                if not self._grow(st, st.pos + 1):
                    break
            segments.append(Segment(st.request.index, st.slot, st.pos, 1, sample=True, pages=tuple(st.pages)))
            known = known and st.in_flight == 0
            if known:
                ids.append(st.output[-1])
            st.pos += 1
            st.in_flight += 1
            st.committed += 1
        return segments, ids if known else None

    def _prefill_part(self, decode_tokens: int) -> tuple[list[Segment], list[int]]:
        prefilling = [st for st in self.active if st.prefilling and not st.preempting and st.finish_reason is None]
        if not prefilling:
            return [], []
        decoding = any(st.prefilled and st.finish_reason is None for st in self.active)
        alone = not decoding and len(prefilling) == 1 and not self.queue
        if alone:   # the plan's latency-optimal slicing for this prompt's exact length
            st = prefilling[0]
            budget = st.cuts[bisect.bisect_right(st.cuts, st.pos)] - st.pos
        else:
            waiting = sum(len(st.tokens) - st.pos for st in prefilling) + sum(len(r.input_ids) for r in self.queue)
            budget = self.policy.prefill_tokens(waiting, self.pool.free_rate, decode_tokens)
            if budget <= 0 and not decode_tokens and not self.inflight:   # never idle with prompts waiting
                budget = self.policy.min_prefill
        budget = min(budget, self.max_tokens - decode_tokens)
        segments, ids = [], []
        size = self.pool.page_size
        # vLLM's watermark: a page kept free for each running decoder's next step, so that a prompt
        # does not take the pages decoders need and then lose them (and its work) to a preemption
        reserve = sum(1 for st in self.active if st.prefilled and st.finish_reason is None and not st.preempting)
        waiting_new, leader = False, True
        for st in prefilling:
            if budget <= 0:
                break
            free = len(self.pool.free) - reserve
            if not st.pages:     # a prompt starts only when all of it fits beside the running decoders, in order
                if waiting_new or pages_needed(len(st.tokens), size) > free:
                    waiting_new = True
                    continue
            if leader and st.pages:     # the oldest prompt under way always gets on: the reserve, then preemption
                free = len(self.pool.free)
                if (len(st.pages) + free) * size <= st.pos:
                    self._preempt_for(st)
                    free = len(self.pool.free)
            n = min(budget, len(st.tokens) - st.pos, (len(st.pages) + max(0, free)) * size - st.pos)
            if n <= 0 or not self._grow(st, st.pos + n):
                break
            leader = False
            sample = st.pos + n == len(st.tokens)
            segments.append(Segment(st.request.index, st.slot, st.pos, n, sample=sample, prefill=True,
                                    pages=tuple(st.pages)))
            ids += st.tokens[st.pos:st.pos + n]
            st.pos += n
            budget -= n
            if sample:
                st.in_flight += 1
                st.committed = len(st.output) + 1
        return segments, ids

    # ------------------------------------------------------------------ ids in
    def input_ids(self, mb: MicroBatch) -> list[int] | None:
        """The micro-batch's input ids, or None while a decode step's token is still in flight. A
        sequence that stopped in the meantime gets a dummy id (its step's output is dropped)."""
        if mb.tokens is not None:
            return mb.tokens
        by_seq = {st.request.index: st for st in self.active}
        ids = []
        for seg in mb.segments:
            st = by_seq.get(seg.seq)
            if st is None or st.finish_reason is not None:     # finished: this step is a leftover
                ids += [0] * seg.length
                continue
            if seg.prefill:
                ids += st.tokens[seg.start:seg.end]
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
            if self.on_token is not None:
                self.on_token(st, token)
            st.finish_reason = st.request.finish_reason(token, len(st.output))
            if st.finish_reason:
                finished.append(st)
            elif st.preempting and st.in_flight == 0:
                self._release_pages(st)
        for st in finished:
            self._retire(st)
        return finished


def _cuts(slices_for: Callable[[int], list[int]], n: int) -> list[int]:
    slices = slices_for(n)
    assert sum(slices) == n, (slices, n)
    return list(itertools.accumulate(slices))
