"""Malformed Prefill/Decode calls: each fails with its gRPC code and changes nothing.

Every case starts from a valid request on sequence "a" (24 tokens on every layer): a Prefill that
rewrites positions 20..23 of layer 1 with new K/V, or a Decode that only reads. After the bad call
the pool's free page count must be unchanged and layer 1 must still hold exactly what the test
wrote (checked by a read-only Prefill against the local mirror).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from attnserve import AttnError, Client
from attnserve.tensors import pack_tensor, unpack_tensor
from attnserve.v1 import attention_pb2 as pb

from workload import MLA_SM_SCALE, PoolSession

Code = grpc.StatusCode
INVALID = {Code.INVALID_ARGUMENT}
LAYER = 1
Request = pb.PrefillRequest | pb.DecodeRequest


@dataclass
class Target:
    """A pool with sequence "a" written, valid base requests and a page known to be free."""

    session: PoolSession
    prefill: pb.PrefillRequest
    decode: pb.DecodeRequest
    free_page: int

    @property
    def pool(self) -> pb.PoolInfo:
        return self.session.pool

    def pages(self) -> list[int]:
        return self.session.table.pages("a")


def attention_fields(session: PoolSession, request: Request, num_tokens: int, new_kv: bool) -> None:
    """Fills pool, layer, tensors, sm_scale and the page table of "a" into request."""
    table = session.table.csr(["a"])
    request.pool = session.pool.name
    request.layer = LAYER
    request.return_lse = True
    request.kv_indptr.extend(table.kv_indptr.tolist())
    request.kv_indices.extend(table.kv_indices.tolist())
    request.kv_last_page_len.extend(table.kv_last_page_len.tolist())
    if session.is_mla:
        request.sm_scale = MLA_SM_SCALE
    for name, bits in session.tokens(num_tokens).items():
        if new_kv or not name.endswith("_new"):
            getattr(request, name).CopyFrom(pack_tensor(bits))


@pytest.fixture
def target(request: pytest.FixtureRequest, client: Client) -> Iterator[Target]:
    """The pool named by the test's (indirect) parameter, prepared as described above."""
    session = PoolSession(client, client.pool_info(request.param), seed=11)
    try:
        session.chunk(["a"], [24])
        spare = client.allocate_pages(1, pool=session.pool.name)
        client.free_pages(spare, pool=session.pool.name)  # known to be free now
        prefill = pb.PrefillRequest(qo_indptr=[0, 4])
        attention_fields(session, prefill, 4, new_kv=True)
        decode = pb.DecodeRequest()
        attention_fields(session, decode, 1, new_kv=False)
        yield Target(session, prefill, decode, spare[0])
    finally:
        session.close()


# --- mutations -------------------------------------------------------------------------------

Mutation = Callable[[Request, Target], None]


def retype(field: str, dtype: int) -> Mutation:
    """Re-encodes a tensor in another dtype (consistent shape and byte count)."""

    def mutate(r: Request, t: Target) -> None:
        tensor = getattr(r, field)
        tensor.CopyFrom(pack_tensor(unpack_tensor(tensor), dtype))

    return mutate


def relabel(field: str, dtype: int) -> Mutation:
    """Changes only a tensor's dtype field."""

    def mutate(r: Request, t: Target) -> None:
        getattr(r, field).dtype = dtype

    return mutate


def reshape(field: str, shape: Callable[[tuple[int, ...]], tuple[int, ...]]) -> Mutation:
    """Replaces a tensor by zeros of another shape (consistent byte count)."""

    def mutate(r: Request, t: Target) -> None:
        tensor = getattr(r, field)
        new_shape = shape(tuple(tensor.shape))
        tensor.CopyFrom(pack_tensor(np.zeros(new_shape, np.float32)))

    return mutate


def resize_data(field: str, delta: int) -> Mutation:
    """Drops (delta < 0) or appends bytes of a tensor's data."""

    def mutate(r: Request, t: Target) -> None:
        tensor = getattr(r, field)
        data = tensor.data
        tensor.data = data[:delta] if delta < 0 else data + b"\0" * delta

    return mutate


def clear(field: str) -> Mutation:
    return lambda r, t: r.ClearField(field)


def add_tensor(field: str, shape: Callable[[pb.PoolInfo], tuple[int, ...]]) -> Mutation:
    def mutate(r: Request, t: Target) -> None:
        getattr(r, field).CopyFrom(pack_tensor(np.zeros(shape(t.pool), np.float32)))

    return mutate


def set_fields(**values: Callable[[Target], object]) -> Mutation:
    """Sets scalar fields and replaces repeated ones, each value computed from the target."""

    def mutate(r: Request, t: Target) -> None:
        for name, value in values.items():
            v = value(t)
            if isinstance(v, list):
                r.ClearField(name)
                getattr(r, name).extend(v)
            else:
                setattr(r, name, v)

    return mutate


def replace_page(index_of: Callable[[Target], int]) -> Mutation:
    def mutate(r: Request, t: Target) -> None:
        r.kv_indices[0] = index_of(t)

    return mutate


def n_pages(t: Target) -> int:
    return len(t.pages())


def last_len(t: Target) -> int:
    return 24 - (n_pages(t) - 1) * t.pool.page_size


@dataclass(repr=False)
class Case:
    """One malformed call: which op and pools, how to break the base request, accepted codes."""

    name: str
    op: str  # "prefill" or "decode"
    kinds: tuple[str, ...]  # pool names it applies to
    mutate: Mutation
    codes: set[Code]

    def __repr__(self) -> str:
        return f"Case({self.name})"


BOTH = ("gqa", "mla")
CASES = [
    # dtypes
    Case("q_fp32", "prefill", BOTH, retype("q", pb.DTYPE_FP32), INVALID),
    Case("q_fp16", "prefill", BOTH, retype("q", pb.DTYPE_FP16), INVALID),
    Case("q_unspecified_dtype", "prefill", BOTH, relabel("q", pb.DTYPE_UNSPECIFIED), INVALID),
    Case("k_new_fp32", "prefill", ("gqa",), retype("k_new", pb.DTYPE_FP32), INVALID),
    Case("kpe_new_fp16", "prefill", ("mla",), retype("kpe_new", pb.DTYPE_FP16), INVALID),
    Case("decode_q_fp32", "decode", BOTH, retype("q", pb.DTYPE_FP32), INVALID),
    # shapes
    Case("q_extra_head", "prefill", BOTH, reshape("q", lambda s: (s[0], s[1] + 1, s[2])), INVALID),
    Case("q_head_dim", "prefill", BOTH, reshape("q", lambda s: (s[0], s[1], s[2] * 2)), INVALID),
    Case("q_rank_2", "prefill", BOTH, reshape("q", lambda s: (s[0], s[1] * s[2])), INVALID),
    Case("q_extra_row", "prefill", BOTH, reshape("q", lambda s: (s[0] + 1, *s[1:])), INVALID),
    Case("k_new_kv_heads", "prefill", ("gqa",),
         reshape("k_new", lambda s: (s[0], s[1] + 1, s[2])), INVALID),
    Case("v_new_missing_row", "prefill", ("gqa",),
         reshape("v_new", lambda s: (s[0] - 1, *s[1:])), INVALID),
    Case("q_pe_dim", "prefill", ("mla",), reshape("q_pe", lambda s: (s[0], s[1], 32)), INVALID),
    Case("ckv_new_dim", "prefill", ("mla",), reshape("ckv_new", lambda s: (s[0], 256)), INVALID),
    Case("decode_q_two_rows", "decode", BOTH, reshape("q", lambda s: (2, *s[1:])), INVALID),
    # data length
    Case("q_data_short", "prefill", BOTH, resize_data("q", -2), INVALID),
    Case("q_data_long", "prefill", BOTH, resize_data("q", 2), INVALID),
    Case("v_new_data_short", "prefill", ("gqa",), resize_data("v_new", -1), INVALID),
    Case("kpe_new_data_long", "prefill", ("mla",), resize_data("kpe_new", 2), INVALID),
    # missing or mismatched tensors
    Case("no_q", "prefill", BOTH, clear("q"), INVALID),
    Case("k_new_without_v_new", "prefill", ("gqa",), clear("v_new"), INVALID),
    Case("v_new_without_k_new", "prefill", ("gqa",), clear("k_new"), INVALID),
    Case("ckv_new_without_kpe_new", "prefill", ("mla",), clear("kpe_new"), INVALID),
    Case("kpe_new_without_ckv_new", "prefill", ("mla",), clear("ckv_new"), INVALID),
    Case("mla_without_q_pe", "prefill", ("mla",), clear("q_pe"), INVALID),
    Case("gqa_with_q_pe", "prefill", ("gqa",),
         add_tensor("q_pe", lambda p: (4, p.num_qo_heads, 64)), INVALID),
    Case("mla_with_k_new", "prefill", ("mla",), add_tensor("k_new", lambda p: (4, 1, 512)),
         INVALID),
    Case("decode_k_new_shape", "decode", ("gqa",), add_tensor(
        "k_new", lambda p: (1, p.num_kv_heads + 1, p.head_dim)), INVALID),
    # layer
    Case("layer_too_large", "prefill", BOTH, set_fields(layer=lambda t: t.pool.num_layers),
         INVALID),
    Case("layer_negative", "prefill", BOTH, set_fields(layer=lambda t: -1), INVALID),
    Case("decode_layer_too_large", "decode", BOTH,
         set_fields(layer=lambda t: t.pool.num_layers), INVALID),
    # sm_scale
    Case("sm_scale_nan", "prefill", BOTH, set_fields(sm_scale=lambda t: math.nan), INVALID),
    Case("sm_scale_inf", "prefill", BOTH, set_fields(sm_scale=lambda t: math.inf), INVALID),
    Case("decode_sm_scale_neg_inf", "decode", BOTH, set_fields(sm_scale=lambda t: -math.inf),
         INVALID),
    Case("mla_without_sm_scale", "prefill", ("mla",), clear("sm_scale"), INVALID),
    Case("decode_mla_without_sm_scale", "decode", ("mla",), clear("sm_scale"), INVALID),
    # qo_indptr
    Case("qo_indptr_decreasing", "prefill", BOTH, set_fields(
        qo_indptr=lambda t: [0, 5, 4], kv_indptr=lambda t: [0, n_pages(t), n_pages(t)],
        kv_last_page_len=lambda t: [last_len(t), 0]), INVALID),
    Case("qo_indptr_not_from_zero", "prefill", BOTH, set_fields(qo_indptr=lambda t: [1, 4]),
         INVALID),
    Case("qo_indptr_short_of_total_q", "prefill", BOTH, set_fields(qo_indptr=lambda t: [0, 3]),
         INVALID),
    Case("qo_indptr_empty", "prefill", BOTH, clear("qo_indptr"), INVALID),
    # kv_indptr
    Case("kv_indptr_decreasing", "prefill", BOTH, set_fields(
        qo_indptr=lambda t: [0, 4, 4], kv_indptr=lambda t: [0, n_pages(t), n_pages(t) - 1],
        kv_last_page_len=lambda t: [last_len(t), 1]), INVALID),
    Case("kv_indptr_short_of_indices", "prefill", BOTH,
         set_fields(kv_indptr=lambda t: [0, n_pages(t) - 1]), INVALID),
    Case("kv_indptr_other_batch", "prefill", BOTH,
         set_fields(kv_indptr=lambda t: [0, n_pages(t), n_pages(t)]), INVALID),
    Case("decode_kv_indptr_empty", "decode", BOTH, clear("kv_indptr"), INVALID),
    # kv_indices
    Case("page_not_allocated", "prefill", BOTH, replace_page(lambda t: t.free_page),
         {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    Case("decode_page_not_allocated", "decode", BOTH, replace_page(lambda t: t.free_page),
         {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    Case("page_out_of_range", "prefill", BOTH, replace_page(lambda t: t.pool.total_pages),
         INVALID),
    Case("page_negative", "prefill", BOTH, replace_page(lambda t: -1), INVALID),
    # kv_last_page_len
    Case("last_page_len_zero", "prefill", BOTH, set_fields(kv_last_page_len=lambda t: [0]),
         INVALID),
    Case("last_page_len_over_page_size", "prefill", BOTH,
         set_fields(kv_last_page_len=lambda t: [t.pool.page_size + 1]), INVALID),
    Case("decode_last_page_len_zero", "decode", BOTH,
         set_fields(kv_last_page_len=lambda t: [0]), INVALID),
    Case("last_page_len_missing", "prefill", BOTH, clear("kv_last_page_len"), INVALID),
    Case("last_page_len_too_many", "prefill", BOTH,
         set_fields(kv_last_page_len=lambda t: [last_len(t), 0, 0]), INVALID),
    # appended rows must fit in the page table
    Case("append_beyond_kv_len", "prefill", BOTH, set_fields(
        kv_indptr=lambda t: [0, 1], kv_indices=lambda t: t.pages()[:1],
        kv_last_page_len=lambda t: [3]), INVALID),
    # pool
    Case("unknown_pool", "prefill", BOTH, set_fields(pool=lambda t: "nope"),
         {Code.NOT_FOUND, Code.INVALID_ARGUMENT}),
    Case("decode_unknown_pool", "decode", BOTH, set_fields(pool=lambda t: "nope"),
         {Code.NOT_FOUND, Code.INVALID_ARGUMENT}),
    Case("pool_name_empty_with_several_pools", "prefill", BOTH, set_fields(pool=lambda t: ""),
         INVALID),
]  # fmt: skip


@pytest.mark.parametrize("target", BOTH, indirect=True)
def test_base_requests_are_valid(target: Target, client: Client) -> None:
    """The unmodified requests succeed (so each case fails for its one change)."""
    assert client.call_decode(target.decode).output.shape[0] == 1
    assert client.call_prefill(target.prefill).output.shape[0] == 4


@pytest.mark.parametrize(
    ("target", "case"),
    [pytest.param(kind, case, id=f"{kind}-{case.name}") for case in CASES for kind in case.kinds],
    indirect=["target"],
)
def test_bad_request(target: Target, client: Client, case: Case) -> None:
    bad = pb.PrefillRequest() if case.op == "prefill" else pb.DecodeRequest()
    bad.CopyFrom(target.prefill if case.op == "prefill" else target.decode)
    case.mutate(bad, target)
    pool = target.pool.name
    free_before = client.pool_info(pool).free_pages
    call = client.call_prefill if case.op == "prefill" else client.call_decode
    with pytest.raises(AttnError) as err:
        call(bad)
    codes = sorted(c.name for c in case.codes)
    assert err.value.code in case.codes, f"{case.name}: got {err.value}, expected {codes}"
    assert err.value.message, "error without a message"
    assert client.pool_info(pool).free_pages == free_before
    # Nothing was written: layer LAYER still holds what the mirror says.
    target.session.prefill(["a"], [24], layer=LAYER, new_kv=False)
