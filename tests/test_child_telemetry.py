"""Telemetry over the measured window: what a probe reports from it, and how long it measures for it.

Fake :class:`Telemetry` objects stand in for NVML; the stopping rule is fed made-up step times."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autotune.params import TrialParams
from autotune.probe import telemetry as telemetry_module
from autotune.probe.child import TELEMETRY_MAX_STEPS, stop_rule
from autotune.probe.steady import StopRule, steps_until_stop
from autotune.probe.summary import min_telemetry_window_s, telemetry_fields
from autotune.probe.telemetry import Telemetry
from autotune.records import ProbeSpec


def _telemetry(window_s: float, energy_j: float | None = 900.0, samples: int = 40) -> Telemetry:
    return Telemetry(
        samples=samples, gpu_util_mean_pct=97.0, gpu_util_peak_pct=100.0, power_mean_w=450.0,
        sm_clock_mean_mhz=1980.0, mem_used_peak_bytes=10 * 2**30, energy_j=energy_j, window_s=window_s,
    )


def test_long_window_reports_everything_and_energy_from_the_counter() -> None:
    fields = telemetry_fields(_telemetry(window_s=2.5, energy_j=900.0), samples=300, min_window_s=2.0)
    assert fields["telemetry_reliable"] is True and fields["telemetry_window_s"] == 2.5
    assert (fields["gpu_util_mean_pct"], fields["gpu_util_peak_pct"], fields["power_mean_w"]) == (97.0, 100.0, 450.0)
    # 900 J over 300 samples; not 450 W x 2.5 s / 300 (power is a trailing 1 s average).
    assert fields["energy_per_sample_j"] == pytest.approx(3.0)


def test_short_window_drops_power_and_utilisation_but_keeps_energy() -> None:
    fields = telemetry_fields(_telemetry(window_s=0.6, energy_j=240.0), samples=80, min_window_s=2.0)
    assert fields["telemetry_reliable"] is False and fields["telemetry_window_s"] == 0.6
    assert fields["gpu_util_mean_pct"] is None and fields["gpu_util_peak_pct"] is None and fields["power_mean_w"] is None
    assert fields["energy_per_sample_j"] == pytest.approx(3.0)
    assert fields["sm_clock_mean_mhz"] == 1980.0  # an instantaneous reading


def test_no_energy_counter_means_no_energy() -> None:
    assert telemetry_fields(_telemetry(window_s=3.0, energy_j=None), samples=80, min_window_s=2.0)["energy_per_sample_j"] is None


def test_cpu_has_no_telemetry() -> None:
    fields = telemetry_fields(Telemetry(samples=0), samples=12, min_window_s=2.0)
    assert fields == {
        "gpu_util_mean_pct": None, "gpu_util_peak_pct": None, "power_mean_w": None, "sm_clock_mean_mhz": None,
        "energy_per_sample_j": None, "telemetry_window_s": None, "telemetry_reliable": False,
    }


def test_telemetry_without_a_window_is_not_trusted() -> None:
    # A Telemetry that does not say how long it sampled (an older sampler): no power, no utilisation.
    legacy = SimpleNamespace(samples=30, gpu_util_mean_pct=90.0, gpu_util_peak_pct=99.0, power_mean_w=400.0, sm_clock_mean_mhz=1900.0)
    fields = telemetry_fields(legacy, samples=100, min_window_s=2.0)
    assert fields["telemetry_reliable"] is False and fields["power_mean_w"] is None and fields["energy_per_sample_j"] is None


def test_minimum_window_follows_the_telemetry_module(monkeypatch) -> None:
    monkeypatch.setattr(telemetry_module, "MIN_TELEMETRY_WINDOW_S", 3.5, raising=False)
    assert min_telemetry_window_s() == 3.5
    monkeypatch.delattr(telemetry_module, "MIN_TELEMETRY_WINDOW_S")
    assert min_telemetry_window_s() == 2.0  # before the telemetry module defines it


def _spec(**overrides) -> ProbeSpec:
    return ProbeSpec(model={}, params=TrialParams(), seq_len=32, **{"measure_steps": 8, "max_measure_steps": 20, **overrides})


def test_without_a_minimum_window_the_rule_is_the_plain_one() -> None:
    spec = _spec(target_ci_rel=0.02)
    plain = StopRule(min_steps=8, max_steps=20, max_s=30.0, target_rel=0.02)
    rule = stop_rule(spec)
    assert rule.step_budget == 20
    for series in ([0.1] * 30, [0.1, 0.2] * 15, [0.01] * 30):
        assert steps_until_stop(rule, series) == steps_until_stop(plain, series)


def test_minimum_window_keeps_measuring_past_the_step_cap() -> None:
    rule = stop_rule(_spec(), min_measure_s=2.25)
    assert rule.step_budget == max(20, TELEMETRY_MAX_STEPS)
    # 1/64 s steps, perfectly stable: the plain rule stops at 8; the window needs 144 steps.
    assert steps_until_stop(rule, [1 / 64] * 1000) == 144
    # 0.5 s steps: the window is full after 5, but the minimum step count still holds.
    assert steps_until_stop(rule, [0.5] * 100) == 8
    # Noisy 0.2 s steps: the window is full after 12 steps, then the step cap (20) or stability decides.
    assert steps_until_stop(rule, [0.1, 0.3] * 50) == 20


def test_minimum_window_never_passes_the_time_cap_or_its_step_ceiling() -> None:
    assert steps_until_stop(stop_rule(_spec(max_measure_s=1.0), min_measure_s=2.25), [1 / 64] * 1000) == 64
    tiny = [1e-4] * (TELEMETRY_MAX_STEPS + 500)
    assert steps_until_stop(stop_rule(_spec(), min_measure_s=2.25), tiny) == TELEMETRY_MAX_STEPS
