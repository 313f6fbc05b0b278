"""Opening a study: the storage's errors in one line, creating or resuming a study whose settings agree, study
names, the run log."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import re
import sqlite3
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

import autotune.storage as storage_lib
from autotune.errors import StorageFailed, UsageError
from autotune.storage import DEFAULT_STORAGE
from autotune.studies.schema import METRIC_NAME, STUDY_ATTR
from autotune.studies.settings import RunLog, StudySettings
from autotune.units import GiB

# A study's identity: a resumed study must agree on these settings (the memory ceiling may change; the device is
# checked by name, and by memory for a GPU).
IDENTITY_KEYS = ("model_config_sha1", "seq_len", "space", "effective_batch_size", "dataset", "peft", "trainer", "baseline", "nproc_per_probe")
# What a study made before a key existed measured: its value then (a study without ``nproc_per_probe`` ran one process per
# probe). StudySettings reads a missing key as the same (tests/test_study_settings.py holds them equal).
IDENTITY_DEFAULTS: dict[str, Any] = {"nproc_per_probe": 1}



@contextlib.contextmanager
def storage_errors(storage: Any, *, during_run: bool = False) -> Iterator[None]:
    """Turn an unusable storage, an unreachable server or a damaged file met while Optuna works into a
    one-line :class:`UsageError` (most are caught before, by :func:`autotune.storage.check`); ``during_run``:
    into :class:`StorageFailed` (the run stops, what it stored is kept), for the storage's own errors only."""
    shown = storage_lib.describe(storage)
    try:
        yield
    except Exception as exc:
        found = _storage_failure(exc, during_run=during_run)
        if found is None:
            raise
        kind, cause = found
        if during_run:
            raise StorageFailed(f"the storage {shown!r} failed during the run ({cause}): the trials it stored before are kept; "
                                "fix it (a writable file and folder, free disk, the server running) and run the same command "
                                "to resume") from None
        if kind == "open":
            raise UsageError(f"cannot open storage {shown!r} ({cause}): use e.g. {storage_lib.EXAMPLES}") from None
        if kind == "write":
            raise UsageError(f"cannot write to storage {shown!r} ({cause}): check that its file and folder are writable") from None
        raise UsageError(f"cannot open storage {shown!r} ({cause}): check that the server is running and the host, port, user "
                         "and database in the URL, or use e.g. " + DEFAULT_STORAGE) from None


def _storage_failure(exc: BaseException, *, during_run: bool) -> tuple[str, str] | None:
    """What kind of storage failure ``exc`` is (``open``, ``write``, ``server``) and its cause in one line; None when
    it is not the storage's. Opening, a ValueError or ImportError is a bad URL or a damaged journal line; during a run
    only a damaged journal line is (another ValueError is a bug to show), and so are the files' OSError and sqlite3's."""
    if isinstance(exc, optuna.exceptions.StorageInternalError):  # a commit failed: a read-only database, a full disk
        return "write", _first_line(exc.__cause__) if exc.__cause__ is not None else _first_line(exc)
    if type(exc).__module__.startswith("sqlalchemy"):  # its own tree for bad URLs, unreachable servers, damaged files
        return "server", f"{type(exc).__name__}: {_first_line(getattr(exc, 'orig', None) or exc)}"
    if during_run:
        if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError, OSError, sqlite3.Error)):  # a journal file removed...
            return "open", f"{type(exc).__name__}: {_first_line(exc)}"
        return None
    if isinstance(exc, (ValueError, ImportError)):  # a damaged journal line is a UnicodeDecodeError or JSONDecodeError
        return "open", _first_line(exc)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line[:200]


def _summaries(storage: Any) -> list[optuna.study.StudySummary]:
    """Every study's summary (name, user attributes, trial count); ``storage`` as :func:`storage_lib.to_optuna` gives it."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with storage_errors(storage):
        return optuna.get_all_study_summaries(storage, include_best_trial=False)


def study_names(storage: Any) -> list[str]:
    """The study names in ``storage``; nothing is created.

    Raises:
        UsageError: if the storage is unusable, or names an SQLite or journal file that does not exist.
    """
    return [s.study_name for s in _summaries(storage_lib.to_optuna(storage, write=False))]


@dataclass(frozen=True)
class StoredStudy:
    """A study in a storage: its name, whether autotune made it (it holds the settings), its trial count."""

    name: str
    ours: bool
    n_trials: int


def stored_studies(storage: Any) -> list[StoredStudy]:
    """Every study in ``storage``, autotune's or not; nothing is created.

    Raises:
        UsageError: as :func:`study_names`.
    """
    return [StoredStudy(s.study_name, STUDY_ATTR in s.user_attrs, s.n_trials) for s in _summaries(storage_lib.to_optuna(storage, write=False))]


def foreign_error(study_name: str, storage: Any, n_trials: int, *, others: Sequence[str] = ()) -> UsageError:
    """The one-line answer for a study that plain Optuna (or another tool) made: autotune neither reads nor writes it."""
    shown = storage_lib.describe(storage)
    trials = f"{n_trials} trial{'s' if n_trials != 1 else ''}"
    where = f"name one of autotune's studies ({', '.join(others)})" if others else "pass --study NEW_NAME for a study of autotune's own"
    return UsageError(
        f"study {study_name!r} in {shown} was not made by autotune (it has {trials} and no {STUDY_ATTR!r} settings): "
        f"{where}, or open it with optuna-dashboard"
    )


def load_existing(study_name: str, storage: Any) -> optuna.Study:
    """An existing study that autotune made, for read-only use (``report``, ``export``, ``list``): never creates one.

    Raises:
        UsageError: bad storage, no such study (the message lists the ones there are), or a study
            that autotune did not make.
    """
    opened = storage_lib.to_optuna(storage, write=False)
    summaries = _summaries(opened)
    summary = next((s for s in summaries if s.study_name == study_name), None)
    ours = [s.study_name for s in summaries if STUDY_ATTR in s.user_attrs]
    if summary is None:
        names = [s.study_name for s in summaries]
        raise UsageError(
            f"no study {study_name!r} in {storage_lib.describe(storage)}: use one of {', '.join(names) or '(none yet)'} "
            "or run `autotune run` first"
        )
    if STUDY_ATTR not in summary.user_attrs:
        raise foreign_error(study_name, storage, summary.n_trials, others=ours)
    with storage_errors(storage):
        return optuna.load_study(study_name=study_name, storage=opened)


def settings_of(study: optuna.Study) -> dict[str, Any]:
    """The run's settings stored with the study, as stored (empty for a study autotune did not make); the run log too."""
    return dict(study.user_attrs.get(STUDY_ATTR, {}))


def study_settings(study: optuna.Study) -> StudySettings:
    """The run's settings stored with the study, read (:meth:`StudySettings.from_dict`)."""
    return StudySettings.from_dict(settings_of(study))


def open_or_create(
    storage: Any,
    study_name: str,
    settings: dict[str, Any],
    *,
    sampler: optuna.samplers.BaseSampler,
    must_match: Sequence[str] = IDENTITY_KEYS,
    budget_s: float | None,
    n_trials: int | None,
) -> optuna.Study:
    """Create the study with ``settings``, or resume it when its stored settings agree on ``must_match``.

    The memory ceiling may change between runs (the stored one is updated); this run is appended
    to the run log either way. Everything is checked before anything is written: the storage
    (:func:`autotune.storage.check`: driver, file, folder), and an existing study of that name must
    be autotune's (an empty maximising one, as ``optuna create-study`` leaves it, is adopted).

    Raises:
        UsageError: if the storage is unusable, the existing study was made for another setup, or by
            another tool.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opened = storage_lib.to_optuna(storage, write=True)
    summary = next((s for s in _summaries(opened) if s.study_name == study_name), None)
    if summary is not None and STUDY_ATTR not in summary.user_attrs and (
        summary.n_trials or summary.directions != [optuna.study.StudyDirection.MAXIMIZE]
    ):
        raise foreign_error(study_name, storage, summary.n_trials)
    with storage_errors(storage):
        study = optuna.create_study(
            study_name=study_name, storage=opened, direction="maximize", sampler=sampler, load_if_exists=True
        )
    existing = study.user_attrs.get(STUDY_ATTR)
    if existing is not None:
        clash = mismatch(existing, settings, must_match)
        if clash is not None:
            raise UsageError(f"study {study_name!r} {clash}: pass --study NEW_NAME to start a new one, or repeat the original options to resume it")
    ceiling = StudySettings.from_dict(settings).memory_ceiling_bytes
    with storage_errors(storage):
        if existing is None:
            study.set_user_attr(STUDY_ATTR, settings)
            with warnings.catch_warnings():  # "experimental" since Optuna 3.2, and what the dashboard reads
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names([METRIC_NAME])
        elif StudySettings.from_dict(existing).memory_ceiling_bytes != ceiling:
            study.set_user_attr(STUDY_ATTR, {**existing, "memory_ceiling_bytes": ceiling})
        _log_run(study, budget_s, n_trials)
    return study


def config_hash(config: dict[str, Any]) -> str:
    """A short hash of a model's config (``model_config_sha1``): two studies of different configs never resume each other."""
    return hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def default_study_name(model: str, seq_len: int, device_kind: str, effective_batch_size: int | None, peft: Any = None,
                       nproc_per_probe: int = 1) -> str:
    """``<model>-seq<N>-<cpu|cuda>[x<procs>][-ebs<N>][-lora-r<N>]``: what a run without ``--study`` is called."""
    name = Path(model).name if Path(model).is_dir() else model.replace("/", "--")
    suffix = f"x{nproc_per_probe}" if nproc_per_probe > 1 else ""
    suffix += f"-ebs{effective_batch_size}" if effective_batch_size else ""
    if peft is not None:  # a LoraSettings: the rank is in the name, other adapter settings in the hash if they clash
        suffix += f"-{peft.method}-r{peft.r}"
    return f"{name}-seq{seq_len}-{device_kind}{suffix}"


def own_study_name(storage: Any, study_name: str, settings: dict[str, Any]) -> str:
    """``study_name``, or, when a study of that name was made for other settings (another space, dataset, effective
    batch, model config or device: :data:`IDENTITY_KEYS`), that name with a short hash of ``settings``' identity: a run
    with other settings starts its own study instead of failing (an explicit ``--study`` that clashes still fails), and
    the same command finds the same study again."""
    existing = existing_settings(storage, study_name)
    if existing is None or mismatch(existing, settings) is None:
        return study_name
    identity = {key: settings[key] for key in IDENTITY_KEYS} | {"device": StudySettings.from_dict(settings).device["name"]}
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return f"{study_name}-{digest}"


def mismatch(existing: dict[str, Any], settings: dict[str, Any], must_match: Sequence[str] = IDENTITY_KEYS) -> str | None:
    """Why a study with ``existing`` settings cannot take a run with ``settings`` (None: it can resume)."""
    for key in must_match:
        before, now = existing.get(key, IDENTITY_DEFAULTS.get(key)), settings.get(key, IDENTITY_DEFAULTS.get(key))
        if before != now:
            if isinstance(before, dict) and isinstance(now, dict):  # name the part that differs (the trainer's inputs, ...)
                parts = [k for k in sorted({*before, *now}) if before.get(k) != now.get(k)]
                detail = "; ".join(f"{k}: {_brief(before.get(k))} then, {_brief(now.get(k))} now" for k in parts[:2])
                return f"was made with a different {key.replace('_sha1', '')} ({detail})"
            return f"was made with a different {key.replace('_sha1', '')}"
    before, now = StudySettings.from_dict(existing).device, StudySettings.from_dict(settings).device
    if before.get("name") != now.get("name"):
        return f"was measured on {before.get('name')}, not {now.get('name')}"
    memory_before, memory_now = before.get("total_memory_bytes"), now.get("total_memory_bytes")
    if before.get("kind") == "cuda" and memory_before and memory_now and memory_before != memory_now:
        return f"was measured on a {memory_before / GiB:.1f} GiB {before.get('name')}, not a {memory_now / GiB:.1f} GiB one"
    return None


STUDY_NAME_MAX_CHARS = 128
_STUDY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*")


def check_study_name(name: str, flag: str = "--study") -> str:
    """A study name a user gives: a name, never a path (it names the report file too).

    Raises:
        UsageError: empty, too long, or holding anything but letters, digits, ``.``, ``_``, ``+`` and ``-``
            (a ``/`` or ``..`` would put the report outside ``--report-dir``).
    """
    if not name or len(name) > STUDY_NAME_MAX_CHARS or not _STUDY_NAME.fullmatch(name) or ".." in name:
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise UsageError(f"{flag} {shown!r} is not a study name: use letters, digits, '.', '_', '+' and '-' "
                         f"(at most {STUDY_NAME_MAX_CHARS}, not starting with '.', '-' or '+'), e.g. {flag} my-run")
    return name


def report_file_name(study_name: str) -> str:
    """``<study>.html`` with anything that is not a plain name character replaced: a report stays in its folder."""
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", study_name).lstrip(".") or "study"
    return f"{safe[:STUDY_NAME_MAX_CHARS]}.html"


def _brief(value: Any, chars: int = 80) -> str:
    text = " ".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else json.dumps(value, default=str)
    return text if len(text) <= chars else text[: chars - 3] + "..."


def existing_settings(storage: Any, study_name: str) -> dict[str, Any] | None:
    """The stored settings of study ``study_name`` (empty for a study autotune did not make), or
    None when there is no such study. Nothing is created, not even an SQLite or journal file; the
    storage is checked as for a run (:func:`autotune.storage.check` with ``write``), so a storage a
    run cannot use fails here, while the run is still being planned.

    Raises:
        UsageError: a storage that a run cannot use.
    """
    storage_lib.check(storage, write=True)
    if not storage_lib.exists(storage):
        return None
    summary = next((s for s in _summaries(storage_lib.to_optuna(storage, write=False)) if s.study_name == study_name), None)
    return None if summary is None else dict(summary.user_attrs.get(STUDY_ATTR, {}))


def _log_run(study: optuna.Study, budget_s: float | None, n_trials: int | None) -> None:
    """Append this invocation to the study's run log; ``budget_s`` is the total over all runs."""
    attrs = settings_of(study)
    runs = [*RunLog.from_dict(attrs).runs, {
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "n_trials": n_trials,
        "stopped_because": None,
    }]
    budgets = [run["budget_s"] for run in runs if run["budget_s"]]
    study.set_user_attr(STUDY_ATTR, {**attrs, "runs": runs, "budget_s": sum(budgets) if budgets else None})


def record_stop(study: optuna.Study, stopped_because: str) -> None:
    """Note why the latest run stopped (for reports regenerated later)."""
    attrs = settings_of(study)
    runs = list(RunLog.from_dict(attrs).runs)
    if runs:
        runs[-1] = {**runs[-1], "stopped_because": stopped_because}
        study.set_user_attr(STUDY_ATTR, {**attrs, "runs": runs})


def last_stop(settings: dict[str, Any]) -> str | None:
    """Why the latest run of a study stopped, from its run log."""
    return RunLog.from_dict(settings).stopped_because
