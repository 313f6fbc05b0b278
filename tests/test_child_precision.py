"""The trial's fp32 matmul precision: set through torch's legacy and new APIs consistently, read
back, and the MFU peak taken from what was in force rather than from the trial's label."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune.probe.child import fp32_matmul_setting
from autotune.probe.flops import mfu, peak_precision, peak_tflops

H100 = "NVIDIA H100 80GB HBM3"

# What the libraries write before the probe sets its precision (torch >= 2.9 names):
# transformers' TrainingArguments with torch_compile (tf32=None) or tf32=True / tf32=False, and
# accelerate's legacy flag for fp32 + torch.compile on CUDA.
_WRITES = {
    "nothing": "",
    "transformers_tf32": "torch.backends.fp32_precision = 'tf32'",
    "transformers_tf32+accelerate": "torch.backends.fp32_precision = 'tf32'; torch.backends.cuda.matmul.allow_tf32 = True",
    "transformers_ieee": "torch.backends.fp32_precision = 'ieee'",
    "transformers_ieee+accelerate": "torch.backends.fp32_precision = 'ieee'; torch.backends.cuda.matmul.allow_tf32 = True",
}

# Runs in a fresh interpreter: torch's precision flags are process-global. First the failure the
# probe must avoid (the legacy getter that inductor calls raises after transformers' write), then,
# for every history of writes and every precision, what the getters say after the probe's setter.
_SCRIPT = r"""
import json, sys, torch
from autotune.probe.child import apply_matmul_precision
writes, precisions = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
exec(writes["transformers_tf32"])
try:
    torch.get_float32_matmul_precision()
    out["precondition"] = "no error"
except RuntimeError as exc:
    out["precondition"] = str(exc)
getters = {
    "legacy": torch.get_float32_matmul_precision,
    "cuda_matmul_allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "cudnn_allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    "generic": lambda: torch.backends.fp32_precision,
    "cuda_matmul": lambda: torch.backends.cuda.matmul.fp32_precision,
    "mkldnn_matmul": lambda: torch.backends.mkldnn.matmul.fp32_precision,
    "mkldnn": lambda: torch.backends.mkldnn.fp32_precision,
    "cudnn_conv": lambda: torch.backends.cudnn.conv.fp32_precision,
}
for name, code in writes.items():
    for precision in precisions:
        exec(code)
        case = {"returned_cuda": apply_matmul_precision(precision, cuda=True)}
        for getter, read in getters.items():
            try:
                case[getter] = read()
            except RuntimeError as exc:
                case[getter] = "raised: " + str(exc)
        case["returned_cpu"] = apply_matmul_precision(precision, cuda=False)
        out[name + "/" + precision] = case
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def after_setter() -> dict:
    import torch

    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision API to mix with the legacy one")
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(_WRITES), json.dumps(["fp32", "tf32", "fp16", "bf16"])],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_new_api_write_breaks_the_legacy_getter_inductor_reads(after_setter) -> None:
    # Why the probe sets the precision itself: after transformers' new-API TF32 write, the legacy
    # getter (read by inductor's autotuning cache) raises (pytorch#166387).
    assert "mix of the legacy and new APIs" in after_setter["precondition"]


@pytest.mark.parametrize("writes", list(_WRITES))
@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_setter_leaves_every_getter_agreeing_with_the_trial(after_setter, writes, precision) -> None:
    case = after_setter[f"{writes}/{precision}"]
    raised = {name: value for name, value in case.items() if str(value).startswith("raised")}
    assert not raised, raised
    tf32 = precision == "tf32"
    expected = "tf32" if tf32 else "ieee"
    assert case["returned_cuda"] == case["returned_cpu"] == expected
    assert case["legacy"] == ("high" if tf32 else "highest")
    assert case["cuda_matmul"] == case["mkldnn_matmul"] == case["generic"] == case["mkldnn"] == expected
    assert case["cuda_matmul_allow_tf32"] is tf32
    assert case["cudnn_allow_tf32"] is True and case["cudnn_conv"] == "tf32"  # PyTorch's default for convolutions


def test_only_a_tf32_trial_gets_tf32_matmuls() -> None:
    assert fp32_matmul_setting("tf32") == "high"
    assert {fp32_matmul_setting(p) for p in ("fp32", "fp16", "bf16")} == {"highest"}


@pytest.mark.parametrize(
    ("precision", "matmul_precision", "column"),
    [
        ("fp32", "ieee", "fp32"),
        ("fp32", "tf32", "tf32"),  # TF32 turned on behind an "fp32" label: bounded by the TF32 peak
        ("tf32", "tf32", "tf32"),
        ("tf32", "ieee", "fp32"),  # a "tf32" label that ran IEEE matmuls
        ("fp32", "highest", "fp32"),  # legacy names
        ("fp32", "high", "tf32"),
        ("bf16", "ieee", "bf16"),  # autocast matmuls run in 16 bit whatever the fp32 setting
        ("fp16", "tf32", "fp16"),
        ("fp32", None, "fp32"),  # unknown: the label
        ("tf32", "something-new", "tf32"),
    ],
)
def test_peak_column_follows_the_precision_in_force(precision, matmul_precision, column) -> None:
    assert peak_precision(precision, matmul_precision) == column


def test_fp32_label_with_tf32_in_force_never_reports_mfu_over_one() -> None:
    # 200 TFLOP/s achieved on an H100: impossible in IEEE fp32 (67), plausible with TF32 (494.5).
    flops_per_token, tokens_per_s = 2e9, 100_000.0
    assert mfu(flops_per_token, tokens_per_s, H100, "fp32") == pytest.approx(200.0 / 67.0)  # the mislabel
    in_force = mfu(flops_per_token, tokens_per_s, H100, "fp32", matmul_precision="tf32")
    assert in_force == pytest.approx(200.0 / peak_tflops(H100, "tf32")) and in_force < 1
    assert mfu(flops_per_token, tokens_per_s, H100, "bf16", matmul_precision="ieee") == pytest.approx(200.0 / 989.5)
