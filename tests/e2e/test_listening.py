"""Where the server listens: a unix domain socket (file mode, metrics beside it, checked
attention), the metrics endpoint's own address and its limits."""

from __future__ import annotations

import os
import stat
import urllib.request

from attnserve import Client
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import server_config_pb2 as config_pb

from launcher import sample
from workload import PoolSession


def config() -> config_pb.ServerConfig:
    c = config_pb.ServerConfig()
    c.pools.add(name="p", kind=pb.POOL_KIND_GQA, num_layers=1, page_size=16, num_qo_heads=8,
                num_kv_heads=2, head_dim=64, num_pages=256)  # fmt: skip
    return c


def test_serves_on_a_unix_socket_with_its_mode_and_metrics(private, tmp_path) -> None:
    path = tmp_path / "attn.sock"
    server = private(config(), f"--listen_address=unix:{path}", "--unix_socket_mode=0660")
    assert server.address == f"unix:{path}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    # Metrics are on (launch gives a metrics port) and bind 127.0.0.1 for a unix: address.
    assert "attn_build_info" in server.metrics()
    with Client(server.address) as client:
        pool = client.server_info().pools[0]
        session = PoolSession(client, pool, seed=3)
        session.grow(["a", "b"], [40, 7])
        session.prefill(["a", "b"], [40, 7])  # checked against the reference
        session.grow(["a", "b"], [1, 1])
        session.decode(["a", "b"])
        session.close()
    assert sample(server.metrics(), "attn_rpc_duration_seconds_count", method="Decode") >= 1


def test_messages_larger_than_the_socket_buffers_cross_a_unix_socket(private, tmp_path) -> None:
    # 2048 sequences: 2 MiB of q in and 2 MiB of output back, several times the system's default
    # unix socket buffer and half of what the server asks for (server/rpc/transport_args.h).
    c = config()
    c.pools[0].num_pages = 2048
    server = private(c, f"--listen_address=unix:{tmp_path}/attn.sock")
    with Client(server.address) as client:
        session = PoolSession(client, client.server_info().pools[0], seed=5)
        seqs = list(range(2048))
        session.grow(seqs, [1] * len(seqs))
        result = session.decode(seqs)  # checked against the reference
        assert result.output.nbytes >= 2 << 20
        session.close()


def test_grpc_args_reach_the_servers_port(private) -> None:
    import pytest

    from attnserve.errors import ResourceExhausted

    # An argument whose effect a client sees: headers larger than 16 bytes are refused.
    server = private(config(), "--grpc_arg=grpc.max_metadata_size=16")
    with Client(server.address) as client, pytest.raises(ResourceExhausted, match="metadata"):
        client.server_info()
    # Flow-control and frame sizes of its own: a 2 MiB decode still crosses, in 16 KiB frames.
    c = config()
    c.pools[0].num_pages = 2048
    server = private(
        c, "--grpc_arg=grpc.http2.lookahead_bytes=67108864,grpc.http2.max_frame_size=16384"
    )
    with Client(server.address) as client:
        session = PoolSession(client, client.server_info().pools[0], seed=6)
        seqs = list(range(2048))
        session.grow(seqs, [1] * len(seqs))
        assert session.decode(seqs).output.nbytes >= 2 << 20  # checked against the reference
        session.close()


def test_a_bad_grpc_arg_is_refused() -> None:
    import subprocess

    from launcher import binary

    for arg in ("grpc.http2.lookahead_bytes", "grpc.a=1.5", "=3"):
        result = subprocess.run(
            [str(binary()), "--listen_address=127.0.0.1:0", f"--grpc_arg={arg}"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "--grpc_arg" in result.stderr and arg in result.stderr


def test_metrics_address_is_its_own(private) -> None:
    from launcher import free_port

    port = free_port()
    server = private(config(), f"--metrics_address=127.0.0.1:{port}")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert b"attn_build_info" in response.read()
    assert server.health() == 1


def test_a_bad_socket_mode_is_refused(tmp_path) -> None:
    import subprocess

    from launcher import binary

    for mode, address in (("0980", f"unix:{tmp_path}/s"), ("0660", "127.0.0.1:0")):
        result = subprocess.run(
            [str(binary()), f"--listen_address={address}", f"--unix_socket_mode={mode}"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "unix_socket_mode" in result.stderr


def test_idle_half_sent_requests_do_not_stall_metrics(private) -> None:
    import socket

    server = private(config())
    idle = []
    for _ in range(6):  # more than /metrics has workers
        s = socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
        idle.append(s)
    try:
        # Each idle request times out after 2 s; before, two of them held /metrics for 30 s.
        assert "attn_build_info" in server.metrics()
    finally:
        for s in idle:
            s.close()
