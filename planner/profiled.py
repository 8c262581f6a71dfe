"""Plans from a profile: the profile's fitted unit times and link figures turned into the
partition's inputs (HPipe eq. 1 and 3), memory per stage, and the predicted pipeline.

A slice of s tokens after c tokens of context on stage j costs the sum of its units' t(s, c) on
that stage's device; sending it to stage j+1 costs alpha + s x (activation bytes per token at
the cut) / beta of that link.
"""

from __future__ import annotations

import numpy as np

from hpipe import __version__, formats, models
from hpipe.errors import HpipeError
from planner.partition import partition_layers
from planner.simulate import simulate
from planner.uniform import uniform_cuts
from profiler.fit import GridModel


def check_profile_matches(profile: dict, config, model_name: str, path: str) -> None:
    m = profile["model"]
    fp = models.fingerprint(config)
    if m["fingerprint"] != fp or m["units"] != models.num_units(config):
        raise HpipeError(f"{path}: the profile was made for model {m['name']!r} ({m['family']}, {m['units']} units, "
                         f"{m['fingerprint']}), not for {model_name!r} ({config.model_type}, "
                         f"{models.num_units(config)} units, {fp}); profile this model with "
                         f"`hpipe profile --model {model_name} ...`")


class CostModel:
    """Unit and link costs for devices in pipeline order, from a profile."""

    def __init__(self, profile: dict, config, devices: list[tuple[str, str]], path: str = "<profile>"):
        self.profile = profile
        self.config = config
        self.path = path
        self.entries = [self._entry(h, d) for h, d in devices]
        self.kinds = [models.unit_kind(config, u) for u in range(models.num_units(config))]
        self.fits = {}
        for e in self.entries:
            if e["id"] not in self.fits:
                self.fits[e["id"]] = {k: GridModel(t["s"], t["c"], t["t"]) for k, t in e["compute"].items()}
        self.bytes = profile["bytes"]
        self.links = {(x["src"], x["dst"]): (x["alpha_s"], x["beta_bytes_per_s"]) for x in profile["links"]}

    def _entry(self, host: str, device: str) -> dict:
        devs = self.profile["devices"]
        exact = [d for d in devs if d["id"] == f"{host}/{device}"]
        if exact:
            return exact[0]
        same = [d for d in devs if d["device"] == device]
        if len({d["type"] for d in same}) == 1:  # one device type measured once stands for the others
            return same[0]
        raise HpipeError(f"{self.path}: no profile for device {host}/{device}; the profile has "
                         f"{', '.join(d['id'] for d in devs)}")

    def unit_times(self, j: int, s, c) -> np.ndarray:
        """[U]: every unit's time for a slice of s tokens after c on stage j's device."""
        fits = self.fits[self.entries[j]["id"]]
        per_kind = {k: float(f(np.array([s]), np.array([c]))[0]) for k, f in fits.items()}
        return np.array([per_kind[k] for k in self.kinds])

    def link(self, j: int) -> tuple[float, float]:
        a, b = self.entries[j]["id"], self.entries[j + 1]["id"]
        if (a, b) not in self.links:
            raise HpipeError(f"{self.path}: the profile has no link {a} -> {b}; profile both devices together")
        return self.links[(a, b)]

    def send_time(self, j: int, cut: int, s: int) -> float:
        alpha, beta = self.link(j)
        return alpha + s * self.bytes["activation_per_token_at_cut"][cut] / beta


def plan_from_profile(profile: dict, profile_path: str, model_name: str, config, devices: list[tuple[str, str]],
                      seq_len: int, batch: int = 1, slicing: formats.Slicing | None = None,
                      margin: float = 0.1, dtype: str | None = None) -> formats.Plan:
    ctx = models.context_length(config)
    if not 1 <= seq_len <= ctx:
        raise HpipeError(f"--seq-len {seq_len}: must be between 1 and the model's context ({ctx} tokens)")
    if batch < 1:
        raise HpipeError(f"--batch must be at least 1, got {batch}")
    n_units = models.num_units(config)
    if len(devices) > n_units:
        raise HpipeError(f"{len(devices)} devices but the model has only {n_units} units")
    cost = CostModel(profile, config, devices, profile_path)
    slicing = slicing or formats.Slicing(count=2 * len(devices))
    slices = slicing.slices_for(seq_len)
    starts = np.cumsum([0] + slices[:-1])
    d = len(devices)
    # the partition's inputs: the whole workload (every slice of every sequence) per unit and device
    unit_time = np.zeros((d, n_units))
    out_comm = np.zeros((d, n_units))
    for j in range(d):
        for s, c in zip(slices, starts):
            unit_time[j] += batch * cost.unit_times(j, s, c)
            if j < d - 1:
                out_comm[j] += batch * np.array([cost.send_time(j, u + 1, s) for u in range(n_units)])
    b = cost.bytes
    unit_mem = np.array(b["weights_per_unit"], dtype=float) + \
        np.array(b["kv_per_token_per_unit"], dtype=float) * seq_len * batch
    act_buffer = 4 * max(slices) * max(b["activation_per_token_at_cut"])
    device_mem = np.array([e["memory"]["free_bytes"] * (1 - margin) - act_buffer for e in cost.entries])
    names = [f"{h}/{dv}" for h, dv in devices]
    part = partition_layers(unit_time, out_comm, unit_mem, device_mem, names)
    cuts = part.cuts
    # the predicted pipeline of one batch: every sequence's slices in order
    t = np.zeros((len(slices) * batch, d))
    comm = np.zeros_like(t)
    for j in range(d):
        a, e = cuts[j], cuts[j + 1]
        for i, (s, c) in enumerate(zip(slices, starts)):
            t[i::len(slices), j] = cost.unit_times(j, s, c)[a:e].sum()
            if j < d - 1:
                comm[i::len(slices), j] = cost.send_time(j, e, s)
    timeline = simulate(t, comm)
    busy = timeline.busy()
    predicted = {
        "profile": profile_path, "seq_len": seq_len, "batch": batch, "slices": slices,
        "makespan_s": timeline.makespan, "throughput_tokens_per_s": seq_len * batch / timeline.makespan,
        "stage_busy_s": busy.tolist(), "utilization": (busy / timeline.makespan).tolist(),
        "partition_bottleneck_s": part.bottleneck,
        "memory_bytes_per_stage": [float(unit_mem[cuts[j]:cuts[j + 1]].sum() + act_buffer) for j in range(d)],
        "memory_free_bytes": [int(e["memory"]["free_bytes"]) for e in cost.entries],
        "uniform_makespan_s": _uniform_makespan(cost, uniform_cuts(n_units, d), slices, starts, batch),
    }
    identity = formats.ModelIdentity(name=model_name, family=config.model_type, units=n_units,
                                     blocks=models.num_blocks(config), fingerprint=models.fingerprint(config))
    stages = tuple(formats.StagePlan(host=h, device=dv, units=(cuts[j], cuts[j + 1]))
                   for j, (h, dv) in enumerate(devices))
    plan = formats.Plan(model=identity, stages=stages, slicing=slicing, dtype=dtype or profile["dtype"],
                        predicted=predicted, created_by=f"hpipe {__version__} (profile, DP partition)")
    formats.validate_plan(plan)
    return plan


def _uniform_makespan(cost: CostModel, interior: list[int], slices, starts, batch) -> float:
    cuts = [0, *interior, len(cost.kinds)]
    d = len(cuts) - 1
    t = np.zeros((len(slices) * batch, d))
    comm = np.zeros_like(t)
    for j in range(d):
        for i, (s, c) in enumerate(zip(slices, starts)):
            t[i::len(slices), j] = cost.unit_times(j, s, c)[cuts[j]:cuts[j + 1]].sum()
            if j < d - 1:
                comm[i::len(slices), j] = cost.send_time(j, cuts[j + 1], s)
    return simulate(t, comm).makespan
