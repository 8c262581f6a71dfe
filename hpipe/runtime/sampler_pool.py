"""Sampling off the pipeline's critical path (SiPipe §4, §6): the last stage hands each
micro-batch's logits to a pool of sampler processes through a shared-memory ring buffer and starts
its next micro-batch at once; a collector thread sends the sampled ids back to stage 0 in order.

Ring: N cells, each holding up to `max_rows` rows of logits, their sequence ids and the sampled
ids. A cell has a lock; the writer (the last stage) always holds the lock of the cell it will
write next and takes the following cell's lock before releasing the one it has just filled
(lock-ahead), so a sampler waiting for micro-batch m blocks on cell m's lock until m is written.
A cell is rewritten only after the collector has taken its ids (at most N micro-batches wait).
Every sampler process reads every cell and samples the rows of the sequences it owns
(seq % processes == its index), each with its own hpipe.sampling.RequestSampler, so a
sequence's penalty state and generator live in exactly one process. Requests join and leave with
the schedules: `admit` and `release` go to the owning process's queue before the micro-batch of
the schedule that carries them is submitted, and a process that meets a row of a sequence it has
not been told of waits for its admission.
"""

from __future__ import annotations

import collections
import os
import queue
import sys
import threading
import time

import torch

from hpipe.lifeline import tie_to_parent
from hpipe.grammar import GrammarVocabulary
from hpipe.sampling import RequestSampler

_POLL_S = 0.0002


def _take_events(sampler: RequestSampler, events, held: collections.deque, upto: int, block_for: set | None,
                 stop) -> None:
    """Applies, in order, the admissions and releases queued for this process that precede
    micro-batch `upto` (each is tagged with the micro-batch it precedes: a release must not be
    applied before an earlier micro-batch's leftover row of its sequence is sampled); with
    block_for, waits until every sequence in it is known."""
    while True:
        try:
            while True:
                held.append(events.get_nowait())
        except queue.Empty:
            pass
        while held and held[0][0] <= upto:
            _, kind, what = held.popleft()
            if kind == "admit":
                sampler.admit(what)
                if block_for is not None:
                    block_for.discard(what.index)
            else:
                sampler.release(what)
        if not block_for or stop.is_set():
            return
        try:
            held.append(events.get(timeout=0.1))
        except queue.Empty:
            continue


def _sampler_main(index: int, n_procs: int, shared: dict, locks, done_sems, stop, config: dict, events) -> None:
    tie_to_parent("sampler process", config["parent"])
    torch.set_num_threads(config["threads"])
    logits, seqs, expected, out, meta, done = (shared[k] for k in ("logits", "seqs", "expected", "out", "meta", "done"))
    n_cells = logits.shape[0]
    grammars = GrammarVocabulary(config["model_dir"], logits.shape[2]) if config["model_dir"] else None
    sampler = RequestSampler(logits.shape[2], config["max_batch"], config["max_len"], grammars=grammars)
    held: collections.deque = collections.deque()
    m = 0
    while not stop.is_set():
        k = m % n_cells
        if not locks[k].acquire(timeout=0.1):
            continue
        seq_no, n = int(meta[k, 0]), int(meta[k, 1])
        locks[k].release()
        if seq_no != m:          # the cell still holds an older micro-batch: not written yet
            time.sleep(_POLL_S)
            continue
        row_seqs = seqs[k, :n].tolist()
        rows = [r for r, s in enumerate(row_seqs) if s % n_procs == index]
        _take_events(sampler, events, held, m, None, stop)
        unknown = {row_seqs[r] for r in rows if not sampler.knows(row_seqs[r])}
        if unknown:          # its admission was queued before this micro-batch: it is on its way
            _take_events(sampler, events, held, m, unknown, stop)
        ids = sampler.sample(logits[k, rows], [row_seqs[r] for r in rows], expected[k, rows].tolist()) if rows else []
        if rows:
            out[k, rows] = torch.tensor(ids, dtype=torch.long)
        done[k, index] = m
        done_sems[k].release()   # a semaphore release orders the writes above before the collector's reads
        m += 1


def _quiet_resource_tracker() -> None:
    """The pool's locks, semaphores, event and queues are named POSIX semaphores that
    multiprocessing's resource tracker (a process of its own, started with the first of them)
    removes when the stage ends without removing them itself: killed, which is how a launcher stops
    a stage (SIGTERM: a Python handler would wait for a receive blocked in gloo to return, and a
    stage cut off from a lost host's link waited out the launcher's grace), or by a lost host. The
    tracker then warned "There appear to be 16 leaked semaphore objects" into the stage's log. It
    removes them all the same, silently: it takes this process's -W options, and the first pool
    starts it."""
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet not in sys.warnoptions:
        sys.warnoptions.append(quiet)


class SamplerPool:
    def __init__(self, vocab_size: int, max_rows: int, max_batch: int, max_len: int, send, n_procs: int = 1,
                 n_cells: int = 4, threads: int = 1, errors: list | None = None, model_dir: str | None = None):
        """send(mb_id, ids) is called by the collector thread for every micro-batch, in order; a
        failure is also appended to `errors` (the stage's executors stop on it)."""
        _quiet_resource_tracker()
        ctx = torch.multiprocessing.get_context("spawn")
        self.n_cells, self.n_procs, self.max_rows = n_cells, n_procs, max_rows
        self.shared = {
            "logits": torch.empty(n_cells, max_rows, vocab_size, dtype=torch.float32).share_memory_(),
            "seqs": torch.zeros(n_cells, max_rows, dtype=torch.long).share_memory_(),
            "expected": torch.full((n_cells, max_rows), -1, dtype=torch.long).share_memory_(),   # speculation
            "out": torch.zeros(n_cells, max_rows, dtype=torch.long).share_memory_(),
            "meta": torch.full((n_cells, 3), -1, dtype=torch.long).share_memory_(),   # seq no, rows, mb id
            "done": torch.full((n_cells, n_procs), -1, dtype=torch.long).share_memory_(),
        }
        self.locks = [ctx.Lock() for _ in range(n_cells)]
        self.done_sems = [ctx.Semaphore(0) for _ in range(n_cells)]   # one release per process per micro-batch
        self.stop_event = ctx.Event()
        config = {"threads": threads, "max_batch": max_batch, "parent": os.getpid(), "max_len": max_len,
                  "model_dir": model_dir}       # the tokenizer of requests with a grammar
        self.events = [ctx.Queue() for _ in range(n_procs)]      # admissions and releases, per owner
        self.procs = [ctx.Process(target=_sampler_main, args=(i, n_procs, self.shared, self.locks, self.done_sems,
                                                               self.stop_event, config, self.events[i]), daemon=True,
                                  name=f"hpipe-sampler-{i}") for i in range(n_procs)]
        for p in self.procs:
            p.start()
        self.locks[0].acquire()          # the writer holds the cell it writes next
        self.written = 0                 # micro-batches handed to the pool
        self.collected = 0               # micro-batches whose ids went back
        self.error: BaseException | None = None
        self.errors = errors if errors is not None else []
        self.send = send
        self.cond = threading.Condition()
        self.collector = threading.Thread(target=self._collect, name="hpipe-sampler-collector", daemon=True)
        self.collector.start()

    def admit(self, request) -> None:
        """A request that joins, before the first micro-batch that samples it is submitted."""
        self.events[request.index % self.n_procs].put((self.written, "admit", request))

    def release(self, index: int) -> None:
        """A request whose state goes, from the next micro-batch submitted on."""
        self.events[index % self.n_procs].put((self.written, "release", index))

    def submit(self, mb_id: int, logits: torch.Tensor, seqs: list[int], expected: list[int]) -> None:
        """Writes one micro-batch's sampling rows (and each row's proposed token to verify, or -1)
        into the ring and returns (the last stage goes on)."""
        n = len(seqs)
        if n > self.max_rows:
            raise ValueError(f"{n} rows to sample, the ring holds {self.max_rows}")
        m = self.written
        k = m % self.n_cells
        sh = self.shared
        if n:
            sh["logits"][k, :n].copy_(logits.detach())     # device and dtype in one copy
            sh["seqs"][k, :n] = torch.tensor(seqs, dtype=torch.long)
            sh["expected"][k, :n] = torch.tensor(expected, dtype=torch.long)
        sh["meta"][k] = torch.tensor([m, n, mb_id])
        # lock ahead: the next cell must be free (its ids collected), then it is ours before k is released
        nxt = (m + 1) % self.n_cells
        self._wait(lambda: self.collected >= m + 1 - self.n_cells + 1 or m + 1 < self.n_cells)
        self.locks[nxt].acquire()
        self.locks[k].release()
        with self.cond:
            self.written = m + 1
            self.cond.notify_all()

    def _wait(self, ready) -> None:
        while not ready():
            self._check()
            with self.cond:
                self.cond.wait(timeout=0.01)

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"sampler pool failed: {self.error}")
        for p in self.procs:
            if p.exitcode is not None:
                raise RuntimeError(f"sampler process {p.name} exited with code {p.exitcode}")

    def _collect(self) -> None:
        sh = self.shared
        try:
            m = 0
            while True:
                with self.cond:
                    while self.written <= m:
                        if self.stop_event.is_set():
                            return
                        self.cond.wait(timeout=0.05)
                k = m % self.n_cells
                waiting = self.n_procs
                while waiting:                     # every process signals once per micro-batch
                    if self.done_sems[k].acquire(timeout=0.5):
                        waiting -= 1
                    elif any(p.exitcode is not None for p in self.procs):
                        raise RuntimeError("a sampler process died")
                if not bool((sh["done"][k] == m).all()):
                    raise RuntimeError(f"sampler ring out of step at micro-batch {m}")
                n, mb_id = int(sh["meta"][k, 1]), int(sh["meta"][k, 2])
                ids = sh["out"][k, :n].tolist()
                self.send(mb_id, ids)
                m += 1
                with self.cond:
                    self.collected = m
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to the stage's loop by _check
            self.error = e
            self.errors.append(RuntimeError(f"sampler pool failed: {e}"))

    def drain(self) -> None:
        """Waits until every submitted micro-batch's ids have been sent."""
        self._wait(lambda: self.collected >= self.written)

    def close(self) -> None:
        self.stop_event.set()
        with self.cond:
            self.cond.notify_all()
        for p in self.procs:
            p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
