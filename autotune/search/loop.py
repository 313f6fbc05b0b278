"""The search loop: an Optuna study, an ask/tell loop, a budget. Runs in the parent; never imports torch.

Trial lifecycle (one iteration of :func:`run_search`):

1. **ask** - the sampler proposes a point of the :class:`~autotune.space.SearchSpace` (trial 0 of a
   new study is the enqueued baseline: transformers' default ``TrainingArguments``).
2. **dedupe** - a point measured before is not run again: the new trial repeats the stored outcome,
   and the next trial is a random unmeasured point, so the budget buys new information.
3. **evaluate** - the :class:`Evaluator` runs the probe (real: a fresh child process per trial;
   tests and replays: a table or a fake), with a deadline no later than the end of the budget.
4. **tell** - the outcome becomes an Optuna state (:func:`autotune.studies.record_outcome`): ``ok``
   -> COMPLETE with samples/s as the value and ``(peak_mem - ceiling) / ceiling`` as the ``memory``
   constraint (feasible when <= 0); ``oom`` -> PRUNED (constraint +1); ``timeout``/``crash``/
   ``diverged`` -> FAIL; ``pruned`` (not run, below) -> PRUNED (constraint from the predicted
   peak). The full :class:`~autotune.records.ProbeResult` is kept in the trial's user attributes,
   so a report can be rebuilt from the storage alone.

Before step 1 the :class:`~autotune.search.strategies.base.Strategy` may **propose** a configuration (enqueued,
so it is what ``ask`` returns), and after step 2 it may **prune** one: a configuration the memory
model rules out is told PRUNED with ``status="pruned"`` and a ``reason`` ("predicted 42.1 GiB >
ceiling 40.0 GiB", "OOM at batch 32 in the same group"), costs no probe time, and is not stored as
reusable (a resumed run decides again). Every trial records the memory model's prediction at ask
time (``predicted_peak_mem_bytes``); every measurement calibrates the model.

Near-ties are measured again before the search ends: a probe is noisy (run-to-run differences of
1-2 % on a GPU), so when configurations that fit are within the noise band of the best
(:func:`autotune.search.ranking.near_ties`), each of them measured once is probed once more (a new
trial with ``remeasure_of`` = its first trial's number), and every consumer ranks configurations
by the mean of their measurements (:func:`autotune.search.ranking.rank_configurations`).
Exploration stops early enough to leave the time these probes take.

The loop stops when the budget (``clock`` time) or the trial count runs out, when every point has
been measured, or on Ctrl-C; a trial in flight at Ctrl-C is told FAIL ("interrupted") and every
finished trial stays in the storage, so re-running the same command resumes the study.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import optuna

import autotune.studies as studies
from autotune.params import TrialParams
from autotune.records import Probe, ProbeResult, ProbeStatus
from autotune.search.memory import MemoryModel
from autotune.search.ranking import Configuration, near_ties, rank_configurations
from autotune.search.strategies.base import SearchState, Strategy
from autotune.space import SearchSpace
from autotune.studies import StoredOutcome

StopReason = Literal["budget", "n_trials", "exhausted", "interrupted"]

MAX_CONSECUTIVE_PRUNES = 200  # then a random configuration the strategy allows is enqueued


class Evaluator(Protocol):
    """Turns one configuration into a measured outcome."""

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        """Measure ``params``; return ``status="timeout"`` if it cannot finish in ``timeout_s``."""
        ...


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    """Real elapsed time."""

    def now(self) -> float:
        return time.monotonic()


@dataclass
class VirtualClock:
    """A clock that only moves when told to: replays and tests charge each probe's cost to it."""

    elapsed_s: float = 0.0

    def now(self) -> float:
        return self.elapsed_s

    def advance(self, seconds: float) -> None:
        self.elapsed_s += seconds


@dataclass(frozen=True)
class SearchSettings:
    """Bounds of one search run."""

    memory_ceiling_bytes: int
    budget_s: float | None = None  # the whole run, probes included
    n_trials: int | None = None  # exploring probes run in this invocation (near-tie re-measures, <= 3, come on top)
    trial_timeout_s: float = 900.0  # one probe, start-up and compilation included
    min_probe_s: float = 5.0  # do not start a probe with less time than this left
    seed: int = 0


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial as the loop saw it (what progress displays receive)."""

    number: int
    params: TrialParams
    result: ProbeResult
    feasible: bool
    is_baseline: bool = False
    duplicate_of: int | None = None
    remeasure_of: int | None = None


@dataclass
class SearchOutcome:
    stopped_because: StopReason
    probes_run: int = 0  # re-measures included
    remeasures: int = 0
    duplicates: int = 0
    pruned: int = 0
    oom_probes: int = 0
    records: list[TrialRecord] = field(default_factory=list)


def ranked_configurations(study: optuna.Study, ceiling_bytes: int) -> list[Configuration]:
    """The study's configurations that fit, fastest mean first (:func:`~autotune.search.ranking.rank_configurations`)."""
    return rank_configurations(studies.stored_probes(study), ceiling_bytes)


def _remeasure_queue(study: optuna.Study, ceiling_bytes: int, tried: set[tuple[int, int]]) -> Iterator[Configuration]:
    """The near-ties as they stand when the search ends, then, read afresh, those that their second
    probe made unstable (a third probe decides); each (configuration, probe count) once."""
    for _ in range(2):
        pending = [c for c in _to_remeasure(study, ceiling_bytes) if (c.number, c.n_measurements) not in tried]
        for contender in pending:
            tried.add((contender.number, contender.n_measurements))
            yield contender


def _to_remeasure(study: optuna.Study, ceiling_bytes: int) -> list[Configuration]:
    """The near-ties measured only once, and those whose two probes disagree (unstable: a third probe
    decides); a resumed run probes none of them beyond that."""
    ranked = ranked_configurations(study, ceiling_bytes)
    contenders = near_ties(ranked) or [c for c in ranked[:1] if c.unstable]
    return [c for c in contenders if c.n_measurements == 1 or (c.n_measurements == 2 and c.unstable)]


def _random_unmeasured(space: SearchSpace, seen: dict[tuple[Any, ...], Any], rng: random.Random) -> TrialParams | None:
    for _ in range(2000):
        params = space.random_point(rng)
        if params.key() not in seen:
            return params
    return None


def _remeasure_cost_s(contenders: list[Configuration], typical_s: float, available_s: float, min_probe_s: float) -> float:
    """Probe time re-measuring ``contenders`` takes within ``available_s``.

    Each costs its own last wall time (same configuration, same compilation), the typical probe's
    where it has none. One that does not fit in what is left is skipped, as
    :func:`remeasure_near_ties` skips it: reserving time for a probe that cannot run would only
    take it from exploring.
    """
    reserve_s = 0.0
    for contender in contenders:
        cost_s = max(min_probe_s, contender.wall_s or typical_s)
        if reserve_s + cost_s <= available_s:
            reserve_s += cost_s
    return reserve_s


def remeasure_near_ties(
    study: optuna.Study,
    evaluator: Evaluator,
    settings: SearchSettings,
    *,
    clock: Clock,
    deadline_s: float | None,
    typical_s: float,
    on_start: Callable[[int, TrialParams], None] | None = None,
    on_trial: Callable[[TrialRecord], None] | None = None,
) -> int:
    """Probe each near-tie measured once a second time, as a new trial with ``remeasure_of``; then
    those whose two probes disagree beyond the noise band (unstable) a third time.

    A contender whose probe would not finish in the time left is skipped, and no probe's deadline
    passes the budget's. Ctrl-C fails the trial in flight (as in :func:`run_search`) and re-raises.

    Returns:
        How many probes ran.
    """
    done = 0
    tried: set[tuple[int, int]] = set()  # (configuration, its probes so far): each gets one more probe at most per pass
    for contender in _remeasure_queue(study, settings.memory_ceiling_bytes, tried):
        remaining_s = deadline_s - clock.now() if deadline_s is not None else settings.trial_timeout_s
        if remaining_s < max(settings.min_probe_s, contender.wall_s or typical_s):
            continue
        trial = studies.start_remeasure(study, contender.number)
        try:
            if on_start:
                on_start(trial.number, contender.params)
            result, reusable = _probe(evaluator, contender.params, settings, remaining_s)
            studies.record_outcome(study, trial, contender.params, result, settings.memory_ceiling_bytes, reusable=reusable)
        except KeyboardInterrupt:
            studies.fail_interrupted(study, trial)
            raise
        done += 1
        if on_trial:
            on_trial(TrialRecord(
                number=trial.number,
                params=contender.params,
                result=result,
                feasible=result.fits(settings.memory_ceiling_bytes),
                remeasure_of=contender.number,
            ))
    return done


def _probe(evaluator: Evaluator, params: TrialParams, settings: SearchSettings, remaining_s: float) -> tuple[ProbeResult, bool]:
    """Run one probe with a deadline no later than the budget's; returns it and whether it is reusable."""
    timeout_s = min(settings.trial_timeout_s, remaining_s)
    result = evaluator.evaluate(params, timeout_s=timeout_s)
    cut_by_budget = result.status is ProbeStatus.TIMEOUT and timeout_s < settings.trial_timeout_s
    if cut_by_budget:
        result = result.replace(error=f"the run's budget ended during this probe ({timeout_s:.0f} s left)")
    return result, not cut_by_budget


def run_search(
    study: optuna.Study,
    space: SearchSpace,
    evaluator: Evaluator,
    settings: SearchSettings,
    *,
    baseline: TrialParams | None = None,
    clock: Clock | None = None,
    on_trial: Callable[[TrialRecord], None] | None = None,
    on_start: Callable[[int, TrialParams], None] | None = None,
    strategy: Strategy | None = None,
    memory: MemoryModel | None = None,
    started_s: float | None = None,
) -> SearchOutcome:
    """Run the ask/evaluate/tell loop until the budget, the trial count or the space runs out.

    Args:
        study: an Optuna study (new or resumed); finished trials in it are never re-run.
        space: the restricted search space.
        evaluator: measures one configuration.
        settings: budget, trial count, memory ceiling, per-probe timeout.
        baseline: enqueued as the first trial of a study that has none.
        clock: time source for the budget (a :class:`VirtualClock` for replays and tests).
        on_trial: called after every finished trial, e.g. to update a progress display.
        on_start: called before every probe with the trial number and its parameters.
        strategy: proposes and prunes configurations and sets the study's sampler; ``None`` keeps
            the study's own sampler and prunes nothing.
        memory: the memory model (with model dimensions for an analytic prior); default: one that
            learns from the measurements only.
        started_s: when the budget started, on ``clock`` (default: now): a run charges its set-up
            (opening the study, starting the probe server) to the budget too.

    Returns:
        Why it stopped, and what it ran.
    """
    clock = clock or WallClock()
    start_s = clock.now() if started_s is None else started_s
    deadline_s = start_s + settings.budget_s if settings.budget_s else None
    rng = random.Random(settings.seed)
    studies.fail_orphaned_trials(study)
    seen: dict[tuple[Any, ...], StoredOutcome] = studies.reusable_outcomes(study)
    if baseline is not None and not studies.has_baseline(study):
        studies.enqueue_baseline(study, space.optuna_params(baseline))
    outcome = SearchOutcome(stopped_because="budget")
    wall_times_s: list[float] = []
    memory = memory if memory is not None else MemoryModel()
    history: list[Probe] = studies.stored_probes(study)
    memory.observe_all((o.params, o.result) for o in history)
    state = SearchState(space, settings.memory_ceiling_bytes, memory, history, seen, baseline=baseline)
    if strategy is not None:
        study.sampler = strategy.sampler(settings.seed)
    consecutive_prunes = 0
    open_trial: optuna.Trial | None = None  # asked, not yet told

    def finished(record: TrialRecord) -> None:
        """Bookkeeping after every probe (exploring or re-measuring)."""
        history.append(Probe(record.number, record.params, record.result))
        memory.observe(record.params, record.result)
        outcome.probes_run += 1
        outcome.remeasures += record.remeasure_of is not None
        outcome.oom_probes += record.result.status is ProbeStatus.OOM
        if record.result.wall_s:
            wall_times_s.append(record.result.wall_s)
        outcome.records.append(record)
        if on_trial:
            on_trial(record)

    try:
        while True:
            if settings.n_trials is not None and outcome.probes_run >= settings.n_trials:
                outcome.stopped_because = "n_trials"
                break
            if len(seen) >= space.size:
                outcome.stopped_because = "exhausted"
                break
            remaining_s = deadline_s - clock.now() if deadline_s is not None else settings.trial_timeout_s
            # Do not start a probe that typically cannot finish in the time left: it would be wasted.
            # Nor one that would eat the time reserved for re-measuring the near-ties so far.
            typical_s = statistics.median(wall_times_s) if wall_times_s else 0.0
            reserve_s = 0.0
            if deadline_s is not None:
                contenders = _to_remeasure(study, settings.memory_ceiling_bytes)
                reserve_s = _remeasure_cost_s(contenders, typical_s, remaining_s, settings.min_probe_s)
            if remaining_s - reserve_s < max(settings.min_probe_s, typical_s):
                outcome.stopped_because = "budget"
                break
            # The strategy plans with the whole time left: a near-tie found mid-run is usually overtaken
            # by a faster configuration, and shrinking the plan for it cost the frontier strategy a probe
            # in bench.search. The reserve is enforced here, when deciding whether to explore at all.
            state.remaining_s = remaining_s if deadline_s is not None else None
            if strategy is not None and not studies.has_waiting(study):
                proposal = strategy.propose(state)
                if proposal is None and consecutive_prunes >= MAX_CONSECUTIVE_PRUNES:
                    proposal = _random_allowed(space, seen, rng, strategy, state)
                    consecutive_prunes = 0
                if proposal is not None and proposal.key() not in seen:
                    study.enqueue_trial(space.optuna_params(proposal))
            trial = open_trial = studies.ask(study)
            params = space.suggest(trial)
            key = params.key()
            if key in seen:
                studies.record_repeat(study, trial, params, seen[key])
                open_trial = None
                outcome.duplicates += 1
                fresh = _random_unmeasured(space, seen, rng)
                if fresh is not None:
                    study.enqueue_trial(space.optuna_params(fresh))
                continue
            predicted = memory.predict(params)
            if predicted is not None:
                studies.record_predicted_peak(trial, predicted)
            reason = strategy.prune(params, state) if strategy is not None else None
            if reason is not None:
                seen[key] = studies.record_pruned(study, trial, params, reason, predicted, settings.memory_ceiling_bytes)
                open_trial = None
                outcome.pruned += 1
                consecutive_prunes += 1
                continue
            consecutive_prunes = 0
            if on_start:
                on_start(trial.number, params)
            result, reusable = _probe(evaluator, params, settings, remaining_s)
            measured = studies.record_outcome(study, trial, params, result, settings.memory_ceiling_bytes, reusable=reusable)
            open_trial = None
            if reusable:
                seen[key] = measured
            record = TrialRecord(
                number=trial.number,
                params=params,
                result=result,
                feasible=result.fits(settings.memory_ceiling_bytes),
                is_baseline=studies.is_baseline(trial),
            )
            finished(record)
        # The loop ended without Ctrl-C (budget, trial count or space): decide the near-ties.
        typical_s = statistics.median(wall_times_s) if wall_times_s else 0.0
        remeasure_near_ties(
            study, evaluator, settings, clock=clock, deadline_s=deadline_s, typical_s=typical_s,
            on_start=on_start, on_trial=finished,
        )
    except KeyboardInterrupt:
        # Ctrl-C anywhere in an iteration: the trial in flight (if any) is failed, not left RUNNING,
        # and every finished trial is already in the storage.
        if open_trial is not None:
            studies.fail_interrupted(study, open_trial)
        outcome.stopped_because = "interrupted"
    return outcome


def _random_allowed(
    space: SearchSpace, seen: dict[tuple[Any, ...], Any], rng: random.Random, strategy: Strategy, state: SearchState
) -> TrialParams | None:
    """A random unmeasured configuration the strategy does not prune (the sampler keeps proposing pruned ones)."""
    for _ in range(200):
        params = _random_unmeasured(space, seen, rng)
        if params is None:
            return None
        if strategy.prune(params, state) is None:
            return params
    return None
