"""Planning a run: :func:`plan_run` validates and resolves every :class:`~autotune.options.RunOptions` into a
:class:`RunPlan` before any study is created or touched (so bad input never leaves a broken study), with the
helpers only planning uses (the ``--trainer`` check, the baseline, the memory-bounded batch sizes, the dataset).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import autotune.defaults as defaults
from autotune.errors import DeviceError, UsageError
from autotune.options import RunOptions
from autotune.params import PARAM_DEFAULTS, PARAM_NAMES, TrialParams
from autotune.probe.device import detect_device, loader_cores
from autotune.records import DeviceInfo
from autotune.search.loop import SearchSettings
from autotune.search.strategies.registry import DEFAULT_STRATEGY, make_strategy
from autotune.space import NO_EFFECT_ON_CPU, Dropped, SearchSpace, parse_space, read_space_data
from autotune.storage import DEFAULT_STORAGE
from autotune.studies import opening
from autotune.studies.settings import TRAINING_ARGUMENTS, ProbeSettings, StudySettings
from autotune.units import format_bytes, parse_bytes, parse_duration_s
from autotune.version import __version__

if TYPE_CHECKING:
    from autotune.probe.isolation import IsolationMode

DEFAULT_MODEL = defaults.MODEL
DEFAULT_SEQ_LEN = defaults.SEQ_LEN
WORKERS_STORAGE = defaults.WORKERS_STORAGE
CEILING_SAFETY_FRACTION = 0.95  # leave 5% of the device below the ceiling for the user's real run
# --isolation: how each probe's process starts -> autotune.probe.isolation's mode.
ISOLATION_MODES: dict[str, IsolationMode] = {"fork": "forkserver", "cold": "cold"}
OBJECTIVES = ("tokens", "samples")


@dataclass(frozen=True)
class RunPlan:
    """Everything validated and resolved for one run, before any study is touched."""

    model: Any  # ModelSpec
    device: DeviceInfo
    space: SearchSpace
    seq_len: int
    memory_ceiling_bytes: int
    baseline: TrialParams
    storage: Any  # a URL, or the Optuna storage object tune() was given (as TuneResult.storage)
    study_name: str
    settings: SearchSettings
    warmup_steps: int
    measure_steps: int
    max_measure_s: float
    dataset: Any = None  # autotune.data.DatasetSpec, or None for synthetic tokens
    strategy: str = DEFAULT_STRATEGY
    isolation: str = "fork"  # a key of ISOLATION_MODES
    gpus: list[int] | None = None  # one worker process per GPU (autotune.workers); None: probe here
    peft: Any = None  # autotune.lora.LoraSettings; None: every weight is trained
    parameters: Any = None  # autotune.lora.ParameterCounts of the model as trained (with peft); None: all trainable
    trainer: Any = None  # autotune.probe.trainer_check.UserTrainer: the user's factory, checked; None: the built-in path
    expert: TrialParams | None = None  # the expert rule's configuration (autotune.search.expert), a reference row
    objective: str = "samples"  # one of OBJECTIVES
    baseline_source: str = "defaults"  # "user" (a make_trainer(argv) factory's own settings), "file" (--baseline), "defaults"
    started_s: float | None = None  # time.monotonic() when planning began: the budget counts from there
    warnings: tuple[str, ...] = ()  # what the plan tells before any probe ran (autotune.probe.duration), one line each
    nproc_per_probe: int = 1  # processes per probe (torchrun ranks, one GPU each): part of the study's identity
    host_memory_ceiling_bytes: int | None = None  # a GPU run's host memory for the probe's processes together; None on a CPU

    @property
    def tokens_per_sample(self) -> float | None:
        """Under the tokens objective, the data's real tokens per sequence (samples/s is tokens/s over it)."""
        if self.objective != "tokens" or self.trainer is None or not self.trainer.tokens_per_sequence:
            return None
        return round(float(self.trainer.tokens_per_sequence), 3)

    def trainer_identity(self) -> dict[str, Any] | None:
        """What makes the user's training this training: the factory, its inputs (and the files they name, by
        content), and what the plan-time check saw it build (model, parameters, dtypes, tokens per sequence)."""
        if self.trainer is None:
            return None
        user, counts = self.trainer, self.parameters
        return {
            "reference": user.ref.reference,
            "args": list(user.trainer_args) if user.trainer_args is not None else None,
            "files": _named_files(user.trainer_args or (), user.ref),
            "config_class": user.config_class,
            "model_config_sha1": opening.config_hash(user.config),
            "trainable": counts.trainable if counts else None,
            "frozen": counts.frozen if counts else None,
            "dtypes": counts.to_dict().get("dtypes") if counts else None,
            "tokens_per_sequence": round(float(user.tokens_per_sequence), 1) if user.tokens_per_sequence else None,
            "objective": self.objective,
        }

    def memory_model(self) -> Any:
        """A fresh :class:`autotune.search.memory.MemoryModel` of the plan's model (as trained) at its sequence length."""
        from autotune.search.memory import MemoryModel
        from autotune.search.memory_prior import ModelDims

        return MemoryModel(ModelDims.from_spec(self.model, counts=self.parameters), self.seq_len, world=self.nproc_per_probe)

    def study_attrs(self, command: str | None) -> dict[str, Any]:
        """What the study stores about this run (:class:`~autotune.studies.settings.StudySettings`, as its JSON)."""
        return self.study_settings(command).to_dict()

    def study_settings(self, command: str | None) -> StudySettings:
        from autotune.models import count_parameters

        return StudySettings(
            autotune_version=__version__,
            model=self.model.name,
            model_source=self.model.source,
            model_config_sha1=opening.config_hash(self.model.config),
            num_parameters=self.parameters.total if self.trainer else count_parameters(self.model),
            seq_len=self.seq_len,
            device=self.device.to_dict(),
            memory_ceiling_bytes=self.memory_ceiling_bytes,
            space=self.space.to_dict(),
            # Samples per optimizer step over every process of a probe (what --effective-batch-size said); the space's is one rank's.
            effective_batch_size=self.space.effective_batch_size * self.nproc_per_probe if self.space.effective_batch_size else None,
            baseline=self.baseline.to_dict(),
            dataset=self.dataset.to_dict() if self.dataset else None,
            strategy=self.strategy,
            peft=self.peft.to_dict() if self.peft else None,
            parameters=self.parameters.to_dict() if self.parameters else None,
            trainer=self.trainer_identity(),
            expert=self.expert.to_dict() if self.expert else None,
            objective=self.objective,
            nproc_per_probe=self.nproc_per_probe,
            host_memory_ceiling_bytes=self.host_memory_ceiling_bytes,
            baseline_source=self.baseline_source,
            config_class=self.trainer.config_class if self.trainer else TRAINING_ARGUMENTS,
            user_config=self.trainer.user_config if self.trainer else None,
            # What a worker joining from elsewhere needs to probe exactly as this run does (autotune.workers).
            probe=ProbeSettings(
                warmup_steps=self.warmup_steps, measure_steps=self.measure_steps, max_measure_s=self.max_measure_s,
                trial_timeout_s=self.settings.trial_timeout_s, seed=self.settings.seed, isolation=self.isolation,
                trainer_sys_path=self.trainer.ref.sys_path if self.trainer else None,
                trainer_attn_flag=bool(self.trainer and self.trainer.takes_attn_flag),
                tokens_per_sample=self.tokens_per_sample,
            ),
            command=command,
            versions=package_versions(),
        )


def _named_files(argv: Sequence[str], ref: Any) -> dict[str, str]:
    """The files a factory's inputs name (``--config sft.yaml``, a local dataset), by content: editing one is
    another training, though the command line is the same. Paths relative to the user's folder, as the factory sees them."""
    base = Path(ref.sys_path) if getattr(ref, "sys_path", None) else Path.cwd()
    found = {}
    for item in argv:
        for text in (item, item.partition("=")[2]):
            if not text or text.startswith("-") or len(text) > 4096:
                continue
            path = Path(text).expanduser()
            path = path if path.is_absolute() else base / path
            try:
                if path.is_file():
                    found[text] = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
            except OSError:
                continue
    return found


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": sys.version.split()[0]}
    for name in ("autotune", "torch", "transformers", "accelerate", "optuna"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            pass
    return versions


def model_attention_support(model: Any) -> tuple[bool, bool]:
    """Whether this architecture has SDPA and FlashAttention paths in transformers."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(model.to_config())]
    except (KeyError, ValueError):
        return True, True
    return bool(getattr(cls, "_supports_sdpa", True)), bool(getattr(cls, "_supports_flash_attn", True))


def plan_run(options: RunOptions) -> RunPlan:
    """Validate and resolve every input of a run (no study is created or changed).

    Raises:
        UsageError: (and subclasses) for any bad input, with a one-line message naming the fix.
    """
    from autotune.models import resolve_model

    planned_s = time.monotonic()  # the budget is the run's wall time: planning (a --trainer check) included
    make_strategy(options.strategy)  # an unknown name fails here, before anything is touched
    if options.study is not None:
        opening.check_study_name(options.study)
    if options.storage is not None and isinstance(options.storage, str) and not options.storage.strip():
        raise UsageError("--storage '' is empty: drop it for the default (sqlite:///autotune.db), or give a URL such as "
                         "sqlite:///runs.db")
    if options.isolation not in ISOLATION_MODES:
        raise UsageError(
            f"--isolation {options.isolation!r} is not a way to start probes: use fork (the default, from a "
            "pre-imported probe server) or cold (a new interpreter per probe)"
        )
    budget_s = parse_duration_s(options.budget) if options.budget is not None else None
    if budget_s is None and options.n_trials is None:
        raise UsageError("give a --budget (e.g. 30m) or --n-trials, or the search never ends")
    if options.n_trials is not None and options.n_trials <= 0:
        raise UsageError(f"--n-trials must be positive, got {options.n_trials}")
    if options.warmup_steps < 1 or options.measure_steps < 1:
        raise UsageError("--warmup-steps and --measure-steps must be at least 1")
    trial_timeout_s = parse_duration_s(options.trial_timeout)
    try:
        max_measure_s = parse_duration_s(options.max_measure_time)
    except UsageError:
        raise UsageError(f"--max-measure-time {options.max_measure_time!r} is not a positive duration: use e.g. 30s") from None
    trainer_ref = _trainer_ref(options)  # parsed and checked against the options it replaces; nothing imported
    model_spec = resolve_model(options.model or DEFAULT_MODEL) if trainer_ref is None else None
    seq_len = options.seq_len if options.seq_len is not None else DEFAULT_SEQ_LEN
    if model_spec is not None and (seq_len <= 0 or seq_len > model_spec.max_positions):
        raise UsageError(
            f"--seq-len {seq_len} is outside 1..{model_spec.max_positions}, the limit of {model_spec.name}: "
            f"use --seq-len {min(DEFAULT_SEQ_LEN, model_spec.max_positions)} or less"
        )
    from autotune.workers import parse_gpus

    gpus = parse_gpus(options.gpus)
    if gpus is not None:
        device_info = _same_kind_gpus(gpus, options.device)
    else:
        device_info = options.device if isinstance(options.device, DeviceInfo) else detect_device(options.device)
    _check_nproc(options, device_info, gpus)
    user = None
    trainer_args = _trainer_args(options, trainer_ref)
    space_data = None if isinstance(options.space, SearchSpace) else read_space_data(options.space)
    if trainer_ref is not None:  # the user's factory, called once in a child process: the parent never imports it
        check_values = {str(k): v if isinstance(v, list) else [v] for k, v in space_data[1].items()
                        if k not in PARAM_NAMES} if space_data and isinstance(space_data[1], dict) else None
        user, model_spec = _user_trainer_plan(trainer_ref, device_info, trial_timeout_s, ISOLATION_MODES[options.isolation],
                                              trainer_args, check_values)
        seq_len = user.seq_len
    objective = _objective(options.objective, user)
    if options.memory_ceiling is None:  # on a CPU the ranks of a probe share the host's memory: each gets its share
        ceiling = int(CEILING_SAFETY_FRACTION * device_info.total_memory_bytes / (1 if device_info.is_cuda else options.nproc_per_probe))
    else:
        ceiling = parse_bytes(options.memory_ceiling, total_bytes=device_info.total_memory_bytes)
        if ceiling > device_info.total_memory_bytes:
            raise DeviceError(
                f"--memory-ceiling {format_bytes(ceiling)} is above the {format_bytes(device_info.total_memory_bytes)} "
                f"of {device_info.name}: use at most {format_bytes(device_info.total_memory_bytes)} or a fraction like 0.9"
            )
    host_ceiling = _host_ceiling(options, device_info)
    fields, class_name = _config_class_fields(user)
    if isinstance(options.space, SearchSpace):
        loaded = options.space
    else:
        assert space_data is not None
        loaded = parse_space(space_data[1], name=space_data[0], source=str(options.space), config_fields=fields, config_class=class_name,
                             more_problems=user.value_problems if user else ())
    supports_sdpa, supports_flash = (user.supports_sdpa, user.supports_flash) if user else model_attention_support(model_spec)
    restricted = loaded.restrict(
        device_info,
        # One rank's share: with N processes per probe, per-device batch x accumulation x N is the effective batch.
        effective_batch_size=options.effective_batch_size // options.nproc_per_probe if options.effective_batch_size else options.effective_batch_size,
        model_supports_sdpa=supports_sdpa,
        model_supports_flash=supports_flash,
        model_type=getattr(model_spec, "model_type", None),  # Liger kernels exist for some model types only
    )
    if device_info.is_cuda and restricted.batch_growth():  # a CPU probe gains nothing from huge batches; a GPU may fit far more than 128
        # Bounded by the device's memory, not the ceiling: a resumed study may change its ceiling, not its space.
        restricted = restricted.with_batches_up_to(
            largest_lean_batch(model_spec, seq_len, device_info.total_memory_bytes, restricted, counts=user.parameters if user else None))
    restricted.check_combinations()  # the user's space, before the baseline joins it
    if host_ceiling is not None:
        restricted = _offload_within(restricted, model_spec, user.parameters if user else None, host_ceiling)
    if user is not None and user.trainer_args is not None and not user.takes_attn_flag:
        restricted = _attention_fixed(restricted, user)
    baseline, baseline_source = _baseline(options.baseline, restricted, user, fields, class_name, supports_sdpa)
    if not device_info.is_cuda:  # settings that change nothing on the CPU read as the one value the space keeps there
        baseline = baseline.replace(**{name: PARAM_DEFAULTS[name] for name in NO_EFFECT_ON_CPU})
    # The baseline is always a point of the space, so Optuna can enqueue it (transformers' defaults run
    # everywhere: fp32, no compile, fused AdamW on CPU and CUDA, sdpa only where supported; a user's own
    # settings are theirs to run).
    restricted = restricted.including(baseline)
    dataset_spec = _dataset_spec(options.dataset, options.text_column, options.tokenizer, model_spec)
    lora, counts = _peft_plan(options, model_spec, device_info)
    if user is not None:
        counts = user.parameters
    name = user.ref.label if user else options.model or DEFAULT_MODEL
    study_name = options.study or opening.default_study_name(name, seq_len, device_info.kind, options.effective_batch_size, lora,
                                                                          options.nproc_per_probe)
    plan = RunPlan(
        model=model_spec,
        device=device_info,
        space=restricted,
        seq_len=seq_len,
        memory_ceiling_bytes=ceiling,
        baseline=baseline,
        storage=options.storage or (WORKERS_STORAGE if gpus else DEFAULT_STORAGE),
        study_name=study_name,
        settings=SearchSettings(
            memory_ceiling_bytes=ceiling, budget_s=budget_s, n_trials=options.n_trials, trial_timeout_s=trial_timeout_s,
            seed=options.seed, gpu=device_info.is_cuda, loader_cores=loader_cores(_processes_on_host(options, gpus)),
        ),
        warmup_steps=options.warmup_steps,
        measure_steps=options.measure_steps,
        max_measure_s=max_measure_s,
        dataset=dataset_spec,
        strategy=options.strategy,
        isolation=options.isolation,
        gpus=gpus,
        peft=lora,
        parameters=counts,
        trainer=user,
        objective=objective,
        baseline_source=baseline_source,
        started_s=planned_s,
        nproc_per_probe=options.nproc_per_probe,
        host_memory_ceiling_bytes=host_ceiling,
    )
    plan = dataclasses.replace(plan, expert=_expert(plan), warnings=_plan_warnings(plan))
    if gpus and not isinstance(plan.storage, str):
        raise UsageError("--gpus starts worker processes, which open the storage by its URL: pass storage as a URL "
                         f"(e.g. {WORKERS_STORAGE}), not an object")
    if options.study is None:
        plan = dataclasses.replace(plan, study_name=opening.own_study_name(plan.storage, plan.study_name, plan.study_attrs(None)))
    return plan


def _processes_on_host(options: RunOptions, gpus: list[int] | None) -> int:
    """The training processes that share this host's cores while a probe runs: a probe's ranks, times the
    workers probing side by side (one per group of ``--nproc-per-probe`` GPUs under ``--gpus``; a worker
    those started reads their count from :data:`autotune.workers.HOST_WORKERS_ENV`)."""
    import os

    from autotune.workers import HOST_WORKERS_ENV

    if gpus:
        return max(len(gpus), options.nproc_per_probe)
    workers = os.environ.get(HOST_WORKERS_ENV) or "1"
    if not workers.isdigit():
        raise UsageError(f"{HOST_WORKERS_ENV}={workers!r} is not a number of workers: unset it (autotune run --gpus sets it for its workers)")
    return options.nproc_per_probe * max(1, int(workers))


def _trainer_ref(options: RunOptions) -> Any:
    """``--trainer`` parsed (nothing imported; a file must exist) and refused with the options its factory
    replaces: an :class:`autotune.probe.user_trainer.TrainerRef`, or None without ``--trainer``.

    Raises:
        UsageError: a malformed reference, a missing file, or ``--model``/``--dataset``/``--peft``/``--seq-len``
            (and their companions) given with it.
    """
    if options.trainer is None:
        return None
    from autotune.probe.user_trainer import TrainerRef, parse_trainer_ref

    given = [flag for flag, value in (
        ("--model", options.model), ("--dataset", options.dataset), ("--tokenizer", options.tokenizer), ("--peft", options.peft),
        ("--lora-r", options.lora_r), ("--lora-alpha", options.lora_alpha), ("--lora-dropout", options.lora_dropout),
        ("--lora-target-modules", options.lora_target_modules), ("--seq-len", options.seq_len),
    ) if value is not None]
    if given:
        flags = " and ".join([", ".join(given[:-1]), given[-1]] if len(given) > 1 else given)
        raise UsageError(f"--trainer builds its own model and data (and adapters, and batches of its own length): "
                         f"drop {flags}, or drop --trainer to tune a model from its config")
    return options.trainer if isinstance(options.trainer, TrainerRef) else parse_trainer_ref(str(options.trainer))


def _trainer_args(options: RunOptions, ref: Any) -> tuple[str, ...] | None:
    """``--trainer-args`` as a list of strings (a string is split as a shell would), or None without it.

    Raises:
        UsageError: without ``--trainer``, or a string that does not split (an unclosed quote).
    """
    if options.trainer_args is None:
        return None
    if ref is None:
        raise UsageError("--trainer-args are the inputs of your --trainer factory: give --trainer my_train.py:make_trainer too")
    if isinstance(options.trainer_args, str):
        try:
            return tuple(shlex.split(options.trainer_args))
        except ValueError as exc:
            raise UsageError(f"--trainer-args {options.trainer_args!r} does not split into arguments ({exc}): close the quote") from None
    return tuple(str(a) for a in options.trainer_args)


def _objective(objective: str | None, user: Any) -> str:
    """The quantity configurations are ranked by: tokens/s with a user's Trainer (its batches' lengths vary), else samples/s.

    Raises:
        UsageError: an unknown objective, or tokens where the data cannot say how many tokens a sequence holds.
    """
    if objective is None:
        return "tokens" if user is not None and user.tokens_per_sequence else "samples"
    if objective not in OBJECTIVES:
        close = difflib.get_close_matches(objective, OBJECTIVES, n=1)
        raise UsageError(f"--objective {objective!r}: use tokens (real tokens/s) or samples (sequences/s)"
                         + (f"; did you mean {close[0]}?" if close else ""))
    if objective == "tokens" and user is not None and not user.tokens_per_sequence:
        raise UsageError(f"--objective tokens: the first batch of {user.ref.function}'s Trainer holds no sequence to count tokens in: "
                         "use --objective samples")
    return objective


def _config_class_fields(user: Any) -> tuple[dict[str, Any], str]:
    """The fields of the class the training's config is (a user's ``SFTConfig``, else ``TrainingArguments``) and its name."""
    from autotune.config_fields import FieldKind, training_arguments_fields

    if user is not None and user.fields:
        return {name: FieldKind.from_dict(kind) for name, kind in user.fields.items()}, user.config_class_name
    return training_arguments_fields(), "TrainingArguments"


def _attention_fixed(space: SearchSpace, user: Any) -> SearchSpace:
    """A ``make_trainer(argv)`` factory whose parser has no ``--attn_implementation``: its model's kernel is the one it
    loads, so the space keeps that one, and says why the others went."""
    kept = user.attn_implementation or "sdpa"
    reason = (f"the parser of {user.ref.function} has no --attn_implementation (add TRL's ModelConfig, or an "
              "attn_implementation field, to search the kernel)")
    dropped = tuple(Dropped("attn_implementation", v, reason) for v in space.choices["attn_implementation"] if v != kept)
    narrowed = space.with_values("attn_implementation", (kept,))
    return dataclasses.replace(narrowed, dropped=(*narrowed.dropped, *dropped))


def _baseline(given: str | dict[str, Any] | None, space: SearchSpace, user: Any, fields: dict[str, Any], class_name: str,
              supports_sdpa: bool) -> tuple[TrialParams, str]:
    """What the speed-up is measured against: ``--baseline`` (a file or mapping of config fields) over the user's own
    settings (a ``make_trainer(argv)`` factory's, as its inputs give them), else over transformers' defaults; and
    which of those it is (``file``, ``user``, ``defaults``: :attr:`RunPlan.baseline_source`).

    Raises:
        UsageError: a baseline file that does not load, or names a field the class does not have or a value it does not take.
    """
    from autotune.config_fields import check_config_file, params_from_config, read_config_file

    defaults = {name: fields[name].default for name in space.config_fields if name in fields}
    base = space.baseline() if supports_sdpa else space.baseline().replace(attn_implementation="eager")
    values: dict[str, Any] = {}
    source = "defaults"
    if user is not None and user.user_config is not None:
        source = "user"
        values = dict(user.user_config)
        if user.attn_implementation:
            values["attn_implementation"] = user.attn_implementation
        if space.effective_batch_size:  # the user's batch, with the accumulation the fixed effective batch implies
            values.pop("gradient_accumulation_steps", None)
    if given is not None:
        extra = given if isinstance(given, dict) else read_config_file(given)
        check_config_file(extra, fields, class_name)
        values.update(extra)
        source = "file"
    params = params_from_config(values, base, space.config_fields, defaults)
    if space.effective_batch_size:
        params = space.with_changes(params)
    return params, source


def _expert(plan: RunPlan) -> TrialParams:
    """The expert rule's configuration for the plan (:func:`autotune.search.expert.expert_params`), with its batch
    from the memory model of the plan's model; the user's other settings (their loader, their own fields) kept."""
    from autotune.search.expert import expert_params

    return expert_params(plan.space, plan.baseline, plan.memory_model(), plan.memory_ceiling_bytes, gpu=plan.device.is_cuda)


def _plan_warnings(plan: RunPlan) -> tuple[str, ...]:
    """What the plan can tell before any probe: that its first probe (the baseline) cannot finish in time."""
    from autotune.probe.duration import cannot_finish_warning, probe_floor, tightest_limit

    steps, budget_s, timeout_s = plan.warmup_steps + plan.measure_steps, plan.settings.budget_s, plan.settings.trial_timeout_s
    floor = probe_floor(plan.model, plan.device, plan.seq_len, plan.baseline, steps, counts=plan.parameters,
                        within_s=tightest_limit(budget_s, timeout_s)[0])
    warning = cannot_finish_warning(floor, f"the first probe ({plan.baseline.short()}, {steps} steps)", budget_s, timeout_s)
    return (warning,) if warning else ()


def _user_trainer_plan(ref: Any, device: DeviceInfo, timeout_s: float, mode: IsolationMode, trainer_args: tuple[str, ...] | None = None,
                       check_values: dict[str, list[Any]] | None = None) -> tuple[Any, Any]:
    """The plan-time check of the user's factory, in a child process on the run's device, started as the
    probes are (``mode``; :func:`autotune.probe.trainer_check.inspect_trainer`), and a ModelSpec of the model it
    builds (for the memory model and the study's identity): (UserTrainer, ModelSpec). The check runs with seed 0
    whatever the run's seed, so a worker joining the study (another seed) finds the same first batch.

    Raises:
        UsageError: anything wrong with the factory, in one line; a model config without the
            dimensions the memory model needs.
    """
    from autotune.models import ModelSpec
    from autotune.probe.trainer_check import inspect_trainer

    user = inspect_trainer(ref, device=f"cuda:{device.index}" if device.is_cuda else "cpu",
                           device_uuid=device.uuid if device.is_cuda else None, timeout_s=timeout_s, mode=mode,
                           trainer_args=trainer_args, check_values=check_values)
    spec = ModelSpec(name=f"{ref.where}:{ref.function}", source="trainer", config=user.config)
    try:
        for prop in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            getattr(spec, prop)
    except KeyError as error:
        raise UsageError(f"the model {ref.function} builds: {error.args[0]}; autotune's memory model needs it: "
                         "set it on the model's config") from None
    return user, spec


def _peft_plan(options: RunOptions, model: Any, device: DeviceInfo) -> tuple[Any, Any]:
    """``--peft`` and ``--lora-*`` checked, and the model's parameters counted with its adapters on the
    meta device (so target modules it does not have fail now): (LoraSettings, ParameterCounts), or
    (None, None) without ``--peft``.

    Raises:
        UsageError: see :func:`autotune.lora.lora_settings` and :func:`autotune.lora.apply_lora`.
    """
    from autotune.lora import lora_settings, parameter_counts

    settings = lora_settings(options.peft, r=options.lora_r, alpha=options.lora_alpha, dropout=options.lora_dropout,
                             target_modules=options.lora_target_modules, device=device)
    if settings is None:
        return None, None
    return settings, parameter_counts(model, settings)


def largest_lean_batch(model: Any, seq_len: int, memory_bytes: int, space: SearchSpace, *, counts: Any = None) -> int:
    """The largest batch size :meth:`SearchSpace.batch_growth` offers that the memory model predicts
    fits in ``memory_bytes`` for the leanest configuration of ``space`` (checkpointing, a 16-bit
    precision, the smallest optimizer state, a fused attention kernel, Liger kernels, where the space allows
    them); 0 when none does. No configuration of the space fits a larger one, so it bounds the batch sizes
    worth adding (:meth:`SearchSpace.with_batches_up_to`). ``counts``: the model's parameters as trained
    (a user's Trainer's), instead of counting them from the config."""
    from autotune.search.memory import MemoryModel
    from autotune.search.memory_prior import ModelDims, static_memory

    dims = ModelDims.from_spec(model, counts=counts)
    choices = space.choices
    precision = next((p for p in ("bf16", "fp16", "bf16+tf32", "fp16+tf32") if p in choices["precision"]), choices["precision"][0])
    optim = min(choices["optim"], key=lambda o: static_memory(dims, precision, o).total_bytes)
    attention = next((a for a in ("flash_attention_2", "flash_attention_3", "sdpa") if a in choices["attn_implementation"]),
                     choices["attn_implementation"][0])
    lean = TrialParams(precision=precision, optim=optim, attn_implementation=attention,
                       gradient_checkpointing=True in choices["gradient_checkpointing"],
                       use_liger_kernel=True in choices.get("use_liger_kernel", ()))
    return MemoryModel(dims, seq_len).largest_batch_that_fits(lean, space.batch_growth(), memory_bytes) or 0


def _host_ceiling(options: RunOptions, device: DeviceInfo) -> int | None:
    """A GPU run's host-memory ceiling (default 95% of this machine's memory); None on a CPU, whose --memory-ceiling is the host's.

    Raises:
        UsageError/DeviceError: given on a CPU run, or over this machine's memory.
    """
    import psutil

    if not device.is_cuda:
        if options.host_memory_ceiling is not None:
            raise UsageError("--host-memory-ceiling is for GPU runs: on a CPU run --memory-ceiling is the host's; drop it")
        return None
    total = int(psutil.virtual_memory().total)
    if options.host_memory_ceiling is None:
        return int(CEILING_SAFETY_FRACTION * total)
    ceiling = parse_bytes(options.host_memory_ceiling, total_bytes=total)
    if ceiling > total:
        raise DeviceError(f"--host-memory-ceiling {format_bytes(ceiling)} is above this machine's {format_bytes(total)}: "
                          f"use at most {format_bytes(total)} or a fraction like 0.9")
    return ceiling


def _offload_within(space: SearchSpace, model: Any, counts: Any, host_ceiling: int) -> SearchSpace:
    """The space without the offloading sharding values whose state (at the space's least demanding precision and
    optimizer that value runs) cannot fit in ``host_ceiling``.

    Raises:
        UsageError: no sharding value left (offload alone, without the host memory for it).
    """
    from autotune.search.memory_prior import ModelDims, host_state_bytes
    from autotune.sharding import NONE, incompatible

    if model is None or not any(v != NONE for v in space.choices.get("sharding", ())):
        return space
    dims = ModelDims.from_spec(model, counts=counts)
    reasons = {}
    for value in space.choices["sharding"]:
        needs = [host_state_bytes(dims, TrialParams(precision=p, optim=o, sharding=value))
                 for p in space.choices["precision"] for o in space.choices["optim"] if incompatible(value, o) is None]
        if needs and min(needs) > host_ceiling:
            reasons[value] = (f"its offloaded state needs {format_bytes(min(needs))} of host memory, over the "
                              f"{format_bytes(host_ceiling)} host ceiling (--host-memory-ceiling)")
    return space.without("sharding", reasons) if reasons else space


def _check_nproc(options: RunOptions, device: DeviceInfo, gpus: list[int] | None) -> None:
    """Processes per probe that this machine can run.

    Raises:
        UsageError/DeviceError: fewer than 1; more than the GPUs from ``--device`` on (or, on a CPU, than its cores);
            GPUs of different kinds; ``--gpus`` that do not split into runs of N consecutive GPUs; an
            ``--effective-batch-size`` that N processes cannot share equally.
    """
    import os

    n = options.nproc_per_probe
    if n < 1:
        raise UsageError(f"--nproc-per-probe must be at least 1, got {n}")
    if n == 1:
        return
    if gpus is not None:  # workers of n consecutive GPUs each; the kinds were checked over every GPU of --gpus
        from autotune.workers import worker_devices

        worker_devices(gpus, n)
        return
    if options.effective_batch_size is not None and options.effective_batch_size % n:
        raise UsageError(f"--effective-batch-size {options.effective_batch_size} is not a multiple of --nproc-per-probe {n}: "
                         f"each process takes an equal share; use e.g. {n * max(options.effective_batch_size // n, 1)}")
    if device.is_cuda:
        from autotune.probe.ranks import probe_gpus

        wanted = [int(d.partition(":")[2]) for d in probe_gpus(f"cuda:{device.index}", n)]
        flag = f"--nproc-per-probe {n} from cuda:{device.index}"
        try:
            infos = [detect_device(f"cuda:{gpu}") for gpu in wanted]
        except DeviceError as exc:
            raise DeviceError(f"{flag} needs GPUs {wanted[0]}..{wanted[-1]} ({exc}): use fewer processes or a lower --device cuda:N") from exc
        _one_kind(wanted, infos, flag, f"pick --device so that its {n} GPUs are of one kind")
    elif n > (os.cpu_count() or 1):
        raise UsageError(f"--nproc-per-probe {n} on a CPU of {os.cpu_count()} cores: each process needs a core; "
                         f"use --nproc-per-probe {os.cpu_count()} or less")


def _same_kind_gpus(gpus: list[int], device: str | DeviceInfo) -> DeviceInfo:
    """The first of ``gpus``, after checking every one exists and is the same model with the same memory
    (a study belongs to one device kind: its measurements rank configurations for that kind).

    Raises:
        UsageError/DeviceError: ``--device`` is not a GPU, a GPU is missing, or the GPUs differ.
    """
    if device not in ("auto", "cuda"):
        raise UsageError(f"--gpus picks the GPUs itself: drop --device {device if isinstance(device, str) else device.name}")
    infos = [detect_device(f"cuda:{gpu}") for gpu in gpus]
    _one_kind(gpus, infos, "--gpus", "run one study per kind, each with its own --gpus")
    return infos[0]


def _one_kind(gpus: list[int], infos: list[DeviceInfo], flag: str, fix: str) -> None:
    """GPUs of one model and memory size (a study is for one kind: its measurements rank configurations for that kind).

    Raises:
        DeviceError: naming each GPU and ``fix``.
    """
    if len({(info.name, info.total_memory_bytes) for info in infos}) > 1:
        listing = ", ".join(f"cuda:{gpu} {info.name} {format_bytes(info.total_memory_bytes)}" for gpu, info in zip(gpus, infos))
        raise DeviceError(f"{flag} names GPUs of different kinds ({listing}): a study is for one kind; {fix}")


def _dataset_spec(dataset: str | None, text_column: str, tokenizer: str | None, model: Any) -> Any:
    """Check ``--dataset``/``--tokenizer`` now (file, format, column, tokenizer, vocabulary).

    Raises:
        UsageError: with a one-line message naming the fix.
    """
    from autotune.data import DatasetSpec, validate_dataset

    if dataset is None:
        if tokenizer is not None:
            raise UsageError("--tokenizer is only used with --dataset: give --dataset PATH too, or drop --tokenizer")
        return None
    if tokenizer is None:
        if model.source == "local":
            tokenizer = model.name
        elif model.hub_id:
            tokenizer = model.hub_id
        else:
            raise UsageError(f"{model.name} has no tokenizer of its own: pass --tokenizer with a tokenizer directory")
    spec = DatasetSpec(path=str(Path(dataset).resolve()), tokenizer=tokenizer, text_column=text_column)
    validate_dataset(spec, model.vocab_size)
    if Path(tokenizer).is_dir():
        spec = DatasetSpec(path=spec.path, tokenizer=str(Path(tokenizer).resolve()), text_column=text_column)
    return spec
