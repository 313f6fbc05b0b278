"""The probe's CUDA memory accounting: what the process uses outside the caching allocator, the cap
the allocator gets under the ceiling, and the peak memory reported against that ceiling (pure
functions of NVML and allocator readings), plus the result's memory fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.records import ProbeSpec

# Device memory the process still takes outside the caching allocator after its baseline is measured:
# kernels loaded on first use (CUDA lazy loading, the default since CUDA 12.2: CUDA C++ Programming
# Guide, "Lazy Loading"), cuBLASLt/cuDNN handles and the workspaces cuBLAS takes with cudaMallocAsync
# outside PyTorch's allocator for new streams and shapes (CUDA >= 12.2, pytorch#124250), the Triton
# kernels of a compiled model. The allocator's cap leaves this much room for it under the ceiling.
NON_ALLOCATOR_HEADROOM_BYTES = 256 * 2**20


def non_allocator_bytes(used_before_cuda_bytes: int | None, used_after_init_bytes: int | None, reserved_bytes: int) -> int | None:
    """Device memory this process uses outside the caching allocator: NVML's used memory after CUDA
    init and a first matmul, less NVML's before CUDA init (other processes, driver reservations), less
    what the allocator holds (``torch.cuda.memory_reserved()``). That is the context, the library
    handles and the kernels loaded so far. None without NVML."""
    if used_before_cuda_bytes is None or used_after_init_bytes is None:
        return None
    return max(used_after_init_bytes - used_before_cuda_bytes - reserved_bytes, 0)


def allocator_cap_bytes(
    ceiling_bytes: int, used_before_cuda_bytes: int | None, non_allocator: int | None,
    headroom_bytes: int = NON_ALLOCATOR_HEADROOM_BYTES,
) -> int:
    """What the caching allocator may reserve so the whole device stays under ``ceiling_bytes``: the
    ceiling less what was used before this process (NVML counts it in the peak too), less this
    process's memory outside the allocator, less headroom for what it takes later."""
    return max(ceiling_bytes - (used_before_cuda_bytes or 0) - (non_allocator or 0) - headroom_bytes, 0)


def reported_peak_bytes(
    nvml_peak_bytes: int | None, used_before_cuda_bytes: int | None, non_allocator: int | None, max_reserved_bytes: int
) -> int:
    """Peak device memory, as the ceiling is checked against: NVML's peak over the probe, or the
    allocator's peak reserved plus what NVML saw outside it, whichever is larger (NVML is sampled,
    so it can miss the allocator's peak between two samples)."""
    accounted = (used_before_cuda_bytes or 0) + (non_allocator or 0) + max_reserved_bytes
    return max(nvml_peak_bytes or 0, accounted)


@dataclass(frozen=True)
class CudaBaseline:
    """Device memory around CUDA init: NVML's used before this process's context, and this process's
    memory outside the caching allocator after init and a first matmul (None without NVML)."""

    used_before_cuda_bytes: int | None
    non_allocator_bytes: int | None


def memory_fields(spec: ProbeSpec, callback: Any, baseline: CudaBaseline | None) -> dict[str, Any]:
    import torch

    from autotune.probe.device import cpu_peak_rss_bytes

    if spec.device.startswith("cuda") and torch.cuda.is_initialized():
        reserved = int(torch.cuda.max_memory_reserved())
        device_used = callback.peak_device_used_bytes if callback else None
        sampled = callback.telemetry.mem_used_peak_bytes if callback else None
        if sampled is not None:
            device_used = max(sampled, device_used or 0)
        used_before = baseline.used_before_cuda_bytes if baseline else None
        outside = baseline.non_allocator_bytes if baseline else None
        retries = torch.cuda.memory_stats().get("num_alloc_retries")
        return {
            "host_peak_rss_bytes": cpu_peak_rss_bytes(),
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": reserved,
            "peak_device_used_bytes": device_used,
            "non_allocator_bytes": outside,
            "num_alloc_retries": int(retries) if retries is not None else None,
            # The ceiling is checked against what runs out: the whole device, context included.
            "peak_mem_bytes": reported_peak_bytes(device_used, used_before, outside, reserved),
        }
    peak = cpu_peak_rss_bytes()
    return {"peak_mem_bytes": peak, "host_peak_rss_bytes": peak}
