"""The caller's side of a call queue without a server: the doorbell (attnserve.call_queue)."""

from __future__ import annotations

import ctypes
import errno
import threading

import pytest

from attnserve import call_queue as cq

pytestmark = pytest.mark.skipif(cq._LIBC is None, reason="needs libc's syscall(2) and futex")


def futex_wait(address: int, expected: int, seconds: int) -> int:
    """FUTEX_WAIT on a shared word: 0 when woken, else the errno (EAGAIN: the word had changed
    already; ETIMEDOUT: nobody woke it)."""
    ts = cq._Timespec(seconds, 0)
    got = cq._LIBC.syscall(cq._SYS_FUTEX, ctypes.c_void_p(address), cq._FUTEX_WAIT,
                           ctypes.c_uint(expected), ctypes.byref(ts), None, 0)  # fmt: skip
    return 0 if got == 0 else ctypes.get_errno()


def test_ringing_adds_one_to_the_doorbell_and_wakes_the_server() -> None:
    """The server sleeps on the doorbell's value; one ring moves it by exactly one (atomically,
    in the kernel: FUTEX_WAKE_OP) and wakes the sleeper, never leaving it to its time limit."""
    queue = cq.CallQueue(slots=1, request_bytes=256, response_bytes=256)
    try:
        bell = queue._word(cq.DOORBELL)
        woke: list[int] = []
        sleeper = threading.Thread(
            target=lambda: woke.append(futex_wait(queue._address(cq.DOORBELL), bell, 60))
        )
        sleeper.start()
        queue._ring()
        sleeper.join()
        assert woke[0] in (0, errno.EAGAIN), errno.errorcode.get(woke[0], woke[0])
        assert queue._word(cq.DOORBELL) == (bell + 1) & 0xFFFFFFFF
        for _ in range(3):
            queue._ring()
        assert queue._word(cq.DOORBELL) == (bell + 4) & 0xFFFFFFFF
    finally:
        queue.close()
