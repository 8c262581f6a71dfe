"""One request, from the launcher to the last stage's sampler, and the one rule for when a
sequence ends.

A `Request` is what every part of the pipeline knows of a prompt: its index in the job (KV slots,
sampler rows and the schedule's segments key on it), its id, its token ids, its sampling
parameters already resolved (the launch's, the prompt's own overrides, the per-request seed), how
many tokens it may generate and which token ids end it. The launcher writes the job's requests
(`write_requests`), every stage reads the same file (`read_requests`), the scheduler and the
sampler take them as they are. `Request.finish_reason` is the only place that decides a
sequence's end.

Pure Python (no torch): the file formats validate prompts' sampling objects with the same rules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property

from hpipe.errors import HpipeError

GREEDY_BELOW = 1e-5      # vLLM: a temperature below this is greedy


# The one rule per sampling field, for the CLI, the prompts file and the API alike: (low, high,
# low excluded, what the value means at the edges). OpenAI's ranges where it has them, vLLM's otherwise.
RULES = {
    "temperature": (0.0, 2.0, False, "(below 1e-5 is greedy)"),
    "top_p": (0.0, 1.0, True, ""),
    "min_p": (0.0, 1.0, False, ""),
    "repetition_penalty": (0.0, 10.0, True, "(1 turns it off)"),
    "frequency_penalty": (-2.0, 2.0, False, ""),
    "presence_penalty": (-2.0, 2.0, False, ""),
}


LOGIT_BIAS = (-100.0, 100.0)     # OpenAI's range
MAX_LOGPROBS = 20                # top log-probabilities a request may ask for (vLLM's default max_logprobs)


class SamplingError(HpipeError, ValueError):
    """A sampling field that breaks its rule; `field`, `value` and `rule` for callers that word it
    their own way (the API's 400 names the field)."""

    def __init__(self, message: str, field: str | None = None, value=None, rule: str = ""):
        super().__init__(message)
        self.field, self.value, self.rule = field, value, rule


def _refuse(name: str, value, rule: str):
    raise SamplingError(f"sampling parameter {name}={value!r}: must be {rule}", name, value, rule)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit), OpenAI's, before the rest
    logprobs: int | None = None    # report the sampled token's log-probability and this many top ones (None: off)
    prompt_logprobs: int | None = None   # the same for every prompt token after the first (it skips the prefix cache)
    grammar: str | None = None     # structured output: an llguidance grammar (hpipe.grammar builds them)
    speculative: bool = True       # with --speculative, its decode steps carry proposed tokens (false: opt out)

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name, (lo, hi, lo_open, note) in RULES.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                _refuse(name, v, "a number")
            if not math.isfinite(v):
                _refuse(name, v, "a finite number")
            if v < lo or v > hi or (lo_open and v == lo):
                edge = f"> {lo:g}" if lo_open else f">= {lo:g}"
                _refuse(name, v, f"in {'(' if lo_open else '['}{lo:g}, {hi:g}] ({edge} and <= {hi:g}{', ' + note[1:-1] if note else ''})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            _refuse("top_k", self.top_k, "an integer >= 0 (0 turns it off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            _refuse("seed", self.seed, "an integer or None")
        if not isinstance(self.speculative, bool):
            _refuse("speculative", self.speculative, "true or false")
        if self.grammar is not None and not isinstance(self.grammar, str):
            _refuse("grammar", self.grammar, "an llguidance grammar (text) or None")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                _refuse(name, k, f"an integer in [0, {MAX_LOGPROBS}] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as OpenAI sends it ({"token id": bias}) or as pairs: sorted (id, bias) pairs."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        _refuse("logit_bias", bias, 'an object of token ids to biases ({"50256": -100})')
    out = {}
    for k, v in pairs:
        token = int(k) if isinstance(k, str) and k.strip().isdigit() else k
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            _refuse("logit_bias", k, "keyed by token ids (integers >= 0)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not LOGIT_BIAS[0] <= v <= LOGIT_BIAS[1]:
            _refuse("logit_bias", v, f"biases in [{LOGIT_BIAS[0]:g}, {LOGIT_BIAS[1]:g}]")
        out[token] = float(v)
    return tuple(sorted(out.items()))


BATCH_SAMPLING = SamplingParams(temperature=0.0)   # a job's prompts: greedy unless asked (the API's default
                                                   # temperature is OpenAI's, SamplingParams' own 1.0)
MAX_NEW_TOKENS = 64                                # a job's prompts: tokens each may generate unless asked


MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw for a sequence's output token at `position` (0: its first): a hash of the
    request's seed and the position (splitmix64's finalizer), so that its nth token is drawn the same
    however it got there: in one run, after a preemption, or resumed on another pipeline."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sequence_seed(seed: int, request_id: str) -> int:
    """A per-request seed from the launch's seed and the request id (same tokens however batched)."""
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Request:
    index: int                                  # position in the job, stable over the run
    id: str
    input_ids: tuple[int, ...]
    params: SamplingParams = BATCH_SAMPLING
    max_new_tokens: int = MAX_NEW_TOKENS
    eos_ids: frozenset[int] = frozenset()       # the model's end-of-sequence ids
    stop_ids: frozenset[int] = frozenset()      # the request's own stop token ids
    output_ids: tuple[int, ...] = ()            # tokens it generated already: a request resumed on a new
                                                # pipeline (its KV rebuilt by a prefill of both; it goes on
                                                # at the next position, its sampler state as it was there)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise HpipeError(f"request {self.id!r}: max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not self.input_ids:
            raise HpipeError(f"request {self.id!r}: no input tokens")
        if len(self.output_ids) >= self.max_new_tokens:
            raise HpipeError(f"request {self.id!r}: resumed with {len(self.output_ids)} tokens, but it may "
                             f"generate {self.max_new_tokens}: it has ended")

    def resumed(self, output_ids) -> Request:
        """The same request, to go on after `output_ids` (what it generated before its pipeline was lost)."""
        return dataclasses.replace(self, output_ids=tuple(int(t) for t in output_ids))

    @cached_property
    def ends(self) -> frozenset[int]:
        """The ids that end it when sampled."""
        return self.eos_ids | self.stop_ids

    def finish_reason(self, last_token: int, n_generated: int) -> str | None:
        """Why the sequence ends after generating `n_generated` tokens, the last `last_token`:
        "eos", "stop" (one of its stop ids), "length", or None while it goes on."""
        if last_token in self.eos_ids:
            return "eos"
        if last_token in self.stop_ids:
            return "stop"
        if n_generated >= self.max_new_tokens:
            return "length"
        return None

    def to_json(self) -> dict:
        return {"index": self.index, "id": self.id, "input_ids": list(self.input_ids),
                "params": self.params.__dict__, "max_new_tokens": self.max_new_tokens,
                "eos_ids": sorted(self.eos_ids), "stop_ids": sorted(self.stop_ids),
                **({"output_ids": list(self.output_ids)} if self.output_ids else {})}

    @classmethod
    def from_json(cls, d: dict) -> Request:
        return cls(int(d["index"]), str(d["id"]), tuple(d["input_ids"]), SamplingParams(**d["params"]),
                   int(d["max_new_tokens"]), frozenset(d["eos_ids"]), frozenset(d["stop_ids"]),
                   tuple(d.get("output_ids", ())))


def write_requests(requests: list[Request], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r.to_json()) + "\n" for r in requests)


def read_requests(path: str | os.PathLike) -> list[Request]:
    with open(path) as f:
        return [Request.from_json(json.loads(line)) for line in f if line.strip()]
