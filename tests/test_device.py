"""Which GPU the user means (CUDA_VISIBLE_DEVICES, cuda:N) resolved to an NVML UUID against a fake
pynvml, the DeviceInfo record, and what counts as out of memory."""

from __future__ import annotations

import logging
import os
import sys
import types
from dataclasses import dataclass, field

import pytest

from autotune.errors import DeviceError
from autotune.probe import device
from autotune.probe.device import detect_device, is_out_of_memory
from autotune.records import DeviceInfo
from autotune.units import GiB


def gpu_uuid(index: int) -> str:
    """A complete NVML UUID, distinct from the others in its first characters."""
    return f"GPU-{index:x}{index:x}0a0b0c-1111-2222-3333-{index:012x}"


def mig_uuid(gpu: int, slot: int) -> str:
    return f"MIG-{gpu:x}{slot:x}7e57a1-4444-5555-6666-{16 * gpu + slot:012x}"


class NVMLError(Exception):
    """What pynvml raises: its own class, not an OSError."""


@dataclass
class FakeNvml:
    """A host's GPUs as NVML sees them. Handles are ("gpu", nvml_index) or ("mig", nvml_index, slot)."""

    names: list[str] = field(default_factory=lambda: ["NVIDIA H100 80GB HBM3"] * 4)
    pci_bus: list[int] | None = None  # per NVML index; default: NVML's order is PCI order
    migs: dict[int, int] = field(default_factory=dict)  # nvml_index -> MIG instances on it (MIG mode on)
    reserved_bytes: int = 512 * 2**20  # set aside by the driver: in v1's used, not in v2's
    has_memory_v2: bool = True
    used_bytes: int = 10 * GiB

    def module(self) -> types.ModuleType:
        fake = types.ModuleType("pynvml")
        fake.NVMLError = NVMLError
        fake.NVML_CLOCK_SM = 1
        fake.nvmlInit = lambda: None
        fake.nvmlShutdown = lambda: None
        fake.nvmlDeviceGetCount = lambda: len(self.names)
        fake.nvmlDeviceGetHandleByIndex = lambda index: ("gpu", index)
        fake.nvmlDeviceGetHandleByUUID = self.handle_by_uuid
        fake.nvmlDeviceGetUUID = self.uuid
        fake.nvmlDeviceGetName = self.name
        fake.nvmlDeviceGetPciInfo = lambda handle: types.SimpleNamespace(
            domain=0, bus=(self.pci_bus or list(range(len(self.names))))[handle[1]], device=0
        )
        fake.nvmlDeviceGetMemoryInfo = self.memory
        if self.has_memory_v2:
            fake.nvmlMemory_v2 = 0x02000028
        fake.nvmlDeviceGetCudaComputeCapability = lambda handle: self.gpu_only(handle, (9, 0))
        fake.nvmlSystemGetDriverVersion = lambda: "580.65.06"
        fake.nvmlSystemGetCudaDriverVersion = lambda: 13000
        fake.nvmlDeviceGetMigMode = lambda handle: [1, 1] if self.gpu_only(handle, handle[1]) in self.migs else [0, 0]
        fake.nvmlDeviceGetMaxMigDeviceCount = lambda handle: 7
        fake.nvmlDeviceGetMigDeviceHandleByIndex = self.mig_handle
        return fake

    def uuid(self, handle: tuple) -> str:
        return gpu_uuid(handle[1]) if handle[0] == "gpu" else mig_uuid(handle[1], handle[2])

    def all_handles(self) -> list[tuple]:
        gpus = [("gpu", i) for i in range(len(self.names))]
        return gpus + [("mig", i, slot) for i, count in self.migs.items() for slot in range(count)]

    def handle_by_uuid(self, uuid: str) -> tuple:
        for handle in self.all_handles():
            if self.uuid(handle) == uuid:  # NVML takes the whole UUID, never a prefix
                return handle
        raise NVMLError("Not Found")

    def name(self, handle: tuple) -> str:
        base = self.names[handle[1]]
        return base if handle[0] == "gpu" else f"{base} MIG 1g.10gb"

    def memory(self, handle: tuple, version: int | None = None) -> types.SimpleNamespace:
        total = 80 * GiB if handle[0] == "gpu" else 10 * GiB
        if version is None:
            return types.SimpleNamespace(total=total, used=self.used_bytes + self.reserved_bytes)
        if not self.has_memory_v2:
            raise NVMLError("Function Not Found")
        return types.SimpleNamespace(total=total, used=self.used_bytes, reserved=self.reserved_bytes)

    @staticmethod
    def gpu_only(handle: tuple, value):
        if handle[0] != "gpu":
            raise NVMLError("Not Supported")
        return value

    def mig_handle(self, handle: tuple, slot: int) -> tuple:
        if slot >= self.migs.get(handle[1], 0):
            raise NVMLError("Not Found")
        return ("mig", handle[1], slot)


@pytest.fixture
def host(monkeypatch) -> FakeNvml:
    """Four H100s behind a fake pynvml, a CUDA build of torch, and no CUDA_* variables set."""
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monkeypatch.setattr(device, "_torch_has_cuda", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setattr(device, "_warned", set())
    return fake


def use(monkeypatch, fake: FakeNvml) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())


def test_unset_visible_devices_cuda_n_is_the_nth_gpu(host) -> None:
    assert detect_device("cuda").uuid == gpu_uuid(0)
    info = detect_device("cuda:2")
    assert info.uuid == gpu_uuid(2) and info.index == 2 and info.is_cuda and not info.is_mig
    assert info.compute_capability == (9, 0) and info.cuda_version == "13.0" and info.total_memory_bytes == 80 * GiB


def test_a_pinned_integer_is_that_physical_gpu(host, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    info = detect_device("cuda")
    assert info.uuid == gpu_uuid(3)
    assert info.index == 0  # cuda:0 of this process, as torch would number it
    assert detect_device("auto").uuid == gpu_uuid(3)


def test_integers_are_read_in_pci_bus_order(host, monkeypatch) -> None:
    host.pci_bus = [0x3B, 0x18, 0x86, 0xAF]  # NVML index 1 sits first on the bus
    use(monkeypatch, host)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert detect_device("cuda").uuid == gpu_uuid(1)


def test_a_gpu_uuid_and_an_abbreviated_one(host, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(2))
    assert detect_device("cuda").uuid == gpu_uuid(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(1)[:8])  # "GPU-110a": unique, as CUDA accepts
    assert detect_device("cuda").uuid == gpu_uuid(1)


def test_cuda_n_indexes_the_visible_list(host, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert detect_device("cuda:1").uuid == gpu_uuid(0)
    assert detect_device("cuda:0").uuid == gpu_uuid(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpu_uuid(3)},{gpu_uuid(1)}")
    assert detect_device("cuda:1").uuid == gpu_uuid(1)


def test_a_mig_uuid_is_that_mig_instance(host, monkeypatch) -> None:
    host.migs = {1: 2}
    use(monkeypatch, host)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig_uuid(1, 1))
    info = detect_device("cuda")
    assert info.uuid == mig_uuid(1, 1) and info.is_mig
    assert info.total_memory_bytes == 10 * GiB  # the slice, not the card
    assert info.name.endswith("MIG 1g.10gb") and info.compute_capability == (9, 0)  # from the parent GPU


def test_a_gpu_in_mig_mode_is_its_one_instance_or_an_error(host, monkeypatch) -> None:
    host.migs = {0: 1}
    use(monkeypatch, host)
    assert detect_device("cuda").uuid == mig_uuid(0, 0)  # e.g. a container given one MIG slice
    host.migs = {0: 3}
    use(monkeypatch, host)
    with pytest.raises(DeviceError, match="MIG mode with 3 MIG devices: put one of them in CUDA_VISIBLE_DEVICES"):
        detect_device("cuda")


def test_an_index_past_the_visible_list_is_one_line(host, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    with pytest.raises(DeviceError) as error:
        detect_device("cuda:2")
    assert "cuda:2 is past the 2 visible GPU(s)" in str(error.value) and "use cuda:0 to cuda:1" in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("visible", ["GPU-deadbeef", "0,7", "1,1", "0,nope"])
def test_an_entry_naming_no_gpu_is_named_in_the_error(host, monkeypatch, visible) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    position = 0 if visible == "GPU-deadbeef" else 1  # CUDA keeps the devices before a bad entry
    with pytest.raises(DeviceError, match="names no GPU here or repeats one") as error:
        detect_device(f"cuda:{position}")
    assert "\n" not in str(error.value)
    if visible == "0,7":
        assert detect_device("cuda:0").uuid == gpu_uuid(0)


def test_hidden_gpus_mean_the_cpu_for_auto_and_an_error_for_cuda(host, monkeypatch) -> None:
    for hidden in ("", "-1", "-1,0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert detect_device("auto").kind == "cpu"
        with pytest.raises(DeviceError, match="hides every GPU"):
            detect_device("cuda")


def test_a_malformed_device_is_one_line(host) -> None:
    for bad in ("cuda:x", "gpu", "cuda:-1"):
        with pytest.raises(DeviceError, match="use auto, cuda, cuda:N or cpu"):
            detect_device(bad)


def test_mixed_gpu_models_warn_once_unless_pci_bus_order(host, monkeypatch, caplog) -> None:
    host.names = ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]
    use(monkeypatch, host)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with caplog.at_level(logging.WARNING, logger="autotune.probe.device"):
        assert detect_device("cuda").uuid == gpu_uuid(1)
        detect_device("cuda")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(0))
        detect_device("cuda")  # a UUID leaves no order to guess
    assert [r.message.count("CUDA_DEVICE_ORDER=PCI_BUS_ID") for r in caplog.records] == [1]
    caplog.clear()
    monkeypatch.setattr(device, "_warned", set())
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with caplog.at_level(logging.WARNING, logger="autotune.probe.device"):
        detect_device("cuda")
    assert caplog.records == []


def test_without_nvml_auto_is_the_cpu(monkeypatch) -> None:
    fake = types.ModuleType("pynvml")

    def fail():
        raise NVMLError("NVML Shared Library Not Found")

    fake.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert detect_device("auto").kind == "cpu"
    with pytest.raises(DeviceError, match="--device cuda asked for a GPU but no NVIDIA GPU/driver found"):
        detect_device("cuda")


def test_device_info_round_trips_its_uuid_and_reads_old_records() -> None:
    info = DeviceInfo(kind="cuda", name="NVIDIA H100", total_memory_bytes=80 * GiB, compute_capability=(9, 0),
                      index=1, uuid=gpu_uuid(3))
    assert DeviceInfo.from_dict(info.to_dict()) == info
    old = {"kind": "cuda", "name": "NVIDIA H100", "total_memory_bytes": 80 * GiB, "compute_capability": [9, 0],
           "driver_version": None, "cuda_version": None, "index": 0}
    assert DeviceInfo.from_dict(old).uuid is None
    assert DeviceInfo(kind="cuda", name="x", total_memory_bytes=1, uuid=mig_uuid(0, 0)).is_mig


# ---- out of memory, or a crash --------------------------------------------------------------------


def test_host_memory_error_is_an_oom_only_on_the_cpu() -> None:
    from autotune.probe.child import SimulatedOutOfMemory

    assert is_out_of_memory(MemoryError())  # the old call: a CPU run
    assert is_out_of_memory(MemoryError(), cuda=False)
    assert not is_out_of_memory(MemoryError(), cuda=True)  # the host ran out, not the GPU: a crash
    assert is_out_of_memory(SimulatedOutOfMemory("peak RSS passed the simulated ceiling"))
    assert is_out_of_memory(SimulatedOutOfMemory("peak RSS passed the simulated ceiling"), cuda=False)
    cpu_allocator = RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried")
    assert is_out_of_memory(cpu_allocator) and not is_out_of_memory(cpu_allocator, cuda=True)


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasLtMatmul(...)`",
        "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
        "CUDA error: out of memory",
    ],
)
def test_library_allocation_failures_are_gpu_ooms(text) -> None:
    assert is_out_of_memory(RuntimeError(text), cuda=True)


def test_torch_oom_is_an_oom_and_other_errors_are_not() -> None:
    import torch

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), cuda=True)
    assert not is_out_of_memory(RuntimeError("CUDA error: device-side assert triggered"), cuda=True)
    assert not is_out_of_memory(ValueError("out of memory"), cuda=True)  # text counts only on a RuntimeError


def test_loader_workers_share_the_hosts_cores_among_the_processes_training_at_once() -> None:
    from autotune.probe.device import loader_cores

    assert loader_cores(1, host_cpus=6) == 5  # the training process keeps one
    assert loader_cores(4, host_cpus=32) == 7  # four ranks (or probes side by side), 8 cores each
    assert loader_cores(4, host_cpus=2) == 1  # never below one
    assert 1 <= loader_cores() <= (os.cpu_count() or 1)  # this host's own affinity
