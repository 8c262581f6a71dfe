"""Every runtime setting, once: its default, its unit, its rule and its flag.

`RuntimeConfig` is the one source of truth for how the stage workers run. `hpipe launch` and
`hpipe serve` build their runtime flags from it (`cli_option`), so both expose every setting under
the same flag with the same default; the launcher hands the workers the config whole (one JSON
argument, `to_json` / `from_json`); the run summary records it. A value that breaks its rule is
refused here, with the flag to change, whoever built the config.

Settings whose best value depends on the devices (the policy's prefill amounts) default to 0,
"the plan's devices' default", and are resolved once at start (`hpipe.runtime.scheduler.Policy`).

Pure Python: the CLI imports it without torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from hpipe.errors import HpipeError

__all__ = ["cache_dir", "inductor_cache_dir", "int_list", "DEFAULTS", "DEVICE_DEFAULTS", "POLICIES", "RuntimeConfig", "SETTINGS", "Setting", "Speculation", "cli_option",
           "from_cli"]



def cache_dir() -> Path:
    """Where a host keeps what hpipe builds once (converted models, packed weights, compiled graphs
    and kernels): HPIPE_CACHE, else ~/.cache/hpipe."""
    return Path(os.environ.get("HPIPE_CACHE", Path.home() / ".cache" / "hpipe"))


def inductor_cache_dir() -> Path:
    """Inductor's cache, where hpipe keeps its graphs, warm marks and vector checks beside
    inductor's own files: TORCHINDUCTOR_CACHE_DIR, else hpipe's cache's `inductor/`."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", cache_dir() / "inductor"))


POLICIES = ("throttle", "sarathi")
# gLLM's values (#MaxP 2048, #MinP 32) and Sarathi's budget (512) suit GPUs; a CPU stage needs a
# second for ~1000 prompt tokens of a 135M model, so with any CPU stage in the pipeline #MaxP is 256
# and #MinP 16: a micro-batch then costs at most ~8 decode steps, not ~60, and decode keeps flowing
# while long prompts prefill. The one table of the device-dependent defaults (the flags' 0), resolved
# by hpipe.runtime.scheduler.Policy.
DEVICE_DEFAULTS = {"gpu": {"max_prefill": 2048, "min_prefill": 32, "budget": 512},
                   "cpu": {"max_prefill": 256, "min_prefill": 16, "budget": 256}}


def _by_device(name: str) -> str:
    return f"{DEVICE_DEFAULTS['gpu'][name]} on GPUs, {DEVICE_DEFAULTS['cpu'][name]} with a CPU stage"
SWITCH = ("auto", "on", "off")


@dataclass(frozen=True)
class Setting:
    """How one field of RuntimeConfig looks from the command line and what values it takes."""

    default: object                  # the field's default (one definition: RuntimeConfig's)
    flag: str                        # the CLI flag; a "--no-" flag turns a True default off
    help: str
    unit: str = ""
    choices: tuple = ()
    lo: float | None = None          # the smallest value allowed
    below: float | None = None       # values must be < this

    @property
    def negated(self) -> bool:
        return self.flag.startswith("--no-")

    def check(self, value) -> None:
        """Raises HpipeError naming the flag when `value` breaks this setting's rule."""
        kind = type(self.default)
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else:
            ok = isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            what = {bool: "true or false", float: "a finite number", int: "an integer", str: "a string"}[kind]
            raise HpipeError(f"{self.flag} {value!r}: must be {what}")
        if self.choices and value not in self.choices:
            raise HpipeError(f"{self.flag} {value!r}: use {', '.join(self.choices[:-1])} or {self.choices[-1]}")
        if self.lo is not None and value < self.lo:
            raise HpipeError(f"{self.flag} must be at least {self.lo:g}, got {value}")
        if self.below is not None and value >= self.below:
            raise HpipeError(f"{self.flag} must be below {self.below:g}, got {value}")


def setting(default, flag: str, help: str, **rule):
    """A RuntimeConfig field: its default and, in the metadata, its flag and rule."""
    return field(default=default, metadata={"setting": Setting(default, flag, help, **rule)})


@dataclass(frozen=True)
class RuntimeConfig:
    # -- what runs at once
    max_batch: int = setting(16, "--max-batch", "sequences running at once", unit="sequences", lo=1)
    max_model_len: int = setting(0, "--max-model-len", "the longest prompt + output a request may have "
                                 "(0: the model's context)", unit="tokens", lo=0)
    # -- tokens per micro-batch
    policy: str = setting("throttle", "--policy", "tokens per micro-batch: throttle (gLLM: decode spread over the "
                          "stages, prefill from the waiting tokens and free KV) or sarathi (a fixed budget, decode "
                          "first)", choices=POLICIES)
    iterations: int = setting(8, "--iterations", "throttle #T: waiting prompt tokens spread over this many "
                              "micro-batches", unit="micro-batches", lo=1)
    max_prefill: int = setting(0, "--max-prefill", f"throttle #MaxP (0: {_by_device('max_prefill')})",
                               unit="tokens", lo=0)
    min_prefill: int = setting(0, "--min-prefill", f"throttle #MinP (0: {_by_device('min_prefill')})",
                               unit="tokens", lo=0)
    kv_thresh: float = setting(0.05, "--kv-thresh", "throttle: no new prefill below this KV-free rate",
                               unit="fraction of the pool", lo=0.0, below=1.0)
    budget: int = setting(0, "--budget", f"sarathi: tokens per micro-batch (0: {_by_device('budget')})",
                          unit="tokens", lo=0)
    # -- the KV cache
    page_size: int = setting(16, "--page-size", "tokens per KV page (vLLM's block size)", unit="tokens", lo=1)
    kv_pages: int = setting(0, "--kv-pages", "KV pages per stage (0: what the sequences need, within free "
                            "memory); fewer pages preempt and recompute sequences", unit="pages", lo=0)
    prefix_caching: str = setting("on", "--prefix-caching", "keep the KV pages of prompts (and outputs) after their "
                                  "requests end and start a new request after its longest cached prefix (one "
                                  "decision on stage 0 that every stage follows)", choices=("on", "off"))
    # -- the asynchronous runtime (SiPipe)
    sampling: str = setting("auto", "--sampling", "inline: the last stage samples (on a sampler thread under TSEM on a GPU); "
                            "cpu: a pool of sampler processes takes the logits off the last stage (SiPipe); auto: "
                            "cpu when the last stage is a GPU, else inline", choices=("auto", "inline", "cpu"))
    sampler_procs: int = setting(1, "--sampler-procs", "with --sampling cpu: sampler processes", unit="processes",
                                 lo=1)
    tsem: bool = setting(True, "--no-tsem", "prepare each micro-batch's inputs inline, not on a CPU thread while "
                         "the previous one computes (TSEM off)")
    sat: bool = setting(True, "--no-sat", "send header and segments with every hop's hidden states instead of the "
                        "schedule ahead on the control plane (SAT off)")
    cuda_graphs: bool = setting(True, "--no-cuda-graphs", "CUDA stages: run decode steps eagerly")
    static_decode: str = setting("auto", "--static-decode", "decode steps with static shapes (padded, whole KV "
                                 "slots under a mask), the path CUDA graphs replay; auto: with CUDA graphs (on a "
                                 "CPU it is slower, see docs/architecture.md)", choices=SWITCH)
    compile: str = setting("auto", "--compile", "decode steps run their blocks through torch.compile (inductor), 4 "
                           "or 5 blocks a graph call, graphs shared by every call alike, their wrapper C++ (CPU stages "
                           "of llama-like models): 0.7x the time of an eager step on SmolLM2. on: compile at start "
                           "(1-3 minutes the first time on a 2-core host; later starts load the saved graphs in ~2 s a "
                           "stage); auto: where `hpipe warmup` has compiled the model's graphs on this host, else "
                           "eagerly (a server serves from its start and gets them beside it: loaded, or compiled first "
                           "at the lowest CPU priority on a cold host); off: eagerly. A failed compile leaves the run "
                           "eager",
                           choices=("auto", "on", "off"))
    prepare_thread: str = setting("auto", "--prepare-thread", "with TSEM, prepare inputs on a CPU thread while the "
                                  "previous micro-batch computes; auto: on CUDA stages (a CPU stage's forward "
                                  "already keeps its cores busy, see docs/architecture.md)", choices=SWITCH)
    sidp_mode: str = setting("auto", "--sidp-mode", "SiDP plans: how a replica runs the MLP halves it does not own: "
                             "was (fetch the weights into its cache slots), cas (send its rows to the owner, which "
                             "runs everyone's in one GEMM) or auto (WaS while the group's largest batch stays at the "
                             "plan's threshold or above, CaS in the tail); a shared-mapping group's WaS fetches "
                             "nothing", choices=("auto", "was", "cas"))
    speculation: str = setting("off", "--speculative", "speculative decoding: each decode step of a request also "
                               "carries up to K tokens (default 4) proposed by prompt lookup (ngram[:K], the tokens "
                               "that followed the latest earlier occurrence of its last 1-4 tokens in its prompt and "
                               "output) or by a small draft model with the same tokenizer beside stage 0 "
                               "(draft:MODEL[:K], its own paged KV, greedy), verified in the same trip through the "
                               "stages; exact for greedy and for sampling; off: one token per step")
    attn: str = setting("sdpa", "--attn", "transformers' attention implementation", choices=("sdpa", "eager"))
    deterministic: str = setting("off", "--deterministic", "one answer per request: a row's arithmetic fixed by "
                                 "the row itself (its position, its request's prompt), never by the other requests in "
                                 "its micro-batch, the slicing, the prefix cache or the cuts: the same request gives "
                                 "the same tokens and logits every time (llama-like models; decode steps eagerly, "
                                 "prompts cut on whole pages; off by default: up to 9 % on a decode step of 8 rows "
                                 "and 30 % on a prefill of many short prompts on a CPU, see docs/architecture.md)",
                                 choices=("on", "off"))
    rendezvous_timeout_s: float = setting(300.0, "--rendezvous-timeout", "seconds a stage waits for the others to join",
                               unit="s", lo=1.0)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            f.metadata["setting"].check(getattr(self, f.name))
        Speculation.parse(self.speculation)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RuntimeConfig:
        data = json.loads(text)
        unknown = set(data) - set(SETTINGS)
        if unknown:
            raise HpipeError(f"runtime config: unknown setting(s) {sorted(unknown)}; the launcher and the worker "
                             f"run different hpipe versions")
        return cls(**data)


@dataclass(frozen=True)
class Speculation:
    """--speculative, parsed: the proposer, the most tokens it proposes per step (k) and, for a
    draft proposer, the draft model (as MODEL is given: a .gguf file, a Hugging Face directory or
    `smollm2`; read on stage 0's host)."""

    proposer: str = "off"          # "off", "ngram" or "draft"
    k: int = 0
    model: str = ""                # the draft model
    MAX_K = 16                     # a step's rows grow with k; more than this is never accepted on average
    DEFAULT_K = 4

    @property
    def on(self) -> bool:
        return self.proposer != "off"

    @property
    def step_tokens(self) -> int:
        """The most tokens one sequence's step carries: its fed token and up to k proposals."""
        return 1 + self.k if self.on else 1

    @classmethod
    def parse(cls, text: str) -> Speculation:
        if text == "off":
            return cls()
        name, _, rest = text.partition(":")
        if name == "ngram":
            return cls("ngram", cls._k(text, rest))
        if name == "draft":
            model, _, k = rest.rpartition(":")
            if not k.isdigit():              # no :K (a path may hold colons of its own)
                model, k = rest, ""
            if not model:
                raise HpipeError(f"--speculative {text!r}: name the draft model, e.g. draft:smollm2:4 or "
                                 f"draft:/models/small.gguf (same tokenizer as the model)")
            return cls("draft", cls._k(text, k), model)
        raise HpipeError(f"--speculative {text!r}: use off, ngram[:K] (prompt lookup) or draft:MODEL[:K] (a small "
                         f"model with the same tokenizer); K tokens proposed per step")

    @classmethod
    def _k(cls, text: str, k: str) -> int:
        if not k:
            return cls.DEFAULT_K
        if k.isdigit() and 1 <= int(k) <= cls.MAX_K:
            return int(k)
        raise HpipeError(f"--speculative {text!r}: K must be an integer in [1, {cls.MAX_K}], e.g. ngram:4")


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in dataclasses.fields(RuntimeConfig)}
DEFAULTS = RuntimeConfig()


def int_list(text: str | None, option: str) -> list[int] | None:
    """A comma-separated option's integers (None when it was not given), e.g. --cuts 20,41."""
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HpipeError(f"{option} {text!r}: expected comma-separated integers, e.g. {option} 20,41") from None
    if not values:
        raise HpipeError(f"{option}: give at least one integer")
    return values


def cli_option(name: str):
    """The typer option of one setting, its default taken from RuntimeConfig (a "--no-" flag
    defaults to the opposite of its setting)."""
    import typer
    s = SETTINGS[name]
    default = getattr(DEFAULTS, name)
    return typer.Option(not default if s.negated else default, s.flag,
                        help=f"{s.help}; in {s.unit}" if s.unit else s.help)


def from_cli(values: dict) -> RuntimeConfig:
    """RuntimeConfig from the CLI's parameter values (keyed by setting name; "--no-" flags by the
    setting's name too, holding the flag's value)."""
    return RuntimeConfig(**{name: (not v if SETTINGS[name].negated else v) for name, v in values.items()})
