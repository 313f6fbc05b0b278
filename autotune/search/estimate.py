"""``autotune estimate``: the memory model's predictions as a table, without a GPU.

Calculation only; :func:`autotune.cli.cmd_estimate` displays it. The numbers are the ones the
tuner starts from (:class:`autotune.search.memory.MemoryModel` before any measurement): the model is
counted on the meta device, nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from autotune.errors import UsageError
from autotune.params import ATTN_IMPLEMENTATIONS, TrialParams
from autotune.search.memory import MemoryModel, ModelDims, activation_bytes_per_sample, static_memory


@dataclass(frozen=True)
class EstimateRow:
    """One precision x optimizer x checkpointing combination."""

    precision: str
    optim: str
    gradient_checkpointing: bool
    static_bytes: int  # weights + gradients + optimizer state + CUDA context
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activation_bytes_per_sample: int
    largest_batch: int | None  # of the space's batch sizes; None if not even the smallest fits
    peak_bytes_at_largest: int | None


@dataclass(frozen=True)
class MemoryEstimate:
    model: str
    num_parameters: int
    seq_len: int
    attn_implementation: str
    device_memory_bytes: int
    rows: tuple[EstimateRow, ...]
    # With --peft (autotune.lora): the adapters (LoraSettings.describe()), and the parameters that are trained
    # (num_parameters counts every one, adapters included) and stored in 4 bits. None/0 without.
    peft: str | None = None
    trainable_parameters: int | None = None
    quantized_parameters: int = 0
    use_liger_kernel: bool = False  # --liger-kernel: Liger's fused cross-entropy assumed (no logits tensor)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def estimate_table(
    model: str,
    *,
    seq_len: int,
    device_memory_bytes: int,
    space: str = "default",
    attn_implementation: str = "sdpa",
    peft: str | None = None,
    lora_r: int | None = None,
    lora_alpha: float | None = None,
    lora_target_modules: str | list[str] | None = None,
    use_liger_kernel: bool = False,
) -> MemoryEstimate:
    """Predicted memory per precision x optimizer x checkpointing of ``space``, and the largest batch that fits.

    ``use_liger_kernel``: with Liger's kernels, whose fused linear cross-entropy keeps no logits.

    ``peft``: ``lora`` or ``qlora`` with its adapters (:mod:`autotune.lora`): frozen base weights carry
    no gradient and no optimizer state (QLoRA's are 4-bit). A QLoRA estimate needs no GPU.

    Raises:
        UsageError: an unknown model, space or attention implementation, or a sequence length outside the model's
            range; bad LoRA settings, peft missing, or target modules the model does not have.
    """
    from autotune.models import resolve_model
    from autotune.space import load_space

    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        close = difflib.get_close_matches(str(attn_implementation), ATTN_IMPLEMENTATIONS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"--attn {attn_implementation!r} is not an attention implementation: {hint}use one of {', '.join(ATTN_IMPLEMENTATIONS)}")

    spec = resolve_model(model)
    if seq_len <= 0 or seq_len > spec.max_positions:
        raise UsageError(f"--seq-len {seq_len} is outside 1..{spec.max_positions}, the limit of {spec.name}")
    loaded = load_space(space)
    from autotune.lora import lora_settings, parameter_counts

    lora = lora_settings(peft, r=lora_r, alpha=lora_alpha, dropout=None, target_modules=lora_target_modules, device=None, runtime=False)
    counts = parameter_counts(spec, lora) if lora is not None else None
    dims = ModelDims.from_spec(spec, counts=counts)
    memory = MemoryModel(dims, seq_len)
    batch_sizes = loaded.choices["per_device_train_batch_size"]
    rows = []
    for precision in loaded.choices["precision"]:
        for optim in loaded.choices["optim"]:
            for ckpt in (False, True):
                params = TrialParams(precision=precision, optim=optim, gradient_checkpointing=ckpt, attn_implementation=attn_implementation,
                                     use_liger_kernel=use_liger_kernel)
                static = static_memory(dims, precision, optim)
                largest = memory.largest_batch_that_fits(params, batch_sizes, device_memory_bytes)
                peak = memory.predict(dataclasses.replace(params, per_device_train_batch_size=largest)) if largest else None
                rows.append(EstimateRow(
                    precision, optim, ckpt, static.total_bytes, static.weights_bytes, static.gradients_bytes,
                    static.optimizer_bytes, activation_bytes_per_sample(dims, params, seq_len), largest, peak,
                ))
    return MemoryEstimate(spec.name, dims.num_parameters, seq_len, attn_implementation, device_memory_bytes, tuple(rows),
                          peft=lora.describe() if lora else None, trainable_parameters=counts.trainable if counts else None,
                          quantized_parameters=counts.quantized if counts else 0, use_liger_kernel=use_liger_kernel)
