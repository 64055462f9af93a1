"""Client over real gRPC against the fake server."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from attnserve import AttnError, BatchCsr, Client, PageTable
from attnserve.reference import EMPTY_ROW_LSE, CacheMirror, check_close, gqa_reference
from attnserve.tensors import bf16_round, bf16_to_float, pack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


def test_server_info_and_pool_lookup(client: Client) -> None:
    info = client.server_info()
    assert [p.name for p in info.pools] == ["gqa", "mla"]
    assert client.pool_info("mla").kind == pb.POOL_KIND_MLA
    with pytest.raises(ValueError, match="2 pools"):
        client.pool_info()
    with pytest.raises(ValueError, match="no pool 'x'"):
        client.pool_info("x")


def test_allocate_and_free(client: Client) -> None:
    pages = client.allocate_pages(5, pool="gqa")
    assert len(set(pages)) == 5
    assert client.pool_info("gqa").free_pages == 59
    assert client.free_pages(pages, pool="gqa") == 64


def test_errors_carry_status_code_and_message(client: Client) -> None:
    with pytest.raises(AttnError) as err:
        client.allocate_pages(65, pool="gqa")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "64 pages free" in err.value.message
    assert str(err.value).startswith("RESOURCE_EXHAUSTED: ")
    with pytest.raises(AttnError) as err:
        client.free_pages([0], pool="gqa")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_prefill_and_decode_round_trip(client: Client) -> None:
    pool = client.pool_info("gqa")
    table = PageTable(client, "gqa", pool.page_size)
    mirror = CacheMirror.for_pool(pool)
    rng = np.random.default_rng(0)
    table.reserve("s", 6)
    csr = table.csr(["s"], q_lens=[6])
    q, k, v = (bf16_round(rng.standard_normal((6, h, 8), dtype=np.float32)) for h in (4, 2, 2))
    result = client.prefill(0, q, csr, pool="gqa", k_new=k, v_new=v, return_lse=True)
    mirror.append(0, csr, {"k": k, "v": v})
    out, lse = gqa_reference(mirror, 0, csr, q)
    assert result.output.dtype == np.float32 and result.output.shape == (6, 4, 8)
    assert check_close(result.output, out).ok and check_close(result.lse, lse).ok
    assert result.timings.batch_requests == 1
    assert (result.timings.prepare_us, result.timings.execute_us, result.timings.finish_us) == (
        3, 4, 5)  # fmt: skip

    table.reserve("s", 1)
    dcsr = table.csr(["s"])
    result = client.decode(0, q[:1], dcsr, pool="gqa", k_new=k[:1], v_new=v[:1])
    assert result.lse is None
    mirror.append(0, dcsr, {"k": k[:1], "v": v[:1]})
    assert check_close(result.output, gqa_reference(mirror, 0, dcsr, q[:1])[0]).ok
    table.free_all()


def test_rows_without_keys(client: Client) -> None:
    table = PageTable(client, "gqa", 4)
    table.reserve("empty", 0)
    q = np.ones((2, 4, 8), np.float32)
    result = client.prefill(1, q, table.csr(["empty"], [2]), pool="gqa", return_lse=True)
    assert (result.output == 0).all()
    assert (result.lse == np.float32(EMPTY_ROW_LSE)).all()


def test_request_fields(client: Client) -> None:
    """What prefill() puts on the wire: bf16 tensors, int32 tables, optional sm_scale."""
    sent: list[pb.PrefillRequest] = []
    client.call_prefill = lambda request, timeout=None: sent.append(request)  # type: ignore
    table = PageTable(client, "gqa", 4)
    table.reserve("s", 2)
    raw = pack_tensor(np.zeros((2, 4, 8), np.float32), pb.DTYPE_FP32)
    client.prefill(1, raw, table.csr(["s"], [2]), pool="gqa", sm_scale=0.5)
    client.prefill(1, np.zeros((2, 4, 8), np.uint16), table.csr(["s"], [2]), pool="gqa")
    first, second = sent
    assert first.q.dtype == pb.DTYPE_FP32 and first.sm_scale == 0.5 and first.layer == 1
    assert list(first.qo_indptr) == [0, 2] and list(first.kv_last_page_len) == [2]
    assert not first.HasField("k_new") and not first.return_lse
    assert second.q.dtype == pb.DTYPE_BF16 and not second.HasField("sm_scale")
    table.free_all()


def test_index_arrays_must_be_integer_vectors(client: Client) -> None:
    with pytest.raises(TypeError, match="page_ids"):
        client.free_pages(np.array([1.0]), pool="gqa")
    with pytest.raises(ValueError, match="1-D"):
        client.free_pages(np.zeros((1, 1), np.int32), pool="gqa")


def test_large_messages_pass_both_ways(echo_address: str) -> None:
    """16 MiB each way, above gRPC's 4 MiB default; a client with a small limit fails."""
    q = np.arange(8 << 20, dtype=np.uint32).astype(np.uint16).reshape(-1, 32, 128)
    table = BatchCsr(*(np.zeros(1, np.int32) for _ in range(4)))
    with Client(echo_address) as c:
        out = c.prefill(0, q, table).output
    np.testing.assert_array_equal(out, bf16_to_float(q))
    with Client(echo_address, max_message_bytes=1 << 20) as c, pytest.raises(AttnError) as err:
        c.prefill(0, q, table)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_every_call_has_a_deadline(echo_address: str) -> None:
    with Client(echo_address, timeout=0.05) as c:
        with pytest.raises(AttnError) as err:
            c.server_info()
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert c.server_info(timeout=5.0).version == "slow"


def test_unreachable_server_is_unavailable_without_wait_for_ready() -> None:
    with Client("127.0.0.1:1", timeout=2.0, wait_for_ready=False) as c:
        with pytest.raises(AttnError) as err:
            c.server_info()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_call_waits_for_an_unreachable_server_until_its_deadline() -> None:
    """The retries used to run out within 0.6 s of a 3 s budget: each attempt failed at once
    while the channel was in TRANSIENT_FAILURE. Waiting for the connection uses the budget."""
    with Client("127.0.0.1:1", timeout=1.0) as c, pytest.raises(AttnError) as err:
        start = time.monotonic()
        c.server_info()
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start >= 1.0


def test_a_call_made_before_the_server_is_up_goes_through_once_it_is() -> None:
    """The server starts only after the client's channel failed to connect, when a fail-fast
    attempt (retries off) would already have failed with UNAVAILABLE."""
    with socket.socket() as holder:  # bound but not listening: connections are refused
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        client = Client(f"127.0.0.1:{port}", timeout=30.0, retry=None)
        refused = threading.Event()
        client._channel.subscribe(
            lambda state: state == grpc.ChannelConnectivity.TRANSIENT_FAILURE and refused.set()
        )
        with futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.server_info)
            assert refused.wait(timeout=30.0)
            holder.close()
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
            pb_grpc.add_AttentionServiceServicer_to_server(EchoVersion(), server)
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            server.start()
            try:
                assert call.result(timeout=30.0).version == "up"
            finally:
                server.stop(grace=None)
                client.close()


class EchoVersion(pb_grpc.AttentionServiceServicer):
    def GetServerInfo(self, request, context):  # noqa: N802 - gRPC method name
        return pb.GetServerInfoResponse(version="up")
