"""Shared fixtures: a fake evaluator that stands in for the GPU, and CPU-only test settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from autotune.params import TrialParams
from autotune.records import DeviceInfo, ProbeResult
from autotune.search.loop import VirtualClock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GiB = 2**30


@dataclass
class FakeEvaluator:
    """A pretend GPU: OOM above a memory threshold, throughput a simple function of the params.

    Memory = 1 GiB + 0.5 GiB per sample of batch (halved by checkpointing); real OOM (``oom``) above
    ``oom_above_bytes``. Each probe costs ``probe_s`` on the virtual clock.
    """

    oom_above_bytes: int = 20 * GiB
    probe_s: float = 30.0
    clock: VirtualClock = field(default_factory=VirtualClock)
    calls: list[TrialParams] = field(default_factory=list)
    fail_on: dict[tuple[int, str], str] = field(default_factory=dict)  # (batch, precision) -> status

    @staticmethod
    def memory_bytes(params: TrialParams) -> int:
        per_sample = 0.5 * GiB * (0.5 if params.gradient_checkpointing else 1.0)
        return int(1 * GiB + per_sample * params.per_device_train_batch_size)

    @staticmethod
    def samples_per_s(params: TrialParams) -> float:
        speed = {"fp32": 1.0, "tf32": 1.5, "fp16": 2.0, "bf16": 2.2}[params.precision]
        speed *= 0.75 if params.gradient_checkpointing else 1.0
        batch = params.per_device_train_batch_size
        return speed * 100.0 * batch / (batch + 8)

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        self.calls.append(params)
        self.clock.advance(min(self.probe_s, timeout_s))
        if self.probe_s > timeout_s:
            return ProbeResult(status="timeout", error="deadline", wall_s=timeout_s)
        forced = self.fail_on.get((params.per_device_train_batch_size, params.precision))
        if forced:
            return ProbeResult(status=forced, error=f"forced {forced}", wall_s=self.probe_s)  # type: ignore[arg-type]
        memory = self.memory_bytes(params)
        if memory > self.oom_above_bytes:
            return ProbeResult(status="oom", error="OutOfMemoryError: fake", wall_s=self.probe_s)
        sps = self.samples_per_s(params)
        return ProbeResult(
            status="ok", samples_per_s=sps, tokens_per_s=sps * 128, step_time_s=params.effective_batch_size / sps,
            measured_steps=4, peak_mem_bytes=memory, wall_s=self.probe_s,
        )


@dataclass
class NoisyEvaluator:
    """Every configuration fits (1 GiB); its samples/s is the next value of its batch size's script,
    so a second probe of the same configuration can measure something else (or ``"oom"``)."""

    script: dict[int, list[float | str]]
    ci95_rel: float | None = None
    probe_s: float = 30.0
    clock: VirtualClock = field(default_factory=VirtualClock)
    calls: list[int] = field(default_factory=list)  # batch sizes, in order
    interrupt_at_call: int | None = None

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        batch = params.per_device_train_batch_size
        if len(self.calls) == self.interrupt_at_call:
            raise KeyboardInterrupt
        value = self.script[batch][self.calls.count(batch)]
        self.calls.append(batch)
        assert self.probe_s <= timeout_s, "the driver started a probe that cannot finish"
        self.clock.advance(self.probe_s)
        if value == "oom":
            return ProbeResult(status="oom", error="OutOfMemoryError: fake", wall_s=self.probe_s)
        return ProbeResult(
            status="ok", samples_per_s=float(value), tokens_per_s=float(value) * 128, step_time_s=batch / float(value),
            measured_steps=8, peak_mem_bytes=GiB, wall_s=self.probe_s, step_time_ci95_rel=self.ci95_rel,
        )


@pytest.fixture
def fake_gpu() -> DeviceInfo:
    return DeviceInfo(kind="cuda", name="Fake H100", total_memory_bytes=80 * GiB, compute_capability=(9, 0))


@pytest.fixture
def cpu_device() -> DeviceInfo:
    return DeviceInfo(kind="cpu", name="CPU: test", total_memory_bytes=24 * GiB)
