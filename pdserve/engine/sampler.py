"""Token sampling as pure functions over float32 logits: greedy, temperature, top-k, top-p, a
per-request generator for seeded requests, and the log-probability of the chosen token."""

from __future__ import annotations

import torch

from pdserve.engine.sequence import SamplingParams


def _filtered_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked before it already reach top_p.
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[tuple[int, float]]:
    """One (token id, logprob under the model's distribution) per row of `logits` [S, vocab]."""
    want_logprobs = any(p.logprobs for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    greedy = logits.argmax(dim=-1).tolist()
    out: list[tuple[int, float]] = []
    for row, p in enumerate(params):
        if p.greedy:
            token = greedy[row]
        else:
            probs = _filtered_logits(logits[row], p).softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=generators[row]).item())
        lp = float(logprobs[row, token]) if logprobs is not None and p.logprobs else 0.0
        out.append((token, lp))
    return out
