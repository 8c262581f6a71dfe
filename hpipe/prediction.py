"""What a plan predicts, as the planner writes it into the plan file (`predicted`) and the launcher,
the CLI and the live page read it back: one frozen type per kind of plan, one writer each (the
planner: `hpipe.planner.profiled` for a pipeline, `hpipe.planner.sidp` for SiDP), read and written
as JSON here and nowhere else.

The figures that decide something (the makespan, the slices, the decode terms a run is checked
against, the objective the elastic re-plan keeps) are typed fields. The reports a user reads and a
later tool may chart (the cut search, the lower bound, the gap, the memory that bound the cuts, the
`--compare` rows, the host orders tried) are JSON objects kept as written: nothing decides on them.

A plan file written before a figure existed reads back with that field None (the `Optional`
fields below): its readers then skip the check that needs it, as they did when the key was absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from hpipe.errors import HpipeError

__all__ = ["DecodeTerms", "DecodePrediction", "Prediction", "SidpPrediction", "parse_prediction"]

Report = Mapping[str, Any]      # a JSON object kept as written (see the module's docstring)


@dataclass(frozen=True)
class DecodeTerms:
    """One decode step of one group, per stage and hop: what a run's steady tokens are checked
    against (`hpipe.launcher.jobs`)."""
    compute_s: tuple[float, ...]      # per stage
    send_s: tuple[float, ...]         # per hop, stage j to j + 1
    back_s: float                     # sampling, the ids' trip to stage 0, the commit
    runtime_costs: str                # whether the profile measured the runtime's own costs


@dataclass(frozen=True)
class DecodePrediction:
    """The runtime's steady decode on the plan's cuts (`hpipe.planner.profiled.decode_prediction`)."""
    new_tokens: int
    rows_per_group: int
    groups: int
    context: float                    # the mean context a step reads
    stage_step_s: tuple[float, ...]
    round_s: float                    # one token for every sequence
    tokens_per_s: float
    terms: DecodeTerms | None = None      # None in a plan file older than the run's decode check
    speculative: Report | None = None     # with `--speculative` and `--acceptance` (hpipe.planner.speculative)


@dataclass(frozen=True)
class Prediction:
    """A pipeline plan's predicted prefill of `batch` prompts of `seq_len` tokens in `slices`, from
    the profile at `profile`, and its decode where every device has decode tables."""
    profile: str
    seq_len: int
    batch: int
    slices: tuple[int, ...]
    makespan_s: float
    throughput_tokens_per_s: float
    stage_busy_s: tuple[float, ...] | None = None
    utilization: tuple[float, ...] | None = None
    slice_compute_s: tuple[tuple[float, ...], ...] | None = None    # per slice and stage: the run's re-simulation
    slice_send_s: tuple[tuple[float, ...], ...] | None = None
    way_back_s: float | None = None
    partition_bottleneck_s: float | None = None
    overlap_sends: bool = False
    objective: str = "prefill"            # what the cuts balance (hpipe.planner.OBJECTIVES)
    margin: float | None = None           # the share of free memory kept free
    memory_bytes_per_stage: tuple[int, ...] | None = None
    memory_free_bytes: tuple[int, ...] | None = None
    uniform_makespan_s: float | None = None
    lower_bound_s: float | None = None
    ratio_to_lower_bound: float | None = None
    decode: DecodePrediction | None = None
    cut_search: Report | None = None
    lower_bound: Report | None = None
    gap: Report | None = None
    assumptions: tuple[str, ...] = ()
    memory_binding: Report | None = None          # the device whose memory moved the cuts
    host_experts: Report | None = None            # MoE blocks kept in a host's RAM
    compare: tuple[Report, ...] | None = None     # `hpipe plan --compare`'s rows
    candidates: tuple[Report, ...] | None = None  # the device orders `--order search` planned
    order: str | None = None
    allow_drop: bool | None = None

    def objective_s(self) -> float:
        """The predicted time of what the cuts balance: the prefill makespan, every sequence's new
        tokens decoded, or both (the elastic re-plan compares plans by it)."""
        decode = self.batch * self.decode.new_tokens / self.decode.tokens_per_s if self.objective != "prefill" else 0.0
        return decode + (self.makespan_s if self.objective != "decode" else 0.0)

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True)
class SidpPrediction:
    """A SiDP plan's requests (`seq_len` + `new_tokens`, up to `max_batch` a replica) and, per host
    group, plain DP, SiDP and the pipeline side by side (reports: `hpipe plan --mode sidp` prints them)."""
    seq_len: int
    new_tokens: int
    max_batch: int
    groups: tuple[Report, ...]

    def to_json(self) -> dict:
        return _json(self)


_REQUIRED = {Prediction: ("profile", "seq_len", "batch", "slices", "makespan_s", "throughput_tokens_per_s"),
             SidpPrediction: ("seq_len", "new_tokens", "max_batch", "groups"),
             DecodePrediction: ("new_tokens", "rows_per_group", "groups", "context", "stage_step_s", "round_s",
                                "tokens_per_s"),
             DecodeTerms: ("compute_s", "send_s", "back_s", "runtime_costs")}


def parse_prediction(data: Any, path: str) -> Prediction | SidpPrediction | None:
    """A plan file's `predicted` (None stays None); a SiDP plan's has `groups` at its top."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise HpipeError(f"{path}: predicted: expected an object or null, got {data!r}")
    return _parse(SidpPrediction if "groups" in data else Prediction, data, path, "predicted")


def _parse(cls, data: Any, path: str, where: str):
    if not isinstance(data, dict):
        raise HpipeError(f"{path}: {where}: expected an object, got {data!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HpipeError(f"{path}: {where}: unknown key {unknown[0]!r} (known keys: {', '.join(sorted(known))}); "
                         f"plan again with this hpipe (`hpipe plan ... -o FILE`)")
    missing = [k for k in _REQUIRED[cls] if k not in data]
    if missing:
        raise HpipeError(f"{path}: {where}: missing {missing[0]!r}; plan again with this hpipe (`hpipe plan ... -o FILE`)")
    values = {}
    for k, v in data.items():
        if k == "decode" and v is not None:
            v = _parse(DecodePrediction, v, path, f"{where}.decode")
        elif k == "terms" and v is not None:
            v = _parse(DecodeTerms, v, path, f"{where}.terms")
        elif k == "profile" and not isinstance(v, str):
            raise HpipeError(f"{path}: {where}.profile: expected the profile's path, got {v!r}")
        elif not _finite(v):
            raise HpipeError(f"{path}: {where}.{k}: {v!r} holds a number that is not finite")
        values[k] = _tuples(v)
    return cls(**values)


def _json(obj) -> dict:
    """The dataclass as the plan file holds it: a field that is None is left out (as before it existed)."""
    return {f.name: _json(v) if hasattr(v, "__dataclass_fields__") else v
            for f in fields(obj) if (v := getattr(obj, f.name)) is not None}


def _finite(v) -> bool:
    """No inf or nan anywhere in a figure (lists and the reports' objects included)."""
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(map(_finite, v))
    if isinstance(v, dict):
        return all(map(_finite, v.values()))
    return True


def _tuples(v):
    """JSON's lists as tuples (frozen all the way down, as written); objects stay."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v
