#!/usr/bin/env python3
"""A toy scheduler driving attnserve the way an inference engine would, checking every result.

It learns the pool's geometry from GetServerInfo, allocates pages for a few sequences of
different prompt lengths, prefills all prompts over every layer in chunks (each Prefill call
batches the next chunk of every unfinished sequence and appends that chunk's K/V, so later chunks
attend to earlier ones), runs decode steps over all layers for all sequences together, frees the
pages, and compares every output and lse with the numpy reference (attnserve.reference).

Exit status: 0 when every element is within tolerance and no page leaked, 1 otherwise, 2 when a
call failed. (The leak check compares the pool's free pages before and after, so run it alone on
its pool.)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from attnserve import AttentionResult, AttnError, BatchCsr, Client, PageTable, Timings
from attnserve.reference import (
    MLA_CKV_DIM,
    MLA_KPE_DIM,
    CacheMirror,
    CloseResult,
    check_close,
    gqa_reference,
    mla_reference,
)
from attnserve.tensors import bf16_to_float, float_to_bf16
from attnserve.transport import TRANSPORTS, StagedPageTable
from attnserve.v1 import attention_pb2 as pb

# DeepSeek-V3's softmax scale; MLA calls must always send one.
MLA_SM_SCALE = 0.1352337747812271


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="server host:port")
    parser.add_argument("--pool", default="", help="pool name ('' = the server's only pool)")
    parser.add_argument("--sequences", type=at_least(1), default=3, help="number of sequences")
    parser.add_argument(
        "--prompt-len",
        type=at_least(1),
        default=200,
        help="longest prompt; prompt lengths are drawn from [prompt_len/4, prompt_len]",
    )
    parser.add_argument("--chunk", type=at_least(1), default=64, help="prefill chunk (tokens)")
    parser.add_argument("--decode-steps", type=at_least(0), default=8, help="decode steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="how tensors reach the server: auto (shared memory / CUDA IPC on this node when the "
        "server allows it), bytes, shm, or cuda (torch CUDA tensors through CUDA IPC)",
    )
    return parser.parse_args(argv)


def at_least(lowest: int) -> Callable[[str], int]:
    """argparse type: an integer >= lowest."""

    def parse(text: str) -> int:
        value = int(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        return value

    return parse


@dataclass
class Stats:
    """What the run measured: latencies, server timings, error checks and counts."""

    client_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    server: dict[str, list[Timings]] = field(default_factory=lambda: defaultdict(list))
    checks: dict[str, list[CloseResult]] = field(default_factory=lambda: defaultdict(list))
    prefill_chunks: int = 0
    peak_pages: int = 0

    def record(self, op: str, seconds: float, result: AttentionResult) -> None:
        self.client_s[op].append(seconds)
        self.server[op].append(result.timings)

    def check(self, name: str, outcome: CloseResult) -> None:
        self.checks[name].append(outcome)

    def passed(self) -> bool:
        return all(c.ok for outcomes in self.checks.values() for c in outcomes)


class Scheduler:
    """Drives one pool: random tokens in, attention out, each call checked against numpy."""

    def __init__(self, client: Client, pool: pb.PoolInfo, rng: np.random.Generator) -> None:
        self.client = client
        self.pool = pool
        self.rng = rng
        self.table = PageTable(client, pool.name, pool.page_size)
        self.mirror = CacheMirror.for_pool(pool)
        self.stats = Stats()
        self.is_mla = pool.kind == pb.POOL_KIND_MLA

    def prefill(self, prompt_lens: dict[int, int], chunk: int) -> None:
        """Chunked prefill: each round takes the next chunk of every unfinished prompt."""
        remaining = dict(prompt_lens)
        while any(remaining.values()):
            seqs = [s for s, n in remaining.items() if n > 0]
            q_lens = [min(chunk, remaining[s]) for s in seqs]
            for s, n in zip(seqs, q_lens, strict=True):
                self.table.reserve(s, n)
                remaining[s] -= n
            self._all_layers("prefill", self.table.csr(seqs, q_lens))
            self.stats.prefill_chunks += 1
        self.stats.peak_pages = self.table.num_pages()

    def decode(self, seqs: list[int], steps: int) -> None:
        """Decode steps: one new token per sequence per step, all sequences batched."""
        for _ in range(steps):
            for s in seqs:
                self.table.reserve(s, 1)
            self._all_layers("decode", self.table.csr(seqs))
        self.stats.peak_pages = self.table.num_pages()

    def _all_layers(self, op: str, table: BatchCsr) -> None:
        # One page table per step: in shared memory it is written once for all layers.
        with self.client.stage_page_table(table) as staged:
            for layer in range(self.pool.num_layers):
                self._step(op, layer, table, staged)

    def _step(self, op: str, layer: int, table: BatchCsr, staged: StagedPageTable) -> None:
        total_q = int(table.qo_indptr[-1])
        bits = self._random_tokens(total_q)
        values = {name: bf16_to_float(b) for name, b in bits.items()}
        call = self.client.prefill if op == "prefill" else self.client.decode
        sm_scale = MLA_SM_SCALE if self.is_mla else None
        inputs = {name: self._on_device(b) for name, b in bits.items()}
        start = time.perf_counter()
        result = call(
            layer, table=staged, pool=self.pool.name, sm_scale=sm_scale, return_lse=True, **inputs
        )
        self.stats.record(op, time.perf_counter() - start, result)

        new_kv = {k.removesuffix("_new"): v for k, v in values.items() if k.endswith("_new")}
        self.mirror.append(layer, table, new_kv)
        if self.is_mla:
            q, q_pe = values["q"], values["q_pe"]
            out, lse = mla_reference(self.mirror, layer, table, q, q_pe, MLA_SM_SCALE)
        else:
            out, lse = gqa_reference(self.mirror, layer, table, values["q"])
        self.stats.check("output", check_close(result.output, out))
        self.stats.check("lse", check_close(result.lse, lse))

    def _on_device(self, bits: np.ndarray) -> object:
        """The tensor as the model would hand it over: a torch CUDA tensor for --transport=cuda
        (staged through CUDA IPC), else the numpy bf16 bits."""
        if self.client.transport.transport != "cuda":
            return bits
        import torch

        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).cuda()

    def _random_tokens(self, n: int) -> dict[str, np.ndarray]:
        """bf16 bits of random q (and q_pe) and new K/V for n tokens, keyed by call argument."""
        h = self.pool.num_qo_heads
        if self.is_mla:
            shapes = {
                "q": (n, h, MLA_CKV_DIM),
                "q_pe": (n, h, MLA_KPE_DIM),
                "ckv_new": (n, MLA_CKV_DIM),
                "kpe_new": (n, MLA_KPE_DIM),
            }
        else:
            kv = (n, self.pool.num_kv_heads, self.pool.head_dim)
            shapes = {"q": (n, h, self.pool.head_dim), "k_new": kv, "v_new": kv}
        return {
            name: float_to_bf16(self.rng.standard_normal(shape, dtype=np.float32))
            for name, shape in shapes.items()
        }


def describe_pool(pool: pb.PoolInfo) -> str:
    kind = pb.PoolKind.Name(pool.kind).removeprefix("POOL_KIND_")
    if pool.kind == pb.POOL_KIND_MLA:
        heads = f"{pool.num_qo_heads} heads, ckv {pool.ckv_dim} + kpe {pool.kpe_dim}"
    else:
        heads = f"{pool.num_qo_heads}/{pool.num_kv_heads} heads, head_dim {pool.head_dim}"
    return (
        f"{pool.name!r}: {kind}, {pool.num_layers} layers, page_size {pool.page_size}, "
        f"{heads}, {pool.total_pages} pages"
    )


def p50_p99_ms(seconds: list[float]) -> str:
    p50, p99 = np.percentile(seconds, [50, 99]) * 1e3
    return f"{p50:8.3f} / {p99:8.3f}"


def latency_lines(stats: Stats) -> list[str]:
    """p50 / p99 per op: client round trip and the server's queue / compute / total."""
    columns = ("client", "server queue", "server compute", "server total")
    lines = ["latency  ms, p50 / p99     " + "".join(f"{c:<21}" for c in columns).rstrip()]
    for op in ("prefill", "decode"):
        server = stats.server[op]
        if not server:
            continue
        series = [stats.client_s[op]] + [
            [getattr(t, field) * 1e-6 for t in server]
            for field in ("queue_us", "compute_us", "total_us")
        ]
        label = f"{op} ({len(server)} calls)"
        row = f"         {label:<18}" + "".join(f"{p50_p99_ms(s):<21}" for s in series)
        lines.append(row.rstrip())
    return lines


def check_lines(stats: Stats) -> list[str]:
    """One line per checked tensor: worst error and elements outside the tolerance rule."""
    lines = []
    for name, outcomes in stats.checks.items():
        failed = sum(c.num_failed for c in outcomes)
        total = sum(c.num_elements for c in outcomes)
        worst = max(c.max_abs_err for c in outcomes)
        verdict = "PASS" if failed == 0 else "FAIL"
        lines.append(
            f"{name + ':':<7} max abs err {worst:.2e}, {failed} of {total} elements outside "
            f"tolerance -> {verdict}"
        )
    return lines


def run(args: argparse.Namespace, client: Client) -> int:
    """Runs the workload and prints the summary; returns the exit status."""
    info = client.server_info()
    pool = client.pool_info(args.pool)
    rng = np.random.default_rng(args.seed)
    lo = max(1, args.prompt_len // 4)
    prompt_lens = {s: int(rng.integers(lo, args.prompt_len + 1)) for s in range(args.sequences)}
    print(
        f"server   {client.address}: attnserve {info.version}, backend {info.backend}, "
        f"device {info.device}"
    )
    print(f"pool     {describe_pool(pool)}")
    print(
        f"workload {args.sequences} sequences, prompts {list(prompt_lens.values())} "
        f"({sum(prompt_lens.values())} tokens), chunk {args.chunk}, "
        f"{args.decode_steps} decode steps"
    )

    free_before = pool.free_pages
    scheduler = Scheduler(client, pool, rng)
    try:
        scheduler.prefill(prompt_lens, args.chunk)
        scheduler.decode(list(prompt_lens), args.decode_steps)
    finally:
        scheduler.table.free_all()
    free_after = client.pool_info(pool.name).free_pages
    stats = scheduler.stats
    leaked = free_after != free_before

    print(
        f"pages    {stats.peak_pages} allocated; free {free_before} before, {free_after} "
        f"after -> {'LEAK' if leaked else 'OK'}"
    )
    print(
        f"calls    prefill {len(stats.server['prefill'])} ({stats.prefill_chunks} chunked "
        f"rounds x {pool.num_layers} layers), decode {len(stats.server['decode'])} "
        f"({args.decode_steps} steps x {pool.num_layers} layers)"
    )
    kinds = client.transport.kinds  # chosen on the first call
    used = [name for name, on in (("shared memory", kinds.shm), ("CUDA IPC", kinds.cuda)) if on]
    print(f"transport {args.transport}: {' + '.join(used) or 'bytes in the messages'}")
    print("check    tolerance: fails only if |x-ref| > 1e-2 and |x-ref|/|ref| > 1e-2")
    for line in check_lines(stats):
        print(f"         {line}")
    for line in latency_lines(stats):
        print(line)
    ok = stats.passed() and not leaked
    print(f"RESULT: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with Client(args.address, transport=args.transport) as client:
        try:
            return run(args, client)
        except AttnError as e:
            print(f"call failed: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
