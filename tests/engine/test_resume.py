"""A stream resumed on another engine (`RequestOptions.resume`: the tokens it had generated and
the characters of text its client had received) continues exactly as the undisturbed stream
did: the same tokens, and deltas that add up to the rest of its text — greedy, seeded with
penalties, with a stop string and under a guide. The reference is the undisturbed run on an
engine of its own; tokens a stream could not have generated are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.connector import KVConnector, RemotePrefillResult
from pdserve.engine.llm_engine import LLMEngine, RequestError
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import (
    Guide,
    GuideKind,
    Migration,
    RequestOptions,
    Resume,
    SamplingParams,
    Sequence,
)
from tests.helpers import assert_all_free, make_engine, make_tiny_model

EOS = 2  # the tiny tokenizer's
PROMPT = [5, 17, 42, 9, 77, 31, 8, 120, 64, 3, 250, 11]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engines(tiny_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    """The node that served the stream first and the one it resumes on."""
    return make_engine(tiny_dir), make_engine(tiny_dir)


def stream(
    engine: LLMEngine, params: SamplingParams, resume: Resume | None = None
) -> list[tuple[list[int], str]]:
    """Each output of one request as a client sees it: (tokens so far, text delta)."""
    engine.add_request("r", PROMPT, params, RequestOptions(resume=resume))
    outs = []
    while True:
        for o in engine.step():
            assert o.failure is None, o.failure
            outs.append((list(o.token_ids), o.delta_text))
            if o.finished:
                assert_all_free(engine)
                return outs


def check_every_resume_point(engines: tuple[LLMEngine, LLMEngine], params: SamplingParams) -> None:
    first, other = engines
    outs = stream(first, params)
    tokens, text = outs[-1][0], "".join(d for _, d in outs)
    assert len(tokens) > 8
    cuts = [i for i in range(len(outs) - 1) if outs[i][0]][:: max(1, len(outs) // 6)]
    for i in cuts:  # the stream died after the client received outs[: i + 1]
        sent = "".join(d for _, d in outs[: i + 1])
        rest = stream(other, params, Resume(tuple(outs[i][0]), len(sent)))
        assert rest[-1][0] == tokens, f"resumed after output {i}"
        assert sent + "".join(d for _, d in rest) == text, f"resumed after output {i}"
        assert all(len(t) > len(outs[i][0]) for t, _ in rest)  # nothing sent twice


def test_greedy_resumes_where_the_stream_stopped(engines: tuple[LLMEngine, LLMEngine]) -> None:
    check_every_resume_point(engines, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))


def test_seeded_sampling_with_penalties_resumes_the_same(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """Seeded draws depend on the position (sampler), penalties on the outputs so far: both
    carry over."""
    params = SamplingParams(
        max_tokens=40,
        temperature=0.9,
        seed=1234,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        ignore_eos=True,
    )
    check_every_resume_point(engines, params)


def test_a_stop_string_spanning_the_resume_point_still_stops(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """The text the client has not seen yet (held back: it could begin a stop string) is not
    lost, and a stop string whose start came before the resume point ends the stream."""
    free = stream(engines[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    text = "".join(d for _, d in free)
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    check_every_resume_point(engines, params)
    outs = stream(engines[0], params)
    assert "".join(d for _, d in outs) == text[: text.index(stop)]


def test_a_guided_stream_resumes_in_its_grammar(engines: tuple[LLMEngine, LLMEngine]) -> None:
    guide = Guide(GuideKind.REGEX, "(t[0-9]+){30}")
    check_every_resume_point(engines, SamplingParams(max_tokens=40, temperature=0, guide=guide))


def test_tokens_it_could_not_have_generated_are_refused(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    engine = engines[1]
    params = SamplingParams(max_tokens=8, temperature=0)
    vocab = engine.model_config.vocab_size
    for resume, why in [
        (Resume(tuple(range(10, 18))), "nothing is left"),
        (Resume((10, vocab)), "outside the vocabulary"),
        (Resume((10, EOS, 11)), "would have ended it"),
        (Resume((10, 11), sent_chars=10_000), "characters sent"),
    ]:
        with pytest.raises(RequestError, match=why):
            engine.add_request("bad", PROMPT, params, RequestOptions(resume=resume))
        assert_all_free(engine)
    guided = SamplingParams(max_tokens=8, temperature=0, guide=Guide(GuideKind.REGEX, "(t5)+"))
    with pytest.raises(RequestError, match="breaks its guide"):
        engine.add_request("bad", PROMPT, guided, RequestOptions(resume=Resume((10,))))
    assert_all_free(engine)


class CopyFetch(KVConnector):
    """Stands in for the transfer plane between two engines in one process: a migrated
    stream's KV is copied from the engine that paused it (`migration_blocks`, as its KV sender
    reads them) into the blocks this engine gave it, then that engine frees them."""

    def __init__(self, source: LLMEngine, target: LLMEngine) -> None:
        self.source, self.target = source, target
        self.done: list[RemotePrefillResult] = []

    def plan_remote_prefill(self, seq: Sequence) -> bool:
        return seq.options.resume is not None and seq.options.resume.source is not None

    def start_remote_prefill(self, seq: Sequence) -> None:
        assert seq.options.resume is not None and seq.options.resume.source is not None
        handle = seq.options.resume.source.handle
        n = seq.num_tokens - 1  # every token but the last one has its KV there
        src, _ = self.source.migration_blocks(handle, seq.all_token_ids[:n])
        dst = seq.block_table[: len(src)]
        for theirs, ours in zip(self.source.kv_caches, self.target.kv_caches, strict=True):
            ours[dst] = theirs[src]
        self.source.release_migrated(handle)
        self.done.append(RemotePrefillResult(seq.request_id, computed_tokens=n))

    def poll_remote_prefills(self) -> list[RemotePrefillResult]:
        done, self.done = self.done, []
        return done


@pytest.mark.parametrize("seeded", [False, True])
def test_a_stream_paused_between_steps_goes_on_elsewhere_from_its_kv(
    tiny_dir: Path, seeded: bool
) -> None:
    """Live migration, in the engine: paused (`migrate_out`) after any of its outputs, a stream
    ends there as migrated with its blocks held; another engine given its KV (of every token but
    the last) computes only its last token and goes on with exactly the undisturbed tokens and
    text; the first engine frees every block once the KV was taken, or after the hold expired."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    if seeded:
        params = SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True)
    first, other = make_engine(tiny_dir), make_engine(tiny_dir)
    other.attach_connector(CopyFetch(first, other))
    computed: list[int] = []  # tokens each of `other`'s steps computed
    schedule = other.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        computed.append(out.num_tokens)
        return out

    other.scheduler.schedule = spy  # type: ignore[method-assign]
    whole = stream(first, params)
    tokens, text = whole[-1][0], "".join(d for _, d in whole)
    for cut in (1, 5, 17, 30):
        first.add_request("r", PROMPT, params)
        sent, outs = "", []
        while len(outs) < cut:
            outs += [o for o in first.step() if o.token_ids]
        sent = "".join(o.delta_text for o in outs)
        [paused] = first.migrate_out(["r", "unknown"])
        assert paused.finish_reason == "migrated" and not first.requests
        assert first.pool.num_free < first.num_blocks  # held for the fetch
        sent += paused.delta_text
        with pytest.raises(RequestError, match="not a computed prefix"):
            first.migration_blocks("r", [t + 1 for t in PROMPT])
        computed.clear()
        source = Migration("first", "r")
        rest = stream(other, params, Resume(tuple(paused.token_ids), len(sent), source))
        assert rest[-1][0] == tokens, f"migrated after output {cut}"
        assert sent + "".join(d for _, d in rest) == text, f"migrated after output {cut}"
        assert_all_free(first)
        with pytest.raises(RequestError, match="fetched, expired or unknown"):
            first.migration_blocks("r", PROMPT)
        assert [n for n in computed if n][0] == 1  # only the last token, not the prompt
    # Not fetched: freed when its hold runs out.
    first.add_request("r", PROMPT, params)
    while not any(o.token_ids for o in first.step()):
        pass
    assert first.migrate_out(["r"])
    first._migrated["r"] = 0.0  # its hold ran out
    first.step()
    assert_all_free(first)
