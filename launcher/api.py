"""`hpipe serve`'s HTTP front end: the OpenAI API (FastAPI) on a `PipelineClient`.

    GET  /v1/models             the served model
    POST /v1/completions        prompt (text or token ids) -> text; "stream": true as server-sent events
    POST /v1/chat/completions   messages through the model's chat template -> the assistant's reply
    GET  /health                200 while the pipeline runs, 503 once it failed
    GET  /metrics               Prometheus text: queue, running, KV pages, preemptions, TTFT/TPOT, micro-batch sizes
    GET  /hpipe/microbatches    the recent micro-batches' (time, decode tokens, prefill tokens), for benchmarks
    GET  /openapi.json, /docs   the request bodies below, as FastAPI describes them

The OpenAI sampling fields map onto hpipe's (temperature, top_p, max_tokens / max_completion_tokens,
seed, stop, presence_penalty, frequency_penalty; top_k, min_p, repetition_penalty, stop_token_ids and
ignore_eos as the extra fields vLLM accepts), logit_bias, n (choice i with seed + i, after the
first's prefill), logprobs / top_logprobs and completions' echo (the model's raw distribution, from
the last stage), and structured output (response_format, guided_json / guided_regex /
guided_choice: hpipe.grammar's mask in the CPU sampler). Bad input gets OpenAI's error object with
a 4xx that names the field; the server stays up. A client that goes away mid-request has its request aborted
and its KV pages freed at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpipe import grammar as grammars
from hpipe.errors import HpipeError
from hpipe.launcher.serving import Handle, PipelineClient
from hpipe.request import MAX_LOGPROBS, SamplingError, SamplingParams

__all__ = ["ApiError", "create_app"]

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
SAMPLING_FIELDS = tuple(SamplingParams.__dataclass_fields__)   # the OpenAI / vLLM names are hpipe's


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, kind: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param, e.status), status_code=e.status)


# ---------------------------------------------------------------------------------------- fields
def _field(body: dict, name: str, types, default, what: str):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)}", name)
    if not isinstance(value, types):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:60]}", name)
    return value


def _int(body: dict, name: str, default: int | None, lo: int) -> int | None:
    v = _field(body, name, int, default, "an integer")
    if v is not None and v < lo:
        raise ApiError(400, f"'{name}' must be at least {lo}, got {v}", name)
    return v


def logprobs_field(body: dict, chat: bool) -> int | None:
    """How many top log-probabilities a request asks for with each token (0: the sampled token's
    alone), or None: chat's `logprobs` (true/false) and `top_logprobs`, completions' `logprobs` (a
    count)."""
    if chat:
        wanted = _field(body, "logprobs", bool, False, "true or false")
        top = _field(body, "top_logprobs", int, None, "an integer")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if wanted else None
    if body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' is a chat field; completions take 'logprobs': N", "top_logprobs")
    top = _field(body, "logprobs", int, None, "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "logprobs")
    return top


def sampling_fields(body: dict, vocab: int, chat: bool = False) -> tuple[SamplingParams, frozenset[int], bool,
                                                                          list[str]]:
    """The request's sampling parameters (checked by SamplingParams' own rules, the same as the CLI's
    and the prompts file's), stop token ids, ignore_eos and stop strings."""
    for name in ("suffix", "tools", "functions") + (("echo",) if chat else ()):
        if body.get(name) not in (None, False, 0, {}):
            raise ApiError(400, f"'{name}' is not supported by hpipe{' on chat' if name == 'echo' else ''}; "
                                f"leave it out", name)
    if body.get("prompt_logprobs") is not None:
        raise ApiError(400, "'prompt_logprobs': ask for a prompt's log-probabilities with 'echo': true and "
                            "'logprobs' on /v1/completions", "prompt_logprobs")
    if _int(body, "best_of", 1, 1) != 1:
        raise ApiError(400, "'best_of' must be 1", "best_of")
    fields = {name: body[name] for name in SAMPLING_FIELDS
              if name not in ("logprobs", "grammar", "prompt_logprobs") and body.get(name) is not None}
    fields["logprobs"] = logprobs_field(body, chat)
    fields["grammar"] = grammar_field(body)
    if not chat and _field(body, "echo", bool, False, "true or false"):
        fields["prompt_logprobs"] = fields["logprobs"]
    if fields.get("top_k") == -1:            # vLLM's and OpenAI-style "off"
        fields["top_k"] = 0
    if isinstance(fields.get("seed"), int) and not isinstance(fields["seed"], bool):
        fields["seed"] &= (1 << 63) - 1
    bias = fields.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must be an object of token ids to biases in [-100, 100]", "logit_bias")
    if bias and any(not str(k).isdigit() or int(k) >= vocab for k in bias):
        raise ApiError(400, f"'logit_bias' keys must be token ids in [0, {vocab})", "logit_bias")
    try:
        params = SamplingParams(**fields)
    except SamplingError as e:
        shown = json.dumps(e.value)[:60] if not isinstance(e.value, float) else f"{e.value:g}"
        raise ApiError(400, f"'{e.field}' must be {e.rule}, got {shown}", e.field) from None
    stop_ids = _field(body, "stop_token_ids", list, [], "a list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids):
        raise ApiError(400, f"'stop_token_ids' must hold token ids in [0, {vocab})", "stop_token_ids")
    ignore_eos = _field(body, "ignore_eos", bool, False, "true or false")
    stop = _field(body, "stop", (str, list), [], "a string or a list of strings")
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 16 non-empty strings", "stop")
    return params, frozenset(stop_ids), ignore_eos, stops


GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice")


def guided_fields(body: dict) -> list[str]:
    """The structured-output fields the body gives (`response_format` of type text is none)."""
    return [name for name in GUIDED if body.get(name) is not None
            and not (name == "response_format" and isinstance(body[name], dict) and body[name].get("type") == "text")]


def grammar_field(body: dict) -> str | None:
    """The request's structured output as a grammar (None: free text): OpenAI's `response_format`
    (json_object, json_schema) or vLLM's `guided_json` / `guided_regex` / `guided_choice`, one of them."""
    given = guided_fields(body)
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"give one kind of structured output, not {' and '.join(given)}", given[1])
    name, value = given[0], body[given[0]]
    try:
        if name == "response_format":
            kind = value.get("type") if isinstance(value, dict) else None
            if kind == "json_object":
                return grammars.json_object_grammar()
            if kind != "json_schema":
                raise ApiError(400, "'response_format.type' must be text, json_object or json_schema", name)
            schema = (value.get("json_schema") or {}).get("schema") if isinstance(value.get("json_schema"), dict) \
                else None
            if not isinstance(schema, dict):
                raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema (an object)", name)
            return grammars.json_schema_grammar(schema)
        if name == "guided_json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise ApiError(400, "'guided_json' must be a JSON schema (an object, or its text)", name)
            return grammars.json_schema_grammar(schema)
        if name == "guided_regex":
            if not isinstance(value, str) or not value:
                raise ApiError(400, "'guided_regex' must be a non-empty regular expression", name)
            return grammars.regex_grammar(value)
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, "'guided_choice' must be a non-empty list of non-empty strings", name)
        return grammars.choice_grammar(value)
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"'{name}' is not a grammar hpipe can compile: {e}", name) from None
    except HpipeError as e:
        raise ApiError(400, str(e), name) from None


async def check_grammar(st: ServerState, body: dict, params: SamplingParams, ignore_eos: bool) -> None:
    """A grammar the engine cannot compile is a 400 naming its field (compiled off the event loop)."""
    if params.grammar is None:
        return
    name = guided_fields(body)[0]
    if ignore_eos:
        raise ApiError(400, f"'ignore_eos' cannot go with '{name}': a finished grammar ends with the model's EOS",
                       "ignore_eos")
    try:
        problem = await asyncio.to_thread(st.grammars.check, params.grammar)
    except HpipeError as e:
        raise ApiError(400, str(e), name) from None
    if problem:
        raise ApiError(400, f"'{name}' does not compile: {problem.splitlines()[0][:300]}", name)


def prompts_of(body: dict, tokenizer, vocab: int) -> list[tuple[list[int], str | None]]:
    """The completion request's prompts, each as (token ids, its text when given as text): one
    string or list of token ids, or a list of those (a batch: choice i * n + j is prompt i's j-th)."""
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt")
    p = body["prompt"]
    many = isinstance(p, list) and bool(p) and all(isinstance(x, (str, list)) for x in p)
    return [_one_prompt(x, tokenizer, vocab, f"prompt[{i}]" if many else "prompt")
            for i, x in enumerate(p if many else [p])]


def _one_prompt(p, tokenizer, vocab: int, where: str) -> tuple[list[int], str | None]:
    if isinstance(p, str):
        if not p:
            raise ApiError(400, f"'{where}' is empty", "prompt")
        return [int(t) for t in tokenizer(p)["input_ids"]], p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"'{where}' token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        return list(p), None
    raise ApiError(400, f"'{where}' must be a non-empty string or list of token ids (or 'prompt' a list of those)",
                   "prompt")


def chat_ids(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"'messages[{i}].role' must be one of system, user, assistant, developer",
                           f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):    # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ApiError(400, f"'messages[{i}].content' parts must be text parts (hpipe serves a text model)",
                               f"messages[{i}].content")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"'messages[{i}].content' must be a string", f"messages[{i}].content")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    ids = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# ---------------------------------------------------------------------------------------- text out
class TextStream:
    """Token ids -> text as it becomes final (incremental detokenization, as vLLM does: each token is
    decoded with a few tokens before it, never the whole output again), holding back what may be the
    start of a stop string and anything that ends in half a character."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.prefix, self.read = 0, 0          # ids[prefix:read] were decoded last time (context for the next)
        self.text = ""
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False
        self.tokens_used = 0                   # tokens up to the one that completed a stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        hits = [h for h in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if h >= 0]
        if hits:
            self.stopped = True
            self.tokens_used = len(self.ids)
            return self._take(min(hits))
        return self._take(len(self.text) - self.hold)

    def finish(self) -> str:
        if self.stopped:
            return ""
        if self.read < len(self.ids):     # a trailing half character: whatever the tokenizer makes of it
            self.text += self._decode(self.ids[self.prefix:])[len(self._decode(self.ids[self.prefix:self.read])):]
            self.read = len(self.ids)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out


# ---------------------------------------------------------------------------------------- schema
# The request bodies as /openapi.json and /docs describe them: what the handlers above read (their
# rules live there: these models only document them; extra fields are refused by name or ignored).
class Message(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict] = Field(description="text, or text parts [{\"type\": \"text\", \"text\": ...}]")


class JsonSchemaFormat(BaseModel):
    name: str
    schema_: dict = Field(alias="schema", description="the JSON schema the reply must follow")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingBody(BaseModel):
    model: str = Field(description="the served model (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate (completions: 16; 0 only with echo)")
    n: int = Field(1, ge=1, description="choices: one prefill, n decodes; choice i samples with seed + i")
    temperature: float | None = Field(None, ge=0, le=5)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM's; 0 or -1: off")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="up to 16 strings; the text ends before the first")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    stream: bool = False
    stream_options: dict | None = Field(None, description="{\"include_usage\": true}: a last chunk with usage")
    return_tokens_as_token_ids: bool = False
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = Field(None, description="vLLM's: a JSON schema the output follows")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    speculative: bool | None = Field(None, description="false: this request's decode steps carry no proposed "
                                                       "tokens when the server runs with --speculative")


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(description="one prompt: text or token ids")
    echo: bool = Field(False, description="the prompt first (with logprobs: its log-likelihood)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top log-probabilities per token")


class ChatBody(SamplingBody):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def described(body: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its request body, its models' schemas referenced from components."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}}


def openapi_of(app: FastAPI):
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in (CompletionBody, ChatBody)],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi


# ---------------------------------------------------------------------------------------- the app
@dataclass(frozen=True)
class ServerState:
    """What every handler reads: one object, on `app.state.hpipe`."""

    client: PipelineClient
    tokenizer: object
    model_name: str
    vocab: int
    api_key: str | None
    max_queue: int
    created: int
    grammars: grammars.GrammarVocabulary     # what structured output is checked against (built on first use)


def create_app(client: PipelineClient, tokenizer, model_name: str, vocab: int, api_key: str | None = None,
               max_queue: int = 256) -> FastAPI:
    app = FastAPI(title="hpipe", description="The OpenAI API in front of an hpipe pipeline", redoc_url=None)
    app.openapi = openapi_of(app)
    app.state.hpipe = ServerState(client, tokenizer, model_name, vocab, api_key, max_queue, int(time.time()),
                                  grammars.GrammarVocabulary(client.job.source.path, vocab))
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.get("/hpipe/microbatches")(microbatches)
    app.get("/v1/models")(list_models)
    app.post("/v1/completions", openapi_extra=described(CompletionBody))(completions)
    app.post("/v1/chat/completions", openapi_extra=described(ChatBody))(chat_completions)
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.hpipe


async def api_error(request: Request, e: ApiError):
    return error_response(e)


async def http_error(request: Request, e: StarletteHTTPException):
    msg = f"{request.method} {request.url.path}: " + ("no such endpoint" if e.status_code == 404 else str(e.detail))
    return JSONResponse(error_body(msg, "invalid_request_error", None, e.status_code), status_code=e.status_code)


def authorize(request: Request) -> None:
    api_key = _state(request).api_key
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if not token or not hmac.compare_digest(token.encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key given "
                            "to hpipe serve --api-key", None, "authentication_error")


async def read_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model, served = body.get("model"), _state(request).model_name
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required (GET /v1/models lists it)", "model")
    if model != served:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served}'", "model",
                       "not_found_error")
    return body


async def health(request: Request):
    client = _state(request).client
    if client.failure is not None:
        return JSONResponse({"status": "failed", "error": client.failure}, status_code=503)
    return {"status": "ok"}


async def metrics(request: Request):
    return PlainTextResponse(_state(request).client.prometheus(), media_type="text/plain; version=0.0.4")


async def microbatches(request: Request):
    client = _state(request).client
    return {"policy": client.settings.runtime.policy, "microbatches": list(client.metrics.microbatches),
            "stats": client.stats}


async def list_models(request: Request):
    authorize(request)
    st = _state(request)
    return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": st.created,
                                        "owned_by": "hpipe", "max_model_len": st.client.max_model_len}]}


async def completions(request: Request):
    authorize(request)
    body = await read_body(request)
    st = _state(request)
    return await generate(request, body, prompts_of(body, st.tokenizer, st.vocab), chat=False)


async def chat_completions(request: Request):
    authorize(request)
    body = await read_body(request)
    return await generate(request, body, [(chat_ids(body, _state(request).tokenizer), None)], chat=True)


async def generate(request: Request, body: dict, prompts: list[tuple[list[int], str | None]], chat: bool):
    st = _state(request)
    client = st.client
    params, stop_ids, ignore_eos, stops = sampling_fields(body, st.vocab, chat)
    await check_grammar(st, body, params, ignore_eos)
    limit = client.max_model_len
    ids = max((ids for ids, _ in prompts), key=len)
    room = limit - len(ids)
    if chat:
        max_tokens = _int(body, "max_completion_tokens", None, 1) or _int(body, "max_tokens", None, 1) or room
    else:     # with echo, 0: the prompt's log-likelihood alone (one token is sampled and dropped)
        max_tokens = _int(body, "max_tokens", 16, 0 if body.get("echo") else 1)
    param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if room < 1 or max_tokens > room:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens; the request has {len(ids)} "
                            f"prompt tokens and asks for {max_tokens} more ({len(ids) + max_tokens} in all); "
                            f"shorten the prompt or lower '{param}'", param)
    n = _int(body, "n", 1, 1)
    if n > client.max_batch:
        raise ApiError(400, f"'n' must be at most the server's batch ({client.max_batch}: --max-batch), got {n}", "n")
    stream = _field(body, "stream", bool, False, "true or false")
    options = _field(body, "stream_options", dict, {}, "an object")
    if client.failure is not None:
        raise ApiError(503, f"the pipeline failed: {client.failure}", None, "server_error")
    if len(prompts) * n > client.max_batch + st.max_queue:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} choices is more than the server takes at once "
                            f"({client.max_batch + st.max_queue}: --max-batch + --max-queue); send fewer", "prompt")
    if client.load() + len(prompts) * n > client.max_batch + st.max_queue:
        raise ApiError(429, f"the server has {client.load()} requests open, its limit "
                            f"(--max-batch + --max-queue); retry later", None, "rate_limit_error")
    loop = asyncio.get_running_loop()
    token_ids = _field(body, "return_tokens_as_token_ids", bool, False, "true or false")
    kind = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    echoes = not chat and bool(body.get("echo"))
    answers: list[Answer] = []
    try:
        for ids, text in prompts:
            echo = (text if text is not None else st.tokenizer.decode(ids)) if echoes else None
            first = len(answers)
            for j, choice_params in enumerate(choice_sampling(params, n)):
                if j == 1 and client.prefix_caching and not await first_token(request, client, answers[first].handle):
                    for a in answers:
                        client.abort(a.handle)
                    return JSONResponse(error_body("the client closed the connection", "invalid_request_error"),
                                        status_code=499)
                handle = client.submit(ids, choice_params, max(1, max_tokens), stop_ids, ignore_eos, loop)
                answers.append(Answer(kind, chat, st.model_name, handle, TextStream(st.tokenizer, stops),
                                      st.tokenizer, token_ids, index=len(answers), echo=echo,
                                      generates=max_tokens > 0, counts_prompt=j == 0))
    except HpipeError as e:
        for a in answers:
            client.abort(a.handle)
        raise ApiError(503, f"the pipeline failed: {e}", None, "server_error") from None
    streams = [answer_events(request, client, a) for a in answers]
    if stream:
        return StreamingResponse(stream_answer(answers, streams, bool(options.get("include_usage"))),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await whole_answer(answers, streams)


def choice_sampling(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of n choices: choice i with seed + i when the request has a seed (as
    vLLM derives its children's), its own random stream otherwise."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) & ((1 << 63) - 1)) for i in range(n)]


async def first_token(request: Request, client: PipelineClient, handle: Handle) -> bool:
    """Waits until the first choice's prompt is in the KV cache (its first token came), so that the
    other n - 1 choices start after its cached prefix: one prefill, n decodes. False: the client
    went away (the first choice is aborted)."""
    while True:
        try:
            await asyncio.wait_for(handle.started.wait(), timeout=0.5)
            return True
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                client.abort(handle)
                return False


@dataclass
class Answer:
    """One request's answer on its way out: its id, its kind, its text."""

    id: str
    chat: bool
    model: str
    handle: Handle
    text: TextStream
    tokenizer: object = None
    token_ids: bool = False        # vLLM's return_tokens_as_token_ids: tokens named "token_id:N"
    index: int = 0                 # the choice's index (n > 1)
    echo: str | None = None        # completions' echo: the prompt's text, first
    generates: bool = True         # False: max_tokens 0 with echo (the one token sampled is dropped)
    counts_prompt: bool = True     # the first choice of its prompt (usage counts a prompt once)
    offset: int = 0                # completions' text_offset of the next token

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def wants_logprobs(self) -> bool:
        return self.handle.request.params.logprobs is not None

    @property
    def prompt_entries(self) -> int:
        """The prompt log-probabilities it waits for (every prompt token but the first)."""
        request = self.handle.request
        return len(request.input_ids) - 1 if request.params.prompt_logprobs is not None else 0

    def logprobs(self, entries: list) -> dict | None:
        """OpenAI's logprobs object for these tokens ([token, log-probability, top] each; None and
        None for an echoed prompt's first): chat's `content` list, or completions' parallel lists."""
        if not self.wants_logprobs:
            return None
        name = (lambda t: f"token_id:{t}") if self.token_ids else (lambda t: self.tokenizer.decode([t]))  # noqa: E731
        if self.chat:
            return {"content": [{"token": name(t), "logprob": lp, "bytes": list(name(t).encode()),
                                 "top_logprobs": [{"token": name(a), "logprob": v, "bytes": list(name(a).encode())}
                                                  for a, v in top]} for t, lp, top in entries]}
        offsets = []
        for t, _, _ in entries:
            offsets.append(self.offset)
            self.offset += len(name(t))
        return {"tokens": [name(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else {name(a): v for a, v in top} for _, _, top in entries]
                if self.handle.request.params.logprobs else None, "text_offset": offsets}

    def chunk(self, piece: str | None, finish: str | None, first: bool = False, entries: list = ()) -> dict:
        logprobs = self.logprobs(list(entries)) if entries else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": self.index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
        return {"id": self.id, "object": self.object, "created": int(time.time()), "model": self.model,
                "choices": [choice]}

    @property
    def completion_tokens(self) -> int:
        if not self.generates:
            return 0
        return self.text.tokens_used if self.text.stopped else len(self.handle.output)


def usage(answers: list[Answer]) -> dict:
    """Every prompt once (its n choices share it), every choice's tokens."""
    p = sum(len(a.handle.request.input_ids) for a in answers if a.counts_prompt)
    c = sum(a.completion_tokens for a in answers)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


LOGPROB_WAIT_S = 10.0      # how long an ended request's reader waits for log-probabilities still on their way


async def answer_events(request: Request, client: PipelineClient, answer: Answer):
    """The one state machine of a request's answer, for streaming and whole answers alike: yields
    ("text", piece, entries) as text becomes final, then one of ("finish", reason, entries),
    ("error", message, ()) or ("gone", None, ()) (the client went away; its connection is checked
    every half second, whether tokens flow or not); `entries` are the log-probabilities of the
    tokens taken since the last yield, when the request asked for them (each token waits for its
    entry, which the last stage reports apart from the token). A request that does not reach its
    end (its client went away, or the consumer stopped) is aborted, so that stage 0 frees its KV
    pages now; one that matched a stop string is aborted as "stop"."""
    handle, text = answer.handle, answer.text
    wants = answer.wants_logprobs
    tokens: collections.deque = collections.deque()
    logprobs: collections.deque = collections.deque()
    prompt: list = []                  # an echoed prompt's log-probabilities, [position, token, lp, top]
    entries: list = []
    end, ended, checked, deadline = None, False, time.monotonic(), None
    echoed = answer.echo is None
    try:
        while True:
            if not echoed and (len(prompt) >= answer.prompt_entries or (deadline and time.monotonic() > deadline)):
                echoed = True
                ids = handle.request.input_ids
                first = [[ids[0], None, None]] if answer.prompt_entries else []
                yield "text", answer.echo, first + [e[1:] for e in sorted(prompt)] if wants else []
            while echoed and tokens and (logprobs or not wants or (deadline and time.monotonic() > deadline)):
                token = tokens.popleft()
                entry = logprobs.popleft() if wants and logprobs else None
                if not answer.generates:
                    continue
                if entry is not None:
                    entries.append(entry)
                piece = text.add(token)
                if text.stopped:
                    ended = True
                    client.abort(handle, "stop")
                    if piece:
                        yield "text", piece, entries
                        entries = []
                    yield "finish", "stop", entries
                    return
                if piece:
                    yield "text", piece, entries
                    entries = []
            if echoed and end is not None and not tokens:
                ended = True
                piece = text.finish() if answer.generates else ""
                if piece:
                    yield "text", piece, entries
                    entries = []
                yield "finish", FINISH.get(end, "stop") if answer.generates else "length", entries
                return
            if time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if await request.is_disconnected():
                    yield "gone", None, ()
                    return
            try:
                kind, value = await asyncio.wait_for(handle.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                continue
            if kind == "error":
                ended = True
                yield "error", value, ()
                return
            if kind == "token":
                tokens.append(value)
            elif kind == "logprob":
                logprobs.append(value)
            elif kind == "prompt_logprob":
                prompt.append(value)
            else:
                end = value
                deadline = time.monotonic() + LOGPROB_WAIT_S
    finally:
        client.forget(handle)
        if not ended:
            client.abort(handle)


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def merged(streams: list):
    """The events of several answers as they come: (choice index, event)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, events) -> None:
        try:
            async for event in events:
                await queue.put((i, event))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, events)) for i, events in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, event = await queue.get()
            if event is None:
                live -= 1
            else:
                yield i, event
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)   # each stream's own ending aborts its request


async def stream_answer(answers: list[Answer], streams: list, with_usage: bool):
    head = answers[0]
    events = merged(streams)
    try:
        if head.chat:
            for a in answers:
                yield sse(a.chunk(None, None, first=True))
        async for i, (kind, value, entries) in events:
            if kind == "gone":
                return
            if kind == "error":
                yield sse(error_body(value, "server_error", None, 500))
                yield "data: [DONE]\n\n"
                return
            if kind == "text":
                yield sse(answers[i].chunk(value, None, entries=entries))
            else:
                yield sse(answers[i].chunk(None, value, entries=entries))
        if with_usage:
            yield sse({"id": head.id, "object": head.object, "created": int(time.time()), "model": head.model,
                       "choices": [], "usage": usage(answers)})
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()      # the client went away mid-stream: the requests are aborted now


async def whole_choice(answer: Answer, events):
    """One choice's whole answer, or the error response that ends the request."""
    pieces, finish, taken = [], "stop", []
    try:
        async for kind, value, entries in events:
            if kind == "gone":
                return JSONResponse(error_body("the client closed the connection", "invalid_request_error"),
                                    status_code=499)
            if kind == "error":
                return JSONResponse(error_body(f"the pipeline failed: {value}", "server_error", None, 500),
                                    status_code=500)
            taken += entries
            if kind == "text":
                pieces.append(value)
            else:
                finish = value
    finally:
        await events.aclose()
    content = "".join(pieces)
    logprobs = answer.logprobs(taken)
    if answer.chat:
        return {"index": answer.index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": answer.index, "text": content, "logprobs": logprobs, "finish_reason": finish}


async def whole_answer(answers: list[Answer], streams: list):
    choices = await asyncio.gather(*(whole_choice(a, events) for a, events in zip(answers, streams)))
    failed = [c for c in choices if isinstance(c, JSONResponse)]
    if failed:
        return failed[0]
    head = answers[0]
    return {"id": head.id, "object": "chat.completion" if head.chat else "text_completion",
            "created": int(time.time()), "model": head.model, "choices": choices, "usage": usage(answers)}
