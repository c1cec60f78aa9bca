"""The specification of every kvprune op, in plain PyTorch.

Written for clarity, not speed: loops over batch rows, float64 arithmetic where
rounding matters. Tests compare the compiled CPU and CUDA ops against these
functions. See DESIGN.md §1 for the maths.

Shapes: batch B, query heads Hq, KV heads Hkv (G = Hq // Hkv query heads share a
KV head), cache length N, head dim D, observation window W.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

GQA_REDUCTIONS = ("mean", "max", "sum")
POOL_MODES = ("max", "avg")


def _row_lengths(batch: int, length: int, seq_lens: Optional[torch.Tensor]) -> list[int]:
    """Valid length of every batch row (right padding)."""
    if seq_lens is None:
        return [length] * batch
    return [int(n) for n in seq_lens.tolist()]


def window_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    lse: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    gqa: str = "mean",
    seq_lens: Optional[torch.Tensor] = None,
    qreduce: str = "sum",
    out: Optional[torch.Tensor] = None,
    query_weight: Optional[torch.Tensor] = None,
    key_weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention mass each key receives from the last W queries, per KV head.

    q [B,Hq,W,D] holds the queries of positions n-W .. n-1 of each row (n its valid
    length); k [B,Hkv,N,D]. Query i sees keys j <= n-W+i. Without lse the softmax is
    normalised over the visible keys; with lse [B,Hq,W] the probabilities are
    exp(q.k*scale - lse). Queries at negative positions (n < W) contribute nothing.
    Per query head the W probabilities of key j combine by qreduce: "sum", or "max"
    (invisible pairs count as 0); then the group's heads combine by gqa.
    qreduce "max" only: query_weight [B,Hq,W] multiplies each probability before the max,
    key_weight [B,Hq,M] (M: out's last dim, else N) each head's maximum after it; a weight
    that is not > 0 (NaN included) counts as 0, a missing one is 1.
    Returns fp32 [B,Hkv,N]; positions >= n are 0.
    With out (fp32 [B,Hkv,M], 1 <= M <= N) returns fold(out, new[..., :M]) instead,
    new being the result above and fold max (qreduce "max") or + ("sum"); out itself
    is not modified here.
    """
    batch, q_heads, window, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = torch.zeros(batch, kv_heads, length, dtype=torch.float64)
    m = length if out is None else out.shape[2]
    if (query_weight is not None or key_weight is not None) and qreduce != "max":
        raise ValueError("query_weight and key_weight weigh the maxima: they need qreduce='max'")
    for name, weight, last in (("query_weight", query_weight, window), ("key_weight", key_weight, m)):
        if weight is not None and tuple(weight.shape) != (batch, q_heads, last):
            raise ValueError(f"{name} must have shape [{batch}, {q_heads}, {last}], got {tuple(weight.shape)}")

    def applied(weight, shape):  # float64 weights, 0 where not > 0
        if weight is None:
            return torch.ones(shape, dtype=torch.float64)
        w = weight.double().cpu()
        return torch.where(w > 0, w, torch.zeros((), dtype=torch.float64))

    qw = applied(query_weight, (batch, q_heads, window))
    kw = torch.nn.functional.pad(applied(key_weight, (batch, q_heads, m)), (0, length - m))
    for b, n in enumerate(_row_lengths(batch, length, seq_lens)):
        positions = torch.arange(n - window, n)  # position of each window query
        visible = torch.arange(n)[None, :] <= positions[:, None]  # [W, n]
        for h in range(q_heads):
            logits = q[b, h].double().cpu() @ k[b, h // group, :n].double().cpu().T * scale
            logits = logits.masked_fill(~visible, float("-inf"))
            if lse is None:
                probs = torch.softmax(logits, dim=-1)
            else:
                probs = torch.exp(logits - lse[b, h].double().cpu()[:, None])
            probs = torch.nan_to_num(probs, nan=0.0).masked_fill(~visible, 0.0)  # rows with n < W
            if qreduce == "max":
                per_head = (probs * qw[b, h, :, None]).amax(dim=0) * kw[b, h, :n]  # [n]
            else:
                per_head = probs.sum(dim=0)  # [n]
            g = h // group
            first = h % group == 0
            if gqa == "max":
                scores[b, g, :n] = per_head if first else torch.maximum(scores[b, g, :n], per_head)
            else:
                scores[b, g, :n] += per_head / (group if gqa == "mean" else 1)
    if out is None:
        return scores.float()
    new = scores[..., : out.shape[2]]
    old = out.double().cpu()
    return (torch.maximum(old, new) if qreduce == "max" else old + new).float()


def pool_scores(
    scores: torch.Tensor,
    kernel_size: int = 7,
    mode: str = "max",
    *,
    window: int = 32,
    seq_lens: Optional[torch.Tensor] = None,
    shift: int = 0,
) -> torch.Tensor:
    """Stride-1 1-D pooling of each row's prefix [0, n-window).

    Position i pools the prefix at [i - r - shift, i + r - shift], r = kernel_size//2:
    the prefix is padded with r + shift positions before it and r - shift after it.
    Max pooling never picks padding, avg pooling counts it as zeros (always divides
    by kernel_size). Window positions [n-window, n) are copied, positions >= n become 0.
    """
    batch, heads, length = scores.shape
    out = torch.zeros(batch, heads, length, dtype=torch.float32)
    for b, n in enumerate(_row_lengths(batch, length, seq_lens)):
        prefix = max(n - window, 0)
        out[b, :, prefix:n] = scores[b, :, prefix:n].float().cpu()
        if prefix == 0:
            continue
        row = scores[b, :, :prefix].double().cpu()[:, None, :]  # [heads, 1, prefix]
        r = kernel_size // 2
        padded = F.pad(row, (r + shift, r - shift), value=-math.inf if mode == "max" else 0.0)
        if mode == "max":
            pooled = F.max_pool1d(padded, kernel_size, stride=1)
        else:
            pooled = F.avg_pool1d(padded, kernel_size, stride=1)
        out[b, :, :prefix] = pooled[:, 0, :].float()
    return out


def select_keep(
    scores: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    window: int = 32,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Indices kept per (batch, head) row: int32 [B,H,budget], ascending.

    Kept = sinks [0,n_sink) + window [n-window,n) + the budget-n_sink-window highest
    scores in [n_sink, n-window); equal scores prefer the lower position. Rows with
    n <= budget keep 0..n-1 and pad with -1.
    """
    batch, heads, length = scores.shape
    out = torch.full((batch, heads, budget), -1, dtype=torch.int32)
    for b, n in enumerate(_row_lengths(batch, length, seq_lens)):
        if n <= budget:
            out[b, :, :n] = torch.arange(n, dtype=torch.int32)
            continue
        middle = torch.arange(n_sink, n - window)
        fixed = torch.cat([torch.arange(n_sink), torch.arange(n - window, n)])
        for h in range(heads):
            candidates = scores[b, h, n_sink : n - window].float().cpu()
            # Stable sort on descending score keeps ascending positions among ties.
            order = torch.sort(-candidates, stable=True).indices
            chosen = middle[order[: budget - n_sink - window]]
            out[b, h] = torch.sort(torch.cat([fixed, chosen])).values.int()
    return out


def gather_kv(
    k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out[b,h,t] = k[b,h,idx[b,h,t]] (same for v); indices outside [0,N) give zero rows."""
    batch, heads, length, head_dim = k.shape
    budget = idx.shape[2]
    out_k = torch.zeros(batch, heads, budget, head_dim, dtype=k.dtype)
    out_v = torch.zeros(batch, heads, budget, v.shape[3], dtype=v.dtype)
    for b in range(batch):
        for h in range(heads):
            for t, j in enumerate(idx[b, h].tolist()):
                if 0 <= j < length:
                    out_k[b, h, t] = k[b, h, j].cpu()
                    out_v[b, h, t] = v[b, h, j].cpu()
    return out_k, out_v


def streaming_indices(
    batch: int, heads: int, length: int, budget: int, *, n_sink: int = 4,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """StreamingLLM kept indices: [0,n_sink) + the last budget-n_sink positions."""
    out = torch.full((batch, heads, budget), -1, dtype=torch.int32)
    for b, n in enumerate(_row_lengths(batch, length, seq_lens)):
        if n <= budget:
            keep = torch.arange(n)
        else:
            keep = torch.cat([torch.arange(n_sink), torch.arange(n - (budget - n_sink), n)])
        out[b, :, : keep.numel()] = keep.int()
    return out


def snapkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    window: int = 32,
    kernel_size: int = 7,
    pool: str = "max",
    gqa: str = "mean",
    lse: Optional[torch.Tensor] = None,
    seq_lens: Optional[torch.Tensor] = None,
    pool_shift: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-stage compression: sinks + SnapKV voting, pooling, top-k, gather."""
    scores = window_scores(q, k, lse=lse, gqa=gqa, seq_lens=seq_lens)
    pooled = pool_scores(scores, kernel_size, pool, window=window, seq_lens=seq_lens,
                         shift=pool_shift)
    idx = select_keep(pooled, budget, n_sink=n_sink, window=window, seq_lens=seq_lens)
    out_k, out_v = gather_kv(k, v, idx)
    return out_k, out_v, idx


def paged_to_dense(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   layout: str = "NHD") -> torch.Tensor:
    """The tokens of a paged block pool as a dense [B, Hkv, max_blocks * block_size, D]
    tensor (zeros past each row's length): token t of row b is slot ``t % block_size`` of
    block ``block_table[b, t // block_size]``. ``layout``: "NHD" = pool [num_blocks,
    block_size, Hkv, D], "HND" = [num_blocks, Hkv, block_size, D]."""
    pool = cache if layout == "NHD" else cache.transpose(1, 2)  # [num_blocks, bs, Hkv, D]
    block_size, heads, head_dim = pool.shape[1:]
    batch, max_blocks = block_table.shape
    out = torch.zeros(batch, heads, max_blocks * block_size, head_dim, dtype=cache.dtype)
    for b in range(batch):
        for t in range(int(seq_lens[b])):
            out[b, :, t] = pool[int(block_table[b, t // block_size]), t % block_size].cpu()
    return out


def paged_compact(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, idx: torch.Tensor, layout: str = "NHD") -> torch.Tensor:
    """Returns the new seq_lens int32 [B] and compacts (copies of) the pools in place:
    token t of row b and head h becomes the token at position ``idx[b, h, t]`` for every
    valid (>= 0) index, gathered from the cache before any write."""
    batch = block_table.shape[0]
    dense_k = paged_to_dense(k_cache, block_table, seq_lens, layout)
    dense_v = paged_to_dense(v_cache, block_table, seq_lens, layout)
    kk, vv = gather_kv(dense_k, dense_v, idx)
    pools = [c if layout == "NHD" else c.transpose(1, 2) for c in (k_cache, v_cache)]
    block_size = pools[0].shape[1]
    new = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        kept = int((idx[b, 0] >= 0).sum())
        new[b] = kept
        for t in range(kept):
            blk, off = int(block_table[b, t // block_size]), t % block_size
            pools[0][blk, off] = kk[b, :, t]
            pools[1][blk, off] = vv[b, :, t]
    return new


def streaming(
    k: torch.Tensor,
    v: torch.Tensor,
    budget: int,
    *,
    n_sink: int = 4,
    seq_lens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """StreamingLLM compression: sinks + the most recent tokens."""
    batch, heads, length, _ = k.shape
    idx = streaming_indices(batch, heads, length, budget, n_sink=n_sink, seq_lens=seq_lens)
    out_k, out_v = gather_kv(k, v, idx)
    return out_k, out_v, idx


# =====================================================================================
# Decode-time eviction (StreamingLLM ring cache, RoPE re-rotation, H2O heavy hitters).
# Functional versions of the in-place ops of kvprune_cuda.decode: they return new
# tensors instead of mutating. Cache layout: k, v [B,Hkv,C,D]; slot_pos int32
# [B,Hkv,C] (-1 = empty); seq_lens int32 [B] tokens seen; h2o_scores fp32 [B,Hkv,C].
# =====================================================================================

ROPE_LAYOUTS = ("neox", "gptj")


def rope_inv_freq(
    rotary_dim: int, theta: float = 10000.0, inv_freq: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """float64 [rotary_dim // 2]: theta^(-2i/rotary_dim), or the given inv_freq."""
    if inv_freq is not None:
        return inv_freq.double().cpu()
    return theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def _rope_pairs(head_dim: int, rotary_dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dim indices (x, y) of each rotated pair."""
    half = rotary_dim // 2
    i = torch.arange(half)
    if layout == "neox":
        return i, i + half
    return 2 * i, 2 * i + 1


def rope_rotate(
    x: torch.Tensor,
    delta: torch.Tensor,
    *,
    theta: float = 10000.0,
    rotary_dim: Optional[int] = None,
    layout: str = "neox",
    inv_freq: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rotates x [..., D] by `delta` positions (broadcast over x[..., 0]), in float64.

    Pair (a, b) at frequency f: a' = a cos(delta f) - b sin(delta f), b' = b cos + a sin.
    Applied to an un-rotated key with delta = position, this is RoPE itself.
    Dims >= rotary_dim are unchanged. Returns float64.
    """
    head_dim = x.shape[-1]
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    freq = rope_inv_freq(rotary_dim, theta, inv_freq)
    angle = delta.double().cpu()[..., None] * freq  # [..., rotary_dim/2]
    cos, sin = torch.cos(angle), torch.sin(angle)
    out = x.double().cpu().clone()
    ia, ib = _rope_pairs(head_dim, rotary_dim, layout)
    a, b = out[..., ia].clone(), out[..., ib].clone()
    out[..., ia] = a * cos - b * sin
    out[..., ib] = b * cos + a * sin
    return out


def rerotate_keys(
    k: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    *,
    theta: float = 10000.0,
    rotary_dim: Optional[int] = None,
    layout: str = "neox",
    inv_freq: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """k [B,H,N,D] rotated from old_pos to new_pos (int, broadcastable to [B,H,N]).

    Entries with a negative old or new position are copied unchanged. Returns k's dtype.
    """
    shape = k.shape[:3]
    old = old_pos.expand(shape).long().cpu()
    new = new_pos.expand(shape).long().cpu()
    valid = (old >= 0) & (new >= 0)
    rotated = rope_rotate(k, torch.where(valid, new - old, 0), theta=theta,
                          rotary_dim=rotary_dim, layout=layout, inv_freq=inv_freq)
    return torch.where(valid[..., None], rotated, k.double().cpu()).to(k.dtype)


def gather_kv_rope(
    k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, *, theta: float = 10000.0,
    rotary_dim: Optional[int] = None, layout: str = "neox", inv_freq: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_kv, then each kept key re-rotated from position idx[b,h,t] to position t."""
    out_k, out_v = gather_kv(k, v, idx)
    target = torch.arange(idx.shape[2], dtype=torch.int32).expand(idx.shape)
    out_k = rerotate_keys(out_k, idx.cpu(), target, theta=theta, rotary_dim=rotary_dim,
                          layout=layout, inv_freq=inv_freq)
    return out_k, out_v


def append_slot(pos: int, capacity: int, n_sink: int, slot: Optional[int] = None) -> int:
    """Slot of stream position `pos`: in order below capacity, then the ring (or `slot`)."""
    if pos < capacity:
        return pos
    if slot is not None:
        return slot
    return n_sink + (pos - n_sink) % (capacity - n_sink)


def streaming_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    n_sink: int = 4,
    slots: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Appends tokens one at a time (so later tokens of a call overwrite earlier ones).

    Returns new (k_cache, v_cache, slot_pos, seq_lens). Slots outside [0, C) drop the token.
    """
    k_cache, v_cache = k_cache.cpu().clone(), v_cache.cpu().clone()
    slot_pos, seq_lens = slot_pos.cpu().clone(), seq_lens.cpu().clone()
    batch, heads, capacity, _ = k_cache.shape
    for b in range(batch):
        n = int(seq_lens[b])
        for h in range(heads):
            for t in range(k_new.shape[2]):
                given = None if slots is None else int(slots[b, h, t])
                s = append_slot(n + t, capacity, n_sink, given)
                if not 0 <= s < capacity:
                    continue
                k_cache[b, h, s] = k_new[b, h, t].cpu()
                v_cache[b, h, s] = v_new[b, h, t].cpu()
                slot_pos[b, h, s] = n + t
        seq_lens[b] = n + k_new.shape[2]
    return k_cache, v_cache, slot_pos, seq_lens


def streaming_cache_positions(length: int, capacity: int, n_sink: int) -> list[int]:
    """Positions a StreamingLLM cache holds after `length` tokens: sinks + the last C-S."""
    if length <= capacity:
        return list(range(length))
    return list(range(n_sink)) + list(range(length - (capacity - n_sink), length))


def decode_scores(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    slot_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    h2o_scores: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    gqa: str = "mean",
    v_cache: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Decode attention over the cache. Returns (new h2o_scores fp32 or None, out or None).

    Query t of row b sits at position seq_lens[b] - T + t and sees slot s of its KV head
    iff 0 <= slot_pos <= that position. probs = softmax over visible slots (float64);
    scores[g] += reduce_{h in g} sum_t probs[h,t]; out[h,t] = probs[h,t] @ v.
    """
    batch, q_heads, num_q, head_dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    added = torch.zeros(batch, kv_heads, capacity, dtype=torch.float64)
    out = torch.zeros(batch, q_heads, num_q, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        for h in range(q_heads):
            g = h // group
            pos = slot_pos[b, g].long().cpu()
            qpos = torch.arange(n - num_q, n)[:, None]  # [T, 1]
            visible = (pos[None, :] >= 0) & (pos[None, :] <= qpos)  # [T, C]
            logits = q[b, h].double().cpu() @ k_cache[b, g].double().cpu().T * scale
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            probs = torch.nan_to_num(probs, nan=0.0)
            if v_cache is not None:
                out[b, h] = probs @ v_cache[b, g].double().cpu()
            summed = probs.sum(dim=0)
            if gqa == "max":
                added[b, g] = summed if h % group == 0 else torch.maximum(added[b, g], summed)
            else:
                added[b, g] += summed / (group if gqa == "mean" else 1)
    new_scores = None if h2o_scores is None else (h2o_scores.double().cpu() + added).float()
    return new_scores, (out.to(q.dtype) if v_cache is not None else None)


def h2o_evict(
    h2o_scores: torch.Tensor,
    slot_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int = 4,
    recent: int = 32,
    num: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """H2O slot choice for the next `num` tokens. Returns (h2o_scores, slot_pos, next_slot).

    Position p = n + t below capacity keeps slot p. Beyond, evict: holes (slot_pos < 0,
    slot < n) first by slot, then the lowest score among slots whose position lies in
    [n_sink, n - recent), ties to the lowest position; the evicted slot gets
    slot_pos = -1 and score 0. The evicted slots are listed in ascending order.
    """
    scores, pos = h2o_scores.cpu().clone(), slot_pos.cpu().clone()
    batch, heads, capacity = scores.shape
    nxt = torch.full((batch, heads, num), -1, dtype=torch.int32)
    for b in range(batch):
        n = int(seq_lens[b])
        for h in range(heads):
            chosen: list[int] = []
            for t in range(num):
                if n + t < capacity:
                    nxt[b, h, t] = n + t
                    continue
                keys = []
                for s in range(capacity):
                    sp = int(pos[b, h, s])
                    if s in chosen:
                        continue
                    if sp < 0 and s < n:
                        keys.append(((0, s, 0), s))
                    elif sp >= 0 and n_sink <= sp < n - recent:
                        keys.append(((1, float(scores[b, h, s]), sp), s))
                if keys:
                    s = min(keys)[1]
                    chosen.append(s)
                    nxt[b, h, t] = s
                    pos[b, h, s] = -1
                    scores[b, h, s] = 0.0
            # evicted slots are listed in ascending slot order, -1 (none found) last
            first = min(max(capacity - n, 0), num)
            chosen_sorted = sorted(chosen) + [-1] * (num - first - len(chosen))
            nxt[b, h, first:] = torch.tensor(chosen_sorted, dtype=torch.int32)
    return scores, pos, nxt


def periodic_decode(
    held: list[int],
    steps: int,
    *,
    max_held: int,
    interval: int,
    n_sink: int = 4,
    window: int = 32,
    pick=None,
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Periodic decode-time compression, one generated token per step.

    `held`: positions the cache holds after the prompt (its last is the prompt's last).
    Decode step g = 1..steps writes the next position; after it, when g is a multiple of
    `interval` and more than `target = max(max_held, n_sink + window)` positions are held,
    the cache keeps `target` of them: `pick(held, target)` (default StreamingLLM: the first
    `n_sink` held and the most recent). Returns the positions held at the end and one
    (g, held before, held after) per compression.
    """
    held = list(held)
    target = max(max_held, n_sink + window)
    if pick is None:
        pick = lambda h, t: h[:n_sink] + h[len(h) - (t - n_sink):]  # noqa: E731
    events = []
    for g in range(1, steps + 1):
        held.append(held[-1] + 1)
        if g % interval == 0 and len(held) > target:
            before = len(held)
            held = sorted(pick(held, target))
            events.append((g, before, len(held)))
    return held, events


def periodic_h2o_decode(
    queries: torch.Tensor,
    keys: torch.Tensor,
    held: list[int],
    *,
    max_held: int,
    interval: int,
    n_sink: int = 4,
    window: int = 32,
    scale: Optional[float] = None,
    gqa: str = "mean",
) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """Periodic decode-time H2O of one sequence, one generated token per step.

    `queries` [Hq, T, D] and `keys` [Hkv, T, D] are the post-RoPE queries and keys of every
    position 0..T-1; `held`: the positions the cache holds after the prompt (every KV head
    the same; its last is the prompt's last). Decode step g = 1..T-1-held[-1] writes
    position p = held[-1] + g; its query's softmax over the KV head's held keys (p included)
    adds to each held key's score, the group's query heads combined by `gqa`; the prompt's
    queries add nothing. After step g, when g is a multiple of `interval` and more than
    `target = max(max_held, n_sink + window)` positions are held, each KV head keeps its
    first `n_sink` and last `window` held positions and the highest-scored others (equal
    scores: the lower position), `target` in all; scores stay with their positions.
    Returns the held positions per KV head and one (g, held before, held after) per
    compression.
    """
    q_heads, length, head_dim = queries.shape
    kv_heads = keys.shape[0]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    target = max(max_held, n_sink + window)
    per_head = [list(held) for _ in range(kv_heads)]
    score = [dict.fromkeys(held, 0.0) for _ in range(kv_heads)]
    events = []
    for g, p in enumerate(range(held[-1] + 1, length), start=1):
        for kv in range(kv_heads):
            per_head[kv].append(p)
            score[kv][p] = 0.0
            positions = per_head[kv]
            probs = []
            for h in range(kv * group, (kv + 1) * group):
                logits = keys[kv, positions].double() @ queries[h, p].double() * scale
                probs.append(torch.softmax(logits, dim=0))
            stacked = torch.stack(probs)
            added = (stacked.amax(0) if gqa == "max" else
                     stacked.mean(0) if gqa == "mean" else stacked.sum(0))
            for pos, a in zip(positions, added.tolist()):
                score[kv][pos] += a
        if g % interval == 0 and len(per_head[0]) > target:
            before = len(per_head[0])
            for kv in range(kv_heads):
                positions = per_head[kv]
                middle = positions[n_sink : len(positions) - window]
                best = sorted(middle, key=lambda pos: (-score[kv][pos], pos))
                kept = set(positions[:n_sink] + positions[len(positions) - window :]
                           + best[: target - n_sink - window])
                per_head[kv] = [pos for pos in positions if pos in kept]
                score[kv] = {pos: score[kv][pos] for pos in per_head[kv]}
            events.append((g, before, target))
    return per_head, events
