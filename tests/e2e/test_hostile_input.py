"""Hostile input beyond the malformed-request table of test_bad_requests.py: bytes that are not a
request at all, sizes built to overflow, ids and handles that are not the caller's. Each gets an
error, the server keeps serving, and the pool is unchanged."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from attnserve.tensors import float_to_bf16, pack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve.v1 import server_config_pb2 as config_pb

from launcher import Launched, launch

POOL = "p"
INT32_MAX = 2**31 - 1
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory):
    c = config_pb.ServerConfig()
    c.pools.add(name=POOL, kind=pb.POOL_KIND_GQA, num_layers=2, page_size=16, num_qo_heads=4,
                num_kv_heads=1, head_dim=64, num_pages=64)  # fmt: skip
    launched = launch(tmp_path_factory.mktemp("hostile"), c)
    yield launched
    launched.process.kill()
    launched.process.wait()


@pytest.fixture(scope="module")
def setup(hostile: Launched):
    """Two sessions with pages: 'mine' is the caller's, 'theirs' another tenant's."""
    channel = grpc.insecure_channel(hostile.address)
    s = pb_grpc.AttentionServiceStub(channel)
    mine = s.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    theirs = s.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    my_pages = list(s.AllocatePages(pb.AllocatePagesRequest(pool=POOL, num_pages=2, session=mine),
                                    timeout=10).page_ids)  # fmt: skip
    their_pages = list(
        s.AllocatePages(
            pb.AllocatePagesRequest(pool=POOL, num_pages=2, session=theirs), timeout=10
        ).page_ids
    )
    return channel, s, mine, my_pages, their_pages


def prefill(session: str, pages: list[int]) -> pb.PrefillRequest:
    q = float_to_bf16(np.ones((3, 4, 64), dtype=np.float32))
    return pb.PrefillRequest(pool=POOL, session=session, q=pack_tensor(q, pb.DTYPE_BF16),
                             qo_indptr=[0, 3], kv_indptr=[0, 2], kv_indices=pages,
                             kv_last_page_len=[5])  # fmt: skip


def state(s) -> tuple[int, ...]:
    return tuple(p.free_pages for p in s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).pools)


def mutated(session: str, pages: list[int], edit) -> pb.PrefillRequest:
    request = prefill(session, pages)
    edit(request)
    return request


# name -> (build the request bytes from (session, my pages, their pages), the expected codes)
CASES = {
    "truncated_request": (
        lambda me, mine, theirs: prefill(me, mine).SerializeToString()[:37],
        {Code.INVALID_ARGUMENT},
    ),
    "random_bytes": (lambda me, mine, theirs: b"\xff" + os.urandom(511), {Code.INVALID_ARGUMENT}),
    # Field 15 (session) holding bytes that are not UTF-8: proto3 refuses to parse it.
    "invalid_utf8_in_a_string_field": (
        lambda me, mine, theirs: prefill(me, mine).SerializeToString() + b"\x7a\x02\xff\xfe",
        {Code.INVALID_ARGUMENT},
    ),
    "length_prefix_past_the_end": (
        lambda me, mine, theirs: b"\x1a\xff\xff\xff\x7f" + b"\x00" * 16,
        {Code.INVALID_ARGUMENT},
    ),
    "q_shape_product_overflows": (
        lambda me, mine, theirs: mutated(
            me, mine, lambda r: (r.q.ClearField("shape"), r.q.shape.extend([2**62, 4, 64]))
        ).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
    "q_shape_negative": (
        lambda me, mine, theirs: mutated(
            me, mine, lambda r: (r.q.ClearField("shape"), r.q.shape.extend([-3, 4, 64]))
        ).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
    "total_q_int32_max": (
        lambda me, mine, theirs: mutated(
            me, mine, lambda r: r.qo_indptr.__setitem__(1, INT32_MAX)
        ).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
    "kv_indptr_int32_max": (
        lambda me, mine, theirs: mutated(
            me, mine, lambda r: r.kv_indptr.__setitem__(1, INT32_MAX)
        ).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
    "kv_last_page_len_negative": (
        lambda me, mine, theirs: mutated(
            me, mine, lambda r: r.kv_last_page_len.__setitem__(0, -7)
        ).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
    "layer_int32_min": (
        lambda me, mine, theirs: mutated(
            me, mine, lambda r: setattr(r, "layer", -(2**31))
        ).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
    "another_sessions_pages": (
        lambda me, mine, theirs: prefill(me, theirs).SerializeToString(),
        {Code.FAILED_PRECONDITION},
    ),
    "page_id_int32_max": (
        lambda me, mine, theirs: prefill(me, [mine[0], INT32_MAX]).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
    "garbage_session_handle": (
        lambda me, mine, theirs: prefill("\x00\xff" * 40, mine).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
    "session_of_another_epoch": (
        lambda me, mine, theirs: prefill(f"{1:016x}-{'0' * 32}", mine).SerializeToString(),
        {Code.FAILED_PRECONDITION},
    ),
    "a_million_sequences": (
        lambda me, mine, theirs: mutated(
            me, mine, lambda r: (r.ClearField("qo_indptr"), r.qo_indptr.extend([0] * (2**20 + 2)))
        ).SerializeToString(),
        {Code.INVALID_ARGUMENT},
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_hostile_prefill_is_refused(hostile: Launched, setup, name: str) -> None:
    channel, s, mine, my_pages, their_pages = setup
    build, codes = CASES[name]
    payload = build(mine, my_pages, their_pages)
    before = state(s)
    call = channel.unary_unary("/attnserve.v1.AttentionService/Prefill")  # raw bytes both ways
    with pytest.raises(grpc.RpcError) as err:
        call(payload, timeout=10)
    assert err.value.code() in codes, err.value.details()
    assert err.value.details(), "errors carry a message"
    assert hostile.process.poll() is None
    assert state(s) == before


def test_invalid_utf8_does_not_flood_the_log(hostile: Launched, setup) -> None:
    channel, s, mine, my_pages, _ = setup
    call = channel.unary_unary("/attnserve.v1.AttentionService/Prefill")
    payload = prefill(mine, my_pages).SerializeToString() + b"\x7a\x02\xff\xfe"
    before = hostile.log.read_text().count("protobuf ")
    for _ in range(200):
        with pytest.raises(grpc.RpcError):
            call(payload, timeout=10)
    assert hostile.log.read_text().count("protobuf ") - before <= 5  # about one line a second


@pytest.mark.parametrize("num_pages", [-1, 0, INT32_MAX, 65])
def test_hostile_allocation_sizes(hostile: Launched, setup, num_pages: int) -> None:
    _, s, mine, _, _ = setup
    before = state(s)
    request = pb.AllocatePagesRequest(pool=POOL, num_pages=num_pages, session=mine)
    with pytest.raises(grpc.RpcError) as err:
        s.AllocatePages(request, timeout=10)
    assert err.value.code() == Code.INVALID_ARGUMENT
    assert state(s) == before


def test_hostile_frees(hostile: Launched, setup) -> None:
    _, s, mine, my_pages, their_pages = setup
    before = state(s)
    hostile_ids = ([their_pages[0]], [my_pages[0]] * 100_000, [INT32_MAX], [-(2**31)],
                   my_pages + [9999])  # fmt: skip
    for ids in hostile_ids:
        request = pb.FreePagesRequest(pool=POOL, page_ids=ids, session=mine)
        with pytest.raises(grpc.RpcError):
            s.FreePages(request, timeout=10)
    assert state(s) == before
