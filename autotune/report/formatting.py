"""How the report writes a value: units, missing values, sort keys. Shared by the table and the charts."""

from __future__ import annotations

from typing import Any, Literal

import pandas as pd

from autotune.units import format_bytes

Kind = Literal["int", "text", "bool", "rate", "bytes", "percent", "fraction", "tflops", "joules", "watts", "seconds", "ratio"]


def is_missing(value: Any) -> bool:
    """None, NaN and pandas' NA/NaT all read as "not measured"."""
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def format_value(kind: Kind, value: Any) -> str:
    """A cell's text, with its unit; "-" when not measured."""
    if is_missing(value):
        return "-"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "bool":
        return "yes" if bool(value) else "no"
    if kind == "rate":
        return f"{float(value):,.1f}" if float(value) < 1_000 else f"{float(value):,.0f}"
    if kind == "bytes":
        return format_bytes(float(value))
    if kind == "percent":
        return f"{float(value):.0f}%"
    if kind == "fraction":
        return f"{100 * float(value):.1f}%"
    if kind == "tflops":
        return f"{float(value):,.1f} TFLOP/s"
    if kind == "joules":
        return f"{float(value):.3g} J"
    if kind == "watts":
        return f"{float(value):,.0f} W"
    if kind == "seconds":
        return f"{1000 * float(value):,.1f} ms" if float(value) < 1 else f"{float(value):,.2f} s"
    if kind == "ratio":
        return f"{float(value):.2f}x"
    return str(value)


def format_count(n: int | float | None) -> str:
    """``1_414_000_000`` -> ``'1.41 B'``; ``7_300_000`` -> ``'7.30 M'``."""
    if is_missing(n):
        return "-"
    n = float(n)  # type: ignore[arg-type]
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def sort_key(kind: Kind, value: Any) -> float | str | None:
    if is_missing(value):
        return None
    if kind in ("text",):
        return str(value)
    if kind == "bool":
        return float(bool(value))
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
