"""A SiDP plan's replicas on this machine: data parallelism over one job.

Every replica is a one-stage pipeline (the plan's stage for it) started as `hpipe serve` starts
its stages, taking requests on stage 0's stdin; one dispatcher hands the job's requests out so that
no replica idles while another has a queue (a request goes to the least loaded replica with room
under its --max-batch, the rest wait), and every result is appended to the results file as it
finishes (`--resume` skips them). On a CPU host the replicas map one copy of the weights (the
packed cache or the safetensors file, read-only): SiDP's shared-mapping source, nothing fetched,
and each replica's resident weights are shared pages (Pss = 1/d of them). The CPU's cores are
split among the replicas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpipe import formats, models, protocol
from hpipe.errors import HpipeError
from hpipe.launcher.jobs import LaunchSettings, PreparedJob
from hpipe.launcher.serving import PipelineClient

__all__ = ["ReplicaReport", "check_replicas", "launch_replicas", "mapped_bytes"]


@dataclass
class ReplicaReport:
    results: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    replicas: list[dict] = field(default_factory=list)      # per replica: device, requests, tokens, mapped bytes


def check_replicas(plan: formats.Plan, plan_path: str, local: bool) -> None:
    """What this version runs of a SiDP plan: replicas on this machine that share one mapped copy."""
    if not local:
        raise HpipeError(f"{plan_path}: a SiDP plan runs its replicas on this machine (--local); over SSH "
                         f"each host would run its own group: launch the plan on each host")
    other = [g for g in plan.sidp if g.source != "shared-mapping"]
    if other:
        raise HpipeError(f"{plan_path}: sidp[{plan.sidp.index(other[0])}] reads weights from {other[0].source!r}: "
                         f"WaS and CaS between GPUs are not in this version of hpipe; plan CPU replicas "
                         f"(--sidp-source shared-mapping) or launch a plan made with --mode pipeline")


def _replica_plan(plan: formats.Plan, r: int, directory: Path) -> str:
    one = dataclasses.replace(plan, stages=(plan.stages[r],), mode="pipeline", sidp=(), predicted=None)
    path = directory / f"replica-{r}.json"
    formats.write_plan(one, path)
    return str(path)


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
    with tempfile.TemporaryDirectory(prefix="hpipe-replicas-") as tmp:
        clients = []
        try:
            for r in range(n):
                path = _replica_plan(plan, r, Path(tmp))
                clients.append(PipelineClient(dataclasses.replace(job, plan=formats.load_plan(path)), path, serve,
                                              log=log, quiet=quiet, threads=threads if cpu[r] else None))
            with concurrent.futures.ThreadPoolExecutor(n) as pool:      # the replicas load at once
                for started in [pool.submit(c.start) for c in clients]:
                    started.result()
            t0 = time.time()
            asyncio.run(_dispatch(clients, job, out_path, report, log, t0))
            report.wall_s = time.time() - t0
            for r, client in enumerate(clients):
                report.replicas[r].update(mapped_bytes(client.launch.workers[0].proc.pid, roots) or {})
        finally:
            for client in clients:
                client.close()
    return report


async def _dispatch(clients: list[PipelineClient], job: PreparedJob, out_path: str, report: ReplicaReport, log,
                    t0: float) -> None:
    loop = asyncio.get_running_loop()
    room = asyncio.Condition()
    total = len(job.requests)
    report.replicas = [{"device": f"{c.job.plan.stages[0].host}/{c.job.plan.stages[0].device}", "requests": 0,
                        "output_tokens": 0} for c in clients]
    tokens = 0
    last_line = 0.0

    def pick() -> int | None:
        loads = [(c.load() / max(1, c.max_batch), r) for r, c in enumerate(clients) if c.load() < c.max_batch]
        return min(loads)[1] if loads else None

    async def run(request) -> None:
        nonlocal tokens, last_line
        async with room:
            await room.wait_for(lambda: pick() is not None)
            r = pick()
            handle = clients[r].submit_request(request, loop)
        while True:
            kind, value = await handle.queue.get()
            if kind == "error":
                raise HpipeError(f"replica {r} ({report.replicas[r]['device']}): {value}")
            if kind == "end":
                break
        result = handle.result
        fields = protocol.as_dict(result)
        del fields["index"]
        text = job.tokenizer.decode(result.output_ids, skip_special_tokens=True) if job.tokenizer else None
        record = {"id": request.id, "output_ids": result.output_ids, "text": text, **fields, "replica": r}
        formats.append_result(out_path, record)
        report.results.append(record)
        report.replicas[r]["requests"] += 1
        report.replicas[r]["output_tokens"] += len(result.output_ids)
        tokens += len(result.output_ids)
        now = time.time()
        done = len(report.results)
        if now - last_line > 2 or done == total:
            rate = tokens / max(now - t0, 1e-9)
            eta = (now - t0) / done * (total - done)
            log(f"hpipe: {done}/{total} done, {rate:.1f} tokens/s, ETA {eta:.0f} s")
            last_line = now
        async with room:
            room.notify_all()

    tasks = [asyncio.ensure_future(run(r)) for r in job.requests]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
