"""Model FLOPs per token and MFU (model FLOPs utilisation), from the model's shape alone.

Pure arithmetic: no torch, no device. The formula is PaLM's (Chowdhery et al. 2022, Appendix B):
a training step costs ``6N + 12·L·H·Q·T`` FLOPs per token, where ``N`` counts the parameters that
take part in matrix multiplies (the output projection included, the input embedding lookup not),
``L`` layers, ``H`` heads, ``Q`` head dimension, ``T`` sequence length. The ``6N`` is forward (2N)
plus backward (4N); the second term is the attention scores and their weighted sum, forward and
backward. These are *model* FLOPs: recomputation by activation checkpointing is not counted (that
would be hardware FLOPs), so a configuration is never rewarded for doing more work.

MFU = achieved model FLOP/s / the device's dense peak for the precision the matmuls actually ran
in (:func:`peak_precision`: an "fp32" trial whose fp32 matmuls ran on TF32 tensor cores is bounded
by the TF32 peak, not the FP32 one). Peaks come from :data:`PEAK_TFLOPS` below; for a device not in
the table MFU stays ``None`` (we report the achieved TFLOP/s and do not guess a peak).
"""

from __future__ import annotations

from collections.abc import Mapping

from autotune.params import mixed_precision_dtype

# Dense (no 2:4 sparsity) peak TFLOP/s by precision. "fp32" is the non-tensor-core FP32 rate
# (PyTorch's default for fp32 matmuls); "tf32" is TF32 tensor cores; "fp16"/"bf16" are tensor
# cores with fp32 accumulation, what autocast mixed precision uses. Datasheets quote the sparse
# rate for tensor cores ("with sparsity"); the dense rate is half of it.
# Keys are matched as case-insensitive substrings of the NVML/torch device name, in this order,
# so the more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, Mapping[str, float]], ...] = (
    # H200 NVL: NVIDIA H200 datasheet (2024): FP32 60, TF32 835, BF16/FP16 1671 (sparse).
    ("h200 nvl", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    # H200 SXM: NVIDIA H200 datasheet (2024): FP32 67, TF32 989, BF16/FP16 1979 (sparse).
    ("h200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    # H100 NVL: NVIDIA H100 datasheet (2023): FP32 60, TF32 835, BF16/FP16 1671 (sparse).
    ("h100 nvl", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    # H100 PCIe: NVIDIA H100 datasheet (2023): FP32 51, TF32 756, BF16/FP16 1513 (sparse).
    ("h100 pcie", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    # H100 SXM5 (NVML: "NVIDIA H100 80GB HBM3"): NVIDIA H100 datasheet (2023): FP32 67, TF32 989,
    # BF16/FP16 1979 (sparse).
    ("h100", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    # A100 (SXM4 and PCIe, 40/80 GB): NVIDIA A100 datasheet (2021): FP32 19.5, TF32 156,
    # BF16/FP16 312 (dense).
    ("a100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    # L4: NVIDIA L4 datasheet (2023): FP32 30.3, TF32 120, BF16/FP16 242 (sparse).
    ("l4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    # T4 (Turing: no TF32, no BF16 tensor cores): NVIDIA T4 datasheet (2019): FP32 8.1,
    # FP16 mixed precision 65. TF32 requests run as FP32.
    ("t4", {"fp32": 8.1, "tf32": 8.1, "fp16": 65.0}),
    # RTX 4090: NVIDIA Ada Lovelace architecture whitepaper v1.03 (2023), appendix table: FP32 82.6,
    # TF32 tensor 82.6, FP16/BF16 tensor with FP32 accumulate 165.2 (dense).
    ("rtx 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
)


def model_flops_per_token(
    matmul_params: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int, frozen_params: int = 0
) -> float:
    """Training FLOPs per token, forward and backward: ``6N + 12·L·H·Q·T`` (PaLM Appendix B), less
    ``2`` per frozen matmul parameter: a frozen weight skips its weight-gradient matmul in backward
    (2 of the 6 FLOPs per parameter and token).

    Args:
        matmul_params: N, the parameters used in matrix multiplies: every weight except the input
            embedding tables, with the output projection counted once even when tied.
        num_layers: L (0 where the model's config does not say: the attention term is left out).
        num_heads: H.
        head_dim: Q (hidden size / heads).
        seq_len: T, tokens per sample.
        frozen_params: those of the N that are not trained (a LoRA base).
    """
    return 6.0 * matmul_params + 12.0 * num_layers * num_heads * head_dim * seq_len - 2.0 * frozen_params


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """The dense peak TFLOP/s of ``device_name`` at ``precision``, or None if we do not know it."""
    peaks = device_peaks(device_name)
    return peaks.get(precision) if peaks is not None else None


def device_peaks(device_name: str | None) -> Mapping[str, float] | None:
    """The :data:`PEAK_TFLOPS` row of ``device_name`` (dense TFLOP/s by precision), or None if we do not know it."""
    if not device_name:
        return None
    name = device_name.lower()
    return next((peaks for key, peaks in PEAK_TFLOPS if _matches(name, key)), None)


# torch's names for the internal precision of fp32 matmuls (``torch.backends.<backend>.matmul.fp32_precision``,
# and the legacy ``torch.get_float32_matmul_precision()`` names) -> the PEAK_TFLOPS column they run at.
# "bf16" exists on oneDNN (the CPU) only; legacy "medium" means bf16 there but TF32 on CUDA, which
# has no bf16 mode for fp32 matmuls (torch.set_float32_matmul_precision docs), and the table is GPUs.
_FP32_MATMUL_COLUMN = {
    "ieee": "fp32", "highest": "fp32", "tf32": "tf32", "high": "tf32", "medium": "tf32", "bf16": "bf16",
}


def peak_precision(precision: str, matmul_precision: str | None) -> str:
    """The :data:`PEAK_TFLOPS` column that bounds a trial of ``precision`` whose fp32 matmuls ran at
    ``matmul_precision`` (what torch had in force, e.g. ``"ieee"`` or ``"tf32"``).

    Under fp16/bf16 autocast the matmuls run in 16 bit whatever the fp32 setting, so the trial's own
    16-bit dtype decides (bf16+tf32 is bounded by the bf16 peak: TF32 only touches the few matmuls
    autocast keeps in fp32). For fp32 and tf32 trials the precision in force decides, not the label: a
    library that turns TF32 on behind the label (transformers does for ``torch_compile``) must not
    give an "fp32" trial an MFU against the FP32 peak, 7-8x lower on A100/H100. Unknown (None, or
    a name we do not know): the label.
    """
    amp = mixed_precision_dtype(precision)
    if amp is not None:
        return amp
    return _FP32_MATMUL_COLUMN.get(matmul_precision or "", precision)


def _matches(name: str, key: str) -> bool:
    # "l4" must not match "l40s"; "t4" must not match "rtx 4090": match whole words only.
    words = name.replace("-", " ").replace("_", " ").split()
    key_words = key.split()
    return any(words[i : i + len(key_words)] == key_words for i in range(len(words)))


def achieved_tflops(flops_per_token: float, tokens_per_s: float) -> float:
    """Model TFLOP/s actually achieved."""
    return flops_per_token * tokens_per_s / 1e12


def mfu(
    flops_per_token: float, tokens_per_s: float, device_name: str | None, precision: str,
    matmul_precision: str | None = None,
) -> float | None:
    """Model FLOPs utilisation in 0..1, or None for a device/precision without a known peak.

    ``matmul_precision``: the fp32 matmul precision in force (see :func:`peak_precision`); None
    takes the trial's ``precision`` at its word.
    """
    peak = peak_tflops(device_name, peak_precision(precision, matmul_precision))
    if peak is None:
        return None
    return achieved_tflops(flops_per_token, tokens_per_s) / peak
