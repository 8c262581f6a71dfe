"""The request models are the API's parser: /openapi.json's bounds are the rule table's, and every
body the old hand-written parsers refused is still a 400 (404 for another model) that names the
field, in OpenAI's error body. The app runs on a pipeline that never starts (the bodies are parsed
before a handler reaches it); the fuzzing against a served pipeline is in test_openai_fields.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hpipe.launcher import api
from hpipe.request import LOGIT_BIAS, MAX_LOGPROBS, RULES

VOCAB = 100


class Tokenizer:
    chat_template = "{{ messages }}"

    def __call__(self, text):
        return {"input_ids": [1, 2, 3]}

    def apply_chat_template(self, messages, **kwargs):
        return [1, 2]


class Unstarted:
    """What the handlers read of a pipeline before they submit: its limits."""

    max_model_len, max_batch, capacity, failure, degraded = 64, 4, 8, None, None

    class job:
        class source:
            path = "/nowhere"

    def load(self) -> int:
        return 0


@pytest.fixture(scope="module")
def app() -> TestClient:
    return TestClient(api.create_app(Unstarted(), Tokenizer(), "m", VOCAB, None))


@pytest.fixture(scope="module")
def schema(app) -> dict:
    assert app.get("/docs").status_code == 200
    return app.get("/openapi.json").json()


def bounds(prop: dict) -> tuple:
    """(low, high, low excluded) of a property, through its nullable anyOf."""
    form = next(f for f in prop.get("anyOf", [prop]) if f.get("type") in ("number", "integer"))
    if "exclusiveMinimum" in form:
        return form["exclusiveMinimum"], form["maximum"], True
    return form["minimum"], form["maximum"], False


@pytest.mark.parametrize("body", ["CompletionRequest", "ChatCompletionRequest"])
def test_the_schemas_bounds_are_the_rule_tables(schema, body):
    props = schema["components"]["schemas"][body]["properties"]
    for name, (lo, hi, lo_open, _) in RULES.items():
        assert bounds(props[name]) == (lo, hi, lo_open), name
    top = props["logprobs" if body == "CompletionRequest" else "top_logprobs"]
    assert bounds(top) == (0, MAX_LOGPROBS, False)
    bias = next(f for f in props["logit_bias"]["anyOf"] if f.get("type") == "object")["patternProperties"]
    assert [(b["minimum"], b["maximum"]) for b in bias.values()] == [LOGIT_BIAS]
    path = "/v1/chat/completions" if body == "ChatCompletionRequest" else "/v1/completions"
    assert schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"] \
        == f"#/components/schemas/{body}"


COMPLETIONS = [     # (body beside model "m", status, param, the message's start)
    ({"prompt": "hi", "temperature": 7}, 400, "temperature", "'temperature' must be in [0, 2], got 7"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", "'top_p' must be in (0, 1]"),
    ({"prompt": "hi", "top_p": "x"}, 400, "top_p", "'top_p' must be a number"),
    ({"prompt": "hi", "temperature": "0.5"}, 400, "temperature", "'temperature' must be a number"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "'repetition_penalty' must be in (0, 10]"),
    ({"prompt": "hi", "presence_penalty": -3}, 400, "presence_penalty", "'presence_penalty' must be in [-2, 2]"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k", "'top_k' must be >= -1"),
    ({"prompt": "hi", "seed": "1"}, 400, "seed", "'seed' must be an integer"),
    ({"prompt": [999]}, 400, "prompt", "'prompt' token id 999 is outside the vocabulary [0, 100)"),
    ({"prompt": [[1], [2, 100]]}, 400, "prompt", "'prompt[1]' token id 100 is outside"),
    ({"prompt": ""}, 400, "prompt", "'prompt' must be a non-empty string or list of token ids"),
    ({"prompt": 5}, 400, "prompt", "'prompt' must be a non-empty string"),
    ({}, 400, "prompt", "'prompt' is required"),
    ({"prompt": "hi", "prompt_logprobs": 1}, 400, "prompt_logprobs", "'prompt_logprobs': ask for"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs", "'logprobs' must be in [0, 20], got 21"),
    ({"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs", "'top_logprobs' is a chat field"),
    ({"prompt": "hi", "logit_bias": {"5": 300}}, 400, "logit_bias", "'logit_bias' must be in [-100, 100], got 300"),
    ({"prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias", "'logit_bias' keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"100": 1}}, 400, "logit_bias", "'logit_bias' keys must be token ids in [0, 100)"),
    ({"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias", "'logit_bias' must be an object"),
    ({"prompt": "hi", "stop_token_ids": [100]}, 400, "stop_token_ids", "'stop_token_ids' must hold token ids"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids[0]", "'stop_token_ids[0]' must be >= 0"),
    ({"prompt": "hi", "stop": ""}, 400, "stop", "'stop' must be a string or up to 16 strings"),
    ({"prompt": "hi", "stop": ["a"] * 17}, 400, "stop", "'stop' takes at most 16 strings"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "'max_tokens' must be at least 1 (0 only with 'echo'"),
    ({"prompt": "hi", "max_tokens": 100}, 400, "max_tokens", "this model's maximum context length is 64 tokens"),
    ({"prompt": "hi", "n": 0}, 400, "n", "'n' must be >= 1"),
    ({"prompt": "hi", "n": True}, 400, "n", "'n' must be an integer, got true"),
    ({"prompt": "hi", "n": 5}, 400, "n", "'n' must be at most the server's batch (4"),
    ({"prompt": ["a", "b", "c"], "n": 3}, 400, "prompt", "3 prompts x n=3 choices is more than the server takes"),
    ({"prompt": "hi", "best_of": 2}, 400, "best_of", "'best_of' must be one of 1"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix", "'suffix' is not supported"),
    ({"prompt": "hi", "tools": [{}]}, 400, "tools", "'tools' is not supported"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", "'stream' must be true or false"),
    ({"prompt": "hi", "stream_options": 3}, 400, "stream_options", "'stream_options' must be an object"),
    ({"prompt": "hi", "echo": 1}, 400, "echo", "'echo' must be true or false"),
    ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice",
     "give one kind of structured output, not guided_regex and guided_choice"),
    ({"prompt": "hi", "guided_choice": []}, 400, "guided_choice", "'guided_choice' must not be empty"),
    ({"prompt": "hi", "guided_json": 3}, 400, "guided_json", "'guided_json' must be"),
    ({"prompt": "hi", "guided_json": "[1]"}, 400, "guided_json", "'guided_json' must be a JSON schema"),
    ({"prompt": "hi", "ignore_eos": True, "guided_regex": "a+"}, 400, "ignore_eos", "'ignore_eos' cannot go with"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model", "the model 'gpt-9' does not exist; this server serves 'm'"),
    ({"prompt": "hi", "model": 3}, 400, "model", "'model' must be a string"),
]
CHAT = [
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     "'messages[0].role' must be one of system, user, assistant or developer"),
    ({"messages": []}, 400, "messages", "'messages' must not be empty"),
    ({"messages": "hi"}, 400, "messages", "'messages' must be a list"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", "'messages[0].content' is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content",
     "'messages[0].content' must be text, or text parts"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "'top_logprobs' must be in [0, 20], got 21"),
    ({"logprobs": 1}, 400, "logprobs", "'logprobs' must be true or false"),
    ({"echo": True}, 400, "echo", "'echo' is not supported by hpipe on chat"),
    ({"max_tokens": 0}, 400, "max_tokens", "'max_tokens' must be >= 1"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens", "'max_completion_tokens' must be >= 1"),
    ({"max_completion_tokens": 80}, 400, "max_completion_tokens", "this model's maximum context length"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema", "'response_format.json_schema.schema' is required"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema",
     "'response_format.json_schema' is required with type json_schema"),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type", "'response_format.type' must be one of text"),
]


@pytest.mark.parametrize("body,status,param,message", COMPLETIONS + [
    ({"messages": [{"role": "user", "content": "x"}], **b}, *rest) for b, *rest in CHAT])
def test_a_bad_body_is_a_4xx_naming_its_field(app, body, status, param, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = app.post(path, json={"model": "m", **body})
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (status, param, status), error
    assert error["message"].startswith(message), error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_bodies_that_are_not_json_objects(app):
    for raw, message in ((b"{not json", "the request body is not valid JSON"),
                         (b"[1, 2]", "the request body must be a JSON object"),
                         (b"", "the request body must be a JSON object")):
        r = app.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (raw, r.json())


def test_a_json_body_is_read_whatever_its_content_type(app):
    for kind in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": kind} if kind else {}
        r = app.post("/v1/completions", content=b'{"model": "m", "prompt": "hi", "temperature": 9}', headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", (kind, r.json())


def test_the_key_is_checked_before_the_body():
    keyed = TestClient(api.create_app(Unstarted(), Tokenizer(), "m", VOCAB, "k"))
    r = keyed.post("/v1/completions", json={"model": "m", "prompt": "hi", "temperature": 9})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = keyed.post("/v1/completions", json={"model": "m", "prompt": "hi", "temperature": 9},
                   headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


class Full(Unstarted):
    """Every body that parses, and passes the rules across fields, is answered 429: no room left."""

    def load(self) -> int:
        return self.capacity


BOUNDS = {"minimum": (0, -1), "maximum": (0, 1), "exclusiveMinimum": (1, 0)}   # (inside, past): steps off the bound
NEEDS = {"top_logprobs": {"logprobs": True}}       # what a field's bound goes with (and completions' max_tokens 0)


def numeric_forms(prop: dict):
    """(form, wrap) of a property's numeric forms: the number itself, or a list of them."""
    for form in prop.get("anyOf", [prop]):
        if form.get("type") in ("integer", "number"):
            yield form, lambda v: v
        elif form.get("type") == "array" and form.get("items", {}).get("type") in ("integer", "number"):
            yield form["items"], lambda v: [v]


@pytest.mark.parametrize("body", ["CompletionRequest", "ChatCompletionRequest"])
def test_every_bound_the_schema_publishes_is_taken_at_it_and_refused_past_it(body):
    """What /openapi.json publishes is what the server takes: each numeric field's bound (integers as
    integers, and an integer's bound also as an integral number, 20.0) is accepted, one step past it
    is a 400 naming the field."""
    app = TestClient(api.create_app(Full(), Tokenizer(), "m", VOCAB, None))
    props = app.get("/openapi.json").json()["components"]["schemas"][body]["properties"]
    chat = body == "ChatCompletionRequest"
    path, base = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}) if chat else \
        ("/v1/completions", {"prompt": "hi"})
    needs = {**NEEDS, **({} if chat else {"max_tokens": {"echo": True}})}
    tried = 0
    for name, prop in props.items():
        for form, wrap in numeric_forms(prop):
            integral = form["type"] == "integer"
            for key, (inside, past) in BOUNDS.items():
                if key not in form:
                    continue
                bound = form[key]
                assert not integral or type(bound) is int, (name, key, bound)
                step = 1 if integral else 1e-3
                takes = [bound + inside * step] + ([float(bound + inside * step)] if integral else [])
                for value in takes:
                    r = app.post(path, json={"model": "m", **base, **needs.get(name, {}), name: wrap(value)})
                    assert r.status_code == 429, (name, value, r.json())
                r = app.post(path, json={"model": "m", **base, **needs.get(name, {}), name: wrap(bound + past * step)})
                assert r.status_code == 400 and r.json()["error"]["param"].split("[")[0] == name, (name, r.json())
                tried += 1
    assert tried >= 12
