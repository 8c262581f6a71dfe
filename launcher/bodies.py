"""The OpenAI request bodies as typed models: they are the API's parser, as vLLM's
`entrypoints/openai/protocol.py` is its (FastAPI validates each body against its model before a
handler runs; /openapi.json is generated from the same models).

One definition per rule:
- a sampling field's bounds come from `hpipe.request.RULES` (`ruled`), so the schema, these models
  and `SamplingParams` (the CLI's and the prompts file's checks) cannot differ;
- rules across fields are model validators (`give`: a 400 naming the field);
- what needs the served model (its vocabulary, its tokenizer, its grammar engine) is checked where
  the body becomes the engine's types: `sampling_params(vocab)`, `prompts(tokenizer, vocab)`.

`describe(error)` words a validation error for OpenAI's error body: the field as the client wrote it
(`messages[0].role`) and what to change. Fields we do not know are allowed and ignored (clients send
more than they need), except those we refuse by name (`REFUSED`): a request that asks for something
hpipe does not do is told so.
"""

from __future__ import annotations

import json
import typing
from typing import Annotated, Literal, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from hpipe import grammar as grammars
from hpipe.errors import HpipeError
from hpipe.request import LOGIT_BIAS, MAX_LOGPROBS, RULES, SamplingError, SamplingParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "Message", "SamplingRequest", "describe", "give"]

MAX_STOPS = 16                  # OpenAI's limit on stop strings is 4; vLLM takes any number
SEED_BITS = (1 << 63) - 1       # seeds are folded into the sampler's 63 bits
STRICT = ConfigDict(strict=True, extra="allow")   # no "0.5" for 0.5, no true for 1; unknown fields ignored


def give(param: str | None, message: str) -> PydanticCustomError:
    """A rule across fields, broken: raised from a validator, it becomes a 400 naming `param`."""
    return PydanticCustomError("hpipe", "{message}", {"message": message, "param": param})


def ruled(name: str, **more) -> object:
    """A sampling field whose bounds are the rule table's."""
    lo, hi, lo_open, note = RULES[name]
    bounds = {"gt": lo} if lo_open else {"ge": lo}
    return Field(None, **bounds, le=hi, description=note.strip("()") or None, **more)


def _integral(value):
    """20.0 for 20: JSON Schema counts an integral number as an integer, and so does OpenAI's API."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds) -> object:
    """An integer field's type within `bounds` (strict otherwise: no "20", no true). The bounds come
    before the validator: after it, /openapi.json would state them as `ge`/`le`, not JSON Schema's."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Integer = integer()
TokenId = integer(ge=0)
NonEmpty = Annotated[str, StringConstraints(min_length=1)]
Bias = Annotated[float, Field(ge=LOGIT_BIAS[0], le=LOGIT_BIAS[1])]
TokenKey = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] = Field(description='text, or text parts [{"type": "text", "text": ...}]')

    def as_template_input(self) -> dict:
        """What the chat template reads: the text as one string, developer as system."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str | None = None
    schema_: dict = Field(alias="schema", description="the JSON schema the reply must follow")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise give("response_format.json_schema", "'response_format.json_schema' is required with type "
                                                      "json_schema: {\"name\": ..., \"schema\": {...}}")
        return self


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = Field(False, description="a last chunk with the usage")


# fields a client may send that hpipe does not do: refused by name, with what to do instead
REFUSED = {
    "suffix": "'suffix' is not supported by hpipe; leave it out",
    "tools": "'tools' is not supported by hpipe; leave it out",
    "functions": "'functions' is not supported by hpipe; leave it out",
    "prompt_logprobs": "'prompt_logprobs': ask for a prompt's log-probabilities with 'echo': true and 'logprobs' "
                       "on /v1/completions",
}
GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice")


class SamplingRequest(BaseModel):
    """What completions and chat share: the model, the choices, sampling, stops, structured output."""

    model_config = STRICT
    model: NonEmpty = Field(description="the served model (GET /v1/models)")
    n: Integer = Field(1, ge=1, description="choices: one prefill, n decodes; choice i samples with seed + i")
    best_of: Annotated[Literal[1], BeforeValidator(_integral)] | None = Field(None, description="1 only (hpipe does not rank choices)")
    temperature: float | None = ruled("temperature")
    top_p: float | None = ruled("top_p")
    top_k: integer(ge=-1) | None = Field(None, description="vLLM's; 0 or -1: off")
    min_p: float | None = ruled("min_p")
    seed: Integer | None = None
    stop: NonEmpty | list[NonEmpty] | None = Field(
        None, description=f"a string or up to {MAX_STOPS} strings; the text ends before the first found")
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = ruled("presence_penalty")
    frequency_penalty: float | None = ruled("frequency_penalty")
    repetition_penalty: float | None = ruled("repetition_penalty")
    logit_bias: dict[TokenKey, Bias] | None = Field(
        None, description=f"token id -> bias in [{LOGIT_BIAS[0]:g}, {LOGIT_BIAS[1]:g}]")
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: bool = False
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = Field(None, description="vLLM's: a JSON schema the output follows")
    guided_regex: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    speculative: bool | None = Field(None, description="false: this request's decode steps carry no proposed "
                                                       "tokens when the server runs with --speculative")

    @model_validator(mode="after")
    def _shared_rules(self):
        for name, why in REFUSED.items():
            if (self.model_extra or {}).get(name) not in (None, False, 0, {}):
                raise give(name, why)
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOPS:
            raise give("stop", f"'stop' takes at most {MAX_STOPS} strings, got {len(self.stop)}")
        given = self.guided_fields
        if len(given) > 1:
            raise give(given[1], f"give one kind of structured output, not {' and '.join(given)}")
        return self

    # ------------------------------------------------------------------ to the engine's types
    @property
    def guided_fields(self) -> list[str]:
        """The structured-output fields given (`response_format` of type text is none)."""
        return [name for name in GUIDED if getattr(self, name) is not None
                and not (name == "response_format" and self.response_format.type == "text")]

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def top_logprobs_asked(self) -> int | None:
        """How many top log-probabilities each token reports (0: the sampled token's alone), or None."""
        raise NotImplementedError

    def prompt_logprobs_asked(self) -> int | None:
        return None

    def grammar(self) -> str | None:
        """The structured output as an llguidance grammar (None: free text); a schema or pattern
        the engine cannot read is a 400 naming its field."""
        given = self.guided_fields
        if not given:
            return None
        name = given[0]
        try:
            if name == "response_format":
                if self.response_format.type == "json_object":
                    return grammars.json_object_grammar()
                return grammars.json_schema_grammar(self.response_format.json_schema.schema_)
            if name == "guided_json":
                schema = json.loads(self.guided_json) if isinstance(self.guided_json, str) else self.guided_json
                if not isinstance(schema, dict):
                    raise ApiRuleError(name, "'guided_json' must be a JSON schema (an object, or its text)")
                return grammars.json_schema_grammar(schema)
            if name == "guided_regex":
                return grammars.regex_grammar(self.guided_regex)
            return grammars.choice_grammar(self.guided_choice)
        except ApiRuleError:
            raise
        except (ValueError, TypeError) as e:
            raise ApiRuleError(name, f"'{name}' is not a grammar hpipe can compile: {e}") from None
        except HpipeError as e:
            raise ApiRuleError(name, str(e)) from None

    def sampling_params(self, vocab: int) -> SamplingParams:
        """hpipe's sampling parameters (the model's vocabulary bounds the token ids given)."""
        if self.stop_token_ids and max(self.stop_token_ids) >= vocab:
            raise ApiRuleError("stop_token_ids", f"'stop_token_ids' must hold token ids in [0, {vocab})")
        if self.logit_bias and max(map(int, self.logit_bias)) >= vocab:
            raise ApiRuleError("logit_bias", f"'logit_bias' keys must be token ids in [0, {vocab})")
        fields = {name: getattr(self, name) for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                                         "frequency_penalty", "presence_penalty", "speculative")
                  if getattr(self, name) is not None}
        if self.top_k is not None:
            fields["top_k"] = max(self.top_k, 0)          # -1: vLLM's and OpenAI-style "off"
        if self.seed is not None:
            fields["seed"] = self.seed & SEED_BITS
        try:
            return SamplingParams(**fields, logit_bias=self.logit_bias or (), logprobs=self.top_logprobs_asked(),
                                  prompt_logprobs=self.prompt_logprobs_asked(), grammar=self.grammar())
        except SamplingError as e:          # the models above hold the same rules: kept as a last guard
            raise ApiRuleError(e.field, f"'{e.field}' must be {e.rule}") from None


class ApiRuleError(HpipeError, ValueError):
    """A body that parsed but breaks a rule that needs the served model: a 400 naming `param`."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class CompletionRequest(SamplingRequest):
    prompt: NonEmpty | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[NonEmpty], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)] = Field(
            description="a non-empty string or list of token ids, or a list of those (a batch)")
    max_tokens: Integer = Field(16, ge=0, description="tokens to generate (OpenAI's default 16; 0 only with echo)")
    echo: bool = Field(False, description="the prompt first (with logprobs: its log-likelihood)")
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="top log-probabilities per token")

    @model_validator(mode="after")
    def _completion_rules(self):
        if (self.model_extra or {}).get("top_logprobs") is not None:
            raise give("top_logprobs", "'top_logprobs' is a chat field; completions take 'logprobs': N")
        if self.max_tokens == 0 and not self.echo:
            raise give("max_tokens", "'max_tokens' must be at least 1 (0 only with 'echo': true), got 0")
        return self

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self, tokenizer, vocab: int) -> list[tuple[list[int], str | None]]:
        """Each prompt as (token ids, its text when given as text): one string or list of token
        ids, or a list of those (choice i * n + j is prompt i's j-th)."""
        p = self.prompt
        many = isinstance(p, list) and not isinstance(p[0], int)
        out = []
        for i, one in enumerate(p if many else [p]):
            where = f"prompt[{i}]" if many else "prompt"
            if isinstance(one, str):
                out.append(([int(t) for t in tokenizer(one)["input_ids"]], one))
                continue
            bad = [t for t in one if t >= vocab]
            if bad:
                raise ApiRuleError("prompt", f"'{where}' token id {bad[0]} is outside the vocabulary [0, {vocab})")
            out.append((list(one), None))
        return out


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: integer(ge=1) | None = Field(None, description="tokens to generate (default: the context left)")
    max_completion_tokens: integer(ge=1) | None = Field(None, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None

    @model_validator(mode="after")
    def _chat_rules(self):
        if (self.model_extra or {}).get("echo") not in (None, False):
            raise give("echo", "'echo' is not supported by hpipe on chat; leave it out")
        if self.top_logprobs is not None and not self.logprobs:
            raise give("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def prompt_ids(self, tokenizer) -> list[int]:
        """The conversation through the model's chat template, ready for the assistant's reply."""
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiRuleError("messages", "this model has no chat template; use /v1/completions")
        ids = tokenizer.apply_chat_template([m.as_template_input() for m in self.messages],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


# ---------------------------------------------------------------------------------------- errors
WHAT = {"float_type": "a number", "int_type": "an integer", "bool_type": "true or false", "string_type": "a string",
        "list_type": "a list", "dict_type": "an object", "model_type": "an object", "model_attributes_type":
        "an object"}
EDGE = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _models_in(annotation) -> list[type[BaseModel]]:
    """The models a field's annotation holds (through lists, unions and Annotated)."""
    if typing.get_origin(annotation) is None and isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _field_at(loc: tuple, bodies: tuple[type[BaseModel], ...]) -> tuple[str | None, FieldInfo | None]:
    """The field an error's loc points at, as the client wrote it (`messages[0].role`), and its
    declaration: the walk follows the models' fields and list positions and stops where pydantic's
    loc goes on with a union member's name ('list[int]') or a dict key."""
    path, field, models = "", None, list(bodies)
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int) and field is not None:
            path += f"[{part}]"
            continue
        found = next((f for m in models for name, f in m.model_fields.items() if part in (name, f.alias)), None)
        if found is None:
            break
        path += f".{part}" if path else str(part)
        field, models = found, _models_in(found.annotation)
    return path or None, field


def _shown(value) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def describe(errors: list[dict], bodies: tuple[type[BaseModel], ...]) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's errors: what is wrong, where, what to change."""
    e = errors[0]
    kind, ctx = e["type"], e.get("ctx") or {}
    param, field = _field_at(tuple(e["loc"]), bodies)
    if kind == "hpipe":
        return ctx["message"], ctx["param"]
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {ctx.get('error', e['msg'])}", None
    if param is None:
        return "the request body must be a JSON object", None
    if kind == "missing":
        return f"'{param}' is required", param
    got = f", got {_shown(e.get('input'))}"
    tried = {tuple(x["loc"]) for x in errors if _field_at(tuple(x["loc"]), bodies)[0] == param}
    if len(tried) > 1:            # a union: every form failed
        what = field.description if field is not None and field.description else "one of the forms /openapi.json gives"
        return f"'{param}' must be {what}{got}", param
    if kind == "literal_error":
        return f"'{param}' must be one of {ctx.get('expected', '').replace(chr(39), '')}{got}", param
    if kind in WHAT:
        return f"'{param}' must be {WHAT[kind]}{got}", param
    if kind in EDGE:
        return f"'{param}' must be {_range(field) or f'{EDGE[kind]} {next(iter(ctx.values())):g}'}{got}", param
    if kind in ("too_short", "string_too_short"):
        return f"'{param}' must not be empty", param
    if kind == "string_pattern_mismatch":
        return f"'{param}' keys must be token ids (digits){got}", param
    return f"'{param}': {e['msg']}{got}", param


def _constraints(field: FieldInfo) -> list:
    """The field's own constraints and those its type carries (`integer(...)`, through `| None`)."""
    found, types = list(field.metadata), [field.annotation]
    while types:
        t = types.pop()
        if get_origin(t) is Annotated:
            found += [c for m in t.__metadata__ for c in (m.metadata if isinstance(m, FieldInfo) else [m])]
        types += get_args(t)
    return found


def _range(field: FieldInfo | None) -> str | None:
    """The field's interval as its model declares it ("in [0, 2]", "in (0, 1]"), when it has both ends."""
    if field is None:
        return None
    bounds = {type(m).__name__: getattr(m, type(m).__name__.lower(), None) for m in _constraints(field)}
    lo = bounds.get("Ge", bounds.get("Gt"))
    if lo is None or "Le" not in bounds:
        return None
    return f"in {'(' if 'Gt' in bounds else '['}{lo:g}, {bounds['Le']:g}]"
