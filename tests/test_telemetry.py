"""The NVML sampler against a fake pynvml: which GPU it opens, what it reads, and how it summarises a window."""

from __future__ import annotations

import sys
import time
import types

import pytest

from autotune.probe.telemetry import (
    MIN_TELEMETRY_WINDOW_S,
    NvmlSampler,
    Telemetry,
    nvml_used_bytes,
    probe_device_uuid,
    summarise_telemetry,
)
from tests.test_device import FakeNvml, GiB, gpu_uuid, mig_uuid


def _sampling_nvml(fake: FakeNvml, reads: list[str], energy_step_mj: int = 1_500) -> types.ModuleType:
    """The fake host's pynvml, with utilisation, power, clock and an energy counter that record what they read."""
    module = fake.module()
    step = {"n": 0, "energy_mj": 7_000_000}

    def util(handle):
        step["n"] += 1
        reads.append(fake.uuid(handle))
        return types.SimpleNamespace(gpu=50 + 10 * (step["n"] % 2))  # alternates 60, 50

    def energy(handle):
        step["energy_mj"] += energy_step_mj  # millijoules since the driver loaded
        return step["energy_mj"]

    module.nvmlDeviceGetUtilizationRates = util
    module.nvmlDeviceGetPowerUsage = lambda handle: 300_000  # milliwatts
    module.nvmlDeviceGetClockInfo = lambda handle, clock: 1980
    module.nvmlDeviceGetTotalEnergyConsumption = energy
    return module


def test_sampler_opens_the_pinned_uuid_and_summarises(monkeypatch) -> None:
    reads: list[str] = []
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", _sampling_nvml(fake, reads))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(3))  # as the parent pins a probe
    assert probe_device_uuid() == gpu_uuid(3)
    sampler = NvmlSampler(interval_s=0.01)
    assert sampler.start()
    time.sleep(0.1)
    result = sampler.stop()
    assert result.samples >= 3 and set(reads) == {gpu_uuid(3)}
    assert 50 <= result.gpu_util_mean_pct <= 60 and result.gpu_util_peak_pct == 60
    assert result.power_mean_w == pytest.approx(300.0) and result.sm_clock_mean_mhz == 1980
    assert result.mem_used_peak_bytes == 10 * GiB  # v2: the driver's reserved memory left out
    assert result.energy_j == pytest.approx(1.5)  # one counter step (1,500 mJ) between start() and stop()
    assert result.window_s >= 0.1


def test_a_child_started_by_hand_resolves_its_visible_gpu(monkeypatch) -> None:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert probe_device_uuid() == gpu_uuid(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(1)[:8])
    assert probe_device_uuid() == gpu_uuid(1)


def test_on_a_mig_instance_only_memory_and_clock_are_read(monkeypatch) -> None:
    reads: list[str] = []
    fake = FakeNvml(migs={1: 2})
    module = _sampling_nvml(fake, reads)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig_uuid(1, 1))
    sampler = NvmlSampler(interval_s=0.01)
    assert sampler.start()
    time.sleep(0.05)
    result = sampler.stop()
    # The power, energy and utilisation of the whole GPU are not this slice's: None, not a wrong number.
    assert reads == [] and result.gpu_util_mean_pct is None and result.power_mean_w is None and result.energy_j is None
    assert result.mem_used_peak_bytes == 10 * GiB and result.sm_clock_mean_mhz == 1980 and result.samples >= 2


def test_used_memory_is_v2_where_the_driver_has_it(monkeypatch) -> None:
    fake = FakeNvml(used_bytes=20 * GiB, reserved_bytes=GiB)
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(0))
    assert nvml_used_bytes() == 20 * GiB
    old_driver = FakeNvml(used_bytes=20 * GiB, reserved_bytes=GiB, has_memory_v2=False)
    module = old_driver.module()
    module.nvmlMemory_v2 = 0x02000028  # a new pynvml on a driver without nvmlDeviceGetMemoryInfo_v2
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert nvml_used_bytes() == 21 * GiB  # v1, reserved included
    monkeypatch.setitem(sys.modules, "pynvml", old_driver.module())  # an old pynvml: no nvmlMemory_v2 at all
    assert nvml_used_bytes() == 21 * GiB
    assert nvml_used_bytes(gpu_uuid(2)) == 21 * GiB


def test_an_unknown_uuid_reads_nothing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml().module())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000-0000-0000-0000-000000000000")
    assert nvml_used_bytes() is None
    assert not NvmlSampler().start()


def test_energy_is_none_when_the_counter_is_missing_or_goes_back(monkeypatch) -> None:
    fake = FakeNvml()
    module = _sampling_nvml(fake, [], energy_step_mj=-10)  # a driver reload reset the counter
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu_uuid(0))
    sampler = NvmlSampler(interval_s=0.01)
    assert sampler.start()
    assert sampler.stop().energy_j is None
    del module.nvmlDeviceGetTotalEnergyConsumption  # before Volta
    sampler = NvmlSampler(interval_s=0.01)
    assert sampler.start()
    result = sampler.stop()
    assert result.energy_j is None and result.power_mean_w == pytest.approx(300.0)


def test_missing_fields_are_none_not_zero() -> None:
    result = summarise_telemetry([(80.0, None, 1500.0, None), (100.0, None, 1700.0, None)])
    assert result.gpu_util_mean_pct == 90.0 and result.gpu_util_peak_pct == 100.0
    assert result.power_mean_w is None and result.mem_used_peak_bytes is None
    assert result.sm_clock_mean_mhz == 1600.0
    assert result.energy_j is None and result.window_s == 0.0


def test_without_nvml_the_sampler_records_only_the_window(monkeypatch) -> None:
    fake = types.ModuleType("pynvml")

    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    fake.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NvmlSampler()
    assert not sampler.start()
    result = sampler.stop()
    assert result.samples == 0 and result.energy_j is None and result.window_s >= 0.0
    assert NvmlSampler().stop() == Telemetry(samples=0)  # never started: an empty window


def test_the_minimum_window_covers_nvmls_one_second_averages() -> None:
    assert MIN_TELEMETRY_WINDOW_S == 2.0  # twice the 1 s over which NVML averages power and utilisation
