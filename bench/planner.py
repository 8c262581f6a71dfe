"""Planner speed: `slice_sequence` on 32,768 tokens at granularity 16 (2,048 units) for 16 stages,
`partition_layers` for 160 units on 16 devices, and the paper's literal Algorithm 2 (every
threshold, a full DP for each) against `slice_sequence` on the same tau. Writes
bench/results/planner.json.

    python bench/planner.py [--literal-n 128,256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)


def realistic_tau(n: int, g: int = 16) -> np.ndarray:
    """tau[s, c] in units of g tokens for a bottleneck stage: fixed cost, per-token cost, attention
    over the context, and a tile-quantization penalty for lengths not a multiple of 64 tokens."""
    s = np.arange(n + 1)[:, None] * g
    c = np.arange(n + 1)[None, :] * g
    return 2e-4 + 3e-6 * s + 4e-10 * s * (c + s / 2) + 2e-5 * ((s % 64) != 0)


def literal_algorithm2(tau: np.ndarray, n_stages: int):
    """HPipe's Algorithm 2 as written: for every candidate t_max (every value of tau), the DP of the
    least sum with every slice <= t_max, then (n_stages - 1) t_max + L[N]."""
    n = tau.shape[0] - 1
    s_idx, c_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = (s_idx >= 1) & (s_idx + c_idx <= n)
    values = np.unique(tau[valid])
    best = np.inf
    for t_max in values:
        length = np.full(n + 1, np.inf)
        length[0] = 0.0
        for cur in range(1, n + 1):
            steps = np.arange(1, cur + 1)
            cost = tau[steps, cur - steps]
            cand = np.where(cost <= t_max, length[cur - steps] + cost, np.inf)
            length[cur] = cand.min()
        if np.isfinite(length[n]):
            best = min(best, (n_stages - 1) * t_max + length[n])
    return best, len(values)


def literal_algorithm2_batched(tau: np.ndarray, n_stages: int, device: str = "cpu", chunk: int = 8192):
    """The same algorithm, every threshold and a full DP for each, with the DPs of `chunk` thresholds
    run side by side as tensor rows (torch, float64) so that N = 1,024 units finishes in minutes
    rather than hours. Nothing is pruned: each threshold's DP visits every (cur, step) pair."""
    import torch

    n = tau.shape[0] - 1
    s_idx, c_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = (s_idx >= 1) & (s_idx + c_idx <= n)
    values = torch.from_numpy(np.unique(tau[valid])).to(device)
    tau_t = torch.from_numpy(tau).to(device)
    best = torch.tensor(float("inf"), dtype=torch.float64, device=device)
    for lo in range(0, len(values), chunk):
        t_max = values[lo:lo + chunk, None]
        length = torch.full((len(t_max), n + 1), float("inf"), dtype=torch.float64, device=device)
        length[:, 0] = 0.0
        for cur in range(1, n + 1):
            steps = torch.arange(1, cur + 1, device=device)
            cost = tau_t[steps, cur - steps]
            cand = torch.where(cost[None, :] <= t_max, length[:, cur - steps] + cost[None, :], float("inf"))
            length[:, cur] = cand.amin(dim=1)
        total = (n_stages - 1) * t_max[:, 0] + length[:, n]
        best = torch.minimum(best, total.min())
    return float(best), len(values)


def main() -> None:
    from hpipe.planner.partition import partition_layers
    from hpipe.planner.slicing import slice_sequence

    ap = argparse.ArgumentParser()
    ap.add_argument("--literal-n", default="64,128")
    ap.add_argument("--batched-literal-n", default="",
                    help="unit counts for the threshold-batched literal Algorithm 2, e.g. 1024")
    ap.add_argument("--batched-literal-device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "planner.json"))
    args = ap.parse_args()
    report = {}
    tau = realistic_tau(2048)
    t = time.perf_counter()
    result = slice_sequence(tau, 16)
    report["slice_sequence_2048_units_16_stages"] = {"seconds": time.perf_counter() - t, "dps": result.steps,
                                                     "slices": len(result.lengths),
                                                     "first_last_units": [result.lengths[0], result.lengths[-1]]}
    rng = np.random.default_rng(0)
    unit_time = rng.uniform(0.5, 2.0, (16, 160)) * rng.uniform(0.5, 2.0, (16, 1))
    out_comm = rng.uniform(0.0, 0.5, (16, 160))
    out_comm[-1] = 0
    t = time.perf_counter()
    partition_layers(unit_time, out_comm, rng.uniform(1, 2, 160), np.full(16, 40.0))
    report["partition_layers_160_units_16_devices_s"] = time.perf_counter() - t
    batched = lambda tau, stages: literal_algorithm2_batched(  # noqa: E731
        tau, stages, args.batched_literal_device, chunk=65536 if args.batched_literal_device.startswith("cuda") else 8192)
    for key, literal_fn, sizes, extra in (
            ("literal_vs_ours", literal_algorithm2, args.literal_n, {}),
            ("batched_literal_vs_ours", batched, args.batched_literal_n, {"literal_device": args.batched_literal_device})):
        report[key] = []
        for n in [int(x) for x in sizes.split(",") if x]:
            small = realistic_tau(n)
            t = time.perf_counter()
            ours = slice_sequence(small, 8)
            t_ours = time.perf_counter() - t
            t = time.perf_counter()
            literal, thresholds = literal_fn(small, 8)
            t_literal = time.perf_counter() - t
            report[key].append({"units": n, "stages": 8, "thresholds": thresholds, **extra, "literal_s": t_literal,
                                "ours_s": t_ours, "speedup": t_literal / t_ours,
                                "same_optimum": bool(abs(literal - ours.objective) <= 1e-12 * literal)})
            print(report[key][-1], flush=True)
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
