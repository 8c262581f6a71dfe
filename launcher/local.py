"""`hpipe launch --local`: every stage worker as a process on this machine.

Workers run `python -m hpipe.runtime.worker ...` (the same command the SSH launcher runs on remote
hosts), each in its own process group. Their stdout reports go to `JobOutput`; their stderr is
streamed with a `[host:rank]` prefix. If one worker fails, or on Ctrl-C, every worker is stopped
and the launch fails with one line naming the stage, its cause and its last log lines; results
already written stay in the results file.
"""

from __future__ import annotations

import collections
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpipe.errors import HpipeError
from launcher.jobs import JobOutput, LaunchSettings, PreparedJob, write_requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(python: str, plan_path: str, rank: int, world: int, addr: str, port: int, model: str,
                   requests_path: str, settings: LaunchSettings, eos: list[int], threads: int,
                   logits_out: str | None) -> list[str]:
    cmd = [python, "-m", "hpipe.runtime.worker", "--plan", plan_path, "--rank", str(rank),
           "--world-size", str(world), "--master-addr", addr, "--master-port", str(port), "--model", model,
           "--requests", requests_path, "--max-new-tokens", str(settings.max_new_tokens),
           "--temperature", repr(settings.temperature), "--seed", str(settings.seed),
           "--max-batch", str(settings.max_batch), "--eos", ",".join(map(str, eos)), "--attn", settings.attn,
           "--threads", str(threads)]
    if logits_out:
        cmd += ["--logits-out", logits_out]
    return cmd


@dataclass
class LaunchReport:
    output: JobOutput
    wall_s: float


def threads_per_stage(devices: list[str]) -> list[int]:
    """CPU threads for each local stage: the cores are shared among the CPU stages, less one core
    for each GPU stage (its process launches the kernels and must not wait for a core)."""
    cores = os.cpu_count() or 1
    n_cpu = sum(1 for d in devices if d == "cpu")
    per_cpu_stage = max(1, (cores - (len(devices) - n_cpu)) // max(1, n_cpu))
    return [per_cpu_stage if d == "cpu" else 1 for d in devices]


def launch_local(job: PreparedJob, plan_path: str, out_path: str, settings: LaunchSettings,
                 log=None, quiet: bool = False) -> LaunchReport:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    output = JobOutput(out_path, job.tokenizer)
    if not job.requests:
        log(f"hpipe: nothing to run: all {len(job.skipped)} prompts are already in {out_path}")
        return LaunchReport(output, 0.0)
    world = len(job.plan.stages)
    threads = threads_per_stage([s.device for s in job.plan.stages])
    port = free_port()
    env = dict(os.environ, HPIPE_JOB_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
    # so that `python -m hpipe.runtime.worker` finds this checkout even when it is not installed
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hpipe-launch-") as tmp:
        requests_path = str(Path(tmp) / "requests.jsonl")
        write_requests(job, Path(requests_path))
        procs: list[subprocess.Popen] = []
        lines: queue.Queue = queue.Queue()
        tails = {r: collections.deque(maxlen=20) for r in range(world)}
        readers = []
        try:
            for rank, stage in enumerate(job.plan.stages):
                cmd = worker_command(sys.executable, os.path.abspath(plan_path), rank, world, "127.0.0.1", port,
                                     str(job.source.path), requests_path, settings, job.eos, threads[rank],
                                     os.path.abspath(settings.logits_out) if settings.logits_out and rank == world - 1
                                     else None)
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True, stdin=subprocess.DEVNULL)
                procs.append(p)
                for stream, name in ((p.stdout, "out"), (p.stderr, "err")):
                    t = threading.Thread(target=_pump, args=(stream, rank, name, lines), daemon=True)
                    t.start()
                    readers.append(t)
            _watch(procs, lines, output, tails, job, log, quiet)
        except KeyboardInterrupt:
            _stop_all(procs)
            raise HpipeError(f"interrupted; every worker was stopped; {len(output.results)} results are in "
                             f"{out_path}; rerun with --resume to finish") from None
        finally:
            _stop_all(procs)
    return LaunchReport(output, time.time() - t0)


def _pump(stream, rank: int, name: str, lines: queue.Queue) -> None:
    for line in stream:
        lines.put((rank, name, line.rstrip("\n")))
    lines.put((rank, name, None))


def _watch(procs, lines: queue.Queue, output: JobOutput, tails, job: PreparedJob, log, quiet: bool) -> None:
    open_streams = 2 * len(procs)
    failed: tuple[int, int] | None = None
    while open_streams:
        try:
            rank, name, line = lines.get(timeout=0.5)
        except queue.Empty:
            line = ""
            rank = name = None
        if line is None:
            open_streams -= 1
        elif rank is not None:
            if not output.take(rank, line):
                tails[rank].append(line)
                if not quiet or name == "err" and ("Error" in line or "Traceback" in line):
                    host = job.plan.stages[rank].host
                    log(f"[{host}:{rank}] {line}")
        for r, p in enumerate(procs):
            code = p.poll()
            if code not in (None, 0) and failed is None:
                failed = (r, code)
        if failed is not None:
            break
    for p in procs:
        if failed is None:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if p.returncode not in (0, None):
                failed = (procs.index(p), p.returncode)
                break
    if failed is not None:
        rank, code = failed
        _stop_all(procs)
        # collect what is left of that worker's output
        deadline = time.time() + 2
        while time.time() < deadline:
            try:
                r, name, line = lines.get(timeout=0.1)
            except queue.Empty:
                break
            if line is not None and not output.take(r, line):
                tails[r].append(line)
        stage = job.plan.stages[rank]
        cause = output.errors.get(rank) or f"exit code {code}"
        last = " | ".join(list(tails[rank])[-5:])
        raise HpipeError(f"stage {rank} ({stage.host} {stage.device}, units {stage.units[0]}-{stage.units[1] - 1}) "
                         f"failed: {cause}" + (f"; last log lines: {last}" if last else "")
                         + f"; {len(output.results)} results were written")


def _stop_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
