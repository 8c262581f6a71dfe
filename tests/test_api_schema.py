"""/openapi.json describes the request bodies the server really reads: every field the API's
parsers look at is in the schema (recorded while they parse a body holding every field), and
every documented field is one they read."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hpipe.launcher import api


class Recording(dict):
    """A request body that notes the fields read from it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


class Tokenizer:
    def __call__(self, text):
        return {"input_ids": [1, 2, 3]}


@pytest.fixture(scope="module")
def schema() -> dict:
    class Client:
        class job:
            class source:
                path = "/nowhere"
    app = api.create_app(Client(), Tokenizer(), "m", 100)
    client = TestClient(app)
    assert client.get("/docs").status_code == 200
    return client.get("/openapi.json").json()


# what `generate` reads beside the sampling fields (its own parsing is inline)
GENERATE = {"max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "echo",
            "return_tokens_as_token_ids", "model"}


@pytest.mark.parametrize("chat", [False, True])
def test_every_field_the_parsers_read_is_documented_and_back(schema, chat):
    name = "ChatBody" if chat else "CompletionBody"
    documented = set(schema["components"]["schemas"][name]["properties"])
    body = Recording({"model": "m", "temperature": 0.5, "logprobs": chat or 2})
    api.sampling_fields(body, 100, chat)
    if chat:
        body.read.add("messages")
    else:
        api.prompts_of(Recording({"prompt": "x"}), Tokenizer(), 100)
        body.read.add("prompt")
    read = (body.read | GENERATE) - ({"echo"} if chat else {"max_completion_tokens"})
    # read only to be refused by name
    read -= {"suffix", "tools", "functions", "best_of", "prompt_logprobs"} | (set() if chat else {"top_logprobs"})
    assert read - documented == set(), "read but not documented"
    assert documented - read == set(), "documented but never read"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    assert schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"] \
        == f"#/components/schemas/{name}"
