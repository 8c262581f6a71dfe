"""`hpipe serve` with --compile auto (the default) on a host no `hpipe warmup` ran on: the stages
serve at once, eagerly, while a child of each compiles its graphs at the lowest CPU priority; the
stages then run them (hpipe.runtime.background_compile)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_greedy_equal
from hpipe.cli import main
from test_serve import client, start_server, stop_server

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


def test_a_cold_server_compiles_its_graphs_beside_it_and_then_runs_them(talking_model, tmp_path, monkeypatch):
    """Two stages with a block cut between them (whole blocks and halves both compile). At start each
    stage says, in a quiet server's log, that it decodes eagerly while its graphs compile; a child
    process per stage compiles them at nice 19, below its stage in the process tree; each stage then
    says it runs them. Greedy answers before and after are transformers' (the graphs' sums are not
    eager's bit for bit: near-ties aside). The graphs are marked warm for the next start, and
    nothing is left running after the server stops."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))     # a host that never compiled
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", str(talking_model), "--stages", "2", "--cuts", "4", "-o", str(plan)]) == 0
    proc, base, log = start_server(tmp_path, plan, key=None, compile="auto")
    reference = AutoModelForCausalLM.from_pretrained(talking_model).eval()
    c = client(base, key=None)
    model = c.models.list().data[0].id
    prompt = list(range(40, 75))

    def greedy() -> list[int]:
        done = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        return [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens]

    try:
        eager = greedy()
        started = [line for line in log.read_text().splitlines() if "compile in the background" in line]
        assert len(started) == 2 and all("decode runs eagerly" in line for line in started), log.read_text()
        compiling = [pid for pid, cmd in descendants(proc.pid).items() if CHILD in cmd]
        assert len(compiling) == 2 and all(os.getpriority(os.PRIO_PROCESS, pid) == 19 for pid in compiling), \
            descendants(proc.pid)
        deadline = time.time() + 400
        while time.time() < deadline:
            text = log.read_text()
            if text.count("decode compiled in the background") == 2 or "failed" in text:
                break
            time.sleep(1)
        assert text.count("decode compiled in the background") == 2, text
        compiled = greedy()
        assert not [cmd for cmd in descendants(proc.pid).values() if CHILD in cmd]
    finally:
        stop_server(proc)
    assert proc.returncode in (0, 130), log.read_text()
    assert len(list((tmp_path / "inductor" / "hpipe-warm").iterdir())) >= 2     # the next start runs them
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    for tokens in (eager, compiled):
        assert_greedy_equal(reference, prompt, tokens, ids[len(prompt):])
