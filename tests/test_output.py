"""One request's output, assembled in one place (launcher/output.py): tokens from stage 0 and their
log-probabilities from the last stage paired in whichever order they arrive, the text the
tokenizer's whole decode gives, stop strings, the end decided once. The default model's own
tokenizer; no pipeline (the served paths are tests/test_serve.py and test_openai_fields.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from hpipe import models
from hpipe.launcher.output import RequestOutput
from hpipe.request import Request, SamplingParams

TEXT = "Déjà vu — naïve café 🚀 über straße: 12,345 tokens; «quoted» end."


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer(models.resolve_model("smollm2").path)


def request_of(prompt: list[int], logprobs: int | None = None, echo: bool = False) -> Request:
    return Request(0, "r", tuple(prompt), SamplingParams(temperature=0.0, logprobs=logprobs,
                                                         prompt_logprobs=logprobs if echo else None), 64)


def replay(output: RequestOutput, arrivals: list[tuple]) -> list[tuple]:
    events = []
    for kind, value in arrivals:
        events += getattr(output, kind)(value)
    return events


def texts(events: list[tuple]) -> str:
    return "".join(value for kind, value, _ in events if kind == "text")


@pytest.mark.parametrize("seed", range(6))
def test_tokens_and_their_entries_pair_in_any_order(tokenizer, seed):
    ids = tokenizer(TEXT)["input_ids"]
    entries = [[t, -0.1 * i, [[t, -0.1 * i]]] for i, t in enumerate(ids)]
    rng = random.Random(seed)
    # stage 0's reports keep their order, the last stage's theirs; the two interleave at random
    a, b = [("token", t) for t in ids] + [("finish", "length")], [("logprob", e) for e in entries]
    arrivals = []
    while a or b:
        arrivals.append((a if a and (not b or rng.random() < 0.5) else b).pop(0))
    events = replay(RequestOutput(request_of([1], logprobs=1), tokenizer, []), arrivals)
    assert texts(events) == tokenizer.decode(ids, skip_special_tokens=True)
    assert [e for _, _, es in events for e in es] == entries          # every entry once, in order
    assert events[-1][:2] == ("finish", "length") and [k for k, _, _ in events].count("finish") == 1
    ends = [i for i, (kind, _, _) in enumerate(events) if kind == "finish"]
    assert ends == [len(events) - 1]


def test_the_end_waits_for_entries_still_on_their_way_then_gives_up(tokenizer):
    ids = tokenizer("one two three")["input_ids"]
    out = RequestOutput(request_of([1], logprobs=0), tokenizer, [])
    events = replay(out, [("token", t) for t in ids] + [("finish", "eos"), ("logprob", [ids[0], -1.0, []])])
    assert not out.done and all(kind == "text" for kind, _, _ in events)
    assert out.expire(now=0.0) == []                                  # before the deadline: nothing
    late = out.expire(now=float("inf"))
    assert out.done and late[-1][:2] == ("finish", "stop")
    assert texts(events + late) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop", ["café", "🚀 ü", "345 tok", "nowhere"])
def test_a_stop_string_ends_the_text_where_it_starts(tokenizer, stop):
    ids = tokenizer(TEXT)["input_ids"]
    out = RequestOutput(request_of([1]), tokenizer, [stop])
    events = []
    for t in ids:
        events += out.token(t)
        if out.done:
            break
    events += out.finish("length")
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert texts(events) == (whole[:whole.index(stop)] if stop in whole else whole)
    assert out.stopped == (stop in whole)
    assert events[-1][:2] == ("finish", "stop" if stop in whole else "length")
    if out.stopped:
        assert 0 < out.completion_tokens <= len(ids) and out.finish("length") == []   # one end only


def test_an_echo_comes_first_with_the_prompts_entries(tokenizer):
    prompt = tokenizer("The sky is")["input_ids"]
    out = RequestOutput(request_of(prompt, logprobs=0, echo=True), tokenizer, [], echo="The sky is", generates=False)
    arrivals = [("token", 5), ("finish", "length")] + \
        [("prompt_logprob", [p, t, -0.5, []]) for p, t in reversed(list(enumerate(prompt))[1:])] + \
        [("logprob", [5, -0.2, []])]
    events = replay(out, arrivals)
    assert events[0][:2] == ("text", "The sky is")
    assert [e[0] for e in events[0][2]] == prompt and events[0][2][0][1] is None
    assert events[-1][:2] == ("finish", "length") and out.completion_tokens == 0
    assert texts(events) == "The sky is"


def test_an_error_ends_it_once(tokenizer):
    out = RequestOutput(request_of([1]), tokenizer, [])
    assert out.token(tokenizer("hi")["input_ids"][0]) is not None
    assert out.error("the pipeline failed") == [("error", "the pipeline failed", ())]
    assert out.error("again") == [] and out.finish("eos") == [] and out.done


def test_every_interleaving_of_a_short_answer(tokenizer):
    ids = tokenizer("ab")["input_ids"][:2]
    reference = None
    stage0 = [("token", t) for t in ids] + [("finish", "eos")]
    last = [("logprob", [t, -1.0, []]) for t in ids]
    for picks in set(itertools.permutations([0] * len(stage0) + [1] * len(last))):
        a, b = list(stage0), list(last)
        arrivals = [(a if p == 0 else b).pop(0) for p in picks]
        events = replay(RequestOutput(request_of([1], logprobs=0), tokenizer, []), arrivals)
        pieces = [(kind, value, [e[0] for e in entries]) for kind, value, entries in events]
        merged = (texts(events), [t for _, _, es in pieces for t in es], pieces[-1][:2])
        assert reference is None or merged == reference
        reference = merged


class Stage0:
    """Where a client's ops go while no workers run: kept, to be read back."""

    def __init__(self):
        self.ops = []

    def send(self, op) -> bool:
        self.ops.append(op)
        return True


def client_with_request(tokenizer, stops: list[str], logprobs: int | None):
    """A PipelineClient's own bookkeeping (no workers: its reports are fed by hand, as the report
    thread feeds them) and one submitted request with its output and its asyncio queue."""
    import asyncio

    from hpipe import protocol
    from hpipe.launcher.jobs import LaunchSettings
    from hpipe.launcher.serving import PipelineClient

    client = PipelineClient(None, "", LaunchSettings())
    client.launch, client.accepting = Stage0(), True     # its stage 0 is ready
    loop = asyncio.new_event_loop()
    request = client.request([1, 2], SamplingParams(temperature=0.0, logprobs=logprobs), 16, frozenset(), False)
    handle = client.submit_request(request, loop, RequestOutput(request, tokenizer, stops))

    def events() -> list[tuple]:
        loop.run_until_complete(asyncio.sleep(0))      # the callbacks the report thread scheduled
        out = []
        while not handle.queue.empty():
            out.append(handle.queue.get_nowait())
        return out

    return client, handle, events, protocol


def test_a_stop_string_found_on_a_late_entry_aborts_the_request_as_stop(tokenizer):
    client, handle, events, protocol = client_with_request(tokenizer, ["two"], logprobs=0)
    ids = tokenizer("one two three")["input_ids"]
    client.on_tokens(protocol.Tokens([(handle.request.index, t) for t in ids]))
    assert not any(kind == "finish" for kind, _, _ in events())       # each token waits for its entry
    client.on_logprobs(protocol.Logprobs([[handle.request.index, t, -1.0, []] for t in ids], []))
    assert events()[-1][:2] == ("finish", "stop")
    assert [type(op).__name__ for op in client.launch.ops] == ["Add", "Abort"]
    assert client.metrics.finished == {"stop": 1} and client.load() == 0


def test_a_failure_after_the_end_still_answers_with_the_entries_that_came(tokenizer):
    client, handle, events, protocol = client_with_request(tokenizer, [], logprobs=0)
    ids = tokenizer("one two")["input_ids"]
    client.on_tokens(protocol.Tokens([(handle.request.index, t) for t in ids]))
    client.on_logprobs(protocol.Logprobs([[handle.request.index, ids[0], -1.0, []]], []))
    client.on_result(protocol.Result(handle.request.index, ids, "length", 2, 0.1, 0.01, 0.2, 10.0))
    out = events()
    assert not any(kind == "finish" for kind, _, _ in out)             # the second entry is on its way
    client._fail("stage 2 (h2 cpu) exited")                            # ... and never comes
    out += events()
    assert out[-1][:2] == ("finish", "length") and "".join(v for k, v, _ in out if k == "text") == \
        tokenizer.decode(ids, skip_special_tokens=True)
