"""Point-to-point messages between stages, over torch.distributed.

Two directions, each FIFO:
- forward, stage j -> j+1 (tag 0): a header [op, micro-batch id, segments, tokens, ...], the
  segments [n, 6] (seq, slot, start, length, sample, prefill), then the hidden states [tokens, hidden];
- back, last stage -> stage 0 (tag 1): a header [op, micro-batch id, n] and the n sampled ids.

Headers and segments always travel on a gloo group (small, CPU); the hidden states travel on the
data group: NCCL when every stage is a distinct CUDA device, else the same gloo group (CUDA tensors
are staged through host memory). Splitting control from data is the seam where SiPipe's
structure-aware transfers go.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpipe.errors import HpipeError
from hpipe.net import choose_gloo_interface
from hpipe.runtime.kv import Segment

OP_WORK, OP_STOP, OP_TOKENS = 1, 2, 3
HEADER_LEN = 8
SEGMENT_FIELDS = 6
TAG_FORWARD, TAG_BACK = 0, 1


def choose_backend(devices: list[str]) -> str:
    """NCCL when every stage sits on its own CUDA device, else gloo."""
    if all(d.startswith("cuda") for d in devices) and torch.cuda.is_available() and dist.is_nccl_available():
        indices = [int(d.split(":")[1]) if ":" in d else 0 for d in devices]
        if len(set(indices)) == len(indices):
            return "nccl"
    return "gloo"


@dataclass
class Groups:
    backend: str
    ctrl: object          # gloo process group for headers and tokens
    data: object          # process group for hidden states
    data_device: torch.device


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
        return Groups(backend, ctrl, dist.group.WORLD, torch.device(devices[rank]))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return Groups(backend, dist.group.WORLD, dist.group.WORLD, torch.device("cpu"))


class Pending:
    """Handles of in-flight sends; the tensors stay referenced until the sends complete."""

    def __init__(self):
        self.works: list = []
        self.tensors: list = []

    def wait(self):
        for w in self.works:
            w.wait()
        self.works.clear()
        self.tensors.clear()


def isend_work(groups: Groups, dst: int, mb_id: int, segments: list[Segment], hidden: torch.Tensor | None,
               pending: Pending) -> None:
    n_tokens = 0 if hidden is None else hidden.shape[0]
    header = torch.tensor([OP_WORK, mb_id, len(segments), n_tokens] + [0] * (HEADER_LEN - 4), dtype=torch.long)
    segs = torch.tensor([[s.seq, s.slot, s.start, s.length, int(s.sample), int(s.prefill)] for s in segments],
                        dtype=torch.long).reshape(-1, SEGMENT_FIELDS)
    pending.works.append(dist.isend(header, dst, group=groups.ctrl, tag=TAG_FORWARD))
    pending.works.append(dist.isend(segs, dst, group=groups.ctrl, tag=TAG_FORWARD))
    pending.tensors += [header, segs]
    if hidden is not None:
        payload = hidden.contiguous() if groups.backend == "nccl" else hidden.detach().to("cpu").contiguous()
        pending.works.append(dist.isend(payload, dst, group=groups.data, tag=TAG_FORWARD))
        pending.tensors.append(payload)


def send_stop(groups: Groups, dst: int, tag: int = TAG_FORWARD) -> None:
    header = torch.tensor([OP_STOP] + [0] * (HEADER_LEN - 1), dtype=torch.long)
    dist.send(header, dst, group=groups.ctrl, tag=tag)


def irecv_header(groups: Groups, src: int, tag: int = TAG_FORWARD):
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    return header, dist.irecv(header, src, group=groups.ctrl, tag=tag)


def recv_work_body(groups: Groups, src: int, header: torch.Tensor, hidden_size: int, dtype: torch.dtype):
    """After a WORK header arrived: receives its segments and hidden states."""
    _, mb_id, n_segs, n_tokens = header[:4].tolist()
    segs = torch.empty((n_segs, SEGMENT_FIELDS), dtype=torch.long)
    dist.recv(segs, src, group=groups.ctrl, tag=TAG_FORWARD)
    segments = [Segment(seq, slot, start, length, bool(sample), bool(prefill))
                for seq, slot, start, length, sample, prefill in segs.tolist()]
    hidden = torch.empty((n_tokens, hidden_size), dtype=dtype, device=groups.data_device)
    dist.recv(hidden, src, group=groups.data, tag=TAG_FORWARD)
    return mb_id, segments, hidden


def send_tokens(groups: Groups, dst: int, mb_id: int, ids: list[int]) -> None:
    header = torch.tensor([OP_TOKENS, mb_id, len(ids)] + [0] * (HEADER_LEN - 3), dtype=torch.long)
    dist.send(header, dst, group=groups.ctrl, tag=TAG_BACK)
    if ids:
        dist.send(torch.tensor(ids, dtype=torch.long), dst, group=groups.ctrl, tag=TAG_BACK)


def recv_tokens(groups: Groups, src: int) -> tuple[int, int, list[int]]:
    """Blocks for the next message on the back path: (op, micro-batch id, sampled ids)."""
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    dist.recv(header, src, group=groups.ctrl, tag=TAG_BACK)
    op, mb_id, n = header[:3].tolist()
    ids: list[int] = []
    if op == OP_TOKENS and n:
        buf = torch.empty(n, dtype=torch.long)
        dist.recv(buf, src, group=groups.ctrl, tag=TAG_BACK)
        ids = buf.tolist()
    return op, mb_id, ids
