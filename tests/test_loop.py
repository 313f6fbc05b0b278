"""The search loop against a fake evaluator: exact expectations, in milliseconds."""

from __future__ import annotations

import socket

import optuna
import pytest
from optuna.trial import TrialState

from autotune.params import TrialParams, baseline_params
from autotune.records import ProbeResult
from autotune.results import TuneResult, trials_frame
from autotune.search.loop import SearchSettings, VirtualClock, ranked_configurations, run_search
from autotune.search.ranking import noise_band
from autotune.search.strategies.baselines import tpe_sampler as make_sampler
from autotune.space import parse_space
from autotune.studies.schema import ATTR_DUPLICATE_OF, ATTR_OWNER, ATTR_REASON, ATTR_REMEASURE_OF, ATTR_REUSABLE
from tests.conftest import FakeEvaluator, GiB, NoisyEvaluator

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(storage: str | None = None, name: str = "t") -> optuna.Study:
    return optuna.create_study(study_name=name, storage=storage, direction="maximize", sampler=make_sampler(0), load_if_exists=True)


def _space(**overrides):
    data = {
        "per_device_train_batch_size": [8, 16, 32, 48, 64],
        "precision": ["fp32", "bf16"],
        "gradient_checkpointing": [False, True],
    }
    data.update(overrides)
    return parse_space(data)


def test_baseline_runs_first_and_ooms_are_pruned(fake_gpu) -> None:
    space = _space().restrict(fake_gpu)
    fake = FakeEvaluator(oom_above_bytes=20 * GiB)
    study = _study()
    outcome = run_search(
        study, space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=15), baseline=baseline_params(), clock=fake.clock
    )
    assert fake.calls[0] == TrialParams()  # bs 8, fp32, adamw_torch_fused, sdpa, no compile
    assert study.trials[0].user_attrs["role"] == "baseline"
    assert outcome.stopped_because == "n_trials"
    assert outcome.probes_run == len(fake.calls) == 15
    for trial, params in zip([t for t in study.trials if "duplicate_of" not in t.user_attrs], fake.calls):
        expected = TrialState.PRUNED if fake.memory_bytes(params) > 20 * GiB else TrialState.COMPLETE
        assert trial.state == expected
        if expected == TrialState.PRUNED:
            assert trial.user_attrs[ATTR_REASON] == "OutOfMemoryError: fake"
            assert trial.constraints["memory"] == 1.0


def test_budget_counts_probe_time_on_the_clock(fake_gpu) -> None:
    fake = FakeEvaluator(probe_s=30.0)
    outcome = run_search(
        _study(), _space().restrict(fake_gpu), fake, SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=300.0),
        baseline=baseline_params(), clock=fake.clock,
    )
    # 10 probes of 30 s fill 300 s exactly; an 11th would not finish, so it is not started.
    assert len(fake.calls) == 10
    assert fake.clock.now() == 300.0
    assert outcome.stopped_because == "budget"


def test_probe_deadline_never_passes_the_budget(fake_gpu) -> None:
    fake = FakeEvaluator(probe_s=100.0)
    settings = SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=150.0, trial_timeout_s=600.0, min_probe_s=5.0)
    study = _study()
    run_search(study, _space().restrict(fake_gpu), fake, settings, baseline=baseline_params(), clock=fake.clock)
    # The first probe takes 100 s; the second starts with 50 s left (no typical time yet is 100 s,
    # so it is not started at all).
    assert len(fake.calls) == 1
    fake2 = FakeEvaluator(probe_s=100.0)
    settings2 = SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=60.0, trial_timeout_s=600.0)
    study2 = _study()
    run_search(study2, _space().restrict(fake_gpu), fake2, settings2, baseline=baseline_params(), clock=fake2.clock)
    assert fake2.clock.now() == 60.0  # cut at the budget, not at the 600 s per-probe timeout
    assert study2.trials[0].state == TrialState.FAIL
    assert "budget ended" in study2.trials[0].user_attrs[ATTR_REASON]
    assert study2.trials[0].user_attrs[ATTR_REUSABLE] is False


def test_small_space_is_exhausted_without_repeating_a_probe(fake_gpu) -> None:
    space = parse_space({"per_device_train_batch_size": [8, 16], "precision": ["fp32", "bf16"]}).restrict(fake_gpu)
    fake = FakeEvaluator()
    outcome = run_search(_study(), space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=50), baseline=baseline_params(), clock=fake.clock)
    assert outcome.stopped_because == "exhausted"
    assert len(fake.calls) == 4
    assert len({(p.per_device_train_batch_size, p.precision) for p in fake.calls}) == 4


def test_resume_keeps_finished_trials_and_never_reruns_them(fake_gpu, tmp_path) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    space = _space().restrict(fake_gpu)
    first = FakeEvaluator()
    run_search(_study(storage), space, first, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=4), baseline=baseline_params(), clock=first.clock)
    second = FakeEvaluator()
    study = _study(storage)
    run_search(study, space, second, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=4), baseline=baseline_params(), clock=second.clock)
    assert len(second.calls) == 4
    assert TrialParams() not in second.calls  # the baseline is not enqueued again
    assert not set(first.calls) & set(second.calls)
    assert sum(t.user_attrs.get("role") == "baseline" for t in study.trials) == 1
    assert sum("duplicate_of" not in t.user_attrs for t in study.trials) == 8


def test_effective_batch_size_is_kept_by_every_trial(fake_gpu) -> None:
    space = parse_space(
        {"per_device_train_batch_size": [1, 2, 4, 8, 16, 24, 32, 64], "gradient_accumulation_steps": [1, 2], "precision": ["fp32", "bf16"]}
    ).restrict(fake_gpu, effective_batch_size=32)
    assert space.choices["per_device_train_batch_size"] == (1, 2, 4, 8, 16, 32)
    fake = FakeEvaluator()
    run_search(
        _study(), space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=12),
        baseline=baseline_params(32, space.choices["per_device_train_batch_size"]), clock=fake.clock,
    )
    assert fake.calls[0] == TrialParams(per_device_train_batch_size=8, gradient_accumulation_steps=4)
    assert all(p.effective_batch_size == 32 for p in fake.calls)


def test_ctrl_c_keeps_finished_trials(fake_gpu) -> None:
    class Interrupting(FakeEvaluator):
        def evaluate(self, params, *, timeout_s):
            if len(self.calls) == 2:
                raise KeyboardInterrupt
            return super().evaluate(params, timeout_s=timeout_s)

    fake = Interrupting()
    study = _study()
    outcome = run_search(study, _space().restrict(fake_gpu), fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=10), baseline=baseline_params(), clock=fake.clock)
    assert outcome.stopped_because == "interrupted"
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL]
    assert study.trials[2].user_attrs[ATTR_REASON] == "interrupted by the user"


def test_over_ceiling_is_measured_but_infeasible(fake_gpu) -> None:
    space = parse_space({"per_device_train_batch_size": [8, 64]}).restrict(fake_gpu)
    fake = FakeEvaluator(oom_above_bytes=80 * GiB)
    study = _study()
    outcome = run_search(study, space, fake, SearchSettings(memory_ceiling_bytes=10 * GiB, n_trials=5), baseline=baseline_params(), clock=fake.clock)
    by_batch = {r.params.per_device_train_batch_size: r for r in outcome.records}
    assert by_batch[8].feasible and not by_batch[64].feasible  # 33 GiB > 10 GiB ceiling
    big = next(t for t in study.trials if t.user_attrs["params"]["per_device_train_batch_size"] == 64)
    assert big.state == TrialState.COMPLETE and big.constraints["memory"] > 0
    assert "over the ceiling" in big.user_attrs[ATTR_REASON]


def test_failures_are_recorded_and_never_fatal(fake_gpu) -> None:
    space = parse_space({"per_device_train_batch_size": [8, 16], "precision": ["fp32", "bf16"]}).restrict(fake_gpu)
    fake = FakeEvaluator(fail_on={(16, "fp32"): "crash", (16, "bf16"): "diverged"})
    study = _study()
    outcome = run_search(study, space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=10), baseline=baseline_params(), clock=fake.clock)
    assert outcome.stopped_because == "exhausted"
    statuses = sorted(t.user_attrs["status"] for t in study.trials if "duplicate_of" not in t.user_attrs)
    assert statuses == ["crash", "diverged", "ok", "ok"]
    assert all(t.state == TrialState.FAIL for t in study.trials if t.user_attrs["status"] in ("crash", "diverged"))


def test_orphaned_running_trial_is_failed_on_resume(fake_gpu, tmp_path) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = _study(storage)
    orphan = study.ask()
    orphan.set_user_attr(ATTR_OWNER, f"{socket.gethostname()}:999999999")
    fake = FakeEvaluator()
    run_search(_study(storage), _space().restrict(fake_gpu), fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=1), clock=fake.clock)
    trial = _study(storage).trials[0]
    assert trial.state == TrialState.FAIL
    assert "gone" in trial.user_attrs[ATTR_REASON]


@pytest.mark.parametrize("status", ["timeout", "crash", "diverged", "oom"])
def test_each_status_maps_to_one_state(fake_gpu, status) -> None:
    class Always:
        def evaluate(self, params, *, timeout_s):
            return ProbeResult(status=status, error="x", wall_s=1.0)

    study = _study()
    run_search(study, _space().restrict(fake_gpu), Always(), SearchSettings(memory_ceiling_bytes=GiB, n_trials=1), baseline=baseline_params(), clock=VirtualClock())
    expected = TrialState.PRUNED if status == "oom" else TrialState.FAIL
    assert study.trials[0].state == expected


@pytest.mark.parametrize("where", ["on_start", "on_trial"])
def test_ctrl_c_between_probes_leaves_no_running_trial(fake_gpu, where) -> None:
    calls = {"n": 0}

    def interrupt(*args) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    fake = FakeEvaluator()
    study = _study()
    outcome = run_search(
        study, _space().restrict(fake_gpu), fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=10),
        baseline=baseline_params(), clock=fake.clock, **{where: interrupt},
    )
    assert outcome.stopped_because == "interrupted"
    states = [t.state for t in study.trials]
    assert TrialState.RUNNING not in states
    assert states[0] == TrialState.COMPLETE
    # on_start fires after ask and before the probe: that trial fails; on_trial fires after the tell.
    assert states[-1] == (TrialState.FAIL if where == "on_start" else TrialState.COMPLETE)


# ---------------------------------------------------------------------------------------- near-ties


def _batch_space(fake_gpu, batches=(8, 16, 32, 64)):
    return parse_space({"per_device_train_batch_size": list(batches), "precision": ["fp32"]}).restrict(fake_gpu)


def _search(fake_gpu, fake: NoisyEvaluator, study=None, **settings):
    study = study or _study()
    settings.setdefault("memory_ceiling_bytes", 40 * GiB)
    batches = sorted(fake.script)
    outcome = run_search(study, _batch_space(fake_gpu, batches), fake, SearchSettings(**settings), clock=fake.clock)
    return study, outcome


def _remeasures(study: optuna.Study) -> dict[int, int]:
    """Batch size of each re-measure -> the trial it re-measures."""
    return {t.params["per_device_train_batch_size"]: t.user_attrs[ATTR_REMEASURE_OF]
            for t in study.trials if ATTR_REMEASURE_OF in t.user_attrs}


def _first_trial(study: optuna.Study, batch: int) -> int:
    return min(t.number for t in study.trials if t.params.get("per_device_train_batch_size") == batch)


def test_near_tie_is_remeasured_and_the_best_is_decided_by_the_mean(fake_gpu) -> None:
    # 64 measures 1% below 32 at first; measured again, 32 drops to 98.5 and 64 rises to 101.
    fake = NoisyEvaluator({8: [50.0], 16: [80.0], 32: [100.0, 98.5], 64: [99.0, 101.0]})
    study, outcome = _search(fake_gpu, fake)
    assert outcome.stopped_because == "exhausted"
    assert fake.calls[4:] == [32, 64]  # the best first, each once; 8 and 16 are far behind
    assert outcome.probes_run == 6 and outcome.remeasures == 2
    assert _remeasures(study) == {32: _first_trial(study, 32), 64: _first_trial(study, 64)}
    again = [t for t in study.trials if ATTR_REMEASURE_OF in t.user_attrs]
    assert all(t.state == TrialState.COMPLETE and ATTR_DUPLICATE_OF not in t.user_attrs for t in again)
    assert [r.remeasure_of for r in outcome.records[4:]] == [_first_trial(study, 32), _first_trial(study, 64)]

    result = TuneResult("t", "memory", trials_frame(study, 40 * GiB), settings={"memory_ceiling_bytes": 40 * GiB})
    ranked = result.ranked()
    assert list(ranked["per_device_train_batch_size"]) == [64, 32, 16, 8]  # one row per configuration
    assert list(ranked["samples_per_s"]) == [100.0, 99.25, 80.0, 50.0]
    assert list(ranked["n_measurements"]) == [2, 2, 1, 1]
    assert result.best_params["per_device_train_batch_size"] == 64  # by a single probe it would be 32
    assert int(result.best["trial"]) == _first_trial(study, 64)
    assert len(result.trials) == 6  # trials: one row per probe


def test_the_searchs_estimates_are_stored_when_it_ends_and_order_its_near_ties_until_the_study_goes_on(fake_gpu) -> None:
    """After the near-ties were measured again, the strategy's estimates (given every probe) are stored with
    the study; the ranking, the result and its note read them. A probe added since makes them stale: the means decide."""
    from autotune.search.strategies.base import SearchState, Strategy
    from autotune.studies import reading, writing

    class Estimating(Strategy):  # its model, say, puts 32 ahead of 64 (within the noise of each other)
        name = "estimating"

        def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
            return make_sampler(seed)

        def estimates(self, state: SearchState) -> dict:
            return {c.params.key(): 120.0 if c.params.per_device_train_batch_size == 32 else c.mean_samples_per_s for c in state.feasible()}

    fake = NoisyEvaluator({8: [50.0], 16: [80.0], 32: [99.0, 99.0], 64: [100.0, 100.0]})
    study = _study()
    run_search(study, _batch_space(fake_gpu, [8, 16, 32, 64]), fake, SearchSettings(memory_ceiling_bytes=40 * GiB), clock=fake.clock,
               strategy=Estimating())
    probes = reading.stored_probes(study)
    assert reading.estimates(study, len(probes)) is not None and len(probes) == 6  # after the two re-measures
    assert [c.params.per_device_train_batch_size for c in ranked_configurations(study, 40 * GiB)][:2] == [32, 64]
    result = TuneResult("t", "memory", trials_frame(study, 40 * GiB), settings={"memory_ceiling_bytes": 40 * GiB})
    assert result.best_params["per_device_train_batch_size"] == 32
    assert result.best["estimated_samples_per_s"] == 120.0
    note = result.order_note()
    assert note is not None and "bs64x1" in note and "measured 1.0% faster" in note and "puts it 20.0% ahead" in note
    # Another probe since: the stored estimates rest on six probes, not seven, and the means decide again.
    trial = writing.ask(study)
    params = TrialParams(per_device_train_batch_size=8, dataloader_num_workers=2)
    writing.record_params(trial, params)
    writing.record_outcome(study, trial, params, ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=GiB, wall_s=1.0), 40 * GiB)
    assert reading.estimates(study, len(reading.stored_probes(study))) is None
    assert ranked_configurations(study, 40 * GiB)[0].params.per_device_train_batch_size == 64
    assert TuneResult("t", "memory", trials_frame(study, 40 * GiB), settings={"memory_ceiling_bytes": 40 * GiB}).order_note() is None


def test_a_configuration_whose_probes_disagree_is_unstable_and_measured_a_third_time(fake_gpu) -> None:
    # 32's two probes are 4% apart, twice the noise band: a third probe decides, once; 64's agree.
    fake = NoisyEvaluator({8: [50.0], 16: [80.0], 32: [100.0, 96.0, 97.0], 64: [99.0, 99.5]})
    study, outcome = _search(fake_gpu, fake)
    assert fake.calls[4:] == [32, 64, 32]
    assert outcome.remeasures == 3
    ranked = ranked_configurations(study, 40 * GiB)
    by_batch = {c.params.per_device_train_batch_size: c for c in ranked}
    assert by_batch[32].n_measurements == 3 and by_batch[32].unstable  # flagged: its probes disagree
    assert not by_batch[64].unstable and by_batch[64].n_measurements == 2
    assert ranked[0].params.per_device_train_batch_size == 64  # 99.25 against 32's mean of 97.67


@pytest.mark.parametrize(("ci95_rel", "remeasured"), [(None, False), (0.005, False), (0.02, True)])
def test_noise_band_is_2_percent_or_twice_the_probe_ci(fake_gpu, ci95_rel, remeasured) -> None:
    # 64 is 3% below 32: beyond the 2% floor, within 2 x a 2% CI.
    fake = NoisyEvaluator({8: [50.0], 32: [100.0, 100.0], 64: [97.0, 97.0]}, ci95_rel=ci95_rel)
    study, outcome = _search(fake_gpu, fake)
    assert noise_band(ci95_rel, None) == max(0.02, 2 * (ci95_rel or 0.0))
    assert outcome.remeasures == (2 if remeasured else 0)
    assert sorted(_remeasures(study)) == ([32, 64] if remeasured else [])


def test_at_most_the_top_three_are_remeasured_after_n_trials(fake_gpu) -> None:
    # Five configurations within 1%: the three fastest are probed again, once each.
    script = {8: [99.0, 99.0], 16: [99.5, 99.5], 32: [100.0, 100.0], 64: [99.2, 99.2], 96: [99.7, 99.7]}
    fake = NoisyEvaluator(script)
    study, outcome = _search(fake_gpu, fake, n_trials=5)
    assert outcome.stopped_because == "n_trials"
    assert fake.calls[5:] == [32, 96, 16]
    assert outcome.remeasures == 3 and outcome.probes_run == 8

    # Resumed, the contenders already have two probes each: none is probed a third time.
    calls = len(fake.calls)
    _, again = _search(fake_gpu, fake, study=study, n_trials=0)
    assert len(fake.calls) == calls and again.remeasures == 0


@pytest.mark.parametrize("budget_s", [45.0, 60.0, 90.0, 120.0, 150.0, 170.0, 180.0, 200.0, 240.0, 400.0])
def test_remeasuring_never_exceeds_the_budget(fake_gpu, budget_s) -> None:
    fake = NoisyEvaluator({b: [100.0, 100.0] for b in (8, 16, 32, 64)})  # all tied
    study, outcome = _search(fake_gpu, fake, budget_s=budget_s, min_probe_s=1.0)
    assert fake.clock.now() <= budget_s
    assert outcome.probes_run == len(fake.calls)
    # Time for re-measuring is reserved: a tie found with time to spare is always probed again.
    if budget_s >= 90.0:
        assert outcome.remeasures >= 1


def test_budget_reserves_time_for_the_near_ties(fake_gpu) -> None:
    # 30 s probes, 120 s: the time kept for near-ties is one typical probe (more than 10% of the
    # budget): three exploring probes (90 s), then the 30 s kept re-measure the best of the ties.
    fake = NoisyEvaluator({b: [100.0, 100.0] for b in (8, 16, 32, 64)})
    study, outcome = _search(fake_gpu, fake, budget_s=120.0, min_probe_s=1.0)
    assert outcome.stopped_because == "budget"
    assert len(fake.calls) == 4 and outcome.remeasures == 1
    assert fake.clock.now() == 120.0
    # 1,000 s: 10% of it (100 s) is kept, three re-measures; the rest explores (all four batches).
    fake = NoisyEvaluator({b: [100.0, 100.0] for b in (8, 16, 32, 64)})
    study, outcome = _search(fake_gpu, fake, budget_s=1000.0, min_probe_s=1.0)
    assert outcome.probes_run - outcome.remeasures == 4 and outcome.remeasures == 3


def test_the_strategy_is_told_the_time_kept_for_the_near_ties(fake_gpu) -> None:
    """Once two configurations are near-tied, each measured once, the strategy is told that the loop
    keeps their two re-measures (30 s each) of the time left (``SearchState.kept_s``)."""
    from autotune.search.strategies.baselines import RandomStrategy

    seen: list[tuple[float, float | None, float]] = []

    class Recording(RandomStrategy):
        """The near-tied pair first, then the rest: proposals go on after the tie, whatever a random stream draws."""

        def propose(self, state):
            seen.append((fake.clock.now(), state.remaining_s, state.kept_s))
            order = [state.space.with_changes(state.space.baseline(), per_device_train_batch_size=b) for b in (32, 64, 8, 16, 96)]
            return next((p for p in order if p.key() not in state.seen), None)

    fake = NoisyEvaluator({8: [50.0], 16: [80.0], 32: [100.0, 100.0], 64: [99.5, 99.5], 96: [60.0]})
    run_search(_study(), _batch_space(fake_gpu, (8, 16, 32, 64, 96)), fake,
               SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=1000.0, min_probe_s=1.0), clock=fake.clock, strategy=Recording())
    tied_from = 30.0 * (1 + max(fake.calls.index(32), fake.calls.index(64)))  # both measured once by then
    assert any(now >= tied_from for now, _, _ in seen)
    assert all(left == 1000.0 - now and kept == (60.0 if now >= tied_from else 0.0) for now, left, kept in seen)


def test_long_near_tie_probes_do_not_stop_exploring(fake_gpu) -> None:
    """A near-tie whose re-measure would take more than a tenth of the budget (and more than a typical
    probe) keeps no time from exploring: deciding a tie within noise is worth less than the probes it
    would cost; a re-measure still runs if time is left at the end."""
    import dataclasses

    from autotune.search.loop import REMEASURE_RESERVE_FRACTION, _remeasure_cost_s

    fake = NoisyEvaluator({8: [100.0, 100.0], 16: [100.5, 100.5]})
    study, _ = _search(fake_gpu, fake, n_trials=2)
    contenders = ranked_configurations(study, 40 * GiB)
    long_ties = [dataclasses.replace(c, wall_s=300.0) for c in contenders]
    budget_s = 1800.0
    keep_s = max(REMEASURE_RESERVE_FRACTION * budget_s, 90.0)
    assert _remeasure_cost_s(long_ties, 90.0, keep_s, 1.0) == 0.0
    assert _remeasure_cost_s(long_ties, 90.0, 1800.0, 1.0) == 600.0  # the old rule kept 600 s of 1,800


def test_no_remeasure_without_a_near_tie(fake_gpu) -> None:
    fake = NoisyEvaluator({8: [50.0], 16: [80.0], 32: [100.0]})
    study, outcome = _search(fake_gpu, fake)
    assert outcome.remeasures == 0 and len(fake.calls) == 3 and _remeasures(study) == {}


def test_a_configuration_fits_only_if_every_probe_fits(fake_gpu) -> None:
    # 32 OOMs when probed again: it is not reliably under the ceiling, so 64 is the best.
    fake = NoisyEvaluator({8: [50.0], 32: [100.0, "oom"], 64: [99.0, 99.0]})
    study, _ = _search(fake_gpu, fake)
    result = TuneResult("t", "memory", trials_frame(study, 40 * GiB), settings={"memory_ceiling_bytes": 40 * GiB})
    assert list(result.ranked()["per_device_train_batch_size"]) == [64, 8]
    assert result.best_params["per_device_train_batch_size"] == 64
    assert ranked_configurations(study, 40 * GiB)[0].params.per_device_train_batch_size == 64


@pytest.mark.parametrize("where", ["probe", "on_start"])
def test_ctrl_c_during_a_remeasure_fails_that_trial_only(fake_gpu, where) -> None:
    script = {8: [50.0], 32: [100.0, 100.0], 64: [99.0, 99.0]}
    fake = NoisyEvaluator(script, interrupt_at_call=4 if where == "probe" else None)
    starts: list[int] = []

    def on_start(number: int, params: TrialParams) -> None:
        starts.append(number)
        if where == "on_start" and len(starts) == 5:
            raise KeyboardInterrupt

    study = _study()
    outcome = run_search(study, _batch_space(fake_gpu, (8, 32, 64)), fake, SearchSettings(memory_ceiling_bytes=40 * GiB),
                         clock=fake.clock, on_start=on_start)
    assert outcome.stopped_because == "interrupted"
    assert TrialState.RUNNING not in [t.state for t in study.trials]
    probes = [t for t in study.trials if ATTR_DUPLICATE_OF not in t.user_attrs]  # the sampler's repeats left out
    assert [t.state for t in probes] == [TrialState.COMPLETE] * 4 + [TrialState.FAIL]  # 3 explored, 32 again, 64 cut
    assert probes[-1].user_attrs[ATTR_REASON] == "interrupted by the user"
    assert probes[-1].user_attrs[ATTR_REMEASURE_OF] == _first_trial(study, 64)
    result = TuneResult("t", "memory", trials_frame(study, 40 * GiB), settings={"memory_ceiling_bytes": 40 * GiB})
    assert list(result.ranked()["n_measurements"]) == [2, 1, 1]  # the interrupted probe measured nothing


def test_speedup_compares_means_when_the_baseline_is_re_measured(fake_gpu) -> None:
    # The baseline (bs 8) first measures 100, then 90; bs 16 measures 99 twice: 16 wins on the mean.
    fake = NoisyEvaluator({8: [100.0, 90.0], 16: [99.0, 99.0]})
    study = _study()
    run_search(study, _batch_space(fake_gpu, [8, 16]), fake, SearchSettings(memory_ceiling_bytes=40 * GiB),
               baseline=baseline_params(), clock=fake.clock)
    assert fake.calls == [8, 16, 8, 16]
    result = TuneResult("t", "memory", trials_frame(study, 40 * GiB), settings={"memory_ceiling_bytes": 40 * GiB})
    assert result.best_params["per_device_train_batch_size"] == 16
    assert result.baseline_samples_per_s == pytest.approx(95.0)
    assert result.speedup == pytest.approx(99.0 / 95.0)  # > 1, though 16's probes were slower than the baseline's first


def test_an_unstable_configuration_is_flagged_in_the_terminal_and_the_report(fake_gpu) -> None:
    from rich.console import Console

    from autotune.console import print_summary
    from autotune.report.model import build_report_model

    fake = NoisyEvaluator({8: [50.0], 16: [80.0], 32: [100.0, 96.0, 97.0], 64: [99.0, 99.5]})
    study, _ = _search(fake_gpu, fake)
    result = TuneResult("t", "memory", trials_frame(study, 40 * GiB), settings={"memory_ceiling_bytes": 40 * GiB})
    assert list(result.ranked()["unstable"]) == [False, True, False, False]
    console = Console(width=200, record=True)
    print_summary(console, result)
    assert "1 configuration unstable: its probes disagree beyond the noise band" in console.export_text()
    model = build_report_model(result)
    flags = [cell.text for row in model.rows for column, cell in zip(model.columns, row.cells) if column.key == "flags"]
    assert sum("unstable (probes 4% apart)" in f for f in flags) == 1


def test_the_expert_rule_runs_right_after_the_baseline_as_a_named_reference(fake_gpu) -> None:
    from autotune.search.expert import expert_params

    space = _space(optim=["adamw_torch", "adamw_torch_fused"], torch_compile=["off", "inductor"],
                   attn_implementation=["eager", "sdpa"]).restrict(fake_gpu)
    # No model dims: the memory model knows nothing yet, so the expert takes the largest batch of the space.
    expert = expert_params(space, baseline_params(), None, 40 * GiB)
    assert expert == TrialParams(per_device_train_batch_size=64, precision="bf16", optim="adamw_torch_fused",
                                 torch_compile="inductor", attn_implementation="sdpa")
    fake = FakeEvaluator()
    study = _study()
    run_search(study, space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=4), baseline=baseline_params(),
               expert=expert, clock=fake.clock)
    assert fake.calls[:2] == [baseline_params(), expert]
    assert [t.user_attrs.get("role") for t in study.trials[:2]] == ["baseline", "expert"]
    # A resumed study does not run it again.
    fake2 = FakeEvaluator()
    run_search(study, space, fake2, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=2), baseline=baseline_params(),
               expert=expert, clock=fake2.clock)
    assert expert not in fake2.calls and baseline_params() not in fake2.calls


def test_the_expert_batch_is_the_largest_the_memory_model_says_fits(fake_gpu) -> None:
    from autotune.search.expert import expert_params

    class Memory:  # a fixed frontier: batch 24 fits, 32 does not
        def largest_batch_that_fits(self, params, batches, ceiling):
            assert params.precision == "bf16" and not params.gradient_checkpointing
            return max(b for b in batches if b <= 24)

    space = _space(per_device_train_batch_size=[8, 16, 24, 32], gradient_checkpointing=[True, False])
    assert expert_params(space, baseline_params(), Memory(), 40 * GiB).per_device_train_batch_size == 24
    fixed = parse_space({"per_device_train_batch_size": [8, 16, 24, 32], "precision": ["fp32", "bf16"]}).restrict(
        fake_gpu, effective_batch_size=32)
    # Under a fixed effective batch of 32 only divisors of it are candidates: 24 is not one.
    assert expert_params(fixed, baseline_params(32, (8, 16, 24, 32)), Memory(), 40 * GiB).per_device_train_batch_size == 16


def test_a_tie_goes_to_the_prior_not_to_chance() -> None:
    """#44: within the noise of the fastest, the expert rule's preferences decide (16-bit over fp32),
    then the mean; beyond it, speed alone."""
    from autotune.records import Probe
    from autotune.search.ranking import near_ties, rank_configurations

    def probe(number: int, sps: float, **changes) -> Probe:
        params = TrialParams(per_device_train_batch_size=16, dataloader_num_workers=2).replace(**changes)
        return Probe(number, params, ProbeResult(status="ok", samples_per_s=sps, peak_mem_bytes=GiB, wall_s=30.0))

    # The loader sets the pace: every precision measures alike, fp32 luckiest; a 16-bit one is returned
    # (the faster of the two 16-bit formats: the prior ranks precisions by class, 16-bit, tf32, fp32).
    tied = [probe(0, 101.0, precision="fp32"), probe(1, 100.0, precision="tf32"), probe(2, 99.5, precision="bf16"),
            probe(3, 99.8, precision="fp16"), probe(4, 80.0, precision="bf16", per_device_train_batch_size=8)]
    ranked = rank_configurations(tied, 40 * GiB)
    assert [c.params.precision for c in ranked] == ["fp16", "bf16", "tf32", "fp32", "bf16"]
    assert ranked[-1].params.per_device_train_batch_size == 8  # outside the noise: ranked by speed
    assert {c.params.precision for c in near_ties(ranked)} == {"bf16", "fp16", "tf32"}  # the three contenders in the prior's order
    # Only the precision's class orders a tie: within one, the faster kernel stays first.
    kernels = rank_configurations([probe(0, 100.0, precision="bf16", attn_implementation="eager"),
                                   probe(1, 99.0, precision="bf16", attn_implementation="sdpa")], 40 * GiB)
    assert kernels[0].params.attn_implementation == "eager"
    # Beyond the noise band speed wins, whatever the prior says.
    apart = rank_configurations([probe(0, 110.0, precision="fp32"), probe(1, 100.0, precision="bf16")], 40 * GiB)
    assert [c.params.precision for c in apart] == ["fp32", "bf16"]
    # Within one precision the mean decides among equals of the prior (batch and workers are not ordered by it).
    same = rank_configurations([probe(0, 100.0, precision="bf16"), probe(1, 101.0, precision="bf16", dataloader_num_workers=4)], 40 * GiB)
    assert same[0].params.dataloader_num_workers == 4
    # On a CPU the prior is the expert rule's there (autocast's 16 bits emulated): a tie goes to fp32, the
    # same probes otherwise ranked alike.
    on_cpu = rank_configurations(tied, 40 * GiB, gpu=False)
    assert [c.params.precision for c in on_cpu] == ["fp32", "tf32", "fp16", "bf16", "bf16"]
    faster_bf16 = [probe(0, 110.0, precision="bf16"), probe(1, 100.0, precision="fp32")]
    assert [c.params.precision for c in rank_configurations(faster_bf16, 40 * GiB, gpu=False)] == ["bf16", "fp32"]  # beyond the noise, speed wins


def test_within_the_noise_the_searchs_estimate_orders_equals_of_the_prior_and_never_overrules_it() -> None:
    """Two bf16 configurations 1 % apart, each measured once: the search's estimate from all its probes
    (the throughput model's) orders them, where it left one for each; the prior's order comes first, and
    beyond the noise band the measurements alone decide."""
    from autotune.records import Probe
    from autotune.search.ranking import rank_configurations

    def probe(number: int, sps: float, **changes) -> Probe:
        params = TrialParams(per_device_train_batch_size=16, precision="bf16").replace(**changes)
        return Probe(number, params, ProbeResult(status="ok", samples_per_s=sps, peak_mem_bytes=GiB, wall_s=30.0))

    probes = [probe(0, 101.0, attn_implementation="sdpa"), probe(1, 100.0, attn_implementation="flash_attention_2")]
    assert rank_configurations(probes, 40 * GiB)[0].number == 0  # by the mean
    assert rank_configurations(probes, 40 * GiB, estimates={0: 99.0, 1: 102.0})[0].number == 1  # by the estimate
    assert rank_configurations(probes, 40 * GiB, estimates={1: 102.0})[0].number == 0  # not every one has one: the mean
    prior = [probe(0, 101.0, precision="fp32"), probe(1, 100.0)]
    assert rank_configurations(prior, 40 * GiB, estimates={0: 110.0, 1: 100.0})[0].params.precision == "bf16"  # the prior first
    apart = [probe(0, 110.0), probe(1, 100.0, attn_implementation="sdpa")]
    assert rank_configurations(apart, 40 * GiB, estimates={0: 100.0, 1: 120.0})[0].number == 0  # beyond the noise: measured


def test_a_crashing_expert_gets_its_nearest_runnable_neighbour_measured(fake_gpu) -> None:
    """#44: the expert configuration crashes (bf16 at start-up); the loop measures its neighbours, the
    other 16-bit format first, until one runs under the ceiling, then leaves the rest to the strategy."""
    from autotune.search.expert import expert_params

    space = _space(precision=["fp32", "fp16", "bf16"], optim=["adamw_torch", "adamw_torch_fused"]).restrict(fake_gpu)
    expert = expert_params(space, baseline_params(), None, 40 * GiB)
    assert expert.precision == "bf16" and expert.per_device_train_batch_size == 64
    fake = FakeEvaluator(oom_above_bytes=40 * GiB, fail_on={(64, "bf16"): "crash"})
    run_search(_study(), space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=4), baseline=baseline_params(),
               expert=expert, clock=fake.clock)
    assert fake.calls[1] == expert and fake.calls[2] == expert.replace(precision="fp16")  # it runs: no further neighbour


def test_an_expert_out_of_memory_is_followed_by_a_smaller_batch(fake_gpu) -> None:
    from autotune.search.expert import expert_fallback

    space = _space().restrict(fake_gpu)
    expert = TrialParams(per_device_train_batch_size=64, precision="bf16")
    oom = ProbeResult(status="oom", error="OutOfMemoryError", wall_s=30.0)
    ok = ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=GiB, wall_s=30.0)
    assert expert_fallback(space, expert, {}, None, 40 * GiB) == expert  # not asked yet
    smaller = expert_fallback(space, expert, {expert.key(): oom}, None, 40 * GiB)
    assert smaller == expert.replace(per_device_train_batch_size=32)  # half of it
    assert expert_fallback(space, expert, {expert.key(): oom, smaller.key(): ok}, None, 40 * GiB) is None
    # At the smallest batch: one setting lightened at a time (checkpointing, then an optimizer with less state,
    # 8-bit AdamW first), then checkpointing and the optimizer with the least state the space holds, together.
    small = expert.replace(per_device_train_batch_size=8)
    frugal_space = _space(optim=["adamw_torch_fused", "adamw_bnb_8bit", "adafactor"])  # as on a GPU with bitsandbytes
    outcomes: dict = {small.key(): oom}
    asked = []
    while (neighbour := expert_fallback(frugal_space, small, outcomes, None, 40 * GiB)) is not None:
        asked.append(neighbour)
        outcomes[neighbour.key()] = oom
    assert asked[:4] == [small.replace(gradient_checkpointing=True), small.replace(optim="adamw_bnb_8bit"), small.replace(optim="adafactor"),
                         small.replace(gradient_checkpointing=True, optim="adafactor")]


def test_the_expert_fallback_stops_after_its_failures_when_each_out_of_memory_moves_the_memory_models_batch() -> None:
    """A neighbour's batch is the largest the memory model predicts to fit, and each out-of-memory lowers that
    prediction, so the same step of the walk names another batch every time. The walk counts the failures
    measured, not the neighbours it reaches now: before, draw 3400035 stepped 32 -> 24 -> 16 -> 8 -> 4 with
    8-bit AdamW and checkpointing, 14 failed probes, and its search found nothing that fits."""
    from autotune.search.expert import MAX_FALLBACK_PROBES, expert_fallback
    from autotune.space import parse_space

    space = parse_space({"per_device_train_batch_size": [1, 2, 4, 8, 16, 24, 32], "precision": ["fp32", "bf16"],
                         "gradient_checkpointing": [False, True], "optim": ["adamw_torch_fused", "adamw_bnb_8bit", "adafactor"]})
    outcomes: dict = {}

    class Moving:  # predicts one batch size less for every out-of-memory so far
        def largest_batch_that_fits(self, params: TrialParams, batches: list[int], ceiling_bytes: int) -> int:
            ordered = sorted(batches)
            return ordered[max(0, len(ordered) - 1 - len(outcomes))]

    oom = ProbeResult(status="oom", error="OutOfMemoryError", wall_s=30.0)
    baseline = TrialParams(per_device_train_batch_size=8)
    outcomes[baseline.key()] = oom  # the baseline's failure is not the walk's
    expert = TrialParams(per_device_train_batch_size=1, precision="bf16", optim="adamw_torch_fused")
    asked = []
    while (neighbour := expert_fallback(space, expert, outcomes, Moving(), 40 * GiB, not_counted=[baseline.key()])) is not None:
        assert len(asked) <= 2 * MAX_FALLBACK_PROBES, [p.short() for p in asked]
        asked.append(neighbour)
        outcomes[neighbour.key()] = oom
    assert asked[0] == expert and len(asked) == 1 + MAX_FALLBACK_PROBES  # the expert and its neighbours, then the strategy


def test_the_expert_fallback_measures_the_neighbour_likeliest_to_run_after_the_failures_so_far() -> None:
    """A card where bf16 and flash attention both crash (second-generator draw 4600124): one setting at a
    time, breadth first, the walk spent its failures on bf16 and flash combinations and stopped before fp16
    with sdpa, two settings from the expert's. With the failure model's P(runs), once bf16 crashed in two
    contexts the next neighbour leaves bf16, and the walk reaches fp16 with sdpa."""
    from autotune.records import Probe
    from autotune.search.expert import MAX_FALLBACK_PROBES, expert_fallback
    from autotune.search.strategies.failures import p_runs
    from autotune.space import parse_space

    space = parse_space({"per_device_train_batch_size": [2, 4], "precision": ["fp32", "fp16", "bf16"], "attn_implementation": ["sdpa", "flash_attention_2"],
                         "torch_compile": ["off", "inductor"], "optim": ["adamw_torch", "adamw_torch_fused"]})
    expert = TrialParams(per_device_train_batch_size=2, precision="bf16", attn_implementation="flash_attention_2", torch_compile="inductor",
                         optim="adamw_torch_fused")
    ok = ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=GiB, wall_s=30.0)

    def result(params: TrialParams) -> ProbeResult:
        crashes = params.precision == "bf16" or params.attn_implementation == "flash_attention_2"
        return ProbeResult(status="crash", error="RuntimeError", wall_s=20.0, setup_s=10.0) if crashes else ok

    def walk(ordered: bool) -> list[TrialParams]:
        outcomes: dict = {}
        history: list[Probe] = []
        while (neighbour := expert_fallback(space, expert, outcomes, None, 40 * GiB,
                                            p_runs=p_runs(space, history) if ordered else None)) is not None:
            outcomes[neighbour.key()] = result(neighbour)
            history.append(Probe(len(history), neighbour, outcomes[neighbour.key()]))
        return history

    ordered = walk(True)
    assert ordered[-1].result.ok and ordered[-1].params.precision == "fp16" and ordered[-1].params.attn_implementation == "sdpa"
    assert len(ordered) <= 1 + MAX_FALLBACK_PROBES
    breadth_first = walk(False)  # as before: no neighbour ran
    assert not any(p.result.ok for p in breadth_first) and len(breadth_first) == 1 + MAX_FALLBACK_PROBES


def test_an_expert_whose_optimizer_state_does_not_fit_gets_a_lighter_optimizer_at_the_largest_batch_that_fits() -> None:
    """A 1.5 B-parameter model under a 24 GiB ceiling: fused AdamW's state alone is over it, with or without
    checkpointing. After checkpointing (predicted over too, so at the smallest batch), the expert's next step
    is 8-bit AdamW without checkpointing at the largest batch the memory model predicts to fit (before: the
    frugal pair, checkpointing and Adafactor, at batch 1, and the strategy took over from there)."""
    from autotune.search.expert import expert_fallback, expert_params
    from autotune.search.memory import MemoryModel
    from autotune.search.memory_prior import ModelDims
    from autotune.space import parse_space

    dims = ModelDims(num_parameters=1_500_000_000, num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=32000, intermediate_size=8192)
    memory = MemoryModel(dims, 1024)
    space = parse_space({"per_device_train_batch_size": [1, 2, 4, 8, 16], "precision": ["fp32", "bf16"], "gradient_checkpointing": [False, True],
                         "optim": ["adamw_torch_fused", "adamw_bnb_8bit", "adafactor"], "torch_compile": ["off", "inductor"]})
    expert = expert_params(space, TrialParams(), memory, 24 * GiB)
    assert (expert.optim, expert.per_device_train_batch_size, expert.gradient_checkpointing) == ("adamw_torch_fused", 1, False)
    oom = ProbeResult(status="oom", error="OutOfMemoryError", wall_s=30.0)
    checkpointed = expert_fallback(space, expert, {expert.key(): oom}, memory, 24 * GiB)
    assert checkpointed == expert.replace(gradient_checkpointing=True)
    lighter = expert_fallback(space, expert, {expert.key(): oom, checkpointed.key(): oom}, memory, 24 * GiB)
    assert lighter is not None and (lighter.optim, lighter.gradient_checkpointing) == ("adamw_bnb_8bit", False)
    assert lighter.per_device_train_batch_size == memory.largest_batch_that_fits(lighter, [1, 2, 4, 8, 16], 24 * GiB) == 4


def test_an_expert_fallback_that_cannot_finish_in_the_time_left_is_not_started(fake_gpu) -> None:
    """As on an H100 (2026-11-27): the compiled expert ran out of memory after its compilation, and its compiled
    fallback, started with less time left than a compilation takes, was killed at the budget's end."""

    class CompileCosts(FakeEvaluator):
        def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
            self.probe_s = 80.0 if params.torch_compile != "off" else 10.0
            return super().evaluate(params, timeout_s=timeout_s)

    space = _space(torch_compile=["off", "inductor"]).restrict(fake_gpu)
    expert = TrialParams(per_device_train_batch_size=64, precision="bf16", torch_compile="inductor")
    from autotune.search.strategies.registry import make_strategy

    fake = CompileCosts(oom_above_bytes=30 * GiB)
    settings = SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=160.0, min_probe_s=5.0)
    run_search(_study(), space, fake, settings, baseline=baseline_params(), expert=expert, clock=fake.clock, strategy=make_strategy("bayes"))
    assert fake.calls[:2] == [TrialParams(), expert]  # baseline 10 s, expert 80 s: out of memory, 70 s left
    assert all(p.torch_compile == "off" for p in fake.calls[2:]) and len(fake.calls) > 2  # uncompiled probes use the rest
    # With the time for it, the compiled fallback runs next.
    fake = CompileCosts(oom_above_bytes=30 * GiB)
    run_search(_study(name="t2"), space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=400.0, min_probe_s=5.0),
               baseline=baseline_params(), expert=expert, clock=fake.clock, strategy=make_strategy("bayes"))
    assert fake.calls[2].torch_compile == "inductor" and fake.calls[2].per_device_train_batch_size < 64


def test_on_a_cpu_the_expert_keeps_the_baselines_precision(fake_gpu) -> None:
    from autotune.search.expert import expert_params

    space = _space(optim=["adamw_torch", "adamw_torch_fused"]).restrict(fake_gpu)
    assert expert_params(space, baseline_params(), None, 40 * GiB, gpu=False).precision == "fp32"
    assert expert_params(space, baseline_params(), None, 40 * GiB).precision == "bf16"
