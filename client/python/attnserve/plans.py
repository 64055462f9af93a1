"""Plans: a page table the server checks and pins once for the calls of one step (attention.proto,
"Plans"). Pass a Plan as the `table` of prefill()/decode()/prepare(): the call then names it and
carries no page table, and the server does nothing per page for it."""

from __future__ import annotations

from typing import Any

from attnserve.v1 import attention_pb2 as pb


class Plan:
    """A page table the server holds under `name` for the client's session (Client.plan).

    Its pages stay pinned until release() (or the end of its `with` block), a plan of the same
    name replacing it, or the session's end: FreePages refuses them meanwhile, so release the
    step's plan (or replace it with the next step's) before freeing the pages of finished
    sequences. Calls already sent with it are not affected by its release.
    """

    def __init__(self, release: Any, name: str, prefill: bool, response: pb.CreatePlanResponse):
        self._release = release
        self.name = name
        self.prefill = prefill  # a Prefill plan (with qo_indptr), else a Decode plan
        self.batch = response.batch
        self.total_q = response.total_q
        self.num_pages = response.num_pages
        self.released = False

    def release(self) -> None:
        """Drops the plan on the server (once; a plan replaced by one of its name is gone too)."""
        if not self.released:
            self.released = True
            self._release(self.name)

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        kind = "prefill" if self.prefill else "decode"
        return f"Plan({self.name!r}, {kind}, batch={self.batch}, pages={self.num_pages})"
