"""A busy machine is detected before each probe, recorded with the trial, and shown."""

from __future__ import annotations

import sys
import types

from rich.console import Console

from autotune.console import print_summary
from autotune.probe import interference as busy
from autotune.report.model import build_report_model
from tests.report_studies import make_study


def test_cpu_load_above_the_core_count_is_busy() -> None:
    assert busy.cpu_busy_reason(90.0, cores=2) == "CPU 90% busy on 2 cores"
    assert busy.cpu_busy_reason(25.0, cores=2) is None


def test_the_cpu_check_measures_a_window(monkeypatch) -> None:
    windows = []

    def cpu_percent(interval):  # type: ignore[no-untyped-def]
        windows.append(interval)
        return 75.0

    monkeypatch.setattr(busy.psutil, "cpu_percent", cpu_percent)
    monkeypatch.setattr(busy.psutil, "cpu_count", lambda: 4)
    assert busy.interference(None, cuda=False) == "CPU 75% busy on 4 cores"
    assert windows == [busy.CPU_WINDOW_S]  # a fresh window, not psutil's reading since its last call


def test_other_gpu_processes_or_utilisation_are_busy() -> None:
    assert busy.gpu_busy_reason([], 0.0, own_pid=1) is None
    assert busy.gpu_busy_reason([1], 3.0, own_pid=1) is None  # ourselves
    assert busy.gpu_busy_reason([7, 8], None, own_pid=1) == "2 other processes on the GPU"
    assert busy.gpu_busy_reason([7], 85.0, own_pid=1) == "1 other process on the GPU, 85% utilised before the probe"


def test_the_gpu_check_reads_nvml_by_uuid(monkeypatch) -> None:
    from autotune.probe import telemetry

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: ("handle", uuid),
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [types.SimpleNamespace(pid=4242)],
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=97),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(telemetry, "_handle_cache", {})
    assert busy.interference("GPU-abc", cuda=True) == "1 other process on the GPU, 97% utilised before the probe"


def test_after_our_own_probe_only_later_utilisation_samples_count(monkeypatch) -> None:
    """Right after a probe ends NVML's rolling utilisation still holds its kernels: only samples taken
    after it ended (and settled) say whether someone else computes on the GPU."""
    from autotune.probe import telemetry

    end_s = 1_000.0
    settle_us = int(busy.UTIL_SETTLE_S * 1e6)
    ours = (int(end_s * 1e6) + settle_us // 2, 100.0)  # still our probe's last kernels
    assert busy.utilisation_after([ours], end_s) is None
    assert busy.utilisation_after([ours, (int(end_s * 1e6) + 2 * settle_us, 40.0), (int(end_s * 1e6) + 3 * settle_us, 60.0)], end_s) == 50.0

    asked = []

    def samples(handle, kind, since_us):  # type: ignore[no-untyped-def]
        asked.append(since_us)
        return 1, [types.SimpleNamespace(timeStamp=ours[0], sampleValue=types.SimpleNamespace(uiVal=100))]

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: ("handle", uuid),
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [],
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=100),
        nvmlDeviceGetSamples=samples,
        NVML_GPU_UTILIZATION_SAMPLES=1,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(telemetry, "_handle_cache", {})
    assert busy.interference("GPU-abc", cuda=True) == "100% utilised before the probe"  # no probe of ours before
    assert busy.interference("GPU-abc", cuda=True, idle_since_s=end_s) is None
    assert asked == [int(end_s * 1e6)]


def test_the_evaluator_passes_when_its_last_probe_ended(monkeypatch) -> None:
    from autotune.probe import evaluator as evaluator_module
    from autotune.records import ProbeResult, ProbeStatus

    seen = []
    monkeypatch.setattr(evaluator_module, "interference", lambda uuid, *, cuda, idle_since_s=None: seen.append(idle_since_s))
    monkeypatch.setattr(evaluator_module, "run_isolated",
                        lambda spec, **kw: ProbeResult(status=ProbeStatus.OK, samples_per_s=1.0))
    monkeypatch.setattr(evaluator_module.time, "time", lambda: 1234.5)
    from autotune.models import resolve_model

    ev = evaluator_module.ProbeEvaluator(model=resolve_model("tiny-gptneox").to_dict(), seq_len=16, device="cpu")
    from autotune.params import TrialParams

    ev.evaluate(TrialParams(), timeout_s=10)
    ev.evaluate(TrialParams(), timeout_s=10)
    assert seen == [None, 1234.5]


def test_busy_probes_are_flagged_in_the_terminal_and_the_report(tmp_path) -> None:
    result = make_study(f"sqlite:///{tmp_path / 'b.db'}", n_trials=6, busy_first=2)
    assert result.busy_probes() == 2
    console = Console(width=200, record=True)
    print_summary(console, result)
    assert "2 of 6 probes ran while something else used the device" in console.export_text()
    model = build_report_model(result)
    assert model.notice.startswith("2 of 6 probes ran while something else used the device")
    flags = [cell.text for row in model.rows for column, cell in zip(model.columns, row.cells) if column.key == "flags"]
    assert sum("busy machine (1 other process on the GPU)" in f for f in flags) == 2
