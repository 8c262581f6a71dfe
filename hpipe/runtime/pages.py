"""A sequence's KV pages and the segments of a micro-batch: the bookkeeping every stage shares,
apart from the torch store that holds the keys and values (`hpipe.runtime.kv`).

Token position p of a sequence lives in page `pages[p // page_size]` at row p % page_size. Page 0
is the scratch page: never handed out, it takes the writes of padded rows (the static decode path)
and stands in for positions a row does not have (masked).

Who owns which page is decided in one place. Stage 0's scheduler allocates pages from the pool
(`PagePool`) and every segment of a micro-batch carries the pages of its sequence
(`Segment.pages`); a schedule sends only the pages a segment adds (`added_pages`) and every other
stage rebuilds the whole list with its `PageTable` (indexed by the sequence's slot, its row in the
table), in the schedule's order.

Pure Python (no torch): the scheduler and the schedule's codec are tested alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SCRATCH_PAGE", "PagePool", "PageTable", "Segment", "added_pages", "layout_of", "microbatch_kind",
           "pages_needed"]

SCRATCH_PAGE = 0


@dataclass(frozen=True)
class Segment:
    """Tokens [start, start + length) of one sequence, processed in one micro-batch."""

    seq: int      # request index (stable over the run)
    slot: int     # the sequence's row in every stage's page table (reused once it ends)
    start: int    # tokens of this sequence already in the cache = position of the first token
    length: int
    sample: bool  # the segment ends at a position whose next token is sampled
    prefill: bool = False  # its tokens are the prompt's (else: tokens the pipeline generated)
    pages: tuple[int, ...] = ()   # the KV pages of positions [0, end) (empty: the store's own per slot)

    @property
    def end(self) -> int:
        return self.start + self.length


def pages_needed(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def microbatch_kind(segments: list[Segment]) -> str:
    """The one definition of a micro-batch's kind, the same on every stage (timelines, plan
    checks): "prefill" (prompt tokens only), "decode" (generated tokens only) or "mixed"."""
    kinds = {s.prefill for s in segments}
    if len(kinds) > 1:
        return "mixed"
    return "prefill" if True in kinds else "decode"


def layout_of(segments: list[Segment]) -> str:
    return "rows" if len({s.length for s in segments}) == 1 else "packed"


class PagePool:
    """Stage 0's allocator: which pages are free (page 0, the scratch page, never is)."""

    def __init__(self, pages: int, page_size: int):
        if pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is scratch), got {pages}")
        self.pages, self.page_size = pages, page_size
        self.free = list(range(pages - 1, 0, -1))

    @property
    def usable(self) -> int:
        return self.pages - 1

    @property
    def free_rate(self) -> float:
        return len(self.free) / self.usable

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))


class PageTable:
    """Every stage but the first: the pages of each slot, rebuilt from what the schedule adds."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.rows: dict[int, list[int]] = {}

    def resolve(self, seg: Segment, added: list[int]) -> Segment:
        keep = pages_needed(seg.start, self.page_size)
        row = self.rows.get(seg.slot, [])[:keep] + list(added)
        self.rows[seg.slot] = row
        return Segment(seg.seq, seg.slot, seg.start, seg.length, seg.sample, seg.prefill, tuple(row))




def added_pages(seg: Segment, page_size: int) -> tuple[int, ...]:
    """What a segment adds to its sequence's page table: the pages past those holding [0, start)."""
    return seg.pages[pages_needed(seg.start, page_size):]
