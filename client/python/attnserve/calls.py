"""What the sync and the asyncio clients share: the RPC table, request building, result decoding.

Client (client.py) and AsyncClient (aio.py) differ only in how they wait: each public method
builds its request here, runs it through the client's retry loop, and decodes the response with
the Rpc's decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from attnserve.pages import BatchCsr
from attnserve.plans import PlanBase
from attnserve.tensors import bf16_to_float, pack_tensor, unpack_tensor, wire_array
from attnserve.torch_tensors import _import_torch, is_torch_tensor, pack_torch, tensor_to_torch
from attnserve.transport import TENSOR_FIELDS, StagedPageTable
from attnserve.v1 import attention_pb2 as pb

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# A tensor argument: a float array (rounded to bf16), a uint16 array (raw bf16 bits), a torch
# tensor (bf16 sent as is, other floating types rounded to bf16; attnserve.torch_tensors) or a
# ready-made Tensor message (sent as is, e.g. to send another dtype).
TensorLike = npt.ArrayLike | pb.Tensor
# An index array argument: 1-D integers (sent as int32).
IndexLike = npt.ArrayLike

T = TypeVar("T")


@dataclass(frozen=True)
class Rpc(Generic[T]):
    """One AttentionService method: its name on the stub, whether running it twice is harmless
    (so it may be retried after UNAVAILABLE; attnserve.retry), and its response decoder."""

    name: str
    idempotent: bool
    decode: Callable[[Any], T]


@dataclass(frozen=True)
class Timings:
    """Server-side time of one call, in microseconds (attention.proto Timings)."""

    queue_us: int
    compute_us: int
    total_us: int
    batch_requests: int
    # The launch's stages: gathering inputs, the backend's work (GPU: copies in, kernels,
    # copies out; compute_us is part of it), writing outputs.
    prepare_us: int = 0
    execute_us: int = 0
    finish_us: int = 0

    @classmethod
    def from_proto(cls, t: pb.Timings) -> Timings:
        return cls(t.queue_us, t.compute_us, t.total_us, t.batch_requests, t.prepare_us,
                   t.execute_us, t.finish_us)  # fmt: skip


@dataclass(frozen=True)
class AttentionResult:
    """Result of Prefill or Decode, decoded from the response when first read.

    output: float32 numpy [total_q, H, D] (GQA) or [total_q, H, 512] (MLA), widened from bf16.
    lse: float32 numpy [total_q, H] base-2 log-sum-exp, or None when not requested.
    output_bits(): the bf16 output as uint16 bit patterns (exact, no conversion).
    output_torch() / lse_torch(): torch tensors, bf16 straight from the wire bits (needs torch).

    Every accessor returns a copy the caller owns. When the server wrote the output into a
    region (attnserve.transport), region_output / region_lse hold what was copied out of it
    when the response arrived: numpy (uint16 bf16 bits, float32 lse) for shared memory, torch
    tensors on the GPU for CUDA IPC, whose output_torch("cuda") involves no host copy.
    """

    response: pb.AttentionResponse = field(repr=False)
    region_output: Any = field(default=None, repr=False)
    region_lse: Any = field(default=None, repr=False)

    @classmethod
    def from_proto(cls, response: pb.AttentionResponse) -> AttentionResult:
        return cls(response)

    @cached_property
    def output(self) -> np.ndarray:
        if self.region_output is None:
            return unpack_tensor(self.response.output)
        return bf16_to_float(self._output_bits())

    @cached_property
    def lse(self) -> np.ndarray | None:
        if self.region_lse is not None:
            return _numpy(self.region_lse).copy()
        return unpack_tensor(self.response.lse) if self.response.HasField("lse") else None

    @property
    def timings(self) -> Timings:
        return Timings.from_proto(self.response.timings)

    def output_bits(self) -> np.ndarray:
        """The output as sent: uint16 bf16 bit patterns of its shape."""
        if self.region_output is None:
            return wire_array(self.response.output)
        return self._output_bits().copy()

    def output_torch(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The output as a torch.bfloat16 tensor on device (default CPU), bit-exact."""
        if self.region_output is None:
            return tensor_to_torch(self.response.output, device)
        return _torch_copy(self.region_output, device, bits=True)

    def lse_torch(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """The lse as a torch.float32 tensor on device, or None when not requested."""
        if self.region_lse is not None:
            return _torch_copy(self.region_lse, device, bits=False)
        if not self.response.HasField("lse"):
            return None
        return tensor_to_torch(self.response.lse, device)

    def _output_bits(self) -> np.ndarray:
        out = self.region_output
        if isinstance(out, np.ndarray):
            return out
        return out.view(_import_torch().int16).cpu().numpy().view(np.uint16)


def _numpy(value: Any) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.cpu().numpy()


def _torch_copy(value: Any, device: Any, *, bits: bool) -> torch.Tensor:
    """A new torch tensor of a region output (numpy bf16 bits / float32, or a torch tensor)."""
    torch = _import_torch()
    if isinstance(value, np.ndarray):
        t = torch.from_numpy(value.view(np.int16).copy() if bits else value.copy())
        t = t.view(torch.bfloat16) if bits else t
        return t if device is None else t.to(device)
    return value.to("cpu" if device is None else device, copy=True)


def _same(response: T) -> T:
    return response


SERVER_INFO: Rpc[pb.GetServerInfoResponse] = Rpc("GetServerInfo", True, _same)
ALLOCATE_PAGES: Rpc[list[int]] = Rpc("AllocatePages", False, lambda r: list(r.page_ids))
FREE_PAGES: Rpc[int] = Rpc("FreePages", False, lambda r: r.free_pages)
PREFILL: Rpc[AttentionResult] = Rpc("Prefill", True, AttentionResult.from_proto)
DECODE: Rpc[AttentionResult] = Rpc("Decode", True, AttentionResult.from_proto)
# Repeating OpenSession after a lost reply leaves an unused session, which its lease ends.
OPEN_SESSION: Rpc[pb.OpenSessionResponse] = Rpc("OpenSession", True, _same)
CLOSE_SESSION: Rpc[int] = Rpc("CloseSession", False, lambda r: r.freed_pages)
# Registering again after a lost reply would fail with ALREADY_EXISTS: not retried.
REGISTER_REGION: Rpc[pb.RegisterRegionResponse] = Rpc("RegisterRegion", False, _same)
UNREGISTER_REGION: Rpc[pb.UnregisterRegionResponse] = Rpc("UnregisterRegion", False, _same)
LIST_REGIONS: Rpc[list[pb.RegionInfo]] = Rpc("ListRegions", True, lambda r: list(r.regions))
# CreatePlan replaces the plan of its name, so repeating it after a lost reply is harmless.
CREATE_PLAN: Rpc[pb.CreatePlanResponse] = Rpc("CreatePlan", True, _same)
RELEASE_PLAN: Rpc[pb.ReleasePlanResponse] = Rpc("ReleasePlan", False, _same)


def open_session_request(lease_s: float | None, max_pages: int | None) -> pb.OpenSessionRequest:
    """lease_s / max_pages None: the server's defaults."""
    return pb.OpenSessionRequest(
        lease_ms=round(lease_s * 1000) if lease_s else 0, max_pages=max_pages or 0
    )


# Methods whose calls must name a session: the server has no implicit sessions (attention.proto,
# "Sessions and leases"), so a client without one opens one on its first such call.
NEEDS_SESSION = frozenset(
    {"AllocatePages", "FreePages", "Prefill", "Decode", "RegisterRegion", "UnregisterRegion",
     "ListRegions", "CreatePlan", "ReleasePlan"}
)  # fmt: skip


def with_session(request: Any, session: str | None) -> Any:
    """Names the client's session in a request that names none (OpenSessionRequest, which
    opens one, has no session field)."""
    if session and "session" in request.DESCRIPTOR.fields_by_name and not request.session:
        request.session = session
    return request


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Send and receive limits raised from gRPC's 4 MiB (too small for prefill batches), and
    reconnects after 0.1 s growing to 2 s instead of gRPC's 1 s growing to 120 s, so that a call
    waiting for a server that is starting (wait_for_ready) gets through soon after it is up."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def select_pool(pools: Sequence[pb.PoolInfo], name: str) -> pb.PoolInfo:
    """The pool called name; "" selects the only pool (ValueError if there are several)."""
    if not name:
        if len(pools) != 1:
            raise ValueError(f"the server has {len(pools)} pools; name one")
        return pools[0]
    for info in pools:
        if info.name == name:
            return info
    raise ValueError(f"no pool {name!r}; the server has {[p.name for p in pools]}")


def allocate_pages_request(num_pages: int, pool: str) -> pb.AllocatePagesRequest:
    return pb.AllocatePagesRequest(pool=pool, num_pages=num_pages)


def free_pages_request(page_ids: IndexLike, pool: str) -> pb.FreePagesRequest:
    return pb.FreePagesRequest(pool=pool, page_ids=_ints(page_ids, "page_ids"))


# A page table argument: CSR arrays, a table staged in shared memory for a step's calls, or a
# plan the server checked and pinned for them (Plan or AsyncPlan).
TableLike = BatchCsr | StagedPageTable | PlanBase


def prefill_request(
    layer: int, q: TensorLike, table: TableLike, **inputs: Any
) -> pb.PrefillRequest:
    """A PrefillRequest with every tensor in the message; table.qo_indptr splits the query
    rows. inputs: the keyword arguments of Client.prefill (pool, q_pe, k_new, v_new, ckv_new,
    kpe_new, sm_scale, return_lse)."""
    request, tensors = attention_request(PREFILL, layer, q, table, **inputs)
    fill_tensors(request, tensors)
    return request


def decode_request(layer: int, q: TensorLike, table: TableLike, **inputs: Any) -> pb.DecodeRequest:
    """A DecodeRequest: one query row per sequence, table.qo_indptr is not sent. inputs as in
    prefill_request."""
    request, tensors = attention_request(DECODE, layer, q, table, **inputs)
    fill_tensors(request, tensors)
    return request


def attention_request(
    rpc: Rpc[Any],
    layer: int,
    q: TensorLike,
    table: TableLike,
    *,
    pool: str = "",
    q_pe: TensorLike | None = None,
    k_new: TensorLike | None = None,
    v_new: TensorLike | None = None,
    ckv_new: TensorLike | None = None,
    kpe_new: TensorLike | None = None,
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> tuple[pb.PrefillRequest | pb.DecodeRequest, dict[str, Any]]:
    """The Prefill/Decode request without its tensors, and the tensors by field name (the
    message or a transport puts them in: fill_tensors, Transport.stage_call)."""
    prefill = rpc is PREFILL
    request = pb.PrefillRequest() if prefill else pb.DecodeRequest()
    request.pool = pool
    request.layer = layer
    request.return_lse = return_lse
    if sm_scale is not None:
        request.sm_scale = sm_scale
    if isinstance(table, PlanBase):
        if table.released:
            raise ValueError(f"plan {table.name!r} was released (or replaced by one of its name)")
        if table.prefill != prefill:
            kind = "prefill" if table.prefill else "decode"
            raise ValueError(f"plan {table.name!r} is a {kind} plan; this is a {rpc.name} call")
        request.plan = table.name
    else:
        table_fields(request, table, prefill)
    values = (q, q_pe, k_new, v_new, ckv_new, kpe_new)
    tensors = {name: v for name, v in zip(TENSOR_FIELDS, values, strict=True) if v is not None}
    return request, tensors


def create_plan_request(
    table: BatchCsr | StagedPageTable, name: str, prefill: bool, pool: str
) -> pb.CreatePlanRequest:
    """The CreatePlanRequest for `table`: its PageTableRef when it is staged in shared memory,
    else its arrays (qo_indptr only for a Prefill plan)."""
    request = pb.CreatePlanRequest(name=name, pool=pool, prefill=prefill)
    table_fields(request, table, prefill)
    return request


def table_fields(request: Any, table: BatchCsr | StagedPageTable, prefill: bool) -> None:
    """Sets a request's page table: the staged table's PageTableRef, else the CSR arrays
    (qo_indptr for a prefill)."""
    ref = table.ref(prefill) if isinstance(table, StagedPageTable) else None
    if ref is not None:
        request.page_table.CopyFrom(ref)
        return
    csr = table.csr if isinstance(table, StagedPageTable) else table
    if prefill:
        request.qo_indptr.extend(_ints(csr.qo_indptr, "qo_indptr"))
    request.kv_indptr.extend(_ints(csr.kv_indptr, "kv_indptr"))
    request.kv_indices.extend(_ints(csr.kv_indices, "kv_indices"))
    if csr.kv_last_page_len is not None:
        request.kv_last_page_len.extend(_ints(csr.kv_last_page_len, "kv_last_page_len"))


def fill_tensors(request: Any, tensors: dict[str, Any]) -> None:
    """Puts the tensors into the message as bytes."""
    for name, value in tensors.items():
        getattr(request, name).CopyFrom(tensor_message(value))


def tensor_message(value: TensorLike) -> pb.Tensor:
    """A tensor argument as a Tensor message with its bytes (bf16 unless a message is given)."""
    if isinstance(value, pb.Tensor):
        return value
    if is_torch_tensor(value):
        return pack_torch(value)  # type: ignore[arg-type]
    return pack_tensor(value, pb.DTYPE_BF16)


def _ints(values: IndexLike, name: str) -> list[int]:
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    return a.tolist()
