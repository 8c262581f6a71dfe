"""All stages of a plan in one process, one after another: the same scheduler, stage and sampling
code as the distributed runtime, without processes or transfers. Used by tests (exactness against
transformers over many random plans) and by benchmarks (the one-process baseline)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hpipe.config import DEFAULTS, Speculation
from hpipe.request import Request
from hpipe.runtime import invariant
from hpipe.runtime.draft import proposer_for
from hpipe.runtime.scheduler import Policy, Scheduler
from hpipe.runtime.stage import StageRunner
from hpipe.runtime.static_decode import StaticDecode
from hpipe.sampling import RequestSampler


def run_inprocess(runners: list[StageRunner], requests: list[Request], slices_for: Callable[[int], list[int]],
                  max_batch: int = DEFAULTS.max_batch, n_stages: int | None = None, keep_logits: bool = False,
                  static: bool = False, graphs: bool = False, policy: Policy | None = None,
                  pages: int | None = None, page_size: int = DEFAULTS.page_size,
                  speculation: Speculation = Speculation(), prefix_caching: str = DEFAULTS.prefix_caching) -> dict:
    """Returns {request id: {"output_ids": [...], "logits": [rows] (if keep_logits)}}. static: decode
    micro-batches take the static-shape path (replayed from CUDA graphs on CUDA with `graphs`). pages:
    the KV pool (None: room for max_batch of the longest request)."""
    ids = {r.index: r.id for r in requests}
    sched = Scheduler(requests, slices_for, n_stages or len(runners), max_batch, policy=policy, pages=pages,
                      page_size=page_size, prefix_caching=prefix_caching,
                      **invariant.scheduling(page_size, runners[0].deterministic))
    sched.proposer = proposer_for(speculation, runners[0].config.vocab_size, str(runners[0].device),
                                  str(runners[0].dtype).removeprefix("torch."), sched.pool.pages, page_size,
                                  str(runners[0].kv.dtype).removeprefix("torch."))
    for runner in runners:     # every stage holds the pool the scheduler hands out
        runner.kv.page_size = page_size
        runner.kv.allocate(sched.pool.pages)
    statics: list[StaticDecode | None] = [None] * len(runners)
    if static:
        longest = max(len(r.input_ids) + r.max_new_tokens for r in requests)
        statics = [StaticDecode(runner, max_batch, graphs, longest) for runner in runners]
        for runner, static in zip(runners, statics):
            static.capture()
            runner.kv.frozen = True
    vocab = runners[-1].config.vocab_size
    sampler = RequestSampler(vocab, len(requests), max(r.max_new_tokens for r in requests))
    logits: dict[int, list] = {}
    out: dict[str, dict] = {}
    while not sched.done:
        mb = sched.next_microbatch()
        assert mb is not None, "the scheduler stalled with nothing in flight"
        for request in mb.admitted:       # the sampler follows the schedules, as the last stage does
            sampler.admit(request)
        for index, _ in mb.released:
            sampler.release(index)
        x = torch.tensor(mb.tokens, dtype=torch.long)
        for runner, static in zip(runners, statics):
            with torch.inference_mode():    # as the pipeline's executors prepare (a compiled graph tells the two apart)
                if static is not None and static.accepts(mb.segments):
                    x = static.run(static.prepare(mb.segments, mb.id % 2), x)
                else:
                    x = runner.forward(runner.prepare_inputs(mb.segments), x)
        seqs = mb.sampled
        x = x[:len(seqs)]              # the sampled rows (scored rows follow them)
        tokens = sampler.sample(x, seqs, mb.expected)
        if keep_logits:                # the rows of emitted tokens (not those of rejected proposals)
            for i, s in enumerate(seqs):
                if tokens[i] >= 0:
                    logits.setdefault(s, []).append(x[i].detach().float().cpu())
        for seq in sched.on_sampled(mb.id, tokens):
            out[seq.request.id] = {"output_ids": seq.output, "finish_reason": seq.finish_reason,
                                   "proposed": seq.proposed, "accepted": seq.accepted}
    if keep_logits:
        for s, rows in logits.items():
            out[ids[s]]["logits"] = torch.stack(rows)
    return out
