"""AsyncClient and AsyncPageTable over real gRPC against the fake server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from attnserve import (
    AsyncClient,
    AsyncPageTable,
    AsyncPlan,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    PoolExhausted,
    Unavailable,
)
from attnserve.reference import CacheMirror, check_close, gqa_reference, mla_reference
from attnserve.tensors import bf16_round
from attnserve.v1 import attention_pb2 as pb


def run(
    address: str, body: Callable[[AsyncClient], Awaitable[None]], **options: float | bool
) -> None:
    """Runs body with a fresh AsyncClient of address in a new event loop."""

    async def main() -> None:
        async with AsyncClient(address, **{"timeout": 10.0, **options}) as client:
            await body(client)

    asyncio.run(main())


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return bf16_round(rng.standard_normal(shape, dtype=np.float32))


def test_server_info_pools_and_pages(fake_address: str) -> None:
    async def body(client: AsyncClient) -> None:
        assert client.address == fake_address
        assert [p.name for p in (await client.server_info()).pools] == ["gqa", "mla"]
        assert (await client.pool_info("mla")).kind == pb.POOL_KIND_MLA
        with pytest.raises(ValueError, match="2 pools"):
            await client.pool_info()
        pages = await client.allocate_pages(5, pool="gqa")
        assert (await client.pool_info("gqa")).free_pages == 59
        assert await client.free_pages(pages, pool="gqa") == 64
        with pytest.raises(PoolExhausted):
            await client.allocate_pages(65, pool="gqa")
        with pytest.raises(FailedPrecondition):
            await client.free_pages(pages, pool="gqa")

    run(fake_address, body)


def test_prefill_and_decode_match_the_reference(fake_address: str) -> None:
    async def body(client: AsyncClient) -> None:
        pool = await client.pool_info("gqa")
        table = AsyncPageTable(client, "gqa", pool.page_size)
        mirror = CacheMirror.for_pool(pool)
        rng = np.random.default_rng(1)
        await table.reserve("a", 7)
        await table.reserve("b", 3)
        csr = table.csr(["a", "b"], q_lens=[7, 3])
        q, k, v = randn(rng, 10, 4, 8), randn(rng, 10, 2, 8), randn(rng, 10, 2, 8)
        result = await client.prefill(0, q, csr, pool="gqa", k_new=k, v_new=v, return_lse=True)
        mirror.append(0, csr, {"k": k, "v": v})
        out, lse = gqa_reference(mirror, 0, csr, q)
        assert check_close(result.output, out).ok and check_close(result.lse, lse).ok

        for s in ("a", "b"):
            await table.reserve(s, 1)
        dcsr = table.csr(["a", "b"])
        q, k, v = randn(rng, 2, 4, 8), randn(rng, 2, 2, 8), randn(rng, 2, 2, 8)
        result = await client.decode(0, q, dcsr, pool="gqa", k_new=k, v_new=v)
        mirror.append(0, dcsr, {"k": k, "v": v})
        assert check_close(result.output, gqa_reference(mirror, 0, dcsr, q)[0]).ok
        assert result.lse is None and result.timings.batch_requests == 1
        await table.free_all()
        assert (await client.pool_info("gqa")).free_pages == 64

    run(fake_address, body)


def test_mla_and_concurrent_calls(fake_address: str) -> None:
    """Several tasks share one client and one AsyncPageTable."""

    async def body(client: AsyncClient) -> None:
        pool = await client.pool_info("mla")
        table = AsyncPageTable(client, "mla", pool.page_size)
        mirror = CacheMirror.for_pool(pool)
        rng = np.random.default_rng(2)
        seqs = [f"s{i}" for i in range(4)]
        await asyncio.gather(*(table.reserve(s, 5 + 3 * i) for i, s in enumerate(seqs)))
        lens = [table.length(s) for s in seqs]
        assert lens == [5, 8, 11, 14] and table.num_pages() == 6
        csr = table.csr(seqs, q_lens=lens)
        n = sum(lens)
        ckv, kpe = randn(rng, n, 512), randn(rng, n, 64)
        q, q_pe = randn(rng, n, 2, 512), randn(rng, n, 2, 64)
        await client.prefill(
            0, q, csr, pool="mla", q_pe=q_pe, ckv_new=ckv, kpe_new=kpe, sm_scale=0.1
        )
        mirror.append(0, csr, {"ckv": ckv, "kpe": kpe})

        async def decode(s: str) -> None:
            one = table.csr([s])
            q, q_pe = randn(rng, 1, 2, 512), randn(rng, 1, 2, 64)
            result = await client.decode(0, q, one, pool="mla", q_pe=q_pe, sm_scale=0.1)
            assert check_close(result.output, mla_reference(mirror, 0, one, q, q_pe, 0.1)[0]).ok

        await asyncio.gather(*(decode(s) for s in seqs))
        await table.free_all()
        assert table.num_pages() == 0

    run(fake_address, body)


def test_a_plan_serves_concurrent_layers(fake_address: str) -> None:
    """AsyncClient.plan(): every layer's call names the plan (their tasks run concurrently) and
    matches the reference; its pages cannot be freed until `async with` releases it, once."""

    async def body(client: AsyncClient) -> None:
        pool = await client.pool_info("gqa")
        table = AsyncPageTable(client, "gqa", pool.page_size)
        mirror = CacheMirror.for_pool(pool)
        rng = np.random.default_rng(3)
        for s, n in (("a", 6), ("b", 9)):
            await table.reserve(s, n)
        csr = table.csr(["a", "b"], q_lens=[6, 9])
        inputs = [(randn(rng, 15, 4, 8), randn(rng, 15, 2, 8), randn(rng, 15, 2, 8))
                  for _ in range(pool.num_layers)]  # fmt: skip
        async with await client.plan(csr, op="prefill", pool="gqa", name="p0") as plan:
            assert isinstance(plan, AsyncPlan) and plan.prefill
            assert (plan.batch, plan.total_q, plan.num_pages) == (2, 15, len(csr.kv_indices))
            results = await asyncio.gather(*(
                client.prefill(layer, q, plan, pool="gqa", k_new=k, v_new=v, return_lse=True)
                for layer, (q, k, v) in enumerate(inputs)))  # fmt: skip
            with pytest.raises(FailedPrecondition, match="plan"):
                await client.free_pages(csr.kv_indices[:1].tolist(), pool="gqa")
            with pytest.raises(ValueError, match="prefill plan"):
                await client.decode(0, inputs[0][0][:2], plan, pool="gqa")
        assert plan.released
        for layer, ((q, k, v), result) in enumerate(zip(inputs, results, strict=True)):
            mirror.append(layer, csr, {"k": k, "v": v})
            out, lse = gqa_reference(mirror, layer, csr, q)
            assert check_close(result.output, out).ok and check_close(result.lse, lse).ok
        with pytest.raises(ValueError, match="released"):
            await client.prefill(0, inputs[0][0], plan, pool="gqa")
        with pytest.raises(NotFound):
            await client.release_plan("p0")

        decode = await client.plan(table.csr(["a", "b"]), pool="gqa")
        assert repr(decode) == "AsyncPlan('step', decode, batch=2, pages=5)"
        q = randn(rng, 2, 4, 8)
        result = await client.decode(1, q, decode, pool="gqa")
        assert check_close(result.output, gqa_reference(mirror, 1, table.csr(["a", "b"]), q)[0]).ok
        await asyncio.gather(decode.release(), decode.release())  # one ReleasePlan: no NotFound
        await table.free_all()
        assert (await client.pool_info("gqa")).free_pages == 64

    run(fake_address, body)


def test_replaced_plans_and_plans_of_a_closed_session_are_released(fake_address: str) -> None:
    async def body(client: AsyncClient) -> None:
        table = AsyncPageTable(client, "gqa", 4)
        await table.reserve("a", 5)
        first = await client.plan(table.csr(["a"]), pool="gqa")
        second = await client.plan(table.csr(["a"]), pool="gqa")
        assert first.released and not second.released
        await first.release()  # must not drop `second`, which has its name
        q = randn(np.random.default_rng(4), 1, 4, 8)
        await client.decode(0, q, second, pool="gqa")
        other = await client.plan(table.csr(["a"]), pool="gqa", name="other")
        await client.close_session()
        assert second.released and other.released
        with pytest.raises(ValueError, match="released"):
            await client.decode(0, q, other, pool="gqa")
        await table.free_all()  # the fake keeps pages across sessions

    run(fake_address, body)


def test_deadlines_and_unreachable_servers(echo_address: str) -> None:
    async def slow(client: AsyncClient) -> None:
        with pytest.raises(DeadlineExceeded):
            await client.server_info()
        assert (await client.server_info(timeout=5.0)).version == "slow"

    async def unreachable(client: AsyncClient) -> None:
        with pytest.raises(Unavailable):
            await client.server_info()

    async def waits_for_the_server(client: AsyncClient) -> None:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await client.server_info()
        assert time.monotonic() - start >= 1.0

    run(echo_address, slow, timeout=0.05)
    run("127.0.0.1:1", unreachable, timeout=2.0, wait_for_ready=False)
    run("127.0.0.1:1", waits_for_the_server, timeout=1.0)
