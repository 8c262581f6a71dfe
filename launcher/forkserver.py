"""A fork server for local stage workers: one process imports torch, transformers' model modules
and the stage worker once, then forks a worker for every stage of every local launch.

Why: a worker spends ~6 s of CPU importing before it reads its plan (torch 2.1 s, transformers and
its Llama modules 4.3 s, on this kind of machine), and a local launch's stages share the host's
cores: a 3-stage launch of a tiny model took 17.4 s wall and 25 s of CPU for 0.2 s of tokens. The
server pays that once per launching process (`hpipe serve` restarting stages after a lost host,
the SiDP replicas, the test suite's hundreds of launches) and a forked worker starts at once.

The server is started lazily by the first local launch that can use it (CPU stages only: a
process that imported torch may fork before CUDA is initialised, but a GPU stage is started as a
fresh process all the same) and lives as long as its launching process. The `hpipe` command forks
it from itself after importing what the server imports, before any thread of its own: the command
needs most of those imports anyway, and paying them twice cost a local launch ~2.5 s of its ~11 s
of CPU here. Any other launching process (a test's, one with threads) starts it as a process of
its own. Either way:
- it polls its parent (a parent-death signal follows the thread that started the server, and any
  thread may launch) and exits within `POLL_S` of its death; every worker it forks arms the
  parent-death signal against the server (`hpipe.lifeline`), so none outlives either;
- it stays single-threaded (forking a process with threads can deadlock the child);
- it serves one environment: the workers' environment less what each launch sets
  (`PER_LAUNCH_ENV`); OpenMP and torch read theirs when torch is imported. A launch from another
  environment starts a server of its own in place of the old one.

One request per worker, on its own connection to the server's Unix socket: the worker's stdin,
stdout and stderr (the launcher's pipe ends, as file descriptors), then its command, environment and
working directory as JSON. The server forks; the child starts a session of its own, takes the
descriptors and environment and calls the module's `main(argv)`. The server answers with the
child's pid and, when it has reaped the child, its exit code as `subprocess` gives it (negative:
the signal). `Forked` is the launcher's handle on such a worker, with Popen's surface.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from hpipe.lifeline import PARENT_ENV, arm_parent_death_signal

__all__ = ["Forked", "command_process", "spawn", "start"]

# what the server imports before it forks: what every stage worker imports first
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "hpipe.runtime.worker")
# what a stage that loads compiled decode graphs imports next (~0.9 s of CPU on a 2-core EPYC): a
# host's server, which outlives its launches, imports it once when no worker runs, so the stages
# of every later launch find it imported; a launch's own server does not (its stages are forked at
# once, and an eager job would pay it for nothing)
IDLE_PRELOAD = ("torch._inductor.graph", "torch._inductor.decomposition",
                "torch._functorch._aot_autograd.aot_autograd_result", "torch.utils.cpp_extension")
# what each launch sets, and pytest's name for the test it runs now (it changes under a test
# process at every test: a suite's local launches once started a server per test, ~4 s of imports each)
PER_LAUNCH_ENV = ("HPIPE_JOB_TOKEN", "HPIPE_GROUP_TOKEN", PARENT_ENV, "PYTEST_CURRENT_TEST")
# what a process's own libraries write into its environment as they run, each read at a call (which
# in a forked worker sees the launch's environment), not at an import: a launching process that
# ran a stage or loaded a compiled graph itself has them set, and each, changed, started a new
# server (~4 s of CPU importing: the test suite's workers, which run stages in their own process)
RUNTIME_ENV = ("TRANSFORMERS_SDPA_FORCE_GQA", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
POLL_S = 0.25
REPLY_S = 300.0          # the longest a launcher waits for a pid (the first waits for the imports)
REQUEST_S = 10.0         # the longest the server waits for a request's bytes after its connection
_HEADER = struct.Struct("!Q")        # the JSON's length, sent with the descriptors


# ------------------------------------------------------------------------------ the launcher's side
class Forked:
    """A worker the server forked: `subprocess.Popen`'s pid, stdin/stdout/stderr (text), poll() and
    wait(timeout) (raising `subprocess.TimeoutExpired`). Its exit code comes from the server over
    the request's connection; a server gone before the worker's end reads as SIGKILL (the worker
    is killed with it)."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], stdin, stdout, stderr):
        self.conn, self.pid, self.args = conn, pid, args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._ended = threading.Event()
        threading.Thread(target=self._await_exit, name=f"hpipe-forked-{pid}", daemon=True).start()

    def _await_exit(self) -> None:
        code = -int(signal.SIGKILL)
        try:
            line = _read_line(self.conn)
            if line.startswith("exit "):
                code = int(line.split()[1])
        except (OSError, ValueError):
            pass
        finally:
            self.conn.close()
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class _Server:
    """The running server: its process, socket and the environment it serves."""

    def __init__(self, env: dict[str, str], here: bool):
        """here: forked from this process after it imported `PRELOAD` (its imports paid once, not
        twice); else a process of its own. Raises OSError where the server cannot be set up (the
        caller starts workers itself)."""
        self.key = _env_key(env)
        # a private directory (0700): only this user reaches the socket, and it forks as this user
        self.dir = tempfile.mkdtemp(prefix="hpipe-forkserver-")
        self.address = os.path.join(self.dir, "socket")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                listener.bind(self.address)         # OSError for a path over 107 bytes (a long TMPDIR)
                listener.listen(64)
                # the listening socket is the server's from the start: requests queue while it imports
                own_env = {k: v for k, v in env.items() if k not in PER_LAUNCH_ENV}
                self.proc = _fork_server(listener, own_env) if here else subprocess.Popen(
                    [sys.executable, "-m", "hpipe.launcher.forkserver", str(listener.fileno()), str(os.getpid())],
                    env=own_env, pass_fds=(listener.fileno(),), start_new_session=True,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def retire(self) -> None:
        """No more workers from this server: it exits once those it forked have ended."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)     # the server holds its socket open; nobody else reaches it

    def kill(self) -> None:
        """At the launching process's exit (its workers are gone or going with it)."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def fork(self, cmd: list[str], env: dict[str, str], takes_input: bool) -> Forked | None:
        """Asks for one worker; None when the server cannot fork it (it failed to start, died, or
        did not answer within `REPLY_S`: it is then killed)."""
        stdin_r, stdin_w = os.pipe() if takes_input else (os.open(os.devnull, os.O_RDONLY), None)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ours = [fd for fd in (stdin_w, out_r, err_r) if fd is not None]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = None
        try:
            conn.settimeout(REPLY_S)      # the first request waits for the server's imports
            conn.connect(self.address)
            payload = json.dumps({"cmd": cmd, "env": env, "cwd": os.getcwd()}).encode()
            socket.send_fds(conn, [_HEADER.pack(len(payload))], [stdin_r, out_w, err_w])
            conn.sendall(payload)
            reply = _read_line(conn)
            pid = int(reply.split()[1]) if reply.startswith("pid ") else None
            conn.settimeout(None)         # the exit line comes when the worker ends
        except socket.timeout:
            self.kill()
        except (OSError, ValueError):
            pass
        except BaseException:             # interrupted (Ctrl-C): nothing of this worker stays behind
            if pid is not None:
                _kill_group(pid)
            conn.close()
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, out_w, err_w):        # the child's ends: the child holds them now
                os.close(fd)
        if pid is None:
            conn.close()
            for fd in ours:
                os.close(fd)
            return None
        return Forked(conn, pid, cmd, open(stdin_w, "w", encoding="utf-8") if takes_input else None,
                      open(out_r, encoding="utf-8", errors="replace"), open(err_r, encoding="utf-8", errors="replace"))


class _ServerChild:
    """The server forked from this process, with the surface of `subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:              # reaped by someone else: gone all the same
                self.returncode = -int(signal.SIGKILL)
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["hpipe.launcher.forkserver"], timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def command_process() -> None:
    """Called by the `hpipe` command at its start: until its fork server starts, this process runs
    no thread of its own and no parallel region (OpenMP's pool, once started, would not be there in
    a forked child), so the server may be forked from it (`start(..., here=True)`)."""
    global _COMMAND
    _COMMAND = True


def _preload(env: dict[str, str]) -> dict[str, str]:
    """Imports `PRELOAD` here, as the server would; `env` with what the imports set in this
    process's environment (hpipe's defaults for inductor's cache and the hub), which the launch's
    workers now get too."""
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    return {**env, **{k: v for k, v in os.environ.items() if before.get(k) != v}}


def _fork_server(listener: socket.socket, env: dict[str, str]) -> _ServerChild:
    """The server as a fork of this process, which has imported what the server would (`_preload`):
    the launching process pays the imports once, not twice (~4 s of CPU a local launch here). Only
    from the `hpipe` command before its first thread (`command_process`); the native threads of
    OpenBLAS that numpy's import starts are fork-safe (the server forks workers beside them too)."""
    launcher = os.getpid()
    for stream in (sys.stdout, sys.stderr):     # else the child's copy of their buffers reaches a worker's pipes
        stream.flush()
    pid = os.fork()
    if pid:
        return _ServerChild(pid)
    try:                              # the child: what `start_new_session` and the DEVNULLs give a Popen
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, listener.fileno())
        os.closerange(listener.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        serve(listener.fileno(), launcher)
    finally:
        os._exit(1)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


_SERVER: _Server | None = None
_COMMAND = False             # this process is the `hpipe` command (command_process)
_RETIRED: list[_Server] = []
_LOCK = threading.Lock()


def spawn(cmd: list[str], env: dict[str, str], takes_input: bool) -> Forked | None:
    """The worker `cmd` (`python -m MODULE ARGS`, the module having `main(argv)`) forked by this
    process's server for `env` (started here at first; a launch from another environment retires
    the old server, whose workers run on, and starts one of its own); None where the server cannot
    fork it: the caller starts the command as a process of its own."""
    if _module_argv(cmd)[0] is None:
        return None
    server = start(env)
    return None if server is None else server.fork(cmd, env, takes_input)


def start(env: dict[str, str], here: bool = False) -> _Server | None:
    """This process's server for `env`, started now if need be (a launch may start it ahead of its
    workers); None off Linux. here: the `hpipe` command at its start, before any thread of its
    own, forks the server from itself after importing what the server imports, which the launch
    then finds imported; otherwise the server is a process of its own, whose imports overlap the
    launch's work."""
    global _SERVER
    if not sys.platform.startswith("linux"):
        return None
    with _LOCK:
        if _SERVER is not None and (not _SERVER.alive() or _SERVER.key != _env_key(env)):
            _SERVER.retire()
            _RETIRED.append(_SERVER)
            _SERVER = None
        _RETIRED[:] = [s for s in _RETIRED if s.alive()]      # reaped
        if _SERVER is None:
            try:
                here = here and _COMMAND and threading.active_count() == 1
                _SERVER = _Server(_preload(env) if here else env, here)
            except OSError:
                return None
            atexit.register(_SERVER.kill)
        return _SERVER


def _read_line(conn: socket.socket) -> str:
    """One line of the server's answers, read byte by byte: the exit line may follow the pid line
    at once, and a buffered reader would take it along."""
    data = b""
    while not data.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            break
        data += byte
    return data.decode()


def _env_key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in PER_LAUNCH_ENV and k not in RUNTIME_ENV))


def _module_argv(cmd: list[str]) -> tuple[str | None, list[str]]:
    """`[python, "-m", module, *argv]` -> (module, argv); (None, []) for any other command."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
        return cmd[2], list(cmd[3:])
    return None, []


# ------------------------------------------------------------------------------ the server's side
def _import_frozen(names: tuple[str, ...]) -> None:
    """`names` imported, and what the imports made (hundreds of thousands of objects) frozen before
    any fork: a forked worker's collections, the full one its build makes before freezing what it
    made (`StageWorker.build`) among them, walk its own objects alone (walking the server's too cost
    a SmolLM2 stage ~0.3 s of CPU at its start), and none writes to the pages it shares with the
    server. Not collected first (a full collection of the server's objects costs what it saves a
    worker): the little garbage the imports left stays."""
    for name in names:
        importlib.import_module(name)
    gc.freeze()


def serve(listener_fd: int, launcher: int | None, idle_s: float = float("inf")) -> None:
    """launcher: the pid that started us, compared with our parent from the start (a launcher
    killed while we were starting leaves us with another parent at once). None: a host's server
    (`hpipe.ssh.remote_wrapper`), which outlives the launches it forks for and exits after `idle_s`
    seconds with no worker. Either kills a worker's group when the connection of its request closes
    before the worker's end (its wrapper, or its launching process, is gone)."""
    _import_frozen(PRELOAD)
    listener = socket.socket(fileno=listener_fd)
    address = listener.getsockname()
    bound = os.stat(address).st_ino if launcher is None else None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    retiring = []
    signal.signal(signal.SIGTERM, lambda *_: retiring.append(True))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    workers: dict[int, socket.socket] = {}       # pid -> the connection its exit code goes back on
    idle_since = time.monotonic()
    preloaded_idle = False
    while (launcher is None or os.getppid() == launcher) and not (retiring and not workers):
        for key, _ in selector.select(POLL_S):
            if key.fileobj is listener and not retiring:
                try:
                    conn, _ = listener.accept()
                except OSError:          # out of descriptors, say: the launcher's request times out
                    continue
                pid = _fork_one(conn, [listener.fileno(), wake_r, wake_w, *(c.fileno() for c in workers.values())])
                if pid is None:
                    conn.close()
                else:
                    workers[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
            elif key.fileobj is wake_r:
                os.read(wake_r, 4096)
            elif key.data is not None and not _peek(key.fileobj):     # its requester is gone
                selector.unregister(key.fileobj)
                _kill_group(key.data)
        if retiring and listener.fileno() >= 0:          # requests still queued go unanswered
            selector.unregister(listener)
            listener.close()
        for conn in _reap(workers):
            if conn in selector.get_map():
                selector.unregister(conn)
            conn.close()
        if workers:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > idle_s:
            break
        elif launcher is None and not preloaded_idle:
            _import_quietly(IDLE_PRELOAD)
            gc.freeze()                          # as `_import_frozen` does
            preloaded_idle = True
    # retired with no worker left, idle long enough, or the launching process is gone: so are we
    # (and our workers, by their parent-death signal)
    _remove_socket(address, bound)
    os._exit(0)


def _import_quietly(names: tuple[str, ...]) -> None:
    """Imports `names`; one that fails (another torch's layout) is left to the workers that need it."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:          # noqa: BLE001 - an optimization only: the worker imports it itself, or says why
            pass


def _remove_socket(address: str, bound: int | None) -> None:
    """A launching process's server: the socket's directory (a launcher killed outright removed
    nothing). A host's (`bound`: its socket's inode): its socket, unless a newer server's has taken
    the name."""
    if bound is None:
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)
        return
    try:
        if os.stat(address).st_ino == bound:
            os.unlink(address)
    except OSError:
        pass


def _peek(conn: socket.socket) -> bool:
    """Whether a request's connection is still open (readable now: its end, or bytes nobody sends)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _reap(workers: dict[int, socket.socket]) -> list[socket.socket]:
    """Every ended worker's exit code sent on its request's connection; those connections."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        conn = workers.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            done.append(conn)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the launcher closed the request")
        data += chunk
    return data


def _fork_one(conn: socket.socket, close_in_child: list[int]) -> int | None:
    """Reads one request and forks its worker; the child's pid (answered on `conn`, once the child
    leads a session of its own: the launcher may signal its group at once), or None. Nothing a
    request or the fork raises ends the server (its workers would die with it)."""
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_S)
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
        if len(header) < _HEADER.size:
            header += _recv_exact(conn, _HEADER.size - len(header))
        request = json.loads(_recv_exact(conn, _HEADER.unpack(header)[0]))
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors, not 3")
        started_r, started_w = os.pipe()
        pid = os.fork()
    except Exception:  # noqa: BLE001 - a bad request, or no fork (EAGAIN, ENOMEM): the launcher starts it itself
        for fd in fds:
            os.close(fd)
        return None
    if pid == 0:
        os.close(started_r)
        _become_worker(request, fds, [conn.fileno(), *close_in_child], started_w)
    os.close(started_w)
    for fd in fds:
        os.close(fd)
    os.read(started_r, 1)          # EOF: the child has its own session (or is gone)
    os.close(started_r)
    try:
        conn.settimeout(None)
        conn.sendall(f"pid {pid}\n".encode())
    except OSError:                # the launcher is gone: so is the worker
        _kill_group(pid)
    return pid


def _become_worker(request: dict, fds: list[int], close: list[int], started: int) -> None:
    """In the forked child: the worker's session, descriptors, environment and module; never returns.
    started: closed once the child leads its own session (the server then answers the pid)."""
    code = 1
    try:
        os.setsid()
        os.close(started)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        server = os.getppid()
        for fd in close:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True,
                                      write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                      line_buffering=True, write_through=True)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        os.chdir(request["cwd"])
        if not sys.flags.safe_path:
            sys.path[0] = os.getcwd()                  # as `python -m` sets it
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[PARENT_ENV] = str(server)            # the worker ties itself to the server
        _show_command(request["cmd"])
        arm_parent_death_signal()
        name, argv = _module_argv(request["cmd"])      # the server runs the launcher's interpreter
        sys.argv = [name, *argv]
        try:
            module = importlib.import_module(name)
            # `__main__` as `python -m` makes it: processes the worker spawns (its sampler pool)
            # import the worker's module for theirs, not the server's
            sys.modules["__main__"] = module
            returned = module.main(argv)             # a profiler worker's main returns its status
            code = returned if isinstance(returned, int) else 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the worker's own failure: its traceback, as python -m prints it
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _show_command(cmd: list[str]) -> None:
    """/proc/PID/cmdline (what `ps` and `pgrep -f` read) shows the worker's command, space-joined,
    as setproctitle(3) does it: written over the server's argument and environment strings (the
    C environment no longer points there: `os.environ` was replaced first), past the arguments'
    last NUL, which tells the kernel to read the title up to its first NUL. A title longer than
    that memory is cut; where /proc/self/mem cannot be written the server's command line stays."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        arg_start, env_end = int(fields[45]), int(fields[48])       # fields 48 and 51 of proc(5)
        size = env_end - arg_start
        title = " ".join(cmd).encode()[: size - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(arg_start)
            mem.write(title + b"\0" * (size - len(title)))
    except (OSError, ValueError, IndexError):
        pass


if __name__ == "__main__":
    # LISTENER_FD LAUNCHER_PID (a launching process's server), or LISTENER_FD 0 IDLE_S (a host's)
    serve(int(sys.argv[1]), int(sys.argv[2]) or None, *map(float, sys.argv[3:4]))
