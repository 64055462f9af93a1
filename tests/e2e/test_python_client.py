"""The Python client's own features against real servers: AsyncClient and AsyncPageTable, the
error classes, retries through a full queue (a private server with a queue of one call), and
Router over several private servers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from attnserve import (
    AsyncClient,
    AsyncPageTable,
    AttnError,
    BatchCsr,
    Client,
    FailedPrecondition,
    HashRing,
    InvalidArgument,
    NotFound,
    PoolExhausted,
    QueueFull,
    RetryPolicy,
    Router,
)
from attnserve.reference import EMPTY_ROW_LSE
from attnserve.tensors import bf16_to_float, float_to_bf16
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import server_config_pb2 as config_pb

from launcher import Launched, launch
from workload import PoolSession, check_result

# Rides out a queue that stays full for a few hundred milliseconds.
PATIENT = RetryPolicy(max_attempts=30, initial_backoff=0.02, max_backoff=0.1)


def small_config(pages: int = 256) -> config_pb.ServerConfig:
    """One GQA pool "p" of one layer (8/2 heads, head_dim 64, page_size 16)."""
    config = config_pb.ServerConfig()
    config.pools.add(name="p", kind=pb.POOL_KIND_GQA, num_layers=1, page_size=16, num_qo_heads=8,
                     num_kv_heads=2, head_dim=64, num_pages=pages)  # fmt: skip
    return config


@pytest.fixture
def private(tmp_path: Path) -> Iterator[Callable[..., Launched]]:
    """Starts private servers (small_config plus flags); each must exit 0 on SIGTERM at the end."""
    started: list[Launched] = []

    def start(*flags: str) -> Launched:
        workdir = tmp_path / f"server{len(started)}"
        workdir.mkdir()
        started.append(launch(workdir, small_config(), *flags))
        return started[-1]

    yield start
    for server in started:  # all drain at once
        server.process.terminate()
    codes = {s.address: s.process.wait(timeout=30) for s in started}
    assert not any(codes.values()), f"exit codes after SIGTERM: {codes}"


def random_bits(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return float_to_bf16(rng.standard_normal(shape, dtype=np.float32))


@pytest.mark.parametrize("pool_name", ["gqa", "mla"])
def test_async_client_and_page_table(server, pool_name: str) -> None:
    """Chunked prefill then decode of three sequences through AsyncClient, layers run
    concurrently, every result checked against the reference."""

    async def main() -> None:
        async with AsyncClient(server.address, timeout=60.0, max_message_bytes=64 << 20) as client:
            pool = await client.pool_info(pool_name)
            session = PoolSession(client, pool, seed=3)  # tokens, mirror and reference only
            table = AsyncPageTable(client, pool.name, pool.page_size)
            seqs = ["a", "b", "c"]
            try:
                for call, q_lens in ((client.prefill, [40, 7, 90]), (client.decode, [1, 1, 1])):
                    await asyncio.gather(
                        *(table.reserve(s, n) for s, n in zip(seqs, q_lens, strict=True))
                    )
                    csr = table.csr(seqs, q_lens)
                    inputs = [session.tokens(sum(q_lens)) for _ in range(pool.num_layers)]
                    results = await asyncio.gather(
                        *(
                            call(
                                layer,
                                table=csr,
                                pool=pool.name,
                                return_lse=True,
                                sm_scale=session.default_scale,
                                **bits,
                            )
                            for layer, bits in enumerate(inputs)
                        )
                    )
                    for layer, (bits, result) in enumerate(zip(inputs, results, strict=True)):
                        session.check(layer, csr, bits, result, session.default_scale)
            finally:
                await table.free_all()

    asyncio.run(main())


def test_errors_have_their_classes(client: Client) -> None:
    pool = client.pool_info("gqa")
    pages = client.allocate_pages(10, pool="gqa")
    with pytest.raises(PoolExhausted) as err:
        client.allocate_pages(pool.total_pages, pool="gqa")  # 10 fewer are free
    assert err.value.retry_pushback_ms is None and err.value.message
    client.free_pages(pages, pool="gqa")
    with pytest.raises(FailedPrecondition):
        client.free_pages(pages, pool="gqa")
    with pytest.raises(NotFound):
        client.allocate_pages(1, pool="no_such_pool")
    q = np.zeros((1, pool.num_qo_heads, pool.head_dim), np.float32)
    table = BatchCsr(*(np.asarray(a, np.int32) for a in ([0, 1], [0, 0], [], [0])))
    with pytest.raises(InvalidArgument, match="layer") as err:
        client.decode(pool.num_layers, q, table, pool="gqa")
    assert isinstance(err.value, AttnError) and err.value.code.name == "INVALID_ARGUMENT"

    async def in_asyncio() -> None:
        async with AsyncClient(client.address) as aclient:
            with pytest.raises(InvalidArgument, match="layer"):
                await aclient.decode(pool.num_layers, q, table, pool="gqa")
            with pytest.raises(NotFound):
                await aclient.free_pages([0], pool="no_such_pool")

    asyncio.run(in_asyncio())


def test_retries_ride_out_a_full_queue(private) -> None:
    """Queue of one call, held 150 ms before its launch: a second call is refused with the
    pushback trailer; with retries it gets through once the queue has room."""
    server = private("--max_queue_requests=1", "--max_queue_delay_us=150000")
    q = np.zeros((1, 8, 64), np.float32)
    empty = BatchCsr(*(np.asarray(a, np.int32) for a in ([0, 1], [0, 0], [], [0])))

    async def main() -> None:
        async with (
            AsyncClient(server.address, retry=None) as plain,
            AsyncClient(server.address, retry=PATIENT) as patient,
        ):
            queued = asyncio.create_task(plain.decode(0, q, empty, return_lse=True))
            await asyncio.sleep(0.05)
            with pytest.raises(QueueFull) as refused:
                await plain.decode(0, q, empty)
            assert refused.value.retry_pushback_ms is not None
            assert refused.value.retry_pushback_ms >= 1
            result = await patient.decode(0, q, empty, return_lse=True)
            assert (result.output == 0).all() and (result.lse == np.float32(EMPTY_ROW_LSE)).all()
            await queued

    asyncio.run(main())
    with (  # the sync client retries the same way
        Client(server.address, retry=None) as plain,
        Client(server.address, retry=PATIENT) as patient,
        ThreadPoolExecutor(1) as pool,
    ):
        queued = pool.submit(plain.decode, 0, q, empty)
        time.sleep(0.05)
        assert (patient.decode(0, q, empty).output == 0).all()
        queued.result()


def spread_ids(prefix: str, ring: HashRing, must_reach: list[str], count: int) -> list[str]:
    """`count` ids "prefix-N" (N from 0 up) whose nodes on `ring` include every `must_reach`."""
    for start in range(1000):
        ids = [f"{prefix}-{start + i}" for i in range(count)]
        if set(must_reach) <= {ring.node_for(i) for i in ids}:
            return ids
    raise AssertionError(f"no {count} consecutive ids reach {must_reach}")


def test_router_keeps_sequences_with_their_pages(private) -> None:
    """Sequences spread over three servers by the ring, stay put when a fourth joins, and each
    server's batch (gathered and scattered by ServerBatch.rows) matches the reference."""
    addresses = [private().address for _ in range(4)]
    first, fourth = addresses[0], addresses[3]
    with Router.connect(addresses[:3], timeout=60.0) as router, Client(fourth) as joining:
        pool = router.client(first).pool_info("p")
        sessions = {
            a: PoolSession(router.client(a), pool, seed=i) for i, a in enumerate(addresses[:3])
        }
        sessions[fourth] = PoolSession(joining, pool, seed=3)
        # Placement depends on the servers' (random) ports: take the first ids the ring spreads
        # over all three servers, and newcomers of which some go to the fourth.
        seqs = spread_ids("req", HashRing(addresses[:3]), addresses[:3], 12)
        newcomers = spread_ids("new", HashRing(addresses), [fourth], 12)
        try:
            for batch in router.split(seqs, [5 + 7 * i for i in range(12)]):
                sessions[batch.server].chunk(batch.seq_ids, batch.q_lens)
            placed = {s: router.server_for(s) for s in seqs}
            assert len(set(placed.values())) == 3
            for a in addresses[:3]:
                held = pool.total_pages - router.client(a).pool_info("p").free_pages
                assert held == sessions[a].table.num_pages() > 0

            router.add_server(fourth, joining)
            assert all(router.server_for(s) == placed[s] for s in seqs)  # with their pages
            for batch in router.split(newcomers, [3] * 12):
                sessions[batch.server].chunk(batch.seq_ids, batch.q_lens)
            assert any(router.server_for(s) == fourth for s in newcomers)

            everyone = seqs + newcomers
            q = random_bits(np.random.default_rng(5), len(everyone), 8, 64)
            out = np.zeros((len(everyone), 8, 64), np.float32)
            for batch in router.split(everyone):  # one decode per server, nothing appended
                session = sessions[batch.server]
                table = session.table.csr(batch.seq_ids)
                result = batch.client.decode(0, q[batch.rows], table, pool="p", return_lse=True)
                out[batch.rows] = result.output
                values = {"q": bf16_to_float(q[batch.rows])}
                check_result(result, *session.expected(0, table, values, None))
            assert (np.abs(out).sum(axis=(1, 2)) > 0).all()  # every row came back

            on_first = [s for s in everyone if router.placement(s) == first]
            assert sorted(router.remove_server(first)) == sorted(on_first)
            assert router.servers == addresses[1:]
        finally:
            for session in sessions.values():
                session.close()
    for a in addresses:
        with Client(a) as c:
            assert c.pool_info("p").free_pages == pool.total_pages
