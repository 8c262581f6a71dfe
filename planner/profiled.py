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
from hpipe.planner.partition import partition_layers
from hpipe.planner.simulate import simulate
from hpipe.planner.uniform import uniform_cuts
from hpipe.grid import GridModel


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

    def stage_time(self, j: int, a: int, b: int, s, c, last: bool, overlap: bool = False) -> np.ndarray:
        """Stage j holding units [a, b): compute of slices of s tokens after c (arrays), plus the
        send to stage j+1 unless it is the last stage (or the larger of the two, with overlap)."""
        fits = self.fits[self.entries[j]["id"]]
        s = np.asarray(s, dtype=float)
        out = np.zeros(s.shape)
        for kind in set(self.kinds[a:b]):
            count = self.kinds[a:b].count(kind)
            out = out + count * fits[kind](s, c if kind == "attn" else 0.0)
        if not last:
            alpha, beta = self.link(j)
            send = alpha + s * self.bytes["activation_per_token_at_cut"][b] / beta
            out = np.maximum(out, send) if overlap else out + send
        return out

    def link(self, j: int) -> tuple[float, float]:
        a, b = self.entries[j]["id"], self.entries[j + 1]["id"]
        if (a, b) not in self.links:
            raise HpipeError(f"{self.path}: the profile has no link {a} -> {b}; profile both devices together")
        return self.links[(a, b)]

    def send_time(self, j: int, cut: int, s: int) -> float:
        alpha, beta = self.link(j)
        return alpha + s * self.bytes["activation_per_token_at_cut"][cut] / beta


def _workload(cost: CostModel, slices: list[int], batch: int, d: int, n_units: int):
    """The partition's inputs for a slicing: every unit's time summed over all slices of the batch."""
    starts = np.cumsum([0] + slices[:-1])
    unit_time = np.zeros((d, n_units))
    out_comm = np.zeros((d, n_units))
    for j in range(d):
        for s, c in zip(slices, starts):
            unit_time[j] += batch * cost.unit_times(j, s, c)
            if j < d - 1:
                out_comm[j] += batch * np.array([cost.send_time(j, u + 1, s) for u in range(n_units)])
    return unit_time, out_comm


def _predict(cost: CostModel, cuts: list[int], slices: list[int], batch: int):
    """The simulated pipeline of one batch: every sequence's slices in order through the stages."""
    d = len(cuts) - 1
    starts = np.cumsum([0] + slices[:-1])
    t = np.zeros((len(slices) * batch, d))
    comm = np.zeros_like(t)
    for j in range(d):
        compute = cost.stage_time(j, cuts[j], cuts[j + 1], slices, starts, last=True)
        t[:, j] = np.tile(compute, batch)
        if j < d - 1:
            send = cost.stage_time(j, cuts[j + 1], cuts[j + 1], slices, starts, last=False)
            comm[:, j] = np.tile(send, batch)
    return simulate(t, comm)


def _tau(cost: CostModel, cuts: list[int], seq_len: int, g: int, overlap: bool = False) -> np.ndarray:
    """tau[s, c] in units of g tokens: the slowest stage's time for that slice, its send included
    (added, or overlapped with the compute)."""
    n = -(-seq_len // g)
    s_u, c_u = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    s_tok = np.clip(np.minimum((c_u + s_u) * g, seq_len) - c_u * g, 0, None).astype(float)
    c_tok = (c_u * g).astype(float)
    valid = (s_u >= 1) & (s_u + c_u <= n)
    s_tok, c_tok = s_tok[valid], c_tok[valid]
    d = len(cuts) - 1
    worst = np.zeros(s_tok.shape)
    for j in range(d):
        worst = np.maximum(worst, cost.stage_time(j, cuts[j], cuts[j + 1], s_tok, c_tok, last=(j == d - 1),
                                                  overlap=overlap))
    tau = np.full((n + 1, n + 1), np.inf)
    tau[valid] = worst
    return tau


def plan_from_profile(profile: dict, profile_path: str, model_name: str, config, devices: list[tuple[str, str]],
                      seq_len: int, batch: int = 1, slicing: formats.Slicing | None = None,
                      margin: float = 0.1, dtype: str | None = None, granularity: int = 16,
                      max_rounds: int = 6, overlap: bool = False) -> formats.Plan:
    """Cuts (Algorithm 1) and, unless `slicing` is given, token slices (Algorithm 2) from a profile,
    iterating partition <-> slicing until the simulated makespan stops improving. A stage's time for
    a slice is its compute plus its send (HPipe eq. 1), or with `overlap` the larger of the two (a
    send that runs beside the next compute, as on GPUs with their own copy engines)."""
    from hpipe.planner.slicing import slice_sequence

    ctx = models.context_length(config)
    if not 1 <= seq_len <= ctx:
        raise HpipeError(f"--seq-len {seq_len}: must be between 1 and the model's context ({ctx} tokens)")
    if batch < 1:
        raise HpipeError(f"--batch must be at least 1, got {batch}")
    n_units = models.num_units(config)
    d = len(devices)
    if d > n_units:
        raise HpipeError(f"{d} devices but the model has only {n_units} units")
    cost = CostModel(profile, config, devices, profile_path)
    b = cost.bytes
    unit_mem = np.array(b["weights_per_unit"], dtype=float) + \
        np.array(b["kv_per_token_per_unit"], dtype=float) * seq_len * batch
    names = [f"{h}/{dv}" for h, dv in devices]

    def partition(slices):
        act_buffer = 4 * max(slices) * max(b["activation_per_token_at_cut"])
        device_mem = np.array([e["memory"]["free_bytes"] * (1 - margin) - act_buffer for e in cost.entries])
        return partition_layers(*_workload(cost, slices, batch, d, n_units), unit_mem, device_mem, names,
                                overlap=overlap), act_buffer

    fixed = slicing is not None
    slices = (slicing or formats.Slicing(count=2 * d, granularity=granularity)).slices_for(seq_len)
    best = None
    for _ in range(1 if fixed else max_rounds):
        part, act_buffer = partition(slices)
        timeline = _predict(cost, part.cuts, slices, batch)
        if best is not None and timeline.makespan >= best[2].makespan * (1 - 1e-9):
            break
        best = (part, slices, timeline, act_buffer)
        if fixed:
            break
        units = slice_sequence(_tau(cost, part.cuts, seq_len, granularity, overlap=overlap), d).lengths
        slices = [min(u * granularity, seq_len - sum(x * granularity for x in units[:i])) for i, u in enumerate(units)]
    part, slices, timeline, act_buffer = best
    cuts = part.cuts
    busy = timeline.busy()
    predicted = {
        "profile": profile_path, "seq_len": seq_len, "batch": batch, "slices": slices,
        "makespan_s": timeline.makespan, "throughput_tokens_per_s": seq_len * batch / timeline.makespan,
        "stage_busy_s": busy.tolist(), "utilization": (busy / timeline.makespan).tolist(),
        "partition_bottleneck_s": part.bottleneck, "overlap_sends": overlap,
        "memory_bytes_per_stage": [float(unit_mem[cuts[j]:cuts[j + 1]].sum() + act_buffer) for j in range(d)],
        "memory_free_bytes": [int(e["memory"]["free_bytes"]) for e in cost.entries],
        "uniform_makespan_s": _predict(cost, [0, *uniform_cuts(n_units, d), n_units], slices, batch).makespan,
    }
    if not fixed:
        slicing = formats.Slicing(count=len(slices), granularity=granularity, by_seq_len={seq_len: tuple(slices)})
    identity = formats.ModelIdentity(name=model_name, family=config.model_type, units=n_units,
                                     blocks=models.num_blocks(config), fingerprint=models.fingerprint(config))
    stages = tuple(formats.StagePlan(host=h, device=dv, units=(cuts[j], cuts[j + 1]))
                   for j, (h, dv) in enumerate(devices))
    plan = formats.Plan(model=identity, stages=stages, slicing=slicing, dtype=dtype or profile["dtype"],
                        predicted=predicted, created_by=f"hpipe {__version__} (profile: DP partition"
                                                        f"{'' if fixed else ' and DP slicing'})")
    formats.validate_plan(plan)
    return plan
