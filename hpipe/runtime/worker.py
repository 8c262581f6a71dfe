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
import dataclasses
import os
import sys
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
from hpipe.runtime.kv import Segment
from hpipe.runtime.pipeline import Options, Stage, Timeline, emit_result, run_first_stage, run_later_stage
from hpipe.runtime.sampler_pool import SamplerPool
from hpipe.runtime.scheduler import Scheduler
from hpipe.runtime.stage import StageRunner
from hpipe.runtime.static_decode import StaticDecode, unsupported
from hpipe.sampling import RequestSampler


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


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
    p.add_argument("--sampling", choices=["inline", "cpu", "auto"], default="auto",
                   help="last stage: sample in this process (a sampler thread under TSEM), or in a pool of sampler "
                        "processes (SiPipe); auto: the pool when the last stage is a GPU, else inline")
    p.add_argument("--no-tsem", action="store_true", help="prepare inputs inline, one micro-batch at a time")
    p.add_argument("--no-sat", action="store_true", help="send header and segments with every hop's hidden states")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    p.add_argument("--prepare-thread", choices=["auto", "on", "off"], default="auto",
                   help="with TSEM: prepare inputs on a CPU thread (auto: on CUDA stages)")
    p.add_argument("--static-decode", choices=["auto", "on", "off"], default="auto",
                   help="decode micro-batches with static shapes (padded, whole KV slots under a mask): the path CUDA "
                        "graphs replay; auto: with CUDA graphs")
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


def choose_sampling(asked: str, device: str, world: int) -> str:
    """auto: the pool where sampling would take the accelerator's time (a GPU last stage); on a CPU
    stage the pool's processes compete with the forward for the same cores (bench/decode.py)."""
    if world == 1:
        return "inline"
    if asked == "auto":
        return "cpu" if device.startswith("cuda") else "inline"
    return asked


def run(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.time()
    plan = formats.load_plan(args.plan)
    if args.world_size != len(plan.stages):
        raise formats.HpipeError(f"--world-size {args.world_size} but the plan has {len(plan.stages)} stages")
    stage_plan = plan.stages[args.rank]
    source = models.resolve_model(args.model or plan.model.name)
    config = models.load_config(source.path)
    models.check_plan_matches(plan, config, source.name)
    runner = StageRunner(source.path, config, range(*stage_plan.units), stage_plan.device, plan.dtype, args.attn)
    requests = read_requests(args.requests)
    # A CPU stage's forward already keeps every core it has busy: a preparing thread next to it costs
    # more than it hides (one stage, one sequence: 37 vs 33 ms per token; 2 stages: equal; prepare is
    # 0.3 ms of a 30 ms step), so there the compute thread prepares between forwards
    prepare_thread = args.prepare_thread == "on" or (args.prepare_thread == "auto" and runner.device.type == "cuda")
    options = Options(tsem=not args.no_tsem, sat=not args.no_sat, prepare_thread=prepare_thread,
                      sampling=choose_sampling(args.sampling, stage_plan.device, args.world_size),
                      cuda_graphs=not args.no_cuda_graphs and runner.device.type == "cuda")
    static = args.static_decode == "on" or (args.static_decode == "auto" and options.cuda_graphs)
    if static and (why := unsupported(runner)):
        log(f"stage {args.rank}: decode runs eagerly, not on the static path (CUDA graphs): {why}")
        static = False
        options = dataclasses.replace(options, cuda_graphs=False)
    warm_up(runner, requests, args, scratch_slot=static)
    static_decode = StaticDecode(runner, args.max_batch, options.cuda_graphs) if static and requests else None
    graphs = static_decode.capture() if static_decode is not None else 0
    runner.kv.frozen = True             # sized once: a growth mid-run would be a bug (and move the graphs' KV)
    load_s = time.time() - t_load
    by_index = {r.index: r for r in requests}
    last = args.rank == args.world_size - 1
    sampler = RequestSampler(by_index, int(config.vocab_size),
                             min(len(requests), args.max_batch + args.world_size)) if last else None
    logits_rows: dict[int, list] = {}
    generated: dict[int, int] = {}     # seq -> tokens it really generated (leftover rows after a stop excluded)
    ended: set[int] = set()

    def rows_of(out, segments) -> list[int]:
        seqs = [s.seq for s in segments if s.sample]
        if args.logits_out:
            for i, s in enumerate(seqs):
                logits_rows.setdefault(s, []).append(out[i].detach().float().cpu().numpy())
        return seqs

    def tally(seqs, ids) -> None:
        for s, t in zip(seqs, ids):
            if s not in ended:
                generated[s] = generated.get(s, 0) + 1
                if by_index[s].finish_reason(t, generated[s]):
                    ended.add(s)

    def sample(out, segments) -> list[int]:
        seqs = rows_of(out, segments)
        ids = sampler.sample(out, seqs)
        tally(seqs, ids)
        return ids

    def send_from_pool(mb_id, ids, seqs) -> None:
        tally(seqs, ids)
        comm.send_tokens(groups, 0, mb_id, ids, options.sat)

    groups = comm.init(args.rank, args.world_size, args.master_addr, args.master_port,
                       os.environ.get("HPIPE_JOB_TOKEN", "local"), [s.device for s in plan.stages], args.timeout_s)
    stage = Stage(args.rank, args.world_size, runner, groups, options, Timeline(), max_segments=args.max_batch + 1,
                  max_tokens=longest_microbatch(requests, plan, args.max_batch))
    stage.static = static_decode
    stage.allocate_buffers()
    pool = None
    if last and options.sampling == "cpu":
        pool = SamplerPool(int(config.vocab_size), max(1, min(len(requests), 2 * args.max_batch)), by_index,
                           min(len(requests), args.max_batch + args.world_size),
                           send=send_from_pool, n_procs=args.sampler_procs, errors=stage.errors)

    dist.barrier(group=groups.ctrl)
    t_start = time.time()
    summary = None
    try:
        if args.rank == 0:
            sched = Scheduler(requests, plan.slicing.slices_for, args.world_size, args.max_batch,
                              lookahead=options.tsem)
            summary = run_first_stage(stage, sched, sample, lambda st: emit_result(st, sched.t0))
            summary.update(requests=len(requests), prompt_tokens=sum(len(r.input_ids) for r in requests),
                           options={**dataclasses.asdict(options), "static_decode": static})
        else:
            run_later_stage(stage, sample, rows_of, pool)
    finally:
        if pool is not None:
            pool.close()
    t_end = time.time()
    if args.logits_out and last:
        np.savez(args.logits_out, **{by_index[s].id: np.stack(rows[:generated.get(s, len(rows))])
                                     for s, rows in logits_rows.items()})
    emit("timeline", rank=args.rank, host=stage_plan.host, device=stage_plan.device, units=list(stage_plan.units),
         start=t_start, end=t_end, load_s=round(load_s, 3), peak_rss_bytes=models.peak_rss_bytes(),
         kv_bytes=runner.kv.bytes(), intervals=stage.timeline.intervals, links=groups.counters.as_dict(),
         cuda_graphs=graphs)
    if summary is not None:
        emit("summary", **summary)
    dist.barrier(group=groups.ctrl)
    dist.destroy_process_group()


def longest_microbatch(requests, plan, max_batch: int) -> int:
    """Rows of the receive buffers: the longest prompt slice, or a decode group."""
    slices = [max(plan.slicing.slices_for(len(r.input_ids))) for r in requests if r.input_ids]
    return max(slices + [max_batch, 1])


def warm_up(runner, requests, args, scratch_slot: bool = False) -> None:
    """Before the clock starts: reserve the KV cache for the longest request of every sequence that
    can run at once (no growth copies mid-run; with the static decode path one more slot, where
    padded rows write), and run one small slice through the stage's units (kernel selection,
    thread pools, first-touch allocations)."""
    if not requests:
        return
    slots = min(args.max_batch, len(requests)) + int(scratch_slot)
    runner.kv.reserve(slots, max(len(r.input_ids) + r.max_new_tokens for r in requests))
    n = min(16, max(len(r.input_ids) for r in requests))
    x = torch.zeros(n, dtype=torch.long) if runner.first else torch.zeros(n, runner.hidden_size, dtype=runner.dtype)
    runner.forward(runner.prepare_inputs([Segment(0, 0, 0, n, True)]), x)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


if __name__ == "__main__":
    sys.exit(main())
