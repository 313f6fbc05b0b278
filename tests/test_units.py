"""Durations and byte sizes as users type them."""

from __future__ import annotations

import pytest

from autotune.errors import BudgetError
from autotune.units import format_bytes, format_duration, parse_bytes, parse_duration_s


@pytest.mark.parametrize(("text", "seconds"), [("30m", 1800), ("90s", 90), ("1.5h", 5400), (45, 45), (12, 12.0)])
def test_durations(text, seconds) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["30 minutes", "m", "-5m", "0s", "1d", "30"])
def test_bad_durations(text) -> None:
    with pytest.raises(BudgetError):
        parse_duration_s(text)


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [("40GiB", 40 * 2**30), ("16GB", 16 * 10**9), ("512MiB", 512 * 2**20), ("1024B", 1024), (1024, 1024), ("0.5", 40 * 2**30),
     ("1", 80 * 2**30)],
)
def test_bytes(text, num_bytes) -> None:
    assert parse_bytes(text, total_bytes=80 * 2**30) == num_bytes


@pytest.mark.parametrize("text", ["16", "1.5", "40000000000"])
def test_a_size_without_a_unit_is_refused_unless_a_fraction(text) -> None:
    with pytest.raises(BudgetError, match=f"memory size '{text}' has no unit: write {text}GiB"):
        parse_bytes(text, total_bytes=80 * 2**30)


def test_fraction_needs_a_total() -> None:
    with pytest.raises(BudgetError, match="needs a known device memory"):
        parse_bytes("0.9")


@pytest.mark.parametrize("text", ["40 gigs", "GiB", "-1GiB", "0"])
def test_bad_bytes(text) -> None:
    with pytest.raises(BudgetError):
        parse_bytes(text, total_bytes=2**30)


def test_formatting() -> None:
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(None) == "-"
    assert format_duration(95) == "1m35s"
    assert format_duration(7200) == "2h00m"
