"""Error types and retries, against the fake server's scripted failures and in isolation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import fake_server
import grpc
import numpy as np
import pytest
from fake_server import Failure

from attnserve import (
    NO_RETRIES,
    AsyncClient,
    AttnError,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    PageTable,
    PoolExhausted,
    QueueFull,
    ResourceExhausted,
    RetryPolicy,
    Unavailable,
)
from attnserve.errors import error_for
from attnserve.reference import CacheMirror, check_close, gqa_reference
from attnserve.retry import Attempts
from attnserve.tensors import bf16_round

Code = grpc.StatusCode
QUEUE_FULL = Failure(Code.RESOURCE_EXHAUSTED, pushback_ms=40)
DRAINING = Failure(Code.UNAVAILABLE)
FAST = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture
def service() -> Iterator[fake_server.FakeAttentionService]:
    yield fake_server.FakeAttentionService([fake_server.gqa_pool()])


@pytest.fixture
def address(service: fake_server.FakeAttentionService) -> Iterator[str]:
    server, address = fake_server.start(service)
    yield address
    server.stop(grace=None)


def decode_inputs(client: Client) -> tuple[PageTable, dict[str, np.ndarray]]:
    """A one-token sequence and the inputs of its decode (q, k_new, v_new)."""
    table = PageTable(client, "gqa", 4)
    table.reserve("s", 1)
    rng = np.random.default_rng(0)
    shapes = {"q": (1, 4, 8), "k_new": (1, 2, 8), "v_new": (1, 2, 8)}
    inputs = {k: bf16_round(rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()}
    return table, inputs


def test_each_status_raises_its_class(address: str) -> None:
    with Client(address, timeout=5.0) as client:
        with pytest.raises(PoolExhausted) as err:
            client.allocate_pages(65)
        assert isinstance(err.value, ResourceExhausted) and isinstance(err.value, AttnError)
        assert err.value.code == Code.RESOURCE_EXHAUSTED and err.value.retry_pushback_ms is None
        assert "64 pages free" in err.value.message
        with pytest.raises(FailedPrecondition):
            client.free_pages([3])
        with pytest.raises(NotFound):
            client.allocate_pages(1, pool="nope")


def test_queue_full_without_retries(
    service: fake_server.FakeAttentionService, address: str
) -> None:
    with Client(address, timeout=5.0, retry=None) as client:
        table, inputs = decode_inputs(client)
        service.fail_next("Decode", QUEUE_FULL)
        with pytest.raises(QueueFull) as err:
            client.decode(0, table=table.csr(["s"]), pool="gqa", **inputs)
        assert err.value.retry_pushback_ms == 40 and err.value.code == Code.RESOURCE_EXHAUSTED
        assert service.calls["Decode"] == 1


def test_error_for_picks_the_resource_exhausted_kind() -> None:
    exhausted = Code.RESOURCE_EXHAUSTED
    assert type(error_for(exhausted, "m", method="AllocatePages")) is PoolExhausted
    assert type(error_for(exhausted, "m", method="Prefill")) is ResourceExhausted  # too large
    assert type(error_for(exhausted, "m", method="Prefill", retry_pushback_ms=0)) is QueueFull
    assert type(error_for(Code.UNKNOWN, "m")) is AttnError


def test_queue_full_is_retried_after_the_pushback(
    service: fake_server.FakeAttentionService, address: str
) -> None:
    with Client(address, timeout=5.0, retry=FAST) as client:
        table, inputs = decode_inputs(client)
        mirror = CacheMirror.for_pool(fake_server.gqa_pool())
        service.fail_next("Decode", QUEUE_FULL, times=2)
        start = time.monotonic()
        result = client.decode(0, table=table.csr(["s"]), pool="gqa", **inputs)
        assert time.monotonic() - start >= 2 * 0.040
        assert service.calls["Decode"] == 3
        mirror.append(0, table.csr(["s"]), {"k": inputs["k_new"], "v": inputs["v_new"]})
        expected, _ = gqa_reference(mirror, 0, table.csr(["s"]), inputs["q"])
        assert check_close(result.output, expected).ok


def test_attention_is_retried_after_unavailable(
    service: fake_server.FakeAttentionService, address: str
) -> None:
    """Even when the lost attempt ran: the append rewrites the same slots with the same rows."""
    with Client(address, timeout=5.0, retry=FAST) as client:
        table, inputs = decode_inputs(client)
        csr = table.csr(["s"])
        service.fail_next("Decode", Failure(Code.UNAVAILABLE, after=True))
        service.fail_next("Decode", DRAINING)
        result = client.decode(1, table=csr, pool="gqa", **inputs)
        assert service.calls["Decode"] == 3
        mirror = CacheMirror.for_pool(fake_server.gqa_pool())
        mirror.append(1, csr, {"k": inputs["k_new"], "v": inputs["v_new"]})
        assert check_close(result.output, gqa_reference(mirror, 1, csr, inputs["q"])[0]).ok
        service.fail_next("GetServerInfo", DRAINING, times=3)
        assert client.server_info().version == "fake"


@pytest.mark.parametrize("method", ["AllocatePages", "FreePages"])
def test_page_calls_are_not_retried_after_unavailable(
    service: fake_server.FakeAttentionService, address: str, method: str
) -> None:
    """A lost AllocatePages reply would leak pages; a repeated FreePages could free pages that
    someone else got in between."""
    with Client(address, timeout=5.0, retry=FAST) as client:
        pages = client.allocate_pages(2)
        service.fail_next(method, DRAINING)
        with pytest.raises(Unavailable):
            if method == "AllocatePages":
                client.allocate_pages(1)
            else:
                client.free_pages(pages)
        assert service.calls[method] == (2 if method == "AllocatePages" else 1)
        client.free_pages(pages)


def test_page_calls_are_retried_when_the_queue_is_full(
    service: fake_server.FakeAttentionService, address: str
) -> None:
    with Client(address, timeout=5.0, retry=FAST) as client:
        service.fail_next("AllocatePages", QUEUE_FULL)
        pages = client.allocate_pages(3)
        assert len(pages) == 3 and service.calls["AllocatePages"] == 2
        client.free_pages(pages)


def test_pool_exhausted_is_not_retried(
    service: fake_server.FakeAttentionService, address: str
) -> None:
    with Client(address, timeout=5.0, retry=FAST) as client, pytest.raises(PoolExhausted):
        client.allocate_pages(100)
    assert service.calls["AllocatePages"] == 1


def test_attempts_are_bounded(service: fake_server.FakeAttentionService, address: str) -> None:
    with Client(address, timeout=5.0, retry=FAST) as client:
        service.fail_next("GetServerInfo", QUEUE_FULL, times=10)
        with pytest.raises(QueueFull):
            client.server_info()
        assert service.calls["GetServerInfo"] == FAST.max_attempts


def test_retries_stay_within_the_deadline(
    service: fake_server.FakeAttentionService, address: str
) -> None:
    """A pushback longer than the time left ends the call at once with the refusal."""
    with Client(address, timeout=0.3, retry=FAST) as client:
        service.fail_next("GetServerInfo", Failure(Code.RESOURCE_EXHAUSTED, pushback_ms=1000))
        start = time.monotonic()
        with pytest.raises(QueueFull):
            client.server_info()
        assert time.monotonic() - start < 0.25
        assert service.calls["GetServerInfo"] == 1


def test_unreachable_server_is_retried_until_the_attempts_run_out() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.01)
    fail_fast = Client("127.0.0.1:1", timeout=5.0, retry=policy, wait_for_ready=False)
    with fail_fast as client, pytest.raises(Unavailable):
        client.server_info()


def test_async_client_retries_the_same_way(
    service: fake_server.FakeAttentionService, address: str
) -> None:
    async def main() -> None:
        async with AsyncClient(address, timeout=5.0, retry=FAST) as client:
            service.fail_next("GetServerInfo", QUEUE_FULL)
            service.fail_next("GetServerInfo", DRAINING)
            assert (await client.server_info()).version == "fake"
            assert service.calls["GetServerInfo"] == 3
            service.fail_next("AllocatePages", DRAINING)
            with pytest.raises(Unavailable):
                await client.allocate_pages(1)
            with pytest.raises(PoolExhausted):
                await client.allocate_pages(100)

    asyncio.run(main())


class FakeRpcError(grpc.RpcError):
    """A failed attempt as grpc raises it: code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, pushback: str | None = None) -> None:
        self._code = code
        self._trailer = () if pushback is None else (("grpc-retry-pushback-ms", pushback),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "fake"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailer


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=0.5, multiplier=2.0)
    assert [policy.backoff(n) for n in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_waits_are_jittered_backoffs_plus_the_pushback() -> None:
    policy = RetryPolicy(max_attempts=100, initial_backoff=0.1, max_backoff=0.4, jitter=0.5)
    waits = []
    attempts = Attempts(policy, "Prefill", True, timeout=1000.0)
    for n in range(60):
        waits.append(attempts.wait_after(FakeRpcError(Code.UNAVAILABLE)) - policy.backoff(n))
    assert all(-0.5 * 0.4 <= w <= 0 for w in waits) and len(set(waits)) > 50  # spread
    pushed = attempts.wait_after(FakeRpcError(Code.RESOURCE_EXHAUSTED, pushback="250"))
    assert 0.25 + 0.2 <= pushed <= 0.25 + 0.4


def test_what_is_retried() -> None:
    def retried(code: Code, idempotent: bool, pushback: str | None = None) -> bool:
        attempts = Attempts(RetryPolicy(), "AllocatePages", idempotent, timeout=10.0)
        try:
            attempts.wait_after(FakeRpcError(code, pushback))
        except AttnError:
            return False
        return True

    assert retried(Code.RESOURCE_EXHAUSTED, idempotent=False, pushback="5")
    assert retried(Code.UNAVAILABLE, idempotent=True)
    assert not retried(Code.UNAVAILABLE, idempotent=False)
    assert not retried(Code.RESOURCE_EXHAUSTED, idempotent=True)  # pool full: no pushback
    assert not retried(Code.RESOURCE_EXHAUSTED, idempotent=True, pushback="x")  # malformed
    for code in (Code.INVALID_ARGUMENT, Code.DEADLINE_EXCEEDED, Code.INTERNAL, Code.CANCELLED):
        assert not retried(code, idempotent=True)


def test_failed_attempt_is_the_cause_of_the_error() -> None:
    attempts = Attempts(NO_RETRIES, "Decode", True, timeout=1.0)
    failure = FakeRpcError(Code.DEADLINE_EXCEEDED)
    with pytest.raises(DeadlineExceeded) as err:
        attempts.wait_after(failure)
    assert err.value.__cause__ is failure and err.value.message == "fake"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"initial_backoff": 1.0, "max_backoff": 0.5},
        {"initial_backoff": -1.0},
        {"multiplier": 0.5},
        {"jitter": 1.5},
    ],
)
def test_policy_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)
