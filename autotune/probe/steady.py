"""When to stop measuring: the steady-state stopping rule, a pure function of the step times.

A probe times optimizer steps one by one after its warm-up. Fixed step counts give numbers whose
noise nobody knows; instead we keep measuring until the mean step time is known to within
``target_rel`` (the half-width of its 95% confidence interval, relative to the mean), or until a
step or time cap is reached. The result records whether the estimate became stable, so a ranking
never rests on a noisy number without saying so.

The interval uses Student's t (step times of a steady loop are close to i.i.d.; a few outliers
from the allocator or the garbage collector widen the interval, which is what we want).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class StopRule:
    """Measure at least ``min_steps``; stop once stable, or at ``max_steps`` / ``max_s`` of measuring."""

    min_steps: int = 8
    max_steps: int = 50
    max_s: float = 30.0
    target_rel: float = DEFAULT_TARGET_REL

    def __post_init__(self) -> None:
        assert 1 <= self.min_steps <= self.max_steps, (self.min_steps, self.max_steps)

    def should_stop(self, step_times_s: Sequence[float]) -> bool:
        """Whether to stop after these measured step times (warm-up steps excluded)."""
        n = len(step_times_s)
        if n < self.min_steps:
            return False
        if n >= self.max_steps or sum(step_times_s) >= self.max_s:
            return True
        return ci95_rel(step_times_s) <= self.target_rel

    def is_stable(self, step_times_s: Sequence[float]) -> bool:
        """Whether the estimate met the target (rather than stopping at a cap)."""
        return ci95_rel(step_times_s) <= self.target_rel


def steps_until_stop(rule: StopRule, step_times_s: Sequence[float]) -> int:
    """How many steps of this series the rule measures before it stops (the whole series if never)."""
    for n in range(1, len(step_times_s) + 1):
        if rule.should_stop(step_times_s[:n]):
            return n
    return len(step_times_s)
