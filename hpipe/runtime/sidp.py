"""SiDP inside a replica (SiDP §4): shared-weight data parallelism among the replicas of one host.

Every replica is a whole-model, one-stage pipeline with its own scheduler, KV cache and sampler;
block b's MLP half has one owner in the group (`hpipe.formats.SidpGroupPlan.owners`). How a
replica runs the MLP halves it does not own is the step's mode, one object:

- WaS (weight as a service): from a cache of `slots` MLP modules sized once before the clock
  starts, which a housekeeper thread fills ahead of the forward in the peak-shifting order
  (`SidpGroupPlan.prefetch_order`), copying from the plan's source (`hpipe.runtime.was_sources`).
  On a CPU host the source is the weights' one mapping in the page cache (the host pool); with
  source `shared-mapping` the replica runs the mapped module itself: nothing to fetch. A GPU
  replica copies on a stream of its own, from one pinned host copy shared by the group
  (`host-pool`) or from the owner's device memory through CUDA IPC (`peer`), and holds on its
  device only the MLPs it owns and its slots.
- CaS (compute as a service): the replica sends the MLP's input rows to the owner, which runs them
  with its own in one GEMM and sends each replica its slice. A replica without rows sends nothing
  and the owner does not wait for it: it knows every replica's rows from the step's all-gather. An
  owner with no rows of its own still serves the others.

How the replicas keep in step is one object, chosen at start (`--sidp-mode`):
- `was`: `Alone`. Every replica runs as plain DP does, its own steps at its own pace (the paper's
  "full DP independence" of the WaS bulk); the replicas never meet.
- `cas`: `InStep`. Every step begins with one all-gather on the group's own gloo group (apart from
  each replica's pipeline): each replica's rows, its batch (running sequences) and whether it has
  stopped; the owner of a block then knows whose rows to wait for, and the job ends when every
  replica has stopped.
- `auto`: `Epochs`, the paper's orchestrator. In WaS every replica runs alone and publishes its
  batch in the group's store; replica 0 watches the largest and, once it has stayed below the
  plan's B_th (`Switch`: PATIENCE steps, with hysteresis), advances the store's epoch. Every
  replica looks at the epoch between its steps and, on a new one, joins the others in step (the
  first all-gather is the meeting point); in step, all of them take the decision back to WaS from
  the same numbers at the same step, and part again. A replica that has stopped keeps looking
  until all have (an owner may still have to serve).
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
from torch.distributed.distributed_c10d import AllgatherOptions

from hpipe import formats
from hpipe.errors import HpipeError
from hpipe.runtime import was_sources
from hpipe.runtime.comm import RUN_TIMEOUT
from hpipe.runtime.pipeline import (Driver, Executors, Sampling, Work, _forward, _join, _prepare, _start_prepare,
                                    _thread, run_summary)
from hpipe.runtime.was_sources import module_tensors

__all__ = ["PATIENCE", "Seat", "Replica", "needs_group", "run_replica", "runs_plain"]

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
    """Whether the replicas ever meet: only CaS needs it (forced, or `auto` with a threshold that
    can be crossed); WaS fills each replica's slots on its own."""
    return len(group.replicas) > 1 and (mode == "cas" or (mode == "auto" and group.threshold > 1))


def runs_plain(group: formats.SidpGroupPlan, mode: str) -> bool:
    """A shared mapping that never switches to CaS: each replica is a plain one-stage pipeline."""
    return group.source == "shared-mapping" and not needs_group(group, mode)


# ---------------------------------------------------------------------------------- the group's link
@dataclass
class Step:
    """One step as the group sees it (in step: the all-gather's numbers, the same on every
    replica; alone: this replica's own)."""

    rows: list[int]             # each replica's tokens in this step (the MLP's input rows)
    batch: int                  # the largest replica's running sequences
    finished: bool = False      # every replica has stopped
    mode: object = None         # WasMode or CasMode


class GroupLink:
    """The replicas' own gloo group and store: a rendezvous on the launcher-chosen port, keys under
    the group's token (a replica of another launch never joins). The store also carries what the
    replicas tell each other between meetings (batches, the epoch, the stops).

    The rendezvous is bounded by timeout_s; a meeting is not (`comm.RUN_TIMEOUT`, as the pipeline's
    groups): a replica waits for one whose step runs long (a long prefill, a host busy elsewhere),
    where the group's deadline had been the rendezvous timeout and both replicas fell. A lost
    replica still closes its connections at once."""

    def __init__(self, seat: Seat, addr: str, port: int, token: str, timeout_s: float):
        self.rank, self.size = seat.member, seat.size
        timeout = datetime.timedelta(seconds=timeout_s)
        self.tcp = dist.TCPStore(addr, port, self.size, is_master=self.rank == 0, timeout=timeout,
                                 wait_for_workers=False)           # kept alive: replica 0's is the server
        self.store = dist.PrefixStore(f"hpipe-sidp/{token}/", self.tcp)
        self.store.set(f"batch/{self.rank}", "0")        # before the rendezvous: every key exists after it
        self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.size, timeout)
        self.published = 0
        # the meetings' own deadline: a collective takes it in its options, a send or receive in its wait
        self.gather_options = AllgatherOptions()
        self.gather_options.timeout = RUN_TIMEOUT

    def gather(self, values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.long)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self.wait(self.pg.allgather([out], [mine], self.gather_options))
        return [o.tolist() for o in out]

    def send(self, x: torch.Tensor, to: int, tag: int):
        return self.pg.send([x.contiguous()], to, tag)

    def recv(self, x: torch.Tensor, src: int, tag: int):
        return self.pg.recv([x], src, tag)

    @staticmethod
    def wait(work) -> None:
        """A lost replica ends the others with one line (the launcher names the one that was lost)."""
        try:
            work.wait(RUN_TIMEOUT)
        except RuntimeError as e:
            raise HpipeError(f"the SiDP group lost a replica ({_cause(e)})") from None

    # the store, between meetings
    def publish(self, batch: int) -> None:
        if batch != self.published:
            self._store(self.store.set, f"batch/{self.rank}", str(batch))
            self.published = batch

    def largest_batch(self) -> int:
        return max(int(v) for v in self._store(self.store.multi_get, [f"batch/{r}" for r in range(self.size)]))

    def epoch(self, advance: int = 0) -> int:
        return int(self._store(self.store.add, "epoch", advance))

    def stopped(self, add: int = 0) -> int:
        return int(self._store(self.store.add, "stopped", add))

    @staticmethod
    def _store(op, *args):
        try:
            return op(*args)
        except (RuntimeError, dist.DistStoreError) as e:
            raise HpipeError(f"the SiDP group lost a replica ({_cause(e)})") from None


def _cause(e: Exception) -> str:
    return str(e).split("] ", 1)[-1].split(". ")[0]


# ---------------------------------------------------------------------------------- WaS's weight cache
class MappedWeights:
    """Source `shared-mapping`: every replica maps every block's weights; WaS runs them in place."""

    def __init__(self, sources: dict[int, nn.Module]):
        self.sources = sources
        self.stats = {"fetches": 0, "fetch_s": 0.0, "wait_s": 0.0}

    def take(self, block: int) -> nn.Module:
        return self.sources[block]

    def give_back(self, block: int) -> None:
        pass

    def stop(self) -> None:
        pass

    def report(self) -> dict:
        return dict(self.stats)


class FetchedWeights:
    """WaS's cache: `slots` copies of an MLP module (`template`, on the replica's device), allocated
    once, which a housekeeper thread fills in `order` (cyclically, step after step) from the source
    tensors of each block through `copies` (`HostCopies` on a CPU, `StreamCopies` on a GPU);
    `take(b)` waits until block b is in a slot, `give_back(b)` frees its slot for the next fetch.
    The order runs whole cycles of the group's size ahead of the forward, which takes a cycle's
    blocks in its own order: with at least a cycle's remote blocks of slots (the plan's
    validation), the fetch the forward waits for always finds a free slot."""

    def __init__(self, template: nn.Module, sources: dict[int, list[torch.Tensor]], order: list[int], slots: int,
                 copies, errors: list):
        shapes = [t.shape for t in module_tensors(template)]
        for b in order:
            if [t.shape for t in sources[b]] != shapes:
                raise HpipeError(f"WaS cache slots hold one MLP shape; block {b}'s MLP differs from block "
                                 f"{order[0]}'s: run this model with --sidp-mode cas")
        self.sources, self.order, self.copies, self.errors = sources, order, copies, errors
        with torch.inference_mode():
            self.slots = [copy.deepcopy(template) for _ in range(slots)]
        self.slot_tensors = [module_tensors(m) for m in self.slots]
        self.bytes_per_fetch = sum(t.numel() * t.element_size() for t in self.slot_tensors[0])
        self.cond = threading.Condition()
        self.free = list(range(slots))
        self.held: dict[int, int] = {}           # block -> slot
        self.stats = {"fetches": 0, "wait_s": 0.0}     # the fetches' time is the copies' (report)
        self.stopping = False
        copies.begin()
        self.housekeeper = _thread(self._housekeeper, "hpipe-was-housekeeper", errors)

    def _housekeeper(self) -> None:
        for block in itertools.cycle(self.order):
            with self.cond:
                while not self.stopping and (not self.free or block in self.held):
                    self.cond.wait()
                if self.stopping:
                    return
                slot = self.free.pop()
            self.copies.fill(slot, self.slot_tensors[slot], self.sources[block])
            with self.cond:
                self.stats["fetches"] += 1
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
            slot = self.held[block]
        self.copies.filled(slot)
        return self.slots[slot]

    def give_back(self, block: int) -> None:
        with self.cond:
            slot = self.held.pop(block)
            self.copies.emptied(slot)
            self.free.append(slot)
            self.cond.notify_all()

    def stop(self) -> None:
        """The replica's loop is over: no more fills, and the last one done."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.housekeeper.join()
        self.copies.finish()

    def report(self) -> dict:
        """The fetches, their time (a GPU's: the copy stream's, from its events), the forward's waits,
        and the bytes of one fetch."""
        return {**self.stats, "fetch_s": self.copies.fetch_seconds(), "bytes_per_fetch": self.bytes_per_fetch}


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
    """The rows travel over the group's gloo link in host memory: a GPU replica's go through the
    host both ways (replicas that share one GPU cannot form an NCCL group)."""

    name = "cas"

    def __init__(self, link: GroupLink, seat: Seat, owned: dict[int, nn.Module], hidden: int, dtype,
                 device: torch.device):
        self.link, self.seat, self.modules, self.hidden, self.dtype = link, seat, owned, hidden, dtype
        self.device = device
        self.stats = {"rows_sent": 0, "rows_served": 0}

    def owned(self, block: int, module: nn.Module, x: torch.Tensor, step: Step) -> torch.Tensor:
        """Everyone's rows of this block in one GEMM: ours first, then each sender's in rank order."""
        senders = [r for r, n in enumerate(step.rows) if n and r != self.link.rank]
        if not senders:
            return module(x)
        rows = [torch.empty(step.rows[r], self.hidden, dtype=x.dtype) for r in senders]
        for w in [self.link.recv(buf, r, block) for buf, r in zip(rows, senders)]:
            self.link.wait(w)
        y = module(torch.cat([x, *(buf.to(x.device) for buf in rows)]))
        sends, at = [], x.shape[0]
        for r, buf in zip(senders, rows):
            sends.append(self.link.send(y[at:at + buf.shape[0]].cpu(), r, block))
            at += buf.shape[0]
        for w in sends:
            self.link.wait(w)
        self.stats["rows_served"] += at - x.shape[0]
        return y[:x.shape[0]]

    def remote(self, block: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        owner = self.seat.group.owners[block]
        self.link.wait(self.link.send(x.cpu(), owner, block))
        y = torch.empty(x.shape, dtype=x.dtype)
        self.link.wait(self.link.recv(y, owner, block))
        self.stats["rows_sent"] += x.shape[0]
        return y.to(x.device)

    def serve(self, step: Step) -> None:
        """An owner without rows of its own: its blocks, in the forward's order, for the others."""
        if not any(step.rows):
            return
        empty = torch.empty(0, self.hidden, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            for block, module in self.modules.items():
                self.owned(block, module, empty, step)


# ---------------------------------------------------------------------------------- the switch
class Switch:
    """WaS while the group's largest batch stays at B_th or above; CaS after PATIENCE steps with
    work below it; back to WaS after PATIENCE steps at B_th + max(1, B_th / 4) or above. Steps where
    no replica has work do not count (a job's start is not its tail)."""

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

    def enter(self, mode) -> None:
        self.mode, self.count = mode, 0


# ---------------------------------------------------------------------------------- keeping in step
class Alone:
    """--sidp-mode was: plain DP's pace; the MLP halves from the WaS cache."""

    def __init__(self, replica: Replica):
        self.replica = replica

    def next_step(self, rows: int, batch: int, stopped: bool) -> Step | None:
        return None if stopped else self.replica.alone(rows, batch)


class InStep:
    """--sidp-mode cas: the group meets at every step."""

    def __init__(self, replica: Replica):
        self.replica = replica

    def next_step(self, rows: int, batch: int, stopped: bool) -> Step | None:
        step = self.replica.meet(rows, batch, stopped)
        return None if step.finished else self.replica.record(step, self.replica.cas)


class Epochs:
    """--sidp-mode auto: alone under WaS, in step under CaS; replica 0 decides when to meet (the
    store's epoch), the meeting decides when to part, from the same numbers on every replica."""

    def __init__(self, replica: Replica, link: GroupLink, switch: Switch):
        self.replica, self.link, self.switch = replica, link, switch
        self.epoch = 0                  # the epochs this replica has entered and left: odd = CaS
        self.stop_told = False

    def next_step(self, rows: int, batch: int, stopped: bool) -> Step | None:
        replica, link = self.replica, self.link
        if self.switch.mode is replica.was:
            link.publish(batch)
            if stopped and not self.stop_told:
                link.stopped(1)
                self.stop_told = True
            if link.rank == 0:
                largest = link.largest_batch()
                if self.switch.decide(largest, largest > 0) is replica.cas:
                    link.epoch(1)
            if link.epoch() <= self.epoch and link.stopped() < link.size:
                if stopped:             # an owner may still have to serve: look again shortly
                    time.sleep(IDLE_WAIT_S)
                return replica.alone(rows, batch)
            self.epoch += 1             # meet: a new epoch, or every replica has stopped
            self.switch.enter(replica.cas)
        step = replica.meet(rows, batch, stopped)
        if step.finished:
            return None
        if self.switch.decide(step.batch, any(step.rows)) is replica.was:
            self.epoch += 1             # part, all at this step
            if link.rank == 0:
                link.epoch(1)
        return replica.record(step, self.switch.mode)


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


def was_cache(seat: Seat, mlps: dict[int, nn.Module], device: torch.device, token: str, timeout_s: float,
              errors: list) -> tuple[MappedWeights | FetchedWeights, int]:
    """WaS's cache for this replica, from its group's source and its device (`hpipe.runtime.was_sources`).
    Returns it and the device bytes freed (a GPU replica drops its own copies of the MLPs it fetches)."""
    group = seat.group
    remote = group.prefetch_order(seat.member)
    if group.source == "shared-mapping":
        return MappedWeights(mlps), 0
    if device.type == "cpu":               # the host pool is the weights' mapping itself
        if not remote:
            return MappedWeights(mlps), 0
        return FetchedWeights(mlps[remote[0]], {b: module_tensors(mlps[b]) for b in remote}, remote, group.slots,
                              was_sources.HostCopies(), errors), 0
    owned = {b: mlps[b] for b in seat.owned}
    if group.source == "host-pool":
        was_sources.publish_host_pool(token, seat.member, owned)
    else:
        was_sources.publish_peer(token, seat.member, owned)
    if not remote:
        return MappedWeights(mlps), 0
    template = mlps[remote[0]]
    mappings = []
    if group.source == "host-pool":
        sources, mappings = was_sources.open_host_pool(token, group.owners, seat.member, mlps, timeout_s)
    else:
        sources = was_sources.open_peer(token, group.owners, seat.member, timeout_s)
    cache = FetchedWeights(template, sources, remote, group.slots, was_sources.StreamCopies(device, group.slots),
                           errors)
    cache.mappings = mappings              # the host pool's mappings live as long as the cache reads them
    freed = sum(was_sources.release(mlps[b]) for b in remote)
    torch.cuda.empty_cache()
    return cache, freed


class Replica:
    """One replica's SiDP machinery, built once before the clock starts: the WaS cache, the CaS
    mode, how it keeps in step with the others, and the step trace (the paper's Fig. 15)."""

    def __init__(self, seat: Seat, runner, mode: str, addr: str, port: int, token: str, timeout_s: float,
                 errors: list):
        self.seat = seat
        group = seat.group
        mlps = runner.mlp_modules()                      # block -> the mapped MLP module
        cache, self.released_bytes = was_cache(seat, mlps, runner.device, token, timeout_s, errors)
        self.token, self.timeout_s = token, timeout_s
        self.reads_peers = group.source == "peer" and runner.device.type == "cuda" and seat.size > 1
        self.was = WasMode(cache)
        link = GroupLink(seat, addr, port, token, timeout_s) if needs_group(group, mode) else None
        self.link = link
        self.cas = CasMode(link, seat, {b: mlps[b] for b in seat.owned}, runner.hidden_size, runner.dtype,
                           runner.device)
        self.pace = Alone(self) if link is None else InStep(self) if mode == "cas" else \
            Epochs(self, link, Switch(self.was, self.cas, group.threshold))
        self.mode = self.was
        self.step = Step([], 0, mode=self.was)
        runner.replace_mlps({b: OwnedMLP(b, mlps[b], self) if b in seat.owned else RemoteMLP(b, self)
                             for b in mlps})
        self.trace: list[list] = []                     # [t, batch, mode] per step with work
        self.steps = {"was": 0, "cas": 0}

    def next_step(self, rows: int, batch: int, stopped: bool) -> Step | None:
        """This step's mode (the MLP halves read it), or None when the replica's loop ends."""
        return self.pace.next_step(rows, batch, stopped)

    def alone(self, rows: int, batch: int) -> Step:
        return self.record(Step([rows], batch), self.was)

    def meet(self, rows: int, batch: int, stopped: bool) -> Step:
        gathered = self.link.gather([rows, batch, int(stopped)])
        return Step([g[0] for g in gathered], max(g[1] for g in gathered), all(g[2] for g in gathered))

    def record(self, step: Step, mode) -> Step:
        step.mode = self.mode = mode
        self.step = step
        if any(step.rows):
            self.steps[mode.name] += 1
            self.trace.append([round(time.time(), 4), step.batch, mode.name])
        return step

    def finish(self) -> None:
        """After the loop: WaS stops fetching; in a peer group, every member waits until none reads
        another's memory any more (an owner's exit frees what the others opened)."""
        self.was.cache.stop()
        if self.reads_peers:
            was_sources.done_reading(self.token, self.seat.member, self.seat.size, self.timeout_s)

    def report(self) -> dict:
        return {"member": self.seat.member, "owned_blocks": len(self.seat.owned), "source": self.seat.group.source,
                "threshold": self.seat.group.threshold, "steps": self.steps, "was": self.was.cache.report(),
                "cas": self.cas.stats, "device_bytes_released": self.released_bytes, "trace": self.trace}


# ---------------------------------------------------------------------------------- the loop
def run_replica(ex: Executors, driver: Driver, sampling: Sampling, replica: Replica) -> dict:
    """A replica's compute loop: before every step the replica learns its mode (alone, or meeting
    the group); with a micro-batch it runs it (its MLP halves through the mode), without one it
    serves (CaS) or looks again; the loop ends when the replica's pace says so."""
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
        step = replica.next_step(rows, 0 if stopped else len(sched.active), stopped)
        if step is None:
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
    replica.finish()
    _join(threads, errors)
    if errors:
        raise errors[0]
    return run_summary(sched, wall0)
