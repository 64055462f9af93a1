"""An in-process stand-in for the attnserve server, for the client's unit tests.

It keeps page ownership and a CacheMirror per pool and answers Prefill/Decode with the numpy
reference, so the client, the page-table helper and the example scheduler can be exercised over
real gRPC without the C++ server. It validates only what those tests need (pool names, page
ownership); the real server's validation is covered by tests/e2e.

fail_next() scripts failures for the retry tests: a queue-full refusal carries the same
`grpc-retry-pushback-ms` trailer as attnserve's, and a failure "after" the call ran stands for a
reply lost in flight.

With shared_memory=True it also serves the data plane's shared-memory regions as
attention.proto describes them (RegisterRegion maps the object and checks its header; tensors,
page tables and outputs may be region slices, checked for bounds and alignment), so the
client's transports can be tested without the C++ server. `seen` keeps every Prefill/Decode
request as received.

Plans (CreatePlan / ReleasePlan) are kept per session as attention.proto describes them: a call
naming one uses its table, and FreePages refuses the pages a plan pins.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import Counter
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np

from attnserve.errors import RETRY_PUSHBACK_KEY
from attnserve.pages import BatchCsr
from attnserve.reference import CacheMirror, gqa_reference, mla_reference
from attnserve.regions import HEADER_BYTES, REGION_MAGIC
from attnserve.tensors import pack_tensor, unpack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


class _Pool:
    def __init__(self, info: pb.PoolInfo) -> None:
        self.info = info
        self.free = set(range(info.total_pages))
        self.mirror = CacheMirror.for_pool(info)


MAX_PLANS = 4  # DataPlane.max_plans_per_session


@dataclass(frozen=True)
class _Plan:
    pool: str
    prefill: bool
    arrays: dict[str, np.ndarray]  # the page table, as _page_table returns it


@dataclass(frozen=True)
class Failure:
    """A scripted failure of one call: its status, the pushback trailer (ms) to send, and
    whether the call runs first (a reply lost after the server did the work)."""

    code: grpc.StatusCode
    pushback_ms: int | None = None
    after: bool = False


class FakeAttentionService(pb_grpc.AttentionServiceServicer):
    """AttentionService over the numpy reference, with scripted failures (fail_next)."""

    def __init__(self, pools: list[pb.PoolInfo], *, shared_memory: bool = False) -> None:
        self._pools = {p.name: _Pool(p) for p in pools}
        self._failures: dict[str, list[Failure]] = {}
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()  # calls received per method, failed ones included
        self.shared_memory = shared_memory
        self.regions: dict[tuple[str, str], mmap.mmap] = {}  # (session, name) -> mapping
        self.plans: dict[tuple[str, str], _Plan] = {}  # (session, name) -> plan
        self.seen: list = []

    def fail_next(self, method: str, failure: Failure, times: int = 1) -> None:
        """The next `times` calls of method (e.g. "Prefill") fail as failure says."""
        with self._lock:
            self._failures.setdefault(method, []).extend([failure] * times)

    def GetServerInfo(self, request, context):  # noqa: N802 - gRPC method name
        return self._serve("GetServerInfo", self._server_info, request, context)

    def AllocatePages(self, request, context):  # noqa: N802
        return self._serve("AllocatePages", self._allocate, request, context)

    def FreePages(self, request, context):  # noqa: N802
        return self._serve("FreePages", self._free, request, context)

    def Prefill(self, request, context):  # noqa: N802
        return self._serve("Prefill", self._prefill, request, context)

    def Decode(self, request, context):  # noqa: N802
        return self._serve("Decode", self._decode, request, context)

    def OpenSession(self, request, context):  # noqa: N802
        with self._lock:
            self.calls["OpenSession"] += 1
            handle = f"session-{self.calls['OpenSession']}"
        return pb.OpenSessionResponse(session=handle, lease_ms=request.lease_ms or 30000)

    def CloseSession(self, request, context):  # noqa: N802
        """Drops the session's regions (pages are not kept per session here)."""
        for key in [k for k in self.regions if k[0] == request.session]:
            self.regions.pop(key).close()
        for key in [k for k in self.plans if k[0] == request.session]:
            del self.plans[key]
        return pb.CloseSessionResponse()

    def RegisterRegion(self, request, context):  # noqa: N802
        return self._serve("RegisterRegion", self._register, request, context)

    def UnregisterRegion(self, request, context):  # noqa: N802
        return self._serve("UnregisterRegion", self._unregister, request, context)

    def ListRegions(self, request, context):  # noqa: N802
        return self._serve("ListRegions", self._list_regions, request, context)

    def CreatePlan(self, request, context):  # noqa: N802
        return self._serve("CreatePlan", self._create_plan, request, context)

    def ReleasePlan(self, request, context):  # noqa: N802
        return self._serve("ReleasePlan", self._release_plan, request, context)

    def _create_plan(self, request, context) -> pb.CreatePlanResponse:
        pool = self._pool(request.pool, context).info.name
        if not request.HasField("page_table") and request.prefill != bool(request.qo_indptr):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefill disagrees with qo_indptr")
        arrays = self._page_table(request, request.prefill, context)
        if set(arrays["kv_indices"].tolist()) & self._pools[pool].free:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "pages not allocated")
        key = (request.session, request.name)
        if key not in self.plans and sum(k[0] == key[0] for k in self.plans) >= MAX_PLANS:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_PLANS} plans")
        self.plans[key] = _Plan(pool, request.prefill, arrays)
        batch = len(arrays["kv_indptr"]) - 1
        total_q = int(arrays["qo_indptr"][-1]) if request.prefill else batch
        return pb.CreatePlanResponse(
            batch=batch, total_q=total_q, num_pages=len(arrays["kv_indices"])
        )

    def _release_plan(self, request, context) -> pb.ReleasePlanResponse:
        if self.plans.pop((request.session, request.name), None) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no plan {request.name!r}")
        return pb.ReleasePlanResponse()

    def _call_table(self, request, prefill: bool, context) -> dict[str, np.ndarray]:
        """The page table of a Prefill/Decode: its plan's, else its own (_page_table)."""
        if not request.plan:
            return self._page_table(request, prefill, context)
        plan = self.plans.get((request.session, request.plan))
        if plan is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no plan {request.plan!r}")
        if plan.prefill != prefill or plan.pool != self._pool(request.pool, context).info.name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan {request.plan!r} is another's")
        return dict(plan.arrays)

    def _register(self, request, context) -> pb.RegisterRegionResponse:
        if not self.shared_memory or request.WhichOneof("memory") != "shared_memory":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this kind of region is not enabled")
        name = request.shared_memory.shm_name
        if not name.startswith("/attnserve") or request.offset % 64 or request.size < 48:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad region {request}")
        key = (request.session, request.name)
        if key in self.regions:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, request.name)
        import _posixshmem

        fd = _posixshmem.shm_open(name, os.O_RDWR, 0)
        try:
            if os.fstat(fd).st_size < request.offset + request.size:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "object too small")
            mapping = mmap.mmap(fd, request.offset + request.size)
        finally:
            os.close(fd)
        header = mapping[request.offset : request.offset + HEADER_BYTES]
        if header != REGION_MAGIC + request.key:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "header does not match")
        self.regions[key] = mapping
        info = pb.RegionInfo(name=request.name, kind=pb.RegionInfo.KIND_SHARED_MEMORY,
                             size=request.size)  # fmt: skip
        return pb.RegisterRegionResponse(region=info)

    def _unregister(self, request, context) -> pb.UnregisterRegionResponse:
        mapping = self.regions.pop((request.session, request.name), None)
        if mapping is None:
            context.abort(grpc.StatusCode.NOT_FOUND, request.name)
        mapping.close()
        return pb.UnregisterRegionResponse()

    def _list_regions(self, request, context) -> pb.ListRegionsResponse:
        return pb.ListRegionsResponse(
            regions=[pb.RegionInfo(name=n, kind=pb.RegionInfo.KIND_SHARED_MEMORY, size=len(m))
                     for (session, n), m in self.regions.items() if session == request.session]
        )  # fmt: skip

    def _slice(self, request, at: pb.RegionSlice, nbytes: int, context) -> memoryview:
        """Bytes [offset, offset + nbytes) of a region of the call's session, checked."""
        mapping = self.regions.get((request.session, at.name))
        if mapping is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no region {at.name!r}")
        if at.offset % 16 or at.offset < 0 or at.offset + nbytes > len(mapping):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad slice {at} of {nbytes} bytes")
        return memoryview(mapping)[at.offset : at.offset + nbytes]

    def _tensor(self, request, name: str, context) -> pb.Tensor:
        """A request's tensor with its bytes, read from its region when it names one."""
        t = getattr(request, name)
        if not t.HasField("region"):
            return t
        itemsize = {pb.DTYPE_BF16: 2, pb.DTYPE_FP16: 2, pb.DTYPE_FP32: 4}[t.dtype]
        data = self._slice(request, t.region, itemsize * int(np.prod(t.shape)), context)
        return pb.Tensor(dtype=t.dtype, shape=t.shape, data=bytes(data))

    def _page_table(self, request, prefill: bool, context) -> dict[str, np.ndarray]:
        """The call's page table arrays, from its PageTableRef when it has one."""
        if not request.HasField("page_table"):
            fields = ["kv_indptr", "kv_indices", "kv_last_page_len"] + ["qo_indptr"] * prefill
            return {f: np.asarray(getattr(request, f), dtype=np.int32) for f in fields}
        ref = request.page_table
        b, n = ref.batch, ref.num_pages
        sizes = [("kv_indptr", b + 1), ("kv_last_page_len", b), ("kv_indices", n)] + [
            ("qo_indptr", b + 1)] * prefill  # fmt: skip
        flat = np.frombuffer(
            self._slice(request, ref.at, 4 * sum(k for _, k in sizes), context), dtype="<i4"
        ).copy()
        out, start = {}, 0
        for name, count in sizes:
            out[name], start = flat[start : start + count], start + count
        return out

    def _write(self, request, at: pb.RegionSlice, tensor: pb.Tensor, context) -> pb.Tensor:
        """Writes tensor's bytes into a region slice; returns the response Tensor naming it."""
        self._slice(request, at, len(tensor.data), context)[:] = tensor.data
        return pb.Tensor(dtype=tensor.dtype, shape=tensor.shape, region=at)

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
        data_plane = pb.DataPlane(
            shared_memory=self.shared_memory, max_regions_per_session=16,
            max_region_bytes_per_session=1 << 30, max_plans_per_session=MAX_PLANS)  # fmt: skip
        return pb.GetServerInfoResponse(
            version="fake", backend="numpy", device="test", pools=pools,
            max_message_bytes=1 << 28, data_plane=data_plane)  # fmt: skip

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
        pinned = {int(i) for p in self.plans.values() if p.pool == pool.info.name
                  for i in p.arrays["kv_indices"]}  # fmt: skip
        if ids & pinned:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"pinned by a plan: {ids & pinned}")
        pool.free.update(ids)
        return pb.FreePagesResponse(free_pages=len(pool.free))

    def _prefill(self, request, context) -> pb.AttentionResponse:
        return self._attend(request, self._call_table(request, True, context), context)

    def _decode(self, request, context) -> pb.AttentionResponse:
        arrays = self._call_table(request, False, context)
        arrays["qo_indptr"] = np.arange(len(arrays["kv_indptr"]), dtype=np.int32)
        return self._attend(request, arrays, context)

    def _attend(self, request, arrays: dict[str, np.ndarray], context) -> pb.AttentionResponse:
        self.seen.append(request)
        pool = self._pool(request.pool, context)
        last = arrays["kv_last_page_len"]
        table = BatchCsr(
            arrays["qo_indptr"],
            arrays["kv_indptr"],
            arrays["kv_indices"],
            last if last.size else None,
        )
        q_message = self._tensor(request, "q", context)
        if request.HasField("output_to"):  # checked before anything changes, as attnserve does
            self._slice(request, request.output_to, 2 * int(np.prod(q_message.shape)), context)
        if request.return_lse and request.HasField("lse_to"):
            self._slice(request, request.lse_to, 4 * int(np.prod(q_message.shape[:2])), context)
        fields = {"k": "k_new", "v": "v_new", "ckv": "ckv_new", "kpe": "kpe_new"}
        new = {
            f: unpack_tensor(self._tensor(request, arg, context))
            for f, arg in fields.items()
            if request.HasField(arg)
        }
        if new:
            pool.mirror.append(request.layer, table, new)
        q = unpack_tensor(q_message)
        if pool.info.kind == pb.POOL_KIND_MLA:
            q_pe = unpack_tensor(self._tensor(request, "q_pe", context))
            out, lse = mla_reference(pool.mirror, request.layer, table, q, q_pe, request.sm_scale)
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
        if request.HasField("output_to"):
            response.output.CopyFrom(
                self._write(request, request.output_to, response.output, context)
            )
        if request.return_lse and request.HasField("lse_to"):
            response.lse.CopyFrom(self._write(request, request.lse_to, response.lse, context))
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
