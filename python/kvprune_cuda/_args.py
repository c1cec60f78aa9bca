"""Checks of scalar arguments, the one place they are written (the public ops, the paged
cache, the policies' options): a wrong type raises a TypeError naming the argument (an op
schema would raise a bare RuntimeError), a value out of range or not among the choices a
ValueError naming it."""

from __future__ import annotations

import operator
from typing import Optional

import torch


def check_int(name: str, value, least: Optional[int] = None) -> None:
    """An integer (Python int, numpy integer, or a SymInt under torch.compile), not a bool;
    ``>= least`` unless None."""
    if isinstance(value, torch.SymInt):
        return
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if least is not None and value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def check_str(name: str, value, choices: tuple[str, ...]) -> None:
    """One of ``choices``: a TypeError for a non-string, a ValueError for another string."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_fraction(name: str, value) -> None:
    """A number in [0, 1], not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(value).__name__} {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def check_scale(value) -> None:
    if value is None or isinstance(value, torch.SymFloat):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(value).__name__} {value!r}")
