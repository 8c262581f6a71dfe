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
- A CPU stage's worker, or a profiler's worker for a CPU device (`"fork_server": true` in the first
  line), is forked by the host's fork server (`hpipe.launcher.forkserver`, started here by the first
  profile or launch that needs it, in a session of its own): it imports torch and transformers once,
  and each later worker on the host starts at once instead of ~6 s of CPU importing them (a restarted
  stage after a lost host, a profile's link workers, every launch after the first). One server per
  interpreter, user, network namespace, environment and installed hpipe, torch and transformers; it
  exits after `SERVER_IDLE_S` with no worker, and kills a worker whose wrapper is gone.
  `HPIPE_HOST_SERVER=off` in the host's environment starts every worker afresh.

Standard library only; Python 3.8+.
"""

import array
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

# the modules the host's server forks (each has main(argv)): stage workers, and the profiler's (a
# profile's workers start the server that the launch after it finds)
SERVED = ("hpipe.runtime.worker", "hpipe.profiler.measure", "hpipe.profiler.links")
SERVER_IDLE_S = 300.0
# what varies between launches or SSH sessions, not what the server's imports read
PER_LAUNCH = ("HPIPE_JOB_TOKEN", "HPIPE_GROUP_TOKEN", "HPIPE_PARENT_PID", "PYTEST_CURRENT_TEST", "PWD", "OLDPWD",
              "SHLVL", "_", "MOTD_SHOWN")
SESSION_PREFIXES = ("SSH_", "XDG_SESSION_")


def main():
    config = json.loads(sys.stdin.readline() or "{}")
    env = dict(os.environ)
    env.update(config.get("env", {}))
    env["HPIPE_PARENT_PID"] = str(os.getpid())   # the worker dies with this wrapper (hpipe/lifeline.py)
    wrapper = WorkerRelay(config.get("marker", "@@hpipe "), float(config.get("timeout_s", 30)))
    starting = threading.Event()        # heartbeats while a host's fork server imports (the first worker)
    threading.Thread(target=wrapper.beat_until, args=(starting,), daemon=True).start()
    try:
        child = served(sys.argv[1:], env, config.get("cwd")) if config.get("fork_server") else None
        child = child or subprocess.Popen(sys.argv[1:], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True,
                                          cwd=config.get("cwd") or None, preexec_fn=die_with_parent)
    except OSError as e:
        starting.set()
        wrapper.report("exit", code=127, why="cannot start %s: %s" % (sys.argv[1] if len(sys.argv) > 1 else "?", e))
        return 127
    starting.set()
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

    def beat_until(self, done):
        while not done.wait(1.0):
            self.report("alive")

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


def served(argv, env, cwd):
    """The worker `argv` forked by this host's fork server, or None: another command, the server
    turned off or not to be had (the caller starts the worker itself)."""
    if len(argv) < 3 or argv[1] != "-m" or argv[2] not in SERVED or env.get("HPIPE_HOST_SERVER") == "off" or \
            not sys.platform.startswith("linux"):
        return None
    try:
        if (shutil.which(argv[0]) or argv[0]) != sys.executable:      # the server runs this interpreter
            return None
        argv = [sys.executable, *argv[1:]]
        own = {k: v for k, v in env.items() if k not in PER_LAUNCH and not k.startswith(SESSION_PREFIXES)}
        return ServedWorker(server_connection(own), argv, env, cwd or os.getcwd())
    except Exception:  # noqa: BLE001 - hpipe not found, no socket, a server that failed: a worker of its own
        return None


def server_key(env):
    """What a server serves: this interpreter, user and network namespace (emulated hosts share a
    file system), the environment its imports read, and the installed hpipe, torch and transformers
    (a server started before an upgrade must not fork the old code)."""
    files = []
    for name in ("hpipe", "hpipe.launcher", "hpipe.planner", "hpipe.profiler", "torch", "transformers"):
        origin = importlib.util.find_spec(name).origin        # imports hpipe's light __init__ alone
        walk = os.walk(os.path.dirname(origin)) if name.startswith("hpipe") else \
            [(os.path.dirname(origin), None, [os.path.basename(origin)])]     # the others' __init__
        for root, _, names in walk:
            for n in sorted(names):
                if n.endswith((".py", ".c", ".h", ".cpp")):
                    st = os.stat(os.path.join(root, n))
                    files.append((root, n, st.st_mtime_ns, st.st_size))
    ident = [sys.executable, os.getuid(), os.stat("/proc/self/ns/net").st_ino, sorted(files), sorted(env.items())]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]


def server_connection(env):
    """A connection to the server for `env`, started here (bound, then forked into a session of its
    own) if none answers; requests queue on its socket while it imports."""
    where = os.path.join(tempfile.gettempdir(), "hpipe-host-%d" % os.getuid())
    os.makedirs(where, mode=0o700, exist_ok=True)
    st = os.lstat(where)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError("%s is not this user's own" % where)
    path = os.path.join(where, server_key(env) + ".sock")
    conn = connect(path)
    if conn is not None:
        return conn
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # one server per key, however many workers start at once
        conn = connect(path)
        if conn is not None:
            return conn
        if os.path.exists(path):
            os.unlink(path)                         # a server that died (killed with its host's processes)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(64)
            subprocess.Popen([sys.executable, "-m", "hpipe.launcher.forkserver", str(listener.fileno()), "0",
                              str(SERVER_IDLE_S)], env=env, pass_fds=(listener.fileno(),), start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
        finally:
            listener.close()
        conn = connect(path)
    if conn is None:
        raise OSError("the host's fork server did not start")
    return conn


def connect(path):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        return conn
    except OSError:
        conn.close()
        return None


class ServedWorker:
    """A worker the host's server forked, with the surface of `subprocess.Popen` the relay uses:
    pid (its session's leader), stdin, stdout, stderr (binary pipes), poll() and wait(). Its exit
    code comes back on the request's connection; a server gone first reads as SIGKILL."""

    def __init__(self, conn, argv, env, cwd):
        self.conn, self.returncode = conn, None
        ends = [os.pipe() for _ in range(3)]            # stdin, stdout, stderr: (read, write)
        theirs = [ends[0][0], ends[1][1], ends[2][1]]
        try:
            payload = json.dumps({"cmd": argv, "env": env, "cwd": cwd}).encode()
            conn.settimeout(300.0)                      # the first request waits for the server's imports
            conn.sendmsg([struct.pack("!Q", len(payload))],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", theirs))])
            conn.sendall(payload)
            reply = self.line()
        except OSError:
            reply = ""
        finally:
            for fd in theirs:
                os.close(fd)
        if not reply.startswith("pid "):
            for fd in (ends[0][1], ends[1][0], ends[2][0]):
                os.close(fd)
            conn.close()
            raise OSError("the host's fork server forked no worker")
        self.pid = int(reply.split()[1])
        self.stdin = os.fdopen(ends[0][1], "wb")
        self.stdout, self.stderr = os.fdopen(ends[1][0], "rb"), os.fdopen(ends[2][0], "rb")
        conn.settimeout(None)
        self.ended = threading.Event()
        threading.Thread(target=self.await_exit, daemon=True).start()

    def line(self):
        data = b""
        while not data.endswith(b"\n"):
            byte = self.conn.recv(1)
            if not byte:
                break
            data += byte
        return data.decode()

    def await_exit(self):
        code = -int(signal.SIGKILL)
        try:
            reply = self.line()
            if reply.startswith("exit "):
                code = int(reply.split()[1])
        except (OSError, ValueError):
            pass
        self.returncode = code
        self.ended.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self.ended.wait(timeout)
        return self.returncode


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
