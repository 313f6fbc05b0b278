"""The NVML sampler against a fake pynvml: what it reads, and how it summarises a window."""

from __future__ import annotations

import sys
import time
import types

import pytest

from autotune.probe.telemetry import NvmlSampler, nvml_index, summarise_telemetry


def _fake_pynvml(reads: list[str]) -> types.ModuleType:
    fake = types.ModuleType("pynvml")
    fake.NVML_CLOCK_SM = 1
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda index: ("handle", index)
    step = {"n": 0}

    def util(handle):
        step["n"] += 1
        reads.append(f"util{handle[1]}")
        return types.SimpleNamespace(gpu=50 + 10 * (step["n"] % 2))  # alternates 60, 50

    fake.nvmlDeviceGetUtilizationRates = util
    fake.nvmlDeviceGetPowerUsage = lambda handle: 300_000  # milliwatts
    fake.nvmlDeviceGetClockInfo = lambda handle, clock: 1980
    fake.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=10 * 2**30 + step["n"])

    return fake


def test_sampler_reads_the_pinned_gpu_and_summarises(monkeypatch) -> None:
    reads: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(reads))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert nvml_index() == 3  # NVML counts physical GPUs; the parent pinned the child to GPU 3
    sampler = NvmlSampler(interval_s=0.01)
    assert sampler.start()
    time.sleep(0.1)
    telemetry = sampler.stop()
    assert telemetry.samples >= 3 and set(reads) == {"util3"}
    assert 50 <= telemetry.gpu_util_mean_pct <= 60 and telemetry.gpu_util_peak_pct == 60
    assert telemetry.power_mean_w == pytest.approx(300.0) and telemetry.sm_clock_mean_mhz == 1980
    assert telemetry.mem_used_peak_bytes >= 10 * 2**30 + telemetry.samples - 1


def test_missing_fields_are_none_not_zero() -> None:
    telemetry = summarise_telemetry([(80.0, None, 1500.0, None), (100.0, None, 1700.0, None)])
    assert telemetry.gpu_util_mean_pct == 90.0 and telemetry.gpu_util_peak_pct == 100.0
    assert telemetry.power_mean_w is None and telemetry.mem_used_peak_bytes is None
    assert telemetry.sm_clock_mean_mhz == 1600.0


def test_without_nvml_the_sampler_records_nothing(monkeypatch) -> None:
    fake = types.ModuleType("pynvml")

    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    fake.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NvmlSampler()
    assert not sampler.start()
    assert sampler.stop().samples == 0
