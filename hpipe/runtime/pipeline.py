"""How a stage runs its micro-batches: the asynchronous runtime (SiPipe's TSEM, SAT and CPU sampling).

Every stage runs the same executors, connected by queues, each micro-batch passing them in order:

    source ──> prepare ──> compute ──> send (hop) / sample (last stage)
    (stage 0: the scheduler; others: the schedule, or the hop without SAT)

- source: on stage 0 the scheduler's driver thread (`Driver`), which commits micro-batches as soon as
  they may start, publishes each schedule (SAT) and takes the ids that come back; on the other
  stages a thread that receives the schedules and posts each micro-batch's receive into a
  preallocated, reused buffer of its version (SAT), or that receives schedule and hidden states
  from the previous stage (without SAT). How schedules and data travel is one object, chosen at
  start (`StructureAware` or `WithHeaders`);
- prepare (TSEM): a CPU thread that builds micro-batch i+1's inputs (positions, masks, rotary, KV
  indices, rows to sample) while micro-batch i computes. Two versions: a micro-batch takes a version
  when its source hands it on and gives it back when its forward is done, so at most two are
  prepared or running at once (SiPipe's CI/GI counters) and version v's buffers are never rewritten
  while v computes. Without TSEM the compute thread prepares inline, as the first runtime did;
- compute (the main thread): waits for the data (hidden states, or stage 0's ids), runs the forward,
  hands the output on and takes the next micro-batch at once; no device synchronisation;
- sample (last stage): one object, chosen at start, with one interface (`submit` a micro-batch's
  logits after its schedule's admissions and releases, `drain` at the end): inline in the loop, on
  a sampler thread (a GPU stage under TSEM), or in the sampler process pool (`--sampling cpu`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hpipe import protocol
from hpipe.runtime import comm
from hpipe.runtime.pages import PageTable
from hpipe.runtime.schedule import Schedule
from hpipe.runtime.scheduler import Scheduler
from hpipe.runtime.static_decode import VERSIONS   # one number of input versions for both paths

__all__ = ["Driver", "Executors", "LogprobReports", "Modes", "Intervals", "run_first_stage", "run_later_stage",
           "run_summary"]


@dataclass(frozen=True)
class Modes:
    """The asynchronous runtime's switches, resolved for this stage at start."""

    tsem: bool                 # double-buffered inputs; decode steps committed ahead
    prepare_thread: bool       # (with tsem) the CPU executor is a thread; else the compute thread prepares
    sampler_thread: bool       # (with tsem) a last stage's inline sampling runs on a thread; else in the loop
    sat: bool                  # schedules on the control plane, hidden states alone into pre-posted buffers
    sampling: str              # "inline" (in this process) or "cpu" (the sampler process pool)
    cuda_graphs: bool          # (CUDA nodes) replay decode steps from captured graphs
    turns: bool                # (CPU stages of a pipeline) in an underfilled pipeline, the scheduler and the
                               # schedules coming in wait for the forward to end (`Turn`, `Source`)


class Intervals:
    """Measured intervals of one stage: compute, prepare, wait, send, sample. Threads append.
    `bounded` (serving, which runs for hours) keeps the latest 100,000. `computed` (compute seconds,
    tokens and micro-batches since the start, by micro-batch kind) and `recent` (the latest
    PULSE_INTERVALS compute intervals) are what the stage's pulse reads from another thread: copied
    whole."""

    def __init__(self, bounded: bool = False):
        self.intervals = collections.deque(maxlen=100_000 if bounded else None)
        self.recent = collections.deque(maxlen=protocol.PULSE_INTERVALS)
        self.computed: dict[str, tuple[float, int, int]] = {}

    def add(self, what: str, start: float, end: float, mb: int | None = None, kind: str | None = None,
            tokens: int | None = None):
        rec = {"what": what, "start": start, "end": end}
        if mb is not None:
            rec.update(mb=mb, kind=kind, tokens=tokens)
        if what == "compute":
            seconds, n, mbs = self.computed.get(kind, (0.0, 0, 0))
            self.computed = {**self.computed, kind: (seconds + end - start, n + (tokens or 0), mbs + 1)}
            self.recent.append(rec)
        self.intervals.append(rec)


class Turn:
    """Whose turn it is on stage 0's core: its forward's, or its scheduler's. A CPU stage's forward
    keeps its core and the GIL busy; the scheduler, woken by the ids that start that forward,
    would commit and publish the next schedule inside it, and the compute thread would wake behind
    it (3 one-thread stages of SmolLM2, in the same runs: stage 0's forward 3.2-3.7 -> 2.8-3.2 ms,
    the ids' way back 0.73-0.92 -> 0.57-0.79 ms). So the compute loop holds the turn from the
    moment its inputs are in hand until its output has gone on; where the pipeline is underfilled
    (`Driver._underfilled`: stage 0 waits for the next ids anyway) the scheduler commits in
    between. A full pipeline has no such wait: there the commit overlaps the forward (8 streams
    through 3 stages: 9 % more tokens a second than committing in between). Without `yields`
    (one stage; a GPU stage, whose forward runs on the device) nothing waits. `cond` is the
    driver's lock."""

    def __init__(self, yields: bool):
        self.yields = yields
        self.cond = threading.Condition()
        self.held = False

    def take(self) -> None:
        """The compute thread has its inputs: a forward starts."""
        with self.cond:
            self.held = self.yields

    def give(self) -> None:
        """The forward's output has gone on: the others' turn."""
        with self.cond:
            if self.held:
                self.held = False
                self.cond.notify_all()


@dataclass
class Executors:
    """What the executors of one stage share."""

    rank: int
    world: int
    runner: object                   # hpipe.runtime.stage.StageRunner
    groups: comm.Groups | None
    modes: Modes
    timeline: Intervals
    link: comm.ScheduleLink          # how schedules are encoded (capacity, page size, requests carried)
    max_tokens: int                  # the longest micro-batch (the receive buffers' rows)
    buffers: list = field(default_factory=list)   # per version: the hidden states' receive buffer
    static: object = None            # hpipe.runtime.static_decode.StaticDecode for decode micro-batches, or None
    errors: list = field(default_factory=list)    # the first failure of any executor (or the sampler pool)
    pages: PageTable | None = None   # stages 1..N-1: the page table the schedule's segments extend
    transport: object = None         # how schedules and data travel (None with one stage)

    def __post_init__(self):
        if self.pages is None:
            self.pages = PageTable(self.link.page_size)
        if self.world > 1:
            self.transport = StructureAware(self) if self.modes.sat else WithHeaders(self)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    def allocate_buffers(self) -> None:
        """Sized once, before the clock starts: one receive buffer per version."""
        if not self.is_first:
            r = self.runner
            self.buffers = [torch.empty((self.max_tokens, r.hidden_size), dtype=r.dtype,
                                        device=self.groups.data_device) for _ in range(VERSIONS)]


@dataclass
class Work:
    """One micro-batch on its way through a stage's executors."""

    schedule: Schedule
    version: int = 0
    hidden: torch.Tensor | None = None    # the received hidden states (or the buffer they arrive in)
    recv: object = None                   # the pending receive of `hidden`
    unreceived: bool = False              # `hidden` is a buffer the compute thread must receive into
    inputs: object = None                 # the prepared StageInputs
    static: tuple | None = None           # or the static decode path's handle (its buffers are filled)
    prepared: bool = False

    @property
    def id(self) -> int:
        return self.schedule.id

    @property
    def segments(self):
        return self.schedule.segments

    def record(self, timeline: Intervals, what: str, start: float) -> None:
        timeline.add(what, start, time.time(), self.id, self.schedule.kind, self.schedule.n_tokens)


def _thread(target, name: str, errors: list) -> threading.Thread:
    """A daemon thread whose exception is kept for the compute loop to raise."""
    def run():
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


def _get(q: queue.Queue, errors: list):
    """Blocks on a queue, but raises at once when another executor of this stage failed."""
    while True:
        if errors:
            raise errors[0]
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            continue


def _join(threads: list[threading.Thread], errors: list) -> None:
    for th in threads:
        while th.is_alive():
            th.join(timeout=0.1)
            if errors:
                raise errors[0]


class Versions:
    """Two input versions: taken by a micro-batch's source, given back after its forward."""

    def __init__(self, errors: list):
        self.free = threading.Semaphore(VERSIONS)
        self.next = 0
        self.errors = errors

    def take(self) -> int:
        while not self.free.acquire(timeout=0.1):
            if self.errors:
                raise self.errors[0]
        v, self.next = self.next, (self.next + 1) % VERSIONS
        return v

    def give_back(self) -> None:
        self.free.release()


# ---------------------------------------------------------------------------------- transport
class StructureAware:
    """SAT (SiPipe §5.3): stage 0 publishes every schedule to every stage on the control plane,
    ahead of the data; hidden states travel alone into pre-posted buffers; ids come back alone."""

    def __init__(self, ex: Executors):
        self.ex = ex
        self.pre_post = ex.groups.backend == "gloo"     # NCCL receives are posted by the compute thread

    def publish(self, schedule: Schedule, driver: Driver) -> None:
        sends = driver.published[schedule.id] = comm.Pending()
        comm.publish_schedule(self.ex.groups, self.ex.world, schedule, self.ex.link, sends)
        driver.expected.put(None if schedule.stop else schedule)

    def receive(self, versions: Versions) -> Work | None:
        ex = self.ex
        schedule = comm.recv_schedule(ex.groups, ex.link, ex.pages)
        if schedule.stop:
            return None
        version = versions.take()
        work = Work(schedule, version=version, hidden=ex.buffers[version][: schedule.n_tokens])
        if self.pre_post:
            work.recv = comm.post_recv_hidden(ex.groups, ex.rank - 1, work.hidden)
        else:
            work.unreceived = True
        return work

    def send_on(self, work: Work, out: torch.Tensor, pending: comm.Pending) -> None:
        comm.send_hidden(self.ex.groups, self.ex.rank + 1, out, pending)

    def end_hop(self) -> None:
        """The stop went out with the schedules."""

    def send_ids(self, mb_id: int, ids: list[int]) -> None:
        comm.send_tokens(self.ex.groups, 0, mb_id, ids, sat=True)

    def end_back(self) -> None:
        """Stage 0 knows every micro-batch that returns ids."""

    def back_loop(self, driver: Driver) -> None:
        """Stage 0: the ids of each micro-batch, alone, in the order of the schedule."""
        ex = self.ex
        while (schedule := _get(driver.expected, ex.errors)) is not None:
            _, _, ids = comm.recv_tokens(ex.groups, ex.world - 1, len(schedule.sampled))
            driver.take_ids(schedule.id, ids)
            driver.published.pop(schedule.id).wait()     # its ids are back: every stage received it


class WithHeaders:
    """Without SAT (the baseline): every hop carries the schedule before the hidden states, and
    the ids come back after a header."""

    def __init__(self, ex: Executors):
        self.ex = ex
        self.pre_post = ex.groups.backend == "gloo"

    def publish(self, schedule: Schedule, driver: Driver) -> None:
        """The schedule goes with the data (`send_on`)."""

    def receive(self, versions: Versions) -> Work | None:
        ex = self.ex
        schedule, hidden = comm.recv_work(ex.groups, ex.rank - 1, ex.runner.hidden_size, ex.runner.dtype, ex.link,
                                          ex.pages, receive_hidden=self.pre_post)
        if schedule.stop:
            return None
        return Work(schedule, version=versions.take(), hidden=hidden, unreceived=not self.pre_post)

    def send_on(self, work: Work, out: torch.Tensor, pending: comm.Pending) -> None:
        comm.isend_work(self.ex.groups, self.ex.rank + 1, work.schedule, out, self.ex.link, pending)

    def end_hop(self) -> None:
        pending = comm.Pending()
        comm.isend_work(self.ex.groups, self.ex.rank + 1, Schedule.end(), None, self.ex.link, pending)
        pending.wait()

    def send_ids(self, mb_id: int, ids: list[int]) -> None:
        comm.send_tokens(self.ex.groups, 0, mb_id, ids, sat=False)

    def end_back(self) -> None:
        comm.send_back_stop(self.ex.groups, 0)

    def back_loop(self, driver: Driver) -> None:
        ex = self.ex
        while True:
            op, mb_id, ids = comm.recv_tokens(ex.groups, ex.world - 1)
            if op == comm.OP_STOP:
                return
            driver.take_ids(mb_id, ids)


# ---------------------------------------------------------------------------------- prepare
def _prepare(ex: Executors, work: Work) -> None:
    t = time.time()
    with torch.inference_mode():
        if ex.static is not None and ex.static.accepts(work.segments):
            work.static = ex.static.prepare(work.segments, work.version)
        else:
            work.inputs = ex.runner.prepare_inputs(work.segments)
    work.prepared = True
    work.record(ex.timeline, "prepare", t)


def _forward(ex: Executors, work: Work, x: torch.Tensor) -> torch.Tensor:
    if work.static is not None:
        with torch.inference_mode():
            return ex.static.run(work.static, x)
    return ex.runner.forward(work.inputs, x)


def _next_work(ex: Executors, ready: queue.Queue) -> tuple[Work | None, float]:
    """The compute thread's next micro-batch, prepared (here, without a CPU executor thread), or None
    at the stop; and the time its wait for data starts."""
    t = time.time()
    work = _get(ready, ex.errors)
    if work is not None and not work.prepared:
        ex.timeline.add("wait", t, time.time())
        _prepare(ex, work)
        t = time.time()
    return work, t


class Source:
    """Stages 1..N-1: the compute loop's micro-batches, in order. A source thread receives them
    ahead (the schedule read, the hidden states' receive posted) while the stage computes. Where
    the pipeline is underfilled (one stream decoding: each stage computes one micro-batch, then
    waits), the next schedule comes in during the forward (stage 0 sends it when its own forward
    ends), and reading it there takes the GIL from that forward: so on a CPU stage (`yields`), after
    a schedule that says so, the compute thread receives the next one itself, between forwards.
    Queue-like for `_get`; gloo keeps what arrives meanwhile."""

    _YOURS = object()       # the thread's word to the compute thread: receive the next one yourself

    def __init__(self, ex: Executors, versions: Versions, yields: bool):
        self.ex, self.versions, self.yields = ex, versions, yields
        self.queue: queue.Queue = queue.Queue()
        self.inline, self.done = False, False
        self.resume = threading.Event()
        _thread(self._loop, "hpipe-source", ex.errors)

    def _receive(self) -> Work | None:
        return self.ex.transport.receive(self.versions)

    def _hands_over(self, work: Work | None) -> bool:
        return self.yields and work is not None and work.schedule.underfilled

    def _loop(self) -> None:
        while True:
            work = self._receive()
            self.queue.put(work)
            if work is None:
                return
            if self._hands_over(work):
                self.queue.put(Source._YOURS)
                self.resume.wait()
                self.resume.clear()
                if self.done:
                    return

    def get(self, timeout: float | None = None) -> Work | None:
        if not self.inline:
            work = self.queue.get(timeout=timeout)
            if work is not Source._YOURS:
                return work
            self.inline = True
        work = self._receive()
        if not self._hands_over(work):      # the thread receives again from the next one on
            self.inline, self.done = False, work is None
            self.resume.set()
        return work


def _start_prepare(ex: Executors, source: queue.Queue) -> queue.Queue:
    """TSEM: the CPU executor. Without TSEM the compute loop prepares inline (same queue)."""
    if not (ex.modes.tsem and ex.modes.prepare_thread):
        return source
    ready: queue.Queue = queue.Queue()

    def loop():
        while True:
            work = _get(source, ex.errors)
            if work is not None:
                _prepare(ex, work)
            ready.put(work)
            if work is None:
                return
    _thread(loop, "hpipe-prepare", ex.errors)
    return ready


# ---------------------------------------------------------------------------------- sampling
class LogprobReports:
    """Log-probabilities for the requests that ask (`SamplingParams.logprobs`), as vLLM gives them
    by default: of the model's own distribution (log_softmax of the raw logits, float32, before
    logit_bias, penalties and temperature), the sampled token's and the top k. Taken from a
    micro-batch's logits when it is submitted (`take`), completed with the sampled ids when they
    are delivered (`report`), and sent by the last stage straight to the launcher
    (`protocol.Logprobs`). Requests that do not ask cost one dictionary lookup per micro-batch."""

    def __init__(self):
        self.wanted: dict[int, int] = {}            # request index -> top k, while admitted
        self.pending: dict[int, tuple] = {}         # micro-batch -> (rows, their log-probabilities)
        self.prompts: dict[int, list] = {}          # request index -> [the request, next prompt position]

    def take(self, schedule: Schedule, out: torch.Tensor) -> torch.Tensor:
        """Keeps the log-probabilities the micro-batch's requests ask for; returns the logits of
        its sampled rows (the scored rows that follow them are the prompts')."""
        for request in schedule.admitted:
            if request.params.logprobs is not None:
                self.wanted[request.index] = request.params.logprobs
            if request.params.prompt_logprobs is not None:
                self.prompts[request.index] = [request, 1]
        for index, _ in schedule.released:
            self.wanted.pop(index, None)
            self.prompts.pop(index, None)
        n = len(schedule.sampled)
        if schedule.scored_rows:
            self._score_prompts(schedule, out[n:])
            out = out[:n]
        if not self.wanted:
            return out
        rows = [(i, seq) for i, seq in enumerate(schedule.sampled) if seq in self.wanted]
        if rows:
            picked = out[torch.tensor([i for i, _ in rows])].detach().to("cpu", torch.float32)
            self.pending[schedule.id] = (rows, torch.log_softmax(picked, dim=-1))
        return out

    def _score_prompts(self, schedule: Schedule, scored: torch.Tensor) -> None:
        """Each scored row at position p gives prompt token p + 1's log-probability (reported once:
        a preemption's recompute, or output tokens fed again, add nothing)."""
        picks, where = [], []
        at = 0
        for s in schedule.segments:
            if not s.scored:
                continue
            request, nxt = self.prompts[s.seq]
            n_prompt = len(request.input_ids)
            for p in range(s.start, s.end - s.sample):
                if nxt <= p + 1 < n_prompt:
                    picks.append(at + p - s.start)
                    where.append((s.seq, p + 1))
                    nxt = p + 2
            self.prompts[s.seq][1] = nxt
            at += s.length - s.sample
        if not picks:
            return
        lp = torch.log_softmax(scored[torch.tensor(picks)].detach().to("cpu", torch.float32), dim=-1)
        asked = [(self.prompts[seq][0].input_ids[pos], self.prompts[seq][0].params.prompt_logprobs)
                 for seq, pos in where]
        protocol.send(protocol.Logprobs([], [[seq, pos, *e] for (seq, pos), e in zip(where, _entries(lp, asked))]))

    def reporting(self, deliver: Callable[[int, list[int]], None]) -> Callable[[int, list[int]], None]:
        """`deliver` that first reports the micro-batch's log-probabilities (so that they reach the
        launcher before the ids reach stage 0)."""
        def deliver_ids(mb_id: int, ids: list[int]) -> None:
            self.report(mb_id, ids)
            deliver(mb_id, ids)
        return deliver_ids

    def report(self, mb_id: int, ids: list[int]) -> None:
        taken = self.pending.pop(mb_id, None)
        if taken is None:
            return
        rows, lp = taken
        emitted = [j for j, (i, _) in enumerate(rows) if ids[i] >= 0]     # a rejected proposal's row: none
        if len(emitted) < len(rows):
            rows, lp = [rows[j] for j in emitted], lp[emitted]
        if rows:
            asked = [(int(ids[i]), self.wanted.get(seq, 0)) for i, seq in rows]
            protocol.send(protocol.Logprobs([[seq, *e] for (_, seq), e in zip(rows, _entries(lp, asked))]))


def _entries(lp: torch.Tensor, asked: list[tuple[int, int]]) -> list[list]:
    """[token, its log-probability, [[id, log-probability] of the top k]] for each row of `lp`
    and its (token, k)."""
    k = max(n for _, n in asked)
    top = lp.topk(k, dim=-1) if k else None
    return [[token, float(lp[j, token]),
             [[int(t), float(v)] for t, v in zip(top.indices[j, :n], top.values[j, :n])] if n else []]
            for j, (token, n) in enumerate(asked)]


class Sampling:
    """The last stage's sampling: one interface whatever runs it. `submit` hands over one
    micro-batch's logits after applying its schedule's admissions and releases (so the sampler
    state follows the schedules' order); `deliver(mb_id, ids)` takes the ids; `drain` waits for
    every id to be delivered."""

    def __init__(self, sampler, deliver: Callable[[int, list[int]], None], timeline: Intervals, keep,
                 logprobs: LogprobReports):
        """deliver: `logprobs.reporting(...)` of where the ids go (the pool, too, calls that)."""
        self.sampler, self.deliver, self.timeline, self.keep, self.logprobs = sampler, deliver, timeline, keep, logprobs

    def _follow(self, schedule: Schedule) -> None:
        for request in schedule.admitted:
            self.sampler.admit(request)
        for index, _ in schedule.released:
            self.sampler.release(index)

    def _sample(self, schedule: Schedule, out: torch.Tensor) -> None:
        self._follow(schedule)
        t = time.time()
        ids = self.sampler.sample(out, schedule.sampled, schedule.expected)
        self.timeline.add("sample", t, time.time())
        self.deliver(schedule.id, ids)

    def _taken(self, schedule: Schedule, out: torch.Tensor) -> torch.Tensor:
        """The sampled rows' logits, once the log-probabilities and --logits-out have theirs."""
        out = self.logprobs.take(schedule, out)
        self.keep.add(schedule.id, out, schedule.sampled)
        return out

    def submit(self, schedule: Schedule, out: torch.Tensor) -> None:
        self._sample(schedule, self._taken(schedule, out))

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadSampling(Sampling):
    """TSEM: a sampler thread, so the compute loop takes its next micro-batch at once."""

    def __init__(self, sampler, deliver, timeline: Intervals, keep, logprobs: LogprobReports, errors: list):
        super().__init__(sampler, deliver, timeline, keep, logprobs)
        self.errors = errors
        self.queue: queue.Queue = queue.Queue()
        self.thread = _thread(self._loop, "hpipe-sampler", errors)

    def _loop(self) -> None:
        while (item := _get(self.queue, self.errors)) is not None:
            self._sample(*item)

    def submit(self, schedule: Schedule, out: torch.Tensor) -> None:
        self.queue.put((schedule, self._taken(schedule, out)))

    def drain(self) -> None:
        self.queue.put(None)
        _join([self.thread], self.errors)


class PoolSampling(Sampling):
    """SiPipe §4: the logits go to a pool of sampler processes (`sampler_pool`); admissions and
    releases are queued to the owning processes before the rows that need them."""

    def submit(self, schedule: Schedule, out: torch.Tensor) -> None:
        out = self._taken(schedule, out)
        self._follow(schedule)          # the pool is the sampler: admit / release queue to its processes
        self.sampler.submit(schedule.id, out, schedule.sampled, schedule.expected)

    def drain(self) -> None:
        self.sampler.drain()

    def close(self) -> None:
        self.sampler.close()


# ---------------------------------------------------------------------------------- stage 0
class Driver:
    """Stage 0's control plane: the scheduler, the requests coming in (serving), the ids coming
    back, the schedules going out. `reports` is told of tokens, results and micro-batches."""

    def __init__(self, ex: Executors, sched: Scheduler, reports):
        self.ex, self.sched, self.reports = ex, sched, reports
        self.transport = ex.transport
        self.errors = ex.errors
        self.versions = Versions(self.errors)
        self.turn = Turn(ex.modes.turns)
        self.cond = self.turn.cond       # the scheduler's lock is the turn's: ids handed over and the turn taken at once
        self.waiting: Schedule | None = None     # the micro-batch the compute thread waits for the ids of
        self.committed: queue.Queue = queue.Queue()     # to prepare/compute, in order
        self.expected: queue.Queue = queue.Queue()      # SAT: micro-batches whose ids come back, in order
        # SAT: each schedule's sends (its message to every stage, a server's requests to the last),
        # held until its ids come back. Pruned by `is_completed()`, which a gloo send never says
        # before it is waited on, they were all kept to the run's end: every step a message of the
        # control plane's capacity per stage (a server's memory growing for as long as it serves)
        # and a scan of them all
        self.published: dict[int, comm.Pending] = {}
        sched.on_token = reports.token

    # ---------------------------------------------------------- requests in (any thread)
    def add(self, request) -> None:
        with self.cond:
            self.sched.add(request)
            self.cond.notify_all()

    def abort(self, index: int) -> bool:
        """Ends a request now (its client went away); False if it is not here (finished already). An
        aborted request's result goes out too (its timing counts in the server's metrics)."""
        with self.cond:
            gone = self.sched.abort(index)
            if gone is not None:
                self.reports.result(gone)
            self.cond.notify_all()
            return gone is not None

    def close(self) -> None:
        with self.cond:
            self.sched.close()
            self.cond.notify_all()

    # ---------------------------------------------------------- the loops
    def take_ids(self, mb_id: int, ids: list[int]) -> None:
        with self.cond:
            finished = self.sched.on_sampled(mb_id, ids)
            # the compute thread's turn starts with its ids, before the scheduler (woken too) can start
            if self.waiting is not None and self.sched.input_ids(self.waiting) is not None:
                self.turn.take()
            self.reports.flush_tokens()          # a request's tokens before its result
            for seq in finished:
                self.reports.result(seq)
            self.cond.notify_all()

    def _next(self) -> Schedule | None:
        """The next schedule to commit (the stop once everything is done), or None after a failure."""
        with self.cond:
            while not self.sched.done:
                if not (self.turn.held and self._underfilled()):    # there, it goes out between forwards
                    schedule = self.sched.next_microbatch()
                    if schedule is not None:
                        schedule.underfilled = self._underfilled()
                        self.reports.microbatch(schedule, self.sched)
                        return schedule
                    self.reports.tick(self.sched)
                self.cond.wait(timeout=0.05)
                if self.errors:
                    return None
            self.reports.tick(self.sched, force=True)
            return self.sched.stop()

    def _underfilled(self) -> bool:
        return self.sched.running() < self.ex.world

    def commit_loop(self) -> None:
        """Commits every micro-batch as soon as the scheduler allows, publishes it, hands it on."""
        while (schedule := self._next()) is not None:
            version = None if schedule.stop else self.versions.take()
            if self.transport is not None:
                self.transport.publish(schedule, self)
            if schedule.stop:
                self.committed.put(None)
                return
            self.committed.put(Work(schedule, version=version))

    def input_ids(self, schedule: Schedule) -> list[int]:
        """Blocks until a decode micro-batch's input ids are back (placeholders filled); the compute
        thread's turn starts with them."""
        with self.cond:
            self.waiting = schedule
            while (ids := self.sched.input_ids(schedule)) is None:
                self.cond.wait(timeout=0.1)
                if self.errors:
                    raise self.errors[0]
            self.waiting = None
            self.turn.take()
            return ids


def run_first_stage(ex: Executors, driver: Driver, sampling: Sampling | None) -> dict:
    """Stage 0: the driver and back threads, the prepare thread, and the compute loop. With one
    stage `sampling` (inline) samples here and hands the ids to the driver."""
    errors, sched, versions = ex.errors, driver.sched, driver.versions
    transport = driver.transport
    threads = [_thread(driver.commit_loop, "hpipe-scheduler", errors)]
    if transport is not None:
        threads.append(_thread(lambda: transport.back_loop(driver), "hpipe-ids", errors))
    ready = _start_prepare(ex, driver.committed)
    pending = comm.Pending()
    wall0 = time.time()
    while True:
        work, t = _next_work(ex, ready)
        if work is None:
            break
        ids = driver.input_ids(work.schedule)
        ex.timeline.add("wait", t, time.time())
        t = time.time()
        out = _forward(ex, work, torch.tensor(ids, dtype=torch.long))
        work.record(ex.timeline, "compute", t)
        if transport is None:
            sampling.submit(work.schedule, out)
        else:
            _send_on(ex, transport, work, out, pending)
        driver.turn.give()
        versions.give_back()
    pending.wait()
    if transport is not None:
        transport.end_hop()
    _join(threads, errors)
    if errors:
        raise errors[0]
    for sends in driver.published.values():       # the stop's, and any whose ids never came (a failure)
        sends.wait()
    return run_summary(sched, wall0)


def run_summary(sched: Scheduler, wall0: float) -> dict:
    """Stage 0's figures of the run, from the compute loop's start."""
    wall = time.time() - wall0
    n = sched.generated
    return {"wall_s": round(wall, 6), "generated_tokens": n, "tokens_per_s": round(n / wall, 3) if wall else None,
            "t0_wall": wall0, **sched.since_start()}


def _send_on(ex: Executors, transport, work: Work, out: torch.Tensor, pending: comm.Pending) -> None:
    t = time.time()
    pending.wait()      # the previous micro-batch's send: one in flight per hop
    transport.send_on(work, out, pending)
    ex.timeline.add("send", t, time.time())


# ---------------------------------------------------------------------------------- stages 1..N-1
def run_later_stage(ex: Executors, sampling: Sampling | None) -> None:
    """Stages 1..N-1: source and prepare threads, the compute loop; the last stage samples."""
    errors, transport = ex.errors, ex.transport
    versions = Versions(errors)
    ready = _start_prepare(ex, Source(ex, versions, ex.modes.turns))
    pending = comm.Pending()
    while True:
        work, t = _next_work(ex, ready)
        if work is None:
            break
        if work.unreceived:
            work.recv = comm.post_recv_hidden(ex.groups, ex.rank - 1, work.hidden)
        if work.recv is not None:
            work.recv.wait()
        ex.timeline.add("wait", t, time.time())
        t = time.time()
        out = _forward(ex, work, work.hidden)
        work.record(ex.timeline, "compute", t)
        if sampling is not None:
            t = time.time()
            sampling.submit(work.schedule, out)
            ex.timeline.add("send", t, time.time())
        else:
            _send_on(ex, transport, work, out, pending)
        versions.give_back()
    pending.wait()
    if sampling is not None:
        sampling.drain()
        transport.end_back()
    else:
        transport.end_hop()
    if errors:
        raise errors[0]
