"""PageTable against a fake allocator."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from attnserve.pages import AsyncPageTable, BatchCsr, PageTable, pages_for


class FakeAllocator:
    """Hands out ids from the top of a free list (so ids are not contiguous across calls)."""

    def __init__(self, total: int) -> None:
        self.free = list(range(total))
        self.calls: list[tuple[str, int | list[int], str]] = []

    def allocate_pages(self, num_pages: int, pool: str = "") -> list[int]:
        self.calls.append(("allocate", num_pages, pool))
        if num_pages > len(self.free):
            raise RuntimeError("pool exhausted")
        taken, self.free = self.free[-num_pages:][::-1], self.free[:-num_pages]
        return taken

    def free_pages(self, page_ids: Sequence[int], pool: str = "") -> int:
        self.calls.append(("free", list(page_ids), pool))
        self.free.extend(page_ids)
        return len(self.free)


def test_pages_for() -> None:
    assert [pages_for(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_reserve_allocates_only_missing_pages() -> None:
    alloc = FakeAllocator(10)
    table = PageTable(alloc, "p", page_size=4)
    assert table.reserve("a", 5) == [9, 8]
    assert table.reserve("a", 3) == []  # 8 tokens still fit in 2 pages
    assert table.reserve("a", 1) == [7]
    assert table.pages("a") == [9, 8, 7]
    assert table.length("a") == 9
    assert alloc.calls == [("allocate", 2, "p"), ("allocate", 1, "p")]


def test_csr_for_a_mixed_batch() -> None:
    table = PageTable(FakeAllocator(20), "p", page_size=4)
    table.reserve("a", 8)  # exact page multiple
    table.reserve("b", 1)
    table.reserve("empty", 0)
    table.reserve("c", 6)
    csr = table.csr(["c", "a", "empty", "b"], q_lens=[6, 3, 2, 1])
    assert all(a.dtype == np.int32 for a in csr)
    np.testing.assert_array_equal(csr.qo_indptr, [0, 6, 9, 11, 12])
    np.testing.assert_array_equal(csr.kv_indptr, [0, 2, 4, 4, 5])
    np.testing.assert_array_equal(
        csr.kv_indices, table.pages("c") + table.pages("a") + table.pages("b")
    )
    np.testing.assert_array_equal(csr.kv_last_page_len, [2, 4, 0, 1])
    np.testing.assert_array_equal(csr.kv_lens(4), [6, 8, 0, 1])
    np.testing.assert_array_equal(csr.q_lens(), [6, 3, 2, 1])
    assert csr.batch_size == 4


def test_csr_defaults_to_one_query_per_sequence() -> None:
    table = PageTable(FakeAllocator(4), "", page_size=16)
    table.reserve(0, 3)
    table.reserve(1, 16)
    np.testing.assert_array_equal(table.csr([0, 1]).qo_indptr, [0, 1, 2])
    with pytest.raises(ValueError, match="q_lens"):
        table.csr([0, 1], q_lens=[1])


def test_kv_lens_with_a_padded_or_omitted_last_page_len() -> None:
    csr = BatchCsr(*(np.asarray(a, np.int32) for a in ([0, 1, 2], [0, 2, 3], [4, 5, 6], [3, 1, 0])))
    np.testing.assert_array_equal(csr.kv_lens(4), [7, 1])
    omitted = csr._replace(kv_last_page_len=None)
    np.testing.assert_array_equal(omitted.kv_lens(1), [2, 1])
    with pytest.raises(ValueError, match="page_size is 1"):
        omitted.kv_lens(4)


def test_failed_allocation_changes_nothing() -> None:
    alloc = FakeAllocator(3)
    table = PageTable(alloc, "p", page_size=2)
    table.reserve("a", 3)
    with pytest.raises(RuntimeError):
        table.reserve("a", 4)  # needs 2 more pages, 1 free
    with pytest.raises(RuntimeError):
        table.reserve("new", 5)
    assert table.length("a") == 3 and len(table.pages("a")) == 2
    assert "new" not in table


def test_short_allocation_is_an_error() -> None:
    class Short(FakeAllocator):
        def allocate_pages(self, num_pages: int, pool: str = "") -> list[int]:
            return super().allocate_pages(num_pages, pool)[:-1]

    with pytest.raises(RuntimeError, match="returned 1"):
        PageTable(Short(5), "p", page_size=1).reserve("a", 2)


def test_free_returns_pages_and_forgets_the_sequence() -> None:
    alloc = FakeAllocator(6)
    table = PageTable(alloc, "p", page_size=2)
    table.reserve("a", 3)
    table.reserve("b", 1)
    table.reserve("empty", 0)
    a_pages = table.pages("a")
    table.free("a")
    assert alloc.calls[-1] == ("free", a_pages, "p")
    assert "a" not in table and table.seq_ids == ["b", "empty"]
    table.free_all()
    assert table.seq_ids == [] and table.num_pages() == 0
    assert sorted(alloc.free) == list(range(6))
    assert sum(1 for c in alloc.calls if c[0] == "free") == 2  # nothing sent for "empty"


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PageTable(FakeAllocator(1), "p", page_size=0)
    with pytest.raises(ValueError):
        PageTable(FakeAllocator(1), "p", page_size=1).reserve("a", -1)


class FakeAsyncAllocator:
    """FakeAllocator behind coroutines that yield to the event loop before answering."""

    def __init__(self, total: int) -> None:
        self.sync = FakeAllocator(total)

    async def allocate_pages(self, num_pages: int, pool: str = "") -> list[int]:
        await asyncio.sleep(0)
        return self.sync.allocate_pages(num_pages, pool)

    async def free_pages(self, page_ids: Sequence[int], pool: str = "") -> int:
        await asyncio.sleep(0)
        return self.sync.free_pages(page_ids, pool)


def test_async_table_matches_the_sync_one() -> None:
    async def main() -> None:
        alloc = FakeAsyncAllocator(10)
        table = AsyncPageTable(alloc, "p", page_size=4)
        assert await table.reserve("a", 5) == [9, 8]
        assert await table.reserve("a", 3) == []
        await table.reserve("b", 1)
        np.testing.assert_array_equal(table.csr(["b", "a"]).kv_last_page_len, [1, 4])
        await table.free("a")
        assert "a" not in table and alloc.sync.calls[-1] == ("free", [9, 8], "p")
        with pytest.raises(RuntimeError):
            await table.reserve("b", 100)
        assert table.length("b") == 1
        await table.free_all()
        assert sorted(alloc.sync.free) == list(range(10))

    asyncio.run(main())


def test_async_table_serializes_concurrent_growth() -> None:
    """Two tasks growing one sequence at once allocate each page once."""

    async def main() -> None:
        alloc = FakeAsyncAllocator(10)
        table = AsyncPageTable(alloc, "p", page_size=4)
        await asyncio.gather(table.reserve("a", 2), table.reserve("a", 2), table.reserve("a", 2))
        assert table.length("a") == 6 and len(table.pages("a")) == 2
        assert len(alloc.sync.free) == 8

    asyncio.run(main())


def test_pages_needed() -> None:
    table = PageTable(FakeAllocator(4), "p", page_size=4)
    assert table.pages_needed("new", 0) == 0 and table.pages_needed("new", 5) == 2
    table.reserve("a", 3)
    assert table.pages_needed("a", 1) == 0 and table.pages_needed("a", 2) == 1
    with pytest.raises(ValueError):
        table.pages_needed("a", -1)
