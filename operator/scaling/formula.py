"""How numbers are written into the formulas shown in status, Events and `plimsoll plan`."""

from fractions import Fraction


def fmt(x: float | Fraction) -> str:
    """A number as a person would write it in a formula: at most two decimals, no trailing zeros; one
    below 0.01 with two significant digits (a target of 0.001 s of backlog is not "0")."""
    if 0 < abs(float(x)) < 0.01:
        return f"{float(x):.2g}"
    text = f"{float(x):.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text
