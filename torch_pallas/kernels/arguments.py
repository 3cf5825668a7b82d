"""The argument checks every layer shares (torch-free, so the kernels use them too): one
rule and one message per argument, wherever it is checked."""

from __future__ import annotations

import numbers


def check_one_of(name: str, value, accepted: tuple):
    """``value`` if it is one of ``accepted``, else a ValueError listing them."""
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}, got {value!r}")
    return value


def check_positive_int(value, name: str) -> int:
    """``value`` as an int: TypeError for a non-int (bool included), ValueError below 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_probability(p, name: str = "p") -> float:
    """A real number in [0, 1] (NaN rejected), as a float."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(p).__name__} {p!r}")
    p = float(p)
    if not 0.0 <= p <= 1.0:  # False for NaN too
        raise ValueError(f"{name} must be in [0, 1], got {p}")
    return p

