"""Synchronous client of attnserve.v1.AttentionService (AsyncClient in aio.py is its asyncio twin).

Every call carries a deadline (the client's default timeout unless one is given; it covers the
retries too, and waiting for a server that is not reachable yet: wait_for_ready), send and
receive message limits are raised to max_message_bytes (gRPC's default of
4 MiB is too small for prefill batches), and failed attempts are retried as attnserve.retry
describes. Server errors surface as AttnError subclasses (attnserve.errors).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from attnserve.call_queue import DECODE as DECODE_METHOD
from attnserve.call_queue import PREFILL as PREFILL_METHOD
from attnserve.call_queue import CallQueue, QueueClosed
from attnserve.calls import (
    ALLOCATE_PAGES,
    CLOSE_SESSION,
    CREATE_PLAN,
    DECODE,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    FREE_PAGES,
    LIST_REGIONS,
    NEEDS_SESSION,
    OPEN_SESSION,
    PREFILL,
    REGISTER_REGION,
    RELEASE_PLAN,
    SERVER_INFO,
    UNREGISTER_REGION,
    AttentionResult,
    Rpc,
    T,
    TableLike,
    TensorLike,
    allocate_pages_request,
    attention_request,
    channel_options,
    create_plan_request,
    free_pages_request,
    open_session_request,
    select_pool,
    with_session,
)
from attnserve.errors import AttnError, error_for
from attnserve.pages import BatchCsr
from attnserve.plans import Plan, PlanBook
from attnserve.prepared import PreparedCall, rpc_for
from attnserve.regions import DEFAULT_ARENA_BYTES, DEFAULT_SHM_PREFIX
from attnserve.retry import DEFAULT_RETRY, NO_RETRIES, Attempts, RetryPolicy
from attnserve.transport import NeedArena, StagedCall, StagedPageTable, Transport, plane_may_free
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


class Client:
    """Client of one attnserve server. Thread-safe (gRPC channels are); close() when done.

    timeout: default budget of a call in seconds, retries included. retry: the RetryPolicy
    (None: never retry). session: a session handle every call names (open_session() sets one).
    credentials: grpc channel credentials for TLS (e.g. grpc.ssl_channel_credentials(root_ca,
    client_key, client_cert) for mutual TLS); None: plaintext. token: a bearer token sent with
    every call. wait_for_ready: an attempt made while the server cannot be reached (not started
    yet, restarting) waits for the connection until its deadline instead of failing at once
    with Unavailable (gRPC's wait-for-ready; nothing is sent before the connection is up, so
    this is safe for every method); False fails fast, e.g. to try another server.
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
        wait_for_ready: bool = True,
        transport: str = "auto",
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        shm_prefix: str = DEFAULT_SHM_PREFIX,
        shm_mode: int = 0o600,
        call_queue: bool | None = None,
    ) -> None:
        self._address = address
        # None: Decode/Prefill whose tensors are in shared memory go through a call queue when
        # the server offers one (attnserve.call_queue); False: always gRPC; True: the queue.
        self._call_queue_wanted = call_queue
        self._call_queue: CallQueue | None = None
        self._call_queue_lock = threading.Lock()
        self._wait_for_ready = wait_for_ready
        self._transport = Transport(
            transport, address, arena_bytes=arena_bytes, shm_prefix=shm_prefix, shm_mode=shm_mode
        )
        self._arena_lock = threading.Lock()
        self._session = session
        self._plans = PlanBook()  # the plans made in the session, by name
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
        self._release_regions(unregister=True)  # they belonged to the previous session
        self._plans.clear()  # so did its plans
        self._session = opened.session
        return opened

    def close_session(self, *, timeout: float | None = None) -> int:
        """Closes the client's session, freeing its pages; returns how many."""
        if not self._session:
            raise ValueError("this client has no open session")
        request = pb.CloseSessionRequest(session=self._session)
        freed = self._invoke(CLOSE_SESSION, request, timeout)
        self._release_regions(unregister=False)  # the session's regions went with it
        self._plans.clear()  # and its plans
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
        """Unregisters and frees the client's regions, then closes the channel."""
        self._release_regions(unregister=True)
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
        table: TableLike,
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
        request, tensors = attention_request(
            PREFILL,
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
        return self._attend(PREFILL, request, tensors, timeout)

    def decode(
        self,
        layer: int,
        q: TensorLike,
        table: TableLike,
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
        request, tensors = attention_request(
            DECODE,
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
        return self._attend(DECODE, request, tensors, timeout)

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

    # ---- registered memory (attnserve.transport)

    @property
    def transport(self) -> Transport:
        """The client's data plane: its transport setting, arenas and what they hold."""
        return self._transport

    def stage_page_table(self, table: BatchCsr, *, timeout: float | None = None) -> StagedPageTable:
        """Writes a page table into shared memory once, for the calls of one step (every layer):
        pass the result as their `table`, and release() it (or use `with`) after the step.
        Without shared memory it holds the arrays, which then travel in each call."""
        plane = self._transport
        if plane.needs_server_info:
            plane.resolve(self.server_info(timeout=timeout))
        while True:
            try:
                return plane.stage_page_table(table)
            except NeedArena as need:
                if not self._add_arena(need, timeout):
                    return StagedPageTable(table)

    def plan(
        self,
        table: BatchCsr | StagedPageTable,
        *,
        op: str = "decode",
        name: str = "step",
        pool: str = "",
        timeout: float | None = None,
    ) -> Plan:
        """Has the server check and pin `table` once for the "decode" or "prefill" calls of one
        step (attnserve.plans): pass the result as their `table`. A plan of the same name is
        replaced, so a scheduler plans each step under one name and then frees the pages of the
        sequences that finished. A staged table (stage_page_table) is read from shared memory."""
        prefill = rpc_for(op) is PREFILL
        request = create_plan_request(table, name, prefill, pool)
        response = self._invoke(CREATE_PLAN, request, timeout)
        plan = Plan(self.release_plan, name, prefill, response)
        self._plans.add(plan)  # the plan it replaced must not be used or released any more
        return plan

    def release_plan(self, name: str, *, timeout: float | None = None) -> None:
        """Drops the session's plan `name` (NotFound when there is none)."""
        self._plans.drop(name)
        self._invoke(RELEASE_PLAN, pb.ReleasePlanRequest(name=name), timeout)

    def register_region(
        self, request: pb.RegisterRegionRequest, *, timeout: float | None = None
    ) -> pb.RegionInfo:
        """Registers memory the caller manages itself (its header written: attnserve.regions);
        the transports register their own arenas. Not retried on Unavailable."""
        return (self._invoke(REGISTER_REGION, request, timeout)).region

    def unregister_region(self, name: str, *, timeout: float | None = None) -> None:
        """Unregisters a region of the session (FailedPrecondition while a call uses it)."""
        self._invoke(UNREGISTER_REGION, pb.UnregisterRegionRequest(name=name), timeout)

    def list_regions(self, *, timeout: float | None = None) -> list[pb.RegionInfo]:
        """The regions the server holds for the client's session."""
        return self._invoke(LIST_REGIONS, pb.ListRegionsRequest(), timeout)

    def _attend(
        self, rpc: Rpc[AttentionResult], request: object, tensors: dict, timeout: float | None
    ) -> AttentionResult:
        """Stages the tensors (transport), sends the call, reads the outputs back."""
        staged = self._stage(request, tensors, timeout)
        try:
            result = self._send(rpc, staged.request, bool(staged.blocks), timeout)
        except BaseException as e:
            staged.abandon(e)
            raise
        return staged.finish(result)

    def _stage(self, request: Any, tensors: dict, timeout: float | None) -> StagedCall:
        """The request with its tensors in arenas (registered as needed) or in the message."""
        plane = self._transport
        if plane.needs_server_info:
            plane.resolve(self.server_info(timeout=timeout))
        as_bytes = False
        while True:
            try:
                return plane.stage_call(request, tensors, as_bytes=as_bytes)
            except NeedArena as need:
                as_bytes = not self._add_arena(need, timeout)

    def _send(
        self,
        rpc: Rpc[AttentionResult],
        request: Any,
        in_regions: bool,
        timeout: float | None,
        serialized: bytes | None = None,
    ) -> AttentionResult:
        """One Prefill/Decode: through the call queue when its tensors are in regions and the
        server offers one, else over gRPC. `serialized`: the request's bytes, when the caller
        already has them (session included)."""
        queue = self._queue_for_call() if in_regions else None
        if queue is not None:
            result = self._queue_call(queue, rpc, request, timeout, serialized)
            if result is not None:
                return result
        send = self.call_prefill if rpc is PREFILL else self.call_decode
        return send(request, timeout=timeout)

    def prepare(
        self,
        op: str,
        q: TensorLike,
        table: TableLike,
        *,
        layer: int = 0,
        timeout: float | None = None,
        **inputs: Any,
    ) -> PreparedCall:
        """Stages a "decode" or "prefill" call once for many runs (attnserve.prepared): the
        tensors given are copied into fixed slices of an arena, whose views the caller rewrites
        between runs. inputs: the keyword arguments of prefill() / decode() (pool, q_pe, k_new,
        v_new, ckv_new, kpe_new, sm_scale, return_lse); every tensor must go to an arena (shared
        memory or CUDA IPC), else ValueError."""
        rpc = rpc_for(op)
        request, tensors = attention_request(rpc, layer, q, table, **inputs)
        return PreparedCall(self, rpc, self._stage(request, tensors, timeout))

    def _queue_for_call(self) -> CallQueue | None:
        """The client's call queue, registered on first use when the server offers queues (or
        when asked for); None: this call goes over gRPC."""
        if self._call_queue_wanted is False:
            return None
        with self._call_queue_lock:
            if self._call_queue is not None or self._call_queue_wanted is False:
                return self._call_queue
            if self._call_queue_wanted is None:
                dp = self.server_info().data_plane
                if not dp.call_queue:
                    self._call_queue_wanted = False
                    return None
            queue = CallQueue(prefix=self._transport.shm_prefix)
            try:
                self._invoke(REGISTER_REGION, queue.register_request(), None)
            except AttnError:
                queue.close()
                if self._call_queue_wanted:
                    raise
                self._call_queue_wanted = False
                return None
            queue.registered()
            self._call_queue = queue
            return queue

    def _queue_call(
        self,
        queue: CallQueue,
        rpc: Rpc[AttentionResult],
        request: Any,
        timeout: float | None,
        serialized: bytes | None = None,
    ) -> AttentionResult | None:
        """One call through the queue; None when the server closed it (the call then goes over
        gRPC, and later calls too unless the queue was asked for)."""
        if serialized is None:
            serialized = with_session(request, self._session_for(rpc)).SerializeToString()
        method = PREFILL_METHOD if rpc is PREFILL else DECODE_METHOD
        try:
            code, data, retry_ms = queue.call(
                method, serialized, self._timeout if timeout is None else timeout
            )
        except QueueClosed:
            with self._call_queue_lock:
                if self._call_queue is queue:
                    self._call_queue = None
                    if not self._call_queue_wanted:
                        self._call_queue_wanted = False
            queue.close()
            return None
        except TimeoutError as e:
            raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, str(e), method=rpc.name) from None
        if code != 0:
            status = next(c for c in grpc.StatusCode if c.value[0] == code)
            message = data.decode("utf-8", "replace")
            raise error_for(status, message, method=rpc.name, retry_pushback_ms=retry_ms or None)
        return rpc.decode(pb.AttentionResponse.FromString(data))

    def _drop_call_queue(self, *, unregister: bool) -> None:
        with self._call_queue_lock:
            queue, self._call_queue = self._call_queue, None
        if queue is None:
            return
        if unregister:
            try:
                self._invoke(UNREGISTER_REGION, pb.UnregisterRegionRequest(name=queue.name), 5.0)
            except AttnError:
                pass  # the session is gone, or so is the server: the queue went with it
        queue.close()

    def _add_arena(self, need: NeedArena, timeout: float | None) -> bool:
        """Creates and registers the arena staging asked for (unless another call did
        meanwhile); False when this call should go as bytes instead (attnserve.transport)."""
        with self._arena_lock:
            plane = self._transport
            if need.generation != plane.generation:
                return True  # arenas changed since: stage again
            try:
                arena = plane.create_arena(need)
            except (OSError, RuntimeError, ValueError) as e:
                return plane.registration_failed(need.where, e)
            try:
                self._invoke(REGISTER_REGION, arena.register_request(), timeout)
            except AttnError as e:
                arena.close()
                return plane.registration_failed(need.where, e)
            except BaseException:
                arena.close()
                raise
            plane.add_arena(need.where, arena)
            return True

    def _release_regions(self, *, unregister: bool) -> None:
        """Forgets the arenas, unregistering them first (unless the session went with them)."""
        self._drop_call_queue(unregister=unregister)
        for arena in self._transport.take_arenas():
            if unregister:
                request = pb.UnregisterRegionRequest(name=arena.name)
                try:
                    self._invoke(UNREGISTER_REGION, request, 5.0)
                except AttnError as e:
                    if not plane_may_free(arena, e):
                        continue  # still in use by the server: leave the memory alone
            arena.close()

    def _invoke(self, rpc: Rpc[T], request: object, timeout: float | None) -> T:
        """Runs rpc with retries (attnserve.retry) within one deadline; decodes the response."""
        budget = self._timeout if timeout is None else timeout
        attempts = Attempts(self._retry, rpc.name, rpc.idempotent, budget)
        method = getattr(self._stub, rpc.name)
        request = with_session(request, self._session_for(rpc))
        while True:
            try:
                response = method(
                    request,
                    timeout=attempts.remaining(),
                    metadata=self._metadata,
                    wait_for_ready=self._wait_for_ready,
                )
            except grpc.RpcError as e:
                time.sleep(attempts.wait_after(e))
                continue
            return rpc.decode(response)
