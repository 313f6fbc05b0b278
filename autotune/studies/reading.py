"""Reading a study's trials: what one iteration of a worker syncs from.

Several workers (processes, machines) may search one study at once; the study is their only shared
state. Each iteration a worker reads the trials once (read_trials) and derives from that list what
it needs: the probes others finished (probes_in), their reusable outcomes (reusable_in), what is in
flight (in_flight), dead trials (dead_trials) and configurations to probe again (retry_candidates).

Claims. A configuration is claimed by a trial carrying its ATTR_PARAMS: a strategy's proposal is
created with them in one storage call (claim), a sampler's trial gets them right after suggest
(record_params). Trial creation is serialised per study on every Optuna storage (RDB: the study
row is locked FOR UPDATE and SQLite has one writer; a journal: the log order), so trial numbers
order the claims: the lowest-numbered live claim (RUNNING, or finished and reusable) of a
configuration holds it (holder), and any other trial of it does not probe (hold). Re-measures
(remeasure_of) are deliberate and claim (configuration, round) instead.

Dead workers. Optuna's own heartbeat (RDBStorage(heartbeat_interval=...), fail_stale_trials,
RetryFailedTrialCallback) exists only for RDB storages: JournalStorage implements no BaseHeartbeat
(Optuna 5.0). So one mechanism of ours serves every storage, modelled on Optuna's: a worker
refreshes ATTR_HEARTBEAT on its RUNNING trial while it probes (Heartbeat); any worker fails a
RUNNING trial whose heartbeat (or start) is older than the grace, on any host, or whose owner
process on this host is gone (fail_dead_trials); like RetryFailedTrialCallback's retry history,
the configuration of a trial that died (so, or because its probe process was killed) is probed
once more (retry_of) and a second death is final.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from autotune.params import TrialParams
from autotune.records import Probe, ProbeResult, ProbeStatus
from autotune.studies.schema import (
    ATTR_DIED,
    ATTR_DUPLICATE_OF,
    ATTR_HEARTBEAT,
    ATTR_OWNER,
    ATTR_PARAMS,
    ATTR_REMEASURE_OF,
    ATTR_RESULT,
    ATTR_RETRY_OF,
    ATTR_REUSABLE,
    ATTR_ROLE,
    ATTR_STATUS,
    CONSTRAINT_MEMORY,
    FINISHED_STATES,
    KILLED_PREFIXES,
    OUTCOME_ATTRS,
    ROLE_BASELINE,
    STUDY_ESTIMATES_ATTR,
)


def owner() -> str:
    """``host:pid`` of this process: who asked a trial (looked up as ``reading.owner`` everywhere, so one patch
    makes a test worker pretend to run on another host)."""
    return f"{socket.gethostname()}:{os.getpid()}"


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
        if trial.state in FINISHED_STATES and ATTR_RESULT in attrs and ATTR_PARAMS in attrs and ATTR_DUPLICATE_OF not in attrs:
            probes.append(Probe(trial.number, TrialParams.from_dict(attrs[ATTR_PARAMS]), ProbeResult.from_dict(attrs[ATTR_RESULT])))
    return probes


def stored_probes(study: optuna.Study) -> list[Probe]:
    """The finished trials that ran a probe (repeats and pruned trials excluded), oldest first."""
    return probes_in(study.get_trials(deepcopy=False, states=FINISHED_STATES))


def estimates(study: optuna.Study, probes: int) -> dict[int, float] | None:
    """The search's estimates of samples/s per configuration's first trial number, as its end stored them
    (:func:`autotune.studies.writing.record_estimates`); ``None`` where none are stored, or where they rest
    on another number of probes than ``probes`` (the study has gone on since: they are stale)."""
    stored = study.user_attrs.get(STUDY_ESTIMATES_ATTR)
    if not isinstance(stored, dict) or stored.get("probes") != probes:
        return None
    return {int(number): float(value) for number, value in (stored.get("samples_per_s") or {}).items()}


@dataclass(frozen=True)
class StoredOutcome:
    """The stored outcome of a configuration, enough to repeat it without re-running."""

    number: int
    state: TrialState
    value: float | None
    attrs: dict[str, Any]
    constraint: float | None


def outcome_of(trial: FrozenTrial) -> StoredOutcome:
    attrs = {k: trial.user_attrs[k] for k in OUTCOME_ATTRS if k in trial.user_attrs}
    value = trial.value if trial.state == TrialState.COMPLETE else None
    return StoredOutcome(trial.number, trial.state, value, attrs, trial.constraints.get(CONSTRAINT_MEMORY))


def is_reusable(trial: FrozenTrial) -> bool:
    return trial.state in FINISHED_STATES and ATTR_PARAMS in trial.user_attrs and trial.user_attrs.get(ATTR_REUSABLE) is not False


def reusable_in(trials: Sequence[FrozenTrial]) -> dict[tuple[Any, ...], StoredOutcome]:
    """Finished, reusable trials by configuration key, the oldest of each (interrupted, cut-short,
    pruned, held and first-death trials are not reusable)."""
    seen: dict[tuple[Any, ...], StoredOutcome] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        if is_reusable(trial):
            seen.setdefault(TrialParams.from_dict(trial.user_attrs[ATTR_PARAMS]).key(), outcome_of(trial))
    return seen


def reusable_outcomes(study: optuna.Study) -> dict[tuple[Any, ...], StoredOutcome]:
    """Finished, reusable trials by configuration key (interrupted or cut-short ones are not reusable)."""
    return reusable_in(study.get_trials(deepcopy=False, states=FINISHED_STATES))


def pruned_in(trials: Sequence[FrozenTrial], from_number: int) -> dict[tuple[Any, ...], StoredOutcome]:
    """Configurations pruned (not run) by trials numbered ``from_number`` or later: decided during this run."""
    pruned: dict[tuple[Any, ...], StoredOutcome] = {}
    for trial in trials:
        if trial.number >= from_number and trial.state == TrialState.PRUNED and trial.user_attrs.get(ATTR_STATUS) == ProbeStatus.PRUNED.value:
            key = config_key(trial)
            if key is not None:
                pruned.setdefault(key, outcome_of(trial))
    return pruned


def in_flight(trials: Sequence[FrozenTrial]) -> set[tuple[Any, ...]]:
    """The configurations of RUNNING trials (being probed, or about to be, somewhere)."""
    return {key for t in trials if t.state == TrialState.RUNNING and (key := config_key(t)) is not None}


def has_waiting(trials: Sequence[FrozenTrial]) -> bool:
    """Whether an enqueued trial is waiting to be asked (``enqueue_trial`` by hand, or an older autotune)."""
    return any(t.state == TrialState.WAITING for t in trials)


def is_live(trial: FrozenTrial) -> bool:
    """It holds its configuration: queued, running, or finished with an outcome a later trial may reuse."""
    return trial.state in (TrialState.WAITING, TrialState.RUNNING) or is_reusable(trial)


def baseline_settled(trials: Sequence[FrozenTrial]) -> bool:
    """A baseline trial is queued, running, or finished for good (one that never finished, was cut
    short, or whose process died for the first time is run again)."""
    return role_settled(trials, ROLE_BASELINE)


def role_settled(trials: Sequence[FrozenTrial], role: str) -> bool:
    """A trial of this role (:data:`ROLE_BASELINE`, :data:`ROLE_EXPERT`) is queued, running, or finished for good."""
    return any(t.user_attrs.get(ATTR_ROLE) == role and is_live(t) for t in trials)


def has_baseline(study: optuna.Study) -> bool:
    """Whether the study's baseline is queued, running or finished for good (see :func:`baseline_settled`)."""
    return baseline_settled(study.get_trials(deepcopy=False))


def is_baseline(trial: optuna.Trial | FrozenTrial) -> bool:
    return trial.user_attrs.get(ATTR_ROLE) == ROLE_BASELINE


def killed(result: ProbeResult) -> bool:
    """The probe's process was killed from outside or lost with its server (:attr:`ProbeResult.process_lost`): that
    says nothing yet about the configuration, so it is probed once more."""
    return result.status is ProbeStatus.CRASH and (result.process_lost or (result.error or "").startswith(KILLED_PREFIXES))


def first_death(trials: Sequence[FrozenTrial], key: tuple[Any, ...] | None, number: int) -> bool:
    """No trial of configuration ``key`` but trial ``number`` has died: it gets its one retry (not reusable)."""
    return key is None or not any(t.number != number and ATTR_DIED in t.user_attrs and config_key(t) == key for t in trials)


def retry_candidates(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that died once (killed, or their worker went silent), whose configuration nothing holds
    and no trial has retried yet: each is probed once more, oldest first."""
    retried = {t.user_attrs[ATTR_RETRY_OF] for t in trials if ATTR_RETRY_OF in t.user_attrs}
    held = {config_key(t) for t in trials if is_claim(t)}
    return [
        t for t in sorted(trials, key=lambda t: t.number)
        if ATTR_DIED in t.user_attrs and t.user_attrs.get(ATTR_REUSABLE) is False and t.state.is_finished()
        and ATTR_REMEASURE_OF not in t.user_attrs and t.number not in retried
        and (key := config_key(t)) is not None and key not in held and first_death(trials, key, t.number)
    ]


def is_claim(trial: FrozenTrial) -> bool:
    """A live claim of its configuration (re-measures and held trials claim nothing)."""
    attrs = trial.user_attrs
    return ATTR_PARAMS in attrs and ATTR_DUPLICATE_OF not in attrs and ATTR_REMEASURE_OF not in attrs and is_live(trial)


def was_popped(trial: FrozenTrial) -> bool:
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
