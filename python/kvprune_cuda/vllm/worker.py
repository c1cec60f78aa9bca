"""vLLM worker side: compress each request's cache right after its prefill, in place.

:class:`CPUWorker` is vLLM's CPU worker plus :class:`RunnerHooks` on its model runner:

1. ``_prepare_inputs`` (wrapped): reads the step's compressions that the scheduler put on
   its output (:class:`~kvprune_cuda.vllm.plan.StepPlan`: kept, pinned and held tokens per
   request; a step without a plan is refused), notes the rows
   of earlier prefill chunks whose queries are recorded
   (:func:`~kvprune_cuda.vllm.rules.records`), and, for requests compressed in an earlier
   step, makes attention see the compacted cache: their ``seq_lens`` shrink by the evicted
   count ``e`` and the slot of a token at position p is computed for position ``p - e``.
   Positions themselves (RoPE) stay the original ones.
2. after the attention of every decoder ``Attention`` layer (its backend's ``impl.forward``,
   wrapped: vLLM calls it inside the opaque attention op, which a compiled model runs in
   order, eagerly, at every step; a forward hook on the module would be traced once by
   torch.compile and never run again): an earlier chunk's row keeps that
   layer's last ``window`` post-RoPE queries (at most ``window x Hq x D`` per layer and
   request, dropped when its prompt is done, or it finishes or is preempted); after the
   attention of a compressing row (which wrote the last chunk's keys), kvprune reads the
   whole prompt's keys through the row's blocks
   (:func:`~kvprune_cuda.vllm.cpu_cache.request_keys`), scores them with the observation
   window's queries (this chunk's and the recorded ones: the policy's ``score``; a bounded
   prefill's earlier chunk, the same way, keeps its window for the next), selects
   (``kp.select_keep``, the pinned prefix kept whole) and compacts the kept tokens of the
   blocks past the pinned prefix in vLLM's cache
   (:func:`kvprune_cuda.vllm.cpu_cache.compact_request`); the pinned blocks, which another
   request may share, are never written. Under a decode-time rule a decoding row feeds its
   evidence every step (snapkv: its last ``window`` queries; h2o: its query's
   attention added to the held keys' sums) and a row the scheduler picks is compressed the
   same way, selecting by that evidence.
3. ``execute_model`` (wrapped): after the step, checks that every planned request was
   compacted in every layer (RuntimeError otherwise), drops the freed blocks from the
   compressed rows' block tables and reports the plan's digest on the step's model output,
   with the step's seconds (the forward's, and kvprune's own work in it: ``StepSeconds``);
   the scheduler, finding the same digest, returns the same blocks to its pool.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass

import torch
import vllm
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
from vllm.v1.worker.cpu_worker import CPUWorker as _VllmCPUWorker

import kvprune_cuda as kp
from kvprune_cuda.engine import keep_last, kept_indices
from kvprune_cuda.vllm import check_vllm_version, logger
from kvprune_cuda.vllm import config, rules
from kvprune_cuda.vllm.cpu_cache import FP8_CACHE_DTYPES, compact_request, request_keys
from kvprune_cuda.vllm.plan import (PlanNotCarriedOut, ReportedModelRunnerOutput, StepPlan,
                                    StepSeconds, plan_of)
from kvprune_cuda.vllm.support import check_engine, check_kv_cache_groups, check_layer

STRIDED_ISAS = ("vec", "vec16")  # CPU_ATTN layouts that compact_request can address


@dataclass
class _Row:
    req_id: str
    row: int        # row of the persistent batch during this step
    prompt_len: int
    kept: int = 0
    pinned: int = 0  # leading tokens kept whole (block-aligned; never rewritten)
    tokens: int = 0  # tokens the request holds once this step's are written
    kind: str = "prompt"  # plan.KINDS: the prompt's own, a bounded chunk's, the decode rule's
    positions: int = 0    # positions computed once this step is done
    past_prompt: int = 0  # this step's tokens past the prompt (rows the decode rule observes)


class RunnerHooks:
    """The three hooks of the module doc on one vLLM (CPU) model runner."""

    def __init__(self, runner, policy, decode=None, prefill=None) -> None:
        self.runner, self.policy, self.decode, self.prefill = runner, policy, decode, prefill
        self.block_size = runner.cache_config.block_size
        # an fp8 cache (allocated as uint8) is read and compacted as its fp8 dtype
        self.fp8 = FP8_CACHE_DTYPES.get(runner.cache_config.cache_dtype)
        self.evicted: dict[str, int] = {}  # req_id -> tokens evicted from its cache
        self.plan: list[_Row] = []         # rows compressed by the step now running
        self.recording: list[_Row] = []     # rows of earlier prefill chunks (kept: unused)
        self.window_queries: dict[str, list] = {}   # req_id -> per layer [<=W, Hq, D]
        # req_id -> per layer: snapkv rule, its last decode queries ([<= W, Hq, D]);
        # h2o rule, the held keys' attention sums (fp32 [1, Hkv, held])
        self.decode_evidence: dict[str, list] = {}
        self.decoding: list[_Row] = []     # rows whose decode queries the rule observes
        # req_id -> per layer: a bounded prefill's running maxima (fp32 [1, Hkv, held]), while
        # the prefill of a request the bound compresses runs ("max", "far" signals)
        self.bound_scores: dict[str, list] = {}
        self.bounding: list[_Row] = []     # rows of those prefills whose maxima this step raises
        self.compactions = 0               # (layer, request) compactions done
        self.step_plan: StepPlan = None    # the plan of the step now running
        self.compacted: Counter = Counter()  # req_id -> layers compacted in this step
        self.report = None                 # digest of the plan carried out, to report
        self.kvprune_seconds = 0.0         # kvprune's own work in the step now running
        self.seconds = None                # the last step's StepSeconds, to report
        self.total_seconds = StepSeconds(0.0, 0.0)  # every step's, summed
        self._select_strided_isa()
        prepare, execute = runner._prepare_inputs, runner.execute_model
        runner._prepare_inputs = lambda out, *a, **kw: self._prepare(prepare, out, *a, **kw)
        runner.execute_model = lambda out, *a, **kw: self._execute(execute, out, *a, **kw)
        self.layers = [m for m in runner.get_model().modules()
                       if isinstance(m, Attention) and m.attn_type == "decoder"]
        self.layer_index = {id(m): i for i, m in enumerate(self.layers)}
        for m in self.layers:
            check_layer(m)
            m.impl.forward = self._attention_then_compress(m, m.impl.forward)

    def _attention_then_compress(self, module, forward):
        """``forward`` (a layer's ``impl.forward``), then :meth:`_after_attention`."""
        def attend(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            out = forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            if attn_metadata is not None:
                t0 = time.perf_counter()
                self._after_attention(module, query, attn_metadata)
                self.kvprune_seconds += time.perf_counter() - t0
            return out
        return attend

    def _select_strided_isa(self) -> None:
        """Makes CPU_ATTN store K/V in the "vec" layout (its fallback ISA, used wherever AMX
        or bf16 is absent) before anything is cached."""
        for groups in self.runner.attn_groups:
            for group in groups:
                for builder in group.metadata_builders:
                    if not isinstance(builder, CPUAttentionMetadataBuilder):
                        raise NotImplementedError(
                            f"kvprune_cuda.vllm: attention backend {type(builder).__name__} "
                            "is not supported (CPU_ATTN only)")
                    if builder.isa not in STRIDED_ISAS:
                        builder.isa = "vec"
                        builder._set_isa_to_layers(builder.layer_names)

    # ------------------------------------------------------------------ hooks
    def _prepare(self, prepare, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        compress = self.step_plan.rows
        self.plan, self.recording, self.decoding, self.bounding = [], [], [], []
        maxima = self.prefill is not None and self.prefill.in_forward
        observes = self.decode is not None and self.decode.policy.observed_queries(1) > 0
        for row, req_id in enumerate(batch.req_ids[:num_reqs]):
            prompt_len = int(batch.num_prompt_tokens[row])
            computed = int(batch.num_computed_tokens_cpu[row])
            scheduled = scheduler_output.num_scheduled_tokens[req_id]
            generated = len(self.runner.requests[req_id].output_token_ids)
            new = rules.decode_positions(computed, scheduled, prompt_len, generated)
            decoding = new > 0
            if req_id in compress:
                kept, pinned, tokens, kind = compress[req_id]
                if pinned % self.block_size:
                    raise RuntimeError(f"kvprune_cuda.vllm: pinned prefix {pinned} of "
                                       f"{req_id} is not whole blocks of {self.block_size}")
                self.plan.append(_Row(req_id, row, prompt_len, kept, pinned, tokens, kind,
                                      computed + scheduled))
            elif rules.records(self.policy, computed, scheduled, prompt_len, generated):
                self.recording.append(_Row(req_id, row, prompt_len))
            end = rules.prefill_end(prompt_len, generated)
            if maxima and prompt_len > self.prefill.target() and computed + scheduled < end:
                held = computed + scheduled - self.evicted.get(req_id, 0)
                self.bounding.append(_Row(req_id, row, prompt_len, tokens=held))
            if decoding and observes:
                held = computed + scheduled - self.evicted.get(req_id, 0)
                self.decoding.append(_Row(req_id, row, prompt_len, tokens=held,
                                          past_prompt=new))
        t0 = time.perf_counter()
        result = prepare(scheduler_output, *args, **kwargs)
        t1 = time.perf_counter()
        shift = [self.evicted.get(r, 0) for r in batch.req_ids[:num_reqs]]
        if any(shift):
            self._shift_to_compacted(num_reqs, torch.tensor(shift, dtype=torch.int32))
        self.kvprune_seconds += (t0 - start) + (time.perf_counter() - t1)  # vLLM's apart
        return result

    def _shift_to_compacted(self, num_reqs: int, shift: torch.Tensor) -> None:
        """seq_lens -= e and slots of positions p - e, for rows with e evicted tokens."""
        r = self.runner
        qsl = r.query_start_loc.gpu[: num_reqs + 1]
        per_token = torch.repeat_interleave(shift, (qsl[1:] - qsl[:-1]).to(torch.int64))
        r.seq_lens[:num_reqs] -= shift.to(r.seq_lens.dtype)
        positions = r.positions[: per_token.shape[0]] - per_token.to(r.positions.dtype)
        r.input_batch.block_table.compute_slot_mapping(num_reqs, qsl, positions)

    def _after_attention(self, module, query: torch.Tensor, meta) -> None:
        """The work of hook 2 for one layer; ``query`` [T, Hq, D] is the step's, post-RoPE,
        and ``meta`` the layer's CPU attention metadata."""
        if not self.plan and not self.recording and not self.decoding and not self.bounding:
            return
        if getattr(module, "isa", "vec") not in STRIDED_ISAS:
            raise RuntimeError(f"kvprune_cuda.vllm: layer {module.layer_name} caches with ISA "
                               f"{module.isa!r}, which compaction cannot address")
        query = query.view(-1, module.num_heads, module.head_size)
        qsl = meta.query_start_loc.tolist()
        layer = self.layer_index[id(module)]
        rows = lambda row: query[qsl[row.row]:qsl[row.row + 1]]  # noqa: E731
        for row in self.recording:
            self._window(row, layer, rows(row))
        blocks = lambda row: meta.block_table[  # noqa: E731
            row.row, : -(-row.tokens // self.block_size)].to(torch.int32).contiguous()
        cache = module.kv_cache if self.fp8 is None else module.kv_cache.view(self.fp8)
        # (req_id, tokens) -> the held keys [1, Hkv, tokens, D] a bounded row read for its
        # maxima, kept for its compaction's novelty reserve (the one later read of them)
        reread = ({(r.req_id, r.tokens) for r in self.plan if r.kind == "chunk"}
                  if self.prefill is not None and self.prefill.novelty else set())
        kept_keys: dict = {}

        def keys_of(row: _Row, row_blocks: torch.Tensor) -> torch.Tensor:
            """The row's held keys as this step's attention left them (before compaction)."""
            keys = kept_keys.pop((row.req_id, row.tokens), None)
            return keys if keys is not None else request_keys(
                cache, row_blocks, row.tokens, query.dtype, module._k_scale_float)

        for row in self.bounding:  # [T, Hq, D] -> [1, Hq, T, D]
            per_layer = self.bound_scores.setdefault(row.req_id, [None] * len(self.layers))
            keys = keys_of(row, blocks(row))
            if (row.req_id, row.tokens) in reread:
                kept_keys[row.req_id, row.tokens] = keys
            fresh = self.prefill.scores(rows(row).transpose(0, 1).unsqueeze(0).contiguous(),
                                        keys, module.impl.scale)
            per_layer[layer] = self.prefill.carry(per_layer[layer], fresh)
        for row in self.decoding:
            new_queries = rows(row)[-row.past_prompt:]  # [past_prompt, Hq, D]
            if self.decode.accumulates:
                keys = keys_of(row, blocks(row))
                self._accumulate(row.req_id, layer, new_queries, keys, module.impl.scale)
            else:
                self._decode_window(row.req_id, layer, new_queries)
        for row in self.plan:
            if row.kind == "decode":
                policy = self.decode.policy
                queries = (self._decode_window(row.req_id, layer)
                           if policy.observed_queries(1) and not self.decode.accumulates
                           else rows(row)[:0])  # streaming, h2o: no query at selection
            else:
                policy, queries = self.policy, self._window(row, layer, rows(row))
            row_blocks = blocks(row)
            policy = rules.with_pinned(policy, row.kept, row.pinned)
            maxima = self.bound_scores.get(row.req_id)
            if row.kind == "chunk" and maxima is not None:  # by the running maxima
                keys = keys_of(row, row_blocks) if self.prefill.novelty else None
                idx = self.prefill.select(maxima[layer], row.kept, row.pinned, keys)
                maxima[layer] = maxima[layer].gather(2, idx.long())
            elif row.kind == "decode" and self.decode.accumulates:  # h2o: by the sums
                evidence = self.decode_evidence[row.req_id]
                idx = kp.select_keep(evidence[layer], row.kept, n_sink=policy.n_sink,
                                     window=policy.window)
                evidence[layer] = evidence[layer].gather(2, idx.long())  # kept keys' sums
            else:
                keys = keys_of(row, row_blocks)
                idx = kept_indices(policy, queries.transpose(0, 1).unsqueeze(0), keys, row.kept,
                                   scale=module.impl.scale)  # queries [M, Hq, D] -> [1, Hq, M, D]
            sums = (self.decode_evidence.get(row.req_id) if row.kind != "decode"
                    and self.decode is not None and self.decode.accumulates else None)
            if sums is not None and sums[layer] is not None:  # a replay's h2o sums follow
                sums[layer] = sums[layer].gather(2, idx.long())
            first = row.pinned // self.block_size  # idx[..., :pinned] is 0..pinned-1: in place
            compact_request(cache, row_blocks[None, first:], row.tokens - row.pinned,
                            (idx[:, :, row.pinned:] - row.pinned).contiguous())
            self.compactions += 1
            self.compacted[row.req_id] += 1

    def _accumulate(self, req_id: str, layer: int, query: torch.Tensor, keys: torch.Tensor,
                    scale: float) -> None:
        """h2o rule: adds the attention of this step's decode queries ``query`` [q, Hq, D] (the
        last q positions) over the request's held ``keys`` [1, Hkv, tokens, D] (theirs
        included) to the held keys' sums."""
        per_layer = self.decode_evidence.setdefault(req_id, [None] * len(self.layers))
        q = query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, q, D]
        per_layer[layer] = self.decode.accumulate(per_layer[layer], q, keys, scale=scale)

    def _decode_window(self, req_id: str, layer: int, query=None) -> torch.Tensor:
        """The request's last ``window`` decode queries of ``layer`` in order ([<= W, Hq, D]),
        after ``query`` ([q, Hq, D], this step's past the prompt) joins them."""
        per_layer = self.decode_evidence.setdefault(req_id, [None] * len(self.layers))
        if query is not None:
            per_layer[layer] = keep_last(per_layer[layer], query, self.decode.policy.window, 0)
        return per_layer[layer]

    def _window(self, row: _Row, layer: int, chunk: torch.Tensor) -> torch.Tensor:
        """The request's last observed queries of ``layer`` once ``chunk`` [T, Hq, D] (this
        step's) joins the recorded ones: [<= W, Hq, D], kept (a copy) for a later chunk."""
        per_layer = self.window_queries.setdefault(row.req_id, [None] * len(self.layers))
        per_layer[layer] = keep_last(per_layer[layer], chunk,
                                     self.policy.observed_queries(row.prompt_len), 0)
        return per_layer[layer]

    def _forget(self, scheduler_output) -> None:
        """Drops the state of finished (aborted included) and preempted requests; every step
        calls it, also one that computes nothing (vLLM then skips ``_prepare_inputs``)."""
        gone = set(scheduler_output.finished_req_ids)
        gone |= scheduler_output.preempted_req_ids or set()
        gone |= scheduler_output.scheduled_cached_reqs.resumed_req_ids  # recomputed from scratch
        for req_id in gone:
            self.evicted.pop(req_id, None)
            self.window_queries.pop(req_id, None)
            self.decode_evidence.pop(req_id, None)
            self.bound_scores.pop(req_id, None)

    def _execute(self, execute, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        self.kvprune_seconds = 0.0
        self.step_plan = plan_of(scheduler_output)
        self._forget(scheduler_output)
        self.compacted.clear()
        try:
            result = execute(scheduler_output, *args, **kwargs)
        finally:
            plan, self.plan, self.decoding = self.plan, [], []
            bounding, self.bounding = {row.req_id for row in self.bounding}, []
            recorded, self.recording = {row.req_id for row in self.recording}, []
            recorded |= {row.req_id for row in plan if row.kind == "chunk"}  # more to come
            for req_id in scheduler_output.num_scheduled_tokens:  # prompt done: window unused
                if req_id not in recorded:
                    self.window_queries.pop(req_id, None)
                if req_id not in bounding:  # prefill done: maxima unused
                    self.bound_scores.pop(req_id, None)
        self._check_carried_out(plan)
        t0 = time.perf_counter()
        self._truncate(plan)
        end = time.perf_counter()
        self.seconds = StepSeconds(self.kvprune_seconds + end - t0, end - start)
        self.total_seconds = self.total_seconds.plus(self.seconds)
        return result

    def _check_carried_out(self, plan: list[_Row]) -> None:
        """PlanNotCarriedOut unless every request of the step's plan was compacted in every
        layer; then the plan's digest is what this worker reports."""
        expected = self.step_plan
        done = {row.req_id for row in plan if self.compacted[row.req_id] == len(self.layers)}
        if done != set(expected.rows):
            raise PlanNotCarriedOut(
                f"kvprune_cuda.vllm: step {expected.step} planned compressions of "
                f"{sorted(expected.rows)}; compacted in all {len(self.layers)} layers: "
                f"{sorted(done)} (per request: {dict(self.compacted)})")
        self.report = expected.digest() if done else None

    def reported(self, output):
        """``output`` (the step's model output) with the digest of the plan carried out and
        the step's :class:`StepSeconds`."""
        if output is None or self.seconds is None:
            return output
        (digest, self.report), (seconds, self.seconds) = (self.report, None), (self.seconds, None)
        return ReportedModelRunnerOutput.of(output, digest or "", seconds)

    def _truncate(self, plan: list[_Row]) -> None:
        """Drops the blocks past each compressed row's kept tokens from its block tables."""
        r = self.runner
        for row in plan:
            keep = -(-row.kept // self.block_size)
            state = r.requests.get(row.req_id)
            if state is not None:
                state.block_ids = tuple(ids[:keep] for ids in state.block_ids)
            index = r.input_batch.req_id_to_index.get(row.req_id)
            if index is not None:
                for table in r.input_batch.block_table.block_tables:
                    n = int(table.num_blocks_per_row[index])
                    table.block_table.np[index, keep:n] = 0
                    table.num_blocks_per_row[index] = min(n, keep)
            self.evicted[row.req_id] = row.positions - row.kept


class CPUWorker(_VllmCPUWorker):
    """vLLM's CPU worker with :class:`RunnerHooks` (``parallel_config.worker_cls``)."""

    def initialize_from_config(self, kv_cache_config) -> None:
        check_vllm_version(vllm.__version__)
        decode = config.decode_from_vllm_config(self.vllm_config)
        check_engine(self.vllm_config, decode)
        check_kv_cache_groups(kv_cache_config)
        super().initialize_from_config(kv_cache_config)
        self.kvprune = RunnerHooks(self.model_runner, config.from_vllm_config(self.vllm_config),
                                   decode, config.prefill_from_vllm_config(self.vllm_config))

    def execute_model(self, scheduler_output, *args, **kwargs):
        try:
            output = super().execute_model(scheduler_output, *args, **kwargs)
        except PlanNotCarriedOut:
            if self.parallel_config.world_size > 1:
                # vLLM's multiprocess executor only logs an exception of a rank other than the
                # one that answers; a rank out of step with the scheduler must stop the engine,
                # and a dead worker does (the executor's monitor shuts the engine down)
                logger.exception("kvprune_cuda.vllm: rank %d stops the engine", self.rank)
                os._exit(1)
            raise
        return self.kvprune.reported(output)

    def sample_tokens(self, *args, **kwargs):
        return self.kvprune.reported(super().sample_tokens(*args, **kwargs))

    def kvprune_stats(self) -> dict:
        """Compactions done, requests held compressed, requests whose observation-window
        queries are recorded while they prefill, requests with decode-rule evidence
        (snapkv: recent decode queries; h2o: attention sums) and requests with a bounded
        prefill's running maxima, and the seconds of every step's forward with kvprune's own
        work in them (:class:`StepSeconds`, summed) (``llm.collective_rpc``)."""
        return {"compactions": self.kvprune.compactions,
                "seconds": self.kvprune.total_seconds._asdict(),
                "evicted": dict(self.kvprune.evicted),
                "recorded_windows": len(self.kvprune.window_queries),
                "decode_evidence": len(self.kvprune.decode_evidence),
                "bound_scores": len(self.kvprune.bound_scores)}
