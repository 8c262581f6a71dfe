"""The fork server that starts local stage workers (`hpipe.launcher.forkserver`), with real
processes: what a forked worker gets (its own session, the launch's environment, working
directory and pipes), exit codes and signals as `subprocess` reports them, one server reused by
every launch of one environment, a retired server running its workers to their end, and nothing
left behind when the launching process dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from hpipe.launcher import forkserver

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import gc, json, os, sys, time

def main(argv):
    if argv[0] == "modules":
        print(json.dumps({"server": os.getppid(), "imported": [n for n in argv[1:] if n in sys.modules],
                          "frozen": gc.get_freeze_count()}), flush=True)
        return
    if argv[0] == "sleep":
        print("ready", flush=True)
        time.sleep(600)
    line = sys.stdin.readline().strip()
    print(json.dumps({"ppid": os.getppid(), "pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(),
                      "probe": os.environ.get("PROBE"), "line": line, "argv": argv,
                      "parent_env": os.environ.get("HPIPE_PARENT_PID")}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(argv[1]))
'''


def _env(tmp_path: Path, **extra) -> dict[str, str]:
    (tmp_path / "fs_probe.py").write_text(PROBE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), **extra}


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_forked_worker_gets_the_launchs_session_environment_pipes_and_exit_code(tmp_path, monkeypatch):
    env = _env(tmp_path, PROBE="first")
    monkeypatch.chdir(tmp_path)
    w = forkserver.spawn([sys.executable, "-m", "fs_probe", "run", "3"], env, takes_input=True)
    assert isinstance(w, forkserver.Forked)
    assert os.getpgid(w.pid) == w.pid, "the pid comes once the worker leads its own process group"
    server = forkserver._SERVER.proc.pid
    w.stdin.write("hello\n")
    w.stdin.flush()
    seen = json.loads(w.stdout.readline())
    assert w.stderr.readline().strip() == "to stderr"
    assert w.wait(timeout=30) == 3 and w.poll() == 3
    assert seen == {"ppid": server, "pid": w.pid, "sid": w.pid, "cwd": str(tmp_path), "probe": "first",
                    "line": "hello", "argv": ["run", "3"], "parent_env": str(server)}

    quick = forkserver.spawn([sys.executable, "-m", "fs_probe", "run", "4"], env, takes_input=False)
    assert quick.wait(timeout=30) == 4, "an exit right after the fork reports its code"

    # a request that is not one (no descriptors, no JSON) is dropped; the server serves on
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:
        bad.connect(forkserver._SERVER.address)
        bad.sendall(forkserver._HEADER.pack(8) + b"not json")
        assert bad.recv(16) == b""
    assert forkserver._SERVER.alive() and forkserver._SERVER.proc.pid == server

    # the same environment (less what each launch sets): the same server, no import paid again
    again = forkserver.spawn([sys.executable, "-m", "fs_probe", "sleep"], {**env, "HPIPE_JOB_TOKEN": "x"},
                             takes_input=False)
    assert forkserver._SERVER.proc.pid == server
    assert again.stdout.readline().strip() == "ready"
    # `ps` and `pgrep -f` see the worker's own command, not the server's
    assert Path(f"/proc/{again.pid}/cmdline").read_bytes().rstrip(b"\0") == \
        f"{sys.executable} -m fs_probe sleep".encode()
    found = subprocess.run(["pgrep", "-f", "fs_probe sleep"], capture_output=True, text=True).stdout.split()
    assert str(again.pid) in found
    with pytest.raises(subprocess.TimeoutExpired):
        again.wait(timeout=0.2)
    os.killpg(again.pid, signal.SIGKILL)         # the launcher stops a worker by its process group
    assert again.wait(timeout=30) == -signal.SIGKILL

    # another environment: a server of its own; the old one runs its worker to the end, then exits
    old = forkserver._SERVER
    running = forkserver.spawn([sys.executable, "-m", "fs_probe", "run", "0"], env, takes_input=True)
    fresh = forkserver.spawn([sys.executable, "-m", "fs_probe", "run", "5"], {**env, "PROBE": "second"},
                             takes_input=True)
    assert forkserver._SERVER is not old and fresh.pid != running.pid
    assert old.alive(), "a retired server keeps serving the workers it forked"
    for w, code in ((running, 0), (fresh, 5)):
        w.stdin.write("x\n")
        w.stdin.flush()
        assert w.wait(timeout=30) == code
    assert json.loads(fresh.stdout.readline())["probe"] == "second"
    assert old.proc.wait(timeout=10) == 0, "a retired server exits once its workers have ended"


@pytest.mark.slow
def test_nothing_outlives_the_launching_process(tmp_path):
    """The launcher killed (SIGKILL: no cleanup of its own runs): its fork server and the worker it
    forked end too, and the server's socket directory is removed."""
    env = _env(tmp_path)
    launcher = textwrap.dedent(f"""
        import sys
        from hpipe.launcher import forkserver
        w = forkserver.spawn([sys.executable, "-m", "fs_probe", "sleep"], {env!r}, takes_input=False)
        assert w.stdout.readline().strip() == "ready"
        print(forkserver._SERVER.proc.pid, w.pid, forkserver._SERVER.dir, flush=True)
        sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        server, worker, socket_dir = proc.stdout.readline().split()
    finally:
        proc.kill()
        proc.wait()
    assert _gone(int(server)) and _gone(int(worker))
    assert not Path(socket_dir).exists(), "the server removes its socket's directory"

    # killed while its server still imports: the server goes too, once it looks
    early = subprocess.Popen([sys.executable, "-c", "import sys\nfrom hpipe.launcher import forkserver\n"
                              f"s = forkserver.start({env!r})\nprint(s.proc.pid, s.dir, flush=True)\nsys.stdin.readline()"],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server, socket_dir = early.stdout.readline().split()
    finally:
        early.kill()
        early.wait()
    assert _gone(int(server), within_s=60)
    assert not Path(socket_dir).exists()


def test_a_hosts_server_imports_what_compiled_graphs_need_while_no_worker_runs(tmp_path):
    """A host's server (started as `hpipe.ssh.remote_wrapper` starts it, outliving its launches)
    forks the first worker as soon as its own imports are done, and imports what a stage loading
    compiled graphs needs (`IDLE_PRELOAD`) once no worker runs: the workers of later launches find
    it imported. What either import made is frozen (`gc.freeze`) before a fork: a worker's
    collections walk its own objects, not the server's hundreds of thousands."""
    from hpipe.ssh import remote_wrapper

    env = _env(tmp_path, PROBE_TEST=str(tmp_path))     # a server of this test's own
    names = list(forkserver.IDLE_PRELOAD)

    def fork_probe() -> dict:
        worker = remote_wrapper.ServedWorker(remote_wrapper.server_connection(env),
                                             [sys.executable, "-m", "fs_probe", "modules", *names], env, str(tmp_path))
        assert worker.wait(120) == 0, worker.stderr.read().decode()
        return json.loads(worker.stdout.readline())

    first = fork_probe()
    try:
        assert first["imported"] == [], "the first worker waited for the idle imports"
        deadline, later = time.time() + 60, first
        while later["imported"] != names and time.time() < deadline:
            time.sleep(0.5)
            later = fork_probe()
        assert later["imported"] == names and later["server"] == first["server"], later
        assert 100_000 < first["frozen"] < later["frozen"], (first, later)
    finally:
        os.kill(first["server"], signal.SIGTERM)
    deadline = time.time() + 10                          # our child (`server_connection` started it): reaped here
    while os.waitpid(first["server"], os.WNOHANG) == (0, 0) and time.time() < deadline:
        time.sleep(0.1)
    assert _gone(first["server"])


def test_a_command_that_is_not_a_module_main_is_not_forked(tmp_path):
    assert forkserver.spawn(["/bin/true"], _env(tmp_path), takes_input=False) is None


@pytest.mark.slow
def test_local_launches_fork_their_stages_from_the_server_their_process_started_first(tiny_models, tmp_path,
                                                                                      monkeypatch):
    """`prestart_local` (what `hpipe launch --local` and `hpipe serve --local` call before preparing
    the job) starts the server; both stages of two launches are forked by it, and the second
    launch gives the first one's tokens, though between them this process wrote into its environment
    what its libraries write as they run a stage here (`forkserver.RUNTIME_ENV`)."""
    from hpipe.cli import main
    from hpipe.launcher import local, prestart_local

    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", str(tiny_models["llama"]), "--stages", "2", "-o", str(plan)]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": [5 + i, 6, 7, 8]}) + "\n" for i in range(3)))
    prestart_local(str(plan))
    server = forkserver._SERVER
    assert server is not None and server.alive()
    started = []
    real = forkserver.spawn
    monkeypatch.setattr(local.forkserver, "spawn", lambda *a, **k: started.append(real(*a, **k)) or started[-1])
    outputs = []
    for k in range(2):
        out = tmp_path / f"o{k}.jsonl"
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts), "--out", str(out),
                     "--max-new-tokens", "6", "--quiet"]) == 0
        for name in forkserver.RUNTIME_ENV:
            monkeypatch.setenv(name, f"{name.lower()}-{k}")
        outputs.append(sorted((r["id"], r["output_ids"]) for r in map(json.loads, out.read_text().splitlines())))
    assert len(started) == 4 and all(isinstance(w, forkserver.Forked) for w in started)
    assert forkserver._SERVER is server
    assert [w.poll() for w in started] == [0] * 4        # every worker ended, its exit code from the server
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3


@pytest.mark.slow
def test_the_hpipe_command_forks_its_server_from_itself_and_nothing_outlives_it(tmp_path):
    """`hpipe serve --local` (as `hpipe launch --local`) forks its fork server from its own process
    after importing what the server imports: the stages' parent is a child of the command's process
    with its command line, and no `hpipe.launcher.forkserver` process runs. The command killed
    outright, its server and stages end too. The server answers while it runs."""
    from serving import start_serve

    from hpipe.cli import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "smollm2", "--stages", "2", "-o", str(plan)]) == 0
    proc, base = start_serve([sys.executable, "-m", "hpipe", "serve", str(plan), "--local", "--port", "0"],
                             tmp_path / "serve.log", env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        body = json.dumps({"model": "smollm2", "prompt": [5, 6, 7], "max_tokens": 3}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit()
                   and _cmdline(int(p)).startswith(f"{sys.executable} -m hpipe.runtime.worker --plan {plan}")]
        assert len(workers) == 2, [_cmdline(int(p)) for p in os.listdir("/proc") if p.isdigit()]
        servers = {_parent(w) for w in workers}
        assert len(servers) == 1 and _parent(next(iter(servers))) == proc.pid
        assert _cmdline(next(iter(servers))) == _cmdline(proc.pid), "the server is the command's own fork"
        assert not [p for p in os.listdir("/proc") if p.isdigit() and "hpipe.launcher.forkserver" in _cmdline(int(p))
                    and _parent(int(p)) == proc.pid]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert all(_gone(pid) for pid in (*servers, *workers))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
