"""SiDP: shared-weight data parallelism inside one host (SiDP §4), planned from a profile.

Every device of a host runs a whole-model replica, but each block's FFN has one *owner* in the
group; the other replicas either fetch it into a few cache slots ahead of use (Weight-as-a-Service,
WaS: large batches hide the fetch) or send their rows to the owner, which runs all ranks' rows in
one GEMM (Compute-as-a-Service, CaS: the small-batch tail). What a replica holds:

    weights = everything but the FFNs + the FFNs it owns + slots x the largest FFN
    KV tokens = (free memory - weights) / KV bytes per token

against plain DP's `free - all weights`. A decode iteration of B rows per replica takes
T_WaS(B) = max(T(B), fetch) with the non-owned FFN bytes fetched once per iteration from the WaS
source (the owner's memory over P2P where it really works, else one pinned copy in host memory read
over each GPU's own PCIe link; on CPU hosts the replicas map one shared copy and fetch nothing), and
T_CaS(B) = T(B) - L·ffn(B) + L·ffn(d·B) + the rows' round trips to the owners. B_th is the smallest
batch at which WaS is no slower than CaS: the switch point, with hysteresis, of the runtime.

Ownership is balanced by bytes against each device's free memory and interleaved (a block's owner
cycles through the group), which is what peak shifting needs: in every cycle of d blocks, rank r
starts its prefetch at block c + r, so at any moment the ranks read different owners (SiDP §4.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hpipe import formats, models
from hpipe.errors import HpipeError

__all__ = ["Member", "SidpGroup", "assign_owners", "kv_tokens", "member_from_profile", "pipeline_estimate",
           "plan_group", "plan_sidp"]

SOURCES = ("peer", "host-pool", "shared-mapping")


@dataclass(frozen=True)
class Member:
    """One device of a SiDP group as the planner sees it."""

    id: str                     # host/device
    free_bytes: float           # what the replica may hold (weights, KV, slots), after the margin
    step_s: object              # (rows, context) -> seconds of one decode step through the whole model
    ffn_s: object               # rows -> seconds of one block's FFN
    read_bytes_per_s: float     # WaS source into this device (peer link or host pool); inf when shared
    hop_s: float                # one small message to a peer (CaS rows out or back): latency
    hop_bytes_per_s: float      # and bandwidth


@dataclass
class SidpGroup:
    """The plan for one host: owners, slots and what they predict."""

    members: list[Member]
    owners: list[int]                      # block -> member index
    slots: int                             # WaS cache slots per replica (each the largest FFN)
    source: str                            # one of SOURCES
    weight_bytes: list[float]              # per member
    kv_tokens: list[float]                 # per member, SiDP
    dp_kv_tokens: list[float]              # per member, plain DP (negative: the model does not fit)
    fetch_s: list[float]                   # per member: its non-owned FFNs, once, from the source
    b_threshold: int | None                # WaS no slower than CaS from this batch on (None: never)
    rows: dict = field(default_factory=dict)   # prediction tables


def assign_owners(ffn_bytes: list[float], free_bytes: list[float]) -> list[int]:
    """Each block's FFN to the member whose owned bytes, with it, are the smallest share of its free
    memory (ties to the lowest index): on equal devices, block l goes to l mod d."""
    load = [0.0] * len(free_bytes)
    owners = []
    for b in ffn_bytes:
        m = min(range(len(free_bytes)), key=lambda i: ((load[i] + b) / free_bytes[i], i))
        load[m] += b
        owners.append(m)
    return owners


def kv_tokens(free: float, weights: float, kv_per_token: float) -> float:
    return (free - weights) / kv_per_token


def plan_group(config, members: list[Member], dtype_bytes: formats.UnitBytes, source: str, seq_len: int, new_tokens: int,
               max_batch: int, slots: int | None = None) -> SidpGroup:
    """One host's SiDP group. dtype_bytes: `hpipe.models.unit_bytes` of the model in the plan's
    weights (weights per unit, KV per token per unit). seq_len + new_tokens: a request's length."""
    if source not in SOURCES:
        raise ValueError(f"source {source!r}; one of {SOURCES}")
    d = len(members)
    per_unit = dtype_bytes.weights_per_unit
    blocks = models.num_blocks(config)
    ffn = [float(per_unit[2 + 2 * b]) for b in range(blocks)]   # unit 2 + 2b: block b's MLP half (norm and MLP)
    rest = float(sum(per_unit)) - sum(ffn)
    kv_per_token = float(sum(dtype_bytes.kv_per_token_per_unit))
    owners = assign_owners(ffn, [m.free_bytes for m in members])
    if slots is None:       # a whole cycle's remote layers (d - 1 on equal devices); a shared mapping needs none
        layout = formats.SidpGroupPlan("", tuple(range(d)), tuple(owners), 0, source)
        slots = 0 if source == "shared-mapping" else max(layout.slots_needed(m) for m in range(d))
    weight_bytes, kv, dp_kv, fetch = [], [], [], []
    for i, m in enumerate(members):
        owned = sum(b for b, o in zip(ffn, owners) if o == i)
        held = rest + owned + slots * max(ffn) if source != "shared-mapping" else rest + sum(ffn)
        weight_bytes.append(held)
        kv.append(kv_tokens(m.free_bytes, held if source != "shared-mapping" else held / d, kv_per_token))
        dp_kv.append(kv_tokens(m.free_bytes, rest + sum(ffn), kv_per_token))
        remote = sum(b for b, o in zip(ffn, owners) if o != i)
        fetch.append(0.0 if source == "shared-mapping" else remote / m.read_bytes_per_s)
    group = SidpGroup(members, owners, slots, source, weight_bytes, kv, dp_kv, fetch, None)
    group.rows = predict(group, config, seq_len, new_tokens, max_batch)
    group.rows["dp"]["weight_bytes"] = rest + sum(ffn)                 # per replica
    group.rows["sidp"]["weight_bytes"] = max(weight_bytes) if source != "shared-mapping" else (rest + sum(ffn)) / d
    group.b_threshold = group.rows["b_threshold"]
    return group


def _iteration(group: SidpGroup, blocks: int, hidden_bytes: float, rows: int, context: float) -> dict:
    """Per-iteration seconds of the slowest member with `rows` rows on every member."""
    out = {"dp": 0.0, "was": 0.0, "cas": 0.0}
    d = len(group.members)
    for i, m in enumerate(group.members):
        t = m.step_s(rows, context)
        remote_blocks = sum(1 for o in group.owners if o != i)
        hop = 2 * (m.hop_s + rows * hidden_bytes / m.hop_bytes_per_s)
        out["dp"] = max(out["dp"], t)
        out["was"] = max(out["was"], t, group.fetch_s[i])
        out["cas"] = max(out["cas"], t + blocks * (m.ffn_s(d * rows) - m.ffn_s(rows)) + remote_blocks * hop)
    return out


def predict(group: SidpGroup, config, seq_len: int, new_tokens: int, max_batch: int) -> dict:
    """T(B) against the fetch, the WaS/CaS crossover, and job throughput: plain DP, SiDP (WaS in the
    bulk at the batch its KV allows), each replica's tokens/s = B / T(B)."""
    blocks = models.num_blocks(config)
    hidden_bytes = float(config.hidden_size) * 2
    context = seq_len + new_tokens / 2
    length = seq_len + new_tokens
    grid = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= max_batch]
    table = []
    for rows in grid:
        it = _iteration(group, blocks, hidden_bytes, rows, context)
        table.append({"batch": rows, "T_s": it["dp"], "was_s": it["was"], "cas_s": it["cas"]})
    b_th = next((r["batch"] for r in table if r["was_s"] <= r["cas_s"]), None)

    def throughput(tokens_per_member: list[float], modes: tuple[str, ...]) -> tuple[int, float, str]:
        batch = int(min(max_batch, min(tokens_per_member) // length))
        if batch < 1:
            return 0, 0.0, "-"
        it = _iteration(group, blocks, hidden_bytes, batch, context)
        mode = min(modes, key=lambda m: it[m])             # SiDP runs the faster mode at this batch (the switch)
        return batch, len(group.members) * batch / it[mode], mode

    dp_batch, dp_tps, _ = throughput(group.dp_kv_tokens, ("dp",))
    sidp_batch, sidp_tps, sidp_mode = throughput(group.kv_tokens, ("was", "cas"))
    return {"iterations": table, "b_threshold": b_th, "fetch_s": max(group.fetch_s) if group.fetch_s else 0.0,
            "dp": {"kv_tokens": float(np.sum(np.maximum(group.dp_kv_tokens, 0))), "batch": dp_batch,
                   "tokens_per_s": dp_tps, "fits": min(group.dp_kv_tokens) > 0},
            "sidp": {"kv_tokens": float(np.sum(np.maximum(group.kv_tokens, 0))), "batch": sidp_batch,
                     "tokens_per_s": sidp_tps, "mode": sidp_mode, "fits": min(group.kv_tokens) > 0}}


def member_from_profile(cost, j: int, free_bytes: float, source: str, peer: tuple[float, float]) -> Member:
    """Stage j of a `hpipe.planner.CostModel` (its device's decode table) as a SiDP member. peer:
    (latency s, bytes/s) to the other devices of its host, the profile's link: the WaS source's
    bandwidth (over P2P, or the GPU's PCIe link to the pinned host pool) and the CaS hop."""
    from hpipe.planner.profiled import decode_unit_times

    kinds = cost.kinds
    mlp = kinds.index("mlp")

    def step_s(rows, context):
        return float(np.sum(decode_unit_times(cost, j, rows, context)))

    def ffn_s(rows):
        return float(decode_unit_times(cost, j, rows, 0.0)[mlp])

    read = float("inf") if source == "shared-mapping" else peer[1]
    return Member(cost.entries[j].id, free_bytes, step_s, ffn_s, read, peer[0], peer[1])


def pipeline_estimate(members: list[Member], config, unit_bytes: formats.UnitBytes, seq_len: int, new_tokens: int,
                      max_batch: int) -> dict:
    """hpipe's own pipeline over the same devices for comparison: the blocks split evenly, the KV of
    a token spread over the stages, one decode group per stage in flight (`decode_prediction`'s
    model: a round is one group's trip through every stage, each stage 1/d of a step, plus the hops)."""
    d = len(members)
    weights = float(sum(unit_bytes.weights_per_unit))
    kv_per_token = float(sum(unit_bytes.kv_per_token_per_unit))
    tokens = min((m.free_bytes - weights / d) * d / kv_per_token for m in members)
    length = seq_len + new_tokens
    batch = int(min(max_batch * d, tokens // length))
    if batch < d:
        return {"kv_tokens": max(tokens, 0.0), "batch": 0, "tokens_per_s": 0.0, "fits": False}
    rows = -(-batch // d)
    context = seq_len + new_tokens / 2
    hidden_bytes = float(config.hidden_size) * 2
    stage = [m.step_s(rows, context) / d + m.hop_s + rows * hidden_bytes / m.hop_bytes_per_s for m in members]
    round_s = max(d * max(stage), sum(stage))
    return {"kv_tokens": tokens, "batch": batch, "tokens_per_s": batch / round_s, "fits": True}


def _peers(profile: formats.Profile, entries: list[formats.DeviceProfile]) -> list[dict]:
    """The profile's probed copies between these devices (`hpipe profile` on a host with GPUs)."""
    ids = {e.id for e in entries}
    return [p for p in profile.peers or [] if p["src"] in ids and p["dst"] in ids]


def choose_source(asked: str, profile: formats.Profile, entries: list[formats.DeviceProfile]) -> str:
    """auto: a CPU host's replicas share one mapping; GPUs read their owners' weights over P2P where
    the profile saw every pair's real copy arrive, faster than each one's pinned host reads, and
    from the pinned host pool otherwise (consumer cards have no P2P)."""
    if asked != "auto":
        return asked
    if all(e.device == "cpu" for e in entries):
        return "shared-mapping"
    peers = _peers(profile, entries)
    pairs = len(entries) * (len(entries) - 1)
    host = min((e.extra.get("fetch", {}).get("bytes_per_s", 0.0) for e in entries), default=0.0)
    if pairs and len(peers) == pairs and all(p.get("works") for p in peers) and \
            min(p["bytes_per_s"] for p in peers) > host:
        return "peer"
    return "host-pool"


def read_bytes_per_s(source: str, profile: formats.Profile, entry: formats.DeviceProfile,
                     others: list[formats.DeviceProfile], link: float) -> float:
    """WaS's read bandwidth for one member, measured where the profile has it: the pinned host
    pool's (per device), the slowest real peer copy from the others; else the link between them."""
    if source == "host-pool" and "fetch" in entry.extra:
        return float(entry.extra["fetch"]["bytes_per_s"])
    if source == "peer":
        into = [p for p in _peers(profile, [entry, *others]) if p["dst"] == entry.id]
        if any(not p.get("works") for p in into):
            bad = next(p for p in into if not p.get("works"))
            raise HpipeError(f"--sidp-source peer: the profile's copy {bad['src']} -> {bad['dst']} did not arrive "
                             f"(no working P2P between them); use --sidp-source host-pool")
        if into:
            return min(float(p["bytes_per_s"]) for p in into)
    return link


def plan_sidp(profile: formats.Profile, profile_path: str, name: str, config, devices: list[tuple[str, str]], seq_len: int,
              new_tokens: int, max_batch: int, margin: float, dtype: str, weights: str, source: str = "auto"):
    """`hpipe plan --mode sidp`: one group per host over `devices`, each device a whole replica.
    Returns (the plan file's object, [SidpGroup], {host: pipeline estimate})."""
    from hpipe.memory import activation_bytes
    from hpipe.planner.profiled import CostModel, check_profile_matches

    if models.is_moe(config):
        raise HpipeError(f"--mode sidp: {name} is a mixture of experts ({config.model_type}), whose FFN weights are "
                         f"routed experts, which SiDP's shared replicas do not hold yet; plan it with --mode pipeline")
    check_profile_matches(profile, config, name, profile_path)
    cost = CostModel(profile, config, devices, profile_path)
    unit_bytes = models.unit_bytes(config, dtype, weights, profile.kv_dtype)
    reserve = activation_bytes(unit_bytes.activation_per_token_at_cut, max_batch)
    hosts: dict[str, list[int]] = {}
    for j, (host, _) in enumerate(devices):
        hosts.setdefault(host, []).append(j)
    groups, pipelines, group_plans = [], {}, []
    for host, js in hosts.items():
        src = choose_source(source, profile, [cost.entries[j] for j in js])
        members = []
        for j in js:
            others = [k for k in js if k != j]
            link = cost.links.get((cost.entries[j].id, cost.entries[others[0]].id)) if others else None
            peer = link if link is not None else (0.0, float("inf"))
            peer = (peer[0], read_bytes_per_s(src, profile, cost.entries[j], [cost.entries[k] for k in others],
                                              peer[1]))
            sharing = sum(1 for k in js if devices[k] == devices[j])      # replicas on one device split it
            free = cost.entries[j].free_bytes * (1 - margin) / sharing - reserve
            members.append(member_from_profile(cost, j, free, src, peer))
        group = plan_group(config, members, unit_bytes, src, seq_len, new_tokens, max_batch)
        groups.append(group)
        pipelines[host] = pipeline_estimate(members, config, unit_bytes, seq_len, new_tokens, max_batch)
        # B_th: CaS below the first batch at which WaS hides its fetch (above the grid: always CaS)
        threshold = group.b_threshold if group.b_threshold is not None else max_batch + 1
        group_plans.append(formats.SidpGroupPlan(host, tuple(js), tuple(group.owners), group.slots, src, threshold))
    from hpipe import quant
    from hpipe.planner.uniform import model_identity
    from hpipe.prediction import SidpPrediction

    stages = tuple(formats.StagePlan(h, d, (0, models.num_units(config)), quant.planned(weights, h, d))
                   for h, d in devices)
    predicted = SidpPrediction(seq_len=seq_len, new_tokens=new_tokens, max_batch=max_batch,
                               groups=tuple({"host": g.host, **grp.rows, "pipeline": pipelines[g.host],
                                             "weight_bytes": grp.weight_bytes, "kv_tokens": grp.kv_tokens,
                                             "dp_kv_tokens": grp.dp_kv_tokens, "fetch_s": grp.fetch_s}
                                            for g, grp in zip(group_plans, groups)))
    plan = formats.Plan(model=model_identity(name, config), stages=stages, slicing=formats.Slicing(), dtype=dtype,
                        kv_dtype=profile.kv_dtype, predicted=predicted,
                        created_by="hpipe plan --mode sidp", weights=weights, mode="sidp",
                        sidp=tuple(group_plans))
    return plan, groups, pipelines

