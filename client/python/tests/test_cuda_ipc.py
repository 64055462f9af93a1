"""CUDA IPC arenas: the ctypes paths with a stand-in runtime (host memory), and on a GPU the
real thing (skipped without one)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from attnserve import cuda_ipc
from attnserve.cuda_ipc import IPC_HANDLE_BYTES, CudaArena, CudaError
from attnserve.regions import HEADER_BYTES, REGION_MAGIC
from attnserve.transport import Kinds, Transport, _placement


class HostRuntime:
    """CudaRuntime's interface over host memory, recording what the arena asks of it."""

    def __init__(self, fail_handle: bool = False) -> None:
        self.device = 0
        self.buffers: dict[int, ctypes.Array] = {}
        self.freed: list[int] = []
        self.devices_used: list[int] = []
        self.fail_handle = fail_handle

    def get_device(self) -> int:
        return self.device

    def set_device(self, device: int) -> None:
        self.device = device

    def malloc(self, nbytes: int) -> int:
        self.devices_used.append(self.device)
        buf = ctypes.create_string_buffer(nbytes)
        self.buffers[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free(self, ptr: int) -> None:
        self.freed.append(ptr)

    def ipc_handle(self, ptr: int) -> bytes:
        if self.fail_handle:
            raise CudaError("cudaIpcGetMemHandle: operation not supported (801)")
        return ptr.to_bytes(8, "little") * (IPC_HANDLE_BYTES // 8)

    def copy_to_device(self, ptr: int, data: bytes) -> None:
        ctypes.memmove(ptr, data, len(data))

    def copy_to_host(self, ptr: int, nbytes: int) -> bytes:
        return ctypes.string_at(ptr, nbytes)


def test_arena_writes_its_header_on_its_device_and_exports_it() -> None:
    runtime = HostRuntime()
    runtime.device = 3
    arena = CudaArena(1 << 12, device=1, runtime=runtime)  # type: ignore[arg-type]
    assert runtime.devices_used == [1] and runtime.device == 3  # the caller's device is restored
    assert arena.read(0, HEADER_BYTES) == REGION_MAGIC + arena.key
    request = arena.register_request()
    assert request.WhichOneof("memory") == "cuda_ipc"
    assert len(request.cuda_ipc.handle) == IPC_HANDLE_BYTES
    assert (request.offset, request.size, request.key) == (0, 1 << 12, arena.key)
    assert request.name.startswith("py-cuda-")
    arena.close()
    arena.close()
    assert runtime.freed == [arena.ptr]


def test_a_failed_export_frees_the_allocation() -> None:
    runtime = HostRuntime(fail_handle=True)
    with pytest.raises(CudaError, match="not supported"):
        CudaArena(1 << 12, device=0, runtime=runtime)  # type: ignore[arg-type]
    assert len(runtime.freed) == 1 and runtime.device == 0


def test_missing_libcudart_says_how_to_point_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_ipc, "_runtime", None)
    monkeypatch.setattr(cuda_ipc, "cudart_candidates", lambda: ["/nonexistent/libcudart.so"])
    with pytest.raises(CudaError, match="ATTNSERVE_CUDART"):
        cuda_ipc.load_cudart()


def test_cudart_candidates_start_with_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSERVE_CUDART", "/opt/cuda/lib64/libcudart.so.12")
    names = cuda_ipc.cudart_candidates()
    assert names[0] == "/opt/cuda/lib64/libcudart.so.12" and "libcudart.so" in names


def test_numpy_arrays_never_go_to_cuda_memory() -> None:
    assert _placement(np.zeros(3, np.float32), Kinds(shm=False, cuda=True)) is None
    assert _placement(np.zeros(3, np.float32), Kinds(shm=True, cuda=True)) == "shm"
    assert _placement(np.zeros(3, np.int32), Kinds(shm=True)) is None  # left to pack's TypeError


def test_cuda_transport_without_shm_stages_tables_as_arrays() -> None:
    plane = Transport("cuda", "127.0.0.1:1")
    plane.resolve(None)
    assert plane.kinds == Kinds(cuda=True)
    csr = _csr()
    assert not plane.stage_page_table(csr).staged


def _csr():
    from attnserve import BatchCsr

    one = np.array([0, 1], np.int32)
    return BatchCsr(one, one, np.array([2], np.int32), np.array([1], np.int32))


def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _gpu(), reason="needs torch with a CUDA GPU")
def test_real_cuda_arena_views_and_header() -> None:
    import torch

    arena = CudaArena(1 << 20, device=torch.cuda.current_device())
    try:
        assert arena.read(0, HEADER_BYTES) == REGION_MAGIC + arena.key
        view = arena.tensor(1024, (4, 8), torch.bfloat16)
        view.copy_(torch.arange(32, device="cuda", dtype=torch.float32).view(4, 8))
        torch.cuda.synchronize()
        again = arena.tensor(1024, (32,), torch.bfloat16)
        assert again.float().tolist() == list(range(32))
        raw = np.frombuffer(arena.read(1024, 64), np.uint16)
        assert (raw == view.cpu().view(torch.int16).numpy().view(np.uint16).reshape(-1)).all()
        assert len(arena.handle) == IPC_HANDLE_BYTES
    finally:
        arena.close()
