"""Writing a study's trials: claims, outcomes, repeats, deaths, heartbeats, re-measures and recovered results.

Optuna offers no public way to set an attribute on a finished trial, or to add a RUNNING trial and
get its id back; the few private calls that do (``study._storage``, ``trial._trial_id``) are made
in this package and nowhere else, as Optuna itself keeps its heartbeat calls inside ``storages/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.params import TrialParams
from autotune.records import ProbeResult, ProbeStatus
from autotune.studies import reading
from autotune.studies.reading import StoredOutcome, config_key, dead_trials, first_death, is_claim, outcome_of, was_popped
from autotune.studies.schema import (
    ATTR_DIED,
    ATTR_DUPLICATE_OF,
    ATTR_HEARTBEAT,
    ATTR_OWNER,
    ATTR_PARAMS,
    ATTR_PREDICTED_PEAK,
    ATTR_REASON,
    ATTR_RECOVERED_FROM,
    ATTR_REMEASURE_OF,
    ATTR_REMEASURE_ROUND,
    ATTR_RESULT,
    ATTR_RETRY_OF,
    ATTR_REUSABLE,
    ATTR_ROLE,
    ATTR_STATUS,
    CLAIM_SETTLE_S,
    CONSTRAINT_MEMORY,
    HEARTBEAT_GRACE_S,
    HEARTBEAT_INTERVAL_S,
    LEGACY_CONSTRAINTS_KEY,
    OUTCOME_ATTRS,
    ROLE_BASELINE,
    SCALAR_RESULT_ATTRS,
    STUDY_DEADLINE_ATTR,
    STUDY_ESTIMATES_ATTR,
)

_log = logging.getLogger(__name__)

def ask(study: optuna.Study) -> optuna.Trial:
    """The sampler's next trial (an enqueued one first), marked as this run's and alive.

    It claims nothing until :func:`record_params` gives it its configuration (:func:`holder` waits
    for that, briefly).
    """
    with _queue_lock(study):
        trial = study.ask()
    trial.set_user_attr(ATTR_OWNER, reading.owner())
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
    user_attrs: dict[str, Any] = {ATTR_PARAMS: params.to_dict(), ATTR_OWNER: reading.owner(), ATTR_HEARTBEAT: time.time()}
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
    popped = was_popped(mine)
    wait_until_s = time.monotonic() + settle_s
    while True:
        trials = study.get_trials(deepcopy=False)
        rivals = [t for t in trials if t.number != me and is_claim(t) and config_key(t) == key and (popped or t.number < me)]
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
        record_repeat(study, trial, params, outcome_of(holding))
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
    study._storage.set_trial_system_attr(trial._trial_id, LEGACY_CONSTRAINTS_KEY, [value])


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
    attrs = {k: v for k, v in trial.user_attrs.items() if k in OUTCOME_ATTRS}
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


def record_estimates(study: optuna.Study, samples_per_s: Mapping[int, float], probes: int) -> None:
    """Store the search's estimates (per configuration's first trial number) and how many probes they rest on."""
    study.set_user_attr(STUDY_ESTIMATES_ATTR, {"probes": int(probes), "samples_per_s": {str(n): float(v) for n, v in samples_per_s.items()}})


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
    user_attrs: dict[str, Any] = {ATTR_REMEASURE_OF: first_number, ATTR_OWNER: reading.owner(), ATTR_HEARTBEAT: time.time()}
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
    user_attrs: dict[str, Any] = {ATTR_RECOVERED_FROM: trial_number, ATTR_OWNER: reading.owner()}
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
