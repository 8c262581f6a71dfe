"""All stages of a plan in one process, one after another: the same scheduler, stage and sampling
code as the distributed runtime, without processes or transfers. Used by tests (exactness against
transformers over many random plans) and by benchmarks (the one-process baseline)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hpipe.request import Request
from hpipe.runtime.kv import PAGE_SIZE
from hpipe.runtime.scheduler import Policy, Scheduler
from hpipe.runtime.stage import StageRunner
from hpipe.runtime.static_decode import StaticDecode
from hpipe.sampling import RequestSampler


def run_inprocess(runners: list[StageRunner], requests: list[Request], slices_for: Callable[[int], list[int]],
                  max_batch: int = 16, n_stages: int | None = None, keep_logits: bool = False,
                  static_decode: bool = False, cuda_graphs: bool = False, policy: Policy | None = None,
                  pages: int | None = None, page_size: int = PAGE_SIZE) -> dict:
    """Returns {request id: {"output_ids": [...], "logits": [rows] (if keep_logits)}}. static_decode:
    decode micro-batches take the static-shape path (CUDA graphs on CUDA with cuda_graphs). pages:
    the KV pool (None: room for max_batch of the longest request)."""
    ids = {r.index: r.id for r in requests}
    sched = Scheduler(requests, slices_for, n_stages or len(runners), max_batch, policy=policy, pages=pages,
                      page_size=page_size)
    for runner in runners:     # every stage holds the pool the scheduler hands out
        runner.kv.page_size = page_size
        runner.kv.allocate(sched.pool.pages)
    statics: list[StaticDecode | None] = [None] * len(runners)
    if static_decode:
        longest = max(len(r.input_ids) + r.max_new_tokens for r in requests)
        statics = [StaticDecode(runner, max_batch, cuda_graphs, longest) for runner in runners]
        for runner, static in zip(runners, statics):
            static.capture()
            runner.kv.frozen = True
    vocab = runners[-1].config.vocab_size
    sampler = RequestSampler({r.index: r for r in requests}, vocab, len(requests))
    logits: dict[int, list] = {}
    out: dict[str, dict] = {}
    while not sched.done:
        mb = sched.next_microbatch()
        assert mb is not None, "the scheduler stalled with nothing in flight"
        x = torch.tensor(mb.tokens, dtype=torch.long)
        for runner, static in zip(runners, statics):
            if static is not None and static.accepts(mb.segments):
                x = static.run(static.prepare(mb.segments, mb.id % 2), x)
            else:
                x = runner.forward(runner.prepare_inputs(mb.segments), x)
        seqs = [s.seq for s in mb.segments if s.sample]
        if keep_logits:
            for i, s in enumerate(seqs):
                logits.setdefault(s, []).append(x[i].detach().float().cpu())
        for st in sched.on_sampled(mb.id, sampler.sample(x, seqs)):
            out[st.request.id] = {"output_ids": st.output, "finish_reason": st.finish_reason}
    if keep_logits:
        for s, rows in logits.items():
            out[ids[s]]["logits"] = torch.stack(rows)
    return out
