"""Python client of attnserve, a gRPC server that owns a paged KV cache and runs attention.

- Client / AsyncClient: the synchronous and the asyncio gRPC clients (client.py, aio.py), with
  deadlines and retries (RetryPolicy, retry.py); requests and results are shared (calls.py).
- AttnError and its subclasses (InvalidArgument, PoolExhausted, QueueFull, ...): errors.py.
- PageTable / AsyncPageTable / BatchCsr: per-sequence page bookkeeping and CSR page tables.
- Plan / AsyncPlan: a step's page table checked and pinned once by the server (Client.plan,
  AsyncClient.plan; plans.py).
- Router / HashRing: keeps each sequence on the server holding its pages, over several servers.
- tensors: bf16 <-> float32 and the wire Tensor message; torch_tensors: the same for torch
  (optional, imported lazily).
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

from attnserve.aio import AsyncClient
from attnserve.calls import AttentionResult, Timings
from attnserve.client import Client
from attnserve.errors import (
    AttnError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PoolExhausted,
    QueueFull,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from attnserve.pages import (
    AsyncPageAllocator,
    AsyncPageTable,
    BatchCsr,
    PageAllocator,
    PageTable,
)
from attnserve.plans import AsyncPlan, Plan
from attnserve.retry import NO_RETRIES, RetryPolicy
from attnserve.router import HashRing, Router, ServerBatch

__all__ = [
    "NO_RETRIES",
    "AsyncClient",
    "AsyncPageAllocator",
    "AsyncPageTable",
    "AsyncPlan",
    "AttentionResult",
    "AttnError",
    "BatchCsr",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "FailedPrecondition",
    "HashRing",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PageAllocator",
    "PageTable",
    "Plan",
    "PermissionDenied",
    "PoolExhausted",
    "QueueFull",
    "ResourceExhausted",
    "RetryPolicy",
    "Router",
    "ServerBatch",
    "Timings",
    "Unauthenticated",
    "Unavailable",
]
__version__ = "0.1.0"
