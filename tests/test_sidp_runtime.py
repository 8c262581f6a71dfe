"""`hpipe launch` of a SiDP plan on this machine: CPU replicas mapping one copy of the weights, the
job handed out among them. Same tokens as a one-stage pipeline, shared pages, and a replica lost
mid-job stops the job with its name while finished results stay for --resume."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import VOCAB, assert_greedy_equal, reference_greedy
from hpipe import formats, protocol
from hpipe.cli import main
from hpipe.launcher.replicas import ReplicaReport, _dispatch
from hpipe.launcher.serving import Handle
from hpipe.request import Request

pytestmark = pytest.mark.slow


def sidp_plan(path, tmp_path, replicas: int):
    """A pipeline plan of one stage, and the SiDP plan of `replicas` CPU replicas of it."""
    single = tmp_path / "single.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "1", "--slices", "16", "-o", str(single)]) == 0
    plan = formats.load_plan(single)
    sidp = formats.Plan(model=plan.model, stages=plan.stages * replicas, slicing=plan.slicing, dtype=plan.dtype,
                        kv_dtype=plan.kv_dtype, weights=plan.weights, mode="sidp",
                        sidp=(formats.SidpGroupPlan("local", tuple(range(replicas)),
                                                    tuple(b % replicas for b in range(plan.model.blocks)), 0,
                                                    "shared-mapping"),))
    out = tmp_path / "sidp.json"
    formats.write_plan(sidp, out)
    return single, out


def fetching_plan(path, tmp_path, threshold: int):
    """The SiDP plan of 2 CPU replicas whose WaS copies the MLPs it does not own from the weights'
    mapping (host-pool) into its slots, and whose switch to CaS is at `threshold` sequences."""
    _, out = sidp_plan(path, tmp_path, 2)
    plan = formats.load_plan(out)
    group = plan.sidp[0]
    formats.write_plan(dataclasses.replace(plan, sidp=(dataclasses.replace(
        group, source="host-pool", slots=group.slots_needed(0), threshold=threshold),)), out)
    return out


def prompts_file(tmp_path, n: int, seed: str, tail: int | None = None):
    """`n` prompts, greedy and seeded in turn; with `tail`, the first two are greedy and generate that
    many tokens (the others --max-new-tokens). The dispatcher hands them to two replicas (the least loaded
    first, ties to the one that has taken fewer, then the lower index), so each replica's share ends with one sequence of its own,
    whatever the timing: a tail that went to the faster replica alone (the last prompt's, once)
    could end while the other, starved on a loaded machine, still ran its bulk at the threshold."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))]
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 50 + i}
        lines.append({"id": f"p{i}", "input_ids": prompt, "sampling": sampling})
    for line in lines[:2 if tail else 0]:           # greedy both (a GPU run compares greedy text up to ties)
        line.update(max_new_tokens=tail, sampling={"temperature": 0})
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path, lines


def results(path) -> dict:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


class EndsAtOnce:
    """A replica whose requests end before the dispatcher hands out the next one: what a loaded
    machine's event loop, running late behind a tiny model, sees of a real one."""

    def __init__(self):
        self.job = SimpleNamespace(plan=SimpleNamespace(stages=[SimpleNamespace(host="local", device="cpu")]))
        self.max_batch, self.failure, self.on_failure = 2, None, None
        self.output = SimpleNamespace(peers_lost=set())

    def load(self) -> int:
        return 0

    def submit_request(self, request, loop):
        handle = Handle(request, loop, asyncio.Queue())
        handle.result = protocol.Result(request.index, [7], "length", len(request.input_ids), None, 0.0, None, None)
        handle.queue.put_nowait(("finish", "length", ()))
        return handle


def test_the_dispatcher_spreads_requests_that_end_before_the_next_is_handed_out(tmp_path):
    clients = [EndsAtOnce(), EndsAtOnce()]
    job = SimpleNamespace(requests=[Request(i, f"p{i}", (3, 4, 5), max_new_tokens=1) for i in range(8)], tokenizer=None)
    report = ReplicaReport()
    asyncio.run(_dispatch(clients, job, str(tmp_path / "out.jsonl"), report, lambda msg: None, time.time()))
    assert [r["requests"] for r in report.replicas] == [4, 4]


def test_replicas_give_the_pipelines_tokens_and_share_the_weights(tiny_models, reference_models, tmp_path):
    path = tiny_models["llama"]
    single, sidp = sidp_plan(path, tmp_path, 2)
    prompts, lines = prompts_file(tmp_path, 8, "sidp")
    out_sidp, out_single = tmp_path / "sidp.jsonl", tmp_path / "single.jsonl"
    assert main(["launch", str(sidp), "--local", "--prompts", str(prompts), "--out", str(out_sidp),
                 "--max-new-tokens", "12", "--max-batch", "2", "--quiet"]) == 0
    assert main(["launch", str(single), "--local", "--prompts", str(prompts), "--out", str(out_single),
                 "--max-new-tokens", "12", "--max-batch", "2", "--quiet"]) == 0
    ours, theirs = results(out_sidp), results(out_single)
    assert {r["replica"] for r in ours.values()} == {0, 1}, "both replicas take requests"
    ref = reference_models["llama"]
    for line in lines:
        pid = line["id"]
        if line["sampling"]["temperature"] == 0:
            assert_greedy_equal(ref, line["input_ids"], ours[pid]["output_ids"],
                                reference_greedy(ref, line["input_ids"], 12, 2))
        assert ours[pid]["output_ids"] == theirs[pid]["output_ids"], pid
    summary = json.loads((tmp_path / "sidp.jsonl.summary.json").read_text())
    assert summary["mode"] == "sidp" and summary["results"] == len(lines)
    for replica in summary["replicas"]:
        # the weights are one file mapped by both (no private copies): each one's share of its pages
        # is at most half (less where this test's own process maps the file too)
        assert replica["weights_rss_bytes"] > 0
        assert replica["weights_pss_bytes"] <= 0.55 * replica["weights_rss_bytes"]


def cas_job_under_way(sidp: Path, prompts: Path, out: Path, new_tokens: int, answered: int,
                      *more: str) -> tuple[subprocess.Popen, int]:
    """`hpipe launch` of `sidp` under CaS in the background, once `answered` results are written, and
    the pid of replica 1's worker (found by this launch's plan: another test's may run beside it)."""
    cmd = [sys.executable, "-m", "hpipe", "launch", str(sidp), "--local", "--prompts", str(prompts), "--out", str(out),
           "--max-new-tokens", str(new_tokens), "--max-batch", "2", "--quiet", "--sidp-mode", "cas", *more]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out.exists() and out.read_text().count("\n") >= answered):
        assert job.poll() is None and time.time() < deadline, job.communicate()
        time.sleep(0.2)
    ps = subprocess.run(["pgrep", "-f", "--", "--replica 1 "], capture_output=True, text=True).stdout.split()
    mine = [p for p in ps if f"--plan {sidp} ".encode() in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")]
    assert mine, "replica 1's worker is running"
    return job, int(mine[0])


def test_a_replica_lost_mid_job_hands_its_requests_to_the_others(tiny_models, tmp_path):
    """Under CaS, where the replicas meet at every MLP half: the survivor falls with the killed
    replica, is started again on its own (WaS), and the job finishes without --resume, every id
    once, each request going on where it stood: the tokens of the one-stage pipeline."""
    single, _ = sidp_plan(tiny_models["llama"], tmp_path, 2)
    sidp = fetching_plan(tiny_models["llama"], tmp_path, 0)
    prompts, lines = prompts_file(tmp_path, 24, "sidp-kill")
    out = tmp_path / "out.jsonl"
    job, replica1 = cas_job_under_way(sidp, prompts, out, 120, 2)
    os.kill(replica1, signal.SIGKILL)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err
    assert "replica 1 (local/cpu) lost" in err and "starting it again on its own" in err and "Traceback" not in err, err
    done = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in done) == sorted(x["id"] for x in lines)          # every id once
    reference = tmp_path / "single.jsonl"
    assert main(["launch", str(single), "--local", "--prompts", str(prompts), "--out", str(reference),
                 "--max-new-tokens", "120", "--max-batch", "2", "--quiet"]) == 0
    theirs = results(reference)
    assert {r["id"]: r["output_ids"] for r in done} == {k: v["output_ids"] for k, v in theirs.items()}


def test_a_replica_stalled_past_the_rendezvous_timeout_is_waited_for(tiny_models, tmp_path):
    """Under CaS, replica 1 stopped (SIGSTOP) for longer than --rendezvous-timeout while replica 0
    waits for it at a meeting: the group goes on in step when it resumes, none lost. The gloo
    deadline of the group's operations was the rendezvous timeout: replica 0 fell after 8 s."""
    sidp = fetching_plan(tiny_models["llama"], tmp_path, 0)
    prompts, lines = prompts_file(tmp_path, 12, "sidp-stall")
    out = tmp_path / "out.jsonl"
    job, replica1 = cas_job_under_way(sidp, prompts, out, 60, 1, "--rendezvous-timeout", "8")
    os.kill(replica1, signal.SIGSTOP)
    time.sleep(11)
    os.kill(replica1, signal.SIGCONT)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0 and "lost" not in err and "Traceback" not in err, err
    assert sorted(r["id"] for r in results(out).values()) == sorted(x["id"] for x in lines)
    steps = [r["sidp"]["steps"] for r in json.loads((tmp_path / "out.jsonl.summary.json").read_text())["replicas"]]
    assert steps[0]["cas"] == steps[1]["cas"] > 0, steps        # in step throughout: neither ran on alone


@pytest.fixture(scope="module")
def one_stage_run(tiny_models, tmp_path_factory):
    """The reference of the WaS / CaS runs: the same prompts through a one-stage pipeline."""
    tmp = tmp_path_factory.mktemp("sidp-modes")
    single, _ = sidp_plan(tiny_models["llama"], tmp, 2)
    prompts, lines = prompts_file(tmp, 10, "sidp-modes", tail=300)
    out = tmp / "single.jsonl"
    assert main(["launch", str(single), "--local", "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "16", "--max-batch", "4", "--quiet"]) == 0
    theirs = results(out)
    # the tails are there, long: on a loaded machine one replica may run far behind the other
    assert sorted(len(r["output_ids"]) for r in theirs.values()) == [16] * 8 + [300] * 2
    return prompts, lines, theirs


@pytest.mark.parametrize("mode,threshold", [("was", 0), ("cas", 0), ("auto", 3)])
def test_was_cas_and_the_switch_give_the_pipelines_tokens(tiny_models, one_stage_run, tmp_path, mode, threshold):
    """WaS copying the MLPs it does not own into its slots, CaS sending its rows to the owner, and
    auto switching from WaS to CaS when the job's tail leaves fewer than 3 sequences per replica:
    every greedy and seeded output equals the one-stage pipeline's, and under CaS both replicas
    ran the same steps."""
    prompts, lines, theirs = one_stage_run
    path = fetching_plan(tiny_models["llama"], tmp_path, threshold)
    blocks = formats.load_plan(path).model.blocks
    out = tmp_path / "sidp.jsonl"
    assert main(["launch", str(path), "--local", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens",
                 "16", "--max-batch", "4", "--quiet", "--sidp-mode", mode, "--timeline-out",
                 str(tmp_path / "modes.json")]) == 0
    ours = results(out)
    for line in lines:
        assert ours[line["id"]]["output_ids"] == theirs[line["id"]]["output_ids"], line["id"]
    summary = json.loads((tmp_path / "sidp.jsonl.summary.json").read_text())
    replicas = summary["replicas"]
    steps = [r["sidp"]["steps"] for r in replicas]
    modes = [[m for *_, m in t["trace"]] for t in summary["traces"]]
    assert json.loads((tmp_path / "modes.json").read_text())["traces"] == summary["traces"]
    if mode == "was":           # alone, as plain DP: every MLP half it does not own came through a slot
        assert all(s["cas"] == 0 and s["was"] > 0 for s in steps)
        assert all(r["sidp"]["was"]["fetches"] >= blocks // 2 for r in replicas)
    elif mode == "cas":         # in step: the group meets at every step
        assert all(s["was"] == 0 for s in steps) and steps[0]["cas"] == steps[1]["cas"] > 0
        assert all(r["sidp"]["cas"]["rows_sent"] > 0 for r in replicas)
    else:                       # WaS alone in the bulk, then all of them in step under CaS in the tail
        assert steps[0]["cas"] == steps[1]["cas"] > 0, (steps, summary["traces"])
        assert all("cas" in m for m in modes)
        # a replica that starts late (a loaded machine) may find the group in step already
        assert any(set(m[:m.index("cas")]) == {"was"} for m in modes), modes


def gpu_plans(path, tmp_path, source: str, threshold: int):
    """The one-stage pipeline plan on cuda:0, and the SiDP plan of 2 replicas sharing that GPU
    (standing in for two cards) whose WaS reads from `source`."""
    single = tmp_path / "single-gpu.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "1", "--device", "cuda:0", "--slices", "16",
                 "-o", str(single)]) == 0
    plan = formats.load_plan(single)
    owners = tuple(b % 2 for b in range(plan.model.blocks))
    group = formats.SidpGroupPlan("local", (0, 1), owners, 0, source, threshold)
    sidp = tmp_path / "sidp-gpu.json"
    formats.write_plan(dataclasses.replace(plan, stages=plan.stages * 2, mode="sidp", sidp=(
        dataclasses.replace(group, slots=group.slots_needed(0)),)), sidp)
    return single, sidp


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
@pytest.mark.parametrize("source,mode,threshold", [("host-pool", "was", 0), ("peer", "was", 0),
                                                   ("host-pool", "cas", 0), ("peer", "auto", 3)])
def test_gpu_replicas_give_the_pipelines_tokens(tiny_models, reference_models, tmp_path, source, mode, threshold):
    """Two GPU replicas sharing one GPU: WaS filling its slots on a copy stream from one pinned host
    copy (host-pool) or from the owner's device memory through CUDA IPC (peer), CaS staging its rows
    through the host, and the switch: the one-stage pipeline's tokens on the same GPU (greedy ones
    up to a float32 tie), each replica holding only the MLPs it owns."""
    single, sidp = gpu_plans(tiny_models["llama"], tmp_path, source, threshold)
    prompts, lines = prompts_file(tmp_path, 10, f"sidp-gpu-{source}-{mode}", tail=60)
    args = ["--local", "--prompts", str(prompts), "--max-new-tokens", "16", "--max-batch", "4", "--quiet"]
    out, ref = tmp_path / "sidp.jsonl", tmp_path / "single.jsonl"
    assert main(["launch", str(sidp), *args, "--out", str(out), "--sidp-mode", mode]) == 0
    assert main(["launch", str(single), *args, "--out", str(ref)]) == 0
    ours, theirs = results(out), results(ref)
    for line in lines:
        a, b = ours[line["id"]]["output_ids"], theirs[line["id"]]["output_ids"]
        if line["sampling"]["temperature"] == 0:
            assert_greedy_equal(reference_models["llama"], line["input_ids"], a, b)
        else:
            assert a == b, line["id"]
    summary = json.loads((tmp_path / "sidp.jsonl.summary.json").read_text())
    replicas = [r["sidp"] for r in summary["replicas"]]
    assert all(r["device_bytes_released"] > 0 for r in replicas), "each replica dropped the MLPs it fetches"
    if mode != "cas":
        assert all(r["was"]["fetches"] > 0 and r["was"]["fetch_s"] > 0 for r in replicas)
    if mode != "was":           # in step (auto: in the tail, where one replica may be left with rows)
        assert replicas[0]["steps"]["cas"] == replicas[1]["steps"]["cas"] > 0
        assert sum(r["cas"]["rows_sent"] for r in replicas) == sum(r["cas"]["rows_served"] for r in replicas) > 0
    if mode == "cas":
        assert all(r["cas"]["rows_sent"] > 0 for r in replicas)
    assert not list(Path("/dev/shm").glob("hpipe-sidp-*")), "the group's files are removed"
