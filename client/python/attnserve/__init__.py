"""Python client of attnserve, a gRPC server that owns a paged KV cache and runs attention.

- Client / AttnError: the synchronous gRPC client (client.py).
- PageTable / BatchCsr: per-sequence page bookkeeping and CSR page tables (pages.py).
- tensors: bf16 <-> float32 and the wire Tensor message.
- reference: a numpy reference of the attention contract and the tolerance check.
The gRPC/protobuf stubs live in attnserve.v1, generated at build time from proto/.
"""

try:
    from attnserve.v1 import attention_pb2 as _attention_pb2  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "attnserve.v1 stubs are missing: install with `pip install ./client/python` (or `-e`), "
        "or generate them with `cd client/python && python setup.py build_py --inplace`"
    ) from e

from attnserve.client import AttentionResult, AttnError, Client, Timings
from attnserve.pages import BatchCsr, PageAllocator, PageTable

__all__ = [
    "AttentionResult",
    "AttnError",
    "BatchCsr",
    "Client",
    "PageAllocator",
    "PageTable",
    "Timings",
]
__version__ = "0.1.0"
