"""`hpipe launch --cluster`, `hpipe cluster check` and `hpipe profile --cluster` against emulated
hosts: network namespaces on this machine, each with a real OpenSSH server, `tc tbf` shaped links
and, while the hosts are profiled, a CPU quota on one (tests/netns_hosts.py). Needs root and openssh-server; skips with the
reason otherwise (`.ci/run` installs openssh-server, so CI runs these).

    pytest -m hosts          # only these
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from browser import browser, open_page, wait_until
from browser import unavailable_reason as browser_missing
from hpipe.cli import main
from netns_hosts import (HostSpec, cpu_quota, elastic_profile, hpipe_processes, process_cmdline, namespace_pids, set_link, start_cluster,
                         stop_cluster, unavailable_reason, write_inventory)
from serving import served_port

ROOT = Path(__file__).resolve().parent.parent
REASON = unavailable_reason()
pytestmark = [pytest.mark.hosts, pytest.mark.skipif(REASON is not None, reason=f"emulated hosts: {REASON}")]

SPECS = [HostSpec("h0", rate_mbit=1000), HostSpec("h1", rate_mbit=1000), HostSpec("h2", rate_mbit=100)]
SLOW = ("h2", 0.5)          # the host and its quota in cores where a test measures the hosts (cpu_quota)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("hosts"), SPECS)
    yield c
    stop_cluster(c)


def hpipe(*args, cwd, timeout=600, check=False):
    """`hpipe ARGS` as a process of its own; `hpipe plan` in this one (`hpipe.cli.main`: it reads the
    inventory and starts nothing on the hosts, and a process of its own paid ~5 s of imports)."""
    argv = [str(a) for a in args]
    if argv[0] == "plan":
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        r = subprocess.CompletedProcess(["hpipe", *argv], code, out.getvalue(), err.getvalue())
    else:
        r = subprocess.run([sys.executable, "-m", "hpipe", *argv], capture_output=True, text=True, cwd=cwd,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=timeout, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise AssertionError(f"hpipe {' '.join(argv)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def error_line(r) -> str:
    """The one error line, after checking that there is exactly one and no traceback."""
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("hpipe: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def nothing_running(cluster) -> list:
    return [(h.spec.name, p) for h in cluster.hosts for p in hpipe_processes(h.namespace)]


def launch_dirs() -> set[str]:
    return set(glob.glob("/tmp/hpipe-launch-*"))


@pytest.fixture(scope="module")
def plan_and_prompts(cluster, tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    hpipe("plan", "--model", "smollm2", "--cluster", cluster.inventory_path, "-o", d / "plan.json", cwd=d, check=True)
    (d / "prompts.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(
        ["What is the capital of France?", "Name three colours.", "Count from one to ten.", "What is 2 + 2?"])))
    return d / "plan.json", d / "prompts.jsonl"


@pytest.fixture(scope="module")
def undisturbed(cluster, plan_and_prompts, tmp_path_factory) -> dict:
    """The first two prompts' output ids from `hpipe launch --cluster` (12 tokens, one prompt at a
    time), nothing lost: what the server's answers are checked against."""
    plan, prompts = plan_and_prompts
    d = tmp_path_factory.mktemp("undisturbed")
    (d / "two.jsonl").write_text("".join(prompts.read_text().splitlines(keepends=True)[:2]))
    hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", d / "two.jsonl", "--out", d / "out.jsonl",
          "--max-new-tokens", "12", "--max-batch", "1", "--quiet", cwd=d, check=True)
    return {r["id"]: r["output_ids"] for r in map(json.loads, (d / "out.jsonl").read_text().splitlines())}


# --------------------------------------------------------------------------------------------
# Refusals before anything starts


def test_unknown_host_key_is_refused_and_nothing_starts(cluster, plan_and_prompts, tmp_path):
    plan, prompts = plan_and_prompts
    known = tmp_path / "known_hosts"
    known.write_text("".join(x + "\n" for x in cluster.known_hosts.read_text().splitlines()
                             if not x.startswith(cluster.host("h1").address + " ")))
    inv = write_inventory(cluster, tmp_path / "c.toml", known_hosts=known)
    before = launch_dirs()
    r = hpipe("launch", plan, "--cluster", inv, "--prompts", prompts, "--out", tmp_path / "out.jsonl", cwd=tmp_path)
    line = error_line(r)
    assert "host h1" in line and "not in" in line and "--accept-new-host-keys" in line, line
    assert nothing_running(cluster) == []
    assert launch_dirs() == before, "a launch directory was created on a host"
    assert not (tmp_path / "out.jsonl").exists()
    # the explicit opt-in records the key and says so; the next check needs no opt-in
    r = hpipe("cluster", "check", inv, "--accept-new-host-keys", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "recorded the new host key of " + cluster.host("h1").address in r.stderr
    assert cluster.host("h1").address in known.read_text()
    assert hpipe("cluster", "check", inv, cwd=tmp_path).returncode == 0


def test_changed_host_key_is_refused_even_with_accept_new(cluster, tmp_path):
    entries = cluster.known_hosts.read_text().splitlines()
    h0, h1 = cluster.host("h0").address, cluster.host("h1").address
    key_of_h1 = next(x for x in entries if x.startswith(h1 + " ")).split(" ", 1)[1]
    known = tmp_path / "known_hosts"
    known.write_text("".join((f"{h0} {key_of_h1}" if x.startswith(h0 + " ") else x) + "\n" for x in entries))
    inv = write_inventory(cluster, tmp_path / "c.toml", known_hosts=known)
    line = error_line(hpipe("cluster", "check", inv, "--accept-new-host-keys", cwd=tmp_path))
    assert "host h0" in line and "CHANGED" in line and "ssh-keygen -R" in line, line
    assert "host h1" not in line


def test_wrong_user_or_key_says_so(cluster, tmp_path):
    inv = write_inventory(cluster, tmp_path / "user.toml", user="nobody")
    line = error_line(hpipe("cluster", "check", inv, cwd=tmp_path))
    assert "user 'nobody' was refused" in line and "authorized_keys" in line, line
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    inv = write_inventory(cluster, tmp_path / "key.toml", key=other)
    line = error_line(hpipe("cluster", "check", inv, cwd=tmp_path))
    assert "was refused with key " + str(other) in line, line
    inv = write_inventory(cluster, tmp_path / "missing.toml", key=tmp_path / "nope")
    assert "identity_file" in error_line(hpipe("cluster", "check", inv, cwd=tmp_path))


def test_unreachable_host_is_named(cluster, tmp_path):
    inv = write_inventory(cluster, tmp_path / "c.toml", timeout_s=2)
    text = inv.read_text().replace(f'address = "{cluster.host("h2").address}"', 'address = "10.213.7.77"')
    inv.write_text(text)
    t = time.time()
    line = error_line(hpipe("cluster", "check", inv, cwd=tmp_path))
    assert time.time() - t < 20
    assert "host h2 (10.213.7.77:22)" in line and ("no answer" in line or "cannot connect" in line), line


def test_hostile_inventory_is_rejected_or_quoted(cluster, tmp_path):
    marker = tmp_path / "pwned"
    # a host name or address that would be shell syntax is refused by the inventory's validation
    for field, value in (("name", f"h0;touch {marker}"), ("address", f"$(touch {marker})"),
                         ("address", "-oProxyCommand=touch"), ("user", "root;id")):
        inv = write_inventory(cluster, tmp_path / "bad.toml")
        text = inv.read_text()
        if field == "user":
            text = text.replace('user = "root"', f'user = "{value}"')
        else:
            old = 'name = "h0"' if field == "name" else f'address = "{cluster.host("h0").address}"'
            text = text.replace(old, f'{field} = "{value}"')
        inv.write_text(text)
        line = error_line(hpipe("cluster", "check", inv, cwd=tmp_path))
        assert "bad.toml" in line and field in line, line
    # what cannot be refused is quoted: a python path and env values with shell syntax run nothing
    python = f"{sys.executable}; touch {marker}"
    inv = write_inventory(cluster, tmp_path / "q.toml", python=python,
                          env={"PYTHONPATH": str(ROOT), "EVIL": f"$(touch {marker}) `touch {marker}`"})
    line = error_line(hpipe("cluster", "check", inv, cwd=tmp_path))
    assert "does not run" in line and "hosts.python" in line, line
    inv = write_inventory(cluster, tmp_path / "e.toml",
                          env={"PYTHONPATH": str(ROOT), "EVIL": f"$(touch {marker}) `touch {marker}`; touch {marker}"})
    assert hpipe("cluster", "check", inv, cwd=tmp_path).returncode == 0
    assert not marker.exists(), "a command was injected"


def test_worker_with_wrong_job_token_refuses_to_join(tiny_models, tmp_path):
    """Two workers of one job on this machine: rank 1 presents another token and must refuse."""
    from hpipe.net import free_port
    from hpipe.request import Request, write_requests

    path = tiny_models["llama"]
    plan = tmp_path / "plan.json"
    assert hpipe("plan", "--model", path, "--stages", "2", "-o", plan, cwd=tmp_path).returncode == 0
    write_requests([Request(0, "a", (5, 6, 7))], tmp_path / "req.jsonl")
    port = free_port()
    procs = []
    for rank, token in ((0, "a" * 32), (1, "b" * 32)):
        cmd = [sys.executable, "-m", "hpipe.runtime.worker", "--plan", str(plan), "--rank", str(rank),
               "--world-size", "2", "--master-port", str(port), "--model", str(path), "--requests",
               str(tmp_path / "req.jsonl"), "--config", '{"rendezvous_timeout_s": 60}']
        env = dict(os.environ, PYTHONPATH=str(ROOT), HPIPE_JOB_TOKEN=token)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        out, err = procs[1].communicate(timeout=60)
        assert procs[1].returncode != 0
        assert "refusing to join" in out, (out, err)
        assert procs[0].poll() is None, "the legitimate rank 0 should still be waiting for its real peer"
    finally:
        for p in procs:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------------------------
# End to end and faults, on the default model


@pytest.mark.slow
def test_profile_plan_launch_end_to_end(cluster, tmp_path):
    profile = tmp_path / "profile.json"
    with cpu_quota(cluster, *SLOW):
        r = hpipe("profile", "--cluster", cluster.inventory_path, "--quick", "--max-seq-len", "256", "-o", profile,
                  cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = json.loads(profile.read_text())
    assert [d["id"] for d in prof["devices"]] == ["h0/cpu", "h1/cpu", "h2/cpu"]
    # its workers were forked by each host's fork server, which the launches below find started
    servers = {h.spec.name: [p for p in namespace_pids(h.namespace) if "-m hpipe.launcher.forkserver" in
                             process_cmdline(p)] for h in cluster.hosts}
    assert all(servers.values()), servers
    # measured bandwidth of each shaped link within 10 % of tbf's payload rate (95.7 % of nominal)
    for link in prof["links"]:
        hosts = {link["src"].split("/")[0], link["dst"].split("/")[0]}
        payload = 0.957 * (100e6 if "h2" in hosts else 1000e6) / 8
        assert abs(link["beta_bytes_per_s"] / payload - 1) < 0.10, (link["src"], link["dst"], link["beta_bytes_per_s"])
    plan = tmp_path / "plan.json"
    r = hpipe("plan", "--profile", profile, "--cluster", cluster.inventory_path, "--seq-len", "128", "-o", plan,
              cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert_cuts_are_the_optimum_for(prof, json.loads(plan.read_text()))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(
        ["Explain in one sentence why the sky is blue.", "Write a haiku about a pipeline.",
         "What is 17 times 3?"])))
    r = hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", prompts, "--out", tmp_path / "ssh.jsonl",
              "--max-new-tokens", "24", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "prefill: predicted" in r.stdout
    r = hpipe("launch", plan, "--local", "--prompts", prompts, "--out", tmp_path / "local.jsonl",
              "--max-new-tokens", "24", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ssh_ids = {x["id"]: x["output_ids"] for x in map(json.loads, (tmp_path / "ssh.jsonl").read_text().splitlines())}
    local_ids = {x["id"]: x["output_ids"] for x in map(json.loads, (tmp_path / "local.jsonl").read_text().splitlines())}
    assert ssh_ids == local_ids and len(ssh_ids) == 3
    assert nothing_running(cluster) == []


def assert_cuts_are_the_optimum_for(profile: dict, plan: dict) -> None:
    """The plan starts from HPipe's Algorithm 1: the cuts it records as Algorithm 1's must be the ones
    no other pair of cuts beats (brute force) on the largest stage time (compute of the plan's
    slices plus the send after the stage, eq. 3), computed here from the profile's own numbers.
    Which host gets more units follows from those numbers (and the LM head's weight), not from the
    emulated limits alone: a quick profile on a busy machine can measure any host a little slower.
    The cuts it keeps are predicted (its own simulator, the three hosts sharing this machine's cores)
    no slower than Algorithm 1's or uniform cuts."""
    from hpipe import formats, models
    from hpipe.planner.partition import stage_time
    from hpipe.planner.profiled import CostModel, predict, workload
    from hpipe.planner.uniform import uniform_cuts
    config = models.load_config(models.resolve_model("smollm2").path)
    cost = CostModel(formats.parse_profile(profile), config, [(st["host"], st["device"]) for st in plan["stages"]])
    pr = plan["predicted"]
    unit_time, out_comm = workload(cost, pr["slices"], pr["batch"])
    n = unit_time.shape[1]

    def largest_stage(cuts):
        return max(stage_time(unit_time, out_comm, j, cuts[j], cuts[j + 1]) for j in range(3))

    algorithm1 = pr["cut_search"]["algorithm1_cuts"]
    best = min(largest_stage([0, a, b, n]) for a in range(1, n - 1) for b in range(a + 1, n))
    assert largest_stage(algorithm1) <= best * (1 + 1e-9), (algorithm1, largest_stage(algorithm1), best)
    cuts = [st["units"][0] for st in plan["stages"]] + [n]
    kept = predict(cost, cuts, pr["slices"], pr["batch"]).makespan
    assert kept == pytest.approx(pr["makespan_s"], rel=1e-9)
    for other in (algorithm1, [0, *uniform_cuts(n, 3), n]):
        assert kept <= predict(cost, other, pr["slices"], pr["batch"]).makespan * (1 + 1e-9), (cuts, other)


def spawn_launch(cluster, plan_and_prompts, tmp_path, *extra):
    plan, prompts = plan_and_prompts
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "hpipe", "launch", str(plan), "--cluster",
                             str(cluster.inventory_path), "--prompts", str(prompts), "--out", str(out),
                             "--max-new-tokens", "64", "--max-batch", "1", "--quiet", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            stdin=subprocess.DEVNULL)
    return proc, out


def start_launch(cluster, plan_and_prompts, tmp_path, *extra):
    proc, out = spawn_launch(cluster, plan_and_prompts, tmp_path, *extra)
    deadline = time.time() + 180
    while not (out.exists() and out.read_text().strip()):   # mid-run: the first prompt is done
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no result within 180 s"
        time.sleep(0.2)
    return proc, out


def wait_until_clean(cluster, within: float) -> list:
    deadline = time.time() + within
    while time.time() < deadline:
        left = nothing_running(cluster)
        if not left:
            return []
        time.sleep(0.2)
    return nothing_running(cluster)


@pytest.mark.slow
def test_a_batch_job_goes_on_without_a_killed_hosts_stage(cluster, tmp_path):
    """A stage worker SIGKILLed mid-job: the job is planned again over the two hosts left and
    finishes there, every prompt once, no --resume; its greedy tokens are those of the whole file
    run in this process. The model is a mixture of experts in a GGUF file's own blocks (its experts
    re-cut between two hosts: issue 67's elastic recovery); a dense model goes through a lost host
    in the serve test below. (With --no-recover a failure stops everything: the link and wrapper
    tests below.)"""
    from conftest import write_moe_gguf
    from hpipe import formats, models, quant
    from hpipe.request import Request
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.runtime.stage import StageRunner
    from test_moe import BLOCK_TYPES

    path = write_moe_gguf(tmp_path / "moe.gguf", BLOCK_TYPES)
    plan = tmp_path / "plan.json"
    hpipe("plan", "--model", path, "--cluster", cluster.inventory_path, "--cuts", "3,6", "-o", plan, cwd=tmp_path,
          check=True)
    prompts = [[300 + i, 9, 11, 40 + i, 7] for i in range(6)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n"
                                              for i, p in enumerate(prompts)))
    proc, out = start_launch(cluster, (plan, tmp_path / "p.jsonl"), tmp_path)
    kill_worker(cluster, "h1")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "lost host h1" in err and "planned again: h0/cpu" in err and "h1/cpu" not in err.split("planned again:")[1]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in got) == [f"p{i}" for i in range(len(prompts))]            # every id once
    events = json.loads(Path(f"{out}.summary.json").read_text())["events"]
    assert [(e["kind"], e["host"]) for e in events] == [("lost", "h1")] and events[0]["resumed"] >= 1
    source = models.resolve_model(str(path))
    config = models.load_config(source.path)
    whole = StageRunner(source, config, range(models.num_units(config)), weights=quant.WeightFormat("gguf"),
                        kv_dtype=formats.load_plan(plan).kv_dtype)
    want = run_inprocess([whole], [Request(i, f"p{i}", tuple(p), max_new_tokens=64, eos_ids=frozenset())
                                   for i, p in enumerate(prompts)], formats.load_plan(plan).slicing.slices_for,
                         max_batch=1)
    for r in got:                        # a stop at an end-of-text token leaves a prefix
        assert r["output_ids"] and r["output_ids"] == want[r["id"]]["output_ids"][:len(r["output_ids"])], r["id"]
    assert wait_until_clean(cluster, 2.0) == []


@pytest.mark.slow
def test_every_switch_combination_gives_the_same_tokens_on_hosts(cluster, tiny_models, tmp_path):
    """--no-tsem/--no-sat/--sampling inline|cpu on the emulated hosts (every pair of two switches'
    values, all on among them): seeded sampling with penalties and early stops gives the same tokens
    in every run. The tiny Llama's dense float32 weights and cache (what runs is the switches, not
    the model: SmolLM2's float32 weights cost each launch's stages seconds to unpack): which
    sequences share a micro-batch depends on the hosts' timing, and quantized kernels round their
    inputs to bf16, where a float32 difference of summation order can pick the other of two
    near-equal tokens (the quantized switches are checked on one machine in test_quant.py)."""
    plan = tmp_path / "plan.json"
    hpipe("plan", "--model", tiny_models["llama"], "--cluster", cluster.inventory_path, "--kv-dtype", "float32",
          "-o", plan, cwd=tmp_path, check=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": p, "stop_token_ids": list(range(30, 60))})
                               + "\n" for i, p in enumerate([[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [100, 101, 102]])))
    runs = {}
    # every pair of two switches' values (an orthogonal array of the three, the one holding all on):
    # 4 launches on the hosts instead of 8; all eight combinations, against all off and
    # transformers, run locally in test_launch_local.py
    for tsem, sat, sampling in ((True, True, "cpu"), (True, False, "inline"), (False, True, "inline"),
                                (False, False, "cpu")):
        out = tmp_path / f"o-{tsem}-{sat}-{sampling}.jsonl"
        hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", prompts, "--out", out,
              "--max-new-tokens", "10", "--max-batch", "3", "--temperature", "0.9", "--top-p", "0.9",
              "--repetition-penalty", "1.2", "--frequency-penalty", "0.3", "--presence-penalty", "0.2",
              "--seed", "5", "--sampling", sampling,
              *(["--prepare-thread", "on"] if tsem else ["--no-tsem"]),
              *([] if sat else ["--no-sat"]), "--quiet", cwd=tmp_path, check=True)
        runs[(tsem, sat, sampling)] = {r["id"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
    all_on = runs[(True, True, "cpu")]
    assert len(all_on) == 3
    for switches, tokens in runs.items():
        assert tokens == all_on, f"tsem, sat, sampling = {switches}"


def wait_for_worker(cluster, host: str, proc, within: float = 120) -> int:
    deadline = time.time() + within
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        for pid in namespace_pids(cluster.host(host).namespace):
            if process_cmdline(pid).split(" ")[1:3] == ["-m", "hpipe.runtime.worker"]:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no worker on {host} within {within} s")


def wrapper_on(cluster, host: str) -> int:
    """The remote wrapper on a host that runs one stage (the worker may be its child, or the host's
    fork server's), not the login shell whose command holds the wrapper's too."""
    return next(pid for pid in namespace_pids(cluster.host(host).namespace)
                if "around one worker" in process_cmdline(pid) and process_cmdline(pid).startswith(sys.executable))


@pytest.mark.slow
def test_a_hosts_fork_server_forks_the_workers_of_every_launch_after_the_first(cluster, plan_and_prompts, tmp_path):
    """A CPU stage's worker on a host is forked by the host's fork server, which the first launch
    started and the next one finds: its imports are paid once a host, not once a worker (a stage
    restarted after a lost host starts at once). Both launches give the same tokens. (With
    HPIPE_HOST_SERVER=off each worker starts afresh under its wrapper: test_remote_wrapper_killed's
    first case.)"""
    servers, outputs = [], []
    for i in range(2):
        run = tmp_path / str(i)
        run.mkdir()
        proc, out = spawn_launch(cluster, plan_and_prompts, run, "--max-new-tokens", "8")
        servers.append(parent_of(wait_for_worker(cluster, "h1", proc)))
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outputs.append([json.loads(x)["output_ids"] for x in out.read_text().splitlines()])
    assert "-m hpipe.launcher.forkserver" in process_cmdline(servers[0]) and servers[1] == servers[0], servers
    assert outputs[0] == outputs[1] and outputs[0]
    assert wait_until_clean(cluster, 2.0) == []


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def in_rendezvous(cluster, host: str, worker: int) -> bool:
    """The worker holds a TCP connection to the rendezvous port (it has loaded its model)."""
    port = process_cmdline(worker).split("--master-port ")[1].split(" ")[0]
    r = subprocess.run(["ip", "netns", "exec", cluster.host(host).namespace, "ss", "-tnpH", "state", "established",
                        f"( dport = :{port} )"], capture_output=True, text=True)
    return f"pid={worker}," in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["loading", "rendezvous", "decode"])
def test_remote_wrapper_killed(cluster, plan_and_prompts, tmp_path, phase):
    """SIGKILL the remote wrapper around stage 1's worker: the worker goes on its own (nothing is
    left on any host 2 s after the launcher exits) and the launcher names the SIGKILL. While it
    loads, the worker is the wrapper's own child (HPIPE_HOST_SERVER=off: it dies by its parent-death
    signal); later, the host's fork server's (which kills it when the wrapper's connection closes)."""
    off = write_inventory(cluster, tmp_path / "off.toml", more_env={"HPIPE_HOST_SERVER": "off"})
    extra = ("--no-recover", "--cluster", off) if phase == "loading" else ("--no-recover",)
    if phase == "decode":
        proc, out = start_launch(cluster, plan_and_prompts, tmp_path, *extra)
    else:
        proc, out = spawn_launch(cluster, plan_and_prompts, tmp_path, *extra)
    worker = wait_for_worker(cluster, "h1", proc)
    served = "-m hpipe.launcher.forkserver" in process_cmdline(parent_of(worker))
    assert served == (phase != "loading") and (served or parent_of(worker) == wrapper_on(cluster, "h1"))
    stopped = None
    if phase == "rendezvous":   # hold stage 2 back so that stage 1 waits in the rendezvous
        stopped = wait_for_worker(cluster, "h2", proc)
        os.kill(stopped, signal.SIGSTOP)
        deadline = time.time() + 120
        while not in_rendezvous(cluster, "h1", worker):
            assert time.time() < deadline and proc.poll() is None, "stage 1 never reached the rendezvous"
            time.sleep(0.05)
    try:
        os.kill(wrapper_on(cluster, "h1"), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert proc.returncode == 2, (proc.returncode, err)
    assert "SIGKILL" in err and "SIGHUP" not in err, err
    assert wait_until_clean(cluster, 2.0) == []


@pytest.mark.slow
def test_host_link_down_mid_run(cluster, plan_and_prompts, tmp_path):
    proc, out = start_launch(cluster, plan_and_prompts, tmp_path, "--host-timeout", "5", "--no-recover")
    t = time.time()
    set_link(cluster, "h2", up=False)
    try:
        _, err = proc.communicate(timeout=60)
        elapsed = time.time() - t
        assert proc.returncode == 2 and elapsed < 5 + 5, (proc.returncode, elapsed, err)
        assert "no answer from host h2 for 5 s" in err, err
        # the cut-off host's wrapper stops its worker on its own once the launcher falls silent
        assert wait_until_clean(cluster, 5 + 5) == []
    finally:
        set_link(cluster, "h2", up=True)


@pytest.mark.slow
def test_sigint_tears_everything_down(cluster, plan_and_prompts, tmp_path):
    proc, out = start_launch(cluster, plan_and_prompts, tmp_path)
    t = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and time.time() - t < 10, err
    assert "interrupted" in err and "--resume" in err, err
    assert wait_until_clean(cluster, 1.0) == []


@pytest.mark.slow
def test_push_model_copies_only_each_hosts_shards(cluster, tiny_models, tmp_path):
    """A sharded checkpoint: --push-model copies to each host the shards its stages read,
    checksummed; a second launch copies nothing and gives the same tokens."""
    import shutil

    from hpipe import models

    src = tmp_path / "only-here-model"
    shutil.copytree(tiny_models["qwen2"], src)
    config = models.load_config(src)
    n_units = models.num_units(config)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) >= 3
    plan = tmp_path / "plan.json"
    cuts = f"{n_units // 3},{2 * n_units // 3}"
    assert hpipe("plan", "--model", src, "--cluster", cluster.inventory_path, "--cuts", cuts, "-o", plan,
                 cwd=tmp_path).returncode == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": [5 + i, 9, 11, 40, 7]}) + "\n"
                               for i in range(2)))
    # where each host keeps pushed models: ask the hosts (their user's home need not be this HOME)
    from hpipe import formats, ssh

    inventory = formats.load_inventory(cluster.inventory_path)
    conns = ssh.connect_all(inventory, [h.name for h in inventory.hosts], log=lambda msg: None)
    try:
        homes = {name: ssh.probe(conn)["home"] for name, conn in conns.items()}
    finally:
        for conn in conns.values():
            conn.close()
    for home in set(homes.values()):
        shutil.rmtree(Path(home) / ".cache" / "hpipe" / "pushed", ignore_errors=True)
    # a model a host does not have is refused by the preflight
    line = error_line(hpipe("cluster", "check", cluster.inventory_path, "--model", tmp_path / "absent", cwd=tmp_path))
    assert "host h0" in line and "absent" in line and "--push-model" in line, line
    r = hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", prompts, "--out", tmp_path / "a.jsonl",
              "--max-new-tokens", "6", "--push-model", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    copied = {line.split(":")[1].strip(): line for line in r.stderr.splitlines() if "model files copied" in line}
    assert set(copied) == {"h0", "h1", "h2"}, r.stderr
    for host, line in copied.items():
        needed, total = (int(x) for x in line.split("(")[1].split(" weight shards")[0].split(" of "))
        assert total == len(shards) and 1 <= needed < total, line      # only the shards of its own units
    for host, line in copied.items():   # the hosts share this file system: read what each was given
        remote_dir = Path(line.rsplit(" to ", 1)[1].strip())
        assert remote_dir.is_relative_to(Path(homes[host]) / ".cache" / "hpipe" / "pushed"), line
        present = [name for name in shards if (remote_dir / name).exists()]
        assert present, line
        for name in present:
            assert (remote_dir / name).read_bytes() == (src / name).read_bytes()
    r = hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", prompts, "--out", tmp_path / "b.jsonl",
              "--max-new-tokens", "6", "--push-model", "--quiet", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr.count(": 0 of ") == 3, r.stderr
    ids = [{x["id"]: x["output_ids"] for x in map(json.loads, (tmp_path / f).read_text().splitlines())}
           for f in ("a.jsonl", "b.jsonl")]
    assert ids[0] == ids[1] and len(ids[0]) == 2


def test_push_model_sends_each_host_a_gguf_of_its_own_stages(cluster, tmp_path):
    """A GGUF mixture-of-experts file over the three hosts: --push-model sends each host a GGUF of only
    its stages' tensors (the file's blocks as they are, checked by hash) beside the whole file's
    config, not the whole file, and the tokens are those of the same cuts run here on the whole file."""
    from conftest import write_moe_gguf
    from hpipe import formats, models, quant
    from hpipe.request import Request
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.runtime.stage import StageRunner
    from test_moe import BLOCK_TYPES

    here = tmp_path / "moe-only-here"
    here.mkdir()
    path = write_moe_gguf(here / "moe.gguf", BLOCK_TYPES)
    hpipe("plan", "--model", path, "--cluster", cluster.inventory_path, "--cuts", "3,6", "-o", tmp_path / "plan.json",
          cwd=tmp_path, check=True)
    prompts = [[300 + i, 9, 11, 40, 7] for i in range(2)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n"
                                              for i, p in enumerate(prompts)))
    r = hpipe("launch", tmp_path / "plan.json", "--cluster", cluster.inventory_path, "--prompts", tmp_path / "p.jsonl",
              "--out", tmp_path / "hosts.jsonl", "--max-new-tokens", "6", "--push-model", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    copied = [line for line in r.stderr.splitlines() if "model files copied" in line]
    assert len(copied) == 3, r.stderr           # each host its own directory (they share a file system here)
    for line in copied:
        sent = list(Path(line.rsplit(" to ", 1)[1].strip()).glob("*.gguf"))
        assert len(sent) == 1 and sent[0].stat().st_size < 0.7 * path.stat().st_size, (line, sent)
    got = {x["id"]: x["output_ids"] for x in map(json.loads, (tmp_path / "hosts.jsonl").read_text().splitlines())}
    source = models.resolve_model(str(path))
    config = models.load_config(source.path)
    plan = formats.load_plan(tmp_path / "plan.json")
    runners = [StageRunner(source, config, range(*st.units), weights=quant.WeightFormat("gguf"), kv_dtype=plan.kv_dtype)
               for st in plan.stages]
    want = run_inprocess(runners, [Request(i, f"p{i}", tuple(p), max_new_tokens=6, eos_ids=frozenset())
                                   for i, p in enumerate(prompts)], plan.slicing.slices_for, max_batch=2)
    for name, ids in got.items():        # a stop at an end-of-text token leaves a prefix
        assert ids and ids == want[name]["output_ids"][:len(ids)], (name, ids, want[name]["output_ids"])


def test_preflight_refuses_missing_devices_and_other_versions(cluster, tmp_path):
    """The preflight compares each host with the plan and with this machine: a CUDA device the host
    does not have, and an hpipe of another version on its path, are refused before anything starts."""
    inv = write_inventory(cluster, tmp_path / "gpu.toml")
    inv.write_text(inv.read_text().replace('devices = ["cpu"]', 'devices = ["cpu", "cuda:0"]', 1))
    plan = tmp_path / "plan.json"
    assert hpipe("plan", "--model", "smollm2", "--cluster", inv, "-o", plan, cwd=tmp_path).returncode == 0
    line = error_line(hpipe("cluster", "check", inv, "--plan", plan, cwd=tmp_path))
    assert "host h0" in line and "cuda:0 not found" in line and "host h1" not in line, line
    # an older hpipe first on h1's path
    fake = tmp_path / "old" / "hpipe"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.0.1"\n')
    inv = write_inventory(cluster, tmp_path / "old.toml")
    text = inv.read_text()
    h1 = text.index('name = "h1"')
    text = text[:h1] + text[h1:].replace(f'PYTHONPATH = "{ROOT}"', f'PYTHONPATH = "{fake.parent}"', 1)
    inv.write_text(text)
    line = error_line(hpipe("cluster", "check", inv, cwd=tmp_path))
    assert "host h1" in line and "hpipe 0.0.1 there" in line and "host h0" not in line, line
    assert nothing_running(cluster) == []


@pytest.mark.slow
def test_serve_on_hosts_answers_like_launch_and_ctrl_c_leaves_nothing(cluster, plan_and_prompts, undisturbed,
                                                                     tmp_path):
    """`hpipe serve --cluster`: requests reach stage 0 through its remote wrapper's stdin; greedy
    answers (streamed and not) equal `hpipe launch --cluster`'s, and Ctrl-C stops every host. The
    server starts on two hosts; the third, added to its inventory, joins on SIGHUP."""
    import openai

    from hpipe import models
    plan, prompts = plan_and_prompts
    questions = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()[:2]]
    # the launch's first 12 tokens, one prompt at a time as the server gets them below: the same
    # micro-batches, the same numbers (the plan's weights are quantized, whose kernels round inputs
    # to bf16: see test_serve.py)
    tokenizer = models.load_tokenizer(models.resolve_model("smollm2").path)
    launched = {k: tokenizer.decode(v[:12], skip_special_tokens=True) for k, v in undisturbed.items()}
    full = Path(cluster.inventory_path).read_text()
    inventory = tmp_path / "inventory.toml"          # h0 and h1 (h2's block left out)
    inventory.write_text("[[hosts]]".join(b for b in full.split("[[hosts]]") if 'name = "h2"' not in b))
    two = tmp_path / "two.json"        # the 3-stage plan's slicing: the same numbers as the launch's
    slices = str(json.loads(Path(plan).read_text())["slicing"]["count"])
    hpipe("plan", "--model", "smollm2", "--cluster", inventory, "--num-slices", slices, "-o", two, cwd=tmp_path,
          check=True)
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", str(two), "--cluster",
                             str(inventory), "--port", "0", "--max-model-len", "512",
                             "--kv-pages", "64", "--compile", "off"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    try:
        port = served_port(proc, tmp_path / "serve.log")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        inventory.write_text(full)
        proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 180
        while "rejoined h2" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.3)
        assert "h2 added" in (tmp_path / "serve.log").read_text()
        whole = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": questions[0]}],
                                               max_tokens=12, temperature=0).choices[0].message.content
        streamed = "".join(ch.delta.content or "" for ev in client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": questions[1]}], max_tokens=12, temperature=0,
            stream=True) for ch in ev.choices)
        assert whole == launched["q0"] and streamed == launched["q1"]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert wait_until_clean(cluster, 2.0) == [], (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# A host lost and taken back while serving (launcher/elastic.py)

class Served:
    """`hpipe serve --cluster` in the background, its log, and the openai client."""

    def __init__(self, cluster, plan: Path, tmp_path: Path, *extra: str):
        import openai

        self.log = tmp_path / "serve.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", str(plan), "--cluster",
                                          str(cluster.inventory_path), "--port", "0", "--max-model-len",
                                          "512", "--kv-pages", "128", "--max-batch", "12", "--compile", "off",
                                          *extra],
                                         stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
        self.port = served_port(self.proc, self.log, 300)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=300)
        self.until(lambda: self.health()[0] == 200, 300, "the server never became ready")

    def text(self) -> str:
        return self.log.read_text()

    def get(self, path: str) -> tuple[int, str]:
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, "{}"

    def health(self) -> tuple[int, dict]:
        status, body = self.get("/health")
        return status, json.loads(body)

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1]
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    def until(self, ok, within: float, what: str) -> None:
        deadline = time.time() + within
        while not ok():
            assert self.proc.poll() is None and time.time() < deadline, f"{what}:\n{self.text()}"
            time.sleep(0.3)

    def chats(self, questions: list[str], during=None) -> list[str]:
        """Every question as a streaming greedy chat at once; `during()` runs once every stream has
        had its first piece. Returns the texts (any error fails the test)."""
        import threading
        texts, errors = [""] * len(questions), []
        begun = threading.Barrier(len(questions) + 1)

        def one(i: int) -> None:
            first = True
            try:
                for ev in self.client.chat.completions.create(
                        model="smollm2", messages=[{"role": "user", "content": questions[i]}], max_tokens=24,
                        temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    for ch in ev.choices:
                        texts[i] += ch.delta.content or ""
                    if first and texts[i]:
                        first = False
                        begun.wait(timeout=300)
            except Exception as e:  # noqa: BLE001 - what the client saw
                errors.append(repr(e))
                begun.abort()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        begun.wait(timeout=300)
        if during is not None:
            during()
        for t in threads:
            t.join(timeout=300)
        assert not errors, (errors, self.text())
        return texts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


QUESTIONS = [f"{q} ({i})" for i, q in enumerate(["What is the capital of France?", "Name three colours.",
                                                  "Count from one to ten.", "What is 2 + 2?"] * 3)]


def kill_worker(cluster, name: str) -> None:
    ns = cluster.host(name).namespace
    os.kill(next(pid for pid in namespace_pids(ns)
                 if process_cmdline(pid).split(" ")[1:3] == ["-m", "hpipe.runtime.worker"]), signal.SIGKILL)


@pytest.mark.slow
def test_serve_goes_on_through_a_lost_host_and_takes_it_back(cluster, tmp_path):
    """`hpipe serve --cluster` on 3 hosts (a float32 plan from a profile), 12 streaming chats at once:
    (a) one host's stage worker SIGKILLed mid-stream, (b) another host's link taken down mid-stream:
    every stream completes without an error with the undisturbed run's greedy text, /metrics counts
    the recoveries and the resumed requests, and each host, back, is taken into the pipeline again.
    Then two hosts down at once: the one left cannot hold the model, so requests get a 503 with the
    cause and /health says degraded, until the hosts return."""
    plan = tmp_path / "plan.json"
    profile = elastic_profile([h.spec.name for h in cluster.hosts], tmp_path / "profile.json")
    hpipe("plan", "--model", "smollm2", "--cluster", cluster.inventory_path, "--profile", profile, "--seq-len",
          "64", "-o", plan, cwd=tmp_path, check=True)
    assert [s["host"] for s in json.loads(plan.read_text())["stages"]] == ["h0", "h1", "h2"]
    served = Served(cluster, plan, tmp_path, "--heartbeat-timeout", "3", "--log-dir", str(tmp_path / "stages"))
    pages = contextlib.ExitStack()
    try:
        undisturbed = served.chats(QUESTIONS)
        # the live page (tests/test_dashboard.py) watches: the lost host's event row comes
        page = open_page(pages.enter_context(browser()), f"http://127.0.0.1:{served.port}", None) \
            if browser_missing() is None else None
        assert served.chats(QUESTIONS, during=lambda: kill_worker(cluster, "h1")) == undisturbed
        assert served.metric("hpipe_recoveries_total") == 1 and served.metric("hpipe_requests_resumed_total") >= 1
        if page is not None:
            wait_until(page, "document.querySelector(\"#events tr[data-kind='lost'][data-host='h1']\") !== null")
            row = page.inner_text("#events tr[data-kind='lost']")
            assert "lost h1" in row and "h1/cpu" in row and page.problems == [], row
        served.until(lambda: served.metric("hpipe_rejoins_total") == 1, 120, "h1 was not taken back")
        assert "hpipe: h1 answers again" in served.text()     # (the next round runs on the three hosts)

        def link_down() -> None:
            set_link(cluster, "h2", up=False)
        try:
            assert served.chats(QUESTIONS, during=link_down) == undisturbed
        finally:
            set_link(cluster, "h2", up=True)
        assert served.metric("hpipe_recoveries_total") == 2
        served.until(lambda: served.metric("hpipe_rejoins_total") == 2, 120, "h2 was not taken back")

        import openai
        for name in ("h1", "h2"):
            set_link(cluster, name, up=False)
        try:
            served.until(lambda: served.health()[0] == 503, 120, "never degraded")
            status, body = served.health()
            assert body["status"] == "degraded" and "cannot hold the model" in body["error"], body
            with pytest.raises(openai.APIStatusError) as refused:
                served.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=4)
            assert refused.value.status_code == 503 and "cannot hold the model" in str(refused.value)
        finally:
            for name in ("h1", "h2"):
                set_link(cluster, name, up=True)
        served.until(lambda: served.health() == (200, {"status": "ok"}), 180, "never recovered from degraded")
        assert served.chats(QUESTIONS[:4]) == undisturbed[:4]
        assert "Traceback" not in served.text()
    finally:
        pages.close()
        served.stop()
    assert wait_until_clean(cluster, 5.0) == [], served.text()


def test_warmup_on_every_host_at_once_then_the_default_launch_runs_compiled(cluster, tiny_models, tmp_path):
    """`hpipe warmup --cluster FILE --plan plan.json`: each host of the plan compiles the graphs of its
    own stage (its units alone) with the plan's settings and the threads its stage will run with, a
    line per host as it goes; a launch with default flags then finds every host warm (no stage says
    it decodes eagerly) and runs compiled graphs."""
    plan = tmp_path / "plan.json"
    hpipe("plan", "--model", tiny_models["llama"], "--cluster", cluster.inventory_path, "-o", plan, cwd=tmp_path,
          check=True)
    r = hpipe("warmup", "--cluster", cluster.inventory_path, "--plan", plan, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    stages = json.loads(plan.read_text())["stages"]
    hosts = [st["host"] for st in stages]
    for st in stages:
        host, (a, b) = st["host"], st["units"]
        assert f"{host}: compiling for 1 thread(s)" in r.stdout, r.stdout
        assert f"{host}: warmup 1/1: units {a}-{b - 1}, 1 thread(s)" in r.stdout, r.stdout      # its stage alone
        assert any(line.startswith(f"{host}: ") and "decode graphs compiled and warm" in line
                   for line in r.stdout.splitlines()), r.stdout
    assert f"{len(set(hosts))} host(s) warm" in r.stdout
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "input_ids": [5, 6, 7, 8, 9]}) + "\n")
    out = tmp_path / "out.jsonl"
    r = hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", tmp_path / "p.jsonl", "--out", out,
              "--max-new-tokens", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "decode runs eagerly" not in r.stderr + r.stdout and "hpipe warmup" not in r.stdout
    options = json.loads(out.with_name(out.name + ".summary.json").read_text())["run"]["options"]
    assert options["compiled"] and not options["compile_cold"]
