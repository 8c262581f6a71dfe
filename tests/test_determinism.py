"""`--deterministic on`: one answer per request. The same request, greedy or seeded, gives the same
tokens and bit-identical logits alone, among 7 random others (at every position in the batch; the
default model at the first, a middle and the last),
after its prefix was cached, after a preemption, sliced by another policy, on 2 and 3 stages, and
under the runtime's switches; on the default model's GGUF file kept quantized and on a float32
model. The reference is the request alone, compared with `torch.equal` (no tolerance)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from conftest import VOCAB
from hpipe import models, quant
from hpipe.cli import main
from hpipe.formats import Slicing
from hpipe.request import Request, SamplingParams
from hpipe.runtime.inprocess import run_inprocess
from hpipe.runtime.scheduler import Policy
from hpipe.runtime.stage import StageRunner

NEW = 24


def request(i: int, prompt: list[int], sampled: bool) -> Request:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7) if sampled else SamplingParams(temperature=0.0)
    return Request(i, f"p{i}", tuple(prompt), max_new_tokens=NEW, eos_ids=frozenset(), params=params)


class Case:
    """One model, one target request, and the ways to run it."""

    def __init__(self, source, weights, vocab: int, seed: str, length: int, positions=range(8)):
        """positions: where the target goes among the 7 others (each a run of all 8 prompts)."""
        self.source, self.weights, self.positions = source, weights, positions
        self.config = models.load_config(source.path if hasattr(source, "path") else source)
        self.units = models.num_units(self.config)
        rng = random.Random(seed)
        self.target = [rng.randrange(3, vocab) for _ in range(length)]
        # others up to the target's length, still sliced (96, 48) around it: up to twice its length took
        # the default model's case ~1.6x the CPU (97.9 against 59.1 s)
        self.others = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, length))] for _ in range(7)]

    def run(self, prompts, target: int, sampled: bool, cuts=(), **kw) -> dict:
        bounds = [0, *cuts, self.units]
        runners = [StageRunner(self.source, self.config, range(a, b), weights=self.weights, deterministic=True)
                   for a, b in zip(bounds, bounds[1:])]
        requests = [request(i, p, sampled and i == target) for i, p in enumerate(prompts)]
        kw.setdefault("max_batch", 8)
        out = run_inprocess(runners, requests, Slicing(lengths=(96, 48)).slices_for, keep_logits=True, **kw)
        return out[f"p{target}"]

    def variants(self, sampled: bool):
        t, others = self.target, self.others
        with_others = others[:3] + [t] + others[3:]
        longest = max(len(p) for p in with_others) + NEW
        yield "alone", self.run([t], 0, sampled)
        for k in self.positions:
            yield f"among 7, position {k}", self.run(others[:k] + [t] + others[k:], k, sampled)
        yield "3 stages", self.run([t], 0, sampled, cuts=(self.units // 3, 2 * self.units // 3))
        yield "mid-block cuts, 4 stages", self.run([t], 0, sampled, cuts=(4, 7, self.units - 3))
        yield "prefix cached", self.run([t, t], 1, sampled, max_batch=1, prefix_caching="on")
        yield "preempted", self.run(with_others, 3, sampled, pages=2 + 2 * -(-longest // 16))
        yield "sarathi, 40 tokens a step", self.run(with_others, 3, sampled, policy=Policy(
            "sarathi", min_prefill=1, max_prefill=40, budget=40))


@pytest.fixture(scope="module")
def default_model():
    # first, a middle and last place in the batch: each run of the 8 prompts takes ~9 s here, and the
    # float32 models take every place
    return Case(models.resolve_model("smollm2"), quant.WeightFormat("gguf"), 49152, "det-gguf", 230,
                positions=(0, 3, 7))


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def float_model(tiny_models, request):
    """float32 models; Mistral's 24-token sliding window is crossed by pieces and by single rows."""
    return Case(tiny_models[request.param], None, VOCAB, f"det-float-{request.param}", 100)


def check_variants(case: Case, sampled: bool) -> None:
    runs = dict(case.variants(sampled))
    alone = runs.pop("alone")
    assert len(alone["output_ids"]) == NEW
    for name, r in runs.items():
        assert r["output_ids"] == alone["output_ids"], f"{name}: tokens differ"
        assert torch.equal(r["logits"], alone["logits"]), \
            f"{name}: logits differ by up to {float((r['logits'] - alone['logits']).abs().max())}"


@pytest.mark.slow
def test_the_default_models_answer_does_not_depend_on_the_rest(default_model):
    check_variants(default_model, sampled=False)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_float32_models_answer_does_not_depend_on_the_rest(float_model, sampled):
    """Greedy and seeded (the seeded draws are the same when the logits are: `hpipe.sampling`)."""
    check_variants(float_model, sampled)


def test_prompt_pieces_fall_on_the_grid_and_generated_tokens_go_alone():
    from hpipe.runtime import invariant
    from hpipe.runtime.pages import Segment

    # a recomputed sequence: prompt 150 tokens, 10 generated, from position 64 (a cached head)
    seg = Segment(0, 0, 64, 96, True, True, prompt=150)
    pieces = invariant.pieces_for([seg], "rows", None, 64, "cpu")
    assert [(p.q0 + 64, p.q1 + 64, p.k1) for p in pieces][:2] == [(64, 128, 128), (128, 150, 150)]
    assert [(p.q0 + 64, p.k1, p.mask) for p in pieces[2:]] == [(p, p + 1, None) for p in range(150, 160)]
    assert invariant.row_paths([seg], None, "cpu").dense is None      # 150 < DENSE_PROMPT: the kernel
    n = quant.DENSE_PROMPT + 3
    long = Segment(0, 0, 0, n + 5, True, True, prompt=n)              # n prompt rows dense, 5 generated
    paths = invariant.row_paths([long], None, "cpu")
    assert paths.dense.tolist() == list(range(n)) and paths.kernel.tolist() == list(range(n, n + 5))


def test_a_model_or_settings_it_cannot_serve_are_refused_in_one_line(tiny_models):
    from hpipe.runtime import invariant

    llama, gpt2 = (models.load_config(tiny_models[f]) for f in ("llama", "gpt2"))
    assert invariant.resolve("on", llama, 16, 64) and not invariant.resolve("off", gpt2, 16, 64)
    with pytest.raises(Exception, match="llama-like"):
        invariant.resolve("on", gpt2, 16, 64)
    with pytest.raises(Exception, match="--page-size"):
        invariant.resolve("on", llama, 16, 12)


@pytest.mark.slow
def test_switches_and_stages_keep_a_requests_tokens_and_logits(tmp_path):
    """`hpipe launch --deterministic on` on the default model, a greedy target among 7 others (one
    of them seeded): the switches on 2 stages (every pair of their values, and all on), and 3 stages,
    bit for bit; the seeded request's text is its text alone."""
    rng = random.Random("det-launch")
    target = [rng.randrange(3, 49152) for _ in range(200)]
    seeded = {"id": "seeded", "input_ids": target[:150], "sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 11}}
    lines = [{"id": "target", "input_ids": target, "sampling": {"temperature": 0}}]
    lines += [{"id": f"o{i}", "input_ids": [rng.randrange(3, 49152) for _ in range(rng.randint(5, 300))]}
              for i in range(6)] + [seeded]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    alone, seeded_alone = tmp_path / "target-prompt.jsonl", tmp_path / "seeded-prompt.jsonl"
    alone.write_text(json.dumps(lines[0]) + "\n")
    seeded_alone.write_text(json.dumps(seeded) + "\n")
    plans = {}
    for stages in (2, 3):
        plans[stages] = tmp_path / f"plan{stages}.json"
        assert main(["plan", "--model", "smollm2", "--stages", str(stages), "-o", str(plans[stages])]) == 0
    variants = {"alone": (2, alone, []), "seeded alone": (2, seeded_alone, []), "3 stages": (3, prompts, [])}
    # an orthogonal array of the three switches (each pair of two switches' values once) and all on:
    # 5 launches of ~13 s instead of 8; all eight combinations run in test_launch_local.py
    for tsem, sat, sampling in ((False, False, "inline"), (False, True, "cpu"), (True, False, "cpu"),
                                (True, True, "inline"), (True, True, "cpu")):
        name = f"tsem {'on' if tsem else 'off'}, sat {'on' if sat else 'off'}, sampling {sampling}"
        variants[name] = (2, prompts, [*([] if tsem else ["--no-tsem"]), *([] if sat else ["--no-sat"]),
                                       "--sampling", sampling])
    runs = {}
    for name, (stages, source, extra) in variants.items():
        stem = name.replace(" ", "-").replace(",", "")
        out, logits = tmp_path / f"{stem}.jsonl", tmp_path / f"{stem}.npz"
        assert main(["launch", str(plans[stages]), "--local", "--prompts", str(source), "--out", str(out),
                     "--max-new-tokens", "16", "--logits-out", str(logits), "--deterministic", "on", "--quiet",
                     *extra]) == 0
        tokens = {r["id"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
        runs[name] = (tokens, np.load(logits))
        summary = json.loads(out.with_name(out.name + ".summary.json").read_text())["run"]
        assert summary["options"]["deterministic"] is True
    reference, seeded_reference = runs.pop("alone"), runs.pop("seeded alone")[0]["seeded"]
    for name, (tokens, rows) in runs.items():
        assert tokens["target"] == reference[0]["target"], name
        assert np.array_equal(rows["target"], reference[1]["target"]), name
        assert tokens["seeded"] == seeded_reference, f"{name}: the seeded request's text"
