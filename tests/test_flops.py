"""Model FLOPs and MFU arithmetic against hand-computed cases; the peak table's lookups."""

from __future__ import annotations

import pytest

from autotune.probe.flops import PEAK_TFLOPS, achieved_tflops, mfu, model_flops_per_token, peak_tflops


def test_palm_formula_by_hand() -> None:
    # N = 1e9, L = 24, H = 16, Q = 128, T = 2048:
    # 6N = 6e9; 12 * 24 * 16 * 128 * 2048 = 1,207,959,552; total 7,207,959,552 FLOPs per token.
    assert model_flops_per_token(10**9, 24, 16, 128, 2048) == 7_207_959_552


def test_mfu_by_hand_on_an_h100() -> None:
    # 7.2e9 FLOPs/token x 50,000 tokens/s = 360 TFLOP/s; bf16 dense peak of an H100 SXM 989.5.
    flops = 7.2e9
    assert achieved_tflops(flops, 50_000) == pytest.approx(360.0)
    assert mfu(flops, 50_000, "NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(360.0 / 989.5)
    assert mfu(flops, 50_000, "NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(360.0 / 19.5)


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "fp16", 756.5),
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "bf16", 312.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla T4", "fp16", 65.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ],
)
def test_peak_lookup_by_device_name(name: str, precision: str, peak: float) -> None:
    assert peak_tflops(name, precision) == peak


def test_unknown_devices_and_precisions_get_no_mfu() -> None:
    assert peak_tflops("NVIDIA L40S", "bf16") is None  # "l4" must not match "l40s"
    assert peak_tflops("CPU: AMD EPYC (2 cores)", "fp32") is None
    assert peak_tflops(None, "bf16") is None
    assert peak_tflops("Tesla T4", "bf16") is None  # no bf16 tensor cores on Turing
    assert mfu(1e9, 1e3, "CPU: test", "fp32") is None


def test_every_row_has_the_precisions_it_supports() -> None:
    for key, peaks in PEAK_TFLOPS:
        assert {"fp32", "tf32", "fp16"} <= set(peaks), key
        assert all(value > 0 for value in peaks.values())


@pytest.mark.parametrize("precision, column", [("bf16+tf32", "bf16"), ("fp16+tf32", "fp16")])
def test_tf32_under_mixed_precision_takes_the_16_bit_peak(precision: str, column: str) -> None:
    from autotune.probe.flops import peak_precision

    # The fp32 setting in force is TF32 ("tf32"), yet autocast runs the matmuls in 16 bit: the 16-bit peak bounds it.
    assert peak_precision(precision, "tf32") == column
    flops_per_token, tokens_per_s = 6e9, 50_000.0
    assert mfu(flops_per_token, tokens_per_s, "NVIDIA H100 80GB HBM3", precision, "tf32") == pytest.approx(
        achieved_tflops(flops_per_token, tokens_per_s) / 989.5)


# ---------------------------------------------------------------------- a probe's compute floor (autotune.probe.duration)

def test_a_probes_flops_by_hand() -> None:
    from autotune.models import ModelSpec, count_parameters
    from autotune.params import TrialParams
    from autotune.probe.duration import probe_flops

    spec = ModelSpec("hand", "builtin", {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                             "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 128})
    matmul = count_parameters(spec) - 1000 * 64  # the input embedding is a lookup, not a matmul
    per_token = 6 * matmul + 12 * 2 * 4 * 16 * 32
    # 3 steps of batch 4 x accumulation 2 at 32 tokens per sample: 3 x 8 x 32 tokens.
    assert probe_flops(spec, 32, TrialParams(per_device_train_batch_size=4, gradient_accumulation_steps=2), 3) == per_token * 3 * 8 * 32


def test_the_warning_names_the_tighter_limit_and_only_when_the_floor_is_over_it() -> None:
    from autotune.probe.duration import ProbeFloor, cannot_finish_warning

    floor = ProbeFloor(flops=1.2e14, peak_flops_per_s=1e11, peak_source="measured")  # 1,200 s
    assert floor.seconds == pytest.approx(1200.0)
    over_budget = cannot_finish_warning(floor, "the first probe", budget_s=300.0, trial_timeout_s=900.0)
    assert over_budget is not None and "20m00s" in over_budget and "the 5m00s budget" in over_budget
    assert "100 GFLOP/s, this CPU's matmul peak" in over_budget and over_budget.endswith("on a GPU") and "\n" not in over_budget
    over_deadline = cannot_finish_warning(floor, "the first probe", budget_s=3600.0, trial_timeout_s=900.0)
    assert over_deadline is not None and "15m00s probe deadline (--trial-timeout)" in over_deadline
    assert cannot_finish_warning(floor, "the first probe", budget_s=None, trial_timeout_s=1500.0) is None
    assert cannot_finish_warning(None, "the first probe", budget_s=1.0, trial_timeout_s=1.0) is None  # a GPU the table lacks
    gpu = ProbeFloor(flops=1e18, peak_flops_per_s=989.5e12, peak_source="datasheet")
    on_gpu = cannot_finish_warning(gpu, "x", 60.0, 900.0)
    assert on_gpu is not None and "990 TFLOP/s, the device's datasheet peak" in on_gpu and on_gpu.endswith("with --peft lora")


def test_a_gpus_peak_is_its_fastest_datasheet_column_and_an_unknown_gpu_has_none() -> None:
    from autotune.probe.duration import peak_flops_per_s
    from autotune.records import DeviceInfo

    h100 = DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", total_memory_bytes=80 << 30)
    assert peak_flops_per_s(h100) == (pytest.approx(989.5e12), "datasheet")
    assert peak_flops_per_s(DeviceInfo(kind="cuda", name="Some Future GPU", total_memory_bytes=1 << 30)) is None


def test_a_plan_on_cpu_warns_that_a_large_models_first_probe_cannot_finish(tmp_path) -> None:
    """#45: polyglot-ko-1.3b on a CPU (seq 512, batch 8, 11 steps: ~3.6e14 FLOPs, at least 20 minutes at the
    ~300 GFLOP/s a 2-core AVX-512 CPU's matmul peaks at; a CPU would need 6 TFLOP/s to make it a minute) against
    a 1-minute budget; the small default model gets no warning."""
    from autotune.api import RunOptions, plan_run

    common = dict(device="cpu", storage=f"sqlite:///{tmp_path / 'w.db'}", budget="1m")
    (warning,) = plan_run(RunOptions(model="polyglot-ko-1.3b", **common)).warnings
    assert warning.startswith("the first probe (bs8x1 fp32") and "the 1m00s budget" in warning and "it will time out" in warning
    assert plan_run(RunOptions(model="tiny-gptneox", seq_len=64, **common)).warnings == ()


def test_no_cpu_peak_is_measured_where_even_a_slow_device_would_finish_in_time(monkeypatch) -> None:
    """The plan times a CPU's matmuls only where the answer may be a warning: a probe whose FLOPs 1 GFLOP/s does
    within the limit gets no floor and no measurement; one that it does not is measured."""
    from autotune.models import resolve_model
    from autotune.params import TrialParams
    from autotune.probe import duration
    from autotune.records import DeviceInfo

    measured: list[bool] = []
    monkeypatch.setattr(duration, "cpu_matmul_flops_per_s", lambda: measured.append(True) or 1e11)
    cpu = DeviceInfo(kind="cpu", name="CPU: test", total_memory_bytes=24 << 30)
    params = TrialParams(per_device_train_batch_size=8)
    tiny = resolve_model("tiny-gptneox")
    flops = duration.probe_flops(tiny, 64, params, 11)
    assert duration.probe_floor(tiny, cpu, 64, params, 11, within_s=flops / 1e9) is None and measured == []
    floor = duration.probe_floor(tiny, cpu, 64, params, 11, within_s=flops / 1e9 / 2)
    assert floor is not None and floor.flops == flops and floor.peak_flops_per_s == 1e11 and measured == [True]
