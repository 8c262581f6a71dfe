"""The pipeline as a service: the stage workers started as `hpipe launch` starts them (local
processes, or hosts over SSH with the same preflight, host keys and teardown), in serving mode:
requests go to stage 0 as `hpipe.protocol` ops on its stdin, tokens come back as reports on its
stdout as they are sampled.

`PipelineClient` is what the HTTP front end (`hpipe.launcher.api`) talks to; it knows nothing of
HTTP: `submit_request()` turns a request into a `Handle` whose events arrive on the caller's
asyncio loop, as the request's `RequestOutput` assembles them from the stages' reports (text with
its log-probabilities, the end, an error: launcher/output.py); `abort()` ends one at once (its KV
pages are freed by stage 0's scheduler); `stats` and `metrics` are what /metrics shows. A request's index is its one key, from
the handler to the sampler.

When a stage fails on a cluster (`Elastic`, chosen once at the start), its host is lost: the
pipeline is planned again over the hosts still up and started, and every open request resumes
where it stood (`Request.output_ids`: the tokens its client has; its stream stays open); a lost
host that answers again is taken back when that is predicted faster (launcher/elastic.py). When the
hosts up cannot hold the model, open requests end with the cause, new ones get it (`degraded`),
and the service waits for a host to return. Without a cluster (local stages), a failure ends every
open request with the launcher's one-line cause and `failure` holds it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field

from hpipe import formats, models, protocol
from hpipe.errors import HpipeError
from hpipe.launcher.cluster import start_cluster
from hpipe.launcher.elastic import Elastic, Recovery
from hpipe.launcher.jobs import HEARTBEAT_TIMEOUT_S, LaunchSettings, PreparedJob, StageReports
from hpipe.launcher.local import start_local
from hpipe.launcher.output import RequestOutput
from hpipe.request import Request, SamplingParams

__all__ = ["MAX_QUEUE", "Handle", "Metrics", "PipelineClient"]

MAX_QUEUE = 256          # requests waiting beyond the running batch before a 429 (--max-queue)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class Handle:
    """One request in flight. Its events go to `queue` on `loop`, as its `RequestOutput` makes them
    (launcher/output.py): ("text", piece, entries), then ("finish", reason, entries) or ("error",
    message, ()). A request submitted without an output (a batch job's, which reads `result`) gets
    ("finish", stage 0's reason, ()) alone, or the error."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    output: RequestOutput | None = None
    result: protocol.Result | None = None       # stage 0's report of its end (timings)
    started: asyncio.Event = field(default_factory=asyncio.Event)   # its first token, its end or an error came
    tokens: list[int] = field(default_factory=list)   # what stage 0 reported it generated (a resume's start)
    sent: bool = False                          # stage 0 of the running pipeline has it
    lost: bool = False                          # a pipeline that failed had it: it resumes on the next

    def put(self, events: list[tuple], started: bool = False) -> None:
        if (events or started) and not self.loop.is_closed():   # its reader is gone (a batch job that stopped)
            self.loop.call_soon_threadsafe(self._arrive, events)

    def _arrive(self, events: list[tuple]) -> None:
        for event in events:
            self.queue.put_nowait(event)
        self.started.set()

    @property
    def done(self) -> bool:
        return self.output is None or self.output.done


def metric(name: str, kind: str, text: str, value, labels: str = "") -> list[str]:
    """One Prometheus metric: its HELP and TYPE lines and its sample."""
    sample = f"{name}{{{labels}}}" if labels else name
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{sample} {value}"]


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """The q-quantile as Prometheus's histogram_quantile() reads it from these buckets: linear
        within the bucket it falls in (the largest bound past the last). None before any value."""
        if not self.count:
            return None
        rank, lower, below = q * self.count, 0.0, 0
        for bound, count in zip(self.buckets, self.counts):
            if count >= rank:
                return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
            lower, below = bound, count
        return float(self.buckets[-1])

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        out += [f"{name}_sum{{{labels}}} {self.sum:.6f}" if labels else f"{name}_sum {self.sum:.6f}",
                f"{name}_count{{{labels}}} {self.count}" if labels else f"{name}_count {self.count}"]
        return out


@dataclass
class Metrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    microbatch_tokens: Histogram = field(default_factory=lambda: Histogram(TOKENS_BUCKETS))
    finished: collections.Counter = field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    rejected: int = 0
    resumed: int = 0                                       # requests resumed on a new pipeline
    microbatches: collections.deque = field(default_factory=lambda: collections.deque(maxlen=50_000))
    events: list[Recovery] = field(default_factory=list)   # hosts lost and taken back, with their phases


class ServeOutput(StageReports):
    """The workers' reports while serving: tokens, results, stats and readiness go to the client;
    timelines, the summary and errors are kept as for a batch job."""

    def __init__(self, client: PipelineClient):
        super().__init__()
        self.client = client
        self.results = 0
        self.handlers = {protocol.Tokens: client.on_tokens, protocol.Result: client.on_result,
                         protocol.Stats: client.on_stats, protocol.Ready: client.on_ready,
                         protocol.Logprobs: client.on_logprobs,
                         protocol.Rejected: client.on_rejected}

    def done_line(self) -> str:
        return f"{self.results} requests had been answered"

    def take_report(self, report) -> None:
        if isinstance(report, protocol.Result):
            self.results += 1
        handler = self.handlers.get(type(report))
        if handler is not None:
            handler(report)


class PipelineClient:
    def __init__(self, job: PreparedJob, plan_path: str, settings: LaunchSettings, inventory=None,
                 accept_new_keys: bool = False, push: bool = False, host_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 max_queue: int = MAX_QUEUE, log=None, quiet: bool = True, threads: int | None = None, seat=None,
                 recover: bool = True):
        self.job, self.plan_path, self.settings, self.inventory = job, plan_path, settings, inventory
        self.checked: set[str] = set()        # hosts whose whole preflight passed (a restart checks them lightly)
        self.launch_kwargs = dict(accept_new_keys=accept_new_keys, push=push, host_timeout_s=host_timeout_s,
                                  checked=self.checked)
        self.max_queue = max_queue
        self.log, self.quiet = log or (lambda msg: None), quiet
        self.threads = threads                 # CPU threads of a local stage (None: the cores shared by its stages)
        self.seat = seat                       # a SiDP replica's hpipe.launcher.jobs.GroupSeat, or None
        self.eos = frozenset()
        self.lock = threading.Lock()
        self.open: dict[int, Handle] = {}      # by request index
        self.logprob_readers: dict[int, Handle] = {}   # outputs waiting for log-probabilities (they may come after the end)
        self.next_index = itertools.count()
        self.launch = None                     # the started pipeline (hpipe.launcher.jobs.Launch)
        self.plan: formats.Plan | None = None  # the running pipeline's plan (another after a recovery)
        self._kv_bytes: tuple = (None, 0)       # (plan, a token's KV bytes over its stages)
        self.ready = threading.Event()
        self.accepting = False                 # stage 0 of the running pipeline takes requests now
        self.info: protocol.Ready | None = None
        self.stats: dict = {}
        self.metrics = Metrics()
        self.failure: str | None = None
        self.stopped = threading.Event()       # the workers have ended (any reason)
        self.on_failure = None                 # called once, from the launch thread, with the cause
        self.output = ServeOutput(self)
        self.thread: threading.Thread | None = None
        self.closing = False                   # close() or stop() asked: the end is not a failure
        self.elastic = (Elastic(self, inventory, accept_new_keys) if inventory is not None and recover
                        else None)

    @property
    def degraded(self) -> str | None:
        """Why the hosts up cannot serve the model now (None: they can, or no cluster)."""
        return self.elastic.degraded if self.elastic is not None else None

    # ------------------------------------------------------------------ life cycle
    def start(self, timeout_s: float = 600.0) -> None:
        """Starts every stage and waits until stage 0 is ready (the KV pool agreed and allocated)."""
        self.eos = frozenset(models.eos_token_ids(self.job.source.path, self.job.config))
        self.thread = threading.Thread(target=self._run, name="hpipe-serve", daemon=True)
        self.thread.start()
        deadline = time.time() + timeout_s
        while not self.ready.wait(0.1):
            if self.stopped.is_set():
                raise HpipeError(self.failure or "the pipeline stopped before it was ready")
            if time.time() > deadline:
                self.stop()
                raise HpipeError(f"the pipeline was not ready after {timeout_s:g} s")

    def _run(self) -> None:
        plan_path = self.plan_path
        try:
            while True:
                error = self._run_pipeline(plan_path)
                if self.closing:
                    return
                if self.elastic is None or not self.ready.is_set():   # no cluster, or it never started
                    self._fail(" ".join(str(error).split()))
                    return
                try:
                    plan_path = self.elastic.next_plan(error)
                except Exception as e:  # noqa: BLE001 - the service cannot go on: every request gets the cause
                    self._fail(str(e) if isinstance(e, HpipeError) else f"{type(e).__name__}: {e}")
                    return
                if plan_path is None:           # closed while it waited for a host
                    return
        finally:
            self.stopped.set()

    def _run_pipeline(self, plan_path: str) -> HpipeError:
        """Starts the plan's stages and serves until they end; returns why they ended."""
        try:
            plan = self.job.plan if plan_path == self.plan_path else formats.load_plan(plan_path)
            job = dataclasses.replace(self.job, plan=plan)
            self.plan = plan
            self.output.restart()
            if self.inventory is not None:
                self.launch = start_cluster(job, plan_path, self.inventory, self.settings, self.output,
                                            log=self.log, quiet=self.quiet, **self.launch_kwargs)
            else:
                self.launch = start_local(job, plan_path, self.settings, self.output, log=self.log,
                                          quiet=self.quiet, threads=self.threads, seat=self.seat)
            if self.closing:         # closed while the stages were starting
                self.launch.stop()
            self.launch.wait()
            return HpipeError("the pipeline stopped")
        except HpipeError as e:
            return e
        except Exception as e:  # noqa: BLE001 - reported like a stage failure
            return HpipeError(f"{type(e).__name__}: {e}")
        finally:
            with self.lock:                   # what it had is resumed on the next one
                self.accepting = False
                for h in self.open.values():
                    h.lost, h.sent = h.lost or h.sent, False
            self._expire(float("inf"))        # entries a lost last stage owed do not come

    def _send(self, op) -> bool:
        return self.launch is not None and self.launch.send(op)

    def _fail(self, cause: str) -> None:
        with self.lock:
            if self.failure is not None or self.closing:
                return
            self.failure = cause
        self.end_open(cause)
        if self.on_failure is not None:
            self.on_failure(cause)

    def while_serving(self, launch, act) -> bool:
        """Runs `act()` under the client's lock where `launch` is the pipeline serving and it takes
        requests (no failure or switch can begin meanwhile): its answer, or False otherwise."""
        with self.lock:
            return self.launch is launch and self.accepting and act()

    def end_open(self, cause: str) -> None:
        """Every open request ends with `cause`."""
        with self.lock:
            handles = list(self.open.values())
            ended = [h for i, h in self.logprob_readers.items() if i not in self.open]
            self.open.clear()
            self.logprob_readers.clear()
        if self.elastic is not None:
            self.elastic.tokens([h.request.index for h in handles])     # not waited for any more
        for h in handles:
            h.put(h.output.error(cause) if h.output else [("error", cause, ())])
        for h in ended:           # it ended at stage 0: its answer goes out with the entries that came
            h.put(h.output.expire(float("inf")))

    def close(self) -> None:
        """Ends the service: open requests are aborted and every worker is stopped."""
        self.closing = True
        if self.elastic is not None:
            self.elastic.close()
        with self.lock:
            handles = list(self.open.values()) + [h for i, h in self.logprob_readers.items() if i not in self.open]
            self.open.clear()
            self.logprob_readers.clear()
        for h in handles:     # the reader ends at the error (the outputs are the report thread's alone)
            h.put([("error", "the server is shutting down", ())])
        if self.launch is not None:      # the aborts first: stage 0 stops reading at Close
            for h in handles:
                self._send(protocol.Abort(h.request.index))
            self._send(protocol.Close())
        if self.thread is not None:
            self.thread.join(timeout=20)
        if self.thread is not None and self.thread.is_alive():
            self.stop()

    def reload_inventory(self, path: str) -> None:
        """SIGHUP: the inventory read again; hosts added to it join when they answer (launcher/elastic.py)."""
        try:
            inventory = formats.load_inventory(path)
        except HpipeError as e:
            self.log(f"hpipe: SIGHUP: {e}; the inventory in use is kept")
            return
        if self.elastic is None:
            self.log("hpipe: SIGHUP: hosts join a running pipeline only with --cluster and --recover")
            return
        added = self.elastic.add_hosts(inventory)
        self.log(f"hpipe: SIGHUP: {path} read again: " + (f"{', '.join(added)} added; each joins once its sshd "
                 f"answers and the plan with it is predicted faster" if added else "no host added"))

    def stop(self) -> None:
        self.closing = True
        if self.elastic is not None:
            self.elastic.close()
        if self.launch is not None:
            self.launch.stop()

    # ------------------------------------------------------------------ requests
    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len if self.info else 0

    @property
    def max_batch(self) -> int:
        return self.info.max_batch if self.info else self.settings.runtime.max_batch

    @property
    def prefix_caching(self) -> bool:
        return self.settings.runtime.prefix_caching == "on"

    @property
    def capacity(self) -> int:
        """Requests open at once before a 429: the running batch and the queue behind it."""
        return self.max_batch + self.max_queue

    def load(self) -> int:
        with self.lock:
            return len(self.open)

    def health(self) -> tuple[int, dict]:
        """/health's status code and body: failed or degraded (503), serving or recovering (200)."""
        if self.failure is not None:
            return 503, {"status": "failed", "error": self.failure}
        if self.degraded is not None:
            return 503, {"status": "degraded", "error": self.degraded}
        return 200, {"status": "ok" if self.accepting else "recovering"}

    def request(self, input_ids: list[int], params: SamplingParams, max_tokens: int, stop_ids: frozenset[int],
                ignore_eos: bool) -> Request:
        """A request of this pipeline's model (its EOS ids unless `ignore_eos`), not yet indexed.
        The caller has checked the lengths against `max_model_len` and the queue against `capacity`."""
        return Request(0, "", tuple(input_ids), params, max_tokens, frozenset() if ignore_eos else self.eos, stop_ids)

    def submit_request(self, request: Request, loop: asyncio.AbstractEventLoop,
                       output: RequestOutput | None = None) -> Handle:
        """Queues a request as it is (sampling, seed, stops), under this pipeline's next index;
        `output` assembles what it answers (None: the end alone). Raises HpipeError when the
        pipeline failed."""
        index = next(self.next_index)
        request = dataclasses.replace(request, index=index, id=request.id or f"req-{index}")
        if request.params.seed is None:   # its own, so that a resume draws what it would have drawn
            request = dataclasses.replace(request, params=dataclasses.replace(request.params,
                                                                                seed=secrets.randbits(63)))
        handle = Handle(request, loop, asyncio.Queue(), output, tokens=list(request.output_ids))
        with self.lock:
            if self.failure is not None:
                raise HpipeError(self.failure)
            if self.degraded is not None:
                raise HpipeError(f"the service is degraded: {self.degraded}")
            self.open[index] = handle
            if output is not None and (request.params.logprobs is not None
                                       or request.params.prompt_logprobs is not None):
                self.logprob_readers[index] = handle
            launch, handle.sent = self.launch, self.accepting   # else the pipeline being started takes it
        self.metrics.prompt_tokens += len(request.input_ids)
        if handle.sent and not launch.send(protocol.Add(request)) and self.elastic is None:
            with self.lock:           # the stage's own cause follows from the launcher
                self.open.pop(index, None)
                self.logprob_readers.pop(index, None)
            raise HpipeError("stage 0 no longer takes requests")
        return handle

    def abort(self, handle: Handle, reason: str = "abort") -> None:
        """Ends a request now (its client went away, or a stop string matched: `reason` "stop"):
        stage 0 frees its KV pages. A request that ended already is left as it is."""
        with self.lock:
            live = self.open.pop(handle.request.index, None) is not None
            self.logprob_readers.pop(handle.request.index, None)
        if self.elastic is not None:
            self.elastic.tokens([handle.request.index])     # not waited for any more
        if live:
            self.metrics.finished[reason] += 1
            self._send(protocol.Abort(handle.request.index))

    # ------------------------------------------------------------------ reports (the launch thread)
    def on_ready(self, ready: protocol.Ready) -> None:
        self.info = ready
        resumed = self._resubmit()
        if self.elastic is not None:
            self.elastic.ready(resumed)
        self.ready.set()

    def _resubmit(self) -> list[int]:
        """A new pipeline is ready: every open request goes to its stage 0, those a lost pipeline had
        resumed after the tokens their clients have (their streams go on). Returns their indices."""
        ops, ended, resumed = [], [], []
        with self.lock:
            for h in sorted(self.open.values(), key=lambda h: h.request.index):
                if h.sent:
                    continue
                request, reason = self._resumed(h)
                if reason is not None:       # it had every token: its end was lost with the pipeline
                    ended.append((h, reason))
                    continue
                if h.lost:
                    resumed.append(h.request.index)
                h.sent, h.lost = True, False
                ops.append(protocol.Add(request))
            for h, _ in ended:
                self.open.pop(h.request.index, None)
            for op in ops:          # under the lock: an abort that comes now follows its request's add
                self.launch.send(op)
            self.accepting = True
        for h, reason in ended:
            self.metrics.finished[reason] += 1
            h.put(h.output.finish(reason) if h.output else [("finish", reason, ())])
            self._settle([h])
        return resumed

    @staticmethod
    def _resumed(h: Handle) -> tuple[Request, str | None]:
        """The request to send again for `h` (after the tokens its output took; tokens still waiting
        for their log-probabilities come again), or its end when it had them all."""
        request = h.request
        if h.output is not None:
            h.tokens = h.tokens[:h.output.rewind()]
            if request.params.prompt_logprobs is not None and not h.output.prompt_pending:
                request = dataclasses.replace(request, params=dataclasses.replace(request.params, prompt_logprobs=None))
        if not h.tokens:
            return request, None
        reason = request.finish_reason(h.tokens[-1], len(h.tokens))
        return (request, reason) if reason else (request.resumed(h.tokens), None)

    def on_tokens(self, tokens: protocol.Tokens) -> None:
        with self.lock:
            taken = [(h, token) for index, token in tokens.items if (h := self.open.get(index)) is not None]
        self.metrics.generation_tokens += len(taken)
        for h, token in taken:        # the report thread alone feeds the outputs: no lock held while decoding
            h.tokens.append(token)
            h.put(h.output.token(token) if h.output else [], started=True)
        if self.elastic is not None:
            self.elastic.tokens(index for index, _ in tokens.items)
        self._stopped([h for h, _ in taken])

    def on_logprobs(self, report: protocol.Logprobs) -> None:
        with self.lock:
            taken = [(kind, h, entry) for kind, entries in (("logprob", report.entries), ("prompt_logprob", report.prompt))
                     for index, *entry in entries if (h := self.logprob_readers.get(index)) is not None]
        for kind, h, entry in taken:
            h.put(h.output.logprob(entry) if kind == "logprob" else h.output.prompt_logprob(entry))
        self._settle([h for _, h, _ in taken])

    def _stopped(self, handles: list[Handle]) -> None:
        """A stop string ended these (on a token or on its late entry): stage 0 frees their pages now."""
        for h in {id(h): h for h in handles if h.output is not None and h.output.stopped}.values():
            self.abort(h, "stop")

    def _settle(self, handles: list[Handle]) -> None:
        """After their outputs were fed: the stopped ones aborted, the ended ones waiting for nothing more."""
        self._stopped(handles)
        with self.lock:
            for h in handles:
                if h.done:
                    self.logprob_readers.pop(h.request.index, None)

    def on_result(self, result: protocol.Result) -> None:
        """A request's end, and its timing as stage 0 measured it (aborted ones too: the metrics)."""
        if result.ttft_s is not None:
            self.metrics.ttft.observe(result.ttft_s)
            if len(result.output_ids) > 1:
                self.metrics.tpot.observe(result.tpot_s)
        reason = result.finish_reason or "stop"
        with self.lock:
            h = self.open.pop(result.index, None)
        if h is None:
            return
        h.result = result
        self.metrics.finished[reason] += 1
        h.put(h.output.finish(reason) if h.output else [("finish", reason, ())])
        self._settle([h])

    def on_rejected(self, rejected: protocol.Rejected) -> None:
        with self.lock:
            h = self.open.pop(rejected.index, None)
            self.logprob_readers.pop(rejected.index, None)
        if self.elastic is not None:
            self.elastic.tokens([rejected.index])
        self.metrics.rejected += 1
        if h is not None:
            h.put(h.output.error(rejected.message) if h.output else [("error", rejected.message, ())])

    def on_stats(self, stats: protocol.Stats) -> None:
        """Stage 0's counters (every 0.25 s): also when ended requests stop waiting for entries."""
        self._expire(time.monotonic())
        for t, decode, prefill in stats.microbatches:
            self.metrics.microbatch_tokens.observe(decode + prefill)
            self.metrics.microbatches.append((t, decode, prefill))
        self.stats = {k: v for k, v in protocol.as_dict(stats).items() if k != "microbatches"}

    def _expire(self, now: float) -> None:
        with self.lock:
            waiting = list(self.logprob_readers.values())
        for h in waiting:
            h.put(h.output.expire(now))
        self._settle(waiting)

    # ------------------------------------------------------------------ /metrics
    def kv_bytes_per_token(self) -> int:
        """What one token's KV cache takes over the running plan's stages (the planner's memory model)."""
        plan = self.plan or self.job.plan
        if self._kv_bytes[0] is not plan:
            table = models.unit_bytes(self.job.config, plan.dtype, plan.weights, plan.kv_dtype)
            self._kv_bytes = (plan, sum(table.kv_per_token_per_unit))
        return self._kv_bytes[1]

    def pages_free(self) -> int:
        """Stage 0's free KV pages (the whole pool before its first stats)."""
        return self.stats.get("pages_free", self.info.kv_pages if self.info else 0)

    def prometheus(self) -> str:
        s, m = self.stats, self.metrics
        lines = [
            "# HELP hpipe_requests_waiting Requests queued at stage 0, not yet running.",
            "# TYPE hpipe_requests_waiting gauge", f"hpipe_requests_waiting {s.get('waiting', 0)}",
            "# HELP hpipe_requests_running Requests admitted (prefilling, decoding or preempted).",
            "# TYPE hpipe_requests_running gauge", f"hpipe_requests_running {s.get('running', 0)}",
            "# HELP hpipe_requests_open Requests the server is answering.",
            "# TYPE hpipe_requests_open gauge", f"hpipe_requests_open {self.load()}",
            "# HELP hpipe_kv_pages_used KV pages held by sequences (every stage holds the same table).",
            "# TYPE hpipe_kv_pages_used gauge", f"hpipe_kv_pages_used {s.get('pages_used', 0)}",
            *metric("hpipe_kv_pages_free", "gauge", "KV pages free.", self.pages_free()),
            *metric("hpipe_kv_bytes_per_token", "gauge", "A token's KV cache, over every stage (the plan's "
                    "--kv-dtype).", self.kv_bytes_per_token()),
            *metric("hpipe_kv_cache_info", "gauge", "The KV cache's element type.", 1,
                    f'dtype="{(self.plan or self.job.plan).kv_dtype}"'),
            "# HELP hpipe_kv_pages_cached KV pages holding a cached prefix (in use or evictable).",
            "# TYPE hpipe_kv_pages_cached gauge", f"hpipe_kv_pages_cached {s.get('pages_cached', 0)}",
            *metric("hpipe_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.",
                    s.get("prefix_hit_tokens", 0)),
            *metric("hpipe_prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix "
                    "cache.", s.get("prefix_query_tokens", 0)),
            "# HELP hpipe_preemptions_total Sequences preempted for KV pages (recomputed later).",
            "# TYPE hpipe_preemptions_total counter", f"hpipe_preemptions_total {s.get('preemptions', 0)}",
            *metric("hpipe_spec_proposed_tokens_total", "counter", "Speculative decoding: tokens proposed (prompt "
                    "lookup).", s.get("spec_proposed_tokens", 0)),
            *metric("hpipe_spec_accepted_tokens_total", "counter", "Speculative decoding: proposed tokens accepted.",
                    s.get("spec_accepted_tokens", 0)),
            *metric("hpipe_spec_acceptance_rate", "gauge", "Speculative decoding: accepted / proposed tokens, since "
                    "the start.", f"{s.get('spec_accepted_tokens', 0) / max(1, s.get('spec_proposed_tokens', 0)):.4f}"),
            "# HELP hpipe_prompt_tokens_total Prompt tokens submitted.",
            "# TYPE hpipe_prompt_tokens_total counter", f"hpipe_prompt_tokens_total {m.prompt_tokens}",
            "# HELP hpipe_generation_tokens_total Tokens generated.",
            "# TYPE hpipe_generation_tokens_total counter", f"hpipe_generation_tokens_total {m.generation_tokens}",
            "# HELP hpipe_requests_finished_total Requests finished, by reason.",
            "# TYPE hpipe_requests_finished_total counter",
        ]
        lines += [f'hpipe_requests_finished_total{{finish_reason="{k}"}} {v}' for k, v in sorted(m.finished.items())]
        lines += self._service_metrics()
        lines += ["# HELP hpipe_time_to_first_token_seconds Time from arrival to the first token.",
                  "# TYPE hpipe_time_to_first_token_seconds histogram", *m.ttft.lines("hpipe_time_to_first_token_seconds"),
                  "# HELP hpipe_time_per_output_token_seconds Mean time between a request's tokens.",
                  "# TYPE hpipe_time_per_output_token_seconds histogram",
                  *m.tpot.lines("hpipe_time_per_output_token_seconds"),
                  "# HELP hpipe_microbatch_tokens Tokens per micro-batch (decode + prefill).",
                  "# TYPE hpipe_microbatch_tokens histogram",
                  *m.microbatch_tokens.lines("hpipe_microbatch_tokens", f'policy="{self.settings.runtime.policy}"')]
        return "\n".join(lines) + "\n"

    def _service_metrics(self) -> list[str]:
        """The service's own: hosts lost and taken back, requests resumed, time without service."""
        m = self.metrics
        lost = [e for e in m.events if e.kind == "lost"]
        return ["# HELP hpipe_recoveries_total Hosts lost while serving, the service planned again without them.",
                "# TYPE hpipe_recoveries_total counter", f"hpipe_recoveries_total {len(lost)}",
                "# HELP hpipe_rejoins_total Returning hosts taken back into the pipeline.",
                "# TYPE hpipe_rejoins_total counter",
                f"hpipe_rejoins_total {sum(1 for e in m.events if e.kind == 'rejoined')}",
                "# HELP hpipe_requests_resumed_total Open requests resumed on a new pipeline where they stood.",
                "# TYPE hpipe_requests_resumed_total counter", f"hpipe_requests_resumed_total {m.resumed}",
                "# HELP hpipe_seconds_without_service_total Seconds from a failure (or a switch) to the first "
                "token after it, summed over the events.",
                "# TYPE hpipe_seconds_without_service_total counter",
                f"hpipe_seconds_without_service_total {sum(e.outage_s or 0 for e in m.events):.3f}",
                "# HELP hpipe_degraded 1 while the hosts up cannot hold the model (requests get 503).",
                "# TYPE hpipe_degraded gauge", f"hpipe_degraded {int(self.degraded is not None)}",
                "# HELP hpipe_deterministic 1 when a request's tokens and logits do not depend on the rest of "
                "the traffic (--deterministic on).",
                "# TYPE hpipe_deterministic gauge",
                f"hpipe_deterministic {int(bool(self.info and self.info.deterministic))}"]

