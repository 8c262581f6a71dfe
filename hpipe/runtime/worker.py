"""The stage worker: one process per pipeline stage.

    python -m hpipe.runtime.worker --plan plan.json --rank R --world-size N \
        --master-addr HOST --master-port PORT --config JSON (--requests requests.jsonl | --serve)

The same command line runs locally (`hpipe launch --local`) and, unchanged, on remote hosts (the
SSH launcher). The runtime's settings come whole as one `hpipe.config.RuntimeConfig` (JSON); the
job token comes in the environment (HPIPE_JOB_TOKEN), not on the command line.

`StageWorker` builds once (units and weights, KV sizing and the stages' agreement, warm-up, graph
capture), choosing every mode there, and then runs. Stage 0 also runs the scheduler; the last
stage also samples. Where requests come from is one object (`JobRequests`: a file every stage
reads; `ServedRequests`: stage 0's stdin while serving), and so is what stage 0 reports
(`JobReports`, `ServeReports`). Everything a launcher needs back comes on stdout as
`hpipe.protocol` reports; logs go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from hpipe import formats, memory, models, protocol, quant
from hpipe.config import RuntimeConfig, Speculation
from hpipe.errors import HpipeError
from hpipe.grammar import GrammarVocabulary
from hpipe.lifeline import exit_now, tie_to_parent
from hpipe.request import Request, read_requests
from hpipe.runtime import comm, invariant
from hpipe.runtime.background_compile import BackgroundCompile
from hpipe.runtime.draft import proposer_for
from hpipe.runtime.pages import pages_needed
from hpipe.runtime.pulse import StagePulse
from hpipe.runtime.pipeline import (Driver, Executors, LogprobReports, Modes, PoolSampling, Sampling, ThreadSampling,
                                    Intervals, run_first_stage, run_later_stage)
from hpipe.runtime.sampler_pool import SamplerPool
from hpipe.runtime.schedule import body_capacity
from hpipe.runtime.scheduler import Policy, Scheduler
from hpipe.runtime.sequence import Sequence
from hpipe.runtime.sidp import Replica, Seat, run_replica, runs_plain
from hpipe.runtime.speculative import SPEC_ROWS
from hpipe.runtime.stage import StageRunner, compile_if_it_pays, record_compile, warm_up
from hpipe.runtime.static_decode import StaticDecode, unsupported
from hpipe.sampling import RequestSampler


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hpipe.runtime.worker", description=__doc__)
    p.add_argument("--plan", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--config", default="{}", help="the RuntimeConfig as JSON (missing settings: their defaults)")
    p.add_argument("--model", help="model to load (default: the plan's model name)")
    p.add_argument("--requests",
                   help="JSONL of hpipe.request.Request (written by the launcher): ids, sampling parameters, limits")
    p.add_argument("--serve", action="store_true", help="take requests on stage 0's stdin until it closes")
    p.add_argument("--background-compile", action="store_true",
                   help="--compile auto: get the decode graphs beside the run (hpipe.runtime.background_compile)")
    p.add_argument("--logits-out", help="last stage: write an .npz of logits per request id")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--replica", type=int, help="a SiDP plan: the stage (replica) this worker runs, as a one-stage "
                                               "pipeline in its group (token: HPIPE_GROUP_TOKEN)")
    p.add_argument("--group-port", type=int, help="with --replica: the group's rendezvous port on --master-addr")
    args = p.parse_args(argv)
    if not args.serve and not args.requests:
        p.error("give --requests FILE (a batch job) or --serve (requests on stdin)")
    if (args.replica is None) != (args.group_port is None):
        p.error("give --replica and --group-port together")
    return args


def main(argv=None) -> None:
    tie_to_parent("stage worker")
    args = parse_args(argv)
    errors: list = []               # what the stage's threads raised (StageWorker's executors share it)
    threading.excepthook = lambda hook: errors.append(hook.exc_value)   # a thread outside the executors
    try:
        worker = StageWorker(args, RuntimeConfig.from_json(args.config), errors)
        worker.build()
        worker.run()
    except Exception as e:
        fail(args.rank, e, errors)
    exit_now(0)     # the stages' closing barrier has passed and the process group is gone: no peer waits on us


def fail(rank: int, error: BaseException, errors: list) -> None:
    """Reports the stage's failure in one line to the launcher and exits now. A neighbour's death
    reaches every thread of this stage blocked on it (sends, receives, the scheduler, the id
    return, the sampler): whichever raised first, the cause is the same line, and no traceback (the
    stage that failed first has the story). A failure of this stage's own: the traceback goes to
    its log."""
    lost = next((e for e in [error, *errors] if comm.lost_peer(e)), None)
    if lost is not None:
        report, code = protocol.Error(comm.lost_peer_line(lost), rank, peer_lost=True), 2
        log(f"stage {rank}: {report.message}")
    elif isinstance(error, HpipeError):
        report, code = protocol.Error(str(error), rank), 2
    else:
        report, code = protocol.Error(f"{type(error).__name__}: {error}", rank), 1
        traceback.print_exception(error)
    protocol.send(report)
    exit_now(code, wait_for_threads=False)   # threads still blocked in the dead transport would end it in
    # C++'s `terminate called without an active exception` in an ordinary exit


# ---------------------------------------------------------------------------------- where requests come from
class JobRequests:
    """A batch job: every request is in the file the launcher wrote, which every stage reads."""

    serving = False

    def __init__(self, path: str, config: RuntimeConfig):
        self.requests = read_requests(path)
        self.by_index = {r.index: r for r in self.requests}
        self.max_len = max((len(r.input_ids) + r.max_new_tokens for r in self.requests), default=1)
        self.sequences = min(config.max_batch, max(1, len(self.requests)))   # running at once, at most
        self.sampler_len = max((r.max_new_tokens for r in self.requests), default=1)
        self.lengths = [len(r.input_ids) for r in self.requests]
        self.max_batch = config.max_batch

    def sampler_columns(self, world: int) -> int:
        """Sampler state for every sequence running, plus those whose release is still on its way."""
        return max(1, min(len(self.requests), self.max_batch + world))

    def pool_rows(self, drafts: int) -> int:
        """The most rows one micro-batch samples (`drafts`: its proposed tokens, at most)."""
        return max(1, min(len(self.requests), 2 * self.max_batch)) + drafts

    def lookup(self) -> Callable[[int], Request] | None:
        """How the other stages learn an admitted request: from the file they all read."""
        return self.by_index.__getitem__

    def reports(self, sched: Scheduler) -> JobReports:
        return JobReports(sched)

    def start(self, driver: Driver, ready: protocol.Ready) -> None:
        """Every request is the scheduler's from the start."""


class ServedRequests:
    """Serving: requests come on stage 0's stdin as `hpipe.protocol` ops until Close or the end."""

    serving = True

    def __init__(self, config: RuntimeConfig, model_config):
        self.requests: list[Request] = []
        self.max_len = models.max_model_len(config.max_model_len, model_config)
        self.max_batch = self.sequences = config.max_batch
        self.sampler_len = self.max_len
        self.lengths = [self.max_len]

    def sampler_columns(self, world: int) -> int:
        return self.max_batch + world

    def pool_rows(self, drafts: int) -> int:
        return 2 * self.max_batch + drafts

    def lookup(self) -> None:
        """None: the schedules carry the admitted requests whole (the other stages have no file)."""
        return None

    def reports(self, sched: Scheduler) -> ServeReports:
        return ServeReports(sched)

    def start(self, driver: Driver, ready: protocol.Ready) -> None:
        protocol.send(ready)
        threading.Thread(target=self._read, args=(driver,), name="hpipe-requests", daemon=True).start()

    @staticmethod
    def _read(driver: Driver) -> None:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                op = protocol.read_op(line)
            except ValueError as e:
                log(f"stage 0: {e}: {line.strip()[:80]!r}")
                continue
            if isinstance(op, protocol.Close):
                break
            if isinstance(op, protocol.Abort):
                driver.abort(op.index)
                continue
            try:
                driver.add(op.request)
            except ValueError as e:
                protocol.send(protocol.Rejected(op.request.index, str(e)))
        driver.close()


# ---------------------------------------------------------------------------------- what stage 0 reports
class JobReports:
    """A batch job: each finished request's result, timed from the job's start."""

    def __init__(self, sched: Scheduler):
        self.sched = sched

    def token(self, seq: Sequence, token: int) -> None:
        pass

    def flush_tokens(self) -> None:
        pass

    def result(self, seq: Sequence) -> None:
        protocol.send(result_of(seq, self.sched.t0))

    def microbatch(self, schedule, sched: Scheduler) -> None:
        pass

    def tick(self, sched: Scheduler, force: bool = False) -> None:
        pass


class ServeReports(JobReports):
    """Serving: tokens as they are sampled, results timed from each request's arrival, and the
    scheduler's stats with the recent micro-batches' sizes every STATS_S."""

    STATS_S = 0.25

    def __init__(self, sched: Scheduler):
        super().__init__(sched)
        self.tokens: list = []
        self.microbatches: list = []            # (t, decode tokens, prefill tokens) since the last stats
        self.t_stats = 0.0

    def token(self, seq: Sequence, token: int) -> None:
        self.tokens.append((seq.index, token))

    def flush_tokens(self) -> None:
        if self.tokens:
            protocol.send(protocol.Tokens(self.tokens))
            self.tokens = []

    def result(self, seq: Sequence) -> None:
        protocol.send(result_of(seq, None))

    def microbatch(self, schedule, sched: Scheduler) -> None:
        decode = sum(s.length for s in schedule.segments if not s.prefill)
        self.microbatches.append((round(time.time(), 4), decode, schedule.n_tokens - decode))
        self.tick(sched)

    def tick(self, sched: Scheduler, force: bool = False) -> None:
        now = time.time()
        if force or now - self.t_stats >= self.STATS_S:
            self.t_stats = now
            protocol.send(protocol.Stats(**sched.stats(), microbatches=self.microbatches))
            self.microbatches = []


def result_of(seq: Sequence, t0: float | None) -> protocol.Result:
    return protocol.Result(seq.index, seq.output, seq.finish_reason, len(seq.request.input_ids), **seq.timing(t0))


# ---------------------------------------------------------------------------------- logits out
class KeepNothing:
    def add(self, mb_id: int, out: torch.Tensor, seqs: list[int]) -> None:
        pass

    def reporting(self, deliver):
        return deliver

    def write(self, requests: JobRequests) -> None:
        pass


class KeepLogits(KeepNothing):
    """--logits-out: every sampled row whose token was emitted, per request; the launcher keeps a
    request's first len(output) rows (the rest are leftover steps after its stop, which stage 0
    decided). A rejected proposal's row (its id -1) is dropped when the ids are delivered."""

    def __init__(self, path: str):
        self.path = path
        self.rows: dict[int, list] = {}
        self.pending: dict[int, tuple] = {}

    def add(self, mb_id: int, out: torch.Tensor, seqs: list[int]) -> None:
        self.pending[mb_id] = (out.detach().float().cpu().numpy(), seqs)

    def reporting(self, deliver):
        def deliver_ids(mb_id: int, ids: list[int]) -> None:
            out, seqs = self.pending.pop(mb_id)
            for i, s in enumerate(seqs):
                if ids[i] >= 0:
                    self.rows.setdefault(s, []).append(out[i])
            deliver(mb_id, ids)
        return deliver_ids

    def write(self, requests: JobRequests) -> None:
        np.savez(self.path, **{requests.by_index[s].id: np.stack(rows) for s, rows in self.rows.items()})


# ---------------------------------------------------------------------------------- the worker
class StageWorker:
    def __init__(self, args, config: RuntimeConfig, errors: list):
        self.args, self.config, self.errors = args, config, errors
        self.rank, self.world = args.rank, args.world_size
        self.first, self.last = self.rank == 0, self.rank == self.world - 1

    # ------------------------------------------------------------------ build: once, before the clock
    def build(self) -> None:
        args, config = self.args, self.config
        if args.threads:
            torch.set_num_threads(args.threads)
        t_load = time.time()
        source = self._read_plan()
        plan = self.plan
        self.speculation = Speculation.parse(config.speculation)
        runner = self.runner = StageRunner(source, self.model_config, range(*self.stage_plan.units),
                                           self.stage_plan.device, plan.dtype, config.attn, config.page_size,
                                           weights=self.weights, compile=config.compile,
                                           deterministic=self.deterministic,
                                           host_experts=self.stage_plan.host_experts, kv_dtype=plan.kv_dtype,
                                           step_tokens=self.speculation.step_tokens,
                                           shared_weights=self.seat is not None)     # SiDP: one copy a host
        if runner.compile_refused and config.compile == "on":
            log(f"stage {self.rank}: decode runs eagerly, not compiled (--compile on): {runner.compile_refused}")
        self.modes, static = self._modes()
        self.groups = comm.init(self.rank, self.world, args.master_addr, args.master_port,
                                os.environ.get("HPIPE_JOB_TOKEN", "local"), [s.device for s in self.stages],
                                config.rendezvous_timeout_s)
        self.pages = self._agree_kv_pages()
        runner.kv.allocate(self.pages)
        # a server's compiled graphs come beside it: it answers without waiting for them
        self.background = BackgroundCompile.for_server(
            runner, args.model or plan.model.name, self.stage_plan.weights, plan.dtype, config,
            f"stage {self.rank}", plan.kv_dtype) if args.background_compile and not self.grouped else None
        self._warm_up(runner, args.serve)
        static_decode = StaticDecode(runner, config.max_batch, self.modes.cuda_graphs,
                                     self.requests.max_len) if static else None
        self.graphs = static_decode.capture() if static_decode is not None else 0
        runner.kv.frozen = True             # sized once: a growth mid-run would be a bug (and move the graphs' KV)
        max_segments = config.max_batch + 1
        lookup = self.requests.lookup()
        link = comm.ScheduleLink(body_capacity(max_segments, self.max_tokens, config.page_size, self.requests.max_len),
                                 config.page_size, with_requests=lookup is None, last=self.world - 1,
                                 requests=lookup)
        self.ex = Executors(self.rank, self.world, runner, self.groups, self.modes, Intervals(bounded=args.serve),
                            link, self.max_tokens, static=static_decode, errors=self.errors)
        self.ex.allocate_buffers()
        self.replica = Replica(self.seat, runner, config.sidp_mode, args.master_addr, args.group_port,
                               os.environ.get("HPIPE_GROUP_TOKEN", "local"), config.rendezvous_timeout_s,
                               self.ex.errors) if self.grouped else None
        self.keep = KeepLogits(args.logits_out) if args.logits_out and self.last else KeepNothing()
        # the draft model (if any) beside stage 0, loaded before the clock as the stage's own weights are
        self.proposer = proposer_for(self.speculation, int(self.model_config.vocab_size), self.stage_plan.device,
                                     plan.dtype, self.pages, config.page_size, plan.kv_dtype) if self.first else None
        # what the build made (modules, dynamo's and inductor's caches: ~600k objects) out of the
        # collector's sight: a full collection mid-run otherwise walks all of it (277 ms, one after a
        # compile, here) where it now walks what the run made
        gc.collect()
        gc.freeze()
        self.load_s = time.time() - t_load

    def _read_plan(self) -> models.ModelSource:
        """The plan, this stage's place in it, its model and weights, the requests and what they ask
        of a micro-batch; returns where the model's files are."""
        args, config = self.args, self.config
        plan = self.plan = formats.load_plan(args.plan)
        self.seat = seat_of(plan, args.replica, self.world)
        self.index = self.rank if self.seat is None else args.replica      # this stage in plan.stages
        self.stages = plan.stages if self.seat is None else (plan.stages[self.index],)    # this pipeline's
        if self.world != len(self.stages):
            raise HpipeError(f"--world-size {self.world} but the plan has {len(self.stages)} stages")
        self.stage_plan = plan.stages[self.index]
        source = models.resolve_model(args.model or plan.model.name)
        self.model_config = models.load_config(source.path)
        self.model_dir = str(source.path)
        models.check_plan_matches(plan, self.model_config, source.name)
        self.weights = quant.stage_weights(quant.WeightFormat.parse(self.stage_plan.weights), self.stage_plan.device)
        self.requests = ServedRequests(config, self.model_config) if args.serve else JobRequests(args.requests, config)
        self.policy = Policy.resolve(config, [s.device for s in self.stages])
        self.max_tokens = longest_microbatch(self.requests.lengths, plan, config.max_batch, self.policy)
        self.deterministic = invariant.resolve(config.deterministic, self.model_config, config.page_size,
                                               self.max_tokens)
        return source

    def _modes(self) -> tuple[Modes, bool]:
        """Every switch resolved for this stage's device, once."""
        config, device = self.config, self.runner.device
        # A CPU stage's forward already keeps every core it has busy: a preparing thread next to it
        # costs more than it hides (one stage, one sequence: 37 vs 33 ms per token; 2 stages: equal;
        # prepare is 0.3 ms of a 30 ms step), so there the compute thread prepares between forwards
        prepare_thread = config.prepare_thread == "on" or (config.prepare_thread == "auto" and device.type == "cuda")
        # The same holds for sampling on a sampler thread: beside a CPU forward it takes the forward's
        # cores and puts a thread handoff on every token's way back (3 one-thread stages of SmolLM2:
        # the sample started 0.22 ms after the last stage's forward ended), so a CPU stage samples
        # in its loop; a GPU stage's forward runs asynchronously and leaves the thread its core
        modes = Modes(tsem=config.tsem, sat=config.sat, prepare_thread=prepare_thread,
                      sampler_thread=config.tsem and device.type == "cuda",
                      sampling=choose_sampling(config.sampling, self.stage_plan.device, self.world),
                      cuda_graphs=config.cuda_graphs and device.type == "cuda",
                      turns=self.world > 1 and device.type == "cpu")
        static = config.static_decode == "on" or (config.static_decode == "auto" and modes.cuda_graphs)
        self.grouped = self.seat is not None and not runs_plain(self.seat.group, config.sidp_mode)
        why = "a SiDP replica's MLP halves run through WaS or CaS" if self.grouped else unsupported(self.runner)
        if static and why:
            log(f"stage {self.rank}: decode runs eagerly, not on the static path (CUDA graphs): {why}")
            static = False
            modes = dataclasses.replace(modes, cuda_graphs=False)
        return modes, static

    def _warm_up(self, runner, serving: bool) -> None:
        """`warm_up`; before it, a batch job on a host without `hpipe warmup` chooses to compile first
        where the job's decode pays for it (`compile_if_it_pays`), and keeps what the compile cost."""
        choice = compile_if_it_pays(runner, sum(r.max_new_tokens for r in self.requests.requests) /
                                    self.requests.sequences, self.requests.max_len, log) \
            if runner.compile_cold and not serving and not self.grouped else None
        compiled_s = warm_up(runner, self.requests.max_len, log)
        if choice is not None and choice.compile:
            record_compile(runner, compiled_s, self.requests.max_len, choice.eager_step_s)

    def _agree_kv_pages(self) -> int:
        """This stage's KV pool, then the smallest over the stages (stage 0 hands out what every stage holds)."""
        config, requests = self.config, self.requests
        wanted = requests.sequences * pages_needed(requests.max_len, config.page_size) + 1
        pages = kv_pool_pages(config, self.plan, self.model_config, self.index, self.runner, self.max_tokens, wanted)
        agreed = torch.tensor([pages], dtype=torch.long)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.groups.ctrl)
        pages = int(agreed.item())
        if pages - 1 < pages_needed(requests.max_len, config.page_size):
            raise HpipeError(f"the KV pool holds {pages - 1} pages of {config.page_size} tokens on the smallest stage, "
                             f"fewer than one sequence of {requests.max_len} tokens needs; give the stages more free "
                             f"memory, raise --kv-pages or lower --max-model-len / --max-new-tokens")
        return pages

    def _sampling(self, deliver) -> Sampling | None:
        """The last stage's sampling, chosen once: inline, a sampler thread, or the process pool."""
        if not self.last:
            return None
        config, requests = self.config, self.requests
        vocab = int(self.model_config.vocab_size)
        columns = requests.sampler_columns(self.world)
        logprobs = LogprobReports()
        deliver = self.keep.reporting(logprobs.reporting(deliver))
        if self.modes.sampling == "cpu":
            drafts = SPEC_ROWS if self.speculation.on else 0
            pool = SamplerPool(vocab, requests.pool_rows(drafts), columns, requests.sampler_len, send=deliver,
                               model_dir=self.model_dir,
                               n_procs=config.sampler_procs, errors=self.ex.errors)
            return PoolSampling(pool, deliver, self.ex.timeline, self.keep, logprobs)
        grammars = GrammarVocabulary(self.model_dir, vocab)        # nothing is loaded until a request has a grammar
        sampler = RequestSampler(vocab, columns, requests.sampler_len, grammars=grammars)
        if self.modes.sampler_thread and self.world > 1:
            return ThreadSampling(sampler, deliver, self.ex.timeline, self.keep, logprobs, self.ex.errors)
        return Sampling(sampler, deliver, self.ex.timeline, self.keep, logprobs)

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        dist.barrier(group=self.groups.ctrl)
        t_start = time.time()
        if self.background is not None:
            self.background.start()
        summary = None
        sampling = None
        pulse = StagePulse(self.rank, self.ex.timeline, self.runner.device, self.runner.kv.bytes).start()
        try:
            if self.first:
                summary = self._run_first()
            else:
                sampling = self._sampling(self.ex.transport.send_ids)
                run_later_stage(self.ex, sampling)
        finally:
            pulse.stop()
            if sampling is not None:
                sampling.close()
        t_end = time.time()
        self.keep.write(self.requests)
        sp = self.stage_plan
        protocol.send(protocol.IntervalsReport(self.rank, sp.host, sp.device, list(sp.units), t_start, t_end,
                                        round(self.load_s, 3), models.peak_rss_bytes(), self.runner.kv.bytes(),
                                        list(self.ex.timeline.intervals), self.groups.counters.as_dict(),
                                        self.graphs))
        if summary is not None:
            protocol.send(summary)
        dist.barrier(group=self.groups.ctrl)
        dist.destroy_process_group()

    def _run_first(self) -> protocol.Summary:
        config, requests = self.config, self.requests
        sched = Scheduler(requests.requests, self.plan.slicing.slices_for, self.world, config.max_batch,
                          lookahead=self.modes.tsem, policy=self.policy, pages=self.pages,
                          page_size=config.page_size, max_tokens=self.max_tokens, serving=requests.serving,
                          prefix_caching=config.prefix_caching, proposer=self.proposer,
                          **invariant.scheduling(config.page_size, self.deterministic))
        driver = Driver(self.ex, sched, requests.reports(sched))
        sampling = self._sampling(driver.take_ids) if self.world == 1 else None
        requests.start(driver, protocol.Ready(self.pages - 1, config.page_size, requests.max_len, config.max_batch,
                                              dataclasses.asdict(self.policy), self.deterministic))
        try:
            run = run_first_stage(self.ex, driver, sampling) if self.replica is None else \
                run_replica(self.ex, driver, sampling, self.replica)
        finally:
            if sampling is not None:
                sampling.close()
        return protocol.Summary(**run, requests=len(requests.requests), prompt_tokens=sum(
            len(r.input_ids) for r in requests.requests),
            options={**dataclasses.asdict(self.modes), "static_decode": self.ex.static is not None,
                     "compiled": self.runner.decode_halves is not self.runner.eager,
                     "compile_cold": self.runner.compile_cold,
                     "deterministic": self.runner.deterministic,
                     "weights": str(self.weights)},
            policy=dataclasses.asdict(self.policy), kv_pages=self.pages - 1, page_size=config.page_size,
            config=dataclasses.asdict(config), sidp=self.replica.report() if self.replica is not None else None)


def seat_of(plan, replica: int | None, world: int) -> Seat | None:
    """A SiDP plan's worker runs one replica (--replica) as a one-stage pipeline; other plans, none."""
    if plan.mode != "sidp":
        if replica is not None:
            raise HpipeError(f"--replica {replica}: the plan is not a SiDP plan")
        return None
    if replica is None or not 0 <= replica < len(plan.stages) or world != 1:
        raise HpipeError(f"a SiDP plan runs one replica per worker: give --replica 0..{len(plan.stages) - 1}, "
                         f"--world-size 1 and --group-port")
    group = next(g for g in plan.sidp if replica in g.replicas)
    return Seat(group, group.replicas.index(replica))


def choose_sampling(asked: str, device: str, world: int) -> str:
    """auto: the pool where sampling would take the accelerator's time (a GPU last stage); on a CPU
    stage the pool's processes compete with the forward for the same cores (bench/decode.py)."""
    if world == 1:
        return "inline"
    if asked == "auto":
        return "cpu" if device.startswith("cuda") else "inline"
    return asked


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 34


def kv_pool_pages(config: RuntimeConfig, plan, model_config, rank: int, runner, max_tokens: int, wanted: int) -> int:
    """This stage's KV pages: at most `wanted` (what max-batch sequences of the longest length
    need), at most what its share of the device's free memory holds after the activation buffers
    less a 10 % margin (stages sharing a device share it), at most --kv-pages."""
    stage = plan.stages[rank]
    sharing = sum(1 for s in plan.stages if (s.host, s.device) == (stage.host, stage.device))
    kv_per_token_per_unit, activation_per_token_at_cut = models.token_bytes(model_config, plan.dtype, plan.kv_dtype)
    per_token = sum(kv_per_token_per_unit[u] for u in range(*stage.units))
    if per_token == 0:
        return wanted if not config.kv_pages else min(wanted, config.kv_pages)
    activations = memory.activation_bytes(activation_per_token_at_cut, max_tokens)
    budget = 0.9 * free_memory_bytes(runner.device) / sharing - activations
    pages = min(wanted, max(2, int(budget // (per_token * config.page_size))))
    return min(pages, config.kv_pages) if config.kv_pages else pages


def longest_microbatch(lengths: list[int], plan, max_batch: int, policy: Policy) -> int:
    """The most tokens of one micro-batch (the receive buffers' rows, the scheduler's cap): the
    policy's prefill tokens or the plan's longest slice of any prompt (a prompt alone follows the
    plan's slicing, from its start or after a cached prefix), plus a decode token of every other
    sequence."""
    unique = sorted(set(n for n in lengths if n))
    slices = [max(plan.slicing.slices_for(n)) for n in unique]
    slices += [max(plan.slicing.slices_for(n - c, c)) for c in plan.slicing.by_context for n in unique if n > c]
    return max(slices + [policy.max_tokens]) + max_batch


if __name__ == "__main__":
    main()
