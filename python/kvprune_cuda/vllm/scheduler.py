"""vLLM scheduler side: decide each step's compressions and return the freed blocks.

:class:`Scheduler` is vLLM's scheduler with these additions:

* after vLLM schedules a step, every request whose step computes the last token of its
  prompt is checked with :func:`~kvprune_cuda.vllm.rules.compresses`. Its first
  ``pinned`` tokens are kept whole: its prefix-cache hits and the leading blocks another
  request holds too (ref count > 1, whether it hit them before or in this very step); the
  budget applies to the rest. The decisions ride to the workers on the scheduler output
  (:class:`~kvprune_cuda.vllm.plan.StepPlan`), and the request's own blocks lose their
  prefix-cache hashes before the workers rewrite them, so no later request can hit stale content; a compressed
  request's blocks are never cached again;
* with a decode-time rule (``engine_args(decode=...)``), a decoding request is compressed
  again, the same way, in the steps that :func:`~kvprune_cuda.vllm.rules.decode_compresses`
  picks (every ``interval`` generated tokens, once it holds more than ``max_held``); a
  request resumed after preemption (recomputed dense) is compressed back in the step that
  completes its recompute, then as before;
* with a bounded prefill (``engine_args(prefill_max_held=...)``), a request whose step computes
  an earlier chunk of its prefill (its prompt, or a resumed request's replay) and leaves it
  holding more than the bound is compressed too
  (:func:`~kvprune_cuda.vllm.rules.prefill_compresses`), the same way; vLLM admits a new
  request when its full sequence fits the free blocks, which for such a request is checked
  against the most it will hold while it prefills (the bound past its prefix-cache hits and
  one chunk), not its length; its blocks stay out of the prefix cache (no other request can
  share, and so pin, blocks that the next chunks rewrite);
* after such a step, the blocks past its kept tokens leave the request and go back to the
  ``BlockPool`` (the workers have compacted the kept tokens into the first blocks);
* from then on, slots are allocated for ``num_computed_tokens - evicted`` held tokens:
  ``KVCacheManager.allocate_slots`` sees the request with that count while it runs.
  ``num_computed_tokens`` itself keeps counting positions, so decoding continues at the
  original positions and every stop criterion (max_tokens, max_model_len) is unchanged.

A preempted request frees all its blocks as usual and is recomputed in full (prompt and
outputs, which is not a prompt-only step, so its prompt is not compressed to the budget; a
bounded prefill bounds the replay chunk by chunk, and a decode-time rule compresses it again).
"""

from __future__ import annotations

from typing import NamedTuple

import vllm
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
from vllm.v1.request import RequestStatus

from kvprune_cuda.vllm import check_vllm_version, logger
from kvprune_cuda.vllm import config, rules
from kvprune_cuda.vllm.plan import (Compression, PlannedSchedulerOutput, StepPlan, StepSeconds,
                                    check_report)
from kvprune_cuda.vllm.support import check_engine, check_kv_cache_groups


class Held(NamedTuple):
    """A compressed request: right after its last compression it held ``kept`` tokens, the
    first ``pinned`` of them whole, and had evicted ``evicted`` (positions - held tokens)."""
    kept: int
    pinned: int
    evicted: int


class Scheduler(_VllmScheduler):
    """vLLM's scheduler that decides compressions and frees the blocks they empty
    (``scheduler_cls``)."""

    def __init__(self, *args, **kwargs) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(*args, **kwargs)
        self.kvprune_policy = config.from_vllm_config(self.vllm_config)
        self.kvprune_decode = config.decode_from_vllm_config(self.vllm_config)
        self.kvprune_prefill = config.prefill_from_vllm_config(self.vllm_config)
        self._chunk = self.vllm_config.scheduler_config.max_num_batched_tokens
        check_engine(self.vllm_config, self.kvprune_decode)
        check_kv_cache_groups(self.kv_cache_config)
        block_size = self.vllm_config.cache_config.block_size
        if self.kvprune_decode is not None and self.kvprune_decode.interval % block_size:
            raise ValueError(f"interval: {self.kvprune_decode.interval} is not a multiple of "
                             f"the block size {block_size} (whole blocks are freed)")
        self.kvprune_held: dict[str, Held] = {}   # req_id -> its compression, while running
        self.kvprune_freed_blocks = 0             # blocks returned to the pool so far
        self._compressing: dict[str, Held] = {}   # req_id -> compression of the step in flight
        self._steps = 0                           # steps planned so far
        self._busy = False                        # a request was scheduled since idle
        self._prefix_hits: dict[str, int] = {}    # req_id -> prompt tokens read from the cache
        # the worker's timing of every step since idle, summed (with tensor parallelism, the
        # rank whose output reaches the scheduler)
        self.kvprune_seconds = StepSeconds(0.0, 0.0)
        manager = self.kv_cache_manager
        allocate, cache = manager.allocate_slots, manager.coordinator.cache_blocks
        manager.allocate_slots = (
            lambda request, *a, **kw: self._allocate_held(allocate, request, *a, **kw))
        manager.coordinator.cache_blocks = (
            lambda request, *a, **kw: None if request.request_id in self.kvprune_held
            or self._bounded(request) else cache(request, *a, **kw))

    def _allocate_held(self, allocate, request, *args, **kwargs):
        held = self.kvprune_held.get(request.request_id)
        if held is None:
            if kwargs.get("full_sequence_must_fit") and self.kvprune_prefill is not None:
                return self._admit_bounded(allocate, request, *args, **kwargs)
            return allocate(request, *args, **kwargs)
        request.num_computed_tokens -= held.evicted
        try:
            return allocate(request, *args, **kwargs)
        finally:
            request.num_computed_tokens += held.evicted

    def _bounded(self, request) -> bool:
        """Whether a bounded prefill compresses ``request`` before its prompt ends."""
        bound = self.kvprune_prefill
        return bound is not None and request.num_prompt_tokens > bound.target()

    def _admit_bounded(self, allocate, request, *args, **kwargs):
        """vLLM's allocation for a request it admits, its check that the full sequence fits
        the free blocks made against the most a bounded prefill holds of it (the bound past
        its prefix-cache hits and one chunk; a resumed request's replay is bounded the same
        way): the manager's length cap is that many tokens during the call (the slots this
        step needs are within it)."""
        manager = self.kv_cache_manager
        hits = kwargs.get("num_new_computed_tokens", 0) + request.num_computed_tokens
        most = self.kvprune_prefill.peak(self._chunk, hits)
        if most >= manager.max_model_len:
            return allocate(request, *args, **kwargs)
        length, manager.max_model_len = manager.max_model_len, most
        try:
            return allocate(request, *args, **kwargs)
        finally:
            manager.max_model_len = length

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        cached = output.scheduled_cached_reqs
        steps = [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        steps += list(zip(cached.req_ids, cached.num_computed_tokens))
        starts = {new.req_id for new in output.scheduled_new_reqs} | set(cached.resumed_req_ids)
        plan = {}
        for req_id, num_computed in steps:  # num_computed: before this step, as the workers see it
            if req_id in starts:  # computed from scratch: what precedes came from the cache
                self._prefix_hits[req_id] = num_computed
            request = self.requests[req_id]
            scheduled = output.num_scheduled_tokens[req_id]
            held = self.kvprune_held.get(req_id)
            pinned = held.pinned if held else max(self._prefix_hits.get(req_id, 0),
                                                  self._shared_tokens(req_id))
            tokens = num_computed + scheduled - (held.evicted if held else 0)  # held after it
            kind, kept = "prompt", rules.compresses(
                self.kvprune_policy, num_computed, scheduled, request.num_prompt_tokens,
                request.num_output_tokens, pinned, tokens)
            if kept is None:
                kind, kept = "chunk", rules.prefill_compresses(
                    self.kvprune_prefill, num_computed, scheduled, request.num_prompt_tokens,
                    tokens, pinned, request.num_output_tokens)
            if kept is None:
                kind, kept = "decode", rules.decode_compresses(
                    self.kvprune_decode, num_computed, scheduled, request.num_prompt_tokens,
                    request.num_output_tokens, tokens, pinned)
            if kept is not None:
                self._compressing[req_id] = Held(kept, pinned, num_computed + scheduled - kept)
                plan[req_id] = Compression(kept, pinned, tokens, kind)
                self._uncache_own_blocks(req_id, pinned)
        self._steps += 1
        self._busy |= bool(steps)
        return PlannedSchedulerOutput.of(output, StepPlan(self._steps, plan))

    def _groups(self):
        return self.kv_cache_manager.coordinator.single_type_managers

    def _shared_tokens(self, req_id: str) -> int:
        """Tokens up to the end of the request's last block that another request holds too
        (not only a leading run: vLLM may hold two blocks under one hash, so a request can
        share a later block of this one without the block before it)."""
        shared = 0
        for group in self._groups():
            blocks = group.req_to_blocks.get(req_id, ())
            n = next((len(blocks) - i for i, b in enumerate(reversed(blocks)) if b.ref_cnt > 1), 0)
            shared = max(shared, n * group.block_size)
        return shared

    def _uncache_own_blocks(self, req_id: str, pinned: int) -> None:
        """Removes the prefix-cache hashes of the request's blocks past ``pinned`` (those
        compaction rewrites, or frees): no later request may hit their old content."""
        pool = self.kv_cache_manager.block_pool
        for group in self._groups():
            for block in group.req_to_blocks.get(req_id, ())[pinned // group.block_size:]:
                pool._maybe_evict_cached_block(block)

    def update_from_output(self, scheduler_output, model_runner_output):
        # the workers compacted exactly the plan (else no block may be freed)
        check_report(scheduler_output.kvprune_plan, model_runner_output)
        self._account(scheduler_output.kvprune_plan, model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        compressing, self._compressing = self._compressing, {}
        for req_id, held in compressing.items():
            self._prefix_hits.pop(req_id, None)
            request = self.requests.get(req_id)
            if request is None or request.is_finished():  # all its blocks are freed whole
                continue
            if request.status != RequestStatus.RUNNING:  # the workers compacted it: its tail
                raise RuntimeError(                       # must go now (sync scheduling)
                    f"kvprune_cuda.vllm: request {req_id}, compacted in step "
                    f"{scheduler_output.kvprune_plan.step}, is {request.status.name} at its "
                    "update; its emptied blocks cannot be freed with the workers'")
            self._free_evicted_blocks(req_id, held)
        for state in (self.kvprune_held, self._prefix_hits):
            for req_id in [r for r in state if r not in self.requests]:
                del state[req_id]
        self._log_if_idle()
        return outputs

    def _account(self, plan: StepPlan, model_runner_output) -> None:
        """Adds the step's worker timing (:class:`StepSeconds`) to the totals; a step that
        compresses logs its own: kvprune's share of its forward."""
        seconds = getattr(model_runner_output, "kvprune_seconds", None)
        if seconds is None:
            return
        self.kvprune_seconds = self.kvprune_seconds.plus(seconds)
        if plan.rows:
            logger.info("kvprune_cuda: step %d compressed %d request(s): kvprune %.2f ms of "
                        "the step's %.1f ms forward (%.2f %%)", plan.step, len(plan.rows),
                        1e3 * seconds.kvprune, 1e3 * seconds.forward, seconds.share)

    def _free_evicted_blocks(self, req_id: str, held: Held) -> None:
        manager = self.kv_cache_manager
        for group in self._groups():
            keep = -(-held.kept // group.block_size)
            blocks = group.req_to_blocks[req_id]
            tail = blocks[keep:]
            del blocks[keep:]
            manager.block_pool.free_blocks(reversed(tail))
            self.kvprune_freed_blocks += len(tail)
            logger.info("kvprune_cuda: request %s keeps %d of %d tokens, %d blocks freed "
                        "(%d in all)", req_id, held.kept, held.kept + held.evicted, len(tail),
                        self.kvprune_freed_blocks)
        self.kvprune_held[req_id] = held

    def _log_if_idle(self) -> None:
        """Once the last request is done: the pool, which should be whole again."""
        if self.requests or not self._busy:
            return
        self._busy = False
        pool = self.kv_cache_manager.block_pool
        spent, self.kvprune_seconds = self.kvprune_seconds, StepSeconds(0.0, 0.0)
        logger.info("kvprune_cuda: idle: %d blocks freed by compression in all; %d of %d "
                    "blocks free in the pool; kvprune's own work took %.3f s of %.3f s of "
                    "forwards since the last idle (%.2f %%)", self.kvprune_freed_blocks,
                    pool.get_num_free_blocks(), pool.num_gpu_blocks - 1, spent.kvprune,
                    spent.forward, spent.share)

    def _preempt_request(self, request, *args, **kwargs):
        self.kvprune_held.pop(request.request_id, None)
        return super()._preempt_request(request, *args, **kwargs)
