"""Search spaces: ``search_spaces/*.yaml`` -> :class:`SearchSpace`.

Loading collects every problem in a file and raises once, so a user fixes a file in one go.
:meth:`SearchSpace.restrict` then drops the values this device and these packages cannot run,
and says why for each.
"""

from __future__ import annotations

import difflib
import importlib.resources
import importlib.util
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import SearchSpaceError, UsageError
from autotune.params import (
    ATTN_IMPLEMENTATIONS,
    BOOL_PARAMS,
    COMPILE_BACKENDS,
    COMPILE_MODES,
    KNOBS_ADDED_LATER,
    PARAM_DEFAULTS,
    PARAM_NAMES,
    PRECISIONS,
    WORKER_ONLY_PARAMS,
    TrialParams,
    baseline_params,
    mixed_precision_dtype,
    parse_compile,
    uses_tf32,
)
from autotune.records import DeviceInfo
from autotune.sharding import NONE as NO_SHARDING
from autotune.sharding import incompatible
from autotune.sharding import parse as sharding_of

# Optimizers that need an optional package (module name) to run.
_OPTIM_PACKAGES = {
    "bnb": "bitsandbytes",
    "adamw_8bit": "bitsandbytes",
    "ademamix": "bitsandbytes",  # transformers takes every AdEMAMix from bitsandbytes
    "lion": "bitsandbytes",
    "paged_": "bitsandbytes",
    "adamw_torch_4bit": "torchao",
    "adamw_torch_8bit": "torchao",
    "adamw_anyprecision": "torchdistx",
    "galore": "galore_torch",
    "apollo": "apollo_torch",
    "schedule_free": "schedulefree",
    "grokadamw": "grokadamw",
    "lomo": "lomo_optim",
    "stable_adamw": "optimi",
}
_CUDA_ONLY_OPTIM_MARKERS = ("bnb", "8bit", "paged_", "lion_", "4bit", "ademamix")
# Settings that change nothing on the CPU: transformers turns pinned memory off there, and
# torch_empty_cache_steps empties a CUDA cache. Values other than the default are dropped there.
NO_EFFECT_ON_CPU = {
    "dataloader_pin_memory": "no effect on the CPU (transformers turns pinned memory off there)",
    "torch_empty_cache_steps": "no effect on the CPU (it empties the CUDA caching allocator)",
}


@dataclass(frozen=True)
class Dropped:
    """A value removed from the space before searching, and why."""

    param: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.param}={self.value}: {self.reason}"


MAX_GROWN_BATCH = 4096  # the largest batch size a grown space adds (grow: memory)


@dataclass(frozen=True)
class SearchSpace:
    """Allowed values per parameter (ordered as in the file), plus an optional fixed effective batch size.

    The space owns the effective-batch rule: with ``effective_batch_size`` N fixed, gradient
    accumulation is not a free dimension but ``N / per_device_train_batch_size``, so every point
    keeps ``batch x accumulation = N``. Everything that makes, counts or checks points goes through
    the methods below (:meth:`free_params`, :meth:`complete`, :meth:`suggest`, :meth:`optuna_params`,
    :meth:`random_point`, :attr:`size`, :meth:`contains`), so the rule is written once. The other
    collapse, worker-only DataLoader settings at their defaults without workers, is TrialParams' own
    (:data:`autotune.params.WORKER_ONLY_PARAMS`); :attr:`size` counts such points once.
    """

    name: str
    choices: dict[str, tuple[Any, ...]]
    effective_batch_size: int | None = None
    dropped: tuple[Dropped, ...] = field(default=())
    # The batch-size rule's multiple_of when the file says ``grow: memory``: a run on a GPU adds larger
    # batch sizes while the memory model says they can fit (:meth:`with_batches_up_to`); None: fixed.
    grow_batches_by: int | None = None
    # Values in ``choices`` only so the baseline is a point of the space (:meth:`including`), not to be searched:
    # the user's space file left them out (:meth:`beyond_user_space`).
    reference_values: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    @property
    def free_params(self) -> tuple[str, ...]:
        """The parameters a sampler chooses (accumulation is derived under a fixed effective batch size)."""
        return tuple(n for n in self.choices if not (n == "gradient_accumulation_steps" and self.effective_batch_size))

    @property
    def size(self) -> int:
        """How many distinct configurations the space holds (points without dataloader workers count
        once whatever their worker-only settings: :data:`autotune.params.WORKER_ONLY_PARAMS`)."""
        free = self.free_params
        others = math.prod(len(self.choices[n]) for n in free if n not in (*WORKER_ONLY_PARAMS, "dataloader_num_workers"))
        worker_only = math.prod(len(self.choices[n]) for n in WORKER_ONLY_PARAMS if n in free)
        return others * sum(worker_only if workers else 1 for workers in self.choices.get("dataloader_num_workers", (0,)))

    def accumulation_for(self, batch: int) -> int | None:
        """The accumulation a batch size implies under the fixed effective batch size (None when it is free)."""
        return self.effective_batch_size // int(batch) if self.effective_batch_size else None

    def complete(self, values: dict[str, Any]) -> TrialParams:
        """A point from values of the free parameters (others at their defaults), accumulation derived if fixed."""
        values = dict(values)
        derived = self.accumulation_for(values["per_device_train_batch_size"]) if self.effective_batch_size else None
        if derived is not None:
            values["gradient_accumulation_steps"] = derived
        return TrialParams.from_flat(values, self.config_fields)

    @property
    def config_fields(self) -> tuple[str, ...]:
        """The user-config fields the space searches beyond the built-in dimensions (``TrialParams.extra``)."""
        return tuple(n for n in self.choices if n not in PARAM_NAMES)

    def with_changes(self, params: TrialParams, **changes: Any) -> TrialParams:
        """``params`` with some values changed, accumulation re-derived if the effective batch size is fixed."""
        return self.complete({**params.flat(), **changes})

    def suggest(self, trial: Any) -> TrialParams:
        """Ask an Optuna trial for one value per free parameter."""
        return self.complete({name: trial.suggest_categorical(name, list(self.choices[name])) for name in self.free_params})

    def optuna_params(self, params: TrialParams) -> dict[str, Any]:
        """The Optuna parameter dict of ``params`` (what ``enqueue_trial`` takes).

        A worker-only setting of a point without workers is held at its default, which the space
        may not list: it is given as the space's first value, which :meth:`suggest` maps back.
        """
        values = params.flat()
        inert = WORKER_ONLY_PARAMS if not params.dataloader_num_workers else ()
        return {
            name: self.choices[name][0] if name in inert and values[name] not in self.choices[name] else values[name]
            for name in self.free_params
        }

    def random_point(self, rng: random.Random) -> TrialParams:
        """A uniformly drawn point; a parameter with one value is not a choice and draws nothing from ``rng``."""
        return self.complete({
            name: values[0] if len(values) == 1 else rng.choice(values)
            for name, values in ((n, self.choices[n]) for n in self.free_params)
        })

    def without(self, name: str, reasons: dict[Any, str]) -> SearchSpace:
        """The space without these values of ``name`` (value -> why), each kept as :class:`Dropped`.

        Raises:
            UsageError: no value of ``name`` would be left.
        """
        kept = tuple(v for v in self.choices[name] if v not in reasons)
        dropped = (*self.dropped, *(Dropped(name, v, reason) for v, reason in reasons.items()))
        if not kept:
            raise _nothing_left(name, dropped)
        return replace(self, choices={**self.choices, name: kept}, dropped=dropped)

    def unrunnable(self, params: TrialParams) -> str | None:
        """Why a point of this space cannot train though each of its values can (a combination), or None."""
        return incompatible(params.sharding, params.optim)

    def check_combinations(self) -> None:
        """Raises UsageError when no combination of the space's sharding and optimizer values can train."""
        shardings, optims = self.choices.get("sharding", (NO_SHARDING,)), self.choices.get("optim", ())
        reasons = [incompatible(s, o) for s in shardings for o in optims]
        if optims and all(reasons):
            raise UsageError(f"no sharding value of the space can train with its optimizers ({reasons[0]}): "
                             "add one of them or sharding: none to the space file")

    def contains(self, params: TrialParams) -> bool:
        if self.effective_batch_size and params.effective_batch_size != self.effective_batch_size:
            return False
        values = params.flat()
        return all(name in values and values[name] in self.choices[name] for name in self.free_params)

    def baseline(self) -> TrialParams:
        """transformers' defaults in this space (under a fixed effective batch size, the largest
        allowed batch <= 8 that divides it): see :func:`autotune.params.baseline_params`."""
        if not self.effective_batch_size:
            return baseline_params()
        return baseline_params(self.effective_batch_size, tuple(self.choices["per_device_train_batch_size"]))

    def including(self, params: TrialParams) -> SearchSpace:
        """This space with ``params``'s values added where missing (first), so ``params`` is a point of it; the added
        values are :attr:`reference_values`, not searched."""
        space = self
        for name in self.free_params:
            value = getattr(params, name)
            if value not in space.choices[name]:
                added = {**space.reference_values, name: (*space.reference_values.get(name, ()), value)}
                space = replace(space.with_values(name, (value, *space.choices[name])), reference_values=added)
        return space

    def beyond_user_space(self, params: TrialParams) -> str | None:
        """Why a point is not searched though it is in :attr:`choices`: a value only the baseline's (:meth:`including`)."""
        for name, values in self.reference_values.items():
            value = getattr(params, name)
            if value in values:
                return f"{name}={value} is in the space only as the baseline's: list it in the space file to search it"
        return None

    def to_dict(self) -> dict[str, Any]:
        """The space as stored with a study. A later knob held at its default alone is left out, with
        what was dropped of it (as before it existed), so a study from before it resumes under the same name."""
        defaults = PARAM_DEFAULTS
        unseen = {k for k, v in self.choices.items() if k in KNOBS_ADDED_LATER and tuple(v) == (defaults[k],)}
        return {
            "name": self.name,
            "choices": {k: list(v) for k, v in self.choices.items() if k not in unseen},
            "effective_batch_size": self.effective_batch_size,
            "dropped": [str(d) for d in self.dropped if d.param not in unseen],
        } | ({"reference_values": {k: list(v) for k, v in self.reference_values.items()}} if self.reference_values else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchSpace:
        """The space as stored with a study (``dropped`` kept as text, for display only)."""
        dropped = []
        for text in data.get("dropped") or ():
            param, _, rest = str(text).partition("=")
            value, _, reason = rest.partition(": ")
            dropped.append(Dropped(param, value, reason))
        choices = {k: tuple(v) for k, v in (data.get("choices") or {}).items()}
        if choices:  # a later knob missing from a stored space was held at its default (see to_dict)
            defaults = PARAM_DEFAULTS
            choices.update({k: (defaults[k],) for k in KNOBS_ADDED_LATER if k not in choices})
        reference = {k: tuple(v) for k, v in (data.get("reference_values") or {}).items()}
        return cls(str(data.get("name", "")), choices, data.get("effective_batch_size"), tuple(dropped), reference_values=reference)

    def with_values(self, param: str, values: tuple[Any, ...]) -> SearchSpace:
        return replace(self, choices={**self.choices, param: values})

    def with_batches_up_to(self, largest_fitting: int, limit: int = MAX_GROWN_BATCH) -> SearchSpace:
        """Batch sizes above the file's ``max``, up to ``largest_fitting`` (at most ``limit``), where the
        rule says ``grow: memory``: a fixed maximum of 128 leaves a small model on a 141 GB card far
        below what fits. Above the maximum the steps are powers of two and 1.5x them (192, 256, 384,
        512, ...), multiples of the rule's ``multiple_of``, so the grid grows by a handful of values;
        under a fixed effective batch size only divisors of it are added.
        """
        added = tuple(b for b in self.batch_growth(limit) if b <= largest_fitting)
        return self.with_values("per_device_train_batch_size", (*self.choices["per_device_train_batch_size"], *added)) if added else self

    def batch_growth(self, limit: int = MAX_GROWN_BATCH) -> tuple[int, ...]:
        """The batch sizes :meth:`with_batches_up_to` may add, smallest first; none for a fixed list."""
        if self.grow_batches_by is None:
            return ()
        top = max(self.choices["per_device_train_batch_size"])
        ladder = sorted({b for k in range(4, 16) for b in (2**k, 3 * 2 ** (k - 1))})
        return tuple(
            b for b in ladder
            if top < b <= limit and b % self.grow_batches_by == 0
            and (not self.effective_batch_size or self.effective_batch_size % b == 0)
        )

    # ------------------------------------------------------------------ restriction

    def restrict(
        self,
        device: DeviceInfo,
        *,
        effective_batch_size: int | None = None,
        model_supports_sdpa: bool = True,
        model_supports_flash: bool = True,
        model_type: str | None = None,
    ) -> SearchSpace:
        """Drop what this device/these packages cannot run; fix the effective batch size if asked.

        Also dropped: settings that change nothing here (pinned memory and cache emptying on the
        CPU; the default is kept), and Liger kernels for a ``model_type`` liger-kernel has none for.

        Raises:
            UsageError: if no allowed batch size divides ``effective_batch_size``, or a
                parameter is left with no runnable value.
        """
        dropped: list[Dropped] = list(self.dropped)
        choices: dict[str, tuple[Any, ...]] = {}
        defaults = PARAM_DEFAULTS
        for name, values in self.choices.items():
            kept = []
            default = defaults.get(name)
            for value in values:
                reason = _unrunnable_reason(name, value, device, model_supports_sdpa, model_supports_flash, model_type)
                if reason is None and name in NO_EFFECT_ON_CPU and not device.is_cuda and value != default:
                    reason = NO_EFFECT_ON_CPU[name]
                if reason:
                    dropped.append(Dropped(name, value, reason))
                else:
                    kept.append(value)
            if not kept and name in NO_EFFECT_ON_CPU and not device.is_cuda:
                kept.append(default)  # the same run as every dropped value here
            if not kept:
                raise _nothing_left(name, dropped)
            choices[name] = tuple(kept)
        if effective_batch_size is not None:
            if effective_batch_size <= 0:
                raise UsageError(f"--effective-batch-size must be positive, got {effective_batch_size}")
            batch_sizes = tuple(b for b in choices["per_device_train_batch_size"] if effective_batch_size % b == 0)
            if not batch_sizes:
                allowed = ", ".join(str(b) for b in choices["per_device_train_batch_size"])
                raise UsageError(
                    f"no allowed batch size ({allowed}) divides --effective-batch-size {effective_batch_size}: "
                    "use a multiple of 8 such as 64, or list a divisor in per_device_train_batch_size"
                )
            choices["per_device_train_batch_size"] = batch_sizes
        return replace(self, choices=choices, effective_batch_size=effective_batch_size, dropped=tuple(dropped))


def _nothing_left(name: str, dropped: Iterable[Dropped]) -> UsageError:
    """The error for a parameter whose every value was dropped, with each reason."""
    reasons = "; ".join(str(d) for d in dropped if d.param == name)
    return UsageError(f"no value of {name} can run here ({reasons}): add a runnable value to the space file")


def _unrunnable_reason(
    name: str, value: Any, device: DeviceInfo, supports_sdpa: bool, supports_flash: bool, model_type: str | None = None
) -> str | None:
    if name == "precision":
        if uses_tf32(value) and not device.supports_tf32:
            return "TF32 needs an Ampere or newer NVIDIA GPU"
        if mixed_precision_dtype(value) == "bf16" and not device.supports_bf16:
            return "bf16 needs an Ampere or newer GPU"
    elif name == "optim":
        for marker, module in _OPTIM_PACKAGES.items():
            if marker in value and module and not package_available(module):
                return f"needs the {module} package (pip install {module.replace('_', '-')})"
        if not device.is_cuda and any(m in value for m in _CUDA_ONLY_OPTIM_MARKERS):
            return "8-bit/paged optimizers need a CUDA GPU"
    elif name == "attn_implementation":
        if value == "sdpa" and not supports_sdpa:
            return "this model's architecture has no SDPA attention in transformers"
        if value.startswith("flash_attention"):
            if not device.is_cuda:
                return "FlashAttention needs a CUDA GPU"
            module = "flash_attn_interface" if value == "flash_attention_3" else "flash_attn"
            if not package_available(module):
                return f"needs the {module} package (pip install flash-attn)"
            if (device.compute_capability or (0, 0)) < (8, 0):
                return "FlashAttention 2 needs an Ampere or newer GPU"
            if not supports_flash:
                return "this model's architecture has no FlashAttention support in transformers"
    elif name == "torch_compile":
        backend, mode = parse_compile(value)
        if not device.is_cuda and (backend == "cudagraphs" or mode == "reduce-overhead"):
            return "CUDA graphs need a CUDA GPU"
    elif name == "sharding":
        engine = sharding_of(value).engine
        if engine is not None and not package_available(engine):
            return f"needs the {engine} package (pip install {engine})"
    elif name == "use_liger_kernel" and value:
        if not device.is_cuda:
            return "Liger's Triton kernels need a CUDA GPU"
        if not package_available("liger_kernel"):
            return "needs the liger_kernel package (pip install liger-kernel)"
        supported = liger_model_types()
        if model_type is not None and supported is not None and model_type not in supported:
            return f"liger-kernel has no kernels for model type {model_type} (it would change nothing)"
    return None


def liger_model_types() -> frozenset[str] | None:
    """The model types the installed liger-kernel patches (the keys of its ``MODEL_TYPE_TO_APPLY_LIGER_FN``,
    which ``Trainer(use_liger_kernel=True)`` looks a model up in), read from its source without importing
    it (that would import torch and Triton); None when it is not installed or the table cannot be read."""
    import ast

    try:
        spec = importlib.util.find_spec("liger_kernel")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "transformers" / "monkey_patch.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "MODEL_TYPE_TO_APPLY_LIGER_FN" for t in node.targets)
            and isinstance(node.value, ast.Dict)
            and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.value.keys)
        ):
            return frozenset(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return None  # not a literal table (a {**other, ...} one included): unknown, so nothing is dropped for it


def package_available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------------- loading


def _builtin_spaces_folder() -> importlib.resources.abc.Traversable:
    """The folder of the built-in spaces: package ``autotune.spaces``, which is the checkout's ``search_spaces/`` installed."""
    try:
        return importlib.resources.files("autotune.spaces")
    except ModuleNotFoundError:
        # An editable install (or a bare checkout) cannot import a package mapped onto a folder without __init__.py (pypa/setuptools#4943).
        return Path(__file__).resolve().parent.parent / "search_spaces"


def builtin_space_names() -> list[str]:
    folder = _builtin_spaces_folder()
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_space(name_or_path: str, *, config_fields: dict[str, Any] | None = None, config_class: str = "TrainingArguments") -> SearchSpace:
    """Load a built-in space by name (``default``, ``quick``) or a YAML file by path.

    ``config_fields``: the fields of the config class the training runs with
    (:func:`autotune.config_fields.describe_fields`): a key that is not one of autotune's dimensions is
    searched as that field where the class has it; None: only autotune's dimensions.

    Raises:
        SearchSpaceError: if the file is missing or has any invalid entry (all listed at once).
    """
    name, data = read_space_data(name_or_path)
    return parse_space(data, name=name, source=name_or_path, config_fields=config_fields, config_class=config_class)


def read_space_data(name_or_path: str) -> tuple[str, Any]:
    """The space's name and its YAML, parsed but not checked (:func:`parse_space` checks it).

    Raises:
        SearchSpaceError: a missing file or built-in name, or YAML that does not parse.
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists() or "/" in name_or_path:
        if not path.is_file():
            raise SearchSpaceError(f"search space file {name_or_path} not found: pass an existing YAML file or one of {', '.join(builtin_space_names())}")
        text, name = path.read_text(encoding="utf-8"), path.stem
    else:
        resource = _builtin_spaces_folder() / f"{name_or_path}.yaml"
        if not resource.is_file():
            names = builtin_space_names()
            close = difflib.get_close_matches(name_or_path, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SearchSpaceError(f"unknown search space {name_or_path!r}: {hint}use one of {', '.join(names)} or a path to a YAML file")
        text, name = resource.read_text(encoding="utf-8"), name_or_path
    try:
        return name, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SearchSpaceError(f"{name_or_path}: not valid YAML ({str(exc).splitlines()[0]}): fix the syntax") from None


def parse_space(data: Any, *, name: str = "custom", source: str = "<space>", config_fields: dict[str, Any] | None = None,
                config_class: str = "TrainingArguments", more_problems: tuple[str, ...] = ()) -> SearchSpace:
    """Validate a parsed YAML mapping into a :class:`SearchSpace`, reporting every problem at once (see
    :func:`load_space` for ``config_fields``)."""
    if not isinstance(data, dict):
        raise SearchSpaceError(f"{source}: expected a mapping of parameter -> list of values, e.g. 'precision: [fp32, bf16]'")
    problems: list[str] = list(more_problems)  # e.g. values the user's config class refused in the plan-time check
    defaults = PARAM_DEFAULTS
    choices: dict[str, tuple[Any, ...]] = {}
    grow_batches_by: int | None = None
    for key in data:
        if key not in PARAM_NAMES and config_fields is not None:
            from autotune.config_fields import check_config_values

            raw_values = data[key] if isinstance(data[key], list) else [data[key]]
            found = check_config_values(str(key), tuple(raw_values), config_fields, config_class)
            if not raw_values:
                found.append(f"{key}: empty list, give at least one value")
            problems.extend(found)
            if not found:
                choices[str(key)] = tuple(dict.fromkeys(raw_values))
        elif key not in PARAM_NAMES:
            close = difflib.get_close_matches(str(key), PARAM_NAMES, n=1, cutoff=0.4)
            close = close or [name for name in PARAM_NAMES if str(key).lower() in name][:1]
            problems.append(f"{key}: unknown parameter" + (f" (did you mean {close[0]}?)" if close else ""))
    for param in PARAM_NAMES:
        if param not in data:
            choices[param] = (defaults[param],)
            continue
        raw = data[param]
        if param == "per_device_train_batch_size" and isinstance(raw, dict):
            values, rule_problems = _batch_rule(raw)
            if raw.get("grow") == "memory" and isinstance(raw.get("multiple_of", 8), int):
                grow_batches_by = int(raw.get("multiple_of", 8))
            problems.extend(f"{param}: {p}" for p in rule_problems)
        elif isinstance(raw, list):
            values = raw
        else:
            values = [raw]
        if not values and not (param == "per_device_train_batch_size" and isinstance(raw, dict)):
            problems.append(f"{param}: empty list, give at least one value")
            continue
        checked = []
        for value in values:
            problem = _check_value(param, value)
            if problem:
                problems.append(f"{param}: {problem}")
            elif value not in checked:
                checked.append(value)
        choices[param] = tuple(checked)
    if not any(choices.get("dataloader_num_workers", (0,))):
        for param in WORKER_ONLY_PARAMS:
            if any(value != defaults[param] for value in choices.get(param, ())):
                problems.append(f"{param}: only applies with DataLoader workers, and dataloader_num_workers lists none above 0: "
                                "add a worker count such as 2")
    if problems:
        raise SearchSpaceError(f"{source} has {len(problems)} problem(s): " + "; ".join(problems))
    return SearchSpace(name=name, choices=choices, grow_batches_by=grow_batches_by)


def _batch_rule(rule: dict[str, Any]) -> tuple[list[int], list[str]]:
    keys = ("multiple_of", "max", "small", "grow")
    problems = [f"unknown key {k!r} in batch-size rule (use {', '.join(keys)})" for k in rule if k not in keys]
    if rule.get("grow", "none") not in ("memory", "none"):
        problems.append(f"grow must be memory or none, got {rule.get('grow')!r}")
    multiple, maximum, small = rule.get("multiple_of", 8), rule.get("max"), rule.get("small", [])
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple <= 0:
        problems.append(f"multiple_of must be a positive integer, got {multiple!r}")
        multiple = 8
    if not isinstance(maximum, int) or isinstance(maximum, bool) or maximum < multiple:
        problems.append(f"max must be an integer >= multiple_of, got {maximum!r}")
        return [], problems
    if not isinstance(small, list):
        problems.append(f"small must be a list, got {small!r}")
        small = []
    return [*small, *range(multiple, maximum + 1, multiple)], problems


def _check_value(param: str, value: Any) -> str | None:
    if param in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"{value!r} is not a positive integer"
    elif param == "dataloader_num_workers":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"{value!r} is not a non-negative integer"
    elif param in BOOL_PARAMS:
        if not isinstance(value, bool):
            return f"{value!r} is not true or false"
    elif param == "torch_empty_cache_steps":
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            return f"{value!r} is not null (never) or a positive step count such as 4"
    elif param == "dataloader_prefetch_factor":
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            return f"{value!r} is not null (torch's default, 2) or a positive number of batches per worker such as 4"
    elif param == "sharding":
        try:
            sharding_of(value)
        except ValueError as exc:
            return str(exc)
    elif param == "precision":
        if value not in PRECISIONS:
            return f"{value!r} is not one of {', '.join(PRECISIONS)}"
    elif param == "optim":
        from transformers.training_args import OptimizerNames

        names = [o.value for o in OptimizerNames]
        if value not in names:
            close = difflib.get_close_matches(str(value), names, n=1)
            return f"{value!r} is not a TrainingArguments optim" + (f" (did you mean {close[0]}?)" if close else "")
    elif param == "attn_implementation":
        if value not in ATTN_IMPLEMENTATIONS:
            return f"{value!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)}"
    elif param == "torch_compile":
        if value is False:
            return "write \"off\" in quotes (YAML reads a bare off as false)"
        if not isinstance(value, str):
            return f"{value!r} is not \"off\" or backend[:mode]"
        backend, mode = parse_compile(value)
        if backend is not None and backend not in COMPILE_BACKENDS:
            return f"unknown compile backend {backend!r} (one of {', '.join(COMPILE_BACKENDS)})"
        if mode is not None and mode not in COMPILE_MODES:
            return f"unknown compile mode {mode!r} (one of {', '.join(COMPILE_MODES)})"
    return None
