"""Is something else using the device? Checked in the parent just before each probe.

A tuner must not rank noise: on a loaded 2-core machine one configuration measured 5.3, 10 and 40
samples/s in three runs. So before every probe the device is looked at, and what was seen is kept
with the trial and shown in the terminal and the report:

* on CUDA, other processes on the GPU (NVML's running compute processes, this run's own probe
  children excepted: none runs between two probes) and its utilisation; NVML only, so the parent
  still never creates a CUDA context;
* on the CPU, how busy the cores are over a short window while this run is idle between probes
  (``/proc/stat``): more than half of them busy is a load above what we leave free. The 1-minute
  load average is the fallback where ``/proc/stat`` is missing; it lags by a minute and still
  counts our own previous probe, so it is not the first choice.
"""

from __future__ import annotations

import os
import time
from typing import Any

# Utilisation of the GPU while no probe of ours runs: above this, someone else is computing on it.
BUSY_GPU_UTIL_PCT = 10.0
BUSY_CPU_FRACTION = 0.5  # share of all cores busy while we are idle
CPU_WINDOW_S = 0.2


def interference(device_uuid: str | None, *, cuda: bool) -> str | None:
    """What else is using the device right now, in a few words, or None when it looks idle."""
    return _gpu_interference(device_uuid) if cuda else _cpu_interference()


def _cpu_interference() -> str | None:
    cores = os.cpu_count() or 1
    before = _cpu_times()
    if before is not None:
        time.sleep(CPU_WINDOW_S)
        after = _cpu_times()
        if after is not None:
            return cpu_busy_reason(before, after, cores)
    try:
        load_1m = os.getloadavg()[0]
    except OSError:  # not every platform has a load average
        return None
    return cpu_load_reason(load_1m, cores)


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores from /proc/stat's first line; None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = [int(v) for v in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy_reason(before: tuple[int, int], after: tuple[int, int], cores: int) -> str | None:
    """``CPU 87% busy on 2 cores`` when more than half of the cores were busy between two readings."""
    total = after[1] - before[1]
    if total <= 0:
        return None
    busy = (after[0] - before[0]) / total
    return f"CPU {100 * busy:.0f}% busy on {cores} cores" if busy > BUSY_CPU_FRACTION else None


def cpu_load_reason(load_1m: float, cores: int) -> str | None:
    """``load 3.2 on 2 cores`` when the 1-minute load average is above the core count."""
    return f"load {load_1m:.1f} on {cores} cores" if load_1m > cores else None


def _gpu_interference(device_uuid: str | None) -> str | None:
    try:
        import pynvml

        from autotune.probe.telemetry import open_device

        handle, _ = open_device(device_uuid)
        processes = _read(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        util = _read(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no driver, no GPU: NVML raises its own error classes
        return None
    return gpu_busy_reason([int(p.pid) for p in processes], util, own_pid=os.getpid())


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
