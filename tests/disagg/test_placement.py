"""`--prefill-placement measured`: the cost lines learn what they are shown, the choice follows
the cheaper line at each size with each side's queue counted, stays local while remote is
unknown (trying it now and then), and goes back to trying once a side's samples are old;
`static` keeps the fixed rule. And on a real pair: whatever it places where, outputs equal
colocated, and it does try remote."""

from __future__ import annotations

import pytest

from pdserve.disagg.placement import EXPLORE_EVERY, MIN_SAMPLES, CostLine, Placement
from pdserve.disagg.proto import pdserve_pb2 as pb
from tests.disagg.cluster import (
    assert_clean,
    decode_stub,
    generate,
    nodes,
    prefill_stub,
    start_pair,
)


def test_a_cost_line_learns_fixed_and_per_token_costs() -> None:
    line = CostLine()
    assert line.predict(100) is None
    for tokens in (100, 400, 200, 800):
        line.add(tokens, 0.05 + 0.002 * tokens, now=0.0)
    assert line.predict(300) == pytest.approx(0.65)
    assert line.predict(0) == pytest.approx(0.05)
    # Samples of one size only: a rate through the origin, never a division by zero.
    flat = CostLine()
    for _ in range(MIN_SAMPLES):
        flat.add(200, 0.4, now=0.0)
    assert flat.predict(100) == pytest.approx(0.2)


def test_a_line_follows_what_changed() -> None:
    """Older samples weigh less: after the link slowed down, the line moves to the new cost."""
    line = CostLine()
    for i in range(20):
        line.add(100 + 50 * (i % 4), 0.001 * (100 + 50 * (i % 4)), now=0.0)
    for i in range(40):
        line.add(100 + 50 * (i % 4), 0.004 * (100 + 50 * (i % 4)), now=0.0)
    assert line.predict(200) == pytest.approx(0.8, rel=0.05)


def measured(local: tuple[float, float], remote: tuple[float, float]) -> Placement:
    """A placement that has seen (fixed s, per-token s) costs here and on a prefill node."""
    p = Placement("measured")
    for tokens in (64, 256, 1024):
        p.observe(False, tokens, local[0] + local[1] * tokens, now=0.0)
        p.observe(True, tokens, remote[0] + remote[1] * tokens, now=0.0)
    return p


def test_the_cheaper_side_is_chosen_at_each_size() -> None:
    # Here: no fixed cost, 1 ms a token. There: 200 ms of call and transfer, 0.2 ms a token.
    p = measured(local=(0.0, 0.001), remote=(0.2, 0.0002))
    assert p.choose(100, now=1.0) == (False, "local_sooner")  # 0.10 s here vs 0.22 s there
    assert p.choose(500, now=1.0) == (True, "remote_sooner")  # 0.50 s here vs 0.30 s there
    # A slow link: remote's per-token cost above compute's: local at every size.
    slow = measured(local=(0.0, 0.001), remote=(0.05, 0.003))
    assert all(slow.choose(n, now=1.0) == (False, "local_sooner") for n in (10, 500, 4000))


def test_a_queue_here_sends_remote_what_alone_is_sooner_here() -> None:
    """Each side's line is costed at the prompt's tokens plus those queued before it there: a
    prompt that alone is sooner here goes remote behind a queue here, and back once the same
    queue is on the prefill side instead."""
    p = measured(local=(0.0, 0.001), remote=(0.2, 0.0015))  # a slow link: 1.5 ms a token
    assert p.choose(300, 300, now=1.0) == (False, "local_sooner")  # 0.30 s here vs 0.65 s there
    assert p.choose(300 + 900, 300, now=1.0) == (True, "remote_sooner")  # 1.20 s vs 0.65 s
    assert p.choose(300, 300 + 900, now=1.0) == (False, "local_sooner")  # 0.30 s vs 2.00 s
    assert p.choose(300 + 900, 300 + 900, now=1.0) == (False, "local_sooner")  # 1.20 vs 2.00


def test_unsure_is_local_and_remote_is_tried_now_and_then() -> None:
    p = Placement("measured", explore_every=4)
    choices = [p.choose(300, now=0.0) for _ in range(8)]
    assert choices.count((True, "explore")) == 2
    assert choices.count((False, "unmeasured")) == 6
    # Remote known, this side not yet: local, to learn it.
    q = Placement("measured")
    for tokens in (64, 256, 1024):
        q.observe(True, tokens, 0.1, now=0.0)
    assert q.choose(300, now=1.0) == (False, "unmeasured")


def test_old_samples_make_a_side_tried_again() -> None:
    p = measured(local=(0.0, 0.0001), remote=(0.2, 0.0002))  # local always sooner
    assert p.choose(500, now=1.0) == (False, "local_sooner")
    later = 1.0 + p.stale_s + 1
    tries = [p.choose(500, now=later) for _ in range(p.explore_every)]
    assert (True, "explore") in tries  # remote unseen for long: tried again


def test_static_placement_always_goes_remote() -> None:
    assert Placement("static").choose(10) == (True, "static")


def test_measured_placement_on_a_real_pair_keeps_outputs_and_tries_remote(
    prompts, colocated
) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = start_pair(decode_args=["--prefill-placement", "measured"])
    with nodes(prefill, decode):
        d, p = decode_stub(decode.address), prefill_stub(prefill.address)
        placed = []
        for (ids, n), ref in zip(prompts, colocated, strict=True):
            tokens, remote = generate(d, ids, n)
            assert tokens == ref  # wherever it was computed
            placed.append(remote)
        assert placed[0] is False  # nothing measured yet: local
        # Prompts nothing of which is cached (each one a placement decision): within
        # EXPLORE_EVERY of them one is tried remotely, remote still unmeasured.
        base = max((ids for ids, _ in prompts), key=len)
        for k in range(EXPLORE_EVERY):
            fresh = [base[(i * 5 + k) % len(base)] for i in range(48)]
            placed.append(generate(d, fresh, 2)[1])
        assert any(placed)
        assert d.GetStats(pb.StatsRequest()).not_split == placed.count(False)
        assert_clean(d, p)
