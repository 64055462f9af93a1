"""Faults: device failures (through the --inject_fault hook), cancelled and expired calls, clients
that die or churn connections, an exhausted pool, oversized messages. After each, the server still
serves and every page it should have back is back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from attnserve.tensors import float_to_bf16, pack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve.v1 import server_config_pb2 as config_pb

from launcher import Launched, SessionStub, sample

POOL = "p"
PAGES = 512
Code = grpc.StatusCode


def config() -> config_pb.ServerConfig:
    c = config_pb.ServerConfig()
    c.pools.add(name=POOL, kind=pb.POOL_KIND_GQA, num_layers=1, page_size=16, num_qo_heads=32,
                num_kv_heads=8, head_dim=128, num_pages=PAGES)  # fmt: skip
    return c


def stub(server: Launched, **options: int) -> SessionStub:
    """A stub on a connection of its own, naming a session of its own."""
    return SessionStub(server.address, **options)


def allocate(s, n: int) -> list[int]:
    return list(
        s.AllocatePages(pb.AllocatePagesRequest(pool=POOL, num_pages=n), timeout=10).page_ids
    )


def decode(pages: list[int], sequences: int = 1) -> pb.DecodeRequest:
    """`sequences` sequences over all of `pages` (split evenly), no append."""
    per = len(pages) // sequences
    q = np.random.default_rng(0).standard_normal((sequences, 32, 128), dtype=np.float32)
    return pb.DecodeRequest(pool=POOL, q=pack_tensor(float_to_bf16(q), pb.DTYPE_BF16),
                            kv_indptr=[per * i for i in range(sequences + 1)],
                            kv_indices=pages[:per * sequences],
                            kv_last_page_len=[16] * sequences)  # fmt: skip


def free_pages(server: Launched) -> int:
    s = pb_grpc.AttentionServiceStub(grpc.insecure_channel(server.address))
    return s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).pools[0].free_pages


def expect_code(call, code: Code) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()


def still_serves(server: Launched, used: int = 0) -> None:
    assert server.process.poll() is None, server.log_tail()
    assert server.health() == 1
    assert free_pages(server) == PAGES - used


@pytest.mark.flags("--inject_fault=sticky:3")
def test_a_sticky_device_error_fails_calls_and_exits_nonzero(own) -> None:
    s = stub(own)
    pages = allocate(s, 4)
    s.Decode(decode(pages), timeout=10)
    s.Decode(decode(pages), timeout=10)
    expect_code(lambda: s.Decode(decode(pages), timeout=10), Code.INTERNAL)
    # The context is gone: the process must stop serving and exit non-zero for a restart.
    assert own.process.wait(timeout=15) == 1
    assert "fatal device error" in own.log.read_text()


@pytest.mark.flags("--inject_fault=alloc:2")
def test_a_device_allocation_failure_fails_one_call_only(own) -> None:
    s = stub(own)
    pages = allocate(s, 4)
    s.Decode(decode(pages), timeout=10)
    expect_code(lambda: s.Decode(decode(pages), timeout=10), Code.RESOURCE_EXHAUSTED)
    s.Decode(decode(pages), timeout=10)
    s.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=pages), timeout=10)
    still_serves(own)


def start_blocker(s: SessionStub, pages: list[int]):
    """A call that holds the lane for the injected delay; sent, and running 0.5 s later."""
    call = s.Decode.future(decode(pages), timeout=30)
    time.sleep(0.5)
    return call


@pytest.mark.flags("--inject_fault=delay:2000")
def test_cancelled_before_its_batch_forms(own) -> None:
    s = stub(own)
    pages = allocate(s, 4)
    blocker = start_blocker(s, pages[:2])
    call = s.Decode.future(decode(pages[2:]), timeout=10)  # queued behind the running launch
    time.sleep(0.1)
    call.cancel()
    blocker.result()
    deadline = time.monotonic() + 10  # the batcher drops it once the lane is free
    while True:
        text = own.metrics()
        if sample(text, "attn_rpc_requests_total", method="Decode", code="cancelled") == 1:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    assert sample(text, "attn_batch_requests_count", op="decode") == 1  # the blocker's only
    s.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=pages), timeout=10)
    still_serves(own)


# Each launch takes 1.5 s (the delay hook), so "while running" is a fact, not a race: the
# deadline used to be a fraction of a measured call time, which a fast device outran.
@pytest.mark.flags("--inject_fault=delay:1500")
def test_cancelled_or_expired_while_running(own) -> None:
    s = stub(own)
    pages = allocate(s, 16)
    request = decode(pages, sequences=4)
    call = s.Decode.future(request, timeout=30)
    time.sleep(0.5)  # running
    call.cancel()
    time.sleep(1.2)  # that launch is over; the next call has the lane to itself
    expect_code(lambda: s.Decode(request, timeout=0.5), Code.DEADLINE_EXCEEDED)
    # Both launches finish server-side and release their pins (within their 1.5 s).
    give_up = time.monotonic() + 10
    while True:
        try:
            s.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=pages), timeout=10)
            break
        except grpc.RpcError as e:
            if e.code() != Code.FAILED_PRECONDITION or time.monotonic() > give_up:
                raise
            time.sleep(0.01)
    still_serves(own)


@pytest.mark.flags("--session_lease_seconds=1")
def test_a_client_killed_mid_call_loses_its_pages_to_the_lease(own) -> None:
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import grpc, test_faults as t
from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc
s = pb_grpc.AttentionServiceStub(grpc.insecure_channel({own.address!r}))
session = s.OpenSession(pb.OpenSessionRequest(), timeout=10).session
pages = [int(p) for p in s.AllocatePages(
    pb.AllocatePagesRequest(pool="p", num_pages=256, session=session), timeout=10).page_ids]
print("allocated", flush=True)
while True:
    request = t.decode(pages, sequences=16)
    request.session = session
    s.Decode(request, timeout=30)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout.readline().strip() == "allocated"
    time.sleep(0.3)  # mid-call
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 10
    while free_pages(own) != PAGES and time.monotonic() < deadline:
        time.sleep(0.1)
    still_serves(own)
    metrics = own.metrics()
    assert sample(metrics, "attn_pages_reclaimed_total", pool=POOL) == 256
    # Pages pinned at the reclaim are freed by their call's end; the gauge follows that too.
    assert sample(metrics, "attn_kv_pages", pool=POOL, state="used") == 0


@pytest.mark.flags("--session_lease_seconds=1")
def test_thousands_of_connections_opened_and_dropped(own) -> None:
    def churn(i: int) -> None:
        if i % 4 == 0:
            allocate(stub(own), 1)  # its session's lease (1 s) reclaims the page
        else:
            with grpc.insecure_channel(
                own.address, options=[("grpc.use_local_subchannel_pool", 1)]
            ) as channel:
                pb_grpc.AttentionServiceStub(channel).GetServerInfo(
                    pb.GetServerInfoRequest(), timeout=10
                )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(churn, range(2000)))
    deadline = time.monotonic() + 10
    while free_pages(own) != PAGES and time.monotonic() < deadline:
        time.sleep(0.2)
    still_serves(own)


def test_an_exhausted_pool_recovers(own) -> None:
    s = stub(own)
    pages = allocate(s, PAGES)
    expect_code(lambda: allocate(s, 1), Code.RESOURCE_EXHAUSTED)
    s.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=pages[:10]), timeout=10)
    more = allocate(s, 10)
    s.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=pages[10:] + more), timeout=10)
    still_serves(own)


@pytest.mark.flags("--max_message_bytes=1048576")
def test_a_message_over_the_size_limit_is_refused(own) -> None:
    s = stub(own, **{"grpc.max_send_message_length": 8 << 20})
    pages = allocate(s, 4)
    big = decode(pages)
    big.q.data = bytes(2 << 20)  # 2 MiB: over the 1 MiB limit
    expect_code(lambda: s.Decode(big, timeout=10), Code.RESOURCE_EXHAUSTED)
    s.Decode(decode(pages), timeout=10)
    s.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=pages), timeout=10)
    still_serves(own)
