#!/usr/bin/env python3
"""Screens query-aware SnapKV variants on the RULER-style suite (``eval_ruler.py``), issue 39.

Each variant is a small policy class (registered with ``kp.policy.register``) whose scoring
differs from :class:`kvprune_cuda.policy.SnapKV` in one idea; the pooling and chunking here
are plain torch (a screen: what wins moves into ``kp.policy`` on the library's ops). They run
as ``eval_ruler.py`` settings on the same samples and token ids as its files, so its
``--table`` compares them with ``full`` and the other settings recorded there:

* ``sv-fwd-A-B``: max pooling over ``[i - A, i + B]`` (a kept key's following tokens, a
  retrieval answer, pooled with it) instead of the symmetric ``[i - k//2, i + k//2]``;
* ``sv-k63``: a symmetric pool of 63;
* ``sv-chunkC``: ChunkKV-style: every token scored by the sum of its C-token chunk's votes,
  so whole chunks are kept;
* ``sv-qmax-k31``: each query head's largest probability over the window instead of the sum;
* ``sv-gqamax-k31``: the KV group's largest query head instead of the mean;
* ``sv-w16-k31`` / ``sv-w64-k31``: a window of 16 / 64 queries (run with ``--window 64`` so
  64 are recorded; every setting then names its own window);
* ``sv-d-*``: the default pool (49 wide, shifted 16) centred (``c49``), shifted 8 (``s8``),
  averaged (``avg``), with GQA max (``gqamax``), or with every 32nd / 64th token kept
  whatever its vote (``stride32`` / ``stride64``: a uniform sample for word counting), or with
  the prompt's first 128 / 256 tokens kept (``prefix128`` / ``prefix256``: a wider sink, where
  a list's recitation starts);
* ``sv-d-wq``: the default with the question as its observation window: the window is each
  sample's question, all its tokens but the last (which starts the answer; 33-97 tokens)
  instead of the last 32 prompt tokens (run with ``--window 100`` so every question's queries
  are recorded);
* ``sv-d-head`` / ``sv-d-global``: the default's votes with the budget shared over every
  (layer, KV head) / over the layers (budget scopes "head" / "global"); ``sv-d-head-f20``:
  "head" with AdaKV's safeguard, 20 % of each head's budget to its own best votes first;
* ``kz-SCOPE-pK[sS]``: query-agnostic kvzip (budget scope SCOPE) with its reconstruction
  maxima max-pooled over K positions (shifted S later) before ranking;
* ``kz-head-strideS``: kvzip-head with every S-th context token kept whatever its maximum;
* ``kd-layer[-p7]``: KeyDiff alone (the keys least like their head's mean key, pooled over 7);
* ``kzkd-SCOPE-hP``: the library's ``KVzip(novelty=P/100)``: P % of each head's budget to its
  most novel keys first; ``kzkd-head-fF[p7]``: F % of the context instead (pooled over 7);
* ``kzur-head-h50``: ``kzkd-head-h50`` with the novelty of the keys before RoPE;
* ``kzfl-head-hP``: its control, the library's ``KVzip(head_floor=P/100)``: each head's floor
  (P % of its budget) filled by the head's own largest maxima instead of its most novel keys;
* ``kzplus-head[-h25]``: kvzip ranked by KVzip+ maxima (each probability times the key's
  ``||W_O v||`` over the query's ``||h||``, recorded beside the plain maxima in the same
  reconstruction), with no floor / the default floor;
* ``pq-layer``: the votes of a generic question asked after the context (PROBE_QUESTION,
  then dropped), pooled as the query-aware default.

The ``kz*`` settings but ``kzplus`` rank kvzip's plain maxima (``weight="none"``), with no
floor unless they name one, as their records hold; ``kzplus-head-h25`` ranks as the library's
default kvzip (KVzip+ with the floor; ``eval_ruler.py``'s ``kvzip-head-default``).

    .venv/bin/python bench/ruler_variants.py --tokens 4096 --samples 2 --budgets 0.16 --dtype float32 \\
        --window 64 --settings sv-fwd-24-6 ... --out bench/results/ruler_4k/variants.json
    .venv/bin/python bench/eval_ruler.py --table bench/results/ruler_4k/ours*.json bench/results/ruler_4k/variants*.json

(``--table`` of eval_ruler.py reads the variants' names once this module is imported: run
the table through this script, ``bench/ruler_variants.py --table ...``.)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_ruler as er  # noqa: E402
import ruler_tasks as rt  # noqa: E402

import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda.policy.novelty import key_novelty  # noqa: E402


def _prefix_pool(s: torch.Tensor, window: int, before: int, after: int) -> torch.Tensor:
    """Pools each row's prefix [0, n - window) of ``s`` [B, H, n] over [i - before, i + after]
    (padding never wins); the window is copied."""
    n = s.shape[-1]
    prefix = max(n - window, 0)
    out = s.clone()
    if prefix == 0:
        return out
    row = s[..., :prefix].reshape(-1, 1, prefix)
    padded = F.pad(row, (before, after), value=float("-inf"))
    out[..., :prefix] = F.max_pool1d(padded, before + after + 1, stride=1).reshape(*s.shape[:-1], prefix)
    return out


def _chunk_sum(s: torch.Tensor, window: int, chunk: int) -> torch.Tensor:
    """Every prefix token scored by its chunk's summed votes (chunks of ``chunk`` from 0)."""
    n = s.shape[-1]
    prefix = max(n - window, 0)
    out = s.clone()
    if prefix == 0:
        return out
    m = -(-prefix // chunk) * chunk
    padded = F.pad(s[..., :prefix], (0, m - prefix))
    sums = padded.reshape(*s.shape[:-1], m // chunk, chunk).sum(-1, keepdim=True)
    out[..., :prefix] = sums.expand(*s.shape[:-1], m // chunk, chunk).reshape(*s.shape[:-1], m)[..., :prefix]
    return out


def _always_kept(s: torch.Tensor, window: int, *, stop: Optional[int] = None,
                 step: int = 1) -> torch.Tensor:
    """Lifts the votes ``s`` [B, H, n] of the tokens ``[0, min(stop, n - window)):step`` above
    any vote (a sum of <= window probabilities), so they are kept whatever their vote."""
    prefix = max(s.shape[-1] - window, 0)
    s[..., :prefix if stop is None else min(stop, prefix):step] += 1e3
    return s


@dataclass(frozen=True)
class SnapKVForward(kp.policy.SnapKV):
    """SnapKV whose max pool covers [i - before, i + after]."""

    name: ClassVar[str] = "snapkv_fwd"
    before: int = 24
    after: int = 6

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        s = kp.window_scores(queries, keys, scale=scale, gqa=self.gqa)
        return _prefix_pool(s, self.window, self.before, self.after)


@dataclass(frozen=True)
class SnapKVChunk(kp.policy.SnapKV):
    """SnapKV scoring whole chunks of ``chunk`` tokens by their summed votes (ChunkKV)."""

    name: ClassVar[str] = "snapkv_chunk"
    chunk: int = 16

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        s = kp.window_scores(queries, keys, scale=scale, gqa=self.gqa)
        return _chunk_sum(s, self.window, self.chunk)


@dataclass(frozen=True)
class SnapKVQueryMax(kp.policy.SnapKV):
    """SnapKV with each query head's largest window probability per key (qreduce "max")."""

    name: ClassVar[str] = "snapkv_qmax"

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        s = kp.window_scores(queries, keys, scale=scale, gqa=self.gqa, qreduce="max")
        return kp.pool_scores(s, self.kernel_size, self.pool, window=self.window)


@dataclass(frozen=True)
class SnapKVStride(kp.policy.SnapKV):
    """The default SnapKV plus a coverage floor: every ``stride``-th token before the window
    is kept whatever its vote (a uniform sample of the context, for the word-frequency
    tasks), the rest of the budget by the pooled votes."""

    name: ClassVar[str] = "snapkv_stride"
    stride: int = 32

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        s = super().score(queries, keys, scale=scale, seq_lens=seq_lens)
        return _always_kept(s, self.window, step=self.stride)


@dataclass(frozen=True)
class SnapKVPrefix(kp.policy.SnapKV):
    """The default SnapKV that also keeps the prompt's first ``prefix`` tokens whatever their
    vote (a wider sink: where the model starts when it recites a list, for cwe), the rest of
    the budget by the pooled votes."""

    name: ClassVar[str] = "snapkv_prefix"
    prefix: int = 128

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        s = super().score(queries, keys, scale=scale, seq_lens=seq_lens)
        return _always_kept(s, self.window, stop=self.prefix)


@dataclass(frozen=True)
class SnapKVFloor(kp.policy.SnapKV):
    """The default SnapKV for a budget shared over heads (``budget_scope="head"``): each KV
    head's ``floor`` share of its budget goes first to its own best-voted tokens between the
    sinks and the window (AdaKV's safeguard), the rest to the best votes of every head."""

    name: ClassVar[str] = "snapkv_floor"
    floor: float = 0.2

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        s = super().score(queries, keys, scale=scale, seq_lens=seq_lens)
        n = s.shape[-1]
        free = s[..., self.n_sink:max(n - self.window, self.n_sink)]
        count = min(int(self.floor * self.kept_tokens(n)), free.shape[-1])
        if count > 0:
            top = free.topk(count, -1).indices + self.n_sink
            s.scatter_add_(-1, top, torch.full(top.shape, 1e3, dtype=s.dtype, device=s.device))
        return s


@dataclass(frozen=True)
class KVzipStride(kp.policy.KVzip):
    """kvzip plus a coverage floor: every ``stride``-th context token is kept whatever its
    reconstruction maximum (a uniform sample, for the word-frequency tasks), the rest of the
    budget by the maxima. Ranks the recorded maxima only, so it shares kvzip's reconstruction."""

    name: ClassVar[str] = "kvzip_stride"
    stride: int = 32

    def rank_recorded(self, recorded, keys=None):
        s = super().rank_recorded(recorded).clone()
        s[..., ::self.stride] += 1e3  # above any maximum: a probability <= 1
        return s


@dataclass(frozen=True)
class KeyDiff(kp.policy.Policy):
    """KeyDiff (query-agnostic, no forward of its own): the keys least like their head's mean
    key, ``kernel_size`` > 1 max-pooled."""

    name: ClassVar[str] = "keydiff"
    kernel_size: int = 1

    def score(self, queries, keys, *, scale=None, seq_lens=None):
        s = key_novelty(keys)
        return s if self.kernel_size == 1 else kp.pool_scores(s, self.kernel_size, "max")


@dataclass(frozen=True)
class KVzipKeyDiff(kp.policy.KVzip):
    """kvzip whose every head first keeps its ``share`` (of the context) most novel keys
    (:func:`kvprune_cuda.policy.novelty.key_novelty`, max-pooled over ``novelty_kernel``),
    the rest of the budget by the reconstruction maxima. The library's ``KVzip(novelty=f)``
    is the unpooled case with the share a fraction of the budget."""

    name: ClassVar[str] = "kvzip_keydiff"
    share: float = 0.08
    novelty_kernel: int = 1

    def rank_recorded(self, recorded, keys=None):
        s = super().rank_recorded(recorded).clone()
        nov = key_novelty(keys)
        if self.novelty_kernel > 1:
            nov = kp.pool_scores(nov, self.novelty_kernel, "max")
        top = max(1, int(self.share * nov.shape[-1]))
        s[nov >= nov.topk(top, -1).values[..., -1:]] += 1e3  # above any maximum (<= 1)
        return s


ROPE_THETA = 1e6  # Qwen2.5's (config rope_parameters): KVzipUnroped undoes the rotation


def unroped(keys: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """``keys`` [B, H, n, D], rotated by the default (half-split) RoPE at positions 0..n-1,
    rotated back: a token's key is then the same wherever it stands."""
    d, n = keys.shape[-1], keys.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]  # [n, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    k = keys.float()
    half = torch.cat([-k[..., d // 2:], k[..., :d // 2]], -1)
    return k * cos - half * sin


@dataclass(frozen=True)
class KVzipUnroped(kp.policy.KVzip):
    """The library's ``KVzip(novelty=f)`` with the novelty of the keys before RoPE (a phrase
    repeated through the context then has one key, the mean's direction, and is not novel)."""

    name: ClassVar[str] = "kvzip_unroped"

    def rank_recorded(self, recorded, keys=None):
        return super().rank_recorded(recorded, None if keys is None else unroped(keys))


# A generic question asked of every context before it is compressed: its queries vote as
# SnapKV's window does on the real question (query-agnostic: the same text for every context).
PROBE_QUESTION = ("List every important detail of the text above, such as names, numbers, "
                  "codes and identifiers.")
_PROBE: dict = {}  # layer -> the probe question's post-RoPE queries [B, Hq, W, D] (this sample)


@dataclass(frozen=True)
class KVzipProbe(kp.policy.KVzip):
    """Query-agnostic SnapKV: a key's score is the vote of PROBE_QUESTION's queries (asked
    after the context, then dropped), max-pooled as the query-aware default pools (49 wide,
    shifted 16). A KVzip only to share the sample's kvzip scoring run."""

    name: ClassVar[str] = "kvzip_probe"

    def rank_with_probe(self, keys, layer):
        votes = kp.window_scores(_PROBE[layer], keys, gqa="mean")
        return kp.policy.pooling.shifted_pool(votes, 49, "max", 16, 0)


def record_probe(sc, tok) -> None:
    """Asks PROBE_QUESTION after the context of ``sc`` (a ScoredContext) and keeps its queries
    per layer in ``_PROBE`` (the extension itself is dropped)."""
    _, post = rt.template_parts(tok)
    ids = torch.tensor([tok("\n" + PROBE_QUESTION + post, add_special_tokens=False).input_ids])
    saved = sc.policies
    sc.policies = [kp.policy.make("snapkv", window=ids.shape[1])]
    try:
        ext = sc.extend(ids)
    finally:
        sc.policies = saved
    _PROBE.clear()
    _PROBE.update({i: st.queries for i, st in enumerate(ext._state["layers"])})


# KVzip+ (the library's ``KVzip(weight="output")``) recorded in _PLUS beside the plain maxima
# during the same reconstruction, so one forward pass serves both (the records of
# kvzip_plus_{a,b}.json ran this screen's own torch copy of the weighting, at 9d4cfdc; the
# library's gives the same maxima to 4e-7).
_PLUS: dict = {}      # layer -> LayerState holding the KVzip+ maxima of this sample
_PLUS_ON = [False]    # record them (a kzplus setting runs)
_scorer_call = kp.hf.reconstruct.ReconstructionScorer.__call__


def _scorer_call_plus(self, module, st, hs, position_embeddings, k, v):
    """The library's fold, then (kzplus settings) the KVzip+ maxima of the same forward."""
    _scorer_call(self, module, st, hs, position_embeddings, k, v)
    if not _PLUS_ON[0]:
        return
    plus = kp.policy.make(self.kvzip, weight="output")
    qn = kp.hf.scoring.post_rope_queries(module, hs, *position_embeddings)
    kp.hf.scoring.fold_reconstruction(
        _PLUS.setdefault(module.layer_idx, kp.hf.scoring.LayerState()), plus, qn, None, k,
        self.n, self.span, getattr(module, "scaling", None),
        lambda s, e: kp.hf.reconstruct.output_weights(module, hs, v[:, :, s:e]))


kp.hf.reconstruct.ReconstructionScorer.__call__ = _scorer_call_plus


@dataclass(frozen=True)
class KVzipPlus(kp.policy.KVzip):
    """kvzip ranked by the KVzip+ maxima (_PLUS) recorded beside the plain ones; the floor
    and the rest of the ranking as the library's."""

    name: ClassVar[str] = "kvzip_plus"


_selection_scores = kp.hf.scoring.selection_scores


def _selection_scores_with_probe(st, policy, k, layer, seq_lens=None):
    if isinstance(policy, KVzipProbe):
        return policy.rank_with_probe(k, layer)
    if isinstance(policy, KVzipPlus):
        return policy.rank_recorded(_PLUS[layer].kvzip, k)
    return _selection_scores(st, policy, k, layer, seq_lens=seq_lens)


kp.hf.scoring.selection_scores = _selection_scores_with_probe

for _cls in (SnapKVForward, SnapKVChunk, SnapKVQueryMax, SnapKVStride, SnapKVPrefix, SnapKVFloor,
             KVzipStride, KeyDiff, KVzipKeyDiff, KVzipUnroped, KVzipProbe, KVzipPlus):
    kp.policy.register(_cls)

W = 32  # the library's default window: every setting names its own (the run records --window)
VARIANTS = {
    "sv-fwd-24-6": ("snapkv_fwd", {"before": 24, "after": 6, "window": W}),
    "sv-fwd-40-8": ("snapkv_fwd", {"before": 40, "after": 8, "window": W}),
    "sv-fwd-12-3": ("snapkv_fwd", {"before": 12, "after": 3, "window": W}),
    "sv-fwd-32-8": ("snapkv_fwd", {"before": 32, "after": 8, "window": W}),
    "sv-fwd-56-8": ("snapkv_fwd", {"before": 56, "after": 8, "window": W}),
    "sv-k63": ("snapkv", {"kernel_size": 63, "window": W}),
    "sv-chunk16": ("snapkv_chunk", {"chunk": 16, "window": W}),
    "sv-chunk32": ("snapkv_chunk", {"chunk": 32, "window": W}),
    "sv-qmax-k31": ("snapkv_qmax", {"kernel_size": 31, "window": W}),
    "sv-gqamax-k31": ("snapkv", {"kernel_size": 31, "gqa": "max", "window": W}),
    "sv-w16-k31": ("snapkv", {"kernel_size": 31, "window": 16}),
    "sv-w64-k31": ("snapkv", {"kernel_size": 31, "window": 64}),
    # around the default (49 wide, shifted 16), for the word-extraction families cwe / fwe
    "sv-d-c49": ("snapkv", {"kernel_size": 49, "pool_shift": 0, "window": W}),
    "sv-d-s8": ("snapkv", {"kernel_size": 49, "pool_shift": 8, "window": W}),
    "sv-d-avg": ("snapkv", {"pool": "avg", "window": W}),
    "sv-d-gqamax": ("snapkv", {"gqa": "max", "window": W}),
    "sv-d-stride32": ("snapkv_stride", {"stride": 32, "window": W}),
    "sv-d-stride64": ("snapkv_stride", {"stride": 64, "window": W}),
    "sv-d-prefix128": ("snapkv_prefix", {"prefix": 128, "window": W}),
    "sv-d-prefix256": ("snapkv_prefix", {"prefix": 256, "window": W}),
}
# query-aware, the default's votes ranked over more than a layer's heads (budget scope "head":
# every (layer, KV head) of the model, AdaKV with PyramidKV-like layer shares; "global": layers
# by their votes, evenly over a layer's heads), with AdaKV's 20 % safeguard per head or none
SCOPED_VARIANTS = {
    "sv-d-head": ("head", "snapkv", {"window": W}),
    "sv-d-head-f20": ("head", "snapkv_floor", {"floor": 0.2, "window": W}),
    "sv-d-global": ("global", "snapkv", {"window": W}),
}
# query-aware, the default with each sample's question as its window (_QUESTION: the question's
# tokens but its last, set per sample by _run_sample)
QUESTION_WINDOW = ("sv-d-wq",)
_QUESTION = [0]
# query-agnostic: kvzip's reconstruction maxima pooled before they are ranked (the library's
# KVzip(kernel_size, pool_shift)); every variant shares the sample's one reconstruction
KVZIP_VARIANTS = {
    "kz-head-p7": ("head", {"kernel_size": 7}),
    "kz-head-p15": ("head", {"kernel_size": 15}),
    "kz-head-p31": ("head", {"kernel_size": 31}),
    "kz-head-p49s16": ("head", {"kernel_size": 49, "pool_shift": 16}),
    "kz-head-p15s4": ("head", {"kernel_size": 15, "pool_shift": 4}),
    "kz-global-p15": ("global", {"kernel_size": 15}),
    "kz-head-stride32": ("head", {"stride": 32}),
    "kz-head-stride16": ("head", {"stride": 16}),
    "kzkd-head-f8": ("head", {"share": 0.08}),
    "kzkd-head-f4": ("head", {"share": 0.04}),
    "kzkd-head-f8p7": ("head", {"share": 0.08, "novelty_kernel": 7}),
    "kzkd-head-h50": ("head", {"novelty": 0.5}),
    "kzkd-head-h75": ("head", {"novelty": 0.75}),
    "kzkd-head-h25": ("head", {"novelty": 0.25}),
    "kzkd-layer-h50": ("layer", {"novelty": 0.5}),
    "kzkd-layer-h25": ("layer", {"novelty": 0.25}),
    "kzkd-global-h50": ("global", {"novelty": 0.5}),
    "kzur-head-h50": ("head", {"unroped": 0.5}),
    "kzfl-head-h50": ("head", {"head_floor": 0.5}),
    "kzfl-head-h25": ("head", {"head_floor": 0.25}),
    "kzfl-head-h75": ("head", {"head_floor": 0.75}),
    "pq-layer": ("layer", {"probe": True}),
    "kzplus-head": ("head", {"plus": True}),
    "kzplus-head-h25": ("head", {"plus": True, "head_floor": 0.25}),
}
for _name, (_policy, _options) in VARIANTS.items():
    er.SETTINGS[_name] = ("aware", _policy, None)
    er.OPTIONS[_name] = _options
for _name, (_scope, _policy, _options) in SCOPED_VARIANTS.items():
    er.SETTINGS[_name] = ("aware", _policy, _scope)
    er.OPTIONS[_name] = _options
for _name in QUESTION_WINDOW:
    er.SETTINGS[_name] = ("aware", "snapkv", None)
for _name, _kernel in (("kd-layer", 1), ("kd-layer-p7", 7)):
    er.SETTINGS[_name] = ("agnostic", "keydiff", "layer")
    er.OPTIONS[_name] = {"kernel_size": _kernel, "window": 0}
for _name, (_scope, _options) in KVZIP_VARIANTS.items():
    er.SETTINGS[_name] = ("agnostic", "kvzip", _scope)
    # no floor and plain maxima (as their records hold) unless the variant sets them
    er.OPTIONS[_name] = {"head_floor": 0.0, "weight": "none", **_options}
_kvzip_setting_policy = er._setting_policy


def _setting_policy(setting: str, args):
    """kvzip settings with a ``stride`` rank by KVzipStride (the sample's kvzip reconstruction);
    the question-window settings vote with the running sample's question."""
    if setting in QUESTION_WINDOW:
        return kp.policy.make(_kvzip_setting_policy(setting, args), window=_QUESTION[0])
    options = KVZIP_VARIANTS.get(setting, (None, {}))[1]
    base = lambda: vars(_kvzip_setting_policy("kvzip-head", args))  # noqa: E731
    if "stride" in options:
        return kp.policy.make(KVzipStride(stride=options["stride"]), **base())
    if "share" in options:
        return kp.policy.make(KVzipKeyDiff(**options), **base())
    if "unroped" in options:  # (base() holds novelty 0: the variant's own share replaces it)
        return kp.policy.make(KVzipUnroped(), **{**base(), "novelty": options["unroped"]})
    if "probe" in options:
        return kp.policy.make(KVzipProbe(), **base())
    if "plus" in options:
        return kp.policy.make(KVzipPlus(), **{**base(), "head_floor": options.get("head_floor", 0.0)})
    return _kvzip_setting_policy(setting, args)


er._setting_policy = _setting_policy
_plain_scored = er._scored


def _scored(model, tok, ids, names, args, recorded_with=None):
    """eval_ruler's scoring, plus the probe question's queries for the pq* settings when the
    scoring is the context's with kvzip's plain maxima recorded (the screens' kvzip)."""
    screens = "kvzip" in names and dict((recorded_with or {}).get("kvzip", ())).get("weight") == "none"
    _PLUS.clear()
    _PLUS_ON[0] = screens and any(s.startswith("kzplus") for s in args.settings)
    sc, info = _plain_scored(model, tok, ids, names, args, recorded_with)
    if screens and any(s.startswith("pq") for s in args.settings):
        record_probe(sc, tok)
    return sc, info


er._scored = _scored
_plain_run_sample = er.run_sample


def _run_sample(model, tok, ctx, qst, *rest, **options):
    """eval_ruler's sample, its question's length (but the last token) in _QUESTION first."""
    _QUESTION[0] = qst.shape[1] - 1
    return _plain_run_sample(model, tok, ctx, qst, *rest, **options)


er.run_sample = _run_sample
for _name in ("snapkv-aware", "snapkv-aware-k15", "snapkv-aware-k31"):
    er.OPTIONS[_name] = {**er.OPTIONS.get(_name, {}), "window": W}

if __name__ == "__main__":
    er.main()
