"""Fixtures of the client's unit tests: a fake server over the numpy reference."""

from __future__ import annotations

from collections.abc import Iterator

import fake_server
import pytest

from attnserve import Client


@pytest.fixture
def fake_address() -> Iterator[str]:
    """Address of a fresh fake server with pools "gqa" and "mla"."""
    pools = [fake_server.gqa_pool(), fake_server.mla_pool()]
    server, address = fake_server.start(fake_server.FakeAttentionService(pools))
    yield address
    server.stop(grace=None)


@pytest.fixture
def client(fake_address: str) -> Iterator[Client]:
    with Client(fake_address, timeout=10.0) as c:
        yield c
