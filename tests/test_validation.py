"""fedlightning._validation: the shared argument checks (values accepted, conversions, messages, error types)."""

import math

import numpy as np
import pytest

from fedlightning._validation import WrongTypeError, flag, in_range, integer, non_negative, number, one_of, positive


@pytest.mark.parametrize(
    "check,value,want",
    [
        (positive, 3, 3.0),
        (positive, np.float32(0.5), 0.5),
        (non_negative, 0, 0.0),
        (number, -2.5, -2.5),
        (lambda n, v: in_range(n, v, 0.0, 1.0), 0.0, 0.0),
        (lambda n, v: in_range(n, v, 0.0, 1.0, low_closed=False, high_closed=True), 1.0, 1.0),
        (lambda n, v: in_range(n, v, 1.0, finite=False), math.inf, math.inf),
        (integer, 4, 4),
        (integer, 2.0, 2),
        (integer, np.int64(7), 7),
        (lambda n, v: integer(n, v, 0), 0, 0),
    ],
)
def test_accepted_values_are_converted(check, value, want):
    got = check("x", value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    "check,value,message",
    [
        (positive, 0, "lr must be a finite number > 0, got 0"),
        (positive, math.nan, "lr must be a finite number > 0, got nan"),
        (positive, math.inf, "lr must be a finite number > 0, got inf"),
        (non_negative, -1e-3, "lr must be a finite number >= 0, got -0.001"),
        (lambda n, v: in_range(n, v, 0.0, 1.0), 1.0, "lr must be in [0, 1), got 1.0"),
        (lambda n, v: in_range(n, v, 0.0, 1.0, low_closed=False), 0.0, "lr must be in (0, 1), got 0.0"),
        (lambda n, v: in_range(n, v, 1.0, low_closed=False), 1.0, "lr must be a finite number > 1, got 1.0"),
        (integer, 2.5, "lr must be an integer >= 1, got 2.5"),
        (integer, 0, "lr must be an integer >= 1, got 0"),
        (lambda n, v: integer(n, v, allow_none=True), -1, "lr must be an integer >= 1 or None, got -1"),
        (
            lambda n, v: positive(n, v, show_name=True, label="Dirichlet lr"),
            -0.5,
            "Dirichlet lr must be a finite number > 0, got lr=-0.5",
        ),
        (lambda n, v: in_range(n, v, 0.0, 1.0, hint="0 disables it"), 2, "lr must be in [0, 1) (0 disables it), got 2"),
        (lambda n, v: one_of(n, v, ("a", "b", "c")), "d", "lr must be 'a', 'b' or 'c', got 'd'"),
    ],
)
def test_refused_values_name_the_field_and_the_value(check, value, message):
    with pytest.raises(ValueError) as info:
        check("lr", value)
    assert str(info.value) == message
    assert not isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    "check,value",
    [
        (positive, "0.1"),
        (positive, True),
        (positive, None),
        (integer, "3"),
        (integer, False),
        (number, [1.0]),
        (flag, 1),
        (flag, "yes"),
    ],
)
def test_wrong_kinds_are_both_type_and_value_errors(check, value):
    with pytest.raises(WrongTypeError) as info:
        check("field", value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith("field must be ") and repr(value) in str(info.value)


def test_none_passes_only_when_allowed_and_choices_compare_types():
    assert positive("x", None, allow_none=True) is None and integer("k", None, allow_none=True) is None
    assert in_range("p", None, 0.0, 1.0, allow_none=True) is None
    assert one_of("m", "auto", (True, False, "auto")) == "auto" and one_of("m", False, (True, False, "auto")) is False
    with pytest.raises(ValueError, match="m must be True, False or 'auto', got 1"):
        one_of("m", 1, (True, False, "auto"))  # 1 == True, but it is not a bool
    assert flag("f", np.bool_(True)) is True
