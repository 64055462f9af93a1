#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (deterministic).

    .venv/bin/python fuzz/make_corpus.py [OUT_DIR [QUEUE_OUT_DIR]]

fuzz/corpus/ (OUT_DIR), for fuzz/request_fuzzer.cc: each seed is one selector byte followed by a
serialized PrefillRequest or DecodeRequest (the format request_fuzzer.cc documents): valid calls
on every pool and op, and malformed ones that each break one rule (shapes, dtypes, indptr, page
ids and owners, layer, sm_scale, MLA/GQA fields, appends longer than the page table), plus
truncated and garbage wire bytes.

fuzz/call_queue_corpus/ (QUEUE_OUT_DIR), for fuzz/call_queue_fuzzer.cc: a geometry byte and the
operations that file documents: valid calls over the queue, and a hostile caller's writes into
its slots (lengths, methods, timeouts, cancel, states flipped while a call runs, the queue
header, garbage requests).
"""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path

import numpy as np

from attnserve.v1 import attention_pb2 as pb

# The fuzzer's pools (request_fuzzer.cc PoolConfig): selector bits 0-1.
# Pages 0 .. num_pages - 4 belong to the caller, the next two to another session, the last is free.
POOLS = {
    "gqa": dict(index=0, mla=False, page_size=4, heads=4, kv_heads=2, dim=64, layers=2, pages=16),
    "gqa_p1": dict(
        index=1, mla=False, page_size=1, heads=3, kv_heads=1, dim=64, layers=1, pages=32
    ),
    "mla": dict(index=2, mla=True, page_size=4, heads=2, kv_heads=1, dim=512, layers=2, pages=8),
}
DECODE = 4  # selector bit 2
MERGE = 8  # selector bit 3
PLAN = 16  # selector bit 4 (without MERGE): the page table goes into a plan the call names
EPOCH = 0xA77E5E11

rng = np.random.default_rng(1234)


def bf16(shape: tuple[int, ...]) -> pb.Tensor:
    """Random bf16 tensor (values in [-2, 2), truncated from float32)."""
    values = rng.uniform(-2, 2, size=shape).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype("<u2")
    return pb.Tensor(dtype=pb.DTYPE_BF16, shape=list(shape), data=bits.tobytes())


def csr(q_lens: list[int], kv_lens: list[int], page_size: int, first_page: int = 0):
    """qo_indptr, kv_indptr, kv_indices (consecutive pages from first_page), kv_last_page_len."""
    qo, kv, indices, last = [0], [0], [], []
    page = first_page
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        qo.append(qo[-1] + q_len)
        n = -(-kv_len // page_size)
        indices += list(range(page, page + n))
        page += n
        kv.append(kv[-1] + n)
        last.append(kv_len - (n - 1) * page_size if n else 0)
    return qo, kv, indices, last


def request(
    pool: str,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    decode: bool = False,
    append: bool = True,
    layer: int = 0,
    lse: bool = False,
    **extra,
):
    p = POOLS[pool]
    qo, kv, indices, last = csr(q_lens, kv_lens, p["page_size"])
    total = len(q_lens) if decode else sum(q_lens)
    r = pb.DecodeRequest() if decode else pb.PrefillRequest()
    r.pool = pool
    r.layer = layer
    if p["mla"]:
        r.q.CopyFrom(bf16((total, p["heads"], 512)))
        r.q_pe.CopyFrom(bf16((total, p["heads"], 64)))
        if append:
            r.ckv_new.CopyFrom(bf16((total, 512)))
            r.kpe_new.CopyFrom(bf16((total, 64)))
        r.sm_scale = 0.1352337747812271
    else:
        r.q.CopyFrom(bf16((total, p["heads"], p["dim"])))
        if append:
            r.k_new.CopyFrom(bf16((total, p["kv_heads"], p["dim"])))
            r.v_new.CopyFrom(bf16((total, p["kv_heads"], p["dim"])))
    if not decode:
        r.qo_indptr.extend(qo)
    r.kv_indptr.extend(kv)
    r.kv_indices.extend(indices)
    r.kv_last_page_len.extend(last)
    r.return_lse = lse
    for name, value in extra.items():
        setattr(r, name, value)
    return r


def seed(pool: str, message, flags: int = 0) -> bytes:
    decode = isinstance(message, pb.DecodeRequest)
    selector = POOLS[pool]["index"] | (DECODE if decode else 0) | flags
    return bytes([selector]) + message.SerializeToString()


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}

    def add(name: str, pool: str, message, flags: int = 0) -> None:
        out[name] = seed(pool, message, flags)

    # Valid calls.
    add("gqa_prefill_append", "gqa", request("gqa", [3, 2], [6, 5], lse=True, layer=1))
    add("gqa_prefill_no_append", "gqa", request("gqa", [4], [2], append=False))
    add("gqa_prefill_merged", "gqa", request("gqa", [2, 1], [5, 1], lse=True), MERGE)
    add("gqa_prefill_empty_queries", "gqa", request("gqa", [0, 0], [3, 0], append=False))
    add("gqa_decode_append", "gqa", request("gqa", [1, 1, 1], [1, 4, 9], decode=True, lse=True))
    add("gqa_decode_no_pages", "gqa", request("gqa", [1, 1], [0, 7], decode=True, append=False))
    add("gqa_decode_merged", "gqa", request("gqa", [1, 1], [3, 8], decode=True), MERGE)
    p1 = request("gqa_p1", [2, 3], [4, 3], lse=True)
    del p1.kv_last_page_len[:]  # page size 1: may be empty
    add("gqa_p1_prefill_implicit_last", "gqa_p1", p1)
    add("gqa_p1_decode", "gqa_p1", request("gqa_p1", [1, 1], [5, 1], decode=True))
    add("mla_prefill_append", "mla", request("mla", [2], [5], lse=True, layer=1))
    add("mla_decode_append", "mla", request("mla", [1], [6], decode=True))
    add("mla_decode_merged", "mla", request("mla", [1], [3], decode=True, append=False), MERGE)
    trailing = request("gqa", [1], [2], decode=True)
    trailing.kv_last_page_len.append(3)  # batch + 1 entries: the last is ignored
    add("gqa_decode_trailing_last_len", "gqa", trailing)
    add(
        "gqa_decode_session",
        "gqa",
        request("gqa", [1], [2], decode=True, session=f"{EPOCH:016x}-{'0' * 32}"),
    )

    # Malformed: each breaks one rule.
    bad = request("gqa", [2], [3])
    bad.q.dtype = pb.DTYPE_FP32
    add("bad_dtype", "gqa", bad)
    bad = request("gqa", [2], [3])
    bad.q.shape[1] = 8
    add("bad_shape", "gqa", bad)
    bad = request("gqa", [2], [3])
    bad.k_new.data = bad.k_new.data[:-2]
    add("bad_data_size", "gqa", bad)
    bad = request("gqa", [2, 1], [3, 4])
    bad.qo_indptr[:] = [0, 3, 2]
    add("bad_qo_indptr_decreasing", "gqa", bad)
    bad = request("gqa", [2], [3])
    bad.qo_indptr[0] = 1
    add("bad_qo_indptr_start", "gqa", bad)
    bad = request("gqa", [2], [3])
    bad.qo_indptr[-1] = 1 << 30
    add("bad_total_q_huge", "gqa", bad)
    bad = request("gqa", [2], [3])
    bad.kv_indptr.append(1)
    add("bad_kv_indptr_length", "gqa", bad)
    bad = request("gqa", [1], [6], decode=True)
    bad.kv_last_page_len[0] = 5
    add("bad_last_page_len_high", "gqa", bad)
    bad = request("gqa", [1], [6], decode=True)
    bad.kv_last_page_len[0] = 0
    add("bad_last_page_len_zero", "gqa", bad)
    bad = request("gqa", [1, 1], [6, 2], decode=True)
    del bad.kv_last_page_len[1:]
    add("bad_last_page_len_count", "gqa", bad)
    for name, page in (("range", 99), ("negative", -1), ("other_session", 13), ("free", 15)):
        bad = request("gqa", [1], [6], decode=True)
        bad.kv_indices[1] = page
        add(f"bad_page_{name}", "gqa", bad)
    add("bad_layer", "gqa", request("gqa", [1], [2], decode=True, layer=2))
    add("bad_layer_negative", "mla", request("mla", [1], [2], decode=True, layer=-1))
    add("bad_sm_scale_nan", "gqa", request("gqa", [1], [2], decode=True, sm_scale=float("nan")))
    add("bad_sm_scale_inf", "mla", request("mla", [1], [2], decode=True, sm_scale=float("inf")))
    bad = request("mla", [1], [2], decode=True)
    bad.ClearField("sm_scale")
    add("bad_mla_without_scale", "mla", bad)
    bad = request("gqa", [1], [2], decode=True)
    bad.q_pe.CopyFrom(bf16((1, 4, 64)))
    add("bad_gqa_with_mla_field", "gqa", bad)
    bad = request("gqa", [1], [2], decode=True)
    bad.ClearField("v_new")
    add("bad_k_without_v", "gqa", bad)
    add("bad_append_longer_than_table", "gqa", request("gqa", [3], [2]))
    add("bad_decode_no_sequences", "gqa", pb.DecodeRequest(kv_indptr=[0]))
    add("bad_prefill_empty", "gqa", pb.PrefillRequest())
    add(
        "bad_session_epoch",
        "gqa",
        request("gqa", [1], [2], decode=True, session="0000000000000001-1"),
    )
    add(
        "bad_session_garbage",
        "mla",
        request("mla", [1], [2], decode=True, session="-9223372036854775808-x"),
    )
    long_table = request("gqa_p1", [1], [28], decode=True, append=False)
    add("gqa_p1_decode_long_table", "gqa_p1", long_table)
    too_long = request("gqa_p1", [1], [1], decode=True, append=False)
    too_long.kv_indices.extend([0] * 32)  # 33 pages: more than the pool holds
    too_long.kv_indptr[1] = 33
    add("bad_sequence_longer_than_pool", "gqa_p1", too_long)

    # Wire-level damage.
    valid = seed("gqa", request("gqa", [2], [5], lse=True))
    out["wire_truncated_in_tensor"] = valid[: len(valid) // 2]
    out["wire_truncated_in_varint"] = valid[:2] + b"\xff\xff"
    out["wire_garbage"] = bytes([0]) + bytes(rng.integers(0, 256, 64, dtype=np.uint8))
    out["wire_huge_length"] = bytes([4]) + b"\x1a\xff\xff\xff\xff\x0f"
    out["wire_unknown_fields"] = valid + b"\xf8\x07\x01\x92\x08\x03abc"
    # A second `q` field: protobuf merges it into the first (its shape gains a dimension).
    extra_q = pb.Tensor(shape=[1]).SerializeToString()
    merged = seed("gqa", request("gqa", [1], [2], decode=True))
    out["wire_merged_field"] = merged + b"\x1a" + bytes([len(extra_q)]) + extra_q
    out["wire_selector_only"] = bytes([DECODE | 2])

    # Merged launches of calls that only read (an appending call's copy is refused by its append
    # locks, so the merged seeds above run once). Last, so the seeds above keep their bytes.
    add("gqa_prefill_merged_read", "gqa", request("gqa", [2, 1], [5, 1], append=False), MERGE)
    add(
        "gqa_p1_decode_merged_read",
        "gqa_p1",
        request("gqa_p1", [1, 1], [4, 2], decode=True, append=False, lse=True),
        MERGE,
    )

    # Region references (the target registers region "r": a page table at 1024, bf16 values from
    # 4096; fuzz/request_fuzzer.cc). Last, so the seeds above keep their bytes.
    def in_region(r, *fields: str, offset: int = 4096):
        for f in fields:
            t = getattr(r, f)
            t.region.name, t.region.offset = "r", offset
            offset += (len(t.data) + 255) // 256 * 256
            t.ClearField("data")
        return r

    add("region_decode_q", "gqa", in_region(request("gqa", [1], [3], decode=True), "q"))
    add("region_prefill_all", "gqa",
        in_region(request("gqa", [2], [4], lse=True), "q", "k_new", "v_new"))  # fmt: skip
    mla = in_region(request("mla", [1], [2], decode=True), "q", "q_pe", "ckv_new", "kpe_new")
    add("region_mla_decode", "mla", mla)
    out_to = request("gqa", [1], [1], decode=True, append=False, lse=True)
    out_to.output_to.name, out_to.output_to.offset = "r", 65536
    out_to.lse_to.name, out_to.lse_to.offset = "r", 131072
    add("region_outputs", "gqa", out_to)
    for decode in (True, False):
        table = request("gqa", [1], [1], decode=decode, append=False)
        for f in ("kv_indptr", "kv_indices", "kv_last_page_len", "qo_indptr"):
            if table.DESCRIPTOR.fields_by_name.get(f):
                table.ClearField(f)
        table.page_table.at.name, table.page_table.at.offset = "r", 1024
        table.page_table.batch, table.page_table.num_pages = 1, 1
        add(f"region_page_table_{'decode' if decode else 'prefill'}", "gqa", table)
    unknown = request("gqa", [1], [3], decode=True)
    unknown.q.region.name, unknown.q.region.offset = "elsewhere", 4096
    unknown.q.ClearField("data")
    out["region_unregistered"] = seed("gqa", unknown)
    merged_table = request("gqa", [1], [1], decode=True, append=False)
    for f in ("kv_indptr", "kv_indices", "kv_last_page_len"):
        merged_table.ClearField(f)
    merged_table.page_table.at.name, merged_table.page_table.at.offset = "r", 1024
    merged_table.page_table.batch, merged_table.page_table.num_pages = 1, 1
    add("region_page_table_merged_read", "gqa", merged_table, MERGE)

    # An output written over the region's header (the caller's memory is the caller's): the
    # target must restore the region for the inputs after it.
    over = request("gqa", [1], [1], decode=True, append=False, lse=True)
    over.output_to.name, over.output_to.offset = "r", 65536
    over.lse_to.name = "r"  # offset 0
    add("output_over_the_region_header", "gqa", over)

    # Plans (the table moved into a plan first). Last, so the seeds above keep their bytes.
    add("plan_gqa_decode_append", "gqa",
        request("gqa", [1, 1, 1], [1, 4, 9], decode=True, lse=True), PLAN)  # fmt: skip
    add("plan_gqa_prefill_append", "gqa", request("gqa", [3, 2], [6, 5], layer=1), PLAN)
    add("plan_mla_decode", "mla", request("mla", [1], [6], decode=True), PLAN)
    plan_ref = request("gqa", [1], [1], decode=False, append=False)
    for f in ("kv_indptr", "kv_indices", "kv_last_page_len", "qo_indptr"):
        plan_ref.ClearField(f)
    plan_ref.page_table.at.name, plan_ref.page_table.at.offset = "r", 1024
    plan_ref.page_table.batch, plan_ref.page_table.num_pages = 1, 1
    add("plan_from_region_prefill", "gqa", plan_ref, PLAN)
    bad = request("gqa", [1], [6], decode=True)
    bad.kv_indices[1] = 13  # another session's page: CreatePlan refuses it
    add("plan_bad_page_other_session", "gqa", bad, PLAN)
    add("plan_bad_append_longer_than_table", "gqa", request("gqa", [3], [2]), PLAN)
    return out


# call_queue_fuzzer.cc's operations and slot words (proto/attnserve/v1/call_queue.h).
WORD, BYTES, PUBLISH, QUEUE, POLL, IDLE, CALL, TIMEOUT = range(8)
STATE, CLIENT_WAITING, METHOD, REQUEST_LEN, CANCEL, STATUS = 0, 1, 2, 3, 6, 8
SUBMITTED, TAKEN, DONE = 1, 2, 3
METHOD_DECODE, METHOD_PREFILL = 1, 2  # call_queue.h's methods (not the selector bits above)
# CALL's variant bits.
V_PREFILL, V_APPEND, V_LSE, V_IN_REGION, V_OTHER_SESSION = 1, 2, 4, 64, 128


def word(slot: int, index: int, value: int) -> bytes:
    return bytes([WORD, slot, index]) + struct.pack("<I", value & 0xFFFFFFFF)


def call(slot: int, variant: int, offset: int = 0) -> bytes:
    return bytes([CALL, slot, variant]) + struct.pack("<H", offset)


def timeout(slot: int, us: int) -> bytes:
    return bytes([TIMEOUT, slot]) + struct.pack("<q", us)


def publish(slot: int) -> bytes:
    return bytes([PUBLISH, slot])


def queue_word(index: int, value: int) -> bytes:
    return bytes([QUEUE, index]) + struct.pack("<I", value)


def ops(geometry: int, *parts: bytes) -> bytes:
    return bytes([geometry]) + b"".join(parts)


def queue_seeds() -> dict[str, bytes]:
    four, one = 3, 0  # geometry: 4 slots, 1 slot
    poll, idle = bytes([POLL]), bytes([IDLE])
    garbage = bytes((i * 37 + 11) % 256 for i in range(96))
    every = [call(i, V_APPEND if i % 2 else 0) for i in range(4)]
    freed = [word(i, STATE, 0) for i in range(4)]
    again = [call(i, V_LSE) for i in range(4)]
    return {
        "decode_append": ops(four, call(0, V_APPEND), idle),
        "decode_read_lse": ops(four, call(2, V_LSE | (3 << 4)), idle),
        "prefill_append_lse": ops(four, call(1, V_PREFILL | V_APPEND | V_LSE), idle),
        "every_slot_then_again": ops(four, *every, idle, *freed, *again, idle),
        "one_slot_reused": ops(one, call(0, V_APPEND), idle, word(0, STATE, 0), call(0, 0), idle),
        # q read from the queue's own memory: slot 0's request area, then past the region.
        "q_in_own_region": ops(four, call(1, V_IN_REGION, (128 + 64) // 16), idle),
        "q_past_own_region": ops(four, call(1, V_IN_REGION, 0xFFFF), idle),
        "other_session": ops(four, call(0, V_OTHER_SESSION | V_APPEND), idle),
        "length_past_area": ops(
            four, word(0, METHOD, METHOD_DECODE), word(0, REQUEST_LEN, 0xFFFFFFFF), publish(0), idle
        ),
        "length_area_plus_one": ops(
            four, word(3, METHOD, METHOD_PREFILL), word(3, REQUEST_LEN, 2049), publish(3), idle
        ),
        "unknown_method": ops(four, word(0, METHOD, 99), word(0, REQUEST_LEN, 4), publish(0), idle),
        "garbage_request": ops(
            four,
            bytes([BYTES, 0, 0, 0, len(garbage)]) + garbage,
            word(0, METHOD, METHOD_DECODE),
            word(0, REQUEST_LEN, len(garbage)),
            publish(0),
            idle,
        ),
        "negative_timeout": ops(four, timeout(0, -1), call(0, V_APPEND), idle),
        "tiny_timeout": ops(four, timeout(0, 1), call(0, 0), idle),
        "cancelled": ops(four, word(0, CANCEL, 1), call(0, V_APPEND), idle),
        # Hostile: the state flipped back while the call runs, the answer's words scribbled,
        # states the server ignores, a caller that sleeps, the queue header overwritten.
        "flip_back_while_running": ops(
            four,
            call(0, V_APPEND),
            word(0, STATE, SUBMITTED),
            word(0, STATE, TAKEN),
            poll,
            word(0, STATE, SUBMITTED),
            idle,
        ),
        "answer_words_scribbled": ops(
            four, call(0, 0), word(0, STATUS, 0xFFFFFFFF), word(0, STATUS + 1, 0xFFFFFFFF), idle
        ),
        "unknown_states": ops(
            four, word(0, STATE, 7), word(1, STATE, DONE), word(2, STATE, 0xFFFFFFFF), call(3, 0)
        ),
        "client_waiting": ops(four, word(1, CLIENT_WAITING, 1), call(1, V_APPEND), idle),
        "queue_header_scribbled": ops(
            four, queue_word(0, 0xFFFFFFFF), queue_word(1, 1), queue_word(2, 1), call(0, 0), idle
        ),
        "publish_without_idle": ops(four, call(0, V_APPEND), call(1, V_LSE), call(2, V_PREFILL)),
    }


def write(out_dir: Path, all_seeds: dict[str, bytes]) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for name, data in all_seeds.items():
        (out_dir / name).write_bytes(data)
    total = sum(len(d) for d in all_seeds.values())
    print(f"wrote {len(all_seeds)} seeds ({total} bytes) to {out_dir}")


def main() -> None:
    here = Path(__file__).resolve().parent
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else here / "corpus", seeds())
    write(Path(sys.argv[2]) if len(sys.argv) > 2 else here / "call_queue_corpus", queue_seeds())


if __name__ == "__main__":
    main()
