"""CUDA paths, selected by capability: skipped where no GPU is visible (CI has none; they run on
a lent GPU machine). Stages on a GPU against transformers on the same GPU; a GPU stage and a CPU
stage in one pipeline (gloo, staged through host memory); bfloat16."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import reference_logits
from hpipe import models
from hpipe.cli import main
from hpipe.formats import Slicing
from hpipe.runtime.inprocess import run_inprocess
from hpipe.request import Request
from hpipe.runtime.stage import StageRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

PROMPTS = [[5, 9, 11, 200, 17, 3, 44, 90] * 6, [7] * 33, [12, 13]]


def run_on(path, bounds, device, dtype):
    config = models.load_config(path)
    runners = [StageRunner(path, config, range(a, b), device=device, dtype=dtype, kv_dtype="float32") for a, b in zip(bounds, bounds[1:])]
    requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=12, eos_ids=frozenset([2]))
                for i, p in enumerate(PROMPTS)]
    return run_inprocess(runners, requests, Slicing(lengths=(16, 8)).slices_for, max_batch=2, keep_logits=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_cuda_stages_match_transformers_on_cuda(family, tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models[family]
    reference = AutoModelForCausalLM.from_pretrained(path).eval().to("cuda")
    results = run_on(path, [0, 2, 5, 10], "cuda", "float32")
    for i, p in enumerate(PROMPTS):
        r = results[f"p{i}"]
        ids = torch.tensor([p + r["output_ids"][:-1]], device="cuda")
        with torch.no_grad():
            ref = reference(ids).logits[0, len(p) - 1:].float().cpu()
        assert float((r["logits"].cpu() - ref).abs().max()) < 1e-4


def test_cuda_bfloat16_close_to_transformers_bfloat16(tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().to("cuda")
    results = run_on(path, [0, 3, 10], "cuda", "bfloat16")
    for i, p in enumerate(PROMPTS):
        r = results[f"p{i}"]
        ids = torch.tensor([p + r["output_ids"][:-1]], device="cuda")
        with torch.no_grad():
            ref = reference(ids).logits[0, len(p) - 1:].float().cpu()
        scale = float(ref.abs().max())
        assert float((r["logits"].cpu() - ref).abs().max()) < 0.05 * scale


def test_gpu_and_cpu_stages_in_one_pipeline(tiny_models, reference_models, tmp_path):
    path = tiny_models["llama"]
    plan, prompts, out, logits = (tmp_path / n for n in ("plan.json", "p.jsonl", "o.jsonl", "l.npz"))
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "3", "--cuts", "4,7", "--slices", "16,8",
                 "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["stages"][0]["device"] = "cuda:0"
    data["stages"][2]["device"] = "cuda:0"
    plan.write_text(json.dumps(data))
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    assert main(["launch", str(plan), "--local", "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "12", "--logits-out", str(logits), "--quiet"]) == 0
    saved = np.load(logits)
    for line in out.read_text().splitlines():
        r = json.loads(line)
        p = PROMPTS[int(r["id"][1:])]
        ref = reference_logits(reference_models["llama"], p, r["output_ids"])
        assert float((torch.from_numpy(saved[r["id"]]) - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cuda_graphs_match_eager(family, tiny_models):
    """Decode steps replayed from CUDA graphs (per version and padded batch size) give the eager
    path's logits and tokens."""
    path = tiny_models[family]
    config = models.load_config(path)
    outs = []
    for graphs in (False, True):
        runners = [StageRunner(path, config, range(a, b), device="cuda", kv_dtype="float32") for a, b in ((0, 5), (5, 10))]
        requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=12, eos_ids=frozenset([2]))
                    for i, p in enumerate(PROMPTS)]
        outs.append(run_inprocess(runners, requests, Slicing(lengths=(16, 8)).slices_for, max_batch=3,
                                  keep_logits=True, static=graphs, graphs=graphs))
    for rid, eager in outs[0].items():
        assert outs[1][rid]["output_ids"] == eager["output_ids"]
        assert float((outs[1][rid]["logits"] - eager["logits"]).abs().max()) < 1e-4


def test_war_hazard_writing_one_version_while_the_other_replays(tiny_models):
    """SiPipe's WAR hazard: while the graph of version v replays (a long queue of replays on the
    GPU), the CPU executor fills version 1-v for the next step. The copy stream waits for the last
    replay of the version it overwrites, so every step's output equals the eager path's."""
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.static_decode import StaticDecode

    path = tiny_models["llama"]
    config = models.load_config(path)
    n_units = models.num_units(config)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]

    def decode_all(static: bool) -> list[torch.Tensor]:
        runner = StageRunner(path, config, range(n_units), device="cuda", kv_dtype="float32")
        runner.kv.allocate(64)      # pages for every sequence: never grown (the graphs bind the pool)
        for slot, p in enumerate(prompts):        # prefill, eager
            runner.forward(runner.prepare_inputs([Segment(slot, slot, 0, len(p), True, True)]), torch.tensor(p))
        sd = StaticDecode(runner, len(prompts), graphs=True, max_len=64) if static else None
        if sd is not None:
            assert sd.capture() > 0
        outs = []
        for step in range(24):                    # alternate two groups of sequences, versions 0 and 1
            group = [0, 1] if step % 2 == 0 else [2, 3]
            segs = [Segment(s, s, len(prompts[s]) + step // 2, 1, True) for s in group]
            x = torch.tensor([(7 * step + s) % 200 + 3 for s in group])
            if sd is None:
                outs.append(runner.forward(runner.prepare_inputs(segs), x).clone())
            else:
                handle = sd.prepare(segs, step % 2)   # no host synchronisation: the GPU is still busy
                outs.append(sd.run(handle, x))
                torch.cuda._sleep(2_000_000)            # keep the GPU behind the CPU executor
        torch.cuda.synchronize()
        return outs

    eager, graphed = decode_all(False), decode_all(True)
    for a, b in zip(eager, graphed):
        assert float((a - b).abs().max()) < 1e-4
