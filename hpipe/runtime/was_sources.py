"""Where a SiDP replica's WaS reads the MLP halves it does not own, and how it copies them into its
slots (SiDP §4.2). Chosen once per replica, from the group's source and the replica's device:

- a CPU replica copies from the weights' one mapping in the page cache (`host-pool`), or runs the
  mapping itself (`shared-mapping`, `sidp.MappedWeights`): `HostCopies`, a plain copy in the
  housekeeper's thread;
- a GPU replica copies on a CUDA stream of its own (`StreamCopies`): the forward waits for a
  slot's fill on the GPU (an event per fill), never on the host, and a fill waits on the GPU for
  the forward's last read of its slot (the event recorded when the forward gave it back: the
  write-after-read guard). Its sources:
  - `host-pool`: every owner writes the MLPs it owns once into a file in /dev/shm
    (`publish_host_pool`); each replica maps the others' files and page-locks the mapping
    (cudaHostRegister), so the host holds one pinned copy of every MLP, shared by the replicas,
    and the copies run at the link's DMA speed;
  - `peer`: every owner exports the memory of the MLPs it owns through CUDA IPC
    (`publish_peer`); each replica opens the others' and copies device to device (over P2P
    between two cards; inside one card, as the tests run two replicas sharing one GPU).
  A GPU replica then frees its own copies of the MLPs it does not own (`release`).

The files are named by the launch's group token and the owner's seat; the launcher removes them
when the job ends (`remove_published`).
"""

from __future__ import annotations

import collections
import glob
import os
import pickle
import threading
import time

import torch
from torch import nn

from hpipe.errors import HpipeError

__all__ = ["HostCopies", "StreamCopies", "publish_host_pool", "open_host_pool", "publish_peer", "open_peer",
           "done_reading", "release", "remove_published", "module_tensors"]

SHM_DIR = "/dev/shm"
POLL_S = 0.05
ALIGN = 64                 # every tensor of the host pool starts on a 64-byte boundary (any dtype's view)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers in one fixed order (by name): the slots' and the sources' layout."""
    return [t for _, t in sorted([*module.named_parameters(), *module.named_buffers()], key=lambda kv: kv[0])]


# ---------------------------------------------------------------------------------- copying into slots
class HostCopies:
    """CPU slots: the housekeeper copies in its own thread; a slot is ready when the copy returns."""

    def __init__(self):
        self.seconds = 0.0

    def begin(self) -> None:
        """The slots are made: nothing is queued anywhere."""

    def finish(self) -> None:
        """Every fill has returned."""

    def fill(self, slot: int, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        t = time.perf_counter()
        with torch.inference_mode():
            for d, s in zip(dst, src):
                d.copy_(s)
        self.seconds += time.perf_counter() - t

    def filled(self, slot: int) -> None:
        """Nothing to wait for: the copy was done when the slot was handed over."""

    def emptied(self, slot: int) -> None:
        """The forward's reads of the slot are over when it returns."""

    def fetch_seconds(self) -> float:
        return self.seconds


class StreamCopies:
    """GPU slots: each fill is enqueued on the replica's copy stream between two timing events and
    returns at once; `filled(slot)` makes the forward's stream wait for that fill's end event,
    `emptied(slot)` records where the forward's stream stands, and the next fill of the slot waits
    for it on the copy stream. The fill's device time (the events' elapsed) is summed as the fills
    complete."""

    def __init__(self, device: torch.device, slots: int):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ends: list = [None] * slots                   # each slot's last fill's end event
        self.freed: list = [None] * slots                  # the forward's event when it last gave the slot back
        self.pending: collections.deque = collections.deque()
        self.lock = threading.Lock()                       # the housekeeper folds, and so does the report
        self.seconds = 0.0

    def begin(self) -> None:
        """Before the first fill: the copy stream (one of torch's pool, which waits for nothing)
        waits for what the forward's stream has queued so far: the slots' own copies from the
        template, and a peer source's wait for its owner's event."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def finish(self) -> None:
        """The last fill done: nothing reads a source any more (a peer's memory may go)."""
        self.stream.synchronize()

    def fill(self, slot: int, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.inference_mode():
            if self.freed[slot] is not None:
                self.stream.wait_event(self.freed[slot])    # write after read: the last forward is done with it
            start.record(self.stream)
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
            end.record(self.stream)
        self.ends[slot] = end
        self.pending.append((start, end))
        self._fold(block=False)

    def filled(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ends[slot])

    def emptied(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.freed[slot] = event

    def fetch_seconds(self) -> float:
        self._fold(block=True)
        return self.seconds

    def _fold(self, block: bool) -> None:
        with self.lock:
            while self.pending and (block or self.pending[0][1].query()):
                start, end = self.pending.popleft()
                end.synchronize()
                self.seconds += start.elapsed_time(end) / 1000


# ---------------------------------------------------------------------------------- publishing the sources
def _path(token: str, member: int, kind: str) -> str:
    return os.path.join(SHM_DIR, f"hpipe-sidp-{token}-{member}.{kind}")


def _write_atomically(path: str, write) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)                 # readers see the whole file or none


def _wait_for(path: str, owner: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            raise HpipeError(f"SiDP replica {owner} did not publish its MLP weights ({path}) within {timeout_s:.0f} s: "
                             f"see its log; raise --rendezvous-timeout if it loads slowly")
        time.sleep(POLL_S)


def publish_host_pool(token: str, member: int, owned: dict[int, nn.Module]) -> int:
    """The owner's part of the host pool: its MLPs' bytes, block after block, each module's tensors
    in `module_tensors` order (each padded to `ALIGN` bytes), in /dev/shm. Returns the bytes written."""
    total = 0

    def write(f):
        nonlocal total
        for b in sorted(owned):
            for t in module_tensors(owned[b]):
                data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                f.write(data.tobytes() + bytes(_padded(data.nbytes) - data.nbytes))
                total += _padded(data.nbytes)
    _write_atomically(_path(token, member, "pool"), write)
    return total


def open_host_pool(token: str, owners: tuple[int, ...], member: int, modules: dict[int, nn.Module],
                   timeout_s: float) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
    """Every block this member does not own, as host tensors over its owner's file (mapped shared,
    page-locked once for the device's DMA), each block laid out as this member's own copy of that
    block's MLP (`modules`, before `release`). Returns ({block: tensors}, the mappings)."""
    def layout(b: int) -> list[tuple]:
        return [(t.dtype, t.shape, t.numel() * t.element_size()) for t in module_tensors(modules[b])]

    sources, mappings = {}, []
    for owner in sorted(set(owners) - {member}):
        path = _path(token, owner, "pool")
        _wait_for(path, owner, timeout_s)
        blocks = [b for b, o in enumerate(owners) if o == owner]
        size, expected = os.path.getsize(path), sum(_padded(n) for b in blocks for *_, n in layout(b))
        if size != expected:
            raise HpipeError(f"{path}: {size} bytes where replica {owner}'s {len(blocks)} MLPs take "
                             f"{expected}: the replicas load different models")
        pool = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        _page_lock(pool)
        mappings.append(pool)
        at = 0
        for b in blocks:
            tensors = []
            for dtype, shape, n in layout(b):
                tensors.append(pool[at:at + n].view(dtype).view(shape))
                at += _padded(n)
            sources[b] = tensors
    return sources, mappings


def _page_lock(t: torch.Tensor) -> None:
    """cudaHostRegister over a mapping: the copy engine then reads it directly (async, full speed)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise HpipeError(f"page-locking the SiDP host pool ({t.numel() >> 20} MiB) failed (cudaError {int(err)}): "
                         f"raise the locked-memory limit (ulimit -l) or plan --sidp-source peer")


def publish_peer(token: str, member: int, owned: dict[int, nn.Module]) -> None:
    """The owner's part of the peer source: a CUDA IPC handle of each tensor of each MLP it owns
    (torch's own reduction), in /dev/shm. The owner keeps the tensors alive while the job runs."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = {b: [reduce_tensor(t.detach())[1] for t in module_tensors(owned[b])] for b in owned}
    _write_atomically(_path(token, member, "ipc"), lambda f: pickle.dump(handles, f))


def open_peer(token: str, owners: tuple[int, ...], member: int, timeout_s: float) -> dict[int, list[torch.Tensor]]:
    """Every block this member does not own, as its owner's device memory opened through CUDA IPC."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    sources = {}
    for owner in sorted(set(owners) - {member}):
        path = _path(token, owner, "ipc")
        _wait_for(path, owner, timeout_s)
        with open(path, "rb") as f:
            handles = pickle.load(f)
        for b, args in handles.items():
            sources[b] = [rebuild_cuda_tensor(*a) for a in args]
    return sources


def done_reading(token: str, member: int, members: int, timeout_s: float) -> None:
    """The end of a peer group's job: this member has stopped reading the others' memory; it
    waits until every member has, so that no owner's memory goes while another still copies from
    it (a member lost meanwhile is waited for `timeout_s`, then left)."""
    _write_atomically(_path(token, member, "done"), lambda f: None)
    deadline = time.time() + timeout_s
    while not all(os.path.exists(_path(token, m, "done")) for m in range(members)) and time.time() < deadline:
        time.sleep(POLL_S)


def remove_published(token: str) -> None:
    """The group's files, once its replicas are gone (mappings and opened handles outlive them)."""
    for path in glob.glob(os.path.join(SHM_DIR, f"hpipe-sidp-{token}-*")):
        try:
            os.unlink(path)
        except OSError:
            pass


def release(module: nn.Module) -> int:
    """Frees a module's device memory (a GPU replica's copy of an MLP it does not own, once its
    slots and sources are set up): every parameter and buffer becomes an empty tensor. Returns the
    bytes freed."""
    freed = 0
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                freed += p.numel() * p.element_size()
                sub._parameters[name] = nn.Parameter(p.new_empty(0), requires_grad=False)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                freed += b.numel() * b.element_size()
                sub._buffers[name] = b.new_empty(0)
    return freed
