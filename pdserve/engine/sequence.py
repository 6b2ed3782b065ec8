"""Requests as the scheduler sees them: sampling parameters and the per-request sequence state.
Plain Python (no torch) so the scheduler and block pool are testable on their own.

Lifecycle of a Sequence: WAITING -> (WAITING_FOR_KV ->) RUNNING -> FINISHED_*; preemption moves
RUNNING back to WAITING (its blocks freed, recomputed on readmission).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.config import DEFAULT_MAX_TOKENS
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.failure import Failure

if TYPE_CHECKING:
    import torch


MAX_TOP_LOGPROBS = 20  # as OpenAI
# Caps on what a request may list (each check runs per token on the engine thread, for every
# stream of the node): OpenAI's for `stop`, vLLM-like for the rest. Refused with the cap named.
MAX_STOP = 4  # stop strings, as OpenAI
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 300
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_GUIDE_CHARS = 64 * 1024  # a structured-output schema, regex, grammar or choice list
INT32_MAX = 2**31 - 1  # token counts and ids travel as int32 between nodes
INT64_RANGE = (-(2**63), 2**63 - 1)  # seeds travel as int64
TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it."""


class GuideKind(enum.StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    REGEX = "regex"
    CHOICE = "choice"  # spec: a JSON list of strings
    GRAMMAR = "grammar"  # spec: EBNF (GBNF-style, as xgrammar reads it)


@dataclass(frozen=True)
class Guide:
    """What the output must match (structured output)."""

    kind: GuideKind
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: also this many most likely tokens per position
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # no EOS, stop token or stop string before this many outputs
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    guide: Guide | None = None  # structured output

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= INT32_MAX:
            raise SamplingError(f"max_tokens must be in [1, {INT32_MAX}], got {self.max_tokens}")
        if not -1 <= self.top_k <= INT32_MAX:
            raise SamplingError(f"top_k must be -1, 0 or up to {INT32_MAX}, got {self.top_k}")
        if self.seed is not None and not INT64_RANGE[0] <= self.seed <= INT64_RANGE[1]:
            raise SamplingError(f"seed must fit 64 bits (signed), got {self.seed}")
        self._check_lists()
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise SamplingError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise SamplingError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise SamplingError(
                    f"logit_bias must map token ids >= 0 to biases in [-100, 100], "
                    f"got {token}: {bias}"
                )

    def _check_lists(self) -> None:
        if len(self.stop) > MAX_STOP:
            raise SamplingError(f"stop: at most {MAX_STOP} strings, got {len(self.stop)}")
        long = [s for s in self.stop if len(s) > MAX_STOP_CHARS]
        if long:
            raise SamplingError(
                f"stop: strings of at most {MAX_STOP_CHARS} characters, got {len(long[0])}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise SamplingError(f"stop_token_ids: ids in [0, {INT32_MAX}]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(
                f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        if any(t > INT32_MAX for t, _ in self.logit_bias):
            raise SamplingError(f"logit_bias: token ids in [0, {INT32_MAX}]")
        if self.guide is not None and len(self.guide.spec) > MAX_GUIDE_CHARS:
            raise SamplingError(
                f"structured output: a {self.guide.kind.value} of at most {MAX_GUIDE_CHARS} "
                f"characters, got {len(self.guide.spec)}"
            )

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before sampling (beyond temperature/top-k/p)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(frozen=True)
class Sampled:
    """A token chosen for a request, with what it asked to know about the choice."""

    token: int
    logprob: float = 0.0  # of `token`; 0.0 unless the request asked for logprobs
    top: TopLogprobs = ()


@dataclass(frozen=True)
class Migration:
    """Where a resumed stream's KV still is: the decode node that paused it (its gRPC address)
    and its request id there (the handle). The KV of every token but the last one comes over
    the transfer plane instead of being computed again."""

    address: str
    handle: str


@dataclass(frozen=True)
class Resume:
    """A stream continued here after the node that served it died or handed it over: the
    tokens it already generated (they extend the prompt, count against `max_tokens` and steer
    penalties, the guide, stop strings and the seeded draws as they did there) and how many
    characters of their text the client already received (nothing is sent twice); `source`:
    the node whose KV of it is fetched (a live migration), None: computed here."""

    token_ids: tuple[int, ...]
    sent_chars: int = 0
    source: Migration | None = None


@dataclass(frozen=True)
class RequestOptions:
    """How a request is to be served, beyond sampling."""

    deadline: float | None = None  # absolute time.time(); None: the node's default timeout
    allow_split: bool = True  # False: never prefilled on another node
    # Another request with the same prompt (choice 0 of n): this one is admitted only once
    # that one's prompt KV is in the cache, and shares those blocks instead of recomputing.
    after: str | None = None
    # A router's choice: a prefill node's address (one decode knows), LOCAL_PREFILL, or None
    # (decode chooses).
    prefill_peer: str | None = None
    # Prefix-cache blocks are shared only between requests of the same salt (vLLM's field).
    cache_salt: str | None = None
    # A stream resumed from another node (its tokens so far): computed here, never split,
    # unless its KV is fetched from the node that paused it (`Resume.source`).
    resume: Resume | None = None
    # The W3C traceparent of the request's span where it entered (None: not traced): its
    # prefill call's span is parented to it.
    trace: str | None = None


LOCAL_PREFILL = "local"  # a router asks decode to prefill the prompt itself


class Milestone(enum.StrEnum):
    """Wall-clock instants of a request's way to its first token (the TTFT breakdown)."""

    ARRIVED = "arrived"
    SCHEDULED = "scheduled"
    REMOTE_START = "remote_start"  # decode called prefill
    PREFILL_RECEIVED = "prefill_received"
    PREFILL_SCHEDULED = "prefill_scheduled"
    PREFILL_COMPUTED = "prefill_computed"
    PREFILL_LAST_LAYER_SENT = "prefill_last_layer_sent"
    SIDE_CHANNEL = "side_channel"  # decode got prefill's response (the first token)
    KV_COMPLETE = "kv_complete"  # every layer arrived on decode
    CLAIMED = "claimed"  # decode's engine took the handoff
    FIRST_TOKEN = "first_token"  # the request's first output token is known (here)


Timings = dict[Milestone, float]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # decode node: blocks allocated, KV arriving from prefill
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    # Paused and handed to another decode (live migration): its blocks are held here until
    # that node fetched their KV.
    FINISHED_MIGRATED = "migrated"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error", "migrated")


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # per output token, the most likely tokens as (id, logprob) (requests with top_logprobs)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    block_keys: list[int] = field(default_factory=list)  # cache keys of computed full blocks
    num_preemptions: int = 0
    remote_prefill: bool = False  # decode node: the prompt's KV comes from a prefill node
    # decode node: the blocks before this one came without the windowed layers' KV (behind
    # their window when it was sent): they are registered for reuse as partial
    window_blocks_from: int = 0
    # per block of block_table: whether this request holds its window part (block pools of
    # models with windowed layers), and the first block whose part it may still hold
    window_held: list[bool] = field(default_factory=list)
    window_kept_from: int = 0
    # decode node, --prefill-placement measured: the prompt tokens its placement was costed at
    # (its own uncached ones and those queued before it where it went); 0: not placed so
    placement_tokens: int = 0
    options: RequestOptions = field(default_factory=RequestOptions)
    timings: Timings = field(default_factory=dict)  # wall clock (time.time())
    failure: Failure | None = None
    # Engine-side objects the scheduler ignores.
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None  # seeded requests only
    parent: Sequence | None = None  # options.after, while it was known at admission
    matcher: Any = None  # guided requests: the grammar state (engine/structured.py)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]
