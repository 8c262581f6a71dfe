"""A SiDP plan's replicas on this machine: data parallelism over one job.

Every replica is a one-stage pipeline (the plan's stage for it, `--replica`) started as `hpipe
serve` starts its stages, taking requests on stage 0's stdin; one dispatcher hands the job's
requests out so that no replica idles while another has a queue (a request goes to the least
loaded replica with room under its --max-batch, ties to the one that has taken fewer, the rest
wait), and every result is appended to
the results file as it finishes (`--resume` skips them). On a CPU host the replicas map one copy
of the weights (the packed cache or the safetensors file, read-only), and each replica's resident
weights are shared pages (Pss = 1/d of them); the CPU's cores are split among the replicas. The
MLP halves a replica does not own run as the group's mode says (`hpipe.runtime.sidp`: WaS from the
mapping, CaS through the owner, or the switch between them); the replicas of one group meet on
their own gloo group, whose port and token the launcher hands out.

A replica that is lost (its worker exits) hands its open requests to the others: each goes on
where it stood (`Request.output_ids`: the tokens it had), and the job goes on with the rest of the
group. Replicas that fell with it (in CaS they meet at every MLP half) are started again on their
own (WaS, `--sidp-mode was`: they never meet again); a job ends with an error only when no replica
is left.
"""

from __future__ import annotations

import asyncio
import json
import concurrent.futures
import dataclasses
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpipe import formats, models, protocol
from hpipe.errors import HpipeError
from hpipe.launcher.jobs import GroupSeat, LaunchSettings, PreparedJob
from hpipe.launcher.serving import PipelineClient
from hpipe.net import free_port

__all__ = ["ReplicaReport", "check_replicas", "launch_replicas", "mapped_bytes", "replica_job", "write_mode_trace"]


@dataclass
class ReplicaReport:
    results: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    replicas: list[dict] = field(default_factory=list)      # per replica: device, requests, tokens, mapped bytes
    traces: list[dict] = field(default_factory=list)        # per replica with WaS/CaS: [[t, batch, mode], ...]


def check_replicas(plan: formats.Plan, plan_path: str, local: bool, timeline_out: str | None = None) -> None:
    """What this version runs of a SiDP plan: replicas on this machine, each group all CPUs (WaS's
    source the weights' one mapping: shared-mapping, or host-pool, the mapping as the pool the
    slots copy from) or all GPUs (host-pool: one pinned host copy; peer: the owners' device memory
    through CUDA IPC; `hpipe.runtime.was_sources`)."""
    if timeline_out and Path(timeline_out).suffix.lower() not in (".png", ".json"):
        raise HpipeError(f"--timeline-out {timeline_out}: a SiDP job draws its batch and mode per step: give a "
                         f"file name ending in .png or .json")
    if not local:
        raise HpipeError(f"{plan_path}: a SiDP plan runs its replicas on this machine (--local); over SSH "
                         f"each host would run its own group: launch the plan on each host")
    for i, g in enumerate(plan.sidp):
        kinds = {"cpu" if plan.stages[r].device == "cpu" else "gpu" for r in g.replicas}
        if len(kinds) > 1:
            raise HpipeError(f"{plan_path}: sidp[{i}] mixes CPU and GPU replicas: a group's replicas share their "
                             f"MLP weights one way; plan the GPUs and the CPU as separate hosts or with --mode pipeline")
        if kinds == {"cpu"} and g.source == "peer":
            raise HpipeError(f"{plan_path}: sidp[{i}] reads WaS weights from a peer GPU, but its replicas are "
                             f"CPUs: set its source to host-pool or shared-mapping (--sidp-source)")
        if kinds == {"gpu"} and g.source == "shared-mapping":
            raise HpipeError(f"{plan_path}: sidp[{i}] runs GPU replicas on weights mapped in host memory: set its "
                             f"source to host-pool (one pinned host copy) or peer (--sidp-source)")


def replica_job(job: PreparedJob, r: int) -> PreparedJob:
    """Replica r as its client sees it: a one-stage pipeline (its worker reads the whole SiDP plan)."""
    plan = job.plan
    return dataclasses.replace(job, plan=dataclasses.replace(plan, stages=(plan.stages[r],), mode="pipeline",
                                                             sidp=(), predicted=None))


def mapped_bytes(pid: int, roots: list[str]) -> dict | None:
    """Rss and Pss of a process's mappings of files under `roots` (the weights it maps), and its
    whole Pss, from /proc/PID/smaps: a page that n processes map counts 1/n to each one's Pss."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    out = {"weights_rss_bytes": 0, "weights_pss_bytes": 0, "pss_bytes": 0}
    inside = False
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:         # a mapping's first line: its range, perms, ..., path
            inside = len(head) >= 6 and any(head[5].startswith(r) for r in roots)
        elif head and head[0] in ("Rss:", "Pss:"):
            kb = int(head[1]) * 1024
            if head[0] == "Pss:":
                out["pss_bytes"] += kb
            if inside:
                out["weights_rss_bytes" if head[0] == "Rss:" else "weights_pss_bytes"] += kb
    return out


def replica_settings(settings: LaunchSettings, replica: int) -> LaunchSettings:
    """A replica runs as its own one-stage pipeline: its log (--log-dir) is DIR/replica-R/stage-0.log."""
    if settings.log_dir is None:
        return settings
    log_dir = os.path.join(settings.log_dir, f"replica-{replica}")
    os.makedirs(log_dir, exist_ok=True)
    return dataclasses.replace(settings, log_dir=log_dir)


def launch_replicas(job: PreparedJob, plan_path: str, out_path: str, settings: LaunchSettings, log,
                    quiet: bool = False) -> ReplicaReport:
    """Runs the job on the plan's replicas until every request has its result."""
    plan = job.plan
    n = len(plan.stages)
    cpu = [s.device == "cpu" for s in plan.stages]
    threads = max(1, (os.cpu_count() or 1) // max(1, sum(cpu)))
    report = ReplicaReport()
    if not job.requests:
        log(f"hpipe: nothing to run: all {len(job.skipped)} prompts are already in {out_path}")
        return report
    # each replica's KV pool holds what the job's longest request needs for --max-batch sequences,
    # not the model's whole context (n replicas on one device would each size for all of it)
    longest = max(len(r.input_ids) + r.max_new_tokens for r in job.requests)
    runtime = dataclasses.replace(settings.runtime, max_model_len=settings.runtime.max_model_len or longest)
    serve = dataclasses.replace(settings, serve=True, runtime=runtime)
    roots = [str(models.cache_dir()), str(job.source.path), str(job.source.location)]
    seats = {}
    for g in plan.sidp:
        port, token = free_port(), secrets.token_hex(16)
        seats.update({r: GroupSeat(r, port, token) for r in g.replicas})
    clients = [PipelineClient(replica_job(job, r), plan_path, replica_settings(serve, r), log=log, quiet=quiet,
                              threads=threads if cpu[r] else None, seat=seats[r]) for r in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        try:
            for started in [pool.submit(c.start) for c in clients]:    # the replicas load at once
                started.result()
            t0 = time.time()
            restart = lambda r, on_failure: _restart(clients, job, plan_path, serve, r,  # noqa: E731
                                                     threads if cpu[r] else None, seats[r], log, quiet, on_failure)
            # a peer group's replicas read each other's GPU memory: one lost, the others stop with it
            together = {r: g.replicas for g in plan.sidp if g.source == "peer" for r in g.replicas}
            asyncio.run(_dispatch(clients, job, out_path, report, log, t0, restart, together))
            report.wall_s = time.time() - t0
            for r, client in enumerate(clients):
                report.replicas[r].update(mapped_bytes(client.launch.workers[0].proc.pid, roots) or {})
        finally:    # at once: a group's replicas end together (each waits for the others' stop)
            try:
                list(pool.map(lambda c: c.close(), clients))
            finally:
                from hpipe.runtime.was_sources import remove_published     # torch: here, not at every command's start
                for token in {s.token for s in seats.values()}:
                    remove_published(token)         # a GPU group's host pool and IPC handles in /dev/shm
    for r, client in enumerate(clients):
        sidp = (client.output.summary or {}).get("sidp")
        if sidp is not None and r < len(report.replicas):
            report.traces.append({"replica": r, "trace": sidp.pop("trace")})
            report.replicas[r]["sidp"] = sidp
    return report


def _restart(clients: list[PipelineClient], job: PreparedJob, plan_path: str, serve: LaunchSettings, r: int,
             threads: int | None, seat: GroupSeat, log, quiet: bool, on_failure) -> None:
    """Replica r, which fell with a lost one, started again on its own (WaS: it never meets the group)."""
    runtime = dataclasses.replace(serve.runtime, sidp_mode="was")
    client = PipelineClient(replica_job(job, r), plan_path, replica_settings(dataclasses.replace(serve, runtime=runtime), r),
                            log=log, quiet=quiet, threads=threads, seat=seat)
    client.on_failure = on_failure
    client.start()
    clients[r] = client


async def _dispatch(clients: list[PipelineClient], job: PreparedJob, out_path: str, report: ReplicaReport, log,
                    t0: float, restart=None, together: dict[int, tuple[int, ...]] | None = None) -> None:
    """Every request of the job on the replicas, as they have room; a lost replica's requests on the
    others (`_Dispatcher`)."""
    dispatcher = _Dispatcher(clients, job, out_path, report, log, t0, restart, together or {})
    tasks = [asyncio.ensure_future(dispatcher.run(r)) for r in job.requests]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


class _Dispatcher:
    """The replicas' shared state while a job runs on them: which have room, which are lost for
    good or starting again, how many requests each has taken, and the job's progress."""

    def __init__(self, clients: list[PipelineClient], job: PreparedJob, out_path: str, report: ReplicaReport, log,
                 t0: float, restart, together: dict[int, tuple[int, ...]]):
        self.clients, self.job, self.out_path, self.report, self.log = clients, job, out_path, report, log
        self.t0, self.restart, self.together = t0, restart, together
        self.loop = asyncio.get_running_loop()
        self.room = asyncio.Condition()
        self.lost: set[int] = set()              # replicas gone for good
        self.restarting: set[int] = set()
        self.taken = [0] * len(clients)          # requests handed to each replica so far
        self.causes: list[str] = []
        self.tokens, self.last_line = 0, 0.0
        report.replicas = [{"device": f"{c.job.plan.stages[0].host}/{c.job.plan.stages[0].device}", "requests": 0,
                            "output_tokens": 0} for c in clients]
        for r, c in enumerate(clients):
            c.on_failure = lambda cause, r=r: self.failed(r, cause)

    def pick(self) -> int | None:
        # ties go to the replica that has taken fewer: where the event loop runs late (a loaded machine)
        # and a short request ends before the next is handed out, the lower index would take them all
        loads = [(c.load() / max(1, c.max_batch), self.taken[r], r) for r, c in enumerate(self.clients)
                 if c.failure is None and r not in self.restarting and c.load() < c.max_batch]
        return min(loads)[-1] if loads else None

    def none_left(self) -> bool:
        return len(self.lost) == len(self.clients)

    def failed(self, r: int, cause: str) -> None:       # a client's run thread: replica r failed
        if not self.loop.is_closed():                  # (after the job: nothing left to hand over)
            asyncio.run_coroutine_threadsafe(self.replica_lost(r, cause), self.loop)

    async def replica_lost(self, r: int, cause: str) -> None:
        """Replica r failed (its client says so, with or without requests of its own): one that
        fell with another is started again alone; one that failed by itself is gone. Its requests
        go on the others (each `run` resubmits its own)."""
        clients, lost, restarting = self.clients, self.lost, self.restarting
        async with self.room:
            if r in lost or r in restarting or clients[r].failure is None:
                return
            fell_with_peer = bool(clients[r].output.peers_lost)
            readers = [q for q in self.together.get(r, ()) if q != r and q not in lost]
            (restarting if fell_with_peer and self.restart is not None and not readers else lost).add(r)
            self.causes.append(f"replica {r}: {cause}")
            self.log(f"hpipe: replica {r} ({self.report.replicas[r]['device']}) lost: {cause}; its open requests go "
                     f"on the " + ("others; starting it again on its own (WaS)" if r in restarting else "others"))
            if readers:     # they read its freed GPU memory from now on: they stop too
                lost.update(readers)
                restarting.difference_update(readers)
                self.causes.append(f"replicas {', '.join(map(str, readers))}: stopped with replica {r}, whose GPU "
                                   f"memory they read (--sidp-source peer; host-pool survives a lost replica)")
                self.log(f"hpipe: {self.causes[-1]}")
            self.room.notify_all()
        for q in readers:
            await self.loop.run_in_executor(None, clients[q].close)
        if r in restarting:
            try:
                await self.loop.run_in_executor(None, self.restart, r, lambda cause, r=r: self.failed(r, cause))
            except HpipeError as e:
                self.log(f"hpipe: replica {r} could not start again: {e}")
                lost.add(r)
            async with self.room:
                restarting.discard(r)
                self.room.notify_all()

    async def run(self, request) -> None:
        """One request to its end on a replica with room, resumed on another where its replica is lost."""
        while True:
            async with self.room:
                await self.room.wait_for(lambda: self.pick() is not None or self.none_left())
                if self.none_left():
                    raise HpipeError(f"every replica was lost ({'; '.join(self.causes)}); rerun with --resume to "
                                     f"finish")
                r = self.pick()
                handle = self.clients[r].submit_request(request, self.loop)
                self.taken[r] += 1
            kind, value, _ = await handle.queue.get()     # no output assembled: the end or an error alone
            if kind != "error":
                break
            if self.clients[r].failure is None:
                raise HpipeError(f"replica {r} ({self.report.replicas[r]['device']}): {value}")
            await self.replica_lost(r, value)
            if handle.tokens:           # it goes on after the tokens it had
                reason = request.finish_reason(handle.tokens[-1], len(handle.tokens))
                if reason is not None:
                    handle.result = protocol.Result(request.index, handle.tokens, reason, len(request.input_ids),
                                                    None, 0.0, None, None)
                    break
                request = request.resumed(handle.tokens)
        self.record(request, handle.result, r)
        async with self.room:
            self.room.notify_all()

    def record(self, request, result: protocol.Result, r: int) -> None:
        """A finished request into the results file and the report, and the progress line every 2 s."""
        fields = protocol.as_dict(result)
        del fields["index"]
        text = self.job.tokenizer.decode(result.output_ids, skip_special_tokens=True) if self.job.tokenizer else None
        record = {"id": request.id, "output_ids": result.output_ids, "text": text, **fields, "replica": r}
        formats.append_result(self.out_path, record)
        self.report.results.append(record)
        self.report.replicas[r]["requests"] += 1
        self.report.replicas[r]["output_tokens"] += len(result.output_ids)
        self.tokens += len(result.output_ids)
        now, done, total = time.time(), len(self.report.results), len(self.job.requests)
        if now - self.last_line > 2 or done == total:
            rate = self.tokens / max(now - self.t0, 1e-9)
            eta = (now - self.t0) / done * (total - done)
            self.log(f"hpipe: {done}/{total} done, {rate:.1f} tokens/s, ETA {eta:.0f} s")
            self.last_line = now


def write_mode_trace(path: str, traces: list[dict], title: str = "") -> None:
    """`--timeline-out` of a SiDP job (the SiDP paper's Fig. 15): every replica's steps with work,
    their batch (the group's largest in CaS steps) and mode; .json (the traces) or .png."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        Path(path).write_text(json.dumps({"version": 1, "traces": traces}) + "\n")
        return
    if suffix != ".png":
        raise HpipeError(f"--timeline-out {path}: a SiDP job draws its batch and mode per step as .png or .json")
    from hpipe.planner import PALETTE, pyplot

    plt = pyplot("--timeline-out", (".json",))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    colours = {"was": PALETTE[0], "cas": PALETTE[1]}
    t0 = min((t["trace"][0][0] for t in traces if t["trace"]), default=0.0)
    for t in traces:
        steps = t["trace"]
        if not steps:
            continue
        times = [s[0] - t0 for s in steps]
        ax.step(times, [s[1] for s in steps], where="post", lw=1, color="#777777")
        ax.scatter(times, [s[1] for s in steps], s=6, c=[colours[s[2]] for s in steps], zorder=3)
    steps = [s for t in traces for s in t["trace"]]
    for mode, colour in colours.items():
        n = sum(1 for s in steps if s[2] == mode)
        ax.scatter([], [], color=colour, s=20, label=f"{mode.upper()} ({n / max(len(steps), 1):.0%} of steps)")
    ax.set_ylim(0, max((s[1] for s in steps), default=0) + 1)
    ax.set_xlabel("seconds into the job")
    ax.set_ylabel("batch (running sequences)")
    ax.set_title(title or "SiDP: every replica's steps, their batch and mode (the paper's Fig. 15)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
