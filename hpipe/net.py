"""Small network helpers shared by the launcher, the profiler and the runtime."""

from __future__ import annotations

import os
import random
import socket
import struct


def free_port() -> int:
    """A TCP port that is free on this machine now, for a server (a rendezvous) started right after.

    One outside the kernel's ephemeral range (`ip_local_port_range`), at random: the kernel never
    gives such a port to an outgoing connection, where the port that `bind(("", 0))` returns is one
    it hands out again, and a run's gloo connections (hundreds, on a busy host) took it before the
    server bound it ("address already in use", seen in the test suite). Not below 20000, where
    services of one's own listen (`hpipe serve`'s 8000). Where the range leaves no port outside it,
    the kernel's pick."""
    low, high = _ephemeral_range()
    outside = [(20000, low), (high + 1, 65536)]
    spans = [(a, b) for a, b in outside if b - a >= 1024]
    rng = random.SystemRandom()
    for _ in range(64 if spans else 0):
        a, b = rng.choice(spans)
        port = rng.randrange(a, b)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux; elsewhere IANA's 49152-65535)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def interface_with_address(ip: str) -> str | None:
    """The name of the local network interface that holds IPv4 address `ip` (Linux), or None."""
    try:
        import fcntl
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(res[20:24]) == ip:
                return name
    return None


def choose_gloo_interface(master_addr: str) -> str | None:
    """Gloo advertises the address its host name resolves to. When that is not the address this
    host uses to reach the rendezvous (typically 127.0.1.1 from /etc/hosts, or a name shared by
    several hosts), peers cannot connect back. Sets GLOO_SOCKET_IFNAME to the interface that
    reaches `master_addr`, unless the user set it. Returns the interface chosen, or None."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            local_ip = s.getsockname()[0]
    except OSError:
        return None
    if local_ip.startswith("127."):
        return None  # every stage on this machine: loopback is right
    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError:
        resolved = None
    if resolved == local_ip:
        return None
    name = interface_with_address(local_ip)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name
