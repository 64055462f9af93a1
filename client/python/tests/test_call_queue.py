"""The caller's side of a call queue without a server: the doorbell (attnserve.call_queue)."""

from __future__ import annotations

import ctypes
import errno
import threading
import time

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


def test_call_times_learn_each_shape_on_its_own() -> None:
    times = cq.CallTimes()
    assert times.expected(cq.DECODE, 100) == 0.0
    times.record(cq.DECODE, 100, 1e-3)
    assert times.expected(cq.DECODE, 100) == pytest.approx(1e-3)
    times.record(cq.DECODE, 100, 1.8e-3)  # an eighth of the way to each new time
    assert times.expected(cq.DECODE, 100) == pytest.approx(1.1e-3)
    assert times.expected(cq.DECODE, 101) == 0.0
    assert times.expected(cq.PREFILL, 100) == 0.0
    for i in range(cq.SHAPES):  # the least recently recorded shape goes first
        times.record(cq.PREFILL, i, 1e-3)
    assert times.expected(cq.DECODE, 100) == 0.0
    assert times.expected(cq.PREFILL, 0) == pytest.approx(1e-3)


def test_long_calls_sleep_through_all_but_a_margin() -> None:
    spin = 200e-6
    assert cq.sleep_before_polling(0.0, spin) == 0.0
    assert cq.sleep_before_polling(150e-6, spin) == 0.0
    assert cq.sleep_before_polling(300e-6, spin) == pytest.approx(100e-6)
    assert cq.sleep_before_polling(1.2e-3, spin) == pytest.approx(0.9e-3)


def answer_once_the_caller_sleeps(queue: cq.CallQueue, answer: bytes) -> None:
    """The server's side of slot 0: waits for a submitted call whose caller says it sleeps,
    then answers it and wakes the caller."""
    state = cq.SLOTS_AT + cq.STATE
    while queue._word(state) != cq.SUBMITTED or queue._word(cq.SLOTS_AT + cq.CLIENT_WAITING) == 0:
        pass
    queue._set(state, cq.TAKEN)
    area = cq.SLOTS_AT + cq.SLOT_HEADER + queue.request_bytes
    queue._buf[area : area + len(answer)] = answer
    queue._set(cq.SLOTS_AT + cq.STATUS, 0)
    queue._set(cq.SLOTS_AT + cq.RESPONSE_LEN, len(answer))
    queue._set(state, cq.DONE)
    cq._LIBC.syscall(cq._SYS_FUTEX, ctypes.c_void_p(queue._address(state)), cq._FUTEX_WAKE, 1,
                     None, None, 0)  # fmt: skip


@pytest.mark.parametrize("predict", [True, False])
def test_an_answer_before_the_expected_time_wakes_the_caller(predict: bool) -> None:
    """A caller sleeping through a long call's expected time says so in its slot, so an answer
    that lands early wakes it: missed, this call would sleep past its timeout."""
    queue = cq.CallQueue(slots=1, request_bytes=256, response_bytes=256, predict=predict)
    try:
        request = b"request"
        queue.call_times.record(cq.DECODE, len(request), 600.0)
        server = threading.Thread(target=answer_once_the_caller_sleeps, args=(queue, b"ok"))
        server.start()
        status, data, _ = queue.call(cq.DECODE, request, timeout=30.0)
        server.join()
        assert (status, data) == (0, b"ok")
        # The answered call's time went into its shape's average.
        assert 0 < queue.call_times.expected(cq.DECODE, len(request)) < 600.0
    finally:
        queue.close()


class _SeenWaiting(threading.Condition):
    """A queue's slot condition that says when a caller starts waiting on it."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def start_call(queue: cq.CallQueue, outcome: dict[str, object], name: str) -> threading.Thread:
    """One call without a timeout on a thread of its own; outcome[name]: its answer, or what it
    raised."""

    def call() -> None:
        try:
            outcome[name] = queue.call(cq.DECODE, b"request", timeout=None)
        except Exception as e:
            outcome[name] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_a_caller_waiting_for_a_slot_sees_the_queue_close() -> None:
    """The server closes the queue after its last pass over the slots: the call in the only slot,
    still submitted, is never answered and fails as QueueClosed, and its slot never comes back.
    A call waiting for a free slot must see `closed` too, or it waits forever."""
    queue = cq.CallQueue(slots=1, request_bytes=256, response_bytes=256, predict=False)
    queue._have_slot = _SeenWaiting(queue._lock)
    raised: dict[str, object] = {}
    try:
        holder = start_call(queue, raised, "holder")
        while queue._word(cq.SLOTS_AT + cq.STATE) != cq.SUBMITTED:
            time.sleep(1e-4)
        waiter = start_call(queue, raised, "waiter")
        assert queue._have_slot.waiting.wait(10)
        queue._set(cq.CLOSED, 1)  # the server stopped; nobody takes or answers the slot
        holder.join(10)
        waiter.join(10)
        assert not holder.is_alive() and not waiter.is_alive(), "a call waits on a closed queue"
        assert isinstance(raised["holder"], cq.QueueClosed), raised["holder"]
        assert isinstance(raised["waiter"], cq.QueueClosed), raised["waiter"]
        # The client closes a queue the server closed (Client._queue_call): a call still waiting
        # for a slot then fails the same way rather than read the released segment.
        queue.close()
        with pytest.raises(cq.QueueClosed):
            queue.call(cq.DECODE, b"request", timeout=None)
    finally:
        queue.close()


def park_in_sleep(queue: cq.CallQueue) -> tuple[threading.Event, threading.Event]:
    """Replaces the queue's futex sleep: the first caller to sleep on its slot sets `parked` and
    stays there, touching nothing, until `release` is set (its later sleeps return at once). It is
    then inside the queue, past its publish and before it looks at its slot again."""
    parked, release = threading.Event(), threading.Event()

    def sleep(offset: int, expected: int, seconds: float) -> None:
        parked.set()
        release.wait(10)

    queue._sleep = sleep
    return parked, release


@pytest.mark.parametrize("server", ["closed", "answers"])
def test_a_call_inside_the_queue_when_the_client_closes_it(server: str) -> None:
    """The client closes the queue while a call sleeps in its slot, past its publish. The segment
    stays mapped until the call is out, which ends as it would have without the close:
    - closed: the server closed the queue with the call still submitted; another call saw it and
      the client closed the queue (Client._queue_call). The call must still read its slot, see
      `closed` and fail as QueueClosed (the client then goes over gRPC), not find the segment
      released under it (a ValueError).
    - answers: the client closed it after UnregisterRegion. The server stops the queue on its own
      thread and may take the call until it sets `closed`: the call waits for it as usual and
      reads its answer.
    The last call out releases the segment; a later call fails as QueueClosed."""
    queue = cq.CallQueue(slots=1, request_bytes=256, response_bytes=256, predict=False)
    parked, release = park_in_sleep(queue)
    outcome: dict[str, object] = {}
    try:
        caller = start_call(queue, outcome, "call")
        assert parked.wait(10)
        if server == "closed":
            queue._set(cq.CLOSED, 1)  # nobody takes or answers the slot
        queue.close()
        mapped_while_used = not queue._map.closed
        if server == "answers":
            assert mapped_while_used, "close() released the segment under a call still in it"
            answer_once_the_caller_sleeps(queue, b"ok")
        release.set()
        caller.join(10)
        assert not caller.is_alive(), "the call still waits"
        if server == "closed":
            assert isinstance(outcome["call"], cq.QueueClosed), repr(outcome["call"])
        else:
            assert outcome["call"] == (0, b"ok", 0), repr(outcome["call"])
        assert mapped_while_used, "close() released the segment under a call still in it"
        assert queue._map.closed, "the last call out of a closed queue releases the segment"
        with pytest.raises(cq.QueueClosed):  # its slot free again after an answer, or not
            queue.call(cq.DECODE, b"request", timeout=None)
    finally:
        release.set()
        queue.close()
