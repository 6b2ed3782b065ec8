"""The load generator: sends every prompt to an OpenAI-compatible /v1/completions endpoint as a
streaming request (Poisson arrivals at a rate, or as fast as a concurrency limit allows) and
records what the client sees of each: time to first token, every gap between streamed
chunks, end-to-end latency and token counts (from the usage the server reports)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

from pdserve.bench.dataset import BenchPrompt
from pdserve.bench.stats import RequestRecord


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    model: str
    request_rate: float = math.inf  # requests/s (Poisson); inf: all at once
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    api_key: str | None = field(default=None, repr=False)  # sent as a Bearer token


async def _one(client: httpx.AsyncClient, cfg: LoadConfig, p: BenchPrompt) -> RequestRecord:
    body: dict[str, object] = {
        "model": cfg.model,
        "prompt": p.prompt,
        "max_tokens": p.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    start = time.monotonic()
    rec = RequestRecord(start=start, ok=False, prompt_tokens=p.prompt_len)
    last: float | None = None
    chunks = 0
    try:
        async with client.stream("POST", f"{cfg.base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = str(obj["error"].get("message", obj["error"]))
                    return rec
                now = time.monotonic()
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    chunks += 1
                    if rec.ttft is None:
                        rec.ttft = now - start
                    elif last is not None:
                        rec.itl.append(now - last)
                    last = now
                if obj.get("usage"):
                    rec.prompt_tokens = obj["usage"]["prompt_tokens"]
                    rec.output_tokens = obj["usage"]["completion_tokens"]
                if obj.get("pdserve_timing"):
                    rec.timing = obj["pdserve_timing"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.e2e = time.monotonic() - start
    rec.output_tokens = rec.output_tokens or chunks
    rec.ok = rec.ttft is not None
    if not rec.ok:
        rec.error = "no tokens streamed"
    return rec


async def run_load(
    cfg: LoadConfig, prompts: list[BenchPrompt], progress: bool = True
) -> tuple[list[RequestRecord], float]:
    """(one record per prompt in order, wall-clock duration of the run)."""
    rng = random.Random(cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(prompts) or 1)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="requests", unit="req")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits, headers=headers) as client:

        async def guarded(p: BenchPrompt) -> RequestRecord:
            async with limit:
                rec = await _one(client, cfg, p)
            if bar is not None:
                bar.update(1)
            return rec

        start = time.monotonic()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(guarded(p)))
            if math.isfinite(cfg.request_rate) and cfg.request_rate > 0:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        records = list(await asyncio.gather(*tasks))
        duration = time.monotonic() - start
    if bar is not None:
        bar.close()
    return records, duration
