"""examples/scheduler.py against the fake server."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import fake_server
import numpy as np
import pytest

SCHEDULER = Path(__file__).resolve().parent.parent / "examples" / "scheduler.py"
SMALL = ["--sequences", "3", "--prompt-len", "40", "--chunk", "16", "--decode-steps", "4"]


@pytest.mark.parametrize("pool", ["gqa", "mla"])
def test_scheduler_passes(fake_address: str, pool: str) -> None:
    run = subprocess.run(
        [sys.executable, str(SCHEDULER), "--address", fake_address, "--pool", pool, *SMALL],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "RESULT: PASS" in run.stdout
    total = {"gqa": 64, "mla": 32}[pool]
    assert f"free {total} before, {total} after -> OK" in run.stdout
    for op in ("prefill", "decode"):
        assert f"  {op}" in run.stdout


@pytest.mark.parametrize("transport", ["bytes", "shm"])
def test_scheduler_over_each_transport(transport: str) -> None:
    service = fake_server.FakeAttentionService([fake_server.gqa_pool()], shared_memory=True)
    server, address = fake_server.start(service)
    try:
        run = subprocess.run(
            [sys.executable, str(SCHEDULER), "--address", address, "--transport", transport,
             *SMALL],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        server.stop(grace=None)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "RESULT: PASS" in run.stdout
    expected = "shared memory" if transport == "shm" else "bytes in the messages"
    assert f"transport {transport}: {expected}" in run.stdout
    in_region = [r.HasField("page_table") and r.q.HasField("region") for r in service.seen]
    assert in_region and all(in_region) == (transport == "shm")


class OffByOne(fake_server.FakeAttentionService):
    """Decode outputs are off by 0.5."""

    def Decode(self, request, context):  # noqa: N802 - gRPC method name
        response = super().Decode(request, context)
        out = fake_server.unpack_tensor(response.output) + np.float32(0.5)
        response.output.CopyFrom(fake_server.pack_tensor(out))
        return response


class Leaky(fake_server.FakeAttentionService):
    """FreePages reports success but frees nothing."""

    def FreePages(self, request, context):  # noqa: N802
        return fake_server.pb.FreePagesResponse()


def load_scheduler():
    spec = importlib.util.spec_from_file_location("scheduler", SCHEDULER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scheduler"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_in_process(service, capsys) -> tuple[int, str, str]:
    """Runs scheduler.main against service; returns the exit code, stdout and stderr."""
    module = load_scheduler()
    server, address = fake_server.start(service)
    try:
        code = module.main(["--address", address, *SMALL])
    finally:
        server.stop(grace=None)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_scheduler_fails_on_wrong_results(capsys) -> None:
    code, out, _ = run_in_process(OffByOne([fake_server.gqa_pool()]), capsys)
    assert code == 1
    assert "-> FAIL" in out and "RESULT: FAIL" in out


def test_scheduler_fails_on_leaked_pages(capsys) -> None:
    code, out, _ = run_in_process(Leaky([fake_server.gqa_pool()]), capsys)
    assert code == 1
    assert "LEAK" in out


def test_scheduler_reports_failed_calls(capsys) -> None:
    tiny = fake_server.FakeAttentionService([fake_server.gqa_pool(total_pages=4)])
    code, _, err = run_in_process(tiny, capsys)
    assert code == 2
    assert "call failed: RESOURCE_EXHAUSTED" in err
