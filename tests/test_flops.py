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
