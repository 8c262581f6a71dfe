"""A request resumed after its pipeline was lost goes on as if nothing happened.

`Request.output_ids` carries the tokens it had generated; the scheduler rebuilds its KV by a
prefill of prompt and output, and the sampler starts where the output left it: penalties count
those tokens, a grammar has consumed them, and the draw for the next position is the one the
undisturbed run made there (`hpipe.request.position_seed`). Checked on the sampler alone (random
logits, every sampling field) and through the in-process pipeline of a small transformers model,
resumed after every k."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, assert_greedy_equal, reference_greedy
from hpipe import models
from hpipe.errors import HpipeError
from hpipe.formats import Slicing
from hpipe.request import Request, SamplingParams, position_seed
from hpipe.runtime.inprocess import run_inprocess
from hpipe.runtime.stage import StageRunner
from hpipe.sampling import CPUSampler

V = 64


def draws(params: SamplingParams, logits: torch.Tensor, prompt: list[int], output: list[int]) -> list[int]:
    """The sampler's tokens for rows len(output).. of `logits`, after `output` was generated before."""
    sampler = CPUSampler(V, max_batch=2, max_len=len(logits) + 1)
    sampler.add("s", params, prompt, output_ids=output)
    return [int(sampler.step(logits[i:i + 1], ["s"])[0]) for i in range(len(output), len(logits))]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), k=st.integers(0, 11), temperature=st.sampled_from([0.0, 0.7, 1.3]),
       top_k=st.sampled_from([0, 5]), top_p=st.sampled_from([1.0, 0.8]),
       penalties=st.sampled_from([(1.0, 0.0, 0.0), (1.3, 0.5, 0.4), (0.8, -0.5, 1.0)]))
def test_the_sampler_resumed_after_k_tokens_draws_what_the_undisturbed_run_drew(seed, k, temperature, top_k, top_p,
                                                                                 penalties):
    rep, freq, pres = penalties
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=rep,
                            frequency_penalty=freq, presence_penalty=pres, seed=seed)
    logits = torch.randn(12, V, generator=torch.Generator().manual_seed(seed % 1000)) * 3
    prompt = [1, 5, 9, 5]
    whole = draws(params, logits, prompt, [])
    assert draws(params, logits, prompt, whole[:k]) == whole[k:]


def test_a_draw_depends_on_the_seed_and_the_position_alone():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.zeros(6, V)               # uniform: each draw is the generator's alone
    first = draws(params, logits, [1], [])
    assert len(set(first)) > 1               # positions differ
    assert draws(params, logits, [1], []) == first
    assert draws(SamplingParams(temperature=1.0, seed=8), logits, [1], []) != first
    assert len({position_seed(7, p) for p in range(1000)}) == 1000


def test_a_request_resumed_past_its_length_is_refused():
    with pytest.raises(HpipeError, match="has ended"):
        Request(0, "r", (1, 2), max_new_tokens=3).resumed([4, 5, 6])
    r = Request(0, "r", (1, 2), max_new_tokens=3).resumed([4, 5])
    assert Request.from_json(r.to_json()) == r


def test_a_grammar_resumed_after_k_tokens_allows_what_it_allowed(grammar_vocab):
    """The grammar's matcher consumes the carried tokens: the resumed sequence samples under the masks
    the undisturbed one had there, and draws the same tokens."""
    from hpipe import grammar
    from hpipe.sampling import RequestSampler

    params = SamplingParams(temperature=0.9, seed=11, grammar=grammar.regex_grammar(r"(yes|no) [0-9]{2,6}!"))
    logits = torch.randn(14, grammar_vocab.vocab_size, generator=torch.Generator().manual_seed(3))

    def run(output: list[int]) -> list[int]:
        sampler = RequestSampler(grammar_vocab.vocab_size, max_batch=1, max_len=16, grammars=grammar_vocab)
        sampler.admit(Request(0, "g", (1, 2, 3), params, 14).resumed(output))
        got = []
        for i in range(len(output), 14):
            got.append(sampler.sample(logits[i:i + 1], [0])[0])
            if sampler.masks.matchers[0].is_stopped():
                break
        return got

    whole = run([])
    assert len(whole) >= 3
    for k in range(1, len(whole)):
        assert run(whole[:k]) == whole[k:], k


@pytest.fixture(scope="module")
def grammar_vocab():
    from hpipe.grammar import GrammarVocabulary

    source = models.resolve_model("smollm2")
    return GrammarVocabulary(source.path, int(models.load_config(source.path).vocab_size))


def test_the_pipeline_resumed_after_every_k_goes_on_as_the_undisturbed_run(tiny_models, reference_models):
    """A small llama through two in-process stages: greedy and seeded sampling with penalties, each
    request resumed after k = 1..n-1 of its tokens (its KV rebuilt by a prefill of prompt and output,
    sliced as any prompt) gives the same tokens; the greedy ones equal transformers' generate."""
    path = tiny_models["llama"]
    config = models.load_config(path)
    runners = [StageRunner(path, config, range(0, 3), kv_dtype="float32"), StageRunner(path, config, range(3, models.num_units(config)), kv_dtype="float32")]
    prompts = [[5, 9, 14, 3, 77, 21, 8], [40, 41, 42, 43] * 5]
    kinds = [SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.2, frequency_penalty=0.3, seed=5)]
    requests = [Request(i, f"r{i}", tuple(p), kinds[i % 2], max_new_tokens=12)
                for i, p in enumerate(prompts + prompts[::-1])]
    slicing = Slicing(lengths=(8, 4))

    def run(reqs):
        return {k: v["output_ids"] for k, v in run_inprocess(runners, reqs, slicing.slices_for, max_batch=3).items()}

    whole = run(requests)
    for r in requests:
        if r.params.greedy:
            theirs = reference_greedy(reference_models["llama"], list(r.input_ids), 12, None)
            assert_greedy_equal(reference_models["llama"], list(r.input_ids), whole[r.id], theirs)
    for k in (1, 5, 11):
        got = run([r.resumed(whole[r.id][:k]) for r in requests])
        assert got == whole, k
    assert max(max(p) for p in prompts) < VOCAB
