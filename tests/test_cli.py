"""`autotune run` end to end on the CPU, resume, the API's TrainingArguments, and bad input."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autotune.cli import main

DATA = Path(__file__).parent / "data"
FAST = ["--model", "tiny-gptneox", "--seq-len", "32", "--warmup-steps", "1", "--measure-steps", "2", "--max-measure-time", "3s",
        "--device", "cpu"]


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autotune.cli", "run", *FAST, "--storage", f"sqlite:///{tmp_path / 'a.db'}",
         "--report-dir", str(tmp_path / "reports"), *extra],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )


@pytest.mark.slow
def test_run_end_to_end_then_resume(tmp_path) -> None:
    first = _run(tmp_path, "--space", str(DATA / "tiny_space.yaml"), "--n-trials", "2", "--output", "best.json")
    assert first.returncode == 0, first.stderr
    assert "Top configurations" in first.stdout and "(baseline)" in first.stdout
    best = json.loads((tmp_path / "best.json").read_text())
    assert "attn_implementation" not in best and best["per_device_train_batch_size"] in (4, 8)
    loading = json.loads((tmp_path / "best.model.json").read_text())
    assert loading["attn_implementation"] == "sdpa" and "x transformers' defaults" in loading["autotune_note"]
    assert (tmp_path / "reports" / "tiny-gptneox-seq32-cpu.html").read_text().count("<tr") >= 2

    # The same command resumes: the two measured trials stay, two new ones run, then the space is done.
    second = _run(tmp_path, "--space", str(DATA / "tiny_space.yaml"), "--n-trials", "5")
    assert second.returncode == 0, second.stderr
    assert "resuming 2 finished trials" in second.stdout
    study = optuna.load_study(study_name="tiny-gptneox-seq32-cpu", storage=f"sqlite:///{tmp_path / 'a.db'}")
    # Repeats of a measured configuration are never re-run; near-ties may be re-measured on purpose.
    measured = [t for t in study.trials if "duplicate_of" not in t.user_attrs and "remeasure_of" not in t.user_attrs]
    configs = {(t.user_attrs["params"]["per_device_train_batch_size"], t.user_attrs["params"]["precision"]) for t in measured}
    assert len(measured) == 4 == len(configs)
    assert "Stopped: exhausted" in second.stdout
    runs = study.user_attrs["autotune"]["runs"]
    assert [r["n_trials"] for r in runs] == [2, 5] and runs[-1]["stopped_because"] == "exhausted"
    assert study.user_attrs["autotune"]["budget_s"] == 2 * 30 * 60  # the default budget, once per run

    # best.json is TrainingArguments' fields alone (TrainingArguments(**best) loads it); the model-loading
    # field is beside it, in best.model.json.
    from transformers import HfArgumentParser, TrainingArguments

    from autotune.results import ModelLoadingArguments

    training = TrainingArguments(**best)
    (loading,) = HfArgumentParser(ModelLoadingArguments).parse_json_file(str(tmp_path / "best.model.json"))
    assert training.per_device_train_batch_size == best["per_device_train_batch_size"]
    assert loading.attn_implementation == "sdpa"


@pytest.mark.slow
def test_api_returns_training_arguments_that_trainer_accepts(tmp_path) -> None:
    from transformers import Trainer

    import autotune
    from autotune.models import build_model, resolve_model

    result = autotune.tune(
        "tiny-gptneox", space=str(DATA / "tiny_space.yaml"), n_trials=2, budget=None, seq_len=32, device="cpu",
        storage=f"sqlite:///{tmp_path / 'api.db'}", warmup_steps=1, measure_steps=2, max_measure_time=3, report_dir=tmp_path,
    )
    assert len(result.trials[result.trials["remeasure_of"].isna()]) == 2  # near-ties may be re-measured on top
    assert result.baseline["is_baseline"] and result.baseline["per_device_train_batch_size"] == 8
    # On a CPU the ranking's prior puts fp32 (the baseline's precision) first among near-ties, so nothing
    # measured slower than the baseline is ever returned there.
    assert result.baseline["precision"] == "fp32" and result.speedup is not None and result.speedup >= 1.0
    assert set(result.best_params) >= {"per_device_train_batch_size", "precision", "attn_implementation"}
    args = result.best_training_arguments(output_dir=str(tmp_path / "out"), learning_rate=1e-4)
    assert args.learning_rate == 1e-4
    assert args.per_device_train_batch_size == result.best_params["per_device_train_batch_size"]
    model = build_model(resolve_model("tiny-gptneox"), attn_implementation=result.best_params["attn_implementation"], device="cpu")
    trainer = Trainer(model=model, args=args)
    assert trainer.args.per_device_train_batch_size == args.per_device_train_batch_size


def _db_has_study(path: Path) -> bool:
    if not path.exists():
        return False
    with sqlite3.connect(path) as db:
        tables = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
        return "studies" in tables and db.execute("select count(*) from studies").fetchone()[0] > 0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "polyglot-ko-1.3"], "did you mean polyglot-ko-1.3b"),
        (["--budget", "30 minutes"], "cannot read duration"),
        (["--memory-ceiling", "40 gigs"], "cannot read memory size"),
        (["--memory-ceiling", "999TiB"], "is above the"),
        (["--space", "nope.yaml"], "not found"),
        (["--space", "defualt"], "did you mean 'default'"),
        (["--seq-len", "4096"], "outside 1..1024"),
        (["--effective-batch-size", "7", "--space", "quick"], "divides --effective-batch-size 7"),
        (["--device", "cuda"], "--device cuda asked for a GPU"),
        (["--storage", "nosuchdb://x"], "cannot open storage"),
        (["--memory-ceiling", "16"], "memory size '16' has no unit: write 16GiB"),
        (["--study", "../../escape"], "is not a study name"),
        (["--study", "a/b"], "is not a study name"),
        (["--study", ""], "is not a study name"),
        (["--study", "-"], "is not a study name"),
        (["--study", "x" * 600], "is not a study name"),
        (["--trainer-args", "--lr 1"], "--trainer-args are the inputs of your --trainer factory"),
        (["--objective", "tokenz"], "did you mean tokens?"),
        (["--baseline", "missing.yaml"], "--baseline missing.yaml: no such file"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_leaves_no_study(tmp_path, monkeypatch, capsys, args, expected) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--storage", f"sqlite:///{tmp_path / 'a.db'}", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("autotune: error: ") and expected in err
    assert err.count("\n") == 1
    assert not _db_has_study(tmp_path / "a.db")


def test_an_empty_storage_is_refused(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--storage", ""]) == 2
    assert "--storage '' is empty" in capsys.readouterr().err and not (tmp_path / "autotune.db").exists()


def test_a_report_never_leaves_its_folder() -> None:
    from autotune.studies.opening import report_file_name

    assert report_file_name("../../escape") == "_.._escape.html" and "/" not in report_file_name("a/b")
    assert report_file_name("tiny-gptneox-seq128-cpu") == "tiny-gptneox-seq128-cpu.html"


def test_invalid_space_file_lists_every_problem(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("precision: [fp32, fp8]\nbatch_size: [8]\noptim: [adamw]\ndataloader_num_workers: [-1]\n")
    code = main(["run", "--space", str(bad), "--storage", f"sqlite:///{tmp_path / 'a.db'}"])
    err = capsys.readouterr().err
    assert code == 2
    for fragment in ("4 problem(s)", "'fp8'", "batch_size: unknown parameter (did you mean per_device_train_batch_size?)", "'adamw'", "-1"):
        assert fragment in err


def test_resume_with_other_settings_is_refused_without_touching_the_study(tmp_path, capsys) -> None:
    from autotune.api import RunOptions, open_study, plan_run

    storage = f"sqlite:///{tmp_path / 'a.db'}"
    open_study(plan_run(RunOptions(model="tiny-gptneox", space="quick", seq_len=32, device="cpu", storage=storage, study="s")))
    code = main(["run", "--model", "tiny-gptneox", "--space", "default", "--seq-len", "32", "--device", "cpu",
                 "--storage", storage, "--study", "s"])
    assert code == 2
    assert "different space" in capsys.readouterr().err
    assert optuna.load_study(study_name="s", storage=storage).user_attrs["autotune"]["space"]["name"] == "quick"


def test_help_lists_examples(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "autotune run --model polyglot-ko-1.3b --budget 30m" in capsys.readouterr().out


def test_help_imports_neither_the_search_nor_the_data_libraries() -> None:
    # --help is read often: building the parser must not import optuna, pandas, numpy or torch (a second each).
    code = ("import sys\nfrom autotune.cli import main\n"
            "for argv in (['--help'], ['run', '--help'], ['worker', '--help'], ['estimate', '--help'], ['replay', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('optuna', 'pandas', 'numpy', 'torch', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_debug_is_accepted_after_the_subcommand_too(capsys) -> None:
    from autotune.errors import ModelNotFound

    assert main(["run", "--model", "no-such-model", "--device", "cpu"]) == 2  # one line, no traceback
    assert capsys.readouterr().err.startswith("autotune: error: unknown model")
    for argv in (["--debug", "run", "--model", "no-such-model"], ["run", "--debug", "--model", "no-such-model"]):
        with pytest.raises(ModelNotFound):
            main([*argv, "--device", "cpu"])


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly(tmp_path) -> None:
    """`autotune estimate ... | head -3`: the reader goes away; no BrokenPipeError traceback."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"  # stdout whose reader is gone
        "from autotune.cli import main\n"
        "sys.exit(main(['estimate', '--model', 'tiny-gptneox', '--seq-len', '64']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 141 and done.stderr == ""


@pytest.mark.slow
def test_a_run_whose_reader_goes_away_stops_as_on_ctrl_c_and_exits_141(tmp_path) -> None:
    """`autotune run ... | head -4`: the run stops at its next line, keeps what it measured, writes its report, exits 141."""
    import subprocess
    import sys

    import optuna

    storage = f"sqlite:///{tmp_path / 'a.db'}"
    command = [sys.executable, "-m", "autotune", "run", "--model", "tiny-gptneox", "--space", "quick", "--seq-len", "32",
               "--device", "cpu", "--n-trials", "6", "--storage", storage, "--study", "s", "--report-dir", str(tmp_path / "reports")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stderr is not None
    head = [process.stdout.readline() for _ in range(4)]  # the header, then "trial 0 starts" (not a terminal)
    process.stdout.close()  # what head does after its lines
    assert process.wait(timeout=300) == 141, process.stderr.read()[-2000:]
    assert head[0].startswith("autotune tiny-gptneox") and head[3].startswith("trial   0 starts") and process.stderr.read() == ""
    trials = optuna.load_study(study_name="s", storage=storage).trials
    assert trials and all(t.state.is_finished() for t in trials)  # nothing left RUNNING
    assert any(t.user_attrs.get("status") == "ok" for t in trials)
    assert (tmp_path / "reports" / "s.html").is_file()


def test_a_default_name_that_clashes_starts_its_own_study(tmp_path) -> None:
    """Without --study, a run with another space gets a study of its own (and finds it again next time);
    the first study is left as it was."""
    from autotune.api import RunOptions, open_study, plan_run

    storage = f"sqlite:///{tmp_path / 'a.db'}"
    common = dict(model="tiny-gptneox", seq_len=32, device="cpu", storage=storage)
    first = plan_run(RunOptions(space="quick", **common))
    assert first.study_name == "tiny-gptneox-seq32-cpu"
    open_study(first)
    other = plan_run(RunOptions(space="default", **common))
    assert other.study_name.startswith("tiny-gptneox-seq32-cpu-") and other.study_name != first.study_name
    open_study(other)
    assert plan_run(RunOptions(space="default", **common)).study_name == other.study_name  # resumes its own
    assert plan_run(RunOptions(space="quick", **common)).study_name == first.study_name
    assert optuna.load_study(study_name=first.study_name, storage=storage).user_attrs["autotune"]["space"]["name"] == "quick"


def test_tune_writes_nothing_in_the_current_directory_and_is_silent_when_asked(tmp_path, monkeypatch, capsys, fake_gpu) -> None:
    import autotune
    from tests.conftest import FakeEvaluator

    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("AUTOTUNE_HOME", str(home))
    result = autotune.tune("tiny-gptneox", budget=None, n_trials=2, space="quick", device=fake_gpu, seq_len=64,
                           evaluator=FakeEvaluator(), command="test", verbose=False)
    assert list(work.iterdir()) == []  # nothing beside the notebook or script
    assert result.storage == f"sqlite:///{home / 'autotune.db'}"
    assert (home / "reports" / f"{result.study_name}.html").is_file()
    assert capsys.readouterr().out == ""
    autotune.tune("tiny-gptneox", budget=None, n_trials=1, space="quick", device=fake_gpu, seq_len=64,
                  evaluator=FakeEvaluator(), command="test", study="loud")
    out = capsys.readouterr().out
    assert "trial   0 (baseline)" in out and "Top configurations" in out and "report: " in out


def test_the_recorded_command_hides_a_storage_password() -> None:
    from autotune.cli import recorded_command

    command = recorded_command(["run", "--storage", "postgresql://tuner:s3cret@db/autotune", "--budget", "30m"])
    assert "s3cret" not in command and "tuner" in command and "--budget 30m" in command
    assert "s3cret" not in recorded_command(["run", "--storage=postgresql://tuner:s3cret@db/autotune"])


def test_spaces_lists_every_knob_with_its_values(capsys) -> None:
    import re

    from autotune.params import PARAM_NAMES

    assert main(["spaces"]) == 0
    out = capsys.readouterr().out
    default = out.split("\nquick")[0]
    assert default.startswith("default    175,104 configurations")
    for name in PARAM_NAMES:
        assert re.search(rf"^  {name} ", default, re.M), name
    assert re.search(r"^  precision +fp32, tf32, fp16, bf16$", default, re.M)
    assert re.search(r"^  use_liger_kernel +false, true$", default, re.M)
    assert re.search(r"^  torch_empty_cache_steps +null  \(fixed\)$", default, re.M)
    assert re.search(r"^  dataloader_pin_memory +true  \(fixed\)$", default, re.M)


def test_python_dash_m_autotune_is_the_command() -> None:
    """``python -m autotune`` runs the CLI from a checkout that is not installed (a GPU image)."""
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: autotune run" in done.stdout and "--budget" in done.stdout
