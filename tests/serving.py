"""An `hpipe serve` child process for the tests and the benches (bench/ has tests/ on its path):
started in a session of its own with its output in a log, ready once /health answers, stopped as a
user would stop it (Ctrl-C: SIGINT), killed with its process group only when that hangs."""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


def start_serve(cmd: list[str], log: Path, port: int | None = None, *, within: float = 240,
                **popen) -> tuple[subprocess.Popen, str]:
    """(the process, its base URL) once it is ready (`wait_ready`); `popen`: env, cwd. port None: the
    command has `--port 0`, and the port is the one its "serving ... on" line names."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True, **popen)
    base = f"http://127.0.0.1:{port if port is not None else served_port(proc, log, within)}"
    wait_ready(proc, base, log, within)
    return proc, base


def served_port(proc: subprocess.Popen, log: Path, within: float = 240) -> int:
    """The port an `hpipe serve --port 0` listens on, from its "serving ... on http://HOST:PORT/v1"
    line (the port is the server's from its start: one picked free by the test and bound by the
    server later had gone meanwhile to another process's pick)."""
    deadline = time.time() + within
    while time.time() < deadline:
        found = re.search(r"^serving .* on http://[^ ]*:(\d+)/v1 ", log.read_text(), re.M)
        if found:
            return int(found.group(1))
        if proc.poll() is not None:
            raise AssertionError(f"hpipe serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        time.sleep(0.3)
    stop_serve(proc, within=5)
    raise AssertionError(f"hpipe serve named no port within {within:.0f} s: {log.read_text()[-3000:]}")


def wait_ready(proc: subprocess.Popen, base: str, log: Path, within: float = 240) -> None:
    """Returns once GET /health answers 200. A server that exits or does not answer within `within`
    seconds raises AssertionError with its log's tail (and one that hangs is stopped)."""
    deadline = time.time() + within
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"hpipe serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):     # not listening yet, or cut off mid-answer
            time.sleep(0.5)
    stop_serve(proc, within=5)
    raise AssertionError(f"hpipe serve did not come up within {within:.0f} s: {log.read_text()[-3000:]}")


def stop_serve(proc: subprocess.Popen, within: float = 60) -> None:
    """Ctrl-C, then the process group killed if it has not exited within `within` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
