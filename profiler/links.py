"""Measures one link between two workers through the runtime's own transport
(`hpipe.runtime.comm`: gloo, or NCCL between distinct CUDA devices).

    python -m hpipe.profiler.links --rank R --master-addr A --master-port P --devices cpu,cuda:0 [--quick]

Rank 0 and rank 1 each send messages of 8 B, 1 KB and 4x larger each time, up to 64 MB (`--quick`:
16 MB, fewer repeats) or the first that takes `ENOUGH_S` (`QUICK_ENOUGH_S`), to the other and time
the round trip with a one-element reply. rtt(n) = 2 alpha + n / beta (the reply costs one more latency): 2 alpha is the
smallest message's round trip, beta the slope over the messages of 1 MB and more (each its fastest
round trip; a small message its median); the one-way points
kept in the profile are rtt(n) - alpha. Rank 0 reports `@@hpipe {"type": "link_profile", ...}` with
both directions and the raw points.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import numpy as np

from hpipe.lifeline import exit_now, tie_to_parent
from hpipe.reports import emit

SIZES = [8] + [1024 * 4 ** k for k in range(9)]  # 8 B, 1 KB ... 64 MB
# --quick stops at 16 MB: at 4 MB a 1 Gbit/s link behind tbf read 10.3 % fast (its 256 KB burst on
# messages of 34 ms); 16 MB keeps them within tests/test_ssh.py's 10 %
QUICK_SIZES = SIZES[:-1]
# A message whose round trip takes this long ends the sizes: what a shaper or a switch lets through
# at line rate (a burst) is a small part of it, and larger ones would only repeat its slope at 4x
# the time. The bytes a link needs follow its speed: a 1 Gbit/s link still goes to 16 MB under
# --quick (0.13 s), a 100 Mbit/s one stops at 4 MB (0.34 s; 16 MB took ~16 s a link, both ways,
# where this takes ~5, within the same 10 % of tbf's rate)
ENOUGH_S, QUICK_ENOUGH_S = 0.4, 0.1


SMALL_BYTES = 4096      # messages whose time is the link's latency: a decode step's hidden state and less
# messages whose time is the link's bandwidth: the slope's points. Each is the fastest of its round
# trips, not their median: no round trip beats the wire, and a slower one is a host busy elsewhere
# (a CI run's 1 Gbit/s link, with two other test workers on the same 2 cores, read 10.05 % slow by
# the median of three 16 MB round trips, where alone it reads within 0.1 %). A small message keeps
# its median: that is the latency a decode step's hop pays.
BULK_BYTES = 1 << 20


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """t(n) = alpha + n / beta from (bytes, seconds) points: alpha is the fastest of the small
    messages (up to SMALL_BYTES: no message costs less than the latency, and one slow point among
    them is a host answering late, not the link: on the emulated hosts the 100 Mbit/s link h1 -> h2
    answered its 8-byte round trip in 3.2 ms and its 1 and 4 KB ones in 0.15, and every decode hop
    over it was predicted 2.45 ms against 0.25-0.36 measured); beta
    is the slope of a least-squares line through the messages of BULK_BYTES and more (or the two
    largest). Fitting the slope on the large messages alone keeps a noisy latency from bending the
    bandwidth."""
    pts = sorted(points)
    alpha = max(0.0, min(t for n, t in pts if n <= max(SMALL_BYTES, pts[0][0])))
    big = [p for p in pts if p[0] >= BULK_BYTES]
    if len(big) < 2:
        big = pts[-2:]
    n = np.array([p[0] for p in big], dtype=float)
    t = np.array([p[1] for p in big], dtype=float)
    slope = np.polyfit(n, t, 1)[0] if len(big) >= 2 and n[-1] > n[0] else 0.0
    if slope <= 0:  # degenerate: the largest message alone
        slope = max(t[-1] - alpha, 1e-12) / max(n[-1], 1.0)
    return float(alpha), float(1.0 / slope)


def measure(rank: int, groups, device, quick: bool) -> dict:
    import torch

    peer = 1 - rank
    on_gpu = groups.backend == "nccl"
    dev = groups.data_device if on_gpu else torch.device("cpu")
    # a CUDA stage on gloo stages its hidden states through host memory: time that copy too
    staged = torch.device(device) if (not on_gpu and device.startswith("cuda")) else None
    sizes, enough_s = (QUICK_SIZES, QUICK_ENOUGH_S) if quick else (SIZES, ENOUGH_S)
    result = {}
    for sender in (0, 1):
        points = []
        for size in sizes:
            buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=dev)  # touched: see test-hosts notes
            reps = 3 if size >= 1 << 24 else (5 if quick else 10)
            times = _round_trips(rank == sender, peer, groups, buf, staged, reps)
            if rank == sender:
                n = buf.numel() * 4
                points.append((n, min(times) if n >= BULK_BYTES else statistics.median(times)))
            if not _next_size(rank == sender, peer, groups, dev, rank != sender or points[-1][1] < enough_s):
                break
        if rank == sender:
            two_alpha, beta = fit_alpha_beta(points)
            alpha = two_alpha / 2
            result[sender] = {"alpha_s": alpha, "beta_bytes_per_s": beta,
                              "points": [(n, max(t - alpha, 0.0)) for n, t in points],
                              "round_trip_small_s": points[0][1]}
    return _gathered(rank, groups, result)


def _round_trips(sending: bool, peer: int, groups, buf, staged, reps: int) -> list[float]:
    """reps + 1 round trips of `buf` to the peer and its one-element reply; the sender's times of all
    but the first (the receiver's list is empty)."""
    import torch
    import torch.distributed as dist

    on_gpu = groups.backend == "nccl"
    ack = torch.zeros(1, device=buf.device)
    src = buf.to(staged) if staged is not None else buf
    times = []
    for r in range(reps + 1):
        if sending:
            if on_gpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            dist.send(buf if staged is None else src.cpu(), peer, group=groups.data)
            dist.recv(ack, peer, group=groups.data)
            if on_gpu:
                torch.cuda.synchronize()
            if r:
                times.append(time.perf_counter() - t)
        else:
            dist.recv(buf, peer, group=groups.data)
            if staged is not None:
                buf.to(staged)
                torch.cuda.synchronize(staged)
            dist.send(ack, peer, group=groups.data)
    return times


def _next_size(sending: bool, peer: int, groups, dev, more: bool) -> bool:
    """Whether the sender goes on to the next size (its `more`), told to the receiver."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(more)], device=dev)
    if sending:
        dist.send(flag, peer, group=groups.data)
    else:
        dist.recv(flag, peer, group=groups.data)
    return bool(flag.item())


def _gathered(rank: int, groups, result: dict) -> dict:
    """Both directions at rank 0 (rank 1 measured the backward one), {} at rank 1."""
    import torch
    import torch.distributed as dist

    blob = torch.tensor(bytearray(json.dumps(result.get(1, {})).encode()), dtype=torch.uint8)
    size = torch.tensor([blob.numel()])
    if rank == 1:
        dist.send(size, 0, group=groups.ctrl)
        dist.send(blob, 0, group=groups.ctrl)
        return {}
    dist.recv(size, 1, group=groups.ctrl)
    other = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(other, 1, group=groups.ctrl)
    result[1] = json.loads(bytes(other.tolist()).decode())
    return result


def main(argv=None) -> int:
    tie_to_parent("profiler worker")
    p = argparse.ArgumentParser(prog="python -m hpipe.profiler.links", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--devices", required=True, help="the two devices, rank 0's first")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout-s", type=float, default=120)
    args = p.parse_args(argv)
    try:
        import torch.distributed as dist

        from hpipe.runtime import comm

        devices = args.devices.split(",")
        groups = comm.init(args.rank, 2, args.master_addr, args.master_port,
                           os.environ.get("HPIPE_JOB_TOKEN", "local"), devices, args.timeout_s)
        result = measure(args.rank, groups, devices[args.rank], args.quick)
        if args.rank == 0:
            emit("link_profile", backend=groups.backend, forward=result[0], backward=result[1])
        dist.barrier(group=groups.ctrl)
        dist.destroy_process_group()
        return 0
    except Exception as e:
        emit("error", message=f"{type(e).__name__}: {e}")
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    exit_now(main())      # without the interpreter's teardown (up to a second of finalizing torch)
