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
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Optional, Sequence

from kvprune_cuda.vllm import server_args


def _budget(text: str):
    """A budget as given: "512" a token count, "0.16" a fraction."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvprune_cuda.vllm.serve",
        description="vLLM's OpenAI server with kvprune_cuda KV-cache compression; arguments "
                    "other than these go to vLLM's server.")
    p.add_argument("--kv-policy", default="snapkv", help="full | snapkv | streaming")
    p.add_argument("--kv-budget", type=_budget, default=None,
                   help="kept share of each prompt (0.16) or a token count (512)")
    p.add_argument("--kv-n-sink", type=int, default=None)
    p.add_argument("--kv-window", type=int, default=None)
    p.add_argument("--kv-kernel-size", type=int, default=None)
    p.add_argument("--kv-pool-shift", type=int, default=None)
    p.add_argument("--kv-pool", default=None, help="max | avg")
    p.add_argument("--kv-gqa", default=None, help="the policy's GQA reduction")
    p.add_argument("--kv-decode", default=None, help="decode-time rule: streaming | snapkv | h2o")
    p.add_argument("--kv-max-held", type=int, default=None)
    p.add_argument("--kv-interval", type=int, default=None)
    p.add_argument("--kv-prefill-max-held", type=int, default=None,
                   help="bounded prefill: compress a prompt back to this many tokens after "
                        "every chunk that leaves more (prompts longer than the KV pool)")
    p.add_argument("--kv-prefill-signal", default=None,
                   help="what ranks a bounded prefill's held tokens: max (default) | far | window "
                        "(reconstruct: kp.hf only, refused)")
    p.add_argument("--kv-prefill-novelty", type=float, default=None,
                   help="bounded prefill: the share of each compression's kept tokens that "
                        "goes first to each head's most novel keys (0 default; max or far)")
    return p


def vllm_argv(argv: Sequence[str]) -> list:
    """vLLM's server arguments for this command's ``argv`` (MODEL first): ``--model MODEL``,
    the arguments this command does not know, and :func:`~kvprune_cuda.vllm.server_args`'s
    flags."""
    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m kvprune_cuda.vllm.serve MODEL [--kv-* options] "
                         "[vLLM server arguments]: MODEL comes first")
    model = argv.pop(0)
    ours, rest = parser().parse_known_args(argv)
    flags = server_args(ours.kv_policy, ours.kv_budget, n_sink=ours.kv_n_sink,
                        window=ours.kv_window, kernel_size=ours.kv_kernel_size,
                        pool_shift=ours.kv_pool_shift, pool=ours.kv_pool, gqa=ours.kv_gqa,
                        decode=ours.kv_decode,
                        max_held=ours.kv_max_held, interval=ours.kv_interval,
                        prefill_max_held=ours.kv_prefill_max_held,
                        prefill_signal=ours.kv_prefill_signal,
                        prefill_novelty=ours.kv_prefill_novelty)
    for flag in ("--scheduler-cls", "--worker-cls", "--additional-config"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise SystemExit(f"{flag}: set by kvprune_cuda.vllm.serve; leave it out")
    return ["--model", model, *rest, *flags]


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = vllm_argv(sys.argv[1:] if argv is None else argv)
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv = [sys.argv[0], *args]
    serve()


class ServerProcess:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server --model model
    *flags``) in a process of its own on a free port of 127.0.0.1, its output in ``log_path``:
    what the tests and benchmarks start, as an operator would. The environment is this one
    without ``VLLM_ENABLE_V1_MULTIPROCESSING`` (vLLM's default: its engine core in a process
    of its own), plus ``env``."""

    def __init__(self, model: str, flags: Sequence[str], log_path, env: Optional[dict] = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        environ = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        environ.update(env or {})
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(self.port), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=environ)

    def url(self, route: str) -> str:
        return f"http://127.0.0.1:{self.port}{route}"

    def wait_ready(self, timeout: float = 600) -> None:
        """Returns once ``/health`` answers; RuntimeError (with the log's end) if the server
        exits or is not ready in ``timeout`` seconds."""
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.text()[-4000:]}")

    def stop(self) -> int:
        """SIGINT (vLLM stops its engine core itself), then SIGKILL after 120 s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def text(self) -> str:
        """The server's output so far."""
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()


if __name__ == "__main__":
    main()
