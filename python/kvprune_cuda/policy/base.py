"""What every policy is: :class:`Policy` (options, validation, the evidence it scores by),
the budget rule (:func:`resolve_budget`) and :class:`Options`, the options an integration
passes on to every policy it builds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Optional, Union

import torch

from kvprune_cuda._args import check_int

SCOPES = ("layer", "global", "head")  # how a budget is shared: per layer, over layers, per head
GQA = ("mean", "max", "sum")
# Policy.evidence: what its score reads besides the keys
EVIDENCE = ("none",             # the keys alone (or nothing: positions)
            "window_queries",   # the last `window` post-RoPE queries of the prompt
            "attention",        # attention accumulated over every observed query (h2o)
            "reconstruction")   # maxima while the model reconstructs the context (kvzip)


def resolve_budget(budget: Union[int, float], n: int) -> int:
    """Tokens kept for a prompt of ``n`` tokens: ``round(budget * n)`` (at least 1) for a float
    in (0, 1], else the int ``budget``."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget: expected a fraction in (0, 1] or a token count, got {budget!r}")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget: a float must be a fraction in (0, 1], got {budget}")
        return max(1, int(round(budget * n)))
    if budget < 1:
        raise ValueError(f"budget: a token count must be >= 1, got {budget}")
    return int(budget)


def check_shift(shift, kernel_size: int) -> None:
    """A pool's ``pool_shift``: an int in [0, kernel_size // 2] (ValueError naming it)."""
    check_int("pool_shift", shift, 0)
    if shift > kernel_size // 2:
        raise ValueError(f"pool_shift: {shift} > kernel_size // 2 = {kernel_size // 2} (a "
                         "token's own score would leave its pool)")


@dataclass(frozen=True)
class Options:
    """The options a user gives an integration (``kp.hf.compress``, ``kp.vllm.engine_args``,
    ...), passed on as one object; None leaves a policy its own default, and a policy takes
    only those among its fields (:func:`kvprune_cuda.policy.make`). Validated by the policy
    built with them."""

    n_sink: Optional[int] = None
    window: Optional[int] = None
    kernel_size: Optional[int] = None
    pool: Optional[str] = None
    gqa: Optional[str] = None
    pool_shift: Optional[int] = None
    chunk_size: Optional[int] = None
    softmax: Optional[str] = None
    head_floor: Optional[float] = None
    novelty: Optional[float] = None
    weight: Optional[str] = None

    def given(self) -> dict:
        """The options set (not None)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Policy:
    """Keep the ``n_sink`` first and the ``window`` last tokens, plus the best-scored others,
    ``budget`` tokens in all (a fraction of the prompt in (0, 1] or a count)."""

    name: ClassVar[str] = ""
    evidence: ClassVar[str] = "none"        # one of EVIDENCE
    fixed_capacity: ClassVar[bool] = False  # kp.hf: decoding evicts, holding `budget` slots
    default_scope: ClassVar[str] = "layer"   # kp.hf.compress_context's measured default
    recorded_with: ClassVar[tuple] = ()      # the fields that shape the evidence recorded

    budget: Union[int, float] = 0.2
    n_sink: int = 4
    window: int = 32

    def __post_init__(self) -> None:
        resolve_budget(self.budget, 1)
        check_int("n_sink", self.n_sink, 0)
        check_int("window", self.window, 0)
        if isinstance(self.budget, int) and self.budget < self.min_keep:
            raise ValueError(f"budget: {self.budget} tokens < {self.min_keep}, the least policy "
                             f"{self.name!r} keeps with n_sink = {self.n_sink}, window = "
                             f"{self.window}")

    @property
    def min_keep(self) -> int:
        """The fewest tokens the policy works with: the sinks and the window."""
        return self.n_sink + self.window

    def kept_tokens(self, n: int, budget: Union[int, float, None] = None) -> int:
        """Tokens a prompt of ``n`` keeps per layer and head (``budget``: this policy's, unless
        given): ``max(resolve_budget(budget, n), min_keep)``. Above ``n`` nothing is evicted
        (a fixed-capacity policy's cache then has that many slots, filled while decoding)."""
        b = self.budget if budget is None else budget
        return max(resolve_budget(b, n), self.min_keep)

    def observed_queries(self, q_len: int) -> int:
        """How many of a forward's last ``q_len`` queries the policy needs, by its evidence:
        the last ``window`` ("window_queries"), all ("attention"), none (otherwise)."""
        if self.evidence == "window_queries":
            return min(q_len, self.window)
        return q_len if self.evidence == "attention" else 0

    def evidence_mismatch(self, recorder: "Policy") -> Optional[str]:
        """Why this policy cannot rank the evidence ``recorder`` records: "evidence" when
        their kinds differ, else the first of this policy's :attr:`recorded_with` fields
        whose value differs from ``recorder``'s; None when it can."""
        if recorder.evidence != self.evidence:
            return "evidence"
        return next((f for f in self.recorded_with
                     if getattr(recorder, f, None) != getattr(self, f)), None)

    @property
    def ranks(self) -> bool:
        """Whether the policy has scores to rank (budget scopes "global" / "head")."""
        return True

    def score(self, queries: torch.Tensor, keys: torch.Tensor, *, scale: Optional[float] = None,
              seq_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 ``[B, Hkv, n]`` scores of ``keys`` [B, Hkv, n, D] from the post-RoPE
        ``queries`` [B, Hq, q, D] the policy observed."""
        raise NotImplementedError(f"policy {self.name!r} does not score keys")

    def rank_recorded(self, recorded: torch.Tensor,
                      keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 ``[B, Hkv, n]``: the scores ranked from the evidence an integration recorded
        over forwards (``recorded``, fp32 ``[B, Hkv, n]``: the "attention" sums, the
        "reconstruction" maxima) and, for a policy that reads them too, the layer's ``keys``
        [B, Hkv, n, D]; as recorded unless a policy pools or reweighs them."""
        return recorded

    def select(self, queries: Optional[torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
               kept: int, *, seq_lens: Optional[torch.Tensor] = None):
        """A fused op that scores, selects and gathers at once, for integrations that can use
        one (``kp.hf``): a :class:`kvprune_cuda.KeptKV` of ``kept`` tokens of ``keys`` /
        ``values`` [B, Hkv, n, D] from the observed ``queries`` [B, Hq, W, D]; None (the
        default) when the policy has none, and the integration ranks :meth:`score` with
        :func:`kvprune_cuda.select_keep`. Both must keep the same tokens."""
        return None

    def select_indices(self, queries: Optional[torch.Tensor], keys: torch.Tensor, kept: int, *,
                       scale: Optional[float] = None,
                       seq_lens: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """:meth:`select` without the gather, for integrations that compact their own cache
        in place (``kp.vllm``): int32 ``[B, Hkv, kept]`` ascending positions of ``keys``
        [B, Hkv, n, D] to keep, from one fused op (softmax ``scale``, None: 1/sqrt(D)); None
        (the default) when the policy has none. It must keep what :meth:`select` keeps."""
        return None

    def to_config(self) -> dict:
        return {"policy": self.name, **asdict(self)}
