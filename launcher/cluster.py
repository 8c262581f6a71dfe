"""`hpipe launch --cluster` and `hpipe cluster check`: the pipeline's stages on their hosts, over SSH.

    connect (parallel, strict host keys) -> preflight every host -> [push the model] ->
    copy plan + requests -> start every worker under the remote wrapper -> stream -> tear down

Nothing starts unless every host passes the preflight. Each worker runs the runtime's worker
command unchanged (launcher.jobs.worker_command) with a per-launch random job token in its
environment. On the first fault (a worker exits non-zero, a host goes silent for
`host_timeout_s`, Ctrl-C) every remote process group of this launch is stopped and one error names
the stage, host, cause and last log lines; results already finished stay in the results file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import secrets
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpipe.launcher.elastic import Recovery, Replanner, ssh_answers, stage_names
from hpipe.launcher.jobs import (
    HEARTBEAT_TIMEOUT_S,
    JobOutput,
    job_output,
    StageFailure,
    Launch,
    StageReports,
    LaunchSettings,
    PreparedJob,
    stop_workers,
    trim_logits,
    worker_command,
)
from hpipe.launcher.local import LaunchReport, forked

from hpipe import formats, memory, models, ssh
from hpipe.errors import HpipeError
from hpipe.ssh import sha256


@dataclass
class HostCheck:
    name: str
    address: str
    problems: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def plan_hosts(plan: formats.Plan, inventory: formats.Inventory) -> list[str]:
    """The inventory hosts the plan's stages run on (in stage order); refuses stages on unknown
    hosts or devices the inventory does not list."""
    hosts = {h.name: h for h in inventory.hosts}
    names: list[str] = []
    for i, st in enumerate(plan.stages):
        if st.host not in hosts:
            raise HpipeError(f"plan stage {i} runs on host {st.host!r}, which {inventory.path} does not list "
                             f"(hosts: {', '.join(hosts)}); make the plan with --cluster {inventory.path}")
        if st.device not in hosts[st.host].devices:
            raise HpipeError(f"plan stage {i} uses {st.device} on {st.host}, but {inventory.path} lists "
                             f"{list(hosts[st.host].devices)} there")
        if st.host not in names:
            names.append(st.host)
    return names


def stage_threads(plan: formats.Plan, st: formats.StagePlan, host: formats.Host, cores: int) -> int:
    """The threads a stage gets on its host: the inventory's `threads` where it gives them, else the
    host's cores (less one per GPU stage, which keeps a core busy) over its CPU stages, and 1 for
    a GPU stage."""
    n_cpu = sum(1 for s in plan.stages if s.host == st.host and s.device == "cpu")
    n_gpu = sum(1 for s in plan.stages if s.host == st.host and s.device != "cpu")
    return host.threads or (max(1, (cores - n_gpu) // max(1, n_cpu)) if st.device == "cpu" else 1)


def warm_hosts(inventory: formats.Inventory, model_spec: str, settings: dict, plan: formats.Plan | None,
               accept_new_keys: bool, log, silence_s: float = 60.0) -> dict[str, str]:
    """`hpipe warmup --cluster`: every host with a CPU stage (the plan's; without a plan, every host
    that lists a CPU) compiles the model's decode graphs at once over SSH: `hpipe warmup` with the
    threads its CPU stages will run with (the plan's; else the host's `threads` or its cores, what
    one CPU stage alone gets) and `settings` (--quantize, --dtype, --kv-dtype); with a plan, only the
    graphs of its own stages (`--units`). Each host's lines
    are logged as they come, prefixed with its name. Returns host -> its last line, for the hosts
    that compiled; HpipeError naming the hosts that failed or fell silent for `silence_s`."""
    names = plan_hosts(plan, inventory) if plan is not None else [h.name for h in inventory.hosts if "cpu" in h.devices]
    hosts = {h.name: h for h in inventory.hosts}
    conns = ssh.connect_all(inventory, names, accept_new_keys, log=log)
    lines: queue.Queue = queue.Queue()
    procs, last, failed = {}, {}, []
    try:
        for name in names:
            cores = ssh.probe(conns[name]).get("cores") or 1
            counts = sorted({stage_threads(plan, st, hosts[name], cores) for st in plan.stages
                             if st.host == name and st.device == "cpu"}) if plan is not None else \
                [hosts[name].threads or cores]
            if not counts:
                continue                   # only GPU stages there: nothing of theirs compiles ahead
            argv = [hosts[name].python, "-m", "hpipe", "warmup", "--model", model_spec,
                    "--threads", ",".join(map(str, counts))] + [a for k, v in settings.items() for a in (k, v)]
            if plan is not None:          # its own stages' graphs (a whole model's took 2-3x as long)
                argv += ["--units", ",".join(f"{st.units[0]}-{st.units[1] - 1}" for st in plan.stages
                                             if st.host == name and st.device == "cpu")]
            procs[name] = ssh.RemoteProcess(conns[name], argv, {**hosts[name].env, "PYTHONUNBUFFERED": "1"}, lines,
                                            name, timeout_s=silence_s)
            log(f"{name}: compiling for {' and '.join(map(str, counts))} thread(s)")
        _follow_warmups(procs, lines, last, failed, silence_s, log)
    finally:
        for proc in procs.values():
            proc.close()
        for conn in conns.values():
            conn.close()
    if failed:
        raise HpipeError(f"warmup failed on {len(failed)} host(s): {'; '.join(failed)}")
    return {name: last.get(name, "") for name in procs}


def _follow_warmups(procs: dict, lines: queue.Queue, last: dict, failed: list, silence_s: float, log) -> None:
    """Logs the hosts' lines until every host's process has ended or fallen silent (its wrapper
    reports every second while it runs); `failed` gets each host that did not end well."""
    open_streams = {name: 2 for name in procs}
    while any(open_streams.values()):
        try:
            name, _, line = lines.get(timeout=1.0)
        except queue.Empty:
            for name, proc in procs.items():
                if open_streams[name] and proc.silent_s() > silence_s:
                    failed.append(f"{name} (silent for {silence_s:g} s)")
                    open_streams[name] = 0
            continue
        if line is None:
            open_streams[name] = max(0, open_streams[name] - 1)
        elif line.strip():
            last[name] = line.strip()
            log(f"{name}: {line.strip()}")
    for name, proc in procs.items():
        if any(f.startswith(f"{name} ") for f in failed):
            continue
        code = proc.wait(timeout=30)
        if code != 0:
            why = "no exit status" if code is None else proc.describe_exit(code)
            failed.append(f"{name} ({why}: {last.get(name, '')})")


def device_needs(plan: formats.Plan, config, host_name: str, kv_tokens: int, microbatch_tokens: int) -> dict:
    """Bytes each device of the host needs for its stages: the planner's memory model
    (hpipe.memory), for kv_tokens tokens of KV cache and micro-batches of up to microbatch_tokens."""
    table = models.unit_bytes(config, plan.dtype, plan.weights, plan.kv_dtype)
    need: dict[str, int] = {}
    for st in plan.stages:
        if st.host == host_name:
            units = range(*st.units)
            m = memory.stage_memory(table, units, kv_tokens, microbatch_tokens,
                                    models.host_expert_units(config, units, st.host_experts))
            need[st.device] = need.get(st.device, 0) + m.total
            if m.host:
                need["cpu"] = need.get("cpu", 0) + m.host
    return need


def check_host(conn: ssh.Connection, versions: dict, plan: formats.Plan | None = None, config=None,
               model_spec: str | None = None, kv_tokens: int = 0, microbatch_tokens: int = 1,
               push_model: bool = False, checked: frozenset[str] = frozenset(), kernels: bool = False) -> HostCheck:
    """checked: hosts whose whole check passed before in this run (a recovery's restart): their
    model files are not looked at again, their versions, free memory and a free port are.
    kernels: also which weight-only kernels each device runs, for `hpipe cluster check`'s table (the probe
    then imports torch on the host: 1.4 s alone, 3-4 s on three hosts sharing two cores, a launch's
    whole preflight otherwise; nothing a launch decides reads it)."""
    host = conn.host
    check = HostCheck(host.name, f"{host.address}:{host.port}")
    again = host.name in checked
    try:
        p = ssh.probe(conn, model=None if push_model or again else model_spec, kernels=kernels)
    except HpipeError as e:
        check.problems.append(str(e).split(": ", 1)[-1])
        return check
    check.info = p
    check.problems += [x + ("; or pass --push-model" if x.startswith("model:") else "")
                       for x in ssh.host_problems(p, versions)]
    if plan is None or config is None:
        return check
    n_cuda = len(p.get("cuda", []))
    for dev, nbytes in device_needs(plan, config, host.name, kv_tokens, microbatch_tokens).items():
        if dev.startswith("cuda"):
            index = int(dev.split(":")[1]) if ":" in dev else 0
            if index >= n_cuda:
                check.problems.append(f"{dev} not found (the host has {n_cuda} CUDA devices visible to torch)")
                continue
            free = p["cuda"][index]["free_bytes"]
        else:
            free = p.get("mem_available_bytes")
        if free is not None and nbytes > free:
            check.problems.append(f"{dev}: its stages need {nbytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB "
                                  f"free; move units to another device (hpipe plan --cuts ...)")
    return check


def preflight(conns: dict[str, ssh.Connection], **kwargs) -> list[HostCheck]:
    from concurrent.futures import ThreadPoolExecutor

    versions = ssh.local_versions()
    with ThreadPoolExecutor(max_workers=max(1, len(conns))) as pool:
        futures = [pool.submit(check_host, c, versions, **kwargs) for c in conns.values()]
        return [f.result() for f in futures]


def check_table(checks: list[HostCheck]):
    from rich.table import Table

    table = Table(title="hpipe cluster check")
    for col in ("host", "address", "status", "python / hpipe / torch / transformers", "cores", "free memory",
                "CUDA", "weight-only kernels", "model"):
        table.add_column(col)
    for c in checks:
        p = c.info
        cuda = ", ".join(f"{d['index']}: {d['name']} ({d['free_bytes'] / 2**30:.1f} GiB free)"
                         for d in p.get("cuda", [])) or "-"
        mem = p.get("mem_available_bytes")
        kernels = "\n".join(f"{d}: {line}" for d, line in (p.get("kernels") or {}).items()) or "-"
        table.add_row(c.name, c.address, "[green]ok" if c.ok else "[red]" + "\n".join(c.problems),
                      " / ".join(str(p.get(k)) for k in ("python", "hpipe", "torch", "transformers")),
                      str(p.get("cores", "?")), f"{mem / 2**30:.1f} GiB" if mem else "?", cuda, kernels,
                      (p.get("model") or {}).get("note", "-"))
    return table


def refuse_failed(checks: list[HostCheck]) -> None:
    bad = [c for c in checks if not c.ok]
    if bad:
        raise HpipeError("preflight failed, nothing was started: " +
                         "; ".join(f"host {c.name} ({c.address}): {' / '.join(c.problems)}" for c in bad))


def push_model(conns: dict[str, ssh.Connection], checks: dict[str, HostCheck], job: PreparedJob, log) -> dict[str, str]:
    """Copies to each host only the files its stages read, into ~/.cache/hpipe/pushed/<fingerprint>/,
    skipping files already there with the same SHA-256 and verifying each copy. Returns the remote
    model directory per host."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    fp = job.plan.model.fingerprint
    remote_dirs = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), transient=False) as progress:
        for name, conn in conns.items():
            units = [u for st in job.plan.stages if st.host == name for u in range(*st.units)]
            files = models.files_for_units(job.source, job.config, range(min(units), max(units) + 1))
            home = checks[name].info.get("home") or "/root"
            # a GGUF file goes as a file of the host's units alone: a directory per unit range, so
            # that a host planned again (or hosts sharing a file system) never finds two of them
            span = f"-units{min(units)}-{max(units)}" if job.source.gguf is not None else ""
            rdir = f"{home}/.cache/hpipe/pushed/{job.source.path.name}-{fp.split(':')[-1][:16]}{span}"
            remote_dirs[name] = rdir
            local_sums = {str(f): sha256(f) for f in files}
            targets = [f"{rdir}/{f.name}" for f in files]
            there = ssh.probe(conn, sha256=targets).get("sha256", {})
            todo = [(str(f), t) for f, t in zip(files, targets) if there.get(t) != local_sums[str(f)]]
            total = sum(os.path.getsize(f) for f, _ in todo)
            task = progress.add_task(f"push to {name}", total=total or 1)
            done = 0
            for local, remote in todo:
                ssh.put_files(conn, [(local, remote)],
                              progress=lambda n, base=done, t=task: progress.update(t, completed=base + n))
                done += os.path.getsize(local)
            progress.update(task, completed=total or 1)
            if todo:
                after = ssh.probe(conn, sha256=[t for _, t in todo]).get("sha256", {})
                bad = [t for (f, t) in todo if after.get(t) != local_sums[f]]
                if bad:
                    raise HpipeError(f"host {name}: checksum mismatch after copying {bad[0]}; retry --push-model")
            n_shards = sum(1 for f in files if f.suffix in (".safetensors", ".gguf"))
            all_shards = len(list(job.source.path.glob("*.safetensors"))) or 1
            log(f"hpipe: {name}: {len(todo)} of {len(files)} model files copied ({n_shards} of {all_shards} weight "
                f"shards needed; {total / 2**20:.1f} MiB) to {rdir}")
    return remote_dirs


def remote_model_spec(source: models.ModelSource) -> str:
    """What the hosts are told to load: the built-in name as is, a path made absolute (the same
    path must exist there, or use --push-model)."""
    if source.name == models.DEFAULT_MODEL:
        return source.name
    path = Path(source.name).expanduser()
    return str(path.resolve()) if path.exists() else source.name


def launch_cluster(job: PreparedJob, plan_path: str, inventory: formats.Inventory, out_path: str,
                   settings: LaunchSettings, *, accept_new_keys: bool = False, push: bool = False,
                   host_timeout_s: float = HEARTBEAT_TIMEOUT_S, log=None, quiet: bool = False,
                   recover: bool = True) -> LaunchReport:
    """As `launch_local`, on the inventory's hosts over SSH. With `recover`, a lost host's stages
    are planned again over the hosts still up (launcher/elastic.py) and the prompts without a result
    run there: the job finishes without --resume, every id once (`output.events` says what
    happened); the report's `plan` is the one the job finished on."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    output = job_output(job, out_path, log, quiet)
    if not job.requests:
        log(f"hpipe: nothing to run: all {len(job.skipped)} prompts are already in {out_path}")
        return LaunchReport(output, 0.0)
    try:
        return _run_on_hosts(job, plan_path, inventory, out_path, settings, output, accept_new_keys, push,
                             host_timeout_s, log, quiet, recover)
    finally:
        output.close_progress()


def _run_on_hosts(job: PreparedJob, plan_path: str, inventory: formats.Inventory, out_path: str,
                  settings: LaunchSettings, output: JobOutput, accept_new_keys: bool, push: bool,
                  host_timeout_s: float, log, quiet: bool, recover: bool) -> LaunchReport:
    """launch_cluster's runs: the plan's, then after each lost host the one planned without it."""
    replanner = Replanner(job.plan, job.config, job.plan.model.name, inventory, log) if recover else None
    lost: set[str] = set()
    checked: set[str] = set()
    t0 = time.time()
    failed_starts = 0
    while True:
        t_start = time.monotonic()
        try:
            launch = start_cluster(job, plan_path, inventory, settings, output, accept_new_keys=accept_new_keys,
                                   push=push, host_timeout_s=host_timeout_s, log=log, quiet=quiet, checked=checked)
            launch.where = f" to {out_path}"
            if output.events:
                output.events[-1].phases["start"] = round(time.monotonic() - t_start, 3)
            launch.wait()
            return LaunchReport(output, time.time() - t0, job.plan)
        except HpipeError as e:
            # the first start's refusals (preflight, keys) stand; later, a start that failed or a stage lost
            if replanner is None or not (isinstance(e, StageFailure) or output.events):
                raise
            failure = e
        if isinstance(failure, StageFailure):
            gone = [failure.host]
        else:       # a start after a loss failed: the hosts that no longer answer SSH
            up = set(replanner.hosts) - lost
            gone = sorted({h for h in up if not ssh_answers(inventory, h, accept_new_keys)})
            failed_starts += 1
            if not gone and failed_starts >= 3:
                raise failure
        lost.update(gone)
        checked.difference_update(gone)
        event = Recovery("lost", ",".join(gone) or "?", " ".join(str(failure).split()),
                         old_stages=stage_names(job.plan))
        event.phases["notice"] = round(getattr(failure, "silent_s", 0.0), 3)
        log(f"hpipe: lost host {event.host}: {event.cause}")
        t = time.monotonic()
        try:
            plan = replanner.plan_for(set(replanner.hosts) - lost)
        except HpipeError as e:
            raise HpipeError(f"{e}; {output.done_line()} to {out_path}; rerun with --resume once a host is back") \
                from None
        event.phases["replan"] = round(time.monotonic() - t, 3)
        done = {r["id"] for r in output.results}
        left = [dataclasses.replace(r, index=i) for i, r in enumerate(r for r in job.requests if r.id not in done)]
        event.new_stages, event.resumed = stage_names(plan), len(left)
        output.events.append(event)
        log(f"hpipe: planned again: {' -> '.join(event.new_stages)}; {len(left)} prompts left run there")
        plan_path = os.path.join(tempfile.mkdtemp(prefix="hpipe-plans-"), "plan.json")
        formats.write_plan(plan, plan_path)
        job = dataclasses.replace(job, plan=plan, requests=left)
        output.requests = left
        output.restart(plan)


def start_cluster(job: PreparedJob, plan_path: str, inventory: formats.Inventory, settings: LaunchSettings,
                  output: StageReports, *, accept_new_keys: bool = False, push: bool = False,
                  host_timeout_s: float = HEARTBEAT_TIMEOUT_S, log=None, quiet: bool = False,
                  checked: set[str] | None = None) -> Launch:
    """Connects, checks and starts every stage on its host (serving: stage 0's requests go through
    its wrapper's stdin); the returned Launch drives them and tears everything down at its end.
    checked: the hosts whose whole preflight passed before in this run (checked lightly; those
    that pass now are added)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    plan = job.plan
    names = plan_hosts(plan, inventory)
    hosts = {h.name: h for h in inventory.hosts}
    conns = ssh.connect_all(inventory, names, accept_new_keys, log)
    launch_id = secrets.token_hex(6)
    workers: list[ssh.RemoteProcess] = []
    remote_tmp = f"/tmp/hpipe-launch-{launch_id}"

    def cleanup() -> None:
        stop_workers(workers)
        lost = {w.conn.host.name for w in workers if w.silent_s() > 2.0}
        for w in workers:
            w.close()
        _remove_remote_tmp({n: c for n, c in conns.items() if n not in lost}, remote_tmp)
        for c in conns.values():
            c.close()

    try:
        kv_tokens, microbatch = _memory_asked(job, settings)
        spec = remote_model_spec(job.source)
        checks = preflight(conns, plan=plan, config=job.config, model_spec=spec, kv_tokens=kv_tokens,
                           microbatch_tokens=microbatch, push_model=push, checked=frozenset(checked or ()))
        refuse_failed(checks)
        if checked is not None:
            checked.update(names)
        by_name = {c.name: c for c in checks}
        model_on = push_model(conns, by_name, job, log) if push else {n: spec for n in names}
        files = {"plan.json": Path(plan_path).read_bytes(),
                 "requests.jsonl": "".join(json.dumps(r.to_json()) + "\n" for r in job.requests).encode()}
        for name in names:
            ssh.write_files(conns[name], remote_tmp, files)
        lines: queue.Queue = queue.Queue()
        rendezvous = _start_workers(workers, lines, conns, hosts, by_name, plan, model_on, remote_tmp, settings,
                                    host_timeout_s)
        if not quiet:
            log(f"hpipe: launched {len(plan.stages)} stages on {', '.join(names)} (rendezvous {rendezvous})")
    except BaseException:
        cleanup()
        raise

    def fetch_logits() -> None:
        ssh.get_file(conns[plan.stages[-1].host], f"{remote_tmp}/logits.npz", settings.logits_out)
        trim_logits(settings.logits_out, output.results)

    return Launch(workers, lines, output, plan, log, quiet, host_timeout_s=host_timeout_s,
                  finish=fetch_logits if settings.logits_out else None, cleanup=cleanup, log_dir=settings.log_dir)


def _start_workers(workers: list, lines: queue.Queue, conns: dict, hosts: dict, by_name: dict, plan: formats.Plan,
                   model_on: dict[str, str], remote_tmp: str, settings: LaunchSettings, host_timeout_s: float) -> str:
    """Every stage's worker on its host, under the wrapper, into `workers` as each starts (so that a
    failure midway stops those already running); returns the rendezvous, host:port on stage 0's host."""
    master = hosts[plan.stages[0].host]
    port = by_name[master.name].info["free_port"]
    token, world = secrets.token_hex(16), len(plan.stages)
    for rank, st in enumerate(plan.stages):
        host = hosts[st.host]
        threads = stage_threads(plan, st, host, by_name[st.host].info.get("cores") or 1)
        logits = f"{remote_tmp}/logits.npz" if settings.logits_out and rank == world - 1 else None
        argv = worker_command(host.python, f"{remote_tmp}/plan.json", rank, world, master.address, port,
                              model_on[st.host], None if settings.serve else f"{remote_tmp}/requests.jsonl",
                              settings, threads, logits)
        env = {**host.env, "HPIPE_JOB_TOKEN": token, "PYTHONUNBUFFERED": "1"}
        workers.append(ssh.RemoteProcess(conns[st.host], argv, env, lines, rank, timeout_s=host_timeout_s,
                                         fork_server=forked(st.device)))
    return f"{master.address}:{port}"


def _memory_asked(job: PreparedJob, settings: LaunchSettings) -> tuple[int, int]:
    """What the preflight checks each host's memory for: KV tokens and the largest micro-batch's.
    A server's KV pool sizes itself from free memory: room for one longest sequence."""
    plan, runtime = job.plan, settings.runtime
    if settings.serve:
        kv_tokens = models.max_model_len(runtime.max_model_len, job.config)
        return kv_tokens, memory.microbatch_tokens([plan.slicing.slices_for(kv_tokens)[0]], runtime.max_batch)
    running = min(runtime.max_batch, len(job.requests))
    kv_tokens = max(len(r.input_ids) + r.max_new_tokens for r in job.requests) * running
    slices = [max(plan.slicing.slices_for(len(r.input_ids))) for r in job.requests]
    return kv_tokens, memory.microbatch_tokens(slices, running)


def _remove_remote_tmp(conns: dict[str, ssh.Connection], path: str) -> None:
    for conn in conns.values():
        try:
            transport = conn.client.get_transport()
            if transport is None or not transport.is_active():
                continue
            chan = transport.open_session(timeout=2)
            chan.exec_command(f"rm -rf {shlex.quote(path)}")
            chan.settimeout(3)
            chan.recv_exit_status()
            chan.close()
        except Exception:  # noqa: BLE001, S110 - best effort on a host that may be gone
            pass
