"""Every file format hpipe reads or writes, defined once, versioned and validated.

- cluster inventory (TOML): hosts, their devices and how to reach them over SSH;
- plan (JSON): model identity, pipeline stages in order, token slicing, predicted figures;
- prompts (JSONL, input) and results (JSONL, output, one line per finished prompt).

Validation errors are `HpipeError`s that name the file and the offending field. The formats are
documented in docs/formats.md; keep the two in step.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from hpipe.errors import HpipeError
from hpipe.prediction import Prediction, SidpPrediction, parse_prediction
from hpipe.request import SamplingError, SamplingParams

INVENTORY_VERSION = 1
PLAN_VERSION = 1
RESULTS_VERSION = 1

_DEVICE_RE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
_HOST_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ADDRESS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:-]*$")
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def _fail(path: str | os.PathLike, where: str, what: str) -> HpipeError:
    return HpipeError(f"{path}: {where}: {what}")


def _expect(path, where, value, types, what):
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise _fail(path, where, f"expected {what}, got {value!r}")
    return value


def _as_tuple(types):
    return types if isinstance(types, tuple) else (types,)


def _no_unknown_keys(path, where, table: dict, known: set[str]):
    unknown = sorted(set(table) - known)
    if unknown:
        raise _fail(path, where, f"unknown key {unknown[0]!r} (known keys: {', '.join(sorted(known))})")


def _check_version(path, data: dict, expected: int, what: str):
    version = data.get("version", expected)
    if version != expected:
        raise _fail(path, "version", f"this hpipe reads {what} version {expected}, the file says {version!r}")


def check_device(path, where, device) -> str:
    _expect(path, where, device, str, "a device name like 'cpu' or 'cuda:0'")
    if not _DEVICE_RE.match(device):
        raise _fail(path, where, f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'")
    return device


# --------------------------------------------------------------------------------------------
# Cluster inventory (TOML)


@dataclass(frozen=True)
class SSHSettings:
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    connect_timeout_s: float = 10.0


INTRA_LINK = (10e-6, 12e9)   # between one host's devices unless its inventory says: PCIe 3.0 x16's 12 GB/s


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    python: str
    devices: tuple[str, ...]
    port: int = 22
    user: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    device_types: tuple[str, ...] = ()       # catalog names, for estimated profiles
    intra_link: tuple[float, float] = INTRA_LINK     # (latency s, bandwidth B/s) between its devices
    threads: int = 0                         # torch threads per CPU stage; 0: the host's cores shared out


@dataclass(frozen=True)
class Link:
    hosts: tuple[str, str]
    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class Inventory:
    ssh: SSHSettings
    hosts: tuple[Host, ...]
    path: str = ""
    links: tuple[Link, ...] = ()

    def devices(self) -> list[tuple[str, str]]:
        """(host name, device) for every device, in inventory order: the default pipeline order."""
        return [(h.name, d) for h in self.hosts for d in h.devices]

    def link(self, a: str, b: str) -> tuple[float, float]:
        """(latency s, bandwidth B/s) between hosts a and b as the inventory states it."""
        if a == b:
            return next(h.intra_link for h in self.hosts if h.name == a)
        for link in self.links:
            if set(link.hosts) == {a, b}:
                return link.latency_s, link.bandwidth_bytes_per_s
        raise HpipeError(f"{self.path}: no [[links]] entry between hosts {a!r} and {b!r}; add one with "
                         f"hosts = [\"{a}\", \"{b}\"], bandwidth_gbps and latency_ms")


def load_inventory(path: str | os.PathLike) -> Inventory:
    path = str(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise HpipeError(f"{path}: cluster inventory not found; pass the path of a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise HpipeError(f"{path}: not valid TOML: {e}") from None
    return parse_inventory(data, path)


def parse_inventory(data: dict, path: str = "<inventory>") -> Inventory:
    _no_unknown_keys(path, "top level", data, {"version", "ssh", "hosts", "links"})
    _check_version(path, data, INVENTORY_VERSION, "cluster inventories")
    ssh = _parse_ssh(path, data.get("ssh", {}))
    hosts_list = data.get("hosts")
    if not isinstance(hosts_list, list) or not hosts_list:
        raise _fail(path, "hosts", "expected at least one [[hosts]] table")
    hosts: list[Host] = []
    for i, h in enumerate(hosts_list):
        hosts.append(_parse_host(path, f"hosts[{i}]", h, {x.name for x in hosts}))
    return Inventory(ssh=ssh, hosts=tuple(hosts), path=path,
                     links=_parse_links(path, data.get("links", []), {h.name for h in hosts}))


def _parse_ssh(path: str, ssh_table) -> SSHSettings:
    _expect(path, "[ssh]", ssh_table, dict, "a table")
    _no_unknown_keys(path, "[ssh]", ssh_table, {"user", "identity_file", "known_hosts", "connect_timeout_s"})
    for key in ("user", "identity_file", "known_hosts"):
        if key in ssh_table:
            _expect(path, f"ssh.{key}", ssh_table[key], str, "a string")
    if "user" in ssh_table and not _USER_RE.match(ssh_table["user"]):
        raise _fail(path, "ssh.user", f"{ssh_table['user']!r} is not a user name")
    timeout = ssh_table.get("connect_timeout_s", 10.0)
    _expect(path, "ssh.connect_timeout_s", timeout, (int, float), "a number of seconds")
    if not 0 < timeout <= 600:
        raise _fail(path, "ssh.connect_timeout_s", f"must be in (0, 600], got {timeout}")
    return SSHSettings(user=ssh_table.get("user"), identity_file=ssh_table.get("identity_file"),
                       known_hosts=ssh_table.get("known_hosts"), connect_timeout_s=float(timeout))


def _parse_host(path: str, where: str, h, seen: set[str]) -> Host:
    """One [[hosts]] table (`seen`: the names of the hosts before it): how to reach the host, then
    what it has."""
    _expect(path, where, h, dict, "a table")
    _no_unknown_keys(path, where, h, {"name", "address", "port", "user", "python", "devices", "env",
                                      "device_types", "intra_link", "threads"})
    for key in ("name", "address", "python", "devices"):
        if key not in h:
            raise _fail(path, where, f"missing required key {key!r}")
    name = _expect(path, f"{where}.name", h["name"], str, "a string")
    if not _HOST_NAME_RE.match(name):
        raise _fail(path, f"{where}.name", f"{name!r}: use letters, digits, '.', '_' or '-'")
    if name in seen:
        raise _fail(path, f"{where}.name", f"host name {name!r} appears twice")
    address = _expect(path, f"{where}.address", h["address"], str, "a host name or IP address")
    if not _ADDRESS_RE.match(address):
        raise _fail(path, f"{where}.address", f"{address!r} is not a host name or IP address "
                                              f"(letters, digits, '.', '-', ':' only)")
    port = _expect(path, f"{where}.port", h.get("port", 22), int, "a port number")
    if not 0 < port < 65536:
        raise _fail(path, f"{where}.port", f"{port} is not a TCP port (1-65535)")
    user = h.get("user")
    if user is not None:
        _expect(path, f"{where}.user", user, str, "a user name")
        if not _USER_RE.match(user):
            raise _fail(path, f"{where}.user", f"{user!r} is not a user name")
    python = _expect(path, f"{where}.python", h["python"], str, "the absolute path of a Python interpreter")
    if any(ord(c) < 32 for c in python):
        raise _fail(path, f"{where}.python", f"{python!r} contains control characters")
    if not python.startswith("/"):
        raise _fail(path, f"{where}.python", f"{python!r} must be an absolute path (the remote PATH is minimal)")
    return Host(name=name, address=address, python=python, port=port, user=user, **_host_hardware(path, where, h))


def _host_hardware(path: str, where: str, h: dict) -> dict:
    """A host's devices (and their catalog types), environment, link between its devices and threads."""
    devices = _expect(path, f"{where}.devices", h["devices"], list, "a list of devices")
    if not devices:
        raise _fail(path, f"{where}.devices", "list at least one device, e.g. [\"cpu\"]")
    for j, d in enumerate(devices):
        check_device(path, f"{where}.devices[{j}]", d)
    if len(set(devices)) != len(devices):
        raise _fail(path, f"{where}.devices", "a device is listed twice")
    env = h.get("env", {})
    _expect(path, f"{where}.env", env, dict, "a table of strings")
    for k, v in env.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise _fail(path, f"{where}.env", f"{k!r} is not a valid environment variable name")
        _expect(path, f"{where}.env.{k}", v, str, "a string")
    types = h.get("device_types", [])
    _expect(path, f"{where}.device_types", types, list, "a list of catalog device types")
    if types and len(types) != len(devices):
        raise _fail(path, f"{where}.device_types", f"{len(types)} types for {len(devices)} devices")
    for j, t in enumerate(types):
        _expect(path, f"{where}.device_types[{j}]", t, str, "a catalog name such as \"RTX3090\"")
    intra = h.get("intra_link", {})
    _expect(path, f"{where}.intra_link", intra, dict, "a table {bandwidth_gbps, latency_us}")
    _no_unknown_keys(path, f"{where}.intra_link", intra, {"bandwidth_gbps", "latency_us"})
    intra_bw = _expect(path, f"{where}.intra_link.bandwidth_gbps", intra.get("bandwidth_gbps", 96), (int, float),
                       "gigabits per second")
    intra_lat = _expect(path, f"{where}.intra_link.latency_us", intra.get("latency_us", 10), (int, float),
                        "microseconds")
    if intra_bw <= 0 or intra_lat < 0:
        raise _fail(path, f"{where}.intra_link", "bandwidth must be > 0 and latency >= 0")
    threads = _expect(path, f"{where}.threads", h.get("threads", 0), int, "a number of threads")
    if threads < 0:
        raise _fail(path, f"{where}.threads", f"must be >= 0 (0: share the host's cores), got {threads}")
    return dict(devices=tuple(devices), env=dict(env), device_types=tuple(types),
                intra_link=(intra_lat * 1e-6, intra_bw * 1e9 / 8), threads=threads)


def _parse_links(path: str, raw_links, names: set[str]) -> tuple[Link, ...]:
    _expect(path, "links", raw_links, list, "a list of [[links]] tables")
    links = []
    for i, link in enumerate(raw_links):
        where = f"links[{i}]"
        _expect(path, where, link, dict, "a table")
        _no_unknown_keys(path, where, link, {"hosts", "bandwidth_gbps", "latency_ms"})
        pair = link.get("hosts")
        if not (isinstance(pair, list) and len(pair) == 2 and all(p in names for p in pair) and pair[0] != pair[1]):
            raise _fail(path, f"{where}.hosts", f"expected two different host names of this file, got {pair!r}")
        bw = _expect(path, f"{where}.bandwidth_gbps", link.get("bandwidth_gbps"), (int, float), "gigabits per second")
        lat = _expect(path, f"{where}.latency_ms", link.get("latency_ms", 0.2), (int, float), "milliseconds")
        if bw <= 0 or lat < 0:
            raise _fail(path, where, "bandwidth must be > 0 and latency >= 0")
        links.append(Link(hosts=(pair[0], pair[1]), latency_s=lat * 1e-3, bandwidth_bytes_per_s=bw * 1e9 / 8))
    return tuple(links)


# --------------------------------------------------------------------------------------------
# Plan (JSON)


@dataclass(frozen=True)
class ModelIdentity:
    name: str          # what the user called it: "smollm2", a directory or a .gguf path
    family: str        # transformers model_type, e.g. "llama"
    units: int         # partition units: embedding, 2 per block, final norm + head
    blocks: int
    fingerprint: str   # hash of the architecture-defining config fields


@dataclass(frozen=True)
class StagePlan:
    host: str
    device: str
    units: tuple[int, int]  # [start, end) in partition units
    weights: str = "none"   # the weight format this stage runs (hpipe.quant.WeightFormat)
    host_experts: int = 0   # its first N MoE blocks keep their routed experts in the host's RAM (run by its CPU)


@dataclass(frozen=True)
class Slicing:
    """How a prompt is cut on the token dimension.

    `by_seq_len` maps a prompt length to explicit slice lengths (from the DP planner); otherwise
    `lengths` are cut in order (the last slice takes the rest of a longer prompt), otherwise the
    prompt is cut into `count` near-equal slices in multiples of `granularity`.

    `by_context` (from the DP planner) maps a context c, the tokens of a prompt already in the KV
    cache (a cached prefix), to Algorithm 2's slices of the planned prompt's rest after it: the
    rest of a prompt that starts at context >= c is cut like that (the entry of the largest such
    c), its last slice cut at its end or taking what is left.
    """

    count: int = 1
    lengths: tuple[int, ...] = ()
    granularity: int = 16
    by_seq_len: dict[int, tuple[int, ...]] = field(default_factory=dict)
    by_context: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def slices_for(self, n_tokens: int, context: int = 0) -> list[int]:
        if n_tokens <= 0:
            return []
        at = max((c for c in self.by_context if c <= context), default=0) if context else 0
        if at:
            return _fill(_truncate(list(self.by_context[at]), n_tokens), n_tokens)
        table = self.by_seq_len
        if n_tokens in table:
            return list(table[n_tokens])
        longer = [n for n in table if n >= n_tokens]
        if longer:
            return _truncate(list(table[min(longer)]), n_tokens)
        if self.lengths:
            return _fill(_truncate(list(self.lengths), n_tokens), n_tokens)
        count = max(1, min(self.count, n_tokens))
        size = math.ceil(n_tokens / count)
        g = self.granularity
        if g > 1 and n_tokens >= count * g:
            size = math.ceil(size / g) * g
        out = []
        left = n_tokens
        while left > 0:
            out.append(min(size, left))
            left -= out[-1]
        return out


def _fill(cut: list[int], n: int) -> list[int]:
    """The last slice takes what the others leave of n tokens."""
    rest = n - sum(cut)
    if rest:
        cut[-1] += rest
    return cut


def _truncate(lengths: list[int], n: int) -> list[int]:
    out, total = [], 0
    for s in lengths:
        if total >= n:
            break
        out.append(min(s, n - total))
        total += out[-1]
    return out


@dataclass(frozen=True)
class SidpGroupPlan:
    """One host's SiDP group: its replicas are the plan's stages at `replicas` (each a whole-model
    stage), `owners[b]` the index into `replicas` of the one that holds block b's FFN."""

    host: str
    replicas: tuple[int, ...]
    owners: tuple[int, ...]
    slots: int                 # WaS cache slots per replica, each the largest FFN
    source: str                # where WaS reads: "peer", "host-pool" or "shared-mapping"
    threshold: int = 0         # B_th: CaS while the group's largest batch stays below it (0: never)

    def prefetch_order(self, member: int) -> list[int]:
        """The blocks member `member` (an index into `replicas`) fetches, in SiDP's peak-shifting
        order: cycles of d blocks; in the cycle starting at block c it begins at c + member and
        wraps around inside the cycle, skipping the blocks it owns, so that at any moment the d
        members read d different owners' blocks."""
        d, order = len(self.replicas), []
        for c in range(0, len(self.owners), d):
            cycle = [c + (member + k) % d for k in range(d)]
            order += [b for b in cycle if b < len(self.owners) and self.owners[b] != member]
        return order

    def slots_needed(self, member: int) -> int:
        """The fewest WaS slots that let the fetches run in `prefetch_order` while the forward takes
        the blocks in their own order: the most remote blocks of one cycle."""
        d = len(self.replicas)
        return max((sum(1 for b in range(c, min(c + d, len(self.owners))) if self.owners[b] != member)
                    for c in range(0, len(self.owners), d)), default=0)


SIDP_SOURCES = ("peer", "host-pool", "shared-mapping")
DTYPES = ("float32", "bfloat16", "float16")


def activation_dtype(dtype: str | None) -> str:
    """Activations' dtype (`--dtype`): float32 unless asked (the KV cache's is `--kv-dtype`). Quantized
    linears hand their kernels bf16 and give back this dtype; the rest of a step (attention, norms)
    is faster in float32 on CPUs (SDPA decode: 26 us against 127 us in bf16 here) and more exact."""
    if dtype is not None and dtype not in DTYPES:
        raise HpipeError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return dtype or "float32"
# The KV cache's default elements: 16-bit halves a token's cache (a box holds twice the context, a
# long-context decode step reads half the bytes). float16 rather than bfloat16, as llama.cpp: its 3
# more bits of mantissa kept SmolLM2's KL against a float32 cache at 7e-7 where bfloat16's was 4e-5
# (llama.cpp's f16 cache: ~1e-6), and a CPU's decode steps read it where it lies through
# hpipe's kernel (kernels/attention.h), faster than torch's SDPA over float32 (bench/kv_dtype.py).
# Exactness tests and users who want every bit choose float32 (`--kv-dtype float32`).
KV_DTYPE = "float16"


@dataclass(frozen=True)
class Plan:
    model: ModelIdentity
    stages: tuple[StagePlan, ...]
    slicing: Slicing
    dtype: str = "float32"
    predicted: Prediction | SidpPrediction | None = None
    created_by: str = ""
    version: int = PLAN_VERSION
    kv_dtype: str = KV_DTYPE   # a plan file without it was made before 16-bit caches: float32, as planned
    weights: str = "none"   # asked for: none, gguf, int8 or int4:G (each stage says what it runs)
    mode: str = "pipeline"  # "pipeline": the stages cut the model; "sidp": each stage is a whole replica
    sidp: tuple[SidpGroupPlan, ...] = ()   # mode "sidp": one group per host

    @property
    def pipeline_prediction(self) -> Prediction | None:
        """What the pipeline is predicted to do (None: planned without a profile, or a SiDP plan)."""
        return self.predicted if isinstance(self.predicted, Prediction) else None

    def to_json(self) -> dict:
        extra = {} if self.mode == "pipeline" else {
            "mode": self.mode,
            "sidp": [{"host": g.host, "replicas": list(g.replicas), "owners": list(g.owners), "slots": g.slots,
                      "source": g.source, "threshold": g.threshold} for g in self.sidp]}
        return {**extra,
            "version": self.version,
            "created_by": self.created_by,
            "model": asdict(self.model),
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "weights": self.weights,
            "stages": [{"host": s.host, "device": s.device, "units": list(s.units), "weights": s.weights,
                        **({"host_experts": s.host_experts} if s.host_experts else {})} for s in self.stages],
            "slicing": {
                "count": self.slicing.count,
                "lengths": list(self.slicing.lengths),
                "granularity": self.slicing.granularity,
                "by_seq_len": {str(k): list(v) for k, v in sorted(self.slicing.by_seq_len.items())},
                **({"by_context": {str(k): list(v) for k, v in sorted(self.slicing.by_context.items())}}
                   if self.slicing.by_context else {}),
            },
            "predicted": None if self.predicted is None else self.predicted.to_json(),
        }




def _write_json(data, path: str | os.PathLike, indent: int) -> None:
    """Atomically: a crash never leaves half a file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=indent)
        f.write("\n")
    os.replace(tmp, path)


def _read_json(path: str, what: str, command: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise HpipeError(f"{path}: {what} not found; make one with `hpipe {command} ... -o {path}`") from None
    except json.JSONDecodeError as e:
        raise HpipeError(f"{path}: not valid JSON: {e}") from None


def write_plan(plan: Plan, path: str | os.PathLike) -> None:
    validate_plan(plan, str(path))
    _write_json(plan.to_json(), path, indent=2)


def load_plan(path: str | os.PathLike) -> Plan:
    return parse_plan(_read_json(str(path), "plan file", "plan"), str(path))


def parse_plan(data: Any, path: str = "<plan>") -> Plan:
    _expect(path, "top level", data, dict, "a JSON object")
    _no_unknown_keys(path, "top level", data, {"version", "created_by", "model", "dtype", "kv_dtype", "weights",
                                                "stages", "slicing", "predicted", "mode", "sidp"})
    if "version" not in data:
        raise _fail(path, "version", f"missing; this hpipe writes plan version {PLAN_VERSION}")
    _check_version(path, data, PLAN_VERSION, "plans")
    for key in ("model", "stages", "slicing"):
        if key not in data:
            raise _fail(path, "top level", f"missing required key {key!r}")
    m = _expect(path, "model", data["model"], dict, "an object")
    _no_unknown_keys(path, "model", m, {"name", "family", "units", "blocks", "fingerprint"})
    model = ModelIdentity(**_model_identity(path, m))
    stages = _parse_stages(path, _expect(path, "stages", data["stages"], list, "a list of stages"))
    slicing = _parse_slicing(path, _expect(path, "slicing", data["slicing"], dict, "an object"))
    dtype, kv_dtype = (_expect(path, key, data.get(key, "float32"), str, "a dtype name")
                       for key in ("dtype", "kv_dtype"))
    predicted = parse_prediction(data.get("predicted"), path)
    weights = _expect(path, "weights", data.get("weights", "none"), str, "a weight format")
    mode = _expect(path, "mode", data.get("mode", "pipeline"), str, "'pipeline' or 'sidp'")
    groups = _parse_sidp(path, _expect(path, "sidp", data.get("sidp", []), list, "a list of groups"))
    plan = Plan(model=model, stages=stages, slicing=slicing, dtype=dtype, kv_dtype=kv_dtype, predicted=predicted,
                created_by=str(data.get("created_by", "")), version=data["version"], weights=weights,
                mode=mode, sidp=groups)
    validate_plan(plan, path)
    return plan


def _model_identity(path: str, m: dict) -> dict:
    """A plan's or a profile's `model`: every key there, of its type, and no other."""
    _no_unknown_keys(path, "model", m, {"name", "family", "units", "blocks", "fingerprint"})
    for key, typ in (("name", str), ("family", str), ("units", int), ("blocks", int), ("fingerprint", str)):
        if key not in m:
            raise _fail(path, "model", f"missing required key {key!r}")
        _expect(path, f"model.{key}", m[key], typ, typ.__name__)
    return m


def _parse_stages(path: str, stages_raw: list) -> tuple[StagePlan, ...]:
    stages = []
    for i, s in enumerate(stages_raw):
        where = f"stages[{i}]"
        _expect(path, where, s, dict, "an object")
        _no_unknown_keys(path, where, s, {"host", "device", "units", "weights", "host_experts"})
        host = _expect(path, f"{where}.host", s.get("host"), str, "a host name")
        device = check_device(path, f"{where}.device", s.get("device"))
        units = _expect(path, f"{where}.units", s.get("units"), list, "[start, end]")
        if len(units) != 2 or not all(isinstance(u, int) and not isinstance(u, bool) for u in units):
            raise _fail(path, f"{where}.units", f"expected [start, end] integers, got {units!r}")
        weights = _expect(path, f"{where}.weights", s.get("weights", "none"), str, "a weight format")
        host_experts = _expect(path, f"{where}.host_experts", s.get("host_experts", 0), int,
                               "a count of the stage's MoE blocks")
        if host_experts < 0:
            raise _fail(path, f"{where}.host_experts", f"{host_experts} is negative; use 0 or more MoE blocks")
        stages.append(StagePlan(host=host, device=device, units=(units[0], units[1]), weights=weights,
                                host_experts=host_experts))
    return tuple(stages)


def _parse_slicing(path: str, sl: dict) -> Slicing:
    _no_unknown_keys(path, "slicing", sl, {"count", "lengths", "granularity", "by_seq_len", "by_context"})
    count = _expect(path, "slicing.count", sl.get("count", 1), int, "a positive integer")
    lengths = _expect(path, "slicing.lengths", sl.get("lengths", []), list, "a list of token counts")
    granularity = _expect(path, "slicing.granularity", sl.get("granularity", 16), int, "a positive integer")
    table = {}
    for k, v in _expect(path, "slicing.by_seq_len", sl.get("by_seq_len", {}), dict, "an object").items():
        if not str(k).isdigit():
            raise _fail(path, f"slicing.by_seq_len[{k!r}]", "keys are prompt lengths in tokens")
        _expect(path, f"slicing.by_seq_len[{k!r}]", v, list, "a list of slice lengths")
        table[int(k)] = tuple(v)
    contexts = {}
    for k, v in _expect(path, "slicing.by_context", sl.get("by_context", {}), dict, "an object").items():
        if not str(k).isdigit() or int(k) < 1:
            raise _fail(path, f"slicing.by_context[{k!r}]", "keys are contexts in tokens (>= 1)")
        _expect(path, f"slicing.by_context[{k!r}]", v, list, "a list of slice lengths")
        contexts[int(k)] = tuple(v)
    return Slicing(count=count, lengths=tuple(lengths), granularity=granularity, by_seq_len=table,
                   by_context=contexts)


def _parse_sidp(path: str, raw: list) -> tuple[SidpGroupPlan, ...]:
    groups = []
    for i, g in enumerate(raw):
        where = f"sidp[{i}]"
        _expect(path, where, g, dict, "an object")
        _no_unknown_keys(path, where, g, {"host", "replicas", "owners", "slots", "source", "threshold"})
        for key, typ, what in (("host", str, "a host name"), ("replicas", list, "stage indices"),
                               ("owners", list, "one replica index per block"), ("slots", int, "a count"),
                               ("source", str, "a WaS source")):
            if key not in g:
                raise _fail(path, where, f"missing required key {key!r}")
            _expect(path, f"{where}.{key}", g[key], typ, what)
        threshold = _expect(path, f"{where}.threshold", g.get("threshold", 0), int, "a batch size")
        groups.append(SidpGroupPlan(g["host"], tuple(g["replicas"]), tuple(g["owners"]), g["slots"], g["source"],
                                    threshold))
    return tuple(groups)


def validate_plan(plan: Plan, path: str = "<plan>") -> None:
    """Checks the plan's internal consistency (not against a model: see hpipe.models.check_plan)."""
    if plan.model.units < 3 or plan.model.units != 2 * plan.model.blocks + 2:
        raise _fail(path, "model.units", f"{plan.model.units} units do not match {plan.model.blocks} blocks "
                                         f"(expected 2 x blocks + 2)")
    if not plan.stages:
        raise _fail(path, "stages", "a plan needs at least one stage")
    if plan.mode == "sidp":
        _validate_sidp(plan, path)
    elif plan.mode != "pipeline":
        raise _fail(path, "mode", f"{plan.mode!r} is not 'pipeline' or 'sidp'")
    else:
        _validate_cuts(plan, path)
    _validate_rest(plan, path)


def _validate_sidp(plan: Plan, path: str) -> None:
    """Every stage a whole replica; every replica in one group, on its host; owners cover the blocks."""
    if not plan.sidp:
        raise _fail(path, "sidp", "a SiDP plan needs at least one group")
    for i, s in enumerate(plan.stages):
        if s.units != (0, plan.model.units):
            raise _fail(path, f"stages[{i}].units", f"a SiDP replica holds the whole model: [0, {plan.model.units}]")
    seen: list[int] = []
    for i, g in enumerate(plan.sidp):
        where = f"sidp[{i}]"
        if not g.replicas or any(not isinstance(r, int) or not 0 <= r < len(plan.stages) for r in g.replicas):
            raise _fail(path, f"{where}.replicas",
                        f"indices into stages (0..{len(plan.stages) - 1}), got {list(g.replicas)}")
        if any(plan.stages[r].host != g.host for r in g.replicas):
            raise _fail(path, f"{where}.replicas", f"every replica of the group runs on host {g.host!r}")
        seen += list(g.replicas)
        if len(g.owners) != plan.model.blocks or any(o not in range(len(g.replicas)) for o in g.owners):
            raise _fail(path, f"{where}.owners", f"one owner per block ({plan.model.blocks}), each an index into "
                                                 f"replicas (0..{len(g.replicas) - 1})")
        if g.slots < 0:
            raise _fail(path, f"{where}.slots", f"must be at least 0, got {g.slots}")
        if g.source not in SIDP_SOURCES:
            raise _fail(path, f"{where}.source", f"{g.source!r} is not one of {', '.join(SIDP_SOURCES)}")
        if g.threshold < 0:
            raise _fail(path, f"{where}.threshold", f"must be at least 0, got {g.threshold}")
        if g.source != "shared-mapping":
            needed = max(g.slots_needed(m) for m in range(len(g.replicas)))
            if g.slots < needed:
                raise _fail(path, f"{where}.slots", f"{g.slots} slots cannot hold one cycle's remote MLP halves "
                                                    f"(the peak-shifting order needs {needed}); raise slots to {needed}")
    if sorted(seen) != list(range(len(plan.stages))):
        raise _fail(path, "sidp", "every stage (replica) belongs to exactly one group")


def _validate_cuts(plan: Plan, path: str) -> None:
    expected_start = 0
    for i, s in enumerate(plan.stages):
        start, end = s.units
        if start != expected_start:
            raise _fail(path, f"stages[{i}].units", f"starts at unit {start}, expected {expected_start} "
                                                     f"(stages must cover units in order without gaps)")
        if end <= start:
            raise _fail(path, f"stages[{i}].units", f"[{start}, {end}) is empty; every stage needs a unit")
        expected_start = end
    if expected_start != plan.model.units:
        raise _fail(path, f"stages[{len(plan.stages) - 1}].units",
                    f"ends at unit {expected_start}, but the model has {plan.model.units} units")


def _validate_rest(plan: Plan, path: str) -> None:
    sl = plan.slicing
    if sl.count < 1:
        raise _fail(path, "slicing.count", f"must be at least 1, got {sl.count}")
    if sl.granularity < 1:
        raise _fail(path, "slicing.granularity", f"must be at least 1, got {sl.granularity}")
    if any((not isinstance(x, int)) or x < 1 for x in sl.lengths):
        raise _fail(path, "slicing.lengths", f"slice lengths must be positive integers, got {list(sl.lengths)}")
    for n, lengths in sl.by_seq_len.items():
        if any((not isinstance(x, int)) or x < 1 for x in lengths) or sum(lengths) != n:
            raise _fail(path, f"slicing.by_seq_len[{n}]", f"slice lengths must be positive and sum to {n}")
    for c, lengths in sl.by_context.items():
        if not lengths or any((not isinstance(x, int)) or x < 1 for x in lengths):
            raise _fail(path, f"slicing.by_context[{c}]", "slice lengths must be positive integers")
    _check_dtypes(path, {"dtype": plan.dtype, "kv_dtype": plan.kv_dtype})
    check_weights(path, "weights", plan.weights)
    for i, s in enumerate(plan.stages):
        check_weights(path, f"stages[{i}].weights", s.weights)


def _check_dtypes(path: str, named: dict) -> None:
    for key, value in named.items():
        if value not in DTYPES:
            raise _fail(path, key, f"{value!r} is not one of {', '.join(DTYPES)}")


def check_weights(path: str, where: str, text: str):
    """A weight format named in a file: one of hpipe.quant's."""
    from hpipe import quant

    try:
        return quant.WeightFormat.parse(text, where="weights")
    except HpipeError as e:
        raise _fail(path, where, str(e)) from None


# --------------------------------------------------------------------------------------------
# Prompts (JSONL, input)


@dataclass(frozen=True)
class PromptRecord:
    id: str
    prompt: str | None = None
    input_ids: tuple[int, ...] | None = None
    raw: bool = False
    sampling: dict | None = None     # per-prompt overrides of the launch's sampling parameters
    stop_token_ids: tuple[int, ...] = ()   # ids that end this prompt's output (besides the model's EOS)
    max_new_tokens: int | None = None      # this prompt's own limit (None: the launch's --max-new-tokens)


def _check_sampling(path, where, obj) -> dict:
    """A prompt's "sampling" object: any of hpipe.request.SamplingParams' fields, checked by the
    same rules."""
    _expect(path, where, obj, dict, 'an object like {"temperature": 0.7, "top_p": 0.9, "seed": 1}')
    _no_unknown_keys(path, where, obj, set(SamplingParams.__dataclass_fields__))
    try:
        SamplingParams(**obj)
    except SamplingError as e:
        raise _fail(path, where, str(e)) from None
    return dict(obj)


def load_prompts(path: str | os.PathLike) -> list[PromptRecord]:
    path = str(path)
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise HpipeError(f"{path}: prompts file not found") from None
    except UnicodeDecodeError:
        raise HpipeError(f"{path}: not UTF-8 text; prompts are JSONL, one object per line") from None
    out: list[PromptRecord] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _fail(path, where, f"not valid JSON ({e.msg}); each line must be one JSON object") from None
        _expect(path, where, obj, dict, 'an object like {"id": "q1", "prompt": "..."}')
        _no_unknown_keys(path, where, obj, {"id", "prompt", "input_ids", "raw", "sampling", "stop_token_ids",
                                            "max_new_tokens"})
        stops = obj.get("stop_token_ids", [])
        if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  for t in stops):
            raise _fail(path, f"{where}: stop_token_ids", "expected a list of non-negative integers")
        limit = obj.get("max_new_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise _fail(path, f"{where}: max_new_tokens", f"expected a whole number of at least 1, got {limit!r}")
        sampling = obj.get("sampling")
        if sampling is not None:
            sampling = _check_sampling(path, f"{where}: sampling", sampling)
        pid = obj.get("id")
        _expect(path, f"{where}: id", pid, str, "a string id")
        if pid in seen:
            raise _fail(path, f"{where}: id", f"{pid!r} is used twice; ids must be unique")
        seen.add(pid)
        has_prompt, has_ids = "prompt" in obj, "input_ids" in obj
        if has_prompt == has_ids:
            raise _fail(path, where, 'give exactly one of "prompt" (text) or "input_ids" (token ids)')
        raw = obj.get("raw", False)
        _expect(path, f"{where}: raw", raw, bool, "true or false")
        if has_prompt:
            _expect(path, f"{where}: prompt", obj["prompt"], str, "a string")
            if not obj["prompt"]:
                raise _fail(path, f"{where}: prompt", "is empty")
            out.append(PromptRecord(id=pid, prompt=obj["prompt"], raw=raw, sampling=sampling,
                                    stop_token_ids=tuple(stops), max_new_tokens=limit))
        else:
            ids = obj["input_ids"]
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise _fail(path, f"{where}: input_ids", "expected a non-empty list of non-negative integers")
            out.append(PromptRecord(id=pid, input_ids=tuple(ids), sampling=sampling, stop_token_ids=tuple(stops),
                                    max_new_tokens=limit))
    if not out:
        raise HpipeError(f"{path}: no prompts in the file")
    return out


# --------------------------------------------------------------------------------------------
# Results (JSONL, output)

RESULT_REQUIRED = ("id", "output_ids", "text", "ttft_s", "tpot_s")


def append_result(path: str | os.PathLike, record: dict) -> None:
    """Appends one finished prompt; flushed and synced so a later crash keeps it."""
    missing = [k for k in RESULT_REQUIRED if k not in record]
    if missing:
        raise ValueError(f"result record lacks {missing}")
    line = json.dumps({"version": RESULTS_VERSION, **record}, ensure_ascii=False)
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def load_results(path: str | os.PathLike) -> list[dict]:
    """Reads a results file; a torn last line (a crash mid-write) is ignored, others must parse."""
    path = str(path)
    if not os.path.exists(path):
        return []
    lines = Path(path).read_text().splitlines()
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise HpipeError(f"{path}: line {n}: not valid JSON; fix or remove that line") from None
        if not isinstance(obj, dict) or "id" not in obj:
            raise HpipeError(f"{path}: line {n}: not a results record (no 'id')")
        if obj.get("version", RESULTS_VERSION) != RESULTS_VERSION:
            raise HpipeError(f"{path}: line {n}: results version {obj.get('version')!r}, "
                             f"this hpipe writes {RESULTS_VERSION}")
        out.append(obj)
    return out


# --------------------------------------------------------------------------------------------
# Profile (JSON)

PROFILE_VERSION = 1
UNIT_KINDS = ("embed", "attn", "mlp", "head")


def _check_table(path, where, table, context_dependent: bool):
    _expect(path, where, table, dict, "a table {s, c, t}")
    for key in ("s", "c", "t"):
        if key not in table:
            raise _fail(path, where, f"missing {key!r}")
    s, c, t = table["s"], table["c"], table["t"]
    if not (isinstance(s, list) and s and all(isinstance(x, int) and x >= 1 for x in s) and s == sorted(set(s))):
        raise _fail(path, f"{where}.s", "expected increasing positive token counts")
    if not (isinstance(c, list) and c and all(isinstance(x, int) and x >= 0 for x in c) and c == sorted(set(c))):
        raise _fail(path, f"{where}.c", "expected increasing context lengths (>= 0)")
    if not context_dependent and c != [0]:
        raise _fail(path, f"{where}.c", "this unit kind does not depend on context: expected [0]")
    if not isinstance(t, list) or len(t) != len(s) or any(not isinstance(row, list) or len(row) != len(c) for row in t):
        raise _fail(path, f"{where}.t", f"expected a {len(s)} x {len(c)} table of seconds (null where not measured)")
    for row in t:
        for v in row:
            if v is not None and (not isinstance(v, (int, float)) or v < 0 or v != v):
                raise _fail(path, f"{where}.t", f"{v!r} is not a time in seconds")
    if all(v is None for row in t for v in row):
        raise _fail(path, f"{where}.t", "no measured value")


RUNTIME_COSTS = ("step_s", "hop_s", "back_s")   # a profile's "runtime": see hpipe.profiler.runtime_costs


def validate_profile(data: Any, path: str = "<profile>") -> None:
    """Checks a profile's JSON (`parse_profile` reads it). Fields are documented in docs/formats.md."""
    _expect(path, "top level", data, dict, "a JSON object")
    _no_unknown_keys(path, "top level", data, {"version", "created", "created_by", "model", "dtype", "kv_dtype",
                                              "weights", "max_seq_len",
                                              "quick", "bytes", "devices", "links", "peers", "errors", "runtime"})
    if data.get("version") != PROFILE_VERSION:
        raise _fail(path, "version", f"this hpipe reads profile version {PROFILE_VERSION}, "
                                     f"the file says {data.get('version')!r}")
    for key in ("model", "bytes", "devices", "links", "max_seq_len", "dtype"):
        if key not in data:
            raise _fail(path, "top level", f"missing required key {key!r}")
    units = _model_identity(path, _expect(path, "model", data["model"], dict, "an object"))["units"]
    _check_dtypes(path, {"dtype": data["dtype"], "kv_dtype": _profile_kv_dtype(data)})
    check_weights(path, "weights", data.get("weights", "none"))
    b = _expect(path, "bytes", data["bytes"], dict, "an object")
    for key, n in (("weights_per_unit", units), ("kv_per_token_per_unit", units),
                   ("activation_per_token_at_cut", units + 1)):
        v = b.get(key)
        if not isinstance(v, list) or len(v) != n or not all(isinstance(x, int) and x >= 0 for x in v):
            raise _fail(path, f"bytes.{key}", f"expected {n} non-negative integers")
    routed = b.get("experts_per_unit", [0] * units)      # profiles before MoE placement lack it
    if not isinstance(routed, list) or len(routed) != units or not all(isinstance(x, int) and x >= 0 for x in routed):
        raise _fail(path, "bytes.experts_per_unit", f"expected {units} non-negative integers")
    devices = _expect(path, "devices", data["devices"], list, "a list of device profiles")
    seen = set()
    for i, d in enumerate(devices):
        _check_device_profile(path, f"devices[{i}]", d, seen)
        seen.add(d["id"])
    if "runtime" in data:
        rt = _expect(path, "runtime", data["runtime"], dict, "an object")
        for key in RUNTIME_COSTS:
            if not isinstance(rt.get(key), (int, float)) or not rt[key] >= 0:
                raise _fail(path, f"runtime.{key}", "expected seconds (a number >= 0)")
    for i, link in enumerate(_expect(path, "links", data["links"], list, "a list of links")):
        _check_link_profile(path, f"links[{i}]", link, seen)


def _profile_kv_dtype(data: dict) -> str:
    """The KV cache's elements a profile's JSON measured and counted (profiles before 16-bit caches
    lack the key: their cache was of the activations' dtype)."""
    return data.get("kv_dtype", data["dtype"])


def _check_device_profile(path: str, where: str, d, seen: set[str]) -> None:
    """One measured (or estimated) device of a profile (`seen`: the ids before it): who it is, its
    memory and its unit tables."""
    _expect(path, where, d, dict, "an object")
    for key in ("id", "host", "device", "type", "source", "identity", "memory", "compute"):
        if key not in d:
            raise _fail(path, where, f"missing required key {key!r}")
    if d["id"] in seen:
        raise _fail(path, f"{where}.id", f"{d['id']!r} appears twice")
    if d["source"] not in ("measured", "estimated"):
        raise _fail(path, f"{where}.source", "expected 'measured' or 'estimated'")
    check_device(path, f"{where}.device", d["device"])
    mem = _expect(path, f"{where}.memory", d["memory"], dict, "an object")
    if not isinstance(mem.get("free_bytes"), int) or mem["free_bytes"] < 0:
        raise _fail(path, f"{where}.memory.free_bytes", "expected a byte count")
    compute = _expect(path, f"{where}.compute", d["compute"], dict, "an object")
    for kind in UNIT_KINDS:
        if kind not in compute:
            raise _fail(path, f"{where}.compute", f"missing unit kind {kind!r}")
        _check_table(path, f"{where}.compute.{kind}", compute[kind], kind == "attn")
    for key in ("decode", "fit_error"):
        if key in d:
            _expect(path, f"{where}.{key}", d[key], dict, "an object")


def _check_link_profile(path: str, where: str, link, devices: set[str]) -> None:
    _expect(path, where, link, dict, "an object")
    for key in ("src", "dst", "alpha_s", "beta_bytes_per_s", "source"):
        if key not in link:
            raise _fail(path, where, f"missing required key {key!r}")
    if link["src"] not in devices or link["dst"] not in devices:
        raise _fail(path, where, f"names a device that is not in devices: {link['src']!r} -> {link['dst']!r}")
    if not link["alpha_s"] >= 0 or not link["beta_bytes_per_s"] > 0:
        raise _fail(path, where, "latency must be >= 0 and bandwidth > 0")


@dataclass(frozen=True)
class UnitTable:
    """A unit kind's measured seconds on one device: t[i][j] for s[i] tokens after c[j] tokens of
    context (None where not measured; c is [0] for the kinds that do not read the context)."""
    s: tuple[int, ...]
    c: tuple[int, ...]
    t: tuple[tuple[float | None, ...], ...]

    @staticmethod
    def from_json(table: dict) -> "UnitTable":
        return UnitTable(tuple(table["s"]), tuple(table["c"]), tuple(tuple(row) for row in table["t"]))

    def to_json(self) -> dict:
        return {"s": list(self.s), "c": list(self.c), "t": [list(row) for row in self.t]}


@dataclass(frozen=True)
class DecodeTable:
    """A device's decode step per unit kind: t[kind][i][j] seconds for batch[i] rows after
    context[j] tokens."""
    batch: tuple[int, ...]
    context: tuple[int, ...]
    t: dict[str, tuple[tuple[float | None, ...], ...]]

    @staticmethod
    def from_json(table: dict) -> "DecodeTable":
        return DecodeTable(tuple(table["batch"]), tuple(table["context"]),
                           {k: tuple(tuple(row) for row in rows) for k, rows in table["t"].items()})

    def to_json(self) -> dict:
        return {"batch": list(self.batch), "context": list(self.context),
                "t": {k: [list(row) for row in rows] for k, rows in self.t.items()}}


@dataclass(frozen=True)
class DeviceProfile:
    """One measured (or estimated) device of a profile."""
    id: str                          # "host/device"
    host: str
    device: str                      # "cpu", "cuda:0", ...
    type: str                        # what kind of device: one measured device stands for others of its type
    source: str                      # "measured" or "estimated"
    identity: dict[str, Any]         # what the device is: name, cores, threads, machine, flags, ...
    free_bytes: int
    total_bytes: int | None
    compute: dict[str, UnitTable]    # per unit kind (UNIT_KINDS)
    decode: DecodeTable | None = None
    fit_error: dict[str, float | None] = field(default_factory=dict)    # the fit's held-out error per kind
    extra: dict[str, Any] = field(default_factory=dict)   # what else the profiler recorded (its settings, fetch)

    @staticmethod
    def from_json(d: dict) -> "DeviceProfile":
        known = {"id", "host", "device", "type", "source", "identity", "memory", "compute", "decode", "fit_error"}
        return DeviceProfile(d["id"], d["host"], d["device"], d["type"], d["source"], dict(d["identity"]),
                             d["memory"]["free_bytes"], d["memory"].get("total_bytes"),
                             {k: UnitTable.from_json(t) for k, t in d["compute"].items()},
                             DecodeTable.from_json(d["decode"]) if d.get("decode") else None,
                             dict(d.get("fit_error") or {}), {k: v for k, v in d.items() if k not in known})

    def to_json(self) -> dict:
        memory = {"free_bytes": self.free_bytes}
        if self.total_bytes is not None:
            memory["total_bytes"] = self.total_bytes
        return {"id": self.id, "host": self.host, "device": self.device, "type": self.type, "source": self.source,
                "identity": self.identity, "memory": memory,
                "compute": {k: t.to_json() for k, t in self.compute.items()},
                **({"decode": self.decode.to_json()} if self.decode else {}),
                **({"fit_error": self.fit_error} if self.fit_error else {}), **self.extra}


@dataclass(frozen=True)
class LinkProfile:
    """A measured (or estimated) link from one device to another: alpha_s + bytes / beta."""
    src: str
    dst: str
    alpha_s: float
    beta_bytes_per_s: float
    source: str
    extra: dict[str, Any] = field(default_factory=dict)   # the measurement's backend and points

    @staticmethod
    def from_json(x: dict) -> "LinkProfile":
        known = {"src", "dst", "alpha_s", "beta_bytes_per_s", "source"}
        return LinkProfile(x["src"], x["dst"], float(x["alpha_s"]), float(x["beta_bytes_per_s"]), x["source"],
                           {k: v for k, v in x.items() if k not in known})

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "alpha_s": self.alpha_s, "beta_bytes_per_s": self.beta_bytes_per_s,
                "source": self.source, **self.extra}


@dataclass(frozen=True)
class UnitBytes:
    """The model's bytes per partition unit, as the profile counted them."""
    weights_per_unit: tuple[int, ...]
    kv_per_token_per_unit: tuple[int, ...]
    activation_per_token_at_cut: tuple[int, ...]      # one per cut position: units + 1
    experts_per_unit: tuple[int, ...]                  # the routed experts' share of weights_per_unit

    @staticmethod
    def from_json(b: dict) -> "UnitBytes":
        units = len(b["weights_per_unit"])
        return UnitBytes(tuple(b["weights_per_unit"]), tuple(b["kv_per_token_per_unit"]),
                         tuple(b["activation_per_token_at_cut"]), tuple(b.get("experts_per_unit", [0] * units)))

    def to_json(self) -> dict:
        return {k: list(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class RuntimeCosts:
    """The runtime's own costs, measured on the profiling host (hpipe.profiler.runtime_costs)."""
    step_s: float         # one process's per-step machinery
    hop_s: float          # a hop between stages beyond the link's own time
    back_s: float         # the last stage's end to stage 0's next step: sampling, the ids' trip, the commit
    measured: str = ""    # how they were had

    def to_json(self) -> dict:
        out = asdict(self)
        if not self.measured:
            del out["measured"]
        return out


@dataclass(frozen=True)
class Profile:
    """`hpipe profile`'s file: every device's unit times and every link, for one model, dtype and
    weight format. Written by hpipe.profiler alone; the planner reads it. Fields: docs/formats.md."""
    model: ModelIdentity              # the model it was measured for
    dtype: str                        # the activations' dtype the units were timed in
    kv_dtype: str                     # the KV cache's elements it measured and counted
    weights: str                      # the weight format the units ran
    max_seq_len: int
    bytes: UnitBytes
    devices: tuple[DeviceProfile, ...]
    links: tuple[LinkProfile, ...]
    runtime: RuntimeCosts | None = None     # absent from profiles before its measurement
    quick: bool = False
    peers: Any = None                 # GPU peer-to-peer links of one host, where measured
    errors: tuple[dict, ...] = ()     # devices and links that could not be measured, and why
    created: str = ""
    created_by: str = ""
    version: int = PROFILE_VERSION

    def device(self, device_id: str) -> DeviceProfile | None:
        return next((d for d in self.devices if d.id == device_id), None)

    def to_json(self) -> dict:
        out = {"version": self.version, "created": self.created, "created_by": self.created_by,
               "model": asdict(self.model),
               "dtype": self.dtype, "kv_dtype": self.kv_dtype, "weights": self.weights, "max_seq_len": self.max_seq_len,
               "quick": self.quick, "bytes": self.bytes.to_json(), "devices": [d.to_json() for d in self.devices],
               "links": [x.to_json() for x in self.links], "errors": list(self.errors)}
        if self.runtime is not None:
            out["runtime"] = self.runtime.to_json()
        if self.peers is not None:
            out["peers"] = self.peers
        return out


def parse_profile(data: Any, path: str = "<profile>") -> Profile:
    """A profile from its JSON (validated: one line naming the field where it is wrong)."""
    validate_profile(data, path)
    rt = data.get("runtime")
    return Profile(model=ModelIdentity(**data["model"]), dtype=data["dtype"], kv_dtype=_profile_kv_dtype(data),
                   weights=data.get("weights", "none"), max_seq_len=data["max_seq_len"],
                   bytes=UnitBytes.from_json(data["bytes"]),
                   devices=tuple(DeviceProfile.from_json(d) for d in data["devices"]),
                   links=tuple(LinkProfile.from_json(x) for x in data["links"]),
                   runtime=None if not rt else RuntimeCosts(**{k: float(rt[k]) for k in RUNTIME_COSTS},
                                                            measured=str(rt.get("measured", ""))),
                   quick=bool(data.get("quick", False)), peers=data.get("peers"), errors=tuple(data.get("errors", ())),
                   created=str(data.get("created", "")), created_by=str(data.get("created_by", "")),
                   version=data["version"])


def write_profile(profile: Profile, path: str | os.PathLike) -> None:
    data = profile.to_json()
    validate_profile(data, str(path))
    _write_json(data, path, indent=1)


def load_profile(path: str | os.PathLike) -> Profile:
    return parse_profile(_read_json(str(path), "profile", "profile"), str(path))
