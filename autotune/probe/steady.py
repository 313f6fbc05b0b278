"""When to stop measuring: the steady-state stopping rule, a pure function of the step times.

A probe times optimizer steps one by one after its warm-up. Fixed step counts give numbers whose
noise nobody knows; instead we keep measuring until the mean step time is known to within
``target_rel`` (the half-width of its 95% confidence interval, relative to the mean), or until a
step or time cap is reached. The result records whether the estimate became stable, so a ranking
never rests on a noisy number without saying so.

The interval uses Student's t (step times of a steady loop are close to i.i.d.; a few outliers
from the allocator or the garbage collector widen the interval, which is what we want). A tight
interval is not enough: a series with a jump (one step far slower than the fastest: a stall, another
process taking the device or the cores) or a drift (its two halves' means apart) is not a steady
state however tight its interval looks over a few steps, so it is not called stable; measuring goes
on to the cap and the trial is flagged (``stable=False``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# A step this much slower (or faster) than the window's median is a jump (a stall, not noise): GPU
# step times vary by a few percent; 50% is an order of magnitude past that.
JUMP_REL = 0.5
JUMP_PER_TARGET = 25.0  # a looser target tolerates proportionally larger jumps: 0.5 at the default +-2%
DRIFT_MIN_STEPS = 6  # fewer steps than this give halves too short to compare
DEFAULT_TARGET_REL = 0.02  # +-2% on the mean step time: below the 2% run-to-run spread we accept on a GPU

# Two-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom (any statistics table,
# e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2); above 30 the normal quantile is close enough.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)
_Z975 = 1.960


def t975(dof: int) -> float:
    """The 97.5% quantile of Student's t with ``dof`` degrees of freedom (two-sided 95%)."""
    if dof < 1:
        return math.inf
    return _T975[dof - 1] if dof <= len(_T975) else _Z975


def ci95_rel(step_times_s: Sequence[float]) -> float:
    """Half-width of the 95% confidence interval of the mean step time, relative to the mean.

    Returns ``inf`` with fewer than two steps (no estimate of the spread yet).
    """
    n = len(step_times_s)
    if n < 2:
        return math.inf
    mean = statistics.fmean(step_times_s)
    if mean <= 0:
        return math.inf
    half_width = t975(n - 1) * statistics.stdev(step_times_s) / math.sqrt(n)
    return half_width / mean


def has_jump(step_times_s: Sequence[float], reference_step_s: float | None = None, jump_rel: float = JUMP_REL) -> bool:
    """Whether the window holds a jump: a step more than ``jump_rel`` away from the window's median,
    or a median that far slower than ``reference_step_s`` (the last warm-up step: a window that
    starts inside a stall is uniform, and only the steps before it show the stall)."""
    if not step_times_s:
        return False
    median = statistics.median(step_times_s)
    if median <= 0:
        return False
    factor = 1.0 + jump_rel
    if any(t > factor * median or t * factor < median for t in step_times_s):
        return True
    return reference_step_s is not None and reference_step_s > 0 and median > factor * reference_step_s


def drift_rel(step_times_s: Sequence[float]) -> float:
    """How far apart the means of the window's first and second halves are, relative to the mean (0 for short windows)."""
    n = len(step_times_s)
    if n < DRIFT_MIN_STEPS:
        return 0.0
    mean = statistics.fmean(step_times_s)
    if mean <= 0:
        return 0.0
    return abs(statistics.fmean(step_times_s[: n // 2]) - statistics.fmean(step_times_s[n - n // 2 :])) / mean


@dataclass(frozen=True)
class StopRule:
    """Measure at least ``min_steps``; stop once stable, or at ``max_steps`` / ``max_s`` of measuring."""

    min_steps: int = 8
    max_steps: int = 50
    max_s: float = 30.0
    target_rel: float = DEFAULT_TARGET_REL

    def __post_init__(self) -> None:
        assert 1 <= self.min_steps <= self.max_steps, (self.min_steps, self.max_steps)

    def should_stop(self, step_times_s: Sequence[float], reference_step_s: float | None = None) -> bool:
        """Whether to stop after these measured step times (warm-up steps excluded; ``reference_step_s``:
        the last warm-up step's time, see :func:`has_jump`)."""
        n = len(step_times_s)
        if n < self.min_steps:
            return False
        if n >= self.max_steps or sum(step_times_s) >= self.max_s:
            return True
        return self.is_stable(step_times_s, reference_step_s)

    def is_stable(self, step_times_s: Sequence[float], reference_step_s: float | None = None) -> bool:
        """Whether the series is a steady state: its mean known to the target, no jump, no drift.

        The drift allowed is twice the target: the two halves' means each carry the noise the
        target bounds for the whole mean.
        """
        return (
            ci95_rel(step_times_s) <= self.target_rel
            and not has_jump(step_times_s, reference_step_s, max(JUMP_REL, JUMP_PER_TARGET * self.target_rel))
            and drift_rel(step_times_s) <= 2 * self.target_rel
        )


def steps_until_stop(rule: StopRule, step_times_s: Sequence[float], reference_step_s: float | None = None) -> int:
    """How many steps of this series the rule measures before it stops (the whole series if never)."""
    for n in range(1, len(step_times_s) + 1):
        if rule.should_stop(step_times_s[:n], reference_step_s):
            return n
    return len(step_times_s)
