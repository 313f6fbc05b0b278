"""The storage: how an autotune study lives in an Optuna storage, and every call that touches it.

A study holds the run's settings in one study user attribute (:data:`STUDY_ATTR`: model, device,
space, memory ceiling, the run log) and, per trial, the user attributes named ``ATTR_*`` below: the
full :class:`~autotune.params.TrialParams`, the :class:`~autotune.records.ProbeResult`, its status,
and why it ended as it did. Everything a result, a table or a report shows is rebuilt from these,
so they are a schema: add to it, never rename.

Optuna offers no public way to set an attribute on a finished trial, or to add a RUNNING trial and
get its id back; the few private calls that do (``study._storage``, ``trial._trial_id``) are made
here and nowhere else, as Optuna itself keeps its heartbeat calls inside ``storages/``.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import re
import socket
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

import autotune.storage as storage_lib
from autotune.errors import StorageFailed, UsageError
from autotune.params import TrialParams
from autotune.records import Probe, ProbeResult, ProbeStatus
from autotune.storage import DEFAULT_STORAGE as DEFAULT_STORAGE  # re-exported: the CLI, the API and the report read it here
from autotune.units import GiB

STUDY_ATTR = "autotune"  # study user attribute holding the run's settings (model, device, space, run log)

# Trial user attributes.
ATTR_PARAMS = "params"  # full TrialParams dict (accumulation included when derived)
ATTR_RESULT = "result"  # ProbeResult.to_dict()
ATTR_STATUS = "status"  # a ProbeStatus value
ATTR_REASON = "reason"  # why it was pruned, failed or is over the ceiling
ATTR_ROLE = "role"  # ROLE_BASELINE for the trial of transformers' defaults
ATTR_DUPLICATE_OF = "duplicate_of"  # not run: a measured configuration's outcome repeated, or the trial holding it (see hold)
ATTR_REMEASURE_OF = "remeasure_of"  # a near-tie probed again: the number of the configuration's first trial
ATTR_OWNER = "owner"  # "host:pid" of the run that asked the trial, to fail it if that run died
ATTR_PREDICTED_PEAK = "predicted_peak_mem_bytes"  # the memory model's prediction when the trial was asked
ATTR_REUSABLE = "reusable"  # False: a later run must not reuse this outcome (cut by the budget, interrupted, pruned)
ATTR_HEARTBEAT = "heartbeat_unix_s"  # while RUNNING: when its worker last said it is alive (time.time())
ATTR_DIED = "died"  # how the process running it died (killed, or its worker went silent): see retry_candidates
ATTR_RETRY_OF = "retry_of"  # probes again the configuration of this trial, whose process died
ATTR_REMEASURE_ROUND = "remeasure_round"  # a re-measure: which probe of the configuration it is (2, 3)
STUDY_DEADLINE_ATTR = "deadline_unix_s"  # study user attribute: when the workers' shared budget ends (time.time())
ROLE_BASELINE = "baseline"
ROLE_EXPERT = "expert"  # the expert rule's configuration (autotune.search.expert), measured early as a reference

CONSTRAINT_MEMORY = "memory"  # (peak - ceiling) / ceiling: feasible when <= 0
METRIC_NAME = "samples_per_s"  # the objective's name, as optuna-dashboard and Optuna's plots label it
# Scalar copies of what people sort and filter by, beside the full result (ATTR_RESULT, a JSON
# object that the dashboard can only show as text).
SCALAR_RESULT_ATTRS = ("samples_per_s", "tokens_per_s", "peak_mem_bytes", "mfu")
# Optuna 5 keeps each constraint under "constraints:<name>"; optuna-dashboard (0.21) and Optuna 4's
# plots read the list under "constraints". Both are written, so every reader sees the memory constraint.
_LEGACY_CONSTRAINTS_KEY = "constraints"
_OUTCOME_ATTRS = (ATTR_RESULT, ATTR_STATUS, ATTR_REASON, *SCALAR_RESULT_ATTRS)  # what a repeat copies from the original
_log = logging.getLogger(__name__)
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


# ---------------------------------------------------------------------------------------- opening


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
    """The run's settings stored with the study (empty for a study autotune did not make)."""
    return dict(study.user_attrs.get(STUDY_ATTR, {}))


def open_or_create(
    storage: Any,
    study_name: str,
    settings: dict[str, Any],
    *,
    sampler: optuna.samplers.BaseSampler,
    must_match: Sequence[str],
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
    with storage_errors(storage):
        if existing is None:
            study.set_user_attr(STUDY_ATTR, settings)
            with warnings.catch_warnings():  # "experimental" since Optuna 3.2, and what the dashboard reads
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names([METRIC_NAME])
        elif existing.get("memory_ceiling_bytes") != settings["memory_ceiling_bytes"]:
            study.set_user_attr(STUDY_ATTR, {**existing, "memory_ceiling_bytes": settings["memory_ceiling_bytes"]})
        _log_run(study, budget_s, n_trials)
    return study


def mismatch(existing: dict[str, Any], settings: dict[str, Any], must_match: Sequence[str]) -> str | None:
    """Why a study with ``existing`` settings cannot take a run with ``settings`` (None: it can resume)."""
    for key in must_match:
        before, now = existing.get(key), settings.get(key)
        if before != now:
            if isinstance(before, dict) and isinstance(now, dict):  # name the part that differs (the trainer's inputs, ...)
                parts = [k for k in sorted({*before, *now}) if before.get(k) != now.get(k)]
                detail = "; ".join(f"{k}: {_brief(before.get(k))} then, {_brief(now.get(k))} now" for k in parts[:2])
                return f"was made with a different {key.replace('_sha1', '')} ({detail})"
            return f"was made with a different {key.replace('_sha1', '')}"
    before, now = existing.get("device") or {}, settings.get("device") or {}
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
    runs = [*attrs.get("runs", []), {
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
    runs = attrs.get("runs") or []
    if runs:
        runs[-1] = {**runs[-1], "stopped_because": stopped_because}
        study.set_user_attr(STUDY_ATTR, {**attrs, "runs": runs})


def last_stop(settings: dict[str, Any]) -> str | None:
    """Why the latest run of a study stopped, from its run log."""
    return (settings.get("runs") or [{}])[-1].get("stopped_because")


# ---------------------------------------------------------------------------------------- reading
#
# Several workers (processes, machines) may search one study at once; the study is their only shared
# state. Each iteration a worker reads the trials once (read_trials) and derives from that list what
# it needs: the probes others finished (probes_in), their reusable outcomes (reusable_in), what is in
# flight (in_flight), dead trials (dead_trials) and configurations to probe again (retry_candidates).
#
# Claims. A configuration is claimed by a trial carrying its ATTR_PARAMS: a strategy's proposal is
# created with them in one storage call (claim), a sampler's trial gets them right after suggest
# (record_params). Trial creation is serialised per study on every Optuna storage (RDB: the study
# row is locked FOR UPDATE and SQLite has one writer; a journal: the log order), so trial numbers
# order the claims: the lowest-numbered live claim (RUNNING, or finished and reusable) of a
# configuration holds it (holder), and any other trial of it does not probe (hold). Re-measures
# (remeasure_of) are deliberate and claim (configuration, round) instead.
#
# Dead workers. Optuna's own heartbeat (RDBStorage(heartbeat_interval=...), fail_stale_trials,
# RetryFailedTrialCallback) exists only for RDB storages: JournalStorage implements no BaseHeartbeat
# (Optuna 5.0). So one mechanism of ours serves every storage, modelled on Optuna's: a worker
# refreshes ATTR_HEARTBEAT on its RUNNING trial while it probes (Heartbeat); any worker fails a
# RUNNING trial whose heartbeat (or start) is older than the grace, on any host, or whose owner
# process on this host is gone (fail_dead_trials); like RetryFailedTrialCallback's retry history,
# the configuration of a trial that died (so, or because its probe process was killed) is probed
# once more (retry_of) and a second death is final.

HEARTBEAT_INTERVAL_S = 10.0  # a probing worker refreshes its trial's heartbeat this often
HEARTBEAT_GRACE_S = 60.0  # a RUNNING trial with no heartbeat for this long has lost its worker
CLAIM_SETTLE_S = 2.0  # the longest a claim waits for an older trial that is still being given its configuration
# Results stored before ProbeResult.process_lost existed say it only in their error text (autotune.probe.isolation's).
_KILLED_PREFIXES = ("probe process killed by SIGKILL", "probe process killed by SIGTERM")


def read_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Every trial of the study, read once: what one iteration of the loop syncs from."""
    return study.get_trials(deepcopy=False)


def config_key(trial: FrozenTrial) -> tuple[Any, ...] | None:
    """The configuration a trial claims or measured (None while a sampler's trial has none yet)."""
    params = trial.user_attrs.get(ATTR_PARAMS)
    return TrialParams.from_dict(params).key() if params else None


def probes_in(trials: Sequence[FrozenTrial]) -> list[Probe]:
    """The finished trials that ran a probe (repeats, held and pruned trials excluded), oldest first."""
    probes = []
    for trial in sorted(trials, key=lambda t: t.number):
        attrs = trial.user_attrs
        if trial.state in _FINISHED and ATTR_RESULT in attrs and ATTR_PARAMS in attrs and ATTR_DUPLICATE_OF not in attrs:
            probes.append(Probe(trial.number, TrialParams.from_dict(attrs[ATTR_PARAMS]), ProbeResult.from_dict(attrs[ATTR_RESULT])))
    return probes


def stored_probes(study: optuna.Study) -> list[Probe]:
    """The finished trials that ran a probe (repeats and pruned trials excluded), oldest first."""
    return probes_in(study.get_trials(deepcopy=False, states=_FINISHED))


@dataclass(frozen=True)
class StoredOutcome:
    """The stored outcome of a configuration, enough to repeat it without re-running."""

    number: int
    state: TrialState
    value: float | None
    attrs: dict[str, Any]
    constraint: float | None


def _outcome(trial: FrozenTrial) -> StoredOutcome:
    attrs = {k: trial.user_attrs[k] for k in _OUTCOME_ATTRS if k in trial.user_attrs}
    value = trial.value if trial.state == TrialState.COMPLETE else None
    return StoredOutcome(trial.number, trial.state, value, attrs, trial.constraints.get(CONSTRAINT_MEMORY))


def _reusable(trial: FrozenTrial) -> bool:
    return trial.state in _FINISHED and ATTR_PARAMS in trial.user_attrs and trial.user_attrs.get(ATTR_REUSABLE) is not False


def reusable_in(trials: Sequence[FrozenTrial]) -> dict[tuple[Any, ...], StoredOutcome]:
    """Finished, reusable trials by configuration key, the oldest of each (interrupted, cut-short,
    pruned, held and first-death trials are not reusable)."""
    seen: dict[tuple[Any, ...], StoredOutcome] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        if _reusable(trial):
            seen.setdefault(TrialParams.from_dict(trial.user_attrs[ATTR_PARAMS]).key(), _outcome(trial))
    return seen


def reusable_outcomes(study: optuna.Study) -> dict[tuple[Any, ...], StoredOutcome]:
    """Finished, reusable trials by configuration key (interrupted or cut-short ones are not reusable)."""
    return reusable_in(study.get_trials(deepcopy=False, states=_FINISHED))


def pruned_in(trials: Sequence[FrozenTrial], from_number: int) -> dict[tuple[Any, ...], StoredOutcome]:
    """Configurations pruned (not run) by trials numbered ``from_number`` or later: decided during this run."""
    pruned: dict[tuple[Any, ...], StoredOutcome] = {}
    for trial in trials:
        if trial.number >= from_number and trial.state == TrialState.PRUNED and trial.user_attrs.get(ATTR_STATUS) == ProbeStatus.PRUNED.value:
            key = config_key(trial)
            if key is not None:
                pruned.setdefault(key, _outcome(trial))
    return pruned


def in_flight(trials: Sequence[FrozenTrial]) -> set[tuple[Any, ...]]:
    """The configurations of RUNNING trials (being probed, or about to be, somewhere)."""
    return {key for t in trials if t.state == TrialState.RUNNING and (key := config_key(t)) is not None}


def has_waiting(trials: Sequence[FrozenTrial]) -> bool:
    """Whether an enqueued trial is waiting to be asked (``enqueue_trial`` by hand, or an older autotune)."""
    return any(t.state == TrialState.WAITING for t in trials)


def _live(trial: FrozenTrial) -> bool:
    """It holds its configuration: queued, running, or finished with an outcome a later trial may reuse."""
    return trial.state in (TrialState.WAITING, TrialState.RUNNING) or _reusable(trial)


def baseline_settled(trials: Sequence[FrozenTrial]) -> bool:
    """A baseline trial is queued, running, or finished for good (one that never finished, was cut
    short, or whose process died for the first time is run again)."""
    return role_settled(trials, ROLE_BASELINE)


def role_settled(trials: Sequence[FrozenTrial], role: str) -> bool:
    """A trial of this role (:data:`ROLE_BASELINE`, :data:`ROLE_EXPERT`) is queued, running, or finished for good."""
    return any(t.user_attrs.get(ATTR_ROLE) == role and _live(t) for t in trials)


def has_baseline(study: optuna.Study) -> bool:
    """Whether the study's baseline is queued, running or finished for good (see :func:`baseline_settled`)."""
    return baseline_settled(study.get_trials(deepcopy=False))


def is_baseline(trial: optuna.Trial | FrozenTrial) -> bool:
    return trial.user_attrs.get(ATTR_ROLE) == ROLE_BASELINE


def killed(result: ProbeResult) -> bool:
    """The probe's process was killed from outside or lost with its server (:attr:`ProbeResult.process_lost`): that
    says nothing yet about the configuration, so it is probed once more."""
    return result.status is ProbeStatus.CRASH and (result.process_lost or (result.error or "").startswith(_KILLED_PREFIXES))


def first_death(trials: Sequence[FrozenTrial], key: tuple[Any, ...] | None, number: int) -> bool:
    """No trial of configuration ``key`` but trial ``number`` has died: it gets its one retry (not reusable)."""
    return key is None or not any(t.number != number and ATTR_DIED in t.user_attrs and config_key(t) == key for t in trials)


def retry_candidates(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that died once (killed, or their worker went silent), whose configuration nothing holds
    and no trial has retried yet: each is probed once more, oldest first."""
    retried = {t.user_attrs[ATTR_RETRY_OF] for t in trials if ATTR_RETRY_OF in t.user_attrs}
    held = {config_key(t) for t in trials if _claims(t)}
    return [
        t for t in sorted(trials, key=lambda t: t.number)
        if ATTR_DIED in t.user_attrs and t.user_attrs.get(ATTR_REUSABLE) is False and t.state.is_finished()
        and ATTR_REMEASURE_OF not in t.user_attrs and t.number not in retried
        and (key := config_key(t)) is not None and key not in held and first_death(trials, key, t.number)
    ]


def _claims(trial: FrozenTrial) -> bool:
    """A live claim of its configuration (re-measures and held trials claim nothing)."""
    attrs = trial.user_attrs
    return ATTR_PARAMS in attrs and ATTR_DUPLICATE_OF not in attrs and ATTR_REMEASURE_OF not in attrs and _live(trial)


def _popped(trial: FrozenTrial) -> bool:
    """Enqueued (enqueue_trial), then popped by a worker: its number is older than its claim."""
    return "fixed_params" in trial.system_attrs


def _death(trial: FrozenTrial, host: str, now_unix_s: float, grace_s: float) -> str | None:
    """Why a RUNNING trial has lost its worker, or None while it may still be alive."""
    owner_text = str(trial.user_attrs.get(ATTR_OWNER, ""))
    if owner_text == owner():
        return None
    owner_host, _, pid = owner_text.rpartition(":")
    if owner_host == host and pid.isdigit() and not psutil.pid_exists(int(pid)):
        return "interrupted: the run that started it is gone"
    last_s = trial.user_attrs.get(ATTR_HEARTBEAT)
    if last_s is None and trial.datetime_start is not None:
        last_s = trial.datetime_start.timestamp()  # naive local time (RDB and journal alike)
    if last_s is not None and now_unix_s - float(last_s) > grace_s:
        return f"its worker ({owner_text or 'unknown'}) sent no heartbeat for {now_unix_s - float(last_s):.0f} s"
    return None


def dead_trials(trials: Sequence[FrozenTrial], *, now_unix_s: float, grace_s: float) -> list[tuple[FrozenTrial, str]]:
    """RUNNING trials whose worker died, on any host (no heartbeat for ``grace_s``) or on this one
    (its process is gone), with why."""
    host = socket.gethostname()
    found = []
    for trial in trials:
        if trial.state == TrialState.RUNNING:
            cause = _death(trial, host, now_unix_s, grace_s)
            if cause is not None:
                found.append((trial, cause))
    return found


# ---------------------------------------------------------------------------------------- writing


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def ask(study: optuna.Study) -> optuna.Trial:
    """The sampler's next trial (an enqueued one first), marked as this run's and alive.

    It claims nothing until :func:`record_params` gives it its configuration (:func:`holder` waits
    for that, briefly).
    """
    with _queue_lock(study):
        trial = study.ask()
    trial.set_user_attr(ATTR_OWNER, owner())
    trial.set_user_attr(ATTR_HEARTBEAT, time.time())
    return trial


@contextlib.contextmanager
def _queue_lock(study: optuna.Study) -> Iterator[None]:
    """Serialise popping enqueued trials between the processes on one SQLite file.

    ``Study.ask`` pops an enqueued trial by reading it WAITING, then setting it RUNNING; the RDB
    storage locks its row ``FOR UPDATE`` in between, which SQLite ignores, and pysqlite begins the
    transaction only at the write: two processes could pop the same trial and both run it, and the
    slower one crashed on telling it (``UpdateFinishedTrialError: Trial#N has already finished``,
    ``ValueError: Cannot tell a PRUNED trial``: issue #12, 7 of 11 workers). Processes that share an
    SQLite file share a machine, so a lock file next to it makes the pop atomic. PostgreSQL locks
    the row; a journal's log order decides the pop. (The loop itself no longer enqueues: see :func:`claim`.)
    """
    backend = getattr(study._storage, "_backend", None)
    url = str(getattr(backend, "url", ""))
    path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else ""
    if not path or path == ":memory:" or path.startswith("file:"):
        yield
        return
    with open(f"{path}.autotune-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def claim(
    study: optuna.Study,
    params: TrialParams,
    optuna_params: dict[str, Any],
    distributions: dict[str, optuna.distributions.BaseDistribution],
    *,
    baseline: bool = False,
    role: str | None = None,
    retry_of: int | None = None,
) -> optuna.Trial:
    """A RUNNING trial of ``params`` that claims it from its creation: parameters, configuration,
    owner and heartbeat are set in the one storage call that numbers it.

    Not ``enqueue_trial`` + ``ask``: ``ask`` pops the oldest enqueued trial, which may be another
    worker's proposal, and it has no configuration until ``suggest``.
    """
    user_attrs: dict[str, Any] = {ATTR_PARAMS: params.to_dict(), ATTR_OWNER: owner(), ATTR_HEARTBEAT: time.time()}
    if baseline or role:
        user_attrs[ATTR_ROLE] = role or ROLE_BASELINE
    if retry_of is not None:
        user_attrs[ATTR_RETRY_OF] = retry_of
    template = optuna.trial.create_trial(
        state=TrialState.RUNNING, params=optuna_params, distributions=distributions, user_attrs=user_attrs
    )
    return optuna.Trial(study, study._storage.create_new_trial(study._study_id, template_trial=template))


def record_params(trial: optuna.Trial, params: TrialParams) -> None:
    """Give a sampler's trial its configuration: from now on it claims it."""
    if trial.user_attrs.get(ATTR_PARAMS) != params.to_dict():
        trial.set_user_attr(ATTR_PARAMS, params.to_dict())


def holder(study: optuna.Study, trial: optuna.Trial, *, settle_s: float = CLAIM_SETTLE_S, poll_s: float = 0.05) -> FrozenTrial | None:
    """The trial that holds ``trial``'s configuration if it is not ``trial`` itself; None: probe it.

    The lowest-numbered live claim holds a configuration. A trial popped from the queue claims only
    from when it was popped, so it yields to any other claim. An older RUNNING trial with no
    configuration yet (a sampler's, between ask and suggest) may turn out to claim the same one: the
    decision waits for it, ``settle_s`` at most (past that it is a worker that died in between, and
    the heartbeat grace will fail it).
    """
    me = trial.number
    mine = study._storage.get_trial(trial._trial_id)
    key = config_key(mine)
    popped = _popped(mine)
    wait_until_s = time.monotonic() + settle_s
    while True:
        trials = study.get_trials(deepcopy=False)
        rivals = [t for t in trials if t.number != me and _claims(t) and config_key(t) == key and (popped or t.number < me)]
        if rivals:
            return min(rivals, key=lambda t: t.number)
        unsettled = any(t.number < me and t.state == TrialState.RUNNING and ATTR_PARAMS not in t.user_attrs for t in trials)
        if not unsettled or time.monotonic() >= wait_until_s:
            return None
        time.sleep(poll_s)


def taken(study: optuna.Study, trial: optuna.Trial) -> bool:
    """``trial`` was finished behind its worker's back (another worker failed it as dead)."""
    return study._storage.get_trial(trial._trial_id).state.is_finished()


def hold(study: optuna.Study, trial: optuna.Trial, params: TrialParams, holding: FrozenTrial) -> None:
    """``trial`` does not probe: ``holding`` has its configuration. A finished holder's outcome is
    repeated (as :func:`record_repeat`); a running one is named in ``duplicate_of``, and the trial is
    told FAIL (which samplers ignore) without a status, result or reuse: it is neither a probe, nor
    an outcome, nor a failure to any reader, all of which leave ``duplicate_of`` trials out."""
    if holding.state.is_finished():
        record_repeat(study, trial, params, _outcome(holding))
        return
    with unless_taken(study, trial):
        trial.set_user_attr(ATTR_PARAMS, params.to_dict())
        trial.set_user_attr(ATTR_DUPLICATE_OF, holding.number)
        trial.set_user_attr(ATTR_REASON, f"not run: trial {holding.number} was already probing this configuration")
        trial.set_user_attr(ATTR_REUSABLE, False)
        study.tell(trial, state=TrialState.FAIL)


@contextlib.contextmanager
def unless_taken(study: optuna.Study, trial: optuna.Trial, *, dropped_warning: str | None = None) -> Iterator[None]:
    """Writes that record ``trial``'s outcome, given up where another worker failed it meanwhile as dead
    (this worker was alive but silent past the heartbeat grace, as on a loaded machine): it cannot be
    told again. ``dropped_warning``: logged then, where what is given up was measured (a repeat or a
    hold measured nothing). Any other error is raised."""
    try:
        yield
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
        if not taken(study, trial):
            raise
        if dropped_warning:
            _log.warning("%s", dropped_warning)


def _set_memory_constraint(study: optuna.Study, trial: optuna.Trial, value: float) -> None:
    trial.set_constraint(CONSTRAINT_MEMORY, value)
    study._storage.set_trial_system_attr(trial._trial_id, _LEGACY_CONSTRAINTS_KEY, [value])


def record_outcome(
    study: optuna.Study,
    trial: optuna.Trial,
    params: TrialParams,
    result: ProbeResult,
    ceiling_bytes: int,
    *,
    reusable: bool = True,
    died: bool = False,
) -> StoredOutcome:
    """Store ``result`` on the trial and tell Optuna the matching state; returns what was stored.

    ``ok`` -> COMPLETE with samples/s as the value and ``(peak - ceiling) / ceiling`` as the memory
    constraint (feasible when <= 0); ``oom`` -> PRUNED (constraint +1); ``timeout``, ``crash`` and
    ``diverged`` -> FAIL. ``died``: the probe's process was killed (:func:`killed`; ``ATTR_DIED``).
    """
    if died:
        trial.set_user_attr(ATTR_DIED, (result.error or "killed").splitlines()[0])
    record_params(trial, params)
    trial.set_user_attr(ATTR_RESULT, result.to_dict())
    trial.set_user_attr(ATTR_STATUS, result.status.value)
    for name in SCALAR_RESULT_ATTRS:
        value = getattr(result, name)
        if value is not None:
            trial.set_user_attr(name, value)
    if not reusable:
        trial.set_user_attr(ATTR_REUSABLE, False)
    reason = result.error
    if result.ok and not result.fits(ceiling_bytes):
        reason = f"peak memory {result.peak_mem_bytes} B is over the ceiling {ceiling_bytes} B"
    if reason:
        trial.set_user_attr(ATTR_REASON, reason[-2000:])
    value, constraint = None, None
    if result.ok:
        peak = result.peak_mem_bytes if result.peak_mem_bytes is not None else 0
        constraint = (peak - ceiling_bytes) / ceiling_bytes
        _set_memory_constraint(study, trial, constraint)
        state, value = TrialState.COMPLETE, result.samples_per_s
        study.tell(trial, value)
    elif result.status is ProbeStatus.OOM:
        constraint = 1.0
        _set_memory_constraint(study, trial, constraint)
        state = TrialState.PRUNED
        study.tell(trial, state=state)
    else:
        state = TrialState.FAIL
        study.tell(trial, state=state)
    attrs = {k: v for k, v in trial.user_attrs.items() if k in _OUTCOME_ATTRS}
    return StoredOutcome(trial.number, state, value, attrs, constraint)


def record_pruned(
    study: optuna.Study, trial: optuna.Trial, params: TrialParams, reason: str, predicted_bytes: int | None, ceiling_bytes: int
) -> StoredOutcome:
    """Tell ``trial`` PRUNED without running it: status ``pruned``, the reason, no probe time.

    Not reusable: a resumed run decides again, with what it knows by then.
    """
    trial.set_user_attr(ATTR_PARAMS, params.to_dict())
    trial.set_user_attr(ATTR_STATUS, ProbeStatus.PRUNED.value)
    trial.set_user_attr(ATTR_REASON, reason)
    trial.set_user_attr(ATTR_REUSABLE, False)
    constraint = max((predicted_bytes - ceiling_bytes) / ceiling_bytes, 1e-3) if predicted_bytes else 1.0
    _set_memory_constraint(study, trial, constraint)
    study.tell(trial, state=TrialState.PRUNED)
    attrs = {ATTR_STATUS: ProbeStatus.PRUNED.value, ATTR_REASON: reason}
    return StoredOutcome(trial.number, TrialState.PRUNED, None, attrs, constraint)


def record_predicted_peak(trial: optuna.Trial, predicted_bytes: int) -> None:
    trial.set_user_attr(ATTR_PREDICTED_PEAK, predicted_bytes)


def record_repeat(study: optuna.Study, trial: optuna.Trial, params: TrialParams, original: StoredOutcome) -> None:
    """Tell ``trial`` the outcome already measured for the same configuration, without running it."""
    with unless_taken(study, trial):
        trial.set_user_attr(ATTR_PARAMS, params.to_dict())
        trial.set_user_attr(ATTR_DUPLICATE_OF, original.number)
        for name, value in original.attrs.items():
            trial.set_user_attr(name, value)
        if original.constraint is not None:
            _set_memory_constraint(study, trial, original.constraint)
        if original.state == TrialState.COMPLETE:
            study.tell(trial, original.value)
        else:
            study.tell(trial, state=original.state)


def record_death(study: optuna.Study, trial: optuna.Trial, params: TrialParams, cause: str) -> None:
    """Fail a trial whose probe's process was killed, the first time for its configuration: no
    result, status or reuse (it measured nothing about it), ``ATTR_DIED``; it is probed once more."""
    trial.set_user_attr(ATTR_PARAMS, params.to_dict())
    trial.set_user_attr(ATTR_DIED, cause.splitlines()[0] if cause else "killed")
    trial.set_user_attr(ATTR_REASON, f"{cause[-2000:]}\n(its process was killed: the configuration is probed once more)")
    trial.set_user_attr(ATTR_REUSABLE, False)
    study.tell(trial, state=TrialState.FAIL)


def fail_interrupted(study: optuna.Study, trial: optuna.Trial) -> None:
    """Fail a trial whose probe was interrupted (Ctrl-C); not reusable."""
    try:
        release_unstarted(study, trial, "interrupted by the user")
    except (RuntimeError, ValueError):  # already told: the interrupt came after its outcome was stored
        pass


def release_unstarted(study: optuna.Study, trial: optuna.Trial, reason: str) -> None:
    """Fail a claimed trial whose probe did not run to an outcome (interrupted, or not started: it could not finish in
    the time left); not reusable, so a later run asks it again."""
    trial.set_user_attr(ATTR_REASON, reason)
    trial.set_user_attr(ATTR_REUSABLE, False)
    study.tell(trial, state=TrialState.FAIL)


def fail_dead_trials(
    study: optuna.Study, trials: Sequence[FrozenTrial], *, now_unix_s: float | None = None, grace_s: float = HEARTBEAT_GRACE_S
) -> list[int]:
    """Fail the RUNNING trials whose worker died (:func:`dead_trials`); returns their numbers.

    Each gets ``ATTR_DIED``; the first death of a configuration is not reusable, so it is retried
    once (:func:`retry_candidates`), and a second is final. Several workers may fail the same trial
    at once, and its worker may finish it after all: whoever tells first wins, the others move on.
    """
    now_unix_s = time.time() if now_unix_s is None else now_unix_s
    storage = study._storage
    failed = []
    for trial, cause in dead_trials(trials, now_unix_s=now_unix_s, grace_s=grace_s):
        try:
            storage.set_trial_user_attr(trial._trial_id, ATTR_REASON, cause)
            storage.set_trial_user_attr(trial._trial_id, ATTR_DIED, cause)
            if first_death(trials, config_key(trial), trial.number):
                storage.set_trial_user_attr(trial._trial_id, ATTR_REUSABLE, False)
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            continue
        failed.append(trial.number)
    return failed


def fail_orphaned_trials(study: optuna.Study) -> int:
    """Fail RUNNING trials whose run died (killed, or silent past the heartbeat grace); returns how many."""
    return len(fail_dead_trials(study, study.get_trials(deepcopy=False)))


class Heartbeat:
    """While a probe runs: a daemon thread refreshes its trial's ``ATTR_HEARTBEAT`` every ``interval_s``
    (a context manager), so that other workers, on any host, can tell it is alive (:func:`dead_trials`)."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._storage = study._storage
        self._trial_id = trial._trial_id
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"autotune-heartbeat-{trial.number}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=max(5.0, self._interval_s))

    def _beat(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._storage.set_trial_user_attr(self._trial_id, ATTR_HEARTBEAT, time.time())
            except optuna.exceptions.UpdateFinishedTrialError:
                return  # another worker failed it as dead: nothing left to keep alive
            except Exception:  # noqa: BLE001 - a busy or unreachable database: the next beat tries again
                continue


def record_deadline(study: optuna.Study, deadline_unix_s: float) -> None:
    """Store when the shared budget of this study's workers ends (``time.time()``), for workers that join later."""
    study.set_user_attr(STUDY_DEADLINE_ATTR, float(deadline_unix_s))


def deadline_unix_s(study: optuna.Study) -> float | None:
    """When the shared budget ends (``time.time()``), as :func:`record_deadline` stored it; None: no deadline."""
    value = study.user_attrs.get(STUDY_DEADLINE_ATTR)
    return float(value) if value is not None else None


def start_remeasure(study: optuna.Study, first_number: int, round_: int | None = None) -> optuna.Trial:
    """A RUNNING trial with the exact parameters of trial ``first_number`` and ``remeasure_of`` set;
    ``round_``: which probe of the configuration it is (2, 3), what :func:`remeasure_holder` decides on.

    Not ``enqueue_trial`` + ``ask``: ``ask`` takes the oldest waiting trial first, which may be another's.
    """
    storage = study._storage
    original = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(study._study_id, first_number))
    user_attrs: dict[str, Any] = {ATTR_REMEASURE_OF: first_number, ATTR_OWNER: owner(), ATTR_HEARTBEAT: time.time()}
    if round_ is not None:
        user_attrs[ATTR_REMEASURE_ROUND] = round_
    if ATTR_PARAMS in original.user_attrs:
        user_attrs[ATTR_PARAMS] = original.user_attrs[ATTR_PARAMS]
    template = optuna.trial.create_trial(
        state=TrialState.RUNNING,
        params=original.params,
        distributions=original.distributions,
        user_attrs=user_attrs,
    )
    # Study.add_trial returns no id; its storage call does.
    trial_id = storage.create_new_trial(study._study_id, template_trial=template)
    return optuna.Trial(study, trial_id)


def remeasure_holder(study: optuna.Study, trial: optuna.Trial) -> FrozenTrial | None:
    """The re-measure that holds ``trial``'s (configuration, round), if it is not ``trial``: the
    lowest-numbered one running or finished with a probe (two workers ending at once must not both
    probe a near-tie a second time)."""
    attrs = trial.user_attrs
    first, round_ = attrs.get(ATTR_REMEASURE_OF), attrs.get(ATTR_REMEASURE_ROUND)
    rivals = [
        t for t in study.get_trials(deepcopy=False)
        if t.number < trial.number and t.user_attrs.get(ATTR_REMEASURE_OF) == first and t.user_attrs.get(ATTR_REMEASURE_ROUND) == round_
        and ATTR_DUPLICATE_OF not in t.user_attrs and (t.state == TrialState.RUNNING or ATTR_RESULT in t.user_attrs)
    ]
    return min(rivals, key=lambda t: t.number) if rivals else None


# ---------------------------------------------------------------------------------------- recovery

ATTR_RECOVERED_FROM = "recovered_from"  # a result a probe finished after its run was killed: the trial it belonged to


def record_recovered(
    study: optuna.Study, trial_number: int, params: TrialParams, result: ProbeResult, ceiling_bytes: int
) -> int | None:
    """Store a result that the probe of trial ``trial_number`` finished after its run was killed.

    The dead run's trial is RUNNING (or already failed as orphaned), and Optuna cannot finish a
    trial twice, so the result becomes a new finished trial with the same parameters (and role),
    marked ``recovered_from``; a still-RUNNING original is failed. Returns the new trial's number,
    or None when there is nothing to do (the original finished after all, or it was recovered before).
    """
    storage = study._storage
    try:
        original = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(study._study_id, trial_number))
    except KeyError:
        return None
    if original.state == TrialState.COMPLETE or any(
        t.user_attrs.get(ATTR_RECOVERED_FROM) == trial_number for t in study.get_trials(deepcopy=False)
    ):
        return None
    user_attrs: dict[str, Any] = {ATTR_RECOVERED_FROM: trial_number, ATTR_OWNER: owner()}
    if ATTR_ROLE in original.user_attrs:
        user_attrs[ATTR_ROLE] = original.user_attrs[ATTR_ROLE]
    template = optuna.trial.create_trial(
        state=TrialState.RUNNING, params=original.params, distributions=original.distributions, user_attrs=user_attrs,
    )
    trial = optuna.Trial(study, storage.create_new_trial(study._study_id, template_trial=template))
    record_outcome(study, trial, params, result, ceiling_bytes)
    if original.state == TrialState.RUNNING:
        storage.set_trial_user_attr(original._trial_id, ATTR_REASON, f"its run was killed; the result is trial {trial.number}")
        storage.set_trial_user_attr(original._trial_id, ATTR_REUSABLE, False)
        study.tell(trial_number, state=TrialState.FAIL)
    return trial.number
