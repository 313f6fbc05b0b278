"""The device the probes run on: described in the parent through NVML, measured in the child.

:func:`detect_device` reads NVML, which does not create a CUDA context, so the parent process can
call it and still never initialise CUDA (it then has no GPU state to clean up after a failed probe,
and the probe server it forks from stays CUDA-clean). Everything else here runs inside a probe.
"""

from __future__ import annotations

import os
import platform
import resource

from autotune.records import DeviceInfo


def _cpu_info() -> DeviceInfo:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceInfo(kind="cpu", name=f"CPU: {name} ({os.cpu_count()} cores)", total_memory_bytes=int(total))


def _nvml_info(index: int) -> DeviceInfo | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no GPU: NVML raises its own error classes
        return None
    try:
        if pynvml.nvmlDeviceGetCount() <= index:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return DeviceInfo(
            kind="cuda",
            name=name,
            total_memory_bytes=int(memory.total),
            compute_capability=(int(major), int(minor)),
            driver_version=driver,
            cuda_version=f"{cuda // 1000}.{(cuda % 1000) // 10}",
            index=index,
        )
    finally:
        pynvml.nvmlShutdown()


def _torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build (checked without initialising CUDA)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None


def detect_device(requested: str = "auto") -> DeviceInfo:
    """Describe the device to tune on: ``auto`` (CUDA if present, else CPU), ``cuda[:N]`` or ``cpu``.

    Raises:
        DeviceError: if CUDA is requested but there is no usable GPU.
    """
    from autotune.errors import DeviceError

    if requested == "cpu":
        return _cpu_info()
    index = int(requested.split(":", 1)[1]) if requested.startswith("cuda:") else 0
    if requested not in ("auto", "cuda") and not requested.startswith("cuda:"):
        raise DeviceError(f"unknown device {requested!r}: use auto, cuda, cuda:N or cpu")
    info = _nvml_info(index)
    if info is not None and _torch_has_cuda():
        return info
    if requested == "auto":
        return _cpu_info()
    reason = "no NVIDIA GPU/driver found" if info is None else "the installed torch is a CPU-only build"
    raise DeviceError(f"--device {requested} asked for a GPU but {reason}: use --device cpu, or install a CUDA build of torch")


# ---- used inside the probe process only -------------------------------------------------------


def cpu_peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def cpu_current_rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return cpu_peak_rss_bytes()


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception raised in a training step means "out of memory".

    By type first (``torch.OutOfMemoryError``, ``MemoryError``); by text only for backends that
    raise a plain RuntimeError (the CPU allocator, cuBLAS/cuDNN workspace failures).
    """
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:
        pass
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(
            marker in text
            for marker in (
                "out of memory",
                "CUBLAS_STATUS_ALLOC_FAILED",
                "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
                "DefaultCPUAllocator: can't allocate memory",
            )
        )
    return False
