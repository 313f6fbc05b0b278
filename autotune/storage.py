"""Storage strings: what Optuna takes, checked before anything is written, and shown without secrets.

``--storage`` (and ``tune(storage=...)``) is one of:

* an SQLAlchemy URL that Optuna's ``RDBStorage`` opens: ``sqlite:///autotune.db`` (a path relative to
  the current directory; four slashes for an absolute one), ``postgresql://user@host/db`` (psycopg 3,
  ``pip install 'autotune[postgres]'``), ``mysql+pymysql://user@host/db`` (``pip install 'autotune[mysql]'``);
* ``journal:///study.log`` (relative) or ``journal:////abs/study.log``: Optuna's ``JournalStorage``
  with a ``JournalFileBackend``, one append-only file that several processes on one machine, or on
  an NFS share, can use without a database server;
* in the Python API, an Optuna storage object (``JournalStorage``, ``RDBStorage``, ``InMemoryStorage``).

:func:`to_optuna` is the one place a storage string becomes what Optuna takes; :func:`check` runs
first and turns every storage that cannot work (a missing driver, a corrupt or read-only file, a
folder that does not exist) into a one-line :class:`~autotune.errors.UsageError` naming the fix,
before anything is created or written. :func:`describe` is what messages, the console and the
report show (passwords hidden).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any

import autotune.defaults as defaults
from autotune.errors import UsageError

DEFAULT_STORAGE = defaults.STORAGE
JOURNAL_PREFIX = "journal:///"
EXAMPLES = "sqlite:///autotune.db, postgresql://user@host/db or journal:///autotune.log"

_SQLITE_HEADER = b"SQLite format 3\x00"
_OPTUNA_TABLES = {"studies", "version_info"}
# (backend, driver) -> the install line when the driver cannot be imported. A bare postgresql://
# is psycopg 3 in SQLAlchemy 2.1 (the driver autotune's extra installs); a bare mysql:// is mysqlclient.
_DRIVER_FIXES = {
    ("postgresql", "psycopg"): "pip install 'autotune[postgres]'",
    ("postgresql", "psycopg2"): "pip install psycopg2-binary, or write postgresql://... (psycopg 3) and pip install 'autotune[postgres]'",
    ("mysql", "pymysql"): "pip install 'autotune[mysql]'",
    ("mysql", "mysqldb"): "write mysql+pymysql://... and pip install 'autotune[mysql]' (or pip install mysqlclient for mysql://)",
}
_DRIVER_NAMES = {"postgresql": "PostgreSQL", "mysql": "MySQL"}


def describe(storage: Any) -> str:
    """A readable, password-free description of a storage string or Optuna storage object."""
    if isinstance(storage, str):
        if storage.startswith("journal:"):
            return storage
        return _hide_password(storage)
    from optuna.storages import InMemoryStorage, JournalStorage, RDBStorage

    inner = getattr(storage, "_backend", None)
    if isinstance(storage, JournalStorage) or type(storage).__name__ == "_CachedStorage":
        if isinstance(inner, RDBStorage):
            return _hide_password(inner.url)
        path = getattr(inner, "_file_path", None)
        if path is not None:
            return JOURNAL_PREFIX + str(path)
        return f"JournalStorage({type(inner).__name__})"
    if isinstance(storage, RDBStorage):
        return _hide_password(storage.url)
    if isinstance(storage, InMemoryStorage):
        return "an in-memory Optuna storage"
    return f"an Optuna {type(storage).__name__}"


def as_cli_option(storage: Any) -> str | None:
    """What ``--storage`` takes to reach ``storage`` again (None: an object the CLI cannot name)."""
    described = describe(storage)
    return None if described.startswith(("an ", "JournalStorage(")) else described


def _hide_password(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL: shown as given (it names no password SQLAlchemy can find)
        return url
    return parsed.render_as_string(hide_password=True) if parsed.password else url


def _error(storage: Any, problem: str, fix: str) -> UsageError:
    return UsageError(f"cannot open storage {describe(storage)!r}: {problem}: {fix}")


def journal_path(storage: str) -> Path:
    """The file of ``journal:///path`` (relative) or ``journal:////abs/path``.

    Raises:
        UsageError: for a journal URL without a file.
    """
    if not storage.startswith(JOURNAL_PREFIX) or not storage[len(JOURNAL_PREFIX):]:
        raise _error(storage, "a journal storage names a file",
                     "write e.g. journal:///study.log (relative to the current folder) or journal:////abs/path/study.log")
    return Path(storage[len(JOURNAL_PREFIX):])


def sqlite_path(storage: str) -> Path | None:
    """The database file of an ``sqlite://`` URL, or None for any other storage (or an in-memory one)."""
    if not storage.startswith("sqlite:"):
        return None
    url = _parse_url(storage)
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:") or url.query.get("mode") == "memory":
        return None
    return Path(database)


def file_of(storage: Any) -> Path | None:
    """The file an SQLite or journal storage string lives in (None: a server, memory, or an object)."""
    if not isinstance(storage, str):
        return None
    return journal_path(storage) if storage.startswith("journal:") else sqlite_path(storage)


def exists(storage: Any) -> bool:
    """Whether anything can be stored there yet: False only for an SQLite or journal file that does not exist."""
    path = file_of(storage)
    return path is None or path.exists()


def check(storage: Any, *, write: bool) -> None:
    """Everything that can be known about ``storage`` without creating or changing anything.

    ``write``: the caller will create or change studies (``autotune run``); otherwise a missing file
    is an error (``report``, ``export``, ``list`` read what a run left).

    Raises:
        UsageError: a malformed URL, a database kind without its driver, a file that is not a
            database or journal, a missing file (reading), a read-only file or a missing or
            read-only folder (writing); each names the fix.
    """
    if not isinstance(storage, str):
        from optuna.storages import BaseStorage

        if not isinstance(storage, BaseStorage):
            raise UsageError(f"storage {storage!r} is neither a URL nor an Optuna storage: use e.g. {EXAMPLES}")
        return
    if storage.startswith("journal:"):
        _check_file(storage, journal_path(storage), write, _check_journal_content, "journal")
        return
    url = _parse_url(storage)
    _check_driver(storage, url)
    path = sqlite_path(storage)
    if path is not None:
        _check_file(storage, path, write, _check_sqlite_content, "database")


def to_optuna(storage: Any, *, write: bool) -> Any:
    """What Optuna's ``storage=`` takes: the URL string, a ``JournalStorage`` for ``journal:///``, or the object given.

    Checks first (:func:`check`); nothing is created unless ``write``.

    Raises:
        UsageError: as :func:`check`.
    """
    check(storage, write=write)
    if isinstance(storage, str) and storage.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(str(journal_path(storage))))
    return storage


def _parse_url(storage: str) -> Any:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(storage)
    except (ArgumentError, ValueError):
        raise UsageError(f"cannot open storage {storage!r}: it is not a storage URL: use e.g. {EXAMPLES}") from None


def _check_driver(storage: str, url: Any) -> None:
    """The database kind is one SQLAlchemy knows, and its Python driver imports."""
    try:
        dialect = url.get_dialect()
    except Exception:  # noqa: BLE001 - sqlalchemy.exc.NoSuchModuleError, or a dialect that fails to load
        raise _error(storage, f"unknown database kind {url.drivername!r}", f"use e.g. {EXAMPLES}") from None
    try:
        dialect.import_dbapi()
    except ImportError:
        backend, driver = url.get_backend_name(), url.get_driver_name()
        fix = _DRIVER_FIXES.get((backend, driver), f"install the Python package of the {driver} driver")
        kind = _DRIVER_NAMES.get(backend, backend)
        raise _error(storage, f"the {kind} driver {driver} is not installed", fix) from None


def _check_file(storage: str, path: Path, write: bool, check_content: Any, what: str) -> None:
    shown = str(path)
    if path.is_dir():
        raise _error(storage, f"{shown} is a folder, not a {what} file", f"name a file in it, e.g. {shown.rstrip('/')}/autotune.db")
    if not path.exists():
        if not write:
            raise UsageError(f"no {what} file {shown} (from --storage {describe(storage)}): pass the --storage that `autotune run` used")
        _check_folder(storage, path, what)
        return
    if not os.access(path, os.R_OK):
        raise _error(storage, f"{what} file {shown} is not readable", f"make it readable (chmod u+r {shown}) or pass another --storage")
    check_content(storage, path)
    if write:
        if not os.access(path, os.W_OK):
            raise _error(storage, f"{what} file {shown} is read-only",
                         f"make it writable (chmod u+w {shown}), or copy it and pass the copy's --storage")
        _check_folder(storage, path, what)


def _check_folder(storage: str, path: Path, what: str) -> None:
    folder = path.parent
    shown = str(folder) if str(folder) not in ("", ".") else "."
    if not folder.exists():
        raise _error(storage, f"folder {shown} does not exist", f"create it (mkdir -p {shown}) or pass a --storage in an existing folder")
    if not folder.is_dir():
        raise _error(storage, f"{shown} is not a folder", "pass a --storage whose file is in a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        beside = "its journal" if what == "database" else "its lock"
        raise _error(storage, f"folder {shown} is read-only (the {what} and {beside} are written there)",
                     f"make it writable (chmod u+w {shown}) or pass a --storage in a writable folder")


def _check_sqlite_content(storage: str, path: Path) -> None:
    """An existing file is an SQLite database of Optuna's (or an empty one), read without writing."""
    with open(path, "rb") as handle:
        header = handle.read(len(_SQLITE_HEADER))
    if not header:
        return  # an empty file: SQLite makes it a database
    move = f"pass another --storage file, or move {path} away"
    if header != _SQLITE_HEADER:
        raise _error(storage, f"{path} is not an SQLite database (it does not start with the SQLite header; corrupt or another kind of file)", move)
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    query = "select name from sqlite_master where type='table'"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            tables = {row[0] for row in db.execute(query)}
    except sqlite3.DatabaseError as exc:
        hot = Path(f"{path}-journal")
        if not (hot.is_file() and hot.stat().st_size):
            raise _error(storage, f"{path} is a damaged SQLite database ({exc})", move) from None
        # A hot rollback journal: a writer was killed mid-commit. A read-only connection cannot roll it back; the
        # first read-write one does (SQLite's own recovery), and the database is whole again as before that commit.
        try:
            with contextlib.closing(sqlite3.connect(str(path))) as db:
                tables = {row[0] for row in db.execute(query)}
        except sqlite3.DatabaseError as again:
            raise _error(storage, f"{path} has an unfinished commit in {hot.name} that SQLite could not roll back ({again})",
                         f"make {path.parent} writable so that SQLite can recover it, or {move}") from None
    if tables and not tables & _OPTUNA_TABLES:
        shown = ", ".join(sorted(tables)[:5])
        raise _error(storage, f"{path} is an SQLite database of something else (tables {shown}), not an Optuna storage", move)


def _check_journal_content(storage: str, path: Path) -> None:
    """An existing journal file is empty or starts with an Optuna journal record (one JSON object per line).

    Optuna never writes a blank line, and its reader fails on one, so a blank first line is not a journal.
    """
    with open(path, "rb") as handle:
        first = handle.readline(1 << 20)
    if not first:
        return
    try:
        record = json.loads(first.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError
        record = None
    if not isinstance(record, dict) or "op_code" not in record:
        raise _error(storage, f"{path} is not an Optuna journal file (its first line is not a journal record)",
                     f"pass another --storage file, or move {path} away")

