"""Parse and format the quantities users type: durations (``30m``) and byte sizes (``40GiB``)."""

from __future__ import annotations

import re

from autotune.errors import BudgetError

GiB = 2**30  # bytes; the one definition every module and test uses
_DURATION_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0}
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_duration_s(text: str | float | int) -> float:
    """Parse ``90s``, ``30m``, ``1.5h`` (or a number of seconds, an int or float, not text) into seconds.

    Raises:
        BudgetError: if the text is not a positive duration.
    """
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text).lower())  # a sign: "-5m" must be positive
        if not match:
            raise BudgetError(f"cannot read duration {text!r}: write a number with s, m or h, e.g. 90s, 30m, 2h")
        if not match.group(2):  # "30" meant as minutes runs 30 seconds: a text duration says its unit
            raise BudgetError(f"duration {text!r} has no unit: write {match.group(1)}m (minutes), {match.group(1)}s or {match.group(1)}h")
        seconds = float(match.group(1)) * _DURATION_UNITS_S[match.group(2)]
    if seconds <= 0:
        raise BudgetError(f"duration {text!r} must be positive, e.g. 30m")
    return seconds


def parse_bytes(text: str | int | float, *, total_bytes: int | None = None) -> int:
    """Parse ``40GiB``, ``16GB``, ``512MiB``, ``16B``, an int of bytes, or a fraction ``0.9`` of ``total_bytes`` (a
    text number without a unit is a fraction in (0, 1], else refused).

    Raises:
        BudgetError: if the text is not a positive size, or a fraction is given without a total.
    """
    if isinstance(text, int):
        value = text
    else:
        raw = str(text).strip().lower().replace(" ", "")
        match = re.fullmatch(r"(-?\d+(?:\.\d+)?)([a-z]*)", raw)  # a sign: "-4GiB" must be positive
        if not match or (match.group(2) and match.group(2) not in _BYTE_UNITS):
            raise BudgetError(
                f"cannot read memory size {text!r}: write e.g. 40GiB, 16GB, 512MiB, or a fraction like 0.9"
            )
        number, unit = float(match.group(1)), match.group(2)
        if not unit and 0.0 < number <= 1.0:
            if total_bytes is None:
                raise BudgetError(f"memory fraction {text!r} needs a known device memory: give bytes instead, e.g. 40GiB")
            value = int(number * total_bytes)
        elif not unit:  # "16" is far more often 16 GiB meant than 16 bytes: a size without a unit is refused
            raise BudgetError(f"memory size {text!r} has no unit: write {match.group(1)}GiB (or {match.group(1)}GB, "
                              f"{match.group(1)}MiB), or a fraction of the device like 0.8")
        else:
            value = int(number * _BYTE_UNITS[unit])
    if value <= 0:
        raise BudgetError(f"memory size {text!r} must be positive, e.g. 40GiB")
    return value


def format_bytes(num_bytes: float | int | None) -> str:
    """``1536 * 2**20`` -> ``'1.50 GiB'``; None -> ``'-'``."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_duration(seconds: float | None) -> str:
    """``95`` -> ``'1m35s'``."""
    if seconds is None:
        return "-"
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
