"""Service behaviour across calls, each on a private server with its own flags: Prometheus
metrics, merging of concurrent calls, queue limits and deadlines, and the graceful drain."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from attnserve import AttnError, Client
from attnserve.tensors import float_to_bf16, pack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import server_config_pb2 as config_pb

from launcher import SessionStub, sample
from workload import PoolSession

POOL = "p"


def one_pool(heads: int = 8, kv_heads: int = 2, head_dim: int = 64, pages: int = 4096,
             layers: int = 1):  # fmt: skip
    config = config_pb.ServerConfig()
    config.pools.add(name=POOL, kind=pb.POOL_KIND_GQA, num_layers=layers, page_size=16,
                     num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     num_pages=pages)  # fmt: skip
    return config


def decode_request(pool: pb.PoolInfo, pages: list[int], tokens: int, rng) -> pb.DecodeRequest:
    """One sequence of `tokens` tokens on `pages`, a random query, nothing appended."""
    ps = pool.page_size
    n = (tokens + ps - 1) // ps
    q = rng.standard_normal((1, pool.num_qo_heads, pool.head_dim), dtype=np.float32)
    return pb.DecodeRequest(
        pool=pool.name,
        q=pack_tensor(float_to_bf16(q), pb.DTYPE_BF16),
        kv_indptr=[0, n],
        kv_indices=pages[:n],
        kv_last_page_len=[tokens - (n - 1) * ps],
        return_lse=True,
    )


FAMILIES = {
    "attn_rpc_duration_seconds": "histogram",
    "attn_rpc_requests_total": "counter",
    "attn_queue_wait_seconds": "histogram",
    "attn_kernel_duration_seconds": "histogram",
    "attn_launch_stage_seconds": "histogram",
    "attn_batch_requests": "histogram",
    "attn_batch_tokens": "histogram",
    "attn_kv_pages": "gauge",
    "attn_kv_pages_capacity": "gauge",
    "attn_page_alloc_failures_total": "counter",
    "attn_request_errors_total": "counter",
    "attn_transfer_bytes_total": "counter",
    "attn_inflight_requests": "gauge",
    "attn_build_info": "gauge",
    # The standard process families, from /proc/self.
    "process_cpu_seconds_total": "counter",
    "process_start_time_seconds": "gauge",
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
}


def test_metrics_are_exported_and_move(private) -> None:
    server = private(one_pool())
    with Client(server.address) as client:
        pool = client.pool_info(POOL)
        session = PoolSession(client, pool, seed=1)
        session.chunk(["a", "b"], [40, 17])
        session.decode_step(["a", "b"])
        with pytest.raises(AttnError) as full:
            client.allocate_pages(pool.total_pages, pool=POOL)
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        text = server.metrics()
        used = pool.total_pages - client.pool_info(POOL).free_pages
        session.close()

    # Names follow the conventions named in the issue; types are declared.
    for name, kind in FAMILIES.items():
        assert f"# TYPE {name} {kind}" in text, name
    # Latency buckets from 5 us to 10 s; batch sizes in powers of two.
    assert 'le="5e-06"' in text and 'le="10"' in text
    # Values moved with the calls above.
    assert sample(text, "attn_rpc_requests_total", method="Prefill", code="ok") == 1
    assert sample(text, "attn_rpc_requests_total", method="Decode", code="ok") == 1
    assert sample(text, "attn_rpc_requests_total", method="AllocatePages",
                  code="resource_exhausted") == 1  # fmt: skip
    assert sample(text, "attn_request_errors_total", method="AllocatePages",
                  reason="resource_exhausted") == 1  # fmt: skip
    assert sample(text, "attn_page_alloc_failures_total", pool=POOL) == 1
    assert sample(text, "attn_kv_pages", pool=POOL, state="used") == used > 0
    assert sample(text, "attn_kv_pages_capacity", pool=POOL) == pool.total_pages
    # Launch histograms are per pool and op.
    assert sample(text, "attn_batch_requests_count", pool=POOL, op="prefill") == 1
    assert sample(text, "attn_batch_tokens_sum", pool=POOL, op="prefill") == 57
    assert sample(text, "attn_kernel_duration_seconds_count", pool=POOL, op="decode") == 1
    assert sample(text, "attn_queue_wait_seconds_count", pool=POOL, op="decode") == 1
    for stage in ("prepare", "execute", "finish"):
        assert sample(text, "attn_launch_stage_seconds_count", pool=POOL, op="decode",
                      stage=stage) == 1  # fmt: skip
    assert sample(text, "attn_launch_stage_seconds_sum", pool=POOL, op="decode",
                  stage="execute") > 0  # fmt: skip
    assert sample(text, "attn_transfer_bytes_total", direction="in") > 0
    assert sample(text, "attn_transfer_bytes_total", direction="out") > 0
    assert sample(text, "attn_inflight_requests") == 0
    assert sample(text, "attn_build_info", version="0.1.0") == 1
    # Every method's success and internal-error counts exist from the start, at 0 until they move.
    for method in pb.DESCRIPTOR.services_by_name["AttentionService"].methods_by_name:
        assert f'attn_request_errors_total{{method="{method}",reason="internal"}} 0' in text
        assert f'attn_rpc_requests_total{{code="ok",method="{method}"}}' in text
    assert sample(text, "process_resident_memory_bytes") > 0
    assert 0 < sample(text, "process_open_fds") <= sample(text, "process_max_fds")
    assert time.time() - 3600 < sample(text, "process_start_time_seconds") <= time.time() + 1

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    check = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                           capture_output=True)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_concurrent_calls_merge_and_match_sequential_results(private) -> None:
    # A 50 ms batching window: calls that arrive together are served by one launch.
    server = private(one_pool(), "--max_queue_delay_us=50000")
    clients = 8
    with Client(server.address) as client:
        pool = client.pool_info(POOL)
        session = PoolSession(client, pool, seed=2)
        seqs = [f"s{i}" for i in range(clients)]
        session.chunk(seqs, [60 + 7 * i for i in range(clients)])
        rng = np.random.default_rng(3)
        requests = [
            decode_request(pool, session.table.pages(s), session.table.length(s), rng) for s in seqs
        ]
        alone = [client.call_decode(r) for r in requests]
        launches_before = sample(server.metrics(), "attn_batch_requests_count", op="decode")

        together: list = [None] * clients
        barrier = threading.Barrier(clients)

        def call(i: int) -> None:
            with Client(server.address) as own:
                barrier.wait()
                together[i] = own.call_decode(requests[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        launches = sample(server.metrics(), "attn_batch_requests_count", op="decode")
        session.close()

    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a.output, b.output) and np.array_equal(a.lse, b.lse)
    assert launches - launches_before < clients, "concurrent calls were not merged"
    assert max(r.timings.batch_requests for r in together) > 1


def test_timings_break_a_call_down_by_stage(private) -> None:
    server = private(one_pool())
    with Client(server.address) as client:
        pool = client.pool_info(POOL)
        pages = client.allocate_pages(4, pool=POOL)
        request = decode_request(pool, pages, 50, np.random.default_rng(3))
        t = client.call_decode(request).timings
    # The stages of the launch run one after another inside the call's server time.
    assert t.execute_us > 0 and 0 <= t.compute_us <= t.execute_us
    assert t.prepare_us >= 0 and t.finish_us >= 0
    assert t.queue_us + t.prepare_us + t.execute_us + t.finish_us <= t.total_us


def append_request(pool: pb.PoolInfo, pages: list[int], tokens: int, rng, layer: int = 0):
    """decode_request that also appends the last token's K/V (it lands in the last page)."""
    request = decode_request(pool, pages, tokens, rng)
    request.layer = layer
    for field in (request.k_new, request.v_new):
        kv = rng.standard_normal((1, pool.num_kv_heads, pool.head_dim), dtype=np.float32)
        field.CopyFrom(pack_tensor(float_to_bf16(kv), pb.DTYPE_BF16))
    return request


def test_overlapping_appends_to_one_page_are_refused(private) -> None:
    # A long batching window keeps the first call queued, holding the page it appends to.
    server = private(one_pool(layers=2), "--max_queue_delay_us=1000000")
    rng = np.random.default_rng(6)
    with Client(server.address) as client:
        pool = client.pool_info(POOL)
        pages = client.allocate_pages(4, pool=POOL)
        done = []
        first = threading.Thread(
            target=lambda: done.append(client.call_decode(append_request(pool, pages, 50, rng)))
        )
        first.start()
        time.sleep(0.3)
        with pytest.raises(AttnError) as clash:
            client.call_decode(append_request(pool, pages, 50, rng))
        assert clash.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "being appended to" in str(clash.value)
        # The same page of another layer holds other rows: no conflict.
        client.call_decode(append_request(pool, pages, 50, rng, layer=1))
        first.join()
        assert len(done) == 1
        # Once the first call finished, its page takes appends again.
        client.call_decode(append_request(pool, pages, 50, rng))
        client.free_pages(pages, pool=POOL)  # nothing still pinned
        assert client.pool_info(POOL).free_pages == pool.free_pages


def blocked_lane(server, pool: pb.PoolInfo, session_stub) -> threading.Thread:
    """A decode that holds the lane for the server's injected delay; running when this returns
    (the lane was free, and the launch takes seconds)."""
    pages = list(session_stub.AllocatePages(pb.AllocatePagesRequest(pool=POOL, num_pages=1),
                                            timeout=10).page_ids)  # fmt: skip
    request = decode_request(pool, pages, 16, np.random.default_rng(9))
    blocker = threading.Thread(target=session_stub.Decode, args=(request,),
                               kwargs={"timeout": 30})  # fmt: skip
    blocker.start()
    time.sleep(0.5)
    return blocker


def test_full_queue_answers_resource_exhausted_with_a_retry_hint(private) -> None:
    # Each launch takes 2 s: one call runs, one waits, the next finds the queue full.
    server = private(one_pool(), "--max_queue_requests=1", "--inject_fault=delay:2000")
    stub = SessionStub(server.address)
    pool = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).pools[0]
    pages = list(stub.AllocatePages(pb.AllocatePagesRequest(pool=POOL, num_pages=4),
                                    timeout=10).page_ids)  # fmt: skip
    request = decode_request(pool, pages[:1], 16, np.random.default_rng(4))
    blocker = blocked_lane(server, pool, stub)
    queued = stub.Decode.future(request, timeout=30)
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(decode_request(pool, pages[1:2], 16, np.random.default_rng(4)), timeout=10)
    queued.result()
    blocker.join()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hint = dict(err.value.trailing_metadata() or ())
    # The lane has been busy 0.7 s with a call as large as the queued one, so the work ahead is
    # at least that. (It said 1 ms: no launch had finished to measure the lane by.)
    assert int(hint["grpc-retry-pushback-ms"]) >= 500, hint


def test_a_call_whose_deadline_passes_in_the_queue_never_runs(private) -> None:
    server = private(one_pool(), "--inject_fault=delay:1500")
    stub = SessionStub(server.address)
    pool = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).pools[0]
    pages = list(stub.AllocatePages(pb.AllocatePagesRequest(pool=POOL, num_pages=4),
                                    timeout=10).page_ids)  # fmt: skip
    blocker = blocked_lane(server, pool, stub)
    request = decode_request(pool, pages, 50, np.random.default_rng(5))
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(request, timeout=0.2)  # queued behind the running launch until it expires
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    blocker.join()
    deadline = time.monotonic() + 10  # the batcher drops it when the lane frees up
    while True:
        text = server.metrics()
        dropped = sum(sample(text, "attn_rpc_requests_total", method="Decode", code=code)
                      for code in ("deadline_exceeded", "cancelled"))  # fmt: skip
        if dropped == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert dropped == 1
    assert sample(text, "attn_batch_requests_count", op="decode") == 1  # the blocker alone


def test_sigterm_drains_accepted_calls_and_exits_zero(private) -> None:
    # Calls wait up to 300 ms for company, so several are queued when the signal arrives.
    server = private(one_pool(32, 8, 128), "--max_queue_delay_us=300000",
                     "--drain_timeout_seconds=20")  # fmt: skip
    outcomes: list[tuple[float, grpc.StatusCode]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def load(seed: int) -> None:
        # No retries: each refusal must surface as the server's own code.
        with Client(server.address, timeout=30, retry=None) as own:
            pool = own.pool_info(POOL)
            pages = own.allocate_pages(64, pool=POOL)
            request = decode_request(pool, pages, 1000, np.random.default_rng(seed))
            while not stop.is_set():
                try:
                    own.call_decode(request)
                    code = grpc.StatusCode.OK
                except AttnError as e:
                    code = e.code
                with lock:
                    outcomes.append((time.monotonic(), code))
                if code != grpc.StatusCode.OK:
                    return

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    assert server.health() == 2, "health must be NOT_SERVING while draining"
    with Client(server.address, wait_for_ready=False) as late:
        with pytest.raises(AttnError) as refused:
            late.allocate_pages(1, pool=POOL)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    code = server.process.wait(timeout=20)
    stop.set()
    for t in threads:
        t.join()

    assert code == 0, server.log_tail()
    codes = {c for _, c in outcomes}
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    # Calls that were queued when the signal came finished normally.
    assert any(c == grpc.StatusCode.OK and t > signalled for t, c in outcomes)
