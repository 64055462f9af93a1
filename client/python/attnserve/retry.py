"""Retries with exponential backoff and jitter, honouring the server's retry pushback.

What is retried, and why that is safe:

- QueueFull (RESOURCE_EXHAUSTED with the `grpc-retry-pushback-ms` trailer), any method: the
  server refused the call before queueing it, so nothing happened. The next attempt waits at
  least the pushback the server asked for.
- Unavailable, for GetServerInfo, Prefill and Decode only. attnserve answers UNAVAILABLE while it
  drains, for calls it refused or dropped from its queue before their launch: nothing happened.
  UNAVAILABLE from the transport (connection lost mid-call) is ambiguous: the call may have run.
  GetServerInfo only reads. Prefill and Decode are still safe to run twice: the append writes
  row r of a sequence at the position the page table fixes (kv_len - q_len + r), not at a
  server-side cursor, so the same request writes the same bytes into the same slots and
  computes the same attention again. (The caller must not free or reuse those pages while the
  call runs; a scheduler never does.) No retry policy covers a server restarted at the same
  address: it has lost every page, so a scheduler that sees a restart (GetServerInfo) must
  rebuild its sequences there, whether or not a call was retried.
- Not AllocatePages or FreePages on UNAVAILABLE: if the lost attempt ran, a second AllocatePages
  allocates again and the first pages leak (nobody holds their ids), and a second FreePages may
  free pages that another client was given in between. These raise Unavailable at once; the
  caller knows its situation (e.g. restart the server's pool, or compare free page counts).
- Never PoolExhausted (AllocatePages on a full pool, no pushback: waiting cannot help until pages
  are freed), InvalidArgument, NotFound, FailedPrecondition, Internal, DeadlineExceeded, Cancelled.

Timing: the call's timeout is the budget of all its attempts together. Each attempt gets what
is left; a retry whose wait would end past the deadline is not made (the last error is raised).
Before retry n (n = 0, 1, ...) the wait is pushback + b * (1 - jitter * u), with
b = min(max_backoff, initial_backoff * multiplier**n) and u uniform in [0, 1): exponential
growth, spread at random so that refused clients do not all come back at once.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

from attnserve.errors import AttnError, QueueFull, Unavailable, from_rpc_error


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a client retries (see the module docstring for what).

    max_attempts counts the first attempt (1 = no retries). Backoffs are in seconds; jitter is
    the fraction of each backoff that is drawn at random (0: none, 1: anywhere in [0, b]).
    """

    max_attempts: int = 5
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError(
                f"need 0 <= initial_backoff <= max_backoff, got {self.initial_backoff} "
                f"and {self.max_backoff}"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def backoff(self, retry: int) -> float:
        """Largest wait before retry number `retry` (0-based), pushback not included."""
        return min(self.max_backoff, self.initial_backoff * self.multiplier**retry)


DEFAULT_RETRY = RetryPolicy()
NO_RETRIES = RetryPolicy(max_attempts=1)


def is_retryable(error: AttnError, idempotent: bool) -> bool:
    """Whether a failed attempt may be sent again: QueueFull always, Unavailable when the
    method is idempotent."""
    return isinstance(error, QueueFull) or (idempotent and isinstance(error, Unavailable))


class Attempts:
    """The attempts of one call: their shared deadline and the wait before each retry.

    The sync and the asyncio clients run the same loop around it, one with time.sleep and the
    other with asyncio.sleep.
    """

    def __init__(self, policy: RetryPolicy, method: str, idempotent: bool, timeout: float) -> None:
        self._policy = policy
        self._method = method
        self._idempotent = idempotent
        self._deadline = time.monotonic() + timeout
        self._retries = 0

    def remaining(self) -> float:
        """Seconds left of the call's budget: the timeout of the next attempt."""
        return max(0.0, self._deadline - time.monotonic())

    def wait_after(self, failure: grpc.RpcError) -> float:
        """Seconds to wait before the next attempt; raises the failure as an AttnError when it
        is not to be retried (not retryable, out of attempts, or past the deadline)."""
        error = from_rpc_error(failure, self._method)
        delay = self._delay(error)
        if delay is None:
            raise error from failure
        self._retries += 1
        return delay

    def _delay(self, error: AttnError) -> float | None:
        if self._retries + 1 >= self._policy.max_attempts:
            return None
        if not is_retryable(error, self._idempotent):
            return None
        pushback = (error.retry_pushback_ms or 0) / 1000
        backoff = self._policy.backoff(self._retries)
        delay = pushback + backoff * (1 - self._policy.jitter * random.random())
        return delay if delay < self.remaining() else None
