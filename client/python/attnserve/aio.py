"""asyncio client of attnserve.v1.AttentionService (grpc.aio), the twin of attnserve.Client.

Same methods, arguments, deadlines, retries and errors as Client (requests and results come from
attnserve.calls); every method is a coroutine. Create it inside the event loop that uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from attnserve.calls import (
    ALLOCATE_PAGES,
    CLOSE_SESSION,
    DECODE,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    FREE_PAGES,
    NEEDS_SESSION,
    OPEN_SESSION,
    PREFILL,
    SERVER_INFO,
    AttentionResult,
    Rpc,
    T,
    TensorLike,
    allocate_pages_request,
    channel_options,
    decode_request,
    free_pages_request,
    open_session_request,
    prefill_request,
    select_pool,
    with_session,
)
from attnserve.pages import BatchCsr
from attnserve.retry import DEFAULT_RETRY, NO_RETRIES, Attempts, RetryPolicy
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


class AsyncClient:
    """asyncio client of one attnserve server; `await close()` or `async with` when done.

    Arguments as in attnserve.Client. Calls from many tasks share one channel.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        session: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
    ) -> None:
        self._address = address
        self._session = session
        # A bearer token goes with every call (servers configured with access_tokens need one).
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._timeout = timeout
        self._retry = retry or NO_RETRIES
        options = channel_options(max_message_bytes)
        self._channel = (
            grpc.aio.secure_channel(address, credentials, options=options)
            if credentials
            else grpc.aio.insecure_channel(address, options=options)
        )
        self._stub = pb_grpc.AttentionServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self._address

    @property
    def session(self) -> str | None:
        """The session every call names; None until the first call that needs one opens it."""
        return self._session

    async def open_session(
        self,
        *,
        lease_s: float | None = None,
        max_pages: int | None = None,
        timeout: float | None = None,
    ) -> pb.OpenSessionResponse:
        """Opens a session and names it in every later call of this client (pass its handle,
        .session, to Client(session=...) to share it). Its pages survive reconnects and are
        reclaimed when no call renews it for lease_s (server default when None); max_pages is
        its page quota (server default when None)."""
        opened = await self._invoke(OPEN_SESSION, open_session_request(lease_s, max_pages), timeout)
        self._session = opened.session
        return opened

    async def close_session(self, *, timeout: float | None = None) -> int:
        """Closes the client's session, freeing its pages; returns how many."""
        if not self._session:
            raise ValueError("this client has no open session")
        request = pb.CloseSessionRequest(session=self._session)
        freed = await self._invoke(CLOSE_SESSION, request, timeout)
        self._session = None
        return freed

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def server_info(self, *, timeout: float | None = None) -> pb.GetServerInfoResponse:
        """Version, backend, device and every pool's geometry and occupancy."""
        return await self._invoke(SERVER_INFO, pb.GetServerInfoRequest(), timeout)

    async def pool_info(self, pool: str = "", *, timeout: float | None = None) -> pb.PoolInfo:
        """One pool's PoolInfo; pool "" selects the only pool (ValueError if there are several)."""
        return select_pool((await self.server_info(timeout=timeout)).pools, pool)

    async def allocate_pages(
        self, num_pages: int, pool: str = "", *, timeout: float | None = None
    ) -> list[int]:
        """Allocates num_pages pages (all or nothing) and returns their ids (see Client)."""
        return await self._invoke(ALLOCATE_PAGES, allocate_pages_request(num_pages, pool), timeout)

    async def free_pages(
        self, page_ids: Sequence[int], pool: str = "", *, timeout: float | None = None
    ) -> int:
        """Frees the pages (all or nothing); returns the pool's free page count after the call."""
        return await self._invoke(FREE_PAGES, free_pages_request(page_ids, pool), timeout)

    async def prefill(
        self,
        layer: int,
        q: TensorLike,
        table: BatchCsr,
        *,
        pool: str = "",
        q_pe: TensorLike | None = None,
        k_new: TensorLike | None = None,
        v_new: TensorLike | None = None,
        ckv_new: TensorLike | None = None,
        kpe_new: TensorLike | None = None,
        sm_scale: float | None = None,
        return_lse: bool = False,
        timeout: float | None = None,
    ) -> AttentionResult:
        """Appends the new K/V (when given), then runs causal paged attention (see Client)."""
        request = prefill_request(
            layer,
            q,
            table,
            pool=pool,
            q_pe=q_pe,
            k_new=k_new,
            v_new=v_new,
            ckv_new=ckv_new,
            kpe_new=kpe_new,
            sm_scale=sm_scale,
            return_lse=return_lse,
        )
        return await self.call_prefill(request, timeout=timeout)

    async def decode(
        self,
        layer: int,
        q: TensorLike,
        table: BatchCsr,
        *,
        pool: str = "",
        q_pe: TensorLike | None = None,
        k_new: TensorLike | None = None,
        v_new: TensorLike | None = None,
        ckv_new: TensorLike | None = None,
        kpe_new: TensorLike | None = None,
        sm_scale: float | None = None,
        return_lse: bool = False,
        timeout: float | None = None,
    ) -> AttentionResult:
        """One query row per sequence (see Client.decode)."""
        request = decode_request(
            layer,
            q,
            table,
            pool=pool,
            q_pe=q_pe,
            k_new=k_new,
            v_new=v_new,
            ckv_new=ckv_new,
            kpe_new=kpe_new,
            sm_scale=sm_scale,
            return_lse=return_lse,
        )
        return await self.call_decode(request, timeout=timeout)

    async def call_prefill(
        self, request: pb.PrefillRequest, *, timeout: float | None = None
    ) -> AttentionResult:
        """Sends a ready-made PrefillRequest as is."""
        return await self._invoke(PREFILL, request, timeout)

    async def call_decode(
        self, request: pb.DecodeRequest, *, timeout: float | None = None
    ) -> AttentionResult:
        """Sends a ready-made DecodeRequest as is."""
        return await self._invoke(DECODE, request, timeout)

    async def _session_for(self, rpc: Rpc[T]) -> str | None:
        """Client._session_for with an asyncio lock."""
        if self._session is None and rpc.name in NEEDS_SESSION:
            async with self.__dict__.setdefault("_open_lock", asyncio.Lock()):
                if self._session is None:
                    await self.open_session()
        return self._session

    async def _invoke(self, rpc: Rpc[T], request: object, timeout: float | None) -> T:
        """Client._invoke with asyncio waits."""
        budget = self._timeout if timeout is None else timeout
        attempts = Attempts(self._retry, rpc.name, rpc.idempotent, budget)
        method = getattr(self._stub, rpc.name)
        request = with_session(request, await self._session_for(rpc))
        while True:
            try:
                response = await method(
                    request, timeout=attempts.remaining(), metadata=self._metadata
                )
            except grpc.RpcError as e:
                await asyncio.sleep(attempts.wait_after(e))
                continue
            return rpc.decode(response)
