"""The data plane without the C++ server: arenas, allocation, transport choice, and calls over
shared memory against the fake server (which maps the regions as attnserve does)."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import fake_server
import grpc
import numpy as np
import pytest

from attnserve import AsyncClient, AttnError, Client, PageTable
from attnserve.calls import DECODE, PREFILL, attention_request
from attnserve.errors import DeadlineExceeded, InvalidArgument
from attnserve.reference import CacheMirror, check_close, gqa_reference
from attnserve.regions import (
    BLOCK_ALIGNMENT,
    HEADER_BYTES,
    REGION_MAGIC,
    Allocator,
    SharedMemoryArena,
    new_shm_name,
)
from attnserve.tensors import bf16_round
from attnserve.transport import (
    Kinds,
    StagedCall,
    StagedPageTable,
    Transport,
    is_local_address,
    resolve_kinds,
)
from attnserve.v1 import attention_pb2 as pb

SHM_DIR = Path("/dev/shm")


def shm_path(arena: SharedMemoryArena) -> Path:
    return SHM_DIR / arena.shm_name.lstrip("/")


# ---- addresses and transport choice


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("unix:/run/attnserve.sock", True),
        ("unix-abstract:attn", True),
        ("127.0.0.1:50051", True),
        ("127.3.4.5:1", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("ipv4:127.0.0.1:50051", True),
        ("dns:///localhost:50051", True),
        ("10.0.0.1:50051", False),
        ("attn.example.com:443", False),
        ("[2001:db8::1]:50051", False),
        ("0.0.0.0:50051", False),
    ],
)
def test_local_addresses(address: str, local: bool) -> None:
    assert is_local_address(address) == local


def test_transport_choice_follows_the_server_and_the_address() -> None:
    both = pb.DataPlane(shared_memory=True, cuda_ipc=True)
    shm_only = pb.DataPlane(shared_memory=True)
    assert resolve_kinds("auto", "127.0.0.1:1", both) == Kinds(shm=True, cuda=True)
    assert resolve_kinds("auto", "unix:/s", shm_only) == Kinds(shm=True)
    assert resolve_kinds("auto", "127.0.0.1:1", pb.DataPlane()) == Kinds()
    assert resolve_kinds("auto", "127.0.0.1:1", None) == Kinds()  # a server without data_plane
    assert resolve_kinds("auto", "10.1.2.3:1", both) == Kinds()  # never for a remote server
    assert resolve_kinds("bytes", "127.0.0.1:1", both) == Kinds()
    assert resolve_kinds("shm", "10.1.2.3:1", None) == Kinds(shm=True)  # explicit: not asked
    assert resolve_kinds("cuda", "127.0.0.1:1", pb.DataPlane()) == Kinds(cuda=True)
    assert resolve_kinds("cuda", "127.0.0.1:1", both) == Kinds(shm=True, cuda=True)
    with pytest.raises(ValueError, match="transport must be one of"):
        Transport("tcp", "127.0.0.1:1")


def test_only_auto_and_cuda_ask_the_server() -> None:
    assert Transport("auto", "127.0.0.1:1").needs_server_info
    assert Transport("cuda", "10.0.0.1:1").needs_server_info
    assert not Transport("auto", "10.0.0.1:1").needs_server_info
    assert not Transport("shm", "127.0.0.1:1").needs_server_info
    assert not Transport("bytes", "127.0.0.1:1").needs_server_info


# ---- allocation


def test_allocator_aligns_reuses_and_coalesces() -> None:
    a = Allocator(1024)
    assert a.capacity == 1024 - BLOCK_ALIGNMENT
    first, second, third = a.allocate(1), a.allocate(65), a.allocate(64)
    assert (first, second, third) == (64, 128, 256)  # 1 -> 64 bytes, 65 -> 128
    assert all(o % 16 == 0 for o in (first, second, third))
    a.free(second)
    assert a.allocate(100) == 128  # first fit: the freed block
    a.free(128)
    a.free(first)
    a.free(third)
    assert a.used_bytes == 0 and a.largest_free == a.capacity  # coalesced into one extent
    assert a.allocate(a.capacity) == 64
    assert a.allocate(1) is None
    with pytest.raises(KeyError):
        a.free(128)  # never allocated: a double free is an error


def test_allocator_is_thread_safe() -> None:
    a = Allocator(64 * 1025)
    taken: list[int] = []
    lock = threading.Lock()

    def grab() -> None:
        for _ in range(64):
            offset = a.allocate(64)
            assert offset is not None
            with lock:
                taken.append(offset)

    threads = [threading.Thread(target=grab) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(taken)) == 1024 and a.allocate(1) is None


# ---- shared-memory arenas


def test_shm_names_are_random_under_the_prefix() -> None:
    name = new_shm_name()
    assert name.startswith("/attnserve-") and len(name) == len("/attnserve-") + 32
    int(name.rsplit("-", 1)[1], 16)
    assert new_shm_name() != name
    assert new_shm_name("/team1").startswith("/team1-")
    for bad in ("attnserve", "/a/b", "/a b"):
        with pytest.raises(ValueError):
            new_shm_name(bad)


def test_arena_header_mode_and_unlink() -> None:
    arena = SharedMemoryArena(1 << 16)
    try:
        path = shm_path(arena)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.stat().st_size == 1 << 16
        header = path.read_bytes()[:HEADER_BYTES]
        assert header == REGION_MAGIC + arena.key and len(arena.key) == 32
        request = arena.register_request()
        assert request.shared_memory.shm_name == arena.shm_name
        assert (request.offset, request.size, request.key) == (0, 1 << 16, arena.key)
        arena.registered()
        assert not path.exists()  # mapped by the server: the name is no longer needed
        view = arena.array(64, (2, 3), np.float32)
        view[...] = 7
        assert arena.array(64, (6,), np.float32).tolist() == [7] * 6
        with pytest.raises(ValueError, match="outside the arena"):
            arena.array((1 << 16) - 8, (3,), np.float32)
        with pytest.raises(ValueError, match="outside the arena"):
            arena.array(-16, (3,), np.float32)
        assert arena.array(72, (2,), np.uint16).ctypes.data == view.ctypes.data + 8  # a view
    finally:
        arena.close()
    with pytest.raises(ValueError, match="outside the arena"):  # closed: no view of the unmapped
        arena.array(64, (2,), np.float32)


def test_closing_an_unregistered_arena_unlinks_it() -> None:
    arena = SharedMemoryArena(4096, mode=0o640)
    path = shm_path(arena)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    arena.close()
    assert not path.exists()
    arena.close()  # twice is fine


def test_nothing_is_left_in_dev_shm_when_a_client_is_killed(fake_shm_address: str) -> None:
    """The process registers an arena, then dies by SIGKILL (no cleanup runs)."""
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from attnserve import BatchCsr, Client
        c = Client({fake_shm_address!r}, transport="shm")
        one = np.array([0, 1])
        c.stage_page_table(BatchCsr(one, one, np.array([3]), np.array([1])))
        [arena] = c.transport.take_arenas()
        print(arena.shm_name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == -9, run.stderr
    name = run.stdout.strip()
    assert name.startswith("/attnserve-")
    assert not (SHM_DIR / name.lstrip("/")).exists()


# ---- calls over shared memory against the fake server


@pytest.fixture
def fake_shm() -> Iterator[tuple[fake_server.FakeAttentionService, str]]:
    service = fake_server.FakeAttentionService(
        [fake_server.gqa_pool(), fake_server.mla_pool()], shared_memory=True
    )
    server, address = fake_server.start(service)
    yield service, address
    server.stop(grace=None)


@pytest.fixture
def fake_shm_address(fake_shm: tuple[fake_server.FakeAttentionService, str]) -> str:
    return fake_shm[1]


def gqa_inputs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    return tuple(bf16_round(rng.standard_normal((n, h, 8), dtype=np.float32)) for h in (4, 2, 2))


def test_auto_uses_shared_memory_on_loopback_and_matches_bytes(fake_shm) -> None:
    service, address = fake_shm
    rng = np.random.default_rng(0)
    q, k, v = gqa_inputs(rng, 6)
    results = {}
    for transport in ("bytes", "auto"):
        with Client(address, transport=transport) as client:
            table = PageTable(client, "gqa", 4)
            table.reserve(transport, 6)
            csr = table.csr([transport], q_lens=[6])
            first = client.prefill(0, q, csr, pool="gqa", k_new=k, v_new=v, return_lse=True)
            sent = service.seen[-1]
            if transport == "auto":
                assert len(client.list_regions()) == 1
                assert sent.q.HasField("region") and not sent.q.data
                assert sent.k_new.HasField("region") and sent.HasField("output_to")
                assert sent.HasField("lse_to")
            else:
                assert sent.q.data and not sent.HasField("output_to")
            results[transport] = (first.output_bits(), first.lse)
            table.free_all()
    np.testing.assert_array_equal(results["auto"][0], results["bytes"][0])
    np.testing.assert_array_equal(results["auto"][1], results["bytes"][1])


def test_shm_prefill_and_decode_against_the_reference(fake_shm) -> None:
    service, address = fake_shm
    rng = np.random.default_rng(1)
    with Client(address, transport="shm") as client:
        pool = client.pool_info("gqa")
        mirror = CacheMirror.for_pool(pool)
        table = PageTable(client, "gqa", pool.page_size)
        table.reserve("a", 9)
        table.reserve("b", 3)
        csr = table.csr(["a", "b"], q_lens=[9, 3])
        q, k, v = gqa_inputs(rng, 12)
        result = client.prefill(1, q, csr, pool="gqa", k_new=k, v_new=v, return_lse=True)
        mirror.append(1, csr, {"k": k, "v": v})
        out, lse = gqa_reference(mirror, 1, csr, q)
        assert check_close(result.output, out).ok and check_close(result.lse, lse).ok
        for seq in ("a", "b"):
            table.reserve(seq, 1)
        csr = table.csr(["a", "b"])
        q1, k1, v1 = gqa_inputs(rng, 2)
        with client.stage_page_table(csr) as staged:
            assert staged.staged
            result = client.decode(1, q1, staged, pool="gqa", k_new=k1, v_new=v1)
            sent = service.seen[-1]
            assert sent.HasField("page_table") and not sent.kv_indptr and not sent.kv_indices
            assert sent.page_table.batch == 2 and sent.page_table.num_pages == len(csr.kv_indices)
        mirror.append(1, csr, {"k": k1, "v": v1})
        assert check_close(result.output, gqa_reference(mirror, 1, csr, q1)[0]).ok
        table.free_all()


def test_a_staged_table_serves_every_layer_and_both_ops(fake_shm) -> None:
    service, address = fake_shm
    rng = np.random.default_rng(2)
    with Client(address, transport="shm") as client:
        table = PageTable(client, "gqa", 4)
        table.reserve("s", 7)
        csr = table.csr(["s"], q_lens=[7])
        q, k, v = gqa_inputs(rng, 7)
        with client.stage_page_table(csr) as staged:
            by_ref = [client.prefill(layer, q, staged, pool="gqa", k_new=k, v_new=v).output
                      for layer in (0, 1)]  # fmt: skip
            refs = [r.page_table for r in service.seen[-2:]]
            assert refs[0] == refs[1]  # the same slice: written once
        by_arrays = [client.prefill(layer, q, csr, pool="gqa").output for layer in (0, 1)]
        for a, b in zip(by_ref, by_arrays, strict=True):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(ValueError, match="released"):
            client.decode(0, q[:1], staged, pool="gqa")
        layout = StagedPageTable.layout(csr)
        assert layout.tolist() == [0, 2, 3, *csr.kv_indices.tolist(), 0, 7]
        table.free_all()


def test_results_are_copies_that_later_calls_do_not_touch(fake_shm) -> None:
    _, address = fake_shm
    rng = np.random.default_rng(3)
    with Client(address, transport="shm") as client:
        table = PageTable(client, "gqa", 4)
        table.reserve("s", 4)
        csr = table.csr(["s"], q_lens=[4])
        q, k, v = gqa_inputs(rng, 4)
        client.prefill(0, q, csr, pool="gqa", k_new=k, v_new=v)
        first = client.prefill(0, q, csr, pool="gqa", return_lse=True)
        kept = first.output_bits(), first.lse.copy()
        client.prefill(0, -q, csr, pool="gqa", return_lse=True)  # reuses the same block
        np.testing.assert_array_equal(first.output_bits(), kept[0])
        np.testing.assert_array_equal(first.lse, kept[1])
        assert client.transport.take_arenas()[0].allocator.used_bytes == 0
        table.free_all()


def test_concurrent_calls_get_their_own_blocks(fake_shm) -> None:
    _, address = fake_shm
    rng = np.random.default_rng(4)
    with Client(address, transport="shm", arena_bytes=1 << 20) as client:
        table = PageTable(client, "gqa", 4)
        table.reserve("s", 5)
        csr = table.csr(["s"], q_lens=[5])
        q, k, v = gqa_inputs(rng, 5)
        client.prefill(0, q, csr, pool="gqa", k_new=k, v_new=v)
        queries = [rng.standard_normal((5, 4, 8), dtype=np.float32) for _ in range(16)]
        with Client(address, transport="bytes") as reference:
            expected = [reference.prefill(0, x, csr, pool="gqa").output for x in queries]
        got: list = [None] * len(queries)

        def call(i: int) -> None:
            got[i] = client.prefill(0, queries[i], csr, pool="gqa").output

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(queries))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)
        arenas = client.transport.take_arenas()
        assert sum(a.allocator.used_bytes for a in arenas) == 0
        table.free_all()


def test_an_arena_too_small_for_a_call_gets_a_bigger_one(fake_shm) -> None:
    service, address = fake_shm
    with Client(address, transport="shm", arena_bytes=4096) as client:
        table = PageTable(client, "gqa", 4)
        table.reserve("s", 40)
        csr = table.csr(["s"], q_lens=[40])
        q = np.ones((40, 4, 8), np.float32)  # 2560 bytes + output 2560: more than 4 KiB
        client.prefill(0, q, csr, pool="gqa")
        assert len(client.list_regions()) == 1
        assert service.calls["RegisterRegion"] == 1
        table.free_all()


def test_close_unregisters_the_regions(fake_shm) -> None:
    service, address = fake_shm
    client = Client(address, transport="shm")
    client.stage_page_table(fake_csr())
    assert len(service.regions) == 1
    client.close()
    assert service.regions == {} and service.calls["UnregisterRegion"] == 1


def test_a_new_session_takes_new_regions(fake_shm) -> None:
    service, address = fake_shm
    client = Client(address, transport="shm")
    client.stage_page_table(fake_csr())
    first = client.session  # opened for the registration
    assert first and list(service.regions)[0][0] == first
    client.open_session()
    assert client.session != first
    assert service.regions == {}
    client.stage_page_table(fake_csr())
    assert list(service.regions)[0][0] == client.session
    client.close()


def fake_csr():
    from attnserve import BatchCsr

    one = np.array([0, 1], np.int32)
    return BatchCsr(one, one, np.array([5], np.int32), np.array([1], np.int32))


def test_auto_falls_back_to_bytes_when_the_server_has_no_data_plane(fake_address: str) -> None:
    with Client(fake_address) as client:
        staged = client.stage_page_table(fake_csr())
        assert not staged.staged and client.transport.kinds == Kinds()


def test_explicit_shm_fails_on_a_server_without_regions(fake_address: str) -> None:
    before = set(SHM_DIR.glob("attnserve-*"))
    with Client(fake_address, transport="shm") as client, pytest.raises(AttnError) as err:
        client.stage_page_table(fake_csr())
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert client.transport.registered_bytes() == 0
    assert set(SHM_DIR.glob("attnserve-*")) == before  # the refused arena was unlinked


def test_auto_stops_using_shm_when_registration_is_refused(fake_shm) -> None:
    service, address = fake_shm
    with Client(address) as client:
        service.fail_next("RegisterRegion", fake_server.Failure(grpc.StatusCode.PERMISSION_DENIED))
        staged = client.stage_page_table(fake_csr())
        assert not staged.staged and client.transport.kinds == Kinds()


def test_blocks_of_unanswered_calls_are_never_reused() -> None:
    arena = SharedMemoryArena(1 << 16)
    try:
        refused, lost = arena.allocate(1000), arena.allocate(1000)
        orphans: list = []
        StagedCall(None, [refused], on_orphan=orphans.append).abandon(
            InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        )
        assert refused.released
        StagedCall(None, [lost], on_orphan=orphans.append).abandon(
            DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "late")
        )
        assert not lost.released and orphans == [lost]
        assert arena.allocator.used_bytes == 1024
    finally:
        arena.close()


def test_request_building_with_references(fake_shm) -> None:
    """What goes on the wire over shm: every tensor a 16-aligned slice, no bytes."""
    _, address = fake_shm
    with Client(address, transport="shm") as client:
        plane = client.transport
        request, tensors = attention_request(
            DECODE, 0, np.zeros((3, 4, 8), np.float32), fake_csr3(), pool="gqa",
            k_new=np.zeros((3, 2, 8), np.uint16), v_new=np.ones((3, 2, 8), np.float32),
            return_lse=True)  # fmt: skip
        client.stage_page_table(fake_csr())  # registers an arena
        staged = plane.stage_call(request, tensors)
        for name in ("q", "k_new", "v_new"):
            t = getattr(staged.request, name)
            assert not t.data and t.dtype == pb.DTYPE_BF16 and t.region.offset % 16 == 0
        assert list(staged.request.q.shape) == [3, 4, 8]
        offsets = sorted([staged.request.q.region.offset, staged.request.k_new.region.offset,
                          staged.request.v_new.region.offset, staged.request.output_to.offset,
                          staged.request.lse_to.offset])  # fmt: skip
        assert len(set(offsets)) == 5
        v_bits = staged.output.arena.array(staged.request.v_new.region.offset, (3, 2, 8), np.uint16)
        assert (v_bits == 0x3F80).all()  # 1.0 in bf16, converted straight into the arena
        staged.release()
        request, tensors = attention_request(PREFILL, 0, pb.Tensor(dtype=pb.DTYPE_FP32), fake_csr())
        staged = plane.stage_call(request, tensors)
        assert staged.output is None and staged.request.q.dtype == pb.DTYPE_FP32  # sent as is
        staged.release()


def fake_csr3():
    from attnserve import BatchCsr

    return BatchCsr(np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32),
                    np.array([1, 2, 3], np.int32), np.array([1, 1, 1], np.int32))  # fmt: skip


def test_async_client_over_shared_memory(fake_shm) -> None:
    service, address = fake_shm
    rng = np.random.default_rng(5)
    q, k, v = gqa_inputs(rng, 3)

    async def main() -> None:
        async with AsyncClient(address, transport="shm") as client:
            pages = await client.allocate_pages(1, pool="gqa")
            one = np.array([0, 1], np.int32)
            from attnserve import BatchCsr

            csr = BatchCsr(np.array([0, 3], np.int32), one, np.array(pages, np.int32),
                           np.array([3], np.int32))  # fmt: skip
            async with await client.stage_page_table(csr) as staged:
                results = await asyncio.gather(
                    *(
                        client.prefill(layer, q, staged, pool="gqa", k_new=k, v_new=v)
                        for layer in (0, 1)
                    )  # fmt: skip
                )
            assert service.seen[-1].HasField("page_table")
            np.testing.assert_array_equal(results[0].output_bits(), results[1].output_bits())
            await client.free_pages(pages, pool="gqa")
        assert service.regions == {}

    asyncio.run(main())
