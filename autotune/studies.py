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
import os
import socket
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import UsageError
from autotune.params import TrialParams
from autotune.records import Probe, ProbeResult, ProbeStatus

DEFAULT_STORAGE = "sqlite:///autotune.db"
STUDY_ATTR = "autotune"  # study user attribute holding the run's settings (model, device, space, run log)

# Trial user attributes.
ATTR_PARAMS = "params"  # full TrialParams dict (accumulation included when derived)
ATTR_RESULT = "result"  # ProbeResult.to_dict()
ATTR_STATUS = "status"  # a ProbeStatus value
ATTR_REASON = "reason"  # why it was pruned, failed or is over the ceiling
ATTR_ROLE = "role"  # ROLE_BASELINE for the trial of transformers' defaults
ATTR_DUPLICATE_OF = "duplicate_of"  # the sampler proposed a measured configuration: its outcome repeated, not run
ATTR_REMEASURE_OF = "remeasure_of"  # a near-tie probed again: the number of the configuration's first trial
ATTR_OWNER = "owner"  # "host:pid" of the run that asked the trial, to fail it if that run died
ATTR_PREDICTED_PEAK = "predicted_peak_mem_bytes"  # the memory model's prediction when the trial was asked
ATTR_REUSABLE = "reusable"  # False: a later run must not reuse this outcome (cut by the budget, interrupted, pruned)
ROLE_BASELINE = "baseline"

CONSTRAINT_MEMORY = "memory"  # (peak - ceiling) / ceiling: feasible when <= 0
METRIC_NAME = "samples_per_s"  # the objective's name, as optuna-dashboard and Optuna's plots label it
# Scalar copies of what people sort and filter by, beside the full result (ATTR_RESULT, a JSON
# object that the dashboard can only show as text).
SCALAR_RESULT_ATTRS = ("samples_per_s", "tokens_per_s", "peak_mem_bytes", "mfu")
# Optuna 5 keeps each constraint under "constraints:<name>"; optuna-dashboard (0.21) and Optuna 4's
# plots read the list under "constraints". Both are written, so every reader sees the memory constraint.
_LEGACY_CONSTRAINTS_KEY = "constraints"
_OUTCOME_ATTRS = (ATTR_RESULT, ATTR_STATUS, ATTR_REASON, *SCALAR_RESULT_ATTRS)  # what a repeat copies from the original
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


# ---------------------------------------------------------------------------------------- opening


@contextlib.contextmanager
def storage_errors(storage: str) -> Iterator[None]:
    """Turn an unusable storage URL or an unreachable database into a one-line :class:`UsageError`."""
    try:
        yield
    except (ValueError, ImportError) as exc:
        raise UsageError(f"cannot open storage {storage!r} ({exc}): use e.g. {DEFAULT_STORAGE}") from None
    except Exception as exc:  # sqlalchemy raises its own tree for bad URLs and unreachable servers
        if type(exc).__module__.startswith("sqlalchemy"):
            raise UsageError(f"cannot open storage {storage!r} ({type(exc).__name__}): use e.g. {DEFAULT_STORAGE}") from None
        raise


def study_names(storage: str) -> list[str]:
    """The study names in ``storage``; nothing is created.

    Raises:
        UsageError: if the storage URL is unusable, or names an sqlite file that does not exist.
    """
    if storage.startswith("sqlite:///"):
        path = storage[len("sqlite:///"):]
        if path and path != ":memory:" and not Path(path).exists():
            raise UsageError(f"no database file {path} (from --storage {storage}): pass the --storage that `autotune run` used")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with storage_errors(storage):
        return [s.study_name for s in optuna.get_all_study_summaries(storage)]


def load_existing(study_name: str, storage: str) -> optuna.Study:
    """An existing study, read-only use (``report``, ``export``, ``list``): never creates one.

    Raises:
        UsageError: bad storage, or no such study (the message lists the ones there are).
    """
    names = study_names(storage)
    if study_name not in names:
        raise UsageError(
            f"no study {study_name!r} in {storage}: use one of {', '.join(names) or '(none yet)'} or run `autotune run` first"
        )
    with storage_errors(storage):
        return optuna.load_study(study_name=study_name, storage=storage)


def settings_of(study: optuna.Study) -> dict[str, Any]:
    """The run's settings stored with the study (empty for a study autotune did not make)."""
    return dict(study.user_attrs.get(STUDY_ATTR, {}))


def open_or_create(
    storage: str,
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
    to the run log either way.

    Raises:
        UsageError: if the storage is unusable or the existing study was made for another setup.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with storage_errors(storage):
        study = optuna.create_study(
            study_name=study_name, storage=storage, direction="maximize", sampler=sampler, load_if_exists=True
        )
    existing = study.user_attrs.get(STUDY_ATTR)
    if existing is not None:
        clash = mismatch(existing, settings, must_match)
        if clash is not None:
            raise UsageError(f"study {study_name!r} {clash}: pass --study NEW_NAME to start a new one, or repeat the original options to resume it")
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
        if existing.get(key) != settings.get(key):
            return f"was made with a different {key.replace('_sha1', '')}"
    measured_on, now_on = (existing.get("device") or {}).get("name"), (settings.get("device") or {}).get("name")
    if measured_on != now_on:
        return f"was measured on {measured_on}, not {now_on}"
    return None


def existing_settings(storage: str, study_name: str) -> dict[str, Any] | None:
    """The stored settings of study ``study_name`` (empty for a study autotune did not make), or
    None when there is no such study. Nothing is created, not even an SQLite file."""
    if storage.startswith("sqlite:///"):
        path = storage[len("sqlite:///"):]
        if path != ":memory:" and not Path(path).exists():
            return None
    if study_name not in study_names(storage):
        return None
    return settings_of(load_existing(study_name, storage))


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


def stored_probes(study: optuna.Study) -> list[Probe]:
    """The finished trials that ran a probe (repeats and pruned trials excluded), oldest first."""
    probes = []
    for trial in study.get_trials(deepcopy=False, states=_FINISHED):
        attrs = trial.user_attrs
        if ATTR_RESULT in attrs and ATTR_PARAMS in attrs and ATTR_DUPLICATE_OF not in attrs:
            probes.append(Probe(trial.number, TrialParams.from_dict(attrs[ATTR_PARAMS]), ProbeResult.from_dict(attrs[ATTR_RESULT])))
    return probes


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


def reusable_outcomes(study: optuna.Study) -> dict[tuple[Any, ...], StoredOutcome]:
    """Finished, reusable trials by configuration key (interrupted or cut-short ones are not reusable)."""
    seen: dict[tuple[Any, ...], StoredOutcome] = {}
    for trial in study.get_trials(deepcopy=False, states=_FINISHED):
        if ATTR_PARAMS not in trial.user_attrs or trial.user_attrs.get(ATTR_REUSABLE) is False:
            continue
        seen.setdefault(TrialParams.from_dict(trial.user_attrs[ATTR_PARAMS]).key(), _outcome(trial))
    return seen


def has_waiting(study: optuna.Study) -> bool:
    """Whether an enqueued trial is waiting to be asked (the baseline, a fresh point after a repeat)."""
    return any(True for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def has_baseline(study: optuna.Study) -> bool:
    return any(t.user_attrs.get(ATTR_ROLE) == ROLE_BASELINE for t in study.get_trials(deepcopy=False))


def is_baseline(trial: optuna.Trial | FrozenTrial) -> bool:
    return trial.user_attrs.get(ATTR_ROLE) == ROLE_BASELINE


# ---------------------------------------------------------------------------------------- writing


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def ask(study: optuna.Study) -> optuna.Trial:
    """The next trial (an enqueued one first), marked as this run's."""
    trial = study.ask()
    trial.set_user_attr(ATTR_OWNER, owner())
    return trial


def enqueue_baseline(study: optuna.Study, optuna_params: dict[str, Any]) -> None:
    study.enqueue_trial(optuna_params, user_attrs={ATTR_ROLE: ROLE_BASELINE}, skip_if_exists=True)


def _set_memory_constraint(study: optuna.Study, trial: optuna.Trial, value: float) -> None:
    trial.set_constraint(CONSTRAINT_MEMORY, value)
    study._storage.set_trial_system_attr(trial._trial_id, _LEGACY_CONSTRAINTS_KEY, [value])


def record_outcome(
    study: optuna.Study, trial: optuna.Trial, params: TrialParams, result: ProbeResult, ceiling_bytes: int, *, reusable: bool = True
) -> StoredOutcome:
    """Store ``result`` on the trial and tell Optuna the matching state; returns what was stored.

    ``ok`` -> COMPLETE with samples/s as the value and ``(peak - ceiling) / ceiling`` as the memory
    constraint (feasible when <= 0); ``oom`` -> PRUNED (constraint +1); ``timeout``, ``crash`` and
    ``diverged`` -> FAIL.
    """
    trial.set_user_attr(ATTR_PARAMS, params.to_dict())
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


def fail_interrupted(study: optuna.Study, trial: optuna.Trial) -> None:
    """Fail a trial whose probe was interrupted (Ctrl-C); not reusable."""
    try:
        trial.set_user_attr(ATTR_REASON, "interrupted by the user")
        trial.set_user_attr(ATTR_REUSABLE, False)
        study.tell(trial, state=TrialState.FAIL)
    except (RuntimeError, ValueError):  # already told: the interrupt came after its outcome was stored
        pass


def fail_orphaned_trials(study: optuna.Study) -> int:
    """Mark RUNNING trials whose run died (Ctrl-C'd hard, killed) as FAIL; returns how many."""
    count = 0
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner_host, _, pid = str(trial.user_attrs.get(ATTR_OWNER, "")).rpartition(":")
        if owner_host != host or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        study._storage.set_trial_user_attr(trial._trial_id, ATTR_REASON, "interrupted: the run that started it is gone")
        study.tell(trial.number, state=TrialState.FAIL)
        count += 1
    return count


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_remeasure(study: optuna.Study, first_number: int) -> optuna.Trial:
    """A RUNNING trial with the exact parameters of trial ``first_number`` and ``remeasure_of`` set.

    Not ``enqueue_trial`` + ``ask``: ``ask`` takes the oldest waiting trial first, and one the loop
    enqueued but did not reach may still be waiting.
    """
    storage = study._storage
    original = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(study._study_id, first_number))
    template = optuna.trial.create_trial(
        state=TrialState.RUNNING,
        params=original.params,
        distributions=original.distributions,
        user_attrs={ATTR_REMEASURE_OF: first_number, ATTR_OWNER: owner()},
    )
    # Study.add_trial returns no id; its storage call does.
    trial_id = storage.create_new_trial(study._study_id, template_trial=template)
    return optuna.Trial(study, trial_id)
