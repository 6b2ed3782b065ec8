"""Scheduler unit tests: continuous batching, limits, chunked prefill, preemption. No torch
(but the last, which builds nodes' configs)."""

from __future__ import annotations

from pathlib import Path

from pdserve.config import DEFAULT_PREFILL_STEP_TOKENS, NodeConfig, SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sampled, SamplingParams, Sequence, SequenceStatus


def make(num_blocks: int = 64, block_size: int = 4, **cfg: int) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len=1000)


def req(rid: str, n: int, max_tokens: int = 8) -> Sequence:
    """A prompt of n tokens that shares no prefix with other requests."""
    base = 100 * (1 + sum(map(ord, rid)))
    tokens = list(range(base, base + n))
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(s: Scheduler, token: int = 7) -> list[Sequence]:
    out = s.schedule()
    sampled = {x.seq.request_id: Sampled(token) for x in out.scheduled if x.sample}
    return s.update(out, sampled, eos_ids=[0])


def test_new_requests_join_while_others_decode() -> None:
    s = make()
    a = req("a", 6)
    s.add(a)
    run_step(s)
    assert len(a.output_token_ids) == 1
    b = req("b", 5)
    s.add(b)
    out = s.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 5)]


def test_token_budget_chunks_long_prompts() -> None:
    s = make(max_num_batched_tokens=8)
    a = req("a", 20)
    s.add(a)
    chunks = []
    while not a.output_token_ids:
        out = s.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        s.update(out, {"a": Sampled(7)}, eos_ids=[])
    assert chunks == [8, 8, 4]
    assert s.stats.num_partial_prefills == 2


def test_prompts_arriving_together_are_not_left_a_small_last_chunk() -> None:
    """A remainder under an eighth of the budget goes with the rest (a step of its own would
    hold every decoding stream for little work); a larger one waits for the next step."""
    s = make(max_num_batched_tokens=2048, num_blocks=1024)
    together = [req(str(i), 542) for i in range(4)]  # 2168 tokens: 120 past the budget
    for seq in together:
        s.add(seq)
    out = s.schedule()
    assert [x.num_new_tokens for x in out.scheduled] == [542] * 4
    assert all(x.sample for x in out.scheduled)
    s = make(max_num_batched_tokens=2048, num_blocks=1024)
    long = req("long", 2048 + 2048 // 8 + 1)  # one token more than the remainder taken along
    s.add(long)
    assert [x.num_new_tokens for x in s.schedule().scheduled] == [2048]


def test_a_prefill_step_limit_serves_prompts_first_come_first_served() -> None:
    """With `prefill_step_tokens` (a prefill node's default) no new prompt joins a step that
    holds that many prompt tokens: four 542-token prompts arriving together are prefilled one
    per step in arrival order (the first reaches decode after one prompt's step, not four),
    short prompts still share a step up to the limit, and a prompt's chunks count."""
    s = make(max_num_batched_tokens=2048, num_blocks=1024, prefill_step_tokens=512)
    together = [req(str(i), 542) for i in range(4)]
    for seq in together:
        s.add(seq)
    steps = []
    while any(not seq.output_token_ids for seq in together):
        out = s.schedule()
        steps.append([(x.seq.request_id, x.num_new_tokens) for x in out.scheduled])
        s.update(out, {x.seq.request_id: Sampled(7) for x in out.scheduled if x.sample}, [0])
    assert steps == [
        [("0", 542)],
        [("0", 1), ("1", 542)],
        [("0", 1), ("1", 1), ("2", 542)],
        [("0", 1), ("1", 1), ("2", 1), ("3", 542)],
    ]
    s = make(max_num_batched_tokens=2048, num_blocks=1024, prefill_step_tokens=512)
    for i in range(8):
        s.add(req(f"short{i}", 100))
    assert [x.num_new_tokens for x in s.schedule().scheduled] == [100] * 6  # 600 >= 512
    s = make(max_num_batched_tokens=300, num_blocks=1024, prefill_step_tokens=256)
    long, after = req("long", 900), req("after", 10)
    s.add(long)
    run_step(s)  # its first 300-token chunk
    s.add(after)
    assert [x.seq.request_id for x in s.schedule().scheduled] == ["long"]  # 300 >= 256


def test_max_num_seqs_limits_running() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(str(i), 3))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_preemption_frees_and_requeues_latest() -> None:
    s = make(num_blocks=4, block_size=4)
    a, b = req("a", 7, max_tokens=6), req("b", 7, max_tokens=6)
    s.add(a)
    s.add(b)
    run_step(s)  # both admitted: 2 blocks each, pool full
    run_step(s)  # each computes its 8th token, still in its second block
    assert s.kv.pool.num_free == 0
    out = s.schedule()  # a's 9th token needs a 3rd block: b is preempted
    assert out.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and s.waiting[0] is b
    assert b.num_computed_tokens == 0 and len(b.output_token_ids) == 2  # kept, recomputed later
    s.update(out, {x.seq.request_id: Sampled(7) for x in out.scheduled if x.sample}, [])
    while s.num_unfinished:
        run_step(s)
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6
    s.kv.pool.check_integrity()
    assert s.kv.pool.num_free == 4


def test_stop_conditions() -> None:
    s = make()
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=5))
    b = Sequence("b", [1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=(7,)))
    s.add(a)
    s.add(b)
    done = run_step(s, token=0)  # 0 is eos: a stops; b stops too (eos is not ignored)
    assert {x.request_id for x in done} == {"a", "b"}
    assert a.status == SequenceStatus.FINISHED_STOPPED
    c = Sequence("c", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=(7,)))
    s.add(c)
    run_step(s, token=7)
    assert c.status == SequenceStatus.FINISHED_STOPPED and c.output_token_ids == [7]
    d = req("d", 2, max_tokens=3)
    s.add(d)
    for _ in range(3):
        run_step(s)
    assert d.status == SequenceStatus.FINISHED_LENGTH and len(d.output_token_ids) == 3
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_finish_removes_from_anywhere_and_is_idempotent() -> None:
    s = make(max_num_batched_tokens=4)
    a, b = req("a", 10), req("b", 3)
    s.add(a)
    s.add(b)
    s.schedule()  # a is mid-prefill, b waits
    s.finish(a, SequenceStatus.FINISHED_ABORTED)
    s.finish(a, SequenceStatus.FINISHED_ABORTED)
    s.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert not s.running and not s.waiting
    s.kv.pool.check_integrity()
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_a_remote_prefill_is_weighed_against_the_prompt_tokens_still_to_compute_here() -> None:
    """`keep_remote` is asked with the prompt tokens the running requests have left to compute
    here (a chunked prompt's rest; nothing for one that decodes), as they stand when it is
    asked."""
    asked: list[tuple[str, int]] = []

    def keep(seq: Sequence, backlog: int) -> bool:
        asked.append((seq.request_id, backlog))
        return False

    kv = KVCacheManager(BlockPool(64), 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv, max_model_len=1000,
                  keep_remote=keep)  # fmt: skip
    a, b = req("a", 3), req("b", 20)
    s.add(a)
    s.add(b)
    run_step(s)  # a: prompt done, decoding; b: 13 of its 20 computed
    assert len(a.output_token_ids) == 1 and b.num_computed_tokens == 13
    c = req("c", 6)
    c.remote_prefill = True
    s.add(c)
    s.schedule()
    assert asked == [("c", 7)]  # b's rest (scheduled in this step, not yet computed); a decodes
    assert s.prefill_backlog() == 7 + 6  # c now computes here too


def test_prefill_nodes_take_the_step_limit_unless_told_otherwise(tmp_path: Path) -> None:
    """`pdserve prefill` (and a local pair's prefill) limits its steps' prompt tokens by
    default; colocated and decode nodes do not; --prefill-step-tokens overrides either."""
    from pdserve.cli.configs import engine_config
    from pdserve.cli.flags import build_parser
    from pdserve.serve.node import build_node

    def limit(role: str, *flags: str) -> int | None:
        none = lambda args: 0  # noqa: E731
        args = build_parser(none, none, none).parse_args(["serve", "--role", role, *flags])
        node = build_node(
            role, engine_config(args), tmp_path, NodeConfig(prefill_addresses=("127.0.0.1:1",))
        )
        return node.engine_config.scheduler.prefill_step_tokens

    assert limit("prefill") == DEFAULT_PREFILL_STEP_TOKENS
    assert limit("both") is None and limit("decode") is None
    assert limit("prefill", "--prefill-step-tokens", "4096") == 4096
    assert limit("both", "--prefill-step-tokens", "300") == 300
