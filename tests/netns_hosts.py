"""Emulated hosts for the SSH tests and benchmarks: network namespaces on this machine, each with its
own address on a private bridge, its own OpenSSH server (Debian's sshd, key-only root login, its own
host key), `tc tbf` shaping on its link and, optionally, a CPU quota (cgroup v1 `cpu`).

Nothing here is a mock: the launcher reaches these hosts over real SSH and the workers meet over
real TCP through the bridge. Facts this builds on: ../shared/notes/test-hosts.md.

    cluster = start_cluster(tmp_dir, [HostSpec("h0", rate_mbit=1000), HostSpec("h2", rate_mbit=100, cpus=0.5)])
    ... cluster.inventory_path ...
    stop_cluster(cluster)

The subnet exists only inside this machine (a bridge with no route out); traffic goes only to the
namespaces' addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BRIDGE = "hpbr0"
SUBNET = "10.213.7"          # /24, private to this machine
BRIDGE_ADDR = f"{SUBNET}.254"
NS_PREFIX = "hpns-"
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
SSHD = "/usr/sbin/sshd"


@dataclass
class HostSpec:
    name: str
    rate_mbit: int | None = None     # tbf rate of the host's link, both directions; None: unshaped
    cpus: float | None = None        # CPU quota in cores; None: no limit
    threads: int = 1                 # torch threads for this host's CPU stages (inventory `threads`)


@dataclass
class EmulatedHost:
    spec: HostSpec
    index: int
    namespace: str
    address: str
    bridge_veth: str
    sshd: subprocess.Popen | None = None
    cgroup: Path | None = None


@dataclass
class EmulatedCluster:
    dir: Path
    hosts: list[EmulatedHost]
    key: Path
    known_hosts: Path
    inventory_path: Path
    extra: dict = field(default_factory=dict)

    def host(self, name: str) -> EmulatedHost:
        return next(h for h in self.hosts if h.spec.name == name)


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cgroups)"
    if not os.path.exists(SSHD):
        return f"{SSHD} not found: apt-get install openssh-server (.ci/run does)"
    for tool in ("ip", "tc", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found"
    name = f"{NS_PREFIX}probe{os.getpid()}"      # its own: pytest-xdist's workers all collect, and probe, at once
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    r = subprocess.run(full, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: {r.stderr.strip()}")
    return r


def namespace_pids(ns: str) -> list[int]:
    r = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()]


def process_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


HPIPE_MARKS = ("hpipe.runtime", "hpipe.profiler.measure", "hpipe.profiler.links", "around one worker", "host_probe",
               "spawn_main")


def hpipe_processes(ns: str) -> list[tuple[int, str]]:
    """(pid, command line) of every hpipe process in the namespace: workers, profiler workers,
    the remote wrapper, sampler processes (not sshd, whatever its config path says)."""
    out = []
    for pid in namespace_pids(ns):
        cmd = process_cmdline(pid)
        if not cmd.startswith("sshd") and any(m in cmd for m in HPIPE_MARKS):
            out.append((pid, cmd))
    return out


def cleanup_leftovers() -> None:
    """Removes namespaces, cgroups and the bridge of an earlier run (killed processes first: a
    namespace with a process inside survives `ip netns del`)."""
    listed = _sh("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listed:
        ns = line.split(" ")[0]
        if ns.startswith(NS_PREFIX):
            for pid in namespace_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
            _sh("ip", "netns", "del", ns, check=False)
    if CGROUP_ROOT.exists():
        for d in CGROUP_ROOT.glob(NS_PREFIX + "*"):
            try:
                d.rmdir()
            except OSError:
                pass
    _sh("ip", "link", "del", BRIDGE, check=False)
    for line in _sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith("hpv"):
            _sh("ip", "link", "del", name, check=False)


def _shape(dev: str, rate_mbit: int, ns: str | None = None) -> None:
    burst = "256kb" if rate_mbit >= 1000 else "64kb"
    _sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", burst,
        "latency", "10ms", ns=ns)


SSHD_CONFIG = """\
Port 22
ListenAddress {address}
HostKey {dir}/ssh_host_ed25519_key
PidFile {dir}/sshd.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AuthorizedKeysFile {authorized}
# the keys live under /tmp, which StrictModes refuses (test-hosts.md)
StrictModes no
UsePAM no
# skip ~/.bashrc for every command (~150 ms each, test-hosts.md)
SetEnv SHLVL=1
Subsystem sftp internal-sftp
MaxStartups 50
MaxSessions 50
LogLevel ERROR
"""


def start_cluster(base: Path, specs: list[HostSpec]) -> EmulatedCluster:
    cleanup_leftovers()
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    os.makedirs("/run/sshd", exist_ok=True)
    key = base / "id_ed25519"
    if not key.exists():
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key), "-C", "hpipe-test")
    (base / "authorized_keys").write_text((base / "id_ed25519.pub").read_text())
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    hosts = []
    known = []
    for i, spec in enumerate(specs):
        ns = NS_PREFIX + spec.name
        address = f"{SUBNET}.{i + 1}"
        bridge_veth = f"hpv{i}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", bridge_veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "link", "set", bridge_veth, "master", BRIDGE)
        _sh("ip", "link", "set", bridge_veth, "up")
        _sh("ip", "addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
        _sh("ip", "link", "set", "eth0", "up", ns=ns)
        _sh("ip", "link", "set", "lo", "up", ns=ns)
        if spec.rate_mbit:
            _shape("eth0", spec.rate_mbit, ns=ns)      # the host's egress
            _shape(bridge_veth, spec.rate_mbit)        # its ingress
        hdir = base / spec.name
        hdir.mkdir(exist_ok=True)
        hkey = hdir / "ssh_host_ed25519_key"
        if not hkey.exists():
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hkey))
        config = hdir / "sshd_config"
        config.write_text(SSHD_CONFIG.format(address=address, dir=hdir, authorized=base / "authorized_keys"))
        known.append(f"{address} " + " ".join((hdir / "ssh_host_ed25519_key.pub").read_text().split()[:2]))
        host = EmulatedHost(spec, i, ns, address, bridge_veth)
        host.sshd = subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(hdir / "sshd.log", "w"))
        if CGROUP_ROOT.exists():        # every host its cgroup: a test can throttle any of them (cpu_quota)
            host.cgroup = CGROUP_ROOT / ns
            host.cgroup.mkdir(exist_ok=True)
            set_cpus(host, spec.cpus)
        elif spec.cpus is not None:
            raise RuntimeError("cgroup v1 cpu controller not mounted at /sys/fs/cgroup/cpu")
        hosts.append(host)
    (base / "known_hosts").write_text("\n".join(known) + "\n")
    for host in hosts:
        _wait_for_banner(host)
        if host.cgroup is not None:
            # the daemon (found from outside: `ip netns exec` hides the cgroup tree inside)
            for pid in namespace_pids(host.namespace):
                try:
                    (host.cgroup / "cgroup.procs").write_text(str(pid))
                except ProcessLookupError:     # a connection's child that already ended (the banner check's)
                    pass
    cluster = EmulatedCluster(base, hosts, key, base / "known_hosts", base / "cluster.toml")
    write_inventory(cluster, cluster.inventory_path)
    return cluster


def _wait_for_banner(host: EmulatedHost, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if host.sshd.poll() is not None:
            raise RuntimeError(f"sshd of {host.spec.name} exited: see {host.spec.name}/sshd.log")
        try:
            with socket.create_connection((host.address, 22), timeout=0.5) as s:
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"sshd of {host.spec.name} did not answer in {timeout} s")


def write_inventory(cluster: EmulatedCluster, path: Path, *, user: str = "root", key: Path | None = None,
                    known_hosts: Path | None = None, python: str | None = None, timeout_s: float = 5,
                    env: dict[str, str] | None = None, more_env: dict[str, str] | None = None) -> Path:
    """An inventory for the emulated hosts. By default every host's env points PYTHONPATH at this
    checkout (the hosts share this machine's files), HPIPE_CACHE at this process's hpipe cache and
    TORCHINDUCTOR_CACHE_DIR at this process's inductor cache (the test session's own, conftest.py):
    the hosts log in as root, whose own caches may hold a developer's `hpipe warmup` marks, and a
    host that found them would run compiled graphs where CI's fresh machine runs eagerly. more_env:
    added to either."""
    if env is None:
        from hpipe import models

        env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent), "HPIPE_CACHE": str(models.cache_dir())}
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            env["TORCHINDUCTOR_CACHE_DIR"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    env = {**env, **(more_env or {})}
    env_toml = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }"
    lines = ["version = 1", "", "[ssh]", f'user = "{user}"', f'identity_file = "{key or cluster.key}"',
             f'known_hosts = "{known_hosts or cluster.known_hosts}"', f"connect_timeout_s = {timeout_s}", ""]
    for h in cluster.hosts:
        lines += ["[[hosts]]", f'name = "{h.spec.name}"', f'address = "{h.address}"',
                  f"python = {json.dumps(python or sys.executable)}", 'devices = ["cpu"]',
                  f"threads = {h.spec.threads}", f"env = {env_toml}", ""]
    Path(path).write_text("\n".join(lines))
    return Path(path)


# a short CFS period (2 ms): with the default 100 ms, work shorter than the quota runs at full speed
# and only some of it waits, so the profiler's medians would not see the slow host
CFS_PERIOD_US = 2000


def set_cpus(host: EmulatedHost, cpus: float | None) -> None:
    """The host's CPU quota in cores (None: no limit), for every process it runs, now and later."""
    cg = host.cgroup
    if cg is None:
        raise RuntimeError("cgroup v1 cpu controller not mounted at /sys/fs/cgroup/cpu")
    if cpus is not None and cpus * CFS_PERIOD_US < 1000:
        raise RuntimeError(f"cpus={cpus}: the kernel's smallest quota is 1 ms of a {CFS_PERIOD_US} us period")
    (cg / "cpu.cfs_quota_us").write_text("-1")
    (cg / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
    if cpus is not None:
        (cg / "cpu.cfs_quota_us").write_text(str(int(cpus * CFS_PERIOD_US)))


@contextlib.contextmanager
def cpu_quota(cluster: EmulatedCluster, name: str, cpus: float):
    """A slow host for the block (its spec's quota after it). The SSH tests throttle a host only where
    they measure one: on two shared cores a half-core host doubles each launch's start and compile."""
    host = cluster.host(name)
    set_cpus(host, cpus)
    try:
        yield host
    finally:
        set_cpus(host, host.spec.cpus)


def set_link(cluster: EmulatedCluster, name: str, up: bool) -> None:
    _sh("ip", "link", "set", cluster.host(name).bridge_veth, "up" if up else "down")


def stop_cluster(cluster: EmulatedCluster) -> None:
    for h in cluster.hosts:
        for pid in namespace_pids(h.namespace):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if h.sshd is not None:
            try:
                h.sshd.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    time.sleep(0.05)
    cleanup_leftovers()


FREE = 520 * 2**20     # per host: the float32 model (621 MiB) needs two of them


def elastic_profile(names: list[str], path: Path) -> Path:
    """The measured one-thread profile's times on the named hosts' CPUs, for dense float32 weights,
    each host with FREE bytes of memory: two hosts hold the model, one does not."""
    from hpipe import models
    base = json.loads((Path(__file__).resolve().parent.parent / "profiles" / "smollm2-cpu-1thread-quick.json").read_text())
    config = models.load_config(models.resolve_model("smollm2").path)
    device, link = base["devices"][0], base["links"][0]
    base["weights"], base["bytes"] = "none", models.unit_bytes(config, "float32", "none").to_json()
    base["devices"] = [{**device, "id": f"{n}/cpu", "host": n, "weights": "none",
                        "memory": {"free_bytes": FREE, "total_bytes": 2 * FREE}} for n in names]
    base["links"] = [{**link, "src": f"{a}/cpu", "dst": f"{b}/cpu"} for a in names for b in names]
    path.write_text(json.dumps(base))
    return path
