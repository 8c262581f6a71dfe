"""The SSH layer every remote action goes through (the profiler's `--cluster` runs and the
launcher's workers): strict host keys, parallel connections, clear errors, remote processes that
cannot outlive their launcher.

- `connect_all(inventory, names)` opens one paramiko connection per host, in parallel. Host keys
  are checked against the inventory's known_hosts file (default ~/.ssh/known_hosts): an unknown or
  changed key refuses the host before anything starts; `accept_new_keys=True` records unknown keys
  (never changed ones) and says so.
- `probe(conn)` runs hpipe/ssh/host_probe.py remotely (interpreter, versions, memory, devices, model).
- `RemoteProcess` runs one command under hpipe/ssh/remote_wrapper.py, streaming its lines into a queue;
  it stops the remote process group on `stop()`, on a closed connection, and when the launcher
  goes silent (the wrapper's own timeout).

Remote commands are built from argument lists with shlex; the environment (job token included)
travels on stdin, never on a command line.
"""

from __future__ import annotations

import base64
import hashlib
import json
import queue
import shlex
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hpipe import formats
from hpipe.errors import HpipeError
from hpipe.reports import MARKER, parse

WRAPPER_SOURCE = (Path(__file__).parent / "remote_wrapper.py").read_text()
PROBE_SOURCE = (Path(__file__).parent / "host_probe.py").read_text()
INPUT_PREFIX = "input "      # a launcher line the wrapper hands to the worker's stdin (remote_wrapper.py)


def fingerprint(key) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return f"{key.get_name()} SHA256:{base64.b64encode(digest).decode().rstrip('=')}"


def known_hosts_path(ssh: formats.SSHSettings) -> Path:
    return Path(ssh.known_hosts or "~/.ssh/known_hosts").expanduser()


def host_label(host: formats.Host) -> str:
    return f"host {host.name} ({host.address}:{host.port})"


@dataclass
class Connection:
    host: formats.Host
    client: object            # paramiko.SSHClient
    user: str

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass


def _policies(path: Path, accept_new: bool, log):
    import paramiko

    class Refuse(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            raise HpipeError(f"its host key ({fingerprint(key)}) is not in {path}: refused, nothing was started; "
                             f"check the fingerprint on the host, then add it (ssh-keyscan -p PORT ADDRESS >> {path}) "
                             f"or pass --accept-new-host-keys")

    class RecordNew(paramiko.MissingHostKeyPolicy):
        lock = threading.Lock()

        def missing_host_key(self, client, hostname, key):
            with self.lock:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "a") as f:
                    f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            client.get_host_keys().add(hostname, key.get_name(), key)
            log(f"hpipe: recorded the new host key of {hostname} ({fingerprint(key)}) in {path} "
                f"(--accept-new-host-keys)")

    return RecordNew() if accept_new else Refuse()


def connect(host: formats.Host, ssh: formats.SSHSettings, accept_new_keys: bool = False, log=print) -> Connection:
    """One connection; every failure becomes one HpipeError naming the host and what to change."""
    import getpass

    import paramiko

    label = host_label(host)
    path = known_hosts_path(ssh)
    user = host.user or ssh.user or getpass.getuser()
    key_file = str(Path(ssh.identity_file).expanduser()) if ssh.identity_file else None
    if key_file and not Path(key_file).is_file():
        raise HpipeError(f"{label}: identity_file {key_file} not found; fix [ssh] identity_file in the inventory")
    if not path.is_file() and not accept_new_keys:
        raise HpipeError(f"{label}: known_hosts file {path} not found; create it (ssh-keyscan -p {host.port} "
                         f"{host.address} >> {path}) or pass --accept-new-host-keys")
    client = paramiko.SSHClient()
    if path.is_file():
        client.load_host_keys(str(path))
    client.set_missing_host_key_policy(_policies(path, accept_new_keys, log))
    t = ssh.connect_timeout_s
    try:
        client.connect(host.address, port=host.port, username=user, key_filename=key_file, timeout=t,
                       banner_timeout=t, auth_timeout=t, allow_agent=key_file is None,
                       look_for_keys=key_file is None)
    except HpipeError as e:
        client.close()
        raise HpipeError(f"{label}: {e}") from None
    except paramiko.BadHostKeyException as e:
        client.close()
        raise HpipeError(f"{label}: its host key CHANGED (now {fingerprint(e.key)}, {path} has "
                         f"{fingerprint(e.expected_key)}): refused, nothing was started; if the host was "
                         f"reinstalled, remove the old key (ssh-keygen -R {host.address} -f {path})") from None
    except paramiko.AuthenticationException:
        client.close()
        raise HpipeError(f"{label}: user {user!r} was refused with key {key_file or '(agent/default keys)'}; check "
                         f"[ssh] user / identity_file (or the host's user) and the host's authorized_keys") from None
    except TimeoutError:
        client.close()
        raise HpipeError(f"{label}: no answer within {t:g} s; check the address, the network and that sshd "
                         f"runs (connect_timeout_s in [ssh] sets the wait)") from None
    except ConnectionRefusedError:
        client.close()
        raise HpipeError(f"{label}: connection refused: no SSH server on port {host.port}") from None
    except (OSError, paramiko.SSHException) as e:
        client.close()
        raise HpipeError(f"{label}: cannot connect: {e}") from None
    client.get_transport().set_keepalive(5)
    return Connection(host, client, user)


def connect_all(inventory: formats.Inventory, names: list[str], accept_new_keys: bool = False,
                log=print) -> dict[str, Connection]:
    """Connects to the named hosts in parallel. If any fails, closes the others and raises one
    error listing every host that failed."""
    hosts = {h.name: h for h in inventory.hosts}
    results: dict[str, Connection] = {}
    errors: list[str] = []
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        futures = {n: pool.submit(connect, hosts[n], inventory.ssh, accept_new_keys, log) for n in names}
        for n, f in futures.items():
            try:
                results[n] = f.result()
            except HpipeError as e:
                errors.append(str(e))
    if errors:
        for c in results.values():
            c.close()
        raise HpipeError("; ".join(errors))
    return results


def python_command(host: formats.Host, source: str, args: list[str]) -> str:
    """The remote command line: the host's interpreter running `source`, every part quoted."""
    return shlex.join([host.python, "-u", "-c", source, *[str(a) for a in args]])


def run_python(conn: Connection, source: str, args: list[str], env: dict[str, str] | None = None,
               timeout: float = 120) -> tuple[int, str, str]:
    """Runs a Python source on the host (under the wrapper, with the host's env) and returns
    (exit code, stdout, stderr) once it ends."""
    lines: queue.Queue = queue.Queue()
    proc = RemoteProcess(conn, [conn.host.python, "-c", source, *args], {**conn.host.env, **(env or {})}, lines,
                         conn.host.name, timeout_s=max(30.0, timeout))
    out, err, open_streams = [], [], 2
    deadline = time.monotonic() + timeout
    try:
        while open_streams:
            try:
                _, name, line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise HpipeError(f"{host_label(conn.host)}: no answer within {timeout:g} s") from None
            if line is None:
                open_streams -= 1
            else:
                (out if name == "out" else err).append(line)
        code = proc.wait(timeout=5)
    finally:
        proc.close()
    if proc.exit_report and proc.exit_report.get("code") == 127 and not out:
        err.append(str(proc.exit_report.get("why")))
    return (127 if code is None else code), "\n".join(out), "\n".join(err)


def probe(conn: Connection, model: str | None = None, sha256: list[str] | None = None, kernels: bool = False) -> dict:
    """kernels: also which weight-only kernels each device runs (imports torch there, a second or two)."""
    args = (["--cuda"] if any(d.startswith("cuda") for d in conn.host.devices) else []) + \
        (["--kernels"] if kernels else []) + \
        (["--model", model] if model else []) + (["--sha256", *sha256] if sha256 else [])
    code, out, err = run_python(conn, PROBE_SOURCE, args)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    try:
        return json.loads(last)
    except json.JSONDecodeError:
        why = (err.strip().splitlines() or [f"exit code {code}"])[-1]
        if code == 127 or "command not found" in err or "No such file" in err:
            why = f"interpreter {conn.host.python} does not run ({why}); fix hosts.python in the inventory"
        raise HpipeError(f"{host_label(conn.host)}: preflight failed: {why}") from None


def local_versions() -> dict:
    from importlib import metadata

    from hpipe import __version__

    return {"hpipe": __version__, "torch": metadata.version("torch"), "transformers": metadata.version("transformers")}


def host_problems(p: dict, versions: dict | None = None) -> list[str]:
    """What a probe result says is wrong with a host for running hpipe's workers: a package missing
    or at another version than here, the model not there (when it was asked for)."""
    versions = versions or local_versions()
    problems = []
    for name in ("hpipe", "torch", "transformers"):
        if p.get(name) is None:
            hint = " or set PYTHONPATH in the host's env" if name == "hpipe" else ""
            problems.append(f"{name} is not importable by {p.get('executable', 'its python')} "
                            f"({p.get(name + '_error')}); install it there{hint}")
        elif p[name] != versions[name]:
            problems.append(f"{name} {p[name]} there, {versions[name]} here; install the same version")
    if "model" in p and not p["model"]["ok"]:
        problems.append(f"model: {p['model']['note']}")
    return problems


class RemoteProcess:
    """One remote command under the wrapper. Lines go to `lines` as (tag, 'out'|'err', text), then
    (tag, stream, None) at the end of each stream; the wrapper's own reports ('alive', 'exit') are
    consumed here."""

    def __init__(self, conn: Connection, argv: list[str], env: dict[str, str], lines: queue.Queue, tag,
                 timeout_s: float = 30.0, fork_server: bool = False):
        """fork_server: a CPU stage's worker, which the host's fork server may fork (the wrapper's)."""
        self.conn = conn
        self.tag = tag
        self.exit_report: dict | None = None
        self.heard = time.monotonic()
        self._closed = False
        self._input_lock = threading.Lock()
        self.chan = conn.client.get_transport().open_session()
        # not exec'd: the login shell stays the wrapper's parent and turns its death by a signal into
        # an exit status 128 + n (sshd's "exit-signal" never reaches paramiko, which reads it as -1)
        self.chan.exec_command(python_command(conn.host, WRAPPER_SOURCE, argv) + "; exit $?")
        self._stdin = self.chan.makefile_stdin("wb")
        self._send(json.dumps({"env": env, "timeout_s": timeout_s, "marker": MARKER, "fork_server": fork_server}) + "\n")
        self._threads = [threading.Thread(target=self._pump, args=(self.chan.makefile("rb"), "out", lines),
                                          daemon=True),
                         threading.Thread(target=self._pump, args=(self.chan.makefile_stderr("rb"), "err", lines),
                                          daemon=True),
                         threading.Thread(target=self._ping, daemon=True)]
        for t in self._threads:
            t.start()

    def _send(self, text: str) -> bool:
        try:
            self._stdin.write(text.encode())
            self._stdin.flush()
            return True
        except Exception:  # noqa: BLE001 - a dead channel is reported by silence
            return False

    def send_line(self, line: str) -> bool:
        """One line to the worker's stdin, through the wrapper (serving: stage 0's requests)."""
        with self._input_lock:
            return self._send(INPUT_PREFIX + line + "\n")

    def _pump(self, stream, name: str, lines: queue.Queue) -> None:
        try:
            for raw in stream:
                self.heard = time.monotonic()
                line = raw.decode(errors="replace").rstrip("\r\n")
                msg = parse(line) if name == "out" else None
                if msg is not None and msg.get("type") == "alive":
                    continue
                if msg is not None and msg.get("type") == "exit":
                    self.exit_report = msg
                    continue
                lines.put((self.tag, name, line))
        except (TimeoutError, OSError, EOFError):
            pass
        lines.put((self.tag, name, None))

    def _ping(self) -> None:
        while not self._closed and not self.chan.exit_status_ready():
            with self._input_lock:
                self._send("ping\n")
            time.sleep(1.0)

    # the same surface as subprocess.Popen, for the launcher's watcher
    def poll(self) -> int | None:
        if self.chan.exit_status_ready():
            return self.chan.recv_exit_status()
        return None

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.chan.exit_status_ready():
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return self.chan.recv_exit_status()

    def silent_s(self) -> float:
        return time.monotonic() - self.heard

    def stop(self) -> None:
        """Asks the wrapper to stop the worker's process group, then closes our end of stdin."""
        if not self.chan.exit_status_ready():
            self._send("stop\n")
        try:
            self.chan.shutdown_write()
        except Exception:  # noqa: BLE001
            pass

    def kill(self) -> None:
        """Closes the channel: the wrapper sees its stdin end and kills the worker's group."""
        self.close()

    def close(self) -> None:
        self._closed = True
        try:
            self.chan.close()
        except Exception:  # noqa: BLE001
            pass

    def describe_exit(self, code: int) -> str:
        rep = self.exit_report or {}
        c = rep.get("code", code)
        if rep.get("why"):
            return str(rep["why"])
        if not rep and code == -1:      # the channel closed without any exit status
            return "the remote wrapper was lost (no exit status: killed, or its connection dropped)"
        if not rep and code > 128:      # the wrapper itself died; its shell reported 128 + signal
            return f"the remote wrapper was killed by {_signal_name(code - 128)}"
        if isinstance(c, int) and c < 0:
            return f"killed by {_signal_name(-c)}"
        return f"exit code {c}"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _sftp(conn: Connection, what: str):
    import paramiko

    try:
        return conn.client.open_sftp()
    except (paramiko.SSHException, OSError) as e:
        raise HpipeError(f"{host_label(conn.host)}: cannot {what} over SFTP ({e}); enable the sftp subsystem in "
                         f"its sshd_config (Subsystem sftp ...)") from None


def write_files(conn: Connection, directory: str, files: dict[str, bytes]) -> None:
    """Creates `directory` (mode 0700) on the host and writes the given files into it."""
    sftp = _sftp(conn, "copy the launch files")
    try:
        _sftp_makedirs(sftp, directory, mode=0o700)
        for name, data in files.items():
            with sftp.open(f"{directory}/{name}", "wb") as f:
                f.write(data)
    except OSError as e:
        raise HpipeError(f"{host_label(conn.host)}: cannot write {directory}: {e}") from None
    finally:
        sftp.close()


def get_file(conn: Connection, remote: str, local: str) -> None:
    sftp = _sftp(conn, "fetch files")
    try:
        sftp.get(remote, local)
    except OSError as e:
        raise HpipeError(f"{host_label(conn.host)}: cannot fetch {remote}: {e}") from None
    finally:
        sftp.close()


def put_files(conn: Connection, files: list[tuple[str, str]], progress=None) -> None:
    """Copies local files to remote paths over SFTP (parents created), calling
    progress(bytes_done) as it goes."""
    sftp = _sftp(conn, "copy the model")
    try:
        for local, remote in files:
            _sftp_makedirs(sftp, str(Path(remote).parent))
            sftp.put(local, remote, callback=(lambda done, total: progress(done)) if progress else None)
    finally:
        sftp.close()


def _sftp_makedirs(sftp, path: str, mode: int = 0o755) -> None:
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        p = str(Path(*parts[:i]))
        try:
            sftp.stat(p)
        except OSError:
            sftp.mkdir(p, mode=mode)
