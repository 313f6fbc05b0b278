"""The steady-state stopping rule on synthetic step-time series (no probes, no torch)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from autotune.probe.steady import StopRule, ci95_rel, drift_rel, has_jump, steps_until_stop, t975


def test_ci95_rel_by_hand() -> None:
    # mean 1.0, sample stdev 0.1 (values 0.9, 1.0, 1.1), n = 3: t(2) = 4.303, half-width 4.303 * 0.1 / sqrt(3).
    assert ci95_rel([0.9, 1.0, 1.1]) == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert ci95_rel([0.5]) == math.inf and ci95_rel([]) == math.inf
    assert ci95_rel([0.2] * 10) == 0.0


def test_t_quantiles_fall_to_the_normal_one() -> None:
    assert t975(1) == pytest.approx(12.706) and t975(10) == pytest.approx(2.228)
    assert t975(30) == pytest.approx(2.042) and t975(1000) == pytest.approx(1.96)
    assert all(t975(d) >= t975(d + 1) for d in range(1, 40))


def test_a_quiet_series_stops_at_the_minimum() -> None:
    rule = StopRule(min_steps=8, max_steps=50, max_s=60.0, target_rel=0.02)
    quiet = [0.100 + 0.001 * ((i * 7) % 3 - 1) for i in range(50)]  # +-1%
    assert steps_until_stop(rule, quiet) == 8
    assert rule.is_stable(quiet[:8])


def test_a_noisy_series_measures_until_the_interval_is_tight() -> None:
    rng = random.Random(0)
    noisy = [rng.gauss(0.1, 0.01) for _ in range(200)]  # 10% noise: needs ~ (1.96 * 0.1 / 0.02)^2 ~ 96 steps
    rule = StopRule(min_steps=8, max_steps=200, max_s=1e9, target_rel=0.02)
    n = steps_until_stop(rule, noisy)
    assert 40 < n < 200
    assert ci95_rel(noisy[:n]) <= 0.02 < ci95_rel(noisy[: n - 1])
    # The estimate it stops on is within its interval of the true mean.
    assert abs(statistics.fmean(noisy[:n]) - 0.1) / 0.1 < 0.03


def test_caps_stop_a_series_that_never_settles() -> None:
    alternating = [0.1, 0.3] * 50
    by_steps = StopRule(min_steps=4, max_steps=20, max_s=1e9)
    assert steps_until_stop(by_steps, alternating) == 20 and not by_steps.is_stable(alternating[:20])
    by_time = StopRule(min_steps=4, max_steps=100, max_s=2.0)  # 0.2 s mean: 2 s after 10 steps
    assert steps_until_stop(by_time, alternating) == 10


def test_never_stops_before_the_minimum() -> None:
    rule = StopRule(min_steps=5, max_steps=10, max_s=0.0)  # even a spent time cap waits for min_steps
    assert not rule.should_stop([1.0] * 4) and rule.should_stop([1.0] * 5)


def test_a_stall_is_not_a_steady_state_however_tight_its_interval() -> None:
    """Three 1.1 s steps during a stall, while the other steps take 0.01 s: tight over the stall alone,
    but a jump against the last warm-up step (0.01 s) or inside the window; measuring goes on to the
    cap and the series is flagged."""
    rule = StopRule(min_steps=3, max_steps=20, max_s=1e9, target_rel=0.02)
    assert rule.is_stable([1.1, 1.1, 1.1])  # the stall alone looks stable without the warm-up's reference...
    assert not rule.is_stable([1.1, 1.1, 1.1], reference_step_s=0.010)  # ...not once the warm-up shows the stall
    stalled = [1.1, 1.1, 1.1] + [0.010] * 30
    assert steps_until_stop(rule, stalled, reference_step_s=0.010) == 20
    assert not rule.is_stable(stalled[:20], reference_step_s=0.010)  # a jump inside the window
    assert has_jump([0.010, 0.010, 1.1, 0.010]) and not has_jump([0.010, 0.0105, 0.0098, 0.010])


def test_a_bimodal_or_drifting_series_is_not_stable() -> None:
    rule = StopRule(min_steps=3, max_steps=100, max_s=1e9, target_rel=0.02)
    bimodal = [0.10, 0.16, 0.10] * 10  # a step in three 60% slower
    assert has_jump(bimodal) and not rule.is_stable(bimodal)
    drifting = [0.100 * (1 + 0.004 * i) for i in range(30)]  # +0.4% a step: +12% over the window
    assert not has_jump(drifting) and drift_rel(drifting) > 0.04
    assert not rule.is_stable(drifting)
    steady = [0.100 + 0.001 * ((i * 7) % 3 - 1) for i in range(30)]
    assert not has_jump(steady, reference_step_s=0.1) and drift_rel(steady) < 0.01 and rule.is_stable(steady, 0.1)


def test_a_loose_target_tolerates_proportionally_larger_jumps() -> None:
    """Whoever accepts a +-1000% interval does not ask for a steady state: a loaded machine's 2x step still stops it."""
    assert StopRule(min_steps=3, max_steps=12, target_rel=10.0).is_stable([0.1, 0.2, 0.1])
    assert not StopRule(min_steps=3, max_steps=12, target_rel=0.02).is_stable([0.1, 0.2, 0.1])
