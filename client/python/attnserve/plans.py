"""Plans: a page table the server checks and pins once for the calls of one step (attention.proto,
"Plans"). Pass a Plan (Client.plan) or an AsyncPlan (AsyncClient.plan) as the `table` of
prefill()/decode()/prepare(): the call then names it and carries no page table, and the server
does nothing per page for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnserve.v1 import attention_pb2 as pb


class PlanBase:
    """What Plan and AsyncPlan share: the plan's name and kind, what the server made of its
    table, and whether the client released it. Calls take either as their `table`."""

    def __init__(
        self,
        release: Callable[[str], Any],
        name: str,
        prefill: bool,
        response: pb.CreatePlanResponse,
    ) -> None:
        self._release = release  # the client's release_plan
        self.name = name
        self.prefill = prefill  # a Prefill plan (with qo_indptr), else a Decode plan
        self.batch = response.batch
        self.total_q = response.total_q
        self.num_pages = response.num_pages
        self.released = False

    def _take(self) -> bool:
        """Marks the plan released; True the first time (the caller then tells the server)."""
        first = not self.released
        self.released = True
        return first

    def __repr__(self) -> str:
        kind = "prefill" if self.prefill else "decode"
        shape = f"batch={self.batch}, pages={self.num_pages}"
        return f"{type(self).__name__}({self.name!r}, {kind}, {shape})"


class PlanBook:
    """The plans a client made, by name. The server knows a plan by its name only, so once a
    plan of the same name replaces one, the old Plan object would name its successor: the book
    marks it released instead, so that its release() does not drop the successor and calls
    cannot use it. Plans released by name, and every plan when the session changes, are marked
    released too."""

    def __init__(self) -> None:
        self._plans: dict[str, PlanBase] = {}

    def add(self, plan: PlanBase) -> None:
        """Records a plan the server just made, marking the one it replaced released."""
        old = self._plans.get(plan.name)
        self._plans[plan.name] = plan
        if old is not None and old is not plan:
            old._take()

    def drop(self, name: str) -> None:
        """Marks the plan of that name released (the client is releasing it)."""
        plan = self._plans.pop(name, None)
        if plan is not None:
            plan._take()

    def clear(self) -> None:
        """Marks every plan released (the client's session changed: they stay with the old)."""
        plans, self._plans = self._plans, {}
        for plan in plans.values():
            plan._take()


class Plan(PlanBase):
    """A page table the server holds under `name` for the client's session (Client.plan).

    Its pages stay pinned until release() (or the end of its `with` block), a plan of the same
    name replacing it, or the session's end: FreePages refuses them meanwhile, so release the
    step's plan (or replace it with the next step's) before freeing the pages of finished
    sequences. Calls already sent with it are not affected by its release.
    """

    def release(self) -> None:
        """Drops the plan on the server (once; a no-op for a plan replaced by one of its name,
        which must stay)."""
        if self._take():
            self._release(self.name)

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class AsyncPlan(PlanBase):
    """Plan for AsyncClient (AsyncClient.plan): `await plan.release()`, or `async with` it."""

    async def release(self) -> None:
        """Drops the plan on the server (once, even when tasks release it concurrently; a no-op
        for a plan replaced by one of its name)."""
        if self._take():
            await self._release(self.name)

    async def __aenter__(self) -> AsyncPlan:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()
