"""The router's choice of a node for a request, as pure functions of what it knows: each node's
health and load (requests the router has in flight there plus the waiting and running requests
the node last reported), and for `cache_aware` a prefix index of what each node has seen.

`round_robin` cycles over healthy nodes; `least_loaded` takes the smallest load (ties taken in
turn); `cache_aware` takes the node holding the longest prefix of the request,
trading the chunks it holds against the work queued there (each request in flight counted as
an average request's chunks), among the nodes whose load is below max(`balance` x mean,
mean + `slack`) (so a popular prefix cannot pile onto one node).

The prefix index is kept by the router from its own choices: a request's text cut into chunks,
each named by a hash chained over the chunks before it (as the engine names KV blocks), so a
node "holds" a chain that was routed there; entries are bounded and the oldest are forgotten
first. No I/O here; the app feeds loads and health in.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.config import ROUTER_POLICIES as POLICIES

CHUNK_CHARS = 64  # the prefix index's unit: about 16 tokens of English text
MAX_INDEX_ENTRIES = 200_000


@dataclass
class Node:
    name: str  # a decode's base URL or a prefill's host:port
    healthy: bool = True
    in_flight: int = 0  # requests the router has sent here and not seen finish
    reported: int = 0  # waiting + running, as the node last said

    @property
    def load(self) -> int:
        return self.in_flight + self.reported


def prefix_chain(text: str, chunk: int = CHUNK_CHARS) -> list[bytes]:
    """Chained hashes of `text`'s whole chunks: equal prefixes give equal leading hashes."""
    out: list[bytes] = []
    parent = b""
    for i in range(0, len(text) - chunk + 1, chunk):
        parent = hashlib.blake2b(parent + text[i : i + chunk].encode(), digest_size=16).digest()
        out.append(parent)
    return out


@dataclass
class PrefixIndex:
    """Which nodes were sent which chains (LRU over chain hashes)."""

    max_entries: int = MAX_INDEX_ENTRIES
    _holders: OrderedDict[bytes, set[str]] = field(default_factory=OrderedDict)

    def matched(self, chain: list[bytes], node: str) -> int:
        """How many leading chunks of `chain` `node` holds."""
        n = 0
        for h in chain:
            if node not in self._holders.get(h, ()):
                break
            n += 1
        return n

    def record(self, chain: list[bytes], node: str) -> None:
        for h in chain:
            self._holders.setdefault(h, set()).add(node)
            self._holders.move_to_end(h)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, node: str) -> None:
        """A node that restarted lost its cache."""
        for holders in self._holders.values():
            holders.discard(node)


class NoHealthyNode(Exception):
    pass


class Policy:
    def __init__(
        self, name: str, balance: float = 1.2, slack: int = 1, chunk_weight: float = 1.0
    ) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
        self.name = name
        self.balance = balance  # cache_aware: no node past this many times the mean load
        self.slack = slack  # cache_aware: ... or this many requests above the mean
        self.chunk_weight = chunk_weight  # cache_aware: a cached chunk against a queued one
        self.index = PrefixIndex()
        self._next = 0
        self._avg_chunks = 0.0  # moving average of requests' chunk counts

    def pick(self, nodes: list[Node], chain: list[bytes], exclude: tuple[str, ...] = ()) -> Node:
        usable = [n for n in nodes if n.healthy and n.name not in exclude]
        if not usable:
            raise NoHealthyNode("no healthy node")
        # Rotated each call: round robin takes the first; the others break ties by it, so
        # equally good nodes share the work instead of the first listed taking it all.
        k = self._next % len(usable)
        self._next += 1
        usable = usable[k:] + usable[:k]
        if self.name == "round_robin":
            node = usable[0]
        elif self.name == "least_loaded":
            node = min(usable, key=lambda n: n.load)
        else:
            node = self._cache_aware(usable, chain)
        self.index.record(chain, node.name)
        return node

    def _cache_aware(self, usable: list[Node], chain: list[bytes]) -> Node:
        mean = sum(n.load for n in usable) / len(usable)
        # Relative under load, absolute when nearly idle (where one request is a large ratio).
        cap = max(self.balance * mean, mean + self.slack)

        # One request in flight costs about an average prompt's chunks of work: the score is
        # the work this node would save minus the work queued before this request.
        self._avg_chunks += 0.05 * (len(chain) - self._avg_chunks)
        per_request = max(self._avg_chunks, 1.0)

        def score(n: Node) -> float:
            return self.chunk_weight * self.index.matched(chain, n.name) - n.load * per_request

        within = [n for n in usable if n.load < cap]
        return max(within or usable, key=lambda n: (score(n), -n.load))
