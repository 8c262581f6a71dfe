"""Plans from a profile: the profile's fitted unit times and link figures turned into the
partition's inputs (HPipe eq. 1 and 3), memory per stage (hpipe.memory), the predicted pipeline
and a lower bound on its makespan.

A slice of s tokens after c tokens of context on stage j costs the sum of its units' t(s, c) on
that stage's device; sending it to stage j+1 costs alpha + s x (activation bytes per token at
the cut) / beta of that link.

`plan_from_profile` returns a `PlanResult`: the plan file's object and what it was decided with
(the cost model, the simulated timeline, the lower bound), so that callers (the CLI, `--compare`,
`--timeline`) use the planner's own figures instead of recomputing them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from hpipe import __version__, formats, memory, models, quant
from hpipe.errors import HpipeError
from hpipe.grid import GridModel
from hpipe.planner.bound import LowerBound, gap, lower_bound
from hpipe.planner.cuts import CutCosts, CutSearch, objective_values, search_cuts
from hpipe.planner import placement
from hpipe.planner.partition import Infeasible, Partition, partition_layers
from hpipe.planner.simulate import Sharing, Timeline, decode_round, simulate, simulate_shared
from hpipe.planner.slicing import slice_sequence
from hpipe.planner.speculative import speculative_decode
from hpipe.planner.uniform import model_identity
from hpipe.planner.uniform import uniform_cuts
from hpipe.prediction import DecodePrediction, DecodeTerms, Prediction


OBJECTIVES = ("prefill", "decode", "mixed")
MARGIN = 0.1     # the share of each device's free memory a plan keeps free (`hpipe plan --margin`)


def check_profile_matches(profile: formats.Profile, config, model_name: str, path: str) -> None:
    m = profile.model
    fp = models.fingerprint(config)
    if m.fingerprint != fp or m.units != models.num_units(config):
        raise HpipeError(f"{path}: the profile was made for model {m.name!r} ({m.family}, {m.units} units, "
                         f"{m.fingerprint}), not for {model_name!r} ({config.model_type}, "
                         f"{models.num_units(config)} units, {fp}); profile this model with "
                         f"`hpipe profile --model {model_name} ...`")


def _fits(entry: formats.DeviceProfile) -> dict[str, GridModel]:
    """A profiled device's fitted time per unit kind."""
    return {k: GridModel(t.s, t.c, t.t) for k, t in entry.compute.items()}


class CostModel:
    """Unit and link costs for devices in pipeline order, from a profile."""

    def __init__(self, profile: formats.Profile, config, devices: list[tuple[str, str]], path: str = "<profile>"):
        self.profile = profile
        self.config = config
        self.path = path
        self.entries = [self._entry(h, d) for h, d in devices]
        self.kinds = [models.unit_kind(config, u) for u in range(models.num_units(config))]
        self.fits = {}
        for e in self.entries:
            self.fits.setdefault(e.id, _fits(e))
        self.bytes = profile.bytes
        self.links = {(x.src, x.dst): (x.alpha_s, x.beta_bytes_per_s) for x in profile.links}
        # the runtime's own costs per step (hpipe.profiler.runtime_costs); a profile without them counts 0
        self.measured_runtime = profile.runtime is not None
        self.runtime = profile.runtime or formats.RuntimeCosts(0.0, 0.0, 0.0)
        self.hop_s = self.runtime.hop_s
        self.placed: dict[int, frozenset[int]] = {}     # stage -> units whose experts its host's CPU runs
        self.host_cpus: dict[int, formats.DeviceProfile] = {}     # stage -> that CPU's profile entry

    def host_cpu(self, j: int) -> formats.DeviceProfile | None:
        """The profile entry of stage j's host's CPU, where the profile measured it: what could run
        the routed experts of stage j's MoE blocks from the host's RAM."""
        return self.profile.device(f"{self.entries[j].host}/cpu")

    def with_host_experts(self, placed: dict[int, frozenset[int]]) -> "CostModel":
        """These costs with stage j's units `placed[j]` running their MoE half on its host's CPU
        (a plan's `host_experts`): the CPU's time for the unit plus the rows' crossing both ways.
        The CPU's time is its whole MoE half's (router and shared expert too, which stay on the
        stage's device): a little over."""
        out = copy.copy(self)
        out.placed = {j: u for j, u in placed.items() if u}
        out.host_cpus = {j: self.host_cpu(j) for j in out.placed}
        out.fits = dict(self.fits)
        for e in out.host_cpus.values():
            out.fits.setdefault(e.id, _fits(e))
        return out

    def crossing(self, j: int, s):
        """Stage j's rows to its host's CPU and back: the link between them, both ways."""
        alpha, beta = self.links.get((self.entries[j].id, self.host_cpus[j].id), formats.INTRA_LINK)
        return 2 * (alpha + np.asarray(s, dtype=float) * max(self.bytes.activation_per_token_at_cut) / beta)

    def host_mlp(self, j: int, s):
        """A MoE half of stage j on its host's CPU, for slices of s tokens."""
        return self.fits[self.host_cpus[j].id]["mlp"](np.asarray(s, dtype=float), 0.0) + self.crossing(j, s)

    def way_back(self) -> float:
        """From the last stage's compute end to stage 0's next step: the sampling, the ids' trip to
        stage 0 (the link's latency) and the commit; with one stage, the step's own machinery."""
        if len(self.entries) == 1:
            return self.runtime.step_s
        back = (self.entries[-1].id, self.entries[0].id)
        return self.runtime.back_s + (self.links[back][0] if back in self.links else 0.0)

    @functools.cached_property
    def sharing(self) -> Sharing:
        """Which stages compete for one machine's cores: CPU stages on the same machine (the profile's
        boot id, else the host), with the threads they were measured with."""
        machine, threads, cores = [], [], {}
        for e in self.entries:
            ident = e.identity
            if e.device != "cpu" or not ident.get("cores"):
                machine.append(None)
                threads.append(1)
                continue
            name = ident.get("machine") or e.host
            machine.append(name)
            threads.append(int(ident.get("threads") or ident["cores"]))
            cores[name] = int(ident["cores"])
        return Sharing(tuple(machine), tuple(threads), cores)

    def _entry(self, host: str, device: str) -> formats.DeviceProfile:
        devs = self.profile.devices
        exact = self.profile.device(f"{host}/{device}")
        if exact is not None:
            return exact
        same = [d for d in devs if d.device == device]
        if len({d.type for d in same}) == 1:  # one device type measured once stands for the others
            return same[0]
        raise HpipeError(f"{self.path}: no profile for device {host}/{device}; the profile has "
                         f"{', '.join(d.id for d in devs)}")

    def unit_times(self, j: int, s, c) -> np.ndarray:
        """[U]: every unit's time for a slice of s tokens after c on stage j's device."""
        fits = self.fits[self.entries[j].id]
        per_kind = {k: float(f(np.array([s]), np.array([c]))[0]) for k, f in fits.items()}
        out = np.array([per_kind[k] for k in self.kinds])
        placed = list(self.placed.get(j, ()))
        if placed:
            out[placed] = float(self.host_mlp(j, [s])[0])
        return out

    def stage_time(self, j: int, a: int, b: int, s, c, last: bool, overlap: bool = False) -> np.ndarray:
        """Stage j holding units [a, b): compute of slices of s tokens after c (arrays), plus the
        send to stage j+1 unless it is the last stage (or the larger of the two, with overlap)."""
        fits = self.fits[self.entries[j].id]
        s = np.asarray(s, dtype=float)
        out = np.zeros(s.shape)
        for kind in set(self.kinds[a:b]):
            count = self.kinds[a:b].count(kind)
            out = out + count * fits[kind](s, c if kind == "attn" else 0.0)
        moved = sum(1 for u in self.placed.get(j, ()) if a <= u < b)
        if moved:
            out = out + moved * (self.host_mlp(j, s) - fits["mlp"](s, 0.0))
        if not last:
            alpha, beta = self.link(j)
            send = alpha + self.hop_s + s * self.bytes.activation_per_token_at_cut[b] / beta
            out = np.maximum(out, send) if overlap else out + send
        return out

    def link(self, j: int) -> tuple[float, float]:
        a, b = self.entries[j].id, self.entries[j + 1].id
        if (a, b) not in self.links:
            raise HpipeError(f"{self.path}: the profile has no link {a} -> {b}; profile both devices together")
        return self.links[(a, b)]

    def send_time(self, j: int, cut: int, s: int) -> float:
        """Stage j's send of s tokens' hidden states at `cut`, as the runtime pays it (the link's
        latency and bandwidth, and the runtime's own hop)."""
        alpha, beta = self.link(j)
        return alpha + self.hop_s + s * self.bytes.activation_per_token_at_cut[cut] / beta


def workload(cost: CostModel, slices: list[int], batch: int):
    """The partition's inputs for a slicing: every unit's time on every device, summed over all
    slices of the batch [D, U], and the send after each unit [D, U]."""
    d, n_units = len(cost.entries), len(cost.kinds)
    out_comm = np.zeros((d, n_units))
    for j in range(d - 1):
        for s in slices:
            out_comm[j] += batch * np.array([cost.send_time(j, u + 1, s) for u in range(n_units)])
    return unit_work(cost, slices, batch), out_comm


def unit_work(cost: CostModel, slices: list[int], batch: int) -> np.ndarray:
    """[D, U]: every unit's time on every device for all slices of the batch."""
    starts = np.cumsum([0] + slices[:-1])
    unit_time = np.zeros((len(cost.entries), len(cost.kinds)))
    for j in range(len(cost.entries)):
        for s, c in zip(slices, starts):
            unit_time[j] += batch * cost.unit_times(j, s, c)
    return unit_time


def _decode_table_time(table: formats.DecodeTable, kind: str, rows: float, context: float) -> float:
    """A profile's decode table at (rows, context): linear between its measured points, held at
    the edges."""
    batch, ctx = np.asarray(table.batch, float), np.asarray(table.context, float)
    t = np.asarray(table.t[kind], float)                   # [batch, context]
    by_ctx = np.array([np.interp(context, ctx, row) for row in t])
    return float(np.interp(rows, batch, by_ctx))


def decode_unit_times(cost: CostModel, j: int, rows: float, context: float) -> np.ndarray:
    """[U]: every unit's time for one decode step of `rows` sequences after `context` tokens on
    stage j's device, from the profile's decode table (the embedding's lookup counts as free)."""
    table = cost.entries[j].decode
    if not table:
        raise HpipeError(f"{cost.path}: device {cost.entries[j].id} has no decode table; profile it again "
                         f"(`hpipe profile`, or --estimate) to plan for decode")
    per_kind = {"embed": 0.0}
    for kind in ("attn", "mlp", "head"):
        per_kind[kind] = _decode_table_time(table, kind, rows, context)
    out = np.array([per_kind.get(k, 0.0) for k in cost.kinds])
    placed = list(cost.placed.get(j, ()))
    if placed:                # experts in the host's RAM: its CPU's MoE half, and the crossing
        host = cost.host_cpus[j].decode
        out[placed] = (_decode_table_time(host, "mlp", rows, context) if host else per_kind["mlp"]) + \
            float(cost.crossing(j, rows))
    return out


def decode_workload(cost: CostModel, batch: int, seq_len: int, new_tokens: int):
    """The partition's inputs for decoding `new_tokens` tokens of `batch` sequences after a prompt
    of seq_len: the runtime's decode groups (ceil(batch / stages) sequences each, one group per
    stage in flight), every unit's time summed over all steps of all groups [D, U], and the sends."""
    d = len(cost.entries)
    rows, groups = decode_groups(batch, d)
    context = seq_len + new_tokens / 2
    steps = groups * new_tokens
    unit_time = np.stack([steps * decode_unit_times(cost, j, rows, context) for j in range(d)])
    out_comm = np.zeros_like(unit_time)
    for j in range(d - 1):
        out_comm[j] = steps * np.array([cost.send_time(j, u + 1, rows) for u in range(len(cost.kinds))])
    return unit_time, out_comm


def decode_prediction(cost: CostModel, cuts: list[int], batch: int, seq_len: int, new_tokens: int,
                      speculation: tuple[int, float] | None = None) -> DecodePrediction:
    """The runtime's steady decode on these cuts: per stage, one group's step (its compute, and its
    send with the runtime's hop). A round (one token per sequence) takes `groups` steps of the
    slowest stage, but never less than one group's trip: every stage's step, then the way back to
    stage 0 (sampling, the ids' trip, the commit: `CostModel.way_back`); with as many groups as
    stages that trip is what binds once the stages balance. `terms` keeps the parts, for the run's
    predicted-against-measured check. speculation: (K, the measured share of proposals accepted):
    the same with speculative decoding (`hpipe.planner.speculative`), under "speculative"."""
    d = len(cuts) - 1
    rows, groups = decode_groups(batch, d)
    context = seq_len + new_tokens / 2
    back = cost.way_back()

    def compute(r: float) -> list[float]:
        return [float(np.sum(decode_unit_times(cost, j, r, context)[cuts[j]:cuts[j + 1]])) for j in range(d)]

    def sends(r: float) -> list[float]:
        return [cost.send_time(j, cuts[j + 1], r) for j in range(d - 1)]

    def steps(r: float) -> list[float]:
        return [c + s for c, s in zip(compute(r), [*sends(r), 0.0])]
    step = steps(rows)
    round_s = float(decode_round(step, back, groups))
    terms = DecodeTerms(compute_s=tuple(compute(rows)), send_s=tuple(sends(rows)), back_s=back,
                        runtime_costs="measured" if cost.measured_runtime else "not in the profile: counted as 0")
    return DecodePrediction(new_tokens=new_tokens, rows_per_group=rows, groups=groups, context=context,
                            stage_step_s=tuple(step), round_s=round_s, tokens_per_s=batch / round_s, terms=terms,
                            speculative=None if speculation is None else
                            speculative_decode(batch, rows, groups, steps, *speculation, back_s=back))


def decode_groups(batch: int, n_stages: int) -> tuple[int, int]:
    """The runtime's decode groups: (sequences per group, groups); one group per stage in flight."""
    rows = -(-batch // n_stages)
    return rows, -(-batch // rows)


def cut_costs(cost: CostModel, slices: list[int], batch: int, unit_mem: np.ndarray, device_mem: np.ndarray,
              objective: str, seq_len: int, new_tokens: int) -> CutCosts:
    """The cut search's inputs (planner/cuts.py) for this slicing and objective: per device and
    slice, the prefix sums of the units' times and the send at every cut position."""
    d, n_units = len(cost.entries), len(cost.kinds)
    starts = np.cumsum([0] + slices[:-1])
    order = np.tile(np.arange(len(slices)), batch)              # the batch's slices as they enter stage 0
    act = np.asarray(cost.bytes.activation_per_token_at_cut, dtype=float)[: n_units + 1]
    s = np.asarray(slices, dtype=float)
    compute = np.zeros((d, len(slices), n_units + 1))
    for j in range(d):
        for i, (si, ci) in enumerate(zip(slices, starts)):
            compute[j, i, 1:] = np.cumsum(cost.unit_times(j, si, ci))
    send = np.zeros((max(d - 1, 0), len(slices), n_units + 1))
    for j in range(d - 1):
        alpha, beta = cost.link(j)
        send[j] = alpha + cost.hop_s + s[:, None] * act[None, :] / beta
    prefix = np.concatenate([[0.0], np.cumsum(unit_mem)])
    kw = {}
    if objective != "prefill":
        rows, groups = decode_groups(batch, d)
        context = seq_len + new_tokens / 2
        kw = {"decode_tokens": float(new_tokens), "decode_groups": groups,
              "decode_compute": np.stack([np.concatenate([[0.0], np.cumsum(decode_unit_times(cost, j, rows, context))])
                                          for j in range(d)]),
              "decode_send": np.stack([cost.link(j)[0] + cost.hop_s + rows * act / cost.link(j)[1]
                                       for j in range(d - 1)]) if d > 1 else np.zeros((0, n_units + 1)),
              "decode_back": cost.way_back()}
    return CutCosts(compute=compute[:, order], send=send[:, order], memory=prefix, capacity=np.asarray(device_mem, float),
                    prefill_weight=0.0 if objective == "decode" else 1.0, prefill_back=cost.way_back(), **kw)


def objective_seconds(result: "PlanResult") -> float:
    """The predicted time of what the plan balances: the prefill makespan, the decode of every
    sequence's new tokens, or both."""
    return result.plan.predicted.objective_s()


def pipeline_times(cost: CostModel, cuts: list[int], slices: list[int], batch: int) -> tuple[np.ndarray, np.ndarray]:
    """[m, D] every slice's compute on every stage (each alone on its device) and [m, D] its send to
    the next stage, the batch's sequences one after another (m = slices x batch)."""
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
    return t, comm


def predict(cost: CostModel, cuts: list[int], slices: list[int], batch: int) -> Timeline:
    """The simulated pipeline of one batch: every sequence's slices in order through the stages
    (stages that share a machine's cores slowed while they run at once), then the first token's way
    back to stage 0."""
    t, comm = pipeline_times(cost, cuts, slices, batch)
    sharing = cost.sharing
    tl = simulate_shared(t, comm, sharing) if sharing.oversubscribed else simulate(t, comm)
    return dataclasses.replace(tl, makespan=tl.makespan + cost.way_back())


def slice_time_table(cost: CostModel, cuts: list[int], seq_len: int, g: int, overlap: bool = False) -> np.ndarray:
    """tau[s, c] in units of g tokens (Algorithm 2's input): the slowest stage's time for that
    slice, its send included (added, or overlapped with the compute)."""
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


def slices_in_tokens(units: list[int], g: int, seq_len: int) -> list[int]:
    """Algorithm 2's slice lengths (in units of g tokens) as token counts; the last one is cut at
    the prompt's end."""
    out, done = [], 0
    for u in units:
        out.append(min(u * g, seq_len - done))
        done += out[-1]
    return out


def slicings_by_length(cost: CostModel, cuts: list[int], seq_len: int, g: int, n_stages: int,
                       overlap: bool = False) -> dict[int, tuple[int, ...]]:
    """Algorithm 2 for every prompt length up to seq_len in steps of g tokens, with these cuts: what
    the runtime needs to give a prompt of any length its latency-optimal slicing (the table's next
    longer entry, its last slice cut at the prompt's end). One tau table serves every length: the
    cost of a slice depends on its size and context, not on the prompt's length."""
    tau = slice_time_table(cost, cuts, seq_len, g, overlap=overlap)
    table = {}
    for n in range(1, -(-seq_len // g) + 1):
        length = min(n * g, seq_len)
        units = slice_sequence(tau[: n + 1, : n + 1], n_stages).lengths
        table[length] = tuple(slices_in_tokens(units, g, length))
    return table


def slicings_by_context(cost: CostModel, cuts: list[int], seq_len: int, g: int, n_stages: int,
                        overlap: bool = False) -> dict[int, tuple[int, ...]]:
    """Algorithm 2 for the rest of the planned prompt after every cached context c (multiples of g
    tokens): the slice costs after c are tau's columns from c on, tau[s, c + c'], so the rest is
    sliced for the context it really has (a cached prefix), not as a prompt of its own."""
    tau = slice_time_table(cost, cuts, seq_len, g, overlap=overlap)
    n_units = tau.shape[0] - 1
    table = {}
    for c in range(1, n_units):
        n = n_units - c
        units = slice_sequence(tau[: n + 1, c:c + n + 1], n_stages).lengths
        table[c * g] = tuple(slices_in_tokens(units, g, seq_len - c * g))
    return table


def uniform_slicing(seq_len: int, count: int) -> list[int]:
    """count slices as equal as can be, the longer ones first."""
    return [seq_len // count + (1 if i < seq_len % count else 0) for i in range(count)]


def baseline_plans(cost: CostModel, seq_len: int, batch: int, granularity: int) -> dict[str, tuple[list[int], list[int]]]:
    """The HPipe paper's baselines (§4) as (cuts, slices), for `--compare` and as starting points of
    the plan's own search (so that no plan printed beside it is predicted faster):
    - GPipe: uniform cuts, whole prompts (the batch's prompts are its micro-batches);
    - GP-B: Algorithm 1 for whole prompts, whole prompts;
    - TeraPipe: uniform cuts and the best number of uniform slices (1 to 64);
    - HPipe-paper: the paper's two steps as written, Algorithm 1 on the whole-prompt workload, then
      Algorithm 2 for that partition; no memory model."""
    d, n_units = len(cost.entries), len(cost.kinds)
    uniform = [0, *uniform_cuts(n_units, d), n_units]
    whole = [seq_len]
    gpb = partition_layers(*workload(cost, whole, batch)).cuts
    counts = [c for c in range(1, 65) if c <= seq_len]
    tera = min((uniform_slicing(seq_len, c) for c in counts), key=lambda sl: predict(cost, uniform, sl, batch).makespan)
    paper = slices_in_tokens(slice_sequence(slice_time_table(cost, gpb, seq_len, granularity), d).lengths,
                             granularity, seq_len)
    return {"GPipe": (uniform, whole), "GP-B": (gpb, whole), f"TeraPipe ({len(tera)} slices)": (uniform, tera),
            "HPipe-paper": (gpb, paper)}


@dataclass(frozen=True)
class PlanResult:
    plan: formats.Plan           # what `hpipe plan` writes (its `predicted` holds the figures below)
    cost: CostModel              # the profile's costs for the plan's devices, in pipeline order
    timeline: Timeline           # the simulated prefill of the planned batch
    bound: LowerBound            # no plan on these devices does this work faster

    @property
    def cuts(self) -> list[int]:
        return [st.units[0] for st in self.plan.stages] + [self.plan.stages[-1].units[1]]

    @property
    def slices(self) -> list[int]:
        return list(self.plan.predicted.slices)


def _rows(a: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(r) for r in a.tolist())


def assumptions(cost: CostModel, sharing: Sharing) -> list[str]:
    """What the prediction takes for granted that a run can break, one line each (printed by
    `hpipe plan`, kept in the plan)."""
    out = []
    names = [e.id for e in cost.entries]
    groups: dict[str, list[int]] = {}
    for j, m in enumerate(sharing.machine):
        if m is not None:
            groups.setdefault(m, []).append(j)
    for m, stages in groups.items():
        threads = sum(sharing.threads[j] for j in stages)
        if threads > sharing.cores[m]:
            who = ", ".join(dict.fromkeys(names[j] for j in stages))
            out.append(f"stages {', '.join(map(str, stages))} ({who}) share one machine's {sharing.cores[m]} cores "
                       f"with {threads} threads: while they run at once each gets its share (simulated); a decode "
                       f"step runs alone")
    if not cost.measured_runtime:
        out.append("the profile has no runtime costs (hop, way back, per-step machinery): counted as 0; "
                   "profile again with this version to measure them")
    return out


def memory_binding(cost, found, slices, batch, unit_mem, capacity, objective, seq_len, new_tokens, kv_tokens,
                   names, starts) -> dict | None:
    """Where memory moved the cuts: the cuts the same search finds with memory unlimited, if they
    are predicted faster, and the first of their stages whose device cannot hold it (a MoE block's
    experts are most of its bytes). None where memory did not bind."""
    if float(np.sum(unit_mem)) <= float(np.min(capacity)):
        return None                 # every device holds the whole model: memory cannot bind (no second search)
    unlimited = search_cuts(cut_costs(cost, slices, batch, unit_mem, np.full(len(capacity), np.inf), objective,
                                      seq_len, new_tokens), [found.cuts, *starts])
    if unlimited.value >= found.value * (1 - 1e-9):
        return None
    cuts = unlimited.cuts
    need = [memory.stage_memory(cost.bytes, range(cuts[j], cuts[j + 1]), kv_tokens,
                                memory.microbatch_tokens(slices)).total for j in range(len(capacity))]
    j = next((j for j in range(len(capacity)) if need[j] > capacity[j]), None)
    if j is None:
        return None
    return {"device": names[j], "units": [int(cuts[j]), int(cuts[j + 1])], "need_bytes": int(need[j]),
            "free_bytes": int(max(capacity[j], 0)), "unlimited_cuts": [int(c) for c in cuts],
            "unlimited_value_s": float(unlimited.value), "value_s": float(found.value)}


def _experts_in_host_ram(cost, config, binding, found, slices, batch, unit_mem, capacity, objective, seq_len, new_tokens,
                         kv_tokens, margin) -> tuple[CostModel, CutSearch, dict] | None:
    """Where memory moved the cuts of a MoE model: the cuts memory would not have moved, with the
    experts of as few MoE blocks in their host's RAM as make them fit (`placement.host_experts`),
    if that is predicted faster. Returns the placed cost model, the search result it replaces the
    old one with, and the plan's record of the choice."""
    cuts = binding["unlimited_cuts"]
    choice = placement.host_experts(cost, config, cuts, capacity, kv_tokens, margin)
    if choice is None:
        return None
    placed = cost.with_host_experts(choice.units)
    costs = cut_costs(placed, slices, batch, unit_mem, np.full(len(capacity), np.inf), objective, seq_len, new_tokens)
    value = float(objective_values(costs, [cuts])[0])
    if not value < binding["value_s"] * (1 - 1e-9):
        return None
    record = {"blocks": choice.counts(len(cuts) - 1), "host_bytes": [choice.host_bytes.get(j, 0)
                                                                      for j in range(len(cuts) - 1)],
              "value_s": value, "cut_elsewhere_value_s": binding["value_s"], "cut_elsewhere": list(found.cuts)}
    return placed, CutSearch(cuts, value, "cuts memory would not move, experts in host RAM", 1), record


def plan_from_profile(profile: formats.Profile, profile_path: str, model_name: str, config, devices: list[tuple[str, str]],
                      seq_len: int, batch: int = 1, slicing: formats.Slicing | None = None,
                      margin: float = MARGIN, dtype: str | None = None, granularity: int = 16,
                      max_rounds: int = 6, overlap: bool = False, objective: str = "prefill",
                      new_tokens: int = 128) -> PlanResult:
    """Cuts and, unless `slicing` is given, token slices (Algorithm 2) from a profile. Algorithm 1's
    cuts are the start; the cuts kept are the ones the simulated objective itself prefers
    (planner/cuts.py: exact where the candidates are few, local search otherwise), iterated with
    the slicing until it stops improving, and tried on the slicings of the `--compare` baselines. A stage's time for
    a slice is its compute plus its send (HPipe eq. 1), or with `overlap` the larger of the two (a
    send that runs beside the next compute, as on GPUs with their own copy engines).

    objective: what the cuts balance — "prefill" (the batch's prompt slices, HPipe), "decode"
    (`new_tokens` decode steps of the runtime's decode groups, from the profile's decode tables:
    the LM head weighs far more there) or "mixed" (the sum of both per stage: prefill slices and decode
    steps sharing the micro-batches, as under continuous batching)."""
    _check_request(config, len(devices), seq_len, batch, objective, new_tokens)
    cost = CostModel(profile, config, devices, profile_path)
    search = _CutSearcher(cost, config, batch, seq_len, new_tokens, margin, objective, overlap,
                          [f"{h}/{dv}" for h, dv in devices])
    d, fixed = len(devices), slicing is not None
    slices = (slicing or formats.Slicing(count=2 * d, granularity=granularity)).slices_for(seq_len)
    best = None                            # (objective, Algorithm 1's partition, the search, slices)
    for _ in range(1 if fixed else max_rounds):
        part, found = search.by_makespan(slices, [best[2].cuts] if best else [])
        if best is not None and found.value >= best[0] * (1 - 1e-9):
            break
        best = (found.value, part, found, slices)
        if fixed:
            break
        units = slice_sequence(slice_time_table(cost, found.cuts, seq_len, granularity, overlap=overlap), d).lengths
        slices = slices_in_tokens(units, granularity, seq_len)
    if not fixed:      # the slicings of the plans `--compare` prints beside this one, with cuts searched too
        for name, (cuts0, slices0) in baseline_plans(cost, seq_len, batch, granularity).items():
            try:
                part, found = search.by_makespan(slices0, [cuts0, best[2].cuts])
            except Infeasible:
                continue
            if found.value < best[0] * (1 - 1e-9):
                best = (found.value, part, found, slices0)
    _, part, found, slices = best
    binding = None if objective == "mixed" else \
        memory_binding(cost, found, slices, batch, search.unit_mem, search.device_mem(slices), objective, seq_len,
                       new_tokens, search.kv_tokens, search.names, [search.uniform])
    placed = _experts_in_host_ram(cost, config, binding, found, slices, batch, search.unit_mem, search.device_mem(slices),
                                  objective, seq_len, new_tokens, search.kv_tokens, margin) if binding else None
    if placed is not None:
        search.cost, found, binding = placed[0], placed[1], None
    timeline = predict(search.cost, found.cuts, slices, batch)
    work = unit_work(search.cost, slices, batch)
    bound = lower_bound(search.cost, work, slices, batch)
    predicted = search.prediction(profile_path, part, found, slices, timeline, work, bound, binding,
                                  placed[2] if placed is not None else None)
    if not fixed:     # every shorter prompt gets its own Algorithm 2 slicing too (serving: any length comes)
        slicing = _slicing_tables(search.cost, found.cuts, slices, seq_len, granularity, overlap)
    plan = _profiled_plan(profile, model_name, config, devices, search.cost, found.cuts, slicing, dtype, predicted,
                          fixed)
    return PlanResult(plan, search.cost, timeline, bound)


def _slicing_tables(cost: CostModel, cuts: list[int], slices: list[int], seq_len: int, granularity: int,
                    overlap: bool) -> formats.Slicing:
    """The planned prompt's slices, and Algorithm 2's for every shorter prompt and every context
    a cached prefix leaves (`Slicing.by_seq_len`, `by_context`)."""
    d = len(cuts) - 1
    return formats.Slicing(count=len(slices), granularity=granularity,
                           by_seq_len={**slicings_by_length(cost, cuts, seq_len, granularity, d, overlap),
                                       seq_len: tuple(slices)},
                           by_context=slicings_by_context(cost, cuts, seq_len, granularity, d, overlap))


def _check_request(config, d: int, seq_len: int, batch: int, objective: str, new_tokens: int) -> None:
    if objective not in OBJECTIVES:
        raise HpipeError(f"--objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    if new_tokens < 1:
        raise HpipeError(f"--new-tokens must be at least 1, got {new_tokens}")
    ctx = models.context_length(config)
    if not 1 <= seq_len <= ctx:
        raise HpipeError(f"--seq-len {seq_len}: must be between 1 and the model's context ({ctx} tokens)")
    if batch < 1:
        raise HpipeError(f"--batch must be at least 1, got {batch}")
    n_units = models.num_units(config)
    if d > n_units:
        raise HpipeError(f"{d} devices but the model has only {n_units} units")


class _CutSearcher:
    """`plan_from_profile`'s cuts for given slices, and the figures of the plan it keeps: what the
    profile, the batch, the objective and the memory margin fix once."""

    def __init__(self, cost: CostModel, config, batch: int, seq_len: int, new_tokens: int, margin: float,
                 objective: str, overlap: bool, names: list[str]):
        self.cost, self.batch, self.seq_len, self.new_tokens = cost, batch, seq_len, new_tokens
        self.margin, self.objective, self.overlap, self.names = margin, objective, overlap, names
        self.n_units = models.num_units(config)
        self.kv_tokens = (seq_len + (new_tokens if objective != "prefill" else 0)) * batch
        self.unit_mem = memory.unit_memory(cost.bytes, self.kv_tokens)
        self.decoding = decode_workload(cost, batch, seq_len, new_tokens) if objective != "prefill" else None
        self.uniform = [0, *uniform_cuts(self.n_units, len(names)), self.n_units]
        self.sharing = cost.sharing

    def device_mem(self, slices) -> np.ndarray:
        act = memory.activation_bytes(self.cost.bytes.activation_per_token_at_cut, memory.microbatch_tokens(slices))
        return np.array([e.free_bytes * (1 - self.margin) - act for e in self.cost.entries])

    def partition(self, slices) -> Partition:
        unit_time, out_comm = workload(self.cost, slices, self.batch)
        if self.objective == "decode":
            unit_time, out_comm = self.decoding
        elif self.objective == "mixed":
            unit_time, out_comm = unit_time + self.decoding[0], out_comm + self.decoding[1]
        return partition_layers(unit_time, out_comm, self.unit_mem, self.device_mem(slices), self.names,
                                overlap=self.overlap)

    def by_makespan(self, slices, starts) -> tuple[Partition, CutSearch]:
        """Algorithm 1's cuts for these slices, then the cuts that minimize the simulated objective
        (never worse than Algorithm 1's, uniform cuts or the other starts)."""
        part, cost, batch = self.partition(slices), self.cost, self.batch
        if self.objective == "mixed":      # one workload, prefill and decode interleaved: Algorithm 1 is exact for it
            return part, CutSearch(part.cuts, part.bottleneck, "algorithm 1 (mixed: the busiest stage's work)", 1)
        costs = cut_costs(cost, slices, batch, self.unit_mem, self.device_mem(slices), self.objective, self.seq_len,
                          self.new_tokens)
        found = search_cuts(costs, [part.cuts, self.uniform, *starts])
        if self.sharing.oversubscribed and self.objective == "prefill":
            # the search runs every stage at full speed; where stages share cores the processor-
            # sharing simulation (`predict`) decides between its result and the starts
            cands = [list(c) for c in dict.fromkeys(tuple(c) for c in [found.cuts, part.cuts, self.uniform, *starts])]
            fits = np.isfinite(objective_values(costs, cands))
            value, cuts = min((predict(cost, c, slices, batch).makespan, c) for c, ok in zip(cands, fits) if ok)
            found = CutSearch(cuts, value, f"{found.method}, then shared cores", found.evaluated + len(cands))
        return part, found

    def prediction(self, profile_path: str, part: Partition, found: CutSearch, slices: list[int], timeline: Timeline,
                   work: np.ndarray, bound: LowerBound, binding: dict | None, host_experts: dict | None) -> Prediction:
        """The figures of the plan kept (its cuts `found.cuts`; `work`: its units' work, as the bound
        took it), as the plan file holds them."""
        cost, cuts, batch, seq_len, d = self.cost, found.cuts, self.batch, self.seq_len, len(self.names)
        slice_compute, slice_send = pipeline_times(cost, cuts, slices, batch)
        busy = timeline.busy()
        return Prediction(
            profile=profile_path, seq_len=seq_len, batch=batch, slices=tuple(slices),
            makespan_s=timeline.makespan, throughput_tokens_per_s=seq_len * batch / timeline.makespan,
            stage_busy_s=tuple(busy.tolist()), utilization=tuple((busy / timeline.makespan).tolist()),
            # per slice, for the run's check (a re-simulation with the stages' measured computes)
            slice_compute_s=_rows(slice_compute), slice_send_s=_rows(slice_send), way_back_s=cost.way_back(),
            partition_bottleneck_s=part.bottleneck, overlap_sends=self.overlap,
            cut_search={"method": found.method, "candidates": found.evaluated, "algorithm1_cuts": part.cuts,
                        "algorithm1_makespan_s": predict(cost, part.cuts, slices, batch).makespan},
            objective=self.objective, margin=self.margin,
            memory_bytes_per_stage=tuple(memory.stage_memory(cost.bytes, range(cuts[j], cuts[j + 1]), self.kv_tokens,
                                                             memory.microbatch_tokens(slices),
                                                             cost.placed.get(j, frozenset())).total for j in range(d)),
            memory_free_bytes=tuple(int(e.free_bytes) for e in cost.entries),
            uniform_makespan_s=predict(cost, self.uniform, slices, batch).makespan,
            lower_bound_s=bound.makespan_s, lower_bound=bound.as_dict(),
            ratio_to_lower_bound=timeline.makespan / bound.makespan_s,
            gap=gap(timeline.makespan, busy.tolist(), bound, partition_layers(work, np.zeros_like(work)).bottleneck),
            assumptions=tuple(assumptions(cost, self.sharing)),
            memory_binding=binding or None, host_experts=host_experts,
            decode=decode_prediction(cost, cuts, batch, seq_len, self.new_tokens)
            if all(e.decode for e in cost.entries) else None)


def _profiled_plan(profile: formats.Profile, model_name: str, config, devices, cost: CostModel, cuts: list[int],
                   slicing: formats.Slicing, dtype: str | None, predicted: Prediction, fixed: bool) -> formats.Plan:
    weights = profile.weights           # the units whose times these are
    stages = tuple(formats.StagePlan(host=h, device=dv, units=(cuts[j], cuts[j + 1]),
                                     weights=quant.planned(weights, h, dv), host_experts=len(cost.placed.get(j, ())))
                   for j, (h, dv) in enumerate(devices))
    plan = formats.Plan(model=model_identity(model_name, config), stages=stages, slicing=slicing,
                        dtype=dtype or profile.dtype, kv_dtype=profile.kv_dtype, weights=weights,
                        predicted=predicted, created_by=f"hpipe {__version__} (profile: DP partition"
                                                        f"{'' if fixed else ' and DP slicing'})")
    formats.validate_plan(plan)
    return plan
