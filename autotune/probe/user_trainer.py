"""The user's own Trainer (``--trainer my_train.py:make_trainer``): finding their factory, calling it, checking it.

The factory is the contract, in one of two forms::

    def make_trainer(argv: list[str]) -> transformers.Trainer                       # your script's own inputs
    def make_trainer(args: TrainingArguments, attn_implementation: str | None) -> transformers.Trainer

The first is a training script's ``main`` that returns its Trainer instead of training: it parses
``argv`` with its own parser (``HfArgumentParser``, TRL's ``TrlParser``) into its own config class
(``SFTConfig``...), builds the model, data and Trainer, and returns it. autotune calls it with the
user's inputs (``--trainer-args``), then the probe's and the trial's settings as flags
(``--per_device_train_batch_size 16 --bf16 true --packing true ...``; ``--attn_implementation`` where
its parser has it), so any field of the user's class can be searched and the user's own settings are
the baseline (:mod:`autotune.config_fields`). The second builds the model (with
``attn_implementation``), the data and any ``Trainer`` subclass with the ``TrainingArguments`` it is given. It runs only in
child processes: the parent never imports the user's module (it may import torch or TRL, have side
effects at import, or crash). The parent only parses the reference (:func:`parse_trainer_ref`; a file
must exist); two kinds of child call the factory:

* **the plan-time check** (:mod:`autotune.probe.trainer_check`): once, before any study is touched,
  with the baseline ``TrainingArguments`` and the default attention; every way the factory can be
  wrong is a one-line :class:`~autotune.errors.UsageError` naming the fix (:func:`load_factory`,
  :func:`call_factory`).
* **every probe** (:func:`build_trainer`, called by :func:`autotune.probe.child.run_probe`): the trial's
  ``TrainingArguments`` (its parameters plus the probe's step cap, no saving, no reporting, a loss log
  every step) and ``attn_implementation`` go to the factory; the probe then swaps the returned
  Trainer's class for a subclass of itself that times batch fetching, counts non-finite losses and
  counts each step's sequences and non-padding tokens (:func:`batch_tokens`; the same subclass as a
  built-in model's, :func:`autotune.probe.child._timed_trainer`), and attaches its callback.

``TrainingArguments`` fields the factory changed are recorded (:func:`changed_arguments`): the run warns
once, and the probes measure what the Trainer really runs. Nothing here imports torch or transformers
at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.records import ProbeSpec

SIGNATURE = "make_trainer(argv) or make_trainer(args, attn_implementation)"
CONTRACT = "def {name}(argv) -> transformers.Trainer (parse argv with your parser; or {name}(args, attn_implementation))"
_ARGV_NAMES = ("argv", "args_list", "cli_args", "arguments")  # a first parameter so named takes the argv form
# TrainingArguments fields a Trainer or a conversion (TRL's SFTConfig(**args.to_dict())) may rewrite
# without the factory choosing other training: tokens are masked by to_dict(), the logging folder
# follows output_dir.
_IGNORED_FIELDS = frozenset({"hub_token", "push_to_hub_token", "logging_dir"})
_MESSAGE_CHARS = 200  # an exception's message, in a one-line error
_USER_FRAMES = 2  # frames of the user's own files quoted from a traceback


@dataclass(frozen=True)
class TrainerRef:
    """Where a user's Trainer factory lives: a Python file or an importable module, and the function's name.

    Attributes:
        target: the absolute path of a ``.py`` file, or a dotted module name (``package.module``).
        function: the factory's name in it.
        sys_path: for a module: the folder put first on ``sys.path`` to import it (the user's
            directory when the run was planned); None for a file (its own folder goes first, as
            ``python my_train.py`` would have it).
    """

    target: str
    function: str
    sys_path: str | None = None

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py")

    @property
    def reference(self) -> str:
        """``/abs/my_train.py:make_trainer`` or ``package.module:make_trainer``: the study's identity."""
        return f"{self.target}:{self.function}"

    @property
    def where(self) -> str:
        """The file's name or the module's, for messages (``my_train.py``, ``pkg.train``)."""
        return Path(self.target).name if self.is_file else self.target

    @property
    def label(self) -> str:
        """``my_train-make_trainer``: the start of the default study name."""
        stem = Path(self.target).stem if self.is_file else self.target.rsplit(".", 1)[-1]
        return f"{stem}-{self.function}"

    @classmethod
    def from_spec(cls, spec: ProbeSpec) -> TrainerRef:
        assert spec.trainer is not None
        target, _, function = spec.trainer.rpartition(":")
        return cls(target=target, function=function, sys_path=spec.trainer_sys_path)


def parse_trainer_ref(text: str, cwd: str | Path | None = None) -> TrainerRef:
    """``my_train.py:make_trainer`` (a file, relative to ``cwd``) or ``package.module:make_trainer`` -> a
    :class:`TrainerRef`, checked without importing anything (a file must exist).

    Raises:
        UsageError: no ``:function`` part, a name that is not an identifier, a file that does not exist.
    """
    base = Path(cwd) if cwd is not None else Path.cwd()
    target, colon, function = text.strip().rpartition(":")
    example = "--trainer my_train.py:make_trainer (a file) or --trainer my_package.train:make_trainer (a module)"
    if not colon or not target or not function:
        raise UsageError(f"--trainer {text!r} must name the factory after a colon: {example}")
    if not function.isidentifier():
        raise UsageError(f"--trainer {text!r}: {function!r} is not a function name: {example}")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = (base / Path(target).expanduser()).resolve()
        if path.is_dir() or not path.exists():
            what = f"{path} is a folder, not a file" if path.is_dir() else f"no such file {path}"
            raise UsageError(f"--trainer {text}: {what}: pass the path of your training script, e.g. {example.split(' (')[0]}")
        if path.suffix != ".py":
            raise UsageError(f"--trainer {text}: {path} is not a .py file: pass your training script, e.g. {example.split(' (')[0]}")
        return TrainerRef(target=str(path), function=function)
    if not all(part.isidentifier() for part in target.split(".")):
        raise UsageError(f"--trainer {text!r}: {target!r} is neither a .py file nor a module name: {example}")
    return TrainerRef(target=target, function=function, sys_path=str(base.resolve()))


# ----------------------------------------------------------------------------------- child side


def load_factory(ref: TrainerRef) -> Callable[..., Any]:
    """Import the user's file or module and return the factory, its signature checked.

    Raises:
        UsageError: the module cannot be imported (or raises while it is), has no such function
            (close matches named), the name is not callable, or it does not take ``(args, attn_implementation)``.
    """
    module = _import_user_module(ref)
    factory = getattr(module, ref.function, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        close = difflib.get_close_matches(ref.function, names, n=1)
        if close:
            raise UsageError(f"no {ref.function} in {ref.where}: did you mean {close[0]}? (--trainer ...:{close[0]})")
        raise UsageError(f"no {ref.function} in {ref.where}: define {CONTRACT.format(name=ref.function)} there, "
                         "or name the factory that is")
    if not callable(factory):
        raise UsageError(f"{ref.function} in {ref.where} is {_a(type(factory))}, not a function: point --trainer at "
                         f"{CONTRACT.format(name='make_trainer')}")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or an extension without a signature: the call will tell
        return factory  # type: ignore[no-any-return]
    if _binds(signature, 1) or _binds(signature, 2):
        return factory  # type: ignore[no-any-return]
    raise UsageError(f"{ref.function}{signature} in {ref.where} cannot be called as {SIGNATURE}: define it as "
                     f"{CONTRACT.format(name=ref.function)}")


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*([None] * count))
    except TypeError:
        return False
    return True


def takes_argv(factory: Callable[..., Any]) -> bool:
    """The factory is ``make_trainer(argv)`` (its own command-line inputs), not ``make_trainer(args, attn_implementation)``."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return False
    one, two = _binds(signature, 1), _binds(signature, 2)
    if one != two:
        return one
    first = next(iter(signature.parameters), "")
    return first in _ARGV_NAMES


def _import_user_module(ref: TrainerRef) -> Any:
    """The user's module, imported as ``python my_train.py`` would see it (its folder first on sys.path)."""
    folder = str(Path(ref.target).parent) if ref.is_file else ref.sys_path
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    if not ref.is_file:
        try:
            return importlib.import_module(ref.target)
        except ModuleNotFoundError as exc:
            if exc.name and (ref.target == exc.name or ref.target.startswith(exc.name + ".")):
                raise UsageError(f"cannot import {ref.target}: no module {exc.name!r} in {folder} or the installed packages: "
                                 f"run autotune from the folder that holds it, or pass a file: --trainer path/to/file.py:{ref.function}") from None
            raise UsageError(raised_message(f"importing {ref.where}", exc, ref, f"python -c 'import {ref.target}'")) from None
        except Exception as exc:  # noqa: BLE001 - whatever the user's module raises is reported in one line
            raise UsageError(raised_message(f"importing {ref.where}", exc, ref, f"python -c 'import {ref.target}'")) from None
    stem = Path(ref.target).stem
    name = stem if stem.isidentifier() and stem not in sys.modules else f"autotune_user_{abs(hash(ref.target))}"
    spec = importlib.util.spec_from_file_location(name, ref.target)
    if spec is None or spec.loader is None:
        raise UsageError(f"--trainer {ref.reference}: Python cannot load {ref.target}: pass a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises is reported in one line
        del sys.modules[name]
        raise UsageError(raised_message(f"importing {ref.where}", exc, ref, f"python {ref.target}")) from None
    return module


def _a(kind: type) -> str:
    """``a dict``, ``an int``, ``a mypkg.Thing``: a type for a message."""
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def raised_message(what: str, exc: BaseException, ref: TrainerRef, rerun: str | None = None) -> str:
    """``make_trainer in my_train.py raised ValueError: no data (at my_train.py:12 in load: raise ...)``: one
    line, with where it happened in the user's own code and how to see the whole traceback (``rerun``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[0] if lines else ""
    if len(message) > _MESSAGE_CHARS:
        message = message[: _MESSAGE_CHARS - 3] + "..."
    where = _user_frames(exc, ref)
    text = f"{what} raised {type(exc).__name__}" + (f": {message}" if message else "") + (f" (at {where})" if where else "")
    if rerun is None:
        rerun = f"calling {ref.function}(...) yourself with the same inputs"
    return f"{text}: fix it ({rerun} shows the whole traceback)"


def _user_frames(exc: BaseException, ref: TrainerRef) -> str:
    """The innermost frames of the traceback in the user's own files (their folder, not installed packages), one line."""
    root = Path(ref.target).parent if ref.is_file else Path(ref.sys_path or ".")
    frames = []
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        if path.is_absolute() and root in path.parents and "site-packages" not in path.parts:
            code = " ".join((frame.line or "").split())
            frames.append(f"{path.name}:{frame.lineno} in {frame.name}" + (f": {code[:80]}" if code else ""))
    return " <- ".join(reversed(frames[-_USER_FRAMES:]))


def call_factory(factory: Callable[..., Any], ref: TrainerRef, *inputs: Any) -> Any:
    """``factory(*inputs)`` (``(argv)`` or ``(args, attn_implementation)``), checked to return a ``transformers.Trainer``.

    Raises:
        UsageError: the factory raised (its exception and where in the user's code, in one line), its parser
            rejected the inputs, or it returned something else than a Trainer.
    """
    from transformers import Trainer

    try:
        trainer = factory(*inputs)
    except SystemExit as exc:  # argparse exits on inputs it rejects (its message is on stderr, in the log)
        argv = " ".join(inputs[0]) if inputs and isinstance(inputs[0], list) else ""
        raise UsageError(f"{ref.function} in {ref.where}: its argument parser rejected its inputs (exit {exc.code}) "
                         f"[{argv[:200]}]: fix --trainer-args (python {ref.where} {argv[:80]} shows the parser's message)") from None
    except Exception as exc:  # noqa: BLE001 - the user's code: reported in one line, never a traceback here
        raise UsageError(raised_message(f"{ref.function} in {ref.where}", exc, ref)) from None
    if not isinstance(trainer, Trainer):
        kind = "None (no return statement?)" if trainer is None else _a(type(trainer))
        raise UsageError(f"{ref.function} in {ref.where} returned {kind}, not a transformers.Trainer: return the Trainer "
                         "(or a subclass such as trl's SFTTrainer) built with the args it was given")
    return trainer


def changed_arguments(given: dict[str, Any], trainer_args: Any) -> list[str]:
    """The ``TrainingArguments`` fields the Trainer runs with that differ from those the factory was given.

    Compared through ``to_dict()`` on both sides, over the given fields only: a subclass (TRL's
    ``SFTConfig``) adds its own fields, and a conversion such as ``SFTConfig(**args.to_dict())``
    changes nothing here. Fields transformers itself rewrites are left out (:data:`_IGNORED_FIELDS`).
    """
    to_dict = getattr(trainer_args, "to_dict", None)
    if not callable(to_dict):
        return ["args (not a TrainingArguments)"]
    running = to_dict()
    return sorted(k for k, v in given.items() if k not in _IGNORED_FIELDS and running.get(k, v) != v)


def unwrapped_model(model: Any) -> Any:
    """The transformers model inside a peft wrapper (``PeftModel.get_base_model()``), else the model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def model_config_dict(model: Any) -> dict[str, Any]:
    """The model's config as JSON (``model_type`` set even for a config class without one)."""
    config = getattr(unwrapped_model(model), "config", None)
    if config is None:
        return {"model_type": type(unwrapped_model(model)).__name__}
    to_json = getattr(config, "to_json_string", None)
    data = json.loads(to_json(use_diff=False)) if callable(to_json) else json.loads(json.dumps(vars(config), default=str))
    if not isinstance(data.get("model_type"), str) or not data.get("model_type"):
        data["model_type"] = type(unwrapped_model(model)).__name__
    return dict(data)


def _config_dims(model: Any) -> tuple[int, int, int] | None:
    """(layers, heads, head dimension) from the model's config, or None where it does not say."""
    from autotune.models import ModelSpec

    spec = ModelSpec(name="user", source="trainer", config=model_config_dict(model))
    try:
        return spec.num_layers, spec.num_attention_heads, spec.head_dim
    except KeyError:
        return None


def pad_token_id(trainer: Any) -> int | None:
    """The pad token of the trainer's tokenizer (``processing_class``), else of the model's config."""
    for owner in (getattr(trainer, "processing_class", None), getattr(getattr(trainer, "processing_class", None), "tokenizer", None),
                  getattr(unwrapped_model(getattr(trainer, "model", None)), "config", None)):
        value = getattr(owner, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return None


def batch_tokens(batch: Any, pad_id: int | None) -> Any:
    """Non-padding tokens of one micro-batch (a tensor on the batch's device, or an int; no host sync).

    The sum of a 2-D ``attention_mask`` where there is one; for a padding-free batch (``position_ids``,
    no mask: sequences packed end to end) every token; else the ``input_ids`` that are not the pad
    token; without a known pad token, every token.
    """
    if not hasattr(batch, "get"):
        return 0
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if mask is not None and getattr(mask, "dim", lambda: 0)() == 2:
        return mask.sum()
    if ids is None or not hasattr(ids, "numel"):
        return 0
    if pad_id is None or batch.get("position_ids") is not None:
        return ids.numel()
    return (ids != pad_id).sum()


def batch_sequences(batch: Any) -> Any:
    """Sequences in one micro-batch: the rows of its ``input_ids``; for a padding-free batch (one row of
    sequences packed end to end, ``position_ids``, no mask) the sequences starting in it (position 0;
    a tensor on the device, no host sync)."""
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    shape = getattr(ids, "shape", None)
    positions = batch.get("position_ids") if hasattr(batch, "get") else None
    if positions is not None and batch.get("attention_mask") is None and shape and shape[0] == 1:
        return (positions == 0).sum()
    return int(shape[0]) if shape else 0


@dataclass(frozen=True)
class ProbedTrainer:
    """The user's Trainer for one probe (:func:`build_trainer`) and what the result reports about it."""

    trainer: Any
    counts: Any  # autotune.lora.ParameterCounts of the model as trained (adapters included)
    build_s: float  # the factory's call: model, data and Trainer
    trainer_class: str  # the user's class, ``module.Class``
    args_changed: list[str]
    dims: tuple[int, int, int] | None  # layers, heads, head dimension (None: the config does not say)

    def flops_per_token(self, matmul_params: int, trainable_matmul_params: int, mean_seq_len: float | None) -> float:
        """Model FLOPs per token of the real model (PaLM Appendix B, as for a built-in model) with the mean
        real sequence length of the measured batches in the attention term; ``matmul_params``: N of the
        formula (:func:`autotune.probe.model.matmul_params`). Without layers and heads in the model's
        config, or without a length, only ``6N``: the attention term cannot be computed, so it is left out.
        Frozen weights skip their weight-gradient matmul: 2 of the 6 FLOPs per parameter and token."""
        from autotune.probe.flops import model_flops_per_token

        layers, heads, head_dim = self.dims if self.dims is not None and mean_seq_len else (0, 0, 0)  # 0 layers: 6N alone
        return model_flops_per_token(matmul_params, layers, heads, head_dim, round(mean_seq_len or 0),
                                     frozen_params=matmul_params - trainable_matmul_params)

    def extra(self) -> dict[str, Any]:
        """What the result's ``extra`` keeps: the Trainer's class, the fields the factory changed, the
        attention kernel the model really runs (a factory may ignore ``attn_implementation``)."""
        config = getattr(unwrapped_model(self.trainer.model), "config", None)
        return {"trainer_class": self.trainer_class, "args_changed": self.args_changed,
                "attn_implementation_used": getattr(config, "_attn_implementation", None)}


@contextlib.contextmanager
def recorded_options() -> Iterator[set[str]]:
    """The option strings (``--packing``, ...) of every argparse parser that parses inside the block: what a
    ``make_trainer(argv)`` factory's parser accepts (HfArgumentParser and TrlParser parse with argparse).
    Nothing is changed: each parse goes on as it would."""
    seen: set[str] = set()
    original = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        seen.update(self._option_string_actions)
        return original(self, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]


def factory_argv(spec: ProbeSpec, fields: dict[str, Any]) -> list[str]:
    """What a ``make_trainer(argv)`` factory is called with in a probe: the user's inputs, then ``fields`` (the
    probe's and the trial's) as flags, and the trial's attention kernel where the factory's parser takes it."""
    from autotune.config_fields import as_flags

    argv = [*(spec.trainer_args or ()), *as_flags(fields)]
    if spec.trainer_attn_flag:
        argv += ["--attn_implementation", spec.params.attn_implementation]
    return argv


def build_trainer(spec: ProbeSpec, args: Any, cuda: bool, probe: dict[str, Any] | None = None) -> ProbedTrainer:
    """The user's Trainer for one probe: ``spec``'s factory called with ``args`` (the probe's
    ``TrainingArguments``) and the trial's ``attn_implementation``, timed, checked and described; a
    ``make_trainer(argv)`` factory (``spec.trainer_args``) with the user's inputs, then ``probe`` (the probe's
    own fields) and the trial's as flags (``args`` None).
    The probe then makes it its own (:func:`autotune.probe.child.run_probe`: the timing subclass, the callback).

    Raises:
        UsageError: as :func:`load_factory` and :func:`call_factory` (the probe records a crash).
    """
    import torch

    from autotune.lora import count_model_parameters

    ref = TrainerRef.from_spec(spec)
    factory = load_factory(ref)
    start_s = time.perf_counter()
    if spec.trainer_args is not None:  # make_trainer(argv): the user's inputs, then the probe's and the trial's flags
        from autotune.config_fields import config_overrides

        given = {**(probe or {}), **config_overrides(spec.params)}
        trainer = call_factory(factory, ref, factory_argv(spec, given))
        given.pop("report_to")  # transformers keeps it as a list: compared as given it would always differ
        if not cuda:
            given.pop("dataloader_pin_memory", None)  # transformers turns it off on the CPU, where it means nothing
    else:
        given = args.to_dict()
        trainer = call_factory(factory, ref, args, spec.params.attn_implementation)
    if cuda:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - start_s
    kind = type(trainer)
    return ProbedTrainer(trainer=trainer, counts=count_model_parameters(trainer.model), build_s=build_s,
                         trainer_class=f"{kind.__module__}.{kind.__qualname__}", args_changed=changed_arguments(given, trainer.args),
                         dims=_config_dims(trainer.model))
