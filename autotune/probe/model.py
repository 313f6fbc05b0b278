"""The probe's model on the built-in path: built from its config on the device, in LoRA adapters with
``spec.peft``, or (QLoRA) loaded in 4 bits from a random-weight checkpoint shared by the run's probes;
and the parameter count that model FLOPs are computed from (:func:`matmul_params`)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from autotune.params import mixed_precision_dtype
from autotune.probe.flops import model_flops_per_token
from autotune.records import ProbeSpec


def build_probe_model(spec: ProbeSpec, cuda: bool) -> tuple[Any, Any, float, float]:
    """The built-in path's model, from its config on the device (in LoRA adapters with ``spec.peft``):
    (model, its parameter counts, seconds to build it, model FLOPs per token)."""
    import torch

    from autotune.lora import LoraSettings, count_model_parameters
    from autotune.models import ModelSpec, build_model

    params = spec.params
    model_spec = ModelSpec.from_dict(spec.model)
    lora = LoraSettings.from_dict(spec.peft) if spec.peft else None
    build_start_s = time.perf_counter()
    if lora is not None and lora.quantized:
        model = _build_4bit_model(model_spec, params, spec)
    else:
        model = build_model(model_spec, attn_implementation=params.attn_implementation, device="cuda" if cuda else "cpu")
    if lora is not None:
        model = _wrap_in_adapters(model, lora, params.gradient_checkpointing)
    counts = count_model_parameters(model)
    if cuda:
        torch.cuda.synchronize()
    model_build_s = time.perf_counter() - build_start_s
    matmul_count = matmul_params(model)
    flops_per_token = model_flops_per_token(
        matmul_count, model_spec.num_layers, model_spec.num_attention_heads, model_spec.head_dim, spec.seq_len,
        frozen_params=matmul_count - matmul_params(model, trainable_only=True),
    )
    return model, counts, model_build_s, flops_per_token


def matmul_params(model: Any, *, trainable_only: bool = False) -> int:
    """N of the FLOPs formula: every parameter except input embedding tables; a tied output
    projection is counted (it is a real matmul), once. ``trainable_only``: of those, the ones trained."""
    import torch

    params = {id(p): p.numel() for p in model.parameters() if p.requires_grad or not trainable_only}
    embeddings = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and id(output.weight) in embeddings:
        del embeddings[id(output.weight)]
    return sum(params.values()) - sum(n for key, n in embeddings.items() if key in params)


def _wrap_in_adapters(model: Any, lora: Any, gradient_checkpointing: bool) -> Any:
    """The model in its LoRA adapters (base weights frozen).

    With activation checkpointing the embeddings' output is made to require grad
    (``enable_input_require_grads``, as peft's ``prepare_model_for_kbit_training`` does): under
    reentrant checkpointing (transformers' default before 5.x) a checkpointed layer whose inputs and
    weights are all frozen gets no backward at all, so its adapters would never be trained; with
    transformers 5's non-reentrant default it costs one small extra gradient.
    """
    from autotune.lora import apply_lora

    wrapped = apply_lora(model, lora)
    if gradient_checkpointing:
        wrapped.enable_input_require_grads()
    return wrapped


def _build_4bit_model(model_spec: Any, params: Any, spec: ProbeSpec) -> Any:
    """QLoRA's base: the model with random weights loaded in 4 bits (NF4, double quantization) by
    bitsandbytes on the GPU, prepared for k-bit training (norms and the head upcast to fp32).

    transformers quantizes while loading a checkpoint, never in ``from_config``: the random-weight
    model is saved once per run (bf16, in the driver's run cache, :func:`qlora_base_checkpoint`) and
    each probe loads it with the quantization config.
    """
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision_dtype(params.precision) or "", torch.float32)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=compute)
    with qlora_base_checkpoint(model_spec) as folder:
        load_start_s = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=torch.bfloat16,
                                                     device_map={"": 0}, attn_implementation=params.attn_implementation)
        print(f"autotune: QLoRA base loaded in 4 bits in {time.perf_counter() - load_start_s:.1f}s", file=sys.stderr)
    model.config.use_cache = False
    # Checkpointing is the Trainer's to enable, as for every trial; _wrap_in_adapters makes inputs require grad.
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def env_folder(name: str) -> str | None:
    """The folder the parent names in ``$name`` (isolation.SCRATCH_ENV: this probe's scratch;
    isolation.RUN_CACHE_ENV: what the run's probes share), or None when unset or gone."""
    folder = os.environ.get(name)
    return folder if folder and os.path.isdir(folder) else None


@contextmanager
def qlora_base_checkpoint(model_spec: Any) -> Iterator[Path]:
    """A folder holding ``model_spec`` with random weights saved in bf16, for a 4-bit load.

    Inside a run (``$AUTOTUNE_RUN_CACHE``, :func:`autotune.probe.isolation.run_cache_dir`) it is
    written by the first probe that needs it and read by the others (a 1.3B model: 2.6 GB written
    once instead of per probe); it appears under its final name in one rename, so a probe killed while
    writing leaves no half checkpoint behind for the next. Outside a run, a temporary folder.
    """
    import hashlib
    import json
    import shutil

    import torch

    from autotune.models import build_model

    def save(folder: str) -> None:
        save_start_s = time.perf_counter()
        build_model(model_spec, attn_implementation=None, device="cpu", dtype=torch.bfloat16).save_pretrained(folder)
        print(f"autotune: QLoRA base built and saved in {time.perf_counter() - save_start_s:.1f}s", file=sys.stderr)

    cache = env_folder("AUTOTUNE_RUN_CACHE")
    if cache is None:
        with tempfile.TemporaryDirectory(prefix="autotune-qlora-base-", dir=env_folder("AUTOTUNE_PROBE_SCRATCH")) as folder:
            save(folder)
            yield Path(folder)
        return
    key = hashlib.sha256(json.dumps(model_spec.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]
    final = Path(cache) / f"qlora-base-{key}"
    if not final.is_dir():
        partial = Path(tempfile.mkdtemp(prefix=f"{final.name}.partial-", dir=cache))
        try:
            save(str(partial))
            os.replace(partial, final)  # another probe may have won the race: then its copy is used
        except OSError:
            if not final.is_dir():
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    yield final
