"""Option checks, written once: every rule's config validates its options with these (and the modules and the
functional APIs validate through their rule's config).

Each raises with the option's name and the value. A value of the wrong type raises :class:`OptionTypeError`,
which is both a ``TypeError`` and a ``ValueError`` (callers that catch either keep working); a value of the
right type outside its range raises ``ValueError``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional

__all__ = ["OptionTypeError", "check_finite", "check_positive", "check_interval", "check_int", "check_choice",
           "check_eps", "check_bool", "keywords_or_config"]


class OptionTypeError(TypeError, ValueError):
    """An option of the wrong type (a TypeError, and a ValueError like every other bad option value)."""


def check_finite(name: str, value: Any) -> float:
    """A finite real number (not a bool), returned as float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionTypeError(f"{name} must be a finite number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    """A finite number > 0, returned as float."""
    value = check_finite(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def check_interval(name: str, value: Any, low: float, high: float, *, closed: str = "") -> float:
    """A finite number in the interval from ``low`` to ``high``; ``closed`` names the ends that belong to it
    (``""``: open ``(low, high)``, ``"low"``, ``"high"``, ``"both"``). ``high = inf``: no upper end."""
    value = check_finite(name, value)
    lo_ok = value >= low if closed in ("low", "both") else value > low
    hi_ok = value <= high if closed in ("high", "both") else value < high
    if not (lo_ok and hi_ok):
        if high == math.inf:
            raise ValueError(f"{name} must be {'>=' if closed == 'low' else '>'} {low:g}, got {value!r}")
        left = "[" if closed in ("low", "both") else "("
        right = "]" if closed in ("high", "both") else ")"
        raise ValueError(f"{name} must be in {left}{low:g}, {high:g}{right}, got {value!r}")
    return value


def check_int(name: str, value: Any, minimum: int = 1, allow_none: bool = False) -> Optional[int]:
    """An int (not a bool) >= ``minimum`` (or None with ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionTypeError(f"{name} must be an int >= {minimum}{' or None' if allow_none else ''}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """One of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_eps(name: str, value: Any) -> float:
    """A finite eps >= 0 (0 disables the floor: exact scale invariance, NaN on all-zero rows)."""
    value = check_finite(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """True or False."""
    if not isinstance(value, bool):
        raise OptionTypeError(f"{name} must be True or False, got {value!r}")
    return value


def keywords_or_config(owner: str, keywords: Any, config: Any) -> Any:
    """The options of a module that takes them as keywords or whole as ``config=``: ``config`` when given, else
    ``keywords`` (the config the keywords build); a TypeError when both are given (a keyword off its default)."""
    if config is None:
        return keywords
    default = type(keywords)()
    if keywords != default:
        changed = {f: v for f, v in vars(keywords).items() if v != getattr(default, f)}
        raise TypeError(f"{owner} takes its options as keywords or as config=, not both: got config={config!r} and "
                        f"{changed}; put them in the config")
    return config
