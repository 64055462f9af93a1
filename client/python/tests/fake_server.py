"""An in-process stand-in for the attnserve server, for the client's unit tests.

It keeps page ownership and a CacheMirror per pool and answers Prefill/Decode with the numpy
reference, so the client, the page-table helper and the example scheduler can be exercised over
real gRPC without the C++ server. It validates only what those tests need (pool names, page
ownership); the real server's validation is covered by tests/e2e.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np

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


class FakeAttentionService(pb_grpc.AttentionServiceServicer):
    """AttentionService over the numpy reference."""

    def __init__(self, pools: list[pb.PoolInfo]) -> None:
        self._pools = {p.name: _Pool(p) for p in pools}

    def GetServerInfo(self, request, context):  # noqa: N802 - gRPC method name
        pools = []
        for pool in self._pools.values():
            info = pb.PoolInfo()
            info.CopyFrom(pool.info)
            info.free_pages = len(pool.free)
            pools.append(info)
        return pb.GetServerInfoResponse(
            version="fake", backend="numpy", device="test", pools=pools, max_message_bytes=1 << 28
        )

    def AllocatePages(self, request, context):  # noqa: N802
        pool = self._pool(request.pool, context)
        if request.num_pages > len(pool.free):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(pool.free)} pages free")
        ids = sorted(pool.free)[: request.num_pages]
        pool.free.difference_update(ids)
        return pb.AllocatePagesResponse(page_ids=ids)

    def FreePages(self, request, context):  # noqa: N802
        pool = self._pool(request.pool, context)
        ids = set(request.page_ids)
        if ids & pool.free:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"not allocated: {ids & pool.free}")
        pool.free.update(ids)
        return pb.FreePagesResponse(free_pages=len(pool.free))

    def Prefill(self, request, context):  # noqa: N802
        return self._attend(request, np.asarray(request.qo_indptr, dtype=np.int32), context)

    def Decode(self, request, context):  # noqa: N802
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
            timings=pb.Timings(queue_us=1, compute_us=2, total_us=3, batch_requests=1),
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
