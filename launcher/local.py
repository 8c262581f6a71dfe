"""`hpipe launch --local`: every stage worker as a process on this machine.

Workers run `python -m hpipe.runtime.worker ...` (the same command the SSH launcher runs on remote
hosts), each in its own process group; `start_local` returns the `Launch` that drives them. Their
stdout reports go to the launch's output (`JobOutput` for a batch job); their stderr is streamed
with a `[host:rank]` prefix. If one worker fails, or on Ctrl-C, every worker is stopped
and the launch fails with one line naming the stage, its cause and its last log lines; results
already written stay in the results file.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from hpipe import formats
from hpipe.launcher import forkserver
from hpipe.lifeline import PARENT_ENV, arm_parent_death_signal
from hpipe.net import free_port
from hpipe.request import write_requests
from hpipe.launcher.jobs import (
    JobOutput,
    job_output,
    GroupSeat,
    Launch,
    LaunchSettings,
    PreparedJob,
    StageReports,
    stop_workers,
    trim_logits,
    worker_command,
)


@dataclass
class LaunchReport:
    output: JobOutput
    wall_s: float
    plan: formats.Plan | None = None    # the plan the job finished on (another after a lost host)


def threads_per_stage(devices: list[str]) -> list[int]:
    """CPU threads for each local stage: the cores are shared among the CPU stages, less one core
    for each GPU stage (its process launches the kernels and must not wait for a core)."""
    cores = os.cpu_count() or 1
    n_cpu = sum(1 for d in devices if d == "cpu")
    per_cpu_stage = max(1, (cores - (len(devices) - n_cpu)) // max(1, n_cpu))
    return [per_cpu_stage if d == "cpu" else 1 for d in devices]


def launch_local(job: PreparedJob, plan_path: str, out_path: str, settings: LaunchSettings,
                 log=None, quiet: bool = False) -> LaunchReport:
    """Runs the batch job until every worker has ended."""
    log = log or _stderr
    output = job_output(job, out_path, log, quiet)
    if not job.requests:
        log(f"hpipe: nothing to run: all {len(job.skipped)} prompts are already in {out_path}")
        return LaunchReport(output, 0.0)
    launch = start_local(job, plan_path, settings, output, log, quiet)
    launch.where = f" to {out_path}"
    try:
        return LaunchReport(output, launch.wait())
    finally:
        output.close_progress()


def forked(device: str) -> bool:
    """Whether a local stage on `device` is forked by the fork server: CPU stages. A process that
    imported torch may fork before CUDA is initialised, but a GPU stage's process starts afresh."""
    return device == "cpu"


def worker_env() -> dict[str, str]:
    """The environment every local worker starts in, before what each launch adds (its tokens)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # so that `python -m hpipe.runtime.worker` finds this checkout even when it is not installed
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def prestart_local(plan_path: str) -> None:
    """Starts this process's fork server now where the plan has CPU stages: forked from this process
    after its imports where it has no thread yet (the `hpipe` command: the server's imports are the
    launch's own, paid once), else a process of its own whose imports (~6 s of CPU) run while the
    launch prepares its job. A plan that does not load is left to the job's own checks."""
    try:
        devices = [s.device for s in formats.load_plan(plan_path).stages]
    except Exception:  # noqa: BLE001 - `prepare` reports what is wrong with the plan, in one line
        return
    if any(forked(d) for d in devices):
        forkserver.start(worker_env(), here=True)


def start_local(job: PreparedJob, plan_path: str, settings: LaunchSettings, output: StageReports, log=None,
                quiet: bool = False, threads: int | None = None, seat: GroupSeat | None = None) -> Launch:
    """Starts every stage as a local process; the returned Launch drives them. Serving
    (`settings.serve`) stage 0 takes requests on its stdin (`Launch.send`). threads: every CPU
    stage's (default: the cores shared among the job's CPU stages). seat: a SiDP replica's (the
    plan at plan_path is the whole SiDP plan; job.plan the replica's one stage)."""
    log = log or _stderr
    world = len(job.plan.stages)
    threads = [threads or t if s.device == "cpu" else t
               for s, t in zip(job.plan.stages, threads_per_stage([s.device for s in job.plan.stages]))]
    port = free_port()
    env = dict(worker_env(), HPIPE_JOB_TOKEN=secrets.token_hex(16))
    env[PARENT_ENV] = str(os.getpid())       # the workers die with us (hpipe.lifeline)
    if seat is not None:
        env["HPIPE_GROUP_TOKEN"] = seat.token
    tmp = tempfile.mkdtemp(prefix="hpipe-local-")
    requests_path = None
    if not settings.serve:
        requests_path = str(Path(tmp) / "requests.jsonl")
        write_requests(job.requests, requests_path)
    workers: list[LocalWorker] = []
    lines: queue.Queue = queue.Queue()
    logits = os.path.abspath(settings.logits_out) if settings.logits_out else None

    def cleanup() -> None:
        stop_workers(workers)
        shutil.rmtree(tmp, ignore_errors=True)

    try:
        for rank, stage in enumerate(job.plan.stages):
            cmd = worker_command(sys.executable, os.path.abspath(plan_path), rank, world, "127.0.0.1", port,
                                 str(job.source.location), requests_path, settings, threads[rank],
                                 logits if rank == world - 1 else None, seat)
            workers.append(LocalWorker(cmd, env, rank, lines, takes_input=settings.serve and rank == 0,
                                       fork=forked(stage.device)))
    except BaseException:
        cleanup()
        raise
    finish = (lambda: trim_logits(logits, output.results)) if logits else None
    return Launch(workers, lines, output, job.plan, log, quiet, finish=finish, cleanup=cleanup,
                  log_dir=settings.log_dir)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pump(stream, rank: int, name: str, lines: queue.Queue) -> None:
    for line in stream:
        lines.put((rank, name, line.rstrip("\n")))
    lines.put((rank, name, None))


class LocalWorker:
    """A worker process in its own process group, with the surface `watch_workers` expects."""

    def __init__(self, cmd: list[str], env: dict, rank: int, lines: queue.Queue, takes_input: bool = False,
                 fork: bool = True):
        """fork: forked by this process's fork server (`hpipe.launcher.forkserver`) where it can,
        else (and for GPU stages) a process of its own."""
        self.proc = (forkserver.spawn(cmd, env, takes_input) if fork else None) or \
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True, stdin=subprocess.PIPE if takes_input else subprocess.DEVNULL,
                             preexec_fn=arm_parent_death_signal)
        self.input_lock = threading.Lock()
        for stream, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            threading.Thread(target=_pump, args=(stream, rank, name, lines), daemon=True).start()

    def send_line(self, line: str) -> bool:
        """One line to the worker's stdin (serving: stage 0's requests); False once it is gone."""
        with self.input_lock:
            try:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
                return True
            except (OSError, ValueError, AttributeError):
                return False

    def poll(self):
        return self.proc.poll()

    def wait(self, timeout=None):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def silent_s(self) -> float:
        return 0.0

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def describe_exit(self, code: int) -> str:
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"
