"""Hugging Face ``transformers`` integration: compress a causal LM's KV cache with kvprune ops.

Optional: needs ``transformers`` (tested: 4.56.2, 5.2.0, 5.24.0) only at the point of use;
``import kvprune_cuda`` never imports it. Two ways in::

    import kvprune_cuda as kp
    # compress each prompt after its prefill (the question is in the prompt)
    with kp.hf.compress(model, policy="snapkv", budget=0.2) as comp:
        out = model.generate(**inputs, max_new_tokens=32)
    # compress a context before any question is known, then ask it questions
    ctx = kp.hf.compress_context(model, context_ids, policy="kvzip", budget=0.2)
    answer = ctx.generate(question_ids, max_new_tokens=32)

The policies are :mod:`kvprune_cuda.policy`'s. Modules (no import cycle; each imports only
those listed before it): ``_compat`` (transformers version shims), ``memory`` (bytes held),
``fixed_layer`` / ``ragged_layer`` (the compressed cache layers), ``lse`` (the attention's
log-sum-exp), ``scoring`` (recorded evidence and selection scores), ``select`` (budgets,
selection, compaction), ``decode_step`` (the decode-time rule), ``reconstruct`` (kvzip's
reconstruction and its scoring), ``hooks`` (:class:`KVCompressor`, :func:`compress`), ``context`` (:func:`score_context`,
:func:`compress_context`).
"""

from kvprune_cuda.hf._compat import cache_kv
from kvprune_cuda.hf.context import (
    CompressedContext,
    ScoredContext,
    compress_context,
    score_context,
)
from kvprune_cuda.hf.hooks import KVCompressor, compress
from kvprune_cuda.hf.memory import kv_bytes
from kvprune_cuda.hf.reconstruct import RepeatPrompt
from kvprune_cuda.policy import POLICIES, resolve_budget

__all__ = ["compress", "compress_context", "score_context", "CompressedContext", "ScoredContext",
           "KVCompressor", "RepeatPrompt", "kv_bytes", "cache_kv", "POLICIES", "resolve_budget"]
