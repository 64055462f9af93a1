"""Client-side page tables for schedulers.

A PageTable tracks, per sequence, the pages it owns (in token order) and its length in tokens,
allocates pages from the server as sequences grow, builds the CSR arrays that Prefill and Decode
take (attention.proto: qo_indptr, kv_indptr, kv_indices, kv_last_page_len) and frees a finished
sequence's pages. AsyncPageTable does the same through an AsyncClient.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np


class PageAllocator(Protocol):
    """What a PageTable needs from the server; attnserve.Client satisfies it."""

    def allocate_pages(self, num_pages: int, pool: str = "") -> list[int]: ...

    def free_pages(self, page_ids: Sequence[int], pool: str = "") -> int: ...


class AsyncPageAllocator(Protocol):
    """What an AsyncPageTable needs from the server; attnserve.AsyncClient satisfies it."""

    async def allocate_pages(self, num_pages: int, pool: str = "") -> list[int]: ...

    async def free_pages(self, page_ids: Sequence[int], pool: str = "") -> int: ...


class BatchCsr(NamedTuple):
    """Page table of one batch in CSR form, all int32 arrays.

    qo_indptr [batch+1]: query rows of sequence b are qo_indptr[b] .. qo_indptr[b+1].
    kv_indptr [batch+1]: sequence b owns kv_indices[kv_indptr[b] .. kv_indptr[b+1]].
    kv_indices [kv_indptr[batch]]: page ids in token order.
    kv_last_page_len [batch] (or [batch+1], the last entry ignored): tokens in each sequence's
      last page, 0 for a sequence without pages; None is allowed when page_size is 1.
    """

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray | None

    @property
    def batch_size(self) -> int:
        return len(self.kv_indptr) - 1

    def q_lens(self) -> np.ndarray:
        """Query tokens per sequence, [batch]."""
        return np.diff(self.qo_indptr)

    def kv_lens(self, page_size: int) -> np.ndarray:
        """Tokens per sequence [batch]: (pages - 1) * page_size + last page len; 0 without pages."""
        num_pages = np.diff(self.kv_indptr)
        if self.kv_last_page_len is None:
            if page_size != 1:
                raise ValueError("kv_last_page_len may only be omitted when page_size is 1")
            return num_pages
        last = self.kv_last_page_len[: self.batch_size]
        return np.where(num_pages > 0, (num_pages - 1) * page_size + last, 0)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold num_tokens tokens."""
    return -(-num_tokens // page_size)


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class _PageBook:
    """The bookkeeping PageTable and AsyncPageTable share: per-sequence pages and lengths, and
    the CSR arrays of a batch. It never calls the server."""

    def __init__(self, pool: str, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._pool = pool
        self._page_size = page_size
        self._seqs: dict[Hashable, _Sequence] = {}

    @property
    def pool(self) -> str:
        return self._pool

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: Hashable) -> int:
        """Tokens of the sequence, counting every reserved token."""
        return self._seqs[seq_id].length

    def pages(self, seq_id: Hashable) -> list[int]:
        """Page ids of the sequence in token order (a copy)."""
        return list(self._seqs[seq_id].pages)

    def num_pages(self) -> int:
        """Pages held by all sequences together."""
        return sum(len(s.pages) for s in self._seqs.values())

    def pages_needed(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """Pages to allocate before the sequence (new or not) can grow by num_new_tokens."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._seqs.get(seq_id, _Sequence())
        return max(0, pages_for(seq.length + num_new_tokens, self._page_size) - len(seq.pages))

    def csr(self, seq_ids: Sequence[Hashable], q_lens: Sequence[int] | None = None) -> BatchCsr:
        """The batch's CSR arrays, sequences in the order given.

        q_lens gives the query rows of each sequence (default: one per sequence, as in Decode).
        It is not checked against the lengths: rows beyond a sequence's length see no key.
        """
        if q_lens is None:
            q_lens = [1] * len(seq_ids)
        if len(q_lens) != len(seq_ids):
            raise ValueError(f"{len(q_lens)} q_lens for {len(seq_ids)} sequences")
        seqs = [self._seqs[s] for s in seq_ids]
        kv_indices = [p for s in seqs for p in s.pages]
        return BatchCsr(
            qo_indptr=_indptr(q_lens),
            kv_indptr=_indptr([len(s.pages) for s in seqs]),
            kv_indices=np.asarray(kv_indices, dtype=np.int32),
            kv_last_page_len=np.asarray([self._last_page_len(s) for s in seqs], dtype=np.int32),
        )

    def _grow(self, seq_id: Hashable, num_new_tokens: int, new_pages: Sequence[int]) -> list[int]:
        """Records num_new_tokens more tokens held in the sequence's pages plus new_pages (which
        must be exactly the pages_needed); returns new_pages as a list."""
        expected = self.pages_needed(seq_id, num_new_tokens)
        pages = list(new_pages)
        if len(pages) != expected:
            raise RuntimeError(f"asked for {expected} pages, the allocator returned {len(pages)}")
        seq = self._seqs.setdefault(seq_id, _Sequence())
        seq.pages.extend(pages)
        seq.length += num_new_tokens
        return pages

    def _last_page_len(self, seq: _Sequence) -> int:
        if not seq.pages:
            return 0
        return seq.length - (len(seq.pages) - 1) * self._page_size


class PageTable(_PageBook):
    """Per-sequence page lists and lengths over one pool, allocating through a sync client.

    Not thread-safe. State changes only after the server call it depends on succeeded, so an
    exception (e.g. attnserve.PoolExhausted) leaves the table as it was.
    """

    def __init__(self, allocator: PageAllocator, pool: str, page_size: int) -> None:
        super().__init__(pool, page_size)
        self._allocator = allocator

    def reserve(self, seq_id: Hashable, num_new_tokens: int) -> list[int]:
        """Grows the sequence (created if new) by num_new_tokens tokens.

        Allocates the missing pages in one AllocatePages call and returns the new page ids. The
        tokens count as present from now on: csr() describes the table after their append.
        """
        missing = self.pages_needed(seq_id, num_new_tokens)
        new_pages = self._allocator.allocate_pages(missing, pool=self._pool) if missing else []
        return self._grow(seq_id, num_new_tokens, new_pages)

    def free(self, seq_id: Hashable) -> None:
        """Returns the sequence's pages to the pool and forgets the sequence."""
        pages = self._seqs[seq_id].pages
        if pages:
            self._allocator.free_pages(pages, pool=self._pool)
        del self._seqs[seq_id]

    def free_all(self) -> None:
        """Frees every sequence."""
        for seq_id in self.seq_ids:
            self.free(seq_id)


class AsyncPageTable(_PageBook):
    """PageTable for asyncio schedulers, allocating through an AsyncClient.

    Its reserve / free / free_all are coroutines, serialized by a lock so that tasks sharing the
    table never allocate twice for the same pages. Same guarantees as PageTable otherwise.
    """

    def __init__(self, allocator: AsyncPageAllocator, pool: str, page_size: int) -> None:
        super().__init__(pool, page_size)
        self._allocator = allocator
        self._lock = asyncio.Lock()

    async def reserve(self, seq_id: Hashable, num_new_tokens: int) -> list[int]:
        """Grows the sequence (created if new) by num_new_tokens tokens (see PageTable)."""
        async with self._lock:
            missing = self.pages_needed(seq_id, num_new_tokens)
            new_pages = (
                await self._allocator.allocate_pages(missing, pool=self._pool) if missing else []
            )
            return self._grow(seq_id, num_new_tokens, new_pages)

    async def free(self, seq_id: Hashable) -> None:
        """Returns the sequence's pages to the pool and forgets the sequence."""
        async with self._lock:
            pages = self._seqs[seq_id].pages
            if pages:
                await self._allocator.free_pages(pages, pool=self._pool)
            del self._seqs[seq_id]

    async def free_all(self) -> None:
        """Frees every sequence."""
        for seq_id in self.seq_ids:
            await self.free(seq_id)


def _indptr(counts: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=out[1:])
    return out
