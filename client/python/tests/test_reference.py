"""The numpy reference against hand-computed cases and a naive per-element loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnserve.pages import BatchCsr
from attnserve.reference import (
    EMPTY_ROW_LSE,
    CacheMirror,
    attend,
    causal_mask,
    check_close,
    gqa_reference,
    mla_reference,
)


def csr(qo, kv_indptr, kv_indices, last) -> BatchCsr:
    return BatchCsr(*(np.asarray(a, dtype=np.int32) for a in (qo, kv_indptr, kv_indices, last)))


def naive_attend(q, k, v, scale):
    """Row by row, head by head, with math.exp: the contract spelled out."""
    q_len, heads, _ = q.shape
    kv_len, kv_heads, dv = v.shape
    out = np.zeros((q_len, heads, dv))
    lse = np.full((q_len, heads), EMPTY_ROW_LSE)
    for i in range(q_len):
        visible = [j for j in range(kv_len) if j <= i + kv_len - q_len]
        for h in range(heads):
            if not visible:
                continue
            kvh = h // (heads // kv_heads)
            logits = [scale * float(np.dot(q[i, h], k[j, kvh])) for j in visible]
            m = max(logits)
            weights = [math.exp(x - m) for x in logits]
            total = sum(weights)
            out[i, h] = sum(w * v[j, kvh] for w, j in zip(weights, visible, strict=True)) / total
            lse[i, h] = math.log2(sum(math.exp(x) for x in logits))
    return out, lse


def test_single_key_returns_its_value() -> None:
    q = np.array([[[1.0, 2.0]]])
    k = np.array([[[0.5, 0.25]]])
    v = np.array([[[3.0, -4.0]]])
    out, lse = attend(q, k, v, sm_scale=2.0)
    np.testing.assert_allclose(out, v)
    np.testing.assert_allclose(lse, [[2.0 * 1.0 / math.log(2.0)]])  # logit 2*(0.5+0.5)=2


def test_two_keys_hand_computed() -> None:
    q = np.array([[[1.0, 0.0]]])
    k = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    v = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    out, lse = attend(q, k, v, sm_scale=1.0)
    e = math.e
    np.testing.assert_allclose(out[0, 0], [e / (e + 1), 1 / (e + 1)])
    np.testing.assert_allclose(lse[0, 0], math.log2(e + 1))


def test_causal_mask_is_bottom_right_aligned() -> None:
    np.testing.assert_array_equal(causal_mask(2, 3), [[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(causal_mask(3, 1), [[0], [0], [1]])
    assert causal_mask(1, 5).all()  # a decode row sees everything
    assert causal_mask(2, 0).shape == (2, 0)


def test_rows_without_keys_get_zero_and_empty_lse() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 2, 4))
    k = rng.standard_normal((1, 1, 4))
    out, lse = attend(q, k, k, sm_scale=0.5)
    assert (out[:2] == 0).all() and (lse[:2] == EMPTY_ROW_LSE).all()
    np.testing.assert_allclose(out[2], np.broadcast_to(k[0], (2, 4)))
    out, lse = attend(q, np.zeros((0, 1, 4)), np.zeros((0, 1, 4)), sm_scale=0.5)
    assert (out == 0).all() and (lse == EMPTY_ROW_LSE).all()
    assert np.isfinite(lse).all()


def test_query_head_uses_kv_head_h_div_group() -> None:
    # 6 query heads over 2 kv heads (group 3); each kv head's values are constant.
    q = np.zeros((1, 6, 2))
    k = np.zeros((4, 2, 2))
    v = np.zeros((4, 2, 1))
    v[:, 1] = 7.0
    out, _ = attend(q, k, v, sm_scale=1.0)
    np.testing.assert_array_equal(out[0, :, 0], [0, 0, 0, 7, 7, 7])


@pytest.mark.parametrize(
    ("q_len", "kv_len", "heads", "kv_heads"), [(5, 9, 6, 2), (7, 3, 5, 1), (1, 4, 4, 4)]
)
def test_attend_matches_naive_loop(q_len: int, kv_len: int, heads: int, kv_heads: int) -> None:
    rng = np.random.default_rng(q_len * 100 + kv_len)
    q = rng.standard_normal((q_len, heads, 8))
    k = rng.standard_normal((kv_len, kv_heads, 8))
    v = rng.standard_normal((kv_len, kv_heads, 3))
    out, lse = attend(q, k, v, sm_scale=0.3)
    ref_out, ref_lse = naive_attend(q, k, v, 0.3)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


def test_mirror_appends_at_the_last_q_len_positions() -> None:
    mirror = CacheMirror(num_layers=2, page_size=4, fields={"k": (1, 1), "v": (1, 1)})
    first = csr([0, 4], [0, 1], [7], [4])  # 4 tokens into page 7
    rows = np.arange(4, dtype=np.float32).reshape(4, 1, 1)
    mirror.append(1, first, {"k": rows, "v": -rows})
    second = csr([0, 2], [0, 2], [7, 3], [2])  # 2 more tokens: page 3, slots 0 and 1
    more = np.array([10.0, 11.0], dtype=np.float32).reshape(2, 1, 1)
    mirror.append(1, second, {"k": more, "v": -more})
    tokens = mirror.gather(1, second, 0)
    np.testing.assert_array_equal(tokens["k"].ravel(), [0, 1, 2, 3, 10, 11])
    np.testing.assert_array_equal(tokens["v"].ravel(), [0, -1, -2, -3, -10, -11])
    assert np.isnan(mirror.gather(0, second, 0)["k"]).all()  # layer 0 never written


def test_mirror_rejects_bad_appends() -> None:
    mirror = CacheMirror(num_layers=1, page_size=4, fields={"k": (1,), "v": (1,)})
    table = csr([0, 3], [0, 1], [0], [2])  # 3 new rows, but the table holds 2 tokens
    rows = np.zeros((3, 1), np.float32)
    with pytest.raises(ValueError, match="q_len 3 > kv_len 2"):
        mirror.append(0, table, {"k": rows, "v": rows})
    with pytest.raises(ValueError, match="layer"):
        mirror.append(1, table, {"k": rows, "v": rows})
    with pytest.raises(ValueError, match="fields"):
        mirror.append(0, table, {"k": rows})


def test_gqa_reference_over_pages_matches_naive() -> None:
    rng = np.random.default_rng(3)
    mirror = CacheMirror(num_layers=1, page_size=3, fields={"k": (2, 8), "v": (2, 8)})
    # Sequence 0: 7 tokens on pages [5, 1, 4]; sequence 1: empty; sequence 2: 2 tokens on [0].
    table = csr([0, 7, 9, 11], [0, 3, 3, 4], [5, 1, 4, 0], [1, 2, 2])
    k_new = rng.standard_normal((11, 2, 8)).astype(np.float32)
    v_new = rng.standard_normal((11, 2, 8)).astype(np.float32)
    no_rows = csr([0, 7, 7, 9], table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    mirror.append(0, no_rows, {"k": k_new[np.r_[0:7, 9:11]], "v": v_new[np.r_[0:7, 9:11]]})
    q = rng.standard_normal((11, 6, 8))
    out, lse = gqa_reference(mirror, 0, table, q)
    scale = 1 / math.sqrt(8)
    ref0 = naive_attend(q[0:7], k_new[0:7], v_new[0:7], scale)
    ref2 = naive_attend(q[9:11], k_new[9:11], v_new[9:11], scale)
    np.testing.assert_allclose(out[0:7], ref0[0], atol=1e-6)
    np.testing.assert_allclose(lse[0:7], ref0[1], rtol=1e-6)
    assert (out[7:9] == 0).all() and (lse[7:9] == EMPTY_ROW_LSE).all()  # empty sequence
    np.testing.assert_allclose(out[9:11], ref2[0], atol=1e-6)
    out_scaled, _ = gqa_reference(mirror, 0, table, q, sm_scale=0.01)
    assert not np.allclose(out_scaled, out)


def test_mla_reference_matches_direct_formula() -> None:
    rng = np.random.default_rng(4)
    mirror = CacheMirror(num_layers=1, page_size=2, fields={"ckv": (512,), "kpe": (64,)})
    table = csr([0, 3], [0, 2], [1, 0], [1])  # 3 tokens
    ckv = rng.standard_normal((3, 512)).astype(np.float32)
    kpe = rng.standard_normal((3, 64)).astype(np.float32)
    mirror.append(0, table, {"ckv": ckv, "kpe": kpe})
    q_nope = rng.standard_normal((3, 2, 512))
    q_pe = rng.standard_normal((3, 2, 64))
    scale = 0.1352337747812271
    out, lse = mla_reference(mirror, 0, table, q_nope, q_pe, scale)
    for i in range(3):
        for h in range(2):
            logits = scale * (ckv[: i + 1] @ q_nope[i, h] + kpe[: i + 1] @ q_pe[i, h])
            p = np.exp(logits - logits.max())
            np.testing.assert_allclose(out[i, h], p @ ckv[: i + 1] / p.sum(), atol=1e-6)
            np.testing.assert_allclose(lse[i, h], np.log2(np.exp(logits).sum()), rtol=1e-9)


def test_check_close_tolerance_rule() -> None:
    ref = np.array([1.0, 100.0, 0.4, 0.0, 1.0, 1.0, -1e30])
    x = np.array([1.009, 100.5, 0.5, 0.011, np.nan, np.inf, np.float32(-1e30)])
    result = check_close(x, ref)
    # 1.009: |d| <= 1e-2. 100.5: |d| = 0.5 but relative 0.005. -1e30 in float32: relative 1.5e-8.
    # Fail: 0.5 vs 0.4 (both rules), 0.011 vs 0 (both), NaN, inf.
    assert result.num_failed == 4
    assert result.num_elements == 7
    assert math.isnan(result.max_abs_err)
    assert not result.ok
    good = check_close(np.array([1.0, 2.0]), np.array([1.001, 2.0]))
    assert good.ok and good.max_abs_err == pytest.approx(1e-3)


def test_check_close_needs_equal_shapes() -> None:
    with pytest.raises(ValueError, match="shape"):
        check_close(np.zeros((2, 3)), np.zeros((3, 2)))
