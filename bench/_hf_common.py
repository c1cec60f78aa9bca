"""Shared pieces of the real-model evaluations (eval_passkey.py, eval_ppl.py, examples).

Model and text come from the project's fetch scripts (``scripts/fetch_model.py``,
``scripts/fetch_text.py``), cached under ``.cache/`` -- nothing is downloaded by hand.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import fetch_model  # noqa: E402
import fetch_text  # noqa: E402


def load_model(dtype: str = "bfloat16"):
    """(model, tokenizer) of the cached HF copy of Qwen2.5-Coder-0.5B-Instruct (fetches it if needed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_model.fetch_gguf(fetch_model.CACHE)
    path = fetch_model.convert_to_hf(gguf, fetch_model.CACHE)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    return model, tok


def load_novels() -> dict[str, str]:
    d = fetch_text.fetch(fetch_text.CACHE)
    return {n: (d / f"{n}.txt").read_text(encoding="utf-8") for n in fetch_text.NOVELS}


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"transformers {__import__('transformers').__version__}")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def threads() -> int:
    return int(os.environ.get("KVPRUNE_THREADS", "2"))
