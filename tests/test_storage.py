"""Storages other than the default SQLite file: a real PostgreSQL server, Optuna's journal file, and
Optuna storage objects given to ``tune()``; what a missing database driver answers."""

from __future__ import annotations

import json
import sys

import optuna
import pytest

import autotune
from autotune.cli import main
from autotune.errors import UsageError
from autotune.storage import as_cli_option, describe, to_optuna
from tests.conftest import FakeEvaluator


def _tune(storage, fake_gpu, tmp_path, n_trials: int, study: str = "s"):
    return autotune.tune("tiny-gptneox", budget=None, n_trials=n_trials, space="quick", device=fake_gpu, seq_len=64,
                         storage=storage, study=study, evaluator=FakeEvaluator(), report_dir=tmp_path / "reports",
                         command="test", verbose=False)


def _create_resume_list_report_export(storage: str, fake_gpu, tmp_path, capsys) -> None:
    """The whole life of a study through ``storage``: created, resumed, listed, reported, exported."""
    first = _tune(storage, fake_gpu, tmp_path, n_trials=2)
    assert first.storage == storage and len(first.trials) >= 2
    first_numbers = set(first.trials["trial"])
    second = _tune(storage, fake_gpu, tmp_path, n_trials=2)  # the same study resumes: old trials kept, new ones added
    assert first_numbers < set(second.trials["trial"])
    study = optuna.load_study(study_name="s", storage=to_optuna(storage, write=False))
    assert [run["n_trials"] for run in study.user_attrs["autotune"]["runs"]] == [2, 2]
    assert "RUNNING" not in {t.state.name for t in study.trials}
    capsys.readouterr()

    assert main(["list", "--storage", storage]) == 0
    listed = capsys.readouterr().out
    assert listed.splitlines()[1].startswith("s ") and f"{second.best['samples_per_s']:,.1f}" in listed

    html = tmp_path / "again.html"
    assert main(["report", "s", "--storage", storage, "-o", str(html)]) == 0
    page = html.read_text(encoding="utf-8")
    assert f"study &#39;s&#39; in {describe(storage)}" in page or f"study 's' in {describe(storage)}" in page
    capsys.readouterr()

    assert main(["export", "s", "--storage", storage]) == 0
    assert json.loads(capsys.readouterr().out) == second.best_json()


@pytest.mark.slow
def test_a_study_lives_in_postgresql(postgres_database, fake_gpu, tmp_path, capsys) -> None:
    from sqlalchemy.engine import make_url

    assert make_url(postgres_database).get_dialect().driver == "psycopg"  # a bare postgresql:// is psycopg 3 in SQLAlchemy 2.1
    _create_resume_list_report_export(postgres_database, fake_gpu, tmp_path, capsys)


def test_a_study_lives_in_a_journal_file(tmp_path, fake_gpu, capsys) -> None:
    storage = f"journal:///{tmp_path / 'study.log'}"  # an absolute path: journal:////tmp/...
    assert storage.startswith("journal:////")
    _create_resume_list_report_export(storage, fake_gpu, tmp_path, capsys)
    assert (tmp_path / "study.log").stat().st_size > 0
    assert not (tmp_path / "autotune.db").exists()


def test_a_relative_journal_path_is_relative_to_the_current_folder(tmp_path, fake_gpu, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = _tune("journal:///runs.log", fake_gpu, tmp_path, n_trials=1)
    assert result.best is not None and (tmp_path / "runs.log").is_file()


def test_tune_takes_an_optuna_storage_object_and_reports_it_readably(tmp_path, fake_gpu) -> None:
    from optuna.storages import InMemoryStorage, JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from autotune.report.html import write_report

    path = tmp_path / "object.log"
    storage = JournalStorage(JournalFileBackend(str(path)))
    result = _tune(storage, fake_gpu, tmp_path, n_trials=2)
    assert result.storage is storage and result.best is not None
    assert describe(storage) == f"journal:///{path}" == as_cli_option(storage)
    page = (tmp_path / "reports" / "s.html").read_text(encoding="utf-8")
    assert f"journal:///{path}" in page and "JournalStorage object at" not in page
    # The file it wrote is a journal the CLI reads by name.
    assert autotune.load_result("s", f"journal:///{path}").best_params == result.best_params

    memory = InMemoryStorage()
    in_memory = _tune(memory, fake_gpu, tmp_path, n_trials=1, study="m")
    assert describe(memory) == "an in-memory Optuna storage" and as_cli_option(memory) is None
    report = write_report(in_memory, tmp_path / "m.html").read_text(encoding="utf-8")
    assert "an in-memory Optuna storage" in report


def test_passwords_are_not_shown() -> None:
    assert describe("postgresql://tuner:s3cret@db.example/studies") == "postgresql://tuner:***@db.example/studies"
    assert describe("sqlite:///autotune.db") == "sqlite:///autotune.db"


@pytest.mark.parametrize(
    ("storage", "module", "fix"),
    [
        ("postgresql://tuner@127.0.0.1:1/studies", "psycopg", "pip install 'autotune[postgres]'"),
        ("postgresql+psycopg://tuner@127.0.0.1:1/studies", "psycopg", "pip install 'autotune[postgres]'"),
        ("mysql+pymysql://tuner@127.0.0.1:1/studies", "pymysql", "pip install 'autotune[mysql]'"),
        ("mysql://tuner@127.0.0.1:1/studies", "MySQLdb", "pip install 'autotune[mysql]'"),
    ],
)
@pytest.mark.parametrize("command", ["run", "list", "report"])
def test_a_missing_driver_names_the_extra_to_install(storage, module, fix, command, monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails, as where the driver is not installed
    monkeypatch.chdir(tmp_path)
    argv = {"run": ["run", "--device", "cpu", "--space", "quick", "--study", "x"], "list": ["list"], "report": ["report", "x"]}[command]
    assert main([*argv, "--storage", storage]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotune: error: cannot open storage ") and "driver" in err and fix in err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # no report, no database, nothing


def test_the_driver_check_is_the_api_s_too(monkeypatch, fake_gpu, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(UsageError, match=r"autotune\[postgres\]"):
        _tune("postgresql://tuner@127.0.0.1:1/studies", fake_gpu, tmp_path, n_trials=1)


def test_a_database_a_killed_writer_left_with_a_hot_journal_is_recovered_not_refused(tmp_path) -> None:
    """A writer killed mid-commit leaves `a.db-journal`: SQLite rolls it back on the first read-write open, and
    the study is whole as before that commit (it was refused as "damaged")."""
    import subprocess

    from autotune import storage as storage_lib

    path = tmp_path / "a.db"
    url = f"sqlite:///{path}"
    study = optuna.create_study(study_name="s", storage=url)
    for value in range(3):
        trial = study.ask()
        study.tell(trial, float(value))
    writer = (
        "import os, sqlite3\n"
        f"db = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
        "db.execute('PRAGMA cache_size=1'); db.execute('BEGIN'); db.execute('CREATE TABLE junk(x)')\n"
        "for _ in range(2000): db.execute('INSERT INTO junk VALUES (?)', ('x' * 500,))\n"
        "os._exit(9)\n"  # killed mid-transaction, its pages already spilled into the database file
    )
    subprocess.run([sys.executable, "-c", writer], check=False)
    journal = tmp_path / "a.db-journal"
    assert journal.is_file() and journal.stat().st_size > 0
    storage_lib.check(url, write=True)
    assert not journal.exists()
    assert [t.value for t in optuna.load_study(study_name="s", storage=url).trials] == [0.0, 1.0, 2.0]
