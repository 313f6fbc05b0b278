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

**Workers.** Several processes (one per GPU, or on several machines) may run this loop on one
study at once; the study is all they share (the protocol is in :mod:`autotune.studies`, "reading").
Before each proposal a worker reads the trials once and syncs: the probes others finished (history
and memory model), their outcomes (``seen``), and the configurations in flight elsewhere, which
count as seen for the strategy (:class:`~autotune.search.strategies.base.SeenKeys`). A proposal is
created as a trial that claims its configuration in the same storage call (:func:`writing.claim`),
a sampler's trial claims it right after ``suggest``; the lowest-numbered live claim holds a
configuration, and a worker whose trial does not hold it records it as held (not a probe) and
proposes again. While a probe runs its trial's heartbeat is refreshed; a RUNNING trial silent past
``heartbeat_grace_s`` (any host), or whose process on this host is gone, is failed by whichever
worker sees it, and its configuration, like that of a probe whose process was killed, is probed
once more; a second death is final. A baseline that never finished is run again.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial

from autotune.params import TrialParams
from autotune.records import Probe, ProbeResult, ProbeStatus
from autotune.search.expert import expert_fallback
from autotune.search.memory import MemoryModel
from autotune.search.ranking import Configuration, near_ties, rank_configurations
from autotune.search.strategies.base import SearchState, SeenKeys, Strategy
from autotune.search.strategies.failures import p_runs
from autotune.space import SearchSpace
from autotune.studies import reading, schema, writing
from autotune.studies.reading import StoredOutcome

StopReason = Literal["budget", "n_trials", "exhausted", "interrupted"]

MAX_CONSECUTIVE_PRUNES = 200  # then a random configuration the strategy allows is proposed

_log = logging.getLogger(__name__)


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
    heartbeat_interval_s: float = schema.HEARTBEAT_INTERVAL_S  # a probing worker refreshes its trial's heartbeat this often
    heartbeat_grace_s: float = schema.HEARTBEAT_GRACE_S  # a RUNNING trial silent this long is failed (its worker died) and retried once
    claim_settle_s: float = schema.CLAIM_SETTLE_S  # a claim waits this long at most for an older trial without a configuration yet
    gpu: bool = True  # the probes run on a GPU: what the ranking's prior prefers among near-ties (ranking.prior_rank)
    loader_cores: int | None = None  # CPU cores one probe process's loader workers have (autotune.probe.device.loader_cores); None: unknown


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
    held: int = 0  # trials not run because another worker's trial held their configuration
    retries: int = 0  # configurations probed again because the process probing them died
    pruned: int = 0
    oom_probes: int = 0
    records: list[TrialRecord] = field(default_factory=list)


def ranked_configurations(study: optuna.Study, ceiling_bytes: int, *, gpu: bool = True) -> list[Configuration]:
    """The study's configurations that fit, fastest mean first (:func:`~autotune.search.ranking.rank_configurations`,
    near-equals by the search's estimates where it stored them for these probes)."""
    probes = reading.stored_probes(study)
    return rank_configurations(probes, ceiling_bytes, gpu=gpu, estimates=reading.estimates(study, len(probes)))


def record_estimates(study: optuna.Study, strategy: Strategy, state: SearchState) -> None:
    """The strategy's estimates of the configurations that fit, given every probe the study holds now, stored
    for the ranking (nothing where the strategy has no model of throughput)."""
    state.history = reading.stored_probes(study)
    by_key = strategy.estimates(state)
    if by_key:
        numbers = {c.params.key(): c.number for c in state.feasible()}
        writing.record_estimates(study, {numbers[k]: v for k, v in by_key.items() if k in numbers}, len(state.history))


def _remeasure_queue(study: optuna.Study, settings: SearchSettings, tried: set[tuple[int, int]]) -> Iterator[Configuration]:
    """The near-ties as they stand when the search ends, then, read afresh, those that their second
    probe made unstable (a third probe decides); each (configuration, probe count) once."""
    for _ in range(2):
        pending = [c for c in _to_remeasure(reading.stored_probes(study), settings) if (c.number, c.n_measurements) not in tried]
        for contender in pending:
            tried.add((contender.number, contender.n_measurements))
            yield contender


def _to_remeasure(probes: Sequence[Probe], settings: SearchSettings) -> list[Configuration]:
    """The near-ties measured only once, and those whose two probes disagree (unstable: a third probe
    decides); a resumed run probes none of them beyond that."""
    ranked = rank_configurations(probes, settings.memory_ceiling_bytes, gpu=settings.gpu)
    contenders = near_ties(ranked) or [c for c in ranked[:1] if c.unstable]
    return [c for c in contenders if c.n_measurements == 1 or (c.n_measurements == 2 and c.unstable)]


def _random_unmeasured(space: SearchSpace, seen: SeenKeys, rng: random.Random) -> TrialParams | None:
    for _ in range(2000):
        params = space.random_point(rng)
        if params.key() not in seen:
            return params
    return None


# At most this share of the run's budget (or one typical probe, if that is more) is kept from exploring
# for re-measuring near-ties. A near-tie is within a probe's noise of the best, so deciding it is worth
# a few percent at most; where probes are long (compiling a large model: a fifth of a 30-minute budget
# each) exploring is worth more, and what is left at the end still re-measures whatever fits in it.
# On the design draws of the landscape family (bench.search --family design, 2026-11-22) keeping every
# near-tie's time gave 30-minute p5 0.919, this 0.925; at 60 minutes worst 0.793 -> 0.853.
REMEASURE_RESERVE_FRACTION = 0.1


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
    for contender in _remeasure_queue(study, settings, tried):
        remaining_s = deadline_s - clock.now() if deadline_s is not None else settings.trial_timeout_s
        if remaining_s < max(settings.min_probe_s, contender.wall_s or typical_s):
            continue
        trial = writing.start_remeasure(study, contender.number, contender.n_measurements + 1)
        try:
            with writing.Heartbeat(study, trial, settings.heartbeat_interval_s):
                holding = writing.remeasure_holder(study, trial)
                if holding is not None:  # another worker is probing (or probed) this one again
                    writing.hold(study, trial, contender.params, holding)
                    continue
                if on_start:
                    on_start(trial.number, contender.params)
                result, reusable = _probe(evaluator, contender.params, settings, remaining_s)
                _record(study, trial, contender.params, result, settings, reusable)
        except KeyboardInterrupt:
            writing.fail_interrupted(study, trial)
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


def _record(
    study: optuna.Study, trial: optuna.Trial, params: TrialParams, result: ProbeResult, settings: SearchSettings, reusable: bool,
    trials: Sequence[FrozenTrial] | None = None,
) -> StoredOutcome | None:
    """Store a probe's outcome; None when it is not stored as one.

    A probe whose process was killed (:func:`reading.killed`) says nothing about its configuration
    the first time: the trial is failed as dead, not reusable, and the configuration is probed once
    more (:func:`reading.retry_candidates`); the second time the crash is final. A trial that
    another worker failed as dead meanwhile (this worker was alive, but silent past the grace)
    cannot be told again: the outcome is dropped with a warning.
    """
    died = reading.killed(result)
    dropped = f"trial {trial.number} was failed by another worker (no heartbeat for {settings.heartbeat_grace_s:.0f} s): its outcome is dropped"
    with writing.unless_taken(study, trial, dropped_warning=dropped):
        if died and reading.first_death(reading.read_trials(study) if trials is None else trials, params.key(), trial.number):
            writing.record_death(study, trial, params, result.error or "killed")
            return None
        return writing.record_outcome(study, trial, params, result, settings.memory_ceiling_bytes, reusable=reusable, died=died)
    return None


def _distributions(space: SearchSpace) -> dict[str, BaseDistribution]:
    """The Optuna distributions :meth:`SearchSpace.suggest` asks for, for a trial created with its parameters."""
    return {name: CategoricalDistribution(list(space.choices[name])) for name in space.free_params}


@dataclass
class _Synced:
    """This worker's view of the search, synced from the study before each proposal."""

    memory: MemoryModel
    from_number: int  # trials numbered from here were made during this run (their pruned configurations count as seen)
    history: list[Probe] = field(default_factory=list)  # probes that ran, here and in other workers
    seen: dict[tuple[Any, ...], StoredOutcome] = field(default_factory=dict)  # measured (reusable), or pruned in this run
    in_flight: set[tuple[Any, ...]] = field(default_factory=set)  # RUNNING elsewhere
    numbers: set[int] = field(default_factory=set)  # trial numbers in history

    def add(self, probe: Probe) -> None:
        """A probe of this worker's."""
        self.numbers.add(probe.number)
        self.history.append(probe)
        self.memory.observe(probe.params, probe.result)

    def sync(self, trials: Sequence[FrozenTrial]) -> None:
        """Take in what the others finished or run now (nothing new for a lone worker)."""
        new = [p for p in reading.probes_in(trials) if p.number not in self.numbers]
        self.numbers.update(p.number for p in new)
        self.history.extend(new)
        self.memory.observe_all((p.params, p.result) for p in new)
        for key, stored in reading.reusable_in(trials).items():
            self.seen.setdefault(key, stored)
        for key, stored in reading.pruned_in(trials, self.from_number).items():
            self.seen.setdefault(key, stored)
        self.in_flight = reading.in_flight(trials) - self.seen.keys()


def _pruned_here(stored: StoredOutcome | None) -> bool:
    return stored is not None and stored.attrs.get(schema.ATTR_STATUS) == ProbeStatus.PRUNED.value


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
    expert: TrialParams | None = None,
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
        baseline: run first in a study whose baseline is not queued, running or finished for good
            (a baseline that never finished, or whose process died once, is run again).
        expert: the expert rule's configuration (:func:`autotune.search.expert.expert_params`): run right
            after the baseline, as a named reference, unless it is measured or settled already.
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
    trials = reading.read_trials(study)
    memory = memory if memory is not None else MemoryModel()
    memory.oom_floor_bytes = max(memory.oom_floor_bytes, settings.memory_ceiling_bytes or 0)  # probes run out of memory at the ceiling
    synced = _Synced(memory, from_number=max((t.number for t in trials), default=-1) + 1)
    outcome = SearchOutcome(stopped_because="budget")
    wall_times_s: list[float] = []
    state = SearchState(space, settings.memory_ceiling_bytes, memory, synced.history, SeenKeys(synced.seen), baseline=baseline,
                        expert=expert, gpu=settings.gpu, loader_cores=settings.loader_cores)
    if strategy is not None:
        study.sampler = strategy.sampler(settings.seed)
    distributions = _distributions(space)
    consecutive_prunes = 0
    fresh: TrialParams | None = None  # a random unmeasured configuration, to run after a repeat
    open_trial: optuna.Trial | None = None  # asked, not yet told

    def finished(record: TrialRecord, *, stored: bool = True) -> None:
        """Bookkeeping after every probe (exploring or re-measuring); ``stored``: as a probe (not a first death)."""
        if stored:
            synced.add(Probe(record.number, record.params, record.result))
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
            # Sync: read the trials once; fail those whose worker died; take in what the others did.
            trials = reading.read_trials(study)
            if writing.fail_dead_trials(study, trials, grace_s=settings.heartbeat_grace_s):
                trials = reading.read_trials(study)
            synced.sync(trials)
            state.seen = SeenKeys(synced.seen, synced.in_flight)
            if len(state.seen) >= space.size:
                outcome.stopped_because = "exhausted"
                break
            remaining_s = deadline_s - clock.now() if deadline_s is not None else settings.trial_timeout_s
            # Do not start a probe that typically cannot finish in the time left: it would be wasted.
            # Nor one that would eat the time reserved for re-measuring the near-ties so far.
            typical_s = statistics.median(wall_times_s) if wall_times_s else 0.0
            reserve_s = 0.0
            if deadline_s is not None:
                contenders = _to_remeasure(reading.probes_in(trials), settings)
                keep_s = max(REMEASURE_RESERVE_FRACTION * (settings.budget_s or 0.0), typical_s)
                reserve_s = _remeasure_cost_s(contenders, typical_s, min(remaining_s, keep_s), settings.min_probe_s)
            if remaining_s - reserve_s < max(settings.min_probe_s, typical_s):
                outcome.stopped_because = "budget"
                break
            available_s = remaining_s - reserve_s if deadline_s is not None else None  # for one probe (None: no budget)
            # The strategy plans with the whole time left: a near-tie found mid-run is usually overtaken
            # by a faster configuration, and shrinking the plan for it cost the frontier strategy a probe
            # in bench.search. The reserve is enforced here, when deciding whether to explore at all,
            # and told to the strategy (kept_s): bayes keeps it from its exploring probes, not from
            # polishing (another compile mode can pay 10 %, a re-measure among near-ties a few).
            state.remaining_s = remaining_s if deadline_s is not None else None
            state.kept_s = reserve_s
            # What to claim: an enqueued trial first (ask pops it), then the baseline, the expert rule's
            # configuration and, while it has not run under the ceiling, its nearest neighbours, a
            # configuration whose process died, the fresh point after a repeat, the strategy's proposal;
            # else the sampler's.
            proposal, role, retry_of, reference = None, None, None, False  # reference: a reference row's, not a search's
            retry = reading.retry_candidates(trials)
            if reading.has_waiting(trials):
                pass
            elif baseline is not None and not reading.baseline_settled(trials) and not _pruned_here(synced.seen.get(baseline.key())):
                proposal, role = baseline, schema.ROLE_BASELINE
                retry_of = next((t.number for t in retry if reading.config_key(t) == baseline.key()), None)
            elif expert is not None and not reading.role_settled(trials, schema.ROLE_EXPERT) and expert.key() not in synced.seen:
                proposal, role = expert, schema.ROLE_EXPERT
                retry_of = next((t.number for t in retry if reading.config_key(t) == expert.key()), None)
            elif (expert is not None and (neighbour := _expert_neighbour(space, expert, synced, state, settings)) is not None
                  and _can_finish(neighbour, synced, available_s)):
                proposal, reference = neighbour, True
            elif retry:
                proposal, retry_of = TrialParams.from_dict(retry[0].user_attrs[schema.ATTR_PARAMS]), retry[0].number
            elif fresh is not None:
                proposal = fresh
            elif strategy is not None:
                proposal = strategy.propose(state)
                if proposal is None and consecutive_prunes >= MAX_CONSECUTIVE_PRUNES:
                    proposal = _random_allowed(space, state.seen, rng, strategy, state)
                    consecutive_prunes = 0
                    if proposal is None:  # the strategy, the sampler and random draws find nothing it allows: stop pruning
                        outcome.stopped_because = "exhausted"
                        break
                if proposal is not None and proposal.key() in state.seen:
                    proposal = None
            fresh = None
            if proposal is not None:
                trial = open_trial = writing.claim(
                    study, proposal, space.optuna_params(proposal), distributions, role=role, retry_of=retry_of
                )
            else:
                trial = open_trial = writing.ask(study)
            with writing.Heartbeat(study, trial, settings.heartbeat_interval_s):  # alive from its claim to its outcome
                params = space.suggest(trial)
                key = params.key()
                if key in synced.seen:
                    writing.record_repeat(study, trial, params, synced.seen[key])
                    open_trial = None
                    outcome.duplicates += 1
                    fresh = _random_unmeasured(space, state.seen, rng)
                    continue
                writing.record_params(trial, params)
                holding = writing.holder(study, trial, settle_s=settings.claim_settle_s)
                if holding is not None:  # another worker's trial claimed it first: propose again, knowing that
                    writing.hold(study, trial, params, holding)
                    open_trial = None
                    outcome.held += 1
                    if proposal is None:
                        fresh = _random_unmeasured(space, SeenKeys(synced.seen, synced.in_flight | {key}), rng)
                    continue
                outcome.retries += retry_of is not None
                predicted = memory.predict(params)
                if predicted is not None:
                    writing.record_predicted_peak(trial, predicted)
                reference = reference or any(row is not None and key == row.key() for row in (baseline, expert))  # enqueued too
                reason = (space.unrunnable(params) or (None if reference else space.beyond_user_space(params))
                          or (strategy.prune(params, state) if strategy is not None else None))
                if reason is not None:
                    synced.seen[key] = writing.record_pruned(study, trial, params, reason, predicted, settings.memory_ceiling_bytes)
                    open_trial = None
                    outcome.pruned += 1
                    consecutive_prunes += 1
                    continue
                consecutive_prunes = 0
                if proposal is None and not _can_finish(params, synced, available_s):
                    # The sampler's pick, where the strategy proposed nothing: a probe like it would not finish.
                    writing.release_unstarted(study, trial, f"not started: probes like it took longer than the {available_s:.0f} s left")
                    open_trial = None
                    outcome.stopped_because = "budget"
                    break
                if on_start:
                    on_start(trial.number, params)
                result, reusable = _probe(evaluator, params, settings, remaining_s)
                measured = _record(study, trial, params, result, settings, reusable, trials)
                open_trial = None
                if measured is not None and reusable:
                    synced.seen[key] = measured
                record = TrialRecord(
                    number=trial.number,
                    params=params,
                    result=result,
                    feasible=result.fits(settings.memory_ceiling_bytes),
                    is_baseline=reading.is_baseline(trial),
                )
                finished(record, stored=measured is not None)
        # The loop ended without Ctrl-C (budget, trial count or space): decide the near-ties.
        typical_s = statistics.median(wall_times_s) if wall_times_s else 0.0
        remeasure_near_ties(
            study, evaluator, settings, clock=clock, deadline_s=deadline_s, typical_s=typical_s,
            on_start=on_start, on_trial=finished,
        )
        if strategy is not None:
            record_estimates(study, strategy, state)
    except KeyboardInterrupt:
        # Ctrl-C anywhere in an iteration: the trial in flight (if any) is failed, not left RUNNING,
        # and every finished trial is already in the storage.
        if open_trial is not None:
            writing.fail_interrupted(study, open_trial)
        outcome.stopped_because = "interrupted"
    return outcome


def _expert_neighbour(space: SearchSpace, expert: TrialParams, synced: _Synced, state: SearchState,
                      settings: SearchSettings) -> TrialParams | None:
    """While the expert configuration has not run under the ceiling, its nearest neighbour not yet asked
    (:func:`autotune.search.expert.expert_fallback`): the search then returns the expert rule's
    configuration, its best runnable neighbour, or something measured faster."""
    outcomes: dict[tuple[Any, ...], ProbeResult | None] = {probe.params.key(): probe.result for probe in synced.history}
    for key in [*synced.seen, *synced.in_flight]:  # measured, pruned, or in flight elsewhere
        outcomes.setdefault(key, None)
    baseline = [state.baseline.key()] if state.baseline is not None else []
    neighbour = expert_fallback(space, expert, outcomes, synced.memory, settings.memory_ceiling_bytes, not_counted=baseline,
                                p_runs=p_runs(space, synced.history))
    return None if neighbour is None or neighbour.key() == expert.key() else neighbour


def _can_finish(params: TrialParams, synced: _Synced, available_s: float | None) -> bool:
    """Whether a probe like ``params`` typically finishes in ``available_s`` (None: no budget), judged by the
    probes already run with its compile setting: a compiled probe pays a compilation that an uncompiled
    one does not (on an H100 a compiled polyglot-ko-1.3b probe took 85 s, an uncompiled one 6-17 s)."""
    if available_s is None:
        return True
    same = [p.result.wall_s for p in synced.history if p.result.wall_s and p.params.torch_compile == params.torch_compile]
    return not same or statistics.median(same) <= available_s


def _random_allowed(
    space: SearchSpace, seen: SeenKeys, rng: random.Random, strategy: Strategy, state: SearchState
) -> TrialParams | None:
    """A random unmeasured configuration the strategy does not prune (the sampler keeps proposing pruned ones)."""
    for _ in range(200):
        params = _random_unmeasured(space, seen, rng)
        if params is None:
            return None
        if strategy.prune(params, state) is None:
            return params
    return None
