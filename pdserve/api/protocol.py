"""OpenAI request bodies as pydantic models (the JSON edge), their conversion to sampling
parameters, and OpenAI-style error bodies."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from pdserve.config import RETRY_AFTER_S
from pdserve.disagg.wire import STATUS
from pdserve.engine.failure import Failure, FailureReason
from pdserve.engine.sequence import MAX_TOP_LOGPROBS, SamplingError, SamplingParams


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

    @classmethod
    def of(cls, failure: Failure) -> APIError:
        """The error a failure's reason maps to (the one table in `disagg.wire`)."""
        status = STATUS[failure.reason]
        retry = RETRY_AFTER_S if failure.reason == FailureReason.OVERLOADED else None
        return cls(
            str(failure), status.http_status, status.error_type, None, status.error_code, retry
        )

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


class LogprobRequest(NamedTuple):
    """What a request asks to know about its tokens' probabilities."""

    chosen: bool = False  # the chosen tokens' logprobs
    top: int = 0  # and this many most likely tokens per position


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
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)  # vLLM's extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]

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
