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

from launcher import Launched, launch, sample

POOL = "p"
PAGES = 512
Code = grpc.StatusCode


def config() -> config_pb.ServerConfig:
    c = config_pb.ServerConfig()
    c.pools.add(name=POOL, kind=pb.POOL_KIND_GQA, num_layers=1, page_size=16, num_qo_heads=32,
                num_kv_heads=8, head_dim=128, num_pages=PAGES)  # fmt: skip
    return c


def stub(server: Launched, **options: int) -> pb_grpc.AttentionServiceStub:
    """A stub on a connection of its own."""
    opts = [("grpc.use_local_subchannel_pool", 1), *options.items()]
    return pb_grpc.AttentionServiceStub(grpc.insecure_channel(server.address, options=opts))


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
    s = stub(server)
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


@pytest.mark.flags("--max_queue_delay_us=400000")
def test_cancelled_before_its_batch_forms(own) -> None:
    s = stub(own)
    pages = allocate(s, 4)
    call = s.Decode.future(decode(pages), timeout=10)
    time.sleep(0.1)  # queued, waiting for company
    call.cancel()
    time.sleep(0.5)  # past the batching window
    text = own.metrics()
    assert sample(text, "attn_rpc_requests_total", method="Decode", code="cancelled") == 1
    assert sample(text, "attn_batch_requests_count", op="decode") == 0  # it never ran
    s.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=pages), timeout=10)
    still_serves(own)


def test_cancelled_or_expired_while_running(tmp_path: Path) -> None:
    # A pool big enough that one decode over all of it takes ~0.1 s on the CPU backend.
    big = config()
    big.pools[0].num_pages = 16384
    server = launch(tmp_path, big)
    try:
        s = stub(server)
        pages = allocate(s, 16384)
        request = decode(pages, sequences=16)
        s.Decode(request, timeout=60)  # warm
        # The fastest of a few calls: a slow outlier would make the deadline below long enough
        # for a call to finish in time (on a GPU a call takes about a millisecond).
        duration = float("inf")
        for _ in range(3):
            start = time.monotonic()
            s.Decode(request, timeout=60)
            duration = min(duration, time.monotonic() - start)
        call = s.Decode.future(request, timeout=60)
        time.sleep(duration / 4)
        call.cancel()
        expect_code(lambda: s.Decode(request, timeout=duration / 4), Code.DEADLINE_EXCEEDED)
        # Both launches finish server-side and release their pins; until then the pages are in
        # use (FAILED_PRECONDITION), which on a fast backend can outlast any fixed wait.
        give_up = time.monotonic() + 30
        while True:
            try:
                s.FreePages(pb.FreePagesRequest(pool=POOL, page_ids=pages), timeout=10)
                break
            except grpc.RpcError as e:
                if e.code() != Code.FAILED_PRECONDITION or time.monotonic() > give_up:
                    raise
                time.sleep(0.01)
        assert server.health() == 1
        free = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).pools[0].free_pages
        assert free == 16384
    finally:
        server.process.kill()
        server.process.wait()


@pytest.mark.flags("--session_lease_seconds=1")
def test_a_client_killed_mid_call_loses_its_pages_to_the_lease(own) -> None:
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import grpc, test_faults as t
from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc
s = pb_grpc.AttentionServiceStub(grpc.insecure_channel({own.address!r}))
pages = [int(p) for p in s.AllocatePages(pb.AllocatePagesRequest(pool="p", num_pages=256),
                                         timeout=10).page_ids]
print("allocated", flush=True)
while True:
    s.Decode(t.decode(pages, sequences=16), timeout=30)
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
        with grpc.insecure_channel(
            own.address, options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            s = pb_grpc.AttentionServiceStub(channel)
            if i % 4 == 0:
                allocate(s, 1)  # its implicit session dies with the connection
            else:
                s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)

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
