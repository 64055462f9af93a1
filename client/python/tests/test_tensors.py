"""bf16 conversion and Tensor packing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from attnserve import tensors
from attnserve.tensors import (
    bf16_round,
    bf16_to_float,
    float_to_bf16,
    pack_tensor,
    unpack_tensor,
    wire_array,
)
from attnserve.v1 import attention_pb2 as pb

try:
    import ml_dtypes
except ImportError:  # the numpy path is tested alone
    ml_dtypes = None

CONVERSIONS = ["numpy"] + (["ml_dtypes"] if ml_dtypes is not None else [])


@pytest.fixture(autouse=True, params=CONVERSIONS)
def conversion(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of this file runs on the numpy path and, when installed, on ml_dtypes."""
    bf16 = np.dtype(ml_dtypes.bfloat16) if request.param == "ml_dtypes" else None
    monkeypatch.setattr(tensors, "BFLOAT16", bf16)
    return request.param


def _float32_edge_cases() -> np.ndarray:
    """Every bf16 pattern with the low 16 bits that decide the rounding: exact, just above,
    just below and at the tie, the largest, and two arbitrary ones. Covers +-0, subnormals,
    ties to even both ways, the largest finite values rounding to inf, +-inf and NaNs with and
    without payload, quiet and signalling."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xC001], dtype=np.uint32)
    return (high[:, None] | low[None, :]).reshape(-1).view(np.float32)


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
def test_ml_dtypes_conversion_is_bit_identical_to_numpy(conversion: str) -> None:
    rng = np.random.default_rng(7)
    random_bits = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    for x in (_float32_edge_cases(), random_bits.view(np.float32),
              rng.standard_normal((3, 5, 7)).astype(np.float32)):  # fmt: skip
        expected = tensors._float_to_bf16_numpy(x)
        assert expected.dtype == np.uint16
        np.testing.assert_array_equal(float_to_bf16(x), expected)
        out = np.zeros(x.shape, np.uint16)
        tensors.float_to_bf16_into(x, out)
        np.testing.assert_array_equal(out, expected)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    widened = bf16_to_float(every)
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(
        widened.view(np.uint32), tensors._bf16_to_float_numpy(every).view(np.uint32)
    )


def test_nan_payload_is_kept_on_both_paths() -> None:
    x = np.array([0x7F812345, 0xFFA00000, 0x7FC10000], dtype=np.uint32).view(np.float32)
    assert [hex(b) for b in float_to_bf16(x)] == ["0x7fc1", "0xffe0", "0x7fc1"]


def test_float_to_bf16_into_checks_its_output() -> None:
    with pytest.raises(ValueError, match="uint16 of shape"):
        tensors.float_to_bf16_into(np.zeros(3, np.float32), np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="uint16 of shape"):
        tensors.float_to_bf16_into(np.zeros(3, np.float32), np.zeros(3, np.int16))


@pytest.mark.parametrize(
    ("value", "bits"),
    [
        (1.0, 0x3F80),
        (-2.5, 0xC020),
        (0.0, 0x0000),
        (-0.0, 0x8000),
        (1.0 + 2**-8, 0x3F80),  # tie between 0x3F80 and 0x3F81: to even (down)
        (1.0 + 3 * 2**-8, 0x3F82),  # tie between 0x3F81 and 0x3F82: to even (up)
        (1.0 + 2**-8 + 2**-20, 0x3F81),  # just above the tie: up
        (np.inf, 0x7F80),
        (-np.inf, 0xFF80),
        (3.4e38, 0x7F80),  # beyond the largest bf16: rounds to inf
        (3.3895314e38, 0x7F7F),  # the largest bf16
        (2**-133, 0x0001),  # smallest bf16 subnormal
    ],
)
def test_float_to_bf16_rounds_to_nearest_even(value: float, bits: int) -> None:
    assert float_to_bf16(np.float32(value)) == bits


def test_nan_stays_nan_with_its_sign() -> None:
    # 0x7F800001 truncates to 0x7F80 (inf) without the quiet bit.
    x = np.array([0x7F800001, 0xFFC00000, 0x7FC00000], dtype=np.uint32).view(np.float32)
    out = float_to_bf16(x)
    assert np.isnan(bf16_to_float(out)).all()
    assert list(out >> 15) == [0, 1, 0]


def test_every_bf16_value_round_trips() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = np.isfinite(bf16_to_float(bits))
    assert (float_to_bf16(bf16_to_float(bits))[finite] == bits[finite]).all()


def test_bf16_round_error_is_at_most_half_an_ulp() -> None:
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32)
    rel = np.abs(bf16_round(x) - x) / np.abs(x)
    assert rel.max() <= 2.0**-8


def test_bf16_to_float_needs_uint16() -> None:
    with pytest.raises(TypeError):
        bf16_to_float(np.zeros(3, dtype=np.int32))


@pytest.mark.parametrize(
    ("dtype", "itemsize"), [(pb.DTYPE_BF16, 2), (pb.DTYPE_FP16, 2), (pb.DTYPE_FP32, 4)]
)
def test_pack_unpack_round_trip(dtype: int, itemsize: int) -> None:
    x = bf16_round(np.random.default_rng(1).standard_normal((3, 4, 5)).astype(np.float32))
    t = pack_tensor(x, dtype)
    assert t.dtype == dtype
    assert list(t.shape) == [3, 4, 5]
    assert len(t.data) == 60 * itemsize
    np.testing.assert_array_equal(unpack_tensor(t), x)  # bf16 values are exact in all three
    assert unpack_tensor(t).dtype == np.float32


def test_pack_is_row_major_little_endian() -> None:
    x = np.array([[1.0, 2.0], [3.0, -1.0]], dtype=np.float32)
    assert pack_tensor(x.T, pb.DTYPE_FP32).data == np.array([1, 3, 2, -1], "<f4").tobytes()
    assert pack_tensor(x, pb.DTYPE_BF16).data == bytes.fromhex("803f 0040 4040 80bf")


def test_pack_takes_uint16_as_raw_bf16() -> None:
    bits = np.array([0x3F80, 0x7FC1], dtype=np.uint16)
    assert pack_tensor(bits).data == bytes.fromhex("803f c17f")


@pytest.mark.parametrize(
    ("array", "dtype"),
    [(np.zeros(2, np.int32), pb.DTYPE_BF16), (np.zeros(2, np.uint16), pb.DTYPE_FP32)],
)
def test_pack_rejects_ambiguous_arrays(array: np.ndarray, dtype: int) -> None:
    with pytest.raises(TypeError):
        pack_tensor(array, dtype)


def test_unpack_checks_data_length_and_dtype() -> None:
    with pytest.raises(ValueError, match="needs 12"):
        unpack_tensor(pb.Tensor(dtype=pb.DTYPE_BF16, shape=[2, 3], data=b"\0" * 10))
    with pytest.raises(ValueError, match="dtype"):
        unpack_tensor(pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0\0"))


def test_scalar_and_empty_tensors() -> None:
    assert unpack_tensor(pack_tensor(np.float32(2.0))).shape == ()
    empty = pack_tensor(np.zeros((0, 4), np.float32))
    assert unpack_tensor(empty).shape == (0, 4)


@pytest.mark.parametrize(
    ("dtype", "numpy_dtype"),
    [(pb.DTYPE_BF16, np.uint16), (pb.DTYPE_FP16, np.float16), (pb.DTYPE_FP32, np.float32)],
)
def test_wire_array_gives_the_elements_as_stored(dtype: int, numpy_dtype: type) -> None:
    x = bf16_round(np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32))
    raw = wire_array(pack_tensor(x, dtype))
    assert raw.dtype == numpy_dtype and raw.shape == (2, 3) and raw.flags.writeable
    expected = float_to_bf16(x) if dtype == pb.DTYPE_BF16 else x.astype(numpy_dtype)
    np.testing.assert_array_equal(raw, expected)


def test_bf16_storage_seen_as_int16_round_trips_bit_exactly() -> None:
    """What the torch helpers do: a bf16 tensor's storage viewed as int16 (torch has no uint16
    views) is sent as its bits, and a bf16 response comes back as int16 storage."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    storage = bits.view(np.int16)  # torch: tensor.view(torch.int16).numpy()
    message = pack_tensor(storage.view(np.uint16))
    assert message.data == bits.astype("<u2").tobytes()
    np.testing.assert_array_equal(wire_array(message).view(np.int16), storage)
    x = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    assert pack_tensor(float_to_bf16(x).view(np.int16).view(np.uint16)).data == pack_tensor(x).data


def test_importing_attnserve_does_not_import_torch() -> None:
    code = "import sys, attnserve; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
