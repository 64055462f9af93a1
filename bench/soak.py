#!/usr/bin/env python3
"""Soak test: a mixed load on one server for a while; its memory must stay flat and no page leak.

    .venv/bin/python bench/soak.py [--seconds=600] [--clients=6] [--json=PATH]

Starts the server (ATTNSERVE_BIN, default build/release/bin/attnserve; CPU backend) with a GQA and
an MLA pool, then runs --clients threads, each with its own connection, doing episodes until the
time is up. An episode is a scheduler's life in miniature on one pool:
  - a session: the thread's client's own (opened by its first call that needs one), or an
    explicit one (OpenSession, lease 2 s) on a new connection;
  - 1-3 sequences: AllocatePages, chunked prefill with append on every layer, decode steps with
    append on every layer;
  - ~5 % of the attention calls with a 1-3 ms deadline (cancelled, or finished in time);
  - the end: FreePages then CloseSession, CloseSession with the pages still allocated, or (an
    explicit session) abandoned, for the lease reaper to reclaim.
Every second it samples the server's VmRSS (/proc/PID/status).

Pass criteria (exit 1 otherwise):
  - flat memory: after a warm-up (--warmup, default the first third of the run but at least
    30 s), the median RSS of the second half of the rest is at most --max-growth-mib (default 8)
    above the median of its first half. For the default 600 s: the last third against the second.
    Warm-up is when glibc's malloc arenas, gRPC's buffers and the lanes' scratch reach their
    high-water marks (the pools' storage is touched in full before the clock starts). 8 MiB is
    about three times the largest difference of these medians measured here on healthy runs, and
    at ~1300 calls/s catches a leak of ~30 bytes per call in the 10-minute run (200 s apart) and
    ~400 bytes per call in the 1-minute CI run (15 s apart). docs/reliability.md has the figures;
  - no leaked pages: once the clients are done and abandoned sessions have expired, every pool
    has free_pages == total_pages;
  - no unexpected errors: only DEADLINE_EXCEEDED / CANCELLED (the short deadlines),
    RESOURCE_EXHAUSTED (pool full while all clients hold pages) and FAILED_PRECONDITION from a
    FreePages racing a call whose client gave up on it (retried) are expected;
  - the server exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from google.protobuf import text_format

from attnserve import AttnError, Client, FailedPrecondition, PageTable
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import server_config_pb2 as config_pb

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BIN = REPO / "build" / "release" / "bin" / "attnserve"
LISTENING = re.compile(r"^attnserve listening on (\S+)$")
MLA_SCALE = 0.1352337747812271
EXPECTED_ERRORS = {"DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"}
ABANDONED_LEASE_S = 2.0


def server_config() -> config_pb.ServerConfig:
    """Small pools (4 MiB GQA, 4.5 MiB MLA), so the clients contend for pages."""
    config = config_pb.ServerConfig(session_lease_seconds=30)
    config.pools.add(
        name="gqa",
        kind=pb.POOL_KIND_GQA,
        num_layers=2,
        page_size=16,
        num_qo_heads=8,
        num_kv_heads=2,
        head_dim=64,
        num_pages=256,
    )
    config.pools.add(
        name="mla", kind=pb.POOL_KIND_MLA, num_layers=2, page_size=64, num_qo_heads=8, num_pages=32
    )
    return config


@dataclass
class Stats:
    """Counters shared by the client threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: Counter = field(default_factory=Counter)  # by RPC
    errors: Counter = field(default_factory=Counter)  # by (RPC, code)
    episodes: Counter = field(default_factory=Counter)  # by how they ended
    unexpected: list = field(default_factory=list)

    def call(self, rpc: str) -> None:
        with self.lock:
            self.calls[rpc] += 1

    def error(self, rpc: str, e: AttnError) -> None:
        with self.lock:
            self.errors[f"{rpc} {e.code.name}"] += 1
            if e.code.name not in EXPECTED_ERRORS and len(self.unexpected) < 20:
                self.unexpected.append(f"{rpc}: {e.code.name}: {e.message}")

    def episode(self, how: str) -> None:
        with self.lock:
            self.episodes[how] += 1


class Bits:
    """Random finite bf16 bits (uint16), sliced into tensors without per-call conversion."""

    def __init__(self, seed: int, size: int = 1 << 20) -> None:
        values = np.random.default_rng(seed).uniform(-2, 2, size).astype(np.float32)
        self.bits = (values.view(np.uint32) >> 16).astype(np.uint16)

    def take(self, *shape: int) -> np.ndarray:
        n = int(np.prod(shape))
        if n >= self.bits.size:
            return np.resize(self.bits, n).reshape(shape)
        start = random.randrange(0, self.bits.size - n)
        return self.bits[start : start + n].reshape(shape)


class Worker:
    """One client thread: episodes until the stop event."""

    def __init__(self, index: int, address: str, pools: dict, stats: Stats, stop: threading.Event):
        self.index = index
        self.address = address
        self.pools = pools
        self.stats = stats
        self.stop = stop
        self.rng = random.Random(index)
        self.bits = Bits(index)
        self.base = Client(address, timeout=30.0)  # this thread's connection and session

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.episode()
        finally:
            self.base.close()

    def _invoke(self, rpc: str, fn, *args, **kwargs):
        self.stats.call(rpc)
        try:
            return fn(*args, **kwargs)
        except AttnError as e:
            self.stats.error(rpc, e)
            raise

    def episode(self) -> None:
        # The MLA pool is 4x more expensive per token: one episode in four uses it.
        pool = self.pools["mla" if self.rng.random() < 0.25 else "gqa"]
        explicit = self.rng.random() < 0.5
        client = Client(self.address, timeout=30.0) if explicit else self.base
        if explicit:
            self._invoke("OpenSession", client.open_session, lease_s=ABANDONED_LEASE_S)
        table = PageTable(client, pool.name, pool.page_size)
        seqs = list(range(self.rng.randint(1, 3)))
        try:
            self.sequences(client, pool, table, seqs)
        except AttnError:
            pass  # counted; the episode ends as planned below
        end = self.rng.random()
        try:
            if explicit and end < 0.2:
                self.stats.episode("abandoned (lease expiry)")  # pages reclaimed by the reaper
            elif explicit and end < 0.6:
                self._invoke("CloseSession", client.close_session)
                self.stats.episode("closed with pages")
            else:
                self.free_all(table)
                if explicit:
                    self._invoke("CloseSession", client.close_session)
                self.stats.episode("freed")
        finally:
            if explicit:
                client.close()

    def free_all(self, table: PageTable) -> None:
        """FreePages for every sequence. A call whose client gave up on it (short deadline) may
        still run on the server and pin its pages for a moment: FAILED_PRECONDITION, retried."""
        for seq in table.seq_ids:
            for _ in range(200):
                try:
                    self._invoke("FreePages", table.free, seq)
                    break
                except FailedPrecondition:
                    time.sleep(0.01)
            else:
                raise RuntimeError(f"pages of {seq} stayed in use for 2 s")

    def timeout(self) -> float | None:
        """A short deadline for ~5 % of the attention calls."""
        return self.rng.uniform(0.001, 0.003) if self.rng.random() < 0.05 else None

    def attention(self, client: Client, pool, csr, rows: int, decode: bool) -> None:
        """One call per layer: append `rows` tokens' K/V, attend."""
        for layer in range(pool.num_layers):
            if pool.kind == pb.POOL_KIND_MLA:
                kwargs = dict(
                    q_pe=self.bits.take(rows, pool.num_qo_heads, 64),
                    ckv_new=self.bits.take(rows, 512),
                    kpe_new=self.bits.take(rows, 64),
                    sm_scale=MLA_SCALE,
                )
                q = self.bits.take(rows, pool.num_qo_heads, 512)
            else:
                kv = (rows, pool.num_kv_heads, pool.head_dim)
                kwargs = dict(k_new=self.bits.take(*kv), v_new=self.bits.take(*kv))
                q = self.bits.take(rows, pool.num_qo_heads, pool.head_dim)
            fn = client.decode if decode else client.prefill
            rpc = "Decode" if decode else "Prefill"
            try:
                self._invoke(
                    rpc,
                    fn,
                    layer,
                    q,
                    csr,
                    pool=pool.name,
                    timeout=self.timeout(),
                    return_lse=self.rng.random() < 0.5,
                    **kwargs,
                )
            except AttnError as e:
                if e.code.name not in ("DEADLINE_EXCEEDED", "CANCELLED"):
                    raise

    def sequences(self, client: Client, pool, table: PageTable, seqs: list[int]) -> None:
        prompts = {s: self.rng.randint(8, 160) for s in seqs}
        chunk = 64
        done = dict.fromkeys(seqs, 0)
        while any(done[s] < prompts[s] for s in seqs) and not self.stop.is_set():
            batch = [s for s in seqs if done[s] < prompts[s]]
            q_lens = [min(chunk, prompts[s] - done[s]) for s in batch]
            for s, n in zip(batch, q_lens, strict=True):
                self._reserve(table, s, n)
                done[s] += n
            self.attention(client, pool, table.csr(batch, q_lens), sum(q_lens), decode=False)
        for _ in range(self.rng.randint(2, 12)):
            if self.stop.is_set():
                break
            for s in seqs:
                self._reserve(table, s, 1)
            self.attention(client, pool, table.csr(seqs), len(seqs), decode=True)

    def _reserve(self, table: PageTable, seq: int, n: int) -> None:
        if table.pages_needed(seq, n):
            self._invoke("AllocatePages", table.reserve, seq, n)
        else:
            table.reserve(seq, n)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def start_server(binary: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    config = server_config()
    path = workdir / "server.textproto"
    path.write_text(text_format.MessageToString(config))
    command = [
        str(binary),
        "--listen_address=127.0.0.1:0",
        "--metrics_port=0",
        f"--config={path}",
        "--backend=cpu",
    ]
    with (workdir / "server.log").open("w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue = queue.Queue()

    def forward() -> None:  # keeps reading, so the server never blocks on a full pipe
        for line in process.stdout:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=forward, daemon=True).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line is None:
            break
        match = LISTENING.match(line)
        if match:
            return process, match.group(1)
    process.kill()
    raise SystemExit(f"server did not start: {command}\n{(workdir / 'server.log').read_text()}")


def touch_pools(address: str, pools: dict) -> None:
    """Appends into every page of every pool once, so the pools' storage (mapped lazily) is
    resident before the run: one sequence per page, so attention stays cheap."""
    with Client(address, timeout=120.0) as client:
        bits = Bits(12345)
        for pool in pools.values():
            table = PageTable(client, pool.name, pool.page_size)
            per_call = max(1, 512 // pool.page_size)  # 512 rows per call
            for first in range(0, pool.total_pages, per_call):
                seqs = list(range(first, min(first + per_call, pool.total_pages)))
                for s in seqs:
                    table.reserve(s, pool.page_size)
                n = len(seqs) * pool.page_size
                csr = table.csr(seqs, [pool.page_size] * len(seqs))
                for layer in range(pool.num_layers):
                    if pool.kind == pb.POOL_KIND_MLA:
                        client.prefill(
                            layer,
                            bits.take(n, pool.num_qo_heads, 512),
                            csr,
                            pool=pool.name,
                            q_pe=bits.take(n, pool.num_qo_heads, 64),
                            ckv_new=bits.take(n, 512),
                            kpe_new=bits.take(n, 64),
                            sm_scale=MLA_SCALE,
                        )
                    else:
                        kv = (n, pool.num_kv_heads, pool.head_dim)
                        client.prefill(
                            layer,
                            bits.take(n, pool.num_qo_heads, pool.head_dim),
                            csr,
                            pool=pool.name,
                            k_new=bits.take(*kv),
                            v_new=bits.take(*kv),
                        )
            table.free_all()


def median_mib(samples: list[tuple[float, int]]) -> float:
    return statistics.median(kib for _, kib in samples) / 1024 if samples else float("nan")


def slope_mib_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time."""
    if len(samples) < 2:
        return float("nan")
    t = np.array([s[0] for s in samples])
    r = np.array([s[1] for s in samples]) / 1024
    return float(np.polyfit(t, r, 1)[0] * 60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--warmup", type=float, help="seconds (default: max(30, seconds / 3))")
    parser.add_argument("--max-growth-mib", type=float, default=8.0)
    parser.add_argument("--json", type=Path, help="write the summary here too")
    default_bin = Path(os.environ.get("ATTNSERVE_BIN", DEFAULT_BIN))
    parser.add_argument("--bin", type=Path, default=default_bin, help="server binary")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else max(30.0, args.seconds / 3)
    if not args.bin.is_file():
        print(f"no server binary at {args.bin}: build it or set ATTNSERVE_BIN", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="attn-soak-"))
    process, address = start_server(args.bin, workdir)
    failures: list[str] = []
    try:
        with Client(address) as probe:
            pools = {p.name: p for p in probe.server_info().pools}
        touch_pools(address, pools)
        rss_start = rss_kib(process.pid)

        stats, stop = Stats(), threading.Event()
        workers = [Worker(i, address, pools, stats, stop) for i in range(args.clients)]
        errors_in_threads: list[str] = []

        def guarded(fn):
            def run():
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - reported as a failure below
                    errors_in_threads.append(f"{threading.current_thread().name}: {e!r}")

            return run

        threads = [
            threading.Thread(target=guarded(w.run), name=f"client{i}")
            for i, w in enumerate(workers)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        samples: list[tuple[float, int]] = []
        while (elapsed := time.monotonic() - t0) < args.seconds:
            if process.poll() is not None:
                failures.append(f"the server exited with {process.returncode} during the run")
                break
            samples.append((elapsed, rss_kib(process.pid)))
            time.sleep(max(0.0, len(samples) - (time.monotonic() - t0)))
        stop.set()
        run_s = time.monotonic() - t0
        for t in threads:
            t.join(timeout=120)
        failures += [f"client thread failed: {e}" for e in errors_in_threads]

        # Pages: abandoned sessions expire after their lease; then every pool must be free.
        leaked: dict[str, int] = {}
        deadline = time.monotonic() + ABANDONED_LEASE_S + 30
        with Client(address) as probe:
            while True:
                leaked = {p.name: p.total_pages - p.free_pages for p in probe.server_info().pools}
                if not any(leaked.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        if any(leaked.values()):
            failures.append(f"pages still allocated after every session ended: {leaked}")

        measured = [s for s in samples if s[0] >= warmup]
        middle = warmup + (run_s - warmup) / 2
        first = [s for s in measured if s[0] < middle]
        second = [s for s in measured if s[0] >= middle]
        growth = median_mib(second) - median_mib(first)
        if not growth <= args.max_growth_mib:
            failures.append(
                f"RSS grew {growth:.1f} MiB from the first half after warm-up to the second "
                f"(limit {args.max_growth_mib} MiB)"
            )
        if stats.unexpected:
            failures.append(f"unexpected errors: {stats.unexpected[:5]}")
        summary = {
            "seconds": round(time.monotonic() - t0, 1),
            "clients": args.clients,
            "calls": dict(stats.calls),
            "calls_total": sum(stats.calls.values()),
            "calls_per_s": round(sum(stats.calls.values()) / max(1.0, run_s), 1),
            "errors": dict(stats.errors),
            "episodes": dict(stats.episodes),
            "rss_mib": {
                "after_pool_touch": round(rss_start / 1024, 1),
                "first_sample": round(samples[0][1] / 1024, 1) if samples else None,
                "peak": round(max(s[1] for s in samples) / 1024, 1) if samples else None,
                "end": round(samples[-1][1] / 1024, 1) if samples else None,
                "warmup_s": round(warmup, 1),
                "median_first_half": round(median_mib(first), 1),
                "median_second_half": round(median_mib(second), 1),
                "growth": round(growth, 2),
                "slope_after_warmup_mib_per_min": round(slope_mib_per_min(measured), 3),
                "samples": [round(s[1] / 1024, 1) for s in samples],
            },
            "leaked_pages": leaked,
            "failures": failures,
        }
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            code = "killed after 60 s"
    if code != 0:
        failures.append(f"server exit status {code} after SIGTERM (log: {workdir / 'server.log'})")
        summary["failures"] = failures

    rss = summary["rss_mib"]
    print(
        f"soak: {summary['seconds']} s, {args.clients} clients, {summary['calls_total']} calls "
        f"({summary['calls_per_s']}/s): {summary['calls']}"
    )
    print(f"soak: episodes {summary['episodes']}")
    print(f"soak: errors by code {summary['errors'] or 'none'}")
    print(
        f"soak: RSS MiB after pool touch {rss['after_pool_touch']}, first {rss['first_sample']}, "
        f"peak {rss['peak']}, end {rss['end']}; after the {rss['warmup_s']} s warm-up: median "
        f"{rss['median_first_half']} then {rss['median_second_half']} (growth {rss['growth']}, "
        f"limit {args.max_growth_mib}), slope {rss['slope_after_warmup_mib_per_min']} MiB/min"
    )
    print(f"soak: RSS samples (MiB, 1/s): {' '.join(str(s) for s in rss['samples'])}")
    print(f"soak: pages allocated at the end: {summary['leaked_pages']}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if failures:
        for f in failures:
            print(f"soak: FAIL: {f}", file=sys.stderr)
        return 1
    print("soak: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
