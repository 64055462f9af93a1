"""Page ownership: sessions, leases, the server epoch and quotas (attention.proto, "Sessions and
leases"), on private servers driven through the raw stubs."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from attnserve.tensors import float_to_bf16, pack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve.v1 import server_config_pb2 as config_pb

from launcher import SessionStub, sample

POOL = "p"
Code = grpc.StatusCode


def config() -> config_pb.ServerConfig:
    c = config_pb.ServerConfig()
    c.pools.add(name=POOL, kind=pb.POOL_KIND_GQA, num_layers=1, page_size=16, num_qo_heads=4,
                num_kv_heads=1, head_dim=64, num_pages=64)  # fmt: skip
    return c


def stub(address: str) -> pb_grpc.AttentionServiceStub:
    """A stub on a connection of its own."""
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    return pb_grpc.AttentionServiceStub(channel)


def free(s: pb_grpc.AttentionServiceStub) -> int:
    return s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).pools[0].free_pages


def allocate(s, n: int, session: str = "") -> list[int]:
    reply = s.AllocatePages(pb.AllocatePagesRequest(pool=POOL, num_pages=n, session=session),
                            timeout=10)  # fmt: skip
    return list(reply.page_ids)


def decode(pages: list[int], tokens: int, session: str = "") -> pb.DecodeRequest:
    n = (tokens + 15) // 16
    q = np.random.default_rng(0).standard_normal((1, 4, 64), dtype=np.float32)
    return pb.DecodeRequest(pool=POOL, q=pack_tensor(float_to_bf16(q), pb.DTYPE_BF16),
                            kv_indptr=[0, n], kv_indices=pages[:n],
                            kv_last_page_len=[tokens - 16 * (n - 1)], session=session)  # fmt: skip


def code_of(call) -> Code:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_pages_belong_to_their_session(own) -> None:
    a, b = stub(own.address), stub(own.address)
    sa = a.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    pages = allocate(a, 3, sa)
    # The session's pages work from any connection that names it...
    b.Decode(decode(pages, 40, sa), timeout=10)
    # ...and not for another session; a call naming none is refused (no implicit sessions).
    sb = b.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    assert code_of(lambda: b.Decode(decode(pages, 40, sb), timeout=10)) == Code.FAILED_PRECONDITION
    assert code_of(lambda: b.Decode(decode(pages, 40), timeout=10)) == Code.INVALID_ARGUMENT
    freeing = pb.FreePagesRequest(pool=POOL, page_ids=pages, session=sb)
    assert code_of(lambda: b.FreePages(freeing, timeout=10)) == Code.FAILED_PRECONDITION
    # Closing the session frees its pages.
    before = free(a)
    closed = a.CloseSession(pb.CloseSessionRequest(session=sa), timeout=10)
    assert closed.freed_pages == 3 and free(a) == before + 3
    closing = pb.CloseSessionRequest(session=sa)
    assert code_of(lambda: a.CloseSession(closing, timeout=10)) == Code.NOT_FOUND
    assert code_of(lambda: a.Decode(decode(pages, 40, sa), timeout=10)) == Code.NOT_FOUND


@pytest.mark.flags("--session_lease_seconds=1")
def test_expired_leases_are_reclaimed(own) -> None:
    a = stub(own.address)
    explicit = a.OpenSession(pb.OpenSessionRequest(lease_ms=300), timeout=10)
    assert explicit.lease_ms == 300
    pages = allocate(a, 5, explicit.session)
    idle = SessionStub(own.address)
    allocate(idle, 4)  # a session (default lease: 1 s) whose client then goes quiet
    total = 64
    deadline = time.monotonic() + 10
    while free(a) != total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free(a) == total
    metrics = own.metrics()
    assert sample(metrics, "attn_pages_reclaimed_total", pool=POOL) == 9
    # The gauges follow the reclaim (they used to keep the reclaimed pages as used).
    assert sample(metrics, "attn_kv_pages", pool=POOL, state="used") == 0
    assert sample(metrics, "attn_kv_pages", pool=POOL, state="free") == total
    expired = decode(pages, 70, explicit.session)
    assert code_of(lambda: a.Decode(expired, timeout=10)) == Code.NOT_FOUND


@pytest.mark.flags("--session_lease_seconds=1")
def test_calls_renew_the_lease(own) -> None:
    a = stub(own.address)
    session = a.OpenSession(pb.OpenSessionRequest(lease_ms=1200), timeout=10).session
    pages = allocate(a, 1, session)
    for _ in range(8):  # 2.4 s in all, twice the lease; a call every 0.3 s
        time.sleep(0.3)
        a.GetServerInfo(pb.GetServerInfoRequest(session=session), timeout=10)
    a.Decode(decode(pages, 10, session), timeout=10)


def test_handles_from_another_epoch_are_refused(own) -> None:
    a = stub(own.address)
    info = a.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    session = a.OpenSession(pb.OpenSessionRequest(), timeout=10)
    assert session.epoch == info.epoch != 0
    epoch, _, number = session.session.partition("-")
    stale = f"{(int(epoch, 16) ^ 1):016x}-{number}"  # the same session of another server run
    request = pb.AllocatePagesRequest(pool=POOL, num_pages=1, session=stale)
    assert code_of(lambda: a.AllocatePages(request, timeout=10)) == Code.FAILED_PRECONDITION
    garbage = pb.AllocatePagesRequest(pool=POOL, num_pages=1, session="not-a-handle")
    assert code_of(lambda: a.AllocatePages(garbage, timeout=10)) == Code.INVALID_ARGUMENT


def test_quotas_refuse_without_touching_other_sessions(own) -> None:
    a, b = stub(own.address), stub(own.address)
    small = a.OpenSession(pb.OpenSessionRequest(max_pages=5), timeout=10)
    assert small.max_pages == 5
    other = b.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    theirs = allocate(b, 20, other)
    mine = allocate(a, 4, small.session)
    before = free(a)
    assert code_of(lambda: allocate(a, 2, small.session)) == Code.RESOURCE_EXHAUSTED
    assert free(a) == before  # nothing allocated, nothing evicted
    b.Decode(decode(theirs, 300, other), timeout=10)
    a.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=mine[:2], session=small.session),
                timeout=10)  # fmt: skip
    allocate(a, 3, small.session)  # within the quota again


@pytest.mark.flags("--inject_fault=delay:1500")
def test_pages_of_a_queued_call_are_not_freed_under_it(own) -> None:
    a = stub(own.address)
    session = a.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    pages = allocate(a, 3, session)
    # A call holds the lane for 1.5 s; the one under test waits in the queue behind it.
    blocker = a.Decode.future(decode(pages[2:], 10, session), timeout=30)
    time.sleep(0.5)
    result: list = []
    call = threading.Thread(
        target=lambda: result.append(a.Decode(decode(pages, 20, session), timeout=10))
    )
    call.start()
    time.sleep(0.1)
    freeing = pb.FreePagesRequest(pool=POOL, page_ids=pages[:2], session=session)
    assert code_of(lambda: a.FreePages(freeing, timeout=10)) == Code.FAILED_PRECONDITION
    # Closing the session releases the pages, but only once the calls are done with them.
    before = free(a)
    a.CloseSession(pb.CloseSessionRequest(session=session), timeout=10)
    assert free(a) == before
    call.join()
    blocker.result()
    assert len(result) == 1
    assert free(a) == before + 3


def test_python_client_sessions(own) -> None:
    from attnserve import Client, FailedPrecondition, NotFound

    with Client(own.address) as a:
        opened = a.open_session(lease_s=30, max_pages=10)
        assert a.session == opened.session and opened.max_pages == 10
        pages = a.allocate_pages(3, pool=POOL)
        # Another client (another connection, once its channel differs) shares it by handle.
        with Client(own.address, session=a.session, max_message_bytes=1 << 20) as b:
            b.call_decode(decode(pages, 40))
        with Client(own.address, max_message_bytes=1 << 21) as stranger:
            with pytest.raises(FailedPrecondition):
                stranger.call_decode(decode(pages, 40))
        assert a.close_session() == 3
        assert a.session is None
        with Client(own.address, session=opened.session) as late:
            with pytest.raises(NotFound):
                late.allocate_pages(1, pool=POOL)
