"""The interface through which the engine hands KV cache to, and takes it from, another node.

The engine calls these hooks and knows nothing else about disaggregation (the implementations
live in `pdserve.disagg`). Colocated mode uses `NoopConnector`. `LLMEngine.attach_connector` is
the one place a connector is wired in.

Scheduler half (engine thread): `plan_remote_prefill` decides once per request (and counts the
decision); once the request's blocks are allocated, `keep_remote_prefill` may take the decision
back (what its cached prefix leaves is short), else `start_remote_prefill` begins loading its
KV, and `poll_remote_prefills` reports the loads that completed or failed, always on the engine
thread. `request_finished` may keep a finished request's blocks (a send in flight) until
`poll_finished_sends` hands them back. `add_stats` adds the connector's gauges and counters to
the node's snapshot (engine thread).
Worker half: `layer_hook` returns a callback the model calls after each layer wrote its KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.failure import Failure
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence, Timings, TopLogprobs
from pdserve.engine.snapshot import NodeSnapshot
from pdserve.model.layers import LayerDone


@dataclass(frozen=True)
class RemotePrefillResult:
    """A finished remote prefill: the KV is in the request's blocks and the first token known,
    or `failure` says why and where it failed."""

    request_id: str
    first_token: int | None = None
    first_logprob: float = 0.0
    first_top: TopLogprobs = ()
    failure: Failure | None = None
    timings: Timings = field(default_factory=dict)  # milestones of the handoff
    prefill_locally: bool = False  # no prefill node could take it: compute the prompt here
    # A migrated stream: the KV of its first `computed_tokens` tokens arrived, no first token
    # (it computes the rest here).
    computed_tokens: int | None = None


class KVConnector:
    def plan_remote_prefill(self, seq: Sequence) -> bool:
        """Whether `seq`'s prompt is computed by a prefill node; called once per request."""
        return False

    def keep_remote_prefill(self, seq: Sequence, local_backlog: int) -> bool:
        """Whether `seq`, planned remote, still goes remote now that it holds its blocks and
        its cached prefix is known (False: its uncached rest is computed here; counted);
        `local_backlog`: prompt tokens this node still has to compute before it."""
        return True

    def start_remote_prefill(self, seq: Sequence) -> None:
        """`seq` holds blocks for its prompt; start filling them from a prefill node."""
        raise NotImplementedError

    def poll_remote_prefills(self) -> list[RemotePrefillResult]:
        """Remote prefills that completed or failed since the last call."""
        return []

    def abort_remote_prefill(self, seq: Sequence) -> None:
        """Stop loading `seq`'s KV; after this returns nothing more is written to its blocks."""

    def layer_hook(self, out: SchedulerOutput) -> LayerDone | None:
        """A per-layer callback for this step's forward pass, or None."""
        return None

    def request_finished(self, seq: Sequence) -> bool:
        """True if the connector keeps `seq`'s blocks (a send in flight) until
        `poll_finished_sends` returns its request id; False to free them now."""
        return False

    def poll_finished_sends(self) -> list[str]:
        return []

    def fail_all(self, failure: Failure) -> None:
        """The node can no longer compute (its tensor-parallel group broke): end every send
        with `failure`; the blocks they hold come back through `poll_finished_sends`."""

    def add_stats(self, snapshot: NodeSnapshot) -> None:
        """Add this connector's gauges and counters to the node's snapshot."""


class NoopConnector(KVConnector):
    """Colocated mode: every request is computed here."""
