"""OpenAI response bodies: the envelope of a completion or chat completion (whole or one
streamed chunk), its choices, and the chosen tokens' logprobs in each endpoint's format."""

from __future__ import annotations

from typing import Any

from pdserve.api.protocol import CACHED_TOKENS_FIELD, LogprobRequest
from pdserve.api.run import Run
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import TopLogprobs
from pdserve.model.tokenizer import Tokenizer


class Renderer:
    """Renders one endpoint's bodies: chat (`chat.completion[.chunk]`) or text completion."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        chat: bool,
        echo: str = "",
        token_ids: bool = False,
        resumed: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat = chat
        self.echo = echo  # completions with echo: the prompt's text, sent before the output
        self.token_ids = token_ids  # return_token_ids: each choice carries its tokens' ids
        self.resumed = resumed  # a stream another node began: its first chunk was sent there

    def _envelope(self, run: Run, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": f"{'chatcmpl' if self.chat else 'cmpl'}-{run.id}",
            "object": kind,
            "created": run.created,
            "model": self.model_name,
            "choices": choices,
        }

    def response(
        self, run: Run, outputs: list[RequestOutput], logprobs: LogprobRequest
    ) -> dict[str, Any]:
        """The whole (non-streamed) response, with usage and pdserve's TTFT breakdown."""
        kind = "chat.completion" if self.chat else "text_completion"
        choices = [self.choice(i, out, logprobs) for i, out in enumerate(outputs)]
        body = self._envelope(run, kind, choices)
        body["usage"] = run.usage()
        body["pdserve_timing"] = run.timing
        body[CACHED_TOKENS_FIELD] = run.cached_tokens
        return body

    def chunk(
        self, run: Run, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One streamed chunk; the one that finishes a choice carries the TTFT breakdown."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(run, kind, choices)
        if usage is not None:
            body["usage"] = usage
        if any(c.get("finish_reason") for c in choices):
            if run.timing is not None:
                body["pdserve_timing"] = run.timing  # pdserve's extension: TTFT by stage
            # (and the prompt tokens found cached, for a router's audit of its predictions)
            body[CACHED_TOKENS_FIELD] = run.cached_tokens
        return body

    def choice(self, index: int, out: RequestOutput, logprobs: LogprobRequest) -> dict[str, Any]:
        lp = (
            self.logprobs(out.token_ids, out.logprobs, out.top_logprobs)
            if logprobs.chosen
            else None
        )
        if self.chat:
            message = {"role": "assistant", "content": out.text}
            body = {"index": index, "message": message, "logprobs": lp}
        else:
            body = {"index": index, "text": self.echo + out.text, "logprobs": lp}
        body["finish_reason"] = out.finish_reason
        return self._with_ids(body, out.token_ids)

    def _with_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        if self.token_ids:
            choice["token_ids"] = token_ids
        return choice

    def first_delta(self, index: int) -> dict[str, Any] | None:
        """A stream's first chunk for a choice: the chat role, or the echoed prompt (none for
        a resumed stream: the client has it)."""
        if self.resumed:
            return None
        if self.chat:
            return {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
            }
        if self.echo:
            return {"index": index, "text": self.echo, "logprobs": None, "finish_reason": None}
        return None

    def delta(
        self,
        index: int,
        out: RequestOutput,
        sent: int,
        logprobs: LogprobRequest,
    ) -> dict[str, Any]:
        """A streamed choice: the text and tokens after the first `sent` ones."""
        finish = out.finish_reason if out.finished else None
        lp = (
            self.logprobs(out.token_ids[sent:], out.logprobs[sent:], out.top_logprobs[sent:])
            if logprobs.chosen
            else None
        )
        if self.chat:
            delta = {"content": out.delta_text} if out.delta_text else {}
            body = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            body = {"index": index, "text": out.delta_text, "logprobs": lp, "finish_reason": finish}
        return self._with_ids(body, out.token_ids[sent:])

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def logprobs(
        self, token_ids: list[int], logprobs: list[float], tops: list[TopLogprobs]
    ) -> dict[str, Any]:
        """Each endpoint's logprobs object; `tops` is empty unless top logprobs were asked."""
        texts = [self._text(t) for t in token_ids]
        top_texts = [[(self._text(t), lp) for t, lp in top] for top in tops]
        if self.chat:
            content = [
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": tlp, "bytes": list(t.encode())}
                        for t, tlp in (top_texts[i] if i < len(top_texts) else [])
                    ],
                }
                for i, (text, lp) in enumerate(zip(texts, logprobs, strict=False))
            ]
            return {"content": content}
        offsets, pos = [], len(self.echo)
        for text in texts:
            offsets.append(pos)
            pos += len(text)
        # Legacy completions: the N most likely tokens at each position, and the chosen one.
        top_dicts = [
            {**dict(top_texts[i] if i < len(top_texts) else []), text: lp}
            for i, (text, lp) in enumerate(zip(texts, logprobs, strict=False))
        ]
        return {
            "tokens": texts,
            "token_logprobs": logprobs,
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }
