"""How a call's tensors reach the server: bytes in the message, or slices of registered memory.

Client(transport=...) / AsyncClient(transport=...):
- "bytes": every tensor and the page table in the message (works everywhere).
- "shm": inputs, outputs and staged page tables in POSIX shared memory (regions.
  SharedMemoryArena). numpy arrays and torch CPU tensors are converted to bf16 straight into the
  arena (one pass, no message copy); torch CUDA tensors are copied into it.
- "cuda": torch CUDA tensors in CUDA memory shared through CUDA IPC (cuda_ipc.CudaArena), and
  the output of a call with such an input there too (result.output_torch("cuda") without a host
  trip); everything else in shared memory where the server accepts it, else in the message.
- "auto" (default): for unix: and loopback addresses, "shm" and "cuda" as far as the server's
  GetServerInfo.data_plane allows (asked once, on the first attention call); "bytes" otherwise.
  An explicit "shm" or "cuda" does not ask: a server that refuses the region fails the call.

Outputs written into an arena are copied out when the response arrives (AttentionResult holds
the copies), so a result stays valid while later calls reuse the arena. Every call allocates its
own block of an arena (concurrent calls never share one) and gives it back when the call is
done. A call that ends without the server's answer (deadline, cancellation, a lost connection)
may still run on the server, reading and writing its block: that block is never reused.

Page tables: stage_page_table(csr) writes a table into shared memory once; pass the
StagedPageTable as the `table` of every layer's call of a step (PageTableRef) instead of sending
the same arrays in each. Over "bytes" it sends the arrays, so the same code runs everywhere.
"""

from __future__ import annotations

import ipaddress
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from attnserve.pages import BatchCsr
from attnserve.regions import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_SHM_PREFIX,
    Arena,
    Block,
    SharedMemoryArena,
    align,
)
from attnserve.tensors import float_to_bf16_into
from attnserve.torch_tensors import is_torch_tensor
from attnserve.v1 import attention_pb2 as pb

if TYPE_CHECKING:
    from attnserve.calls import AttentionResult

TRANSPORTS = ("auto", "bytes", "shm", "cuda")
TENSOR_FIELDS = ("q", "q_pe", "k_new", "v_new", "ckv_new", "kpe_new")

# Codes with which the server refuses a call before it runs (attention.proto: a bad reference
# changes nothing; a full queue refuses before queueing): its blocks may be reused at once.
_REFUSED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
}


def is_local_address(address: str) -> bool:
    """Whether a gRPC target is on this node: unix: sockets and loopback hosts."""
    a = address.strip()
    if a.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if a.startswith(scheme):
            a = a[len(scheme) :]
            break
    if a.startswith("["):
        host = a[1 : a.find("]")]
    elif a.count(":") == 1:
        host = a.split(":")[0]
    else:
        host = a  # no port, or a bare IPv6 address
    if host.lower() in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Kinds:
    """The region kinds a client uses."""

    shm: bool = False
    cuda: bool = False


_NO_KINDS = Kinds()


def resolve_kinds(transport: str, address: str, data_plane: pb.DataPlane | None) -> Kinds:
    """What a transport setting means for this server (data_plane: GetServerInfo's, None when
    not asked). See the module doc."""
    if transport == "bytes":
        return Kinds()
    if transport == "shm":
        return Kinds(shm=True)
    allowed = data_plane or pb.DataPlane()
    if transport == "cuda":
        return Kinds(shm=allowed.shared_memory, cuda=True)
    if transport != "auto":
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if not is_local_address(address):
        return Kinds()
    return Kinds(shm=allowed.shared_memory, cuda=allowed.cuda_ipc)


class NeedArena(Exception):
    """Staging needs a new arena of at least nbytes for `where` ("shm" or ("cuda", device))."""

    def __init__(self, where: Any, nbytes: int, generation: int) -> None:
        super().__init__(f"no arena block of {nbytes} bytes for {where}")
        self.where = where
        self.nbytes = nbytes
        self.generation = generation


class StagedPageTable:
    """A page table written once into shared memory for the calls of one step (PageTableRef).

    Pass it as `table` to prefill/decode, as often as its page table holds; release() (or
    leave its `with` block) when the step is done. Without shared memory it carries the arrays.
    It must not be released while a call using it runs.
    """

    def __init__(self, csr: BatchCsr, block: Block | None = None) -> None:
        self.csr = csr
        self._block = block
        self._refs: dict[bool, pb.PageTableRef] = {}
        if block is not None:
            self._write(block)

    @property
    def staged(self) -> bool:
        """Whether the table is in shared memory (else its arrays travel in each call)."""
        return self._block is not None and not self._block.released

    def ref(self, prefill: bool) -> pb.PageTableRef | None:
        """The PageTableRef of the prefill or decode layout, or None when not staged."""
        if self._block is None:
            return None
        if self._block.released or self._block.arena.closed:
            raise ValueError("this staged page table was released")
        return self._refs[prefill]

    def release(self) -> None:
        if self._block is not None:
            self._block.release()

    def __enter__(self) -> StagedPageTable:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    async def __aenter__(self) -> StagedPageTable:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    @staticmethod
    def layout(csr: BatchCsr) -> np.ndarray:
        """The int32 layout of PageTableRef: kv_indptr, kv_last_page_len, kv_indices, then
        qo_indptr (read by Prefill only: a Decode reads the same table without it)."""
        batch = len(csr.kv_indptr) - 1
        last = csr.kv_last_page_len
        last = np.ones(batch, np.int32) if last is None else np.asarray(last)[:batch]
        parts = [int_array(csr.kv_indptr, "kv_indptr"), int_array(last, "kv_last_page_len"),
                 int_array(csr.kv_indices, "kv_indices"),
                 int_array(csr.qo_indptr, "qo_indptr")]  # fmt: skip
        return np.concatenate(parts)

    @staticmethod
    def nbytes(csr: BatchCsr) -> int:
        return align(StagedPageTable.layout(csr).nbytes)

    def _write(self, block: Block) -> None:
        arena = block.arena
        assert isinstance(arena, SharedMemoryArena)
        layout = self.layout(self.csr)
        offset = block.carve(layout.nbytes)
        arena.array(offset, layout.shape, np.int32)[...] = layout
        ref = pb.PageTableRef(
            at=pb.RegionSlice(name=arena.name, offset=offset),
            batch=len(self.csr.kv_indptr) - 1,
            num_pages=len(self.csr.kv_indices),
        )
        self._refs[True] = self._refs[False] = ref


def int_array(values: Any, name: str) -> np.ndarray:
    """A 1-D int32 array of integers (TypeError / ValueError naming the field otherwise)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    out = a.astype(np.int32)
    if a.size and not np.array_equal(out, a):
        raise ValueError(f"{name} holds values that do not fit int32")
    return out


@dataclass(slots=True)
class _Output:
    arena: Arena
    offset: int
    shape: tuple[int, ...]
    lse_offset: int | None


@dataclass
class StagedCall:
    """A Prefill/Decode request with its tensors in arenas, and what to do when it ends."""

    request: Any
    blocks: list[Block] = field(default_factory=list)
    output: _Output | None = None
    on_orphan: Callable[[Block], None] | None = None

    def finish(self, result: AttentionResult) -> AttentionResult:
        """The result with its outputs copied out of the arena; gives the blocks back."""
        try:
            if self.output is None or result.response.output.data:
                return result
            return _read_outputs(self.output, result)
        finally:
            self.release()

    def abandon(self, error: BaseException) -> None:
        """The call failed: blocks of a call the server refused are reused; blocks of one it
        may still be running (no answer: deadline, cancellation, lost connection) never are."""
        code = getattr(error, "code", None)
        if code in _REFUSED:
            self.release()
        else:
            for block in self.blocks:
                if self.on_orphan is not None:
                    self.on_orphan(block)
            self.blocks = []

    def release(self) -> None:
        for block in self.blocks:
            block.release()
        self.blocks = []


def _read_outputs(out: _Output, result: AttentionResult) -> AttentionResult:
    response = result.response
    got = response.output
    if got.region.name != out.arena.name or got.region.offset != out.offset:
        raise ValueError(
            f"the server wrote the output to {got.region.name}@{got.region.offset}, not to "
            f"{out.arena.name}@{out.offset} as asked"
        )
    if tuple(got.shape) != out.shape or got.dtype != pb.DTYPE_BF16:
        raise ValueError(f"output {list(got.shape)} is not the asked bf16 {list(out.shape)}")
    lse_shape = out.shape[:2]
    if out.lse_offset is not None and tuple(response.lse.shape) != lse_shape:
        raise ValueError(f"lse {list(response.lse.shape)} is not the asked {list(lse_shape)}")
    arena = out.arena
    if isinstance(arena, SharedMemoryArena):
        bits = arena.array(out.offset, out.shape, np.uint16).copy()
        lse = None
        if out.lse_offset is not None:
            lse = arena.array(out.lse_offset, lse_shape, np.float32).copy()
        return type(result)(response, region_output=bits, region_lse=lse)
    import torch  # a CUDA arena: the inputs were torch tensors

    device = torch.device("cuda", arena.device)  # type: ignore[attr-defined]
    output = arena.tensor(out.offset, out.shape, torch.bfloat16).clone()  # type: ignore[attr-defined]
    lse_t = None
    if out.lse_offset is not None:
        lse_t = arena.tensor(out.lse_offset, lse_shape, torch.float32).clone()  # type: ignore[attr-defined]
    # The clones must be done before another call's server writes reuse the block.
    torch.cuda.current_stream(device).synchronize()
    return type(result)(response, region_output=output, region_lse=lse_t)


class Transport:
    """The data plane of one client: transport choice, arenas, staging. Thread-safe.

    It never calls the server: staging raises NeedArena when an arena is missing, and the
    client registers one (create_arena, then add_arena or registration_failed) and stages again.
    """

    def __init__(
        self,
        transport: str,
        address: str,
        *,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        shm_prefix: str = DEFAULT_SHM_PREFIX,
        shm_mode: int = 0o600,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        self._address = address
        self._arena_bytes = arena_bytes
        self._shm_prefix = shm_prefix
        self._shm_mode = shm_mode
        self._lock = threading.Lock()
        self._kinds: Kinds | None = (
            None if transport in ("auto", "cuda") else resolve_kinds(transport, address, None)
        )
        self._limit_bytes = 0  # DataPlane.max_region_bytes_per_session (0: unknown)
        self._arenas: dict[Any, list[Arena]] = {}
        self.generation = 0  # changes whenever arenas or kinds change
        self.orphaned_bytes = 0  # blocks of unanswered calls, never reused

    @property
    def shm_prefix(self) -> str:
        return self._shm_prefix

    @property
    def needs_server_info(self) -> bool:
        """Whether resolve() must be given GetServerInfo before staging."""
        return self._kinds is None and (self.transport == "cuda" or is_local_address(self._address))

    def resolve(self, info: pb.GetServerInfoResponse | None) -> None:
        data_plane = info.data_plane if info is not None and info.HasField("data_plane") else None
        with self._lock:
            self._kinds = resolve_kinds(self.transport, self._address, data_plane)
            if data_plane is not None:
                self._limit_bytes = data_plane.max_region_bytes_per_session
            self.generation += 1

    @property
    def kinds(self) -> Kinds:
        """The kinds in use: none before resolve() (auto toward a remote server: none ever)."""
        return self._kinds if self._kinds is not None else _NO_KINDS

    # ---- arenas

    def create_arena(self, need: NeedArena) -> Arena:
        """A new (unregistered) arena for need; its registration is the client's."""
        size = max(self._arena_bytes, align(2 * need.nbytes, 1 << 20))
        if self._limit_bytes:
            size = min(size, max(self._limit_bytes - self.registered_bytes(), need.nbytes + 128))
        if need.where == "shm":
            return SharedMemoryArena(size, prefix=self._shm_prefix, mode=self._shm_mode)
        from attnserve.cuda_ipc import CudaArena

        return CudaArena(size, device=need.where[1])

    def add_arena(self, where: Any, arena: Arena) -> None:
        arena.registered()
        with self._lock:
            self._arenas.setdefault(where, []).append(arena)
            self.generation += 1

    def registration_failed(self, where: Any, error: BaseException) -> bool:
        """An arena could not be made or registered. An explicit transport raises the error
        (but "cuda" goes on without shared memory for its page tables and numpy inputs). "auto"
        sends this call as bytes when the session's region limits are reached (returns False),
        and otherwise goes on without that kind: bytes, or shared memory instead of CUDA IPC
        (returns True: stage again)."""
        if self.transport != "auto" and not (self.transport == "cuda" and where == "shm"):
            raise error
        if getattr(error, "code", None) == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        with self._lock:
            kinds = self.kinds
            self._kinds = Kinds(
                shm=kinds.shm and where != "shm", cuda=kinds.cuda and where == "shm"
            )
            self.generation += 1
        return True

    def registered_bytes(self) -> int:
        with self._lock:
            return sum(a.size for arenas in self._arenas.values() for a in arenas)

    def take_arenas(self) -> list[Arena]:
        """Forgets every arena (the client unregisters and closes them)."""
        with self._lock:
            arenas = [a for group in self._arenas.values() for a in group]
            self._arenas = {}
            self.generation += 1
            return arenas

    def _block(self, where: Any, nbytes: int, generation: int) -> Block:
        with self._lock:
            arenas = list(self._arenas.get(where, ()))
        for arena in arenas:
            block = arena.allocate(nbytes)
            if block is not None:
                return block
        raise NeedArena(where, nbytes, generation)

    def _orphan(self, block: Block) -> None:
        with self._lock:
            self.orphaned_bytes += block.size

    # ---- staging

    def stage_page_table(self, csr: BatchCsr) -> StagedPageTable:
        generation = self.generation
        if not self.kinds.shm:
            return StagedPageTable(csr)
        return StagedPageTable(csr, self._block("shm", StagedPageTable.nbytes(csr), generation))

    def stage_call(
        self, request: Any, tensors: dict[str, Any], as_bytes: bool = False
    ) -> StagedCall:
        """Puts the tensors of a request (built without them) into arenas or the message
        (all into the message with as_bytes). NeedArena when an arena lacks room."""
        generation = self.generation
        kinds = _NO_KINDS if as_bytes else self.kinds
        # One pass: where each tensor goes, its shape, and the bytes per arena (every slice
        # rounded up to a block alignment unit); the output goes with the first CUDA input.
        placed: list[tuple[str, Any, Any, tuple[int, ...]]] = []
        sizes: dict[Any, int] = {}
        first_cuda = None
        for name, value in tensors.items():
            w = _placement(value, kinds)
            shape = _shape(value)
            placed.append((name, value, w, shape))  # type: ignore[arg-type]
            if w is not None:
                sizes[w] = sizes.get(w, 0) + align(2 * math.prod(shape))  # type: ignore[arg-type]
                if first_cuda is None and w != "shm":
                    first_cuda = w
        q_shape = _shape(tensors.get("q"))
        out_where = None
        if q_shape is not None and len(q_shape) == 3:
            out_where = first_cuda or ("shm" if kinds.shm else None)
        if out_where is not None:
            total_q, heads = q_shape[0], q_shape[1]  # type: ignore[index]
            out_bytes = align(2 * math.prod(q_shape))  # type: ignore[arg-type]
            if request.return_lse:
                out_bytes += align(4 * total_q * heads)
            sizes[out_where] = sizes.get(out_where, 0) + out_bytes
        staged = StagedCall(request, on_orphan=self._orphan)
        try:
            blocks: dict[Any, Block] = {}
            for w, n in sizes.items():
                blocks[w] = self._block(w, n, generation)
                staged.blocks.append(blocks[w])
            synchronize = set()
            for name, value, w, shape in placed:
                if w is None:
                    from attnserve.calls import tensor_message  # the bytes path only

                    getattr(request, name).CopyFrom(tensor_message(value))
                    continue
                block = blocks[w]
                offset = block.carve(2 * math.prod(shape))
                _write_bf16(block.arena, offset, value, shape)
                if w != "shm":
                    synchronize.add(w[1])
                tensor = getattr(request, name)
                tensor.dtype = pb.DTYPE_BF16
                tensor.shape[:] = shape
                tensor.region.name = block.arena.name
                tensor.region.offset = offset
            if out_where is not None:
                block = blocks[out_where]
                out = _Output(block.arena, block.carve(2 * math.prod(q_shape)), q_shape, None)  # type: ignore[arg-type]
                request.output_to.name = block.arena.name
                request.output_to.offset = out.offset
                if request.return_lse:
                    out.lse_offset = block.carve(4 * q_shape[0] * q_shape[1])  # type: ignore[index]
                    request.lse_to.name = block.arena.name
                    request.lse_to.offset = out.lse_offset
                staged.output = out
            if synchronize:
                _synchronize(synchronize)  # ordering: our writes are done before the send
        except BaseException:
            staged.release()
            raise
        return staged


def plane_may_free(arena: Arena, error: BaseException) -> bool:
    """Whether an arena whose UnregisterRegion failed with error may be freed: shared memory
    always (the server keeps its own mapping), CUDA memory only when the server does not hold
    it (NOT_FOUND), since freeing memory a running call uses would fault the server's device."""
    return arena.kind == "shm" or getattr(error, "code", None) == grpc.StatusCode.NOT_FOUND


def _placement(value: Any, kinds: Kinds) -> Any:
    """Where a tensor argument goes: None (the message), "shm" or ("cuda", device)."""
    if value is None or isinstance(value, pb.Tensor):
        return None
    if is_torch_tensor(value):
        if value.is_cuda and kinds.cuda:
            return ("cuda", value.device.index or 0)
        return "shm" if kinds.shm else None
    if not kinds.shm:
        return None
    a = np.asarray(value)
    return "shm" if a.dtype == np.uint16 or a.dtype.kind == "f" else None  # else: pack's error


def _shape(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if type(value) is np.ndarray:
        return value.shape  # already a tuple of ints
    if isinstance(value, pb.Tensor):
        return tuple(value.shape)
    return tuple(int(d) for d in (value.shape if hasattr(value, "shape") else np.shape(value)))


def _write_bf16(arena: Arena, offset: int, value: Any, shape: tuple[int, ...]) -> None:
    """Writes a tensor argument of that shape as bf16 at offset of the arena."""
    if isinstance(arena, SharedMemoryArena):
        dst = arena.array(offset, shape, np.uint16)  # type: ignore[arg-type]
        if is_torch_tensor(value):
            import torch

            if not value.is_floating_point():
                raise TypeError(
                    f"cannot send a {value.dtype} tensor as bf16: pass a floating tensor"
                )
            torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16).copy_(value.detach())
            return
        a = np.asarray(value)
        if a.dtype == np.uint16:
            dst[...] = a
        else:
            float_to_bf16_into(a, dst)
        return
    import torch

    if not value.is_floating_point():
        raise TypeError(f"cannot send a {value.dtype} tensor as bf16: pass a floating tensor")
    arena.tensor(offset, shape, torch.bfloat16).copy_(value.detach())  # type: ignore[attr-defined]


def _synchronize(devices: set[int]) -> None:
    import torch

    for device in devices:
        torch.cuda.current_stream(torch.device("cuda", device)).synchronize()
