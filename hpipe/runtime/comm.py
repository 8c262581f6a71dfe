"""Messages between stages, over torch.distributed.

Three streams, each FIFO (torch.distributed matches messages by source and tag, in order):
- the schedule (tag 2, the control plane): stage 0's scheduler publishes every micro-batch's
  `Schedule` (hpipe.runtime.schedule: segments, the KV pages they add, the requests admitted and
  released) to every other stage as soon as it is decided, in one fixed-size message, ahead of the
  data; serving, the admitted requests follow in a second message;
- the hop, stage j -> j+1 (tag 0): the hidden states;
- back, last stage -> stage 0 (tag 1): the sampled ids.

Structure-aware transfer (SAT, SiPipe §5.3): a receiver knows every transfer's shape from the
schedule, so the hidden states travel alone, into a receive posted ahead into a preallocated, reused
buffer, and the ids come back alone (stage 0 knows how many each micro-batch returns). Without SAT
(`--no-sat`, the baseline) every hop carries the schedule with the data, as its header and body
before the hidden states, and the ids come back after a header: three and two messages.

Control messages (schedule, headers, ids) travel on a gloo group; the hidden states on the data
group: NCCL when every stage is a distinct CUDA device, else the same gloo group (CUDA tensors are
staged through host memory). `Counters` counts messages and bytes per link and kind.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpipe.errors import HpipeError
from hpipe.net import choose_gloo_interface
from hpipe.runtime import schedule as codec
from hpipe.runtime.pages import PageTable
from hpipe.runtime.schedule import HEADER_LEN, OP_STOP, Schedule

OP_TOKENS = 3                      # the back link's header (without SAT): OP_TOKENS or the schedules' OP_STOP
TAG_FORWARD, TAG_BACK, TAG_SCHEDULE, TAG_REQUESTS = 0, 1, 2, 3


# How a neighbour's death reads once it reaches this stage: gloo's TCP pairs and the rendezvous
# store (the connection closed, reset or broken under a send or receive) and NCCL (the communicator
# aborted, the remote exited). One list, read by `lost_peer` only.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker crashing",
              "failed to recv", "socket closed", "remote process exited", "communicator was aborted")


def lost_peer(error: BaseException | None) -> bool:
    """Whether this error is another stage's death reaching this one (a send or receive on the data
    or control plane, whichever thread made it), rather than a failure of this stage's own."""
    seen = set()
    while error is not None and id(error) not in seen:    # the cause chain: a wrapper keeps what it wraps
        seen.add(id(error))
        if isinstance(error, (RuntimeError, ConnectionError, OSError)) and \
                any(m in str(error).lower() for m in _PEER_LOST):
            return True
        error = error.__cause__ or error.__context__
    return False


def lost_peer_line(error: BaseException) -> str:
    """The one line a stage reports when a neighbour died: what the transport said, without its
    source location."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)          # gloo's "[.../pair.cc:553] " prefix
    text = text.split(". This is typically")[0].rstrip(".")
    return f"lost a peer stage ({text}); the stage that failed first reports why"


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


# How long a gloo receive of the run waits: as long as the job lasts. An idle server's stages wait
# for the next request's schedule for hours; with gloo's deadline at the rendezvous timeout every
# follower's wait ended at 300 s and the server stopped ("Timed out waiting 300000ms for recv"), and
# a timed-out gloo receive closes its pair, so a wait cannot be taken up again. The rendezvous stays
# bounded (`init`'s timeout_s: the store's waits, the groups' creation, the first exchange); a dead
# stage closes its connections, and a host that falls silent is the launcher's to find
# (`--host-timeout`).
RUN_TIMEOUT = datetime.timedelta(days=365)


def init(rank: int, world: int, addr: str, port: int, job_token: str, devices: list[str],
         timeout_s: float = 300.0) -> Groups:
    """Joins the job. Every key of the rendezvous store is prefixed with the job token, so a worker
    that does not present this launch's token never meets the others. The run's gloo groups wait
    without a deadline (`RUN_TIMEOUT`); NCCL's, whose operations are in flight only while a
    micro-batch moves, keep timeout_s."""
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
        ctrl = dist.new_group(backend="gloo", timeout=RUN_TIMEOUT)
        return Groups(backend, ctrl, dist.group.WORLD, torch.device(devices[rank]), rank)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    run = dist.new_group(backend="gloo", timeout=RUN_TIMEOUT)     # created through the store: bounded by timeout_s
    return Groups(backend, run, run, torch.device("cpu"), rank)


class Pending:
    """Handles of in-flight sends; the tensors stay referenced until the sends complete. A gloo
    send's work says it completed only once waited on (`is_completed()` stays False), so the holder
    waits where it knows the other side has received (`wait` of a received send: ~10 us)."""

    def __init__(self):
        self.works: list = []
        self.tensors: list = []

    def add(self, work, tensor: torch.Tensor) -> None:
        self.works.append(work)
        self.tensors.append(tensor)

    def wait(self):
        for w in self.works:
            w.wait()
        self.works.clear()
        self.tensors.clear()


@dataclass(frozen=True)
class ScheduleLink:
    """How this job's schedules travel, fixed at start: the body's capacity (the fixed-size message
    on the control plane), the page size, whether the admitted requests travel whole (serving: from
    stage 0 to the last stage alone, `last`; a batch job's stages all read its requests file) and
    where a request is looked up otherwise."""

    capacity: int
    page_size: int
    with_requests: bool
    last: int                        # the last stage's rank: the one reader of the admitted requests
    requests: object = None          # index -> Request, when not with_requests

    def reads_requests(self, rank: int) -> bool:
        return self.with_requests and rank == self.last


def _payload_tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


# ------------------------------------------------------------------ the control plane (schedule)
def publish_schedule(groups: Groups, world: int, schedule: Schedule, link: ScheduleLink, pending: Pending) -> None:
    """SAT, stage 0: one fixed-size message (header + body) to every other stage, then the payload."""
    header, body, payload = codec.encode(schedule, link.page_size, link.with_requests)
    if len(body) > link.capacity:
        raise ValueError(f"a schedule of {len(body)} integers; the control plane's messages hold {link.capacity}")
    msg = torch.zeros(HEADER_LEN + link.capacity, dtype=torch.long)
    msg[:HEADER_LEN + len(body)] = torch.tensor(header + body, dtype=torch.long)
    for dst in range(1, world):
        pending.add(groups.isend(msg, dst, TAG_SCHEDULE, "schedule"), msg)
    send_requests(groups, payload, link, pending)


def send_requests(groups: Groups, payload: bytes, link: ScheduleLink, pending: Pending) -> None:
    """Stage 0, serving: the admitted requests, to the last stage alone (the middle stages read
    only their indices and the payload's length in the schedule)."""
    if payload:
        extra = _payload_tensor(payload)
        pending.add(groups.isend(extra, link.last, TAG_REQUESTS, "schedule"), extra)


def recv_schedule(groups: Groups, link: ScheduleLink, table: PageTable) -> Schedule:
    """SAT, stages 1..N-1: the next schedule (its `stop` set at the end)."""
    msg = torch.empty(HEADER_LEN + link.capacity, dtype=torch.long)
    dist.recv(msg, 0, group=groups.ctrl, tag=TAG_SCHEDULE)
    flat = msg.tolist()
    header = flat[:HEADER_LEN]
    payload = _recv_requests(groups, link, header)
    return codec.decode(header, flat[HEADER_LEN:HEADER_LEN + codec.body_len(header)], payload, table, link.requests)


def _recv_requests(groups: Groups, link: ScheduleLink, header: list[int]) -> bytes:
    """The last stage: the admitted requests stage 0 sent it (b"" on any other stage)."""
    return _recv_payload(groups, 0, TAG_REQUESTS, codec.payload_len(header)) \
        if link.reads_requests(groups.rank) else b""


def _recv_payload(groups: Groups, src: int, tag: int, n: int) -> bytes:
    if not n:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
    dist.recv(buf, src, group=groups.ctrl, tag=tag)
    return bytes(buf.numpy())


# ------------------------------------------------------------------ the hop (hidden states)
def send_hidden(groups: Groups, dst: int, hidden: torch.Tensor, pending: Pending) -> None:
    """SAT: the hidden states alone; the receiver knows their shape from the schedule."""
    payload = hidden.contiguous() if groups.backend == "nccl" else hidden.detach().to("cpu").contiguous()
    pending.add(groups.isend(payload, dst, TAG_FORWARD, "data", data=True), payload)


def post_recv_hidden(groups: Groups, src: int, buffer: torch.Tensor):
    """SAT: posts the receive of one micro-batch's hidden states into `buffer` (a view of a
    preallocated buffer); returns the work handle to wait on."""
    return dist.irecv(buffer, src, group=groups.data, tag=TAG_FORWARD)


def isend_work(groups: Groups, dst: int, schedule: Schedule, hidden: torch.Tensor | None, link: ScheduleLink,
               pending: Pending) -> None:
    """Without SAT: the schedule's header and body (none at the stop), the hidden states; from stage
    0, the admitted requests to the last stage."""
    header, body, payload = codec.encode(schedule, link.page_size, link.with_requests)
    head = torch.tensor(header, dtype=torch.long)
    pending.add(groups.isend(head, dst, TAG_FORWARD, "meta"), head)
    if body:
        rest = torch.tensor(body, dtype=torch.long)
        pending.add(groups.isend(rest, dst, TAG_FORWARD, "meta"), rest)
    send_requests(groups, payload, link, pending)
    if hidden is not None:
        send_hidden(groups, dst, hidden, pending)


def recv_work(groups: Groups, src: int, hidden_size: int, dtype: torch.dtype, link: ScheduleLink, table: PageTable,
              receive_hidden: bool = True) -> tuple[Schedule, torch.Tensor | None]:
    """Without SAT: (schedule, hidden states); no hidden states at the stop. With receive_hidden
    False the hidden states' buffer comes back empty, for the caller to receive into (NCCL: every
    NCCL call of a stage stays on its compute thread)."""
    head = torch.empty(HEADER_LEN, dtype=torch.long)
    dist.recv(head, src, group=groups.ctrl, tag=TAG_FORWARD)
    header = head.tolist()
    body: list[int] = []
    if codec.body_len(header):
        buf = torch.empty(codec.body_len(header), dtype=torch.long)
        dist.recv(buf, src, group=groups.ctrl, tag=TAG_FORWARD)
        body = buf.tolist()
    schedule = codec.decode(header, body, _recv_requests(groups, link, header), table, link.requests)
    if schedule.stop:
        return schedule, None
    hidden = torch.empty((schedule.n_tokens, hidden_size), dtype=dtype, device=groups.data_device)
    if receive_hidden:
        dist.recv(hidden, src, group=groups.data, tag=TAG_FORWARD)
    return schedule, hidden


# ------------------------------------------------------------------ back (sampled ids)
def send_tokens(groups: Groups, dst: int, mb_id: int, ids: list[int], sat: bool) -> None:
    """The ids of one micro-batch; without SAT after a header [op, id, n]."""
    if not sat:
        header = torch.tensor([OP_TOKENS, mb_id, len(ids)] + [0] * (HEADER_LEN - 3), dtype=torch.long)
        groups.isend(header, dst, TAG_BACK, "meta").wait()
    if ids:
        groups.isend(torch.tensor(ids, dtype=torch.long), dst, TAG_BACK, "data").wait()


def send_back_stop(groups: Groups, dst: int) -> None:
    """Without SAT: the end of the ids coming back."""
    header = torch.tensor([OP_STOP] + [0] * (HEADER_LEN - 1), dtype=torch.long)
    groups.isend(header, dst, TAG_BACK, "meta").wait()


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
