"""Synchronous client of attnserve.v1.AttentionService (AsyncClient in aio.py is its asyncio twin).

Every call carries a deadline (the client's default timeout unless one is given; it covers the
retries too), send and receive message limits are raised to max_message_bytes (gRPC's default of
4 MiB is too small for prefill batches), and failed attempts are retried as attnserve.retry
describes. Server errors surface as AttnError subclasses (attnserve.errors).
"""

from __future__ import annotations

import threading
import time
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


class Client:
    """Client of one attnserve server. Thread-safe (gRPC channels are); close() when done.

    timeout: default budget of a call in seconds, retries included. retry: the RetryPolicy
    (None: never retry). session: a session handle every call names (open_session() sets one).
    credentials: grpc channel credentials for TLS (e.g. grpc.ssl_channel_credentials(root_ca,
    client_key, client_cert) for mutual TLS); None: plaintext. token: a bearer token sent with
    every call.
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
            grpc.secure_channel(address, credentials, options=options)
            if credentials
            else grpc.insecure_channel(address, options=options)
        )
        self._stub = pb_grpc.AttentionServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self._address

    @property
    def session(self) -> str | None:
        """The session every call names; None until the first call that needs one opens it."""
        return self._session

    def open_session(
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
        opened = self._invoke(OPEN_SESSION, open_session_request(lease_s, max_pages), timeout)
        self._session = opened.session
        return opened

    def close_session(self, *, timeout: float | None = None) -> int:
        """Closes the client's session, freeing its pages; returns how many."""
        if not self._session:
            raise ValueError("this client has no open session")
        request = pb.CloseSessionRequest(session=self._session)
        freed = self._invoke(CLOSE_SESSION, request, timeout)
        self._session = None
        return freed

    def _session_for(self, rpc: Rpc[T]) -> str | None:
        """The session a call of rpc names: the client's, opened (server defaults) by the first
        call that needs one. Concurrent first calls open one session between them."""
        if self._session is None and rpc.name in NEEDS_SESSION:
            with self.__dict__.setdefault("_open_lock", threading.Lock()):
                if self._session is None:
                    self.open_session()
        return self._session

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def server_info(self, *, timeout: float | None = None) -> pb.GetServerInfoResponse:
        """Version, backend, device and every pool's geometry and occupancy."""
        return self._invoke(SERVER_INFO, pb.GetServerInfoRequest(), timeout)

    def pool_info(self, pool: str = "", *, timeout: float | None = None) -> pb.PoolInfo:
        """One pool's PoolInfo; pool "" selects the only pool (ValueError if there are several)."""
        return select_pool(self.server_info(timeout=timeout).pools, pool)

    def allocate_pages(
        self, num_pages: int, pool: str = "", *, timeout: float | None = None
    ) -> list[int]:
        """Allocates num_pages pages (all or nothing) and returns their ids.

        PoolExhausted when the pool has fewer free pages. Not retried on Unavailable (a lost
        reply would leak the pages; attnserve.retry).
        """
        return self._invoke(ALLOCATE_PAGES, allocate_pages_request(num_pages, pool), timeout)

    def free_pages(
        self, page_ids: Sequence[int], pool: str = "", *, timeout: float | None = None
    ) -> int:
        """Frees the pages (all or nothing); returns the pool's free page count after the call."""
        return self._invoke(FREE_PAGES, free_pages_request(page_ids, pool), timeout)

    def prefill(
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
        """Appends the new K/V (when given), then runs causal paged attention for every query row.

        GQA: q [total_q, H, D], k_new/v_new [total_q, H_kv, D]. MLA: q is q_nope
        [total_q, H, 512], q_pe [total_q, H, 64], ckv_new [total_q, 512], kpe_new [total_q, 64].
        Tensors are numpy arrays, torch tensors or Tensor messages (TensorLike).
        table is the page table after the append; its qo_indptr splits the query rows.
        """
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
        return self.call_prefill(request, timeout=timeout)

    def decode(
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
        """One query row per sequence (q [batch, ...]); table.qo_indptr is not sent.

        Arguments as in prefill(); the new K/V of a sequence is written at position kv_len - 1.
        """
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
        return self.call_decode(request, timeout=timeout)

    def call_prefill(
        self, request: pb.PrefillRequest, *, timeout: float | None = None
    ) -> AttentionResult:
        """Sends a ready-made PrefillRequest as is (e.g. to test the server's validation)."""
        return self._invoke(PREFILL, request, timeout)

    def call_decode(
        self, request: pb.DecodeRequest, *, timeout: float | None = None
    ) -> AttentionResult:
        """Sends a ready-made DecodeRequest as is."""
        return self._invoke(DECODE, request, timeout)

    def _invoke(self, rpc: Rpc[T], request: object, timeout: float | None) -> T:
        """Runs rpc with retries (attnserve.retry) within one deadline; decodes the response."""
        budget = self._timeout if timeout is None else timeout
        attempts = Attempts(self._retry, rpc.name, rpc.idempotent, budget)
        method = getattr(self._stub, rpc.name)
        request = with_session(request, self._session_for(rpc))
        while True:
            try:
                response = method(request, timeout=attempts.remaining(), metadata=self._metadata)
            except grpc.RpcError as e:
                time.sleep(attempts.wait_after(e))
                continue
            return rpc.decode(response)
