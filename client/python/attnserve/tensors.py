"""Tensor helpers: bf16 <-> float32 conversion and the wire `Tensor` message.

bf16 values are held in numpy as uint16 bit patterns (numpy has no bfloat16). On the wire a
Tensor is dtype + shape + raw bytes, row-major and little-endian (attention.proto).

When ml_dtypes is installed (`pip install attnserve[fast]`) the conversions run through its
bfloat16 casts, about 10x faster than the bit arithmetic below and with the same bits: its
float32 -> bf16 cast rounds to nearest even like ours but makes every NaN the canonical quiet
NaN, so NaNs (rare; found with one BLAS dot product) are redone here to keep their payload.
ATTNSERVE_NO_ML_DTYPES=1 selects the numpy path.
"""

from __future__ import annotations

import math
import os

import numpy as np
import numpy.typing as npt

from attnserve.v1 import attention_pb2 as pb

# Wire element type of each DType, little-endian regardless of the host.
_WIRE_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_BF16: np.dtype("<u2"),
    pb.DTYPE_FP16: np.dtype("<f2"),
    pb.DTYPE_FP32: np.dtype("<f4"),
}

_ROUNDING_BIAS = np.uint32(0x7FFF)
_BF16_QUIET_NAN_BIT = np.uint16(0x0040)


def _ml_dtypes_bfloat16() -> np.dtype | None:
    if os.environ.get("ATTNSERVE_NO_ML_DTYPES"):
        return None
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


# ml_dtypes' bfloat16, or None (not installed, or ATTNSERVE_NO_ML_DTYPES set).
BFLOAT16: np.dtype | None = _ml_dtypes_bfloat16()


def float_to_bf16(x: npt.ArrayLike) -> np.ndarray:
    """Rounds float values to bf16 (nearest, ties to even); returns the uint16 bit patterns.

    NaN stays NaN (sign and payload kept, quiet bit set), +-inf stays +-inf, and finite values
    beyond the bf16 range round to +-inf as IEEE rounding does.
    """
    f = np.asarray(x, dtype=np.float32)
    out = np.empty(f.shape, dtype=np.uint16)
    float_to_bf16_into(f, out)
    return out


def float_to_bf16_into(x: npt.ArrayLike, out: np.ndarray) -> None:
    """float_to_bf16 written into `out`, a uint16 array of x's shape (e.g. a view into shared
    memory), without a temporary of the result when ml_dtypes is installed."""
    f = np.asarray(x, dtype=np.float32)
    if out.dtype != np.uint16 or out.shape != f.shape:
        raise ValueError(f"out must be uint16 of shape {f.shape}, got {out.dtype} {out.shape}")
    if BFLOAT16 is None:
        out[...] = _float_to_bf16_numpy(f)
        return
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow are intended here
        np.copyto(out.view(BFLOAT16), f, casting="unsafe")
        flat = f.reshape(-1)
        # Exactly when f has a NaN: squares are >= 0 or +inf, whose sums are never NaN.
        has_nan = flat.size > 0 and np.isnan(np.dot(flat, flat))
    if has_nan:
        nan = np.isnan(f)
        out[nan] = _float_to_bf16_numpy(f[nan])


def _float_to_bf16_numpy(f: np.ndarray) -> np.ndarray:
    """float_to_bf16 in numpy bit arithmetic (f: float32)."""
    f = np.asarray(f, dtype=np.float32, order="C")
    bits = f.view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + _ROUNDING_BIAS + lsb) >> np.uint32(16)).astype(np.uint16)
    truncated_nan = (bits >> np.uint32(16)).astype(np.uint16) | _BF16_QUIET_NAN_BIT
    return np.where(np.isnan(f), truncated_nan, rounded)


def bf16_to_float(bits: npt.ArrayLike) -> np.ndarray:
    """Widens bf16 bit patterns (uint16) to float32 exactly."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16 bit patterns must be uint16, got {b.dtype}")
    if BFLOAT16 is not None:
        return b.view(BFLOAT16).astype(np.float32)
    return _bf16_to_float_numpy(b)


def _bf16_to_float_numpy(b: np.ndarray) -> np.ndarray:
    """bf16_to_float in numpy bit arithmetic (b: uint16)."""
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_round(x: npt.ArrayLike) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (what the server sees after conversion)."""
    return bf16_to_float(float_to_bf16(x))


def pack_tensor(array: npt.ArrayLike, dtype: int = pb.DTYPE_BF16) -> pb.Tensor:
    """Builds a Tensor message from a numpy array.

    For DTYPE_BF16 a uint16 array is taken as raw bf16 bits and a floating array is rounded to
    bf16. For DTYPE_FP16 / DTYPE_FP32 a floating array is cast to that type.
    """
    a = np.asarray(array)
    wire = _wire_dtype(dtype)
    if a.dtype == np.uint16 and dtype == pb.DTYPE_BF16:
        data = a.astype(wire)
    elif a.dtype.kind != "f":
        raise TypeError(f"cannot pack a {a.dtype} array as {pb.DType.Name(dtype)}")
    elif dtype == pb.DTYPE_BF16:
        data = float_to_bf16(a).astype(wire)
    else:
        data = a.astype(wire)
    return pb.Tensor(dtype=dtype, shape=a.shape, data=np.ascontiguousarray(data).tobytes())


def unpack_tensor(tensor: pb.Tensor) -> np.ndarray:
    """Decodes a Tensor message into a float32 numpy array of its shape."""
    values = wire_array(tensor)
    if tensor.dtype == pb.DTYPE_BF16:
        return bf16_to_float(values)
    return values.astype(np.float32, copy=False)


def wire_array(tensor: pb.Tensor) -> np.ndarray:
    """A Tensor message's elements as stored, in a new native-order array of its shape:
    uint16 bf16 bit patterns, float16 or float32. Nothing is converted, so bf16 stays exact
    (attnserve.torch_tensors reinterprets these bits as a torch.bfloat16 tensor)."""
    wire = _wire_dtype(tensor.dtype)
    shape = tuple(tensor.shape)
    expected = math.prod(shape) * wire.itemsize
    if len(tensor.data) != expected:
        raise ValueError(
            f"tensor data has {len(tensor.data)} bytes, shape {list(shape)} of "
            f"{pb.DType.Name(tensor.dtype)} needs {expected}"
        )
    return np.frombuffer(tensor.data, dtype=wire).reshape(shape).astype(wire.newbyteorder("="))


def _wire_dtype(dtype: int) -> np.dtype:
    try:
        return _WIRE_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {dtype}") from None
