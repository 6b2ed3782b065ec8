"""What a Prefill call asks of the KV sender and what it gets back: the send target (decode's
blocks, the blocks it already holds, the deadline, how each layer's heads split into frames)
and the outcome reported once, when the last write is out (first token or failure)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.failure import Failure
from pdserve.engine.sequence import TopLogprobs


@dataclass(frozen=True)
class SendTarget:
    request_id: str  # decode's request id (for logs)
    unique_key: str  # the prefill engine's request id
    peer: str  # decode's KV receiver, host:port
    dst_blocks: list[int]  # decode blocks for the whole prompt
    num_skipped: int  # leading blocks decode already holds
    deadline: float  # absolute time.time()
    # (head_start, head_count) of each layer's frames (0, 0: one frame of every head); split
    # where either node's tensor-parallel ranks split the heads.
    heads: tuple[tuple[int, int], ...] = ((0, 0),)
    # the tokens whose KV is sent (0: unknown, every block of every layer is sent); a layer
    # with a sliding window gets only the blocks its window still reads after them
    num_tokens: int = 0


@dataclass
class PrefillOutcome:
    has_first_token: bool = False
    first_token: int = 0
    first_logprob: float = 0.0
    first_top: TopLogprobs = ()
    failure: Failure | None = None
    bytes_sent: int = 0
    num_skipped_blocks: int = 0
    num_prefill_cached_tokens: int = 0
    started_at: float = field(default_factory=time.time)
    last_layer_sent_at: float = 0.0
    scheduled_at: float = 0.0
    computed_at: float = 0.0

    @property
    def error(self) -> str | None:
        return None if self.failure is None else str(self.failure)


Complete = Callable[[PrefillOutcome], None]
