"""A streamed answer followed event by event, so that a stream whose decode dies can go on
from another decode where it stopped: the router asks the decode for each delta's token ids
(`return_token_ids`), keeps the tokens and the characters of text the client received, and
strips the ids again unless the client asked for them. Only whole events reach the client (a
half event of a dying decode is dropped: the next decode sends it again); after a resume the
events keep the first decode's `id` and `created`, so the client sees one stream.

A resume is a request to another decode with `pdserve_resume` (the tokens, the characters
sent): that decode computes prompt + tokens itself and sends only what comes after — or, for a
stream its decode paused for a drain (`POST /admin/migrate`), fetches their KV from the decode
that paused it (`migrate_from`) and computes only the last token: a live migration. Greedy and
seeded streams continue as they would have (seeded draws depend on the position); the stream
resumes only with one choice (n and best_of 1).
"""

from __future__ import annotations

import json
from typing import Any

DATA = b"data: "
END = b"\n\n"
MAX_RESUMES = 2  # decodes a stream may move to after the first one failed


def resumable(body: dict[str, Any]) -> bool:
    """Whether a request's stream could be resumed (one streamed choice)."""
    return bool(body.get("stream")) and body.get("n", 1) == 1 and body.get("best_of") in (None, 1)


def asking_ids(body: dict[str, Any]) -> dict[str, Any]:
    """`body` asking the decode for each delta's token ids."""
    return {**body, "return_token_ids": True}


class StreamFollower:
    """Follows one streamed answer (one choice) as it is relayed: `feed` takes the decode's
    bytes as they come and returns the whole events to send on."""

    def __init__(self, chat: bool, keep_ids: bool) -> None:
        self.chat = chat
        self.keep_ids = keep_ids  # the client asked for return_token_ids itself
        self.token_ids: list[int] = []
        self.sent_chars = 0
        self.finished = False  # the choice finished, or the stream ended ([DONE], an error)
        self._pending = b""
        self.request_id = ""  # the router's id for the stream on its decode now (its header)
        self._id: Any = None
        self._created: Any = None

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        out = []
        while (end := self._pending.find(END)) >= 0:
            event, self._pending = self._pending[:end], self._pending[end + len(END) :]
            out.append(self._event(event) + END)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(DATA):
            return event
        data = event[len(DATA) :]
        if data.strip() == b"[DONE]":
            self.finished = True
            return event
        body = json.loads(data)
        if "error" in body:  # the decode ended the stream with its reason: not resumed
            self.finished = True
            return event
        if self._id is None:
            self._id, self._created = body.get("id"), body.get("created")
        else:
            body["id"], body["created"] = self._id, self._created
        for choice in body.get("choices") or ():
            if choice.get("finish_reason"):
                self.finished = True
            if "token_ids" not in choice:  # the head of the stream (chat's role, an echo)
                continue
            ids = choice["token_ids"] if self.keep_ids else choice.pop("token_ids")
            self.token_ids += ids
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            self.sent_chars += len(text or "")
        return DATA + json.dumps(body).encode()

    def moved(self) -> None:
        """The stream goes on from another decode: the failed one's half event is dropped."""
        self._pending = b""

    def resume_body(
        self, body: dict[str, Any], migrate_from: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """The request that continues this stream on another decode (which fetches its KV
        from `migrate_from`, the decode that paused it, where given)."""
        resume: dict[str, Any] = {"token_ids": list(self.token_ids), "sent_chars": self.sent_chars}
        if migrate_from is not None:
            resume["migrate_from"] = migrate_from
        return {**asking_ids(body), "pdserve_resume": resume}
