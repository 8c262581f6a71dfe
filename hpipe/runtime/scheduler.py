"""The scheduler: the one place that decides what every micro-batch holds (stage 0).

Each call to `next_microbatch()` returns the `Schedule` of the next micro-batch (prefill chunks of
some sequences, decode tokens of others, the requests admitted and released since the last one) or
None when nothing may start now; `on_sampled()` takes the ids the last stage sampled for a
micro-batch and is where a sequence's end is decided. Requests enter with `add()` (continuous
batching: the batch job adds them all at once, the server as they come), leave when they finish or
with `abort()`; `stop()` is the last schedule. It knows nothing of torch or processes (it imports
none), so it can be tested alone. A sequence's life is `hpipe.runtime.sequence`.

Memory: every sequence's KV lives in pages of one pool (`hpipe.runtime.pages.PagePool`), allocated here
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
In both, a prompt alone in the pipeline (nothing decoding, nothing else that could start now) is cut
where the plan's slicing cuts it (HPipe's Algorithm 2: longer slices first, shorter later), which
gives the plan's TTFT; under load the policy decides the amounts.

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
from dataclasses import dataclass

from hpipe.config import DEFAULTS, DEVICE_DEFAULTS, POLICIES, RuntimeConfig
from hpipe.request import Request
from hpipe.runtime.pages import PagePool, Segment, page_keys, pages_needed
from hpipe.runtime.schedule import FRESH_PER_SCHEDULE, Schedule
from hpipe.runtime.sequence import Sequence, Status
from hpipe.runtime.speculative import SPEC_ROWS, SPEC_SEQUENCES, Proposer, next_k, through_end

__all__ = ["Policy", "Scheduler"]



@dataclass(frozen=True)
class Policy:
    name: str = DEFAULTS.policy
    iterations: int = DEFAULTS.iterations                       # throttle #T
    max_prefill: int = DEVICE_DEFAULTS["gpu"]["max_prefill"]    # throttle #MaxP
    min_prefill: int = DEVICE_DEFAULTS["gpu"]["min_prefill"]    # throttle #MinP
    kv_thresh: float = DEFAULTS.kv_thresh                       # throttle: no new prefill below this KV-free rate
    budget: int = DEVICE_DEFAULTS["gpu"]["budget"]              # sarathi: tokens per micro-batch

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"policy {self.name!r}: use {' or '.join(POLICIES)}")
        if min(self.iterations, self.max_prefill, self.min_prefill, self.budget) < 1 or \
                not 0 <= self.kv_thresh < 1 or self.min_prefill > self.max_prefill:
            raise ValueError(f"policy {self}: token counts must be >= 1 (#MinP <= #MaxP), kv_thresh in [0, 1)")

    @classmethod
    def resolve(cls, config: RuntimeConfig, devices: list[str]) -> Policy:
        """The config's policy for these devices: its 0s ("the devices' default") resolved once."""
        table = DEVICE_DEFAULTS["cpu" if any(d == "cpu" for d in devices) else "gpu"]
        return cls(config.policy, iterations=config.iterations,
                   max_prefill=config.max_prefill or table["max_prefill"],
                   min_prefill=config.min_prefill or table["min_prefill"],
                   kv_thresh=config.kv_thresh, budget=config.budget or table["budget"])

    @property
    def max_tokens(self) -> int:
        """The most prefill tokens one micro-batch can take under this policy."""
        return self.max_prefill if self.name == "throttle" else self.budget

    def decode_tokens(self, decoding: int, n_stages: int) -> int:
        """#D: throttle spreads the running decoders over the stages; sarathi takes them all (up to its budget)."""
        return math.ceil(decoding / n_stages) if self.name == "throttle" else self.budget

    def prefill_tokens(self, waiting: int, kv_free: float, decode_tokens: int) -> int:
        if self.name == "sarathi":
            return max(0, self.budget - decode_tokens)
        if kv_free < self.kv_thresh:
            return 0
        by_kv = self.max_prefill * (kv_free - self.kv_thresh) / (1 - self.kv_thresh)
        return int(max(min(math.ceil(waiting / self.iterations), by_kv), self.min_prefill))


class Scheduler:
    def __init__(self, requests: list[Request], slices_for: Callable[..., list[int]], n_stages: int,
                 max_batch: int = DEFAULTS.max_batch, max_inflight: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, lookahead: bool = False,
                 policy: Policy | None = None, pages: int | None = None, page_size: int = DEFAULTS.page_size,
                 max_tokens: int | None = None, serving: bool = False, prefix_caching: str = DEFAULTS.prefix_caching,
                 proposer: Proposer | None = None, grid: int = 0, long_prompt: int = 0):
        """pages: the KV pool (page 0 is scratch); None sizes it for `max_batch` of the longest
        request. max_tokens: the most tokens of one micro-batch (the stages' receive buffers).
        serving: requests keep coming (`add`) until `close()`. prefix_caching "on": a new sequence
        starts after the longest prefix of it whose pages are cached (`hpipe.runtime.pages`).
        proposer: speculative decoding (`hpipe.runtime.speculative`): a decode step of a sequence
        whose request allows it carries the tokens it proposes; such a step is committed only once
        its previous token is back. grid (`--deterministic on`, `hpipe.runtime.invariant`): a prompt is
        cut only on multiples of `grid` tokens (and at its end), a prefix hit is whole grid pieces of
        its prompt, and the cache keeps the prefixes of prompts of `long_prompt` tokens or more apart
        from the others' (their quantized linears take another path)."""
        self.slices_for = slices_for
        self.grid, self.long_prompt = grid, long_prompt
        self.n_stages = n_stages
        self.max_batch = max(1, max_batch)
        self.max_inflight = max_inflight or 2 * n_stages
        self.clock = clock
        self.lookahead = lookahead
        self.policy = policy or Policy()
        self.proposer = proposer
        self.proposed = self.accepted = 0      # speculative tokens proposed, and of them accepted
        if pages is None:
            longest = max((len(r.input_ids) + r.max_new_tokens for r in requests), default=1)
            pages = min(self.max_batch, max(1, len(requests))) * pages_needed(longest, page_size) + 1
        self.pool = PagePool(pages, page_size, caching=prefix_caching == "on")
        self.max_tokens = max_tokens or (self.policy.max_tokens + self.max_batch)
        self.queue: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.free_slots = list(range(self.max_batch - 1, -1, -1))
        self.inflight: dict[int, Schedule] = {}
        self.admitted: list[Request] = []          # since the last schedule (the sampler learns them from it)
        self.released: list[tuple[int, int]] = []  # ended since the last schedule: (index, tokens generated)
        self.next_id = 0
        self.order = itertools.count()
        self.generated = 0                     # tokens appended to outputs (leftover steps' ids not counted)
        self.preemptions = 0
        self.closed = not serving
        self.on_token: Callable | None = None  # (sequence, token) for every token appended to an output
        self.t0 = clock()
        for r in requests:
            self.add(r)

    # ------------------------------------------------------------------ requests in and out
    def add(self, request: Request) -> None:
        need = pages_needed(len(request.input_ids) + request.max_new_tokens, self.pool.page_size)
        if need > self.pool.usable:
            raise ValueError(f"request {request.id!r}: {len(request.input_ids)} prompt + {request.max_new_tokens} "
                             f"new tokens need {need} KV pages; the pool has {self.pool.usable}")
        self.queue.append(Sequence(request, self.clock(), output=list(request.output_ids)))

    def abort(self, index: int) -> Sequence | None:
        """Ends a request now (a client went away): its pages return to the pool at once; steps of it
        still in flight run as leftovers. Returns its sequence, None if unknown (ended already)."""
        for seq in self.queue:
            if seq.index == index:
                self.queue.remove(seq)
                seq.finish("abort")
                return seq
        for seq in self.active:
            if seq.index == index:
                seq.finish("abort")
                self._retire(seq)
                return seq
        return None

    def close(self) -> None:
        self.closed = True

    @property
    def done(self) -> bool:
        return self.closed and not self.queue and not self.active and not self.inflight

    @property
    def busy(self) -> bool:
        """Requests waiting, running or in flight: a micro-batch is coming."""
        return bool(self.queue or self.active or self.inflight)

    def since_start(self) -> dict:
        """The counters since the start (`protocol.SinceStart`'s fields)."""
        return {"preemptions": self.preemptions, "prefix_hit_tokens": self.pool.hit_tokens,
                "prefix_query_tokens": self.pool.asked_tokens, "spec_proposed_tokens": self.proposed,
                "spec_accepted_tokens": self.accepted}

    def stats(self) -> dict:
        pool = self.pool
        return {"waiting": len(self.queue), "running": len(self.active), "pages_used": pool.usable - pool.available,
                "pages_free": pool.available, "pages_cached": pool.cached, "inflight": len(self.inflight),
                **self.since_start()}

    def _admit(self) -> None:
        while self.queue and self.free_slots:
            seq = self.queue.popleft()
            seq.slot, seq.order, seq.status = self.free_slots.pop(), next(self.order), Status.PREFILLING
            self._start_prefill(seq, seq.known_tokens)     # a resumed request: its output too
            self.active.append(seq)
            self.admitted.append(seq.request)

    def _start_prefill(self, seq: Sequence, tokens: list[int]) -> None:
        """Its tokens are prefilled from the first (the prefix cache is asked when it starts)."""
        seq.tokens, seq.pages = tokens, []
        seq.pos = seq.cached = seq.fed = 0
        seq.fresh = False
        seq.cuts = self._on_grid(_cuts(self.slices_for, len(tokens)), 0, len(tokens))

    def _on_grid(self, cuts: list[int], start: int, end: int) -> list[int]:
        """Deterministic: the cuts moved down onto the grid (the last stays at `end`)."""
        if not self.grid:
            return cuts
        on = {c // self.grid * self.grid for c in cuts[:-1]}
        return sorted({c for c in on if start < c < end} | {end})

    def _keys(self, seq: Sequence, tokens, pages: int) -> list[bytes]:
        """Its first `pages` pages' prefix-cache keys; deterministic, chained from the quantized
        linears' path its prompt takes (a prefix computed on the other path has other bits)."""
        long = self.grid and self.long_prompt and len(seq.request.input_ids) >= self.long_prompt
        return page_keys(seq.keys, tokens, self.pool.page_size, pages, salt=b"long" if long else b"")

    def _cached_head(self, seq: Sequence) -> list[int]:
        """The pages of the longest cached prefix of its tokens, never all of them (the last
        token's logits are sampled); deterministic, whole grid pieces of its prompt."""
        if not self.pool.caching or seq.request.params.prompt_logprobs is not None:
            return []          # its prompt's log-probabilities need every position's logits
        size = self.pool.page_size
        head = self.pool.cached_prefix(self._keys(seq, seq.tokens, (len(seq.tokens) - 1) // size))
        if self.grid:
            head = head[:len(head) * size // self.grid * self.grid // size]
        return head

    def _start_after(self, seq: Sequence, head: list[int]) -> None:
        """Its prefill starts past its cached head, the rest sliced as the plan slices it."""
        self.pool.pin(head, len(seq.tokens) - 1)
        seq.pages = list(head)
        seq.pos = seq.cached = seq.fed = len(head) * self.pool.page_size
        seq.fresh = seq.cached > 0
        seq.cuts = self._on_grid([seq.cached + c for c in _cuts(self.slices_for, len(seq.tokens) - seq.cached,
                                                                seq.cached)], seq.cached, len(seq.tokens))

    def _register(self, seq: Sequence) -> None:
        """Its full pages whose positions hold their tokens' KV go to the prefix cache."""
        if self.pool.caching:
            n = min(seq.fed // self.pool.page_size, len(seq.pages))
            if self.grid:      # deterministic: generated tokens' KV is not a prompt's (one row each, the kernel)
                n = min(n, len(seq.request.input_ids) // self.pool.page_size)
            self.pool.register(seq.pages, self._keys(seq, seq.known_tokens, n)[:n])

    def _retire(self, seq: Sequence) -> None:
        """A finished sequence leaves: its pages and slot now, its sampler state with the next schedule
        (or never, if no schedule told the sampler of it yet)."""
        self.active.remove(seq)
        if self.proposer is not None:
            self.proposer.forget(seq.index)
        self._register(seq)
        self.pool.give_back(seq.pages)
        seq.pages = []
        self.free_slots.append(seq.slot)
        if seq.request in self.admitted:
            self.admitted.remove(seq.request)
        else:
            self.released.append((seq.index, len(seq.output)))

    # ------------------------------------------------------------------ pages
    def _release_pages(self, seq: Sequence) -> None:
        """Preemption, once nothing of `seq` is in flight: pages back, recomputed from its tokens
        (from past the part of them still cached)."""
        self._register(seq)
        self.pool.give_back(seq.pages)
        seq.status = Status.PREFILLING
        self._start_prefill(seq, seq.known_tokens)

    def _preempt_for(self, needy: Sequence) -> None:
        victims = [s for s in self.active if s is not needy and s.status in (Status.PREFILLING, Status.DECODING)
                   and s.pages]
        if not victims:
            return
        victim = max(victims, key=lambda s: s.order)
        victim.status = Status.PREEMPTED
        victim.preemptions += 1
        self.preemptions += 1
        if victim.in_flight == 0:
            self._release_pages(victim)

    def _grow(self, seq: Sequence, end: int) -> bool:
        """Pages for positions [0, end) of `seq`; False if the pool has not enough free now."""
        more = pages_needed(end, self.pool.page_size) - len(seq.pages)
        if more <= 0:
            return True
        got = self.pool.take(more)
        if got is None:
            return False
        seq.pages += got
        return True

    # ------------------------------------------------------------------ the next micro-batch
    def _emit(self, segments: list[Segment], tokens: list[int] | None, prompt_ids: list[int]) -> Schedule:
        # at most max_batch of each per schedule (the schedule's capacity); the rest go with the next
        cap = self.max_batch
        admitted, self.admitted = self.admitted[:cap], self.admitted[cap:]
        released, self.released = self.released[:cap], self.released[cap:]
        schedule = Schedule(self.next_id, segments, admitted, released, tokens=tokens, prompt_ids=prompt_ids,
                            t=self.clock())
        self.next_id += 1
        self.inflight[schedule.id] = schedule
        return schedule

    def stop(self) -> Schedule:
        """The last schedule (once `done`). The releases still owed are not sent: every stage stops."""
        return Schedule.end()

    def next_microbatch(self) -> Schedule | None:
        if len(self.inflight) >= self.max_inflight:
            return None
        self._admit()
        decode, decode_ids = self._decode_part()
        prefill, prefill_ids = self._prefill_part(sum(s.length for s in decode))
        segments = decode + prefill
        if not segments:
            return None
        known = decode_ids is not None
        schedule = self._emit(segments, decode_ids + prefill_ids if known else None, prefill_ids)
        by_index = {s.index: s for s in self.active}
        for seg in segments:
            by_index[seg.seq].last_mb = schedule.id
            if known:
                by_index[seg.seq].fed = seg.end - len(seg.draft)
        return schedule

    def _speculates(self, seq: Sequence) -> bool:
        return self.proposer is not None and seq.request.params.speculative

    def _decode_part(self) -> tuple[list[Segment], list[int] | None]:
        decoding = [s for s in self.active if s.decoding]
        ahead = 2 if self.lookahead else 1
        # a step goes ahead of its sequence's previous one unless that one carries proposals: how many
        # of them are accepted decides where the next step starts
        ready = sorted((s for s in decoding if s.in_flight < ahead and not s.drafting
                        and s.committed < s.request.max_new_tokens), key=lambda s: s.last_mb)
        take = min(self.policy.decode_tokens(len(decoding), self.n_stages), self.max_tokens)
        if min(take, len(ready)) <= SPEC_SEQUENCES:
            # a step that may carry proposals waits for its sequence's previous token: they follow from
            # it. Not in a micro-batch of more (they carry none): waiting there cost batch 8 on one stage
            # 16 % of its tokens a second with --speculative, the lookahead lost (bench/speculative.py)
            ready = [s for s in ready if not (self._speculates(s) and s.in_flight)]
        ready = ready[:take]
        drafts = self._proposals(ready, len(decoding))
        segments, ids, known = [], [], True
        for seq, draft in zip(ready, drafts):
            if not seq.decoding:                   # preempted by an earlier row of this loop
                continue
            if not self._grow(seq, seq.pos + 1 + len(draft)):
                self._preempt_for(seq)             # a victim with nothing in flight frees its pages now
                if not self._grow(seq, seq.pos + 1 + len(draft)):
                    break
            segments.append(Segment(seq.index, seq.slot, seq.pos, 1 + len(draft), sample=True, pages=tuple(seq.pages),
                                    draft=tuple(draft)))
            known = known and seq.in_flight == 0
            if known:
                ids += [seq.output[-1], *draft]
            seq.pos += 1 + len(draft)
            seq.in_flight += 1
            seq.committed += 1
            seq.drafting = bool(draft)
        return segments, ids if known else None

    def _proposals(self, ready: list[Sequence], decoding: int) -> list[list[int]]:
        """The proposed tokens of each ready sequence's next step (none where it does not speculate):
        at most its adaptive k, the tokens it may still generate after the one the step samples, none
        past one that would end it (`through_end`),
        and this micro-batch's share of a round's spare rows: every decoding sequence's step once
        takes at most SPEC_ROWS rows over all the micro-batches of the round (on a pipeline a round
        is several micro-batches; each keeps a row for every step); none in a micro-batch of more
        than SPEC_SEQUENCES sequences."""
        if len(ready) > SPEC_SEQUENCES:
            return [[] for _ in ready]
        spare = max(0, SPEC_ROWS - decoding) * len(ready) // max(1, decoding)
        room = min(spare, self.max_tokens - len(ready))
        wants, where = [], []
        for i, seq in enumerate(ready):
            if not self._speculates(seq):
                continue
            seq.spec_k = seq.spec_k or self.proposer.k
            n = min(seq.spec_k, room, seq.request.max_new_tokens - seq.committed - 1)
            if n > 0:
                wants.append((seq, n))
                where.append(i)
                room -= n
        drafts: list[list[int]] = [[] for _ in ready]
        for i, draft in zip(where, self.proposer.propose(wants) if wants else []):
            drafts[i] = through_end(draft, ready[i].request.ends)
        return drafts

    def _settle(self, seq: Sequence, seg: Segment, emitted: list[int]) -> None:
        """A speculative step is back with the `emitted` tokens: its proposals up to the first
        mismatch were accepted (all of them where the sequence stopped on one, at its EOS: no token
        follows it); the positions past them hold rejected tokens' KV, so the sequence goes on
        from the first of those (they are written again before they are read) and the pages wholly
        past it return to the pool."""
        accepted = next((i for i, (t, d) in enumerate(zip(emitted, seg.draft)) if t != d),
                        min(len(emitted), len(seg.draft)))
        self.proposed += len(seg.draft)
        self.accepted += accepted
        seq.proposed += len(seg.draft)
        seq.accepted += accepted
        seq.spec_k = next_k(seq.spec_k, len(seg.draft), accepted, self.proposer.k)
        seq.drafting = False
        seq.pos = seq.fed = seg.start + len(emitted)
        keep = pages_needed(seq.pos, self.pool.page_size)
        if seq.status is not Status.PREEMPTED and len(seq.pages) > keep:
            self.pool.give_back(seq.pages[keep:])
            seq.pages = seq.pages[:keep]

    def _prefill_part(self, decode_tokens: int) -> tuple[list[Segment], list[int]]:
        prefilling = [s for s in self.active if s.prefilling]
        if not prefilling:
            return [], []
        decoders = sum(1 for s in self.active if s.decoding)
        budget, alone = self._prefill_budget(prefilling, decoders, decode_tokens)
        hard = self.max_tokens - decode_tokens      # the stages' receive buffers: never more
        segments, ids = [], []
        size = self.pool.page_size
        # vLLM's watermark: a page kept free for each running decoder's next step, so that a prompt
        # does not take the pages decoders need and then lose them (and its work) to a preemption
        reserve = decoders
        waiting_new, leader = False, True
        fresh = 0
        for seq in prefilling:
            if budget <= 0:
                break
            free = self.pool.available - reserve
            if not seq.started:   # a prompt starts only when all of it fits beside the running decoders, in order
                head = [] if seq.pages else self._cached_head(seq)      # pages: its head, taken already
                idle = sum(1 for p in head if p in self.pool.lru)       # taking them makes them not free
                if waiting_new or pages_needed(len(seq.tokens), size) - len(head or seq.pages) > free - idle or \
                        ((head or seq.fresh) and fresh == FRESH_PER_SCHEDULE):
                    waiting_new = True
                    continue
                if head:
                    self._start_after(seq, head)
                    free = self.pool.available - reserve
            if alone:
                budget = min(seq.cuts[bisect.bisect_right(seq.cuts, seq.pos)] - seq.pos,
                             self.max_tokens - decode_tokens)
            if leader and seq.started:   # the oldest prompt under way always gets on: the reserve, then preemption
                free = self.pool.available
                if (len(seq.pages) + free) * size <= seq.pos:
                    self._preempt_for(seq)
                    free = self.pool.available
            room = (len(seq.pages) + max(0, free)) * size - seq.pos
            n = self._piece_on_grid(seq, min(budget, len(seq.tokens) - seq.pos, room), min(room, hard))
            if n <= 0 or not self._grow(seq, seq.pos + n):
                break
            leader = False
            hard -= n
            budget -= n
            fresh += seq.fresh
            segments.append(self._feed(seq, n))
            ids += seq.tokens[seq.pos - n:seq.pos]
        return segments, ids

    def _prefill_budget(self, prefilling: list[Sequence], decoders: int, decode_tokens: int) -> tuple[int, bool]:
        """The prompt tokens this micro-batch may carry, and whether its one prompt is alone: nothing
        decodes and nothing else can start now (requests may wait for a slot, as with --max-batch 1:
        they do not share this prompt's micro-batches, so it is sliced as when it came by itself, and
        a job gives the tokens a server gives one request at a time)."""
        alone = not decoders and len(prefilling) == 1 and not (self.queue and self.free_slots) \
            and not any(s.status is Status.PREEMPTED and s.prefilled for s in self.active)
        if alone:   # the plan's latency-optimal slicing for this prompt's exact length (set once it starts)
            budget = 1
        else:
            waiting = sum(len(s.tokens) - s.pos for s in prefilling) + \
                sum(len(s.known_tokens) for s in self.queue)
            budget = self.policy.prefill_tokens(waiting, self.pool.free_rate, decode_tokens)
            if budget <= 0 and not decode_tokens and not self.inflight:   # never idle with prompts waiting
                budget = self.policy.min_prefill
        return min(budget, self.max_tokens - decode_tokens), alone

    def _piece_on_grid(self, seq: Sequence, n: int, most: int) -> int:
        """--deterministic on: a prompt piece of n tokens ends on the grid (its last piece excepted),
        rounded down, or up to the next grid line where down leaves nothing (0 if that is over `most`)."""
        if not (self.grid and 0 < n and seq.pos + n < min(len(seq.tokens), len(seq.request.input_ids))):
            return n
        end = (seq.pos + n) // self.grid * self.grid
        n = (end if end > seq.pos else min((seq.pos // self.grid + 1) * self.grid, len(seq.tokens))) - seq.pos
        return n if n <= most else 0

    def _feed(self, seq: Sequence, n: int) -> Segment:
        """The sequence's next n prompt tokens into this micro-batch (its first token sampled after the last)."""
        sample = seq.pos + n == len(seq.tokens)
        segment = Segment(seq.index, seq.slot, seq.pos, n, sample=sample, prefill=True, pages=tuple(seq.pages),
                          fresh=seq.fresh, scored=seq.scoring, prompt=len(seq.request.input_ids))
        seq.fresh = False
        seq.pos += n
        seq.fed = seq.pos
        self._register(seq)
        if sample:
            seq.status = Status.DECODING
            seq.in_flight += 1
            seq.committed = len(seq.output) + 1
        return segment

    # ------------------------------------------------------------------ ids in
    def running(self) -> int:
        """The micro-batches in flight whose inputs are all known: in the pipeline, or entering it
        (the others wait for a token that is still out)."""
        return sum(self.input_ids(s) is not None for s in self.inflight.values())

    def input_ids(self, schedule: Schedule) -> list[int] | None:
        """The micro-batch's input ids, or None while a decode step's token is still in flight. A
        decode step of a sequence that stopped in the meantime gets a dummy id (its output is
        dropped); a prefill segment always gets its own tokens, even if its sequence ended since: its
        pages went to the prefix cache when it was scheduled."""
        if schedule.tokens is not None:
            return schedule.tokens
        by_index = {s.index: s for s in self.active}
        ids = []
        prompt_at = 0
        for seg in schedule.segments:
            if seg.prefill:
                ids += schedule.prompt_ids[prompt_at:prompt_at + seg.length]
                prompt_at += seg.length
                continue
            seq = by_index.get(seg.seq)
            if seq is None or seq.finished:     # finished: this step is a leftover
                ids += [0] * seg.length
                continue
            k = seg.start - len(seq.request.input_ids)    # index of the generated token it feeds
            if k >= len(seq.output):
                return None
            ids += [seq.output[k], *seg.draft]
        for seg in schedule.segments:
            seq = by_index.get(seg.seq)
            if seq is not None and not seq.finished:
                seq.fed = max(seq.fed, seg.end - len(seg.draft))
        schedule.tokens = ids
        return ids

    def on_sampled(self, mb_id: int, ids: list[int]) -> list[Sequence]:
        """Takes the ids sampled for micro-batch `mb_id` (one per sampled row, in order; a
        speculative step's rows past its first mismatch are -1) and returns the sequences that
        finished: the one place a sequence's end is decided."""
        schedule = self.inflight.pop(mb_id)
        if len(schedule.sampled) != len(ids):
            raise RuntimeError(f"micro-batch {mb_id}: {len(ids)} ids for {len(schedule.sampled)} sampled rows")
        by_index = {s.index: s for s in self.active}
        now = self.clock()
        finished = []
        at = 0
        for seg in schedule.segments:
            if not seg.sample:
                continue
            got, at = ids[at:at + seg.sampled_rows], at + seg.sampled_rows
            seq = by_index.get(seg.seq)
            if seq is None or seq.finished:   # a step committed after its sequence stopped
                continue
            seq.in_flight -= 1
            emitted = [t for t in got if t >= 0]
            if seg.draft:
                self._settle(seq, seg, emitted)
            for token in emitted:
                seq.take_token(token, now)
                self.generated += 1
                if self.on_token is not None:
                    self.on_token(seq, token)
                if seq.finished:
                    break
            if seg.draft:
                seq.committed = len(seq.output) + seq.in_flight
            if seq.finished:
                finished.append(seq)
            elif seq.status is Status.PREEMPTED and seq.in_flight == 0:
                self._release_pages(seq)
        for seq in finished:
            self._retire(seq)
        return finished


def _cuts(slices_for: Callable[..., list[int]], n: int, context: int = 0) -> list[int]:
    """Where the plan's slices of n tokens after `context` cached ones end (from the context)."""
    slices = slices_for(n, context) if context else slices_for(n)
    assert sum(slices) == n, (slices, n)
    return list(itertools.accumulate(slices))
