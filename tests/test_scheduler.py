"""The scheduler against an independent model of a pipeline: micro-batches leave in order after
passing every stage, tokens come from a fixed function of (sequence, step). Checks every
invariant the stages rely on."""

from __future__ import annotations

import math
from collections import deque

from hypothesis import example, given, settings
from hypothesis import strategies as st

from hpipe.formats import Slicing
from hpipe.request import Request
from hpipe.runtime.pages import microbatch_kind
from hpipe.runtime.scheduler import Scheduler

EOS = 0


def token_for(seq: int, step: int) -> int:
    return EOS if (seq * 7 + step * 3) % 23 == 0 and step > 0 else 1 + (seq + step) % 50


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=8), n_stages=st.integers(1, 5),
       max_batch=st.integers(1, 6), new_tokens=st.integers(1, 9), slice_len=st.integers(1, 25),
       eos=st.booleans(), lookahead=st.booleans())
def test_scheduler_invariants(lengths, n_stages, max_batch, new_tokens, slice_len, eos, lookahead):
    """Micro-batches are committed, then start in order (with lookahead only once their input ids
    are back), then leave the pipeline in order."""
    stop = frozenset([EOS] if eos else [])
    requests = [Request(i, f"r{i}", tuple(range(1, n + 1)), max_new_tokens=new_tokens, eos_ids=stop)
                for i, n in enumerate(lengths)]
    slicing = Slicing(lengths=(slice_len,) * 3)
    sched = Scheduler(requests, slicing.slices_for, n_stages, max_batch, lookahead=lookahead, prefix_caching="off")
    committed: deque = deque()
    pipe: deque = deque()
    cached = {}            # seq -> tokens the stages hold
    fed: dict[int, list[int]] = {r.index: [] for r in requests}
    produced: dict[int, list[int]] = {r.index: [] for r in requests}
    leftovers: dict[int, int] = {r.index: 0 for r in requests}
    finished = {}
    admitted, released = set(), set()     # what the schedules told the last stage's sampler, so far
    while not sched.done:
        mb = sched.next_microbatch()
        if mb is not None:
            admitted |= {r.index for r in mb.admitted}
            assert not {i for i, _ in mb.released} - admitted, "a release follows its admission"
            released |= {i for i, _ in mb.released}
            assert not set(mb.sampled) & released, "no row of a request comes after its release"
            assert set(mb.sampled) <= admitted, "the sampler knows a request before its first row"
            for index, generated in mb.released:
                assert generated == len(finished[index].output), "a release carries the tokens stage 0 kept"
            assert len(sched.inflight) <= sched.max_inflight
            active_slots = [a.slot for a in sched.active]
            assert len(active_slots) == len(set(active_slots)) and len(active_slots) <= max_batch
            seqs = [s.seq for s in mb.segments]
            assert len(seqs) == len(set(seqs))
            for seg in mb.segments:
                assert seg.start == cached.get(seg.seq, 0), "segments of a sequence must be contiguous"
                assert seg.prefill == (seg.start < lengths[seg.seq]), "prompt tokens are prefill, the rest decode"
                cached[seg.seq] = seg.end
            if mb.kind == "decode":
                decoding = sum(1 for a in sched.active if a.prefilled and a.finish_reason is None)
                assert len(mb.segments) <= math.ceil(decoding / n_stages)
            assert lookahead or mb.tokens is not None, "without lookahead a micro-batch's ids are known"
            committed.append(mb)
            continue
        if committed and (tokens := sched.input_ids(committed[0])) is not None:   # it enters stage 0
            mb = committed.popleft()
            offset = 0
            for seg in mb.segments:
                if seg.seq in finished:          # committed before its sequence stopped: a leftover
                    leftovers[seg.seq] += 1
                else:
                    fed[seg.seq] += tokens[offset:offset + seg.length]
                offset += seg.length
            assert offset == len(tokens)
            pipe.append(mb)
            continue
        assert pipe, "the scheduler stalled with nothing in flight"
        done_mb = pipe.popleft()
        ids = []
        for seg in done_mb.segments:
            if seg.sample:
                ids.append(token_for(seg.seq, len(produced[seg.seq])))
                if seg.seq not in finished:
                    produced[seg.seq].append(ids[-1])
        for state in sched.on_sampled(done_mb.id, ids):
            finished[state.request.index] = state
    assert not committed and not pipe
    assert sched.preemptions == 0, "a pool sized for every sequence never preempts"
    for r in requests:
        state = finished[r.index]
        out = produced[r.index]
        assert state.output == out
        # every prompt token, then every produced token but the last, was fed exactly once, in order
        assert fed[r.index] == list(r.input_ids) + out[:-1]
        if eos and EOS in out:
            assert out.index(EOS) == len(out) - 1 and state.finish_reason == "eos"
        else:
            assert len(out) == new_tokens and state.finish_reason == "length"
        # a leftover step only follows a stop the scheduler could not foresee, and only with lookahead
        assert leftovers[r.index] <= (1 if lookahead and state.finish_reason == "eos" else 0)
        slices_seen = slicing.slices_for(len(r.input_ids))
        assert sum(slices_seen) == len(r.input_ids)


def sample_oldest(sched, done_mb, token_for, produced: dict, finished: dict) -> None:
    """The last stage's part, for the oldest micro-batch in flight: each sampled row's token (the
    test's `token_for`, or 1), followed by the sequences it ended."""
    ids = []
    for seg in done_mb.segments:
        if seg.sample:
            ids.append(token_for(seg.seq, len(produced[seg.seq])) or 1)
            if seg.seq not in finished:
                produced[seg.seq].append(ids[-1])
    for state in sched.on_sampled(done_mb.id, ids):
        finished[state.request.index] = state

def test_a_one_token_last_slice_is_prefill_on_every_stage():
    """A 33-token prompt cut [32, 1]: its second slice is one token after context, like a decode
    step, but it is the prompt's: every stage must call it prefill."""
    sched = Scheduler([Request(0, "r", tuple(range(1, 34)), max_new_tokens=3)], lambda n: [32, 1], 2, 1)
    first, second = sched.next_microbatch(), sched.next_microbatch()
    assert [s.length for s in first.segments + second.segments] == [32, 1]
    assert first.kind == second.kind == microbatch_kind(second.segments) == "prefill"
    sched.on_sampled(first.id, [])
    sched.on_sampled(second.id, [7])
    decode = sched.next_microbatch()
    assert decode.kind == "decode" and decode.tokens == [7]


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=8), n_stages=st.integers(1, 4),
       max_batch=st.integers(1, 6), new_tokens=st.integers(1, 20), slice_len=st.integers(1, 25),
       policy=st.sampled_from(["throttle", "sarathi"]), page_size=st.sampled_from([1, 4, 16]),
       spare_pages=st.integers(0, 12), budget=st.integers(1, 40), lookahead=st.booleans(),
       aborts=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 30)), max_size=3))
def test_paged_policies_preempt_and_abort(lengths, n_stages, max_batch, new_tokens, slice_len, policy, page_size,
                                          spare_pages, budget, lookahead, aborts):
    """Any policy, a KV pool from barely one sequence up, requests aborted at random moments: every
    sampling step reads a cache that holds exactly the sequence's true tokens (a preempted sequence
    is recomputed), sequences never share a page, and every request ends with the tokens an
    unpaged run would give."""
    from hpipe.runtime.scheduler import Policy
    requests = [Request(i, f"r{i}", tuple(range(1, n + 1)), max_new_tokens=new_tokens) for i, n in enumerate(lengths)]
    longest = max(n + new_tokens for n in lengths)
    pages = math.ceil(longest / page_size) + 1 + spare_pages
    pol = Policy(policy, min_prefill=1, max_prefill=max(1, budget), budget=budget)
    sched = Scheduler(requests, Slicing(lengths=(slice_len,) * 3).slices_for, n_stages, max_batch,
                      lookahead=lookahead, policy=pol, pages=pages, page_size=page_size, prefix_caching="off")
    pipe: deque = deque()
    committed: deque = deque()
    cache: dict[int, dict[int, int]] = {}
    produced: dict[int, list[int]] = {r.index: [] for r in requests}
    finished: dict[int, object] = {}
    aborted: set[int] = set()
    step = 0
    while not sched.done:
        step += 1
        assert step < 20000, "no progress"
        for seq, at in aborts:
            if at == step and seq < len(requests) and seq not in finished:
                if sched.abort(seq) is not None:
                    aborted.add(seq)
                    finished[seq] = None
        owned = [p for a in sched.active for p in a.pages]
        assert len(owned) == len(set(owned)) and 0 not in owned and len(owned) + len(sched.pool.free) == pages - 1
        mb = sched.next_microbatch()
        if mb is not None:
            assert sum(s.length for s in mb.segments) <= sched.max_tokens
            for seg in mb.segments:
                assert len(seg.pages) >= math.ceil(seg.end / page_size) and 0 not in seg.pages
            committed.append(mb)
            continue
        if committed and (tokens := sched.input_ids(committed[0])) is not None:
            mb = committed.popleft()
            offset = 0
            for seg in mb.segments:
                if seg.seq not in finished:
                    row = cache.setdefault(seg.seq, {})
                    for k in range(seg.length):
                        row[seg.start + k] = tokens[offset + k]
                    if seg.sample:   # what attention reads is the sequence's true prefix
                        true = list(requests[seg.seq].input_ids) + produced[seg.seq]
                        assert [row[p] for p in range(seg.end)] == true[:seg.end]
                offset += seg.length
            pipe.append(mb)
            continue
        if sched.done:
            break
        assert pipe, "the scheduler stalled with nothing in flight"
        sample_oldest(sched, pipe.popleft(), token_for, produced, finished)
    for r in requests:
        if r.index in aborted:
            continue
        assert finished[r.index].output == produced[r.index]
        assert produced[r.index] == [token_for(r.index, k) or 1 for k in range(new_tokens)]
    assert len(sched.pool.free) == pages - 1


@settings(max_examples=300, deadline=None)
@given(docs=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=40), min_size=1, max_size=3),
       picks=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, 9), max_size=12)), min_size=1, max_size=8),
       n_stages=st.integers(1, 4), max_batch=st.integers(1, 5), new_tokens=st.integers(1, 12),
       slice_len=st.integers(1, 25), page_size=st.sampled_from([1, 2, 4, 16]), spare_pages=st.integers(0, 16),
       lookahead=st.booleans(), aborts=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 40)), max_size=3),
       caching=st.booleans())
# found by the search: a request aborted while its prompt's slice waited behind a decode step whose
# token was out; the slice ran on dummy ids into pages already registered in the prefix cache
@example(docs=[[1, 1]], picks=[(0, []), (0, []), (0, []), (0, [1]), (0, [1, 1])], n_stages=1, max_batch=4,
         new_tokens=2, slice_len=1, page_size=1, spare_pages=5, lookahead=True, aborts=[(3, 3)], caching=True)
def test_prefix_caching_reads_every_sequences_own_tokens(docs, picks, n_stages, max_batch, new_tokens, slice_len,
                                                         page_size, spare_pages, lookahead, aborts, caching):
    """Requests sharing random prefixes (documents, then their own questions), a pool from barely
    one sequence up (preemption), aborts at random moments, caching on and off. The KV lives in
    pages written in the schedules' order, and a second stage rebuilds every page table from the
    encoded schedules: every sampled row reads exactly its sequence's tokens through its pages
    (cached heads included), every request ends with the tokens
    of an uncached run, and every page goes back to the pool (free or cached). (A write into a page
    some sequence reads would show as a wrong token in a later read.)"""
    from hpipe.runtime.pages import PageTable
    from hpipe.runtime.schedule import decode, encode

    requests = [Request(i, f"r{i}", tuple(docs[d % len(docs)] + q), max_new_tokens=new_tokens)
                for i, (d, q) in enumerate(picks)]
    longest = max(len(r.input_ids) + new_tokens for r in requests)
    pages = math.ceil(longest / page_size) + 1 + spare_pages
    sched = Scheduler(requests, Slicing(lengths=(slice_len,) * 3).slices_for, n_stages, max_batch,
                      lookahead=lookahead, pages=pages, page_size=page_size,
                      prefix_caching="on" if caching else "off")
    table = PageTable(page_size)
    kv: dict[int, int] = {}                      # page * page_size + row -> the token written there
    pipe: deque = deque()
    committed: deque = deque()
    produced: dict[int, list[int]] = {r.index: [] for r in requests}
    finished: dict[int, object] = {}
    aborted: set[int] = set()
    step = 0
    while not sched.done:
        step += 1
        assert step < 20000, "no progress"
        for seq, at in aborts:
            if at == step and seq < len(requests) and seq not in finished and sched.abort(seq) is not None:
                aborted.add(seq)
                finished[seq] = None
        # what runs in the pipeline: what entered it, and what is committed with all its inputs known
        assert sched.running() == len(pipe) + sum(sched.input_ids(c) is not None for c in committed)
        mb = sched.next_microbatch()
        if mb is not None:
            mb.underfilled = step % 3 == 0
            header, body, payload = encode(mb, page_size, with_requests=False)
            other = decode(header, body, payload, table, requests.__getitem__)
            assert [s.pages for s in other.segments] == [s.pages for s in mb.segments], "stage 1 follows stage 0"
            assert other.underfilled == mb.underfilled
            committed.append(mb)
            continue
        if committed and (tokens := sched.input_ids(committed[0])) is not None:
            mb = committed.popleft()
            offset = 0
            for seg in mb.segments:
                for k in range(seg.length):
                    p = seg.start + k
                    page = seg.pages[p // page_size]
                    assert page != 0
                    kv[page * page_size + p % page_size] = tokens[offset + k]
                if seg.sample and seg.seq not in finished:   # attention reads the sequence's true prefix
                    true = list(requests[seg.seq].input_ids) + produced[seg.seq]
                    got = [kv.get(seg.pages[p // page_size] * page_size + p % page_size) for p in range(seg.end)]
                    assert got == true[:seg.end], (seg, got, true)
                offset += seg.length
            pipe.append(mb)
            continue
        if sched.done:
            break
        assert pipe, "the scheduler stalled with nothing in flight"
        sample_oldest(sched, pipe.popleft(), token_for, produced, finished)
    for r in requests:
        if r.index not in aborted:
            assert finished[r.index].output == produced[r.index] == \
                [token_for(r.index, k) or 1 for k in range(new_tokens)]
    assert sched.pool.available == pages - 1 and not sched.pool.refs


def test_a_second_request_on_the_same_document_starts_after_its_cached_pages():
    """One request ends; the next shares its first 40 tokens: it starts at position 32 (two whole
    pages, cached), its first segment carries them (fresh), and the pool counts the hit."""
    doc = tuple(range(1, 41))
    first, second = Request(0, "a", doc + (50, 51), max_new_tokens=2), Request(1, "b", doc + (60,), max_new_tokens=2)
    sched = Scheduler([first], Slicing(count=1).slices_for, 1, 2, pages=12, page_size=16, prefix_caching="on",
                      serving=True)
    while sched.active or sched.queue:
        mb = sched.next_microbatch()
        sched.on_sampled(mb.id, [7] * len(mb.sampled))
    assert sched.pool.cached == 2 and sched.pool.available == 11       # 2 full pages of the 43 positions fed
    sched.add(second)
    mb = sched.next_microbatch()
    (seg,) = mb.segments
    assert (seg.start, seg.length, seg.fresh) == (32, 9, True) and len(seg.pages) == 3
    assert sched.stats()["prefix_hit_tokens"] == 32


def test_a_prompt_that_runs_alone_is_sliced_as_the_plan_slices_it_whatever_waits():
    """With --max-batch 1 the requests behind a prompt cannot share its micro-batches: it is cut
    where the plan cuts its length, as when it came alone (a job then gives the tokens a server
    gives the same requests one at a time; the quantized kernels round differently per shape)."""
    slicing = Slicing(count=3, granularity=1)

    def prefill_lengths(requests):
        sched = Scheduler(requests, slicing.slices_for, 2, max_batch=1)
        lengths = []
        while (mb := sched.next_microbatch()) is not None and mb.segments[0].prefill:
            lengths.append(mb.segments[0].length)
        return lengths

    first = Request(0, "a", tuple(range(1, 41)), max_new_tokens=4)
    alone = prefill_lengths([first])
    assert alone == slicing.slices_for(40) and len(alone) == 3
    assert prefill_lengths([first, Request(1, "b", tuple(range(1, 300)), max_new_tokens=4)]) == alone


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), max_size=12), st.booleans())
def test_a_stage_takes_its_schedules_in_order_whoever_receives_them(flags, yields):
    """Stages 1..N-1 (`pipeline.Source`): after a schedule that says the pipeline is underfilled, a
    CPU stage's compute thread receives the next one itself; the thread takes over again after one
    that does not. Every schedule comes out once, in order, then the stop; the compute thread
    received exactly those that follow an underfilled one."""
    import threading
    from types import SimpleNamespace

    from hpipe.runtime.pipeline import Source, Work, _get
    from hpipe.runtime.schedule import Schedule

    arriving = [Schedule(i, [], underfilled=f) for i, f in enumerate(flags)] + [Schedule.end()]
    by = []

    def receive(versions):
        schedule = arriving.pop(0)
        by.append(threading.current_thread().name)
        return None if schedule.stop else Work(schedule)

    errors = []
    source = Source(SimpleNamespace(transport=SimpleNamespace(receive=receive), errors=errors), None, yields)
    got = []
    while (work := _get(source, errors)) is not None:
        got.append(work.schedule.id)
    assert got == list(range(len(flags))) and not arriving
    inline = [yields and f for f in [False] + flags]
    assert [name != "hpipe-source" for name in by] == inline


class OracleProposer:
    """Proposes each sequence's true next tokens (`token_for`), one of them wrong where `miss` says:
    accepted runs, mismatches and rejected tails all occur."""

    def __init__(self, k: int, miss: int):
        self.k, self.miss = k, miss

    def propose(self, wants: list[tuple]) -> list[list[int]]:
        out = []
        for seq, n in wants:
            step = len(seq.output)                  # the step's first sampled row is this token's
            draft = [token_for(seq.index, step + j) for j in range(n)]
            wrong = (seq.index * 5 + step * self.miss) % (n + 2)
            if wrong < n:
                draft[wrong] = 51 + draft[wrong] % 7     # never a true token (those are 0..50)
            out.append(draft)
        return out

    def forget(self, index: int) -> None:
        pass


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), n_stages=st.integers(1, 4),
       max_batch=st.integers(1, 6), new_tokens=st.integers(1, 12), slice_len=st.integers(1, 25),
       k=st.integers(1, 4), miss=st.integers(0, 6), lookahead=st.booleans())
def test_speculation_with_lookahead_reads_only_tokens_that_were_accepted(lengths, n_stages, max_batch, new_tokens,
                                                                        slice_len, k, miss, lookahead):
    """Speculating sequences beside each other, with the asynchronous runtime's lookahead: when a
    micro-batch enters stage 0, every position its segments read before their own holds its sequence's
    true token (a rejected proposal's position rewritten first), proposals ride only beside at most
    SPEC_SEQUENCES sequences' decode steps and never behind another step of theirs, and each sequence's
    output is the one decoding without proposals gives."""
    from hpipe.runtime.speculative import SPEC_SEQUENCES

    requests = [Request(i, f"r{i}", tuple(range(1, n + 1)), max_new_tokens=new_tokens, eos_ids=frozenset([EOS]))
                for i, n in enumerate(lengths)]
    sched = Scheduler(requests, Slicing(lengths=(slice_len,) * 3).slices_for, n_stages, max_batch,
                      lookahead=lookahead, prefix_caching="off", proposer=OracleProposer(k, miss))
    truth = {r.index: list(r.input_ids) for r in requests}   # prompt, then every token sampled so far
    kv: dict[int, dict[int, int]] = {r.index: {} for r in requests}    # position -> the token written there
    committed: deque = deque()
    pipe: deque = deque()
    finished = {}
    while not sched.done:
        mb = sched.next_microbatch()
        if mb is not None:
            drafted = [s for s in mb.segments if s.draft]
            decoding = [s for s in mb.segments if not s.prefill]     # (a prompt's slice may ride along)
            assert not drafted or len(decoding) <= SPEC_SEQUENCES, "proposals beside other sequences' steps"
            in_flight = {s.seq for m in list(committed) + list(pipe) for s in m.segments}
            assert not {s.seq for s in drafted} & in_flight, "a proposal behind its sequence's own step"
            committed.append(mb)
            continue
        if committed and (tokens := sched.input_ids(committed[0])) is not None:    # it enters stage 0
            mb = committed.popleft()
            at = 0
            for seg in mb.segments:
                if seg.seq not in finished:
                    for p in range(seg.start):
                        assert kv[seg.seq].get(p) == truth[seg.seq][p], f"r{seg.seq} reads position {p} unwritten or stale"
                    for j in range(seg.length):
                        kv[seg.seq][seg.start + j] = tokens[at + j]
                at += seg.length
            pipe.append(mb)
            continue
        assert pipe, "the scheduler stalled with nothing in flight"
        done_mb = pipe.popleft()
        ids = []
        for seg in done_mb.segments:
            if not seg.sample:
                continue
            rows = [-1] * seg.sampled_rows
            if seg.seq not in finished:            # verification: sample on while the proposal matches
                made = len(truth[seg.seq]) - len(requests[seg.seq].input_ids)
                for j in range(seg.sampled_rows):
                    rows[j] = token_for(seg.seq, made + j)
                    if j >= len(seg.draft) or seg.draft[j] != rows[j] or rows[j] == EOS:
                        break
                taken = [t for t in rows if t >= 0][:new_tokens - made]
                truth[seg.seq] += taken[:taken.index(EOS) + 1] if EOS in taken else taken
            else:
                rows[0] = 1
            ids += rows
        for state in sched.on_sampled(done_mb.id, ids):
            finished[state.request.index] = state
    for r in requests:
        plain = []
        for step in range(new_tokens):
            plain.append(token_for(r.index, step))
            if plain[-1] == EOS:
                break
        assert finished[r.index].output == plain == truth[r.index][len(r.input_ids):]
