"""bench/loadgen.cc (attn_loadgen) against the real server: a short run of each mode must finish,
report consistent numbers and give back every page (the no_page_leaks fixture checks)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

# launcher, not conftest: with client/python/tests in the same run, "conftest" may name the
# other directory's module.
from launcher import binary


def loadgen_binary() -> Path:
    return binary().with_name("attn_loadgen")


@pytest.mark.parametrize(
    ("pool", "flags"),
    [
        ("gqa", ["--op=decode", "--clients=3", "--batch=4"]),
        ("gqa_g5", ["--op=prefill", "--clients=2", "--batch=2", "--prefill_tokens=24"]),
        ("mla", ["--op=decode", "--clients=1", "--batch=3", "--background_prefill_tokens=100"]),
        # Page tables in plans (CreatePlan), released before the pages are freed.
        ("gqa", ["--op=decode", "--clients=2", "--batch=3", "--plan"]),
        ("gqa_g5", ["--op=prefill", "--clients=1", "--batch=2", "--prefill_tokens=8", "--plan"]),
    ],
)
def test_loadgen_reports_a_short_run(server, tmp_path: Path, pool: str, flags: list[str]) -> None:
    binary = loadgen_binary()
    if not binary.is_file():
        pytest.skip(f"attn_loadgen not found at {binary}")
    out = tmp_path / "run.json"
    run = subprocess.run(
        [str(binary), f"--address={server.address}", f"--pool={pool}", "--context=70",
         "--seconds=0.5", "--warmup_seconds=0.1", f"--json={out}", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "end to end" in run.stdout
    r = json.loads(out.read_text())
    assert r["calls_per_s"] > 0 and r["tokens_per_s"] > 0
    assert r["merged_per_launch"] >= 1
    assert 0 <= r["compute_us_p50"] <= r["client_us"]["p50"]
    # Per call, client latency >= server total, so the end-to-end overhead is never below the
    # server's own (and percentiles keep that order).
    assert 0 <= r["server_overhead_us"]["p50"] <= r["end_to_end_overhead_us"]["p50"]
    # The overhead's stages are each non-negative (rest = total minus the timed stages).
    assert "execute - compute" in run.stdout
    assert all(v >= 0 for v in r["stage_us_p50"].values()), r["stage_us_p50"]
