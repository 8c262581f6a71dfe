"""The stage worker: one process per pipeline stage.

    python -m hpipe.runtime.worker --plan plan.json --rank R --world-size N \
        --master-addr HOST --master-port PORT (--requests requests.jsonl | --serve) [options]

The same command line runs locally (`hpipe launch --local`) and, unchanged, on remote hosts (the
SSH launcher). The job token comes in the environment (HPIPE_JOB_TOKEN), not on the command line.

Stage 0 also runs the scheduler; the last stage also samples. Everything a launcher needs back
comes on stdout as lines `@@hpipe {json}` (results, timelines, a summary, errors); logs go to
stderr. A batch job's requests come in a file every stage reads. Serving (`--serve`), stage 0 reads
requests from stdin, one JSON object a line: {"op": "add", "request": {...}}, {"op": "abort",
"index": I} and {"op": "close"} (or the end of stdin): finish what runs and stop; it reports
`ready` (the KV pool, the longest sequence), `tokens` as they are sampled, `result` per finished
request and `stats` (queue, KV pages, preemptions, micro-batch sizes) a few times a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
from hpipe import memory
from hpipe.request import Request, read_requests
from hpipe.runtime import comm
from hpipe.runtime.kv import PAGE_SIZE, Segment, pages_needed
from hpipe.runtime.pipeline import Driver, Options, Stage, Timeline, emit_result, run_first_stage, run_later_stage
from hpipe.runtime.sampler_pool import SamplerPool
from hpipe.runtime.scheduler import POLICIES, Policy, Scheduler
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
    p.add_argument("--requests",
                   help="JSONL of hpipe.request.Request (written by the launcher): ids, sampling parameters, limits")
    p.add_argument("--serve", action="store_true", help="take requests on stage 0's stdin until it closes")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="serving: the longest prompt + output a request may have (0: the model's context)")
    p.add_argument("--policy", choices=POLICIES, default="throttle",
                   help="tokens per micro-batch: gLLM's token throttling, or Sarathi-Serve's fixed budget")
    p.add_argument("--iterations", type=int, default=0, help="throttle #T (0: the plan's devices' default)")
    p.add_argument("--max-prefill", type=int, default=0, help="throttle #MaxP (0: the plan's devices' default)")
    p.add_argument("--min-prefill", type=int, default=0, help="throttle #MinP (0: the plan's devices' default)")
    p.add_argument("--kv-thresh", type=float, default=-1.0, help="throttle KVthresh (<0: the default, 0.05)")
    p.add_argument("--budget", type=int, default=0, help="sarathi: tokens per micro-batch (0: the default)")
    p.add_argument("--page-size", type=int, default=PAGE_SIZE, help="tokens per KV page")
    p.add_argument("--kv-pages", type=int, default=0,
                   help="KV pages per stage (0: what memory allows, at most what max-batch sequences need)")
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
    args = p.parse_args(argv)
    if not args.serve and not args.requests:
        p.error("give --requests FILE (a batch job) or --serve (requests on stdin)")
    return args


def policy_for(args, devices: list[str]) -> Policy:
    """gLLM's defaults (#T 8, #MaxP 2048, #MinP 32, KVthresh 0.05) suit GPUs; a CPU stage needs a
    second for ~1000 prompt tokens of a 135M model, so with any CPU stage in the pipeline #MaxP is
    256 and #MinP 16: a micro-batch then costs at most ~8 decode steps, not ~60, and decode keeps
    flowing while long prompts prefill. Sarathi's budget follows the same rule (512 / 256)."""
    cpu = any(d == "cpu" for d in devices)
    return Policy(args.policy, iterations=args.iterations or 8,
                  max_prefill=args.max_prefill or (256 if cpu else 2048),
                  min_prefill=args.min_prefill or (16 if cpu else 32),
                  kv_thresh=0.05 if args.kv_thresh < 0 else args.kv_thresh,
                  budget=args.budget or (256 if cpu else 512))


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 34


def kv_pool_pages(args, plan, config, rank: int, runner, max_tokens: int, wanted: int) -> int:
    """This stage's KV pages: at most `wanted` (what max-batch sequences of the longest length
    need), at most what its share of the device's free memory holds after the activation buffers
    less a 10 % margin (stages sharing a device share it), at most --kv-pages."""
    stage = plan.stages[rank]
    sharing = sum(1 for s in plan.stages if (s.host, s.device) == (stage.host, stage.device))
    table = models.unit_bytes(config, plan.dtype)
    per_token = sum(table["kv_per_token_per_unit"][u] for u in range(*stage.units))
    if per_token == 0:
        return wanted if not args.kv_pages else min(wanted, args.kv_pages)
    budget = 0.9 * free_memory_bytes(runner.device) / sharing - memory.activation_bytes(table, max_tokens)
    pages = min(wanted, max(2, int(budget // (per_token * args.page_size))))
    return min(pages, args.kv_pages) if args.kv_pages else pages


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
    requests = [] if args.serve else read_requests(args.requests)
    if args.serve:
        max_len = min(args.max_model_len or models.context_length(config), models.context_length(config))
    else:
        max_len = max((len(r.input_ids) + r.max_new_tokens for r in requests), default=1)
    # A CPU stage's forward already keeps every core it has busy: a preparing thread next to it costs
    # more than it hides (one stage, one sequence: 37 vs 33 ms per token; 2 stages: equal; prepare is
    # 0.3 ms of a 30 ms step), so there the compute thread prepares between forwards
    prepare_thread = args.prepare_thread == "on" or (args.prepare_thread == "auto" and runner.device.type == "cuda")
    sampling = choose_sampling(args.sampling, stage_plan.device, args.world_size)
    options = Options(tsem=not args.no_tsem, sat=not args.no_sat or args.serve, prepare_thread=prepare_thread,
                      sampling=sampling, cuda_graphs=not args.no_cuda_graphs and runner.device.type == "cuda")
    policy = policy_for(args, [s.device for s in plan.stages])
    max_tokens = longest_microbatch(requests, plan, args.max_batch, policy, max_len if args.serve else 0)
    static = args.static_decode == "on" or (args.static_decode == "auto" and options.cuda_graphs)
    if static and (why := unsupported(runner)):
        log(f"stage {args.rank}: decode runs eagerly, not on the static path (CUDA graphs): {why}")
        static = False
        options = dataclasses.replace(options, cuda_graphs=False)

    groups = comm.init(args.rank, args.world_size, args.master_addr, args.master_port,
                       os.environ.get("HPIPE_JOB_TOKEN", "local"), [s.device for s in plan.stages], args.timeout_s)
    runner.kv.page_size = args.page_size
    sequences = args.max_batch if args.serve else min(args.max_batch, max(1, len(requests)))
    pages = kv_pool_pages(args, plan, config, args.rank, runner, max_tokens,
                          sequences * pages_needed(max_len, args.page_size) + 1)
    agreed = torch.tensor([pages], dtype=torch.long)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=groups.ctrl)    # stage 0 hands out what every stage holds
    pages = int(agreed.item())
    if pages - 1 < pages_needed(max_len, args.page_size):
        raise HpipeError(f"the KV pool holds {pages - 1} pages of {args.page_size} tokens on the smallest stage, "
                         f"fewer than one sequence of {max_len} tokens needs; give the stages more free memory, "
                         f"raise --kv-pages or lower --max-model-len / --max-new-tokens")
    runner.kv.allocate(pages)
    warm_up(runner, max_len)
    static_decode = StaticDecode(runner, args.max_batch, options.cuda_graphs, max_len) if static else None
    graphs = static_decode.capture() if static_decode is not None else 0
    runner.kv.frozen = True             # sized once: a growth mid-run would be a bug (and move the graphs' KV)
    load_s = time.time() - t_load
    by_index = {r.index: r for r in requests}
    last = args.rank == args.world_size - 1
    columns = args.max_batch + args.world_size if args.serve else min(len(requests), args.max_batch + args.world_size)
    sampler = RequestSampler(by_index, int(config.vocab_size), max(1, columns),
                             max_len=max_len if args.serve else None) if last else None
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
        """A batch job's count of each request's real tokens (for --logits-out); serving keeps none."""
        if args.serve:
            return
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

    def apply_events(events) -> None:
        """Serving: requests that join or leave, before the micro-batch that follows them is sampled
        (here, or queued to the pool's processes that own them)."""
        for kind, what in events:
            if kind == "admit":
                (pool or sampler).admit(what)
            else:
                (pool or sampler).release(what)

    def send_from_pool(mb_id, ids, seqs) -> None:
        tally(seqs, ids)
        comm.send_tokens(groups, 0, mb_id, ids, options.sat)

    stage = Stage(args.rank, args.world_size, runner, groups, options, Timeline(bounded=args.serve),
                  max_segments=args.max_batch + 1, max_tokens=max_tokens, page_size=args.page_size)
    stage.static = static_decode
    stage.allocate_buffers()
    pool = None
    if last and options.sampling == "cpu":
        rows = 2 * args.max_batch if args.serve else max(1, min(len(requests), 2 * args.max_batch))
        pool = SamplerPool(int(config.vocab_size), rows, by_index, max(1, columns),
                           send=send_from_pool, n_procs=args.sampler_procs, errors=stage.errors,
                           max_len=max_len if args.serve else None)

    dist.barrier(group=groups.ctrl)
    t_start = time.time()
    summary = None
    try:
        if args.rank == 0:
            sched = Scheduler(requests, plan.slicing.slices_for, args.world_size, args.max_batch,
                              lookahead=options.tsem, policy=policy, pages=pages, page_size=args.page_size,
                              max_tokens=max_tokens, serving=args.serve)
            driver = Driver(stage, sched, lambda st: emit_result(st, None if args.serve else sched.t0),
                            on_tokens=(lambda items: emit("tokens", items=items)) if args.serve else None,
                            on_stats=(lambda stats: emit("stats", **stats)) if args.serve else None)
            if args.serve:
                emit("ready", kv_pages=pages - 1, page_size=args.page_size, max_model_len=max_len,
                     max_batch=args.max_batch, policy=dataclasses.asdict(policy))
                threading.Thread(target=read_requests_from_stdin, args=(driver,), name="hpipe-requests",
                                 daemon=True).start()
            summary = run_first_stage(stage, driver, sample, apply_events)
            summary.update(requests=len(requests), prompt_tokens=sum(len(r.input_ids) for r in requests),
                           options={**dataclasses.asdict(options), "static_decode": static},
                           policy=dataclasses.asdict(policy), kv_pages=pages - 1, page_size=args.page_size)
        else:
            run_later_stage(stage, sample, rows_of, pool, apply_events)
    finally:
        if pool is not None:
            pool.close()
    t_end = time.time()
    if args.logits_out and last:
        np.savez(args.logits_out, **{by_index[s].id: np.stack(rows[:generated.get(s, len(rows))])
                                     for s, rows in logits_rows.items()})
    emit("timeline", rank=args.rank, host=stage_plan.host, device=stage_plan.device, units=list(stage_plan.units),
         start=t_start, end=t_end, load_s=round(load_s, 3), peak_rss_bytes=models.peak_rss_bytes(),
         kv_bytes=runner.kv.bytes(), intervals=list(stage.timeline.intervals), links=groups.counters.as_dict(),
         cuda_graphs=graphs)
    if summary is not None:
        emit("summary", **summary)
    dist.barrier(group=groups.ctrl)
    dist.destroy_process_group()


def read_requests_from_stdin(driver: Driver) -> None:
    """Serving, stage 0: the server's requests, a JSON object a line, until "close" or the end."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op") if isinstance(msg, dict) else None
            if op == "add":
                request = Request.from_json(msg["request"])
                try:
                    driver.add(request)
                except ValueError as e:
                    emit("rejected", id=request.id, message=str(e))
            elif op == "abort":
                driver.abort(int(msg["index"]))
            elif op == "close":
                break
            else:
                log(f"stage 0: unknown request line {line[:80]!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log(f"stage 0: bad request line ({e}): {line[:80]!r}")
    driver.close()


def longest_microbatch(requests, plan, max_batch: int, policy: Policy, max_len: int = 0) -> int:
    """The most tokens of one micro-batch (the receive buffers' rows, the scheduler's cap): the
    policy's prefill tokens or the plan's longest slice of any prompt (a prompt alone follows the
    plan's slicing), plus a decode token of every other sequence."""
    lengths = [len(r.input_ids) for r in requests] + ([max_len] if max_len else [])
    slices = [max(plan.slicing.slices_for(n)) for n in lengths if n]
    return max(slices + [policy.max_tokens]) + max_batch


def warm_up(runner, max_len: int) -> None:
    """Before the clock starts (the KV pool is allocated): one small slice through the stage's units
    (kernel selection, thread pools, first-touch allocations)."""
    n = max(1, min(16, max_len))
    x = torch.zeros(n, dtype=torch.long) if runner.first else torch.zeros(n, runner.hidden_size, dtype=runner.dtype)
    runner.forward(runner.prepare_inputs([Segment(0, 0, 0, n, True)]), x)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


if __name__ == "__main__":
    sys.exit(main())
