"""The pipeline's numbers are transformers' numbers: random plans (1-4 stages, cuts anywhere
including between the halves of a block, random token slicings, batches of prompts of different
lengths) give logits within 1e-4 of one single-process transformers forward, and greedy tokens
equal to transformers' `generate`.

These run every stage in one process (`hpipe.runtime.inprocess`: the same scheduler, stage and
KV-cache code as the distributed runtime) so that hypothesis can try many plans; the distributed
runtime is checked against the same reference in test_launch_local.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FAMILIES, VOCAB, assert_greedy_equal, reference_greedy, reference_logits
from hpipe import models
from hpipe.formats import Slicing
from hpipe.runtime.inprocess import run_inprocess
from hpipe.request import Request
from hpipe.runtime.stage import StageRunner

NEW_TOKENS = 16
EOS = 2


@st.composite
def random_plans(draw, n_units: int):
    n_stages = draw(st.integers(1, 4))
    cuts = sorted(draw(st.sets(st.integers(1, n_units - 1), min_size=n_stages - 1, max_size=n_stages - 1)))
    if draw(st.booleans()):
        slicing = Slicing(lengths=tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))))
    else:
        slicing = Slicing(count=draw(st.integers(1, 6)), granularity=draw(st.sampled_from([1, 4, 16])))
    prompts = draw(st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=90), min_size=1, max_size=4))
    max_batch = draw(st.integers(1, 4))
    return [0, *cuts, n_units], slicing, prompts, max_batch


def check_against_reference(path, reference, bounds, slicing, prompts, max_batch, attn="sdpa", static_decode=False,
                            policy=None, pages=None, page_size=16, device="cpu", host_experts=None):
    config = models.load_config(path)
    runners = [StageRunner(path, config, range(a, b), attn_implementation=attn, device=device, host_experts=n, kv_dtype="float32")
               for a, b, n in zip(bounds, bounds[1:], host_experts or [0] * len(bounds))]
    requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=NEW_TOKENS, eos_ids=frozenset([EOS]))
                for i, p in enumerate(prompts)]
    results = run_inprocess(runners, requests, slicing.slices_for, max_batch=max_batch, keep_logits=True,
                            static=static_decode, policy=policy, pages=pages, page_size=page_size)
    assert set(results) == {r.id for r in requests}
    for r in requests:
        got = results[r.id]
        out = got["output_ids"]
        ref = reference_logits(reference, list(r.input_ids), out)
        assert got["logits"].shape == ref.shape
        diff = float((got["logits"] - ref).abs().max())
        assert diff < 1e-4, f"{r.id}: logits differ by {diff} (plan {bounds}, {slicing})"
        theirs = reference_greedy(reference, list(r.input_ids), NEW_TOKENS, EOS)
        assert_greedy_equal(reference, list(r.input_ids), out, theirs)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_random_plans_match_transformers(family, tiny_models, reference_models, data, device):
    path = tiny_models[family]
    bounds, slicing, prompts, max_batch = data.draw(random_plans(models.num_units(models.load_config(path))))
    check_against_reference(path, reference_models[family], bounds, slicing, prompts, max_batch, device=device)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_static_decode_matches_transformers(family, tiny_models, reference_models, data, device):
    """The static-shape decode step (the CUDA-graph path, run eagerly here): padded batches, whole
    KV slots read under a mask, inputs in two alternating versions of persistent buffers."""
    path = tiny_models[family]
    bounds, slicing, prompts, max_batch = data.draw(random_plans(models.num_units(models.load_config(path))))
    check_against_reference(path, reference_models[family], bounds, slicing, prompts, max_batch, static_decode=True,
                            device=device)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_policies_and_a_small_kv_pool_match_transformers(family, tiny_models, reference_models, data, device):
    """Continuous batching under either policy, with a KV pool from one sequence's worth up:
    sequences are preempted and recomputed, and every token and logit is still transformers'."""
    from hpipe.runtime.scheduler import Policy
    path = tiny_models[family]
    bounds, slicing, prompts, max_batch = data.draw(random_plans(models.num_units(models.load_config(path))))
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    budget = data.draw(st.integers(1, 64))
    policy = Policy(data.draw(st.sampled_from(["throttle", "sarathi"])), min_prefill=1, max_prefill=budget,
                    budget=budget)
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    pages = -(-longest // page_size) + 1 + data.draw(st.integers(0, 3))
    check_against_reference(path, reference_models[family], bounds, slicing, prompts, max_batch, policy=policy,
                            pages=pages, page_size=page_size, static_decode=data.draw(st.booleans()), device=device)


def test_static_decode_crosses_the_sliding_window(tiny_models, reference_models, device):
    path = tiny_models["mistral"]
    check_against_reference(path, reference_models["mistral"], [0, 5, 10], Slicing(lengths=(8,)),
                            [list(range(3, 20)), list(range(40, 43)), [9] * 13], max_batch=3, static_decode=True,
                            device=device)


def test_mid_block_cuts_and_eager_attention(tiny_models, reference_models):
    path = tiny_models["llama"]
    # units: 0 embed, 1/2 block0 attn/mlp, ..., 9 head; cuts at 2, 5, 8 fall inside blocks 0 and 3
    check_against_reference(path, reference_models["llama"], [0, 2, 5, 8, 10], Slicing(lengths=(7, 5, 3)),
                            [[5, 9, 11, 200, 17, 3, 44, 90, 91, 92, 93, 94, 95, 96, 97, 98], [7] * 33, [12]],
                            max_batch=3, attn="eager")


def test_sliding_window_is_crossed(tiny_models, reference_models):
    """Mistral's window is 24 tokens here: an 80-token prompt in slices must honour it."""
    path = tiny_models["mistral"]
    check_against_reference(path, reference_models["mistral"], [0, 4, 10], Slicing(lengths=(32, 16, 8)),
                            [list(range(3, 83))], max_batch=1)


def test_stage_loads_only_its_units(tiny_models):
    import torch

    path = tiny_models["llama"]
    config = models.load_config(path)
    runner = StageRunner(path, config, range(4, 7), kv_dtype="float32")  # block 1 mlp, block 2 attn + mlp
    real = {n for n, p in runner.model.named_parameters() if not p.is_meta}
    assert real and all(n.startswith(("model.layers.1.post_attention_layernorm", "model.layers.1.mlp",
                                      "model.layers.2.")) for n in real), sorted(real)
    assert runner.model.get_submodule("model.embed_tokens").weight.is_meta
    assert runner.model.get_submodule("lm_head").weight.is_meta
    total = sum(p.numel() for p in runner.model.parameters() if not p.is_meta)
    expected = sum(p.numel() for n, p in torch.nn.Module.named_parameters(runner.model) if n in real)
    assert total == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_call_transformers_modules_without_deprecated_arguments(family, tiny_models):
    """transformers warns (once per call site, then removes the argument) when a module is called the
    old way: a stage must pass what the installed transformers' modules take, eager and static."""
    import warnings

    path = tiny_models[family]
    config = models.load_config(path)
    n = models.num_units(config)
    runners = [StageRunner(path, config, range(a, b), kv_dtype="float32") for a, b in ((0, n // 2), (n // 2, n))]
    requests = [Request(0, "p0", tuple(range(3, 20)), max_new_tokens=4, eos_ids=frozenset([EOS]))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for static in (False, True):
            run_inprocess(runners, requests, Slicing(lengths=(8,)).slices_for, max_batch=1, static=static)
