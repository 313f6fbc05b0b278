"""The parameters one trial sets, and how they map onto ``transformers.TrainingArguments``.

The parameter names are a contract: search-space files, Optuna studies, replay tables and
reports all use them as keys or column names.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from autotune.sharding import NONE as NO_SHARDING
from autotune.sharding import training_arguments_kwargs as sharding_kwargs

# fp32 | tf32 (fp32 weights, TF32 matmuls) | fp16 | bf16 (autocast mixed precision, fp32 master weights) |
# fp16+tf32 | bf16+tf32 (the same, with TF32 for the matmuls autocast leaves in fp32, as the transformers
# GPU guide combines bf16=True, tf32=True).
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp16+tf32", "bf16+tf32")
AMP_PRECISIONS = ("fp16", "bf16")  # the 16-bit compute dtypes of autocast mixed precision
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager", "onnxrt", "tvm", "openxla")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")

# transformers' own defaults (TrainingArguments() and from_pretrained()): the baseline trial.
DEFAULT_BATCH_SIZE = 8
DEFAULT_OPTIM = "adamw_torch_fused"
DEFAULT_ATTN = "sdpa"
# DataLoader settings of its worker processes: with dataloader_num_workers = 0 there are none, so these
# mean nothing (and TrainingArguments refuses a prefetch factor). The one rule for them: such a point
# holds them at transformers' defaults (TrialParams.__post_init__), like a fixed effective batch size
# derives accumulation, so equal trainings have equal keys and TrainingArguments never sees them.
WORKER_ONLY_PARAMS = ("dataloader_persistent_workers", "dataloader_prefetch_factor")
# What a compiled graph depends on: Trainer compiles the model, so not the optimizer, the
# accumulation or the loader. A graph compiled before in a run comes from inductor's cache (on an
# H100, pythia-160m: ~10 s against ~30-42 s the first time; with checkpointing ~40 s every time).
COMPILED_GRAPH_PARAMS = ("per_device_train_batch_size", "precision", "attn_implementation", "gradient_checkpointing",
                         "use_liger_kernel", "torch_compile")
# Parameters by the kind of value they take (space files, replay tables and data frames are read by these).
BOOL_PARAMS = ("gradient_checkpointing", "use_liger_kernel", "dataloader_pin_memory", "dataloader_persistent_workers")
OPTIONAL_INT_PARAMS = ("torch_empty_cache_steps", "dataloader_prefetch_factor")  # None, or a positive integer


@dataclass(frozen=True)
class TrialParams:
    """One point of the search space: exactly what a probe (and later the user's run) uses."""

    per_device_train_batch_size: int = DEFAULT_BATCH_SIZE
    gradient_accumulation_steps: int = 1
    precision: str = "fp32"  # one of PRECISIONS
    optim: str = DEFAULT_OPTIM  # a TrainingArguments `optim` name
    torch_compile: str = "off"  # "off" or "backend[:mode]", e.g. "inductor", "inductor:max-autotune"
    attn_implementation: str = DEFAULT_ATTN  # passed to from_pretrained/from_config, not to TrainingArguments
    dataloader_num_workers: int = 0
    gradient_checkpointing: bool = False
    # Added later (KNOBS_ADDED_LATER), each at transformers' default, so a study or replay table from
    # before them reads as that default. All are TrainingArguments fields of the same name.
    use_liger_kernel: bool = False  # Liger's Triton kernels (fused linear cross-entropy: no logits tensor)
    torch_empty_cache_steps: int | None = None  # torch.cuda.empty_cache() every N steps; None: never
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False  # only with workers (WORKER_ONLY_PARAMS)
    dataloader_prefetch_factor: int | None = None  # batches loaded ahead per worker; None: torch's 2 (only with workers)
    sharding: str = NO_SHARDING  # DeepSpeed ZeRO stage and offload (autotune.sharding.SHARDINGS); "none": the Trainer's DDP
    # Fields of the user's own config class that the space searches beyond the dimensions above (TRL's
    # ``packing``, ``padding_free``...), as sorted (name, value) pairs: read as attributes
    # (``params.packing``), flattened into to_dict() and the Optuna parameters, part of key().
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # One form per configuration: integers read back from data frames (numpy scalars, floats with
        # NaN for None) become Python values, and the worker-only settings of a point without workers
        # are held at their defaults (WORKER_ONLY_PARAMS).
        for name in KNOBS_ADDED_LATER:
            value = getattr(self, name)
            if hasattr(value, "item"):
                value = value.item()
            if name in OPTIONAL_INT_PARAMS and isinstance(value, float):
                value = None if math.isnan(value) else int(value)
            if self.dataloader_num_workers == 0 and name in WORKER_ONLY_PARAMS:
                value = PARAM_DEFAULTS[name]
            if value is not getattr(self, name):
                object.__setattr__(self, name, value)
        extra = self.extra.items() if isinstance(self.extra, Mapping) else self.extra
        normal = tuple(sorted((str(k), v.item() if hasattr(v, "item") else v) for k, v in extra))
        if normal != self.extra:
            object.__setattr__(self, "extra", normal)

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not fields: the user-config fields in ``extra``.
        try:
            extra = object.__getattribute__(self, "extra")
        except AttributeError:
            raise AttributeError(name) from None
        for key, value in extra:
            if key == name:
                return value
        raise AttributeError(f"TrialParams has no parameter {name!r}")

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step on one device."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def key(self) -> tuple[Any, ...]:
        """The configuration as a hashable tuple, in :data:`PARAM_NAMES` order, then ``extra``: equal keys, same configuration."""
        return (*(getattr(self, name) for name in PARAM_NAMES), self.extra)

    @classmethod
    def from_key(cls, key: tuple[Any, ...]) -> TrialParams:
        """The configuration of a :meth:`key`."""
        return cls(**dict(zip(PARAM_NAMES, key)), extra=key[len(PARAM_NAMES)] if len(key) > len(PARAM_NAMES) else ())

    def replace(self, **changes: Any) -> TrialParams:
        """A copy with some parameters changed (user-config fields by their own names too)."""
        if _PARAM_NAME_SET.issuperset(changes):  # autotune's own dimensions only: the dataclass's copy
            return dataclasses.replace(self, **changes)
        return TrialParams.from_flat({**self.flat(), **changes}, {*dict(self.extra), *(k for k in changes if k not in PARAM_NAMES)})

    def to_dict(self) -> dict[str, Any]:
        """Every parameter by name; the user-config fields, if any, as a mapping under ``"extra"`` (left out when
        there are none, so stored configurations and tables from before them read unchanged)."""
        data = {name: getattr(self, name) for name in PARAM_NAMES}
        if self.extra:
            data["extra"] = dict(self.extra)
        return data

    def flat(self) -> dict[str, Any]:
        """Every parameter by name, the user-config fields among them (Optuna parameters, table columns)."""
        return {**{name: getattr(self, name) for name in PARAM_NAMES}, **dict(self.extra)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrialParams:
        """The inverse of :meth:`to_dict` (other keys are ignored)."""
        extra = values.get("extra") or {}
        return cls(**{k: v for k, v in values.items() if k in PARAM_NAMES}, extra=tuple(dict(extra).items()))

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], extra_names: Iterable[str] = ()) -> TrialParams:
        """The inverse of :meth:`flat`, given the names of the user-config fields (other keys are ignored)."""
        return cls(**{k: v for k, v in values.items() if k in PARAM_NAMES},
                   extra=tuple((k, values[k]) for k in extra_names if k in values))

    def training_arguments_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``TrainingArguments`` (``attn_implementation`` excluded)."""
        kwargs: dict[str, Any] = {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "optim": self.optim,
            "dataloader_num_workers": self.dataloader_num_workers,
            checkpointing_field(): self.gradient_checkpointing,
        }
        amp = mixed_precision_dtype(self.precision)
        if amp is not None:
            kwargs[amp] = True  # bf16=True or fp16=True
        if uses_tf32(self.precision):
            kwargs["tf32"] = True
        backend, mode = parse_compile(self.torch_compile)
        if backend is not None:
            kwargs["torch_compile"] = True
            kwargs["torch_compile_backend"] = backend
            if mode is not None:
                kwargs["torch_compile_mode"] = mode
        # The later knobs only where they differ from transformers' default (worker-only ones are at
        # their default without workers: __post_init__), so older exports read unchanged.
        for name in KNOBS_ADDED_LATER:
            if getattr(self, name) != PARAM_DEFAULTS[name] and name not in NOT_CONFIG_FIELDS:
                kwargs[name] = getattr(self, name)
        kwargs.update(sharding_kwargs(self.sharding))  # deepspeed=, nothing for none
        kwargs.update(self.extra)  # the user's own config fields, by their own names
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
        other = self.other_settings()
        if other:
            parts.append(other)
        return " ".join(parts)

    def other_settings(self) -> str:
        """The knobs added later (:data:`KNOBS_ADDED_LATER`) that differ from their defaults, compactly
        (``"prefetch4 persistent no-pin empty-cache/4 liger"``); "" when all are at their defaults."""
        parts = []
        if self.dataloader_prefetch_factor is not None:
            parts.append(f"prefetch{self.dataloader_prefetch_factor}")
        if self.dataloader_persistent_workers:
            parts.append("persistent")
        if not self.dataloader_pin_memory:
            parts.append("no-pin")
        if self.torch_empty_cache_steps is not None:
            parts.append(f"empty-cache/{self.torch_empty_cache_steps}")
        if self.use_liger_kernel:
            parts.append("liger")
        if self.sharding != NO_SHARDING:
            parts.append(self.sharding)
        parts.extend(f"{name}={_short_value(value)}" for name, value in self.extra)
        return " ".join(parts)


def _short_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


# The built-in dimensions (the user-config fields of ``extra`` come on top, by their own names).
PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrialParams) if f.name != "extra")
_PARAM_NAME_SET = frozenset(PARAM_NAMES)
# Dimensions added after studies, replay tables and exports existed: where one is missing it reads as
# its default (a replay table without the column, a stored space or trial from before it), and a space
# holding it at its default alone stores it no more, so such studies resume under the same name.
KNOBS_ADDED_LATER: tuple[str, ...] = (
    "use_liger_kernel", "torch_empty_cache_steps", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "sharding",
)
# Dimensions that are not config fields of their own name: ``sharding`` is the ``deepspeed`` dict it makes
# (autotune.sharding), absent for ``none``.
NOT_CONFIG_FIELDS: tuple[str, ...] = ("sharding",)
# Each parameter's default (transformers' own): what a missing key, column or stored value reads as. Read-only.
PARAM_DEFAULTS: Mapping[str, Any] = MappingProxyType({f.name: f.default for f in dataclasses.fields(TrialParams) if f.name != "extra"})


def mixed_precision_dtype(precision: str) -> str | None:
    """The autocast dtype of a mixed-precision ``precision`` (``"bf16"`` for bf16 and bf16+tf32), else None."""
    base = precision.removesuffix("+tf32")
    return base if base in AMP_PRECISIONS else None


def uses_tf32(precision: str) -> bool:
    """Whether a trial of ``precision`` runs its fp32 matmuls on TF32 tensor cores (tf32, bf16+tf32, fp16+tf32)."""
    return precision == "tf32" or precision.endswith("+tf32")


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

    TF32 ("high") for tf32, bf16+tf32 and fp16+tf32 trials (:func:`uses_tf32`). fp32 means IEEE fp32
    matmuls ("highest"). Under fp16/bf16 autocast the matmuls run in 16 bit; what stays in fp32 keeps
    PyTorch's default, "highest", as in a user's run without torch.compile, unless the precision asks
    for TF32 on top. The probe sets it before training (transformers and accelerate turn TF32 on for
    torch.compile behind the label), and the exported code tells the user's run to do the same.
    """
    return "high" if uses_tf32(precision) else "highest"


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
