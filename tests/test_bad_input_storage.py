"""Bad storages and bad input: each is one line on stderr, exit 2, names the fix, and changes nothing.

Storages: a study plain Optuna made, a corrupt SQLite file, an SQLite database of something else, a
corrupt journal, a read-only database, a missing or read-only folder. Input: a binary --dataset,
--device cuda:x, an empty or row-less replay table, an unknown --attn, and a value that starts with
'-' (--budget -5m).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autotune.cli import attach_dash_values, build_parser, main
from tests.conftest import skip_or_fail

REPO = Path(__file__).resolve().parent.parent
RUN = ["run", "--model", "tiny-gptneox", "--seq-len", "32", "--device", "cpu", "--space", "quick", "--n-trials", "1"]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line_error(capsys, code: int, *fragments: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("autotune: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def _plain_optuna_study(path: Path, name: str = "plain") -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=f"sqlite:///{path}")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)


# ---------------------------------------------------------------------------------------- a study plain Optuna made


def test_a_plain_optuna_study_is_refused_by_run_report_and_export_and_marked_in_list(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "plain.db"
    _plain_optuna_study(db)
    before = _digest(db)
    storage = f"sqlite:///{db}"

    _one_line_error(capsys, main([*RUN, "--storage", storage, "--study", "plain"]),
                    "study 'plain'", "was not made by autotune", "3 trials", "--study NEW_NAME")
    for command in ("report", "export"):
        _one_line_error(capsys, main([command, "plain", "--storage", storage]), "study 'plain'", "was not made by autotune")
    assert _digest(db) == before  # no attribute written, no RUNNING trial left
    study = optuna.load_study(study_name="plain", storage=storage)
    assert study.user_attrs == {} and {t.state.name for t in study.trials} == {"COMPLETE"}
    assert not (tmp_path / "reports").exists()

    assert main(["list", "--storage", storage]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.startswith("plain ") and "not made by autotune" in row and " 3 " in row


def test_report_of_a_plain_study_names_autotune_s_own(tmp_path, capsys, fake_gpu) -> None:
    import autotune
    from tests.conftest import FakeEvaluator

    storage = f"sqlite:///{tmp_path / 'mixed.db'}"
    _plain_optuna_study(tmp_path / "mixed.db")
    autotune.tune("tiny-gptneox", budget=None, n_trials=1, space="quick", device=fake_gpu, seq_len=64, storage=storage,
                  study="ours", evaluator=FakeEvaluator(), report_dir=None, command="test", verbose=False)
    _one_line_error(capsys, main(["export", "plain", "--storage", storage]), "not made by autotune", "(ours)")
    assert main(["list", "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "not made by autotune" in out and "ours " in out


def test_without_study_a_plain_study_of_the_default_name_is_left_alone(tmp_path, fake_gpu) -> None:
    """The default name taken by a plain study: the run gets a study of its own (name + hash)."""
    import autotune
    from tests.conftest import FakeEvaluator

    db = tmp_path / "a.db"
    _plain_optuna_study(db, name="tiny-gptneox-seq64-cuda")
    before = optuna.load_study(study_name="tiny-gptneox-seq64-cuda", storage=f"sqlite:///{db}")
    result = autotune.tune("tiny-gptneox", budget=None, n_trials=1, space="quick", device=fake_gpu, seq_len=64,
                           storage=f"sqlite:///{db}", evaluator=FakeEvaluator(), report_dir=None, command="test", verbose=False)
    assert result.study_name.startswith("tiny-gptneox-seq64-cuda-")
    after = optuna.load_study(study_name="tiny-gptneox-seq64-cuda", storage=f"sqlite:///{db}")
    assert after.user_attrs == before.user_attrs == {} and len(after.trials) == 3


def test_an_empty_study_made_by_optuna_create_study_is_adopted(tmp_path, fake_gpu) -> None:
    import autotune
    from tests.conftest import FakeEvaluator

    storage = f"sqlite:///{tmp_path / 'a.db'}"
    optuna.create_study(study_name="made", storage=storage, direction="maximize")
    result = autotune.tune("tiny-gptneox", budget=None, n_trials=1, space="quick", device=fake_gpu, seq_len=64,
                           storage=storage, study="made", evaluator=FakeEvaluator(), report_dir=None, command="test", verbose=False)
    assert result.best is not None and "autotune" in optuna.load_study(study_name="made", storage=storage).user_attrs


def test_an_empty_minimising_study_is_refused(tmp_path, capsys) -> None:
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    optuna.create_study(study_name="loss", storage=storage, direction="minimize")
    _one_line_error(capsys, main([*RUN, "--storage", storage, "--study", "loss"]), "was not made by autotune", "0 trials")
    assert optuna.load_study(study_name="loss", storage=storage).user_attrs == {}


# ---------------------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("command", ["run", "report", "export", "list"])
def test_a_corrupt_sqlite_file_is_one_line_and_untouched(tmp_path, capsys, monkeypatch, command) -> None:
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "corrupt.db"
    db.write_bytes(random.Random(2).randbytes(8192))
    before = _digest(db)
    argv = {"run": [*RUN, "--study", "s"], "report": ["report", "s"], "export": ["export", "s"], "list": ["list"]}[command]
    _one_line_error(capsys, main([*argv, "--storage", f"sqlite:///{db}"]), "is not an SQLite database", "move", "another --storage")
    assert _digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.db"]  # no journal, no report


def test_a_damaged_sqlite_database_is_one_line(tmp_path, capsys) -> None:
    """A valid header over damaged pages: SQLite itself says the file is not a database."""
    db = tmp_path / "damaged.db"
    db.write_bytes(b"SQLite format 3\x00" + random.Random(3).randbytes(4096))
    before = _digest(db)
    for argv in ([*RUN, "--study", "s"], ["list"]):
        _one_line_error(capsys, main([*argv, "--storage", f"sqlite:///{db}"]), "damaged SQLite database")
    assert _digest(db) == before


def test_an_sqlite_database_of_something_else_is_not_written_into(tmp_path, capsys) -> None:
    db = tmp_path / "app.db"
    with sqlite3.connect(db) as connection:
        connection.execute("create table invoices (id integer primary key, total real)")
    before = _digest(db)
    for argv in ([*RUN, "--study", "s"], ["list"]):
        _one_line_error(capsys, main([*argv, "--storage", f"sqlite:///{db}"]), "database of something else", "invoices")
    assert _digest(db) == before


@pytest.mark.parametrize("content", [random.Random(0).randbytes(4096), b"\n" + random.Random(1).randbytes(4096),
                                     b"hello\nworld\n", b'{"not": "a journal record"}\n', b"\n", b"  \n\n"])
@pytest.mark.parametrize("command", ["run", "list"])
def test_a_corrupt_journal_is_one_line_and_untouched(tmp_path, capsys, content, command) -> None:
    log = tmp_path / "study.log"
    log.write_bytes(content)
    argv = [*RUN, "--study", "s"] if command == "run" else ["list"]
    _one_line_error(capsys, main([*argv, "--storage", f"journal:///{log}"]), "is not an Optuna journal file")
    assert log.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.log"]  # no lock file left either


def test_an_empty_journal_file_is_a_journal_with_no_studies(tmp_path, capsys) -> None:
    log = tmp_path / "study.log"
    log.touch()
    assert main(["list", "--storage", f"journal:///{log}"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("no studies in ")
    assert log.read_bytes() == b""


@pytest.mark.parametrize("storage", ["sqlite:///{dir}/missing/a.db", "journal:///{dir}/missing/a.log"])
def test_a_folder_that_does_not_exist(tmp_path, capsys, storage) -> None:
    storage = storage.format(dir=tmp_path)
    _one_line_error(capsys, main([*RUN, "--study", "s", "--storage", storage]),
                    f"folder {tmp_path / 'missing'} does not exist", f"mkdir -p {tmp_path / 'missing'}")
    _one_line_error(capsys, main(["list", "--storage", storage]), "no ", "pass the --storage that `autotune run` used")
    assert not (tmp_path / "missing").exists()


def test_a_folder_for_a_database_file(tmp_path, capsys) -> None:
    _one_line_error(capsys, main([*RUN, "--study", "s", "--storage", f"sqlite:///{tmp_path}"]), "is a folder, not a database file")


@pytest.mark.parametrize("storage", ["nosuchdb://x", "journal:/x.log", "journal:///", "not a url"])
def test_a_malformed_storage_is_one_line(tmp_path, capsys, monkeypatch, storage) -> None:
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, main([*RUN, "--study", "s", "--storage", storage]), "cannot open storage", "e.g.")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------- permissions


def _without_root_powers() -> list[str]:
    """A command prefix under which file permissions apply: as root, drop the capabilities that bypass
    them (setpriv, util-linux); root still owns the test's files, so it keeps reading them."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        skip_or_fail("setpriv (util-linux) is missing: as root it is how the read-only tests make permissions apply")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner,-linux_immutable", "--"]


def _cli(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*_without_root_powers(), sys.executable, "-m", "autotune.cli", *argv],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)


@pytest.mark.slow
def test_a_read_only_database_is_read_but_not_written(tmp_path, fake_gpu) -> None:
    import autotune
    from tests.conftest import FakeEvaluator

    db = tmp_path / "ro.db"
    autotune.tune("tiny-gptneox", budget=None, n_trials=1, space="quick", device="cpu", seq_len=32, storage=f"sqlite:///{db}",
                  study="s", evaluator=FakeEvaluator(), report_dir=None, command="test", verbose=False)
    db.chmod(0o444)
    before = _digest(db)
    try:
        done = _cli(tmp_path, *RUN, "--study", "s", "--storage", f"sqlite:///{db}")
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("autotune: error: ") and done.stderr.count("\n") == 1
        assert f"database file {db} is read-only" in done.stderr and f"chmod u+w {db}" in done.stderr
        listed = _cli(tmp_path, "list", "--storage", f"sqlite:///{db}")  # reading needs no write access
        assert listed.returncode == 0 and listed.stdout.splitlines()[1].startswith("s "), listed.stderr
    finally:
        db.chmod(0o644)
    assert _digest(db) == before


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite:///{dir}/ro/a.db", "journal:///{dir}/ro/a.log"])
def test_a_read_only_folder(tmp_path, kind) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        done = _cli(tmp_path, *RUN, "--study", "s", "--storage", kind.format(dir=tmp_path))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("autotune: error: ") and done.stderr.count("\n") == 1
        assert f"folder {folder} is read-only" in done.stderr and f"chmod u+w {folder}" in done.stderr
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)


# ---------------------------------------------------------------------------------------- other bad input


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("garbage.jsonl", b"\x93\x01\x00\xff" * 500, "is a binary file, not text"),
        ("garbage.txt", random.Random(4).randbytes(2048).replace(b"\x00", b"\x01") + b"\xff\xfe", "is not UTF-8 text"),
        ("garbage.csv", b"text\n" + b"\xc3\x28 caf\xe9\n" * 10, "is not UTF-8 text (line 2"),
        ("garbage.parquet", random.Random(5).randbytes(2048), "is not a readable Parquet file"),
    ],
)
def test_a_binary_dataset_is_one_line(tmp_path, capsys, name, content, expected) -> None:
    dataset = tmp_path / name
    dataset.write_bytes(content)
    _one_line_error(capsys, main([*RUN, "--dataset", str(dataset), "--tokenizer", str(tmp_path), "--storage", f"sqlite:///{tmp_path / 'a.db'}"]),
                    expected, "give a")
    assert not (tmp_path / "a.db").exists()


def test_a_utf8_bom_is_not_part_of_the_first_column(tmp_path) -> None:
    from autotune.data import read_texts

    path = tmp_path / "bom.csv"
    path.write_bytes("\ufefftext\nhello\n".encode())
    assert read_texts(path) == ["hello"]


@pytest.mark.parametrize(("device", "expected"), [("cuda:x", "after cuda: comes a GPU number"), ("cuda:1.5", "e.g. cuda:0"),
                                                  ("gpu", "use auto, cuda, cuda:N or cpu"), ("cuda:\u0663", "GPU number")])
def test_a_bad_device_is_one_line(tmp_path, capsys, device, expected) -> None:
    _one_line_error(capsys, main([*RUN, "--device", device, "--storage", f"sqlite:///{tmp_path / 'a.db'}"]), expected)
    assert not (tmp_path / "a.db").exists()


def test_a_device_that_is_not_a_string_is_a_usage_error(fake_gpu) -> None:
    from autotune.errors import DeviceError
    from autotune.probe.device import detect_device

    with pytest.raises(DeviceError, match="is not a device name"):
        detect_device(0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "is empty: write a CSV with a header row"),
        (b"per_device_train_batch_size,gradient_accumulation_steps,precision,optim,torch_compile,attn_implementation,"
         b"dataloader_num_workers,gradient_checkpointing,status,samples_per_s,peak_mem_bytes,probe_s\n", "has a header but no rows"),
        (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03garbage", "cannot read replay table"),
    ],
)
def test_a_replay_table_without_rows_is_one_line(tmp_path, capsys, content, expected) -> None:
    table = tmp_path / ("t.csv.gz" if content.startswith(b"\x1f\x8b") else "t.csv")
    table.write_bytes(content)
    _one_line_error(capsys, main(["replay", str(table)]), expected)
    assert capsys.readouterr().out == ""  # not "nothing fits"


@pytest.mark.parametrize(("attn", "expected"), [("foo", "use one of eager, sdpa"), ("flash_attention2", "did you mean flash_attention_2?")])
def test_estimate_refuses_an_unknown_attention(capsys, attn, expected) -> None:
    _one_line_error(capsys, main(["estimate", "--model", "tiny-gptneox", "--seq-len", "64", "--attn", attn]),
                    f"--attn {attn!r} is not an attention implementation", expected)


def test_estimate_takes_every_known_attention(capsys) -> None:
    from autotune.params import ATTN_IMPLEMENTATIONS

    for attn in ATTN_IMPLEMENTATIONS:
        assert main(["estimate", "--model", "tiny-gptneox", "--seq-len", "64", "--attn", attn, "--json"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--budget", "-5m"], "duration '-5m' must be positive"),
        (["--trial-timeout", "-1m"], "duration '-1m' must be positive"),
        (["--memory-ceiling", "-4GiB"], "memory size '-4GiB' must be positive"),
        (["--n-trials", "-3"], "--n-trials must be positive"),
    ],
)
def test_a_value_starting_with_a_dash_reaches_its_parser(tmp_path, capsys, argv, expected) -> None:
    _one_line_error(capsys, main([*RUN[:-2], *argv, "--storage", f"sqlite:///{tmp_path / 'a.db'}"]), expected)
    assert not (tmp_path / "a.db").exists()


def test_dash_values_are_attached_only_to_options_that_take_a_value() -> None:
    parser = build_parser()
    assert attach_dash_values(parser, ["run", "--budget", "-5m", "-o", "-x.json"]) == ["run", "--budget=-5m", "-o-x.json"]
    assert attach_dash_values(parser, ["run", "--study", "--storage", "x"]) == ["run", "--study", "--storage", "x"]  # a forgotten value
    assert attach_dash_values(parser, ["estimate", "--json", "--attn", "-1"]) == ["estimate", "--json", "--attn=-1"]
    assert attach_dash_values(parser, ["run", "--study", "run", "--budget", "5m"]) == ["run", "--study", "run", "--budget", "5m"]
    assert attach_dash_values(parser, ["replay", "--", "-table.csv"]) == ["replay", "--", "-table.csv"]


@pytest.mark.parametrize(("keywords", "named"), [
    ({"n_trials": "5"}, "option n_trials='5' is a str: give int or None"),
    ({"budget": [30]}, "option budget=[30] is a list: give str or float or None"),
    ({"seed": True}, "option seed=True is a bool: give int"),
    ({"gpus": ["a"]}, "option gpus=['a'] is a list"),
])
def test_an_api_option_of_the_wrong_type_is_one_line_naming_it(keywords, named) -> None:
    import autotune
    from autotune.errors import UsageError

    with pytest.raises(UsageError) as info:
        autotune.tune(model="tiny-gptneox", device="cpu", **keywords)
    assert str(info.value).startswith(named) and "\n" not in str(info.value)


def test_during_a_run_only_the_storages_own_errors_become_a_storage_failure(tmp_path) -> None:
    import json as json_lib

    from autotune.errors import StorageFailed
    from autotune.studies import opening

    url = f"sqlite:///{tmp_path / 'a.db'}"
    for error in (optuna.exceptions.StorageInternalError("commit"), OSError(30, "Read-only file system"), sqlite3.OperationalError("locked"),
                  json_lib.JSONDecodeError("torn", "{", 1)):
        with pytest.raises(StorageFailed, match="failed during the run"), opening.storage_errors(url, during_run=True):
            raise error
    with pytest.raises(ValueError, match="a bug"), opening.storage_errors(url, during_run=True):
        raise ValueError("a bug")  # the search's own error is shown as it is, not blamed on the storage
