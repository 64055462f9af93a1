"""An in-process stand-in for the attnserve server, for the client's unit tests.

It keeps page ownership and a CacheMirror per pool and answers Prefill/Decode with the numpy
reference, so the client, the page-table helper and the example scheduler can be exercised over
real gRPC without the C++ server. It validates only what those tests need (pool names, page
ownership); the real server's validation is covered by tests/e2e.

fail_next() scripts failures for the retry tests: a queue-full refusal carries the same
`grpc-retry-pushback-ms` trailer as attnserve's, and a failure "after" the call ran stands for a
reply lost in flight.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np

from attnserve.errors import RETRY_PUSHBACK_KEY
from attnserve.pages import BatchCsr
from attnserve.reference import CacheMirror, gqa_reference, mla_reference
from attnserve.tensors import pack_tensor, unpack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


class _Pool:
    def __init__(self, info: pb.PoolInfo) -> None:
        self.info = info
        self.free = set(range(info.total_pages))
        self.mirror = CacheMirror.for_pool(info)


@dataclass(frozen=True)
class Failure:
    """A scripted failure of one call: its status, the pushback trailer (ms) to send, and
    whether the call runs first (a reply lost after the server did the work)."""

    code: grpc.StatusCode
    pushback_ms: int | None = None
    after: bool = False


class FakeAttentionService(pb_grpc.AttentionServiceServicer):
    """AttentionService over the numpy reference, with scripted failures (fail_next)."""

    def __init__(self, pools: list[pb.PoolInfo]) -> None:
        self._pools = {p.name: _Pool(p) for p in pools}
        self._failures: dict[str, list[Failure]] = {}
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()  # calls received per method, failed ones included

    def fail_next(self, method: str, failure: Failure, times: int = 1) -> None:
        """The next `times` calls of method (e.g. "Prefill") fail as failure says."""
        with self._lock:
            self._failures.setdefault(method, []).extend([failure] * times)

    def GetServerInfo(self, request, context):  # noqa: N802 - gRPC method name
        return self._serve("GetServerInfo", self._server_info, request, context)

    def OpenSession(self, request, context):  # noqa: N802
        # The real server binds pages to sessions; the fake hands out handles and keeps none.
        with self._lock:
            self.calls["OpenSession"] += 1
            handle = f"{0:016x}-{self.calls['OpenSession']:032x}"
        return pb.OpenSessionResponse(session=handle, lease_ms=300_000)

    def AllocatePages(self, request, context):  # noqa: N802
        return self._serve("AllocatePages", self._allocate, request, context)

    def FreePages(self, request, context):  # noqa: N802
        return self._serve("FreePages", self._free, request, context)

    def Prefill(self, request, context):  # noqa: N802
        return self._serve("Prefill", self._prefill, request, context)

    def Decode(self, request, context):  # noqa: N802
        return self._serve("Decode", self._decode, request, context)

    def _serve(self, method: str, handler, request, context):
        """Counts the call and runs handler, failing before or after it when scripted."""
        with self._lock:
            self.calls[method] += 1
            pending = self._failures.get(method)
            failure = pending.pop(0) if pending else None
        if failure is None:
            return handler(request, context)
        if failure.after:
            handler(request, context)
        if failure.pushback_ms is not None:
            context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(failure.pushback_ms)),))
        context.abort(failure.code, f"scripted {failure.code.name}")

    def _server_info(self, request, context) -> pb.GetServerInfoResponse:
        pools = []
        for pool in self._pools.values():
            info = pb.PoolInfo()
            info.CopyFrom(pool.info)
            info.free_pages = len(pool.free)
            pools.append(info)
        return pb.GetServerInfoResponse(
            version="fake", backend="numpy", device="test", pools=pools, max_message_bytes=1 << 28
        )

    def _allocate(self, request, context) -> pb.AllocatePagesResponse:
        pool = self._pool(request.pool, context)
        if request.num_pages > len(pool.free):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(pool.free)} pages free")
        ids = sorted(pool.free)[: request.num_pages]
        pool.free.difference_update(ids)
        return pb.AllocatePagesResponse(page_ids=ids)

    def _free(self, request, context) -> pb.FreePagesResponse:
        pool = self._pool(request.pool, context)
        ids = set(request.page_ids)
        if ids & pool.free:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"not allocated: {ids & pool.free}")
        pool.free.update(ids)
        return pb.FreePagesResponse(free_pages=len(pool.free))

    def _prefill(self, request, context) -> pb.AttentionResponse:
        return self._attend(request, np.asarray(request.qo_indptr, dtype=np.int32), context)

    def _decode(self, request, context) -> pb.AttentionResponse:
        batch = len(request.kv_indptr) - 1
        return self._attend(request, np.arange(batch + 1, dtype=np.int32), context)

    def _attend(self, request, qo_indptr: np.ndarray, context) -> pb.AttentionResponse:
        pool = self._pool(request.pool, context)
        table = BatchCsr(
            qo_indptr,
            np.asarray(request.kv_indptr, dtype=np.int32),
            np.asarray(request.kv_indices, dtype=np.int32),
            np.asarray(request.kv_last_page_len, dtype=np.int32)
            if request.kv_last_page_len
            else None,
        )
        fields = {"k": "k_new", "v": "v_new", "ckv": "ckv_new", "kpe": "kpe_new"}
        new = {
            f: unpack_tensor(getattr(request, arg))
            for f, arg in fields.items()
            if request.HasField(arg)
        }
        if new:
            pool.mirror.append(request.layer, table, new)
        q = unpack_tensor(request.q)
        if pool.info.kind == pb.POOL_KIND_MLA:
            out, lse = mla_reference(
                pool.mirror, request.layer, table, q, unpack_tensor(request.q_pe), request.sm_scale
            )
        else:
            scale = request.sm_scale if request.HasField("sm_scale") else None
            out, lse = gqa_reference(pool.mirror, request.layer, table, q, scale)
        response = pb.AttentionResponse(
            output=pack_tensor(out.astype(np.float32)),
            timings=pb.Timings(
                queue_us=1,
                compute_us=2,
                total_us=9,
                batch_requests=1,
                prepare_us=3,
                execute_us=4,
                finish_us=5,
            ),
        )
        if request.return_lse:
            response.lse.CopyFrom(pack_tensor(lse.astype(np.float32), pb.DTYPE_FP32))
        return response

    def _pool(self, name: str, context) -> _Pool:
        if not name and len(self._pools) == 1:
            return next(iter(self._pools.values()))
        if name not in self._pools:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no pool {name!r}")
        return self._pools[name]


def gqa_pool(name: str = "gqa", **overrides: int) -> pb.PoolInfo:
    """A small GQA PoolInfo (2 layers, page_size 4, 4/2 heads, head_dim 8, 64 pages)."""
    geometry = (
        dict(num_layers=2, page_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=8, total_pages=64)
        | overrides
    )
    return pb.PoolInfo(name=name, kind=pb.POOL_KIND_GQA, kv_dtype=pb.DTYPE_BF16, **geometry)


def mla_pool(name: str = "mla", **overrides: int) -> pb.PoolInfo:
    """A small MLA PoolInfo (2 layers, page_size 8, 2 heads, 32 pages)."""
    geometry = dict(num_layers=2, page_size=8, num_qo_heads=2, total_pages=32) | overrides
    return pb.PoolInfo(
        name=name,
        kind=pb.POOL_KIND_MLA,
        num_kv_heads=1,
        ckv_dim=512,
        kpe_dim=64,
        kv_dtype=pb.DTYPE_BF16,
        **geometry,
    )


def start(service: pb_grpc.AttentionServiceServicer) -> tuple[grpc.Server, str]:
    """Serves service on a free loopback port; returns the server and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pb_grpc.add_AttentionServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
