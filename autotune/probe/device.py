"""The device the probes run on: described in the parent through NVML, measured in the child.

:func:`detect_device` reads NVML, which does not create a CUDA context, so the parent process can
call it and still never initialise CUDA (it then has no GPU state to clean up after a failed probe,
and the probe server it forks from stays CUDA-clean). It resolves the GPU the user means to its
NVML UUID, which is how the parent pins every probe to it. Everything else here runs inside a probe.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import resource
from dataclasses import dataclass
from typing import Any

from autotune.records import DeviceInfo

_log = logging.getLogger(__name__)

# A complete NVML UUID as nvidia-smi -L prints it: GPU-8932f937-d72c-4106-c12f-20bd9faed9f6, or
# MIG-<same shape> for a MIG compute instance (driver R470 and later).
FULL_UUID = re.compile(r"(GPU|MIG)-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_NVML_DEVICE_MIG_ENABLE = 1  # nvmlDeviceGetMigMode's "current mode" when MIG is on


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


def loader_cores(processes: int = 1, host_cpus: int | None = None) -> int:
    """The CPU cores the DataLoader workers of one probe process have: the cores this process may run on
    (its affinity, ``host_cpus`` where given) shared by the ``processes`` that train at once (a probe's
    ranks times the probes running side by side), less the one each training process keeps for itself.
    PyTorch's DataLoader warns past the affinity's count: more workers than cores contend for them."""
    if host_cpus is None:
        host_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, host_cpus // max(1, processes) - 1)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ---- which GPU: CUDA_VISIBLE_DEVICES and cuda:N resolved to an NVML UUID ------------------------


@dataclass(frozen=True)
class VisibleGpu:
    """One device CUDA would enumerate: a whole GPU, or a MIG compute instance on one."""

    uuid: str  # GPU-... or MIG-...: what CUDA_VISIBLE_DEVICES and nvmlDeviceGetHandleByUUID take
    nvml_index: int  # NVML index of the physical GPU (the parent of a MIG instance)
    handle: Any  # NVML handle of the device itself (a MIG device handle for a MIG instance)
    parent_handle: Any  # NVML handle of the physical GPU (the same as handle for a whole GPU)
    name: str  # of the physical GPU

    @property
    def is_mig(self) -> bool:
        return self.uuid.startswith("MIG-")


@dataclass(frozen=True)
class _Physical:
    nvml_index: int
    uuid: str
    handle: Any
    name: str


def _physical_gpus(pynvml: Any) -> list[_Physical]:
    """Every GPU NVML sees, in PCI bus order: CUDA's order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.

    NVML documents no order for its indices, so they are sorted by PCI domain/bus/device here
    (the order nvidia-smi shows); a GPU whose PCI info cannot be read keeps its NVML index's place.
    """
    gpus: list[tuple[tuple[int, int, int, int], _Physical]] = []
    for index in range(int(pynvml.nvmlDeviceGetCount())):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            key = (int(pci.domain), int(pci.bus), int(pci.device), index)
        except Exception:  # noqa: BLE001 - NVML raises its own error classes (unsupported field)
            key = (-1, -1, -1, index)
        gpu = _Physical(index, _text(pynvml.nvmlDeviceGetUUID(handle)), handle, _text(pynvml.nvmlDeviceGetName(handle)))
        gpus.append((key, gpu))
    return [gpu for _, gpu in sorted(gpus, key=lambda pair: pair[0])]


def _mig_devices(pynvml: Any, gpu: _Physical) -> list[VisibleGpu]:
    """The MIG compute instances of one GPU (none when MIG is off or unsupported)."""
    try:
        current_mode, _pending = pynvml.nvmlDeviceGetMigMode(gpu.handle)
        if current_mode != _NVML_DEVICE_MIG_ENABLE:
            return []
        slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu.handle))
    except Exception:  # noqa: BLE001 - not a MIG-capable GPU (NVML raises its own error classes)
        return []
    found = []
    for slot in range(slots):
        try:
            handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
        except Exception:  # noqa: BLE001 - an empty slot is NVML_ERROR_NOT_FOUND
            continue
        found.append(VisibleGpu(_text(pynvml.nvmlDeviceGetUUID(handle)), gpu.nvml_index, handle, gpu.handle, gpu.name))
    return found


def _whole(gpu: _Physical) -> VisibleGpu:
    return VisibleGpu(gpu.uuid, gpu.nvml_index, gpu.handle, gpu.handle, gpu.name)


def _by_prefix(entry: str, candidates: list[VisibleGpu]) -> VisibleGpu | None:
    # CUDA accepts a UUID abbreviated to any prefix that names one GPU (CUDA C++ Programming Guide,
    # "CUDA Environment Variables"); torch.cuda._transform_uuid_to_ordinals does the same.
    matches = [gpu for gpu in candidates if gpu.uuid.lower().startswith(entry.lower())]
    return matches[0] if len(matches) == 1 else None


@dataclass(frozen=True)
class VisibleList:
    """CUDA's device list for a ``CUDA_VISIBLE_DEVICES`` value, as NVML devices."""

    gpus: list[VisibleGpu]
    stopped_at: str | None  # the entry that ended the list early (CUDA ignores it and all after it)
    by_ordinal: bool  # some device was picked by an integer (an order CUDA_DEVICE_ORDER decides)


def visible_gpus(pynvml: Any, visible: str | None) -> VisibleList:
    """The devices CUDA enumerates for ``CUDA_VISIBLE_DEVICES=visible`` (None: unset), in CUDA's order.

    Entries are integers (read in PCI bus order), ``GPU-<uuid>`` or ``MIG-<uuid>`` strings, each
    possibly abbreviated. As in CUDA (CUDA C++ Programming Guide, "CUDA Environment Variables"),
    a negative integer ends the list, and so does an entry naming no device: only the devices
    before it are visible. A repeated device makes the list empty (as torch's
    ``_parse_visible_devices`` models CUDA).
    """
    physical = _physical_gpus(pynvml)
    if visible is None:
        return VisibleList([_whole(gpu) for gpu in physical], None, by_ordinal=True)
    if not visible.strip():
        return VisibleList([], None, by_ordinal=False)  # set and empty: no GPU, on purpose
    whole = [_whole(gpu) for gpu in physical]
    migs: list[VisibleGpu] | None = None
    found: list[VisibleGpu] = []
    by_ordinal = False
    for raw in visible.split(","):
        entry = raw.strip()
        match: VisibleGpu | None = None
        digits = re.match(r"[+-]?\d+", entry)
        if entry.upper().startswith("GPU-"):
            match = _by_prefix(entry, whole)
        elif entry.upper().startswith("MIG-"):
            if migs is None:
                migs = [mig for gpu in physical for mig in _mig_devices(pynvml, gpu)]
            match = _by_prefix(entry, migs)
        elif digits:  # CUDA reads an ordinal like strtoul: "1gpu" is 1
            ordinal = int(digits.group())
            if ordinal < 0:
                return VisibleList(found, None, by_ordinal)
            match = whole[ordinal] if ordinal < len(whole) else None
            by_ordinal = by_ordinal or match is not None
        if match is None:
            return VisibleList(found, entry, by_ordinal)
        if match.uuid in {gpu.uuid for gpu in found}:
            return VisibleList([], entry, by_ordinal)
        found.append(match)
    return VisibleList(found, None, by_ordinal)


def resolve_gpu(pynvml: Any, position: int, visible: str | None, order: str | None = None) -> VisibleGpu | None:
    """The device ``cuda:position`` means under ``CUDA_VISIBLE_DEVICES=visible``, or None when it hides every GPU.

    Raises:
        DeviceError: the position is past the visible list, or an entry of it names no GPU here.
    """
    from autotune.errors import DeviceError

    listed = visible_gpus(pynvml, visible)
    gpus = listed.gpus
    shown = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    if position >= len(gpus):
        if listed.stopped_at is not None:
            raise DeviceError(
                f"{shown}: entry {listed.stopped_at!r} names no GPU here or repeats one, so CUDA sees only "
                f"{len(gpus)} GPU(s) (nvidia-smi -L lists them): fix CUDA_VISIBLE_DEVICES, or use --device cpu"
            )
        if not gpus:
            return None  # "" or "-1": the user hid every GPU on purpose (or NVML sees none)
        raise DeviceError(f"cuda:{position} is past the {len(gpus)} visible GPU(s) ({shown}): use cuda:0 to cuda:{len(gpus) - 1}")
    chosen = gpus[position]
    if listed.by_ordinal and order != "PCI_BUS_ID":
        _warn_if_mixed(pynvml)
    if not chosen.is_mig:
        # A GPU in MIG mode runs CUDA work only in its MIG instances (NVIDIA MIG User Guide, "CUDA
        # Device Enumeration"): one instance (a container given one) is the device; several are a choice.
        physical = _Physical(chosen.nvml_index, chosen.uuid, chosen.handle, chosen.name)
        migs = _mig_devices(pynvml, physical)
        if len(migs) == 1:
            return migs[0]
        if migs:
            raise DeviceError(
                f"{chosen.uuid} is in MIG mode with {len(migs)} MIG devices: put one of them in CUDA_VISIBLE_DEVICES "
                f"(e.g. CUDA_VISIBLE_DEVICES={migs[0].uuid}; nvidia-smi -L lists them)"
            )
    return chosen


_warned: set[str] = set()


def pci_ordinals(uuids: list[str]) -> list[int] | None:
    """The ordinals that name these whole GPUs in ``CUDA_VISIBLE_DEVICES`` under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (their
    places in PCI bus order, the order nvidia-smi numbers them in), or None: a MIG instance (only its UUID names it), a
    UUID NVML does not know, or no NVML. For engines that parse that variable as integers (DeepSpeed's CUDA accelerator
    reads ``nvmlDeviceGetHandleByIndex(int(entry))``)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        order = [gpu.uuid for gpu in _physical_gpus(pynvml)]
    except Exception:  # noqa: BLE001 - no pynvml, no driver: NVML raises its own error classes
        return None
    if not all(uuid in order for uuid in uuids):
        return None
    return [order.index(uuid) for uuid in uuids]


def _warn_if_mixed(pynvml: Any) -> None:
    names = sorted({gpu.name for gpu in _physical_gpus(pynvml)})
    if len(names) < 2:
        # One GPU model: no GPU is faster, and CUDA then numbers them as the PCI bus does in practice
        # (CUDA documents only that fastest-first puts the fastest GPU first).
        return
    message = (
        f"this host mixes GPU models ({', '.join(names)}) and CUDA_DEVICE_ORDER is not PCI_BUS_ID: GPU numbers were read in "
        "PCI bus order (nvidia-smi's), which CUDA's default fastest-first order may not follow; "
        "set CUDA_DEVICE_ORDER=PCI_BUS_ID or name the GPU by UUID in CUDA_VISIBLE_DEVICES"
    )
    if message not in _warned:
        _warned.add(message)
        _log.warning(message)


def _nvml_info(position: int) -> DeviceInfo | None:
    """The GPU ``cuda:position`` means to this process, or None without NVML or a visible GPU.

    Raises:
        DeviceError: ``CUDA_VISIBLE_DEVICES`` or the position names no GPU here.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no GPU: NVML raises its own error classes
        return None
    try:
        gpu = resolve_gpu(
            pynvml, position, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER")
        )
        if gpu is None:
            return None
        name = gpu.name
        if gpu.is_mig:
            try:  # e.g. "NVIDIA A100-SXM4-40GB MIG 1g.5gb": the slice, not the whole card
                name = _text(pynvml.nvmlDeviceGetName(gpu.handle))
            except Exception:  # noqa: BLE001 - NVML raises its own error classes
                pass
        memory = pynvml.nvmlDeviceGetMemoryInfo(gpu.handle)  # a MIG instance reports its own slice
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(gpu.parent_handle)
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return DeviceInfo(
            kind="cuda",
            name=name,
            total_memory_bytes=int(memory.total),
            compute_capability=(int(major), int(minor)),
            driver_version=driver,
            cuda_version=f"{cuda // 1000}.{(cuda % 1000) // 10}",
            index=position,
            uuid=gpu.uuid,
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

    ``cuda:N`` is the N-th GPU this process sees, as in torch: an index into the user's
    ``CUDA_VISIBLE_DEVICES`` when it is set. The GPU is returned with its NVML UUID
    (:attr:`DeviceInfo.uuid`), which the probes are pinned to.

    Raises:
        DeviceError: if CUDA is requested but there is no usable GPU, or the request names no GPU here.
    """
    from autotune.errors import DeviceError

    if not isinstance(requested, str):
        raise DeviceError(f"device {requested!r} is not a device name: use 'auto', 'cuda', 'cuda:N' or 'cpu'")
    if requested == "cpu":
        return _cpu_info()
    match = re.fullmatch(r"cuda(?::([0-9]+))?", requested)  # ASCII digits only: int() would take any Unicode digit
    if requested != "auto" and match is None:
        if requested.lower().startswith(("cuda:", "gpu:")):
            raise DeviceError(f"unknown device {requested!r} (after cuda: comes a GPU number, e.g. cuda:0): use auto, cuda, cuda:N or cpu")
        raise DeviceError(f"unknown device {requested!r}: use auto, cuda, cuda:N or cpu")
    position = int(match.group(1)) if match is not None and match.group(1) else 0
    info = _nvml_info(position)
    if info is not None and _torch_has_cuda():
        return info
    if requested == "auto":
        return _cpu_info()
    if info is not None:
        reason, fix = "the installed torch is a CPU-only build", "install a CUDA build of torch, or use --device cpu"
    elif os.environ.get("CUDA_VISIBLE_DEVICES") is not None and _nvml_gpu_count() > 0:
        reason = f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
        fix = "name a GPU in it (or unset it), or use --device cpu"
    else:
        reason, fix = "no NVIDIA GPU/driver found", "use --device cpu, or install a CUDA build of torch"
    raise DeviceError(f"--device {requested} asked for a GPU but {reason}: {fix}")


def _nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no pynvml, no driver: NVML raises its own error classes
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001 - NVML raises its own error classes
        return 0
    finally:
        pynvml.nvmlShutdown()


# ---- used inside the probe process only -------------------------------------------------------


def cpu_peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB). getrusage, not psutil: psutil has
    no portable peak (its ``peak_wset`` is Windows-only)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# Text of RuntimeErrors that mean the GPU ran out of memory. cuBLAS and cuDNN report a failed
# allocation as their own status, which torch surfaces as a RuntimeError carrying the status name:
# CUDNN_STATUS_ALLOC_FAILED, and cublasCreate's CUBLAS_STATUS_NOT_INITIALIZED, which near the memory
# limit is what an OOM looks like when the handle is created (discuss.pytorch.org/t/125450;
# lm-evaluation-harness#1689). It can also follow a bad index on the GPU, which a probe's
# in-vocabulary tokens do not produce.
_GPU_OOM_MARKERS = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_NOT_INITIALIZED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
)
_HOST_OOM_MARKERS = ("DefaultCPUAllocator: can't allocate memory",)


def is_out_of_memory(exc: BaseException, *, cuda: bool = False) -> bool:
    """Whether an exception raised in a training step means "out of memory" on the probe's device.

    By type first (``torch.OutOfMemoryError``; ``MemoryError`` on a CPU run); by text only for
    backends that raise a plain RuntimeError (cuBLAS/cuDNN allocation failures, the CPU allocator).

    On a CUDA run (``cuda=True``) running out of *host* memory (``MemoryError``, the CPU allocator's
    message) is a crash, not an OOM: an OOM tells the memory model that this batch and every
    larger one of its group do not fit on the GPU, which host memory says nothing about. On a CPU
    run host memory is the device's memory, so it is an OOM, and so is the probe's
    ``SimulatedOutOfMemory`` (a ``MemoryError`` raised at the CPU's simulated ceiling).
    """
    if isinstance(exc, MemoryError):
        return not cuda
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:
        pass
    if isinstance(exc, RuntimeError):
        text = str(exc)
        if any(marker in text for marker in _HOST_OOM_MARKERS):
            return not cuda
        return any(marker in text for marker in _GPU_OOM_MARKERS)
    return False


def nvml_compute_capability(device: object = None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` read from NVML, which does not initialise CUDA: the GPU
    ``device`` (a ``torch.cuda.device``, an index or None: 0) means to this process (:func:`resolve_gpu`)."""
    import pynvml

    index = getattr(device, "idx", device)
    pynvml.nvmlInit()
    try:
        gpu = resolve_gpu(pynvml, 0 if index is None else int(index), os.environ.get("CUDA_VISIBLE_DEVICES"),
                          os.environ.get("CUDA_DEVICE_ORDER"))
        if gpu is None:
            raise RuntimeError("CUDA_VISIBLE_DEVICES hides every GPU")
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(gpu.parent_handle)
    finally:
        pynvml.nvmlShutdown()
    return int(major), int(minor)


def import_bitsandbytes_without_cuda() -> None:
    """bitsandbytes reads every GPU's compute capability when it is imported, through
    ``torch.cuda.get_device_capability``, which initialises CUDA; transformers' Trainer imports peft,
    and peft imports bitsandbytes. So with bitsandbytes installed the server could fork no probe
    (seen on an H100, 2026-11-22: every LoRA probe started cold, 17 s of overhead instead of about 1).
    The probe server (:mod:`autotune.probe.preload`) imports it once with the capability read from
    NVML instead (on that H100: every probe forked, about 1 s of overhead); should that fail, it is
    left to fail the server's CUDA self-test, and probes start cold as before."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return
    import torch

    original = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = nvml_compute_capability  # type: ignore[assignment]
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is reported where it is used, not by the server
        pass
    finally:
        torch.cuda.get_device_capability = original
