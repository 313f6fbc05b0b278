"""Strategies: one shared test class runs against every implementation; pruning in the driver."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.errors import UsageError
from autotune.params import TrialParams, baseline_params
from autotune.records import ProbeResult
from autotune.results import trials_frame
from autotune.search.loop import SearchSettings, run_search
from autotune.search.memory import MemoryModel
from autotune.search.replay import ReplayEvaluator, load_table, replay_search
from autotune.search.strategies.base import SearchState, Strategy
from autotune.search.strategies.frontier import FrontierStrategy
from autotune.search.strategies.registry import STRATEGIES, make_strategy
from autotune.space import parse_space
from tests.conftest import FakeEvaluator, GiB

optuna.logging.set_verbosity(optuna.logging.WARNING)
DATA = Path(__file__).parent / "data"
TINY = DATA / "landscape_tiny.csv"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
class TestEveryStrategy:
    def test_reaches_the_optimum_of_a_small_table(self, name) -> None:
        table = load_table(TINY)
        outcome = replay_search(table, budget_s=4 * 3600, memory_ceiling_bytes=40 * GiB, strategy=name, seed=1)
        assert outcome.best_samples_per_s == table.best_under(40 * GiB)["samples_per_s"]
        assert outcome.best_peak_mem_bytes <= 40 * GiB

    def test_never_runs_a_configuration_twice(self, name) -> None:
        table = load_table(TINY)
        evaluator = ReplayEvaluator(table)
        calls: list[TrialParams] = []
        original = evaluator.evaluate

        def spy(params, *, timeout_s):
            calls.append(params)
            return original(params, timeout_s=timeout_s)

        evaluator.evaluate = spy  # type: ignore[method-assign]
        study = optuna.create_study(direction="maximize")
        settings = SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=1800, min_probe_s=1)
        run_search(study, table.space(), evaluator, settings, baseline=baseline_params(), clock=evaluator.clock, strategy=make_strategy(name))
        assert len({p.key() for p in calls}) == len(calls)


def test_unknown_strategy_names_the_known_ones() -> None:
    with pytest.raises(UsageError, match="did you mean 'frontier'"):
        make_strategy("fronteir")


class _PruneLarge(Strategy):
    name = "prune-large"

    def sampler(self, seed):
        return optuna.samplers.RandomSampler(seed=seed)

    def prune(self, params, state):
        return "too large for this test" if params.per_device_train_batch_size >= 32 else None


def test_pruned_configurations_are_recorded_with_reason_and_cost_no_time(fake_gpu) -> None:
    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "precision": ["fp32", "bf16"]}).restrict(fake_gpu)
    fake = FakeEvaluator(probe_s=30.0)
    study = optuna.create_study(direction="maximize")
    outcome = run_search(
        study, space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=3600), baseline=baseline_params(),
        clock=fake.clock, strategy=_PruneLarge(),
    )
    assert outcome.stopped_because == "exhausted"
    assert outcome.probes_run == len(fake.calls) == 4  # bs 8 and 16, two precisions
    assert fake.clock.now() == 4 * 30.0  # pruned trials charge nothing
    pruned = [t for t in study.trials if t.user_attrs.get("status") == "pruned" and "duplicate_of" not in t.user_attrs]
    assert len(pruned) == outcome.pruned == 4
    assert all(t.state == TrialState.PRUNED and t.user_attrs["reason"] == "too large for this test" for t in pruned)
    frame = trials_frame(study, 40 * GiB)
    assert sorted(frame["status"].unique()) == ["ok", "pruned"]
    assert "predicted_peak_mem_bytes" in frame.columns
    assert frame.loc[frame["status"] == "pruned", "samples_per_s"].isna().all()
    assert not frame.loc[frame["status"] == "pruned", "feasible"].any()


def test_frontier_prunes_larger_batches_after_an_oom() -> None:
    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 48, 64]})
    state = SearchState(space, 40 * GiB, MemoryModel())
    state.memory.observe(TrialParams(per_device_train_batch_size=32), ProbeResult(status="oom"))
    strategy = FrontierStrategy()
    assert strategy.prune(TrialParams(per_device_train_batch_size=64), state) == "OOM at batch 32 in the same group"
    assert strategy.prune(TrialParams(per_device_train_batch_size=16), state) is None


def test_frontier_seeds_an_expert_configuration_at_the_predicted_largest_batch(fake_gpu) -> None:
    space = parse_space({
        "per_device_train_batch_size": [8, 16, 32, 48, 64],
        "optim": ["adamw_torch", "adamw_torch_fused"],
        "attn_implementation": ["eager", "sdpa"],
        "dataloader_num_workers": [0, 4],
    }).restrict(fake_gpu)
    fake = FakeEvaluator(oom_above_bytes=80 * GiB)
    run_search(
        optuna.create_study(direction="maximize"), space, fake, SearchSettings(memory_ceiling_bytes=20 * GiB, n_trials=2),
        baseline=baseline_params(), clock=fake.clock, strategy=FrontierStrategy(),
    )
    expert = fake.calls[1]
    assert (expert.optim, expert.attn_implementation, expert.torch_compile, expert.dataloader_num_workers) == ("adamw_torch_fused", "sdpa", "off", 4)
    # The baseline measured 5 GiB at batch 8 (FakeEvaluator: 1 GiB + 0.5 GiB/sample). Scaled in
    # proportion (an upper bound above batch 8), 32 is the largest batch predicted under 20 GiB.
    assert expert.per_device_train_batch_size == 32
    assert fake.memory_bytes(expert) <= 20 * GiB


@pytest.mark.parametrize("table, ceiling", [
    ("landscape_gptneox-1.3b-a100.csv.gz", 40), ("landscape_pythia-160m-l4.csv.gz", 16), ("landscape_llama-1b-a10g.csv.gz", 22),
])
def test_frontier_beats_plain_tpe_on_the_synthetic_landscapes(table, ceiling) -> None:
    loaded = load_table(DATA / table)
    true_best = loaded.best_under(ceiling * GiB)["samples_per_s"]
    frontier = replay_search(loaded, budget_s=1800, memory_ceiling_bytes=ceiling * GiB, strategy="frontier", seed=0)
    tpe = replay_search(loaded, budget_s=1800, memory_ceiling_bytes=ceiling * GiB, strategy="tpe", seed=0)
    assert frontier.best_samples_per_s / true_best >= 0.95
    assert frontier.best_peak_mem_bytes <= ceiling * GiB
    assert frontier.oom_probes <= tpe.oom_probes
    assert frontier.best_samples_per_s >= tpe.best_samples_per_s


def test_tune_records_predictions_and_never_returns_a_config_over_the_ceiling(tmp_path, fake_gpu) -> None:
    from autotune.api import tune

    space = parse_space({"per_device_train_batch_size": [8, 16, 24, 32, 48, 64], "gradient_checkpointing": [False, True]})
    fake = FakeEvaluator(oom_above_bytes=30 * GiB)
    result = tune(
        "tiny-gptneox", budget=None, n_trials=8, space=space, memory_ceiling="20GiB", device=fake_gpu, seq_len=128,
        storage=f"sqlite:///{tmp_path / 'study.db'}", evaluator=fake, report_dir=None, command="test",
    )
    frame = result.trials
    assert frame["predicted_peak_mem_bytes"].notna().all()  # the analytic prior predicts from the first trial
    assert result.best["peak_mem_bytes"] <= 20 * GiB
    assert result.best_params["per_device_train_batch_size"] == 32  # 1 GiB + 0.5 GiB x 32 = 17 GiB; 48 is 25 GiB
    assert result.settings["strategy"] == "frontier"
