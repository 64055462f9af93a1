"""client/python/examples/scheduler.py against the real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCHEDULER = Path(__file__).resolve().parents[2] / "client" / "python" / "examples" / "scheduler.py"


@pytest.mark.parametrize("pool", ["gqa", "gqa_g5", "mla"])
def test_scheduler_example_passes(server, pool: str) -> None:
    args = ["--address", server.address, "--pool", pool, "--prompt-len", "120"]
    run = subprocess.run(
        [sys.executable, str(SCHEDULER), *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "RESULT: PASS" in run.stdout
