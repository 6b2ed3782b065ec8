"""OpenAI response bodies: the envelope of a completion or chat completion (whole or one
streamed chunk), its choices, and the chosen tokens' logprobs in each endpoint's format."""

from __future__ import annotations

from typing import Any

from pdserve.api.run import Run
from pdserve.engine.outputs import RequestOutput
from pdserve.model.tokenizer import Tokenizer


class Renderer:
    """Renders one endpoint's bodies: chat (`chat.completion[.chunk]`) or text completion."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat = chat

    def _envelope(self, run: Run, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": f"{'chatcmpl' if self.chat else 'cmpl'}-{run.id}",
            "object": kind,
            "created": run.created,
            "model": self.model_name,
            "choices": choices,
        }

    def response(self, run: Run, outputs: list[RequestOutput], logprobs: bool) -> dict[str, Any]:
        """The whole (non-streamed) response, with usage and pdserve's TTFT breakdown."""
        kind = "chat.completion" if self.chat else "text_completion"
        choices = [self.choice(i, out, logprobs) for i, out in enumerate(outputs)]
        body = self._envelope(run, kind, choices)
        body["usage"] = run.usage()
        body["pdserve_timing"] = run.timing
        return body

    def chunk(
        self, run: Run, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """One streamed chunk; the one that finishes a choice carries the TTFT breakdown."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(run, kind, choices)
        if usage is not None:
            body["usage"] = usage
        if run.timing is not None and any(c.get("finish_reason") for c in choices):
            body["pdserve_timing"] = run.timing  # pdserve's extension: TTFT by stage
        return body

    def choice(self, index: int, out: RequestOutput, logprobs: bool) -> dict[str, Any]:
        lp = self.logprobs(out.token_ids, out.logprobs) if logprobs else None
        if self.chat:
            message = {"role": "assistant", "content": out.text}
            return {
                "index": index,
                "message": message,
                "logprobs": lp,
                "finish_reason": out.finish_reason,
            }
        return {
            "index": index,
            "text": out.text,
            "logprobs": lp,
            "finish_reason": out.finish_reason,
        }

    def role_delta(self, index: int) -> dict[str, Any]:
        """A chat stream's first delta for a choice."""
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
        }

    def delta(
        self, index: int, out: RequestOutput, ids: list[int], lps: list[float], logprobs: bool
    ) -> dict[str, Any]:
        """A streamed choice: the text and tokens not sent before."""
        finish = out.finish_reason if out.finished else None
        lp = self.logprobs(ids, lps) if logprobs else None
        if self.chat:
            delta = {"content": out.delta_text} if out.delta_text else {}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": out.delta_text, "logprobs": lp, "finish_reason": finish}

    def logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        texts = [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
        if self.chat:
            content = [
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                for text, lp in zip(texts, logprobs, strict=False)
            ]
            return {"content": content}
        offsets, pos = [], 0
        for text in texts:
            offsets.append(pos)
            pos += len(text)
        return {
            "tokens": texts,
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }
