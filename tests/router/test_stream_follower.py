"""The router's `StreamFollower` against streams written out by hand: whatever the chunking of
the bytes, the client gets the same whole events; the tokens and characters it counted are the
ones the client received (not a head of the stream without token ids, like chat's role or an
echoed prompt); a resumed stream keeps the first stream's id; ids are stripped unless asked."""

from __future__ import annotations

import json
from typing import Any

from pdserve.router.resume import StreamFollower, resumable


def sse(*bodies: Any) -> bytes:
    return b"".join(
        (b"data: " + (b if isinstance(b, bytes) else json.dumps(b).encode()) + b"\n\n")
        for b in bodies
    )


def chat_chunk(id_: str, content: str | None, ids: list[int] | None, finish: str | None = None):  # type: ignore[no-untyped-def]
    choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": finish}
    if content is not None:
        choice["delta"] = {"content": content}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": id_, "created": 5, "choices": [choice]}


HEAD = {
    "id": "a",
    "created": 5,
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
}
STREAM = sse(
    HEAD,
    chat_chunk("a", "Héllo", [10, 11]),
    chat_chunk("a", " wörld", [12]),
    chat_chunk("a", None, [13]),  # a token whose text is held back
    b"[DONE]",
)


def events(data: bytes) -> list[Any]:
    return [
        e.removeprefix(b"data: ")
        if e.endswith(b"[DONE]")
        else json.loads(e.removeprefix(b"data: "))
        for e in data.split(b"\n\n")
        if e
    ]


def test_any_chunking_gives_the_same_events_and_counts() -> None:
    whole = StreamFollower(chat=True, keep_ids=False)
    expected = whole.feed(STREAM)
    assert whole.token_ids == [10, 11, 12, 13] and whole.sent_chars == len("Héllo wörld")
    assert whole.finished  # [DONE]
    assert all("token_ids" not in c for e in events(expected)[:-1] for c in e["choices"])
    for size in (1, 2, 7, 33):
        f = StreamFollower(chat=True, keep_ids=False)
        out = b"".join(f.feed(STREAM[i : i + size]) for i in range(0, len(STREAM), size))
        assert out == expected and f.token_ids == whole.token_ids
        assert f.sent_chars == whole.sent_chars


def test_a_half_event_is_held_and_a_resumed_stream_keeps_its_id() -> None:
    f = StreamFollower(chat=True, keep_ids=True)
    first = sse(HEAD, chat_chunk("a", "ab", [10]))
    out = f.feed(first + b'data: {"id": "a", "cho')  # the decode died mid-event
    assert events(out)[-1]["choices"][0]["token_ids"] == [10]  # kept: the client asked
    assert not f.finished and f.token_ids == [10] and f.sent_chars == 2
    body = f.resume_body({"model": "m", "stream": True})
    assert body["pdserve_resume"] == {"token_ids": [10], "sent_chars": 2}
    assert body["return_token_ids"] is True
    f.moved()  # the next decode's stream starts afresh
    out = f.feed(sse(chat_chunk("b", "c", [11], "length")))
    (event,) = events(out)
    assert event["id"] == "a" and event["created"] == 5 and f.finished


def test_completions_with_an_echo_count_only_generated_text() -> None:
    f = StreamFollower(chat=False, keep_ids=False)
    echo = {"id": "c", "choices": [{"index": 0, "text": "the prompt", "finish_reason": None}]}
    gen = {
        "id": "c",
        "choices": [{"index": 0, "text": " more", "token_ids": [7], "finish_reason": None}],
    }
    f.feed(sse(echo, gen))
    assert f.sent_chars == len(" more") and f.token_ids == [7]


def test_an_error_event_ends_the_stream_without_a_resume() -> None:
    f = StreamFollower(chat=False, keep_ids=False)
    f.feed(sse({"error": {"message": "deadline", "type": "timeout"}}))
    assert f.finished


def test_only_single_choice_streams_resume() -> None:
    assert resumable({"stream": True})
    assert not resumable({"stream": False})
    assert not resumable({"stream": True, "n": 2})
    assert not resumable({"stream": True, "best_of": 3})
