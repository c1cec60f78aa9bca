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
  whatever its vote (``stride32`` / ``stride64``: a uniform sample for word counting);
* ``kz-SCOPE-pK[sS]``: query-agnostic kvzip (budget scope SCOPE) with its reconstruction
  maxima max-pooled over K positions (shifted S later) before ranking;
* ``kz-head-strideS``: kvzip-head with every S-th context token kept whatever its maximum.

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
from typing import ClassVar

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_ruler as er  # noqa: E402

import kvprune_cuda as kp  # noqa: E402


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
        prefix = max(s.shape[-1] - self.window, 0)
        s[..., :prefix:self.stride] += 1e3  # above any vote: a sum of <= window probabilities
        return s


@dataclass(frozen=True)
class KVzipStride(kp.policy.KVzip):
    """kvzip plus a coverage floor: every ``stride``-th context token is kept whatever its
    reconstruction maximum (a uniform sample, for the word-frequency tasks), the rest of the
    budget by the maxima. Ranks the recorded maxima only, so it shares kvzip's reconstruction."""

    name: ClassVar[str] = "kvzip_stride"
    stride: int = 32

    def rank_recorded(self, recorded):
        s = super().rank_recorded(recorded).clone()
        s[..., ::self.stride] += 1e3  # above any maximum: a probability <= 1
        return s


for _cls in (SnapKVForward, SnapKVChunk, SnapKVQueryMax, SnapKVStride, KVzipStride):
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
}
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
}
for _name, (_policy, _options) in VARIANTS.items():
    er.SETTINGS[_name] = ("aware", _policy, None)
    er.OPTIONS[_name] = _options
for _name, (_scope, _options) in KVZIP_VARIANTS.items():
    er.SETTINGS[_name] = ("agnostic", "kvzip", _scope)
    er.OPTIONS[_name] = _options
_kvzip_setting_policy = er._setting_policy


def _setting_policy(setting: str, args):
    """kvzip settings with a ``stride`` rank by KVzipStride (the sample's kvzip reconstruction)."""
    stride = KVZIP_VARIANTS.get(setting, (None, {}))[1].get("stride")
    if stride is None:
        return _kvzip_setting_policy(setting, args)
    return kp.policy.make(KVzipStride(stride=stride), **vars(_kvzip_setting_policy("kvzip-head", args)))


er._setting_policy = _setting_policy
for _name in ("snapkv-aware", "snapkv-aware-k15", "snapkv-aware-k31"):
    er.OPTIONS[_name] = {**er.OPTIONS.get(_name, {}), "window": W}

if __name__ == "__main__":
    er.main()
