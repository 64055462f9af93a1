"""Fixtures of the client's unit tests: a fake server over the numpy reference, and an echo
server for message sizes and deadlines."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import fake_server
import grpc
import pytest

from attnserve import Client
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


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


class EchoService(pb_grpc.AttentionServiceServicer):
    """Prefill answers with q as the output; GetServerInfo takes 0.3 s."""

    def GetServerInfo(self, request, context):  # noqa: N802 - gRPC method name
        time.sleep(0.3)
        return pb.GetServerInfoResponse(version="slow")

    def Prefill(self, request, context):  # noqa: N802 - gRPC method name
        return pb.AttentionResponse(output=request.q)

    def OpenSession(self, request, context):  # noqa: N802 - gRPC method name
        return pb.OpenSessionResponse(session="echo")


@pytest.fixture
def echo_address() -> Iterator[str]:
    limit = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=limit)
    pb_grpc.add_AttentionServiceServicer_to_server(EchoService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)
