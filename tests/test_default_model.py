"""The real default model (SmolLM2-135M-Instruct from its GGUF file, run in the file's own 4/8-bit
blocks) through the multi-process pipeline: a 512-token prompt, 2 and 3 stages, one cut between
the halves of a block, against one process running the same quantized modules over the whole
sequence (transformers' forward and `generate`)."""

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
QUANTIZED_TOLERANCE = 0.5   # logits; see the test


@pytest.fixture(scope="module")
def smollm2():
    from hpipe import quant

    source = models.resolve_model("smollm2")
    tokenizer = models.load_tokenizer(source.path)
    text = (models.Path(models.__file__).parent / "data" / "demo_document.md").read_text()
    prompt = tokenizer(text)["input_ids"][:512]
    assert len(prompt) == 512
    reference = models.build_full_model(source, models.load_config(source.path), weights=quant.WeightFormat("gguf"))
    return source, prompt, reference


def test_smollm2_is_what_the_issue_says(smollm2):
    source, _, _ = smollm2
    config = models.load_config(source.path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
           ("llama", 30, 576, 49152)
    assert models.num_units(config) == 62


def sliced_logits(model, prompt: list[int], output: list[int], slices: list[int]) -> torch.Tensor:
    """`reference_logits`' rows from transformers fed the prompt in these slices and then each
    generated token alone, through its own cache: what the pipeline computes, in transformers."""
    from transformers import DynamicCache

    cache, rows, at = DynamicCache(), [], 0
    with torch.no_grad():
        for n in [*slices, *[1] * (len(output) - 1)]:
            ids = (prompt + output)[at:at + n]
            logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1:]
            at += n
            if at >= len(prompt):
                rows.append(logits)
    return torch.cat(rows).float()


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
    # torch's kernels take bf16 activations and give bf16 results: logits come in steps of 2^-8 of
    # their size (0.125 at 16-32), and a float32 difference in the order of summation (KV pages,
    # slices) can round an input one bf16 step the other way (the VNNI kernels: one int16 step
    # of its block of 32). How far that goes depends on the CPU's kernels
    # (AMX or AVX-512), so the bound is measured here: transformers itself, fed the same slices and
    # then one token at a time through its own cache, differs from its one forward by some mean
    # (0.04 on an AMX Xeon); ours may differ by at most twice that. A wrong cut, page or position is
    # off by whole units on many rows (5.8 for a position off by one): the mean tells them apart.
    # The largest difference is bounded the same way: a long slice and the one forward go through
    # GEMMs on dequantized weights (each weight rounded to bf16 too), the smaller slices and decode
    # steps through the weight-only kernels (quant.dense_gemm).
    diff = (got - ref).abs()
    noise = (sliced_logits(reference, prompt, result["output_ids"], [192, 128, 96, 64, 32]) - ref).abs()
    assert float(diff.max()) < max(QUANTIZED_TOLERANCE, 2 * float(noise.max())) and \
        float(diff.mean()) < max(QUANTIZED_TOLERANCE / 10, 2 * float(noise.mean())), \
        (float(diff.max()), float(diff.mean()), float(noise.max()), float(noise.mean()))
    assert_greedy_equal(reference, prompt, result["output_ids"], reference_greedy(reference, prompt, NEW_TOKENS, 2),
                        tie=QUANTIZED_TOLERANCE)
