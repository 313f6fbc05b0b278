"""Is something else using the device? Checked in the parent just before each probe.

A tuner must not rank noise: on a loaded 2-core machine one configuration measured 5.3, 10 and 40
samples/s in three runs. So before every probe the device is looked at, and what was seen is kept
with the trial and shown in the terminal and the report:

* on CUDA, other processes on the GPU (NVML's running compute processes, this run's own probe
  children excepted: none runs between two probes) and its utilisation since our previous probe
  ended (NVML's utilisation samples taken after it, not its rolling reading: with the probe server a
  probe starts a fraction of a second after the last one, whose kernels that reading still counts;
  on an H100, 2026-11-22, it flagged 11 of 17 of a LoRA run's probes "busy" on an otherwise idle
  GPU); NVML only, so the parent still never creates a CUDA context;
* on the CPU, how busy the cores are over a short window while this run is idle between probes
  (psutil's ``cpu_percent``, iowait counted as idle): more than half of them busy is a load above
  what we leave free. Not the load average: it lags by a minute and still counts our own previous
  probe.
"""

from __future__ import annotations

import os
from typing import Any

import psutil

# Utilisation of the GPU while no probe of ours runs: above this, someone else is computing on it.
BUSY_GPU_UTIL_PCT = 10.0
BUSY_CPU_FRACTION = 0.5  # share of all cores busy while we are idle
CPU_WINDOW_S = 0.2
# NVML samples utilisation over periods of 1/6 s to 1 s (per GPU); one that ends this soon after our
# previous probe may still cover its last kernels, so it is not read as someone else's work.
UTIL_SETTLE_S = 0.5


def interference(device_uuid: str | None, *, cuda: bool, idle_since_s: float | None = None) -> str | None:
    """What else is using the device right now, in a few words, or None when it looks idle.

    ``idle_since_s``: when this run's previous probe ended (``time.time()``), None before the first;
    the GPU's utilisation is then read only from what NVML sampled after it.
    """
    return _gpu_interference(device_uuid, idle_since_s) if cuda else _cpu_interference()


def _cpu_interference() -> str | None:
    return cpu_busy_reason(psutil.cpu_percent(interval=CPU_WINDOW_S), psutil.cpu_count() or 1)


def cpu_busy_reason(busy_pct: float, cores: int) -> str | None:
    """``CPU 87% busy on 2 cores`` when more than half of all cores' time was busy."""
    return f"CPU {busy_pct:.0f}% busy on {cores} cores" if busy_pct > 100 * BUSY_CPU_FRACTION else None


def _gpu_interference(device_uuid: str | None, idle_since_s: float | None) -> str | None:
    try:
        import pynvml

        from autotune.probe.telemetry import open_device

        handle, _ = open_device(device_uuid)
        processes = _read(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        if idle_since_s is None:
            util = _read(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        else:
            since_us = int(idle_since_s * 1e6)
            got = _read(lambda: pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, since_us))
            samples = [(int(s.timeStamp), float(s.sampleValue.uiVal)) for s in got[1]] if got else []
            util = utilisation_after(samples, idle_since_s)
    except Exception:  # noqa: BLE001 - no driver, no GPU: NVML raises its own error classes
        return None
    return gpu_busy_reason([int(p.pid) for p in processes], util, own_pid=os.getpid())


def utilisation_after(samples: list[tuple[int, float]], idle_since_s: float) -> float | None:
    """The mean GPU utilisation (%) of NVML's ``(timestamp_us, value)`` samples taken more than
    :data:`UTIL_SETTLE_S` after ``idle_since_s``; None when there are none yet (a probe that starts
    right after the last one: then only other processes on the GPU tell)."""
    after_us = (idle_since_s + UTIL_SETTLE_S) * 1e6
    values = [value for stamp_us, value in samples if stamp_us > after_us]
    return sum(values) / len(values) if values else None


def gpu_busy_reason(pids: list[int], util_pct: float | None, *, own_pid: int) -> str | None:
    """``2 other processes on the GPU, 85% utilised`` from NVML's readings (None when idle)."""
    others = [pid for pid in pids if pid != own_pid]
    words = []
    if others:
        words.append(f"{len(others)} other process{'es' if len(others) != 1 else ''} on the GPU")
    if util_pct is not None and util_pct > BUSY_GPU_UTIL_PCT:
        words.append(f"{util_pct:.0f}% utilised before the probe")
    return ", ".join(words) or None


def _read(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a reading this GPU (or MIG slice) does not give
        return None
