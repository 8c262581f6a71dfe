"""Messages between stages, over torch.distributed.

Three streams, each FIFO (torch.distributed matches messages by source and tag, in order):
- the schedule (tag 2, the control plane): stage 0's scheduler publishes every micro-batch to every
  other stage as soon as it is decided, in one fixed-size message (op, micro-batch id, segments and
  the KV pages they add), ahead of the data; when serving, the same stream carries to the last stage
  the requests that join (their sampling parameters) and those that were aborted, each before the
  first schedule that needs it;
- the hop, stage j -> j+1 (tag 0): the hidden states;
- back, last stage -> stage 0 (tag 1): the sampled ids.

Structure-aware transfer (SAT, SiPipe §5.3): a receiver knows every transfer's shape from the
schedule, so the hidden states travel alone, into a receive posted ahead into a preallocated, reused
buffer, and the ids come back alone (stage 0 knows how many each micro-batch returns). Without SAT
(`--no-sat`, the baseline) every hop carries the schedule with the data, as a header and the segments
before the hidden states, and the ids come back after a header: three and two messages.

Control messages (schedule, headers, ids) travel on a gloo group; the hidden states on the data
group: NCCL when every stage is a distinct CUDA device, else the same gloo group (CUDA tensors are
staged through host memory). `Counters` counts messages and bytes per link and kind.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpipe.errors import HpipeError
from hpipe.net import choose_gloo_interface
from hpipe.request import Request
from hpipe.runtime.kv import PageTable, Segment, pages_needed

OP_WORK, OP_STOP, OP_TOKENS, OP_ADMIT, OP_RELEASE = 1, 2, 3, 4, 5
HEADER_LEN = 8
SEGMENT_FIELDS = 7
TAG_FORWARD, TAG_BACK, TAG_SCHEDULE = 0, 1, 2


def choose_backend(devices: list[str]) -> str:
    """NCCL when every stage sits on its own CUDA device, else gloo."""
    if all(d.startswith("cuda") for d in devices) and torch.cuda.is_available() and dist.is_nccl_available():
        indices = [int(d.split(":")[1]) if ":" in d else 0 for d in devices]
        if len(set(indices)) == len(indices):
            return "nccl"
    return "gloo"


@dataclass
class Counters:
    """Messages and bytes sent, per link ("0->1", "2->0") and kind: "meta" (headers, segments),
    "data" (hidden states, sampled ids) and "schedule" (the control plane)."""

    sent: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, src: int, dst: int, kind: str, tensor: torch.Tensor) -> None:
        with self.lock:
            link = self.sent.setdefault(f"{src}->{dst}", {})
            link[f"{kind}_msgs"] = link.get(f"{kind}_msgs", 0) + 1
            link[f"{kind}_bytes"] = link.get(f"{kind}_bytes", 0) + tensor.numel() * tensor.element_size()

    def as_dict(self) -> dict:
        with self.lock:
            return {k: dict(v) for k, v in self.sent.items()}


@dataclass
class Groups:
    backend: str
    ctrl: object          # gloo process group for schedules, headers and ids
    data: object          # process group for hidden states
    data_device: torch.device
    rank: int = 0
    counters: Counters = field(default_factory=Counters)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, kind: str, data: bool = False):
        self.counters.add(self.rank, dst, kind, tensor)
        return dist.isend(tensor, dst, group=self.data if data else self.ctrl, tag=tag)


class TokenRejected(HpipeError):
    pass


def token_digest(job_token: str) -> str:
    return hashlib.sha256(b"hpipe-job-token:" + job_token.encode()).hexdigest()


def check_job_token(store, rank: int, job_token: str) -> None:
    """Rank 0 (the rendezvous host) publishes a digest of this launch's token; every other worker
    compares its own before joining and refuses on a mismatch. Even a worker that skipped this
    check would not meet the others: their keys are prefixed with the token itself."""
    if rank == 0:
        store.set("hpipe/job-token-sha256", token_digest(job_token))
        return
    expected = store.get("hpipe/job-token-sha256").decode()
    if expected != token_digest(job_token):
        raise TokenRejected("this worker's job token (HPIPE_JOB_TOKEN) does not match the launch at the rendezvous "
                            "address; refusing to join")


def init(rank: int, world: int, addr: str, port: int, job_token: str, devices: list[str],
         timeout_s: float = 300.0) -> Groups:
    """Joins the job. Every key of the rendezvous store is prefixed with the job token, so a worker
    that does not present this launch's token never meets the others."""
    backend = choose_backend(devices)
    choose_gloo_interface(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    check_job_token(store, rank, job_token)
    store = dist.PrefixStore(f"hpipe/{job_token}/", store)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(devices[rank]))
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=torch.device(devices[rank]))
        ctrl = dist.new_group(backend="gloo", timeout=timeout)
        return Groups(backend, ctrl, dist.group.WORLD, torch.device(devices[rank]), rank)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return Groups(backend, dist.group.WORLD, dist.group.WORLD, torch.device("cpu"), rank)


class Pending:
    """Handles of in-flight sends; the tensors stay referenced until the sends complete."""

    def __init__(self):
        self.works: list = []
        self.tensors: list = []

    def add(self, work, tensor: torch.Tensor) -> None:
        self.works.append(work)
        self.tensors.append(tensor)

    def prune(self) -> None:
        """Forgets the sends that have completed."""
        done = [i for i, w in enumerate(self.works) if w.is_completed()]
        for i in reversed(done):
            del self.works[i], self.tensors[i]

    def wait(self):
        for w in self.works:
            w.wait()
        self.works.clear()
        self.tensors.clear()


def added_pages(seg: Segment, page_size: int) -> tuple[int, ...]:
    """What a segment adds to its sequence's page table: the pages past those holding [0, start)."""
    return seg.pages[pages_needed(seg.start, page_size):]


def encode_segments(segments: list[Segment], page_size: int) -> tuple[torch.Tensor, int]:
    """Segments as rows of SEGMENT_FIELDS, then the pages each adds, in one flat tensor; and the
    number of pages."""
    added = [added_pages(s, page_size) for s in segments]
    rows = [[s.seq, s.slot, s.start, s.length, int(s.sample), int(s.prefill), len(a)] for s, a in zip(segments, added)]
    pages = [p for a in added for p in a]
    return torch.tensor([v for row in rows for v in row] + pages, dtype=torch.long), len(pages)


def decode_segments(flat: list[int], n: int, table: PageTable) -> list[Segment]:
    """The inverse of `encode_segments`, each segment's whole page list rebuilt by the stage's
    page table (in the schedule's order)."""
    out, at = [], SEGMENT_FIELDS * n
    for i in range(n):
        seq, slot, start, length, sample, prefill, k = flat[SEGMENT_FIELDS * i:SEGMENT_FIELDS * (i + 1)]
        seg = Segment(seq, slot, start, length, bool(sample), bool(prefill))
        out.append(table.resolve(seg, flat[at:at + k]) if k or start else seg)
        at += k
    return out


# ------------------------------------------------------------------ the control plane (schedule)
def schedule_len(max_segments: int, max_pages: int) -> int:
    return HEADER_LEN + SEGMENT_FIELDS * max_segments + max_pages


def schedule_pages(max_tokens: int, max_segments: int, page_size: int) -> int:
    """The most pages one micro-batch can add: each segment adds at most ceil(length / size) + 1."""
    return max_tokens // page_size + 2 * max_segments


def publish_schedule(groups: Groups, world: int, mb_id: int, segments: list[Segment] | None,
                     max_segments: int, max_pages: int, page_size: int, pending: Pending) -> None:
    """Stage 0: one fixed-size message per stage: [op, id, n segments, tokens, n pages, ...] +
    segments + the pages they add. segments None publishes the stop."""
    msg = torch.zeros(schedule_len(max_segments, max_pages), dtype=torch.long)
    if segments is None:
        msg[0] = OP_STOP
    else:
        if len(segments) > max_segments:
            raise ValueError(f"{len(segments)} segments, the schedule holds {max_segments}")
        body, n_pages = encode_segments(segments, page_size)
        if n_pages > max_pages:
            raise ValueError(f"{n_pages} new KV pages, the schedule holds {max_pages}")
        msg[:5] = torch.tensor([OP_WORK, mb_id, len(segments), sum(s.length for s in segments), n_pages])
        msg[HEADER_LEN:HEADER_LEN + len(body)] = body
    for dst in range(1, world):
        pending.add(groups.isend(msg, dst, TAG_SCHEDULE, "schedule"), msg)


def publish_admit(groups: Groups, dst: int, request: Request, max_segments: int, max_pages: int,
                  pending: Pending) -> None:
    """Serving: a request that joins, for the last stage's sampler (its parameters, seed, limits)."""
    payload = torch.tensor(list(json.dumps(request.to_json()).encode()), dtype=torch.uint8)
    msg = torch.zeros(schedule_len(max_segments, max_pages), dtype=torch.long)
    msg[:2] = torch.tensor([OP_ADMIT, len(payload)])
    pending.add(groups.isend(msg, dst, TAG_SCHEDULE, "schedule"), msg)
    pending.add(groups.isend(payload, dst, TAG_SCHEDULE, "schedule"), payload)


def publish_release(groups: Groups, dst: int, seq: int, max_segments: int, max_pages: int, pending: Pending) -> None:
    """Serving: a request that was aborted (its sampler state goes)."""
    msg = torch.zeros(schedule_len(max_segments, max_pages), dtype=torch.long)
    msg[:2] = torch.tensor([OP_RELEASE, seq])
    pending.add(groups.isend(msg, dst, TAG_SCHEDULE, "schedule"), msg)


def recv_schedule(groups: Groups, max_segments: int, max_pages: int, table: PageTable,
                  events: list | None = None) -> tuple[int, list[Segment] | None]:
    """Stages 1..N-1: the next micro-batch's (id, segments), or (-1, None) at the stop. Requests
    that join or leave before it are appended to `events` as ("admit", Request) / ("release", seq)."""
    msg = torch.empty(schedule_len(max_segments, max_pages), dtype=torch.long)
    while True:
        dist.recv(msg, 0, group=groups.ctrl, tag=TAG_SCHEDULE)
        op, mb_id, n, _, n_pages = msg[:5].tolist()
        if op == OP_ADMIT:
            payload = torch.empty(mb_id, dtype=torch.uint8)
            dist.recv(payload, 0, group=groups.ctrl, tag=TAG_SCHEDULE)
            events.append(("admit", Request.from_json(json.loads(bytes(payload.tolist()).decode()))))
            continue
        if op == OP_RELEASE:
            events.append(("release", mb_id))
            continue
        if op == OP_STOP:
            return -1, None
        return mb_id, decode_segments(msg[HEADER_LEN:HEADER_LEN + SEGMENT_FIELDS * n + n_pages].tolist(), n, table)


# ------------------------------------------------------------------ the hop (hidden states)
def send_hidden(groups: Groups, dst: int, hidden: torch.Tensor, pending: Pending) -> None:
    """SAT: the hidden states alone; the receiver knows their shape from the schedule."""
    payload = hidden.contiguous() if groups.backend == "nccl" else hidden.detach().to("cpu").contiguous()
    pending.add(groups.isend(payload, dst, TAG_FORWARD, "data", data=True), payload)


def post_recv_hidden(groups: Groups, src: int, buffer: torch.Tensor):
    """SAT: posts the receive of one micro-batch's hidden states into `buffer` (a view of a
    preallocated buffer); returns the work handle to wait on."""
    return dist.irecv(buffer, src, group=groups.data, tag=TAG_FORWARD)


def isend_work(groups: Groups, dst: int, mb_id: int, segments: list[Segment], hidden: torch.Tensor | None,
               page_size: int, pending: Pending) -> None:
    """Without SAT: header, segments (and the pages they add), hidden states."""
    n_tokens = 0 if hidden is None else hidden.shape[0]
    segs, n_pages = encode_segments(segments, page_size)
    header = torch.tensor([OP_WORK, mb_id, len(segments), n_tokens, n_pages] + [0] * (HEADER_LEN - 5),
                          dtype=torch.long)
    pending.add(groups.isend(header, dst, TAG_FORWARD, "meta"), header)
    pending.add(groups.isend(segs, dst, TAG_FORWARD, "meta"), segs)
    if hidden is not None:
        send_hidden(groups, dst, hidden, pending)


def send_stop(groups: Groups, dst: int, tag: int = TAG_FORWARD) -> None:
    header = torch.tensor([OP_STOP] + [0] * (HEADER_LEN - 1), dtype=torch.long)
    groups.isend(header, dst, tag, "meta").wait()


def recv_work(groups: Groups, src: int, hidden_size: int, dtype: torch.dtype, table: PageTable,
              receive_hidden: bool = True):
    """Without SAT: (id, segments, hidden states), or (-1, None, None) at the stop. With
    receive_hidden False the hidden states' buffer comes back empty, for the caller to receive into
    (NCCL: every NCCL call of a stage stays on its compute thread)."""
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    dist.recv(header, src, group=groups.ctrl, tag=TAG_FORWARD)
    op, mb_id, n_segs, n_tokens, n_pages = header[:5].tolist()
    if op == OP_STOP:
        return -1, None, None
    segs = torch.empty(n_segs * SEGMENT_FIELDS + n_pages, dtype=torch.long)
    dist.recv(segs, src, group=groups.ctrl, tag=TAG_FORWARD)
    hidden = torch.empty((n_tokens, hidden_size), dtype=dtype, device=groups.data_device)
    if receive_hidden:
        dist.recv(hidden, src, group=groups.data, tag=TAG_FORWARD)
    return mb_id, decode_segments(segs.tolist(), n_segs, table), hidden


# ------------------------------------------------------------------ back (sampled ids)
def send_tokens(groups: Groups, dst: int, mb_id: int, ids: list[int], sat: bool) -> None:
    """The ids of one micro-batch; without SAT after a header [op, id, n]."""
    if not sat:
        header = torch.tensor([OP_TOKENS, mb_id, len(ids)] + [0] * (HEADER_LEN - 3), dtype=torch.long)
        groups.isend(header, dst, TAG_BACK, "meta").wait()
    if ids:
        groups.isend(torch.tensor(ids, dtype=torch.long), dst, TAG_BACK, "data").wait()


def recv_tokens(groups: Groups, src: int, n: int | None = None) -> tuple[int, int, list[int]]:
    """Stage 0: (op, micro-batch id, ids). With SAT, `n` (the micro-batch's sampling rows, from its
    schedule) replaces the header and the id is the caller's."""
    mb_id = -1
    if n is None:
        header = torch.empty(HEADER_LEN, dtype=torch.long)
        dist.recv(header, src, group=groups.ctrl, tag=TAG_BACK)
        op, mb_id, n = header[:3].tolist()
        if op == OP_STOP:
            return op, mb_id, []
    ids: list[int] = []
    if n:
        buf = torch.empty(n, dtype=torch.long)
        dist.recv(buf, src, group=groups.ctrl, tag=TAG_BACK)
        ids = buf.tolist()
    return OP_TOKENS, mb_id, ids
