"""Synchronous client of attnserve.v1.AttentionService.

Every call carries a deadline (the client's default timeout unless one is given), and send and
receive message limits are raised to max_message_bytes (gRPC's default of 4 MiB is too small for
prefill batches). Server errors surface as AttnError with the gRPC status code and details.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from attnserve.pages import BatchCsr
from attnserve.tensors import pack_tensor, unpack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# A tensor argument: a float array (rounded to bf16), a uint16 array (raw bf16 bits) or a
# ready-made Tensor message (sent as is, e.g. to send another dtype).
TensorLike = npt.ArrayLike | pb.Tensor
# An index array argument: 1-D integers (sent as int32).
IndexLike = npt.ArrayLike


class AttnError(Exception):
    """A failed call: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Timings:
    """Server-side time of one call, in microseconds (attention.proto Timings)."""

    queue_us: int
    compute_us: int
    total_us: int
    batch_requests: int

    @classmethod
    def from_proto(cls, t: pb.Timings) -> Timings:
        return cls(t.queue_us, t.compute_us, t.total_us, t.batch_requests)


@dataclass(frozen=True)
class AttentionResult:
    """Result of Prefill or Decode.

    output: float32 [total_q, H, D] (GQA) or [total_q, H, 512] (MLA), decoded from bf16.
    lse: float32 [total_q, H] base-2 log-sum-exp, or None when not requested.
    """

    output: np.ndarray
    lse: np.ndarray | None
    timings: Timings

    @classmethod
    def from_proto(cls, response: pb.AttentionResponse) -> AttentionResult:
        lse = unpack_tensor(response.lse) if response.HasField("lse") else None
        return cls(unpack_tensor(response.output), lse, Timings.from_proto(response.timings))


class Client:
    """Client of one attnserve server. Thread-safe (gRPC channels are); close() when done."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._address = address
        self._timeout = timeout
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )
        self._stub = pb_grpc.AttentionServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self._address

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def server_info(self, *, timeout: float | None = None) -> pb.GetServerInfoResponse:
        """Version, backend, device and every pool's geometry and occupancy."""
        return self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    def pool_info(self, pool: str = "", *, timeout: float | None = None) -> pb.PoolInfo:
        """One pool's PoolInfo; pool "" selects the only pool (ValueError if there are several)."""
        pools = self.server_info(timeout=timeout).pools
        if not pool:
            if len(pools) != 1:
                raise ValueError(f"the server has {len(pools)} pools; name one")
            return pools[0]
        for info in pools:
            if info.name == pool:
                return info
        raise ValueError(f"no pool {pool!r}; the server has {[p.name for p in pools]}")

    def allocate_pages(
        self, num_pages: int, pool: str = "", *, timeout: float | None = None
    ) -> list[int]:
        """Allocates num_pages pages (all or nothing) and returns their ids."""
        request = pb.AllocatePagesRequest(pool=pool, num_pages=num_pages)
        return list(self._call(self._stub.AllocatePages, request, timeout).page_ids)

    def free_pages(
        self, page_ids: Sequence[int], pool: str = "", *, timeout: float | None = None
    ) -> int:
        """Frees the pages (all or nothing); returns the pool's free page count after the call."""
        request = pb.FreePagesRequest(pool=pool, page_ids=_ints(page_ids, "page_ids"))
        return self._call(self._stub.FreePages, request, timeout).free_pages

    def prefill(
        self,
        layer: int,
        q: TensorLike,
        table: BatchCsr,
        *,
        pool: str = "",
        q_pe: TensorLike | None = None,
        k_new: TensorLike | None = None,
        v_new: TensorLike | None = None,
        ckv_new: TensorLike | None = None,
        kpe_new: TensorLike | None = None,
        sm_scale: float | None = None,
        return_lse: bool = False,
        timeout: float | None = None,
    ) -> AttentionResult:
        """Appends the new K/V (when given), then runs causal paged attention for every query row.

        GQA: q [total_q, H, D], k_new/v_new [total_q, H_kv, D]. MLA: q is q_nope
        [total_q, H, 512], q_pe [total_q, H, 64], ckv_new [total_q, 512], kpe_new [total_q, 64].
        table is the page table after the append; its qo_indptr splits the query rows.
        """
        request = pb.PrefillRequest(qo_indptr=_ints(table.qo_indptr, "qo_indptr"))
        _fill_attention_request(
            request,
            pool,
            layer,
            table,
            sm_scale,
            return_lse,
            q=q,
            q_pe=q_pe,
            k_new=k_new,
            v_new=v_new,
            ckv_new=ckv_new,
            kpe_new=kpe_new,
        )
        return self.call_prefill(request, timeout=timeout)

    def decode(
        self,
        layer: int,
        q: TensorLike,
        table: BatchCsr,
        *,
        pool: str = "",
        q_pe: TensorLike | None = None,
        k_new: TensorLike | None = None,
        v_new: TensorLike | None = None,
        ckv_new: TensorLike | None = None,
        kpe_new: TensorLike | None = None,
        sm_scale: float | None = None,
        return_lse: bool = False,
        timeout: float | None = None,
    ) -> AttentionResult:
        """One query row per sequence (q [batch, ...]); table.qo_indptr is not sent.

        Arguments as in prefill(); the new K/V of a sequence is written at position kv_len - 1.
        """
        request = pb.DecodeRequest()
        _fill_attention_request(
            request,
            pool,
            layer,
            table,
            sm_scale,
            return_lse,
            q=q,
            q_pe=q_pe,
            k_new=k_new,
            v_new=v_new,
            ckv_new=ckv_new,
            kpe_new=kpe_new,
        )
        return self.call_decode(request, timeout=timeout)

    def call_prefill(
        self, request: pb.PrefillRequest, *, timeout: float | None = None
    ) -> AttentionResult:
        """Sends a ready-made PrefillRequest as is (e.g. to test the server's validation)."""
        return AttentionResult.from_proto(self._call(self._stub.Prefill, request, timeout))

    def call_decode(
        self, request: pb.DecodeRequest, *, timeout: float | None = None
    ) -> AttentionResult:
        """Sends a ready-made DecodeRequest as is."""
        return AttentionResult.from_proto(self._call(self._stub.Decode, request, timeout))

    def _call(self, method: Callable[..., Any], request: object, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise AttnError(e.code(), e.details() or "") from e


def _fill_attention_request(
    request: pb.PrefillRequest | pb.DecodeRequest,
    pool: str,
    layer: int,
    table: BatchCsr,
    sm_scale: float | None,
    return_lse: bool,
    **tensors: TensorLike | None,
) -> None:
    """Fills the fields PrefillRequest and DecodeRequest share; tensors are named by field."""
    request.pool = pool
    request.layer = layer
    request.return_lse = return_lse
    request.kv_indptr.extend(_ints(table.kv_indptr, "kv_indptr"))
    request.kv_indices.extend(_ints(table.kv_indices, "kv_indices"))
    if table.kv_last_page_len is not None:
        request.kv_last_page_len.extend(_ints(table.kv_last_page_len, "kv_last_page_len"))
    if sm_scale is not None:
        request.sm_scale = sm_scale
    for name, value in tensors.items():
        if value is not None:
            getattr(request, name).CopyFrom(_tensor(value))


def _tensor(value: TensorLike) -> pb.Tensor:
    if isinstance(value, pb.Tensor):
        return value
    return pack_tensor(value, pb.DTYPE_BF16)


def _ints(values: IndexLike, name: str) -> list[int]:
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    return a.tolist()
