"""End-to-end fixtures: the real attnserve binary on loopback with a small multi-pool config.

Environment:
  ATTNSERVE_BIN      server binary (default <repo>/build/release/bin/attnserve); every test is
                     skipped when it does not exist.
  ATTNSERVE_BACKEND  passed as --backend (default cpu), so the suite also runs against cuda.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import text_format

from attnserve import Client
from attnserve.v1 import server_config_pb2 as config_pb

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO / "build" / "release" / "bin" / "attnserve"
STARTUP_TIMEOUT_S = 60.0
SHUTDOWN_TIMEOUT_S = 30.0
LISTENING = re.compile(r"^attnserve listening on (\S+)$")


@dataclass
class ServerProcess:
    """A running server: its address, how it was started, and where its stderr goes."""

    address: str
    backend: str
    config: config_pb.ServerConfig
    process: subprocess.Popen
    log_path: Path

    def pool_config(self, name: str) -> config_pb.PoolConfig:
        return next(p for p in self.config.pools if p.name == name)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _forward_lines(stream, lines: queue.Queue) -> None:
    """Copies stdout lines to a queue until EOF, so the server never blocks on a full pipe."""
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _wait_for_address(lines: queue.Queue) -> str | None:
    """The address from the 'attnserve listening on HOST:PORT' line, or None (exit, timeout)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line is None:
            return None
        match = LISTENING.match(line)
        if match:
            return match.group(1)
    return None


def _start(binary: Path, workdir: Path) -> ServerProcess:
    from launcher import server_config

    config = server_config()
    config_path = workdir / "server.textproto"
    config_path.write_text(text_format.MessageToString(config))
    backend = os.environ.get("ATTNSERVE_BACKEND", "cpu")
    command = [
        str(binary),
        "--listen_address=127.0.0.1:0",
        "--metrics_port=0",  # off: test runs side by side would collide on the default port
        f"--config={config_path}",
        f"--backend={backend}",
    ]
    log_path = workdir / "stderr.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_forward_lines, args=(process.stdout, lines), daemon=True).start()
    server = ServerProcess("", backend, config, process, log_path)
    address = _wait_for_address(lines)
    if address is None:
        process.kill()
        process.wait()
        pytest.fail(f"no 'attnserve listening on' line from {command}:\n{server.log_tail()}")
    server.address = address
    return server


def _stop(server: ServerProcess) -> int:
    """SIGTERM, then the exit status (the server must drain and exit by itself)."""
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        raise AssertionError(f"server ignored SIGTERM for {SHUTDOWN_TIMEOUT_S} s") from None


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server binary, started once for the session; it must exit 0 on SIGTERM."""
    binary = Path(os.environ.get("ATTNSERVE_BIN", DEFAULT_BIN))
    if not binary.is_file():
        pytest.skip(
            f"attnserve binary not found at {binary}: build it "
            "(cmake --preset release && cmake --build --preset release) or set ATTNSERVE_BIN"
        )
    srv = _start(binary, tmp_path_factory.mktemp("attnserve"))
    yield srv
    code = _stop(srv)
    assert code == 0, f"server exited with {code} after SIGTERM:\n{srv.log_tail()}"


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Iterator[Client]:
    """A client of the session's server; at the end every pool must be entirely free again."""
    with Client(server.address, timeout=60.0, max_message_bytes=64 << 20) as c:
        yield c
        held = {p.name: p.total_pages - p.free_pages for p in c.server_info().pools}
        assert not any(held.values()), f"pages still allocated at the end: {held}"


def free_pages(client: Client) -> dict[str, int]:
    return {p.name: p.free_pages for p in client.server_info().pools}


@pytest.fixture(autouse=True)
def no_page_leaks(client: Client) -> Iterator[None]:
    """Every test must give back every page it allocated."""
    before = free_pages(client)
    yield
    assert free_pages(client) == before, "the test leaked pages (free pages per pool)"


@pytest.fixture
def private(tmp_path: Path) -> Iterator:
    """start(config, *flags) launches a private server (launcher.launch) for the test; every
    server it started is killed at the end if still running."""
    from launcher import Launched, launch

    started: list[Launched] = []

    def start(config: config_pb.ServerConfig, *flags: str) -> Launched:
        started.append(launch(tmp_path, config, *flags))
        return started[-1]

    yield start
    for s in started:
        if s.process.poll() is None:
            s.process.kill()
            s.process.wait()


@pytest.fixture
def own(private, request: pytest.FixtureRequest):
    """A private server of the test module's config(), with @pytest.mark.flags(...) flags."""
    marker = request.node.get_closest_marker("flags")
    return private(request.module.config(), *(marker.args if marker else ()))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "flags(*flags): extra server flags for a private server")
