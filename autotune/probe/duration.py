"""A floor under a probe's wall time before any probe ran: its training FLOPs at the device's peak.

A probe trains ``warmup_steps + measure_steps`` optimizer steps at least. Each step costs the
model FLOPs of :func:`autotune.probe.flops.model_flops_per_token` for every token of its
effective batch, and no device runs them faster than its dense matmul peak: on a GPU the largest
column of :data:`autotune.probe.flops.PEAK_TFLOPS` (whatever the precision), on a CPU the rate a
large fp32 matmul reaches here, timed once. Real training is slower (memory-bound kernels,
optimizer, start-up, compilation), so a floor over the budget says for certain that the probe
cannot finish in it; a floor under it says nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from autotune.params import TrialParams
from autotune.probe.flops import device_peaks, model_flops_per_token

_MATMUL_SIZE = 1024  # a square fp32 matmul large enough to reach a CPU's peak, small enough to time in ~0.1 s
_MATMUL_REPEATS = 6  # the fastest of these counts: a busy moment slows some, none speeds any up
# No device training a model is slower than this: a probe whose FLOPs it would do within the limit cannot be over
# it, so the CPU's peak (a fraction of a second of matmuls) is measured only where the answer may be a warning.
SLOWEST_PEAK_FLOPS_PER_S = 1e9


@dataclass(frozen=True)
class ProbeFloor:
    """The least compute a probe needs: ``flops`` at ``peak_flops_per_s`` (``seconds``), and where the peak came from."""

    flops: float
    peak_flops_per_s: float
    peak_source: str  # "measured" (a CPU matmul here) or "datasheet" (PEAK_TFLOPS)

    @property
    def seconds(self) -> float:
        return self.flops / self.peak_flops_per_s


def probe_flops(model: Any, seq_len: int, params: TrialParams, steps: int, *, counts: Any = None) -> float:
    """The model FLOPs of ``steps`` optimizer steps of ``params`` on ``model`` (a ModelSpec) at ``seq_len``.

    The matmul parameters are the model's less its input embedding table (a tied output projection is
    then left out too: the figure stays a floor); ``counts`` (an :class:`autotune.lora.ParameterCounts`)
    gives the total and the frozen ones of a LoRA model.
    """
    from autotune.models import count_parameters

    total = counts.total if counts is not None else count_parameters(model)
    frozen = counts.total - counts.trainable if counts is not None else 0
    matmul = max(total - model.vocab_size * model.hidden_size, 0)
    per_token = model_flops_per_token(matmul, model.num_layers, model.num_attention_heads, model.head_dim, seq_len,
                                      frozen_params=min(frozen, matmul))
    return max(per_token, 0.0) * seq_len * params.effective_batch_size * steps


def peak_flops_per_s(device: Any) -> tuple[float, str] | None:
    """The fastest the device (a :class:`autotune.records.DeviceInfo`) multiplies matrices, and where that figure
    comes from; None for a GPU the datasheet table does not know."""
    if device.is_cuda:
        peaks = device_peaks(device.name)
        return (max(peaks.values()) * 1e12, "datasheet") if peaks else None
    return cpu_matmul_flops_per_s(), "measured"


def cpu_matmul_flops_per_s() -> float:
    """The FLOP/s of the fastest of a few 1024x1024 fp32 matmuls on this CPU, with torch's threads (~0.1-0.5 s)."""
    import torch

    a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE)
    b = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE)
    torch.mm(a, b)  # the first call allocates and picks kernels
    fastest_s = float("inf")
    for _ in range(_MATMUL_REPEATS):
        start_s = time.perf_counter()
        torch.mm(a, b)
        fastest_s = min(fastest_s, time.perf_counter() - start_s)
    return 2.0 * _MATMUL_SIZE**3 / max(fastest_s, 1e-9)


def probe_floor(model: Any, device: Any, seq_len: int, params: TrialParams, steps: int, *, counts: Any = None,
                within_s: float | None = None) -> ProbeFloor | None:
    """The compute floor of one probe; None where the device's peak is unknown, or where even
    :data:`SLOWEST_PEAK_FLOPS_PER_S` would do its FLOPs within ``within_s`` (then no peak is measured)."""
    flops = probe_flops(model, seq_len, params, steps, counts=counts)
    if within_s is not None and flops / SLOWEST_PEAK_FLOPS_PER_S <= within_s:
        return None
    peak = peak_flops_per_s(device)
    return ProbeFloor(flops, *peak) if peak is not None else None


def tightest_limit(budget_s: float | None, trial_timeout_s: float) -> tuple[float, str]:
    """What bounds one probe first, in seconds, and its name: the probe deadline or the run's budget."""
    limits = [(trial_timeout_s, "probe deadline (--trial-timeout)")]
    if budget_s is not None:
        limits.append((budget_s, "budget"))
    return min(limits)


def cannot_finish_warning(floor: ProbeFloor | None, what: str, budget_s: float | None, trial_timeout_s: float) -> str | None:
    """One line when a probe of ``floor`` (``what``: which probe, for the sentence) cannot finish within the run's
    budget or a probe's deadline, naming the fix; None when it may."""
    from autotune.units import format_duration

    if floor is None:
        return None
    limit_s, limit = tightest_limit(budget_s, trial_timeout_s)
    if floor.seconds <= limit_s:
        return None
    rate = (f"{floor.peak_flops_per_s / 1e9:,.0f} GFLOP/s, this CPU's matmul peak" if floor.peak_source == "measured"
            else f"{floor.peak_flops_per_s / 1e12:,.0f} TFLOP/s, the device's datasheet peak")
    return (f"{what} needs at least {format_duration(floor.seconds)} of compute ({floor.flops:.2g} FLOPs at {rate}), "
            f"over the {format_duration(limit_s)} {limit}: it will time out; raise --budget and --trial-timeout, "
            f"or tune a smaller model, a shorter --seq-len or {'on a GPU' if floor.peak_source == 'measured' else 'with --peft lora'}")
