"""The router's choice of a node for a request, as pure functions of what it knows: each node's
health and load (requests the router has in flight there plus the waiting and running requests
the node last reported), and for `cache_aware` a prefix index of what each node has seen.

`round_robin` cycles over healthy nodes; `least_loaded` takes the smallest load (ties taken in
turn); `cache_aware` takes the node holding the longest prefix of the request,
trading the chunks it holds against the work queued there (each request in flight counted as
an average request's chunks), among the nodes whose load is below max(`balance` x mean,
mean + `slack`) and whose recent work, with this request's, stays within `balance` x the mean
recent work (plus an average request's): so a popular prefix cannot pile onto one node, it
spreads to as many nodes as its traffic needs. Recent work is what the policy itself sent each
node, in chunks it had to compute (those it did not hold, plus one), decayed with a half-life
of `half_life_s`.

The prefix index is kept by the router from its own choices: a request's chain (its text cut
into chunks, or, when the router knows the nodes' tokenizer, its token blocks named by the
engine's own cache keys), each named by a hash chained over the ones before it, so a node
"holds" a chain that was routed there; entries are bounded and the oldest are forgotten first.
`observed` adds what nodes report holding (the router feeds their KV events in). No I/O here;
the app feeds loads and health in.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.config import ROUTER_POLICIES as POLICIES

CHUNK_CHARS = 64  # the prefix index's unit: about 16 tokens of English text
MAX_INDEX_ENTRIES = 200_000


@dataclass
class Node:
    name: str  # a decode's base URL or a prefill's host:port
    healthy: bool = True
    draining: bool = False  # taken out of rotation by an operator (`pdserve drain`)
    in_flight: int = 0  # requests the router has sent here and not seen finish
    reported: int = 0  # waiting + running, as the node last said
    probe_timeouts: int = 0  # health probes in a row it left unanswered

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

    def forget_keys(self, keys: Iterable[bytes], node: str) -> None:
        """`node` no longer holds these (its KV events said so)."""
        for key in keys:
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(node)

    def forget(self, node: str) -> None:
        """A node that restarted lost its cache."""
        for holders in self._holders.values():
            holders.discard(node)


class NoHealthyNode(Exception):
    pass


class Policy:
    def __init__(
        self,
        name: str,
        balance: float = 1.2,
        slack: int = 1,
        chunk_weight: float = 1.0,
        half_life_s: float = 30.0,
        observed: Callable[[list[bytes], str], int] | None = None,
    ) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
        self.name = name
        self.balance = balance  # cache_aware: no node past this many times the mean load
        self.slack = slack  # cache_aware: ... or this many requests above the mean
        self.chunk_weight = chunk_weight  # cache_aware: a cached chunk against a queued one
        self.index = PrefixIndex()
        # What nodes report holding (KV events): leading chunks of a chain a node has cached.
        self.observed = observed
        self._next = 0
        self._avg_chunks = 0.0  # moving average of requests' chunk counts
        self.half_life_s = half_life_s
        self._work: dict[str, float] = {}  # node -> recent work (decayed chunks)
        self._avg_cost = 0.0  # moving average of the work a request added
        self._work_at: float | None = None

    def _decay(self, now: float) -> None:
        if self._work_at is not None and now > self._work_at:
            f = 0.5 ** ((now - self._work_at) / self.half_life_s)
            for name in self._work:
                self._work[name] *= f
        self._work_at = now if self._work_at is None else max(self._work_at, now)

    def held(self, chain: list[bytes], node: str) -> int:
        """Leading chunks of `chain` `node` holds: as it reported, or as it was sent."""
        routed = self.index.matched(chain, node)
        return routed if self.observed is None else max(routed, self.observed(chain, node))

    def work(self, node: str) -> float:
        """The recent work this policy sent `node` (for tests and the simulation)."""
        return self._work.get(node, 0.0)

    def pick(
        self,
        nodes: list[Node],
        chain: list[bytes],
        exclude: tuple[str, ...] = (),
        now: float | None = None,
    ) -> Node:
        """`choose`, then `record` (a simulation, or a caller that counts every choice)."""
        node = self.choose(nodes, chain, exclude, now)
        self.record(chain, node)
        return node

    def choose(
        self,
        nodes: list[Node],
        chain: list[bytes],
        exclude: tuple[str, ...] = (),
        now: float | None = None,
        last_resort: bool = False,
    ) -> Node:
        """The node for a request whose prompt has `chain`, leaving no trace of it until
        `record` (a request the node then refuses must not count); `now` (seconds, monotonic)
        decays the recent work (a simulation passes its virtual time). `last_resort`: when no
        node is healthy, choose among those the probes marked unavailable (never a draining
        one) rather than none: the probes' view is up to a poll old, and a busy node that left
        two probes unanswered, or failed one in a passing moment, still serves (Envoy's panic
        routing, for the case where every node looks down)."""
        self._decay(time.monotonic() if now is None else now)
        candidates = [n for n in nodes if not n.draining and n.name not in exclude]
        usable = [n for n in candidates if n.healthy] or (candidates if last_resort else [])
        if not usable:
            raise NoHealthyNode("no healthy node")
        # Rotated each call: round robin takes the first; the others break ties by it, so
        # equally good nodes share the work instead of the first listed taking it all.
        k = self._next % len(usable)
        self._next += 1
        usable = usable[k:] + usable[:k]
        if self.name == "round_robin":
            return usable[0]
        if self.name == "least_loaded":
            return min(usable, key=lambda n: n.load)
        return self._cache_aware(usable, chain)

    def record(self, chain: list[bytes], node: Node) -> None:
        """`node` took the request whose prompt has `chain`: its work, the averages and the
        prefix index count it."""
        cost = len(chain) - self.held(chain, node.name) + 1
        self._work[node.name] = self._work.get(node.name, 0.0) + cost
        # (the first request's cost to start with: a cold cluster still follows prefixes)
        self._avg_cost += (0.05 if self._avg_cost else 1.0) * (cost - self._avg_cost)
        self._avg_chunks = self._next_avg_chunks(chain)
        self.index.record(chain, node.name)

    def _next_avg_chunks(self, chain: list[bytes]) -> float:
        return self._avg_chunks + 0.05 * (len(chain) - self._avg_chunks)

    def _cache_aware(self, usable: list[Node], chain: list[bytes]) -> Node:
        mean = sum(n.load for n in usable) / len(usable)
        # Relative under load, absolute when nearly idle (where one request is a large ratio).
        cap = max(self.balance * mean, mean + self.slack)

        # One request in flight costs about an average prompt's chunks of work (this one's
        # counted): the score is the work this node would save minus the work queued before it.
        per_request = max(self._next_avg_chunks(chain), 1.0)

        def score(n: Node) -> float:
            return self.chunk_weight * held[n.name] - n.load * per_request

        held = {n.name: self.held(chain, n.name) for n in usable}

        def after(n: Node) -> float:  # the node's recent work if it takes this request
            return self.work(n.name) + len(chain) - held[n.name] + 1

        mean_work = sum(self.work(n.name) for n in usable) / len(usable)
        work_cap = self.balance * mean_work + max(self._avg_cost, 1.0)  # an average request
        within = [n for n in usable if n.load < cap and after(n) <= work_cap]
        if within:
            return max(within, key=lambda n: (score(n), -self.work(n.name), -n.load))
        return min(usable, key=lambda n: (n.load >= cap, after(n), n.load))
