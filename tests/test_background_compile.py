"""A cold host (no `hpipe warmup`) under --compile auto (the default): `hpipe serve` gets its
decode graphs beside it (hpipe.runtime.background_compile): the stages serve at once, eagerly, while
a child of each compiles the graphs at the lowest CPU priority and a thread loads them; the stages
then run them. A batch job compiles first only where its decode pays for the compile
(hpipe.runtime.compile_choice)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_greedy_equal, cold_host_cache
from hpipe import models
from hpipe.cli import main
from hpipe.runtime import compile_choice
from hpipe.runtime.stage import StageRunner, compile_if_it_pays, graph_keys, record_compile, warm_up
from serving import stop_serve
from test_serve import client, start_server

pytestmark = pytest.mark.slow

CHILD = "hpipe.runtime.background_compile"


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                out[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(child)
    return out


def test_a_server_gets_its_graphs_beside_it_compiled_on_a_cold_host_loaded_on_a_warm_one(talking_model, tmp_path,
                                                                                       monkeypatch):
    """Two stages with a block cut between them (whole blocks and halves both compile).
    - A cold host: at start each stage says, in a quiet server's log, that it decodes eagerly while
      its graphs compile; a child process per stage compiles them at nice 19, below its stage in
      the process tree; each stage then says it runs them, and no child is left.
    - The graphs are marked warm: a second server on the host compiles nothing (no child) and says
      its stages loaded them beside it.
    Greedy answers before and after each switch are transformers' (the graphs' sums are not eager's
    bit for bit: near-ties aside)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cold_host_cache(tmp_path / "inductor")))
    plan = tmp_path / "plan.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(talking_model), "--stages", "2", "--cuts", "4", "-o", str(plan)]) == 0
    reference = AutoModelForCausalLM.from_pretrained(talking_model).eval()
    prompt = list(range(40, 75))
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            expected.append(int(reference(torch.tensor([expected])).logits[0, -1].argmax()))

    def serve(check_start) -> str:
        proc, base, log = start_server(tmp_path, plan, key=None, compile="auto")
        c = client(base, key=None)
        model = c.models.list().data[0].id

        def greedy() -> list[int]:
            done = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
            return [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens]

        try:
            answers = [greedy()]
            check_start(proc, log.read_text())
            deadline = time.time() + 400
            while time.time() < deadline:
                text = log.read_text()
                if text.count("steps run them from now") == 2 or "decode stays eager" in text:
                    break
                time.sleep(1)
            assert text.count("steps run them from now") == 2, text
            assert len(graphs_mapped(proc)) == 2, "a stage said it runs graphs it has not loaded"
            answers.append(greedy())
            assert not [cmd for cmd in descendants(proc.pid).values() if CHILD in cmd]
        finally:
            stop_serve(proc)
        assert proc.returncode in (0, 130), log.read_text()
        for tokens in answers:
            assert_greedy_equal(reference, prompt, tokens, expected[len(prompt):])
        return text

    def graphs_mapped(proc) -> list[int]:
        """The stage workers that have inductor's compiled graphs (this host's cache) mapped."""
        cache = str(tmp_path / "inductor")
        return [pid for pid, cmd in descendants(proc.pid).items() if "hpipe.runtime.worker" in cmd
                and cache in Path(f"/proc/{pid}/maps").read_text()]

    def compiling(proc, text: str) -> None:
        started = [line for line in text.splitlines() if "compile in the background" in line]
        assert len(started) == 2 and all("decode runs eagerly" in line for line in started), text
        assert not graphs_mapped(proc)
        deadline = time.time() + 30       # each child past its exec and its priority call
        while time.time() < deadline:
            children = [pid for pid, cmd in descendants(proc.pid).items() if CHILD in cmd]
            if len(children) == 2 and all(os.getpriority(os.PRIO_PROCESS, pid) == 19 for pid in children):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"no 2 children at nice 19 below the server: {descendants(proc.pid)}")

    text = serve(compiling)
    assert text.count("compiled in the background") == 2, text
    assert len(list((tmp_path / "inductor" / "hpipe-warm").iterdir())) >= 2     # the next start runs them

    def loading(proc, text: str) -> None:
        assert "compile in the background" not in text, text
        assert not [cmd for cmd in descendants(proc.pid).values() if CHILD in cmd]

    text = serve(loading)
    assert text.count("decode graphs loaded in") == 2 and "compiled in the background" not in text, text


def test_a_cold_batch_job_compiles_first_only_where_its_decode_pays_for_it(tiny_models, tmp_path, monkeypatch):
    """A cold stage: a short job's choice is to decode eagerly, a long one's to compile first, each
    said in one line with its numbers; the compile then marks the graphs warm on this host (a later
    stage here is not cold) and records its cost, which the next choice uses instead of the
    estimate."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cold_host_cache(tmp_path / "inductor")))
    path = tiny_models["llama"]
    config = models.load_config(path)
    units = range(models.num_units(config))

    def stage():
        # float32 pages, and a pool of 4 as `hpipe warmup` sizes its own: the graphs of all 4 blocks are
        # then those test_launch_local.py's warmup compiles (a pool of 16 pages, the tiny model's head
        # size, had dynamo tie the two in the graphs' guards, which then served no other pool)
        runner = StageRunner(path, config, units, compile="auto", kv_dtype="float32")
        runner.kv.allocate(4)
        return runner

    runner, lines = stage(), []
    assert runner.compile_cold
    short = compile_if_it_pays(runner, 10, 40, lines.append)
    assert not short.compile and not short.measured and runner.decode_halves is runner.eager
    assert "decode runs eagerly: compiling" in lines[-1] and "(estimated)" in lines[-1], lines
    assert short.saved_s == pytest.approx(short.decode_s * (1 - compile_choice.COMPILED_SHARE))
    long = compile_if_it_pays(runner, 1e9, 40, lines.append)
    assert long.compile and "compiling its decode graphs first" in lines[-1], lines
    took = warm_up(runner, 40, lines.append)
    assert took is not None and runner.decode_halves is not runner.eager
    record_compile(runner, took, 40)
    keys = graph_keys(runner)
    kept = [compile_choice.recorded(k) for k in keys]
    assert sum(k["compile_s"] for k in kept) == pytest.approx(took, abs=0.05) and 0 < kept[0]["share"]
    again = stage()
    assert not again.compile_cold and again.compile_refused is None      # warm here now
    # a later cold choice for these graphs, in any layout holding them, uses the measured cost and share
    choice = compile_choice.choose(keys, 1e6, 1e-3)
    assert choice.measured and choice.cost_s == pytest.approx(took, abs=0.05)
    assert choice.saved_s == pytest.approx(1e6 * 1e-3 * (1 - kept[0]["share"]))
    assert not compile_choice.choose(keys + ["a graph never compiled here"], 1e6, 1e-3).measured
