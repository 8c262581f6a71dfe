"""The real default model (SmolLM2-135M-Instruct from its GGUF file) through the multi-process
pipeline: a 512-token prompt, 2 and 3 stages, one cut between the halves of a block."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_greedy_equal, reference_greedy, reference_logits
from hpipe import models
from hpipe.cli import main

pytestmark = pytest.mark.slow
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    source = models.resolve_model("smollm2")
    tokenizer = models.load_tokenizer(source.path)
    text = (models.Path(models.__file__).parent / "data" / "demo_document.md").read_text()
    prompt = tokenizer(text)["input_ids"][:512]
    assert len(prompt) == 512
    reference = AutoModelForCausalLM.from_pretrained(str(source.path)).eval()
    return source, prompt, reference


def test_smollm2_is_what_the_issue_says(smollm2):
    source, _, _ = smollm2
    config = models.load_config(source.path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
           ("llama", 30, 576, 49152)
    assert models.num_units(config) == 62


@pytest.mark.parametrize("stages,cuts", [(2, None), (3, "20,41")])
def test_smollm2_pipeline_matches_transformers(smollm2, tmp_path, stages, cuts):
    source, prompt, reference = smollm2
    plan, prompts, out, logits = (tmp_path / n for n in ("plan.json", "p.jsonl", "o.jsonl", "l.npz"))
    argv = ["plan", "--model", "smollm2", "--stages", str(stages), "--slices", "192,128,96,64,32", "-o", str(plan)]
    if cuts:
        argv += ["--cuts", cuts]  # unit 20 = block 9's MLP half: a cut inside block 9
    assert main(argv) == 0
    prompts.write_text(json.dumps({"id": "doc", "input_ids": prompt}) + "\n")
    assert main(["launch", str(plan), "--local", "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", str(NEW_TOKENS), "--logits-out", str(logits), "--quiet"]) == 0
    result = json.loads(out.read_text())
    got = torch.from_numpy(np.load(logits)["doc"])
    ref = reference_logits(reference, prompt, result["output_ids"])
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) < 1e-4
    assert_greedy_equal(reference, prompt, result["output_ids"], reference_greedy(reference, prompt, NEW_TOKENS, 2))
