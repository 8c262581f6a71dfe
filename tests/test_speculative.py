"""Speculative decoding (prompt lookup) against independent references: the proposer against a
brute-force search, the pipeline's logits and greedy tokens against one transformers forward
(random plans, 1-3 stages, preemption), seeded sampling against decoding without proposals, and the
distribution of sampled tokens against decoding without proposals (a chi-square test whose power
a broken verifier demonstrates)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (VOCAB, assert_greedy_equal, reference_greedy, reference_logits, save_random_model,
                      tiny_config)
from hpipe import models
from hpipe.config import Speculation
from hpipe.errors import HpipeError
from hpipe.formats import Slicing
from hpipe.request import Request, SamplingParams
from hpipe.runtime.inprocess import run_inprocess
from hpipe.runtime.speculative import NGRAM_MAX, NGRAM_MIN, NgramIndex
from hpipe.runtime.stage import StageRunner
from hpipe.sampling import RequestSampler

EOS = 2
HOT = dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.4,
           presence_penalty=0.2, logit_bias=((7, 3.0), (9, -2.0)))


def brute_force_proposal(tokens: list[int], k: int) -> list[int]:
    """The longest suffix (NGRAM_MAX down to NGRAM_MIN tokens) with an earlier occurrence that a
    token follows; what follows its latest such occurrence, at most k tokens and n - 1."""
    for n in range(min(NGRAM_MAX, len(tokens)), NGRAM_MIN - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + min(k, n - 1)]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60), cut=st.integers(0, 60), k=st.integers(1, 6))
def test_prompt_lookup_proposes_what_brute_force_finds(tokens, cut, k):
    index = NgramIndex()
    index.extend(tokens[:cut])            # in two pieces, as a prompt and then its output arrive
    index.extend(tokens[cut:])
    assert index.propose(k) == brute_force_proposal(tokens, k)


def runners_for(path, bounds):
    config = models.load_config(path)
    return [StageRunner(path, config, range(a, b), kv_dtype="float32") for a, b in zip(bounds, bounds[1:])]


def repetitive_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that repeat a phrase (as documents quoted in answers do), so proposals get accepted."""
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 9))]
        noise = [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 12))]
        out.append(noise + phrase * rng.randint(1, 4) + phrase[:rng.randint(0, len(phrase))])
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_speculative_steps_match_transformers(family, tiny_models, reference_models, data):
    """Random plans (1-3 stages, cuts anywhere), k from 1 to 6, batches of 1-3, a KV pool small
    enough to preempt or not, proposals by prompt lookup or by a draft model (the model itself, which
    proposes what it will sample, or another family's random model, which mostly misses): every
    emitted token's logits within 1e-4 of one transformers forward and greedy tokens equal to
    transformers' `generate` (mistral's window is crossed)."""
    path = tiny_models[family]
    n_units = models.num_units(models.load_config(path))
    n_stages = data.draw(st.integers(1, 3))
    cuts = sorted(data.draw(st.sets(st.integers(1, n_units - 1), min_size=n_stages - 1, max_size=n_stages - 1)))
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    prompts = repetitive_prompts(rng, data.draw(st.integers(1, 4)))
    k = data.draw(st.integers(1, 6))
    max_batch = data.draw(st.integers(1, 3))
    new = 24
    # a pool that holds the longest request and a few pages more: batches of 2-3 preempt
    small = -(-max(len(p) + new for p in prompts) // 4) + 4
    pages = data.draw(st.sampled_from([None, small]))
    proposer = data.draw(st.sampled_from(["ngram", "draft:self", "draft:other"]))
    speculation = Speculation("ngram", k) if proposer == "ngram" else \
        Speculation("draft", k, str(path if proposer == "draft:self" else tiny_models["qwen2"]))
    requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=new, eos_ids=frozenset([EOS]))
                for i, p in enumerate(prompts)]
    results = run_inprocess(runners_for(path, [0, *cuts, n_units]), requests, Slicing(count=2).slices_for,
                            max_batch=max_batch, keep_logits=True, pages=pages, page_size=4,
                            speculation=speculation)
    reference = reference_models[family]
    for r in requests:
        got = results[r.id]
        ref = reference_logits(reference, list(r.input_ids), got["output_ids"])
        assert got["logits"].shape == ref.shape
        assert float((got["logits"] - ref).abs().max()) < 1e-4, f"cuts {cuts}, k {k}"
        assert_greedy_equal(reference, list(r.input_ids), got["output_ids"],
                            reference_greedy(reference, list(r.input_ids), new, EOS))
        assert got["accepted"] <= got["proposed"]
    if proposer == "draft:self":     # the draft's own KV (catch-up, rollback, pages) is right
        assert sum(r["accepted"] for r in results.values()) >= 0.9 * sum(r["proposed"] for r in results.values())


def test_a_draft_of_the_model_itself_proposes_nothing_past_the_end(tiny_models):
    """`draft:` the model itself proposes what the model samples: every proposal is accepted, the
    answer's EOS among them, and none is proposed after it (this answer ends on its EOS at the
    first proposed token of a step: the draft went on past it, 12 proposals for 9 accepted)."""
    path = tiny_models["mistral"]
    prompt = repetitive_prompts(random.Random(3519), 1)[0]
    request = Request(0, "p0", tuple(prompt), max_new_tokens=24, eos_ids=frozenset([EOS]))
    got = run_inprocess(runners_for(path, [0, models.num_units(models.load_config(path))]), [request],
                        Slicing(count=2).slices_for, max_batch=1, page_size=4,
                        speculation=Speculation("draft", 4, str(path)))["p0"]
    assert got["output_ids"][-1] == EOS and len(got["output_ids"]) < 24       # the case it checks
    assert got["proposed"] > 0 and got["accepted"] == got["proposed"]


def test_proposals_are_accepted_and_tokens_unchanged(tiny_models):
    """On prompts that repeat themselves a greedy model quotes them: proposals are accepted (the
    test of everything else above is not vacuous), and the tokens are those without proposals."""
    path = tiny_models["llama"]
    prompts = repetitive_prompts(random.Random(3), 4)
    requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=32, eos_ids=frozenset([EOS]))
                for i, p in enumerate(prompts)]
    runs = {spec: run_inprocess(runners_for(path, [0, 4, models.num_units(models.load_config(path))]), requests,
                                Slicing(count=1).slices_for, max_batch=2, speculation=spec)
            for spec in (Speculation(), Speculation("ngram", 4))}
    plain, spec = runs.values()
    assert {i: r["output_ids"] for i, r in plain.items()} == {i: r["output_ids"] for i, r in spec.items()}
    assert sum(r["accepted"] for r in spec.values()) >= 10
    assert sum(r["proposed"] for r in plain.values()) == 0


def test_a_draft_model_proposes_its_own_greedy_continuation(tiny_models, tmp_path):
    """The draft proposes exactly what it would generate greedily (transformers' `generate` on the
    draft, from the sequence's tokens so far), k at a time, through its own paged KV across
    steps, rejections and a pool too small for every sequence (which then gets no proposals)."""
    from transformers import AutoModelForCausalLM

    from hpipe.runtime.draft import DraftProposer
    from hpipe.runtime.sequence import Sequence

    draft_path = tiny_models["qwen2"]
    reference = AutoModelForCausalLM.from_pretrained(draft_path).eval()
    proposer = DraftProposer(Speculation("draft", 3, str(draft_path)), VOCAB, "cpu", "float32", 21, 4, "float32")
    rng = random.Random(9)
    seqs = [Sequence(Request(i, f"p{i}", tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(18, 26)))), 0.0)
            for i in range(3)]
    full = 0
    for step in range(6):
        wants = [(s, rng.randint(1, 3)) for s in seqs]
        got = proposer.propose(wants)
        for (seq, n), draft in zip(wants, got):
            if not draft:       # the pool (80 tokens) is full: no proposals, its pages back
                full += 1
                assert seq.index not in proposer.held
                continue
            assert draft == reference_greedy(reference, seq.known_tokens, n, None), (step, seq.index)
            # the target accepts some of it, then samples another token (or accepts all and adds one)
            taken = draft[:rng.randint(0, n)]
            seq.output += taken + [(draft[len(taken)] + 1) % VOCAB if len(taken) < n else rng.randrange(VOCAB)]
    assert full > 0, "the pool never ran out: the test misses that path"
    for seq in seqs:
        proposer.forget(seq.index)
    assert proposer.pool.available == proposer.pool.usable
    with pytest.raises(HpipeError, match="vocabulary"):
        DraftProposer(Speculation("draft", 3, str(draft_path)), VOCAB + 1, "cpu", "float32", 21, 4, "float32")
    for bad in ("draft", "draft:", "draft:m:0", "ngram:x", "eagle:3"):
        with pytest.raises(HpipeError, match="--speculative"):
            Speculation.parse(bad)
    assert Speculation.parse("draft:/m/a:b.gguf") == Speculation("draft", 4, "/m/a:b.gguf")
    assert Speculation.parse("draft:smollm2:2") == Speculation("draft", 2, "smollm2")


def test_seeded_sampling_is_unchanged_by_speculation(tiny_models):
    """Every sampled token is drawn as without proposals (the same draws of the request's
    generator, the penalties' counts as of its position, logit_bias): the same seed gives the same
    text, with temperature, top-k, top-p, every penalty and logit_bias; and opting out works."""
    path = tiny_models["llama"]
    prompts = repetitive_prompts(random.Random(4), 6)
    warm = dict(temperature=0.3, top_p=0.9, repetition_penalty=1.05, logit_bias=((7, 1.0),))   # quotes: accepted
    # seeds whose draws accept some proposals (each position's draw is its seed's: hpipe.request.position_seed)
    requests = [Request(i, f"p{i}", tuple(p), SamplingParams(**(HOT if i % 2 else warm), seed=60 + i,
                                                             speculative=i != 5),
                        max_new_tokens=24, eos_ids=frozenset([EOS])) for i, p in enumerate(prompts)]
    n_units = models.num_units(models.load_config(path))
    runs = [run_inprocess(runners_for(path, [0, 5, n_units]), requests, Slicing(count=2).slices_for, max_batch=2,
                          speculation=spec) for spec in (Speculation(), Speculation("ngram", 3))]
    assert {i: r["output_ids"] for i, r in runs[0].items()} == {i: r["output_ids"] for i, r in runs[1].items()}
    assert sum(r["accepted"] for r in runs[1].values()) > 0
    assert runs[1]["p5"]["proposed"] == 0, "a request that opts out gets no proposals"


# --------------------------------------------------------------------- the sampled distribution
def small_vocab_model(directory, vocab: int = 6, seed: int = 11):
    config = tiny_config("llama")
    config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id = vocab, 0, 0, 0
    return save_random_model(config, directory, seed=seed, std=0.3)


def sampled_pairs(path, seeds, speculation, params) -> list[tuple[int, int]]:
    """The 2nd and 3rd sampled tokens of a repetitive prompt, one request per seed: the 2nd is
    sampled where a proposal may be verified, the 3rd after an accepted one. With proposals each
    request runs alone (a micro-batch of several carries none); without, 32 at a time (a request's
    draws are its own generator's: the arm's distribution is the same, at a third of the time)."""
    prompt = every_pair(6)                         # every 2-token suffix occurred: every step proposes
    requests = [Request(i, f"s{s}", prompt, SamplingParams(**params, seed=s), max_new_tokens=3)
                for i, s in enumerate(seeds)]
    n_units = models.num_units(models.load_config(path))
    out = run_inprocess(runners_for(path, [0, n_units]), requests, Slicing(count=1).slices_for,
                        max_batch=1 if speculation.on else 32, speculation=speculation)
    return [tuple(out[r.id]["output_ids"][1:3]) for r in requests]


def every_pair(vocab: int) -> tuple[int, ...]:
    """Tokens in which every pair of the vocabulary's tokens occurs, in order (a de Bruijn sequence
    of order 2: the Lyndon words a and a b, b > a, in order; its cycle opened): a proposal needs a
    2-token suffix seen before."""
    cycle = [x for a in range(vocab) for x in [a] + [y for b in range(a + 1, vocab) for y in (a, b)]]
    assert len({(x, y) for x, y in zip(cycle, cycle[1:] + cycle[:1])}) == vocab * vocab, cycle
    return tuple(cycle + cycle[:1])


def homogeneity_p(a: list, b: list) -> float:
    """Chi-square test that two samples come from one distribution (cells with fewer than 10
    observations in both samples pooled into one)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    cells = sorted(set(ca) | set(cb))
    big = [c for c in cells if ca[c] + cb[c] >= 10]
    rest = [c for c in cells if c not in big]
    table = [[ca[c] for c in big] + [sum(ca[c] for c in rest)], [cb[c] for c in big] + [sum(cb[c] for c in rest)]]
    table = [row[:-1] for row in table] if not rest else table
    return float(chi2_contingency(table).pvalue)


@pytest.mark.parametrize("params,proposer", [(dict(temperature=1.0), "ngram"),
                                             (dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3,
                                                   presence_penalty=0.5, logit_bias=((4, 1.5),)), "ngram"),
                                             (dict(temperature=1.0), "draft")])
def test_sampled_distribution_is_the_models(params, proposer, tmp_path, monkeypatch):
    """Over 1,500 seeds per arm (disjoint seeds), the pair of tokens sampled after the first has
    the same distribution with proposals as without (chi-square homogeneity, 5 % level). Its power:
    a verifier that accepts every proposal it is shown (a common bug: no sampling at the proposed
    positions) shifts this distribution, and the same test, on a quarter of the same seeds, rejects it."""
    path = small_vocab_model(tmp_path / "m")
    # the draft: another random model of the vocabulary, whose greedy proposals the model often samples
    speculation = Speculation("ngram", 2) if proposer == "ngram" else \
        Speculation("draft", 2, str(small_vocab_model(tmp_path / "d", seed=12)))
    n = 1500
    plain = sampled_pairs(path, range(n), Speculation(), params)
    spec = sampled_pairs(path, range(n, 2 * n), speculation, params)
    assert homogeneity_p(plain, spec) > 0.05

    def accept_every_proposal(self, logits, seqs, expected=None):
        self._start(seqs)
        out = []
        for r, s in enumerate(seqs):
            taken = expected is not None and expected[r] >= 0
            out.append(expected[r] if taken else self._step(logits[r:r + 1], [s])[0])
        return out
    monkeypatch.setattr(RequestSampler, "sample", accept_every_proposal)
    # a quarter of the seeds: at 800 it was rejected at p < 1e-67 in every case
    broken = sampled_pairs(path, range(n, n + n // 4), speculation, params)
    assert homogeneity_p(plain, broken) < 1e-3, "the test would miss a verifier that accepts every proposal"


def test_a_micro_batch_of_several_sequences_carries_no_proposals(tiny_models, monkeypatch):
    """SPEC_SEQUENCES: a micro-batch of several sequences decodes without proposals (their rows would
    be packed and run eagerly: 0.46-0.56x the tokens a second at batch 8), while a sequence decoding
    alone (here the longest request, once the others are done) still gets them."""
    from hpipe.runtime.scheduler import Scheduler

    seen = []
    proposals = Scheduler._proposals

    def spy(self, ready, decoding):
        drafts = proposals(self, ready, decoding)
        seen.append((len(ready), sum(map(len, drafts))))
        return drafts
    monkeypatch.setattr(Scheduler, "_proposals", spy)
    path = tiny_models["llama"]
    requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=12 + 12 * i, eos_ids=frozenset())
                for i, p in enumerate(repetitive_prompts(random.Random(9), 3))]
    n_units = models.num_units(models.load_config(path))
    run_inprocess(runners_for(path, [0, n_units]), requests, Slicing(count=1).slices_for, max_batch=3,
                  speculation=Speculation("ngram", 3))
    assert any(rows > 1 for rows, _ in seen) and all(n == 0 for rows, n in seen if rows > 1), seen
    assert sum(n for rows, n in seen if rows == 1) > 0, seen


# --------------------------------------------------------------------- the distributed runtime
@pytest.mark.slow
@pytest.mark.parametrize("n_stages,sampling", [(2, "inline"), (3, "cpu")])
def test_launch_with_speculation_gives_the_tokens_without(n_stages, sampling, tiny_models, reference_models,
                                                          tmp_path):
    """`hpipe launch --local` on 2 and 3 stages (inline sampling; the sampler process pool), as many
    sequences at once as stages (a micro-batch of one each: SPEC_SEQUENCES), proposals
    by prompt lookup and by a draft model (the model itself): greedy prompts give
    transformers' logits and tokens, seeded prompts with every penalty the tokens of the same launch
    without proposals; the run summary counts what was proposed and accepted."""
    import json

    from hpipe.cli import main
    from test_launch_local import read_results

    path, reference = tiny_models["llama"], reference_models["llama"]
    prompts = repetitive_prompts(random.Random(f"launch{n_stages}"), 6)
    lines = [{"id": f"p{i}", "input_ids": p, "sampling": {**({"temperature": 0} if i % 2 == 0 else
                                                            {**HOT, "logit_bias": {"7": 3.0}, "seed": i})}}
             for i, p in enumerate(prompts)]
    prompts_file, plan, logits = tmp_path / "p.jsonl", tmp_path / "plan.json", tmp_path / "l.npz"
    prompts_file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", str(n_stages), "--slices", "9,5", "-o", str(plan)]) == 0
    runs, summaries = {}, {}
    for spec in ("off", "ngram:3", f"draft:{path}:3"):
        out = tmp_path / f"{spec.split(':')[0]}.jsonl"
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", "20", "--max-batch", str(n_stages), "--sampling", sampling, "--speculative", spec,
                     "--quiet"] + (["--logits-out", str(logits)] if spec != "off" else [])) == 0
        runs[spec] = {k: v["output_ids"] for k, v in read_results(out).items()}
        summaries[spec] = json.loads(out.with_name(out.name + ".summary.json").read_text())["run"]
    assert runs["off"] == runs["ngram:3"] == runs[f"draft:{path}:3"]
    for spec in ("ngram:3", f"draft:{path}:3"):
        summary = summaries[spec]
        assert 0 < summary["spec_accepted_tokens"] <= summary["spec_proposed_tokens"], spec
    # a draft equal to the model proposes what greedy requests take (the sampled half accepts less)
    draft = summaries[f"draft:{path}:3"]
    assert draft["spec_accepted_tokens"] >= 0.3 * draft["spec_proposed_tokens"]
    saved = np.load(logits)
    for i, p in enumerate(prompts):
        if i % 2 == 0:
            out = runs["ngram:3"][f"p{i}"]
            ref = reference_logits(reference, p, out)
            assert float((torch.from_numpy(saved[f"p{i}"]) - ref).abs().max()) < 1e-4
            assert_greedy_equal(reference, p, out, reference_greedy(reference, p, 20, EOS))


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram:4", "draft"])
def test_serve_streams_speculated_tokens(proposer, talking_model, tmp_path):
    """`hpipe serve --speculative ngram` (and a draft model: the model itself) on 3 stages with the
    real openai client: each request gives
    the text (and the log-probabilities, against transformers) it gives when it opts out
    (`"speculative": false`), streamed or not; a stop string and max_tokens cut inside an accepted
    run; n = 2 seeded choices; structured output parses; /metrics counts the accepted proposals."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpipe.cli import main
    from serving import stop_serve
    from test_serve import client, metric, start_server

    plan = tmp_path / "plan.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(talking_model), "--stages", "3", "-o", str(plan)]) == 0
    spec = proposer if proposer != "draft" else f"draft:{talking_model}:3"
    proc, base, log = start_server(tmp_path, plan, "--speculative", spec, "--sampling", "cpu", key=None)
    try:
        c = client(base, key=None)
        model = c.models.list().data[0].id
        prompt = "the cat sat on the mat and the dog sat on the log. " * 4 + "the cat"
        off = {"speculative": False}

        def complete(extra=None, **kw):
            return c.completions.create(model=model, prompt=prompt, extra_body=extra,
                                        **{"max_tokens": 24, "temperature": 0, **kw})
        ids_out = {"return_tokens_as_token_ids": True}
        plain, spec = complete({**off, **ids_out}, logprobs=2), complete(ids_out, logprobs=2)
        assert spec.choices[0].text == plain.choices[0].text
        assert spec.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
        streamed = "".join(ch.text for ev in complete(stream=True) for ch in ev.choices)
        assert streamed == plain.choices[0].text
        # the log-probabilities of every emitted token, against one transformers forward
        tokenizer = AutoTokenizer.from_pretrained(talking_model)
        reference = AutoModelForCausalLM.from_pretrained(talking_model).eval()
        ids = tokenizer(prompt)["input_ids"]
        out = [int(x.removeprefix("token_id:")) for x in spec.choices[0].logprobs.tokens]
        lp = spec.choices[0].logprobs.token_logprobs
        with torch.no_grad():
            ref = torch.log_softmax(reference(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:], -1)
        assert len(out) == len(lp) == 24
        assert all(abs(a - float(ref[i, t])) < 1e-4 for i, (a, t) in enumerate(zip(lp, out)))
        text = plain.choices[0].text
        stop = text[6:10]            # a stop string inside the text: it ends before it
        cut = complete(stop=[stop]).choices[0]
        assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop"
        short = complete(max_tokens=5).choices[0]
        assert short.finish_reason == "length" and text.startswith(short.text)
        hot = dict(temperature=0.9, top_p=0.95, seed=7, n=2, max_tokens=16)
        assert [ch.text for ch in complete(off, **hot).choices] == [ch.text for ch in complete(**hot).choices]
        chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=40,
                                         response_format={"type": "json_object"}, temperature=0)
        if chat.choices[0].finish_reason == "stop":
            json.loads(chat.choices[0].message.content)
        assert metric(base, "hpipe_spec_accepted_tokens_total") > 0
        assert metric(base, "hpipe_spec_proposed_tokens_total") >= metric(base, "hpipe_spec_accepted_tokens_total")
    finally:
        stop_serve(proc)
    assert proc.returncode in (0, 130), log.read_text()


# --------------------------------------------------------------------- the planner's prediction
@pytest.mark.parametrize("k_max,alpha", [(4, 0.3), (4, 0.8), (8, 0.55), (1, 0.5)])
def test_predicted_proposals_follow_the_runtimes_adaptive_k(k_max, alpha):
    """The planner's chain against a simulation of the runtime's own rule (`next_k`) with every
    proposal accepted with probability alpha after accepted ones: the rate it reports maps back to
    alpha, and the proposals and tokens per step match the simulation's."""
    from hpipe.planner.speculative import adaptive_proposals
    from hpipe.runtime.speculative import next_k

    rng = random.Random(1)
    k, proposed, accepted, steps = k_max, 0, 0, 200_000
    for _ in range(steps):
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        proposed, accepted = proposed + k, accepted + a
        k = next_k(k, k, a, k_max)
    chain = adaptive_proposals(k_max, accepted / proposed)
    if k_max > 1:     # with K = 1 the rate is alpha itself, whatever the chain
        assert abs(chain["alpha"] - alpha) < 0.01
    assert abs(chain["proposed_per_step"] - proposed / steps) < 0.02 * k_max
    assert abs(chain["tokens_per_step"] - (1 + accepted / steps)) < 0.02 * k_max


def test_plan_predicts_decode_with_speculation(tmp_path):
    """`hpipe plan --speculative ngram:4 --acceptance A` adds the prediction to the plan: tokens per
    step from the chain, the stages' steps from the profile's decode table at that many rows (more
    rows cost more, fewer trips), and the two options only together."""
    import json

    from hpipe.cli import main

    prof = Path(__file__).resolve().parents[1] / "profiles" / "smollm2-cpu-1thread-quick.json"
    out = tmp_path / "plan.json"
    base = ["plan", "--profile", str(prof), "--seq-len", "256", "--stages", "2", "-o", str(out)]
    assert main(base + ["--speculative", "ngram:4", "--acceptance", "0.6"]) == 0
    dec = json.loads(out.read_text())["predicted"]["decode"]
    sp = dec["speculative"]
    assert sp["acceptance"] == 0.6 and 1 < sp["tokens_per_step"] <= 1 + 0.6 * sp["proposed_per_step"] + 1e-9
    assert all(a > b for a, b in zip(sp["stage_step_s"], dec["stage_step_s"]))
    assert sp["tokens_per_s"] == pytest.approx(sp["tokens_per_step"] / sp["round_s"])
    assert main(base + ["--acceptance", "0.6"]) == 2
    assert main(base + ["--speculative", "ngram:4", "--acceptance", "2"]) == 2
