"""The policies known by name: :func:`register` (a class decorator) and :func:`make`."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Optional, Union

from kvprune_cuda._args import check_str
from kvprune_cuda.policy.base import EVIDENCE, Options, Policy

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
    check_str(f"cls: {cls.__name__}.evidence", cls.evidence, EVIDENCE)
    held = _REGISTRY.get(cls.name)
    if held is not None and (held.__module__, held.__qualname__) != (cls.__module__,
                                                                      cls.__qualname__):
        raise ValueError(f"cls: the name {cls.name!r} is {held.__module__}.{held.__qualname__}'s")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> tuple:
    """The names :func:`make` knows: the built-ins, then the registered ones."""
    return tuple(_REGISTRY)


def make(policy: Union[str, Policy], options: Optional[Options] = None, **given) -> Policy:
    """The policy named ``policy`` with ``options`` and the fields ``given`` (e.g. ``budget``;
    those it does not have are ignored, so one set serves every policy); a Policy is returned
    as it is, or with them replaced. Values left None take the policy's default."""
    given = {k: v for k, v in {**(options or Options()).given(), **given}.items() if v is not None}
    if isinstance(policy, Policy):
        cls, base = type(policy), asdict(policy)
    else:
        check_str("policy", policy, registered())
        cls, base = _REGISTRY[policy], {}
    names = {f.name for f in fields(cls)}
    return cls(**{**base, **{k: v for k, v in given.items() if k in names}})
