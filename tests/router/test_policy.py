"""The router's policies as pure functions: round robin over healthy nodes, least loaded,
cache aware (longest routed prefix against load, bounded by the balance cap), the chained
prefix hashes they index, and the router's choice to prefill on decode (by reason)."""

from __future__ import annotations

import pytest

from pdserve.router.policy import CHUNK_CHARS, Node, NoHealthyNode, Policy, prefix_chain
from pdserve.router.prompts import prefix_text


def nodes(*loads: int) -> list[Node]:
    return [Node(f"n{i}", reported=load) for i, load in enumerate(loads)]


def test_prefix_chain_shares_exactly_the_common_whole_chunks() -> None:
    a = "x" * (3 * CHUNK_CHARS) + "tail a"
    b = "x" * (2 * CHUNK_CHARS) + "y" * CHUNK_CHARS + "tail b"
    ca, cb = prefix_chain(a), prefix_chain(b)
    assert len(ca) == len(cb) == 3
    assert ca[:2] == cb[:2] and ca[2] != cb[2]
    # Chained: the same chunk after a different prefix is a different hash.
    assert prefix_chain("y" * CHUNK_CHARS)[0] != cb[2]
    assert prefix_chain("short") == []


def test_round_robin_cycles_over_healthy_nodes_only() -> None:
    ns = nodes(0, 0, 0)
    ns[1].healthy = False
    policy = Policy("round_robin")
    assert [policy.pick(ns, []).name for _ in range(4)] == ["n0", "n2", "n0", "n2"]
    assert policy.pick(ns, [], exclude=("n0",)).name == "n2"
    for n in ns:
        n.healthy = False
    with pytest.raises(NoHealthyNode):
        policy.pick(ns, [])


def test_a_last_resort_choice_takes_an_unhealthy_node_only_when_none_is_healthy() -> None:
    """`last_resort`: an unhealthy node when no healthy one is left (never a draining or an
    excluded one); a healthy node is always preferred."""
    ns = nodes(0, 5, 0)
    ns[0].healthy = False
    policy = Policy("least_loaded")
    assert policy.choose(ns, [], exclude=("n2",), last_resort=True).name == "n1"
    ns[1].healthy = False
    with pytest.raises(NoHealthyNode):
        policy.choose(ns, [], exclude=("n2",))
    assert policy.choose(ns, [], exclude=("n2",), last_resort=True).name == "n0"
    ns[0].draining = True
    assert policy.choose(ns, [], exclude=("n2",), last_resort=True).name == "n1"
    with pytest.raises(NoHealthyNode):
        policy.choose(ns, [], exclude=("n1", "n2"), last_resort=True)


def test_least_loaded_counts_router_in_flight_and_reported_load() -> None:
    ns = nodes(3, 1, 2)
    policy = Policy("least_loaded")
    assert policy.pick(ns, []).name == "n1"
    ns[1].in_flight = 5
    assert policy.pick(ns, []).name == "n2"
    # Equally loaded nodes take requests in turn.
    idle = nodes(0, 0, 0)
    assert {policy.pick(idle, []).name for _ in range(3)} == {"n0", "n1", "n2"}


def test_cache_aware_follows_the_prefix_and_balances_otherwise() -> None:
    ns = nodes(0, 0, 0)
    policy = Policy("cache_aware")
    shared = "system prompt " * 40
    first = policy.pick(ns, prefix_chain(shared + "question one"))
    first.in_flight += 1  # it is busy with the first request
    # The same long prefix goes where it went, although that node is now the busiest.
    again = policy.pick(ns, prefix_chain(shared + "question two"))
    assert again is first
    # A request sharing nothing goes to a least-loaded node.
    other = policy.pick(ns, prefix_chain("unrelated " * 40))
    assert other is not first and other.load == 0
    # Past the balance cap (max(1.2 x mean, mean + 1)) the prefix no longer wins.
    first.in_flight = 10
    assert policy.pick(ns, prefix_chain(shared + "question three")) is not first


def test_forgotten_node_holds_no_prefix() -> None:
    ns = nodes(0, 0)
    policy = Policy("cache_aware")
    chain = prefix_chain("p" * 10 * CHUNK_CHARS)
    holder = policy.pick(ns, chain)
    assert policy.index.matched(chain, holder.name) == 10
    policy.index.forget(holder.name)
    assert policy.index.matched(chain, holder.name) == 0


def test_prefix_text_of_chat_and_completion_bodies() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert prefix_text(chat) == "system\x1fS\x1euser\x1fU\x1e"
    assert prefix_text({"prompt": "hello"}) == "hello"
    assert prefix_text({"prompt": [5, 6, 7]}) == "5 6 7"
    assert prefix_text({"prompt": {"bad": 1}}) == ""


def test_conditional_disaggregation_prefills_on_decode_by_reason() -> None:
    from pdserve.config import RouterConfig
    from pdserve.router.app import Router

    config = RouterConfig(
        decodes=("http://d",), prefills=("p0", "p1"), local_prefill_below=100,
        prefill_queue_limit=2,
    )  # fmt: skip
    router = Router(config)
    decode = router.decodes[0]

    long_text = "x" * 500
    assert router._choose_prefill(prefix_chain("short"), "short", decode) == (None, "short_prompt")
    chosen, reason = router._choose_prefill(prefix_chain(long_text), long_text, decode)
    assert chosen is not None and chosen.name in ("p0", "p1") and reason is None
    for p in router.prefills:
        p.in_flight = 2  # every prefill node at the limit and this decode idle
    assert router._choose_prefill(prefix_chain(long_text), long_text, decode) == (
        None,
        "prefill_busy",
    )
    decode.in_flight = 1  # a busy decode keeps disaggregating
    assert router._choose_prefill(prefix_chain(long_text), long_text, decode)[0] is not None
    # Counted (by reason) only once a decode accepted the request: see test_router_security.


def test_a_hot_prefix_spreads_over_as_many_nodes_as_its_work_needs() -> None:
    """Requests that finish at once (no load in flight) all sharing one long prefix: without a
    bound on recent work every one would go to the node that holds the prefix. Each node's
    recent work stays within 1.2x the mean plus one request, and most requests still land
    where the prefix is cached."""
    ns = nodes(*[0] * 8)
    policy = Policy("cache_aware")
    hot = "s" * (20 * CHUNK_CHARS)
    hits = 0
    chosen = set()
    for i in range(400):
        chain = prefix_chain(hot + f"question {i:04d} " * 8)
        held = {n.name: policy.index.matched(chain, n.name) for n in ns}
        node = policy.pick(ns, chain, now=i * 0.05)
        hits += held[node.name] >= 20
        chosen.add(node.name)
        work = [policy.work(n.name) for n in ns]
        mean = sum(work) / len(work)
        assert max(work) <= 1.2 * mean + len(chain) + 1, (i, work)
    assert len(chosen) > 1  # the old cap (load in flight only) sent every one to one node
    assert hits >= 0.95 * 400 - len(ns)  # each node computed the prefix about once
    # An idle cluster with a single request: it goes where its prefix is, not elsewhere.
    quiet = Policy("cache_aware")
    quiet.pick(ns, prefix_chain(hot + "a"), now=0.0)
    first = [n.name for n in ns if quiet.index.matched(prefix_chain(hot + "b"), n.name) == 20]
    assert quiet.pick(ns, prefix_chain(hot + "b"), now=100.0).name == first[0]
