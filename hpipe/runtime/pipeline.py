"""How a stage runs its micro-batches: the asynchronous runtime (SiPipe's TSEM, SAT and CPU sampling).

Every stage runs the same executors, connected by queues, each micro-batch passing them in order:

    source ──> prepare ──> compute ──> send (hop) / sample (last stage)
    (stage 0: the scheduler; others: the schedule, or the hop without SAT)

- source: on stage 0 the scheduler's driver thread (`Driver`), which commits micro-batches as soon as
  they may start, publishes each schedule to every stage (SAT) and takes the ids that come back; on
  the other stages a thread that receives the schedules (SAT) and posts each micro-batch's receive
  into a preallocated, reused buffer of its version, or that receives header, segments and hidden
  states from the previous stage (without SAT);
- prepare (TSEM): a CPU thread that builds micro-batch i+1's inputs (positions, masks, rotary, KV
  indices, rows to sample) while micro-batch i computes. Two versions: a micro-batch takes a version
  when its source hands it on and gives it back when its forward is done, so at most two are
  prepared or running at once (SiPipe's CI/GI counters) and version v's buffers are never rewritten
  while v computes. Without TSEM the compute thread prepares inline, as the first runtime did;
- compute (the main thread): waits for the data (hidden states, or stage 0's ids), runs the forward,
  hands the output on and takes the next micro-batch at once; no device synchronisation;
- sample (last stage): inline in the loop (`--no-tsem --sampling inline`, the baseline), on a
  sampler thread, or in the sampler process pool (`--sampling cpu`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hpipe.reports import emit
from hpipe.runtime import comm
from hpipe.runtime.kv import PAGE_SIZE, PageTable, Segment, microbatch_kind
from hpipe.runtime.scheduler import MicroBatch, Scheduler
from hpipe.runtime.static_decode import VERSIONS   # one number of input versions for both paths

__all__ = ["Options", "Timeline", "run_first_stage", "run_later_stage"]



@dataclass(frozen=True)
class Options:
    tsem: bool = True          # double-buffered inputs, prepared on a CPU thread; decode steps committed ahead
    prepare_thread: bool = True  # (with tsem) the CPU executor is a thread; else the compute thread prepares
    sat: bool = True           # schedules on the control plane, hidden states alone into pre-posted buffers
    sampling: str = "inline"   # "inline" (in this process) or "cpu" (the sampler process pool)
    cuda_graphs: bool = True   # (CUDA nodes) replay decode steps from captured graphs


class Timeline:
    """Measured intervals of one stage: compute, prepare, wait, send, sample. Threads append.
    `bounded` (serving, which runs for hours) keeps the latest 100,000."""

    def __init__(self, bounded: bool = False):
        self.intervals = collections.deque(maxlen=100_000 if bounded else None)

    def add(self, what: str, start: float, end: float, mb: int | None = None, kind: str | None = None,
            tokens: int | None = None):
        rec = {"what": what, "start": start, "end": end}
        if mb is not None:
            rec.update(mb=mb, kind=kind, tokens=tokens)
        self.intervals.append(rec)


@dataclass
class Stage:
    """What the executors of one stage share."""

    rank: int
    world: int
    runner: object                   # hpipe.runtime.stage.StageRunner
    groups: comm.Groups | None
    options: Options
    timeline: Timeline
    max_segments: int                # the schedule's capacity: segments
    max_tokens: int                  # the longest micro-batch (the receive buffers' rows)
    max_pages: int = 0               # the schedule's capacity: KV pages a micro-batch adds
    page_size: int = PAGE_SIZE
    buffers: list = field(default_factory=list)   # per version: the hidden states' receive buffer
    static: object = None            # hpipe.runtime.static_decode.StaticDecode for decode micro-batches, or None
    errors: list = field(default_factory=list)    # the first failure of any executor (or the sampler pool)
    pages: PageTable | None = None   # stages 1..N-1: the page table the schedule's segments extend

    def __post_init__(self):
        if self.pages is None:
            self.pages = PageTable(self.page_size)
        if not self.max_pages:
            self.max_pages = comm.schedule_pages(self.max_tokens, self.max_segments, self.page_size)

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

    mb_id: int
    segments: list[Segment]
    mb: MicroBatch | None = None          # stage 0: the scheduler's micro-batch (its ids)
    version: int = 0
    hidden: torch.Tensor | None = None    # the received hidden states (or the buffer they arrive in)
    recv: object = None                   # the pending receive of `hidden`
    unreceived: bool = False              # `hidden` is a buffer the compute thread must receive into
    inputs: object = None                 # the prepared StageInputs
    static: tuple | None = None           # or the static decode path's handle (its buffers are filled)
    prepared: bool = False
    events: list = field(default_factory=list)   # serving, last stage: requests that join or leave before it

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def kind(self) -> str:
        return microbatch_kind(self.segments)


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


def _prepare(stage: Stage, work: Work) -> None:
    t = time.time()
    with torch.inference_mode():
        if stage.static is not None and stage.static.accepts(work.segments):
            work.static = stage.static.prepare(work.segments, work.version)
        else:
            work.inputs = stage.runner.prepare_inputs(work.segments)
    work.prepared = True
    stage.timeline.add("prepare", t, time.time(), work.mb_id, work.kind, work.tokens)


def _forward(stage: Stage, work: Work, x: torch.Tensor) -> torch.Tensor:
    if work.static is not None:
        with torch.inference_mode():
            return stage.static.run(work.static, x)
    return stage.runner.forward(work.inputs, x)


def _next_work(stage: Stage, ready: queue.Queue, errors: list) -> tuple[Work | None, float]:
    """The compute thread's next micro-batch, prepared (here, without a CPU executor thread), or None
    at the stop; and the time its wait for data starts."""
    t = time.time()
    work = _get(ready, errors)
    if work is not None and not work.prepared:
        stage.timeline.add("wait", t, time.time())
        _prepare(stage, work)
        t = time.time()
    return work, t


def _start_prepare(stage: Stage, source: queue.Queue, errors: list) -> queue.Queue:
    """TSEM: the CPU executor. Without TSEM the compute loop prepares inline (same queue)."""
    if not (stage.options.tsem and stage.options.prepare_thread):
        return source
    ready: queue.Queue = queue.Queue()

    def loop():
        while True:
            work = _get(source, errors)
            if work is not None:
                _prepare(stage, work)
            ready.put(work)
            if work is None:
                return
    _thread(loop, "hpipe-prepare", errors)
    return ready


# ---------------------------------------------------------------------------------- stage 0
class Driver:
    """Stage 0's control plane: the scheduler, the requests coming in (serving), the ids coming
    back, the schedules going out."""

    def __init__(self, stage: Stage, sched: Scheduler, on_result: Callable, on_tokens: Callable | None = None,
                 on_stats: Callable | None = None):
        self.stage, self.sched, self.on_result = stage, sched, on_result
        self.on_tokens, self.on_stats = on_tokens, on_stats
        self.errors = stage.errors
        self.versions = Versions(self.errors)
        self.cond = threading.Condition()
        self.committed: queue.Queue = queue.Queue()     # to prepare/compute, in order
        self.expected: queue.Queue = queue.Queue()      # SAT: micro-batches whose ids come back, in order
        self.pending = comm.Pending()
        self.events: list = []                          # serving: ("admit", Request) / ("release", seq) to deliver
        self.new_tokens: list = []
        self.microbatches: list = []                    # (t, decode tokens, prefill tokens) since the last stats
        self.t_stats = 0.0
        if on_tokens is not None:
            sched.on_token = lambda st, token: self.new_tokens.append((st.request.id, token))

    # ---------------------------------------------------------- requests in (any thread)
    def add(self, request) -> None:
        with self.cond:
            self.sched.add(request)
            self.events.append(("admit", request))
            self.cond.notify_all()

    def abort(self, index: int) -> bool:
        """Ends a request now (its client went away); False if it is not here (finished already)."""
        with self.cond:
            gone = self.sched.abort(index)
            if gone is not None:
                self.events.append(("release", index))
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
            if self.new_tokens:
                self.on_tokens(self.new_tokens)
                self.new_tokens = []
            for st in finished:
                self.on_result(st)
            self.cond.notify_all()

    def _report(self, force: bool = False) -> None:
        now = time.time()
        if self.on_stats is not None and (force or now - self.t_stats >= 0.25):
            self.t_stats = now
            self.on_stats({**self.sched.stats(), "microbatches": self.microbatches})
            self.microbatches = []

    def commit_loop(self) -> None:
        """Commits every micro-batch as soon as the scheduler allows, publishes it, hands it on."""
        st = self.stage
        while True:
            with self.cond:
                while True:
                    if self.sched.done:
                        mb = None
                        break
                    mb = self.sched.next_microbatch()
                    if mb is not None:
                        break
                    self._report()
                    self.cond.wait(timeout=0.05)
                    if self.errors:
                        return
                events, self.events = self.events, []
                if mb is not None and self.on_stats is not None:
                    decode = sum(s.length for s in mb.segments if not s.prefill)
                    self.microbatches.append((round(time.time(), 4), decode,
                                              sum(s.length for s in mb.segments) - decode))
                    self._report()
            if st.world > 1:
                self.pending.prune()
                for kind, what in events:    # before the first schedule that needs them
                    if kind == "admit":
                        comm.publish_admit(st.groups, st.world - 1, what, st.max_segments, st.max_pages, self.pending)
                    else:
                        comm.publish_release(st.groups, st.world - 1, what, st.max_segments, st.max_pages,
                                             self.pending)
            if mb is None:
                self._report(force=True)
                if st.options.sat and st.world > 1:
                    comm.publish_schedule(st.groups, st.world, -1, None, st.max_segments, st.max_pages,
                                          st.page_size, self.pending)
                    self.expected.put(None)
                self.committed.put(None)
                return
            version = self.versions.take()
            if st.options.sat and st.world > 1:
                comm.publish_schedule(st.groups, st.world, mb.id, mb.segments, st.max_segments, st.max_pages,
                                      st.page_size, self.pending)
                self.expected.put(mb)
            self.committed.put(Work(mb.id, mb.segments, mb=mb, version=version,
                                    events=events if st.world == 1 else []))

    def back_loop(self) -> None:
        """The ids the last stage sends back: with SAT alone, in the order of the schedule."""
        st = self.stage
        while True:
            if st.options.sat:
                mb = _get(self.expected, self.errors)
                if mb is None:
                    return
                n = sum(1 for s in mb.segments if s.sample)
                _, _, ids = comm.recv_tokens(st.groups, st.world - 1, n)
                self.take_ids(mb.id, ids)
            else:
                op, mb_id, ids = comm.recv_tokens(st.groups, st.world - 1)
                if op == comm.OP_STOP:
                    return
                self.take_ids(mb_id, ids)

    def input_ids(self, mb: MicroBatch) -> list[int]:
        """Blocks until a decode micro-batch's input ids are back (placeholders filled)."""
        with self.cond:
            while (ids := self.sched.input_ids(mb)) is None:
                self.cond.wait(timeout=0.1)
                if self.errors:
                    raise self.errors[0]
            return ids


def run_first_stage(stage: Stage, driver: Driver, sample: Callable, apply_events: Callable | None = None) -> dict:
    """Stage 0: the driver and back threads, the prepare thread, and the compute loop. With one
    stage, `apply_events` hands the sampler the requests that join or leave before a micro-batch."""
    errors = stage.errors
    sched, versions = driver.sched, driver.versions
    threads = [_thread(driver.commit_loop, "hpipe-scheduler", errors)]
    if stage.world > 1:
        threads.append(_thread(driver.back_loop, "hpipe-ids", errors))
    ready = _start_prepare(stage, driver.committed, errors)
    pending = comm.Pending()
    wall0 = time.time()
    while True:
        work, t = _next_work(stage, ready, errors)
        if work is None:
            break
        ids = driver.input_ids(work.mb)
        stage.timeline.add("wait", t, time.time())
        t = time.time()
        out = _forward(stage, work, torch.tensor(ids, dtype=torch.long))
        stage.timeline.add("compute", t, time.time(), work.mb_id, work.kind, work.tokens)
        if stage.world == 1:
            if work.events and apply_events is not None:
                apply_events(work.events)
            driver.take_ids(work.mb_id, sample(out, work.segments))
        else:
            _send_on(stage, work, out, pending)
        versions.give_back()
    pending.wait()
    if stage.world > 1 and not stage.options.sat:
        comm.send_stop(stage.groups, 1)
    for th in threads:
        while th.is_alive():
            th.join(timeout=0.1)
            if errors:
                raise errors[0]
    if errors:
        raise errors[0]
    driver.pending.wait()
    wall = time.time() - wall0
    n = sched.generated
    return {"wall_s": round(wall, 6), "generated_tokens": n, "tokens_per_s": round(n / wall, 3) if wall else None,
            "t0_wall": wall0, "preemptions": sched.preemptions}


def _send_on(stage: Stage, work: Work, out: torch.Tensor, pending: comm.Pending) -> None:
    t = time.time()
    pending.wait()      # the previous micro-batch's send: one in flight per hop
    if stage.options.sat:
        comm.send_hidden(stage.groups, stage.rank + 1, out, pending)
    else:
        comm.isend_work(stage.groups, stage.rank + 1, work.mb_id, work.segments, out, stage.page_size, pending)
    stage.timeline.add("send", t, time.time())


# ---------------------------------------------------------------------------------- stages 1..N-1
def _source_loop(stage: Stage, versions: Versions, out: queue.Queue, errors: list) -> None:
    """Receives what comes next: with SAT the schedule, then posts the hidden states' receive into
    the version's buffer; without SAT header, segments and hidden states from the previous stage."""
    prev = stage.rank - 1
    pre_post = stage.groups.backend == "gloo"     # NCCL receives are posted by the compute thread
    while True:
        if stage.options.sat:
            events: list = []
            mb_id, segments = comm.recv_schedule(stage.groups, stage.max_segments, stage.max_pages, stage.pages,
                                                 events)
            if segments is None:
                out.put(None)
                return
            version = versions.take()
            work = Work(mb_id, segments, version=version, events=events)
            work.hidden = stage.buffers[version][: work.tokens]
            if pre_post:
                work.recv = comm.post_recv_hidden(stage.groups, prev, work.hidden)
            else:
                work.unreceived = True
        else:
            mb_id, segments, hidden = comm.recv_work(stage.groups, prev, stage.runner.hidden_size, stage.runner.dtype,
                                                     stage.pages, receive_hidden=pre_post)
            if segments is None:
                out.put(None)
                return
            work = Work(mb_id, segments, version=versions.take(), hidden=hidden, unreceived=not pre_post)
        out.put(work)


class Sampling:
    """The last stage's sampling: inline, on a sampler thread, or in the process pool."""

    def __init__(self, stage: Stage, sample: Callable, rows_of: Callable, pool, errors: list,
                 apply_events: Callable | None = None):
        self.stage, self.sample, self.rows_of, self.pool, self.errors = stage, sample, rows_of, pool, errors
        self.apply_events = apply_events     # serving: requests that join or leave, in the schedule's order
        self.queue: queue.Queue | None = None
        self.thread = None
        if pool is None and stage.options.tsem:
            self.queue = queue.Queue()
            self.thread = _thread(self._loop, "hpipe-sampler", errors)

    def _send(self, mb_id: int, ids: list[int]) -> None:
        comm.send_tokens(self.stage.groups, 0, mb_id, ids, self.stage.options.sat)

    def _sample_and_send(self, mb_id: int, out: torch.Tensor, segments: list[Segment], events: list) -> None:
        if events and self.apply_events is not None:
            self.apply_events(events)
        t = time.time()
        ids = self.sample(out, segments)
        self.stage.timeline.add("sample", t, time.time())
        self._send(mb_id, ids)

    def _loop(self) -> None:
        while (item := _get(self.queue, self.errors)) is not None:
            self._sample_and_send(*item)

    def submit(self, mb_id: int, out: torch.Tensor, segments: list[Segment], events: list) -> None:
        if self.pool is not None:
            if events and self.apply_events is not None:   # queued to the pool's processes before the rows
                self.apply_events(events)
            self.pool.submit(mb_id, out, self.rows_of(out, segments))
        elif self.queue is not None:
            self.queue.put((mb_id, out, segments, events))
        else:
            self._sample_and_send(mb_id, out, segments, events)

    def finish(self) -> None:
        if self.pool is not None:
            self.pool.drain()
        elif self.queue is not None:
            self.queue.put(None)
            while self.thread.is_alive():
                self.thread.join(timeout=0.1)
                if self.errors:
                    raise self.errors[0]
        if not self.stage.options.sat:
            comm.send_stop(self.stage.groups, 0, tag=comm.TAG_BACK)


def run_later_stage(stage: Stage, sample: Callable, rows_of: Callable, pool=None,
                    apply_events: Callable | None = None) -> None:
    """Stages 1..N-1: source and prepare threads, the compute loop; the last stage samples."""
    errors = stage.errors
    versions = Versions(errors)
    source: queue.Queue = queue.Queue()
    _thread(lambda: _source_loop(stage, versions, source, errors), "hpipe-source", errors)
    ready = _start_prepare(stage, source, errors)
    sampling = Sampling(stage, sample, rows_of, pool, errors, apply_events) if stage.is_last else None
    pending = comm.Pending()
    while True:
        work, t = _next_work(stage, ready, errors)
        if work is None:
            break
        if work.unreceived:
            work.recv = comm.post_recv_hidden(stage.groups, stage.rank - 1, work.hidden)
        if work.recv is not None:
            work.recv.wait()
        stage.timeline.add("wait", t, time.time())
        t = time.time()
        out = _forward(stage, work, work.hidden)
        stage.timeline.add("compute", t, time.time(), work.mb_id, work.kind, work.tokens)
        if sampling is not None:
            t = time.time()
            sampling.submit(work.mb_id, out, work.segments, work.events)
            stage.timeline.add("send", t, time.time())
        else:
            _send_on(stage, work, out, pending)
        versions.give_back()
    pending.wait()
    if sampling is not None:
        sampling.finish()
    elif not stage.options.sat:
        comm.send_stop(stage.groups, stage.rank + 1)
    if errors:
        raise errors[0]


def emit_result(st, t0: float) -> None:
    """One finished request, on stdout for the launcher."""
    n = len(st.output)
    t0 = st.t_admit if t0 is None else t0
    ttft, e2e = st.t_first - t0, st.t_last - t0
    emit("result", id=st.request.id, output_ids=st.output, finish_reason=st.finish_reason,
         prompt_tokens=len(st.request.input_ids), ttft_s=round(ttft, 6),
         tpot_s=round((st.t_last - st.t_first) / (n - 1), 6) if n > 1 else 0.0,
         e2e_s=round(e2e, 6), tokens_per_s=round(n / e2e, 3) if e2e > 0 else None)
