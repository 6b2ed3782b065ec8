"""OpenAI request bodies as pydantic models (the JSON edge), their conversion to sampling
parameters, and OpenAI-style error bodies."""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from pdserve.config import RETRY_AFTER_S
from pdserve.engine.failure import STATUS, Failure, FailureReason
from pdserve.engine.sequence import (
    MAX_TOP_LOGPROBS,
    Guide,
    GuideKind,
    SamplingError,
    SamplingParams,
)

# Set by `pdserve router`: the prefill node it chose for the request ("host:port", one of the
# decode's --prefill nodes) or "local" (prefill on the decode node).
PREFILL_HEADER = "x-pdserve-prefill"
# A router's id for a stream it follows: the node's id for its request (n 1), which the
# router names to pause the stream and move it live (`POST /admin/migrate`).
REQUEST_ID_HEADER = "x-pdserve-request-id"
MAX_REQUEST_ID_CHARS = 128
# pdserve's extension in a whole response and in the chunk that finishes a choice: the prompt
# tokens the first choice found in the prefix cache (what a router audits its predictions by).
CACHED_TOKENS_FIELD = "pdserve_cached_tokens"
MAX_RESUME_TOKENS = 128 * 1024  # a resumed stream's tokens (the engine bounds them by max_tokens)


class APIError(Exception):
    """An error to return as {"error": {...}} with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as Retry-After
        self.failure = Failure(FailureReason.INVALID_INPUT, message)  # for the gRPC entry

    @classmethod
    def of(cls, failure: Failure) -> APIError:
        """The error a failure's reason maps to (the one table in `engine.failure`)."""
        status = STATUS[failure.reason]
        retry = RETRY_AFTER_S if failure.reason == FailureReason.OVERLOADED else None
        error = cls(
            str(failure), status.http_status, status.error_type, None, status.error_code, retry
        )
        error.failure = failure
        return error

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after)} if self.retry_after else None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk too


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class LogprobRequest(NamedTuple):
    """What a request asks to know about its tokens' probabilities."""

    chosen: bool = False  # the chosen tokens' logprobs
    top: int = 0  # and this many most likely tokens per position


class ResumeFields(BaseModel):
    """pdserve's extension: continue a stream another node began (a router resuming it after
    that node died). `token_ids`: every token it generated; `sent_chars`: how many characters
    of their text the client received. The answer carries only what comes after."""

    model_config = ConfigDict(extra="forbid")
    token_ids: list[int] = Field(max_length=MAX_RESUME_TOKENS)
    sent_chars: int = Field(default=0, ge=0)
    migrate_from: MigrateFrom | None = None


class MigrateFrom(BaseModel):
    """Where a resumed stream's KV is (a live migration, named by the router): the decode
    node that paused it (its gRPC address) and its request id there."""

    model_config = ConfigDict(extra="forbid")
    address: str = Field(min_length=1, max_length=256)
    handle: str = Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)


class SamplingFields(BaseModel):
    """Parameters shared by both endpoints. Unknown fields are refused (400), not ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt (a
    # tenant's), so no request learns from `cached_tokens` what another tenant sent.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)  # vLLM's extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    # vLLM's extension: each choice (each streamed delta) carries its new tokens' ids.
    return_token_ids: bool = False
    pdserve_resume: ResumeFields | None = None

    @property
    def wants_logprobs(self) -> LogprobRequest:
        """Which logprobs are returned (each endpoint asks in its own way)."""
        return LogprobRequest()

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        out = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise SamplingError(f"logit_bias keys are token ids, got {key!r}") from None
            out.append((token, bias))
        return tuple(sorted(out))

    def _guide(self) -> Guide | None:
        """The one output constraint the request names, if any."""
        found: list[tuple[str, Guide]] = []

        def schema(value: dict[str, Any] | str) -> str:
            return value if isinstance(value, str) else json.dumps(value)

        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", Guide(GuideKind.JSON_OBJECT)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise SamplingError("response_format of type json_schema needs json_schema")
            spec = schema(rf.json_schema.json_schema)
            found.append(("response_format", Guide(GuideKind.JSON_SCHEMA, spec)))
        so = self.structured_outputs
        named: list[tuple[str, Any, GuideKind]] = [
            ("guided_json", self.guided_json, GuideKind.JSON_SCHEMA),
            ("guided_regex", self.guided_regex, GuideKind.REGEX),
            ("guided_choice", self.guided_choice, GuideKind.CHOICE),
            ("guided_grammar", self.guided_grammar, GuideKind.GRAMMAR),
        ]
        if so is not None:
            named += [
                ("structured_outputs.json", so.json_, GuideKind.JSON_SCHEMA),
                ("structured_outputs.regex", so.regex, GuideKind.REGEX),
                ("structured_outputs.choice", so.choice, GuideKind.CHOICE),
                ("structured_outputs.grammar", so.grammar, GuideKind.GRAMMAR),
            ]
            if so.json_object:
                found.append(("structured_outputs.json_object", Guide(GuideKind.JSON_OBJECT)))
        for name, value, kind in named:
            if value is None:
                continue
            if kind == GuideKind.JSON_SCHEMA:
                spec = schema(value)
            elif kind == GuideKind.CHOICE:
                spec = json.dumps(value)
            else:
                spec = value
            found.append((name, Guide(kind, spec)))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise SamplingError(f"at most one output constraint per request, got {names}")
        return found[0][1] if found else None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        asked = self.wants_logprobs
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=asked.chosen,
            top_logprobs=asked.top,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=self._logit_bias(),
            guide=self._guide(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    # N: the chosen token's logprob and the N most likely tokens' (with the chosen one)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt's text before the completion's
    best_of: int | None = Field(default=None, ge=1, le=16)  # n best of this many, by logprob

    @property
    def wants_logprobs(self) -> LogprobRequest:
        if self.logprobs is None:
            return LogprobRequest()
        return LogprobRequest(True, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def wants_logprobs(self) -> LogprobRequest:
        if self.top_logprobs and not self.logprobs:
            raise SamplingError("top_logprobs needs logprobs: true")
        return LogprobRequest(self.logprobs, (self.top_logprobs or 0) if self.logprobs else 0)


class PrefillAddress(BaseModel):
    """`POST /admin/prefill-address` (the router's): the decode's prefill node `old` is at
    `new` now."""

    model_config = ConfigDict(extra="forbid")
    old: str = Field(min_length=1, max_length=256)
    new: str = Field(min_length=1, max_length=256)


class MigrateRequest(BaseModel):
    """`POST /admin/migrate` (the router's): pause these streams (request ids the router gave
    them) between two decode steps, for another decode node to fetch their KV and go on."""

    model_config = ConfigDict(extra="forbid")
    request_ids: list[str] = Field(max_length=4096)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages (with the generation prompt)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[int]
