"""Registered memory as the server sees it, through the raw stubs: what it refuses, that a refused
call touches nothing, and that a caller who truncates its shared memory cannot take the server
down (attention.proto, "Registered memory")."""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import grpc
import numpy as np
import pytest

from attnserve.tensors import bf16_to_float, float_to_bf16, pack_tensor
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve.v1 import server_config_pb2 as config_pb

BACKEND = os.environ.get("ATTNSERVE_BACKEND", "cpu")
POOL = "p"
H, H_KV, D = 4, 1, 64
Code = grpc.StatusCode
MAGIC = b"attnserve.region"


def config(enabled: bool = True) -> config_pb.ServerConfig:
    c = config_pb.ServerConfig()
    c.pools.add(name=POOL, kind=pb.POOL_KIND_GQA, num_layers=1, page_size=16, num_qo_heads=H,
                num_kv_heads=H_KV, head_dim=D, num_pages=64)  # fmt: skip
    c.data_plane.shared_memory = enabled
    c.data_plane.cuda_ipc = enabled and BACKEND == "cuda"
    return c


class Shm:
    """A POSIX shared-memory object the test owns (not the client library's arena)."""

    def __init__(self, size: int = 1 << 16, prefix: str = "/attnserve") -> None:
        self.name = f"{prefix}-test-{secrets.token_hex(8)}"
        self.path = Path("/dev/shm") / self.name[1:]
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.key = secrets.token_bytes(32)
        self.map[: len(MAGIC) + 32] = MAGIC + self.key
        self.size = size

    def request(self, name: str = "r", session: str = "", **fields) -> pb.RegisterRegionRequest:
        r = pb.RegisterRegionRequest(name=name, size=self.size, key=self.key, session=session)
        r.shared_memory.shm_name = self.name
        for k, v in fields.items():
            setattr(r, k, v)
        return r

    def write(self, offset: int, data: bytes) -> None:
        self.map[offset : offset + len(data)] = data

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.map[offset : offset + n])

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


@pytest.fixture
def shm():
    objects: list[Shm] = []

    def make(*args, **kwargs) -> Shm:
        objects.append(Shm(*args, **kwargs))
        return objects[-1]

    yield make
    for o in objects:
        o.close()


def stub(address: str) -> pb_grpc.AttentionServiceStub:
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    return pb_grpc.AttentionServiceStub(channel)


def code_of(call) -> Code:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def q_region(name: str, offset: int) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_BF16, shape=[1, H, D],
                     region=pb.RegionSlice(name=name, offset=offset))  # fmt: skip


def decode(pages: list[int], session: str, q: pb.Tensor, **fields) -> pb.DecodeRequest:
    return pb.DecodeRequest(pool=POOL, q=q, kv_indptr=[0, 1], kv_indices=pages[:1],
                            kv_last_page_len=[1], session=session, **fields)  # fmt: skip


def kv(value: float) -> pb.Tensor:
    return pack_tensor(float_to_bf16(np.full((1, H_KV, D), value, np.float32)), pb.DTYPE_BF16)


@pytest.fixture
def plane(private):
    return private(config())


def open_with_page(s, value: float = 0.5) -> tuple[str, list[int]]:
    """A session with one page whose first token's K and V are `value`."""
    session = s.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    pages = list(s.AllocatePages(pb.AllocatePagesRequest(pool=POOL, num_pages=1, session=session),
                                 timeout=10).page_ids)  # fmt: skip
    q = pack_tensor(float_to_bf16(np.ones((1, H, D), np.float32)), pb.DTYPE_BF16)
    s.Decode(decode(pages, session, q, k_new=kv(value), v_new=kv(value)), timeout=10)
    return session, pages


def test_server_info_tells_what_is_allowed(private) -> None:
    off = stub(private(config(enabled=False)).address)
    info = off.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert not info.data_plane.shared_memory and not info.data_plane.cuda_ipc
    session = off.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    request = pb.RegisterRegionRequest(name="r", size=4096, key=bytes(32), session=session)
    request.shared_memory.shm_name = "/attnserve-x"
    assert code_of(lambda: off.RegisterRegion(request, timeout=10)) == Code.UNIMPLEMENTED


def test_registration_needs_memory_the_caller_can_write(plane, shm) -> None:
    s = stub(plane.address)
    info = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).data_plane
    assert info.shared_memory and info.shm_name_prefix == "/attnserve"
    session = s.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    mine = shm()
    cases = {
        "wrong key": (mine.request(session=session, key=bytes(32)), Code.FAILED_PRECONDITION),
        "short key": (mine.request(session=session, key=b"k"), Code.INVALID_ARGUMENT),
        "past the object's end": (mine.request(session=session, size=mine.size + 64),
                                  Code.FAILED_PRECONDITION),
        "misaligned offset": (mine.request(session=session, offset=8), Code.INVALID_ARGUMENT),
        "past the session's limit": (mine.request(session=session, offset=64, size=2**63 - 1),
                                     Code.RESOURCE_EXHAUSTED),
        "bad region name": (mine.request(name="a/b", session=session), Code.INVALID_ARGUMENT),
    }  # fmt: skip
    for what, (request, code) in cases.items():
        assert code_of(lambda r=request: s.RegisterRegion(r, timeout=10)) == code, what
    # A name outside the server's prefix is never opened, whatever it names.
    foreign = shm(prefix="/elsewhere")
    assert code_of(lambda: s.RegisterRegion(foreign.request(session=session), timeout=10)) == (
        Code.INVALID_ARGUMENT
    )
    missing = mine.request(session=session)
    missing.shared_memory.shm_name = "/attnserve-test-missing"
    assert code_of(lambda: s.RegisterRegion(missing, timeout=10)) == Code.NOT_FOUND
    # None of those left a region behind; the real one registers, twice (a retry) as one.
    assert not s.ListRegions(pb.ListRegionsRequest(session=session), timeout=10).regions
    s.RegisterRegion(mine.request(session=session), timeout=10)
    s.RegisterRegion(mine.request(session=session), timeout=10)
    regions = s.ListRegions(pb.ListRegionsRequest(session=session), timeout=10).regions
    assert [(r.name, r.size) for r in regions] == [("r", mine.size)]


def test_bad_references_change_nothing(plane, shm) -> None:
    """Every refused call would append K/V of 2.0 and write its output into the region; after
    them the region is as it was and the page still holds 0.5."""
    s = stub(plane.address)
    session, pages = open_with_page(s)
    other_session, other_pages = open_with_page(s, 0.25)
    mem = shm()
    s.RegisterRegion(mem.request(session=session), timeout=10)
    q = float_to_bf16(np.ones((1, H, D), np.float32)).tobytes()
    mem.write(4096, q)
    nan_q = bytearray(q)
    nan_q[6:8] = b"\xc0\x7f"  # element 3 is NaN
    mem.write(20480, bytes(nan_q))
    poison = b"\xee" * (H * D * 2)
    mem.write(8192, poison)
    out_to = pb.RegionSlice(name="r", offset=8192)
    big = 2**63 - 16
    cases = {
        "unregistered region": (q_region("nope", 4096), session, pages, Code.NOT_FOUND),
        "another session's region": (q_region("r", 4096), other_session, other_pages,
                                     Code.NOT_FOUND),
        "past the end": (q_region("r", mem.size - 16), session, pages, Code.INVALID_ARGUMENT),
        "offset overflow": (q_region("r", big), session, pages, Code.INVALID_ARGUMENT),
        "negative offset": (q_region("r", -16), session, pages, Code.INVALID_ARGUMENT),
        "misaligned": (q_region("r", 4100), session, pages, Code.INVALID_ARGUMENT),
        "wrong shape": (pb.Tensor(dtype=pb.DTYPE_BF16, shape=[1, H + 1, D],
                                  region=pb.RegionSlice(name="r", offset=4096)),
                        session, pages, Code.INVALID_ARGUMENT),
        "wrong dtype": (pb.Tensor(dtype=pb.DTYPE_FP32, shape=[1, H, D],
                                  region=pb.RegionSlice(name="r", offset=4096)),
                        session, pages, Code.INVALID_ARGUMENT),
        "data and region": (pb.Tensor(dtype=pb.DTYPE_BF16, shape=[1, H, D], data=q,
                                      region=pb.RegionSlice(name="r", offset=4096)),
                            session, pages, Code.INVALID_ARGUMENT),
        "another session's page": (q_region("r", 4096), session, other_pages,
                                   Code.FAILED_PRECONDITION),
        "NaN in q": (q_region("r", 20480), session, pages, Code.INVALID_ARGUMENT),
    }  # fmt: skip
    for what, (tensor, who, table, code) in cases.items():
        request = decode(table, who, tensor, k_new=kv(2.0), v_new=kv(2.0), output_to=out_to)
        assert code_of(lambda r=request: s.Decode(r, timeout=10)) == code, what
        assert mem.read(8192, len(poison)) == poison, what
    lse_without = decode(pages, session, q_region("r", 4096), output_to=out_to,
                         lse_to=pb.RegionSlice(name="r", offset=12288))  # fmt: skip
    assert code_of(lambda: s.Decode(lse_without, timeout=10)) == Code.INVALID_ARGUMENT
    # Nothing was appended: one key, so the output is its value.
    reply = s.Decode(decode(pages, session, q_region("r", 4096), output_to=out_to), timeout=10)
    assert reply.output.region == out_to and not reply.output.data
    out = bf16_to_float(np.frombuffer(mem.read(8192, len(poison)), np.uint16).reshape(1, H, D))
    np.testing.assert_array_equal(out, np.full((1, H, D), 0.5, np.float32))


def test_page_tables_in_regions(plane, shm) -> None:
    s = stub(plane.address)
    session, pages = open_with_page(s)
    mem = shm()
    s.RegisterRegion(mem.request(session=session), timeout=10)
    mem.write(4096, float_to_bf16(np.ones((1, H, D), np.float32)).tobytes())
    table = np.array([0, 1, 1, pages[0]], "<i4").tobytes()  # kv_indptr, last_page_len, indices
    mem.write(256, table)
    ref = pb.PageTableRef(at=pb.RegionSlice(name="r", offset=256), batch=1, num_pages=1)
    q = q_region("r", 4096)
    reply = s.Decode(pb.DecodeRequest(pool=POOL, q=q, page_table=ref, session=session), timeout=10)
    out = bf16_to_float(np.frombuffer(reply.output.data, np.uint16).reshape(1, H, D))
    np.testing.assert_array_equal(out, np.full((1, H, D), 0.5, np.float32))
    both = pb.DecodeRequest(pool=POOL, q=q, page_table=ref, kv_indptr=[0, 1], session=session)
    assert code_of(lambda: s.Decode(both, timeout=10)) == Code.INVALID_ARGUMENT
    # A table naming another session's page is refused like the same table in the message.
    other_session, other_pages = open_with_page(s)
    mem.write(256, np.array([0, 1, 1, other_pages[0]], "<i4").tobytes())
    request = pb.DecodeRequest(pool=POOL, q=q, page_table=ref, session=session)
    assert code_of(lambda: s.Decode(request, timeout=10)) == Code.FAILED_PRECONDITION
    huge = pb.PageTableRef(at=ref.at, batch=1, num_pages=2**24 + 1)
    request = pb.DecodeRequest(pool=POOL, q=q, page_table=huge, session=session)
    assert code_of(lambda: s.Decode(request, timeout=10)) == Code.INVALID_ARGUMENT


def test_a_truncated_region_fails_its_calls_and_the_server_lives(plane, shm) -> None:
    s = stub(plane.address)
    session, pages = open_with_page(s)
    mem = shm()
    s.RegisterRegion(mem.request(session=session), timeout=10)
    os.ftruncate(mem.fd, 0)  # the owner pulls the memory from under the server
    request = decode(pages, session, q_region("r", 4096))
    assert code_of(lambda: s.Decode(request, timeout=10)) == Code.FAILED_PRECONDITION
    assert code_of(lambda: s.Decode(request, timeout=10)) == Code.FAILED_PRECONDITION
    # The server is alive and serves the same session over bytes.
    q = pack_tensor(float_to_bf16(np.ones((1, H, D), np.float32)), pb.DTYPE_BF16)
    reply = s.Decode(decode(pages, session, q), timeout=10)
    out = bf16_to_float(np.frombuffer(reply.output.data, np.uint16).reshape(1, H, D))
    np.testing.assert_array_equal(out, np.full((1, H, D), 0.5, np.float32))
    s.UnregisterRegion(pb.UnregisterRegionRequest(name="r", session=session), timeout=10)


def test_cuda_ipc_handles_that_do_not_open_are_refused(plane) -> None:
    s = stub(plane.address)
    session = s.OpenSession(pb.OpenSessionRequest(), timeout=10).session
    info = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).data_plane
    assert info.cuda_ipc == (BACKEND == "cuda")

    def register(handle: bytes) -> Code:
        request = pb.RegisterRegionRequest(name="g", size=4096, key=bytes(32), session=session)
        request.cuda_ipc.handle = handle
        return code_of(lambda: s.RegisterRegion(request, timeout=10))

    if BACKEND != "cuda":
        assert register(secrets.token_bytes(64)) == Code.UNIMPLEMENTED
        return
    assert register(secrets.token_bytes(64)) == Code.FAILED_PRECONDITION  # opens nothing
    assert register(b"short") == Code.INVALID_ARGUMENT
    # The server still serves (a failed open is not a sticky CUDA error).
    assert s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).backend == "cuda"
    session_, pages = open_with_page(s)
    assert pages
