"""`hpipe serve`'s HTTP front end: the OpenAI API (FastAPI) on a `PipelineClient`.

    GET  /v1/models             the served model
    POST /v1/completions        prompt (text or token ids) -> text; "stream": true as server-sent events
    POST /v1/chat/completions   messages through the model's chat template -> the assistant's reply
    GET  /                      the live page: hosts, plan, stages' busy, requests, events, a chat box
                                (launcher/dashboard.py; it polls /hpipe/state, behind --api-key)
    GET  /health                200 while the pipeline runs ("ok", or "recovering" while a lost host's
                                pipeline is planned again), 503 when degraded (the hosts up cannot
                                hold the model) or once it failed
    GET  /metrics               Prometheus text: queue, running, KV pages, preemptions, TTFT/TPOT, micro-batch sizes
    GET  /hpipe/microbatches    the recent micro-batches' (time, decode tokens, prefill tokens), for benchmarks
    GET  /hpipe/events          hosts lost and taken back, each event's phases (notice, re-plan, start, re-prefill)
    GET  /hpipe/state           what the page shows, as one JSON object (behind --api-key)
    GET  /openapi.json, /docs   the request bodies (launcher/bodies.py), as FastAPI describes them

The OpenAI sampling fields map onto hpipe's (temperature, top_p, max_tokens / max_completion_tokens,
seed, stop, presence_penalty, frequency_penalty; top_k, min_p, repetition_penalty, stop_token_ids and
ignore_eos as the extra fields vLLM accepts), logit_bias, n (choice i with seed + i, after the
first's prefill), logprobs / top_logprobs and completions' echo (the model's raw distribution, from
the last stage), and structured output (response_format, guided_json / guided_regex /
guided_choice: hpipe.grammar's mask in the CPU sampler). The bodies are parsed by their typed
models before a handler runs (launcher/bodies.py); bad input gets OpenAI's error object with a 4xx
that names the field, and the server stays up. A request's text, log-probabilities and end come
assembled from launcher/output.py: the handlers here format them. A client that goes away
mid-request has its request aborted and its KV pages freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpipe import grammar as grammars
from hpipe.errors import HpipeError
from hpipe.launcher import dashboard
from hpipe.launcher.bodies import (SEED_BITS, ApiRuleError, ChatCompletionRequest, CompletionRequest, SamplingRequest,
                                   describe)
from hpipe.launcher.output import RequestOutput
from hpipe.launcher.serving import Handle, PipelineClient
from hpipe.request import SamplingParams

__all__ = ["ApiError", "create_app"]

class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, kind: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param, e.status), status_code=e.status)


async def check_grammar(st: ServerState, body: SamplingRequest, params: SamplingParams) -> None:
    """A grammar the engine cannot compile for this model is a 400 naming its field (compiled off
    the event loop)."""
    if params.grammar is None:
        return
    name = body.guided_fields[0]
    if body.ignore_eos:
        raise ApiError(400, f"'ignore_eos' cannot go with '{name}': a finished grammar ends with the model's EOS",
                       "ignore_eos")
    try:
        problem = await asyncio.to_thread(st.grammars.check, params.grammar)
    except HpipeError as e:
        raise ApiError(400, str(e), name) from None
    if problem:
        raise ApiError(400, f"'{name}' does not compile: {problem.splitlines()[0][:300]}", name)


# ---------------------------------------------------------------------------------------- the app
@dataclass(frozen=True)
class ServerState:
    """What every handler reads: one object, on `app.state.hpipe`."""

    client: PipelineClient
    tokenizer: object                        # the event loop's: prompts, chat templates, echo, token names
    detokenizer: object                      # the report thread's: the outputs' text
    model_name: str
    vocab: int
    api_key: str | None
    created: int
    grammars: grammars.GrammarVocabulary     # what structured output is checked against (built on first use)


class JsonBodies:
    """A POST's body is JSON whatever its Content-Type says (`curl -d` sends form-urlencoded), as
    OpenAI's server and hpipe's own before the typed bodies took it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def create_app(client: PipelineClient, tokenizer, model_name: str, vocab: int, api_key: str | None) -> FastAPI:
    app = FastAPI(title="hpipe", description="The OpenAI API in front of an hpipe pipeline", redoc_url=None)
    app.add_middleware(JsonBodies)
    # the outputs detokenize on the client's report thread: their own copy of the tokenizer (a fast
    # tokenizer used from two threads at once can fail with "Already borrowed")
    app.state.hpipe = ServerState(client, tokenizer, copy.deepcopy(tokenizer), model_name, vocab, api_key,
                                  int(time.time()), grammars.GrammarVocabulary(client.job.source.path, vocab))
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.get("/", include_in_schema=False)(page)
    app.get("/health")(health)
    app.get("/hpipe/state", dependencies=[Depends(authorize)])(state)
    app.get("/metrics")(metrics)
    app.get("/hpipe/microbatches")(microbatches)
    app.get("/hpipe/events")(events)
    app.get("/v1/models", dependencies=[Depends(authorize)])(list_models)
    app.post("/v1/completions", dependencies=[Depends(authorize)])(completions)
    app.post("/v1/chat/completions", dependencies=[Depends(authorize)])(chat_completions)
    describe_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's description, with an integer field's bounds written as integers (FastAPI's own
        schema model holds every bound as a float: 20.0)."""
        if app.openapi_schema is None:
            app.openapi_schema = _integer_bounds(describe_openapi())
        return app.openapi_schema

    app.openapi = openapi
    return app


def _integer_bounds(node):
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.update({k: int(v) for k, v in node.items()
                         if k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")})
        for value in node.values():
            _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _integer_bounds(value)
    return node


def _state(request: Request) -> ServerState:
    return request.app.state.hpipe


async def api_error(request: Request, e: ApiError):
    return error_response(e)


async def validation_error(request: Request, e: RequestValidationError):
    """The one handler of bodies that do not parse: OpenAI's error body, naming the field."""
    message, param = describe(list(e.errors()), (CompletionRequest, ChatCompletionRequest))
    return error_response(ApiError(400, message, param))


async def http_error(request: Request, e: StarletteHTTPException):
    msg = f"{request.method} {request.url.path}: " + ("no such endpoint" if e.status_code == 404 else str(e.detail))
    return JSONResponse(error_body(msg, "invalid_request_error", None, e.status_code), status_code=e.status_code)


def authorize(request: Request) -> None:
    """/v1's key, checked before the body is parsed."""
    api_key = _state(request).api_key
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if not token or not hmac.compare_digest(token.encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key given "
                            "to hpipe serve --api-key", None, "authentication_error")


def served(st: ServerState, body: SamplingRequest) -> None:
    if body.model != st.model_name:
        raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{st.model_name}'", "model",
                       "not_found_error")


async def health(request: Request):
    status, body = _state(request).client.health()
    return JSONResponse(body, status_code=status)


async def page(request: Request):
    """The live page (launcher/dashboard.py): public, as it holds no data; it asks for the key."""
    return HTMLResponse(dashboard.PAGE.html, headers={"Content-Security-Policy": dashboard.PAGE.policy,
                                                      "Cache-Control": "no-store"})


async def state(request: Request):
    st = _state(request)
    return dashboard.state(st.client, st.model_name)


async def metrics(request: Request):
    return PlainTextResponse(_state(request).client.prometheus(), media_type="text/plain; version=0.0.4")


async def microbatches(request: Request):
    client = _state(request).client
    return {"policy": client.settings.runtime.policy, "microbatches": list(client.metrics.microbatches),
            "stats": client.stats}


async def events(request: Request):
    """Hosts lost and taken back, with each event's phases (launcher/elastic.py `Recovery`)."""
    client = _state(request).client
    return {"events": [e.as_dict() for e in client.metrics.events], "degraded": client.degraded,
            "stages": [f"{s.host}/{s.device}" for s in client.plan.stages] if client.plan else []}


async def list_models(request: Request):
    st = _state(request)
    return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": st.created,
                                        "owned_by": "hpipe", "max_model_len": st.client.max_model_len}]}


async def completions(body: CompletionRequest, request: Request):
    st = _state(request)
    served(st, body)
    with rule_errors():
        prompts = body.prompts(st.tokenizer, st.vocab)
    # with echo, max_tokens 0: the prompt's log-likelihood alone (one token is sampled and dropped)
    return await generate(request, body, prompts, body.max_tokens, "max_tokens")


async def chat_completions(body: ChatCompletionRequest, request: Request):
    st = _state(request)
    served(st, body)
    with rule_errors():
        ids = body.prompt_ids(st.tokenizer)
    room = st.client.max_model_len - len(ids)
    return await generate(request, body, [(ids, None)], body.max_completion_tokens or body.max_tokens or room,
                          body.max_tokens_param)


@contextlib.contextmanager
def rule_errors():
    """A rule that needs the served model, broken: a 400 naming the field."""
    try:
        yield
    except ApiRuleError as e:
        raise ApiError(400, str(e), e.param) from None


async def generate(request: Request, body: SamplingRequest, prompts: list[tuple[list[int], str | None]],
                   max_tokens: int, max_param: str):
    st = _state(request)
    client = st.client
    with rule_errors():
        params = body.sampling_params(st.vocab)
    await check_grammar(st, body, params)
    limit = client.max_model_len
    ids = max((ids for ids, _ in prompts), key=len)
    room = limit - len(ids)
    if room < 1 or max_tokens > room:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens; the request has {len(ids)} "
                            f"prompt tokens and asks for {max_tokens} more ({len(ids) + max_tokens} in all); "
                            f"shorten the prompt or lower '{max_param}'", max_param)
    n = body.n
    if n > client.max_batch:
        raise ApiError(400, f"'n' must be at most the server's batch ({client.max_batch}: --max-batch), got {n}", "n")
    if client.failure is not None:
        raise ApiError(503, f"the pipeline failed: {client.failure}", None, "server_error")
    if client.degraded is not None:
        raise ApiError(503, f"the service is degraded: {client.degraded}", None, "server_error")
    if len(prompts) * n > client.capacity:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} choices is more than the server takes at once "
                            f"({client.capacity}: --max-batch + --max-queue); send fewer", "prompt")
    if client.load() + len(prompts) * n > client.capacity:
        raise ApiError(429, f"the server has {client.load()} requests open, its limit "
                            f"(--max-batch + --max-queue); retry later", None, "rate_limit_error")
    loop = asyncio.get_running_loop()
    chat = isinstance(body, ChatCompletionRequest)
    kind = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    echoes = not chat and body.echo
    stop_ids = frozenset(body.stop_token_ids or ())
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
                one = client.request(ids, choice_params, max(1, max_tokens), stop_ids, body.ignore_eos)
                output = RequestOutput(one, st.detokenizer, body.stops, echo, generates=max_tokens > 0)
                answers.append(Answer(kind, chat, st.model_name, client.submit_request(one, loop, output),
                                      st.tokenizer, body.return_tokens_as_token_ids, index=len(answers),
                                      counts_prompt=j == 0))
    except HpipeError as e:
        for a in answers:
            client.abort(a.handle)
        raise ApiError(503, str(e) if client.degraded else f"the pipeline failed: {e}", None, "server_error") from None
    streams = [answer_events(request, client, a.handle) for a in answers]
    if body.stream:
        return StreamingResponse(stream_answer(answers, streams, body.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await whole_answer(answers, streams)


def choice_sampling(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of n choices: choice i with seed + i when the request has a seed (as
    vLLM derives its children's), its own random stream otherwise."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) & SEED_BITS) for i in range(n)]


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
    """One choice's answer on its way out: the chunks and objects OpenAI's clients read, formatted
    from its request's output events (launcher/output.py decides the text and the end)."""

    id: str
    chat: bool
    model: str
    handle: Handle
    tokenizer: object = None
    token_ids: bool = False        # vLLM's return_tokens_as_token_ids: tokens named "token_id:N"
    index: int = 0                 # the choice's index (n > 1)
    counts_prompt: bool = True     # the first choice of its prompt (usage counts a prompt once)
    offset: int = 0                # completions' text_offset of the next token

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def logprobs(self, entries: list) -> dict | None:
        """OpenAI's logprobs object for these tokens ([token, log-probability, top] each; None and
        None for an echoed prompt's first): chat's `content` list, or completions' parallel lists."""
        if self.handle.request.params.logprobs is None:
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


def usage(answers: list[Answer]) -> dict:
    """Every prompt once (its n choices share it), every choice's tokens."""
    p = sum(len(a.handle.request.input_ids) for a in answers if a.counts_prompt)
    c = sum(a.handle.output.completion_tokens for a in answers)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


DISCONNECT_CHECK_S = 0.5     # how often a request's connection is checked, whether tokens flow or not


async def answer_events(request: Request, client: PipelineClient, handle: Handle):
    """A request's output events as they come (launcher/output.py), then ("gone", None, ()) if its
    client went away. A request that does not reach its end (its client went away, or the consumer
    stopped) is aborted, so that stage 0 frees its KV pages now."""
    checked = time.monotonic()
    try:
        while True:
            if time.monotonic() - checked > DISCONNECT_CHECK_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    yield "gone", None, ()
                    return
            try:
                event = await asyncio.wait_for(handle.queue.get(), timeout=DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                continue
            yield event
            if event[0] != "text":
                return
    finally:
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
    pieces, finish, taken = [], None, []
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
