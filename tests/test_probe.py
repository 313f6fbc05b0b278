"""Real probes in child processes, on a tiny model on the CPU: every outcome a probe can have."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import pytest

from autotune.models import resolve_model
from autotune.params import TrialParams
from autotune.probe import isolation
from autotune.probe.steady import ci95_rel
from autotune.records import ProbeSpec

pytestmark = pytest.mark.slow  # each probe runs a real Trainer in a fresh process (~1-5 s here)


def _spec(model: str = "tiny-gptneox", **overrides) -> ProbeSpec:
    params = overrides.pop("params", TrialParams(per_device_train_batch_size=4, attn_implementation="sdpa"))
    return ProbeSpec(
        model=resolve_model(model).to_dict(), params=params, seq_len=32, device="cpu",
        **{"warmup_steps": 1, "measure_steps": 3, **overrides},
    )


SLOW_INPUT = Path(__file__).parent / "data" / "trainers" / "slow_input.py"


def _slow_input_spec(factory: str, **overrides) -> ProbeSpec:
    """A probe of the user's-Trainer path (``--trainer``) whose every sample is slow to load (``factory``: its delay)."""
    params = overrides.pop("params", TrialParams(per_device_train_batch_size=4, attn_implementation="sdpa"))
    return ProbeSpec(model={}, params=params, seq_len=32, device="cpu", trainer=f"{SLOW_INPUT}:{factory}",
                     **{"warmup_steps": 1, "measure_steps": 3, **overrides})


def test_ok_probe_measures_steady_state_throughput() -> None:
    result = isolation.run_isolated(_spec(), timeout_s=120)
    assert result.status == "ok", result.error
    assert result.measured_steps == 3
    assert result.samples_per_s == pytest.approx(4 / result.step_time_s)
    assert result.tokens_per_s == pytest.approx(result.samples_per_s * 32)
    assert len(result.losses) == 4 and all(5.0 < loss < 12.0 for loss in result.losses)  # ~ln(4096) = 8.3
    assert result.peak_mem_bytes and result.peak_mem_bytes > 50 * 2**20
    assert result.wall_s > result.setup_s > 0
    # The per-step times behind the mean, and the interval they give.
    step_times = result.extra["step_times_s"]
    assert len(step_times) == 3 and sum(step_times) / 3 == pytest.approx(result.step_time_s)
    assert result.step_time_ci95_rel == pytest.approx(ci95_rel(step_times))
    # FLOPs from the model's shape; no MFU on a CPU (no known peak), but the achieved rate.
    assert result.model_flops_per_token == pytest.approx(_tiny_flops_per_token(32))
    assert result.achieved_tflops == pytest.approx(result.model_flops_per_token * result.tokens_per_s / 1e12)
    assert result.mfu is None and result.gpu_util_mean_pct is None and result.energy_per_sample_j is None
    assert result.telemetry_window_s is None and not result.telemetry_reliable
    assert result.non_allocator_bytes is None and result.num_alloc_retries is None  # CUDA-only accounting
    # Fixed cost, apart from the measured window.
    assert result.model_build_s > 0 and result.overhead_s > 0
    window_s = result.step_time_s * result.measured_steps
    assert result.overhead_s + result.model_build_s + result.warmup_s + window_s == pytest.approx(result.wall_s)
    assert 0 <= result.input_wait_fraction < 0.5 and not result.input_bound


def _tiny_flops_per_token(seq_len: int) -> float:
    # tiny-gptneox by hand: 2 layers, hidden 128, 4 heads of 32, MLP 512, vocab 4096, untied.
    h, layers, vocab, mlp = 128, 2, 4096, 512
    per_layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * mlp + mlp) + (mlp * h + h) + 4 * h  # qkv, out, mlp, 2 LNs
    n = layers * per_layer + 2 * h + h * vocab  # final LN, output projection (no bias); input embedding excluded
    return 6 * n + 12 * layers * 4 * 32 * seq_len


def test_measures_until_stable_or_the_cap() -> None:
    # A target nobody can miss stops at the minimum; a target nobody can meet runs to the cap.
    easy = isolation.run_isolated(_spec(max_measure_steps=12, target_ci_rel=10.0), timeout_s=120)
    assert easy.status == "ok", easy.error
    assert easy.measured_steps == 3 and easy.stable
    hard = isolation.run_isolated(_spec(max_measure_steps=12, target_ci_rel=0.0), timeout_s=120)
    assert hard.status == "ok", hard.error
    assert hard.measured_steps == 12 and not hard.stable
    assert len(hard.losses) == 1 + 12


def test_slow_input_is_input_bound() -> None:
    # 200 ms per sample x 4 samples per step, against tens of ms of compute: the loop mostly waits.
    slow = isolation.run_isolated(_slow_input_spec("make_trainer_200ms", measure_steps=5), timeout_s=120)
    assert slow.status == "ok", slow.error
    assert slow.input_wait_fraction > 0.4 and slow.input_bound


def test_accumulation_counts_every_micro_batch() -> None:
    params = TrialParams(per_device_train_batch_size=2, gradient_accumulation_steps=3, attn_implementation="eager")
    result = isolation.run_isolated(_spec(params=params), timeout_s=120)
    assert result.status == "ok", result.error
    assert result.samples_per_s == pytest.approx(6 / result.step_time_s)


def test_simulated_ceiling_makes_an_oom() -> None:
    result = isolation.run_isolated(_spec(memory_ceiling_bytes=64 * 2**20), timeout_s=120)
    assert result.status == "oom"
    assert "simulated ceiling" in result.error


def test_deadline_kills_a_probe_as_timeout(monkeypatch) -> None:
    # A warm probe of a tiny model can finish within 0.5 s: slow its input so it cannot.
    import contextlib

    used: list[Path] = []
    real_folder = isolation._probe_folder

    @contextlib.contextmanager
    def recorded_folder(*args, **kwargs):
        with real_folder(*args, **kwargs) as folder:
            used.append(folder)
            yield folder

    monkeypatch.setattr(isolation, "_probe_folder", recorded_folder)  # this probe's, not another test's in this process
    result = isolation.run_isolated(_slow_input_spec("make_trainer_500ms"), timeout_s=0.5)
    assert result.status == "timeout"
    assert result.wall_s < 5
    assert len(used) == 1 and not used[0].exists()  # the killed child's scratch folder went with it


def test_fp32_probe_trains_with_ieee_fp32_matmuls() -> None:
    # Read back from torch just before training: what the trial's precision says, not what a library set.
    params = TrialParams(per_device_train_batch_size=4, precision="fp32", attn_implementation="sdpa")
    result = isolation.run_isolated(_spec(params=params), timeout_s=120)
    assert result.status == "ok", result.error
    assert result.matmul_precision == "ieee"


def test_a_probe_runs_the_loader_and_cache_settings_it_is_given() -> None:
    # The knobs reach the Trainer the probe trains with, read back from its TrainingArguments; on the
    # CPU transformers turns pinned memory off itself, so pin_memory=False is what it had either way.
    params = TrialParams(per_device_train_batch_size=4, attn_implementation="sdpa", torch_empty_cache_steps=2, dataloader_num_workers=2,
                         dataloader_prefetch_factor=4, dataloader_persistent_workers=True, dataloader_pin_memory=False)
    result = isolation.run_isolated(_spec(params=params), timeout_s=120)
    assert result.status == "ok", result.error
    applied = result.extra["training_arguments"]
    assert {k: applied[k] for k in ("torch_empty_cache_steps", "dataloader_num_workers", "dataloader_prefetch_factor",
                                    "dataloader_persistent_workers", "dataloader_pin_memory")} == {
        "torch_empty_cache_steps": 2, "dataloader_num_workers": 2, "dataloader_prefetch_factor": 4,
        "dataloader_persistent_workers": True, "dataloader_pin_memory": False}
    assert applied == params.training_arguments_kwargs()
    assert params.short().endswith("w2 prefetch4 persistent no-pin empty-cache/2")


def test_nan_loss_is_diverged(tmp_path) -> None:
    # Weights initialised at 1e30 overflow to inf in the first forward: a genuinely diverged model.
    config = dict(resolve_model("tiny-gptneox").config, initializer_range=1e30)
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = isolation.run_isolated(_spec(str(tmp_path)), timeout_s=120)
    assert result.status == "diverged", result.error
    assert "non-finite loss" in result.error


def test_exception_in_child_is_a_crash_with_its_traceback() -> None:
    params = TrialParams(per_device_train_batch_size=4, optim="adamw_bnb_8bit")  # bitsandbytes is not installed
    result = isolation.run_isolated(_spec(params=params), timeout_s=120)
    assert result.status == "crash"
    assert "Traceback" in result.error and "bitsandbytes" in result.error


@pytest.mark.parametrize("mode", ["forkserver", "cold"])
def test_killed_child_is_a_crash(monkeypatch, mode) -> None:
    real_launch = isolation._launch

    def launch_then_kill(*args, **kwargs):
        child = real_launch(*args, **kwargs)
        threading.Timer(1.0, lambda: os.kill(child.pid, signal.SIGKILL)).start()
        return child

    monkeypatch.setattr(isolation, "_launch", launch_then_kill)
    result = isolation.run_isolated(_slow_input_spec("make_trainer_500ms"), timeout_s=120, mode=mode)  # still running at 1 s
    assert result.status == "crash" and result.process_lost  # says nothing of the configuration: retried once
    assert "killed by SIGKILL" in result.error


def test_timeout_kills_the_childs_dataloader_workers_too(monkeypatch) -> None:
    # Workers are forked by the probe into its session; on the deadline the whole session dies.
    real_launch = isolation._launch
    seen: dict[str, int] = {}

    def launch_and_watch(*args, **kwargs):
        child = real_launch(*args, **kwargs)
        seen["pid"] = child.pid

        def watch() -> None:
            for _ in range(80):
                seen["max_members"] = max(seen.get("max_members", 0), len(_session_members(child.pid)))
                threading.Event().wait(0.1)

        threading.Thread(target=watch, daemon=True).start()
        return child

    monkeypatch.setattr(isolation, "_launch", launch_and_watch)
    params = TrialParams(per_device_train_batch_size=4, dataloader_num_workers=2)
    result = isolation.run_isolated(_slow_input_spec("make_trainer_30s", params=params), timeout_s=8)
    assert result.status == "timeout"
    assert seen["max_members"] >= 3  # the probe and its two workers were running
    for _ in range(50):  # SIGKILLed processes take a moment to exit
        if not _session_members(seen["pid"]):
            break
        threading.Event().wait(0.1)
    assert _session_members(seen["pid"]) == set()


def _session_members(session_id: int) -> set[int]:
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == session_id and Path(f"/proc/{entry}/stat").read_text().split()[2] != "Z":
                    members.add(int(entry))
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                pass
    return members


def test_process_server_overhead_against_a_cold_start(record_property) -> None:
    # Reported, not asserted as a time: both paths must work and measure their fixed overhead.
    isolation.start_server()
    figures = {}
    for mode in ("cold", "forkserver"):
        result = isolation.run_isolated(_spec(), timeout_s=120, mode=mode)
        assert result.status == "ok", result.error
        assert result.overhead_s is not None and result.model_build_s is not None
        figures[mode] = result
        record_property(f"{mode}_overhead_s", round(result.overhead_s, 3))
    print(
        "\nfixed overhead per probe: "
        + ", ".join(f"{m} {r.overhead_s:.2f} s (+ model build {r.model_build_s:.2f} s)" for m, r in figures.items())
    )


def _has_cuda() -> bool:
    from autotune.probe.device import detect_device

    return detect_device("auto").is_cuda


needs_cuda = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")


def _gpu_spec(params: TrialParams, **overrides) -> ProbeSpec:
    from autotune.probe.evaluator import ProbeEvaluator

    evaluator = ProbeEvaluator(model=resolve_model("pythia-160m").to_dict(), seq_len=256, device="cuda:0",
                               warmup_steps=3, measure_steps=8, max_measure_steps=40)
    return dataclasses.replace(evaluator.spec_for(params), **overrides)  # compiled trials get their extra warm-up


@pytest.mark.gpu
@needs_cuda
def test_gpu_probe_reports_telemetry_mfu_and_device_memory() -> None:
    from autotune.probe.telemetry import MIN_TELEMETRY_WINDOW_S

    params = TrialParams(per_device_train_batch_size=16, precision="bf16", attn_implementation="sdpa")
    result = isolation.run_isolated(_gpu_spec(params), timeout_s=300)
    assert result.status == "ok", result.error
    # The window is stretched to the telemetry minimum, so power and utilisation are reported.
    assert result.telemetry_window_s >= MIN_TELEMETRY_WINDOW_S and result.telemetry_reliable
    assert result.device_name and result.gpu_util_mean_pct is not None and result.gpu_util_peak_pct >= result.gpu_util_mean_pct
    assert result.power_mean_w > 0 and result.sm_clock_mean_mhz > 0 and result.energy_per_sample_j > 0
    assert result.peak_device_used_bytes >= result.peak_reserved_bytes > 0
    assert result.non_allocator_bytes > 0 and result.num_alloc_retries is not None
    assert result.peak_mem_bytes >= max(result.peak_device_used_bytes, result.non_allocator_bytes + result.peak_reserved_bytes)
    assert result.matmul_precision == "ieee"
    assert result.achieved_tflops > 0
    if result.mfu is not None:  # a GPU in the peak table
        assert 0 < result.mfu < 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_compiled_probe_runs_the_matmul_precision_it_says(precision) -> None:
    # transformers turns TF32 on for torch_compile through the new API (and accelerate through the
    # legacy one for fp32); inductor's legacy getter used to raise on it (bf16) or fp32 ran TF32.
    params = TrialParams(per_device_train_batch_size=8, precision=precision, torch_compile="inductor", attn_implementation="sdpa")
    result = isolation.run_isolated(_gpu_spec(params), timeout_s=600)
    assert result.status == "ok", result.error
    assert result.matmul_precision == "ieee"  # IEEE fp32 matmuls; bf16's run in bf16 under autocast
    assert result.achieved_tflops > 0
    if result.mfu is not None:
        assert 0 < result.mfu < 1


@pytest.mark.gpu
@needs_cuda
def test_gpu_probe_at_its_own_peak_as_the_ceiling_is_never_ok_over_it() -> None:
    # Measure a configuration's peak, then run it again with exactly that as the ceiling: the
    # allocator now has less room (the headroom kept for memory outside it), so it either fits
    # under the ceiling or runs out of memory, and never finishes ok over it.
    params = TrialParams(per_device_train_batch_size=16, precision="bf16", attn_implementation="sdpa")
    free = isolation.run_isolated(_gpu_spec(params, seq_len=512), timeout_s=300)
    assert free.status == "ok", free.error
    ceiling = free.peak_mem_bytes
    tight = isolation.run_isolated(_gpu_spec(params, seq_len=512, memory_ceiling_bytes=ceiling), timeout_s=300)
    assert tight.status in ("ok", "oom"), tight.error
    assert tight.non_allocator_bytes > 0
    assert tight.peak_mem_bytes >= tight.non_allocator_bytes + tight.peak_reserved_bytes
    assert not (tight.ok and tight.peak_mem_bytes > ceiling), (tight.peak_mem_bytes, ceiling)
    if tight.ok:
        assert tight.fits(ceiling)


@pytest.mark.gpu
@needs_cuda
def test_gpu_memory_ceiling_makes_a_real_oom() -> None:
    params = TrialParams(per_device_train_batch_size=64, attn_implementation="eager")
    spec = dataclasses.replace(_spec("pythia-160m", params=params, memory_ceiling_bytes=2 * 2**30), seq_len=1024, device="cuda:0")
    result = isolation.run_isolated(spec, timeout_s=300)
    assert result.status == "oom", result.error


def test_torch_compile_probe_excludes_compilation_from_the_timing() -> None:
    # torch.compile with inductor on the CPU: ~20-30 s of compilation in the warm-up steps.
    from autotune.probe.evaluator import COMPILE_EXTRA_WARMUP_STEPS, ProbeEvaluator

    evaluator = ProbeEvaluator(model=resolve_model("tiny-gptneox").to_dict(), seq_len=32, device="cpu",
                               warmup_steps=1, measure_steps=3)
    params = TrialParams(per_device_train_batch_size=4, torch_compile="inductor")
    spec = evaluator.spec_for(params)
    assert spec.warmup_steps == 1 + COMPILE_EXTRA_WARMUP_STEPS
    assert evaluator.spec_for(TrialParams(per_device_train_batch_size=4)).warmup_steps == 1
    result = isolation.run_isolated(spec, timeout_s=300)
    assert result.status == "ok", result.error
    assert result.measured_steps >= 3
    # Compilation happened in the warm-up, not in the measured window (counted, not timed: a loaded
    # machine makes any ratio of step times flaky).
    assert result.extra["compiled_graphs_warmup"] >= 1
    assert result.extra["compiled_graphs_measured"] == 0
