"""What the router knows of a prompt: its request body parsed, its text, and its chain (the
keys the prefix index and the decodes' KV events name it by); and `KVView`, what one decode
reported holding. Pure functions of the body and the nodes' tokenizer: no I/O, run off the
router's event loop. Only a prompt's first `MAX_INDEXED_CHARS` (or `MAX_INDEXED_TOKENS`) are
indexed, so a huge prompt costs the router a bounded amount of work."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import RouterConfig
from pdserve.engine.block_pool import cache_keys, key_bytes, keyed_with, root_key
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.policy import prefix_chain

MAX_INDEXED_CHARS = 256 * 1024  # a prompt's prefix beyond this is not indexed (nor tokenized)
MAX_INDEXED_TOKENS = 64 * 1024


@dataclass
class KVView:
    """What one node reported holding in its prefix cache (its KV events, followed)."""

    epoch: str | None = None
    seq: int = 0
    keys: set[bytes] = field(default_factory=set)

    def apply(self, changes: dict[str, Any]) -> set[bytes]:
        """Changes as a decode's /kv_events gives them (keys as hex)."""

        def as_keys(hexes: list[str]) -> list[bytes]:
            return [key_bytes(int(h, 16)) for h in hexes]

        return self.apply_keys(
            str(changes["epoch"]),
            int(changes["seq"]),
            bool(changes["reset"]),
            as_keys(changes["stored"]),
            as_keys(changes["removed"]),
        )

    def apply_keys(
        self,
        epoch: str,
        seq: int,
        reset: bool,
        stored: Iterable[bytes],
        removed: Iterable[bytes],
    ) -> set[bytes]:
        """Changes as keys (a prefill node's `GetKVEvents`); the keys the node no longer
        holds (removed, or gone in a reset)."""
        if reset:
            new = set(stored)
            gone, self.keys = self.keys - new, new
        else:
            gone = set(removed)
            self.keys.update(stored)
            self.keys.difference_update(gone)
        self.epoch, self.seq = epoch, seq
        return gone

    def matched(self, chain: list[bytes]) -> int:
        n = 0
        for key in chain:
            if key not in self.keys:
                break
            n += 1
        return n


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; ValueError naming what is wrong."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise ValueError("body: not JSON") from None
    if not isinstance(body, dict):
        raise ValueError("body: not an object")
    return body


def prefix_text(body: dict[str, Any]) -> str:
    """The request's prompt as one string, for the prefix index: a completion's prompt, or a
    chat's messages with their roles."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content)
                parts.append(f"{m.get('role')}\x1f{text}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt))
    return ""


class PromptIndex:
    """Chains of prompts: with the nodes' tokenizer, the engine's block keys (keyed with the
    cluster secret, rooted in the request's cache salt), so decodes' KV events say what each
    holds; without it, text chunks, and only the router's own choices are known."""

    def __init__(self, config: RouterConfig) -> None:
        self.tokenizer = Tokenizer(config.tokenizer) if config.tokenizer else None
        self.block_size = config.block_size
        secret = config.cluster_secret
        self.hash_key = keyed_with(secret.value) if secret is not None else b""

    def prepare(self, raw: bytes) -> tuple[dict[str, Any], str, list[bytes], bool]:
        """The body, its prompt's text (what the index sees of it), its chain and whether the
        chain is block keys: off the event loop (the router runs it on its indexer's threads).
        ValueError: a bad body."""
        body = parse_body(raw)
        text = prefix_text(body)
        return body, text[:MAX_INDEXED_CHARS], *self.chain_of(body, text)

    def chain_of(self, body: dict[str, Any], text: str) -> tuple[list[bytes], bool]:
        """The request's chain: its prompt's block keys as the engine computes them (when the
        nodes' tokenizer is known and the prompt tokenizes; True), else its text chunks
        (False); of the prompt's first `MAX_INDEXED_CHARS` (or `MAX_INDEXED_TOKENS`) only."""
        tok = self.tokenizer
        cut = len(text) > MAX_INDEXED_CHARS
        if tok is not None:
            with contextlib.suppress(Exception):  # a bad body: decode will say what is wrong
                prompt, messages = body.get("prompt"), body.get("messages")
                ids: list[int] = []
                if isinstance(messages, list) and not cut:  # a cut chat: its text chunks
                    ids = tok.apply_chat_template(messages)
                elif isinstance(prompt, str):
                    ids = tok.encode(prompt[:MAX_INDEXED_CHARS])
                elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    cut = len(prompt) > MAX_INDEXED_TOKENS
                    ids = prompt[:MAX_INDEXED_TOKENS]
                if ids:
                    salt = body.get("cache_salt")
                    root = root_key(salt if isinstance(salt, str) else None, self.hash_key)
                    keys = cache_keys(ids, self.block_size, root=root, key=self.hash_key)
                    # Text cut mid-way may tokenize differently at the cut: its last block goes.
                    return [key_bytes(k) for k in (keys[:-1] if cut else keys)], True
        return prefix_chain(text[:MAX_INDEXED_CHARS]), False
