"""What the engine checks before it queues a request: a prompt it could never run is refused
at once, naming why, instead of failing later in a step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.engine.outputs import RequestError
from pdserve.engine.sequence import SamplingParams


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int  # KV blocks of the whole cache
    blocks_for: Callable[[int], int]  # KV blocks `tokens` need


def check_prompt(
    request_id: str, token_ids: list[int], params: SamplingParams, limits: PromptLimits
) -> None:
    """Refuse (RequestError) a prompt the engine cannot run: empty, past the context, a
    token outside the vocabulary (in the prompt, stop_token_ids or logit_bias), or more
    KV blocks than the whole cache."""
    if not token_ids:
        raise RequestError(f"request {request_id}: the prompt is empty")
    if len(token_ids) >= limits.max_model_len:
        raise RequestError(
            f"request {request_id}: prompt of {len(token_ids)} tokens does not fit the "
            f"context of {limits.max_model_len} tokens"
        )
    vocab = limits.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"request {request_id}: token id {bad[0]} is outside the vocabulary")
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    ):
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise RequestError(
                f"request {request_id}: {name} names token id {bad[0]}, outside the "
                f"vocabulary of {vocab}"
            )
    total = min(len(token_ids) + params.max_tokens, limits.max_model_len)
    if limits.blocks_for(total) > limits.num_blocks:
        raise RequestError(
            f"request {request_id}: {total} tokens need {limits.blocks_for(total)} KV "
            f"blocks, the cache has {limits.num_blocks}"
        )


def check_resume(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    eos_token_ids: Iterable[int],
) -> None:
    """Refuse (RequestError) tokens a stream cannot have generated before it is resumed:
    outside the vocabulary, as many as `max_tokens` or more, or one that would have ended it
    (EOS unless ignored, a stop token id). None is fine: the stream died before its first."""
    where = f"request {request_id}: the resumed stream"
    if len(token_ids) >= params.max_tokens:
        raise RequestError(
            f"{where} has {len(token_ids)} tokens, max_tokens is {params.max_tokens}: "
            "nothing is left to generate"
        )
    if bad := [t for t in token_ids if not 0 <= t < vocab_size]:
        raise RequestError(f"{where}: token id {bad[0]} is outside the vocabulary")
    enders = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if ended := [i for i, t in enumerate(token_ids) if t in enders]:
        raise RequestError(f"{where}: token {ended[0]} would have ended it")
