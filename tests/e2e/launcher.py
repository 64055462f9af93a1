"""Starts a private attnserve process with its own flags (for tests that need a metrics port,
batching knobs or a signal of their own), scrapes its metrics and checks its health."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import text_format

from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve.v1 import server_config_pb2 as config_pb

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"^attnserve listening on (\S+)$")


def server_config() -> config_pb.ServerConfig:
    """Three pools: gqa; gqa_g5 with a non-power-of-two group (20 query heads over 4 kv heads)
    and page_size 1; mla with page_size 64 as published workloads use."""
    config = config_pb.ServerConfig(max_message_bytes=64 << 20)
    gqa, mla = pb.POOL_KIND_GQA, pb.POOL_KIND_MLA
    config.pools.add(name="gqa", kind=gqa, num_layers=2, page_size=16, num_qo_heads=8,
                     num_kv_heads=2, head_dim=64, num_pages=256)  # fmt: skip
    config.pools.add(name="gqa_g5", kind=gqa, num_layers=2, page_size=1, num_qo_heads=20,
                     num_kv_heads=4, head_dim=128, num_pages=1024)  # fmt: skip
    config.pools.add(name="mla", kind=mla, num_layers=2, page_size=64, num_qo_heads=16,
                     num_pages=64)  # fmt: skip
    return config


def binary() -> Path:
    path = Path(os.environ.get("ATTNSERVE_BIN", REPO / "build" / "release" / "bin" / "attnserve"))
    if not path.is_file():
        pytest.skip(f"attnserve binary not found at {path}; build it or set ATTNSERVE_BIN")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launched:
    process: subprocess.Popen
    address: str
    metrics_port: int
    log: Path

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def health(self) -> int:
        """grpc.health.v1 status of the whole server: 1 SERVING, 2 NOT_SERVING."""
        with grpc.insecure_channel(self.address) as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            reply = check(b"", timeout=5)  # empty HealthCheckRequest: the whole server
        # HealthCheckResponse is a single enum field: tag 0x08, then the status.
        return reply[1] if len(reply) == 2 and reply[0] == 0x08 else 0

    def stop(self, timeout: float = 30) -> int:
        self.process.terminate()
        return self.process.wait(timeout=timeout)

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


def launch(workdir: Path, config: config_pb.ServerConfig, *flags: str) -> Launched:
    """Starts the server on a free port with a metrics endpoint; waits until it serves."""
    config_path = workdir / "server.textproto"
    config_path.write_text(text_format.MessageToString(config))
    metrics_port = free_port()
    log = workdir / "server.log"
    command = [
        str(binary()),
        "--listen_address=127.0.0.1:0",
        f"--metrics_port={metrics_port}",
        f"--config={config_path}",
        f"--backend={os.environ.get('ATTNSERVE_BACKEND', 'cpu')}",
        *flags,
    ]
    with log.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
    found: list[str] = []

    def read() -> None:
        for line in process.stdout:
            match = LISTENING.match(line.strip())
            if match:
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 60
    while not found and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not found:
        process.kill()
        pytest.fail(f"server did not start: {command}\n{log.read_text()}")
    return Launched(process, found[0], metrics_port, log)


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0


class SessionStub:
    """An AttentionService stub on a connection of its own, with a session of its own: every
    request that names no session names this one (the server has no implicit sessions). The
    raw stub is .raw; methods keep .future."""

    def __init__(self, address: str, **options: int) -> None:
        opts = [("grpc.use_local_subchannel_pool", 1), *options.items()]
        self.raw = pb_grpc.AttentionServiceStub(grpc.insecure_channel(address, options=opts))
        self.session = self.raw.OpenSession(pb.OpenSessionRequest(), timeout=10).session

    def __getattr__(self, name: str) -> _Named:
        return _Named(getattr(self.raw, name), self.session)


class _Named:
    def __init__(self, method, session: str) -> None:
        self._method, self._session = method, session

    def _named(self, request):
        if not request.session:
            request.session = self._session
        return request

    def __call__(self, request, **kwargs):
        return self._method(self._named(request), **kwargs)

    def future(self, request, **kwargs):
        return self._method.future(self._named(request), **kwargs)
