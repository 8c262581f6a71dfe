"""SiDP inside a replica (SiDP §4): shared-weight data parallelism among the replicas of one host.

Every replica is a whole-model, one-stage pipeline with its own scheduler, KV cache and sampler;
block b's MLP half has one owner in the group (`hpipe.formats.SidpGroupPlan.owners`). How a
replica runs the MLP halves it does not own is the step's mode, one object:

- WaS (weight as a service): from a cache of `slots` MLP modules sized once before the clock
  starts, which a housekeeper thread fills ahead of the forward in the peak-shifting order
  (`SidpGroupPlan.prefetch_order`), copying from the plan's source. On a CPU host the source is
  the weights' one mapping in the page cache (the host pool); with source `shared-mapping` the
  replica runs the mapped module itself: nothing to fetch.
- CaS (compute as a service): the replica sends the MLP's input rows to the owner, which runs them
  with its own in one GEMM and sends each replica its slice. A replica without rows sends nothing
  and the owner does not wait for it: it knows every replica's rows from the step's all-gather. An
  owner with no rows of its own still serves the others.

Every step begins with one all-gather on the group's own gloo group (apart from each replica's
pipeline): each replica's rows, its batch (running sequences) and whether it has stopped. From the
same numbers every replica takes the same decision (`Switch`, with hysteresis around the plan's
B_th, or `Fixed` under --sidp-mode was|cas), so all of them change mode at the same step, and the
job ends when every replica has stopped. Unlike the paper, whose WaS replicas run independently
until the orchestrator broadcasts a switch, ours meet at every step: one small all-gather (about
0.1 ms on gloo beside a 30 ms CPU step) buys a switch without a coordinator.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hpipe import formats
from hpipe.errors import HpipeError
from hpipe.runtime.pipeline import (Driver, Executors, Sampling, Work, _forward, _join, _prepare, _start_prepare,
                                    _thread, run_summary)

__all__ = ["PATIENCE", "Seat", "Replica", "needs_group", "run_replica"]

PATIENCE = 4            # steps in a row on the other side of the threshold before the switch
BUSY_WAIT_S = 0.05      # a replica with sequences waits this long for its next micro-batch before an empty step
IDLE_WAIT_S = 0.002     # ... and one with none, so that an idle group's all-gathers do not spin


@dataclass(frozen=True)
class Seat:
    """Where a replica sits: its group (from the plan) and its index in the group's replicas."""

    group: formats.SidpGroupPlan
    member: int

    @property
    def size(self) -> int:
        return len(self.group.replicas)

    @property
    def owned(self) -> list[int]:
        return [b for b, o in enumerate(self.group.owners) if o == self.member]


def needs_group(group: formats.SidpGroupPlan, mode: str) -> bool:
    """False when the replicas have nothing to exchange: a shared mapping under WaS (every replica
    runs the mapped weights), and `auto` with a threshold that never switches to CaS."""
    if group.source != "shared-mapping" or len(group.replicas) < 2:
        return len(group.replicas) > 1
    return mode == "cas" or (mode == "auto" and group.threshold > 1)


# ---------------------------------------------------------------------------------- the group's link
@dataclass
class Step:
    """What the all-gather at a step's start says, the same on every replica."""

    rows: list[int]             # each replica's tokens in this step (the MLP's input rows)
    batch: int                  # the largest replica's running sequences
    finished: bool              # every replica has stopped
    mode: object = None         # WasMode or CasMode, decided from the above


class GroupLink:
    """The replicas' own gloo group: a rendezvous on the launcher-chosen port, keys under the
    group's token (a replica of another launch never joins)."""

    def __init__(self, seat: Seat, addr: str, port: int, token: str, timeout_s: float):
        self.rank, self.size = seat.member, seat.size
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, self.size, is_master=self.rank == 0, timeout=timeout,
                              wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"hpipe-sidp/{token}/", store), self.rank, self.size,
                                        timeout)
        self.store = store              # kept alive: replica 0's is the server

    def gather(self, values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.long)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self.wait(self.pg.allgather([out], [mine]))
        return [o.tolist() for o in out]

    def send(self, x: torch.Tensor, to: int, tag: int):
        return self.pg.send([x.contiguous()], to, tag)

    def recv(self, x: torch.Tensor, src: int, tag: int):
        return self.pg.recv([x], src, tag)

    @staticmethod
    def wait(work) -> None:
        """A lost replica ends the others with one line (the launcher names the one that was lost)."""
        try:
            work.wait()
        except RuntimeError as e:
            cause = str(e).split("] ", 1)[-1].split(". ")[0]
            raise HpipeError(f"the SiDP group lost a replica ({cause})") from None


# ---------------------------------------------------------------------------------- WaS's weight cache
def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in sorted(itertools.chain(module.named_parameters(), module.named_buffers()))]


class MappedWeights:
    """Source `shared-mapping`: every replica maps every block's weights; WaS runs them in place."""

    def __init__(self, sources: dict[int, nn.Module]):
        self.sources = sources
        self.stats = {"fetches": 0, "fetch_s": 0.0, "wait_s": 0.0}

    def take(self, block: int) -> nn.Module:
        return self.sources[block]

    def give_back(self, block: int) -> None:
        pass


class FetchedWeights:
    """WaS's cache: `slots` copies of an MLP module, allocated once, which a housekeeper thread fills
    in `order` (cyclically, step after step) from the source modules; `take(b)` waits until block b
    is in a slot, `give_back(b)` frees its slot for the next fetch. The order runs whole cycles of
    the group's size ahead of the forward, which takes a cycle's blocks in its own order: with at
    least a cycle's remote blocks of slots (the plan's validation), the fetch the forward waits for
    always finds a free slot."""

    def __init__(self, sources: dict[int, nn.Module], order: list[int], slots: int, errors: list):
        template = _tensors(sources[order[0]])
        for b in order:
            if [t.shape for t in _tensors(sources[b])] != [t.shape for t in template]:
                raise HpipeError(f"WaS cache slots hold one MLP shape; block {b}'s MLP differs from block "
                                 f"{order[0]}'s: run this model with --sidp-mode cas")
        self.sources, self.order, self.errors = sources, order, errors
        with torch.inference_mode():
            self.slots = [copy.deepcopy(sources[order[0]]) for _ in range(slots)]
        self.cond = threading.Condition()
        self.free = list(range(slots))
        self.held: dict[int, int] = {}           # block -> slot
        self.stats = {"fetches": 0, "fetch_s": 0.0, "wait_s": 0.0}
        _thread(self._housekeeper, "hpipe-was-housekeeper", errors)

    def _housekeeper(self) -> None:
        for block in itertools.cycle(self.order):
            with self.cond:
                while not self.free or block in self.held:
                    self.cond.wait()
                slot = self.free.pop()
            t = time.perf_counter()
            with torch.inference_mode():
                for dst, src in zip(_tensors(self.slots[slot]), _tensors(self.sources[block])):
                    dst.copy_(src)
            with self.cond:
                self.stats["fetches"] += 1
                self.stats["fetch_s"] += time.perf_counter() - t
                self.held[block] = slot
                self.cond.notify_all()

    def take(self, block: int) -> nn.Module:
        t = time.perf_counter()
        with self.cond:
            while block not in self.held:
                if self.errors:
                    raise self.errors[0]
                self.cond.wait(timeout=0.1)
            self.stats["wait_s"] += time.perf_counter() - t
            return self.slots[self.held[block]]

    def give_back(self, block: int) -> None:
        with self.cond:
            self.free.append(self.held.pop(block))
            self.cond.notify_all()


# ---------------------------------------------------------------------------------- the two modes
class WasMode:
    name = "was"

    def __init__(self, cache):
        self.cache = cache

    def owned(self, block: int, module: nn.Module, x: torch.Tensor, step: Step) -> torch.Tensor:
        return module(x)

    def remote(self, block: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        module = self.cache.take(block)
        try:
            return module(x)
        finally:
            self.cache.give_back(block)

    def serve(self, step: Step) -> None:
        """A replica without rows has nothing to do under WaS."""


class CasMode:
    name = "cas"

    def __init__(self, link: GroupLink, seat: Seat, owned: dict[int, nn.Module], hidden: int, dtype):
        self.link, self.seat, self.modules, self.hidden, self.dtype = link, seat, owned, hidden, dtype
        self.stats = {"rows_sent": 0, "rows_served": 0}

    def owned(self, block: int, module: nn.Module, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Everyone's rows of this block in one GEMM: ours first, then each sender's in rank order."""
        senders = [r for r, n in enumerate(step.rows) if n and r != self.link.rank]
        if not senders:
            return module(x)
        rows = [torch.empty(step.rows[r], self.hidden, dtype=x.dtype) for r in senders]
        for w in [self.link.recv(buf, r, block) for buf, r in zip(rows, senders)]:
            self.link.wait(w)
        y = module(torch.cat([x, *rows]))
        sends, at = [], x.shape[0]
        for r, buf in zip(senders, rows):
            sends.append(self.link.send(y[at:at + buf.shape[0]], r, block))
            at += buf.shape[0]
        for w in sends:
            self.link.wait(w)
        self.stats["rows_served"] += at - x.shape[0]
        return y[:x.shape[0]]

    def remote(self, block: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        owner = self.seat.group.owners[block]
        self.link.wait(self.link.send(x, owner, block))
        y = torch.empty_like(x)
        self.link.wait(self.link.recv(y, owner, block))
        self.stats["rows_sent"] += x.shape[0]
        return y

    def serve(self, step: Step) -> None:
        """An owner without rows of its own: its blocks, in the forward's order, for the others."""
        if not any(step.rows):
            return
        empty = torch.empty(0, self.hidden, dtype=self.dtype)
        with torch.inference_mode():
            for block, module in self.modules.items():
                self.owned(block, module, empty, step)


# ---------------------------------------------------------------------------------- the switch
class Fixed:
    """--sidp-mode was|cas: one mode for the whole job."""

    def __init__(self, mode):
        self.mode = mode

    def decide(self, batch: int, busy: bool):
        return self.mode


class Switch:
    """--sidp-mode auto: WaS while the group's largest batch stays at B_th or above; CaS after
    PATIENCE steps with work below it; back to WaS after PATIENCE steps at B_th + margin or above.
    Steps where no replica has work do not count (a job's start is not its tail)."""

    def __init__(self, was, cas, threshold: int):
        self.was, self.cas, self.mode = was, cas, was
        self.low, self.high = threshold, threshold + max(1, threshold // 4)
        self.count = 0

    def decide(self, batch: int, busy: bool):
        if busy:
            leaving = batch < self.low if self.mode is self.was else batch >= self.high
            self.count = self.count + 1 if leaving else 0
            if self.count >= PATIENCE:
                self.mode, self.count = (self.cas if self.mode is self.was else self.was), 0
        return self.mode


# ---------------------------------------------------------------------------------- the MLP halves
class OwnedMLP(nn.Module):
    """A block's MLP this replica owns: the step's mode runs it (CaS fuses the others' rows in)."""

    def __init__(self, block: int, module: nn.Module, replica: Replica):
        super().__init__()
        self.block, self.module, self.replica = block, module, replica

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        return self.replica.mode.owned(self.block, self.module, flat, self.replica.step).view(x.shape)


class RemoteMLP(nn.Module):
    """A block's MLP another replica owns: a cache slot (WaS) or the owner (CaS) runs it."""

    def __init__(self, block: int, replica: Replica):
        super().__init__()
        self.block, self.replica = block, replica

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        return self.replica.mode.remote(self.block, flat, self.replica.step).view(x.shape)


class Replica:
    """One replica's SiDP machinery: the group link, the WaS cache, the CaS mode, the switch, and
    the step trace (the paper's Fig. 15), built once before the clock starts."""

    def __init__(self, seat: Seat, runner, mode: str, addr: str, port: int, token: str, timeout_s: float,
                 errors: list):
        self.seat = seat
        group = seat.group
        mlps = runner.mlp_modules()                      # block -> the mapped MLP module
        self.link = GroupLink(seat, addr, port, token, timeout_s)
        remote = group.prefetch_order(seat.member)
        cache = MappedWeights(mlps) if group.source == "shared-mapping" or not remote else \
            FetchedWeights(mlps, remote, group.slots, errors)
        self.was = WasMode(cache)
        self.cas = CasMode(self.link, seat, {b: mlps[b] for b in seat.owned}, runner.hidden_size, runner.dtype)
        self.switch = {"was": Fixed(self.was), "cas": Fixed(self.cas)}.get(mode) or \
            Switch(self.was, self.cas, group.threshold)
        self.mode, self.step = self.was, None
        runner.replace_mlps({b: OwnedMLP(b, mlps[b], self) if b in seat.owned else RemoteMLP(b, self)
                             for b in mlps})
        self.trace: list[list] = []                     # [t, own batch, group batch, mode] per step with work
        self.steps = {"was": 0, "cas": 0}

    def agree(self, rows: int, batch: int, stopped: bool) -> Step:
        gathered = self.link.gather([rows, batch, int(stopped)])
        step = Step([g[0] for g in gathered], max(g[1] for g in gathered), all(g[2] for g in gathered))
        busy = any(step.rows)
        step.mode = self.mode = self.switch.decide(step.batch, busy)
        self.step = step
        if busy:
            self.steps[step.mode.name] += 1
            self.trace.append([round(time.time(), 4), batch, step.batch, step.mode.name])
        return step

    def report(self) -> dict:
        return {"member": self.seat.member, "owned_blocks": len(self.seat.owned), "source": self.seat.group.source,
                "threshold": self.seat.group.threshold, "steps": self.steps, "was": self.was.cache.stats,
                "cas": self.cas.stats, "trace": self.trace}


# ---------------------------------------------------------------------------------- the loop
def run_replica(ex: Executors, driver: Driver, sampling: Sampling, replica: Replica) -> dict:
    """A replica's compute loop, in step with its group: every step starts with the all-gather; a
    replica with a micro-batch runs it (its MLP halves through the step's mode), one without serves
    (CaS) or waits for the next step; the loop ends when every replica has stopped."""
    errors, sched = ex.errors, driver.sched
    threads = [_thread(driver.commit_loop, "hpipe-scheduler", errors)]
    ready = _start_prepare(ex, driver.committed)
    wall0 = time.time()
    stopped = False
    while True:
        work = None
        if not stopped:
            try:
                work = ready.get(timeout=BUSY_WAIT_S if sched.busy else IDLE_WAIT_S)
                stopped = work is None
            except queue.Empty:
                pass
        if errors:
            raise errors[0]
        rows = work.schedule.n_tokens if isinstance(work, Work) else 0
        step = replica.agree(rows, 0 if stopped else len(sched.active), stopped)
        if step.finished:
            break
        if not rows:
            step.mode.serve(step)
            continue
        if not work.prepared:
            _prepare(ex, work)
        ids = driver.input_ids(work.schedule)
        t = time.time()
        out = _forward(ex, work, torch.tensor(ids, dtype=torch.long))
        work.record(ex.timeline, "compute", t)
        sampling.submit(work.schedule, out)
        driver.versions.give_back()
    _join(threads, errors)
    if errors:
        raise errors[0]
    return run_summary(sched, wall0)
