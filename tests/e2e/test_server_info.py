"""GetServerInfo, health and reflection."""

from __future__ import annotations

import grpc
import pytest

from attnserve import Client
from attnserve.v1 import attention_pb2 as pb

# HealthCheckRequest{service: ""} is empty; HealthCheckResponse{status: SERVING} is 08 01.
HEALTH_SERVING = b"\x08\x01"
# ServerReflectionRequest{list_services: ""} (field 7, length 0).
LIST_SERVICES = b"\x3a\x00"
POOL_NAMES = ["gqa", "gqa_g5", "mla"]
BF16_BYTES = 2


def test_server_identity(server, client: Client) -> None:
    info = client.server_info()
    assert info.version
    assert info.device
    if server.backend != "auto":
        assert info.backend == server.backend
    assert info.max_message_bytes == server.config.max_message_bytes


def test_every_pool_is_listed(server, client: Client) -> None:
    listed = sorted(p.name for p in client.server_info().pools)
    assert listed == sorted(p.name for p in server.config.pools)


@pytest.mark.parametrize("name", POOL_NAMES)
def test_pool_geometry_matches_the_config(server, client: Client, name: str) -> None:
    pool = client.pool_info(name)
    config = server.pool_config(name)
    assert pool.kind == config.kind
    assert (pool.num_layers, pool.page_size) == (config.num_layers, config.page_size)
    assert pool.num_qo_heads == config.num_qo_heads
    assert pool.kv_dtype == pb.DTYPE_BF16
    assert pool.total_pages == config.num_pages
    assert pool.free_pages == pool.total_pages
    if pool.kind == pb.POOL_KIND_GQA:
        assert (pool.num_kv_heads, pool.head_dim) == (config.num_kv_heads, config.head_dim)
        per_token = 2 * pool.num_kv_heads * pool.head_dim  # K and V
    else:
        assert (pool.num_kv_heads, pool.ckv_dim, pool.kpe_dim) == (1, 512, 64)
        per_token = pool.ckv_dim + pool.kpe_dim
    assert pool.bytes_per_page == pool.num_layers * pool.page_size * per_token * BF16_BYTES


def test_health_reports_serving(server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(b"", timeout=10) == HEALTH_SERVING


def test_reflection_lists_the_service(server) -> None:
    method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(server.address) as channel:
        responses = list(channel.stream_stream(method)(iter([LIST_SERVICES]), timeout=10))
    assert any(b"attnserve.v1.AttentionService" in r for r in responses)
