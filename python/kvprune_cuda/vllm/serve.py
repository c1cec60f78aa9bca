"""vLLM's OpenAI-compatible server with kvprune_cuda's compression, in one command::

    python -m kvprune_cuda.vllm.serve MODEL --kv-policy snapkv --kv-budget 0.16 [vLLM server args]

The ``--kv-*`` options are :func:`kvprune_cuda.vllm.engine_args`'s; every other argument goes
to vLLM's own server (``vllm.entrypoints.openai.api_server``) unchanged, with the flags of
:func:`kvprune_cuda.vllm.server_args` added. vLLM's defaults stand (torch.compile, the engine
core in a process of its own, chunked prefill, prefix caching); a setting kvprune_cuda.vllm
does not support stops the server at start with an error naming it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from kvprune_cuda.vllm import server_args


def _budget(text: str):
    """A budget as given: "0.16" a fraction, "512" a token count."""
    return float(text) if any(c in text for c in ".eE") else int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvprune_cuda.vllm.serve",
        description="vLLM's OpenAI server with kvprune_cuda KV-cache compression; arguments "
                    "other than these go to vLLM's server.")
    p.add_argument("model", help="the model to serve (vLLM's --model)")
    p.add_argument("--kv-policy", default="snapkv", help="full | snapkv | streaming")
    p.add_argument("--kv-budget", type=_budget, default=None,
                   help="kept share of each prompt (0.16) or a token count (512)")
    p.add_argument("--kv-n-sink", type=int, default=None)
    p.add_argument("--kv-window", type=int, default=None)
    p.add_argument("--kv-kernel-size", type=int, default=None)
    p.add_argument("--kv-pool", default=None, help="max | avg")
    p.add_argument("--kv-gqa", default=None, help="the policy's GQA reduction")
    p.add_argument("--kv-decode", default=None, help="decode-time rule: streaming | snapkv | h2o")
    p.add_argument("--kv-max-held", type=int, default=None)
    p.add_argument("--kv-interval", type=int, default=None)
    return p


def vllm_argv(argv: Sequence[str]) -> list:
    """vLLM's server arguments for this command's ``argv``: ``--model MODEL``, the arguments
    this command does not know, and :func:`~kvprune_cuda.vllm.server_args`'s flags."""
    ours, rest = parser().parse_known_args(list(argv))
    flags = server_args(ours.kv_policy, ours.kv_budget, n_sink=ours.kv_n_sink,
                        window=ours.kv_window, kernel_size=ours.kv_kernel_size,
                        pool=ours.kv_pool, gqa=ours.kv_gqa, decode=ours.kv_decode,
                        max_held=ours.kv_max_held, interval=ours.kv_interval)
    for flag in ("--scheduler-cls", "--worker-cls", "--additional-config"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise SystemExit(f"{flag}: set by kvprune_cuda.vllm.serve; leave it out")
    return ["--model", ours.model, *rest, *flags]


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = vllm_argv(sys.argv[1:] if argv is None else argv)
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv = [sys.argv[0], *args]
    serve()


if __name__ == "__main__":
    main()
