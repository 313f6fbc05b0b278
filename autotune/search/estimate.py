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
from autotune.search.memory import MemoryModel
from autotune.search.memory_prior import ModelDims, activation_bytes_per_sample, host_state_bytes, peak_static_bytes, static_memory
from autotune.sharding import NONE, SHARDINGS, incompatible


@dataclass(frozen=True)
class EstimateRow:
    """One precision x optimizer x checkpointing combination."""

    precision: str
    optim: str
    gradient_checkpointing: bool
    static_bytes: int  # what the peak holds beside activations at the largest batch (batch 1 if none fits): memory_prior.peak_static_bytes
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activation_bytes_per_sample: int
    largest_batch: int | None  # of the space's batch sizes; None if not even the smallest fits (on the device, or the host)
    peak_bytes_at_largest: int | None
    sharding: str = NONE  # autotune.sharding.SHARDINGS: ZeRO stage and offload
    host_bytes: int = 0  # host memory of the offloaded state (all ranks together)
    only_with_offload: bool = False  # no batch fits without offloading at this precision, optimizer and checkpointing


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
    host_memory_bytes: int | None = None  # --host-memory: what the offloaded state must fit in; None: not asked (no offload rows)
    nproc: int = 1  # ranks the state is partitioned over (--nproc-per-probe)

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
    host_memory_bytes: int | None = None,
    nproc: int = 1,
) -> MemoryEstimate:
    """Predicted memory per precision x optimizer x checkpointing of ``space``, and the largest batch that fits.

    ``use_liger_kernel``: with Liger's kernels, whose fused linear cross-entropy keeps no logits.

    ``host_memory_bytes``: add the rows of DeepSpeed ZeRO's offload (and, over ``nproc`` > 1 ranks, its stages), whose
    offloaded state must fit in this much host memory; a row that fits only with offload is marked so.

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
    if nproc < 1:
        raise UsageError(f"--nproc-per-probe must be at least 1, got {nproc}")
    if host_memory_bytes is not None and host_memory_bytes <= 0:
        raise UsageError("--host-memory must be positive, e.g. 120GiB")
    memory = MemoryModel(dims, seq_len, world=nproc)
    batch_sizes = loaded.choices["per_device_train_batch_size"]
    shardings = [NONE]
    if host_memory_bytes is not None or nproc > 1:  # a stage without offload partitions nothing over one rank
        shardings += [s.name for s in SHARDINGS.values() if s.stage and (nproc > 1 or s.offload_optimizer)
                      and (host_memory_bytes is not None or not s.offload_optimizer)]
    rows = []
    for precision in loaded.choices["precision"]:
        for optim in loaded.choices["optim"]:
            for ckpt in (False, True):
                alike = []  # this precision, optimizer and checkpointing under every sharding
                for sharding in shardings:
                    if incompatible(sharding, optim) is not None:
                        continue  # offload runs DeepSpeed's own AdamW: no row for a pair that cannot train
                    params = TrialParams(precision=precision, optim=optim, gradient_checkpointing=ckpt, attn_implementation=attn_implementation,
                                         use_liger_kernel=use_liger_kernel, sharding=sharding)
                    static = static_memory(dims, precision, optim, sharding, nproc)
                    host = host_state_bytes(dims, params)
                    largest = memory.largest_batch_that_fits(params, batch_sizes, device_memory_bytes)
                    if host_memory_bytes is not None and host > host_memory_bytes:
                        largest = None  # the offloaded state does not fit on the host
                    peak = memory.predict(dataclasses.replace(params, per_device_train_batch_size=largest)) if largest else None
                    per_sample = activation_bytes_per_sample(dims, params, seq_len)
                    held = int(peak_static_bytes(static, params, (largest or 1) * per_sample))
                    alike.append(EstimateRow(
                        precision, optim, ckpt, held, static.weights_bytes, static.gradients_bytes,
                        static.optimizer_bytes, per_sample, largest, peak,
                        sharding=sharding, host_bytes=host,
                    ))
                fits_without_offload = any(r.largest_batch is not None and not SHARDINGS[r.sharding].offload_optimizer for r in alike)
                rows += [dataclasses.replace(r, only_with_offload=SHARDINGS[r.sharding].offload_optimizer and r.largest_batch is not None
                                             and not fits_without_offload) for r in alike]
    return MemoryEstimate(spec.name, dims.num_parameters, seq_len, attn_implementation, device_memory_bytes, tuple(rows),
                          peft=lora.describe() if lora else None, trainable_parameters=counts.trainable if counts else None,
                          quantized_parameters=counts.quantized if counts else 0, use_liger_kernel=use_liger_kernel,
                          host_memory_bytes=host_memory_bytes, nproc=nproc)
