"""The fields of a training config class (``TrainingArguments`` or a subclass such as TRL's ``SFTConfig``):
which can be searched, what values each takes, and how a trial becomes the class's fields and command-line flags.

A search space may list any field of the class the user trains with (``packing``, ``padding_free``,
``dataloader_drop_last``...) beside autotune's own dimensions (:data:`autotune.params.PARAM_NAMES`).
The class lives in the child (the parent never imports the user's code), so the child describes it
(:func:`describe_fields`) and the parent checks the space against that description
(:func:`check_config_values`). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from autotune.params import KNOBS_ADDED_LATER, NOT_CONFIG_FIELDS, PARAM_DEFAULTS, WORKER_ONLY_PARAMS, TrialParams

Kind = Literal["bool", "int", "float", "str", "other"]

# Fields a probe sets itself (where it writes, how long it runs, what it logs): never searched, and
# left out of the configuration a user takes home.
PROBE_FIELDS = frozenset({
    "output_dir", "overwrite_output_dir", "max_steps", "num_train_epochs", "use_cpu", "seed", "data_seed",
    "save_strategy", "save_steps", "save_total_limit", "report_to", "logging_strategy", "logging_steps",
    "logging_first_step", "logging_dir", "disable_tqdm", "run_name", "push_to_hub", "hub_model_id", "hub_token",
    "hub_strategy", "hub_private_repo", "do_train", "do_eval", "do_predict", "eval_strategy", "evaluation_strategy",
    "eval_steps", "load_best_model_at_end", "resume_from_checkpoint", "local_rank",
})
# Fields autotune searches under its own names (precision, torch_compile, ...): a space names those instead.
BUILTIN_FIELDS: dict[str, str] = {
    "bf16": "precision", "fp16": "precision", "tf32": "precision",
    "torch_compile": "torch_compile", "torch_compile_backend": "torch_compile", "torch_compile_mode": "torch_compile",
    "gradient_checkpointing": "gradient_checkpointing", "activation_checkpointing": "gradient_checkpointing",
}
# Fields that change what a batch holds (its sequences and their lengths), not only how fast it runs:
# searched only when the space lists them, and the report says so.
BATCH_CONTENT_FIELDS = frozenset({
    "packing", "padding_free", "packing_strategy", "max_length", "max_seq_length", "completion_only_loss",
    "assistant_only_loss", "group_by_length", "dataloader_drop_last", "pad_to_multiple_of",
})


@dataclass(frozen=True)
class FieldKind:
    """What one field of a config class takes: its scalar kind, whether None is allowed, its choices, its default."""

    name: str
    kind: Kind
    optional: bool = False
    choices: tuple[Any, ...] | None = None  # a Literal's or an Enum's values
    default: Any = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not a value of this field (None: it is)."""
        if value is None:
            return None if self.optional or self.default is None else f"{self.name} cannot be null"
        if self.kind == "bool" and not isinstance(value, bool):
            return f"{value!r} is not true or false"
        if self.kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{value!r} is not an integer"
        if self.kind == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"{value!r} is not a number"
        if self.kind == "str" and not isinstance(value, str):
            return f"{value!r} is not a string"
        if self.kind == "other":
            return f"{self.name} does not take a single true/false, number or string value, so autotune cannot search it"
        if self.choices is not None and value not in self.choices:
            return f"{value!r} is not one of {', '.join(map(str, self.choices))}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "optional": self.optional,
                "choices": list(self.choices) if self.choices is not None else None, "default": _jsonable(self.default)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FieldKind:
        choices = data.get("choices")
        return cls(name=data["name"], kind=data["kind"], optional=bool(data.get("optional")),
                   choices=tuple(choices) if choices is not None else None, default=data.get("default"))


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _kind_of(annotation: Any) -> tuple[Kind, bool, tuple[Any, ...] | None]:
    """(kind, optional, choices) of a dataclass field's type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    optional = False
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        optional = len(members) < len(args)
        if str in members and len(members) > 1:  # Union[SomeEnum, str]: any string (the enum's values are its usual ones)
            return "str", optional, None
        if len(members) != 1:
            return "other", optional, None
        annotation = members[0]
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        kinds = {type(a) for a in args}
        kind: Kind = "str" if kinds == {str} else "int" if kinds == {int} else "bool" if kinds == {bool} else "other"
        return kind, optional, tuple(args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "str", optional, tuple(m.value for m in annotation)
    scalar: dict[Any, Kind] = {bool: "bool", int: "int", float: "float", str: "str"}
    return scalar.get(annotation, "other"), optional, None


def describe_fields(config_class: type) -> dict[str, FieldKind]:
    """Every init field of a config dataclass, by name, with what it takes."""
    try:
        hints = typing.get_type_hints(config_class)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: fall back to each field's own
        hints = {}
    described = {}
    for item in dataclasses.fields(config_class):
        if not item.init or item.name.startswith("_"):
            continue
        kind, optional, choices = _kind_of(hints.get(item.name, item.type))
        default = item.default if item.default is not dataclasses.MISSING else None
        described[item.name] = FieldKind(item.name, kind, optional or default is None, choices, _jsonable(default))
    return described


def training_arguments_fields() -> dict[str, FieldKind]:
    """:func:`describe_fields` of the installed ``transformers.TrainingArguments`` (a ``--model`` run's class)."""
    from transformers import TrainingArguments

    return describe_fields(TrainingArguments)


def searchable(fields: dict[str, FieldKind]) -> list[str]:
    """The fields a space may list as user-config fields: not the probe's own, not autotune's under another name."""
    from autotune.params import PARAM_NAMES

    return [n for n in fields if n not in PROBE_FIELDS and n not in BUILTIN_FIELDS and n not in PARAM_NAMES]


def check_config_values(name: str, values: tuple[Any, ...], fields: dict[str, FieldKind], class_name: str) -> list[str]:
    """Problems with a space key ``name`` that is not one of autotune's dimensions, as ``key: problem`` lines."""
    import difflib

    from autotune.params import PARAM_NAMES

    if name in BUILTIN_FIELDS:
        return [f"{name}: autotune searches it as {BUILTIN_FIELDS[name]}: list {BUILTIN_FIELDS[name]} values instead"]
    if name in PROBE_FIELDS:
        return [f"{name}: every probe sets it itself (it decides where a probe writes, how long it runs or what it logs): "
                "leave it out of the space"]
    if name not in fields:
        close = difflib.get_close_matches(name, [*PARAM_NAMES, *searchable(fields)], n=1, cutoff=0.75)
        close = close or difflib.get_close_matches(name, PARAM_NAMES, n=1, cutoff=0.4) or [n for n in PARAM_NAMES if name.lower() in n][:1]
        hint = f" (did you mean {close[0]}?)" if close else ""
        return [f"{name}: unknown parameter{hint}, neither autotune's nor a field of {class_name}"]
    return [f"{name}: {problem}" for value in values if (problem := fields[name].problem(value))]


def config_overrides(params: TrialParams) -> dict[str, Any]:
    """Every config field a trial decides, with explicit values (``bf16=False`` for fp32), so that applied on top
    of a user's own config (which may say ``bf16=True``) it gives exactly the trial: the trial's own
    :meth:`~autotune.params.TrialParams.training_arguments_kwargs` over the values it leaves out because they are
    transformers' defaults. Fields whose value would be None (torch's default prefetch, no cache emptying) are left
    out: a command-line flag cannot say None."""
    values: dict[str, Any] = {"bf16": False, "fp16": False, "tf32": False, "torch_compile": False}
    values.update({name: PARAM_DEFAULTS[name] for name in KNOBS_ADDED_LATER
                   if (params.dataloader_num_workers or name not in WORKER_ONLY_PARAMS) and name not in NOT_CONFIG_FIELDS})
    values.update(params.training_arguments_kwargs())
    return {k: v for k, v in values.items() if v is not None}


def as_flags(values: dict[str, Any]) -> list[str]:
    """``{"bf16": True, "packing": False, "optim": "adamw_torch"}`` -> ``["--bf16", "true", "--packing", "false", "--optim", "adamw_torch"]``:
    what ``HfArgumentParser`` (and TRL's ``TrlParser``) read back into the same values."""
    flags: list[str] = []
    for name, value in values.items():
        flags += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def params_from_config(values: dict[str, Any], base: TrialParams, extra_names: tuple[str, ...] = (),
                       extra_defaults: dict[str, Any] | None = None) -> TrialParams:
    """The trial a config runs: ``values`` (config fields by name, e.g. a user's own ``SFTConfig`` settings or a
    ``--baseline`` file) read into autotune's dimensions, on top of ``base``; the user-config fields of the space
    (``extra_names``) at their value in ``values``, else in ``extra_defaults`` (the class's defaults).
    ``attn_implementation`` may be one of ``values`` (a model-loading setting, not a config field)."""
    changes: dict[str, Any] = {}
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "optim", "dataloader_num_workers",
                 "use_liger_kernel", "torch_empty_cache_steps", "dataloader_pin_memory", "dataloader_persistent_workers",
                 "dataloader_prefetch_factor", "attn_implementation"):
        if values.get(name) is not None or (name in values and name in ("torch_empty_cache_steps", "dataloader_prefetch_factor")):
            changes[name] = values[name]
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        if name in values:
            changes["gradient_checkpointing"] = bool(values[name])
    if any(k in values for k in ("bf16", "fp16", "tf32")):
        amp = "bf16" if values.get("bf16") else "fp16" if values.get("fp16") else None
        tf32 = bool(values.get("tf32"))
        changes["precision"] = (f"{amp}+tf32" if tf32 else amp) if amp else ("tf32" if tf32 else "fp32")
    if "torch_compile" in values or values.get("torch_compile_backend") or values.get("torch_compile_mode"):
        compiled = bool(values.get("torch_compile") or values.get("torch_compile_backend") or values.get("torch_compile_mode"))
        backend, mode = values.get("torch_compile_backend") or "inductor", values.get("torch_compile_mode")
        changes["torch_compile"] = (f"{backend}:{mode}" if mode else backend) if compiled else "off"
    if isinstance(values.get("deepspeed"), dict):  # a ZeRO config of the user's: the sharding value it is, if one of ours
        from autotune.sharding import of_deepspeed_config

        found = of_deepspeed_config(values["deepspeed"])
        if found is not None:
            changes["sharding"] = found
    defaults = extra_defaults or {}
    for name in extra_names:
        changes[name] = values[name] if name in values else defaults.get(name, base.flat().get(name))
    return base.replace(**changes)


def read_config_file(path: str | Any, flag: str = "--baseline") -> dict[str, Any]:
    """A JSON or YAML mapping of config fields (``--baseline FILE``), checked to load.

    Raises:
        UsageError: a missing file, one that does not parse, or one that is not a mapping.
    """
    import json
    from pathlib import Path

    import yaml

    from autotune.errors import UsageError

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{flag} {path}: no such file: pass a JSON or YAML file of your settings, e.g. "
                         "{\"per_device_train_batch_size\": 16, \"bf16\": true}")
    try:
        text = file.read_text(encoding="utf-8")
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"{flag} {path} does not load ({first}): fix it, or write it as JSON like best.json") from None
    if not isinstance(data, dict):
        raise UsageError(f"{flag} {path} holds {type(data).__name__}, not a mapping of settings: write e.g. "
                         "{\"per_device_train_batch_size\": 16, \"bf16\": true}")
    return data


def check_config_file(values: dict[str, Any], fields: dict[str, FieldKind], class_name: str, flag: str = "--baseline") -> None:
    """Every key of ``values`` is a field of the class (or ``attn_implementation``) with a value it takes.

    Raises:
        UsageError: naming every bad key (with the close match) and value at once.
    """
    import difflib

    from autotune.errors import UsageError
    from autotune.params import ATTN_IMPLEMENTATIONS

    problems = []
    for name, value in values.items():
        if name == "attn_implementation":
            if value not in ATTN_IMPLEMENTATIONS:
                problems.append(f"attn_implementation: {value!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)}")
        elif name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
            problems.append(f"{name}: not a field of {class_name}" + (f" (did you mean {close[0]}?)" if close else ""))
        elif name not in PROBE_FIELDS and (problem := fields[name].problem(value)) and fields[name].kind != "other":
            problems.append(f"{name}: {problem}")
    if problems:
        raise UsageError(f"{flag}: " + "; ".join(problems) + f": fix the file (its keys are {class_name} fields)")
