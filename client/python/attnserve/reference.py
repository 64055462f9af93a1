"""numpy (float64) reference of the attention contract (docs: "Attention semantics").

A client keeps its own copy of the K/V it appended (CacheMirror, keyed by layer and page id) and
recomputes every result from it over the same CSR page table the server got:
- row r of sequence b appends the token at position kv_len[b] - q_len[b] + (r - qo_indptr[b]);
- bottom-right aligned causal mask: row i sees key j iff j <= i + kv_len - q_len;
- natural-exp softmax; lse is the base-2 log-sum-exp of the scaled logits;
- a row that sees no key has output 0 and lse EMPTY_ROW_LSE.
Inputs should already be bf16-rounded (tensors.bf16_round) so both sides see the same values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from attnserve.pages import BatchCsr
from attnserve.v1 import attention_pb2 as pb

EMPTY_ROW_LSE = -1.0e30
MLA_CKV_DIM = 512
MLA_KPE_DIM = 64
ATOL = 1e-2
RTOL = 1e-2


class CacheMirror:
    """Client-side copy of the tokens written into one pool, per layer and page.

    Each token holds named fields (GQA: "k", "v" of [num_kv_heads, head_dim]; MLA: "ckv" [512],
    "kpe" [64]). Slots never written read as NaN, so a reference that uses them shows it.
    """

    def __init__(self, num_layers: int, page_size: int, fields: Mapping[str, tuple[int, ...]]):
        self.num_layers = num_layers
        self.page_size = page_size
        self.fields = dict(fields)
        self._pages: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    @classmethod
    def for_pool(cls, pool: pb.PoolInfo) -> CacheMirror:
        """A mirror with the fields of the pool's kind."""
        if pool.kind == pb.POOL_KIND_GQA:
            kv = (pool.num_kv_heads, pool.head_dim)
            return cls(pool.num_layers, pool.page_size, {"k": kv, "v": kv})
        if pool.kind == pb.POOL_KIND_MLA:
            fields = {"ckv": (MLA_CKV_DIM,), "kpe": (MLA_KPE_DIM,)}
            return cls(pool.num_layers, pool.page_size, fields)
        raise ValueError(f"unknown pool kind {pool.kind}")

    def append(self, layer: int, table: BatchCsr, rows: Mapping[str, np.ndarray]) -> None:
        """Writes one new token per query row of the table (the table after the append)."""
        self._check_layer(layer)
        if set(rows) != set(self.fields):
            raise ValueError(f"append needs fields {sorted(self.fields)}, got {sorted(rows)}")
        kv_lens = table.kv_lens(self.page_size)
        for b in range(table.batch_size):
            q_begin, q_end = int(table.qo_indptr[b]), int(table.qo_indptr[b + 1])
            first_pos = int(kv_lens[b]) - (q_end - q_begin)
            if first_pos < 0:
                raise ValueError(f"sequence {b}: q_len {q_end - q_begin} > kv_len {kv_lens[b]}")
            pages = table.kv_indices[table.kv_indptr[b] : table.kv_indptr[b + 1]]
            for r in range(q_begin, q_end):
                page, slot = divmod(first_pos + r - q_begin, self.page_size)
                stored = self._page(layer, int(pages[page]))
                for name, values in rows.items():
                    stored[name][slot] = values[r]

    def gather(self, layer: int, table: BatchCsr, seq: int) -> dict[str, np.ndarray]:
        """The tokens of sequence seq in order: field -> [kv_len, *field_shape] float64."""
        self._check_layer(layer)
        kv_len = int(table.kv_lens(self.page_size)[seq])
        pages = table.kv_indices[table.kv_indptr[seq] : table.kv_indptr[seq + 1]]
        out = {}
        for name, shape in self.fields.items():
            blocks = [self._page(layer, int(p))[name] for p in pages]
            stacked = np.concatenate(blocks) if blocks else np.zeros((0, *shape))
            out[name] = stacked[:kv_len].astype(np.float64)
        return out

    def _page(self, layer: int, page: int) -> dict[str, np.ndarray]:
        key = (layer, page)
        if key not in self._pages:
            self._pages[key] = {
                name: np.full((self.page_size, *shape), np.nan, dtype=np.float32)
                for name, shape in self.fields.items()
            }
        return self._pages[key]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")


def attend(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, sm_scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of one sequence in float64.

    q [q_len, H, Dk], keys [kv_len, H_kv, Dk], values [kv_len, H_kv, Dv]; query head h uses kv
    head h // (H / H_kv). Returns output [q_len, H, Dv] and base-2 lse [q_len, H]. (A decode row,
    q_len 1, sees every key under the bottom-right mask.)
    """
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = keys.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    kv_head = np.arange(num_heads) // (num_heads // num_kv_heads)
    k = keys.astype(np.float64)[:, kv_head]
    v = values.astype(np.float64)[:, kv_head]
    logits = sm_scale * np.einsum("ihd,jhd->ihj", q.astype(np.float64), k)
    visible = causal_mask(q_len, kv_len)[:, None, :]  # [q_len, 1, kv_len]
    has_key = visible.any(axis=-1)  # [q_len, 1]
    logits = np.where(visible, logits, -np.inf)
    row_max = np.where(has_key, logits.max(axis=-1, initial=-np.inf), 0.0)
    p = np.where(visible, np.exp(logits - row_max[..., None]), 0.0)
    denom = np.where(has_key, p.sum(axis=-1), 1.0)
    out = np.einsum("ihj,jhd->ihd", p, v) / denom[..., None]
    lse = np.where(has_key, (row_max + np.log(denom)) / math.log(2.0), EMPTY_ROW_LSE)
    return out, lse


def causal_mask(q_len: int, kv_len: int) -> np.ndarray:
    """[q_len, kv_len] bool, bottom-right aligned: row i sees key j iff j <= i + kv_len - q_len."""
    return np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)


def gqa_reference(
    mirror: CacheMirror,
    layer: int,
    table: BatchCsr,
    q: np.ndarray,
    sm_scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """GQA output [total_q, H, D] and lse [total_q, H]; sm_scale defaults to 1/sqrt(D)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale

    def one(b: int, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        kv = mirror.gather(layer, table, b)
        return attend(q[rows], kv["k"], kv["v"], scale)

    return _per_sequence(table, q.shape[0], q.shape[1], q.shape[2], one)


def mla_reference(
    mirror: CacheMirror,
    layer: int,
    table: BatchCsr,
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    sm_scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """MLA (absorbed) output [total_q, H, 512] and lse [total_q, H]."""
    q = np.concatenate([q_nope, q_pe], axis=-1)

    def one(b: int, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        kv = mirror.gather(layer, table, b)
        keys = np.concatenate([kv["ckv"], kv["kpe"]], axis=-1)[:, None, :]
        return attend(q[rows], keys, kv["ckv"][:, None, :], sm_scale)

    return _per_sequence(table, q.shape[0], q.shape[1], MLA_CKV_DIM, one)


class CloseResult(NamedTuple):
    """Outcome of check_close: the largest |x - ref| and the elements that failed."""

    max_abs_err: float
    num_failed: int
    num_elements: int

    @property
    def ok(self) -> bool:
        return self.num_failed == 0


def check_close(
    x: np.ndarray, ref: np.ndarray, atol: float = ATOL, rtol: float = RTOL
) -> CloseResult:
    """The contract's tolerance rule, element by element.

    An element fails only if |x - ref| > atol AND |x - ref| / (|ref| + 1e-8) > rtol; a NaN or an
    infinity in x always fails (max_abs_err is then nan or inf). Shapes must match exactly.
    """
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape} != reference shape {ref.shape}")
    err = np.abs(x - ref)
    passed = (err <= atol) | (err / (np.abs(ref) + 1e-8) <= rtol)
    max_err = float(np.max(err, initial=0.0))  # nan propagates
    return CloseResult(max_err, int(np.count_nonzero(~passed)), int(x.size))


def _per_sequence(
    table: BatchCsr,
    total_q: int,
    num_heads: int,
    out_dim: int,
    attend_seq: Callable[[int, slice], tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    """Runs attend_seq(b, query_rows_of_b) for every sequence b and assembles the batch result."""
    out = np.zeros((total_q, num_heads, out_dim))
    lse = np.full((total_q, num_heads), EMPTY_ROW_LSE)
    for b in range(table.batch_size):
        rows = slice(int(table.qo_indptr[b]), int(table.qo_indptr[b + 1]))
        out[rows], lse[rows] = attend_seq(b, rows)
    return out, lse
