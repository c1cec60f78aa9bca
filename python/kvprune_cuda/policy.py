"""The compression policies, one small class each, shared by ``kp.hf`` and ``kp.vllm``.

Torch-only (no transformers, no vllm). A policy object holds its options, validates them
(a ValueError naming the argument) and answers three questions for any integration:

* how many tokens a prompt of ``n`` keeps (:meth:`Policy.kept_tokens`: ``budget`` resolved
  against ``n``, never below :attr:`Policy.min_keep`, the sinks and the recent window);
* how many of the prompt's last queries it observes (:meth:`Policy.observed_queries`), so an
  integration computes and keeps no query the policy does not use;
* how it scores the keys (:meth:`Policy.score`, fp32 ``[B, Hkv, n]``; higher is kept first by
  :func:`kvprune_cuda.select_keep`, after the ``n_sink`` sinks and the last ``window``
  tokens, which every policy keeps).

A policy also declares the evidence it scores by (:attr:`Policy.evidence`): nothing, the
last ``window`` observed queries, attention accumulated over forwards, or the model's
reconstruction of the context; integrations (``kp.hf``, ``kp.vllm``) ask the policy, never
its class. A new policy is one small class anywhere (a frozen dataclass extending
:class:`Policy`, with a ``name``, its ``evidence`` and its ``score``) made known by its name
with :func:`register` (docs/policy.md, "Write your own policy").

:class:`DecodeRule` is the periodic decode-time rule built on them (:func:`make_decode`):
every ``interval`` generated tokens, a cache holding more than ``max_held`` tokens is
compressed back to ``max_held`` by a policy's selection.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Optional, Union

import torch

import kvprune_cuda as kp

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


def _check_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


@dataclass(frozen=True)
class Policy:
    """Keep the ``n_sink`` first and the ``window`` last tokens, plus the best-scored others,
    ``budget`` tokens in all (a fraction of the prompt in (0, 1] or a count)."""

    name: ClassVar[str] = ""
    evidence: ClassVar[str] = "none"        # one of EVIDENCE
    fixed_capacity: ClassVar[bool] = False  # kp.hf: decoding evicts, holding `budget` slots
    default_scope: ClassVar[str] = "layer"   # kp.hf.compress_context's measured default

    budget: Union[int, float] = 0.2
    n_sink: int = 4
    window: int = 32

    def __post_init__(self) -> None:
        resolve_budget(self.budget, 1)
        _check_int("n_sink", self.n_sink, 0)
        _check_int("window", self.window, 0)
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

    @property
    def ranks(self) -> bool:
        """Whether the policy has scores to rank (budget scopes "global" / "head")."""
        return True

    def score(self, queries: torch.Tensor, keys: torch.Tensor, *, scale: Optional[float] = None,
              seq_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 ``[B, Hkv, n]`` scores of ``keys`` [B, Hkv, n, D] from the post-RoPE
        ``queries`` [B, Hq, q, D] the policy observed."""
        raise NotImplementedError(f"policy {self.name!r} does not score keys")

    def to_config(self) -> dict:
        return {"policy": self.name, **asdict(self)}


@dataclass(frozen=True)
class Full(Policy):
    """Nothing is evicted (the baseline)."""

    name: ClassVar[str] = "full"

    def kept_tokens(self, n: int, budget: Union[int, float, None] = None) -> int:
        return n

    @property
    def ranks(self) -> bool:
        return False


@dataclass(frozen=True)
class Streaming(Policy):
    """StreamingLLM: the sinks and the most recent tokens; in kp.hf a ring of ``budget``
    slots while decoding (each new token overwrites the oldest non-sink one)."""

    name: ClassVar[str] = "streaming"
    fixed_capacity: ClassVar[bool] = True

    @property
    def min_keep(self) -> int:
        return self.n_sink + self.window + (1 if self.window == 0 else 0)  # a ring slot

    @property
    def ranks(self) -> bool:
        return False

    def score(self, queries, keys, *, scale=None, seq_lens=None) -> torch.Tensor:
        """Recency: the position, so the top scores are the most recent tokens."""
        b, hkv, n = keys.shape[:3]
        return torch.arange(n, dtype=torch.float32, device=keys.device).expand(b, hkv, n).clone()


@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV: the last ``window`` queries vote (attention probabilities, the query heads of
    a KV group combined by ``gqa``), 1-D pooled over ``kernel_size`` positions."""

    name: ClassVar[str] = "snapkv"
    evidence: ClassVar[str] = "window_queries"
    kernel_size: int = 7
    pool: str = "max"
    gqa: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError("window: snapkv votes with the last window queries; needs >= 1")
        _check_int("kernel_size", self.kernel_size, 1)
        _check_choice("pool", self.pool, ("max", "avg"))
        _check_choice("gqa", self.gqa, GQA)

    def score(self, queries, keys, *, scale=None, seq_lens=None) -> torch.Tensor:
        s = kp.window_scores(queries, keys, scale=scale, gqa=self.gqa, seq_lens=seq_lens)
        return kp.pool_scores(s, self.kernel_size, self.pool, window=self.window,
                              seq_lens=seq_lens)


@dataclass(frozen=True)
class H2O(Policy):
    """Heavy hitters: every query's attention probabilities accumulate into each key's score
    (summed over forwards by the integration); in kp.hf a fixed cache of ``budget`` slots
    while decoding, each new token replacing the lowest-scored one outside sinks and window."""

    name: ClassVar[str] = "h2o"
    evidence: ClassVar[str] = "attention"
    fixed_capacity: ClassVar[bool] = True
    gqa: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("gqa", self.gqa, GQA)

    @property
    def min_keep(self) -> int:
        return self.n_sink + self.window + 1  # a free slot for the next token

    def score(self, queries, keys, *, scale=None, seq_lens=None) -> torch.Tensor:
        return kp.window_scores(queries, keys, scale=scale, gqa=self.gqa, seq_lens=seq_lens)


@dataclass(frozen=True)
class KVzip(Policy):
    """KVzip (query-agnostic): a key's score is the largest attention probability it gets
    from any query of the model reconstructing the context (``chunk_size`` context tokens per
    forward), the query heads of a KV group combined by ``gqa``; ``softmax``: the keys a
    probability is normalised over ("chunk": the sinks, the chunk and the reconstruction
    tokens, KVzip's own; "all": every key the query sees). Protects only the sinks by
    default (``window=0``), as KVzip does. Only kp.hf.compress_context runs it."""

    name: ClassVar[str] = "kvzip"
    evidence: ClassVar[str] = "reconstruction"
    default_scope: ClassVar[str] = "head"  # 20/20 passkey at 10 % (bench/RESULTS.md)
    window: int = 0
    gqa: str = "max"
    softmax: str = "chunk"
    chunk_size: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("gqa", self.gqa, GQA)
        _check_choice("softmax", self.softmax, ("chunk", "all"))
        _check_int("chunk_size", self.chunk_size, 1)

    def score(self, queries, keys, *, scale=None, seq_lens=None, lse=None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Folds the maxima of ``queries`` (one reconstruction chunk) into ``out`` (fp32
        ``[B, Hkv, M]``, the first M of ``keys``; a new zero buffer if None)."""
        if out is None:
            out = torch.zeros(*keys.shape[:3], dtype=torch.float32, device=keys.device)
        return kp.window_scores(queries, keys, lse=lse, scale=scale, gqa=self.gqa,
                                qreduce="max", out=out)


POLICIES = ("full", "streaming", "snapkv", "h2o", "kvzip")  # the built-in policies
_REGISTRY: dict = {}  # name -> Policy class: the built-ins and every registered one


def register(cls: type) -> type:
    """Makes the policy class ``cls`` known by its ``name`` to :func:`make` (so ``kp.hf`` and
    ``kp.vllm`` accept the name); returns ``cls``, so it works as a class decorator. ``cls``:
    a dataclass extending :class:`Policy` with a non-empty ``name`` no other class holds and
    an ``evidence`` of :data:`EVIDENCE` (ValueError naming ``cls`` otherwise)."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)) or cls is Policy:
        raise ValueError(f"cls: expected a subclass of kp.policy.Policy, got {cls!r}")
    if not cls.name or not isinstance(cls.name, str):
        raise ValueError(f"cls: {cls.__name__} needs a class attribute name (a non-empty str)")
    _check_choice(f"cls: {cls.__name__}.evidence", cls.evidence, EVIDENCE)
    held = _REGISTRY.get(cls.name)
    if held is not None and (held.__module__, held.__qualname__) != (cls.__module__,
                                                                      cls.__qualname__):
        raise ValueError(f"cls: the name {cls.name!r} is {held.__module__}.{held.__qualname__}'s")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> tuple:
    """The names :func:`make` knows: the built-ins, then the registered ones."""
    return tuple(_REGISTRY)


for _cls in (Full, Streaming, SnapKV, H2O, KVzip):
    register(_cls)


def make(policy: Union[str, Policy], **options) -> Policy:
    """The policy named ``policy`` with ``options`` (those it does not have are ignored, so
    one set of options serves every policy); a Policy is returned as it is, or with the
    given options replaced. Options left as None take the policy's default."""
    options = {k: v for k, v in options.items() if v is not None}
    if isinstance(policy, Policy):
        cls, base = type(policy), asdict(policy)
    else:
        _check_choice("policy", policy, registered())
        cls, base = _REGISTRY[policy], {}
    names = {f.name for f in fields(cls)}
    return cls(**{**base, **{k: v for k, v in options.items() if k in names}})


DECODE_POLICIES = ("streaming", "snapkv", "h2o")


@dataclass(frozen=True)
class DecodeRule:
    """Periodic decode-time compression, the same in kp.hf and kp.vllm.

    After a forward that brings the request's generated tokens in the cache (prompt positions
    excluded) to ``g`` from ``g - q_len``, if ``g`` crossed a multiple of ``interval`` and the
    cache holds more than :meth:`target` tokens, it is compressed to :meth:`target` by
    ``policy``'s selection over the held tokens: ``"streaming"`` keeps the sinks and the most
    recent tokens; ``"snapkv"`` scores every held key by the last ``window`` decode queries
    (SnapKV voting over the request's own recent decode queries, pooled) and keeps the sinks,
    the last ``window`` tokens and the top scores; ``"h2o"`` keeps the sinks, the last
    ``window`` tokens and the held keys with the largest accumulated attention
    (:meth:`accumulate`: every decode query's probabilities, from the forward of the first
    generated token on; the prompt's queries do not count, so the rule is the same after any
    prompt policy). Positions are never changed (kept keys keep their rotation).
    ``policy.budget`` is ``max_held``.
    """

    policy: Policy
    interval: int

    def __post_init__(self) -> None:
        _check_choice("decode", self.policy.name, DECODE_POLICIES)
        _check_int("interval", self.interval, 1)
        if isinstance(self.policy, SnapKV) and self.interval < self.policy.window:
            raise ValueError(f"interval: {self.interval} < window {self.policy.window}; snapkv "
                             "votes with the last window decode queries, all after the last "
                             "compression")

    @property
    def max_held(self) -> int:
        return self.policy.budget

    @property
    def accumulates(self) -> bool:
        """Whether every decode forward adds to the held keys' scores (h2o), rather than
        the last ``window`` decode queries voting at compression time (snapkv)."""
        return isinstance(self.policy, H2O)

    def accumulate(self, scores: Optional[torch.Tensor], queries: torch.Tensor,
                   keys: torch.Tensor, *, scale: Optional[float] = None) -> torch.Tensor:
        """h2o: ``scores`` (fp32 [B, Hkv, M], the held keys' sums so far; None: none yet) plus
        the attention probabilities of a decode forward's post-RoPE ``queries``
        [B, Hq, q, D] (the last q positions, causal) over the held ``keys`` [B, Hkv, N, D]
        (N >= M; the new keys start at 0): fp32 [B, Hkv, N]."""
        new = self.policy.score(queries, keys, scale=scale)
        if scores is not None:
            new[..., : scores.shape[-1]] += scores
        return new

    def target(self, pinned: int = 0) -> int:
        """Tokens held after a compression, the first ``pinned`` (sinks at least) kept whole."""
        return max(self.max_held, max(self.policy.n_sink, pinned) + self.policy.window)

    def compresses(self, generated: int, q_len: int, held: int, pinned: int = 0
                   ) -> Optional[int]:
        """Tokens to keep after a forward of ``q_len`` tokens that brought the generated
        tokens to ``generated`` and the cache to ``held`` tokens; None: no compression."""
        if generated < 1 or generated // self.interval == (generated - q_len) // self.interval:
            return None
        target = self.target(pinned)
        return target if held > target else None


def make_decode(decode: Optional[str], max_held: Optional[int], interval: Optional[int],
                **options) -> Optional[DecodeRule]:
    """The :class:`DecodeRule` ``decode`` ("streaming" | "snapkv" | "h2o"; None: no decode-time
    compression) that compresses to ``max_held`` tokens every ``interval`` generated tokens,
    with the policy ``options`` (n_sink, window, kernel_size, pool, gqa)."""
    if decode is None:
        if max_held is not None or interval is not None:
            raise ValueError("decode: max_held / interval given without a decode policy")
        return None
    _check_choice("decode", decode, DECODE_POLICIES)
    if isinstance(max_held, bool) or not isinstance(max_held, int):
        raise ValueError(f"max_held: expected a token count, got {max_held!r}")
    if isinstance(interval, bool) or not isinstance(interval, int):
        raise ValueError(f"interval: expected a token count, got {interval!r}")
    try:
        policy = make(decode, budget=max_held, **options)
    except ValueError as e:
        raise ValueError(str(e).replace("budget:", "max_held:", 1)) from None
    return DecodeRule(policy, interval)


def decode_options(prompt: Policy, **options) -> dict:
    """A decode rule's policy ``options`` (n_sink, window, kernel_size, pool, gqa) beside the
    prompt policy ``prompt``: the prompt's own where it has the field, else those given."""
    return {f: getattr(prompt, f, v) for f, v in options.items()}


__all__ = ["POLICIES", "EVIDENCE", "register", "registered", "SCOPES", "Policy", "Full",
           "Streaming", "SnapKV", "H2O", "KVzip", "make", "resolve_budget", "DECODE_POLICIES", "DecodeRule", "make_decode",
           "decode_options"]
