"""Memory shared with the server: arenas, their region header, and block allocation.

attention.proto ("Registered memory") lets a session register memory the server maps once; a
call then names slices of it instead of carrying bytes. An arena is one such region owned by this
client: POSIX shared memory here (SharedMemoryArena), CUDA memory in attnserve.cuda_ipc. Each
starts with the 48-byte proof of access the server checks at registration (REGION_MAGIC, then a
fresh 32-byte random key that only this process and the server learn), and hands out 64-byte
aligned blocks (RegionSlice offsets must be multiples of 16) through a thread-safe first-fit
Allocator, so concurrent calls of one client each get their own block and blocks are reused
once their call is done.

Shared memory objects are named PREFIX-<32 hex digits> (128 random bits; the server opens only
names under its configured prefix, "/attnserve" by default), created O_EXCL with mode 0600 so
that only this user (and root) can open them. What survives a crash:
- The name is unlinked as soon as the server has mapped the object (SharedMemoryArena.
  registered()), so from then on nothing is left in /dev/shm whatever happens to this process:
  the memory lives as long as a mapping of it does, the server's included, and the server drops
  its mapping when the region is unregistered or its session closes or expires (the lease).
- Only an object created but not yet registered (the RegisterRegion call in flight, a fraction
  of a millisecond) outlives a process killed at that moment: /dev/shm/attnserve-* (a tmpfs:
  gone at reboot; `rm /dev/shm/attnserve-*` of objects whose owner is gone is safe).
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import re
import secrets
import threading
from dataclasses import dataclass, field

import numpy as np

from attnserve.v1 import attention_pb2 as pb

REGION_MAGIC = b"attnserve.region"
KEY_BYTES = 32
HEADER_BYTES = len(REGION_MAGIC) + KEY_BYTES  # 48
SLICE_ALIGNMENT = 16  # RegionSlice.offset must be a multiple of this (attention.proto)
BLOCK_ALIGNMENT = 64  # what this client allocates: whole cache lines
DEFAULT_SHM_PREFIX = "/attnserve"  # DataPlaneConfig.shm_name_prefix's default
DEFAULT_ARENA_BYTES = 64 << 20

_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]+")


def new_key() -> bytes:
    """A fresh random region key (KEY_BYTES bytes)."""
    return secrets.token_bytes(KEY_BYTES)


def region_header(key: bytes) -> bytes:
    """The HEADER_BYTES a region must start with when it is registered with key."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a region key has {KEY_BYTES} bytes, got {len(key)}")
    return REGION_MAGIC + key


def new_region_name(kind: str) -> str:
    """A RegisterRegionRequest.name unique within a session: py-<kind>-<16 hex digits>."""
    return f"py-{kind}-{secrets.token_hex(8)}"


def new_shm_name(prefix: str = DEFAULT_SHM_PREFIX) -> str:
    """A POSIX shared-memory name under prefix with a 128-bit random suffix."""
    if not prefix.startswith("/") or (len(prefix) > 1 and not _NAME_CHARS.fullmatch(prefix[1:])):
        raise ValueError(f"shm prefix {prefix!r} must be '/' then characters of [A-Za-z0-9_.-]")
    name = f"{prefix}-{secrets.token_hex(16)}"
    if len(name) > 255:
        raise ValueError(f"shm prefix {prefix!r} is too long")
    return name


def align(n: int, alignment: int = BLOCK_ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


class Allocator:
    """First-fit allocation of aligned blocks of [start, size). Thread-safe.

    Offsets and sizes are multiples of `alignment`; freeing coalesces neighbours, so a run of
    calls of the same sizes reuses the same blocks.
    """

    def __init__(self, size: int, start: int = BLOCK_ALIGNMENT, alignment: int = BLOCK_ALIGNMENT):
        if start % alignment or size < start:
            raise ValueError(f"bad arena geometry: start {start}, size {size}, align {alignment}")
        self._alignment = alignment
        self._lock = threading.Lock()
        end = size - size % alignment
        self._free: list[tuple[int, int]] = [(start, end - start)] if end > start else []
        self._used: dict[int, int] = {}
        self.capacity = max(0, end - start)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new block of at least nbytes (at least one alignment unit), or None."""
        need = align(max(nbytes, 1), self._alignment)
        with self._lock:
            for i, (offset, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + need, size - need)
                    self._used[offset] = need
                    return offset
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset)  # KeyError: not allocated (a double free)
            i = bisect.bisect(self._free, (offset, 0))
            if i < len(self._free) and self._free[i][0] == offset + size:  # merge the next
                size += self._free.pop(i)[1]
            if i > 0 and sum(self._free[i - 1]) == offset:  # merge the previous
                offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
                self._free[i - 1] = (offset, size)
            else:
                self._free.insert(i, (offset, size))

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max((size for _, size in self._free), default=0)


class Arena:
    """A region this client registers. Subclasses provide the memory; `kind` is "shm" or "cuda".

    Life: created (header written) -> registration request sent -> registered() -> blocks
    allocated and freed -> close() (after UnregisterRegion, or when the server is gone).
    """

    kind = ""

    def __init__(self, size: int) -> None:
        if size < BLOCK_ALIGNMENT * 2:
            raise ValueError(f"an arena needs at least {BLOCK_ALIGNMENT * 2} bytes, got {size}")
        self.name = new_region_name(self.kind)
        self.size = size
        self.key = new_key()
        self.allocator = Allocator(size)
        self.is_registered = False
        self.closed = False

    def register_request(self) -> pb.RegisterRegionRequest:
        raise NotImplementedError

    def registered(self) -> None:
        """The server has mapped the region."""
        self.is_registered = True

    def allocate(self, nbytes: int) -> Block | None:
        offset = self.allocator.allocate(nbytes)
        return None if offset is None else Block(self, offset, nbytes)

    def close(self) -> None:
        self.closed = True


@dataclass(slots=True)
class Block:
    """A block of an arena: the slices of one call, or one staged page table. release() gives
    it back (once; later calls are no-ops). carve() hands out its slices in order."""

    arena: Arena
    offset: int
    size: int
    _used: int = field(default=0, repr=False)
    released: bool = field(default=False, repr=False)

    def carve(self, nbytes: int) -> int:
        """Region offset of the next slice of nbytes (BLOCK_ALIGNMENT aligned) of this block."""
        if self._used + nbytes > self.size:
            raise ValueError(f"{nbytes} more bytes overrun a block of {self.size}")
        start = self.offset + self._used
        self._used = align(self._used + nbytes)
        return start

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.arena.allocator.free(self.offset)


def _shm_open(name: str, flags: int, mode: int) -> int:
    try:
        import _posixshmem  # CPython's shm_open, used by multiprocessing.shared_memory
    except ImportError:  # pragma: no cover - non-CPython: Linux keeps POSIX shm in /dev/shm
        return os.open("/dev/shm" + name, flags, mode)
    return _posixshmem.shm_open(name, flags, mode)


def unlink_shm(name: str) -> None:
    """Removes a shared-memory name; one already gone is fine."""
    try:
        _shm_unlink(name)
    except FileNotFoundError:
        pass


def _shm_unlink(name: str) -> None:
    try:
        import _posixshmem
    except ImportError:  # pragma: no cover
        os.unlink("/dev/shm" + name)
        return
    _posixshmem.shm_unlink(name)


class SharedMemoryArena(Arena):
    """A POSIX shared-memory object of `size` bytes, mapped here, header written at offset 0.

    mode: file mode of the object (0600: this user only; a server running as another user of
    the same group needs 0660 and that group, see the README's container notes).
    """

    kind = "shm"

    def __init__(self, size: int, *, prefix: str = DEFAULT_SHM_PREFIX, mode: int = 0o600):
        super().__init__(size)
        self.shm_name = new_shm_name(prefix)
        fd = _shm_open(self.shm_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        self._linked = True
        try:
            os.fchmod(fd, mode)  # exactly mode, whatever the umask
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            self._unlink()
            raise
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.bytes[:HEADER_BYTES] = np.frombuffer(region_header(self.key), dtype=np.uint8)

    def register_request(self) -> pb.RegisterRegionRequest:
        return pb.RegisterRegionRequest(
            name=self.name,
            shared_memory=pb.SharedMemory(shm_name=self.shm_name),
            offset=0,
            size=self.size,
            key=self.key,
        )

    def registered(self) -> None:
        """The server has mapped the object: its name is no longer needed (see the module doc)."""
        super().registered()
        self._unlink()

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """A numpy view of bytes [offset, offset + size of shape x dtype) of the arena."""
        dtype = np.dtype(dtype)
        end = offset + math.prod(shape) * dtype.itemsize
        if offset < 0 or end > self.bytes.size:  # the size, or 0 once closed
            raise ValueError(f"[{offset}, {end}) lies outside the arena of {self.size} bytes")
        return np.ndarray(shape, dtype, buffer=self.bytes, offset=offset)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._unlink()
        self.bytes = np.empty(0, np.uint8)
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the last one
            pass

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            unlink_shm(self.shm_name)
