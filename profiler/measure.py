"""Measures one device: the profiler's worker command, run unchanged on every host.

    python -m hpipe.profiler.measure --model MODEL --device cpu [--quick] [--max-seq-len N] [--dtype float32]

Loads only the units it times (the embedding, block 0's two halves, the final norm + head) through
`hpipe.runtime.stage.StageRunner` — the very code the runtime runs — and times each unit kind for
a slice of s tokens after c tokens of context over a grid, then decode steps against batch size
and context. Reports on stdout as `@@hpipe {json}` lines: `estimate` (seconds, up front),
`progress` (points done / total), `device_profile` (the result) or `error`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import platform
import random
import statistics
import time
import traceback

from hpipe import formats
from hpipe.formats import KV_DTYPE
from hpipe.lifeline import exit_now, tie_to_parent
from hpipe.reports import emit


COLD_BYTES = 64 << 20


def grid(max_seq_len: int, quick: bool, switches: tuple[int, ...] = ()) -> tuple[list[int], list[int]]:
    """Slice lengths s and contexts c, log-spaced up to the target length, with multiples of
    8/16/64 and some non-multiples (tile quantization shows between them), and both sides of every
    row count where the linears change path (`quant.path_switches`): interpolated across, a
    171-token slice was predicted 30 % short of the kernel it runs."""
    n = max_seq_len
    if quick:
        s = [1, 16, 64, 100, 256, 500, 768, 1024, 1536, 2048, 3072, 4096, 8192]
        c = [0, n // 4, n // 2, (3 * n) // 4]
    else:
        s = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 96, 100, 128, 192, 250, 256, 384, 500, 512, 768, 1000, 1024,
             1536, 2000, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 32768]
        c = [0, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
        c = [x for x in c if x < n] + [n - 64] if n > 128 else [0]
    s = sorted({x for x in s if x <= n} | {n} | {x for k in switches for x in (k - 1, k) if 0 < x <= n})
    c = sorted({x for x in c if 0 <= x < n})
    return s, c


def median_time(fn, sync, repeats: int, before=None) -> float:
    """One warm-up call, then the median of `repeats` timed calls, each synchronized; `before` (not
    timed) runs ahead of each timed call."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
            sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def device_identity(device: str, torch) -> dict:
    ident = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
             "hostname": platform.node()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        ident.update(name=props.name, cuda=torch.version.cuda, total_bytes=props.total_memory,
                     multiprocessors=props.multi_processor_count, driver=_nvidia_driver())
    else:
        name = platform.processor() or "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        ident.update(name=name, cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                     else os.cpu_count())
    ident["machine"] = machine_id()
    return ident


def machine_id() -> str:
    """The physical machine (its boot id): hosts that share one machine's cores, as emulated hosts in
    network namespaces or containers do, share it, so the planner knows they compete for cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return platform.node()


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return None


def free_memory(device: str, torch) -> dict:
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return {"free_bytes": int(free), "total_bytes": int(total)}
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return {"free_bytes": info.get("MemAvailable", info.get("MemFree", 0)), "total_bytes": info.get("MemTotal", 0)}


FETCH_BYTES = 64 << 20


def fetch_bandwidth(device: str, torch, repeats: int = 5) -> dict:
    """What SiDP's WaS reads from its host pool, in bytes/s: on a GPU a copy from pinned host
    memory into the device (the housekeeper's copy stream), on a CPU a copy from a file's shared
    mapping into private memory (the slots' fill). The best of `repeats` copies of FETCH_BYTES."""
    import tempfile

    if device.startswith("cuda"):
        dev = torch.device(device)
        src = torch.empty(FETCH_BYTES, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(FETCH_BYTES, dtype=torch.uint8, device=dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(repeats + 1):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return {"source": "host-pool", "what": "pinned host -> device", "bytes_per_s": FETCH_BYTES / best}
    with tempfile.NamedTemporaryFile() as f:
        f.truncate(FETCH_BYTES)
        src = torch.from_file(f.name, shared=True, size=FETCH_BYTES, dtype=torch.uint8)
        src.fill_(1)                                   # the pages in the page cache, as a mapped weight file's are
        dst = torch.empty(FETCH_BYTES, dtype=torch.uint8)
        best = float("inf")
        for _ in range(repeats + 1):
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
    return {"source": "host-pool", "what": "shared mapping -> private memory", "bytes_per_s": FETCH_BYTES / best}


def peer_copies(devices: list[str], torch, repeats: int = 5) -> list[dict]:
    """Every ordered pair of CUDA devices: does a device-to-device copy really arrive (the driver
    may say it can access the peer while a real copy fails or is staged through the host: vLLM's
    `can_actually_p2p` probes the same way), and its bandwidth."""
    out = []
    for a, b in itertools.permutations(devices, 2):
        da, db = torch.device(a), torch.device(b)
        entry = {"src": a, "dst": b, "peer_access": bool(torch.cuda.can_device_access_peer(da, db))}
        try:
            src = torch.arange(FETCH_BYTES // 4, dtype=torch.int32, device=da)
            dst = torch.empty_like(src, device=db)
            dst.copy_(src)
            torch.cuda.synchronize(db)
            entry["works"] = bool(torch.equal(dst.cpu(), src.cpu()))
            best = float("inf")
            for _ in range(repeats):
                torch.cuda.synchronize(da)
                t = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(db)
                best = min(best, time.perf_counter() - t)
            entry["bytes_per_s"] = FETCH_BYTES / best
        except RuntimeError as e:
            entry.update(works=False, error=str(e).splitlines()[0])
        out.append(entry)
    return out


def measure(model: str, device: str, quick: bool, max_seq_len: int | None, dtype: str, repeats: int | None,
            weights: str = "none", kv_dtype: str = KV_DTYPE) -> dict:
    import numpy as np
    import torch

    from hpipe import models, quant
    from hpipe.grid import heldout_errors

    source = models.resolve_model(model)
    config = models.load_config(source.path)
    ctx = models.context_length(config)
    n = min(max_seq_len or 2048, ctx)
    if max_seq_len and max_seq_len > ctx:
        raise ValueError(f"--max-seq-len {max_seq_len} exceeds the model's context of {ctx} tokens")
    fmt = quant.stage_weights(quant.WeightFormat.parse(weights), device)   # the units the stage will run
    repeats = repeats or (3 if quick else 5)
    timer = _UnitTimer(source, config, device, dtype, fmt, kv_dtype, repeats)
    s_grid, c_grid = grid(n, quick, quant.path_switches(fmt, device))
    points = [(s, c) for c in c_grid for s in s_grid if s + c <= n]
    decode_batches = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32]
    decode_ctx = sorted({x for x in ([128, n // 2, n - 1] if quick else [64, 256, 1024, n // 2, n - 1]) if 0 < x < n})
    total = len(points) + 3 * len(s_grid) + len(decode_batches) * len(decode_ctx)  # ticks: the last pass
    token_sum = sum(s for s, _ in points) + 2 * sum(s_grid) + sum(b for b in decode_batches) * len(decode_ctx)
    emit("estimate", seconds=round(timer.per_token(n) * token_sum * (repeats + 1) * 2 * 1.3 + 2, 1), points=total)

    tables = {k: {"s": s_grid, "c": [0], "t": [[None] for _ in s_grid]} for k in ("embed", "mlp", "head")}
    tables["attn"] = {"s": s_grid, "c": c_grid, "t": [[None] * len(c_grid) for _ in s_grid]}
    decode = {"batch": decode_batches, "context": decode_ctx,
              "t": {k: [[None] * len(decode_ctx) for _ in decode_batches] for k in ("attn", "mlp", "head")}}
    jobs = [(k, s, 0) for k in ("embed", "mlp", "head") for s in s_grid] + [("attn", s, c) for s, c in points]
    jobs += [("decode", i, j) for i in range(len(decode_batches)) for j in range(len(decode_ctx))]
    _time_all(timer, jobs, tables, decode, total)

    errors = {k: heldout_errors(tab["s"], tab["c"], tab["t"]) for k, tab in tables.items()}
    fit_error = {k: float(np.median(e)) if e.size else None for k, e in errors.items()}
    pooled = np.concatenate(list(errors.values()))
    fit_error["all"] = float(np.median(pooled)) if pooled.size else None  # every held-out point of every kind
    return {"device": device, "source": "measured", "identity": device_identity(device, torch),
            "memory": free_memory(device, torch), "compute": tables, "decode": decode, "fit_error": fit_error,
            "fetch": fetch_bandwidth(device, torch),
            "max_seq_len": n, "quick": quick, "repeats": repeats, "dtype": dtype,
            "weights": str(fmt)}


class _UnitTimer:
    """A stage's units as the profiler times them. A stage runs one block after another, each
    block's weights coming from memory, not from a cache warmed by the same unit a moment ago: the
    blocks are measured in turn, as many as hold COLD_BYTES (twice a large L3; quantized SmolLM2
    blocks are 2.2 MB each). The head is one unit, measured over and over: its weights (the
    vocabulary's embedding, tens of MB) would stay in the CPU's last-level cache, where a run never
    finds them (the stage's blocks ran in between), so each timed call of it comes after
    COLD_BYTES of other memory were written."""

    def __init__(self, source, config, device: str, dtype: str, fmt, kv_dtype: str, repeats: int):
        import torch

        from hpipe import models
        from hpipe.runtime.stage import StageRunner

        sizes = models.unit_bytes(config, dtype, str(fmt)).weights_per_unit
        self.cycle = max(1, min(models.num_blocks(config), -(-COLD_BYTES // max(1, sizes[1] + sizes[2]))))
        self.n_units = models.num_units(config)
        runner = functools.partial(StageRunner, source, config, device=device, dtype=dtype, weights=fmt,
                                   kv_dtype=kv_dtype)
        self.body = runner(range(1 + 2 * self.cycle))                   # the embedding and the blocks
        self.head = runner(range(self.n_units - 1, self.n_units))
        self.dev = self.body.device
        self.sync = torch.cuda.synchronize if self.dev.type == "cuda" else (lambda: None)
        self.repeats, self.hidden, self.vocab = repeats, int(config.hidden_size), int(config.vocab_size)
        self.scratch = torch.zeros(COLD_BYTES // 4) if self.dev.type == "cpu" else None

    def timed(self, fn) -> float:
        return median_time(fn, self.sync, self.repeats)

    def timed_cold(self, fn) -> float:
        scratch = self.scratch
        return median_time(fn, self.sync, self.repeats, before=None if scratch is None else (lambda: scratch.add_(1.0)))

    def unit_fn(self, runner, u, segments):
        import torch

        inputs = runner.prepare_inputs(segments)
        rows, per_row = inputs.shape
        if u == 0:
            x = torch.randint(0, self.vocab, (rows, per_row), device=self.dev)
        else:
            x = torch.randn(rows, per_row, self.hidden, device=self.dev, dtype=runner.dtype)
        if runner is self.body and u > 0:          # the same half of the next block each call
            units = itertools.cycle(range(u, 1 + 2 * self.cycle, 2))
            return lambda: runner._run_unit(next(units), x, inputs, runner.eager)
        return lambda: runner._run_unit(u, x, inputs, runner.eager)

    def step_of_halves(self, u, segments):
        """One decode step's worth of one kind of half: unit u's half of every block of the cycle
        in a row, as a step meets them; timed, then divided by the cycle. A decode half is short
        (0.2-0.7 ms here) and its cost is the memory it reads: timed alone, a few calls on the
        first blocks right after another point's work read 10-30 % slower than the same halves
        inside a step (the 2,047-token context's attention: 0.62-0.71 against 0.52 ms)."""
        half = self.unit_fn(self.body, u, segments)       # the same half of the next block each call

        def run():
            for _ in range(self.cycle):
                half()
        return run

    def per_token(self, n: int) -> float:
        """The up-front estimate's rate: a block's two halves on the largest slice, once."""
        import torch

        from hpipe.runtime.pages import Segment

        with torch.inference_mode():
            probe = self.unit_fn(self.body, 1, [Segment(0, 0, 0, min(256, n), True)])
            probe()
            t0 = time.perf_counter()
            probe(), self.unit_fn(self.body, 2, [Segment(0, 0, 0, min(256, n), True)])()
            self.sync()
            return (time.perf_counter() - t0) / min(256, n)


def _time_all(timer: _UnitTimer, jobs: list, tables: dict, decode: dict, total: int) -> None:
    """Two passes over the grid and the decode steps together, each pass in its own shuffled order,
    and per point the mean of the two medians: a slow spell of the machine (other tenants,
    frequency changes; here spells of 10-20 s at 1.35x) is spread over many points instead of
    landing on neighbours, or on every decode step when they were measured in a row. Not the
    lesser of the two: a run meets the machine as it usually is, not at its best, and the lesser
    made every prediction ~10 % short on this shared machine (bench/fidelity.py)."""
    import torch

    from hpipe.runtime.pages import Segment

    passes, done, head_unit = 2, 0, timer.n_units - 1
    kind_unit = {"embed": (timer.body, 0), "attn": (timer.body, 1), "mlp": (timer.body, 2),
                 "head": (timer.head, head_unit)}
    s_grid, decode_batches, decode_ctx = tables["attn"]["s"], decode["batch"], decode["context"]

    def keep(cell: list, i: int, j: int, t: float) -> None:
        cell[i][j] = t if cell[i][j] is None else (cell[i][j] + t) / 2

    with torch.inference_mode():
        for p in range(passes):
            random.Random(p).shuffle(jobs)
            for kind, a, b in jobs:
                if kind == "decode":
                    segs = [Segment(k, k, decode_ctx[b], 1, True) for k in range(decode_batches[a])]
                    keep(decode["t"]["attn"], a, b, timer.timed(timer.step_of_halves(1, segs)) / timer.cycle)
                    keep(decode["t"]["mlp"], a, b, timer.timed(timer.step_of_halves(2, segs)) / timer.cycle)
                    keep(decode["t"]["head"], a, b, timer.timed_cold(timer.unit_fn(timer.head, head_unit, segs)))
                else:
                    runner, u = kind_unit[kind]
                    table = tables[kind]
                    fn = timer.unit_fn(runner, u, [Segment(0, 0, b, a, True)])
                    keep(table["t"], s_grid.index(a), table["c"].index(b),
                         (timer.timed_cold if kind == "head" else timer.timed)(fn))
                if p == passes - 1:
                    done += 1
                    emit("progress", done=done, total=total)


def probe(model: str, device_entry: formats.DeviceProfile, threads: int, weights: str, dtype: str = "float32") -> float:
    """How far a profiled device is from itself today: one block (attention and MLP halves) on a
    256-token slice, timed here with `threads` threads (in this process), over the profile's
    prediction for the same work. 1.0: the profile holds; 1.3: this device now runs 30 % slower."""
    import numpy as np
    import torch

    from hpipe import models, quant
    from hpipe.grid import GridModel
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner

    source = models.resolve_model(model)
    config = models.load_config(source.path)
    fmt = quant.stage_weights(quant.WeightFormat.parse(weights), "cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = StageRunner(source, config, range(0, 3), "cpu", dtype, weights=fmt)
        inputs = runner.prepare_inputs([Segment(0, 0, 0, PROBE_TOKENS, True)])
        x = torch.randn(1, PROBE_TOKENS, int(config.hidden_size), dtype=runner.dtype)
        with torch.inference_mode():
            took = sum(median_time(lambda u=u: runner._run_unit(u, x, inputs, runner.eager), lambda: None, 9) for u in (1, 2))
    finally:
        torch.set_num_threads(before)
    s, c = np.array([PROBE_TOKENS]), np.array([0])
    fits = {k: GridModel(t.s, t.c, t.t) for k, t in device_entry.compute.items()}
    return took / float(fits["attn"](s, c)[0] + fits["mlp"](s, c)[0])


PROBE_TOKENS = 256


def main(argv=None) -> int:
    tie_to_parent("profiler worker")
    p = argparse.ArgumentParser(prog="python -m hpipe.profiler.measure", description=__doc__)
    p.add_argument("--model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-seq-len", type=int)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-dtype", default=KV_DTYPE)
    p.add_argument("--weights", default="none")
    p.add_argument("--repeats", type=int)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--peers", help="instead: probe copies between these CUDA devices (comma-separated)")
    args = p.parse_args(argv)
    try:
        import torch

        if args.peers:
            emit("peer_profile", peers=peer_copies(args.peers.split(","), torch))
            return 0
        if not args.model:
            p.error("give --model (or --peers)")

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available on this host")
            index = int(args.device.split(":")[1]) if ":" in args.device else 0
            if index >= torch.cuda.device_count():
                raise RuntimeError(f"{args.device} does not exist here ({torch.cuda.device_count()} CUDA devices)")
        result = measure(args.model, args.device, args.quick, args.max_seq_len, args.dtype, args.repeats,
                         args.weights, args.kv_dtype)
        emit("device_profile", **result)
        return 0
    except Exception as e:
        emit("error", message=f"{type(e).__name__}: {e}" if not e.__class__.__name__ == "HpipeError" else str(e))
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    exit_now(main())      # without the interpreter's teardown (up to a second of finalizing torch)
