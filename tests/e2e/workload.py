"""A pool under test: pages, a local mirror of the cache, random tokens and checked calls."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from attnserve import AttentionResult, BatchCsr, Client, PageTable
from attnserve.reference import (
    MLA_CKV_DIM,
    MLA_KPE_DIM,
    CacheMirror,
    check_close,
    gqa_reference,
    mla_reference,
)
from attnserve.tensors import bf16_to_float, float_to_bf16
from attnserve.v1 import attention_pb2 as pb

# DeepSeek-V3's softmax scale: MLA calls always carry one.
MLA_SM_SCALE = 0.1352337747812271

TableEdit = Callable[[BatchCsr], BatchCsr]


class PoolSession:
    """Drives one pool through a client and checks every result against the numpy reference.

    Tokens are random bf16 values. The session keeps its own copy of every K/V it appended, so
    each output and lse is recomputed locally over the same page table. Growing a sequence
    (grow) is separate from the calls, because one chunk is appended once per layer. Not
    thread-safe: use one session per thread (sessions never share pages).
    """

    def __init__(self, client: Client, pool: pb.PoolInfo, seed: int = 0) -> None:
        self.client = client
        self.pool = pool
        self.is_mla = pool.kind == pb.POOL_KIND_MLA
        self.table = PageTable(client, pool.name, pool.page_size)
        self.mirror = CacheMirror.for_pool(pool)
        self.rng = np.random.default_rng(seed)
        # What calls send when the caller gives no sm_scale: none for GQA (server default).
        self.default_scale = MLA_SM_SCALE if self.is_mla else None

    def close(self) -> None:
        """Frees every page the session holds."""
        self.table.free_all()

    def grow(self, seq_ids: Sequence[Hashable], q_lens: Sequence[int]) -> None:
        """Reserves q_lens new tokens per sequence (pages allocated as needed)."""
        for s, n in zip(seq_ids, q_lens, strict=True):
            self.table.reserve(s, n)

    def chunk(self, seq_ids: Sequence[Hashable], q_lens: Sequence[int]) -> None:
        """Grows the sequences and prefills the new tokens on every layer, all checked."""
        self.grow(seq_ids, q_lens)
        for layer in range(self.pool.num_layers):
            self.prefill(seq_ids, q_lens, layer=layer)

    def decode_step(self, seq_ids: Sequence[Hashable]) -> None:
        """One new token per sequence, decoded on every layer, all checked."""
        self.grow(seq_ids, [1] * len(seq_ids))
        for layer in range(self.pool.num_layers):
            self.decode(seq_ids, layer=layer)

    def prefill(
        self,
        seq_ids: Sequence[Hashable],
        q_lens: Sequence[int],
        *,
        layer: int = 0,
        new_kv: bool = True,
        return_lse: bool = True,
        sm_scale: float | None = None,
        edit_table: TableEdit | None = None,
    ) -> AttentionResult:
        """One checked Prefill over the current table. new_kv sends the K/V of each sequence's
        last q_len tokens (grown beforehand); without it the call only reads the pages."""
        table = self.table.csr(seq_ids, q_lens)
        return self._run("prefill", layer, table, new_kv, return_lse, sm_scale, edit_table)

    def decode(
        self,
        seq_ids: Sequence[Hashable],
        *,
        layer: int = 0,
        new_kv: bool = True,
        return_lse: bool = True,
        sm_scale: float | None = None,
        edit_table: TableEdit | None = None,
    ) -> AttentionResult:
        """One checked Decode over the current table (one query per sequence)."""
        table = self.table.csr(seq_ids)
        return self._run("decode", layer, table, new_kv, return_lse, sm_scale, edit_table)

    def tokens(self, n: int) -> dict[str, np.ndarray]:
        """bf16 bits of random queries and new K/V for n tokens, keyed by call argument."""
        p, h = self.pool, self.pool.num_qo_heads
        if self.is_mla:
            shapes = {
                "q": (n, h, MLA_CKV_DIM),
                "q_pe": (n, h, MLA_KPE_DIM),
                "ckv_new": (n, MLA_CKV_DIM),
                "kpe_new": (n, MLA_KPE_DIM),
            }
        else:
            kv = (n, p.num_kv_heads, p.head_dim)
            shapes = {"q": (n, h, p.head_dim), "k_new": kv, "v_new": kv}
        return {
            name: float_to_bf16(self.rng.standard_normal(shape, dtype=np.float32))
            for name, shape in shapes.items()
        }

    def expected(
        self, layer: int, table: BatchCsr, values: dict[str, np.ndarray], sm_scale: float | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Reference output and lse of a call with these inputs over the mirror."""
        if self.is_mla:
            return mla_reference(self.mirror, layer, table, values["q"], values["q_pe"], sm_scale)
        return gqa_reference(self.mirror, layer, table, values["q"], sm_scale)

    def _run(
        self,
        op: str,
        layer: int,
        table: BatchCsr,
        new_kv: bool,
        return_lse: bool,
        sm_scale: float | None,
        edit_table: TableEdit | None,
    ) -> AttentionResult:
        if edit_table is not None:
            table = edit_table(table)
        scale = self.default_scale if sm_scale is None else sm_scale
        bits = self.tokens(int(table.qo_indptr[-1]))
        if not new_kv:
            bits = {k: v for k, v in bits.items() if not k.endswith("_new")}
        call = self.client.prefill if op == "prefill" else self.client.decode
        result = call(
            layer, table=table, pool=self.pool.name, sm_scale=scale, return_lse=return_lse, **bits
        )
        self.check(layer, table, bits, result, scale, return_lse=return_lse)
        return result

    def check(
        self,
        layer: int,
        table: BatchCsr,
        bits: dict[str, np.ndarray],
        result: AttentionResult,
        sm_scale: float | None,
        *,
        return_lse: bool = True,
    ) -> None:
        """Appends a call's new K/V (the *_new entries of its inputs `bits`) to the mirror, then
        checks its result against the reference over the mirror."""
        values = {k: bf16_to_float(v) for k, v in bits.items()}
        rows = {k.removesuffix("_new"): v for k, v in values.items() if k.endswith("_new")}
        if rows:
            self.mirror.append(layer, table, rows)
        out, lse = self.expected(layer, table, values, sm_scale)
        check_result(result, out, lse if return_lse else None)


def check_result(result: AttentionResult, out: np.ndarray, lse: np.ndarray | None) -> None:
    """Asserts shapes, finiteness and the tolerance rule for output (and lse when expected)."""
    assert result.output.shape == out.shape, f"output shape {result.output.shape} != {out.shape}"
    assert np.isfinite(result.output).all(), "output has inf/NaN"
    verdict = check_close(result.output, out)
    assert verdict.ok, f"output out of tolerance: {verdict}"
    if lse is None:
        assert result.lse is None, "lse returned without return_lse"
        return
    assert result.lse is not None, "no lse with return_lse"
    assert result.lse.shape == lse.shape, f"lse shape {result.lse.shape} != {lse.shape}"
    assert np.isfinite(result.lse).all(), "lse has inf/NaN"
    verdict = check_close(result.lse, lse)
    assert verdict.ok, f"lse out of tolerance: {verdict}"
