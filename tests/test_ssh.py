"""`hpipe launch --cluster`, `hpipe cluster check` and `hpipe profile --cluster` against emulated
hosts: network namespaces on this machine, each with a real OpenSSH server, `tc tbf` shaped links
and a CPU quota on one host (tests/netns_hosts.py). Needs root and openssh-server; skips with the
reason otherwise (`.ci/run` installs openssh-server, so CI runs these). Serving, warmup and
--push-model on the hosts: test_ssh_serve.py.

    pytest -m hosts          # only these
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns_hosts import (SUBNET, HostSpec, hpipe_processes, process_cmdline, namespace_pids, set_link, start_cluster,
                         stop_cluster, unavailable_reason, write_inventory)

ROOT = Path(__file__).resolve().parent.parent
REASON = unavailable_reason()
pytestmark = [pytest.mark.hosts, pytest.mark.skipif(REASON is not None, reason=f"emulated hosts: {REASON}")]

SPECS = [HostSpec("h0", rate_mbit=1000), HostSpec("h1", rate_mbit=1000), HostSpec("h2", rate_mbit=100, cpus=0.5)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("hosts"), SPECS)
    yield c
    stop_cluster(c)


def hpipe(*args, cwd, timeout=600, check=False):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "hpipe", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise AssertionError(f"hpipe {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}")
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
    text = inv.read_text().replace(f'address = "{cluster.host("h2").address}"', f'address = "{SUBNET}.77"')
    inv.write_text(text)
    t = time.time()
    line = error_line(hpipe("cluster", "check", inv, cwd=tmp_path))
    assert time.time() - t < 20
    assert f"host h2 ({SUBNET}.77:22)" in line and ("no answer" in line or "cannot connect" in line), line


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
    r = hpipe("profile", "--cluster", cluster.inventory_path, "--quick", "--max-seq-len", "256", "-o", profile,
              cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = json.loads(profile.read_text())
    assert [d["id"] for d in prof["devices"]] == ["h0/cpu", "h1/cpu", "h2/cpu"]
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
    from hpipe import models
    from hpipe.planner.partition import stage_time
    from hpipe.planner.profiled import CostModel, predict, workload
    from hpipe.planner.uniform import uniform_cuts
    config = models.load_config(models.resolve_model("smollm2").path)
    cost = CostModel(profile, config, [(st["host"], st["device"]) for st in plan["stages"]])
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
def test_every_switch_combination_gives_the_same_tokens_on_hosts(cluster, plan_and_prompts, tmp_path):
    """--no-tsem/--no-sat/--sampling inline|cpu on the emulated hosts (every pair of their values, and
    all on): seeded sampling with
    penalties and early stops gives the tokens of the baseline (all off). Dense float32 weights and cache:
    which sequences share a micro-batch depends on the hosts' timing, and quantized kernels round
    their inputs to bf16, where a float32 difference of summation order can pick the other of two
    near-equal tokens (the quantized switches are checked on one machine in test_quant.py)."""
    plan = tmp_path / "plan.json"
    hpipe("plan", "--model", "smollm2", "--cluster", cluster.inventory_path, "--quantize", "none", "--kv-dtype",
          "float32", "-o", plan, cwd=tmp_path, check=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"s{i}", "prompt": p, "stop_token_ids": list(range(30, 300))}) + "\n"
                               for i, p in enumerate(["Name a river.", "Say something about cats.",
                                                      "Write one line of a poem."])))
    runs = {}
    # every pair of two switches' values (an orthogonal array of the three), and all on: 5 launches
    # of ~35 s on the hosts instead of 8; all eight combinations run locally in test_launch_local.py
    for tsem, sat, sampling in ((False, False, "inline"), (False, True, "cpu"), (True, False, "cpu"),
                                (True, True, "inline"), (True, True, "cpu")):
        out = tmp_path / f"o-{tsem}-{sat}-{sampling}.jsonl"
        hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", prompts, "--out", out,
              "--max-new-tokens", "10", "--max-batch", "3", "--temperature", "0.9", "--top-p", "0.9",
              "--repetition-penalty", "1.2", "--frequency-penalty", "0.3", "--presence-penalty", "0.2",
              "--seed", "5", "--sampling", sampling,
              *(["--prepare-thread", "on"] if tsem else ["--no-tsem"]),
              *([] if sat else ["--no-sat"]), "--quiet", cwd=tmp_path, check=True)
        runs[(tsem, sat, sampling)] = {r["id"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
    baseline = runs[(False, False, "inline")]
    assert len(baseline) == 3
    for switches, tokens in runs.items():
        assert tokens == baseline, f"tsem, sat, sampling = {switches}"


def wait_for_worker(cluster, host: str, proc, within: float = 120) -> int:
    deadline = time.time() + within
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        for pid in namespace_pids(cluster.host(host).namespace):
            if process_cmdline(pid).split(" ")[1:3] == ["-m", "hpipe.runtime.worker"]:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no worker on {host} within {within} s")


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
    left on any host 2 s after the launcher exits) and the launcher names the SIGKILL."""
    if phase == "decode":
        proc, out = start_launch(cluster, plan_and_prompts, tmp_path, "--no-recover")
    else:
        proc, out = spawn_launch(cluster, plan_and_prompts, tmp_path, "--no-recover")
    worker = wait_for_worker(cluster, "h1", proc)
    stopped = None
    if phase == "rendezvous":   # hold stage 2 back so that stage 1 waits in the rendezvous
        stopped = wait_for_worker(cluster, "h2", proc)
        os.kill(stopped, signal.SIGSTOP)
        deadline = time.time() + 120
        while not in_rendezvous(cluster, "h1", worker):
            assert time.time() < deadline and proc.poll() is None, "stage 1 never reached the rendezvous"
            time.sleep(0.05)
    try:
        os.kill(parent_of(worker), signal.SIGKILL)
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


def kill_worker(cluster, name: str) -> None:
    ns = cluster.host(name).namespace
    os.kill(next(pid for pid in namespace_pids(ns)
                 if process_cmdline(pid).split(" ")[1:3] == ["-m", "hpipe.runtime.worker"]), signal.SIGKILL)
