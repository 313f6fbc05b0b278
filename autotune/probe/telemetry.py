"""NVML telemetry of the probe's GPU: memory used, and utilisation, power, SM clock and energy over a window.

Runs inside the probe process only. Without NVML (the CPU, no driver) every reading is None. The
GPU is found by its NVML UUID, the one the parent put in ``CUDA_VISIBLE_DEVICES`` (see
:func:`autotune.probe.isolation.child_env`), so NVML reads the very GPU (or MIG instance) CUDA runs on.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

# Shortest sampled window whose power and utilisation mean something. On Ampere (but GA100) and
# later, Hopper included, nvmlDeviceGetPowerUsage returns the average over the last 1 s, and
# utilisation is the busy share over a sample period of 1/6 s to 1 s (NVML API Reference,
# nvmlDeviceGetPowerUsage, nvmlUtilization_t): a window under 2 s is mostly the ramp into it.
MIN_TELEMETRY_WINDOW_S = 2.0


def probe_device_uuid() -> str | None:
    """NVML UUID of this process's CUDA device (a rank's own, else device 0), or None without NVML or a visible GPU.

    The parent pins each probe with ``CUDA_VISIBLE_DEVICES=<uuid>``; a child started by hand
    (``python -m autotune.probe.child``) may have integers or abbreviated UUIDs there, resolved the
    way the parent resolves them. Needs NVML initialised.
    """
    import pynvml

    from autotune.probe.device import FULL_UUID, resolve_gpu
    from autotune.probe.ranks import local_rank

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = local_rank()  # a rank of a multi-process probe reads its own GPU of the probe's
    entries = (visible or "").split(",")
    mine = entries[index].strip() if index < len(entries) else ""
    if FULL_UUID.fullmatch(mine):
        return mine
    gpu = resolve_gpu(pynvml, index, visible, os.environ.get("CUDA_DEVICE_ORDER"))
    return gpu.uuid if gpu is not None else None


_handle_cache: dict[str, tuple[Any, Any]] = {}  # uuid -> (the pynvml module it came from, its handle)


def open_device(uuid: str | None = None) -> tuple[Any, str]:
    """Initialise NVML and open the probe's device by UUID (this process's CUDA device 0 by default).

    Returns:
        The NVML handle (a MIG device handle for a MIG UUID) and the UUID.

    Raises:
        Exception: NVML's own errors (no driver, unknown UUID), or LookupError with no visible GPU.
    """
    import pynvml

    pynvml.nvmlInit()  # reference-counted by NVML: cheap after the first call
    uuid = uuid or probe_device_uuid()
    if uuid is None:
        raise LookupError("no visible GPU")
    cached = _handle_cache.get(uuid)
    if cached is not None and cached[0] is pynvml:
        return cached[1], uuid
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)  # accepts GPU and MIG UUIDs (NVML API Reference)
    _handle_cache[uuid] = (pynvml, handle)
    return handle, uuid


def memory_used_bytes(pynvml: Any, handle: Any) -> int:
    """Device memory in use: NVML's v2 figure where the driver has it, else v1's.

    v1's ``used`` counts the memory the driver and firmware set aside, which no allocation of ours
    can use or free; v2 reports that apart as ``reserved`` and leaves it out of ``used`` (NVML API
    Reference, nvmlMemory_v2_t). Drivers and pynvml releases without v2 raise, and v1 answers.
    """
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=version).used)
        except Exception:  # noqa: BLE001 - NVML_ERROR_FUNCTION_NOT_FOUND / ARGUMENT_VERSION_MISMATCH: v1 answers
            pass
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def nvml_used_bytes(uuid: str | None = None) -> int | None:
    """Memory used on the whole GPU (or MIG instance) according to NVML: context, workspaces and allocator included."""
    try:
        import pynvml

        handle, _ = open_device(uuid)
        return memory_used_bytes(pynvml, handle)
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
    # The change of the GPU's energy counter over the window; None where it has none (before Volta,
    # a MIG instance) or it went backwards (a driver reload resets it).
    energy_j: float | None = None
    window_s: float = 0.0  # from start() to stop(); compare with MIN_TELEMETRY_WINDOW_S


class NvmlSampler:
    """Samples utilisation, memory used, power and SM clock on a background thread, and energy at both ends.

    NVML queries take tens of microseconds and release the GIL, so a 20 Hz sampler does not
    disturb the training loop it watches. ``start()`` opens the window, ``stop()`` closes it and
    returns the :class:`Telemetry`; without NVML (the CPU) it records nothing but the window.

    On a MIG instance only memory and the SM clock are read: NVML does not report utilisation
    there (NVML API Reference, nvmlDeviceGetUtilizationRates), and power and energy belong to the
    whole GPU, shared with the other instances, so they would not be this probe's.
    """

    def __init__(self, uuid: str | None = None, interval_s: float = 0.05) -> None:
        self.uuid = uuid  # None: this process's CUDA device 0, found when start() runs
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rows: list[tuple[float | None, float | None, float | None, int | None]] = []
        self._handle: Any = None
        self._mig = False
        self._start_s: float | None = None
        self._energy_start_mj: int | None = None

    def start(self) -> bool:
        """Start sampling; returns False (and samples nothing) when NVML is not available."""
        self._start_s = time.monotonic()
        try:
            self._handle, self.uuid = open_device(self.uuid)
        except Exception:  # noqa: BLE001 - no driver, no GPU: NVML raises its own error classes
            return False
        self._mig = self.uuid.startswith("MIG-")
        self._energy_start_mj = self._energy_mj()
        self._thread = threading.Thread(target=self._run, name="autotune-nvml", daemon=True)
        self._thread.start()
        return True

    @staticmethod
    def _read(fn: Any) -> Any:
        try:
            return fn()
        except Exception:  # noqa: BLE001 - a field this GPU does not report (NVML raises its own error classes)
            return None

    def _energy_mj(self) -> int | None:
        import pynvml

        if self._mig:
            return None
        value = self._read(lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))  # mJ since driver load
        return int(value) if value is not None else None

    def _sample(self) -> None:
        import pynvml

        read = self._read
        util = None if self._mig else read(lambda: pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        power_mw = None if self._mig else read(lambda: pynvml.nvmlDeviceGetPowerUsage(self._handle))
        clock = read(lambda: pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM))
        used = read(lambda: memory_used_bytes(pynvml, self._handle))
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
        window_s = time.monotonic() - self._start_s if self._start_s is not None else 0.0
        if self._thread is None:
            return Telemetry(samples=0, window_s=window_s)
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()
        end_mj = self._energy_mj()
        start_mj = self._energy_start_mj
        energy_j = (end_mj - start_mj) / 1000.0 if end_mj is not None and start_mj is not None and end_mj >= start_mj else None
        return replace(summarise_telemetry(self._rows), energy_j=energy_j, window_s=window_s)


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
