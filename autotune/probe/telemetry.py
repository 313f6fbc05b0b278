"""NVML telemetry of the probe's GPU: memory used, and utilisation, power and SM clock over a window.

Runs inside the probe process only. Without NVML (the CPU, no driver) every reading is None.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any


def nvml_index() -> int:
    """The NVML index of this process's GPU.

    NVML numbers GPUs physically and ignores ``CUDA_VISIBLE_DEVICES``, which the parent sets to one
    physical index for each probe; CUDA's device 0 in the child is that GPU.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def nvml_used_bytes(index: int | None = None) -> int | None:
    """Memory used on the whole GPU according to NVML (context, workspaces and allocator included)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index() if index is None else index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # noqa: BLE001 - NVML raises its own error classes (no driver, no GPU, unsupported field)
        return None


@dataclass(frozen=True)
class Telemetry:
    """NVML samples over a window: means and peaks (None where the GPU does not report it)."""

    samples: int
    gpu_util_mean_pct: float | None = None
    gpu_util_peak_pct: float | None = None
    power_mean_w: float | None = None
    sm_clock_mean_mhz: float | None = None
    mem_used_peak_bytes: int | None = None


class NvmlSampler:
    """Samples utilisation, memory used, power and SM clock on a background thread.

    NVML queries take tens of microseconds and release the GIL, so a 20 Hz sampler does not
    disturb the training loop it watches. ``start()`` opens the window, ``stop()`` closes it and
    returns the :class:`Telemetry`; without NVML (the CPU) it records nothing.
    """

    def __init__(self, index: int | None = None, interval_s: float = 0.05) -> None:
        self.index = nvml_index() if index is None else index
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rows: list[tuple[float | None, float | None, float | None, int | None]] = []
        self._handle: Any = None

    def start(self) -> bool:
        """Start sampling; returns False (and samples nothing) when NVML is not available."""
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception:  # noqa: BLE001 - no driver, no GPU: NVML raises its own error classes
            return False
        self._thread = threading.Thread(target=self._run, name="autotune-nvml", daemon=True)
        self._thread.start()
        return True

    def _sample(self) -> None:
        import pynvml

        def read(fn: Any) -> Any:
            try:
                return fn()
            except Exception:  # noqa: BLE001 - a field this GPU does not report (NVML raises its own error classes)
                return None

        util = read(lambda: pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        power_mw = read(lambda: pynvml.nvmlDeviceGetPowerUsage(self._handle))
        clock = read(lambda: pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM))
        used = read(lambda: pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        self._rows.append((
            float(util) if util is not None else None,
            power_mw / 1000.0 if power_mw is not None else None,
            float(clock) if clock is not None else None,
            int(used) if used is not None else None,
        ))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def stop(self) -> Telemetry:
        """Stop sampling (one last sample first) and summarise the window."""
        if self._thread is None:
            return Telemetry(samples=0)
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()
        return summarise_telemetry(self._rows)


def summarise_telemetry(rows: list[tuple[float | None, float | None, float | None, int | None]]) -> Telemetry:
    """Means and peaks of (util %, power W, SM clock MHz, memory used B) rows, ignoring missing values."""

    def column(i: int) -> list[Any]:
        return [row[i] for row in rows if row[i] is not None]

    util, power, clock, used = column(0), column(1), column(2), column(3)
    return Telemetry(
        samples=len(rows),
        gpu_util_mean_pct=sum(util) / len(util) if util else None,
        gpu_util_peak_pct=max(util) if util else None,
        power_mean_w=sum(power) / len(power) if power else None,
        sm_clock_mean_mhz=sum(clock) / len(clock) if clock else None,
        mem_used_peak_bytes=max(used) if used else None,
    )
