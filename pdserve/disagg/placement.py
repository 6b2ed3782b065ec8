"""Where a decode node prefills a prompt, decided per request from what it measured
(`--prefill-placement measured`): the time to the first token of its recent prompts computed
here and of those prefilled remotely, each as a line over the prompt tokens it waited for
(seconds = fixed + per-token cost). Those tokens are its own uncached ones plus the ones queued
before it on that side: the prompts still computing here, or those still out on a prefill node
(their compute and their KV on the link). So a line is the side's speed (the call, the link's
transfer and the compute all land in its fixed or per-token cost), and a choice weighs each
side's queue at that moment: a burst that would wait here goes remote although one prompt alone
is sooner here, and the two sides share the work. Fitted online, older requests weighing less.
A request goes remote when the remote line says it is done sooner there; local when unsure: a
side with too few samples is not trusted, and remote is tried now and then (`explore_every`) to
learn it, and again once its last sample is older than `stale_s`.

`static` keeps the fixed rule (`--min-prefill-tokens`). Engine thread only: no locks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.config import DEFAULT_PREFILL_PLACEMENT

MIN_SAMPLES = 3  # samples before a line is trusted
FORGET = 0.9  # each new sample weighs an older one down by this factor
EXPLORE_EVERY = 4  # without a trusted remote line: one request in this many tries remote
# (1 in 16 kept it untrusted for 48 prompts: benchmarks/adaptive_prefill.py's 24-request
# warm-up ended with nearly every placement still `unmeasured`)
STALE_S = 30.0  # a side not sampled for this long is tried again


@dataclass
class CostLine:
    """seconds ~ fixed + per_token * tokens, fitted by exponentially weighted least squares."""

    weight: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    samples: int = 0
    last_at: float = 0.0  # monotonic time of the last sample

    def add(self, tokens: int, seconds: float, now: float) -> None:
        self.weight, self.sx, self.sy = FORGET * self.weight, FORGET * self.sx, FORGET * self.sy
        self.sxx, self.sxy = FORGET * self.sxx, FORGET * self.sxy
        self.weight += 1.0
        self.sx += tokens
        self.sy += seconds
        self.sxx += tokens * tokens
        self.sxy += tokens * seconds
        self.samples += 1
        self.last_at = now

    def predict(self, tokens: int) -> float | None:
        """The expected seconds for `tokens`, or None with fewer than MIN_SAMPLES samples."""
        if self.samples < MIN_SAMPLES:
            return None
        mean_x, mean_y = self.sx / self.weight, self.sy / self.weight
        var = self.sxx / self.weight - mean_x * mean_x
        if var <= 1e-9 * max(1.0, mean_x * mean_x):  # one size only: a rate through the origin
            return mean_y * tokens / mean_x if mean_x > 0 else mean_y
        slope = (self.sxy / self.weight - mean_x * mean_y) / var
        slope = max(0.0, slope)  # more tokens never cost less
        return max(0.0, mean_y + slope * (tokens - mean_x))


@dataclass
class Placement:
    """The per-request choice: `choose(tokens)` -> (remote?, why); `observe` feeds it what a
    request that finished took."""

    mode: str = DEFAULT_PREFILL_PLACEMENT
    explore_every: int = EXPLORE_EVERY
    stale_s: float = STALE_S
    local: CostLine = field(default_factory=CostLine)
    remote: CostLine = field(default_factory=CostLine)
    _decisions: int = 0

    def choose(
        self, here_tokens: int, there_tokens: int | None = None, now: float | None = None
    ) -> tuple[bool, str]:
        """`here_tokens`/`there_tokens`: the prompt's uncached tokens plus those queued before
        it here / on the prefill side (`there_tokens` defaults to `here_tokens`)."""
        if self.mode != "measured":
            return True, "static"
        now = time.monotonic() if now is None else now
        self._decisions += 1
        there_tokens = here_tokens if there_tokens is None else there_tokens
        here, there = self.local.predict(here_tokens), self.remote.predict(there_tokens)
        stale = now - self.remote.last_at > self.stale_s
        if there is None or stale:  # remote unknown (or long unseen): local, trying it now and then
            if self._decisions % self.explore_every == 0:
                return True, "explore"
            return False, "unmeasured"
        if here is None or now - self.local.last_at > self.stale_s:
            return False, "unmeasured"  # learn this side: it is the safe one
        return (True, "remote_sooner") if there < here else (False, "local_sooner")

    def observe(self, remote: bool, tokens: int, seconds: float, now: float | None = None) -> None:
        if tokens <= 0 or seconds < 0:
            return
        line = self.remote if remote else self.local
        line.add(tokens, seconds, time.monotonic() if now is None else now)
