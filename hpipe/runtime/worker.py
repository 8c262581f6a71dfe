"""The stage worker: one process per pipeline stage.

    python -m hpipe.runtime.worker --plan plan.json --rank R --world-size N \
        --master-addr HOST --master-port PORT --requests requests.jsonl [options]

The same command line runs locally (`hpipe launch --local`) and, unchanged, on remote hosts (the
SSH launcher). The job token comes in the environment (HPIPE_JOB_TOKEN), not on the command line.

Stage 0 also runs the scheduler; the last stage also samples. Everything a launcher needs back
comes on stdout as lines `@@hpipe {json}` (results, timelines, a summary, errors); logs go to
stderr.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from hpipe import formats, models
from hpipe.errors import HpipeError
from hpipe.lifeline import tie_to_parent
from hpipe.reports import emit
from hpipe.request import read_requests
from hpipe.runtime import comm
from hpipe.runtime.kv import Segment, microbatch_kind
from hpipe.runtime.sampler_pool import SamplerPool
from hpipe.runtime.scheduler import Scheduler
from hpipe.runtime.stage import StageRunner
from hpipe.sampling import RequestSampler


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


class Timeline:
    def __init__(self):
        self.intervals: list[dict] = []

    def add(self, what: str, start: float, end: float, mb: int | None = None, kind: str | None = None,
            tokens: int | None = None):
        rec = {"what": what, "start": start, "end": end}
        if mb is not None:
            rec.update(mb=mb, kind=kind, tokens=tokens)
        self.intervals.append(rec)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hpipe.runtime.worker", description=__doc__)
    p.add_argument("--plan", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--model", help="model to load (default: the plan's model name)")
    p.add_argument("--requests", required=True,
                   help="JSONL of hpipe.request.Request (written by the launcher): ids, sampling parameters, limits")
    p.add_argument("--sampling", choices=["inline", "cpu"], default="inline",
                   help="last stage: sample in its own loop, or in a pool of sampler processes (SiPipe)")
    p.add_argument("--sampler-procs", type=int, default=1, help="with --sampling cpu: processes in the pool")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--logits-out", help="last stage: write an .npz of logits per request id")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    tie_to_parent("stage worker")
    args = parse_args(argv)
    try:
        run(args)
        return 0
    except Exception as e:  # report one line to the launcher, the traceback to the log
        emit("error", rank=args.rank, message=str(e) if isinstance(e, HpipeError) else f"{type(e).__name__}: {e}")
        if not isinstance(e, HpipeError):
            traceback.print_exc()
        return 2 if isinstance(e, HpipeError) else 1


def run(args) -> None:


    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.time()
    plan = formats.load_plan(args.plan)
    if args.world_size != len(plan.stages):
        raise formats.HpipeError(f"--world-size {args.world_size} but the plan has {len(plan.stages)} stages")
    stage = plan.stages[args.rank]
    source = models.resolve_model(args.model or plan.model.name)
    config = models.load_config(source.path)
    models.check_plan_matches(plan, config, source.name)
    units = range(*stage.units)
    runner = StageRunner(source.path, config, units, stage.device, plan.dtype, args.attn)
    requests = read_requests(args.requests)
    warm_up(runner, requests, args)
    load_s = time.time() - t_load
    by_index = {r.index: r for r in requests}
    last = args.rank == args.world_size - 1
    sampler = RequestSampler(by_index, int(config.vocab_size),
                             min(len(requests), args.max_batch + args.world_size)) if last else None
    logits_rows: dict[int, list] = {}

    def sampling_rows(out, segments) -> list[int]:
        seqs = [s.seq for s in segments if s.sample]
        if args.logits_out:
            for i, s in enumerate(seqs):
                logits_rows.setdefault(s, []).append(out[i].detach().float().cpu().numpy())
        return seqs

    def sample(out, segments) -> list[int]:
        return sampler.sample(out, sampling_rows(out, segments))

    groups = comm.init(args.rank, args.world_size, args.master_addr, args.master_port,
                       os.environ.get("HPIPE_JOB_TOKEN", "local"), [s.device for s in plan.stages], args.timeout_s)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    pool = None
    if last and args.sampling == "cpu" and args.world_size > 1:
        pool = SamplerPool(int(config.vocab_size), max(1, min(len(requests), 2 * args.max_batch)), by_index,
                           min(len(requests), args.max_batch + args.world_size),
                           send=lambda mb_id, ids: comm.send_tokens(groups, 0, mb_id, ids), n_procs=args.sampler_procs)

    dist.barrier(group=groups.ctrl)
    timeline = Timeline()
    t_start = time.time()
    if args.rank == 0:
        summary = drive(args, plan, runner, groups, requests, sample, timeline, sync)
    else:
        try:
            serve(args, runner, groups, sample, timeline, sync, pool, sampling_rows)
        finally:
            if pool is not None:
                pool.close()
        summary = None
    t_end = time.time()
    if args.logits_out and last:
        np.savez(args.logits_out, **{by_index[s].id: np.stack(rows) for s, rows in logits_rows.items()})
    emit("timeline", rank=args.rank, host=stage.host, device=stage.device, units=list(stage.units),
         start=t_start, end=t_end, load_s=round(load_s, 3), peak_rss_bytes=models.peak_rss_bytes(),
         kv_bytes=runner.kv.bytes(), intervals=timeline.intervals)
    if summary is not None:
        emit("summary", **summary)
    dist.barrier(group=groups.ctrl)
    dist.destroy_process_group()


def warm_up(runner, requests, args) -> None:
    """Before the clock starts: reserve the KV cache for the longest request of every sequence that
    can run at once (no growth copies mid-run), and run one small slice through the stage's units
    (kernel selection, thread pools, first-touch allocations)."""


    if not requests:
        return
    slots = min(args.max_batch, len(requests))
    runner.kv.reserve(slots, max(len(r.input_ids) + r.max_new_tokens for r in requests))
    n = min(16, max(len(r.input_ids) for r in requests))
    x = torch.zeros(n, dtype=torch.long) if runner.first else torch.zeros(n, runner.hidden_size, dtype=runner.dtype)
    runner.forward(runner.prepare_inputs([Segment(0, 0, 0, n, True)]), x)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def drive(args, plan, runner, groups, requests, sample, timeline, sync) -> dict:
    """Stage 0: the scheduler loop. Sampled ids come back from the last stage on a thread."""


    world = args.world_size
    sched = Scheduler(requests, plan.slicing.slices_for, world, args.max_batch)
    t0 = sched.t0
    wall0 = time.time()
    back: queue.Queue = queue.Queue()
    receiver = None
    if world > 1:
        def receive():
            while True:
                op, mb_id, ids = comm.recv_tokens(groups, world - 1)
                back.put((op, mb_id, ids))
                if op == comm.OP_STOP:
                    return
        receiver = threading.Thread(target=receive, name="hpipe-tokens", daemon=True)
        receiver.start()

    n_generated = 0

    def handle(mb_id, ids):
        nonlocal n_generated
        n_generated += len(ids)
        for st in sched.on_sampled(mb_id, ids):
            n = len(st.output)
            ttft = st.t_first - t0
            e2e = st.t_last - t0
            emit("result", id=st.request.id, output_ids=st.output, finish_reason=st.finish_reason,
                 prompt_tokens=len(st.request.input_ids), ttft_s=round(ttft, 6),
                 tpot_s=round((st.t_last - st.t_first) / (n - 1), 6) if n > 1 else 0.0,
                 e2e_s=round(e2e, 6), tokens_per_s=round(n / e2e, 3) if e2e > 0 else None)

    pending = comm.Pending()
    while not sched.done:
        while not back.empty():
            op, mb_id, ids = back.get_nowait()
            handle(mb_id, ids)
        mb = sched.next_microbatch()
        if mb is None:
            if sched.done:
                break
            t = time.time()
            op, mb_id, ids = back.get()
            timeline.add("wait", t, time.time())
            handle(mb_id, ids)
            continue
        t = time.time()
        inputs = runner.prepare_inputs(mb.segments)
        out = runner.forward(inputs, torch.tensor(mb.tokens, dtype=torch.long))
        sync()
        timeline.add("compute", t, time.time(), mb.id, mb.kind, len(mb.tokens))
        if world == 1:
            handle(mb.id, sample(out, mb.segments))
        else:
            t = time.time()
            pending.wait()
            comm.isend_work(groups, 1, mb.id, mb.segments, out, pending)
            timeline.add("send", t, time.time())
    pending.wait()
    if world > 1:
        comm.send_stop(groups, 1)
        while True:
            op, mb_id, ids = back.get()
            if op == comm.OP_STOP:
                break
        receiver.join()
    wall = time.time() - wall0
    prompt_tokens = sum(len(r.input_ids) for r in requests)
    return {"wall_s": round(wall, 6), "requests": len(requests), "prompt_tokens": prompt_tokens,
            "generated_tokens": n_generated, "tokens_per_s": round(n_generated / wall, 3) if wall else None,
            "t0_wall": wall0}


def serve(args, runner, groups, sample, timeline, sync, pool=None, rows_of=None) -> None:
    """Stages 1..N-1: receive, compute, pass on. The last stage samples and sends the ids back, or
    hands the logits to the sampler pool (rows_of picks the rows to sample) and goes on."""

    rank, world = args.rank, args.world_size
    last = rank == world - 1
    pending = comm.Pending()
    header, req = comm.irecv_header(groups, rank - 1)
    while True:
        t = time.time()
        req.wait()
        if int(header[0]) == comm.OP_STOP:
            timeline.add("wait", t, time.time())
            pending.wait()
            if last:
                if pool is not None:
                    pool.drain()
                comm.send_stop(groups, 0, tag=comm.TAG_BACK)
            else:
                comm.send_stop(groups, rank + 1)
            return
        mb_id, segments, hidden = comm.recv_work_body(groups, rank - 1, header, runner.hidden_size, runner.dtype)
        timeline.add("wait", t, time.time())
        header, req = comm.irecv_header(groups, rank - 1)  # the next header may arrive while we compute
        t = time.time()
        inputs = runner.prepare_inputs(segments)
        out = runner.forward(inputs, hidden)
        sync()
        timeline.add("compute", t, time.time(), mb_id, microbatch_kind(segments), hidden.shape[0])
        t = time.time()
        if last and pool is not None:
            pool.submit(mb_id, out, rows_of(out, segments))   # the pool samples; we go on
        elif last:
            comm.send_tokens(groups, 0, mb_id, sample(out, segments))
        else:
            pending.wait()
            comm.isend_work(groups, rank + 1, mb_id, segments, out, pending)
        timeline.add("send", t, time.time())


if __name__ == "__main__":
    sys.exit(main())
