"""The data plane end to end: the Python client's transports against a server with registered
memory enabled, every result checked against the numpy reference.

Skipped as a whole while the server answers RegisterRegion with UNIMPLEMENTED (a server that
predates regions, or one without them enabled). The cuda transport runs only with torch, a GPU
and ATTNSERVE_BACKEND=cuda.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from attnserve import (
    AsyncClient,
    AsyncPageTable,
    AttnError,
    BatchCsr,
    Client,
    FailedPrecondition,
    NotFound,
)
from attnserve.calls import prefill_request
from attnserve.regions import SharedMemoryArena
from attnserve.tensors import bf16_to_float

from launcher import Launched, launch, server_config
from workload import PoolSession, check_result

BACKEND = os.environ.get("ATTNSERVE_BACKEND", "cpu")


def data_plane_config():
    config = server_config()
    config.data_plane.shared_memory = True
    config.data_plane.cuda_ipc = BACKEND == "cuda"
    config.data_plane.max_regions_per_session = 8
    config.data_plane.max_region_bytes_per_session = 1 << 30
    return config


@dataclass
class PlaneServer:
    launched: Launched
    regions: str  # "" when the server registers shared memory, else why not

    @property
    def address(self) -> str:
        return self.launched.address

    def require_regions(self) -> None:
        if self.regions:
            pytest.skip(f"the server does not support registered memory yet: {self.regions}")


@pytest.fixture(scope="module")
def plane_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlaneServer]:
    """A server with shared memory (and CUDA IPC on the CUDA backend) enabled; tests that need
    regions skip while it answers RegisterRegion with UNIMPLEMENTED."""
    srv = launch(tmp_path_factory.mktemp("data_plane"), data_plane_config())
    try:
        why = ""
        with Client(srv.address, transport="bytes") as probe:
            arena = SharedMemoryArena(1 << 16)
            try:
                probe.register_region(arena.register_request())
                probe.unregister_region(arena.name)
            except AttnError as e:
                if e.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                why = str(e)
            finally:
                arena.close()
        yield PlaneServer(srv, why)
    finally:
        srv.process.kill()
        srv.process.wait()


def plane_server_with(
    tmp_path_factory: pytest.TempPathFactory, name: str, flag: str
) -> Iterator[PlaneServer]:
    """The plane server's configuration with one more flag."""
    srv = launch(tmp_path_factory.mktemp(name), data_plane_config(), flag)
    try:
        yield PlaneServer(srv, "")
    finally:
        srv.process.kill()
        srv.process.wait()


@pytest.fixture(scope="module")
def direct_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlaneServer]:
    """The same server with every decode's shared-memory output written by the kernels
    themselves, at any size (--cuda_direct_output_min_bytes=1; the CPU backend has no such path
    and copies)."""
    yield from plane_server_with(
        tmp_path_factory, "direct_outputs", "--cuda_direct_output_min_bytes=1"
    )


@pytest.fixture(scope="module")
def chunked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlaneServer]:
    """The same server with every prefill launch that can be cut computed in as many output
    chunks as it allows, each copied out while the next is computed (--cuda_output_chunk_bytes=1;
    the CPU backend has no such path)."""
    yield from plane_server_with(tmp_path_factory, "output_chunks", "--cuda_output_chunk_bytes=1")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return BACKEND == "cuda" and torch.cuda.is_available()


TRANSPORTS = [
    "bytes",
    "shm",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not cuda_available(), reason="needs torch, a GPU and ATTNSERVE_BACKEND=cuda"
        ),
    ),
]


class TorchCudaInputs:
    """A Client whose tensor arguments (numpy bf16 bits) become torch CUDA tensors, so that the
    cuda transport stages them through CUDA IPC; everything else is the client's."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def _cuda(self, kwargs: dict) -> dict:
        import torch

        for name in ("q", "q_pe", "k_new", "v_new", "ckv_new", "kpe_new"):
            if isinstance(kwargs.get(name), np.ndarray):
                bits = kwargs[name].view(np.int16)
                kwargs[name] = torch.from_numpy(bits).view(torch.bfloat16).cuda()
        return kwargs

    def prefill(self, layer, **kwargs):
        result = self._client.prefill(layer, **self._cuda(kwargs))
        assert result.region_output is not None and result.region_output.is_cuda
        return result

    def decode(self, layer, **kwargs):
        return self._client.decode(layer, **self._cuda(kwargs))


def client_for(plane_server: PlaneServer, transport: str) -> Client:
    if transport != "bytes":
        plane_server.require_regions()
    return Client(
        plane_server.address, transport=transport, timeout=60.0, max_message_bytes=64 << 20
    )


def session(client: Client, pool_name: str, seed: int) -> PoolSession:
    pool = client.pool_info(pool_name)
    driver = TorchCudaInputs(client) if client.transport.transport == "cuda" else client
    return PoolSession(driver, pool, seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("pool_name", ["gqa", "gqa_g5", "mla"])
def test_chunked_prefill_with_append_then_decode(
    plane_server: PlaneServer, transport: str, pool_name: str
) -> None:
    with client_for(plane_server, transport) as client:
        s = session(client, pool_name, seed=11)
        try:
            s.chunk(["a", "b"], [37, 5])  # both layers, K/V appended, checked
            s.chunk(["a", "b"], [16, 21])  # prefill on cached tokens
            for _ in range(3):
                s.decode_step(["a", "b"])
            if transport != "bytes":
                regions = client.list_regions()
                assert regions and all(r.calls_in_flight == 0 for r in regions)
        finally:
            s.close()


@pytest.mark.parametrize("transport", ["shm"])
@pytest.mark.parametrize("pool_name", ["gqa", "mla"])
def test_a_staged_page_table_serves_every_layer(
    plane_server: PlaneServer, transport: str, pool_name: str
) -> None:
    with client_for(plane_server, transport) as client:
        s = session(client, pool_name, seed=12)
        try:
            s.chunk(["x", "y", "z"], [9, 40, 1])
            s.grow(["x", "y", "z"], [1, 1, 1])
            csr = s.table.csr(["x", "y", "z"])
            with client.stage_page_table(csr) as staged:
                assert staged.staged
                for layer in range(s.pool.num_layers):
                    bits = s.tokens(3)
                    scale = s.default_scale
                    result = client.decode(layer, table=staged, pool=s.pool.name, sm_scale=scale,
                                           return_lse=True, **bits)  # fmt: skip
                    s.check(layer, csr, bits, result, scale)
        finally:
            s.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_non_finite_inputs_are_refused_and_append_nothing(
    plane_server: PlaneServer, transport: str
) -> None:
    """A NaN or Inf in q or the new K/V fails the call with INVALID_ARGUMENT and appends nothing,
    over every transport (the CUDA backend checks on the GPU: inputs in CUDA IPC regions too)."""
    with client_for(plane_server, transport) as client:
        driver = TorchCudaInputs(client) if transport == "cuda" else client
        pool = client.pool_info("gqa")
        shape = (1, pool.num_kv_heads, pool.head_dim)
        (page,) = client.allocate_pages(1, "gqa")
        try:
            one = BatchCsr(np.array([0, 1], np.int32), np.array([0, 1], np.int32),
                           np.array([page], np.int32), np.array([1], np.int32))  # fmt: skip
            two = one._replace(kv_last_page_len=np.array([2], np.int32))
            q0 = np.zeros((1, pool.num_qo_heads, pool.head_dim), np.uint16)  # bf16 0.0
            half = np.full(shape, 0x3F00, np.uint16)  # bf16 0.5
            driver.prefill(0, q=q0, k_new=half, v_new=half, table=one, pool="gqa")
            for field, bits in (("k_new", 0x7FC0), ("v_new", 0xFF80), ("q", 0x7F80)):
                two_0 = np.full(shape, 0x4000, np.uint16)  # bf16 2.0
                inputs = {"q": q0.copy(), "k_new": two_0, "v_new": two_0.copy()}
                inputs[field].reshape(-1)[3] = bits
                with pytest.raises(AttnError) as refused:
                    driver.decode(0, table=two, pool="gqa", **inputs)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, field
                assert field in refused.value.message, refused.value.message
            # q = 0 weighs both slots equally: 0.5 and the never-written (zeroed) slot 1 average
            # to 0.25; an append of the refused calls' 2.0 would give 1.25.
            result = driver.decode(0, q=q0, table=two, pool="gqa")
            np.testing.assert_array_equal(result.output, np.full(q0.shape, 0.25, np.float32))
        finally:
            client.free_pages([page], "gqa")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("pool_name", ["gqa", "gqa_g5", "mla"])
def test_prefills_computed_in_output_chunks_match_the_reference(
    plane_server: PlaneServer, chunked_server: PlaneServer, transport: str, pool_name: str
) -> None:
    """Prefills long enough to be cut into several output chunks, with append and lse, then a
    decode: each chunk's rows reach the response or the caller's region."""
    if transport != "bytes":
        plane_server.require_regions()
    with client_for(chunked_server, transport) as client:
        s = session(client, pool_name, seed=43)
        try:
            s.chunk(["a", "b"], [300, 45])
            s.chunk(["a", "b"], [130, 7])
            s.decode_step(["a", "b"])
        finally:
            s.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_refused_chunked_prefill_appends_nothing(
    plane_server: PlaneServer, chunked_server: PlaneServer, transport: str
) -> None:
    """A NaN in the last new token's V refuses a prefill whose outputs would come in chunks:
    INVALID_ARGUMENT, and none of its K/V reaches the cache."""
    if transport != "bytes":
        plane_server.require_regions()
    with client_for(chunked_server, transport) as client:
        driver = TorchCudaInputs(client) if transport == "cuda" else client
        pool = client.pool_info("gqa")
        new = 256
        pages = client.allocate_pages((new + 1 + pool.page_size - 1) // pool.page_size, "gqa")
        try:
            ids = np.array(pages, np.int32)
            first = BatchCsr(np.array([0, 1], np.int32), np.array([0, 1], np.int32),
                             ids[:1], np.array([1], np.int32))  # fmt: skip
            last_len = (new + 1) - (len(pages) - 1) * pool.page_size
            whole = BatchCsr(np.array([0, new], np.int32), np.array([0, len(pages)], np.int32),
                             ids, np.array([last_len], np.int32))  # fmt: skip
            heads = (pool.num_kv_heads, pool.head_dim)
            q0 = np.zeros((1, pool.num_qo_heads, pool.head_dim), np.uint16)  # bf16 0.0
            half = np.full((1, *heads), 0x3F00, np.uint16)  # bf16 0.5
            driver.prefill(0, q=q0, k_new=half, v_new=half, table=first, pool="gqa")
            two = np.full((new, *heads), 0x4000, np.uint16)  # bf16 2.0
            v_new = two.copy()
            v_new[-1, 0, 5] = 0x7FC0  # NaN
            q = np.zeros((new, pool.num_qo_heads, pool.head_dim), np.uint16)
            with pytest.raises(AttnError) as refused:
                driver.prefill(0, q=q, k_new=two, v_new=v_new, table=whole, pool="gqa")
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "v_new" in refused.value.message, refused.value.message
            # q = 0 weighs every slot equally: 0.5 in slot 0 and zeros in the never-written slots
            # average to 0.5 / 257; any appended 2.0 would show.
            decode = whole._replace(qo_indptr=np.array([0, 1], np.int32))
            result = driver.decode(0, q=q0, table=decode, pool="gqa")
            expected = bf16_to_float(np.full(q0.shape, 0x3F00, np.uint16)) / (new + 1)
            np.testing.assert_allclose(result.output, expected, rtol=1e-2)
        finally:
            client.free_pages(pages, "gqa")


def test_bad_references_are_refused_and_change_nothing(plane_server: PlaneServer) -> None:
    """Each bad call would append K/V of 2.0 over the token of 0.5 at position 0; afterwards a
    read-only call still sees 0.5 (one key: the output is its value)."""
    plane_server.require_regions()
    with client_for(plane_server, "bytes") as client:
        pool = client.pool_info("gqa")
        h, h_kv, d = pool.num_qo_heads, pool.num_kv_heads, pool.head_dim
        pages = client.allocate_pages(1, pool="gqa")
        one = np.array([0, 1], np.int32)
        table = BatchCsr(one, one, np.array(pages, np.int32), np.array([1], np.int32))
        q = np.ones((1, h, d), np.float32)
        kept = np.full((1, h_kv, d), 0.5, np.float32)
        arena = SharedMemoryArena(1 << 16)
        try:
            client.prefill(0, q, table, pool="gqa", k_new=kept, v_new=kept)
            client.register_region(arena.register_request())
            arena.registered()
            q_bytes = (1 * h * d) * 2
            cases = {
                "unregistered region": ("q", "py-shm-unknown", 64, grpc.StatusCode.NOT_FOUND),
                "q past the end": ("q", arena.name, (1 << 16) - q_bytes + 16,
                                   grpc.StatusCode.INVALID_ARGUMENT),
                "misaligned q": ("q", arena.name, 72, grpc.StatusCode.INVALID_ARGUMENT),
                "output past the end": ("output_to", arena.name, 1 << 16,
                                        grpc.StatusCode.INVALID_ARGUMENT),
            }  # fmt: skip
            for what, (field, name, offset, code) in cases.items():
                other = np.full((1, h_kv, d), 2.0, np.float32)
                request = prefill_request(0, q, table, pool="gqa", k_new=other, v_new=other)
                at = request.q.region if field == "q" else request.output_to
                if field == "q":
                    request.q.ClearField("data")
                at.name, at.offset = name, offset
                with pytest.raises(AttnError) as err:
                    client.call_prefill(request)
                assert err.value.code == code, what
            out = client.prefill(0, q, table, pool="gqa").output
            np.testing.assert_array_equal(out, np.full((1, h, d), 0.5, np.float32))
        finally:
            client.unregister_region(arena.name)
            arena.close()
            client.free_pages(pages, pool="gqa")


def empty_table() -> BatchCsr:
    """One sequence without pages (a table to stage)."""
    return BatchCsr(np.array([0, 1], np.int32), np.array([0, 0], np.int32),
                    np.array([], np.int32), np.array([1], np.int32))  # fmt: skip


def test_regions_go_with_their_client_and_session(plane_server: PlaneServer) -> None:
    plane_server.require_regions()
    with Client(plane_server.address, transport="shm") as owner:
        owner.open_session(lease_s=30)
        assert owner.stage_page_table(empty_table()).staged
        with Client(plane_server.address, session=owner.session, transport="bytes") as observer:
            assert len(observer.list_regions()) == 1
            owner.close()  # unregisters
            assert observer.list_regions() == []
            observer.close_session()


def test_a_dying_client_leaves_nothing_behind(plane_server: PlaneServer) -> None:
    """Killed holding a page and a registered region: no shared-memory object is left on the
    node, and the server drops both with the session when its lease expires (watched through
    the pool's free pages, since a call naming the session would renew it)."""
    plane_server.require_regions()
    script = textwrap.dedent(f"""
        import os, signal
        from attnserve import BatchCsr, Client
        import numpy as np
        c = Client({plane_server.address!r}, transport="shm")
        c.open_session(lease_s=0.3)
        c.allocate_pages(1, pool="gqa")
        one = np.array([0, 1])
        c.stage_page_table(BatchCsr(one, np.array([0, 0]), np.array([], np.int32), np.array([1])))
        print(c.session, c.transport.take_arenas()[0].shm_name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    with client_for(plane_server, "bytes") as watcher:
        free_before = watcher.pool_info("gqa").free_pages
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert run.returncode == -9, run.stderr
        handle, shm_name = run.stdout.split()
        assert not Path("/dev/shm", shm_name.lstrip("/")).exists()
        deadline = time.monotonic() + 30
        while watcher.pool_info("gqa").free_pages != free_before:
            assert time.monotonic() < deadline, "the dead client's session was not reclaimed"
            time.sleep(0.1)
    with Client(plane_server.address, session=handle, transport="bytes", retry=None) as late:
        with pytest.raises(AttnError) as err:
            late.list_regions()
        assert err.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


@pytest.mark.parametrize("pool_name", ["gqa", "mla"])
def test_calls_over_the_call_queue_match_the_reference(
    plane_server: PlaneServer, pool_name: str
) -> None:
    """Prefill with append, then decode, through a call queue (attention.proto, "Call queues"):
    checked against the reference like the gRPC calls, and the queue goes with the client."""
    plane_server.require_regions()
    with Client(plane_server.address, transport="shm", call_queue=True, timeout=60.0) as client:
        s = session(client, pool_name, seed=21)
        try:
            s.chunk(["a", "b"], [23, 4])
            s.chunk(["a", "b"], [3, 17])
            for _ in range(2):
                s.decode_step(["a", "b"])
            queues = [r for r in client.list_regions() if r.call_queue]
            assert len(queues) == 1 and queues[0].calls_in_flight == 0
        finally:
            s.close()
        with Client(plane_server.address, session=client.session, transport="bytes") as observer:
            client.close()  # unregisters the queue (and the arenas)
            assert [r for r in observer.list_regions() if r.call_queue] == []


@pytest.mark.parametrize("table_kind", ["staged", "plan"])
@pytest.mark.parametrize("call_queue", [True, False])
@pytest.mark.parametrize("pool_name", ["gqa", "mla"])
def test_a_prepared_call_runs_every_layer(
    plane_server: PlaneServer, pool_name: str, call_queue: bool, table_kind: str
) -> None:
    """Client.prepare(): staged once, rewritten in place for each layer (decode with append),
    over the call queue and over gRPC, its page table staged in shared memory or in a plan;
    every run checked against the reference, the outputs read from the prepared call's own
    views."""
    plane_server.require_regions()
    with Client(
        plane_server.address, transport="shm", call_queue=call_queue, timeout=60.0
    ) as client:
        s = session(client, pool_name, seed=31)
        try:
            s.chunk(["x", "y"], [12, 30])
            s.grow(["x", "y"], [1, 1])
            csr = s.table.csr(["x", "y"])
            scale = s.default_scale
            with client.stage_page_table(csr) as staged:
                table = client.plan(staged, pool=s.pool.name) if table_kind == "plan" else staged
                first = s.tokens(2)
                with client.prepare("decode", table=table, pool=s.pool.name, sm_scale=scale,
                                    return_lse=True, **first) as call:  # fmt: skip
                    assert sorted(call.inputs) == sorted(first)
                    for layer in range(s.pool.num_layers):
                        bits = first if layer == 0 else s.tokens(2)
                        for name, value in bits.items():
                            call.inputs[name][...] = value
                        result = call.run(layer=layer)
                        assert result.region_output is call.output
                        s.check(layer, csr, bits, result, scale)
                    queues = [r for r in client.list_regions() if r.call_queue]
                    assert len(queues) == (1 if call_queue else 0)
                if table_kind == "plan":
                    table.release()
        finally:
            s.close()


@pytest.mark.parametrize("outputs", ["copied", "direct"])
def test_a_refused_prepared_run_leaves_the_call_usable(
    plane_server: PlaneServer, direct_server: PlaneServer, outputs: str
) -> None:
    """A run the server refuses (a NaN in q: INVALID_ARGUMENT, nothing appended) changes nothing
    of the prepared call: its output and lse in shared memory stay as they were, whether the
    server copies outputs there after the kernels or has the kernels write them there (once the
    input check passed), and the next run with good numbers goes through."""
    plane_server.require_regions()
    server = plane_server if outputs == "copied" else direct_server
    with Client(server.address, transport="shm", timeout=60.0) as client:
        s = session(client, "gqa", seed=32)
        try:
            s.chunk(["x"], [20])
            csr = s.table.csr(["x"])
            q = s.tokens(1)["q"]
            scale = s.default_scale
            out, lse = s.expected(0, csr, {"q": bf16_to_float(q)}, scale)
            with client.prepare(
                "decode", q, csr, pool="gqa", sm_scale=scale, return_lse=True
            ) as call:
                call.output[...] = 0x1234
                call.lse[...] = -7.0
                call.inputs["q"][...] = 0x7FC0  # bf16 NaN
                with pytest.raises(AttnError) as err:
                    call.run()
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert (call.output == 0x1234).all() and (call.lse == -7.0).all()
                call.inputs["q"][...] = q
                check_result(call.run(), out, lse)
        finally:
            s.close()


@pytest.mark.parametrize("pool_name", ["gqa", "mla"])
def test_outputs_the_kernels_write_into_shared_memory_match_the_reference(
    plane_server: PlaneServer, direct_server: PlaneServer, pool_name: str
) -> None:
    """Prefill with append, then decode, lse included, over shared memory on the server whose
    decode kernels write the outputs into the caller's region themselves: checked against the
    reference like the copied outputs."""
    plane_server.require_regions()
    with Client(direct_server.address, transport="shm", timeout=60.0) as client:
        s = session(client, pool_name, seed=41)
        try:
            s.chunk(["a", "b"], [23, 4])
            s.chunk(["a", "b"], [3, 17])
            for _ in range(2):
                s.decode_step(["a", "b"])
        finally:
            s.close()


def test_prepare_needs_an_arena(plane_server: PlaneServer) -> None:
    with Client(plane_server.address, transport="bytes", timeout=60.0) as client:
        pool = client.pool_info("gqa")
        q = np.zeros((1, pool.num_qo_heads, pool.head_dim), np.uint16)
        table = empty_table()
        with pytest.raises(ValueError, match="arena"):
            client.prepare("decode", q, table, pool="gqa")
        with pytest.raises(ValueError, match="op must be"):
            client.prepare("append", q, table, pool="gqa")


@pytest.mark.parametrize("transport", ["bytes", "shm"])
@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("pool_name", ["gqa", "mla"])
def test_a_plan_serves_every_layer_of_a_step(
    plane_server: PlaneServer, transport: str, op: str, pool_name: str
) -> None:
    """Client.plan() (attention.proto, "Plans"): the table checked and pinned once, then every
    layer's call (K/V appended) names it and matches the reference. Over shm the plan is made
    from a staged table and the calls take the call queue. Its pages cannot be freed until it is
    released."""
    with client_for(plane_server, transport) as client:
        s = session(client, pool_name, seed=41)
        try:
            seqs = ["x", "y", "z"]
            s.chunk(seqs, [9, 40, 1])
            q_lens = [1, 1, 1] if op == "decode" else [3, 1, 6]
            s.grow(seqs, q_lens)
            csr = s.table.csr(seqs, q_lens)
            staged = client.stage_page_table(csr) if transport == "shm" else None
            with client.plan(staged or csr, op=op, pool=s.pool.name) as plan:
                assert (plan.batch, plan.total_q) == (3, sum(q_lens))
                assert plan.num_pages == len(csr.kv_indices)
                call = client.prefill if op == "prefill" else client.decode
                for layer in range(s.pool.num_layers):
                    bits = s.tokens(sum(q_lens))
                    result = call(layer, table=plan, pool=s.pool.name, sm_scale=s.default_scale,
                                  return_lse=True, **bits)  # fmt: skip
                    s.check(layer, csr, bits, result, s.default_scale)
                with pytest.raises(FailedPrecondition):
                    client.free_pages(list(csr.kv_indices[:1]), pool=s.pool.name)
            if staged is not None:
                staged.release()
            with pytest.raises(ValueError, match="released"):
                client.decode(0, table=plan, pool=s.pool.name, **s.tokens(3))
        finally:
            s.close()  # the plan is gone: its pages free


def test_plans_go_with_their_session(plane_server: PlaneServer) -> None:
    """A session that ends takes its plans along: their pins do not keep its pages out of the
    pool. A plan of one method cannot serve the other."""
    with client_for(plane_server, "bytes") as client:
        before = client.pool_info("gqa").free_pages
        s = session(client, "gqa", seed=42)
        s.chunk(["a"], [20])
        csr = s.table.csr(["a"])
        plan = client.plan(csr, pool="gqa", name="one")
        client.plan(csr, pool="gqa", name="two")
        with pytest.raises(ValueError, match="decode plan"):
            client.prefill(0, table=plan, pool="gqa", **s.tokens(1))
        with pytest.raises(NotFound):
            client.release_plan("three")
        assert client.pool_info("gqa").free_pages < before
        client.close_session()
        assert client.pool_info("gqa").free_pages == before


def test_a_replaced_plan_leaves_its_successor_alone(plane_server: PlaneServer) -> None:
    """The server knows plans by name: the Plan a plan of its name replaced must neither drop
    its successor when released nor be usable by calls (it would name the successor)."""
    with client_for(plane_server, "bytes") as client:
        s = session(client, "gqa", seed=44)
        try:
            s.chunk(["a", "b"], [7, 12])
            first = client.plan(s.table.csr(["a", "b"]), pool="gqa")
            s.grow(["a"], [1])
            csr = s.table.csr(["a"])
            second = client.plan(csr, pool="gqa")  # the next step, under the same name
            first.release()
            with pytest.raises(ValueError, match="replaced"):
                client.decode(0, table=first, pool="gqa", **s.tokens(2))
            bits = s.tokens(1)
            result = client.decode(0, table=second, pool="gqa", return_lse=True, **bits)
            s.check(0, csr, bits, result, None)
            second.release()
            with pytest.raises(NotFound):
                client.release_plan(second.name)
        finally:
            s.close()


@pytest.mark.parametrize("transport", ["bytes", "shm"])
@pytest.mark.parametrize("pool_name", ["gqa", "mla"])
def test_an_async_plan_serves_every_layer_of_a_step(
    plane_server: PlaneServer, transport: str, pool_name: str
) -> None:
    """AsyncClient.plan(): a prefill step and a decode step, each on a plan (made from a staged
    table over shm), every layer's call (K/V appended) a concurrent task naming it and matching
    the reference. The plan's pages cannot be freed until it is released; then it is gone."""
    if transport != "bytes":
        plane_server.require_regions()

    async def main() -> None:
        async with AsyncClient(plane_server.address, transport=transport, timeout=60.0,
                               max_message_bytes=64 << 20) as client:  # fmt: skip
            pool = await client.pool_info(pool_name)
            s = PoolSession(client, pool, seed=43)  # type: ignore[arg-type]  # tokens, reference
            table = AsyncPageTable(client, pool.name, pool.page_size)
            seqs = ["x", "y", "z"]
            try:
                for op, q_lens in (("prefill", [30, 5, 17]), ("decode", [1, 1, 1])):
                    for seq, n in zip(seqs, q_lens, strict=True):
                        await table.reserve(seq, n)
                    csr = table.csr(seqs, q_lens)
                    staged = await client.stage_page_table(csr) if transport == "shm" else None
                    plan = await client.plan(staged or csr, op=op, pool=pool.name, name=op)
                    async with plan:
                        assert (plan.batch, plan.total_q) == (3, sum(q_lens))
                        call = client.prefill if op == "prefill" else client.decode
                        inputs = [s.tokens(sum(q_lens)) for _ in range(pool.num_layers)]
                        results = await asyncio.gather(*(
                            call(layer, table=plan, pool=pool.name, sm_scale=s.default_scale,
                                 return_lse=True, **bits)
                            for layer, bits in enumerate(inputs)))  # fmt: skip
                        with pytest.raises(FailedPrecondition):
                            await client.free_pages(list(csr.kv_indices[:1]), pool=pool.name)
                    if staged is not None:
                        staged.release()
                    for layer, (bits, result) in enumerate(zip(inputs, results, strict=True)):
                        s.check(layer, csr, bits, result, s.default_scale)
                    with pytest.raises(NotFound):
                        await client.release_plan(op)
            finally:
                await table.free_all()  # the plans are gone: their pages free

    asyncio.run(main())
