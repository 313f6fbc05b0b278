"""LoRA and QLoRA adapters for the model being tuned (``--peft lora|qlora``), through the ``peft`` library.

The adapter settings are the user's choice, never tuned: the rank changes the model (what is trained,
how much optimizer state there is), so a LoRA study is a study of its own (its settings are part of
the study's identity, ``autotune.studies.IDENTITY_KEYS``). Defaults are peft's own ``LoraConfig`` defaults:
rank 8, alpha 8, dropout 0, and peft's default target modules for the architecture
(``query_key_value`` for GPT-NeoX, ``c_attn`` for GPT-2, ``q_proj,v_proj`` for Llama).

* :func:`lora_settings` validates the options in the parent (``plan_run``): a one-line
  :class:`~autotune.errors.UsageError` naming the fix for a bad rank, alpha or dropout, a missing
  ``peft`` (``pip install 'autotune[lora]'``), QLoRA without CUDA or bitsandbytes.
* :func:`parameter_counts` wraps the model in its adapters on the meta device (nothing is allocated)
  and counts total, trainable and frozen parameters, as a probe will; target modules the model does
  not have are a :class:`UsageError` here, before any study is touched.
* :func:`apply_lora` is what the probe child runs after building the model.

Frozen base weights carry no gradient and no optimizer state; the adapters do
(:func:`autotune.search.memory_prior.static_memory`). Importing this module imports neither torch nor peft.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from autotune.errors import UsageError

if TYPE_CHECKING:
    import torch

PEFT_METHODS = ("lora", "qlora")
# peft's own LoraConfig defaults (peft/tuners/lora/config.py): r=8, lora_alpha=8, lora_dropout=0.0.
DEFAULT_LORA_R = 8
DEFAULT_LORA_ALPHA = 8.0
DEFAULT_LORA_DROPOUT = 0.0
INSTALL_PEFT = "pip install 'autotune[lora]'"


@dataclass(frozen=True)
class LoraSettings:
    """What ``--peft`` chose: the method and the adapters' shape.

    Attributes:
        method: ``lora`` (adapters over the full-precision base) or ``qlora`` (a 4-bit NF4 base).
        r: the adapters' rank.
        alpha: LoRA's scaling numerator (the update is scaled by ``alpha / r``).
        dropout: dropout on the adapters' input.
        target_modules: module names to wrap; None: peft's default for the architecture.
    """

    method: str
    r: int = DEFAULT_LORA_R
    alpha: float = DEFAULT_LORA_ALPHA
    dropout: float = DEFAULT_LORA_DROPOUT
    target_modules: tuple[str, ...] | None = None

    @property
    def quantized(self) -> bool:
        return self.method == "qlora"

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "r": self.r, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules) if self.target_modules is not None else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoraSettings:
        targets = data.get("target_modules")
        return cls(method=str(data["method"]), r=int(data.get("r", DEFAULT_LORA_R)), alpha=float(data.get("alpha", DEFAULT_LORA_ALPHA)),
                   dropout=float(data.get("dropout", DEFAULT_LORA_DROPOUT)), target_modules=tuple(targets) if targets is not None else None)

    def describe(self) -> str:
        """``LoRA r=8 alpha=8 dropout=0 on peft's default modules`` (the terminal header, the report, best.json's note)."""
        name = "QLoRA (4-bit NF4 base)" if self.quantized else "LoRA"
        targets = ",".join(self.target_modules) if self.target_modules else "peft's default modules"
        return f"{name} r={self.r} alpha={self.alpha:g} dropout={self.dropout:g} on {targets}"

    def lora_config(self) -> Any:
        """The ``peft.LoraConfig``."""
        from peft import LoraConfig

        alpha: Any = int(self.alpha) if float(self.alpha).is_integer() else self.alpha  # peft types it int; a float scales as well
        return LoraConfig(r=self.r, lora_alpha=alpha, lora_dropout=self.dropout, task_type="CAUSAL_LM",
                          target_modules=list(self.target_modules) if self.target_modules else None)


# Bytes per element of the dtypes a parameter is stored in (torch's names without "torch."); any other: 4.
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES.get(name, 4)


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the model as trained: ``total`` = ``trainable`` + frozen (adapters included in total).

    ``quantized``: frozen parameters stored in 4 bits (QLoRA's linear layers), 0 otherwise.
    ``dtypes`` / ``trainable_dtypes``: the other parameters (all / the trainable ones) by the dtype they
    are stored in, ``{"bfloat16": n, ...}``, as counted on the model the user's factory built; empty when
    not counted (autotune's own models: float32, the master weights mixed precision expects).
    """

    total: int
    trainable: int
    quantized: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    trainable_dtypes: dict[str, int] = field(default_factory=dict)

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    def stored_bytes(self) -> int | None:
        """Bytes the parameters that are not quantized take (None: dtypes not counted)."""
        return sum(n * dtype_bytes(d) for d, n in self.dtypes.items()) if self.dtypes else None

    def trainable_bytes(self) -> int | None:
        """Bytes the trainable parameters take, and so their gradients (None: dtypes not counted)."""
        return sum(n * dtype_bytes(d) for d, n in self.trainable_dtypes.items()) if self.dtypes else None

    def fp32_parameters(self) -> int | None:
        """Parameters stored in float32: the ones autocast copies into 16 bits under mixed precision."""
        return self.dtypes.get("float32", 0) if self.dtypes else None

    def describe_dtypes(self) -> str:
        """``1,331,810,304 bfloat16, 1,572,864 float32`` (largest first), or "" when not counted."""
        parts = sorted(self.dtypes.items(), key=lambda item: -item[1])
        if self.quantized:
            parts.append(("4-bit", self.quantized))
        return ", ".join(f"{n:,} {d}" for d, n in parts) if self.dtypes else ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"total": self.total, "trainable": self.trainable, "frozen": self.frozen, "quantized": self.quantized}
        if self.dtypes:
            out.update(dtypes=dict(self.dtypes), trainable_dtypes=dict(self.trainable_dtypes))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParameterCounts:
        """From :meth:`to_dict` (or an older record without the dtypes)."""
        return cls(total=int(data["total"]), trainable=int(data["trainable"]), quantized=int(data.get("quantized") or 0),
                   dtypes={str(k): int(v) for k, v in (data.get("dtypes") or {}).items()},
                   trainable_dtypes={str(k): int(v) for k, v in (data.get("trainable_dtypes") or {}).items()})


def peft_available() -> bool:
    return importlib.util.find_spec("peft") is not None


def bitsandbytes_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def parse_target_modules(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...] | None:
    """``"q_proj, v_proj"`` or a list -> ``("q_proj", "v_proj")``; None or empty: peft's default."""
    if value is None:
        return None
    words = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    names = tuple(dict.fromkeys(w.strip() for w in words if w.strip()))
    return names or None


def lora_settings(
    peft: str | None, *, r: int | None, alpha: float | None, dropout: float | None, target_modules: Any, device: Any,
    runtime: bool = True,
) -> LoraSettings | None:
    """Check ``--peft`` and the ``--lora-*`` options; None when no adapters are wanted.

    ``device``: the run's :class:`~autotune.records.DeviceInfo` (QLoRA needs CUDA). ``runtime=False``
    (``autotune estimate``, a prediction for some GPU): QLoRA's CUDA and bitsandbytes are not required.

    Raises:
        UsageError: one line naming the fix: an unknown method, a ``--lora-*`` option without
            ``--peft``, a rank below 1, a non-positive alpha, a dropout outside [0, 1), peft missing,
            QLoRA without a CUDA GPU or bitsandbytes.
    """
    if peft in (None, "", "none"):
        given = [flag for flag, value in (("--lora-r", r), ("--lora-alpha", alpha), ("--lora-dropout", dropout),
                                          ("--lora-target-modules", target_modules)) if value is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise UsageError(f"{', '.join(given)} only {verb} with --peft lora or --peft qlora: add --peft lora, or drop {given[0]}")
        return None
    if peft not in PEFT_METHODS:
        raise UsageError(f"--peft {peft!r} is not a method autotune applies: use --peft lora or --peft qlora (or leave it out)")
    rank = DEFAULT_LORA_R if r is None else r
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UsageError(f"--lora-r {r!r} must be a whole number of at least 1 (the adapters' rank): use e.g. --lora-r {DEFAULT_LORA_R}")
    scale = DEFAULT_LORA_ALPHA if alpha is None else alpha
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise UsageError(f"--lora-alpha {alpha!r} must be a positive number: use e.g. --lora-alpha {2 * rank}")
    drop = DEFAULT_LORA_DROPOUT if dropout is None else dropout
    if not isinstance(drop, (int, float)) or isinstance(drop, bool) or not 0 <= drop < 1:
        raise UsageError(f"--lora-dropout {dropout!r} must be in [0, 1): use e.g. --lora-dropout 0.05")
    settings = LoraSettings(method=peft, r=rank, alpha=float(scale), dropout=float(drop), target_modules=parse_target_modules(target_modules))
    if not peft_available():
        raise UsageError(f"--peft {peft} needs the peft library, which is not installed: {INSTALL_PEFT}")
    if settings.quantized and runtime:
        missing = []
        if not getattr(device, "is_cuda", False):
            missing.append("a CUDA GPU (bitsandbytes' 4-bit kernels; --device cuda)")
        if not bitsandbytes_available():
            missing.append("bitsandbytes (pip install bitsandbytes)")
        if missing:
            raise UsageError(f"--peft qlora loads the base model in 4 bits, which needs {' and '.join(missing)}: "
                             "provide them, or use --peft lora")
    return settings


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """Wrap ``model`` in ``settings``' adapters (``peft.get_peft_model``); the base weights are frozen.

    Raises:
        UsageError: target modules the model does not have, or an architecture peft has no default for
            (the message lists the model's linear layers to choose from).
    """
    import warnings

    from peft import get_peft_model

    try:
        with warnings.catch_warnings():  # GPT-2's Conv1D "fan_in_fan_out" notice, transformers' deprecations
            warnings.simplefilter("ignore")
            return get_peft_model(model, settings.lora_config())
    except ValueError as error:  # peft's NoMatchingPeftModuleError is a ValueError, as is "specify target_modules"
        layers = ",".join(linear_layer_names(model)[:12])
        what = f"--lora-target-modules {','.join(settings.target_modules)}" if settings.target_modules else "peft's default target modules"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"{what}: {first.rstrip('.')}; pass --lora-target-modules with some of this model's layers: {layers}") from error


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what ``--lora-target-modules`` takes)."""
    import torch

    names: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            names.setdefault(name.rsplit(".", 1)[-1], None)
    return list(names)


def count_model_parameters(model: torch.nn.Module, *, quantized: int = 0) -> ParameterCounts:
    """Total and trainable (``requires_grad``) parameters of a built model, each shared parameter once,
    with the dtypes they are stored in.

    A bitsandbytes 4-bit weight (``Params4bit``) packs two values per byte of its storage: it counts
    as the weights it holds, and among ``quantized`` (added to ``quantized``, which a meta-device
    count passes in), not among the dtypes.
    """
    total = trainable = 0
    dtypes: dict[str, int] = {}
    trainable_dtypes: dict[str, int] = {}
    for param in {id(p): p for p in model.parameters()}.values():
        n = param.numel()
        if type(param).__name__ == "Params4bit":
            n *= 2 * (param.element_size() if hasattr(param, "element_size") else 1)
            quantized += n
        else:
            name = str(param.dtype).removeprefix("torch.")
            dtypes[name] = dtypes.get(name, 0) + n
            if param.requires_grad:
                trainable_dtypes[name] = trainable_dtypes.get(name, 0) + n
        total += n
        trainable += n if param.requires_grad else 0
    return ParameterCounts(total=total, trainable=trainable, quantized=quantized, dtypes=dtypes, trainable_dtypes=trainable_dtypes)


def quantizable_parameters(model: torch.nn.Module) -> int:
    """Weights bitsandbytes' 4-bit loading quantizes: every linear layer's except the output head."""
    import torch

    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    skip = {id(output.weight)} if output is not None else set()
    seen: set[int] = set()
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            weight: Any = module.weight
            if id(weight) not in skip and id(weight) not in seen:
                seen.add(id(weight))
                count += weight.numel()
    return count


def parameter_counts(spec: Any, settings: LoraSettings | None) -> ParameterCounts:
    """Total, trainable and frozen parameters of ``spec`` (a ModelSpec) with ``settings``' adapters,
    counted on the meta device (nothing is allocated).

    Raises:
        UsageError: as :func:`apply_lora`.
    """
    return _parameter_counts_cached(spec.to_json(), settings)


@lru_cache(maxsize=32)
def _parameter_counts_cached(spec_json: str, settings: LoraSettings | None) -> ParameterCounts:
    import torch
    from transformers import AutoModelForCausalLM

    from autotune.models import ModelSpec

    spec = ModelSpec.from_json(spec_json)
    config = spec.to_config()
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if settings is None:
        return count_model_parameters(model)
    quantized = quantizable_parameters(model) if settings.quantized else 0
    counts = count_model_parameters(apply_lora(model, settings), quantized=quantized)
    # On the meta device every weight is float32, the quantized ones too: the memory model's own
    # assumption (float32, 4-bit weights apart) is the right one, so no dtypes are recorded.
    return dataclasses.replace(counts, dtypes={}, trainable_dtypes={})


# How a QLoRA probe loads its base (autotune.probe.model._build_4bit_model), for the user's script.
QLORA_BASE_CODE = ('from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", '
                   'bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=the bf16/fp16 dtype trained in)), then '
                   'peft.prepare_model_for_kbit_training(model)')


def note(settings: LoraSettings | None, counts: dict[str, Any] | None = None) -> str | None:
    """The line best.json and the export carry: what the configuration was measured with (TrainingArguments
    has no LoRA field, so the user's script must wrap the model the same way)."""
    if settings is None:
        return None
    trained = ""
    if counts and counts.get("trainable") and counts.get("total"):
        trained = f" ({counts['trainable']:,} of {counts['total']:,} parameters trainable)"
    load = f"load the base in 4 bits with {QLORA_BASE_CODE}, then " if settings.quantized else ""
    return (f"measured with {settings.describe()}{trained}: {load}wrap the model with "
            f"peft.get_peft_model(model, {settings_code(settings)}) before Trainer")


def settings_code(settings: LoraSettings) -> str:
    """``LoraConfig(r=8, lora_alpha=8, ...)`` as Python source."""
    parts = [f"r={settings.r}", f"lora_alpha={settings.alpha:g}", f"lora_dropout={settings.dropout:g}"]
    if settings.target_modules:
        parts.append(f"target_modules={list(settings.target_modules)!r}")
    parts.append('task_type="CAUSAL_LM"')
    return f"LoraConfig({', '.join(parts)})"
