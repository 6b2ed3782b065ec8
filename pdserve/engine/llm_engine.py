"""The engine loop: `add_request`, `step`, `abort`, and the synchronous `generate`.

One engine is driven by one thread (the node's engine thread); nothing here is thread-safe.
A request lives from `add_request` until a `step` or `abort` returns its finished output; by
then its blocks are back in the pool (or held by the connector until its send completes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path

import torch

from pdserve.config import ConfigError, EngineConfig
from pdserve.engine.admission import PromptLimits, check_prompt, check_resume
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.canary import Canary
from pdserve.engine.connector import KVConnector, NoopConnector, RemotePrefillResult
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.failure import Failure, FailureReason
from pdserve.engine.kv_cache import WindowMemory
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.loading import load_engine_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import RequestError, RequestOutput, output_of
from pdserve.engine.sampler import sample_batch
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import (
    Milestone,
    RequestOptions,
    Resume,
    Sampled,
    SamplingParams,
    Sequence,
    SequenceStatus,
)
from pdserve.engine.snapshot import NodeSnapshot, scheduler_snapshot
from pdserve.engine.structured import Grammars, GuideError, LazyGrammars
from pdserve.engine.tensor_parallel import (
    TensorParallelError,
    tensor_parallel_threads,
)
from pdserve.model.fused import paged_decode_kernel
from pdserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# A stream paused for another node (live migration) holds its blocks this long for that node's
# fetch; then they are freed (the node computes the stream itself).
MIGRATION_HOLD_S = 10.0


class LLMEngine:
    def __init__(
        self, config: EngineConfig, model_dir: str | Path, connector: KVConnector | None = None
    ) -> None:
        threads = config.num_threads or tensor_parallel_threads(config.tensor_parallel_size)
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        loaded = load_engine_model(config, model_dir)
        self.model_config, self.model = loaded.model_config, loaded.model
        self.num_blocks, self.kv_shards, self.tp = loaded.num_blocks, loaded.kv_shards, loaded.tp
        self.block_size = config.cache.block_size
        try:
            self.tokenizer = Tokenizer(model_dir, self.model_config.eos_token_ids, config.cache_dir)
        except BaseException:
            self.close()  # the tensor-parallel workers started for this engine
            raise
        self.kv_caches = self.kv_shards[0].caches  # this rank's
        self.kv_events = KVEventLog()  # what the prefix cache holds, for routers
        model = self.model_config
        self.pool = BlockPool(
            self.num_blocks,
            config.cache.enable_prefix_caching,
            self.kv_events,
            loaded.window_blocks,
            len(model.local_layers) / model.num_layers,
        )
        if loaded.window_blocks is not None:  # blocks' windowed-layer memory given back
            self.window_memory = WindowMemory(
                [s.caches[i] for s in self.kv_shards for i in model.local_layers]
            )
            self.pool.on_drop = self.window_memory.drop
        self.kv = KVCacheManager(
            self.pool, self.block_size, config.cache.hash_key, self.model_config.sliding_window
        )
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position
        self.limits = PromptLimits(
            self.model_config.vocab_size,
            self.max_model_len,
            self.num_blocks,
            self.kv.blocks_for,
        )
        self.connector: KVConnector = NoopConnector()
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            self.max_model_len,
            hold_blocks=lambda seq: self.connector.request_finished(seq),
            keep_remote=lambda seq, backlog: self.connector.keep_remote_prefill(seq, backlog),
        )
        # --deterministic: prepare_inputs takes the exact decode kernel in this one's place
        kernel = paged_decode_kernel() if config.attention_backend == "auto" else None
        if config.deterministic and kernel is None:
            raise ConfigError("--deterministic needs the compiled CPU kernels, which cannot build")
        self.runner = ModelRunner(
            self.model, self.kv_caches, self.block_size, kernel, self.tp, config.deterministic
        )
        if connector is not None:
            self.attach_connector(connector)
        self.requests: dict[str, Sequence] = {}
        self._broken_handled = False  # the tensor-parallel group's break failed what ran
        self._finished: dict[str, int] = {}  # requests ended, by finish reason
        self._default_generator = torch.Generator().manual_seed(0)
        # Streams paused for another node: request id -> when their held blocks are freed
        # unless fetched (a fetch takes the entry; `release_migrated` frees the blocks).
        self._migrated: dict[str, float] = {}
        rate = config.canary_rate
        self.canary = Canary(rate, config.deterministic) if rate > 0 else None
        # Fault injection for tests: each step's logits are what it returns, given the sampling
        # requests and the model's logits.
        self.testing_logits_fault: Callable[[list[Sequence], torch.Tensor], torch.Tensor] | None = (
            None
        )
        self._grammars = LazyGrammars(
            self.tokenizer.hf, self.model_config.vocab_size, self.tokenizer.eos_token_ids
        )
        windows = self.pool.window_blocks
        logger.info(
            "engine ready: %d KV blocks of %d tokens%s",
            self.num_blocks,
            self.block_size,
            "" if windows is None else f" ({windows} with their sliding-window layers' part)",
        )

    def close(self) -> None:
        """End the tensor-parallel workers (nothing to do without them). Idempotent."""
        if self.tp is not None:
            self.tp.close()

    def attach_connector(self, connector: KVConnector) -> None:
        """Wire in the node's KV connector (before any request): the scheduler asks it whether
        to hold a finished request's blocks, the loop polls it and calls its layer hook."""
        if self.requests:
            raise RuntimeError("attach the connector before adding requests")
        self.connector = connector

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        options: RequestOptions | None = None,
    ) -> Sequence:
        """Queue a request; `options` travel with it to the connector (e.g. its deadline)."""
        if request_id in self.requests or request_id in self.scheduler.held:
            # (held: finished, its blocks still being sent; a second one would leak them)
            raise RequestError(f"request {request_id} already exists", FailureReason.DUPLICATE)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(request_id, token_ids, params, self.limits)
        options = options or RequestOptions()
        if options.resume is not None and options.resume.token_ids:
            options = replace(options, allow_split=False)  # computed here, with the prompt
        seq = Sequence(request_id, token_ids, params, options=options)
        seq.timings[Milestone.ARRIVED] = time.time()
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer.decode, params.stop, params.min_tokens
        )
        seq.generator = torch.Generator() if params.seed is not None else None
        if params.guide is not None:
            try:
                seq.matcher = self.grammars().matcher(params.guide)
            except GuideError as e:
                raise RequestError(f"request {request_id}: {e}") from e
        if options.resume is not None:
            self._resume(seq, options.resume)
        if seq.options.after is not None:
            seq.parent = self.requests.get(seq.options.after)
        seq.remote_prefill = self.connector.plan_remote_prefill(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _resume(self, seq: Sequence, resume: Resume) -> None:
        """`resume`'s tokens become `seq`'s outputs as if sampled here, one at a time: the
        guide, the stop strings and the text advance as they did on the node that generated
        them, and the next delta starts after the text the client already has. RequestError
        if they could not have come from this request."""
        tokens = list(resume.token_ids)
        rid = seq.request_id
        check_resume(rid, tokens, seq.params, self.limits.vocab_size, self.tokenizer.eos_token_ids)
        detok = seq.detokenizer
        assert detok is not None
        for token in tokens:
            Scheduler.append_token(seq, Sampled(token))
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                raise RequestError(f"request {rid}: resumed token {token} breaks its guide")
            detok.update(seq.output_token_ids)
            if detok.stopped or (seq.matcher is not None and seq.matcher.is_terminated()):
                raise RequestError(f"request {rid}: the resumed tokens already end it")
        try:
            detok.mark_sent(resume.sent_chars)
        except ValueError as e:
            raise RequestError(f"request {rid}: resumed stream: {e}") from e

    def grammars(self) -> Grammars:
        """The structured-output compiler for this model's tokenizer (built on first use, from
        any thread: the API compiles a guide off the engine thread first, and the engine's own
        compile of it is then a cache hit)."""
        return self._grammars.get()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; its final output, or None."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return output_of(seq)

    def fail(self, request_id: str, failure: Failure) -> RequestOutput | None:
        """End a request with a failure (e.g. the node is stopping); frees its blocks."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.status == SequenceStatus.WAITING_FOR_KV:
            self.connector.abort_remote_prefill(seq)
        self._finish(seq, SequenceStatus.FINISHED_ERROR, failure)
        return output_of(seq)

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled."""
        return len(self.scheduler.waiting)

    def has_compute(self) -> bool:
        """Whether `step` has model work now (not only requests waiting for remote KV)."""
        work = self.scheduler.has_compute
        return work or (self.canary is not None and self.canary.ready(bool(self.requests)))

    def snapshot(self) -> NodeSnapshot:
        """The node's gauges and counters now, the connector's included."""
        snap = scheduler_snapshot(self.scheduler, self.pool)
        snap.requests_finished = dict(self._finished)
        if self.canary is not None:
            snap.canary_checks = dict(self.canary.results)
        self.connector.add_stats(snap)
        return snap

    # ---- live migration -------------------------------------------------------------------

    def migrate_out(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Pause each of `request_ids` that is between two decode steps and end it here as
        migrated, its blocks (and their KV) held for another node to fetch within
        MIGRATION_HOLD_S (`migration_blocks`); their final outputs (the others are left as
        they are: waiting, prefilling or gone)."""
        outputs = []
        for request_id in request_ids:
            seq = self.requests.get(request_id)
            if seq is None or not self.scheduler.can_migrate(seq):
                continue
            self.scheduler.pause(seq)
            self._migrated[request_id] = time.monotonic() + MIGRATION_HOLD_S
            self._release(seq)
            outputs.append(output_of(seq))
            logger.info(
                "request %s paused after %d tokens for another node",
                request_id,
                len(seq.output_token_ids),
            )
        return outputs

    def migration_blocks(self, handle: str, tokens: list[int]) -> tuple[list[int], int]:
        """The blocks with the KV of `tokens` of the stream paused as `handle`, taken for one
        fetch (a second fails), and how many of the last one's slots hold KV of that stream;
        RequestError if none waits so or `tokens` is not a computed prefix of it. Its blocks
        stay held until `release_migrated`."""
        seq = self.scheduler.held.get(handle)
        if seq is None or self._migrated.pop(handle, None) is None:
            message = f"no stream paused as {handle} waits here (fetched, expired or unknown)"
            raise RequestError(message)
        n = len(tokens)
        if not 0 < n <= seq.num_computed_tokens or tokens != seq.all_token_ids[:n]:
            self._migrated[handle] = time.monotonic() + MIGRATION_HOLD_S  # not this fetch's
            message = f"the {n} tokens asked for are not a computed prefix of stream {handle}"
            raise RequestError(message)
        blocks = seq.block_table[: -(-n // self.block_size)]
        filled = min(self.block_size, seq.num_computed_tokens - (len(blocks) - 1) * self.block_size)
        return blocks, filled

    def release_migrated(self, handle: str) -> None:
        """Free the blocks of the stream paused as `handle` (fetched, or its fetch failed)."""
        self._migrated.pop(handle, None)
        self.scheduler.release_held(handle)

    def _expire_migrated(self) -> None:
        now = time.monotonic()
        for handle in [h for h, until in self._migrated.items() if until <= now]:
            logger.warning("stream %s paused for another node was not fetched: freed", handle)
            self.release_migrated(handle)

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; outputs of every request that advanced or finished."""
        return self.poll_connector() + self.run_step()

    def poll_connector(self) -> list[RequestOutput]:
        """Apply finished remote prefills (their first token is an output now, not after the
        next forward pass) and release blocks whose sends completed."""
        outputs = [o for r in self.connector.poll_remote_prefills() if (o := self._apply_remote(r))]
        for request_id in self.connector.poll_finished_sends():
            self.scheduler.release_held(request_id)
        if self._migrated:
            self._expire_migrated()
        return outputs

    def run_step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass. An exception fails only what it concerns: the
        request whose remote prefill could not start, the batch whose pass failed, or the
        request whose sampling failed."""
        if self.tp is not None and self.tp.broken and not self._broken_handled:
            return self._fail_broken(self.tp.broken)
        if self.canary is not None:
            self.canary.turn(self)
            return self.canary.user_outputs(self._run_step())
        return self._run_step()

    def _run_step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        out = self.scheduler.schedule()
        for seq in out.remote_started:
            try:
                self.connector.start_remote_prefill(seq)
            except Exception as e:
                logger.exception("request %s: remote prefill did not start", seq.request_id)
                outputs += self._fail_all([seq], f"remote prefill did not start: {e}", "handoff")
        if not out.scheduled:
            return outputs
        samplers = [s.seq for s in out.scheduled if s.sample]
        try:
            logits = self.runner.execute(out, self.connector.layer_hook(out))
        except Exception as e:
            batch = [s.seq for s in out.scheduled]
            logger.exception(
                "forward pass failed; failing its batch %s", [s.request_id for s in batch]
            )
            if isinstance(e, TensorParallelError):  # every request in flight, not the batch
                return outputs + self._fail_broken(str(e))
            message = "the forward pass failed (see the node's log)"
            return outputs + self._fail_all(batch, message, "step")
        if self.testing_logits_fault is not None:
            logits = self.testing_logits_fault(samplers, logits)
        eos = self.tokenizer.eos_token_ids
        sampled = sample_batch(logits, samplers, self._grammars.built, self._default_generator, eos)
        broken = [seq for seq in samplers if seq.request_id not in sampled]
        if broken:  # the others' step stands; these end with an error
            out.scheduled = [
                s for s in out.scheduled if s.seq.request_id in sampled or not s.sample
            ]
        self.scheduler.update(out, sampled, self.tokenizer.eos_token_ids)
        outputs += self._fail_all(broken, "sampling failed (see the node's log)", "sample")
        return outputs + [self._advance(seq) for seq in samplers if seq.request_id in sampled]

    def _fail_broken(self, why: str) -> list[RequestOutput]:
        """The tensor-parallel group broke: every request in flight fails now, sends and
        remote prefills included (later steps fail at once, naming the cause)."""
        self._broken_handled = True
        failure = Failure(FailureReason.PEER_UNAVAILABLE, why, "step")
        self.connector.fail_all(failure)
        return [o for rid in list(self.requests) if (o := self.fail(rid, failure)) is not None]

    def _fail_all(self, seqs: list[Sequence], message: str, stage: str) -> list[RequestOutput]:
        failure = Failure(FailureReason.INTERNAL, message, stage)
        return [out for seq in seqs if (out := self.fail(seq.request_id, failure)) is not None]

    def _apply_remote(self, r: RemotePrefillResult) -> RequestOutput | None:
        seq = self.scheduler.waiting_for_kv.get(r.request_id)
        if seq is None:
            return None  # aborted meanwhile
        if r.prefill_locally:
            self.scheduler.prefill_locally(seq)
            return None
        if r.computed_tokens is not None:  # a migrated stream's KV: it goes on here
            seq.timings.update(r.timings)
            self.scheduler.resume_computed(seq, r.computed_tokens)
            return None
        if r.failure is not None or r.first_token is None:
            failure = r.failure or Failure(FailureReason.INTERNAL, "no first token")
            self._finish(seq, SequenceStatus.FINISHED_ERROR, failure)
            return output_of(seq)
        seq.timings.update(r.timings)
        seq.timings[Milestone.CLAIMED] = time.time()
        eos = self.tokenizer.eos_token_ids
        first = Sampled(r.first_token, r.first_logprob, r.first_top)
        if seq.matcher is not None and not seq.matcher.accept_token(first.token):
            # prefill samples under the same guide; a token outside it is a peer's fault
            message = f"the prefill node's first token {first.token} breaks the output constraint"
            self._finish(
                seq,
                SequenceStatus.FINISHED_ERROR,
                Failure(FailureReason.INTERNAL, message, "claim"),
            )
            return output_of(seq)
        self.scheduler.complete_remote_prefill(seq, first, eos)
        return self._advance(seq)

    def _advance(self, seq: Sequence) -> RequestOutput:
        detok = seq.detokenizer
        assert detok is not None
        # A completed output constraint ends the request too (even with ignore_eos: nothing
        # more could be generated under it).
        done = seq.matcher is not None and seq.matcher.is_terminated()
        detok.update(seq.output_token_ids, final=seq.status.finished or done)
        if (detok.stopped or done) and not seq.status.finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        if seq.status.finished:
            self._release(seq)
        return output_of(seq)

    def _finish(
        self, seq: Sequence, status: SequenceStatus, failure: Failure | None = None
    ) -> None:
        if seq.status == SequenceStatus.WAITING_FOR_KV and status != SequenceStatus.FINISHED_ERROR:
            self.connector.abort_remote_prefill(seq)
        seq.failure = failure
        self.scheduler.finish(seq, status)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if self.requests.pop(seq.request_id, None) is not None:
            if self.canary is not None and self.canary.released(seq):
                return  # a check: not a user request
            reason = seq.status.value
            self._finished[reason] = self._finished.get(reason, 0) + 1

    # ---- convenience ----------------------------------------------------------------------

    def generate(
        self, prompts: Seq[str | list[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[RequestOutput]:
        """Run `prompts` to completion together; outputs in the order of `prompts`."""
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, per, strict=True):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[rid] for rid in ids]
