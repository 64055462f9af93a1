"""Runs the real attnserve binary on loopback for the deployment checks."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
LISTENING = re.compile(r"^attnserve listening on (\S+)$")


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick for an ephemeral bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`binary *args`; start() waits for the 'attnserve listening on HOST:PORT' line."""

    def __init__(self, binary: Path, args: list[str], log_path: Path) -> None:
        self.binary, self.args, self.log_path = binary, args, log_path
        self.process: subprocess.Popen | None = None
        self.address = ""
        self._lines: queue.Queue = queue.Queue()

    def start(self) -> Server:
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            [str(self.binary), *self.args], stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            if m := LISTENING.match(line):
                self.address = m.group(1)
                return self
        self.stop()
        raise RuntimeError(f"attnserve did not start ({self.args}):\n{self.log()}")

    def _read_stdout(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def scrape(self, metrics_port: int) -> str:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def stop(self) -> int | None:
        """SIGTERM (a graceful drain) and the exit code; SIGKILL if it does not exit in time."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
