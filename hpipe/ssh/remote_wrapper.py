"""Runs on a remote host, around one worker: `python -c <this file's text> WORKER_ARGV...`.

hpipe/ssh/connect.py sends this file's source with every remote command, so the wrapper always matches the
launcher and needs nothing installed. It exists because sshd signals nothing to a command when the
connection drops (no pty): without it, a launcher that dies or loses a host leaves workers running.

- The first stdin line is JSON: {"env": {...}, "timeout_s": T, "marker": "@@hpipe "}. The env
  (job token included) never appears on a command line.
- The worker runs in its own session and process group, with stdout and stderr relayed line by
  line; every second the wrapper prints `<marker>{"type": "alive"}` so the launcher can tell a
  silent host from a dead one.
- A line `input TEXT` from the launcher goes to the worker's stdin as TEXT (serving: stage 0 takes
  its requests there); the worker's stdin closes when the launcher's does.
- The whole group is stopped (SIGTERM, then SIGKILL after 3 s) when the launcher writes `stop`,
  when stdin reaches EOF (the channel closed), when no line (the launcher pings every second)
  came for T seconds (the host lost its link), or on SIGHUP/SIGINT/SIGTERM.
- Its last line is `<marker>{"type": "exit", "code": C, "why": ...}`; C < 0 means killed by
  signal -C. It exits with the worker's status (128 + signal when killed).

Standard library only; Python 3.8+.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time


def main():
    config = json.loads(sys.stdin.readline() or "{}")
    env = dict(os.environ)
    env.update(config.get("env", {}))
    env["HPIPE_PARENT_PID"] = str(os.getpid())   # the worker dies with this wrapper (hpipe/lifeline.py)
    wrapper = WorkerRelay(config.get("marker", "@@hpipe "), float(config.get("timeout_s", 30)))
    try:
        child = subprocess.Popen(sys.argv[1:], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True, cwd=config.get("cwd") or None,
                                 preexec_fn=die_with_parent)
    except OSError as e:
        wrapper.report("exit", code=127, why="cannot start %s: %s" % (sys.argv[1] if len(sys.argv) > 1 else "?", e))
        return 127
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: wrapper.stop("wrapper got signal %d" % signum))
    code = wrapper.watch(child)
    return code if code >= 0 else 128 - code


class WorkerRelay:
    """One worker's relay: its output to the launcher line by line, the launcher's `input` lines
    to it, a heartbeat every second, and the reason it is stopped (the first one given)."""

    def __init__(self, marker, timeout):
        self.marker, self.timeout = marker, timeout
        self.lock = threading.Lock()
        self.out, self.err = sys.stdout.buffer, sys.stderr.buffer
        self.heard = time.monotonic()
        self.why = None

    def say(self, stream, data):
        with self.lock:
            stream.write(data)
            stream.flush()

    def report(self, kind, **fields):
        fields["type"] = kind
        self.say(self.out, (self.marker + json.dumps(fields) + "\n").encode())

    def stop(self, why):
        if self.why is None:
            self.why = why

    def relay(self, src, dst):
        for line in iter(src.readline, b""):
            self.say(dst, line)

    def listen(self, child):
        for line in sys.stdin:
            self.heard = time.monotonic()
            if line.startswith("input "):
                try:
                    child.stdin.write(line[len("input "):].encode())
                    child.stdin.flush()
                except (OSError, ValueError):
                    pass
            elif line.strip() == "stop":
                self.stop("stopped by the launcher")
        self.stop("the launcher's connection closed")

    def watch(self, child):
        """Relays until the worker exits or is stopped; reports its exit and returns its code."""
        self.heard = time.monotonic()
        relays = [threading.Thread(target=self.relay, args=(child.stdout, self.out), daemon=True),
                  threading.Thread(target=self.relay, args=(child.stderr, self.err), daemon=True)]
        for t in relays + [threading.Thread(target=self.listen, args=(child,), daemon=True)]:
            t.start()
        next_beat = 0.0
        while child.poll() is None:
            now = time.monotonic()
            if now - self.heard > self.timeout:
                self.stop("no word from the launcher for %.0f s" % self.timeout)
            if self.why is not None:
                kill_group(child)
                break
            if now >= next_beat:
                self.report("alive")
                next_beat = now + 1.0
            time.sleep(0.05)
        try:
            os.killpg(child.pid, signal.SIGKILL)  # anything the worker left in its group
        except OSError:
            pass
        for t in relays:
            t.join(timeout=2)
        self.report("exit", code=child.returncode, why=self.why)
        return child.returncode


def die_with_parent():
    """In the child, before exec: the kernel kills it with SIGKILL when this wrapper dies, even by
    SIGKILL, even while it still imports torch (the setting survives exec; Linux only)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - other systems: the worker's own lifeline thread remains
        pass


def kill_group(child):
    try:
        os.killpg(child.pid, signal.SIGTERM)
        os.killpg(child.pid, signal.SIGCONT)   # a stopped process would never see the SIGTERM
    except OSError:
        return
    deadline = time.monotonic() + 3
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    child.wait()


if __name__ == "__main__":
    sys.exit(main())
