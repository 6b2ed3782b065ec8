"""The audit of the router's cache predictions: for every routed request whose prompt the
router names by the engine's block keys (it knows the nodes' tokenizer), the prefix it
predicted the chosen decode holds, against the prefix the decode found (`cached_tokens`, read
from its answer). A cache-aware router whose predictions went wrong (KV events missed, a
tokenizer or secret that differs from the nodes', an eviction storm) routes by load alone
while it believes it follows prefixes; this makes that visible: counters of predicted and
realized hit tokens per decode, the realized share over the last `window` predictions, and a
warning when that share, over at least `AUDIT_MIN` of them, is below `threshold`.

Lifecycle: `expect` when a request is routed returns the callback that reads the decode's
answer as it passes (whole, or chunk by chunk); the first `pdserve_cached_tokens` in it
settles the request. Event loop only.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.api.protocol import CACHED_TOKENS_FIELD

logger = logging.getLogger(__name__)

AUDIT_WINDOW = 32  # predictions the realized share is taken over
AUDIT_MIN = 16  # predictions the share needs before it is judged
AUDIT_THRESHOLD = 0.8  # a realized share below this is warned about
_CACHED = re.compile(rb'"' + CACHED_TOKENS_FIELD.encode() + rb'":\s*(\d+)')


class RoutingAudit:
    def __init__(
        self,
        registry: CollectorRegistry,
        window: int = AUDIT_WINDOW,
        threshold: float = AUDIT_THRESHOLD,
    ) -> None:
        self.window: deque[tuple[int, int]] = deque(maxlen=window)  # (predicted, realized)
        self.threshold = threshold
        self._since_warning = 0
        self.predicted = Counter(
            "pdserve:router_predicted_hit_tokens",
            "Prompt tokens the router predicted the chosen decode holds in its prefix cache",
            ["decode"],
            registry=registry,
        )
        self.realized = Counter(
            "pdserve:router_realized_hit_tokens",
            "Prompt tokens the decode found in its prefix cache (its cached_tokens), for the "
            "requests the router predicted on",
            ["decode"],
            registry=registry,
        )
        self.share = Gauge(
            "pdserve:router_hit_realization",
            f"Realized / predicted prefix-hit tokens over the last {window} predictions "
            "(1: every predicted hit was found)",
            registry=registry,
        )
        self.share.set(1.0)

    def expect(self, decode: str, predicted_tokens: int) -> Callable[[bytes], None]:
        """The reader of the answer of a request routed to `decode` predicting that many
        cached prompt tokens: fed the answer's bytes, it settles on the first count it finds."""
        settled = False

        def read(data: bytes) -> None:
            nonlocal settled
            if settled or CACHED_TOKENS_FIELD.encode() not in data:
                return
            found = _CACHED.search(data)
            if found is not None:
                settled = True
                self.settle(decode, predicted_tokens, int(found.group(1)))

        return read

    def settle(self, decode: str, predicted: int, realized: int) -> None:
        """One request's outcome: `realized` cached tokens where `predicted` were expected."""
        if predicted <= 0:
            return  # nothing was predicted: nothing to audit (a hit is the decode's own luck)
        counted = min(realized, predicted)  # a surplus must not hide another request's miss
        self.predicted.labels(decode).inc(predicted)
        self.realized.labels(decode).inc(counted)
        self.window.append((predicted, counted))
        share = sum(r for _, r in self.window) / sum(p for p, _ in self.window)
        self.share.set(share)
        self._since_warning += 1
        judged = len(self.window) >= min(AUDIT_MIN, self.window.maxlen or AUDIT_MIN)
        if judged and share < self.threshold and self._since_warning >= len(self.window):
            self._since_warning = 0  # once per window's worth of predictions
            logger.warning(
                "the router's prefix predictions are not realized: decodes found %.0f%% of the "
                "predicted prefix-hit tokens over the last %d predictions (last: %s found %d of "
                "%d); KV events missed, a tokenizer or cluster secret other than the nodes', or "
                "evictions faster than events arrive: cache-aware routing is routing blind",
                100 * share, len(self.window), decode, realized, predicted,
            )  # fmt: skip
