"""Decode-time eviction benchmark: per-step cost and memory over a long stream.

    python bench/bench_decode.py                 # per-step table, CPU (and CUDA if a GPU is visible)
    python bench/bench_decode.py --stream        # 100k-token stream through a capacity-1024 cache (CPU)

Per-step (one layer, one decode token, B=1, Hq=32, Hkv=8, D=128, bf16 by default):
  * ``streaming``   kp.streaming_append + kp.decode_scores(v_cache=...) (attention over C slots)
  * ``h2o``         kp.streaming_append(slots=) + kp.decode_scores(h2o_scores, v_cache) + kp.h2o_evict
  * ``h2o_graph``   (CUDA) the same step captured once in a CUDA graph and replayed: the
                    layer-step without its launch overheads
  * ``h2o_torch``   the same H2O step in plain PyTorch (GQA-native matmuls, fp32 softmax,
                    masked argmin, index_copy): what a user would write instead
  * dense full-cache steps: write the token into a preallocated [B,Hkv,N,D] cache and attend
    over all N+1 tokens, written three ways in plain PyTorch (no repeated K in any):
      ``full_matmul``    GQA as a [B,Hkv,G,D] view, matmul for the logits, fp32 softmax, matmul with V
      ``full_sdpa_view`` F.scaled_dot_product_attention on that [B,Hkv,G,D] view (G queries per KV head)
      ``full_sdpa_gqa``  F.scaled_dot_product_attention(q [B,Hq,1,D], enable_gqa=True)
    Which is fastest depends on the CPU and dtype (bf16 matmul is slow on some, SDPA's GQA path
    on others), so the baseline ``full_best`` is the fastest of full_matmul and full_sdpa_view
    in this run; speedups are against it, and against full_sdpa_gqa in a second column.
The cache sizes are reported next to the times (dense memory grows with N, ours stays at C).

--stream: appends a 100k-token stream one token per step to a capacity-1024 StreamingLLM cache
(optionally with decode attention each step), prints the process RSS at 1k, 10k and 100k tokens,
then checks the cache equals "sinks + last C - S tokens" of the stream (kvprune_cuda.reference).
Tokens are rows of a fixed table indexed by position, so the check needs no copy of the stream.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvprune_cuda as kp  # noqa: E402
from kvprune_cuda import reference as ref  # noqa: E402
from common import rss_mib, time_cpu_interleaved, time_cuda  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- per-step ---------------------------------------------------------------------------


class Steps:
    """Prepared state and one-step closures for every variant."""

    def __init__(self, B, Hq, Hkv, D, C, N, dtype, device, n_sink=4, recent=32):
        self.n_sink, self.recent = n_sink, recent
        g = torch.Generator().manual_seed(0)
        self.q = torch.randn(B, Hq, 1, D, generator=g).to(dtype).to(device)
        self.k_new = torch.randn(B, Hkv, 1, D, generator=g).to(dtype).to(device)
        self.v_new = torch.randn(B, Hkv, 1, D, generator=g).to(dtype).to(device)
        # A full cache of capacity C that has seen N tokens already (steady state).
        c = kp.DecodeCache.empty(B, Hkv, C, D, dtype=dtype, device=device, h2o=True)
        c.k.copy_(torch.randn(B, Hkv, C, D, generator=g).to(dtype))
        c.v.copy_(torch.randn(B, Hkv, C, D, generator=g).to(dtype))
        c.slot_pos.copy_(torch.tensor(ref.streaming_cache_positions(N, C, n_sink), dtype=torch.int32)
                         .expand(B, Hkv, C))
        c.seq_lens.fill_(N)
        self.c = c
        self.ring = kp.DecodeCache(c.k.clone(), c.v.clone(), c.slot_pos.clone(), c.seq_lens.clone(), None)
        self.next_slot = kp.h2o_evict(c.h2o_scores, c.slot_pos, c.seq_lens, n_sink=n_sink, recent=recent)
        # torch peer state (its own copy)
        self.t_k, self.t_v = c.k.clone(), c.v.clone()
        self.t_pos, self.t_scores = c.slot_pos.clone().long(), c.h2o_scores.clone()
        self.t_len = N
        self.t_next = self.next_slot.clone().long()
        # dense baseline: [B,Hkv,N+steps,D] preallocated
        self.full_k = torch.randn(B, Hkv, N + 4096, D, generator=g).to(dtype).to(device)
        self.full_v = torch.randn(B, Hkv, N + 4096, D, generator=g).to(dtype).to(device)
        self.N = N
        self.groups = Hq // Hkv

    def streaming(self):
        r = self.ring
        r.seq_lens.fill_(self.N)  # keep the step shape fixed across repeats
        kp.streaming_append(r.k, r.v, r.slot_pos, r.seq_lens, self.k_new, self.v_new, n_sink=self.n_sink)
        return kp.decode_scores(self.q, r.k, r.slot_pos, r.seq_lens, v_cache=r.v)

    def h2o(self):
        c = self.c
        kp.streaming_append(c.k, c.v, c.slot_pos, c.seq_lens, self.k_new, self.v_new,
                            n_sink=self.n_sink, slots=self.next_slot)
        out = kp.decode_scores(self.q, c.k, c.slot_pos, c.seq_lens, c.h2o_scores, v_cache=c.v)
        self.next_slot.copy_(kp.h2o_evict(c.h2o_scores, c.slot_pos, c.seq_lens,
                                          n_sink=self.n_sink, recent=self.recent))
        return out

    def h2o_graph(self):
        """The h2o step captured once in a CUDA graph (made on first use), replayed."""
        if getattr(self, "_graph", None) is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture
                self.h2o()
            torch.cuda.current_stream().wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._graph_out = self.h2o()
        self._graph.replay()
        return self._graph_out

    def h2o_torch(self):
        B, Hkv, C, D = self.t_k.shape
        G = self.groups
        s = self.t_next[:, :, 0]  # [B,Hkv]
        bi = torch.arange(B, device=s.device)[:, None]
        hi = torch.arange(Hkv, device=s.device)[None, :]
        self.t_k[bi, hi, s] = self.k_new[:, :, 0]
        self.t_v[bi, hi, s] = self.v_new[:, :, 0]
        self.t_pos[bi, hi, s] = self.t_len
        self.t_len += 1
        q = self.q.view(B, Hkv, G, D)  # GQA-native: [B,Hkv,G,D] @ [B,Hkv,D,C]
        logits = torch.matmul(q, self.t_k.transpose(-1, -2)).float() / math.sqrt(D)
        logits = logits.masked_fill((self.t_pos < 0)[:, :, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs.to(self.t_v.dtype), self.t_v)
        self.t_scores += probs.mean(dim=2)
        protect = (self.t_pos < self.n_sink) | (self.t_pos >= self.t_len - self.recent)
        victim = self.t_scores.masked_fill(protect, float("inf")).argmin(dim=-1)  # [B,Hkv]
        self.t_scores[bi, hi, victim] = 0
        self.t_pos[bi, hi, victim] = -1
        self.t_next = victim[..., None]
        return out

    def _append_dense(self):
        """Writes the new token at position N of the dense cache; returns K, V [B,Hkv,N+1,D]."""
        n = self.N
        self.full_k[:, :, n:n + 1] = self.k_new
        self.full_v[:, :, n:n + 1] = self.v_new
        return self.full_k[:, :, :n + 1], self.full_v[:, :, :n + 1]

    def full_matmul(self):
        k, v = self._append_dense()
        B, Hkv, _, D = k.shape
        q = self.q.view(B, Hkv, self.groups, D)  # [B,Hkv,G,D]: a KV head's G query heads as rows
        logits = torch.matmul(q, k.transpose(-1, -2))  # [B,Hkv,G,N+1]
        probs = torch.softmax(logits.float() * (1.0 / math.sqrt(D)), dim=-1).to(q.dtype)
        return torch.matmul(probs, v).view(B, Hkv * self.groups, 1, D)  # [B,Hq,1,D]

    def full_sdpa_view(self):
        k, v = self._append_dense()
        B, Hkv, _, D = k.shape
        q = self.q.view(B, Hkv, self.groups, D)
        return F.scaled_dot_product_attention(q, k, v).view(B, Hkv * self.groups, 1, D)

    def full_sdpa_gqa(self):
        k, v = self._append_dense()
        return F.scaled_dot_product_attention(self.q, k, v, enable_gqa=True)


def per_step(args, device):
    dtype = DTYPES[args.dtype]
    B, Hq, Hkv, D, C = 1, 32, 8, 128, args.capacity
    esize = torch.tensor([], dtype=dtype).element_size()
    print(f"\n## per-step cost, {device.type}, B={B} Hq={Hq} Hkv={Hkv} D={D} C={C} {args.dtype}, "
          f"threads={torch.get_num_threads()}")
    print("| context N | variant | ms/step | KV bytes/layer | vs full_best | vs full_sdpa_gqa |")
    print("|---|---|---|---|---|---|")
    dense = ["full_matmul", "full_sdpa_view", "full_sdpa_gqa"]
    for N in args.contexts:
        st = Steps(B, Hq, Hkv, D, C, N, dtype, device)
        names = ["streaming", "h2o"] + (["h2o_graph"] if device.type == "cuda" else [])
        names += ["h2o_torch"] + dense
        fns = [getattr(st, n) for n in names]
        want = st.full_sdpa_gqa().float()  # the dense rows compute the same attention
        err = max((getattr(st, n)().float() - want).abs().max().item() for n in dense[:2])
        if device.type == "cuda":
            res = [time_cuda(fn, repeats=args.repeats, warmup=5) for fn in fns]
        else:
            res = time_cpu_interleaved(fns, repeats=args.repeats, warmup=3)
        by = {name: r["median_ms"] for name, r in zip(names, res)}
        best = min(dense[:2], key=by.get)
        for name, r in zip(names, res):
            mem = 2 * B * Hkv * D * esize * ((N + 1) if name.startswith("full") else C)
            label = f"{name} (= full_best)" if name == best else name
            print(f"| {N} | {label} | {r['median_ms']:.3f} | {mem / 2**20:.1f} MiB | "
                  f"{by[best] / r['median_ms']:.2f}x | {by['full_sdpa_gqa'] / r['median_ms']:.2f}x |")
        print(f"(N={N}: dense outputs agree to {err:.1e}; load average {os.getloadavg()[0]:.2f})")


# ---- long stream ------------------------------------------------------------------------


def stream(args):
    dtype = DTYPES[args.dtype]
    B, Hq, Hkv, D, C, S = 1, 32, 8, 128, args.capacity, 4
    table_rows = 4099  # token(p) = table[p % 4099]: deterministic, no copy of the stream
    g = torch.Generator().manual_seed(1)
    table_k = torch.randn(table_rows, B, Hkv, 1, D, generator=g).to(dtype)
    table_v = torch.randn(table_rows, B, Hkv, 1, D, generator=g).to(dtype)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    cache = kp.DecodeCache.empty(B, Hkv, C, D, dtype=dtype, device="cpu", h2o=args.attn)
    marks = {1_000, 10_000, 100_000, args.tokens}
    print(f"\n## stream: {args.tokens} tokens through a capacity-{C} StreamingLLM cache (CPU, "
          f"{args.dtype}, Hkv={Hkv}, D={D}, n_sink={S}, attention each step: {args.attn})")
    print(f"cache bytes: {2 * B * Hkv * C * D * table_k.element_size() / 2**20:.1f} MiB "
          f"(a dense cache at {args.tokens} tokens: "
          f"{2 * B * Hkv * args.tokens * D * table_k.element_size() / 2**20:.0f} MiB)")
    print("| tokens | RSS MiB | us/token (since last mark) |")
    print("|---|---|---|")
    t0, last = time.perf_counter(), 0
    for p in range(args.tokens):
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, table_k[p % table_rows],
                            table_v[p % table_rows], n_sink=S)
        if args.attn:
            kp.decode_scores(q, cache.k, cache.slot_pos, cache.seq_lens, cache.h2o_scores, v_cache=cache.v)
        if p + 1 in marks:
            now = time.perf_counter()
            print(f"| {p + 1} | {rss_mib():.1f} | {(now - t0) / (p + 1 - last) * 1e6:.1f} |")
            t0, last = now, p + 1
    # check against the reference: sinks + the last C - S positions, each with its own token
    want_pos = ref.streaming_cache_positions(args.tokens, C, S)
    ok = cache.seq_lens.tolist() == [args.tokens] * B
    for h in range(Hkv):
        pos = cache.slot_pos[0, h].long()
        ok &= sorted(pos.tolist()) == want_pos
        ok &= torch.equal(cache.k[0, h], table_k[pos % table_rows, 0, h, 0])
        ok &= torch.equal(cache.v[0, h], table_v[pos % table_rows, 0, h, 0])
    # and the op equals the reference append for a final few steps (incl. multi-token, wrapping)
    state = [t.clone() for t in (cache.k, cache.v, cache.slot_pos, cache.seq_lens)]
    for t in (1, 3, C):
        k_new = torch.randn(B, Hkv, t, D, generator=g).to(dtype)
        kp.streaming_append(cache.k, cache.v, cache.slot_pos, cache.seq_lens, k_new, k_new, n_sink=S)
        state = list(ref.streaming_append(*state, k_new, k_new, n_sink=S))
    ok &= all(torch.equal(a, b) for a, b in zip((cache.k, cache.v, cache.slot_pos, cache.seq_lens), state))
    print(f"cache matches reference (sinks + last {C - S} tokens): {ok}")
    if not ok:
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream", action="store_true", help="run the long-stream memory test instead")
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--attn", action="store_true", help="--stream: also run decode_scores each step")
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    args = ap.parse_args()
    print(f"kvprune_cuda {kp.build_info()}, torch {torch.__version__}")
    if args.stream:
        stream(args)
        return
    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all") and torch.cuda.is_available() and kp.build_info()["cuda"]:
        devices.append(torch.device("cuda"))
    with torch.no_grad():
        for device in devices:
            per_step(args, device)


if __name__ == "__main__":
    main()
