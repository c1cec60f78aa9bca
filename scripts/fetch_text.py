#!/usr/bin/env python3
"""Fetches six public-domain Jane Austen novels from Debian's ``r-cran-janeaustenr`` package.

The package stores the novels as character vectors (one element per line of text) in R's
lazy-load database ``data/Rdata.rdb`` with its index ``data/Rdata.rdx``. The index is a
gzip-compressed serialised R list ``variables = {name: (offset, length)}``; each object in
the ``.rdb`` is a 4-byte big-endian length followed by a zlib stream of a serialised R object.
``rdata`` (PyPI) parses the serialised objects. No R installation is needed.

Steps: ``apt-get download r-cran-janeaustenr`` (the .deb only; nothing is installed),
``dpkg-deb -x``, decode, write ``.cache/text/<novel>.txt`` (UTF-8, one line per R element).
Re-running is a no-op once the files exist. Usage::

    python scripts/fetch_text.py          # -> .cache/text/{emma,persuasion,...}.txt
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import shutil
import struct
import subprocess
import tempfile
import warnings
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
          "sensesensibility")


def _parse_r(raw: bytes):
    import rdata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS"
        return rdata.conversion.convert(rdata.parser.parse_data(raw))


def read_lazyload(data_dir: Path) -> dict[str, list[str]]:
    """{object name: lines} from an R package's data/Rdata.{rdx,rdb} lazy-load database."""
    index = _parse_r(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    if not bool(index["compressed"][0]):
        raise RuntimeError("Rdata.rdx: uncompressed lazy-load databases are not supported")
    db = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (off, length) in index["variables"].items():
        blob = db[int(off): int(off) + int(length)]
        n = struct.unpack(">I", blob[:4])[0]
        raw = zlib.decompress(blob[4:])
        if len(raw) != n:
            raise RuntimeError(f"{name}: {len(raw)} bytes decoded, header says {n}")
        out[str(name)] = [str(s) for s in _parse_r(raw)]
    return out


def fetch(cache: Path) -> Path:
    out = cache / "text"
    if all((out / f"{n}.txt").is_file() for n in NOVELS):
        print(f"[fetch_text] cached {out}")
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=tmp, check=True)
        deb = next(tmp.glob("r-cran-janeaustenr_*.deb"))
        print(f"[fetch_text] {deb.name} sha256 {hashlib.sha256(deb.read_bytes()).hexdigest()}")
        shutil.copy(deb, out / deb.name)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "x")], check=True)
        data_dir = next((tmp / "x").glob("usr/lib/R/site-library/janeaustenr/data"))
        novels = read_lazyload(data_dir)
    missing = set(NOVELS) - set(novels)
    if missing:
        raise RuntimeError(f"r-cran-janeaustenr: novels missing: {sorted(missing)}")
    for name in NOVELS:
        text = "\n".join(novels[name]) + "\n"
        (out / f"{name}.txt").write_text(text, encoding="utf-8")
        print(f"[fetch_text] {name}: {len(novels[name])} lines, {len(text)} chars")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=CACHE, help="cache folder (default: .cache/)")
    fetch(ap.parse_args().cache)


if __name__ == "__main__":
    main()
