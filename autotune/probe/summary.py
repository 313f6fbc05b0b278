"""The probe's result from its measurements: throughput over the measured window, its stability, MFU,
input wait, NVML telemetry (reported only over a long enough window), memory, compilations, and the
model's parameter counts."""

from __future__ import annotations

import math
from typing import Any

from autotune.probe.flops import achieved_tflops, mfu
from autotune.probe.memory import CudaBaseline, memory_fields
from autotune.probe.steady import ci95_rel
from autotune.records import INPUT_BOUND_FRACTION, ProbeResult, ProbeSpec, ProbeStatus


def summarise(
    spec: ProbeSpec, callback: Any, start_s: float, device_name: str | None, model_build_s: float | None,
    flops_per_token: float | None, baseline: CudaBaseline | None, matmul_precision: str | None,
) -> ProbeResult:
    """The result of a probe whose training returned: ``diverged``, ``crash`` when it stopped before
    ``measure_steps`` measured steps, else ``ok`` with what ``callback`` measured (``ProbeCallback``)."""
    memory = memory_fields(spec, callback, baseline)
    setup_s = callback.train_begin_s - start_s if callback.train_begin_s else None
    common: dict[str, Any] = {
        "losses": tuple(callback.losses),
        "setup_s": setup_s,
        "model_build_s": model_build_s,
        "model_flops_per_token": flops_per_token,
        "device_name": device_name,
        "matmul_precision": matmul_precision,
        **memory,
    }
    if callback.diverged:
        if callback.diverged_at_step is not None:
            error = f"non-finite loss at step {callback.diverged_at_step}"
        else:
            error = f"non-finite loss at step {len(callback.losses)}: {callback.losses[-1]}"
        return ProbeResult(status=ProbeStatus.DIVERGED, error=error, **common)
    step_times = callback.step_times_s()
    if len(step_times) < spec.measure_steps:
        return ProbeResult(status=ProbeStatus.CRASH, error=f"training stopped after {len(callback.step_end_s)} steps", **common)
    window_s = sum(step_times)
    step_time_s = window_s / len(step_times)
    samples_per_step = spec.params.effective_batch_size
    samples_per_s = samples_per_step / step_time_s
    tokens_per_s = samples_per_s * spec.seq_len
    counted = callback.measured_batches()
    extra: dict[str, Any] = {}
    if counted is not None and counted[0] > 0:  # a user's Trainer: its real batches, padding not counted as tokens
        samples_per_step = round(counted[0] / len(step_times))
        samples_per_s, tokens_per_s = counted[0] / window_s, counted[1] / window_s
        if spec.objective_tokens_per_sample:  # ranked by tokens: sequences of the data's mean length per second
            extra["sequences_per_s_counted"] = samples_per_s
            samples_per_s = tokens_per_s / spec.objective_tokens_per_sample
    wait_fraction = min(callback.measured_fetch_s() / window_s, 1.0) if window_s > 0 else None
    telemetry = telemetry_fields(callback.telemetry, samples_per_step * len(step_times), min_telemetry_window_s())
    return ProbeResult(
        status=ProbeStatus.OK,
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        step_time_s=step_time_s,
        measured_steps=len(step_times),
        step_time_ci95_rel=_finite_or_none(ci95_rel(step_times)),
        stable=callback.rule.is_stable(step_times, callback.reference_step_s()),
        warmup_s=(callback.step_end_s[spec.warmup_steps - 1] - callback.train_begin_s) if spec.warmup_steps else 0.0,
        achieved_tflops=achieved_tflops(flops_per_token, tokens_per_s) if flops_per_token else None,
        mfu=mfu(flops_per_token, tokens_per_s, device_name, spec.params.precision, matmul_precision) if flops_per_token else None,
        **telemetry,
        input_wait_fraction=wait_fraction,
        input_bound=bool(wait_fraction is not None and wait_fraction > INPUT_BOUND_FRACTION),
        extra={"step_times_s": step_times, "torch_threads": _torch_threads(), **_compile_counts(spec, callback), **extra},
        **common,
    )


def parameter_fields(counts: Any) -> dict[str, int | None]:
    """The result's parameter counts (an :class:`autotune.lora.ParameterCounts`, or None before the model was built)."""
    if counts is None:
        return {}
    return {"parameters_total": counts.total, "parameters_trainable": counts.trainable, "parameters_frozen": counts.frozen}


def min_telemetry_window_s() -> float:
    """The shortest window whose NVML power and utilisation means we report (telemetry's constant)."""
    from autotune.probe import telemetry

    return float(getattr(telemetry, "MIN_TELEMETRY_WINDOW_S", 2.0))


def telemetry_fields(telemetry: Any, samples: int, min_window_s: float) -> dict[str, Any]:
    """The result's telemetry fields from the window's :class:`~autotune.probe.telemetry.Telemetry`.

    ``samples``: training samples processed in the window. Energy comes from the GPU's energy counter
    over the window (``energy_j``), not mean power x time: NVML power is a ~1 s average on Hopper, so
    over a short window it mostly reflects the warm-up. Power and utilisation (also averaged over up
    to a second) are reported only for a window of at least ``min_window_s``; the SM clock is an
    instantaneous reading and is always reported.
    """
    sampled = telemetry.samples > 0
    window_s = float(getattr(telemetry, "window_s", 0.0) or 0.0)
    energy_j = getattr(telemetry, "energy_j", None)
    reliable = sampled and window_s >= min_window_s
    return {
        "gpu_util_mean_pct": telemetry.gpu_util_mean_pct if reliable else None,
        "gpu_util_peak_pct": telemetry.gpu_util_peak_pct if reliable else None,
        "power_mean_w": telemetry.power_mean_w if reliable else None,
        "sm_clock_mean_mhz": telemetry.sm_clock_mean_mhz,
        "energy_per_sample_j": energy_j / samples if energy_j is not None and energy_j > 0 and samples > 0 else None,
        "telemetry_window_s": window_s if sampled else None,
        "telemetry_reliable": reliable,
    }


def _compile_counts(spec: ProbeSpec, callback: Any) -> dict[str, int]:
    """Graphs compiled during the warm-up and during the measured window: a compilation inside the
    window would be timed as a slow step, so a compiled probe should show none there."""
    graphs = callback.graphs_at_step
    if not graphs:
        return {}
    at_warmup_end = graphs[spec.warmup_steps - 1] if spec.warmup_steps else 0
    return {"compiled_graphs_warmup": at_warmup_end, "compiled_graphs_measured": graphs[-1] - at_warmup_end}


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
