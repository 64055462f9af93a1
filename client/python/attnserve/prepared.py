"""Prepared calls: a Prefill or Decode whose tensors stay in the client's arena between runs.

A scheduler that calls us once per layer sends the same shapes, the same staged page table and
the same output place for every layer of a step, only with new numbers in q (and k_new / v_new).
Client.prepare() stages the call once: its tensors get fixed slices of an arena (shared memory,
or CUDA memory for torch CUDA tensors), the request is built and serialized once per layer, and
each run() writes nothing but what the caller put into the views:

    with client.stage_page_table(table) as staged:
        call = client.prepare("decode", q, staged)   # q: the first layer's queries
        for layer in range(num_layers):
            call.inputs["q"][...] = queries(layer)     # or write into the view directly
            result = call.run(layer=layer)
            use(call.output)                           # bf16 bits; next run overwrites it
        call.close()

A run goes through the client's call queue when the server offers one, else gRPC, exactly as
decode() / prefill() do, and raises the same errors. The views belong to the prepared call:
write the inputs before run(), read the outputs before the next run() (copy what must last).
One run at a time per prepared call; it belongs to the session it was prepared in. A run whose
outcome is unknown (deadline, cancellation, lost connection) may still be written into by the
server: the call then closes, and its slices are never reused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from attnserve.calls import DECODE, PREFILL, AttentionResult, Rpc, with_session
from attnserve.regions import Arena
from attnserve.transport import _REFUSED, TENSOR_FIELDS, StagedCall

if TYPE_CHECKING:
    from attnserve.client import Client


class PreparedCall:
    """One staged Prefill/Decode (Client.prepare). inputs: the tensors' views by field name (q,
    q_pe, k_new, v_new, ckv_new, kpe_new): numpy uint16 bf16 bits in shared memory, torch bf16
    tensors in CUDA memory. output / lse: the views the server writes (lse None unless asked)."""

    def __init__(self, client: Client, rpc: Rpc[AttentionResult], staged: StagedCall) -> None:
        out = staged.output
        if (
            out is None
            or not staged.blocks
            or any(
                not getattr(staged.request, name).HasField("region")
                for name in _tensor_fields(staged)
            )
        ):
            staged.release()
            raise ValueError(
                "prepare() needs every tensor in a registered arena: the transport has no shared "
                "memory (or CUDA IPC) for them"
            )
        self._client = client
        self._rpc = rpc
        self._staged = staged
        self._output = out
        arenas = {block.arena.name: block.arena for block in staged.blocks}
        self._cuda = sorted({a.device for a in arenas.values() if not _in_shm(a)})  # type: ignore[attr-defined]
        request = staged.request
        self.inputs: dict[str, Any] = {}
        for name in _tensor_fields(staged):
            t = getattr(request, name)
            self.inputs[name] = _view(arenas[t.region.name], t.region.offset, tuple(t.shape), True)
        self.output = _view(out.arena, out.offset, out.shape, True)
        self.lse = None
        if out.lse_offset is not None:
            self.lse = _view(out.arena, out.lse_offset, out.shape[:2], False)
        with_session(request, client._session_for(rpc))
        self._requests: dict[int, tuple[Any, bytes]] = {}
        self.closed = False

    @property
    def request(self) -> Any:
        """The request as prepared (the layer it was prepared for)."""
        return self._staged.request

    def run(self, *, layer: int | None = None, timeout: float | None = None) -> AttentionResult:
        """Runs the call on what the input views hold now (for `layer`, else the prepared one).
        The result's region_output / region_lse are this call's output views, not copies."""
        if self.closed:
            raise ValueError("the prepared call is closed")
        request, data = self._encoded(self._staged.request.layer if layer is None else layer)
        self._synchronize()  # the caller's writes into CUDA views come first
        try:
            result = self._client._send(self._rpc, request, True, timeout, serialized=data)
        except BaseException as e:
            if getattr(e, "code", None) not in _REFUSED:
                self._staged.abandon(e)  # the server may still write into the slices
                self.closed = True
            raise
        got = result.response.output
        out = self._output
        if got.region.name != out.arena.name or got.region.offset != out.offset:
            raise ValueError(
                f"the server wrote the output to {got.region.name}@{got.region.offset}, not to "
                f"{out.arena.name}@{out.offset} as asked"
            )
        self._synchronize()  # the server's writes are done when it answers; order ours after
        return type(result)(result.response, region_output=self.output, region_lse=self.lse)

    def close(self) -> None:
        """Gives the slices back (the views must not be used afterwards)."""
        if not self.closed:
            self.closed = True
            self._staged.release()

    def __enter__(self) -> PreparedCall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _encoded(self, layer: int) -> tuple[Any, bytes]:
        """The request for `layer` and its serialized bytes, built on the first run of it."""
        got = self._requests.get(layer)
        if got is None:
            request = type(self._staged.request)()
            request.CopyFrom(self._staged.request)
            request.layer = layer
            got = self._requests[layer] = (request, request.SerializeToString())
        return got

    def _synchronize(self) -> None:
        if self._cuda:
            import torch

            for device in self._cuda:
                torch.cuda.current_stream(torch.device("cuda", device)).synchronize()


def _in_shm(arena: Arena) -> bool:
    return arena.kind == "shm"


def _view(arena: Arena, offset: int, shape: tuple[int, ...], bf16: bool) -> Any:
    """A view of a slice of an arena: bf16 (as uint16 bits in shared memory) or float32."""
    if _in_shm(arena):
        return arena.array(offset, shape, np.uint16 if bf16 else np.float32)  # type: ignore[attr-defined]
    import torch

    return arena.tensor(offset, shape, torch.bfloat16 if bf16 else torch.float32)  # type: ignore[attr-defined]


def _tensor_fields(staged: StagedCall) -> list[str]:
    return [name for name in TENSOR_FIELDS if staged.request.HasField(name)]


def rpc_for(op: str) -> Rpc[AttentionResult]:
    if op not in ("decode", "prefill"):
        raise ValueError(f"op must be 'decode' or 'prefill', not {op!r}")
    return PREFILL if op == "prefill" else DECODE
