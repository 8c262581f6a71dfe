"""Sampling of the next token on the CPU, with vLLM's (V1) semantics and SiPipe's design (§5.1).

    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=1)
    sampler = CPUSampler(vocab_size, max_batch=256, max_len=512, replicas=2)
    sampler.add(seq_id, params, prompt_ids, replica=0)
    ids = sampler.step(logits, seq_ids, replica=0)          # logits: float32 [B, V]; ids: LongTensor [B]
    ids, probs = sampler.step(logits, seq_ids, return_probs=True)
    sampler.remove(seq_id)

Semantics, per row, in this order (vLLM V1):
0. logit_bias added to the logits of its token ids (OpenAI's, before anything else);
1. repetition penalty over prompt ∪ output tokens (positive logits divided, non-positive multiplied),
   then frequency (× count) and presence penalties over output tokens only;
2. temperature < 1e-5: greedy, the argmax of the penalized logits (lowest id among equal maxima);
3. otherwise divide by the temperature, then min-p (drop tokens whose probability is below
   min_p × the largest), top-k (ties with the k-th value kept), top-p on the renormalized
   distribution (keep a token iff the mass strictly above it is < top_p; the first is always
   kept), softmax, and the exponential race argmax(p / q), q ~ Exp(1), drawn — over the kept tokens
   in token-id order — from a generator seeded for the token's position in the sequence's output
   (`hpipe.request.position_seed` of its `seed`, or of a random seed drawn when it joins), so that
   a sequence's tokens depend neither on its batch nor on its position in it, and a sequence resumed
   after its first n tokens (`add(..., output_ids)`) draws its next ones as the first run would.

Design (SiPipe §5.1): the penalty state is kept per sequence column and updated in place — counts
of output tokens and seen-in-prompt flags get one scatter per sampled token of a penalized
sequence (nothing is kept for the others), nothing is rebuilt; penalties are applied only at the
ids a sequence has seen (gather, compute, scatter: O(seen) per row, not O(V)); the candidates come
from one top-k over the penalized logits, and the probabilities are computed exactly (float64) on
those candidates only. `replicas` are copies of this state, so that micro-batch n and n + p (p =
pipeline depth) share one while the others are in use. In steady state no [B, V]-sized tensor
is allocated per step: the penalized logits go to a preallocated work buffer, column-wise [V, B]
(SiPipe) or row-wise [B, V]; `bench/sampler.py` measures both and DEFAULT_LAYOUT is the faster
here. Rows that need the whole vocabulary (top_k = 0 with sampling)
take an exact dense path; a tie (or near tie) at the k-th value widens that row's candidates to
every id down to it.
"""

from __future__ import annotations

import bisect
import math
import secrets

import torch

from hpipe.grammar import GrammarMasks, GrammarVocabulary
from hpipe.request import Request, SamplingError, SamplingParams, position_seed

__all__ = ["CPUSampler", "RequestSampler", "SamplingError", "SamplingParams"]

DEFAULT_LAYOUT = "row"   # measured by bench/sampler.py (bench/results/sampler.json)


class _Replica:
    """The state of up to max_batch sequences: one column each."""

    def __init__(self, vocab: int, max_batch: int, max_len: int, layout: str):
        self.layout = layout
        shape = (vocab, max_batch) if layout == "column" else (max_batch, vocab)
        self.counts = torch.zeros(shape, dtype=torch.int32)      # output-token counts
        self.in_prompt = torch.zeros(shape, dtype=torch.bool)
        self.work = torch.empty(shape, dtype=torch.float32)      # penalized logits of a step
        self.lengths = [0] * max_batch
        self.seen: list[list[int]] = [[] for _ in range(max_batch)]   # prompt ∪ output ids, unique
        self.seen_t: list[torch.Tensor | None] = [None] * max_batch
        self.params: list[SamplingParams | None] = [None] * max_batch
        self.seeds: list[int | None] = [None] * max_batch                # each sequence's seed
        self.generator = torch.Generator(device="cpu")                   # seeded per draw (position_seed)
        self.free = list(range(max_batch - 1, -1, -1))

    def at(self, ids: torch.Tensor, cols: torch.Tensor):
        """Index of (token id, column) pairs in this replica's [V, B] or [B, V] buffers."""
        return (ids, cols) if self.layout == "column" else (cols, ids)


class CPUSampler:
    def __init__(self, vocab_size: int, max_batch: int, max_len: int, replicas: int = 1, layout: str | None = None):
        if vocab_size < 1 or max_batch < 1 or max_len < 1 or replicas < 1:
            raise SamplingError("vocab_size, max_batch, max_len and replicas must all be >= 1")
        layout = layout or DEFAULT_LAYOUT
        if layout not in ("column", "row"):
            raise SamplingError(f"layout {layout!r}: use 'column' or 'row'")
        self.vocab_size, self.max_batch, self.max_len, self.layout = vocab_size, max_batch, max_len, layout
        self.replicas = [_Replica(vocab_size, max_batch, max_len, layout) for _ in range(replicas)]
        self.where: dict = {}   # seq_id -> (replica, column)

    # -- sequences ----------------------------------------------------------------------------

    def add(self, seq_id, params: SamplingParams, prompt_ids, replica: int = 0, output_ids=()) -> None:
        """A sequence joins with its prompt and, resumed, the tokens it generated already (its
        penalties count them as output, and its next draw is that of position len(output_ids))."""
        if seq_id in self.where:
            raise SamplingError(f"sequence {seq_id!r} was already added")
        if not 0 <= replica < len(self.replicas):
            raise SamplingError(f"replica {replica} does not exist (replicas: {len(self.replicas)})")
        if not isinstance(params, SamplingParams):
            raise SamplingError("params must be a SamplingParams")
        st = self.replicas[replica]
        if not st.free:
            raise SamplingError(f"replica {replica} already holds max_batch={self.max_batch} sequences")
        prompt = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise SamplingError(f"sequence {seq_id!r}: a prompt id is outside the vocabulary (size {self.vocab_size})")
        output = [int(t) for t in output_ids]
        if any(not 0 <= t < self.vocab_size for t in output) or len(output) >= self.max_len:
            raise SamplingError(f"sequence {seq_id!r}: its output ids must be in the vocabulary and fewer than "
                                f"max_len={self.max_len}")
        col = st.free.pop()
        st.seen_t[col] = None
        st.lengths[col] = len(output)
        if params.penalized:        # the penalty state: only a penalized sequence's is ever read
            unique = sorted(set(prompt))
            if unique:
                st.in_prompt[st.at(torch.tensor(unique), torch.full((len(unique),), col))] = True
            st.seen[col] = sorted(set(unique) | set(output))
            if output:
                ids = torch.tensor(output, dtype=torch.long)
                st.counts.index_put_(st.at(ids, torch.full((len(output),), col)),
                                     torch.ones(len(output), dtype=torch.int32), accumulate=True)
        st.params[col] = params
        st.seeds[col] = secrets.randbits(63) if params.seed is None else params.seed
        self.where[seq_id] = (replica, col)

    def remove(self, seq_id) -> None:
        if seq_id not in self.where:
            raise SamplingError(f"sequence {seq_id!r} is not in the sampler")
        replica, col = self.where.pop(seq_id)
        st = self.replicas[replica]
        ids = torch.tensor(st.seen[col], dtype=torch.long)
        if len(ids):   # clear only what this sequence touched: O(seen), not O(V)
            at = st.at(ids, torch.full((len(ids),), col))
            st.counts[at] = 0
            st.in_prompt[at] = False
        st.seen[col], st.seen_t[col], st.params[col], st.seeds[col] = [], None, None, None
        st.lengths[col] = 0
        st.free.append(col)

    # -- one step -----------------------------------------------------------------------------

    def step(self, logits: torch.Tensor, seq_ids, replica: int = 0, return_probs: bool = False):
        st = self.replicas[replica]
        seq_ids = list(seq_ids)
        b = len(seq_ids)
        if logits.dim() != 2 or logits.shape[0] != b or logits.shape[1] != self.vocab_size:
            raise SamplingError(f"logits must be [{b}, {self.vocab_size}], got {list(logits.shape)}")
        cols_l = []
        for s in seq_ids:
            where = self.where.get(s)
            if where is None or where[0] != replica:
                raise SamplingError(f"sequence {s!r} is not in replica {replica}")
            cols_l.append(where[1])
        if len(set(cols_l)) != b:
            raise SamplingError("a sequence appears twice in one step")
        if b == 0:
            empty = torch.empty(0, dtype=torch.long)
            return (empty, torch.empty((0, self.vocab_size), dtype=torch.float64)) if return_probs else empty
        logits = logits.detach().to("cpu", torch.float32)
        params = [st.params[c] for c in cols_l]
        biased = self._biased(logits, params) if any(p.biased for p in params) else logits
        for c in cols_l:
            if st.lengths[c] >= self.max_len:
                raise SamplingError(f"a sequence reached max_len={self.max_len} sampled tokens")

        pen_rows = [i for i, p in enumerate(params) if p.penalized]
        if all(p.greedy and not p.penalized and not p.biased for p in params):
            out_ids, probs_out = self._argmax(logits, return_probs)
        else:
            out_ids, probs_out = self._candidates(st, logits, biased, cols_l, params, pen_rows, return_probs)

        # 3. the new ids join the penalized sequences' penalty state (one scatter); the others
        # only count their length (the max_len check, the generator's position)
        for c in cols_l:
            st.lengths[c] += 1
        if pen_rows:
            new = out_ids[torch.tensor(pen_rows, dtype=torch.long)]
            st.counts.index_put_(st.at(new, torch.tensor([cols_l[i] for i in pen_rows], dtype=torch.long)),
                                 torch.ones(len(pen_rows), dtype=torch.int32), accumulate=True)
            for i, t in zip(pen_rows, new.tolist()):
                seen = st.seen[cols_l[i]]
                if t not in seen:     # sorted list: binary insert keeps it unique
                    bisect.insort(seen, t)
                    st.seen_t[cols_l[i]] = None
        return (out_ids, probs_out) if return_probs else out_ids

    def _argmax(self, logits: torch.Tensor, return_probs: bool):
        """Greedy rows without penalties or biases (a chat's default): the first maximum of each row, read
        straight off the logits (one pass, where the candidates' top-k and float64 choice took
        3x as long after a forward, with the vocabulary's logits out of cache)."""
        out_ids = torch.argmax(logits, dim=1)
        probs_out = None
        if return_probs:
            probs_out = torch.zeros((logits.shape[0], self.vocab_size), dtype=torch.float64)
            probs_out[torch.arange(logits.shape[0]), out_ids] = 1.0
        return out_ids, probs_out

    def _candidates(self, st: _Replica, logits: torch.Tensor, biased: torch.Tensor, cols_l: list[int], params,
                    pen_rows: list[int], return_probs: bool):
        """Steps 0-2 of the semantics for any rows: the candidates from one top-k over the biased and
        penalized logits (float32), then each row's choice among them, its values recomputed from
        the logits in float64 (biases and penalties)."""
        b = len(cols_l)
        cols = torch.tensor(cols_l, dtype=torch.long)
        # 1. penalized logits, for choosing the candidates (float32, in the work buffer)
        seen_idx = self._seen_matrix(st, cols_l, pen_rows) if pen_rows else None
        if self.layout == "column":
            work = st.work[:, :b]
            work.copy_(biased.t())
            vocab_dim = 0
        else:
            work = st.work[:b] if pen_rows else biased
            if pen_rows:
                work.copy_(biased)
            vocab_dim = 1
        if pen_rows:
            self._penalize_in_place(st, work, seen_idx, cols, params, pen_rows)

        # 2. candidates: one top-k over the vocabulary (one more than needed, to see ties at k)
        ks = [p.top_k for p in params if not p.greedy and p.top_k > 0]
        k_sel = min(self.vocab_size, max([2] + [k + 1 for k in ks]))
        top_vals, top_ids = torch.topk(work, k_sel, dim=vocab_dim)
        if vocab_dim == 0:
            top_vals, top_ids = top_vals.t(), top_ids.t()
        # rows whose k-th and (k+1)-th values tie (bf16 logits tie often), or nearly (float32 arithmetic
        # may differ from the exact float64 values by an ulp), take every id down to the k-th value
        fast, dense, wide = [], [], []
        for i, p in enumerate(params):
            k = 1 if p.greedy else p.top_k
            if k == 0 or k >= self.vocab_size:
                dense.append(i)             # sampling over the whole vocabulary
                continue
            kth, nxt = float(top_vals[i, k - 1]), float(top_vals[i, k])
            floor = kth - 1e-5 * max(1.0, abs(kth))
            if nxt >= floor:
                wide.append((i, floor))
            else:
                fast.append(i)

        out_ids = torch.empty(b, dtype=torch.long)
        probs_out = torch.zeros((b, self.vocab_size), dtype=torch.float64) if return_probs else None
        groups = [(fast, top_ids[fast] if fast else None)] if fast else []
        for i, floor in wide:
            row = work[:, i] if vocab_dim == 0 else work[i]
            groups.append(([i], torch.nonzero(row >= floor).flatten()[None, :]))
        if dense:
            groups.append((dense, torch.arange(self.vocab_size).expand(len(dense), -1)))
        for rows, ids in groups:
            vals = self._exact_penalized(st, logits, rows, ids, cols, params)
            self._choose(st, rows, ids, vals, cols_l, params, out_ids, probs_out)
        return out_ids, probs_out

    # -- helpers ------------------------------------------------------------------------------

    def _biased(self, logits: torch.Tensor, params) -> torch.Tensor:
        """A copy of the logits with each row's logit_bias added (rows without one unchanged)."""
        out = logits.clone()
        for i, p in enumerate(params):
            if p.biased:
                ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
                if int(ids.max()) >= self.vocab_size:
                    raise SamplingError(f"logit_bias: token id {int(ids.max())} is outside the vocabulary "
                                        f"(size {self.vocab_size})", "logit_bias")
                out[i, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=out.dtype)
        return out

    @staticmethod
    def _seen_matrix(st: _Replica, cols_l: list[int], rows: list[int]) -> torch.Tensor:
        """[L, B] ids each row has seen (prompt ∪ output), padded by repeating its first id (or 0):
        a repeated index writes the same value twice, so padding changes nothing."""
        width = max([len(st.seen[cols_l[i]]) for i in rows] + [1])
        out = torch.zeros((width, len(cols_l)), dtype=torch.long)
        for i in rows:
            c = cols_l[i]
            if st.seen_t[c] is None:
                st.seen_t[c] = torch.tensor(st.seen[c], dtype=torch.long)
            t = st.seen_t[c]
            if len(t):
                out[:len(t), i] = t
                out[len(t):, i] = t[0]
        return out

    @staticmethod
    def _penalty_params(params, rows, dtype):
        rep = torch.tensor([params[i].repetition_penalty for i in rows], dtype=dtype)
        freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=dtype)
        pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=dtype)
        return rep, freq, pres

    @staticmethod
    def _apply(vals, count, in_prompt, rep, freq, pres):
        """vLLM's penalties on gathered values [R, K] with per-row parameters [R]."""
        out_seen = count > 0
        rep = rep[:, None]
        penalized = torch.where(vals > 0, vals / rep, vals * rep)
        vals = torch.where(in_prompt | out_seen, penalized, vals)
        return vals - freq[:, None] * count.to(vals.dtype) - pres[:, None] * out_seen.to(vals.dtype)

    def _penalize_in_place(self, st: _Replica, work, seen_idx, cols, params, rows) -> None:
        r = torch.tensor(rows, dtype=torch.long)
        ids = seen_idx[:, r].t()                                  # [R, L]
        c = cols[r][:, None].expand_as(ids)
        count, in_prompt = st.counts[st.at(ids, c)], st.in_prompt[st.at(ids, c)]
        rep, freq, pres = self._penalty_params(params, rows, torch.float32)
        if self.layout == "column":
            vals = work[ids, r[:, None].expand_as(ids)]
            work[ids, r[:, None].expand_as(ids)] = self._apply(vals, count, in_prompt, rep, freq, pres)
        else:
            vals = work[r[:, None].expand_as(ids), ids]
            work[r[:, None].expand_as(ids), ids] = self._apply(vals, count, in_prompt, rep, freq, pres)

    def _exact_penalized(self, st: _Replica, logits, rows, ids, cols, params) -> torch.Tensor:
        """float64 biased and penalized logits of the candidates `ids` [R, K], from the original logits
        (a bias of 100 added in float32 would move a probability by ~1e-6)."""
        r = torch.tensor(rows, dtype=torch.long)
        vals = logits[r[:, None].expand_as(ids), ids].double()
        for j, i in enumerate(rows):
            for t, bias in params[i].logit_bias:
                vals[j][ids[j] == t] += bias
        if any(params[i].penalized for i in rows):
            c = cols[r][:, None].expand_as(ids)
            count, in_prompt = st.counts[st.at(ids, c)], st.in_prompt[st.at(ids, c)]
            rep, freq, pres = self._penalty_params(params, rows, torch.float64)
            vals = self._apply(vals, count, in_prompt, rep, freq, pres)
        return vals

    def _choose(self, st, rows, ids, vals, cols_l, params, out_ids, probs_out) -> None:
        """Greedy rows take the argmax; the others go through min-p, top-k, top-p and the race."""
        n = ids.shape[1]
        greedy = torch.tensor([params[i].greedy for i in rows])
        temp = torch.tensor([params[i].temperature if not params[i].greedy else 1.0 for i in rows],
                            dtype=torch.float64)
        z = vals / temp[:, None]
        zmax = z.max(dim=1, keepdim=True).values
        rel = torch.exp(z - zmax)                                   # p / p_max
        min_p = torch.tensor([params[i].min_p for i in rows], dtype=torch.float64)
        keep = rel >= min_p[:, None]
        top_k = torch.tensor([params[i].top_k for i in rows])
        if bool((top_k > 0).any()):
            # the k-th largest value among the min-p survivors; ties with it are kept
            masked = torch.where(keep, z, torch.tensor(-math.inf, dtype=torch.float64))
            k_eff = torch.clamp(torch.minimum(top_k, keep.sum(dim=1)), min=1)
            kth = torch.sort(masked, dim=1, descending=True).values.gather(1, (k_eff - 1)[:, None])
            keep &= torch.where((top_k > 0)[:, None], z >= kth, torch.ones_like(keep))
        p = torch.where(keep, rel, torch.zeros((), dtype=torch.float64))
        p = p / p.sum(dim=1, keepdim=True)
        top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float64)
        need_p = top_p < 1
        if bool(need_p.any()):
            sub = need_p.nonzero().flatten()
            ps, order = torch.sort(p[sub], dim=1, descending=True)
            cum_before = torch.cumsum(ps, dim=1) - ps
            # mass strictly above: the cumulative mass before the first of a group of equal values
            pos = torch.arange(n).expand_as(ps)
            starts = torch.ones_like(ps, dtype=torch.bool)
            starts[:, 1:] = ps[:, 1:] != ps[:, :-1]
            first = torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), dim=1).values
            above = cum_before.gather(1, first)
            keep_sorted = (above < top_p[sub][:, None]) & (ps > 0)
            keep_sorted[:, 0] = True
            kept = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
            p_sub = torch.where(kept, p[sub], torch.zeros((), dtype=torch.float64))
            p[sub] = p_sub / p_sub.sum(dim=1, keepdim=True)
        for j, i in enumerate(rows):
            row_ids = ids[j]
            if bool(greedy[j]):
                best = vals[j].max()
                choice = int(row_ids[vals[j] == best].min())
                out_ids[i] = choice
                if probs_out is not None:
                    probs_out[i, choice] = 1.0
                continue
            nz = p[j] > 0
            kept_ids, kept_p = row_ids[nz], p[j][nz]
            order = torch.argsort(kept_ids)
            kept_ids, kept_p = kept_ids[order], kept_p[order]
            c = cols_l[i]
            st.generator.manual_seed(position_seed(st.seeds[c], st.lengths[c]))
            q = torch.empty(len(kept_ids), dtype=torch.float64).exponential_(generator=st.generator)
            out_ids[i] = kept_ids[torch.argmax(kept_p / q)]
            if probs_out is not None:
                probs_out[i, kept_ids] = kept_p


class RequestSampler:
    """The pipeline's sampling (the last stage, or a sampler process of the pool): every request
    samples with its own resolved parameters (`Request.params`, its seed included). Requests come
    and go with the schedules (`admit` before the first row of it, `release` once stage 0 has
    decided it ended and no row of it can come any more: hpipe.runtime.schedule), so the sampler
    never decides an end and holds only the requests running. A row of a sequence that already
    ended but is not yet released (a decode step committed before its stop was known) is sampled
    like any other; stage 0 drops its id."""

    def __init__(self, vocab_size: int, max_batch: int, max_len: int, layout: str | None = None,
                 grammars: GrammarVocabulary | None = None):
        """max_batch: sequences holding sampler state at once; max_len: the most tokens one may
        generate; grammars: the model's vocabulary for requests with a grammar (structured output)."""
        self.requests: dict[int, Request] = {}    # index -> Request, admitted and not yet released
        self.cpu = CPUSampler(vocab_size, max_batch, max_len, layout=layout)
        self.started: set[int] = set()            # those with state in `cpu` (from their first row)
        self.grammars = grammars
        self.masks: GrammarMasks | None = None    # from the first request with a grammar

    def admit(self, request: Request) -> None:
        self.requests[request.index] = request

    def release(self, index: int) -> None:
        """Its state goes now."""
        if index in self.started:
            self.cpu.remove(index)
            self.started.discard(index)
        if self.masks is not None:
            self.masks.drop(index)
        self.requests.pop(index, None)

    def knows(self, index: int) -> bool:
        return index in self.requests

    def sample(self, logits: torch.Tensor, seqs: list[int], expected: list[int] | None = None) -> list[int]:
        """One id per row. `expected` (speculative decoding): per row, the proposed token that
        must be sampled for the sequence's next row (its next position) to be sampled too, or -1;
        a sequence's rows are consecutive. Rows are sampled position by position, each with the
        state (penalties, grammar, generator) as of its position, and a row not reached (a
        proposal before it was rejected, or its sequence sampled an end id) gets -1: every id
        returned is a token the sequence emits, drawn exactly as decoding without proposals draws it."""
        self._start(seqs)
        if expected is None or all(e < 0 for e in expected):
            return self._step(logits, seqs)
        out = [-1] * len(seqs)
        rows = [r for r in range(len(seqs)) if r == 0 or seqs[r] != seqs[r - 1] or expected[r - 1] < 0]
        while rows:                              # the first row of each sequence, then the next of those that go on
            ids = self._step(logits[rows], [seqs[r] for r in rows])
            going = []
            for r, token in zip(rows, ids):
                out[r] = token
                if token == expected[r] and token not in self.requests[seqs[r]].ends:
                    going.append(r + 1)
            rows = going
        return out

    def _start(self, seqs: list[int]) -> None:
        """Sampler state for the sequences met for the first time (from their first row)."""
        for s in seqs:
            if s not in self.started:
                r = self.requests[s]
                self.cpu.add(s, r.params, r.input_ids, output_ids=r.output_ids)
                self.started.add(s)
                if r.params.grammar is not None:
                    self._start_grammar(s, r.params.grammar)
                    for token in r.output_ids:          # resumed: its grammar where its output left it
                        self.masks.advance([s], [token])

    def _step(self, logits: torch.Tensor, seqs: list[int]) -> list[int]:
        if self.masks is None:
            return self.cpu.step(logits, seqs).tolist()
        ids = self.cpu.step(self.masks.apply(logits, seqs), seqs).tolist()
        self.masks.advance(seqs, ids)            # the next masks, before the next rows' logits
        return ids

    def _start_grammar(self, index: int, grammar: str) -> None:
        if self.grammars is None:
            raise SamplingError("a request has a grammar, but this sampler was given no vocabulary for grammars")
        if self.masks is None:
            self.masks = GrammarMasks(self.grammars)
        self.masks.start(index, grammar)
