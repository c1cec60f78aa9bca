"""The compression rule the scheduler and the workers share.

Both sides decide, from the same scheduler output, which requests are compressed after
their prefill step and to how many tokens, so no message passes between them: a request
is compressed when one step computes its whole prompt from an empty cache (no prefix-cache
hit, no chunking) and the policy keeps fewer tokens than the prompt holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Union

from kvprune_cuda.hf import resolve_budget

POLICIES = ("full", "snapkv", "streaming")
CONFIG_KEY = "kvprune"  # the entry of vLLM's additional_config that holds a Policy


@dataclass(frozen=True)
class Policy:
    """What to keep after a request's prefill (the arguments of ``kp.vllm.engine_args``)."""

    policy: str = "snapkv"
    budget: Union[int, float] = 0.2
    n_sink: int = 4
    window: int = 32
    kernel_size: int = 7
    pool: str = "max"
    gqa: str = "mean"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {self.policy!r}")
        resolve_budget(self.budget, 1)
        for name in ("n_sink", "window", "kernel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
        if self.policy == "snapkv" and self.window < 1:
            raise ValueError("window: snapkv votes with the last window queries; needs >= 1")
        if self.pool not in ("max", "avg"):
            raise ValueError(f"pool: expected 'max' or 'avg', got {self.pool!r}")
        if self.gqa not in ("mean", "max", "sum"):
            raise ValueError(f"gqa: expected 'mean', 'max' or 'sum', got {self.gqa!r}")

    def to_config(self) -> dict:
        return asdict(self)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "Policy":
        extra = getattr(vllm_config, "additional_config", None) or {}
        if CONFIG_KEY not in extra:
            raise ValueError("additional_config: no 'kvprune' entry; build the engine "
                             "arguments with kvprune_cuda.vllm.engine_args()")
        return cls(**extra[CONFIG_KEY])

    def min_keep(self) -> int:
        """The fewest tokens the policy keeps: the sinks and the window (kp.hf's rule)."""
        return self.n_sink + self.window + (1 if self.policy == "streaming" and self.window == 0
                                            else 0)

    def kept_tokens(self, prompt_len: int) -> Optional[int]:
        """Tokens a prompt of ``prompt_len`` keeps, or None when nothing is evicted."""
        if self.policy == "full" or prompt_len < 1:
            return None
        kept = max(resolve_budget(self.budget, prompt_len), self.min_keep())
        return kept if kept < prompt_len else None

    def compresses(self, num_computed: int, num_scheduled: int, prompt_len: int) -> Optional[int]:
        """Tokens kept by a request whose step computes ``num_scheduled`` tokens from
        ``num_computed``; None when this step does not compress it."""
        if num_computed != 0 or num_scheduled != prompt_len:
            return None
        return self.kept_tokens(prompt_len)
