"""The OpenAI API of a real `pdserve serve` cluster, driven by the official openai client, and
compared with a colocated `--role both` server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.disagg.cluster import free_port
from tests.helpers import logs_kept_on_failure

pytestmark = pytest.mark.slow

T = TypeVar("T")
MODEL = "SmolLM2-135M-Instruct"
FLAGS = ["--dtype", "float32", "--threads", "1", "--log-level", "INFO"]


class Server:
    def __init__(self, args: list[str], global_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="pdserve-serve-", suffix=".log")[1])
        log_level, rest = FLAGS[-1], [f for f in FLAGS if f not in ("--log-level", "INFO")]
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", log_level, *global_args, "serve",
               "--port", str(self.port), *rest, *args]  # fmt: skip
        env = {**os.environ, "UCX_NET_DEVICES": "lo"}  # NIXL's UCX would pick interfaces itself
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text()[-3000:])
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError(self.log.read_text()[-3000:])
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def prefill_http(self) -> str:
        m = re.search(r"pdserve prefill ready http=(\S+)", self.log.read_text())
        assert m, self.log.read_text()
        return m.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def server(request: pytest.FixtureRequest, *args: Any, **kwargs: Any) -> Iterator[Server]:
    s = Server(*args, **kwargs)
    with logs_kept_on_failure(request, lambda: [s.log]):
        try:
            yield s
        finally:
            s.stop()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Server]:
    with server(request, []) as s:
        yield s


@pytest.fixture(scope="module")
def colocated(request: pytest.FixtureRequest) -> Iterator[Server]:
    with server(request, ["--role", "both"], ("--log-format", "json")) as s:
        yield s


PROMPTS = [
    "Once upon a time, in a quiet village by the sea, there lived an old fisherman who",
    "The three most important inventions of the nineteenth century were the telegraph,",
]


def complete(s: Server, prompt: str, stream: bool, **kw) -> str:  # type: ignore[no-untyped-def]
    if not stream:
        return s.client.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].text
    chunks = s.client.completions.create(model=MODEL, prompt=prompt, stream=True, **kw)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def chat(s: Server, prompt: str, stream: bool, **kw) -> str:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = s.client.chat.completions.create(model=MODEL, messages=messages, **kw)
        return r.choices[0].message.content or ""
    chunks = s.client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw)
    return "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)


def together(*calls: Callable[[], T]) -> list[T]:
    """Independent requests sent at once, their results in order (they batch on the nodes;
    batching does not change outputs: tests/engine/test_generation.py)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_streamed_equals_non_streamed_and_disagg_equals_colocated(
    cluster: Server, colocated: Server
) -> None:
    greedy = dict(max_tokens=24, temperature=0.0)
    seeded = dict(max_tokens=16, temperature=0.9, seed=7)
    for call in (complete, chat):
        for prompt in PROMPTS:
            texts = together(
                *(partial(call, s, prompt, stream, **greedy)
                  for s in (cluster, colocated) for stream in (False, True)),
                *(partial(call, cluster, prompt, stream, **seeded) for stream in (False, True)),
            )  # fmt: skip
            assert texts[0] and len(set(texts[:4])) == 1, texts
            assert texts[4] == texts[5]


def test_usage_counts(cluster: Server) -> None:
    r = cluster.client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=9,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None
    assert r.usage.completion_tokens == 9
    from pdserve.model.fetch import resolve_model
    from pdserve.model.tokenizer import Tokenizer
    from tests.helpers import cache_dir

    tok = Tokenizer(resolve_model("default", cache_dir(), "float32"))
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[0]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9
    chunks = list(
        cluster.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_errors_are_openai_style_400s_without_traceback(cluster: Server) -> None:
    cases = [
        dict(model=MODEL, prompt="hi", top_p=5.0),
        dict(model="no-such-model", prompt="hi"),
        dict(model=MODEL, prompt="word " * 9000, max_tokens=4),
    ]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError) as e:
            cluster.client.completions.create(**kwargs)  # type: ignore[call-overload]
        body = e.value.body
        assert isinstance(body, dict) and body.get("message"), body
        assert "Traceback" not in str(body)
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=4)
    assert re.search(r"8192 tokens.*\d+ prompt tokens", str(e.value.body))


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{v}}}" for v in sample.labels.values())
            out[key] = sample.value
    return out


def all_free(url: str) -> bool:
    m = metrics(url)
    return m["pdserve:kv_blocks_free"] == m["pdserve:kv_blocks_total"] and (
        m.get("pdserve:resource_store_entries", 0) == 0
    )


def test_disconnect_mid_stream_frees_both_nodes_within_2s(cluster: Server) -> None:
    prefill_url = cluster.prefill_http()
    with httpx.stream(
        "POST",
        f"{cluster.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPTS[1] * 3,
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        },
        timeout=30,
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert not all_free(cluster.url)
    closed = time.monotonic()  # leaving the block closed the connection
    while time.monotonic() - closed < 2.0:
        if all_free(cluster.url) and all_free(prefill_url):
            break
        time.sleep(0.05)
    assert all_free(cluster.url) and all_free(prefill_url)


def test_disconnect_while_waiting_for_a_non_streamed_answer_frees_both_nodes(
    cluster: Server,
) -> None:
    prefill_url = cluster.prefill_http()
    body = {"model": MODEL, "prompt": PROMPTS[1] * 3, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=1.5)
    closed = time.monotonic()
    while time.monotonic() - closed < 2.0:
        if all_free(cluster.url) and all_free(prefill_url):
            break
        time.sleep(0.05)
    assert all_free(cluster.url) and all_free(prefill_url)


@pytest.fixture
def small_queue(request: pytest.FixtureRequest) -> Iterator[Server]:
    with server(request, ["--role", "both", "--max-waiting", "4", "--max-num-seqs", "2"]) as s:
        yield s


def test_burst_beyond_max_waiting_gets_503_with_retry_after_and_frees_everything(
    small_queue: Server,
) -> None:
    s = small_queue
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            calls = [client.post(f"{s.url}/v1/completions", json=body) for _ in range(50)]
            return list(await asyncio.gather(*calls))

    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(refused) == 50, [r.status_code for r in responses]
    assert ok and refused
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in ok)
    for r in refused:
        assert r.headers.get("retry-after") == "1"
        assert r.json()["error"]["code"] == "overloaded"
    deadline = time.monotonic() + 2  # the node's snapshot follows its loop turn
    while not all_free(s.url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all_free(s.url)
    assert 1 <= metrics(s.url)["pdserve:num_requests_waiting_peak"] <= 4  # never more


@pytest.fixture
def short_deadline(request: pytest.FixtureRequest) -> Iterator[Server]:
    with server(request, ["--role", "both", "--request-timeout", "2"]) as s:
        yield s


def test_a_request_past_its_deadline_ends_504_naming_the_stage_and_frees_its_blocks(
    short_deadline: Server,
) -> None:
    """A colocated HTTP request gets the node's deadline at the edge, like a gRPC one: past
    it, non-streamed, a 504 naming where it was; streamed, an error event; blocks freed."""
    s = short_deadline
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True}
    start = time.monotonic()
    r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
    took = time.monotonic() - start
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["code"] == "timeout" and "stage: decode" in error["message"], error
    assert 2.0 <= took < 10.0, took  # it ended at its deadline, not after 4000 tokens
    with httpx.stream(
        "POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as streamed:
        assert streamed.status_code == 200  # the stream started before the deadline
        events = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert "error" in json.loads(events[-1][len("data: ") :]), events[-1]
    assert "stage: decode" in events[-1]
    deadline = time.monotonic() + 2  # the node's snapshot follows its loop turn
    while not all_free(s.url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all_free(s.url)


def test_metrics_parse_and_transfer_series_move(cluster: Server) -> None:
    before = metrics(cluster.url)
    # A prompt nothing before sent (a cached one would be finished on decode: short_suffix).
    complete(cluster, "Metrics, series and counters move: " + PROMPTS[0], False, max_tokens=4)
    after = metrics(cluster.url)
    assert after["pdserve:transfer_bytes_total{received}"] > before.get(
        "pdserve:transfer_bytes_total{received}", 0
    )
    assert after["pdserve:transfer_latency_seconds_count"] > before.get(
        "pdserve:transfer_latency_seconds_count", 0
    )
    assert (
        after[f"vllm:time_to_first_token_seconds_count{{{MODEL}}}"]
        > before[f"vllm:time_to_first_token_seconds_count{{{MODEL}}}"]
    )
    assert "pdserve:resource_store_entries" in after and "pdserve:side_channel_entries" in after
    prefill = metrics(cluster.prefill_http())
    assert prefill["pdserve:transfer_bytes_total{sent}"] > 0


def test_ttft_breakdown_comes_from_node_timestamps(cluster: Server) -> None:
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
        timeout=60,
    ).json()
    timing = r["pdserve_timing"]
    stages = ("queueing", "prefill_compute", "exposed_transfer", "decode_admission", "other")
    assert all(timing[s] >= -0.01 for s in stages[:4])
    assert sum(timing[s] for s in stages) == pytest.approx(timing["ttft"])
    assert timing["prefill_compute"] > 0
    m = metrics(cluster.url)
    assert m["pdserve:ttft_breakdown_seconds_count{exposed_transfer}"] >= 1


def test_models_and_health(cluster: Server) -> None:
    assert [m.id for m in cluster.client.models.list()] == [MODEL]
    assert httpx.get(f"{cluster.url}/health").json()["status"] == "ok"


def test_tokenize_and_detokenize_agree_with_transformers(
    cluster: Server, smollm_fp32_dir: Path
) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm_fp32_dir))
    r = httpx.post(f"{cluster.url}/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == reference(PROMPTS[0])["input_ids"]
    assert body["count"] == len(body["tokens"])
    card = httpx.get(f"{cluster.url}/v1/models").json()["data"][0]
    assert body["max_model_len"] == card["max_model_len"] > 0
    usage = cluster.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == body["count"]
    messages = [{"role": "user", "content": PROMPTS[1]}]
    r = httpx.post(f"{cluster.url}/tokenize", json={"model": MODEL, "messages": messages})
    assert r.json()["tokens"] == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    r = httpx.post(f"{cluster.url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == reference.decode(body["tokens"])
    for bad in (
        {"model": MODEL, "tokens": [10**9]},
        {"model": "other", "tokens": [1]},
    ):
        r = httpx.post(f"{cluster.url}/detokenize", json=bad)
        assert r.status_code in (400, 404) and "error" in r.json()
    # More ids than the context holds: refused naming the cap (the answer stays bounded).
    limit = card["max_model_len"]
    r = httpx.post(f"{cluster.url}/detokenize", json={"model": MODEL, "tokens": [5] * (limit + 1)})
    assert r.status_code == 400 and f"at most {limit} token ids" in r.json()["error"]["message"]
    both = {"model": MODEL, "prompt": "a", "messages": messages}
    assert httpx.post(f"{cluster.url}/tokenize", json=both).status_code == 400


def _chat_logprobs(s: Server, stream: bool, **kw: object) -> list[tuple[str, float, list[str]]]:
    """(token, logprob, top tokens) per position of a greedy chat answer."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=12,
                temperature=0.0, logprobs=True, **kw)  # fmt: skip
    if not stream:
        r = s.client.chat.completions.create(**args)  # type: ignore[call-overload]
        content = r.choices[0].logprobs.content
    else:
        chunks = s.client.chat.completions.create(stream=True, **args)  # type: ignore[call-overload]
        content = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]  # fmt: skip
    return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in content]


def test_penalties_bias_min_tokens_and_top_logprobs_disagg_equal_colocated(
    cluster: Server, colocated: Server
) -> None:
    plain = _chat_logprobs(colocated, False, top_logprobs=3)
    assert all(len(top) == 3 and tok == top[0] for tok, _, top in plain)  # greedy: the top one
    first = colocated.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=1,
        temperature=0.0, logprobs=True,
    )  # fmt: skip
    first_text = first.choices[0].logprobs.content[0].token
    body = {"model": MODEL, "prompt": first_text}
    tok = httpx.post(f"{colocated.url}/tokenize", json=body).json()["tokens"]
    # Banning the unbiased first token: prefill samples it, so the bias must travel there.
    controls = dict(
        top_logprobs=4, presence_penalty=0.8, frequency_penalty=0.5,
        logit_bias={str(tok[0]): -100},
        extra_body={"repetition_penalty": 1.3, "min_tokens": 10},
    )  # fmt: skip
    runs = [_chat_logprobs(s, bool(st), **controls) for s in (cluster, colocated) for st in (0, 1)]
    assert runs[0][0][0] != first_text
    assert len(runs[0]) >= 10
    for other in runs[1:]:
        assert [(t, top) for t, _, top in other] == [(t, top) for t, _, top in runs[0]]
        assert max(abs(a[1] - b[1]) for a, b in zip(other, runs[0], strict=True)) < 1e-3
    assert [t for t, _, _ in runs[0]] != [t for t, _, _ in plain]


def test_completion_logprobs_echo_and_continuous_usage(colocated: Server) -> None:
    r = colocated.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0.0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.text.startswith(PROMPTS[0]) and len(choice.text) > len(PROMPTS[0])
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == 5 and len(lp.top_logprobs) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and max(top.values()) == logprob  # greedy: the chosen is top
        assert 1 <= len(top) <= 3  # the two most likely and the chosen one
    assert lp.text_offset[0] == len(PROMPTS[0])
    chunks = list(
        colocated.client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0.0, echo=True,
            stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )  # fmt: skip
    assert chunks[0].choices[0].text == PROMPTS[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    used = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(used) == len(chunks) and used == sorted(used) and used[-1] == 5


def test_cached_tokens_count_the_prompt_found_in_the_prefix_cache(colocated: Server) -> None:
    prompt = "A fresh prompt for the cache: " + "the quick brown fox jumps over the lazy dog " * 8
    usage = [
        colocated.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
        for _ in range(2)
    ]
    assert usage[0] is not None and usage[1] is not None
    cached = [u.prompt_tokens_details.cached_tokens for u in usage]  # type: ignore[union-attr]
    assert cached[0] == 0
    block = 16
    assert cached[1] == (usage[1].prompt_tokens - 1) // block * block > 0


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_output_holds_disaggregated_and_equals_colocated(
    cluster: Server, colocated: Server
) -> None:
    ask = "Describe a fictional person."
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    greedy = dict(max_tokens=60, temperature=0.0)
    *texts, free = together(
        *(partial(chat, s, ask, stream, response_format=fmt, **greedy)
          for s in (cluster, colocated) for stream in (False, True)),
        partial(chat, colocated, ask, False, **greedy),
    )  # fmt: skip
    assert len(set(texts)) == 1, texts
    person = json.loads(texts[0])
    assert set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert free != texts[0]  # the constraint, not the model's habit, made it this JSON
    # Choices the model would never start with: prefill samples the first token, so the
    # constraint must hold there too.
    choices = ["zebra-42", "yak-7"]
    choice = {"structured_outputs": {"choice": choices}}
    regex = r"[0-9]{3}-[0-9]{4}"
    *chosen, unguided, number_a, number_b, obj = together(
        *(partial(complete, s, PROMPTS[0], stream, max_tokens=12, temperature=0.0,
                  extra_body=choice)
          for s in (cluster, colocated) for stream in (False, True)),
        partial(complete, cluster, PROMPTS[0], False, max_tokens=12, temperature=0.0),
        *(partial(complete, s, PROMPTS[1], False, max_tokens=12, temperature=0.9, seed=5,
                  extra_body={"guided_regex": regex})
          for s in (cluster, colocated)),
        partial(chat, cluster, ask, False, max_tokens=40, temperature=0.0,
                response_format={"type": "json_object"}),
    )  # fmt: skip
    assert all(got in choices for got in chosen), chosen
    assert unguided not in choices
    assert re.fullmatch(regex, number_a) and re.fullmatch(regex, number_b), (number_a, number_b)
    assert obj.lstrip().startswith("{")


def test_bad_structured_output_is_a_400_naming_the_problem(cluster: Server) -> None:
    cases = [
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"guided_json": "{not json"}, "json_schema"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex, guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ]
    for extra, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            cluster.client.completions.create(
                model=MODEL, prompt="hi", max_tokens=4, extra_body=extra
            )
        assert needle in str(e.value.body), e.value.body


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def test_n_choices_are_prefilled_once_and_equal_colocated(
    cluster: Server, colocated: Server
) -> None:
    def counters(url: str) -> tuple[float, float]:
        m = metrics(url)
        return m.get("pdserve:not_split_total{shares_prompt}", 0.0), m[
            f"vllm:prefix_cache_queries_total{{{MODEL}}}"
        ]

    prompt = "Three different endings for a story about a lighthouse keeper: " * 3
    kw = dict(model=MODEL, prompt=prompt, n=4, max_tokens=10, temperature=0.9, seed=11)
    shared_before, _ = counters(cluster.url)
    prefill_queries_before = counters(cluster.prefill_http())[1]
    got = cluster.client.completions.create(**kw)  # type: ignore[call-overload]
    want = colocated.client.completions.create(**kw)  # type: ignore[call-overload]
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(want.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # the seeds differ per choice
    shared_after, _ = counters(cluster.url)
    assert shared_after - shared_before == 3  # choices 1-3 took choice 0's blocks
    prompt_tokens = got.usage.prompt_tokens
    # The prefill node admitted the prompt once, for choice 0.
    assert counters(cluster.prefill_http())[1] - prefill_queries_before == prompt_tokens
    streamed = cluster.client.completions.create(stream=True, **kw)  # type: ignore[call-overload]
    joined = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            joined[c.index] += c.text
    assert joined == texts


def test_best_of_returns_the_n_most_likely_of_its_candidates(cluster: Server) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True})  # fmt: skip
    pool = cluster.client.completions.create(n=4, logprobs=0, **kw)  # type: ignore[call-overload]
    scored = sorted(pool.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = cluster.client.completions.create(n=2, best_of=4, **kw)  # type: ignore[call-overload]
    assert [c.text for c in best.choices] == [c.text for c in scored[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage is not None and best.usage.completion_tokens == 4 * 8
    for bad in (dict(n=3, best_of=2), dict(n=1, best_of=2, stream=True)):
        with pytest.raises(openai.BadRequestError, match="best_of"):
            cluster.client.completions.create(**{**kw, **bad})  # type: ignore[call-overload]


def exported_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":  # declared, if not yet counted anything
            names.add(f"{family.name}_total")
        names.update(sample.name for sample in family.samples)
    return names


def test_grafana_dashboard_queries_only_exported_metrics(cluster: Server) -> None:
    from pdserve.config import RouterConfig
    from pdserve.router.app import Router

    cluster.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    exported = set()
    for url in (cluster.url, cluster.prefill_http()):
        exported |= exported_names(httpx.get(f"{url}/metrics", timeout=5).text)
    router = Router(RouterConfig(decodes=("http://127.0.0.1:9",)))
    for family in router.registry.collect():
        exported |= {family.name, f"{family.name}_total"}
    dashboard = json.loads(Path("docs/grafana/pdserve.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"]]
    named = {m for q in queries for m in re.findall(r"[a-z_]+:[a-z0-9_]+", q)}
    assert len(named) >= 15 and {n.split(":")[0] for n in named} == {"vllm", "pdserve"}
    assert named <= exported, sorted(named - exported)
    # vLLM's own names carry its model_name label, as vLLM's dashboards filter on it
    text = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in text


def test_json_access_log_names_request_status_tokens_and_timings(colocated: Server) -> None:
    r = colocated.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, extra_body={"ignore_eos": True}
    )
    chunks = list(colocated.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        colocated.client.completions.create(model=MODEL, prompt="hi", top_p=5.0)
    deadline = time.monotonic() + 10
    while True:
        records = []
        for line in colocated.log.read_text().splitlines():
            if line.startswith("{"):
                record = json.loads(line)  # every log line is one JSON object
                if record["logger"] == "pdserve.access":
                    records.append(record)
        by_id = {rec.get("request_id"): rec for rec in records}
        stream_id = chunks[0].id.removeprefix("chatcmpl-")
        refused = [rec for rec in records if rec["status"] == 400]
        logged = r.id.removeprefix("cmpl-") in by_id and stream_id in by_id and refused
        if logged or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    done = by_id[r.id.removeprefix("cmpl-")]
    assert done["status"] == 200 and done["path"] == "/v1/completions"
    assert done["completion_tokens"] == 4 and done["prompt_tokens"] == r.usage.prompt_tokens
    assert 0 < done["ttft_s"] <= done["duration_s"]
    # where that TTFT went: colocated, queueing and the prompt's compute, nothing transferred
    stages = done["ttft_stages"]
    assert set(stages) == {
        "queueing",
        "prefill_compute",
        "exposed_transfer",
        "decode_admission",
        "other",
    }
    assert stages["prefill_compute"] > 0 and stages["exposed_transfer"] == 0
    assert 0 < sum(stages.values()) <= done["duration_s"]
    streamed = by_id[stream_id]  # logged when the stream's last byte was sent
    assert streamed["completion_tokens"] == 3 and streamed["path"] == "/v1/chat/completions"
    assert refused and refused[-1]["path"] == "/v1/completions"


def test_top_logprobs_and_repetition_penalty_match_transformers(
    cluster: Server, colocated: Server, hf_smollm: torch.nn.Module
) -> None:
    """Against transformers' own GGUF loader (its own dequantization) on the same weights:
    `logprobs=5` (completions) and chat `top_logprobs=5` are its five most likely tokens with
    its log-softmax values; `repetition_penalty` picks what its logits processor picks."""
    body = {"model": MODEL, "prompt": PROMPTS[0]}
    ids = httpx.post(f"{colocated.url}/tokenize", json=body).json()["tokens"]
    steps, want = 4, []
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(hf_smollm(torch.tensor([seq])).logits[0, -1].float(), -1)
            values, top = torch.topk(row, 5)
            want.append(list(zip(top.tolist(), values.tolist(), strict=True)))
            seq.append(int(top[0]))

    def text(token: int) -> str:
        r = httpx.post(f"{colocated.url}/detokenize", json={"model": MODEL, "tokens": [token]})
        return str(r.json()["prompt"])

    want_text = [[(text(t), v) for t, v in pos] for pos in want]
    for s in (cluster, colocated):
        r = s.client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=steps, temperature=0.0, logprobs=5,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        got = r.choices[0].logprobs.top_logprobs
        assert len(got) == steps
        for g, w in zip(got, want_text, strict=True):
            assert set(g) == {t for t, _ in w}
            assert max(abs(g[t] - v) for t, v in w) < 2e-3
    with torch.no_grad():
        ref = hf_smollm.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=None,
            pad_token_id=0,
        )
    ref_ids = ref[0, len(ids) :].tolist()
    plain = complete(colocated, PROMPTS[0], False, max_tokens=12, temperature=0.0,
                     extra_body={"ignore_eos": True})  # fmt: skip
    for s in (cluster, colocated):
        r = s.client.completions.create(
            model=MODEL, prompt=ids, max_tokens=12, temperature=0.0, logprobs=0,
            extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
        )  # fmt: skip
        assert r.choices[0].logprobs.tokens == [text(t) for t in ref_ids]
    assert r.choices[0].text != plain  # the penalty changed the output


def test_json_schema_output_validates_for_ten_prompts(cluster: Server, colocated: Server) -> None:
    import concurrent.futures

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    asks = [f"Invent person number {i} for a story set in city {i * 7}." for i in range(10)]
    for s in (cluster, colocated):
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            texts = list(pool.map(
                lambda a, s=s: chat(s, a, False, max_tokens=100, temperature=0.0,
                                    response_format=fmt),
                asks,
            ))  # fmt: skip
        for t in texts:
            jsonschema.validate(json.loads(t), PERSON)


def test_min_tokens_yields_to_a_constraint_that_allows_only_a_stop(colocated: Server) -> None:
    """Once the choice "zebra-42" is complete only a stop token is allowed, which min_tokens
    would ban: the request must still end (not fail), and a request sharing its batch too."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(
            complete, colocated, PROMPTS[1], False, max_tokens=30, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        guided = pool.submit(
            complete, colocated, PROMPTS[0], False, max_tokens=30, temperature=1.0, seed=1,
            extra_body={"structured_outputs": {"choice": ["zebra-42"]}, "min_tokens": 20},
        )  # fmt: skip
        assert guided.result() == "zebra-42"
        assert len(other.result()) > 0


def test_a_completed_constraint_ends_the_request_even_with_ignore_eos(cluster: Server) -> None:
    r = cluster.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["zebra-42"]}, "ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].text == "zebra-42" and r.choices[0].finish_reason == "stop"


def test_streamed_logprobs_cover_every_token_while_text_is_held_back(colocated: Server) -> None:
    # A long stop string holds text back for several tokens: their logprobs must still come.
    kw = dict(stop=["@" * 24], extra_body={"ignore_eos": True})
    # Both compared answers start from the prompt's prefix cached (the first one alone computes
    # the whole prompt, whose first logprob may differ in its last bits over a cached prefix:
    # this failed whenever no earlier test on this worker had sent the prompt).
    _chat_logprobs(colocated, False, **kw)
    whole = _chat_logprobs(colocated, False, **kw)
    assert len(whole) == 12
    assert _chat_logprobs(colocated, True, **kw) == whole


def sse_chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed answer, up to [DONE]."""
    events = []
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def test_a_stream_resumed_on_another_node_goes_on_where_it_stopped(
    cluster: Server, colocated: Server
) -> None:
    """`return_token_ids` gives each delta's tokens; a request with `pdserve_resume` (those
    tokens and the characters received) on another node — here the disaggregated cluster —
    sends exactly the rest of the undisturbed stream: chat (no second role chunk) and
    completions, greedy and seeded."""
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}]}),
        ("/v1/completions", {"prompt": PROMPTS[1], "temperature": 0.8, "seed": 11}),
    ]
    for path, extra in cases:
        body = {"model": MODEL, "max_tokens": 24, "stream": True, "temperature": 0, **extra}
        body["ignore_eos"] = True
        whole = sse_chunks(colocated.url + path, {**body, "return_token_ids": True})
        chat_ = path.endswith("chat/completions")

        def text_of(c: dict[str, Any], chat_: bool = chat_) -> str:
            choice = c["choices"][0]
            return str((choice["delta"].get("content") if chat_ else choice["text"]) or "")

        tokens = [t for c in whole for t in c["choices"][0].get("token_ids", [])]
        text = "".join(text_of(c) for c in whole)
        assert len(tokens) == 24 and text == complete_text(colocated, path, body)
        for cut in (2, len(whole) // 2):
            head = whole[:cut]
            sent = [t for c in head for t in c["choices"][0].get("token_ids", [])]
            chars = sum(len(text_of(c)) for c in head)
            resume = {"token_ids": sent, "sent_chars": chars}
            rest = sse_chunks(cluster.url + path, {**body, "pdserve_resume": resume})
            assert "".join(text_of(c) for c in head + rest) == text, (path, cut)
            assert all("token_ids" not in c["choices"][0] for c in rest)  # not asked for
            roles = [c for c in rest if c["choices"][0].get("delta", {}).get("role")]
            assert not roles, "a resumed stream has its head already"
        # Named as migrated from a decode that holds nothing (nothing listens there): the
        # fetch fails and the stream is computed here instead, the same text.
        failed = metrics(cluster.url).get("pdserve:migrations_total{failed}", 0.0)
        cut = len(whole) // 2
        sent = [t for c in whole[:cut] for t in c["choices"][0].get("token_ids", [])]
        chars = sum(len(text_of(c)) for c in whole[:cut])
        nowhere = {"address": f"127.0.0.1:{free_port()}", "handle": "abc123"}
        resume = {"token_ids": sent, "sent_chars": chars, "migrate_from": nowhere}
        rest = sse_chunks(cluster.url + path, {**body, "pdserve_resume": resume})
        assert "".join(text_of(c) for c in whole[:cut] + rest) == text, path
        assert metrics(cluster.url)["pdserve:migrations_total{failed}"] == failed + 1
    bad = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    for resume, why in [
        ({"token_ids": [1, 2, 3, 4]}, "nothing is left"),
        ({"token_ids": [5], "sent_chars": 99}, "characters sent"),
    ]:
        r = httpx.post(f"{colocated.url}/v1/completions", json={**bad, "pdserve_resume": resume})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    r = httpx.post(
        f"{colocated.url}/v1/completions",
        json={**bad, "n": 2, "pdserve_resume": {"token_ids": [5]}},
    )
    assert r.status_code == 400 and "one choice" in r.json()["error"]["message"], r.text


def complete_text(s: Server, path: str, body: dict[str, Any]) -> str:
    """The same request answered whole (not streamed)."""
    r = httpx.post(s.url + path, json={**body, "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def test_sigterm_on_serve_leaves_no_child_process(cluster: Server) -> None:
    """Last in this module: it ends the module's `serve` cluster."""
    kids = children_of(cluster.proc.pid)
    assert len(kids) == 2
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(30) == 0
    for pid in kids:
        assert (
            not Path(f"/proc/{pid}").exists()
            or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        )
