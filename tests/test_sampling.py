"""hpipe.sampling.CPUSampler against an independent float64 reference written here from vLLM V1's
semantics (the issue's text), over random parameters and the edge cases; greedy = argmax; seeded
runs reproducible whatever the batch; sampled ids follow the returned distribution (chi-square)."""

from __future__ import annotations

import collections
import functools
import random

import pytest
import torch

from hpipe.sampling import CPUSampler, SamplingError, SamplingParams


def reference_probs(logits: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """The distribution of one row, float64, dense, straight from the semantics."""
    x = logits.double().clone()
    for t, b in p.logit_bias:
        x[t] += b
    counts = collections.Counter(outputs)
    for t in set(prompt) | set(outputs):
        if x[t] > 0:
            x[t] = x[t] / p.repetition_penalty
        else:
            x[t] = x[t] * p.repetition_penalty
    for t, c in counts.items():
        x[t] = x[t] - p.frequency_penalty * c - p.presence_penalty
    if p.temperature < 1e-5:
        out = torch.zeros_like(x)
        out[int(torch.argmax(x))] = 1.0        # torch.argmax: the first maximum
        return out
    z = x / p.temperature
    probs = torch.softmax(z, dim=0)
    keep = probs >= p.min_p * probs.max()
    if p.top_k > 0:
        survivors = sorted(z[keep].tolist(), reverse=True)
        kth = survivors[min(p.top_k, len(survivors)) - 1]
        keep &= z >= kth
    q = torch.where(keep, probs, torch.zeros_like(probs))
    q = q / q.sum()
    if p.top_p < 1:
        above = torch.tensor([float(q[q > q[i]].sum()) for i in range(len(q))], dtype=torch.float64)
        keep &= above < p.top_p
        keep[int(torch.argmax(q))] = True
        q = torch.where(keep, q, torch.zeros_like(q))
        q = q / q.sum()
    return q


def random_params(rng: random.Random, greedy: bool | None = None) -> SamplingParams:
    greedy = rng.random() < 0.2 if greedy is None else greedy
    return SamplingParams(
        temperature=rng.choice([0.0, 1e-6]) if greedy else rng.choice([0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([0, 0, 1, 3, 10, 40]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 1e-9]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.5, -0.7, 2.0]),
        presence_penalty=rng.choice([0.0, 0.4, -1.5]),
        seed=rng.randrange(1 << 30),
        logit_bias={str(rng.randrange(17)): rng.choice([-100, -3.5, 2.0, 100]) for _ in range(rng.choice([0, 0, 1, 3]))})


def run_against_reference(vocab, rows, steps, rng, layout, logits_fn=None):
    """rows: [(params, prompt)]. Runs `steps` steps of one batch; checks every row's
    distribution against the reference, then records the sampled id as the reference's history."""
    sampler = CPUSampler(vocab, max_batch=len(rows) + 2, max_len=steps + 1, replicas=2, layout=layout)
    seqs = [f"s{i}" for i in range(len(rows))]
    for s, (params, prompt) in zip(seqs, rows):
        sampler.add(s, params, prompt, replica=1)
    outputs = {s: [] for s in seqs}
    for _ in range(steps):
        order = seqs[:]
        rng.shuffle(order)                 # any order of sequences in a step
        logits = logits_fn(len(order)) if logits_fn else torch.randn(len(order), vocab) * rng.choice([1.0, 3.0, 8.0])
        ids, probs = sampler.step(logits, order, replica=1, return_probs=True)
        assert ids.dtype == torch.long and probs.shape == (len(order), vocab)
        for i, s in enumerate(order):
            params, prompt = rows[seqs.index(s)]
            ref = reference_probs(logits[i], prompt, outputs[s], params)
            assert float((probs[i] - ref).abs().max()) < 1e-6, (params, outputs[s])
            assert ref[int(ids[i])] > 0, "the sampled id has probability 0"
            if params.temperature < 1e-5:
                x = ref                              # one-hot at the penalized argmax
                assert int(ids[i]) == int(torch.argmax(x))
            outputs[s].append(int(ids[i]))
    return outputs


@pytest.mark.parametrize("layout", ["row", "column"])
def test_random_parameters_match_reference(layout):
    rng = random.Random(f"sampling-{layout}")
    for trial in range(25):
        vocab = rng.choice([17, 64, 300])
        rows = [(random_params(rng), [rng.randrange(vocab) for _ in range(rng.randint(0, 12))])
                for _ in range(rng.randint(1, 6))]
        run_against_reference(vocab, rows, steps=rng.randint(1, 6), rng=rng, layout=layout)


def test_bfloat16_logits_with_many_ties_match_reference():
    """Logits from a bf16 model have 8 significant bits: ties at the k-th value and at the maximum
    are common, and each must be resolved as the semantics say (ties kept, greedy = first maximum)."""
    rng = random.Random("bf16")
    for trial in range(12):
        vocab = rng.choice([64, 500])
        rows = [(random_params(rng), [rng.randrange(vocab) for _ in range(rng.randint(0, 6))])
                for _ in range(rng.randint(1, 5))]
        run_against_reference(vocab, rows, steps=3, rng=rng, layout="row",
                              logits_fn=lambda b: (torch.randn(b, vocab) * 2).to(torch.bfloat16).float())


def bf16_logits(rows: int, vocab: int) -> torch.Tensor:
    return (torch.randn(rows, vocab) * 2).to(torch.bfloat16).float()


@pytest.mark.parametrize("layout", ["row", "column"])
def test_greedy_batches_without_penalties_take_the_first_maximum(layout):
    """A batch of greedy rows without penalties (a chat's default) is read straight off the logits:
    the first maximum of each (biased) row, ties included, as the reference and the candidates'
    path give; with or without the distributions asked for."""
    rng = random.Random("greedy")
    for trial in range(8):
        vocab = rng.choice([64, 500])
        rows = [(SamplingParams(temperature=rng.choice([0.0, 1e-6]), top_k=rng.choice([0, 3]),
                                logit_bias={str(rng.randrange(vocab)): 2.0} if rng.random() < 0.3 else {}),
                 [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]) for _ in range(rng.randint(1, 4))]
        bf16 = functools.partial(bf16_logits, vocab=vocab)       # ties at the maximum
        outputs = run_against_reference(vocab, rows, steps=3, rng=rng, layout=layout, logits_fn=bf16)
        sampler = CPUSampler(vocab, max_batch=len(rows), max_len=4, layout=layout)
        for i, (params, prompt) in enumerate(rows):
            sampler.add(i, params, prompt)
        logits = bf16(len(rows))
        biased = logits.double()
        for i, (params, _) in enumerate(rows):
            for t, bias in params.logit_bias:
                biased[i, t] += bias
        assert sampler.step(logits, list(range(len(rows)))).tolist() == biased.argmax(dim=1).tolist()
        assert all(len(o) == 3 for o in outputs.values())


@pytest.mark.parametrize("layout", ["row", "column"])
def test_edge_cases(layout):
    rng = random.Random(1)
    vocab = 40
    ties = lambda b: torch.tensor([[3.0] * 4 + [1.0] * 6 + [-2.0] * 30] * b)  # noqa: E731  equal logits
    cases = [
        [(SamplingParams(top_k=1, seed=1), [1, 2])],
        [(SamplingParams(top_p=1e-9, seed=2), [])],
        [(SamplingParams(min_p=1.0, seed=3), [])],                       # keeps exactly the tied maxima
        [(SamplingParams(min_p=0.1, top_k=2, seed=4), [])],              # top-k tie: all four 3.0 kept
        [(SamplingParams(temperature=1e-6), [5, 5, 5])],
        [(SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=2.0, presence_penalty=2.0),
          [3, 3, 9])],
        [(SamplingParams(temperature=0.8, repetition_penalty=0.5, frequency_penalty=-2.0, presence_penalty=-2.0,
                         seed=5), [0, 0, 1, 1, 2])],
        [(SamplingParams(temperature=0.0), [1]), (SamplingParams(temperature=1.2, top_k=5, seed=6), [1]),
         (SamplingParams(temperature=0.0, presence_penalty=1.0), []), (SamplingParams(top_p=0.3, seed=7), [2])],
    ]
    for rows in cases:
        run_against_reference(vocab, rows, steps=5, rng=rng, layout=layout)
        run_against_reference(vocab, rows, steps=3, rng=rng, layout=layout, logits_fn=ties)


def test_seeded_runs_do_not_depend_on_batch_or_position():
    vocab = 100
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.2, seed=42)
    base = torch.randn(12, vocab, generator=torch.Generator().manual_seed(0))

    def run(companions: int, position: int) -> list[int]:
        s = CPUSampler(vocab, max_batch=8, max_len=16)
        others = [f"o{i}" for i in range(companions)]
        for o in others:
            s.add(o, SamplingParams(temperature=1.0, seed=hash(o) % 1000), [1, 2])
        s.add("me", params, [4, 5, 6])
        got = []
        for step in range(12):
            order = others[:]
            order.insert(min(position, len(order)), "me")
            logits = torch.randn(len(order), vocab)
            logits[order.index("me")] = base[step]
            ids = s.step(logits, order)
            got.append(int(ids[order.index("me")]))
        return got

    first = run(0, 0)
    assert run(0, 0) == first
    assert run(3, 0) == first and run(3, 2) == first and run(5, 5) == first


def test_sampled_ids_follow_the_returned_distribution():
    """Chi-square goodness of fit: 20,000 draws from one distribution (df = 7)."""
    vocab = 8
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5]])
    s = CPUSampler(vocab, max_batch=1, max_len=1)
    counts = torch.zeros(vocab)
    probs = None
    n = 20000
    for i in range(n):
        s.add(i, SamplingParams(temperature=1.3, seed=i), [])
        ids, probs = s.step(logits, [i], return_probs=True)
        counts[int(ids[0])] += 1
        s.remove(i)
    expected = probs[0] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, chi2      # the 0.999 quantile of chi-square with 7 degrees of freedom


def test_invalid_parameters_are_refused_with_the_rule():
    for kwargs, words in (({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "[-2, 2]"),
                          ({"repetition_penalty": 0}, "> 0"), ({"top_p": 0}, "(0, 1]"), ({"top_p": 1.1}, "(0, 1]"),
                          ({"min_p": -0.1}, "[0, 1]"), ({"top_k": -1}, ">= 0"), ({"temperature": -1}, ">= 0"),
                          ({"temperature": float("nan")}, "finite"), ({"top_k": 2.5}, "integer")):
        with pytest.raises(SamplingError, match=r".*") as e:
            SamplingParams(**kwargs)
        assert words in str(e.value) and next(iter(kwargs)) in str(e.value)


def test_remove_clears_the_state_and_slots_are_independent():
    vocab = 30
    s = CPUSampler(vocab, max_batch=1, max_len=4, replicas=2)
    p = SamplingParams(temperature=0.0, repetition_penalty=5.0)
    s.add("a", p, [7], replica=0)
    s.add("b", SamplingParams(temperature=0.0), [], replica=1)
    logits = torch.zeros(1, vocab)
    logits[0, 7] = 2.0
    logits[0, 8] = 1.0
    assert int(s.step(logits, ["a"], replica=0)[0]) == 8          # 7 is penalized: 2/5 < 1
    assert int(s.step(logits, ["b"], replica=1)[0]) == 7          # replica 1 knows nothing of "a"
    with pytest.raises(SamplingError):
        s.add("c", p, [], replica=0)                              # replica 0 is full
    s.remove("a")
    s.add("c", SamplingParams(temperature=0.0), [], replica=0)    # the freed column starts clean
    assert int(s.step(logits, ["c"], replica=0)[0]) == 7


def test_a_released_request_frees_its_column_for_the_next():
    """The asynchronous runtime may run one more decode step of a sequence that just stopped: its row
    is sampled with the state it still has (stage 0 drops the id), and once the schedule releases it
    its column serves the next request (max_batch 1 here)."""
    from hpipe.request import Request
    from hpipe.sampling import RequestSampler

    reqs = [Request(i, f"r{i}", (5, 6), SamplingParams(temperature=0.0), max_new_tokens=5,
                    eos_ids=frozenset([3])) for i in range(2)]
    sampler = RequestSampler(16, max_batch=1, max_len=5)
    to_eos, to_seven = torch.zeros(1, 16), torch.zeros(1, 16)
    to_eos[0, 3] = to_seven[0, 7] = 10.0
    sampler.admit(reqs[0])
    assert sampler.sample(to_eos, [0]) == [3]          # r0 stops (stage 0 decides it)
    assert sampler.sample(to_seven, [0]) == [7]        # its leftover step, before its release
    sampler.release(0)
    sampler.admit(reqs[1])
    assert sampler.sample(to_seven, [1]) == [7]        # r0's column is free for r1
    assert not sampler.knows(0) and sampler.knows(1)


def test_a_sampler_holds_only_the_requests_running():
    """Requests admitted and released as the schedules say: over 3,072 requests the sampler's
    memory does not grow with the requests served."""
    from hpipe.request import Request
    from hpipe.sampling import RequestSampler

    sampler = RequestSampler(16, max_batch=2, max_len=64)
    to_eos, to_seven = torch.zeros(1, 16), torch.zeros(1, 16)
    to_eos[0, 3] = to_seven[0, 7] = 10.0
    for i in range(3072):
        sampler.admit(Request(i, f"r{i}", (5,), SamplingParams(temperature=0.0), max_new_tokens=5,
                              eos_ids=frozenset([3])))
        assert sampler.sample(to_eos, [i]) == [3]
        sampler.release(i)
    assert not sampler.requests and not sampler.started
