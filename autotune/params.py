"""The parameters one trial sets, and how they map onto ``transformers.TrainingArguments``.

The parameter names are a contract: search-space files, Optuna studies, replay tables and
reports all use them as keys or column names.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager", "onnxrt", "tvm", "openxla")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")

# transformers' own defaults (TrainingArguments() and from_pretrained()): the baseline trial.
DEFAULT_BATCH_SIZE = 8
DEFAULT_OPTIM = "adamw_torch_fused"
DEFAULT_ATTN = "sdpa"


@dataclass(frozen=True)
class TrialParams:
    """One point of the search space: exactly what a probe (and later the user's run) uses."""

    per_device_train_batch_size: int = DEFAULT_BATCH_SIZE
    gradient_accumulation_steps: int = 1
    precision: str = "fp32"  # fp32 | tf32 | fp16 | bf16 (the last two as mixed precision, fp32 master weights)
    optim: str = DEFAULT_OPTIM  # a TrainingArguments `optim` name
    torch_compile: str = "off"  # "off" or "backend[:mode]", e.g. "inductor", "inductor:max-autotune"
    attn_implementation: str = DEFAULT_ATTN  # passed to from_pretrained/from_config, not to TrainingArguments
    dataloader_num_workers: int = 0
    gradient_checkpointing: bool = False

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step on one device."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def key(self) -> tuple[Any, ...]:
        """The configuration as a hashable tuple, in :data:`PARAM_NAMES` order: equal keys, same configuration."""
        return tuple(getattr(self, name) for name in PARAM_NAMES)

    def replace(self, **changes: Any) -> TrialParams:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrialParams:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def training_arguments_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``TrainingArguments`` (``attn_implementation`` excluded)."""
        kwargs: dict[str, Any] = {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "optim": self.optim,
            "dataloader_num_workers": self.dataloader_num_workers,
            checkpointing_field(): self.gradient_checkpointing,
        }
        if self.precision == "bf16":
            kwargs["bf16"] = True
        elif self.precision == "fp16":
            kwargs["fp16"] = True
        elif self.precision == "tf32":
            kwargs["tf32"] = True
        backend, mode = parse_compile(self.torch_compile)
        if backend is not None:
            kwargs["torch_compile"] = True
            kwargs["torch_compile_backend"] = backend
            if mode is not None:
                kwargs["torch_compile_mode"] = mode
        return kwargs

    def short(self) -> str:
        """A compact one-line description for tables and logs."""
        parts = [
            f"bs{self.per_device_train_batch_size}x{self.gradient_accumulation_steps}",
            self.precision,
            self.optim,
            self.attn_implementation,
        ]
        if self.torch_compile != "off":
            parts.append(f"compile={self.torch_compile}")
        if self.gradient_checkpointing:
            parts.append("ckpt")
        if self.dataloader_num_workers:
            parts.append(f"w{self.dataloader_num_workers}")
        return " ".join(parts)


PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrialParams))


@functools.lru_cache(maxsize=1)
def checkpointing_field() -> str:
    """The TrainingArguments field for activation checkpointing in the installed transformers.

    transformers 5 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` (the old
    name warns and goes in v6); our parameter keeps the well-known name.
    """
    try:
        from transformers import TrainingArguments
    except ImportError:
        return "gradient_checkpointing"
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def fp32_matmul_setting(precision: str) -> str:
    """``torch.set_float32_matmul_precision``'s setting for a trial of ``precision``.

    TF32 ("high") for a tf32 trial only. fp32 means IEEE fp32 matmuls ("highest"). Under fp16/bf16
    autocast the matmuls run in 16 bit; what stays in fp32 keeps PyTorch's default, "highest", as
    in a user's run without torch.compile. The probe sets it before training (transformers and
    accelerate turn TF32 on for torch.compile behind the label), and the exported code tells the
    user's run to do the same.
    """
    return "high" if precision == "tf32" else "highest"


def parse_compile(value: str) -> tuple[str | None, str | None]:
    """``"off"`` -> (None, None); ``"inductor:max-autotune"`` -> ("inductor", "max-autotune")."""
    if value in ("off", "", "false", "none"):
        return None, None
    backend, _, mode = value.partition(":")
    return backend, (mode or None)


def baseline_params(effective_batch_size: int | None = None, batch_sizes: tuple[int, ...] = ()) -> TrialParams:
    """transformers' defaults for this model: bs 8, fp32, default optimizer, no compile, default attention.

    With a fixed effective batch size N, the baseline keeps N: the largest allowed batch size <= 8 that
    divides N, with the matching accumulation.
    """
    if effective_batch_size is None:
        return TrialParams()
    candidates = [b for b in (batch_sizes or (1, 2, 4, 8)) if b <= DEFAULT_BATCH_SIZE and effective_batch_size % b == 0]
    if not candidates:
        candidates = [b for b in batch_sizes if effective_batch_size % b == 0] or [1]
        batch = min(candidates)
    else:
        batch = max(candidates)
    return TrialParams(per_device_train_batch_size=batch, gradient_accumulation_steps=effective_batch_size // batch)
