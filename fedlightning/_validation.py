"""Argument checks shared by the package: one message style that names the field and the value.

Every check returns the value converted (``float``, ``int``, ``bool`` or the matching choice) or raises

* ``ValueError``: ``"<name> must be <rule>, got <value>"`` (a number outside its range, a value not among the
  choices);
* :class:`WrongTypeError` for a value of the wrong kind (a string where a number belongs): both a ``TypeError`` and
  a ``ValueError``, so a caller catching either sees it.

Numbers are Python or NumPy reals, finite unless the rule says otherwise; ``bool`` is not a number here
(``True`` is no step size). Integers also accept integral floats (``2.0``); ``2.5`` is refused. ``allow_none``
lets ``None`` through (returned as is) and adds "or None" to the rule; ``show_name`` writes the value as
``name=value``; ``label`` replaces the field name at the start of the message (``"Dirichlet alpha"``); ``hint``
follows the rule in parentheses.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import numpy as np

__all__ = [
    "WrongTypeError",
    "flag",
    "in_range",
    "integer",
    "non_negative",
    "number",
    "one_of",
    "positive",
]


class WrongTypeError(TypeError, ValueError):
    """A value of the wrong kind for its field (both a ``TypeError`` and a ``ValueError``)."""


def _fail(name: str, rule: str, value: Any, *, label: Optional[str], show_name: bool, allow_none: bool,
          error: type = ValueError, hint: str = "") -> None:
    shown = f"{name}={value!r}" if show_name else repr(value)
    rule = rule + (" or None" if allow_none else "") + (f" ({hint})" if hint else "")
    raise error(f"{label or name} must be {rule}, got {shown}")


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _bound(low: Optional[float], high: Optional[float], low_closed: bool, high_closed: bool) -> str:
    if low is not None and high is not None:
        return f"in {'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
    if low is not None:
        return f"{'>=' if low_closed else '>'} {low:g}"
    if high is not None:
        return f"{'<=' if high_closed else '<'} {high:g}"
    return ""


def in_range(name: str, value: Any, low: Optional[float] = None, high: Optional[float] = None, *,
             low_closed: bool = True, high_closed: bool = False, finite: bool = True, allow_none: bool = False,
             label: Optional[str] = None, show_name: bool = False, hint: str = "") -> Optional[float]:
    """``float(value)`` for a real number in the interval (``low`` / ``high`` None: unbounded on that side;
    ``low_closed`` / ``high_closed``: whether the end belongs to it); NaN never does, ±inf only with
    ``finite=False``."""
    if value is None and allow_none:
        return None
    bound = _bound(low, high, low_closed, high_closed)
    if low is not None and high is not None:
        rule = bound
    else:
        rule = " ".join(filter(None, ("a finite number" if finite else "a number", bound)))
    options = dict(label=label, show_name=show_name, allow_none=allow_none, hint=hint)
    if not _is_real(value):
        _fail(name, rule, value, error=WrongTypeError, **options)
    v = float(value)
    ok = not math.isnan(v) and (math.isfinite(v) or not finite)
    if ok and low is not None:
        ok = v >= low if low_closed else v > low
    if ok and high is not None:
        ok = v <= high if high_closed else v < high
    if not ok:
        _fail(name, rule, value, **options)
    return v


def number(name: str, value: Any, **options: Any) -> Optional[float]:
    """A finite real number."""
    return in_range(name, value, **options)


def positive(name: str, value: Any, **options: Any) -> Optional[float]:
    """A finite real number > 0."""
    return in_range(name, value, 0.0, low_closed=False, **options)


def non_negative(name: str, value: Any, **options: Any) -> Optional[float]:
    """A finite real number >= 0."""
    return in_range(name, value, 0.0, **options)


def integer(name: str, value: Any, minimum: Optional[int] = 1, *, allow_none: bool = False,
            label: Optional[str] = None, show_name: bool = False, hint: str = "") -> Optional[int]:
    """``int(value)`` for an integer (or integral float) >= ``minimum`` (None: no lower bound)."""
    if value is None and allow_none:
        return None
    rule = "an integer" + ("" if minimum is None else f" >= {minimum}")
    options = dict(label=label, show_name=show_name, allow_none=allow_none, hint=hint)
    if not _is_real(value):
        _fail(name, rule, value, error=WrongTypeError, **options)
    if isinstance(value, (numbers.Integral, np.integer)):
        v = int(value)
    else:
        f = float(value)
        if not (math.isfinite(f) and f.is_integer()):
            _fail(name, rule, value, **options)
        v = int(f)
    if minimum is not None and v < minimum:
        _fail(name, rule, value, **options)
    return v


def one_of(name: str, value: Any, choices: Sequence[Any], *, label: Optional[str] = None,
           show_name: bool = False) -> Any:
    """``value`` when it equals one of ``choices`` and has its type (``1`` is not ``True``)."""
    for choice in choices:
        if isinstance(value, type(choice)) and value == choice:
            return value
    listed = [repr(c) for c in choices]
    rule = listed[0] if len(listed) == 1 else f"{', '.join(listed[:-1])} or {listed[-1]}"
    _fail(name, rule, value, label=label, show_name=show_name, allow_none=False)


def flag(name: str, value: Any) -> bool:
    """``value`` when it is a ``bool``."""
    if not isinstance(value, (bool, np.bool_)):
        _fail(name, "a bool", value, label=None, show_name=False, allow_none=False, error=WrongTypeError)
    return bool(value)
