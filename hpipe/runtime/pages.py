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

Prefix caching (vLLM's automatic prefix caching, on stage 0 alone): a full page of a sequence's
tokens is registered under a key chained over every token before it (`page_keys`), and stays
cached after the sequence ends, counted by the sequences using it and, once none does, kept in
least-recently-used order until the pool needs the page (`PagePool.take` evicts). A new
sequence's longest cached prefix (`PagePool.lookup`) becomes the head of its page list and its
first segment starts after it; that segment is `fresh`, carrying its whole page list, so every
other stage's table follows the one decision. A sequence writes only positions past its cached
prefix, in pages of its own: a cached page is never written while shared. Every stage holds the
keys and values of a cached page for its own layers (it computed them for the sequence that
registered it), and runs micro-batches in the schedules' order, so a hit reads what was written.

Pure Python (no torch): the scheduler and the schedule's codec are tested alone.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import math
from dataclasses import dataclass

__all__ = ["SCRATCH_PAGE", "PagePool", "PageTable", "Segment", "added_pages", "layout_of", "microbatch_kind",
           "page_keys", "pages_needed"]

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
    fresh: bool = False   # its sequence's first segment after a cached prefix: it carries every page
    scored: bool = False  # every row's logits are wanted, not only the sampled one's (prompt log-probabilities)
    draft: tuple[int, ...] = ()   # speculative decoding: the proposed tokens, its last len(draft) rows' inputs
    prompt: int = 0       # its sequence's prompt length: positions from it on hold generated tokens (0: not told)

    @property
    def sampled_rows(self) -> int:
        """Rows whose logits are sampled: its last one, and with a draft every proposed token's too."""
        return (1 + len(self.draft)) if self.sample else 0

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


def page_keys(keys: list[bytes], tokens, page_size: int, pages: int, salt: bytes = b"") -> list[bytes]:
    """`keys` extended to the first `pages` full pages of `tokens` (and returned): each key a
    digest of its page's tokens chained over every page before it (and `salt`: what else the KV
    depends on), so that a key names a whole prefix, never a page alone. A sequence keeps its keys:
    positions never change their token."""
    for i in range(len(keys), pages):
        chunk = array.array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        keys.append(hashlib.blake2b((keys[-1] if keys else salt) + chunk, digest_size=16).digest())
    return keys


class PagePool:
    """Stage 0's allocator: which pages are free (page 0, the scratch page, never is) and, with
    `caching`, which hold a cached prefix: in use (`refs`, by the sequences whose tables hold them)
    or evictable (`lru`, oldest first), the latter as good as free when pages are needed."""

    def __init__(self, pages: int, page_size: int, caching: bool = False):
        if pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is scratch), got {pages}")
        self.pages, self.page_size, self.caching = pages, page_size, caching
        self.free = list(range(pages - 1, 0, -1))
        self.page_of: dict[bytes, int] = {}          # cached prefix key -> its page
        self.key_of: dict[int, bytes] = {}           # and back
        self.refs: dict[int, int] = {}               # cached pages in use -> sequences using them
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()   # cached, unused
        self.hit_tokens = self.asked_tokens = 0

    @property
    def usable(self) -> int:
        return self.pages - 1

    @property
    def available(self) -> int:
        """Pages a sequence can take now: the free ones and the cached ones nobody uses."""
        return len(self.free) + len(self.lru)

    @property
    def free_rate(self) -> float:
        return self.available / self.usable

    @property
    def cached(self) -> int:
        return len(self.key_of)

    def take(self, n: int) -> list[int] | None:
        if n > self.available:
            return None
        out = [self.free.pop() for _ in range(min(n, len(self.free)))]
        while len(out) < n:                           # evict the least recently used cached pages
            page, _ = self.lru.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
            out.append(page)
        return out

    def give_back(self, pages: list[int]) -> None:
        for page in reversed(pages):
            if page not in self.key_of:
                self.free.append(page)
                continue
            self.refs[page] -= 1
            if not self.refs[page]:
                del self.refs[page]
                self.lru[page] = None

    def cached_prefix(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest prefix of `keys` that is cached (not taken: see `pin`)."""
        found = []
        for key in keys if self.caching else ():
            page = self.page_of.get(key)
            if page is None:
                break
            found.append(page)
        return found

    def pin(self, pages: list[int], asked_tokens: int) -> None:
        """Cached pages now in use by one more sequence (it gives them back like any other)."""
        for page in pages:
            if page in self.lru:
                del self.lru[page]
            self.refs[page] = self.refs.get(page, 0) + 1
        self.asked_tokens += asked_tokens
        self.hit_tokens += len(pages) * self.page_size

    def register(self, pages: list[int], keys: list[bytes]) -> None:
        """Caches a sequence's full pages whose positions all hold their tokens' keys and values
        (`keys`, one per such page): a page already cached, or whose prefix another page holds,
        stays as it is."""
        for page, key in zip(pages, keys if self.caching else ()):
            if page in self.key_of or key in self.page_of:
                continue
            self.page_of[key], self.key_of[page] = page, key
            self.refs[page] = 1                       # the sequence registering it holds it


class PageTable:
    """Every stage but the first: the pages of each slot, rebuilt from what the schedule adds."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.rows: dict[int, list[int]] = {}

    def resolve(self, seg: Segment, added: list[int]) -> Segment:
        keep = 0 if seg.fresh else pages_needed(seg.start, self.page_size)
        row = self.rows.get(seg.slot, [])[:keep] + list(added)
        self.rows[seg.slot] = row
        return dataclasses.replace(seg, pages=tuple(row))




def added_pages(seg: Segment, page_size: int) -> tuple[int, ...]:
    """What a segment adds to its sequence's page table: the pages past those holding [0, start),
    or every page (a fresh segment: its head is a cached prefix)."""
    return seg.pages if seg.fresh else seg.pages[pages_needed(seg.start, page_size):]
