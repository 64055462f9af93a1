"""Prefill and Decode results against the numpy reference, for GQA and MLA pools."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from attnserve import AttnError, BatchCsr, Client
from attnserve.reference import EMPTY_ROW_LSE
from attnserve.tensors import float_to_bf16

from workload import PoolSession

POOL_NAMES = ["gqa", "gqa_g5", "mla"]


@pytest.fixture(params=POOL_NAMES)
def session(request: pytest.FixtureRequest, client: Client) -> Iterator[PoolSession]:
    """A fresh session on each pool; its pages are freed after the test."""
    seed = zlib.crc32(request.node.name.encode())
    s = PoolSession(client, client.pool_info(request.param), seed=seed)
    yield s
    s.close()


def prompt_lengths(page_size: int) -> list[int]:
    """Ragged prompts: 1 token, an exact page multiple, a partial page and a longer one."""
    return [1, 2 * page_size if page_size > 1 else 32, 37, 100]


def test_chunked_prefill_then_decode(session: PoolSession) -> None:
    """Every round prefills the next chunk of every unfinished prompt on every layer."""
    prompts = dict(enumerate(prompt_lengths(session.pool.page_size)))
    chunk = 32
    done = dict.fromkeys(prompts, 0)
    while any(done[s] < n for s, n in prompts.items()):
        seqs = [s for s in prompts if done[s] < prompts[s]]
        q_lens = [min(chunk, prompts[s] - done[s]) for s in seqs]
        session.chunk(seqs, q_lens)
        for s, n in zip(seqs, q_lens, strict=True):
            done[s] += n
    for _ in range(3):
        session.decode_step(list(prompts))


@pytest.mark.parametrize("return_lse", [True, False])
def test_return_lse_on_and_off(session: PoolSession, return_lse: bool) -> None:
    session.grow(["a", "b"], [20, 5])
    session.prefill(["a", "b"], [20, 5], layer=1, return_lse=return_lse)
    session.grow(["a", "b"], [1, 1])
    session.decode(["a", "b"], layer=1, return_lse=return_lse)


def test_calls_without_new_kv_read_existing_pages(session: PoolSession) -> None:
    session.chunk(["a", "b"], [40, 17])
    for layer in range(session.pool.num_layers):
        # Re-query the last 10 tokens of a, and all of b (q_len == kv_len), reading only.
        session.prefill(["a", "b"], [10, 17], layer=layer, new_kv=False)
        session.decode(["a", "b"], layer=layer, new_kv=False)
    before = session.table.length("a")
    session.decode(["a"], new_kv=False)  # no growth: still the same pages
    assert session.table.length("a") == before


def test_rows_that_see_no_key(session: PoolSession) -> None:
    """q_len > kv_len without an append: the first rows see nothing; an empty sequence too."""
    session.chunk(["short"], [3])
    session.grow(["empty"], [0])
    result = session.prefill(["short", "empty"], [5, 2], layer=0, new_kv=False)
    no_key = [0, 1, 5, 6]  # short's rows 0-1 (need key index < 0), all of empty's
    assert (result.output[no_key] == 0).all()
    np.testing.assert_array_equal(result.lse[no_key], np.float32(EMPTY_ROW_LSE))
    assert (result.lse[[2, 3, 4]] > EMPTY_ROW_LSE / 2).all()


def test_decode_of_an_empty_sequence(session: PoolSession) -> None:
    session.chunk(["a"], [5])
    session.grow(["empty"], [0])
    result = session.decode(["a", "empty"], new_kv=False)
    assert (result.output[1] == 0).all() and (result.lse[1] == np.float32(EMPTY_ROW_LSE)).all()


@pytest.mark.parametrize("pool", ["gqa", "mla"])
def test_overflowing_logits_come_back_nan(client: Client, pool: str) -> None:
    """q = 1e38, or sm_scale = 1e38, overflows the float32 logits: a row that sees keys comes back
    NaN (or the call fails), never as a row that sees no key (output 0, lse EMPTY_ROW_LSE); an
    empty sequence in the same call still does. Keys and queries are positive, so every logit
    overflows to +inf whatever the order of the sums."""
    s = PoolSession(client, client.pool_info(pool), seed=9)
    try:
        s.grow(["a"], [5])
        s.grow(["empty"], [0])

        def positive(n: int) -> dict[str, np.ndarray]:
            return {k: v & np.uint16(0x7FFF) for k, v in s.tokens(n).items()}  # clear the sign

        table = s.table.csr(["a"], [5])
        prefilled = client.prefill(
            0, table=table, pool=pool, sm_scale=s.default_scale, **positive(5)
        )
        assert np.isfinite(prefilled.output).all()
        table = s.table.csr(["a", "empty"])
        queries = {k: v for k, v in positive(2).items() if not k.endswith("_new")}
        huge_q = {k: float_to_bf16(np.full(v.shape, 1e38, np.float32)) for k, v in queries.items()}
        cases = {"q = 1e38": (huge_q, s.default_scale), "sm_scale = 1e38": (queries, 1e38)}
        for what, (q, scale) in cases.items():
            try:
                result = client.decode(
                    0, table=table, pool=pool, sm_scale=scale, return_lse=True, **q
                )
            except AttnError as e:  # refusing the call is an answer too; a wrong number is not
                assert e.code == grpc.StatusCode.INVALID_ARGUMENT, (what, e)
                continue
            assert np.isnan(result.output[0]).all(), what
            assert np.isnan(result.lse[0]).all(), what
            assert (result.output[1] == 0).all(), what
            np.testing.assert_array_equal(result.lse[1], np.float32(EMPTY_ROW_LSE), what)
    finally:
        s.close()


def test_explicit_sm_scale(session: PoolSession) -> None:
    """GQA: a scale other than the default; MLA: DeepSeek's and another one."""
    session.chunk(["a"], [30])
    for scale in (0.05, 0.3):
        session.prefill(["a"], [30], layer=0, new_kv=False, sm_scale=scale)
        session.decode(["a"], layer=0, new_kv=False, sm_scale=scale)


def test_kv_last_page_len_with_a_trailing_entry(session: PoolSession) -> None:
    def pad(table: BatchCsr) -> BatchCsr:
        return table._replace(kv_last_page_len=np.append(table.kv_last_page_len, 0))

    session.grow(["a", "b"], [9, 20])
    session.prefill(["a", "b"], [9, 20], edit_table=pad)
    session.decode(["a", "b"], new_kv=False, edit_table=pad)


def test_pages_in_any_order(session: PoolSession) -> None:
    """A sequence's pages need not be ascending or contiguous: send them reversed, every call."""

    def reverse_pages(table: BatchCsr) -> BatchCsr:
        return table._replace(kv_indices=table.kv_indices[::-1].copy())

    n = 3 * session.pool.page_size + 1
    session.grow(["a"], [n])
    session.prefill(["a"], [n], edit_table=reverse_pages)
    session.prefill(["a"], [n // 2], new_kv=False, edit_table=reverse_pages)
    session.decode(["a"], new_kv=False, edit_table=reverse_pages)


def test_page_size_one_without_kv_last_page_len(client: Client) -> None:
    session = PoolSession(client, client.pool_info("gqa_g5"), seed=7)
    try:
        session.grow(["a", "b"], [12, 1])
        for layer in range(session.pool.num_layers):
            session.prefill(
                ["a", "b"],
                [12, 1],
                layer=layer,
                edit_table=lambda t: t._replace(kv_last_page_len=None),
            )
    finally:
        session.close()


def test_layers_are_separate(client: Client) -> None:
    """Appending on layer 1 leaves layer 0's tokens as they were (and the reverse)."""
    session = PoolSession(client, client.pool_info("gqa"), seed=8)
    try:
        session.chunk(["a"], [24])
        session.grow(["a"], [8])
        session.prefill(["a"], [8], layer=1)  # positions 24..31 written on layer 1 only
        session.prefill(["a"], [24], layer=1, new_kv=False)
        session.prefill(["a"], [8], layer=0)
        session.prefill(["a"], [32], layer=0, new_kv=False)
    finally:
        session.close()


@pytest.mark.parametrize("pool", ["gqa", "mla"])
def test_concurrent_clients(client: Client, pool: str) -> None:
    """Several schedulers at once (the server may batch their calls); each result is checked."""
    info = client.pool_info(pool)
    errors: list[BaseException] = []

    def scheduler(seed: int) -> None:
        s = PoolSession(client, info, seed=seed)
        try:
            s.chunk([seed], [8 + 5 * seed])
            for _ in range(4):
                s.decode_step([seed])
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            s.close()

    threads = [threading.Thread(target=scheduler, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
