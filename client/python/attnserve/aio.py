"""asyncio client of attnserve.v1.AttentionService (grpc.aio), the twin of attnserve.Client.

Same methods, arguments, deadlines, retries and errors as Client (requests and results come from
attnserve.calls); every method is a coroutine, and plan() returns an AsyncPlan (`await
plan.release()` or `async with`). Create it inside the event loop that uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

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
from attnserve.errors import AttnError
from attnserve.pages import BatchCsr
from attnserve.plans import AsyncPlan, PlanBook
from attnserve.prepared import rpc_for
from attnserve.regions import DEFAULT_ARENA_BYTES, DEFAULT_SHM_PREFIX
from attnserve.retry import DEFAULT_RETRY, NO_RETRIES, Attempts, RetryPolicy
from attnserve.transport import NeedArena, StagedPageTable, Transport, plane_may_free
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
        wait_for_ready: bool = True,
        transport: str = "auto",
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        shm_prefix: str = DEFAULT_SHM_PREFIX,
        shm_mode: int = 0o600,
    ) -> None:
        self._address = address
        self._wait_for_ready = wait_for_ready
        self._transport = Transport(
            transport, address, arena_bytes=arena_bytes, shm_prefix=shm_prefix, shm_mode=shm_mode
        )
        self._arena_lock = asyncio.Lock()
        self._session = session
        self._plans = PlanBook()  # the plans made in the session, by name
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
        await self._release_regions(unregister=True)  # they belonged to the previous session
        self._plans.clear()  # so did its plans
        self._session = opened.session
        return opened

    async def close_session(self, *, timeout: float | None = None) -> int:
        """Closes the client's session, freeing its pages; returns how many."""
        if not self._session:
            raise ValueError("this client has no open session")
        request = pb.CloseSessionRequest(session=self._session)
        freed = await self._invoke(CLOSE_SESSION, request, timeout)
        await self._release_regions(unregister=False)  # the session's regions went with it
        self._plans.clear()  # and its plans
        self._session = None
        return freed

    async def close(self) -> None:
        """Unregisters and frees the client's regions, then closes the channel."""
        await self._release_regions(unregister=True)
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
        """Appends the new K/V (when given), then runs causal paged attention (see Client)."""
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
        return await self._attend(PREFILL, request, tensors, timeout)

    async def decode(
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
        """One query row per sequence (see Client.decode)."""
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
        return await self._attend(DECODE, request, tensors, timeout)

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

    # ---- registered memory (attnserve.transport)

    @property
    def transport(self) -> Transport:
        """The client's data plane: its transport setting, arenas and what they hold."""
        return self._transport

    async def stage_page_table(
        self, table: BatchCsr, *, timeout: float | None = None
    ) -> StagedPageTable:
        """Writes a page table into shared memory once, for the calls of one step (every layer):
        pass the result as their `table`, and release() it (or use `with`) after the step.
        Without shared memory it holds the arrays, which then travel in each call."""
        plane = self._transport
        if plane.needs_server_info:
            plane.resolve(await self.server_info(timeout=timeout))
        while True:
            try:
                return plane.stage_page_table(table)
            except NeedArena as need:
                if not await self._add_arena(need, timeout):
                    return StagedPageTable(table)

    async def plan(
        self,
        table: BatchCsr | StagedPageTable,
        *,
        op: str = "decode",
        name: str = "step",
        pool: str = "",
        timeout: float | None = None,
    ) -> AsyncPlan:
        """Has the server check and pin `table` once for the "decode" or "prefill" calls of one
        step (see Client.plan): pass the result as their `table`, then `await plan.release()`
        or use `async with`. A plan of the same name is replaced."""
        prefill = rpc_for(op) is PREFILL
        request = create_plan_request(table, name, prefill, pool)
        response = await self._invoke(CREATE_PLAN, request, timeout)
        plan = AsyncPlan(self.release_plan, name, prefill, response)
        self._plans.add(plan)  # the plan it replaced must not be used or released any more
        return plan

    async def release_plan(self, name: str, *, timeout: float | None = None) -> None:
        """Drops the session's plan `name` (NotFound when there is none)."""
        self._plans.drop(name)
        await self._invoke(RELEASE_PLAN, pb.ReleasePlanRequest(name=name), timeout)

    async def register_region(
        self, request: pb.RegisterRegionRequest, *, timeout: float | None = None
    ) -> pb.RegionInfo:
        """Registers memory the caller manages itself (its header written: attnserve.regions);
        the transports register their own arenas. Not retried on Unavailable."""
        return (await self._invoke(REGISTER_REGION, request, timeout)).region

    async def unregister_region(self, name: str, *, timeout: float | None = None) -> None:
        """Unregisters a region of the session (FailedPrecondition while a call uses it)."""
        await self._invoke(UNREGISTER_REGION, pb.UnregisterRegionRequest(name=name), timeout)

    async def list_regions(self, *, timeout: float | None = None) -> list[pb.RegionInfo]:
        """The regions the server holds for the client's session."""
        return await self._invoke(LIST_REGIONS, pb.ListRegionsRequest(), timeout)

    async def _attend(
        self, rpc: Rpc[AttentionResult], request: object, tensors: dict, timeout: float | None
    ) -> AttentionResult:
        """Stages the tensors (transport), sends the call, reads the outputs back."""
        plane = self._transport
        if plane.needs_server_info:
            plane.resolve(await self.server_info(timeout=timeout))
        as_bytes = False
        while True:
            try:
                staged = plane.stage_call(request, tensors, as_bytes=as_bytes)
                break
            except NeedArena as need:
                as_bytes = not await self._add_arena(need, timeout)
        try:
            send = self.call_prefill if rpc is PREFILL else self.call_decode
            result = await send(staged.request, timeout=timeout)
        except BaseException as e:
            staged.abandon(e)
            raise
        return staged.finish(result)

    async def _add_arena(self, need: NeedArena, timeout: float | None) -> bool:
        """Creates and registers the arena staging asked for (unless another call did
        meanwhile); False when this call should go as bytes instead (attnserve.transport)."""
        async with self._arena_lock:
            plane = self._transport
            if need.generation != plane.generation:
                return True  # arenas changed since: stage again
            try:
                arena = plane.create_arena(need)
            except (OSError, RuntimeError, ValueError) as e:
                return plane.registration_failed(need.where, e)
            try:
                await self._invoke(REGISTER_REGION, arena.register_request(), timeout)
            except AttnError as e:
                arena.close()
                return plane.registration_failed(need.where, e)
            except BaseException:
                arena.close()
                raise
            plane.add_arena(need.where, arena)
            return True

    async def _release_regions(self, *, unregister: bool) -> None:
        """Forgets the arenas, unregistering them first (unless the session went with them)."""
        for arena in self._transport.take_arenas():
            if unregister:
                request = pb.UnregisterRegionRequest(name=arena.name)
                try:
                    await self._invoke(UNREGISTER_REGION, request, 5.0)
                except AttnError as e:
                    if not plane_may_free(arena, e):
                        continue  # still in use by the server: leave the memory alone
            arena.close()

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
                    request,
                    timeout=attempts.remaining(),
                    metadata=self._metadata,
                    wait_for_ready=self._wait_for_ready,
                )
            except grpc.RpcError as e:
                await asyncio.sleep(attempts.wait_after(e))
                continue
            return rpc.decode(response)
