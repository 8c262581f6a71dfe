"""A stage that dies is one line, from the stage that died, whatever its neighbours were doing.

First the transport itself: a real gloo peer killed under a receive and a send, and what
`hpipe.runtime.comm.lost_peer` makes of the error each survivor gets. Then `hpipe serve` on three
local stages of the default model, a stage killed at several moments (a prefill, a decode, between
steps, the last stage's sampler pool at work): the server's one error line names the killed stage,
and no survivor's whole log (`--log-dir`) carries a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import openai
import pytest

from hpipe.cli import main
from hpipe.net import free_port
from serving import served_port

PEER = textwrap.dedent("""
    import os, sys, datetime, torch, torch.distributed as dist
    rank, port, what = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.zeros(4)
    dist.send(t, 1 - rank) if rank == 0 else dist.recv(t, 1 - rank)      # both are up
    if rank == 1:
        print("ready", flush=True)
        sys.stdin.read()                                                  # until it is killed
    from hpipe.runtime import comm
    try:
        if what == "recv":
            dist.recv(t, 1)
        else:
            for _ in range(10000):                                        # until the kernel's buffers refuse
                dist.send(torch.zeros(1 << 16), 1)
        print("no error")
    except Exception as e:
        print(("lost" if comm.lost_peer(e) else "other") + "|" + comm.lost_peer_line(e) + "|" + repr(e)[:300])
""")


def test_a_rendezvous_port_is_one_no_connection_is_given_meanwhile():
    """`free_port` picks outside the kernel's ephemeral range: a port `bind(("", 0))` returned went to
    one of a run's gloo connections before this file's rendezvous bound it ("address already in
    use"). With a hundred connections open, no pick is a port the kernel gives them, and each binds."""
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    with socket.create_server(("127.0.0.1", 0)) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(100)]
        try:
            taken = {c.getsockname()[1] for c in clients}
            assert all(low <= p <= high for p in taken)          # what the kernel gives a connection
            picks = [free_port() for _ in range(300)]
            assert not [p for p in picks if low <= p <= high or p in taken], picks
            for p in picks[:20]:
                with socket.create_server(("", p)):
                    pass
        finally:
            for c in clients:
                c.close()


@pytest.mark.parametrize("what", ["recv", "send"])
def test_a_killed_gloo_peer_reads_as_a_lost_peer(tmp_path, what):
    """The survivor's error, blocked in a receive or sending, is what `lost_peer` recognizes; its
    line keeps what the transport said, without the source location."""
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), what], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        assert procs[1].stdout.readline().strip() == "ready", procs[1].stderr.read()
        time.sleep(0.5)              # rank 0 is in its receive (or sending)
        procs[1].kill()
        out, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    kind, line, raw = out.strip().split("|", 2)
    assert kind == "lost", (out, err)
    assert line.startswith("lost a peer stage (") and "pair.cc" not in line and "\n" not in line, line


# ---------------------------------------------------------------------------------- hpipe serve, a stage killed
@pytest.fixture(scope="module")
def three_stages(tmp_path_factory) -> Path:
    plan = tmp_path_factory.mktemp("peer-loss") / "plan.json"
    assert main(["plan", "--model", "smollm2", "--stages", "3", "-o", str(plan)]) == 0
    return plan


def stage_pid(server: int, rank: int) -> int:
    """The server's stage worker of `rank`: a process below it (its fork server's child) whose
    command line is the worker's."""
    parents, commands = {}, {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            commands[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() + " "
        except OSError:
            continue
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])

    def below_server(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == server:
                return True
        return False

    for pid, cmd in commands.items():
        if "hpipe.runtime.worker" in cmd and f" --rank {rank} " in cmd and below_server(pid):
            return pid
    raise AssertionError(f"no stage {rank} under pid {server}")


def serve(tmp: Path, plan: Path, *extra: str) -> tuple[subprocess.Popen, openai.OpenAI, Path]:
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "hpipe", "serve", str(plan), "--local", "--port", "0", "--max-model-len",
           "1024", "--max-batch", "4", "--log-dir", str(tmp / "stages"), "--compile", "off", *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    port = served_port(proc, log)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    deadline = time.time() + 240
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            client.models.list()
            return proc, client, log
        except openai.APIConnectionError:
            assert time.time() < deadline, log.read_text()
            time.sleep(0.5)


def in_background(fn) -> threading.Thread:
    def run():
        try:
            fn()
        except openai.APIError:         # the request fails with the stage: what the server's test checks
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def prefill(client: openai.OpenAI) -> None:
    """Four long prompts at once, killed as soon as the first has been taken in (its prefill runs)."""
    for i in range(4):
        in_background(lambda i=i: client.completions.create(model="smollm2", prompt=f"{i} " + "tell me more. " * 200,
                                                             max_tokens=8))
    time.sleep(0.3)


def decode(client: openai.OpenAI) -> None:
    """Killed after a stream's first few tokens: the pipeline is decoding."""
    stream = iter(client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=400,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    for _ in range(4):
        next(stream)
    in_background(lambda: list(stream))


def between_steps(client: openai.OpenAI) -> None:
    """Killed with nothing running: one request has finished, the stages wait for the next."""
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=4)
    time.sleep(0.5)


MOMENTS = {      # moment: (what runs when the stage is killed, which stage, the server's extra flags)
    "prefill": (prefill, 1, []),
    "decode": (decode, 1, []),
    "between-steps": (between_steps, 1, []),
    "sampler-pool": (decode, 0, ["--sampling", "cpu"]),   # the last stage survives with its sampler processes
}


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_killed_stage_is_one_line_and_no_survivor_prints_a_traceback(three_stages, tmp_path, moment):
    run, victim, extra = MOMENTS[moment]
    proc, client, log = serve(tmp_path, three_stages, *extra)
    try:
        run(client)
        os.kill(stage_pid(proc.pid, victim), signal.SIGKILL)
        assert proc.wait(timeout=90) == 2, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("hpipe: error:")]
    assert len(errors) == 1 and f"stage {victim} " in errors[0] and "killed by SIGKILL" in errors[0], text
    assert "Warning" not in errors[0] and "Traceback" not in text, text
    for rank in {0, 1, 2} - {victim}:
        survivor = (tmp_path / "stages" / f"stage-{rank}.log").read_text()
        assert "Traceback" not in survivor and "terminate called" not in survivor, (rank, survivor)
        # at most the one line (a survivor stopped by the launcher first has nothing to say)
        assert all(line.startswith(f"stage {rank}: lost a peer stage (") for line in survivor.splitlines()), \
            (rank, survivor)


@pytest.mark.slow
def test_a_stopped_stage_with_a_sampler_pool_says_nothing(three_stages, tmp_path):
    """The launcher stops a survivor with SIGTERM to its process group: the last stage, its sampler
    pool at work, ends killed by SIGTERM at once, and its log stays empty: multiprocessing's
    resource tracker (which ignores SIGTERM) removes the pool's named semaphores after it, and wrote
    a warning of "leaked semaphore objects" there; every semaphore is gone all the same."""
    proc, client, log = serve(tmp_path, three_stages, "--sampling", "cpu")
    try:
        decode(client)
        stage = stage_pid(proc.pid, 2)
        maps = Path(f"/proc/{stage}/maps").read_text().split()
        semaphores = {Path(w) for w in maps if w.startswith("/dev/shm/sem.")}     # sem_open maps each
        assert len(semaphores) >= 8, semaphores
        os.killpg(os.getpgid(stage), signal.SIGTERM)
        assert proc.wait(timeout=90) == 2, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    errors = [line for line in log.read_text().splitlines() if line.startswith("hpipe: error:")]
    assert len(errors) == 1 and "stage 2 " in errors[0] and "killed by SIGTERM" in errors[0], log.read_text()
    assert (tmp_path / "stages" / "stage-2.log").read_text() == ""
    deadline = time.time() + 10
    while [s for s in semaphores if s.exists()] and time.time() < deadline:
        time.sleep(0.1)
    assert not [s for s in semaphores if s.exists()]
