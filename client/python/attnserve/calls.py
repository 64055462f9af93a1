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
from attnserve.tensors import pack_tensor, unpack_tensor, wire_array
from attnserve.torch_tensors import is_torch_tensor, pack_torch, tensor_to_torch
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
    """

    response: pb.AttentionResponse = field(repr=False)

    @classmethod
    def from_proto(cls, response: pb.AttentionResponse) -> AttentionResult:
        return cls(response)

    @cached_property
    def output(self) -> np.ndarray:
        return unpack_tensor(self.response.output)

    @cached_property
    def lse(self) -> np.ndarray | None:
        return unpack_tensor(self.response.lse) if self.response.HasField("lse") else None

    @property
    def timings(self) -> Timings:
        return Timings.from_proto(self.response.timings)

    def output_bits(self) -> np.ndarray:
        """The output as sent: uint16 bf16 bit patterns of its shape."""
        return wire_array(self.response.output)

    def output_torch(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The output as a torch.bfloat16 tensor on device (default CPU), bit-exact."""
        return tensor_to_torch(self.response.output, device)

    def lse_torch(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """The lse as a torch.float32 tensor on device, or None when not requested."""
        if not self.response.HasField("lse"):
            return None
        return tensor_to_torch(self.response.lse, device)


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


def open_session_request(lease_s: float | None, max_pages: int | None) -> pb.OpenSessionRequest:
    """lease_s / max_pages None: the server's defaults."""
    return pb.OpenSessionRequest(
        lease_ms=round(lease_s * 1000) if lease_s else 0, max_pages=max_pages or 0
    )


# Methods whose calls must name a session: the server has no implicit sessions (attention.proto,
# "Sessions and leases"), so a client without one opens one on its first such call.
NEEDS_SESSION = frozenset(
    {"AllocatePages", "FreePages", "Prefill", "Decode", "RegisterRegion", "UnregisterRegion",
     "ListRegions"}
)  # fmt: skip


def with_session(request: Any, session: str | None) -> Any:
    """Names the client's session in a request that names none (every request type has the
    field)."""
    if session and not request.session:
        request.session = session
    return request


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Send and receive limits raised from gRPC's 4 MiB (too small for prefill batches)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
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


def prefill_request(layer: int, q: TensorLike, table: BatchCsr, **inputs: Any) -> pb.PrefillRequest:
    """A PrefillRequest; table.qo_indptr splits the query rows. inputs: the keyword arguments
    of Client.prefill (pool, q_pe, k_new, v_new, ckv_new, kpe_new, sm_scale, return_lse)."""
    request = pb.PrefillRequest(qo_indptr=_ints(table.qo_indptr, "qo_indptr"))
    _fill_attention_request(request, layer, q, table, **inputs)
    return request


def decode_request(layer: int, q: TensorLike, table: BatchCsr, **inputs: Any) -> pb.DecodeRequest:
    """A DecodeRequest: one query row per sequence, table.qo_indptr is not sent. inputs as in
    prefill_request."""
    request = pb.DecodeRequest()
    _fill_attention_request(request, layer, q, table, **inputs)
    return request


def _fill_attention_request(
    request: pb.PrefillRequest | pb.DecodeRequest,
    layer: int,
    q: TensorLike,
    table: BatchCsr,
    *,
    pool: str,
    q_pe: TensorLike | None,
    k_new: TensorLike | None,
    v_new: TensorLike | None,
    ckv_new: TensorLike | None,
    kpe_new: TensorLike | None,
    sm_scale: float | None,
    return_lse: bool,
) -> None:
    """Fills the fields PrefillRequest and DecodeRequest share."""
    request.pool = pool
    request.layer = layer
    request.return_lse = return_lse
    request.kv_indptr.extend(_ints(table.kv_indptr, "kv_indptr"))
    request.kv_indices.extend(_ints(table.kv_indices, "kv_indices"))
    if table.kv_last_page_len is not None:
        request.kv_last_page_len.extend(_ints(table.kv_last_page_len, "kv_last_page_len"))
    if sm_scale is not None:
        request.sm_scale = sm_scale
    tensors = {
        "q": q,
        "q_pe": q_pe,
        "k_new": k_new,
        "v_new": v_new,
        "ckv_new": ckv_new,
        "kpe_new": kpe_new,
    }
    for name, value in tensors.items():
        if value is not None:
            getattr(request, name).CopyFrom(_tensor(value))


def _tensor(value: TensorLike) -> pb.Tensor:
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
