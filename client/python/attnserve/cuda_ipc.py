"""CUDA memory shared with the server through CUDA IPC (attention.proto "Registered memory").

A CudaArena is one cudaMalloc allocation of its own (libcudart through ctypes), exported with
cudaIpcGetMemHandle and registered as a CudaIpcMemory region; torch tensors are staged into it
with one device copy (and bf16 conversion) each, and outputs are written into it by the server.
torch views it through __cuda_array_interface__ (torch.as_tensor), so torch's allocator never
owns the memory. Why not tensors from torch's allocator:
- the legacy IPC handle names a whole cudaMalloc allocation: torch's caching allocator hands out
  pieces of larger segments, so a tensor's handle names its segment (whose base the server would
  then need, and which torch may reuse for other tensors while the server uses it);
- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True maps memory with cuMemCreate (virtual memory
  management) and backend:cudaMallocAsync allocates from stream-ordered pools: cudaIpcGetMemHandle
  cannot export either (cuMem memory needs cuMemExportToShareableHandle and a file descriptor
  passed over a unix socket, which this API does not carry).
An arena of its own works whatever the allocator settings.

Ordering (attention.proto): the copies into the arena run on torch's current stream of the
arena's device; the client synchronizes that stream before it sends the call, and the server's
writes into the arena are complete when the response arrives. Outputs are copied out into new
tensors and that copy is synchronized before the arena block is reused.

Containers: CUDA IPC between processes needs them to see each other's processes (the same PID
namespace: `--pid=host` or a pod with shareProcessNamespace) and usually `--ipc=host`; both must
see the GPU. The memory is freed with the arena (or when this process exits), so the server must
not use the region after that: the client unregisters its regions on close.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from attnserve.regions import Arena, region_header
from attnserve.v1 import attention_pb2 as pb

if TYPE_CHECKING:
    import torch

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2


class CudaError(RuntimeError):
    """A CUDA runtime call failed (or libcudart could not be loaded)."""


class CudaRuntime:
    """The few libcudart entry points the arena needs, through ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaDeviceGetPCIBusId.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]

    def _check(self, what: str, err: int) -> None:
        if err != 0:
            message = self._lib.cudaGetErrorString(err).decode(errors="replace")
            raise CudaError(f"{what}: {message} ({err})")

    def get_device(self) -> int:
        device = ctypes.c_int()
        self._check("cudaGetDevice", self._lib.cudaGetDevice(ctypes.byref(device)))
        return device.value

    def set_device(self, device: int) -> None:
        self._check(f"cudaSetDevice({device})", self._lib.cudaSetDevice(device))

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(f"cudaMalloc({nbytes})", self._lib.cudaMalloc(ctypes.byref(ptr), nbytes))
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self._lib.cudaFree(ctypes.c_void_p(ptr)))

    def ipc_handle(self, ptr: int) -> bytes:
        handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._check("cudaIpcGetMemHandle", self._lib.cudaIpcGetMemHandle(handle, ptr))
        return handle.raw

    def copy_to_device(self, ptr: int, data: bytes) -> None:
        err = self._lib.cudaMemcpy(ptr, data, len(data), _MEMCPY_HOST_TO_DEVICE)
        self._check("cudaMemcpy to the device", err)

    def copy_to_host(self, ptr: int, nbytes: int) -> bytes:
        out = ctypes.create_string_buffer(nbytes)
        self._check(
            "cudaMemcpy to the host", self._lib.cudaMemcpy(out, ptr, nbytes, _MEMCPY_DEVICE_TO_HOST)
        )
        return out.raw

    def pci_bus_id(self, device: int) -> str:
        out = ctypes.create_string_buffer(32)
        self._check("cudaDeviceGetPCIBusId", self._lib.cudaDeviceGetPCIBusId(out, 32, device))
        return out.value.decode()


def cudart_candidates() -> list[str]:
    """Where libcudart may be, in the order tried: $ATTNSERVE_CUDART, the loader's search path
    (CUDA toolkits, LD_LIBRARY_PATH), then the copy torch's wheels bring (nvidia-cuda-runtime)."""
    names = [os.environ.get("ATTNSERVE_CUDART", "")]
    names += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    for root in sys.path:
        names += sorted(
            glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        )
    return [n for n in names if n]


_runtime: CudaRuntime | None = None


def load_cudart() -> CudaRuntime:
    """The process's CudaRuntime (loaded once). CudaError when no libcudart loads."""
    global _runtime
    if _runtime is None:
        tried = []
        for name in cudart_candidates():
            try:
                _runtime = CudaRuntime(ctypes.CDLL(name))
                break
            except OSError as e:
                tried.append(f"{name}: {e}")
        else:
            raise CudaError(
                "the cuda transport needs the CUDA runtime (libcudart); set ATTNSERVE_CUDART to "
                "its path. Tried: " + "; ".join(tried)
            )
    return _runtime


class _DeviceMemory:
    """A view of raw device memory for torch.as_tensor (__cuda_array_interface__ version 3)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # no stream to wait for: the caller orders its own work
        }


class CudaArena(Arena):
    """`size` bytes of cudaMalloc memory on `device`, its header written, exported for IPC."""

    kind = "cuda"

    def __init__(self, size: int, device: int, runtime: CudaRuntime | None = None) -> None:
        super().__init__(size)
        self.device = device
        self._runtime = runtime or load_cudart()
        previous = self._runtime.get_device()
        self._runtime.set_device(device)
        try:
            self.ptr = self._runtime.malloc(size)
            try:
                self._runtime.copy_to_device(self.ptr, region_header(self.key))
                self.handle = self._runtime.ipc_handle(self.ptr)
            except BaseException:
                self._runtime.free(self.ptr)
                raise
        finally:
            self._runtime.set_device(previous)

    def register_request(self) -> pb.RegisterRegionRequest:
        return pb.RegisterRegionRequest(
            name=self.name,
            cuda_ipc=pb.CudaIpcMemory(handle=self.handle),
            offset=0,
            size=self.size,
            key=self.key,
        )

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A torch view of bytes at offset of the arena (bf16 or float32), on its device."""
        import torch

        typestr = {torch.bfloat16: "<i2", torch.float32: "<f4"}[dtype]
        nbytes = int(np.prod(shape, dtype=np.int64)) * (2 if dtype == torch.bfloat16 else 4)
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"[{offset}, {offset + nbytes}) lies outside the arena")
        memory = _DeviceMemory(self.ptr + offset, tuple(shape), typestr)
        view: Any = torch.as_tensor(memory, device=f"cuda:{self.device}")
        return view.view(torch.bfloat16) if dtype == torch.bfloat16 else view

    def read(self, offset: int, nbytes: int) -> bytes:
        """Bytes of the arena, copied to the host (synchronously)."""
        return self._runtime.copy_to_host(self.ptr + offset, nbytes)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._runtime.free(self.ptr)
