"""torch tensor helpers. torch is optional: it is imported only by the functions that need it,
and never by `import attnserve`.

- pack_torch: q / k / v given as torch tensors. A bf16 tensor travels as its own bits: its
  storage is reinterpreted as int16 on the CPU, no float32 round trip. Other floating tensors
  are rounded to bf16 by torch (nearest even) on their own device first, then copied.
- tensor_to_torch: a response Tensor as a torch tensor; bf16 output becomes torch.bfloat16 from
  its bits, fp32 lse torch.float32. AttentionResult.output_torch() / lse_torch() use it.

The clients call pack_torch for every argument that is_torch_tensor recognizes, so torch tensors
can be passed wherever numpy arrays can.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from attnserve.tensors import pack_tensor, wire_array
from attnserve.v1 import attention_pb2 as pb

if TYPE_CHECKING:
    import torch


def is_torch_tensor(value: object) -> bool:
    """Whether value is a torch.Tensor, without importing torch (not imported: not a tensor)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def pack_torch(tensor: torch.Tensor) -> pb.Tensor:
    """A bf16 Tensor message of a floating torch tensor on any device (see the module doc)."""
    torch = _import_torch()
    if not tensor.is_floating_point():
        raise TypeError(f"cannot send a {tensor.dtype} tensor as bf16: pass a floating tensor")
    bf16 = tensor.detach().to(torch.bfloat16).cpu().contiguous()
    return pack_tensor(bf16.view(torch.int16).numpy().view(np.uint16), pb.DTYPE_BF16)


def tensor_to_torch(tensor: pb.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A Tensor message as a torch tensor of its shape on device (default CPU).

    bf16 becomes torch.bfloat16 with the exact bits sent; fp16 and fp32 keep their type.
    """
    torch = _import_torch()
    values = wire_array(tensor)
    if tensor.dtype == pb.DTYPE_BF16:
        out = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(values)
    return out if device is None else out.to(device)


def _import_torch() -> ModuleType:
    try:
        import torch
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "attnserve's torch helpers need PyTorch, which attnserve does not install: "
            "pip install torch"
        ) from e
    return torch
