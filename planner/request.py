"""`hpipe plan`'s request: every option of the command as one frozen object, checked when it is made
(each refusal one line naming the option and what to give instead: the options' own rules here,
what needs the model or the profile where they are read), and `plan_request`, which
decides what the command does with it: equal cuts without a profile, the profiled planner (the
host-order search where it is asked for, the speculative decode, the `--compare` rows) with one.

Each field's metadata holds its flags and help (`option`): the CLI makes the command's options from
them (`hpipe.cli.request_options`), so a flag, its default and its help are written once, here.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from hpipe import formats
from hpipe.config import DEFAULTS, SETTINGS, Speculation, int_list
from hpipe.errors import HpipeError
from hpipe.planner.profiled import MARGIN, PlanResult, check_profile_matches
from hpipe.planner.search import plan_profiled
from hpipe.planner.uniform import make_plan

__all__ = ["PlanRequest", "option", "plan_request"]


def option(default, *flags: str, help: str):
    """A request's field: its default and, in the metadata, its command-line flags and help."""
    return field(default=default, metadata={"flags": flags, "help": help})


SPECULATIVE = SETTINGS["speculation"]
# what only a profile's measured times can plan: refused, unless left at its default, without --profile
NEEDS_PROFILE = ("seq_len", "compare_baselines", "order", "allow_drop", "timeline", "overlap_sends", "objective",
                 "acceptance")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str = option("smollm2", "--model", help="'smollm2', a Hugging Face directory or a .gguf file")
    stages: int | None = option(None, "--stages", help="number of local stages (one per process)")
    cluster: str | None = option(None, "--cluster", help="cluster inventory TOML: one stage per device")
    device: str = option("cpu", "--device", help="with --stages: the device of every stage")
    cuts: str | None = option(None, "--cuts", help="N-1 interior cut positions in units, e.g. 20,41")
    slices: str | None = option(None, "--slices", help="slice lengths in tokens, e.g. 512,384,256")
    num_slices: int | None = option(None, "--num-slices", help="uniform slices per prompt (default: 2 x stages)")
    granularity: int = option(16, "--granularity", help="uniform slices are multiples of this")
    dtype: str | None = option(None, "--dtype", help="activations: float32, bfloat16 or float16 (default: the "
                               "profile's, else float32)")
    quantize: str | None = option(None, "--quantize", help="weights: gguf (a .gguf model's own 4/8-bit blocks, its "
                                  "default), int8 or int4[:group] (quantized at load), none (dense in --dtype, a "
                                  "float checkpoint's default)")
    kv_dtype: str | None = option(None, "--kv-dtype", help=f"the KV cache's elements: {formats.KV_DTYPE} (default; "
                                  "half float32's bytes), bfloat16 or float32 (every bit, as the exactness tests run)")
    profile: str | None = option(None, "--profile", help="profile from `hpipe profile`: cut where the measured "
                                 "times balance (DP), within memory")
    seq_len: int | None = option(None, "--seq-len", help="with --profile: the prompt length to plan for")
    batch: int = option(1, "--batch", help="with --profile: sequences per batch")
    margin: float = option(MARGIN, "--margin", help="with --profile: share of free memory kept free")
    compare_baselines: bool = option(False, "--compare", help="with --profile: a table of this plan against Base, "
                                     "GPipe, GP-B, TeraPipe and the paper's own two-step method")
    order: str = option("inventory", "--order", help="with --profile: 'inventory' (devices in file order) or "
                        "'search' (host orders ranked by their links, the best planned in full)")
    allow_drop: bool = option(False, "--allow-drop", help="with --profile: leave out a device if that is faster")
    timeline: str | None = option(None, "--timeline", help="with --profile: the simulated pipeline as a Gantt chart, "
                                  "FILE.html or FILE.png")
    overlap_sends: bool = option(False, "--overlap-sends", help="with --profile: a stage's send overlaps its next "
                                 "compute (GPUs with their own copy engines) instead of adding to it (HPipe eq. 1; "
                                 "right where sends share the cores, as gloo on CPUs)")
    objective: str = option("prefill", "--objective", help="with --profile: what the cuts balance: prefill (the "
                            "prompts' slices), decode (--new-tokens decode steps, from the profile's decode tables) "
                            "or mixed (their sum per stage, as when prefill and decode share micro-batches)")
    new_tokens: int = option(128, "--new-tokens", help="with --objective decode or mixed: tokens generated per "
                             "sequence")
    speculation: str = option(DEFAULTS.speculation, SPECULATIVE.flag, help=SPECULATIVE.help)
    acceptance: float | None = option(None, "--acceptance", help="with --profile and --speculative: the share of "
                                      "proposed tokens accepted, as a run measured it (`hpipe launch --speculative "
                                      "...` prints it): decode is also predicted with speculation")
    mode: str = option("pipeline", "--mode", help="pipeline: cut the model between the devices (HPipe); sidp: one "
                       "whole replica per device, each host's FFN weights shared among its replicas (SiDP, offline "
                       "jobs; needs --profile)")
    sidp_source: str = option("auto", "--sidp-source", help="with --mode sidp: where replicas read FFN weights they "
                              "do not own: peer (the owner GPU over P2P), host-pool (one pinned copy in host memory), "
                              "shared-mapping (CPU: one mapped copy); auto: shared-mapping on CPU hosts, host-pool on "
                              "GPUs")
    max_batch: int = option(DEFAULTS.max_batch, "--max-batch", help="with --mode sidp: the most sequences a replica "
                            "batches (the runtime's --max-batch)")
    out: str = option(MISSING, "-o", "--out", help="where to write the plan (JSON)")

    def __post_init__(self):
        if self.stages is not None and self.cluster is not None:
            raise HpipeError("give one of --stages N (local processes) or --cluster FILE, not both")
        if self.num_slices is not None and self.num_slices < 1:
            raise HpipeError(f"--num-slices must be at least 1, got {self.num_slices}")
        if self.granularity < 1:
            raise HpipeError(f"--granularity must be at least 1, got {self.granularity}")
        if self.stages is not None:
            if self.stages < 1:
                raise HpipeError(f"--stages must be at least 1, got {self.stages}")
            formats.check_device("--device", "value", self.device)
        formats.activation_dtype(self.dtype)
        if self.mode == "pipeline":
            self._check_pipeline()
        elif self.mode == "sidp":
            self._check_sidp()
        else:
            raise HpipeError(f"--mode {self.mode!r}: use 'pipeline' or 'sidp'")

    def _check_sidp(self) -> None:
        if self.sidp_source not in ("auto", *formats.SIDP_SOURCES):
            raise HpipeError(f"--sidp-source {self.sidp_source!r}: use auto, {', '.join(formats.SIDP_SOURCES)}")
        if self.max_batch < 1:
            raise HpipeError(f"--max-batch must be at least 1, got {self.max_batch}")

    def _check_pipeline(self) -> None:
        if (self.acceptance is None) != (self.speculative_k == 0):
            raise HpipeError("--speculative and --acceptance go together: decode with speculation is predicted from "
                             "the share of proposals a run accepted (`hpipe launch --speculative ngram` prints it)")
        if self.profile is None:
            if any(getattr(self, f.name) != f.default for f in fields(self) if f.name in NEEDS_PROFILE):
                raise HpipeError("--seq-len, --compare, --order, --allow-drop, --timeline, --overlap-sends, --objective "
                                 "and --acceptance plan from measured times: add --profile FILE")
            return
        if self.cuts is not None:
            raise HpipeError("--cuts and --profile exclude each other: the profile decides the cuts")
        if self.seq_len is None:
            raise HpipeError("--profile needs --seq-len N, the prompt length to plan for")
        if self.order not in ("inventory", "search"):
            raise HpipeError(f"--order {self.order!r}: use 'inventory' or 'search'")

    @property
    def speculative_k(self) -> int:
        return Speculation.parse(self.speculation).k

    def cut_list(self) -> list[int] | None:
        return int_list(self.cuts, "--cuts")

    def slice_list(self) -> list[int] | None:
        return int_list(self.slices, "--slices")

    def slicing(self) -> formats.Slicing | None:
        """With a profile, the slicing asked for (None: the DP slices)."""
        if self.slices is None and self.num_slices is None:
            return None
        return formats.Slicing(count=self.num_slices or 1, lengths=tuple(self.slice_list() or ()),
                               granularity=self.granularity)


def plan_request(r: PlanRequest, profile: dict | None, name: str, config, devices: list[tuple[str, str]],
                 weights: str, kv_dtype: str, log=None) -> tuple[formats.Plan, PlanResult | None]:
    """A pipeline's plan for the request: equal (or the given) cuts without a profile, the profiled
    planner's with one (its PlanResult beside it: the simulated pipeline and the lower bound)."""
    if profile is None:
        return make_plan(name, config, devices, r.cut_list(), r.slice_list(), r.num_slices, r.granularity,
                         formats.activation_dtype(r.dtype), weights, kv_dtype), None
    check_profile_matches(profile, config, r.model, r.profile)
    result = plan_profiled(profile, r.profile, name, config, devices, r.seq_len, r.batch, r.slicing(), r.margin,
                           r.dtype, r.granularity, r.order, r.allow_drop, log=log, overlap=r.overlap_sends,
                           objective=r.objective, new_tokens=r.new_tokens,
                           speculation=None if r.acceptance is None else (r.speculative_k, r.acceptance),
                           compare_baselines=r.compare_baselines)
    return result.plan, result
