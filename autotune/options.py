"""What a user chooses for one run: :class:`RunOptions` (``autotune run``'s flags and :func:`autotune.api.tune`'s
keywords, one list) and the check that each option has the type its annotation names."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna

import autotune.defaults as defaults
from autotune.errors import UsageError
from autotune.records import DeviceInfo
from autotune.search.strategies.registry import DEFAULT_STRATEGY
from autotune.space import SearchSpace


@dataclass(frozen=True)
class RunOptions:
    """What a user chooses for one run: ``autotune run``'s flags and :func:`~autotune.api.tune`'s keywords, one list.

    Attributes:
        model: a built-in name (``autotune models``), a Hugging Face hub id, or a local directory
            with a ``config.json``; None: :data:`~autotune.plan.DEFAULT_MODEL` (or, with ``trainer``, the factory's model).
        budget: wall-clock budget of the whole run, probes included (``"30m"``, ``"90s"``, ``"2h"``
            or seconds); None: no time limit (give ``n_trials``).
        n_trials: at most this many exploring probes in this run (near-tie re-measures, at most 3,
            come on top).
        space: a built-in space name (``default``, ``quick``), a YAML path, or a SearchSpace.
        memory_ceiling: peak device memory allowed (``"40GiB"``, bytes, or a fraction like ``0.8``);
            default: 95% of the device's memory.
        effective_batch_size: keep ``per_device_train_batch_size * gradient_accumulation_steps``
            equal to this, so tuning never changes the optimisation.
        seq_len: tokens per sample; None: :data:`~autotune.plan.DEFAULT_SEQ_LEN` (with ``trainer``: the length of its first batch).
        device: ``auto``, ``cuda``, ``cuda:N`` or ``cpu``.
        storage: an Optuna storage URL (default: ``sqlite:///autotune.db``).
        study: the study name; the same name resumes the study (default: from model, seq-len, device).
        seed: sampler and data seed.
        trial_timeout: deadline of one probe, compilation included.
        warmup_steps: optimizer steps run before timing starts.
        measure_steps: the fewest optimizer steps timed; probes keep measuring until the mean
            step time is stable (95% CI within +-2%) or a cap is reached.
        max_measure_time: that cap in time (``"30s"``, seconds): the most a probe spends timing steps after its
            warm-up (50 steps is the other cap); a probe stopped by it before its interval is within +-2% is flagged.
        dataset: a text file (``.jsonl``, ``.csv``, ``.parquet``, ``.txt``) to train the probes on,
            tokenised and packed in the DataLoader workers; None: synthetic tokens.
        text_column: the dataset's text column (not used for ``.txt``).
        tokenizer: a tokenizer directory or hub id for ``dataset`` (default: the model's).
        strategy: how to search: ``bayes`` (the default: a throughput model learned from the probes,
            expected improvement per probe second, crashes inferred, memory model), or the baselines
            ``tpe`` (plain Optuna TPE) and ``random``.
        isolation: how each probe's fresh process starts: ``fork`` from a probe server that has
            imported torch and transformers once (checked CUDA-clean when it starts; probes start
            cold if it is not), or ``cold``, a new interpreter per probe (slower, nothing shared).
        gpus: one worker per GPU on this machine, all on one study (``"0,1,2,3"``, ``[0, 1]`` or
            ``"all"``; :mod:`autotune.workers`); the storage then defaults to a journal file
            (:data:`~autotune.plan.WORKERS_STORAGE`), which several processes share safely without a server.
        peft: ``"lora"``: train LoRA adapters on a frozen base (the ``peft`` library, ``pip install
            'autotune[lora]'``); ``"qlora"``: the same on a base loaded in 4 bits (needs CUDA and
            bitsandbytes); None: train every weight. The adapters are the user's choice, not tuned,
            and part of the study's identity (:mod:`autotune.lora`).
        lora_r: the adapters' rank (default 8, peft's).
        lora_alpha: LoRA's alpha, the update scaled by alpha / r (default 8, peft's).
        lora_dropout: dropout on the adapters' input (default 0, peft's).
        lora_target_modules: module names to wrap (``"q_proj,v_proj"`` or a list); default: peft's
            default for the architecture.
        trainer: tune your own training: ``"my_train.py:make_trainer"`` or ``"package.module:make_trainer"``
            (imported with the current directory first on ``sys.path``), a function
            ``make_trainer(args: TrainingArguments, attn_implementation: str | None) -> transformers.Trainer``
            (any subclass, e.g. TRL's ``SFTTrainer``) that builds your model, data and Trainer with the
            arguments it is given. It runs only in the probes' child processes (and one plan-time check);
            its model and data replace ``model``, ``dataset``, ``peft`` and ``seq_len``, which must not be
            given with it (:mod:`autotune.probe.user_trainer`). A factory ``make_trainer(argv)`` takes its own
            command-line inputs instead (``trainer_args``) and parses them with its own parser.
        trainer_args: the inputs of a ``make_trainer(argv)`` factory, as one string (split like a shell
            would: ``"--model_name_or_path m --lora_r 64"``) or a list; TRL's ``--config sft.yaml`` among
            them works. They are part of the study's identity (with what the factory builds from them).
        baseline: the settings to measure the speed-up against: a JSON/YAML file (or a mapping) of config
            fields (``{"per_device_train_batch_size": 16, "bf16": true}``); default: the factory's own
            settings (``trainer_args`` alone), else transformers' defaults.
        objective: ``tokens`` (real, non-padding tokens per second; the default with ``trainer``, whose
            batches' lengths vary) or ``samples`` (sequences per second; the default otherwise, where
            every sequence has ``seq_len`` tokens).
        host_memory_ceiling: on a GPU run, the host memory a probe's processes may hold together (their peak resident
            memory, summed): ``"120GiB"`` or a fraction of this machine's memory; default 95% of it. A probe over it
            does not fit, and an offloading ``sharding`` value whose state cannot fit in it is dropped before the search.
            On a CPU run ``memory_ceiling`` is the host's.
        nproc_per_probe: processes per probe, one per GPU (``--device cuda:N``: GPUs N, N+1, ...), started by
            ``torchrun`` and trained data-parallel by the Trainer (DDP; gloo on the CPU, where each process gets its share
            of the cores and of the memory ceiling). Throughput is the sum over the processes, the peak the largest; the
            best configuration is per device, for ``torchrun --nproc-per-node N``. Default 1: one process, no process group.
    """

    model: str | None = None
    budget: str | float | None = defaults.BUDGET
    n_trials: int | None = None
    space: str | SearchSpace = defaults.SPACE
    memory_ceiling: str | float | None = None
    effective_batch_size: int | None = None
    seq_len: int | None = None
    device: str | DeviceInfo = defaults.DEVICE
    storage: str | optuna.storages.BaseStorage | None = None
    study: str | None = None
    seed: int = defaults.SEED
    trial_timeout: str | float = defaults.TRIAL_TIMEOUT
    warmup_steps: int = defaults.WARMUP_STEPS
    measure_steps: int = defaults.MEASURE_STEPS
    max_measure_time: str | float = defaults.MAX_MEASURE_TIME
    dataset: str | None = None
    text_column: str = defaults.TEXT_COLUMN
    tokenizer: str | None = None
    strategy: str = DEFAULT_STRATEGY
    isolation: str = defaults.ISOLATION
    gpus: str | Sequence[int] | None = None
    peft: str | None = None
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_target_modules: str | Sequence[str] | None = None
    trainer: Any = None  # a reference string, or an autotune.probe.user_trainer.TrainerRef (a worker: the study's)
    trainer_args: str | Sequence[str] | None = None
    baseline: str | dict[str, Any] | None = None
    objective: str | None = None
    nproc_per_probe: int = 1
    host_memory_ceiling: str | float | None = None

    def __post_init__(self) -> None:
        check_option_types(self)

    @classmethod
    def of(cls, **values: Any) -> RunOptions:
        """Options from keywords; an unknown keyword is a :class:`UsageError` naming the close match.

        Raises:
            UsageError: for a keyword that is not an option.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise UsageError(f"unknown option {key!r}: {hint}use one of {', '.join(names)}")
        return cls(**values)


def check_option_types(options: RunOptions) -> None:
    """Each option of the type its annotation names (a path may stand for a string, an int for a float), so a
    wrong one is one line naming it, not a traceback from deep in the run.

    Raises:
        UsageError: for the first option of another type.
    """
    import typing

    hints = typing.get_type_hints(RunOptions)
    for field in dataclasses.fields(RunOptions):
        value = getattr(options, field.name)
        if not _of_type(value, hints[field.name]):
            raise UsageError(f"option {field.name}={value!r} is a {type(value).__name__}: give {_type_name(hints[field.name])} "
                             f"(help(autotune.tune) lists every option)")


def _of_type(value: Any, hint: Any) -> bool:
    import collections.abc
    import types
    import typing

    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_of_type(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, (str, os.PathLike))
    if origin in (collections.abc.Sequence, list, tuple):
        args = typing.get_args(hint)
        return (isinstance(value, (list, tuple)) and not isinstance(value, str)
                and (not args or all(_of_type(v, args[0]) for v in value)))
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, origin or hint)


def _type_name(hint: Any) -> str:
    import types
    import typing

    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", None) or str(hint).replace("collections.abc.", "")
