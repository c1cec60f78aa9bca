"""vLLM scheduler side: return a compressed request's freed blocks to the pool.

:class:`Scheduler` is vLLM's scheduler with two additions:

* after the step that computed the last token of a request's prompt
  (:func:`~kvprune_cuda.vllm._policy.compresses`, the workers' rule), the blocks past its kept tokens leave the request and go back to the
  ``BlockPool`` (the worker has compacted the kept tokens into the first blocks);
* from then on, slots are allocated for ``num_computed_tokens - evicted`` held tokens:
  ``KVCacheManager.allocate_slots`` sees the request with that count while it runs.
  ``num_computed_tokens`` itself keeps counting positions, so decoding continues at the
  original positions and every stop criterion (max_tokens, max_model_len) is unchanged.

A preempted request frees all its blocks as usual and is recomputed in full (prompt and
outputs, which is not a prompt-only step, so it stays uncompressed).
"""

from __future__ import annotations

import vllm
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
from vllm.v1.request import RequestStatus

from kvprune_cuda.vllm import check_vllm_version
from kvprune_cuda.vllm import _policy


class Scheduler(_VllmScheduler):
    """vLLM's scheduler that frees the blocks compression empties (``scheduler_cls``)."""

    def __init__(self, *args, **kwargs) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(*args, **kwargs)
        self.kvprune_policy = _policy.from_vllm_config(self.vllm_config)
        self.kvprune_evicted: dict[str, int] = {}   # req_id -> tokens evicted, while running
        self.kvprune_freed_blocks = 0               # blocks returned to the pool so far
        self._compressing: dict[str, int] = {}      # req_id -> kept, for the step in flight
        allocate = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = (
            lambda request, *a, **kw: self._allocate_held(allocate, request, *a, **kw))

    def _allocate_held(self, allocate, request, *args, **kwargs):
        evicted = self.kvprune_evicted.get(request.request_id, 0)
        if not evicted:
            return allocate(request, *args, **kwargs)
        request.num_computed_tokens -= evicted
        try:
            return allocate(request, *args, **kwargs)
        finally:
            request.num_computed_tokens += evicted

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        cached = output.scheduled_cached_reqs
        steps = [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        steps += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_computed in steps:  # num_computed: before this step, as the workers see it
            request = self.requests[req_id]
            kept = _policy.compresses(self.kvprune_policy, num_computed,
                                      output.num_scheduled_tokens[req_id],
                                      request.num_prompt_tokens, request.num_output_tokens)
            if kept is not None:
                self._compressing[req_id] = kept
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        compressing, self._compressing = self._compressing, {}
        for req_id, kept in compressing.items():
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self._free_evicted_blocks(request, kept)
        for req_id in [r for r in self.kvprune_evicted if r not in self.requests]:
            del self.kvprune_evicted[req_id]
        return outputs

    def _free_evicted_blocks(self, request, kept: int) -> None:
        manager = self.kv_cache_manager
        for group in manager.coordinator.single_type_managers:
            keep = -(-kept // group.block_size)
            blocks = group.req_to_blocks[request.request_id]
            tail = blocks[keep:]
            del blocks[keep:]
            if request.request_id in group.num_cached_block:
                group.num_cached_block[request.request_id] = min(
                    group.num_cached_block[request.request_id], keep)
            manager.block_pool.free_blocks(reversed(tail))
            self.kvprune_freed_blocks += len(tail)
        self.kvprune_evicted[request.request_id] = request.num_prompt_tokens - kept

    def _preempt_request(self, request, *args, **kwargs):
        self.kvprune_evicted.pop(request.request_id, None)
        return super()._preempt_request(request, *args, **kwargs)
