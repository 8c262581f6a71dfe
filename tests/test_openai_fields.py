"""What real clients send, with the real openai client against `hpipe serve`, checked against
transformers: a tiny float32 model with the default model's tokenizer, served by 2 stages, sampled
inline and by the sampler process pool. Log-probabilities with vLLM's default semantics (the
model's own distribution, log_softmax of the raw logits, whatever the sampling parameters), echo's
prompt log-likelihood, n choices sharing one prefill, and structured output (the grammar's mask is
all that makes a random model's output parse)."""

from __future__ import annotations

import time

import pytest
import torch

from hpipe.cli import main
from serving import stop_serve
from test_serve import client, request, start_server

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
NEW = 8


@pytest.fixture(scope="module", params=["inline", "cpu"])
def served(request, talking_model, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp(f"logprobs-{request.param}")
    plan = tmp / "plan.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(talking_model), "--stages", "2", "-o", str(plan)]) == 0
    proc, base, log = start_server(tmp, plan, "--sampling", request.param, key=None)
    reference = AutoModelForCausalLM.from_pretrained(talking_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(talking_model)
    c = client(base, key=None)
    yield c, c.models.list().data[0].id, reference, tokenizer, base
    stop_serve(proc)
    assert proc.returncode in (0, 130), log.read_text()


def reference_logprobs(reference, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of one transformers forward over prompt + output, at the positions that
    produced each output token: [len(output), V]."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def check(ref: torch.Tensor, output: list[int], chosen: list[float], tops: list[dict[int, float]], k: int):
    for i, token in enumerate(output):
        assert chosen[i] == pytest.approx(float(ref[i, token]), abs=1e-4)
        values, ids = ref[i].topk(k)
        assert sorted(tops[i]) == sorted(ids.tolist())
        for t, v in zip(ids.tolist(), values.tolist()):
            assert tops[i][t] == pytest.approx(v, abs=1e-4)


def test_completion_logprobs_are_the_models_log_softmax(served):
    c, model, reference, tokenizer, _ = served
    prompt = tokenizer(PROMPT)["input_ids"]
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    for sampling, more in (({"temperature": 0}, {}),
                           ({"temperature": 1.3, "seed": 7, "logit_bias": {"42": 5}}, {"top_k": 5})):
        done = c.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, logprobs=5, **sampling,
                                    extra_body={**extra, **more})
        lp = done.choices[0].logprobs
        output = ids_of(lp.tokens)
        assert len(output) == NEW == len(lp.token_logprobs) and done.choices[0].text == tokenizer.decode(output)
        tops = [{int(t.removeprefix("token_id:")): v for t, v in top.items()} for top in lp.top_logprobs]
        # raw: the model's distribution, before temperature, top-k and logit_bias
        check(reference_logprobs(reference, prompt, output), output, lp.token_logprobs, tops, 5)
        if sampling["temperature"] == 0:
            assert output == reference_logprobs(reference, prompt, output).argmax(-1).tolist()
        # streamed: the same entries, chunk by chunk
        pieces = [ch.choices[0].logprobs for ch in c.completions.create(
            model=model, prompt=PROMPT, max_tokens=NEW, logprobs=5, stream=True, **sampling,
            extra_body={**extra, **more}) if ch.choices and ch.choices[0].logprobs]
        assert [t for p in pieces for t in p.tokens] == lp.tokens
        assert [v for p in pieces for v in p.token_logprobs] == lp.token_logprobs


def test_chat_logprobs_follow_the_chat_template(served):
    c, model, reference, tokenizer, _ = served
    messages = [{"role": "user", "content": "Name a large animal."}]
    done = c.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0, logprobs=True,
                                     top_logprobs=3, extra_body={"ignore_eos": True})
    content = done.choices[0].logprobs.content
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    output = []
    with torch.no_grad():                 # transformers' own greedy continuation
        for _ in range(NEW):
            output.append(int(reference(torch.tensor([ids + output])).logits[0, -1].argmax()))
    ref = reference_logprobs(reference, ids, output)
    name = lambda t: tokenizer.decode([t])          # noqa: E731
    assert [e.token for e in content] == [name(t) for t in output]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    for i, e in enumerate(content):
        assert e.logprob == pytest.approx(float(ref[i, output[i]]), abs=1e-4)
        values, top = ref[i].topk(3)
        assert [(a.token, a.logprob) for a in e.top_logprobs] == \
            [(name(t), pytest.approx(v, abs=1e-4)) for t, v in zip(top.tolist(), values.tolist())]
    plain = c.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == done.choices[0].message.content


def test_logprob_fields_out_of_range_name_the_field(served):
    import openai

    c, model, _, _, _ = served
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match=r"'top_logprobs' must be in \[0, 20\], got 21"):
        c.chat.completions.create(model=model, messages=messages, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match=r"'top_logprobs' needs 'logprobs': true"):
        c.chat.completions.create(model=model, messages=messages, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match=r"'logprobs' must be in \[0, 20\]"):
        c.completions.create(model=model, prompt="hi", logprobs=21)
    assert c.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].logprobs is None


def prefix_hits(base: str, at_least: int = 0) -> int:
    """The server's prefix-cache hits, once they reach `at_least` (stage 0 reports every 0.25 s) or
    after 5 s."""
    deadline = time.time() + 5
    while True:
        text = request(base, "GET", "/metrics")[1]
        hits = int(next(line.split()[1] for line in text.splitlines()
                        if line.startswith("hpipe_prefix_cache_hit_tokens_total ")))
        if hits >= at_least or time.time() > deadline:
            return hits
        time.sleep(0.1)


def test_n_choices_share_one_prefill_and_take_seed_plus_i(served):
    import openai

    c, model, reference, tokenizer, base = served
    prompt = "A long prompt, so that its full pages are cached: " + " ".join(f"item {i}," for i in range(40))
    ids = tokenizer(prompt)["input_ids"]
    kw = dict(model=model, prompt=prompt, max_tokens=NEW, extra_body={"ignore_eos": True})
    before = prefix_hits(base)
    done = c.completions.create(n=3, temperature=1.0, seed=11, **kw)
    full = (len(ids) - 1) // 16 * 16
    hits = prefix_hits(base, before + 2 * full) - before
    assert [ch.index for ch in done.choices] == [0, 1, 2]
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 3 * NEW
    # choices 1 and 2 started after choice 0's cached prompt: at least its full pages each (16 tokens)
    assert hits >= 2 * full > 0
    # seeded choices: choice i is the single request with seed + i
    for i, ch in enumerate(done.choices):
        alone = c.completions.create(temperature=1.0, seed=11 + i, **kw)
        assert ch.text == alone.choices[0].text
    assert len({ch.text for ch in done.choices}) > 1
    # greedy: every choice is transformers' greedy continuation; streamed, the same texts by index
    greedy = c.completions.create(n=2, temperature=0, **kw)
    output = []
    with torch.no_grad():
        for _ in range(NEW):
            output.append(int(reference(torch.tensor([ids + output])).logits[0, -1].argmax()))
    assert [ch.text for ch in greedy.choices] == [tokenizer.decode(output)] * 2
    texts = {0: "", 1: ""}
    for chunk in c.completions.create(n=2, temperature=0, stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == {0: tokenizer.decode(output), 1: tokenizer.decode(output)}
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
                                     temperature=0)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match=r"'n' must be at most the server's batch \(8"):
        c.completions.create(n=9, **kw)


def test_echo_gives_the_prompts_log_likelihood(served):
    c, model, reference, tokenizer, _ = served
    prompt = "Colors of the rainbow: " + " ".join(["red orange yellow green blue"] * 12)
    ids = tokenizer(prompt)["input_ids"]
    c.completions.create(model=model, prompt=prompt, max_tokens=1)       # its pages are cached now: echo skips them
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    extra = {"return_tokens_as_token_ids": True}
    done = c.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0,
                                extra_body=extra)
    lp = done.choices[0].logprobs
    assert done.choices[0].text == prompt and done.usage.completion_tokens == 0
    assert ids_of(lp.tokens) == ids and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        values, top = ref[i - 1].topk(2)
        assert {int(t.removeprefix("token_id:")): v for t, v in lp.top_logprobs[i].items()} == \
            {t: pytest.approx(v, abs=1e-4) for t, v in zip(top.tolist(), values.tolist())}
    # with tokens after it: the prompt, then the continuation, one list of log-probabilities
    more = c.completions.create(model=model, prompt=ids, max_tokens=3, echo=True, logprobs=0, temperature=0,
                                extra_body={**extra, "ignore_eos": True})
    lp2 = more.choices[0].logprobs
    assert more.choices[0].text.startswith(tokenizer.decode(ids)) and len(lp2.tokens) == len(ids) + 3
    assert lp2.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert int(lp2.tokens[len(ids)].removeprefix("token_id:")) == int(ref[-1].argmax())


def test_structured_output_validates_whatever_the_model(served):
    """The tiny model's weights are random: only the grammar's mask makes its output parse."""
    import enum
    import json
    import re

    import openai
    from pydantic import BaseModel, Field

    c, model, _, _, _ = served

    class Color(str, enum.Enum):
        red = "red"
        green = "green"

    class Address(BaseModel):
        city: str = Field(max_length=12)
        zip: str = Field(pattern=r"^[0-9]{5}$")

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)
        color: Color
        favourites: list[Color] = Field(max_length=3)
        addresses: list[Address] = Field(max_length=2)   # strings bounded: random weights never end one

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in (1, 2):
        done = c.beta.chat.completions.parse(model=model, messages=messages, response_format=Person, max_tokens=300,
                                             temperature=0.8, seed=seed)
        person = done.choices[0].message.parsed
        assert isinstance(person, Person) and done.choices[0].finish_reason == "stop"
        assert Person.model_validate_json(done.choices[0].message.content) == person
    close = served[3].convert_tokens_to_ids("{}")      # any object: biased to the empty one
    plain = c.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0,
                                      response_format={"type": "json_object"}, logit_bias={str(close): 100})
    assert isinstance(json.loads(plain.choices[0].message.content), dict)
    regex = c.completions.create(model=model, prompt="A date:", max_tokens=20, temperature=0,
                                 extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", regex.choices[0].text)
    choice = c.completions.create(model=model, prompt="Pick:", max_tokens=10, n=2, seed=3, temperature=1,
                                  extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(ch.text in ("yes", "no", "maybe") for ch in choice.choices)
    # bad grammars: a 400 naming the field, and the server stays up
    with pytest.raises(openai.BadRequestError, match=r"'guided_json' does not compile: .*frob"):
        c.completions.create(model=model, prompt="x", extra_body={"guided_json": {"type": "frob"}})
    with pytest.raises(openai.BadRequestError, match=r"'guided_regex' does not compile"):
        c.completions.create(model=model, prompt="x", extra_body={"guided_regex": "([a-z"})
    with pytest.raises(openai.BadRequestError, match=r"'response_format.json_schema.schema' is required"):
        c.chat.completions.create(model=model, messages=messages,
                                  response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match=r"give one kind of structured output"):
        c.completions.create(model=model, prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert c.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].text is not None


def test_lm_eval_local_completions_scores_as_its_hf_model(served, tmp_path, request):
    """lm-eval's own client (echo, logprobs, batched token-id prompts) against hpipe serve, and
    lm-eval's transformers model on the same checkpoint: the same log-likelihoods, the same scores."""
    if "cpu" in request.node.callspec.id:
        pytest.skip("prompt log-probabilities come from the last stage whatever samples: one sampler is enough")
    import json

    import lm_eval

    _, model, _, _, base = served
    docs = [{"question": f"Question {i}: which word comes next after {w}?", "choices": [" red", " blue", " seven",
             " the end"], "label": i % 4} for i, w in enumerate(["one", "two", "sky", "sea", "fire", "stone"])]
    data = tmp_path / "mini.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {"task": "hpipe_mini", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "label", "target_delimiter": "",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}], "metadata": {"version": 1.0}}
    ours = lm_eval.simple_evaluate(
        model="local-completions", tasks=[task], model_args=f"base_url={base}/v1/completions,model={model},"
        f"tokenizer={model},tokenizer_backend=huggingface,tokenized_requests=True,batch_size=4")
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", tasks=[task],
                                     device="cpu", batch_size=1)
    a, b = ours["results"]["hpipe_mini"], theirs["results"]["hpipe_mini"]
    for metric in ("acc,none", "acc_norm,none"):
        assert abs(a[metric] - b[metric]) <= b[metric.replace(",", "_stderr,")], (metric, a, b)
    ll = lambda r: [float(x[0][0]) for s in r["samples"]["hpipe_mini"] for x in s["resps"]]     # noqa: E731
    assert len(ll(ours)) == 4 * len(docs) and ll(ours) == pytest.approx(ll(theirs), abs=1e-3)


def from_schema(schema: dict, components: dict):
    """A hypothesis strategy of the JSON values a JSON schema (as /openapi.json writes pydantic's)
    allows: objects with their required and some optional properties, anyOf, $ref, bounds."""
    from hypothesis import strategies as st

    def of(s: dict):
        if "$ref" in s:
            return st.deferred(lambda: of(components[s["$ref"].rsplit("/", 1)[1]]))
        if "const" in s:
            return st.just(s["const"])
        if "enum" in s:
            return st.sampled_from(s["enum"])
        if "anyOf" in s:
            return st.one_of([of(f) for f in s["anyOf"]])
        kind = s.get("type")
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind in ("integer", "number"):
            lo = s.get("minimum", s.get("exclusiveMinimum", -1000))
            hi = s.get("maximum", 1000)
            if kind == "integer":
                return st.integers(int(lo) + ("exclusiveMinimum" in s), int(hi))
            return st.floats(lo, hi, exclude_min="exclusiveMinimum" in s, allow_nan=False)
        if kind == "string":
            return st.from_regex(s["pattern"], fullmatch=True) if "pattern" in s else \
                st.text(min_size=s.get("minLength", 0), max_size=12)
        if kind == "array":
            return st.lists(of(s.get("items", {})), min_size=s.get("minItems", 0), max_size=3)
        if kind == "object" and "properties" in s:
            required = set(s.get("required", ()))
            return st.fixed_dictionaries({k: of(v) for k, v in s["properties"].items() if k in required},
                                         optional={k: of(v) for k, v in s["properties"].items() if k not in required})
        if kind == "object":
            values = next(iter(s.get("patternProperties", {}).items()), None)
            keys = st.from_regex(values[0], fullmatch=True) if values else st.text(max_size=5)
            return st.dictionaries(keys, of(values[1]) if values else st.integers(), max_size=3)
        return st.none() | st.booleans() | st.integers() | st.text(max_size=5)

    return of(schema)


def test_bodies_drawn_from_the_openapi_schema_never_get_a_5xx(served, request):
    """Schemathesis' idea: bodies drawn from /openapi.json's own request schemas (valid ones, and
    ones with a field replaced by any JSON value) against the served pipeline: every answer is a
    200 or a 4xx in OpenAI's error body, and the server stays up. Lengths are capped (chat's default
    is the context left: a body without one gets one) so that the bodies that pass run quickly."""
    if "cpu" in request.node.callspec.id:
        pytest.skip("the API parses before any sampler: one pipeline is enough")
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from test_serve import request as http

    _, model, _, _, base = served
    openapi = json.loads(http(base, "GET", "/openapi.json", key=None)[1])
    components = openapi["components"]["schemas"]

    def body_schema(name: str) -> dict:
        schema = json.loads(json.dumps(components[name]))
        for capped in ("max_tokens", "max_completion_tokens"):
            if capped in schema["properties"]:
                schema["properties"][capped] = {"type": "integer", "minimum": -1, "maximum": 4}
        schema["properties"]["n"] = {"type": "integer", "minimum": -1, "maximum": 3}
        return schema

    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner,
                                                                                            max_size=3), max_leaves=6)

    @st.composite
    def bodies(draw):
        path, name = draw(st.sampled_from([("/v1/completions", "CompletionRequest"),
                                           ("/v1/chat/completions", "ChatCompletionRequest")]))
        body = draw(from_schema(body_schema(name), components))
        body["model"] = draw(st.sampled_from([model, model, model, "other"]))
        if draw(st.booleans()):
            field = draw(st.sampled_from(sorted(components[name]["properties"])))
            body[field] = draw(json_values)
        lengths = [f for f in ("max_tokens", "max_completion_tokens") if f in components[name]["properties"]]
        if all(body.get(f) is None for f in lengths):       # a chat's default is the context left: capped
            body[([f for f in lengths if f not in body] or lengths)[0]] = draw(st.integers(1, 4))
        return path, body

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(bodies())
    def answered(drawn):
        path, body = drawn
        status, text = http(base, "POST", path, json.dumps(body).encode(), key=None)
        assert status < 500, (status, text, body)
        if status != 200:
            error = json.loads(text)["error"]
            assert 400 <= error["code"] < 500 and error["message"], (status, text, body)

    answered()
    assert http(base, "GET", "/health", key=None)[0] == 200
