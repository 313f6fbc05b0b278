"""``--trainer``: the user's own Trainer factory (autotune/probe/user_trainer.py), the examples under examples/, and every bad input.

The bad inputs are checked through ``plan_run`` (and two through the CLI): a one-line UsageError that names
the fix, and no storage file. The end-to-end tests tune both examples on the CPU with a 2-point space and
probes capped at 2 measured steps (``plan_evaluator`` wrapped), then train one step with the result.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

import autotune.api as api
from autotune.api import RunOptions, plan_run
from autotune.errors import EXIT_USAGE, UsageError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PADDED = ROOT / "tests" / "data" / "trainers" / "padded.py"
SPACE = str(ROOT / "tests" / "data" / "trainer_space.yaml")

MY_TRAIN = '''
import json

NUMBER = 3


def make_trainer(args, attn_implementation):
    return _load(args)


def _load(args):
    raise FileNotFoundError("no train.jsonl here")


def one_argument(args):
    return None


def three_arguments(a, b, c):
    return None


def returns_dict(args, attn_implementation):
    return {"loss": 0.0}
'''


def _options(tmp_path: Path, **values: Any) -> RunOptions:
    return RunOptions.of(**{"budget": None, "n_trials": 1, "space": SPACE, "device": "cpu",
                            "storage": f"sqlite:///{tmp_path / 'a.db'}", **values})


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's folder, the current directory: my_train.py (factories that are wrong in every way) and broken.py."""
    (tmp_path / "my_train.py").write_text(MY_TRAIN, encoding="utf-8")
    (tmp_path / "broken.py").write_text("import not_installed_xyz\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _one_line(error: pytest.ExceptionInfo[UsageError]) -> str:
    message = str(error.value)
    assert "\n" not in message and error.value.exit_code == EXIT_USAGE
    return message


# Cold isolation where the factory is not found: reported without importing torch. The two that call it
# import transformers: forked from the probe server (started once per test process, as the probes use it).
@pytest.mark.parametrize(("trainer", "expected"), [
    ("missing.py:make_trainer", "no such file"),
    ("my_train.py", "must name the factory after a colon: --trainer my_train.py:make_trainer"),
    ("nopkg.train:make_trainer", "cannot import nopkg.train: no module 'nopkg'"),
    ("broken.py:make_trainer", "importing broken.py raised ModuleNotFoundError: No module named 'not_installed_xyz' (at broken.py:1"),
    ("my_train.py:make_trainr", "no make_trainr in my_train.py: did you mean make_trainer?"),
    ("my_train.py:NUMBER", "NUMBER in my_train.py is an int, not a function"),
    ("my_train.py:one_argument", "one_argument in my_train.py takes argv: pass its inputs with --trainer-args"),
    ("my_train.py:three_arguments", "three_arguments(a, b, c) in my_train.py cannot be called as make_trainer(argv) or make_trainer(args, attn_implementation)"),
    pytest.param("my_train.py:make_trainer", "make_trainer in my_train.py raised FileNotFoundError: no train.jsonl here "
                 "(at my_train.py:12 in _load: raise FileNotFoundError(", marks=pytest.mark.slow),  # imports transformers
    pytest.param("my_train.py:returns_dict", "returns_dict in my_train.py returned a dict, not a transformers.Trainer", marks=pytest.mark.slow),
])
def test_a_bad_factory_is_a_one_line_error_and_no_study(user_dir: Path, trainer: str, expected: str) -> None:
    calls_it = trainer in ("my_train.py:make_trainer", "my_train.py:returns_dict")
    with pytest.raises(UsageError) as error:
        plan_run(_options(user_dir, trainer=trainer, isolation="fork" if calls_it else "cold"))
    assert expected in _one_line(error)
    assert not (user_dir / "a.db").exists()


@pytest.mark.parametrize(("values", "expected"), [
    ({"model": "tiny-gptneox"}, "drop --model, or drop --trainer"),
    ({"seq_len": 64, "dataset": "corpus.jsonl", "peft": "lora"}, "drop --dataset, --peft and --seq-len, or drop --trainer"),
])
def test_the_options_a_factory_replaces_are_refused_with_it(user_dir: Path, values: dict[str, Any], expected: str) -> None:
    with pytest.raises(UsageError) as error:
        plan_run(_options(user_dir, trainer="my_train.py:make_trainer", **values))
    assert expected in _one_line(error)
    assert not (user_dir / "a.db").exists()


@pytest.mark.parametrize(("argv", "expected"), [
    (["--trainer", "my_train.py:make_trainr"], "did you mean make_trainer?"),
    (["--trainer", "my_train.py:make_trainer", "--model", "gpt2"], "drop --model"),
])
def test_cli_bad_trainer_exits_2_with_one_line(user_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    from autotune.cli import main

    code = main(["run", *argv, "--device", "cpu", "--n-trials", "1", "--isolation", "cold", "--storage", f"sqlite:///{user_dir / 'a.db'}"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.count("\n") == 1 and expected in err
    assert not (user_dir / "a.db").exists()


def test_references_are_parsed_without_importing(tmp_path: Path) -> None:
    from autotune.probe.user_trainer import TrainerRef, parse_trainer_ref

    (tmp_path / "train.py").write_text("raise SystemExit('imported')\n", encoding="utf-8")
    ref = parse_trainer_ref("train.py:make", cwd=tmp_path)
    assert ref == TrainerRef(target=str(tmp_path / "train.py"), function="make") and ref.label == "train-make"
    assert ref.reference == f"{tmp_path / 'train.py'}:make" and ref.where == "train.py"
    module = parse_trainer_ref("pkg.sub.train:make", cwd=tmp_path)
    assert module == TrainerRef(target="pkg.sub.train", function="make", sys_path=str(tmp_path)) and module.label == "train-make"


def test_a_batch_counts_its_non_padding_tokens_and_its_sequences() -> None:
    import torch

    from autotune.probe.user_trainer import batch_sequences, batch_tokens

    ids = torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0]])
    assert int(batch_tokens({"input_ids": ids, "attention_mask": (ids != 0).long()}, None)) == 4  # the mask first
    assert int(batch_tokens({"input_ids": ids}, 0)) == 4  # else the tokens that are not the pad token
    assert batch_tokens({"input_ids": ids}, None) == 8 and batch_sequences({"input_ids": ids}) == 2
    # Padding-free (TRL's padding_free): sequences packed end to end in one row, each starting at position 0.
    packed = {"input_ids": torch.tensor([[5, 6, 7, 5, 0]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    assert batch_tokens(packed, 0) == 5 and int(batch_sequences(packed)) == 2


# ------------------------------------------------------------------------------------------ real probes


@pytest.mark.slow
def test_a_probe_counts_only_non_padding_tokens_and_records_changed_arguments() -> None:
    """padded.py: every sample has exactly 10 real tokens in a batch padded to 24."""
    from autotune.params import TrialParams
    from autotune.probe import isolation
    from autotune.probe.flops import model_flops_per_token
    from autotune.records import ProbeSpec

    spec = ProbeSpec(model={}, params=TrialParams(per_device_train_batch_size=4), seq_len=24, device="cpu", warmup_steps=1,
                     measure_steps=3, trainer=f"{PADDED}:make_trainer_changing_args")
    result = isolation.run_isolated(spec, timeout_s=180)
    assert result.status == "ok", result.error
    assert result.samples_per_s == pytest.approx(4 / result.step_time_s)
    assert result.tokens_per_s == pytest.approx(result.samples_per_s * 10)  # not x 24: the padding is not counted
    # FLOPs of the real model (1 layer, 2 heads of 16; N: qkv, out, MLP, 3 layer norms, the untied head) at its mean real length.
    n = (32 * 96 + 96) + (32 * 32 + 32) + (32 * 64 + 64) + (64 * 32 + 32) + 6 * 32 + 64 * 32
    assert result.model_flops_per_token == pytest.approx(model_flops_per_token(n, 1, 2, 16, 10))
    assert result.parameters_total == result.parameters_trainable == n + 64 * 32 == 12_704  # + the input embedding
    assert result.extra["args_changed"] == ["learning_rate"]
    assert result.extra["trainer_class"] == "transformers.trainer.Trainer" and result.extra["attn_implementation_used"] == "sdpa"
    assert len(result.losses) == 4


@pytest.mark.slow
def test_a_module_factory_plans_its_study_and_warns_about_changed_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from autotune.console import print_header
    from autotune.studies import opening
    from autotune.studies.settings import StudySettings
    from autotune.workers import options_for_worker

    package = tmp_path / "project" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "train.py").write_text(f"import sys\nsys.path.insert(0, {str(PADDED.parent)!r})\n"
                                      "from padded import make_trainer_changing_args\n", encoding="utf-8")
    monkeypatch.chdir(package.parent)
    plan = plan_run(_options(tmp_path, trainer="mypkg.train:make_trainer_changing_args"))
    assert plan.seq_len == 24 and plan.model.source == "trainer" and plan.model.config["model_type"] == "gpt_neox"
    assert plan.study_name == "train-make_trainer_changing_args-seq24-cpu"
    assert plan.trainer.args_changed == ("learning_rate",) and plan.parameters.total == plan.parameters.trainable == 12_704
    console = Console(width=400, record=True)
    print_header(console, plan, 0)
    assert ("warning: make_trainer_changing_args changes TrainingArguments it is given (learning_rate): the probes "
            "measure what your Trainer runs, so those are not tuned") in console.export_text()
    attrs = plan.study_attrs(None)
    assert attrs["trainer"]["reference"] == "mypkg.train:make_trainer_changing_args" and attrs["trainer"]["args"] is None
    assert attrs["probe"]["trainer_sys_path"] == str(package.parent)
    assert attrs["num_parameters"] == 12_704 and "trainer" in opening.IDENTITY_KEYS
    # A worker joining from another directory imports the module as the run did, and finds the same study.
    monkeypatch.chdir(tmp_path)
    joined = options_for_worker(StudySettings.from_dict(attrs), deadline_unix_s=None, storage="sqlite://", study=plan.study_name,
                                device="cpu", budget="1m", n_trials=None, seed_offset=1)
    assert joined["model"] is None and joined["seq_len"] is None
    worker = plan_run(RunOptions(**{**joined, "storage": f"sqlite:///{tmp_path / 'a.db'}"}))
    assert opening.mismatch(attrs, worker.study_attrs(None)) is None
    evaluator = api.plan_evaluator(worker)
    assert (evaluator.trainer, evaluator.trainer_sys_path) == ("mypkg.train:make_trainer_changing_args", str(package.parent))


@pytest.fixture
def short_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real probes, each measuring 2 steps at most (the CPU is too noisy to reach a stable mean quickly)."""
    original = api.plan_evaluator
    monkeypatch.setattr(api, "plan_evaluator", lambda plan: dataclasses.replace(original(plan), max_measure_steps=2, max_measure_s=10.0))


def _example(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """examples/<name>.py as a module, as the user's script would import it."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


def _train_one_step(module: Any, args: Any, attn_implementation: str, tmp_path: Path) -> None:
    args = dataclasses.replace(args, output_dir=str(tmp_path / "out"), max_steps=1, report_to="none", save_strategy="no")
    trainer = module.make_trainer(args, attn_implementation)
    assert trainer.train().global_step == 1


def _check_trials(trials: Any, counts: dict[str, int], max_length: int) -> None:
    probes = trials[trials["status"] != "pruned"]
    assert len(probes) >= 2 and (probes["status"] == "ok").all(), probes[["status", "reason"]]
    assert (probes["parameters_total"] == counts["total"]).all() and (probes["parameters_trainable"] == counts["trainable"]).all()
    # Padded to the longest in each batch: fewer real tokens per sample than the longest allowed.
    assert (probes["tokens_per_s"] < probes["samples_per_s"] * max_length).all()


@pytest.mark.slow
def test_sft_lora_example_is_tuned_end_to_end_and_its_best_arguments_train(
    tmp_path: Path, short_probes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("trl")
    import autotune
    from autotune.report.formatting import format_count

    sft_lora = _example("sft_lora", monkeypatch)
    result = autotune.tune(trainer=f"{EXAMPLES / 'sft_lora.py'}:make_trainer", budget=None, n_trials=2, space=SPACE, device="cpu",
                           warmup_steps=1, measure_steps=2, storage=f"sqlite:///{tmp_path / 'a.db'}", report_dir=tmp_path,
                           verbose=False, command="test")
    counts = result.settings["parameters"]
    assert 0 < counts["trainable"] < counts["total"]  # LoRA: the base is frozen
    _check_trials(result.trials, counts, sft_lora.MAX_LENGTH)
    assert result.trials["tokens_per_s"].notna().all()
    report = (tmp_path / f"{result.study_name}.html").read_text(encoding="utf-8")
    assert f"{format_count(counts['trainable'])} of {format_count(counts['total'])} parameters trainable" in report
    # The dtypes the factory's model is stored in are counted (they size the memory model) and shown.
    assert sum(counts["dtypes"].values()) == counts["total"] and sum(counts["trainable_dtypes"].values()) == counts["trainable"]
    assert "Parameter dtypes" in report and f"{max(counts['dtypes'].values()):,} " in report
    _train_one_step(sft_lora, result.best_training_arguments(), result.best_params["attn_implementation"], tmp_path)


@pytest.mark.slow
def test_custom_collator_example_is_tuned_through_the_cli_and_best_json_trains(
    tmp_path: Path, short_probes: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    from autotune.cli import main
    from autotune.results import ModelLoadingArguments, load_result

    monkeypatch.chdir(ROOT)
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    code = main(["run", "--trainer", "examples/custom_collator.py:make_trainer", "--space", SPACE, "--n-trials", "2", "--device", "cpu",
                 "--warmup-steps", "1", "--measure-steps", "2", "--storage", storage, "--report-dir", str(tmp_path),
                 "--output", str(tmp_path / "best.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "your Trainer from" in out and "warning" not in out.split("study '")[0]  # no TrainingArguments changed
    assert "parameters trainable (stored as " in out and " float32)" in out
    study = "custom_collator-make_trainer-seq"
    result = load_result(next(line.split("'")[1] for line in out.splitlines() if line.startswith(f"study '{study}")), storage)
    custom = _example("custom_collator", monkeypatch)
    counts = result.settings["parameters"]
    assert counts["trainable"] == counts["total"] > 0
    _check_trials(result.trials, counts, custom.MAX_LENGTH)
    assert "parameters trainable" in (tmp_path / f"{result.study_name}.html").read_text(encoding="utf-8")
    args = TrainingArguments(**json.loads((tmp_path / "best.json").read_text(encoding="utf-8")))
    (loading,) = HfArgumentParser(ModelLoadingArguments).parse_json_file(str(tmp_path / "best.model.json"))
    _train_one_step(custom, args, loading.attn_implementation, tmp_path)


# ------------------------------------------------------------------- a factory's own inputs (make_trainer(argv))

ARGV = ROOT / "tests" / "data" / "trainers" / "argv_trainer.py"


def _argv_plan(tmp_path: Path, args: str | None, **values: Any) -> Any:
    return plan_run(_options(tmp_path, trainer=f"{ARGV}:make_trainer", trainer_args=args, **values))


@pytest.mark.slow
def test_a_factorys_inputs_are_part_of_its_studys_identity(tmp_path: Path) -> None:
    from autotune.api import run_plan
    from tests.conftest import FakeEvaluator

    first = _argv_plan(tmp_path, "--hidden_size 32")
    run_plan(first, evaluator=FakeEvaluator(), report_dir=None)
    identity = first.study_attrs(None)["trainer"]
    assert identity["args"] == ["--hidden_size", "32"] and (identity["trainable"], identity["frozen"]) == (12_704, 0)
    assert identity["tokens_per_sequence"] == 10.0 and identity["objective"] == "tokens"
    assert _argv_plan(tmp_path, "--hidden_size 32").study_name == first.study_name  # the same inputs: the same study
    wider = _argv_plan(tmp_path, "--hidden_size 48")  # another model
    slower = _argv_plan(tmp_path, "--hidden_size 32 --learning_rate 1e-3")  # the same model, other training
    assert len({first.study_name, wider.study_name, slower.study_name}) == 3
    assert wider.study_name.startswith(first.study_name + "-")  # the default name, and a hash of what differs
    # An explicit --study that clashes is refused, naming what differs; the study keeps its trials.
    clash = _argv_plan(tmp_path, "--hidden_size 32 --learning_rate 1e-3", study=first.study_name)
    with pytest.raises(UsageError) as error:
        run_plan(clash, evaluator=FakeEvaluator(), report_dir=None)
    assert "different trainer (args: --hidden_size 32 then, --hidden_size 32 --learning_rate 1e-3 now" in _one_line(error)


@pytest.mark.slow
def test_a_file_a_factorys_inputs_name_is_part_of_the_identity_by_content(tmp_path: Path) -> None:
    from autotune.api import run_plan
    from tests.conftest import FakeEvaluator

    config = tmp_path / "run.json"
    config.write_text('{"hidden_size": 32}', encoding="utf-8")
    first = _argv_plan(tmp_path, f"--hidden_size 32 --run_name {config}")
    run_plan(first, evaluator=FakeEvaluator(), report_dir=None)
    assert first.study_attrs(None)["trainer"]["files"] == {str(config): first.study_attrs(None)["trainer"]["files"][str(config)]}
    config.write_text('{"hidden_size": 64}', encoding="utf-8")
    assert _argv_plan(tmp_path, f"--hidden_size 32 --run_name {config}").study_name != first.study_name


@pytest.mark.slow
def test_the_users_own_settings_are_the_baseline_and_the_expert_rule_a_reference(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("per_device_train_batch_size: [4, 8, 16]\nprecision: [fp32, bf16]\ngradient_checkpointing: [false, true]\n"
                     "dataloader_drop_last: [false, true]\n", encoding="utf-8")
    plan = _argv_plan(tmp_path, "--per_device_train_batch_size 4 --gradient_checkpointing true --dataloader_drop_last true",
                      space=str(space))
    assert plan.baseline_source == "user" and plan.objective == "tokens" and plan.seq_len == 24  # padded to 24: tokens per sequence
    assert (plan.baseline.per_device_train_batch_size, plan.baseline.gradient_checkpointing, plan.baseline.precision) == (4, True, "fp32")
    assert plan.baseline.dataloader_drop_last is True and plan.space.config_fields == ("dataloader_drop_last",)
    # The expert rule: fused AdamW, no checkpointing, the largest batch (16 bits on a GPU only: on this CPU it keeps
    # the baseline's precision); the user's own fields kept.
    expert = plan.expert
    assert (expert.precision, expert.optim, expert.gradient_checkpointing, expert.per_device_train_batch_size) == ("fp32", "adamw_torch_fused", False, 16)
    assert expert.dataloader_drop_last is True and plan.space.contains(expert) and plan.space.contains(plan.baseline)
    attrs = plan.study_attrs(None)
    assert attrs["expert"] == expert.to_dict() and attrs["user_config"]["per_device_train_batch_size"] == 4
    # --baseline: a file of the settings run today, over the factory's own.
    settings = tmp_path / "today.yaml"
    settings.write_text("per_device_train_batch_size: 8\nbf16: true\n", encoding="utf-8")
    other = _argv_plan(tmp_path, "--per_device_train_batch_size 4", space=str(space), baseline=str(settings))
    assert other.baseline_source == "file" and (other.baseline.per_device_train_batch_size, other.baseline.precision) == (8, "bf16")


@pytest.mark.slow
@pytest.mark.parametrize(("values", "space", "expected"), [
    ({"trainer_args": "--no_such_flag 1"}, None, "Some specified arguments are not used by the HfArgumentParser: ['--no_such_flag'"),
    ({"trainer_args": "--hidden_size wide"}, None, "its argument parser rejected its inputs (exit 2)"),
    ({"trainer_args": "--run_name 'unclosed"}, None, "does not split into arguments"),
    ({"trainer_args": ""}, "dataloader_drop_lats: [true]\n", "dataloader_drop_lats: unknown parameter (did you mean dataloader_drop_last?)"),
    ({"trainer_args": ""}, "dataloader_drop_last: [maybe]\n", "dataloader_drop_last: 'maybe' is not true or false"),
    ({"trainer_args": ""}, "bf16: [true, false]\n", "bf16: autotune searches it as precision"),
    ({"trainer_args": ""}, "max_steps: [5]\n", "max_steps: every probe sets it itself"),
    ({"trainer_args": "", "baseline": "missing.json"}, None, "--baseline missing.json: no such file"),
    ({"trainer_args": "", "baseline": "bad.yaml"}, None, "per_device_train_bach_size: not a field of TrainingArguments (did you mean per_device_train_batch_size?)"),
    ({"trainer_args": "", "objective": "tokenz"}, None, "did you mean tokens?"),
])
def test_bad_factory_inputs_spaces_and_baselines_are_one_line_errors(user_dir: Path, values: dict[str, Any], space: str | None,
                                                                     expected: str) -> None:
    (user_dir / "bad.yaml").write_text("per_device_train_bach_size: 16\n", encoding="utf-8")
    extra = {}
    if space is not None:
        (user_dir / "space.yaml").write_text(space, encoding="utf-8")
        extra["space"] = str(user_dir / "space.yaml")
    with pytest.raises(UsageError) as error:
        plan_run(_options(user_dir, trainer=f"{ARGV}:make_trainer", **values, **extra))
    assert expected in _one_line(error)
    assert not (user_dir / "a.db").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("trainer", "args", "expected"), [
    (f"{ARGV}:make_trainer_without_parser", "", "parsed no command line: parse argv with your parser"),
    (f"{PADDED}:make_trainer", "--lr 1", "takes (args, attn_implementation), not its own inputs"),
])
def test_a_factory_that_cannot_take_its_inputs_is_refused(user_dir: Path, trainer: str, args: str, expected: str) -> None:
    with pytest.raises(UsageError) as error:
        plan_run(_options(user_dir, trainer=trainer, trainer_args=args))
    assert expected in _one_line(error)


@pytest.mark.slow
def test_a_probe_passes_the_trial_to_an_argv_factory_as_flags() -> None:
    from autotune.params import TrialParams
    from autotune.probe import isolation
    from autotune.records import ProbeSpec

    params = TrialParams(per_device_train_batch_size=4, attn_implementation="eager", extra=(("dataloader_drop_last", True),))
    spec = ProbeSpec(model={}, params=params, seq_len=24, device="cpu", warmup_steps=1, measure_steps=3, trainer=f"{ARGV}:make_trainer",
                     trainer_args=("--hidden_size", "32", "--per_device_train_batch_size", "2"), trainer_attn_flag=True,
                     objective_tokens_per_sample=10.0)
    result = isolation.run_isolated(spec, timeout_s=180)
    assert result.status == "ok", result.error
    assert result.extra["args_changed"] == [] and result.extra["attn_implementation_used"] == "eager"
    assert result.extra["training_arguments"]["dataloader_drop_last"] is True
    assert result.extra["training_arguments"]["per_device_train_batch_size"] == 4  # the trial's flag comes after the user's
    assert result.samples_per_s == pytest.approx(result.tokens_per_s / 10.0)  # ranked by tokens
    assert result.extra["sequences_per_s_counted"] == pytest.approx(4 / result.step_time_s)


@pytest.mark.slow
def test_trls_own_sft_script_is_tuned_with_packing_and_its_answer_loads_into_sftconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/trl_sft.py (TRL's sft.py adapted) with packing and padding_free searched: the packed configuration wins
    (its rows are full where padded batches of the example's long-tailed lengths are mostly padding: several times the
    tokens per step, measured over up to 6 steps so that a busy machine does not decide it)."""
    pytest.importorskip("trl")
    from trl import SFTConfig

    import autotune

    original = api.plan_evaluator
    monkeypatch.setattr(api, "plan_evaluator", lambda plan: dataclasses.replace(original(plan), max_measure_steps=6, max_measure_s=20.0))

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    space = tmp_path / "space.yaml"
    space.write_text("per_device_train_batch_size: [8]\nprecision: [fp32]\ngradient_checkpointing: [false]\nattn_implementation: [sdpa]\n"
                     "packing: [false, true]\npadding_free: [false, true]\n", encoding="utf-8")
    inputs = (f"--model_name_or_path {EXAMPLES / 'data' / 'tiny-llama'} --dataset_name {EXAMPLES / 'data' / 'sft'} --max_length 128 "
              "--bf16 false --gradient_checkpointing false --per_device_train_batch_size 8")
    result = autotune.tune(trainer=f"{EXAMPLES / 'trl_sft.py'}:make_trainer", trainer_args=inputs, budget=None, n_trials=6, space=str(space),
                           device="cpu", warmup_steps=1, measure_steps=2, storage=f"sqlite:///{tmp_path / 'a.db'}", report_dir=tmp_path,
                           verbose=False, command="test")
    assert result.objective == "tokens" and result.settings["baseline_source"] == "user"
    assert result.best_params["extra"]["packing"] is True, result.ranked()[["trial", "extra", "tokens_per_s"]]
    assert result.speedup_over("baseline") > 1 and result.speedup_over("expert") is not None
    best = json.loads(json.dumps(result.best_json()))
    config = SFTConfig(output_dir=str(tmp_path / "out"), **best)  # the answer goes back into the user's class
    assert config.packing is True and config.max_length == 128 and config.per_device_train_batch_size == 8
    # ... and into the script's own parser as a TRL config file (`python sft.py --config best.json`, `trl sft --config`).
    path = result.write_best_json(tmp_path / "best.json")
    parsed = _example("trl_sft", monkeypatch).make_parser().parse_args_and_config(["--config", str(path), "--output_dir", str(tmp_path)])
    assert parsed[1].packing is True and parsed[1].per_device_train_batch_size == 8
    report = (tmp_path / f"{result.study_name}.html").read_text(encoding="utf-8")
    assert "your settings" in report and "the expert rule" in report and "SFTConfig(" in report
