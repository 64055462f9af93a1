"""A call queue: Decode and Prefill through shared memory instead of gRPC (attention.proto,
"Call queues"; the layout is proto/attnserve/v1/call_queue.h, restated here).

The client registers one queue per session (Client(call_queue=...)): a POSIX shared-memory
object of SLOTS call slots. A call writes its serialized request into a free slot, publishes it
and waits for the server's answer in the slot: it polls for a moment, then sleeps on the slot's
futex (through libc's syscall(2) via ctypes; without it, short sleeps). A call longer than the
polling window, of a shape (method, request size) seen before, first sleeps through most of the
time such calls took, then polls: its answer is seen as it lands rather than after a wake-up
(tens of microseconds on a VM); an answer that lands during that sleep wakes it as before.
Python has no atomic read-modify-write on shared memory, so this side rings the server's
doorbell with FUTEX_WAKE_OP: the kernel adds 1 to the doorbell and wakes the server in one
atomic step (one syscall per call, rather than only when the server announced that it sleeps; a
plain read-add-write could lose the server's own increment and let it sleep through the call).
It sleeps on its own slot in bounded slices, so a wake-up missed for want of a memory fence costs
a slice, never a hang.
Slots are handed out under a lock: concurrent calls of one client take different slots. The
segment stays mapped while any call is inside the queue: close() marks the queue closed and the
last call out unmaps it (the calls still in it see `closed`, or their answers, as usual).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import struct
import threading
import time

from attnserve.regions import (
    DEFAULT_SHM_PREFIX,
    HEADER_BYTES,
    _shm_open,
    new_key,
    new_region_name,
    new_shm_name,
    region_header,
    unlink_shm,
)
from attnserve.v1 import attention_pb2 as pb

FREE, SUBMITTED, TAKEN, DONE = 0, 1, 2, 3
DECODE, PREFILL = 1, 2
DOORBELL, SERVER_SLEEPING, CLOSED, SLOTS_AT = 64, 68, 72, 128
SLOT_HEADER = 64
STATE, CLIENT_WAITING, METHOD, REQUEST_LEN, TIMEOUT_US, CANCEL = 0, 4, 8, 12, 16, 24
STATUS, RESPONSE_LEN, RETRY_AFTER_MS = 32, 36, 40

SLOTS = 4
REQUEST_BYTES = 256 << 10
RESPONSE_BYTES = 64 << 10
SPIN_S = 50e-6  # polling before the first sleep
SLICE_S = 1e-3  # longest sleep between looks at the slot
SLOT_WAIT_S = 0.1  # longest wait for a free slot between looks at `closed`
SHAPES = 16  # call shapes whose times a queue keeps
PREDICT = True  # queues sleep through the expected time of long calls (CallQueue's predict)

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
_FUTEX_WAIT, _FUTEX_WAKE, _FUTEX_WAKE_OP = 0, 1, 5
# FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0): *uaddr2 += 1 (the conditional second wake
# wakes nobody: its count is 0).
_ADD_ONE = (1 << 28) | (1 << 12)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> ctypes.CDLL | None:
    if _SYS_FUTEX is None:
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def sleep_before_polling(expected: float, spin: float) -> float:
    """Seconds a call expected to take `expected` sleeps before it polls: none when the spin
    window covers it; else all but max(spin, a quarter of the call), the margin for its variation
    and for the sleep's own lateness."""
    margin = max(spin, expected / 4)
    return expected - margin if expected > margin else 0.0


class CallTimes:
    """How long calls of each shape (method, request size) took: an average over about the last
    8 calls of each of the last SHAPES shapes."""

    def __init__(self) -> None:
        self._average: dict[tuple[int, int], float] = {}

    def expected(self, method: int, request_bytes: int) -> float:
        """Seconds a call of this shape is expected to take; 0 when none was recorded."""
        return self._average.get((method, request_bytes), 0.0)

    def record(self, method: int, request_bytes: int, seconds: float) -> None:
        key = (method, request_bytes)
        old = self._average.pop(key, None)
        self._average[key] = seconds if old is None else old + (seconds - old) / 8
        if len(self._average) > SHAPES:
            del self._average[next(iter(self._average))]  # the least recently recorded


class QueueClosed(Exception):
    """The server stopped serving the queue (unregistered, session gone, shutting down)."""


class CallQueue:
    """One registered queue. register_request() for RegisterRegion, registered() once it
    succeeded, call() per call, close() after UnregisterRegion (or once the session is gone)."""

    def __init__(
        self,
        *,
        prefix: str = DEFAULT_SHM_PREFIX,
        slots: int = SLOTS,
        request_bytes: int = REQUEST_BYTES,
        response_bytes: int = RESPONSE_BYTES,
        predict: bool | None = None,
    ) -> None:
        self.name = new_region_name("queue")
        self.predict = PREDICT if predict is None else predict
        self.call_times = CallTimes()
        self.shm_name = new_shm_name(prefix)
        self.key = new_key()
        self.slots, self.request_bytes, self.response_bytes = slots, request_bytes, response_bytes
        self.stride = SLOT_HEADER + request_bytes + response_bytes
        self.size = SLOTS_AT + slots * self.stride
        fd = _shm_open(self.shm_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._linked = True
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            self._unlink()
            raise
        finally:
            os.close(fd)
        self._map[:HEADER_BYTES] = region_header(self.key)
        self._buf = memoryview(self._map)
        self._words = self._buf.cast("I")  # 32-bit words: each read and written in one access
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._free = list(range(slots))
        self._lock = threading.Lock()
        self._have_slot = threading.Condition(self._lock)
        self._users = 0  # calls holding a slot, which use the segment; guarded by _lock
        self.closed_here = False  # guarded by _lock; the segment is unmapped once no call uses it

    def register_request(self, session: str = "") -> pb.RegisterRegionRequest:
        return pb.RegisterRegionRequest(
            name=self.name,
            shared_memory=pb.SharedMemory(shm_name=self.shm_name),
            size=self.size,
            key=self.key,
            session=session,
            call_queue=pb.CallQueue(
                slots=self.slots,
                request_bytes=self.request_bytes,
                response_bytes=self.response_bytes,
            ),  # fmt: skip
        )

    def registered(self) -> None:
        self._unlink()  # the server mapped it: the name can go

    @property
    def server_closed(self) -> bool:
        return self._word(CLOSED) != 0

    def call(self, method: int, request: bytes, timeout: float | None) -> tuple[int, bytes, int]:
        """(status code, answer bytes, retry_after_ms) of one call; TimeoutError past timeout
        (the slot is then never reused: the server may still answer into it), QueueClosed."""
        if len(request) > self.request_bytes:
            raise ValueError(f"the request ({len(request)} bytes) does not fit a slot of "
                             f"{self.request_bytes}")  # fmt: skip
        give_up = None if timeout is None else time.monotonic() + timeout
        i = self._take_slot(give_up)
        base = SLOTS_AT + i * self.stride
        answer = None
        try:
            self._buf[base + SLOT_HEADER : base + SLOT_HEADER + len(request)] = request
            timeout_us = 0 if timeout is None else max(1, int(timeout * 1e6))
            struct.pack_into("<IIq", self._map, base + METHOD, method, len(request), timeout_us)
            self._set(base + CANCEL, 0)
            self._set(base + CLIENT_WAITING, 0)
            self._set(base + STATE, SUBMITTED)  # x86 keeps stores in order: the request first
            self._ring()
            published = time.monotonic()
            expected = self.call_times.expected(method, len(request)) if self.predict else 0.0
            answer = self._await(base, give_up, expected)
            if answer[0] == 0:
                self.call_times.record(method, len(request), time.monotonic() - published)
        finally:
            # A call that got no answer (QueueClosed, TimeoutError) keeps its slot out of use:
            # the server may still answer into it.
            self._let_go(None if answer is None else i)
        return answer

    def _take_slot(self, give_up: float | None) -> int:
        """A free slot, counted as a use of the segment until _let_go; QueueClosed once the
        queue is closed (by the server or by close()), TimeoutError past give_up."""
        with self._have_slot:
            while True:
                # Under the lock, so that close() has not released the segment meanwhile.
                if self.closed_here or self.server_closed:
                    raise QueueClosed("the call queue is closed")
                if self._free:
                    break
                left = None if give_up is None else give_up - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no free call-queue slot before the timeout")
                # Slots whose calls end in QueueClosed or TimeoutError never come back, so no
                # one may wake this wait: it looks at `closed` again after a while.
                self._have_slot.wait(SLOT_WAIT_S if left is None else min(left, SLOT_WAIT_S))
            self._users += 1
            return self._free.pop()

    def _let_go(self, slot: int | None) -> None:
        """Ends a use of the segment, giving the slot back unless it is None; the last use of a
        closed queue unmaps the segment."""
        with self._have_slot:
            self._users -= 1
            if slot is not None:
                self._free.append(slot)
                self._have_slot.notify()
            else:  # callers waiting for a slot: this one will not come back, look at `closed`
                self._have_slot.notify_all()
            if self.closed_here and self._users == 0:
                self._release()

    def _await(self, base: int, give_up: float | None, expected: float) -> tuple[int, bytes, int]:
        start = time.monotonic()
        poll = SPIN_S
        nap = sleep_before_polling(expected, SPIN_S)
        if nap > 0:  # a long call of a known shape: sleep through most of it, then poll
            wake = start + nap if give_up is None else min(give_up, start + nap)
            self._set(base + CLIENT_WAITING, 1)
            state = self._word(base + STATE)
            while state != DONE and not self.server_closed:
                now = time.monotonic()
                if now >= wake:
                    break
                self._sleep(base + STATE, state, min(wake - now, SLICE_S))
                state = self._word(base + STATE)
            self._set(base + CLIENT_WAITING, 0)
            poll += expected - nap
        spin_end = time.monotonic() + poll
        while True:
            state = self._word(base + STATE)
            if state == DONE:
                break
            now = time.monotonic()
            if self.server_closed and state == SUBMITTED:
                raise QueueClosed("the server closed the call queue")
            if give_up is not None and now >= give_up:
                self._set(base + CANCEL, 1)
                raise TimeoutError("no answer from the call queue before the timeout")
            if now < spin_end:
                continue
            self._set(base + CLIENT_WAITING, 1)
            if self._word(base + STATE) != DONE:
                self._sleep(base + STATE, state, SLICE_S)
        self._set(base + CLIENT_WAITING, 0)
        status, length, retry = struct.unpack_from("<iII", self._map, base + STATUS)
        area = base + SLOT_HEADER + self.request_bytes
        data = bytes(self._buf[area : area + min(length, self.response_bytes)])
        self._set(base + STATE, FREE)
        return status, data, retry

    def _word(self, offset: int) -> int:
        return self._words[offset // 4]

    def _set(self, offset: int, value: int) -> None:
        self._words[offset // 4] = value

    def _address(self, offset: int) -> int:
        return self._base + offset

    def _ring(self) -> None:
        """Adds 1 to the doorbell and wakes the server, atomically (FUTEX_WAKE_OP)."""
        if _LIBC is None:
            self._set(DOORBELL, (self._word(DOORBELL) + 1) & 0xFFFFFFFF)  # the server polls
            return
        bell = ctypes.c_void_p(self._address(DOORBELL))
        _LIBC.syscall(_SYS_FUTEX, bell, _FUTEX_WAKE_OP, 1, None, bell, _ADD_ONE)

    def _sleep(self, offset: int, expected: int, seconds: float) -> None:
        if _LIBC is None:
            time.sleep(min(seconds, 1e-4))
            return
        ts = _Timespec(0, int(seconds * 1e9))
        _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(self._address(offset)), _FUTEX_WAIT,
                      ctypes.c_uint(expected), ctypes.byref(ts), None, 0)  # fmt: skip

    def close(self) -> None:
        """Closes the queue: later calls, and those waiting for a slot, fail as QueueClosed. Calls
        already inside keep the segment mapped until they are out: a published call still waits
        for the server (which may take it until it sets `closed`: the client closes a queue after
        UnregisterRegion, or once the server closed it), and the last one out unmaps it."""
        with self._have_slot:
            if self.closed_here:
                return
            self.closed_here = True
            self._unlink()
            self._have_slot.notify_all()  # callers waiting for a slot: QueueClosed now
            if self._users == 0:
                self._release()

    def _release(self) -> None:
        """Unmaps the segment; under the lock, once closed and no call uses it."""
        self._words.release()
        self._buf.release()
        try:
            self._map.close()
        except BufferError:
            pass

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            unlink_shm(self.shm_name)
