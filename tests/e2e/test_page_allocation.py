"""AllocatePages / FreePages: all or nothing, and errors that change nothing."""

from __future__ import annotations

import grpc
import pytest

from attnserve import AttnError, Client

POOL = "gqa"
Code = grpc.StatusCode


def free_count(client: Client, pool: str = POOL) -> int:
    return client.pool_info(pool).free_pages


def expect_error(codes: set[Code], call, *args, **kwargs) -> AttnError:
    """Runs call, asserts it fails with one of codes and a message; returns the error."""
    with pytest.raises(AttnError) as err:
        call(*args, **kwargs)
    assert err.value.code in codes, f"{err.value} (expected {sorted(c.name for c in codes)})"
    assert err.value.message, "error without a message"
    return err.value


def test_allocate_returns_distinct_ids_in_range(client: Client) -> None:
    pool = client.pool_info(POOL)
    pages = client.allocate_pages(10, pool=POOL)
    try:
        assert len(set(pages)) == 10
        assert all(0 <= p < pool.total_pages for p in pages)
        assert free_count(client) == pool.free_pages - 10
        more = client.allocate_pages(1, pool=POOL)
        assert not set(more) & set(pages)
        assert client.free_pages(more, pool=POOL) == pool.free_pages - 10
    finally:
        assert client.free_pages(pages, pool=POOL) == pool.free_pages


def test_over_capacity_allocates_nothing(client: Client) -> None:
    held = client.allocate_pages(10, pool=POOL)  # so that free + 1 is within 1 .. total_pages
    try:
        before = free_count(client)
        expect_error({Code.RESOURCE_EXHAUSTED}, client.allocate_pages, before + 1, pool=POOL)
        assert free_count(client) == before
    finally:
        client.free_pages(held, pool=POOL)


def test_exhausting_the_pool(client: Client) -> None:
    total = client.pool_info(POOL).total_pages
    pages = client.allocate_pages(free_count(client), pool=POOL)
    try:
        assert free_count(client) == 0
        assert sorted(pages) == list(range(total))
        expect_error({Code.RESOURCE_EXHAUSTED}, client.allocate_pages, 1, pool=POOL)
        assert free_count(client) == 0
        assert free_count(client, "mla") == client.pool_info("mla").total_pages  # pools apart
    finally:
        assert client.free_pages(pages, pool=POOL) == total


@pytest.mark.parametrize("num_pages", [0, -1])
def test_allocate_needs_a_positive_count(client: Client, num_pages: int) -> None:
    before = free_count(client)
    expect_error({Code.INVALID_ARGUMENT}, client.allocate_pages, num_pages, pool=POOL)
    assert free_count(client) == before


def test_allocate_more_than_the_pool_holds(client: Client) -> None:
    # num_pages is documented as 1 .. total_pages; either code tells the caller it can't fit.
    total = client.pool_info(POOL).total_pages
    expect_error(
        {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED},
        client.allocate_pages,
        total + 1,
        pool=POOL,
    )


def test_pool_name_is_checked(client: Client) -> None:
    expect_error({Code.NOT_FOUND, Code.INVALID_ARGUMENT}, client.allocate_pages, 1, pool="nope")
    # "" selects the only pool; this server has several.
    expect_error({Code.INVALID_ARGUMENT}, client.allocate_pages, 1, pool="")
    expect_error({Code.NOT_FOUND, Code.INVALID_ARGUMENT}, client.free_pages, [0], pool="nope")


def test_free_unallocated_frees_nothing(client: Client) -> None:
    pages = client.allocate_pages(3, pool=POOL)
    spare = client.allocate_pages(1, pool=POOL)
    client.free_pages(spare, pool=POOL)  # spare[0] is now known to be unallocated
    before = free_count(client)
    try:
        expect_error({Code.FAILED_PRECONDITION}, client.free_pages, pages + spare, pool=POOL)
        assert free_count(client) == before
    finally:
        client.free_pages(pages, pool=POOL)  # still allocated: succeeds
    expect_error({Code.FAILED_PRECONDITION}, client.free_pages, pages[:1], pool=POOL)  # twice


def test_free_duplicates_frees_nothing(client: Client) -> None:
    pages = client.allocate_pages(2, pool=POOL)
    before = free_count(client)
    try:
        expect_error(
            {Code.INVALID_ARGUMENT}, client.free_pages, [pages[0], pages[1], pages[0]], pool=POOL
        )
        assert free_count(client) == before
    finally:
        client.free_pages(pages, pool=POOL)


@pytest.mark.parametrize("bad", ["negative", "total"])
def test_free_out_of_range_frees_nothing(client: Client, bad: str) -> None:
    total = client.pool_info(POOL).total_pages
    pages = client.allocate_pages(2, pool=POOL)
    before = free_count(client)
    try:
        bad_id = -1 if bad == "negative" else total
        expect_error({Code.INVALID_ARGUMENT}, client.free_pages, [*pages, bad_id], pool=POOL)
        assert free_count(client) == before
    finally:
        client.free_pages(pages, pool=POOL)
