"""The plan-time check of a user's Trainer factory (``--trainer``), in a child process: ``plan_run`` calls
:func:`inspect_trainer` before any study is touched.

The parent never imports the user's module (it may import torch or TRL, have side effects at import,
or crash), so the check runs where a probe runs: a child forked from the probe server (or
``python -m autotune.probe.trainer_check SPEC.json RESULT.json``, cold), pinned to the run's GPU, with
a deadline. It imports the factory, calls it once with the baseline ``TrainingArguments`` and the
default attention (None), takes one batch from ``trainer.get_train_dataloader()``, and writes what the
parent needs as JSON: the model's config (for the memory model and the study's identity), its
parameter counts, the batch's sequence length (the memory model's tokens per sample), the
``TrainingArguments`` fields the factory changed, and which attention paths the model class has.
Anything wrong is ``{"error": "one line"}`` (:mod:`autotune.probe.user_trainer` words it), which the
parent raises as a :class:`~autotune.errors.UsageError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import autotune.defaults as defaults
from autotune.config_fields import as_flags, describe_fields
from autotune.errors import UsageError
from autotune.probe.user_trainer import (
    TrainerRef,
    batch_sequences,
    batch_tokens,
    call_factory,
    changed_arguments,
    load_factory,
    model_config_dict,
    pad_token_id,
    raised_message,
    recorded_options,
    takes_argv,
    unwrapped_model,
)
from autotune.records import ProbeSpec

_MESSAGE_CHARS = 200  # the last line of a check that crashed, in its one-line error


def inspect_in_child(spec: ProbeSpec) -> dict[str, Any]:
    """The plan-time check, in the child: call the factory once with the baseline ``TrainingArguments``
    and the default attention (None), take one batch, and describe what it built.

    Raises:
        UsageError: anything wrong with the factory or what it returns, in one line.
    """
    ref = TrainerRef.from_spec(spec)
    factory = load_factory(ref)  # first: a factory that cannot be found is reported without importing torch
    if spec.trainer_args is not None and not takes_argv(factory):
        raise UsageError(f"--trainer-args: {ref.function} in {ref.where} takes (args, attn_implementation), not its own inputs: "
                         f"define it as {ref.function}(argv) and parse argv with your parser, or drop --trainer-args")
    if spec.trainer_args is None and takes_argv(factory):
        raise UsageError(f"{ref.function} in {ref.where} takes argv: pass its inputs with --trainer-args (\"\" for none), "
                         "e.g. --trainer-args \"--model_name_or_path my-model\"")
    import torch
    from transformers.utils import logging as hf_logging

    from autotune.lora import count_model_parameters
    from autotune.probe.child import probe_training_arguments

    hf_logging.set_verbosity_error()
    torch.manual_seed(spec.seed)
    cuda = spec.device.startswith("cuda")
    options: set[str] | None = None
    with tempfile.TemporaryDirectory(prefix="autotune-trainer-check-") as output_dir:
        if spec.trainer_args is not None:  # the user's own inputs: their settings, as they run them
            argv = [*spec.trainer_args, *as_flags({"output_dir": output_dir, "report_to": "none", "save_strategy": "no",
                                                    **({} if cuda else {"use_cpu": True})})]
            with recorded_options() as options:
                trainer = call_factory(factory, ref, argv)
            given: dict[str, Any] = {}
            _check_parser(ref, options)
        else:
            args = probe_training_arguments(spec, output_dir, 1, cuda)
            given = args.to_dict()
            trainer = call_factory(factory, ref, args, None)
        try:
            batch = next(iter(trainer.get_train_dataloader()))
        except Exception as exc:  # noqa: BLE001 - the user's data or collator: reported in one line
            what = f"the first batch of {ref.function}'s Trainer ({type(trainer).__name__}.get_train_dataloader())"
            raise UsageError(raised_message(what, exc, ref)) from None
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        if ids is None or getattr(ids, "dim", lambda: 0)() < 1:
            keys = ", ".join(map(str, batch.keys())) if hasattr(batch, "keys") else type(batch).__name__
            raise UsageError(f"the batches of {ref.function}'s Trainer have no input_ids (they hold {keys}): autotune tunes "
                             "token models: return a Trainer whose collator yields input_ids")
        model = unwrapped_model(trainer.model)
        counts = count_model_parameters(trainer.model)
        sequences, tokens = int(batch_sequences(batch)), int(batch_tokens(batch, pad_token_id(trainer)))
        # The class the factory's configuration is: what it parses its inputs into, or the TrainingArguments it is given.
        config_class = type(trainer.args) if options is not None else type(args)
        fields = describe_fields(config_class)
        return {
            "config_class": f"{config_class.__module__}.{config_class.__qualname__}",
            "user_config": _own_settings(trainer.args, fields) if options is not None else None,
            "fields": {name: kind.to_dict() for name, kind in fields.items()},
            "options": sorted(options) if options is not None else None,
            "attn_implementation": getattr(getattr(model, "config", None), "_attn_implementation", None),
            "tokens_per_sequence": tokens / sequences if sequences else None,
            "batch_numel": int(ids.numel()),
            "max_length": _max_length(trainer.args),
            "value_problems": _value_problems(trainer.args, {k: v for k, v in (spec.check_values or {}).items() if k in fields}),
            "config": model_config_dict(trainer.model),
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "trainer_class": f"{type(trainer).__module__}.{type(trainer).__qualname__}",
            "parameters": counts.to_dict(),
            # Tokens per sequence, not per flattened row (a padding-free or packed batch is one long row): the
            # config's max_length where it has one (what no sequence exceeds), else the first batch's tokens per sequence.
            "seq_len": _max_length(trainer.args) or max(1, round(int(ids.numel()) / max(sequences, 1))),
            "batch_size": int(batch_sequences(batch)),
            "batch_tokens": int(batch_tokens(batch, pad_token_id(trainer))),
            "args_changed": changed_arguments(given, trainer.args),
            "supports_sdpa": bool(getattr(type(model), "_supports_sdpa", True)),
            "supports_flash": bool(getattr(type(model), "_supports_flash_attn", True)),
        }


def _check_parser(ref: TrainerRef, options: set[str] | None) -> None:
    """A ``make_trainer(argv)`` factory parsed its inputs with a parser that takes the probe's flags."""
    if not options:
        raise UsageError(f"{ref.function}(argv) in {ref.where} parsed no command line: parse argv with your parser, e.g. "
                         "TrlParser((ScriptArguments, SFTConfig, ModelConfig)).parse_args_and_config(argv)")
    missing = [f"--{name}" for name in ("output_dir", "max_steps", "per_device_train_batch_size") if f"--{name}" not in options]
    if missing:
        raise UsageError(f"the parser of {ref.function}(argv) in {ref.where} has no {', '.join(missing)}: parse argv into your "
                         "TrainingArguments (or SFTConfig) with HfArgumentParser/TrlParser")


def _own_settings(args: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """The user's settings: the fields of their config that differ from the class's defaults (JSON values;
    the probe's own fields left out)."""
    import enum

    from autotune.config_fields import PROBE_FIELDS

    own = {}
    for name, kind in fields.items():
        value = getattr(args, name, None)  # not to_dict(): it masks every field named *_token (TRL's eos_token too)
        value = value.value if isinstance(value, enum.Enum) else value
        if name in PROBE_FIELDS or not (value is None or isinstance(value, (bool, int, float, str))):
            continue
        if value != kind.default:
            own[name] = value
    return own


def _max_length(args: Any) -> int | None:
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _value_problems(args: Any, values: dict[str, list[Any]]) -> list[str]:
    """Each value of the space's user-config fields set alone on the user's config: what the class refuses."""
    problems = []
    for name, choices in values.items():
        for value in choices:
            try:
                dataclasses.replace(args, **{name: value})
            except Exception as exc:  # noqa: BLE001 - the class's own validation, reported in one line
                message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:_MESSAGE_CHARS]
                problems.append(f"{name}={value!r}: {type(args).__name__} refuses it ({message})")
    return problems


def main(argv: list[str] | None = None) -> int:
    """``python -m autotune.probe.trainer_check SPEC.json RESULT.json``: the plan-time check; writes
    the description, or ``{"error": "one line"}``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m autotune.probe.trainer_check SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = ProbeSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        found: dict[str, Any] = inspect_in_child(spec)
    except UsageError as error:
        found = {"error": str(error)}
    Path(argv[1]).write_text(json.dumps(found), encoding="utf-8")
    return 0


@dataclass(frozen=True)
class UserTrainer:
    """A checked factory and what its Trainer trains (the plan-time check's findings).

    Attributes:
        ref: where the factory lives.
        config: the model's config (``config.to_dict()``), for the memory model and the study's identity.
        parameters: an :class:`autotune.lora.ParameterCounts` of the model as trained (adapters included).
        seq_len: tokens per sequence (the memory model's tokens per sample): the config's ``max_length``, else the first
            batch's tokens (padding included) per sequence.
        trainer_class: the Trainer's class, ``module.Class``.
        args_changed: ``TrainingArguments`` fields the factory changed (the probes measure what it runs).
        supports_sdpa, supports_flash: the model class has these attention paths.
    """

    ref: TrainerRef
    config: dict[str, Any]
    parameters: Any
    seq_len: int
    trainer_class: str
    args_changed: tuple[str, ...] = ()
    supports_sdpa: bool = True
    supports_flash: bool = True
    trainer_args: tuple[str, ...] | None = None  # the factory's own inputs (a make_trainer(argv) factory); None: the other form
    config_class: str = defaults.CONFIG_CLASS  # the class the Trainer's args are, module.Class
    user_config: dict[str, Any] | None = None  # the user's own settings (fields that differ from the class's defaults)
    fields: dict[str, Any] | None = None  # name -> autotune.config_fields.FieldKind of the config class
    options: tuple[str, ...] | None = None  # the option strings the factory's parser takes
    attn_implementation: str | None = None  # the kernel the model runs with the user's own settings
    tokens_per_sequence: float | None = None  # real (non-padding) tokens per sequence in the first batch
    max_length: int | None = None  # the config's max_length (TRL), if any
    value_problems: tuple[str, ...] = ()  # values of the space's user-config fields the class refuses

    @property
    def config_class_name(self) -> str:
        """``SFTConfig``: the class's own name, for messages and the code a user pastes."""
        return self.config_class.rsplit(".", 1)[-1]

    @property
    def takes_attn_flag(self) -> bool:
        return bool(self.options) and "--attn_implementation" in (self.options or ())


def inspect_trainer(ref: TrainerRef, *, device: str, device_uuid: str | None, timeout_s: float, mode: str = "forkserver",
                    seed: int = 0, python: str = sys.executable, trainer_args: tuple[str, ...] | None = None,
                    check_values: dict[str, list[Any]] | None = None) -> UserTrainer:
    """Run the plan-time check of ``ref`` in a fresh child process, as a probe is started (``mode``: forked
    from the probe server, or ``cold``; pinned to the run's GPU, if any), and read its findings.

    Raises:
        UsageError: the factory is wrong (the child's one-line message), or the check crashed or ran past ``timeout_s``.
    """
    from autotune.lora import ParameterCounts
    from autotune.params import TrialParams
    from autotune.probe import isolation
    from autotune.probe.lifetime import DEADLINE_ENV, DRIVER_PID_ENV

    spec = ProbeSpec(model={}, params=TrialParams(), seq_len=0, device=device, seed=seed, trainer=ref.reference,
                     trainer_sys_path=ref.sys_path, trainer_args=trainer_args, check_values=check_values)
    env = isolation.child_env(spec, device_uuid)
    if device.startswith("cuda:"):
        spec = dataclasses.replace(spec, device="cuda")  # the one GPU the child sees
    if mode == "forkserver" and not isolation.start_server():  # the probes' server: started once, now rather than later
        mode = "cold"
    with tempfile.TemporaryDirectory(prefix="autotune-trainer-check-") as folder:
        spec_path, result_path, log_path = Path(folder, "spec.json"), Path(folder, "result.json"), Path(folder, "output.txt")
        spec_path.write_text(spec.to_json(), encoding="utf-8")
        env = {**env, DRIVER_PID_ENV: str(os.getpid()), DEADLINE_ENV: f"{timeout_s:.0f}"}
        child = isolation._launch(mode, spec_path, result_path, log_path, env, python,  # type: ignore[arg-type]
                                  target=_forked_check, module="autotune.probe.trainer_check")
        try:
            code = child.wait(timeout_s)
        finally:
            child.kill_group()
        if code is None:
            raise UsageError(f"checking --trainer {ref.reference}: {ref.function} did not return a Trainer and a first batch "
                             f"within {timeout_s:.0f} s: make it faster, or give more time with --trial-timeout")
        found = json.loads(result_path.read_text(encoding="utf-8")) if result_path.exists() else None
        if found is None:
            tail = [line for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
            last = tail[-1].strip()[:_MESSAGE_CHARS] if tail else "no output"
            raise UsageError(f"checking --trainer {ref.reference}: the check process exited with code {code} ({last}): "
                             f"call {ref.function} yourself to see why")
    if "error" in found:
        raise UsageError(str(found["error"]))
    return UserTrainer(
        ref=ref, config=dict(found["config"]), seq_len=int(found["seq_len"]), trainer_class=str(found["trainer_class"]),
        parameters=ParameterCounts.from_dict(found["parameters"]),
        args_changed=tuple(found.get("args_changed") or ()), supports_sdpa=bool(found.get("supports_sdpa", True)),
        supports_flash=bool(found.get("supports_flash", True)), trainer_args=trainer_args,
        config_class=str(found.get("config_class") or UserTrainer.config_class), user_config=found.get("user_config"),
        fields=found.get("fields"), options=tuple(found["options"]) if found.get("options") is not None else None,
        attn_implementation=found.get("attn_implementation"), tokens_per_sequence=found.get("tokens_per_sequence"),
        max_length=found.get("max_length"), value_problems=tuple(found.get("value_problems") or ()),
    )


def _forked_check(spec_path: str, result_path: str, log_path: str, env: dict[str, str]) -> None:
    """The plan-time check forked from the probe server: a probe's process set-up, then :func:`main`."""
    from autotune.probe.isolation import enter_probe_process

    enter_probe_process(log_path, env)
    main([spec_path, result_path])


if __name__ == "__main__":
    from autotune.probe.lifetime import arm_deadline, die_with_parent

    die_with_parent()
    arm_deadline()
    sys.exit(main())
