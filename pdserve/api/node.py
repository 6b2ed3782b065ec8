"""What the HTTP API needs from a node, and nothing more: its tokenizer and context limit, a
way to submit and abort requests (outputs come back through a callback on another thread),
one snapshot of its state, and its health. Prefill, decode and colocated nodes provide it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from pdserve.engine.failure import Failure
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import Guide, RequestOptions, SamplingParams
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.model.tokenizer import Tokenizer


class ServingNode(Protocol):
    role: str
    accepts_requests: bool  # False: clients are told to send requests elsewhere (prefill)

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        options: RequestOptions | None = None,
    ) -> Future[None]:
        """Queue a request; the future fails with RequestFailed if it is refused."""
        ...

    @property
    def reader_idle_timeout_s(self) -> float:
        """A stream whose reader takes nothing this long is aborted."""
        ...

    @property
    def request_timeout_s(self) -> float:
        """A request's deadline, from its arrival, unless it sets its own."""
        ...

    def abort(self, request_id: str, failure: Failure | None = None) -> None: ...

    def snapshot(self) -> NodeSnapshot: ...

    def health(self) -> tuple[bool, str]: ...

    async def compile_guide(self, guide: Guide) -> None:
        """Compile a structured-output guide off the engine thread, bounded in time (a worker
        process); raises GuideError."""
        ...

    def kv_events(self) -> KVEventLog:
        """The engine's prefix-cache changes (thread-safe)."""
        ...

    def knows_prefill(self, address: str) -> bool:
        """Whether a router may name `address` as the prefill node of a request."""
        ...

    async def readdress_prefill(self, old: str, new: str) -> bool:
        """Its prefill node at `old` is at `new` now (a router says so); whether it was one."""
        ...

    @property
    def migration_address(self) -> str:
        """Where other decode nodes fetch the KV of streams paused here ("": nowhere)."""
        ...

    async def migrate_out(self, request_ids: list[str]) -> list[str]:
        """Pause those of `request_ids` between two decode steps for another node to go on
        with (their streams end); the ids paused."""
        ...
