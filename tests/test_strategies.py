"""Strategies: one shared test class runs against every implementation; pruning in the driver."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from autotune.errors import UsageError
from autotune.params import TrialParams, baseline_params
from autotune.records import Probe, ProbeResult, ProbeStatus
from autotune.results import trials_frame
from autotune.search.loop import SearchSettings, VirtualClock, ranked_configurations, run_search
from autotune.search.memory import MemoryModel
from autotune.search.replay import ReplayEvaluator, load_table, replay_search
from autotune.search.strategies.base import SearchState, SeenKeys, Strategy
from autotune.search.strategies.bayes import fit, questions, throughput
from autotune.search.strategies.bayes import strategy as bayes_strategy
from autotune.search.strategies.bayes.groups import MemoryEvidence
from autotune.search.strategies.bayes.strategy import BayesStrategy, pending_probes
from autotune.search.strategies.failures import COMPILED, CRASH, DIVERGENCE, FailureModel
from autotune.search.strategies.registry import DEFAULT_STRATEGY, STRATEGIES, make_strategy
from autotune.search.strategies.surrogate import Grid
from autotune.space import SearchSpace, parse_space
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


    def test_searches_only_the_users_values_where_the_baseline_added_its_own(self, name) -> None:
        # A space file without fp32 and without 0 loader workers (the H200 offload study listed bf16 alone, and the search
        # spent five of eight probes on fp32): the baseline's values join the space so it can run, and only it, the
        # expert rule's row and that row's neighbours use them.
        table = load_table(TINY)
        user = table.space().with_values("precision", ("bf16",)).with_values("dataloader_num_workers", (4,))
        space = user.including(baseline_params())
        assert space.reference_values == {"precision": ("fp32",), "dataloader_num_workers": (0,)}
        assert SearchSpace.from_dict(space.to_dict()).reference_values == space.reference_values  # stored with the study
        evaluator = ReplayEvaluator(table)
        study = optuna.create_study(direction="maximize")
        settings = SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=4 * 3600, min_probe_s=1)
        outcome = run_search(study, space, evaluator, settings, baseline=baseline_params(), clock=evaluator.clock, strategy=make_strategy(name))
        probed = [r.params for r in outcome.records if not r.is_baseline]
        assert probed and all(p.precision == "bf16" and p.dataloader_num_workers == 4 for p in probed), [p.short() for p in probed]


def test_the_cli_names_the_registrys_strategies_and_default() -> None:
    import autotune.defaults as defaults

    assert tuple(STRATEGIES) == defaults.STRATEGY_NAMES and DEFAULT_STRATEGY in STRATEGIES


def test_unknown_strategy_names_the_known_ones() -> None:
    with pytest.raises(UsageError, match="did you mean 'bayes'"):
        make_strategy("bayse")


class _PruneLarge(Strategy):
    name = "prune-large"

    def sampler(self, seed):
        return optuna.samplers.RandomSampler(seed=seed)

    def prune(self, params, state):
        return "too large for this test" if params.per_device_train_batch_size >= 32 else None


class _PruneAllButTheBaseline(Strategy):
    name = "prune-all"

    def sampler(self, seed):
        return optuna.samplers.RandomSampler(seed=seed)

    def prune(self, params, state):
        return None if params == state.baseline else "nothing runs in this test"


def test_a_search_whose_strategy_allows_nothing_stops_instead_of_pruning_the_whole_space(fake_gpu) -> None:
    # gen2-heldout4's draw 600096: nothing of the space could run; bayes proposed nothing and pruned
    # every sampler proposal, 1,054 of them, 66 CPU seconds, until its budget ended.
    from autotune.search.loop import MAX_CONSECUTIVE_PRUNES

    space = parse_space({"per_device_train_batch_size": list(range(1, 65)), "precision": ["fp32", "bf16"],
                         "optim": ["adamw_torch", "adamw_torch_fused"], "dataloader_num_workers": [0, 2, 4, 8]}).restrict(fake_gpu)
    assert space.size > 4 * MAX_CONSECUTIVE_PRUNES
    fake = FakeEvaluator(probe_s=30.0)
    outcome = run_search(optuna.create_study(direction="maximize"), space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, budget_s=3600),
                         baseline=baseline_params(), clock=fake.clock, strategy=_PruneAllButTheBaseline())
    assert outcome.stopped_because == "exhausted" and outcome.probes_run == 1
    assert MAX_CONSECUTIVE_PRUNES <= outcome.pruned <= MAX_CONSECUTIVE_PRUNES + 1


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


def test_bayes_prunes_larger_batches_after_an_oom() -> None:
    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 48, 64]})
    state = SearchState(space, 40 * GiB, MemoryModel())
    state.memory.observe(TrialParams(per_device_train_batch_size=32), ProbeResult(status="oom"))
    strategy = BayesStrategy()
    assert strategy.prune(TrialParams(per_device_train_batch_size=64), state) == "OOM at batch 32 in the same group"
    assert strategy.prune(TrialParams(per_device_train_batch_size=16), state) is None


@pytest.mark.parametrize("table, ceiling", [
    ("landscape_gptneox-1.3b-a100.csv.gz", 40), ("landscape_pythia-160m-l4.csv.gz", 16), ("landscape_llama-1b-a10g.csv.gz", 22),
])
def test_bayes_beats_plain_tpe_on_the_synthetic_landscapes(table, ceiling) -> None:
    loaded = load_table(DATA / table)
    true_best = loaded.best_under(ceiling * GiB)["samples_per_s"]
    tpe = replay_search(loaded, budget_s=1800, memory_ceiling_bytes=ceiling * GiB, strategy="tpe", seed=0)
    # bayes's floor is lower: on the pythia table flash attention gains mostly when compiled, a
    # pair effect the step-time model does not hold; once its sd is calibrated (round 13) it trusts
    # the uncompiled comparison and returns sdpa compiled, 0.888 of the best (0.968 before). These
    # hand-built tables are a check that nothing broke; the family judges the search.
    for strategy, least_ratio in (("bayes", 0.85),):
        found = replay_search(loaded, budget_s=1800, memory_ceiling_bytes=ceiling * GiB, strategy=strategy, seed=0)
        assert found.best_samples_per_s / true_best >= least_ratio, strategy
        assert found.best_peak_mem_bytes <= ceiling * GiB, strategy
        assert found.oom_probes <= tpe.oom_probes, strategy
        assert found.best_samples_per_s >= tpe.best_samples_per_s, strategy


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
    assert result.settings["strategy"] == DEFAULT_STRATEGY


# ---------------------------------------------------------------------------- bayes


def _probe(number: int, status: str, **values) -> Probe:
    ok = status == "ok"
    return Probe(number, TrialParams(**values), ProbeResult(status=status, samples_per_s=1.0 if ok else None, peak_mem_bytes=GiB if ok else None))


def _grid(space_data: dict | None = None) -> Grid:
    return Grid(parse_space(space_data or {
        "per_device_train_batch_size": [8, 16, 32], "precision": ["fp32", "fp16", "bf16"], "optim": ["adamw_torch_fused", "adafactor"],
        "torch_compile": ["off", "inductor"], "attn_implementation": ["eager", "sdpa", "flash_attention_2"], "gradient_checkpointing": [False, True],
    }))


def _p_ok(model: FailureModel, grid: Grid, **values) -> float:
    return float(np.broadcast_to(model.p_ok_grid(grid), grid.shape).reshape(-1)[grid.flat_index(TrialParams(**values))])


def test_a_crash_is_evidence_about_its_value_elsewhere_confirmed_in_another_context() -> None:
    grid = _grid()
    history = [_probe(0, "ok"), _probe(1, "crash", precision="bf16")]
    model = FailureModel.from_history(grid, history)
    suspicion = model.cause_probability()[(("precision", "bf16"),)]
    assert 0.3 < suspicion < 0.9  # inferred, not ruled out: it may be bf16 with one of the others
    assert 0.0 < _p_ok(model, grid, precision="bf16", attn_implementation="eager", optim="adafactor") < 0.7
    assert _p_ok(model, grid, precision="fp16") > 0.7  # the next value of the dimension: only its prior against it
    assert model.certain_failure(TrialParams(precision="bf16", per_device_train_batch_size=32)) is not None  # same context
    # A second crash in a context that shares nothing else with the first, and whose other values
    # ran, confirms it.
    other = {"attn_implementation": "eager", "optim": "adafactor", "torch_compile": "inductor", "gradient_checkpointing": True}
    history += [_probe(2, "ok", **other), _probe(3, "crash", precision="bf16", **other)]
    confirmed = FailureModel.from_history(grid, history)
    assert confirmed.cause_probability()[(("precision", "bf16"),)] > max(0.75, suspicion + 0.2)
    assert _p_ok(confirmed, grid, precision="bf16", attn_implementation="flash_attention_2") < 0.2


def test_a_value_every_configuration_holds_is_no_suspect() -> None:
    # Nothing ran yet: eight frugal probes (adafactor, checkpointing, uncompiled) crashed with one of
    # three attention kernels and four precisions (held-out draw 2600033: flash, sdpa, bf16 and tf32
    # crash on a pre-Ampere card). Liger kernels, sharding and the loader's flags have one value in
    # this space: blaming them would say nothing runs anywhere, and they took the enumeration's first
    # places from the attention kernels. A configuration that shares none of the frugal values keeps
    # a fair chance to run (0.21 when the one-valued settings were suspects).
    grid = Grid(parse_space({
        "per_device_train_batch_size": [1, 8], "precision": ["fp32", "fp16", "bf16", "tf32"], "optim": ["adamw_torch_fused", "adafactor"],
        "torch_compile": ["off", "inductor"], "attn_implementation": ["eager", "sdpa", "flash_attention_2"],
        "gradient_checkpointing": [False, True], "dataloader_num_workers": [0, 2]}))
    frugal = {"per_device_train_batch_size": 1, "optim": "adafactor", "gradient_checkpointing": True}
    crashed = [("flash_attention_2", "fp16", 0), ("flash_attention_2", "fp32", 0), ("sdpa", "fp16", 0), ("sdpa", "fp32", 0),
               ("eager", "bf16", 0), ("eager", "tf32", 0), ("flash_attention_2", "bf16", 2), ("sdpa", "tf32", 2)]
    history = [_probe(i, "crash", attn_implementation=a, precision=p, dataloader_num_workers=w, **frugal) for i, (a, p, w) in enumerate(crashed)]
    model = FailureModel.from_history(grid, history)
    one_valued = {n for n in grid.names if len(grid.values[n]) == 1}
    assert one_valued and not any(value[0] in one_valued for cause in model.cause_probability() for value in cause)
    assert _p_ok(model, grid, per_device_train_batch_size=8, precision="fp16", attn_implementation="eager", torch_compile="inductor") > 0.3


def test_a_crash_of_values_that_ran_elsewhere_is_blamed_on_their_pair() -> None:
    grid = _grid()
    history = [_probe(0, "ok", precision="bf16"), _probe(1, "ok", torch_compile="inductor"),
               _probe(2, "crash", precision="bf16", torch_compile="inductor")]
    model = FailureModel.from_history(grid, history)
    # bf16 and inductor each ran: only their pair is left to blame, so the compile mode is not
    # retried with bf16 (whatever else changes), while it stays open elsewhere.
    assert model.certain_failure(TrialParams(precision="bf16", torch_compile="inductor", attn_implementation="eager")) is not None
    assert model.certain_failure(TrialParams(precision="fp16", torch_compile="inductor")) is None
    assert _p_ok(model, grid, precision="fp16", torch_compile="inductor") > 0.5


def test_a_compile_crash_makes_the_other_compile_mode_suspect_until_a_compiled_probe_runs() -> None:
    # Both compile modes trace the graph the same way (dynamo, then inductor): where one mode
    # crashed, the other is likelier to crash too; a compiled probe that ran clears what they share.
    grid = _grid({"per_device_train_batch_size": [8], "precision": ["fp32", "bf16"], "optim": ["adamw_torch_fused", "adafactor"],
                  "torch_compile": ["off", "inductor", "inductor:max-autotune"], "attn_implementation": ["eager", "sdpa"]})
    history = [_probe(0, "ok"), _probe(1, "ok", precision="bf16", optim="adafactor", attn_implementation="eager"),
               _probe(2, "crash", torch_compile="inductor")]
    before = _p_ok(FailureModel.from_history(grid, history[:2]), grid, torch_compile="inductor:max-autotune")
    suspect = _p_ok(FailureModel.from_history(grid, history), grid, torch_compile="inductor:max-autotune", precision="bf16")
    assert suspect < before - 0.15
    history.append(_probe(3, "crash", torch_compile="inductor:max-autotune", precision="bf16", optim="adafactor"))
    both = FailureModel.from_history(grid, history)
    assert both.cause_probability()[(COMPILED,)] > 0.5  # two modes, two contexts: compilation itself, likelier than not
    assert _p_ok(both, grid, torch_compile="inductor", attn_implementation="eager", precision="bf16") < 0.15
    cleared = FailureModel.from_history(grid, [*history[:3], _probe(3, "ok", torch_compile="inductor:max-autotune", precision="bf16")])
    assert COMPILED in cleared.cleared_values
    assert _p_ok(cleared, grid, torch_compile="inductor:max-autotune", attn_implementation="eager") > 0.8


@pytest.mark.parametrize("history", [
    [_probe(0, "ok"), _probe(1, "crash", precision="bf16")],
    [_probe(0, "ok", precision="bf16"), _probe(1, "ok", torch_compile="inductor"), _probe(2, "crash", precision="bf16", torch_compile="inductor")],
    [_probe(0, "ok"), _probe(1, "crash", torch_compile="inductor"), _probe(2, "crash", torch_compile="inductor", precision="bf16", optim="adafactor")],
])
def test_what_the_prune_calls_a_certain_failure_is_never_proposed(history) -> None:
    """The proposal and the prune apply one rule: a point holding every suspect of a failure has P(ok) 0 (on a
    design draw the two disagreed, and 311 proposals were made and pruned one after another)."""
    grid = _grid()
    model = FailureModel.from_history(grid, history)
    p_ok = np.broadcast_to(model.p_ok_grid(grid), grid.shape).reshape(-1)
    certain = np.broadcast_to(model.certain_failure_grid(grid), grid.shape).reshape(-1)
    assert certain.any() and not certain.all()
    for flat in range(grid.size):
        params = grid.params_at(flat)
        assert bool(certain[flat]) == (model.certain_failure(params) is not None), params.short()
    assert (p_ok[certain] == 0).all() and (p_ok[~certain] > 0).all()


def test_an_out_of_memory_clears_crashes_but_not_divergence() -> None:
    grid = _grid()
    history = [_probe(0, "ok"), _probe(1, "oom", precision="fp16", per_device_train_batch_size=32)]
    assert ("precision", "fp16") in FailureModel.from_history(grid, history, CRASH).cleared_values  # it got past start-up
    assert ("precision", "fp16") not in FailureModel.from_history(grid, history, DIVERGENCE).cleared_values  # its loss was never seen


def test_bayes_prunes_what_needs_no_less_memory_than_an_oom() -> None:
    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "optim": ["adafactor", "adamw_torch"], "gradient_checkpointing": [False, True]})
    oom = TrialParams(per_device_train_batch_size=32, optim="adafactor")
    state = SearchState(space, 40 * GiB, MemoryModel(), [Probe(0, oom, ProbeResult(status="oom"))])
    state.memory.observe(oom, ProbeResult(status="oom"))
    strategy = BayesStrategy()
    assert strategy.prune(oom.replace(per_device_train_batch_size=64), state) is not None
    assert strategy.prune(oom.replace(optim="adamw_torch"), state) is not None  # more optimizer state, same batch
    assert strategy.prune(oom.replace(per_device_train_batch_size=16), state) is None
    assert strategy.prune(oom.replace(gradient_checkpointing=True), state) is None  # checkpointing needs less



def test_bayes_counts_accumulation_as_needing_no_less_memory() -> None:
    """Accumulating keeps the gradients between micro-batches: on an H100 AdamW ran compiled at batch
    64 accumulating 1 and ran out of memory accumulating 2. At the same batch an OOM rules out no less
    accumulation only, and a fit vouches for no more; a larger batch needs more memory whatever it
    accumulates, a smaller one less."""
    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "gradient_accumulation_steps": [1, 2, 4], "optim": ["adafactor", "adamw_torch"]})
    oom = TrialParams(per_device_train_batch_size=32, gradient_accumulation_steps=2, optim="adafactor")
    fit = Probe(1, TrialParams(per_device_train_batch_size=16, gradient_accumulation_steps=2, optim="adamw_torch"),
                ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=GiB))
    history = [Probe(0, oom, ProbeResult(status="oom")), fit]
    state = SearchState(space, 40 * GiB, MemoryModel(), history)
    state.memory.observe(oom, ProbeResult(status="oom"))
    strategy = BayesStrategy()
    assert strategy.prune(oom.replace(gradient_accumulation_steps=4), state) is not None
    assert strategy.prune(oom.replace(per_device_train_batch_size=64, optim="adamw_torch"), state) is not None
    assert strategy.prune(oom.replace(gradient_accumulation_steps=1, per_device_train_batch_size=64), state) is not None
    assert strategy.prune(oom.replace(gradient_accumulation_steps=1), state) is None
    assert state.memory.prune_reason(oom.replace(gradient_accumulation_steps=1), state.ceiling_bytes) is None  # the memory model's rule too
    context = strategy.context(state)
    evidence = MemoryEvidence.of(context.groups, context.grid, history, state.ceiling_bytes)
    known = context.batch_grid(evidence.known_fit)

    def known_fit(**values) -> bool:
        return bool(known.reshape(-1)[context.grid.flat_index(TrialParams(**values))])

    assert known_fit(per_device_train_batch_size=16, gradient_accumulation_steps=1, optim="adafactor")  # less state, less accumulation
    assert known_fit(per_device_train_batch_size=8, gradient_accumulation_steps=4, optim="adamw_torch")  # a smaller batch
    assert not known_fit(per_device_train_batch_size=16, gradient_accumulation_steps=4, optim="adamw_torch")
    assert not known_fit(per_device_train_batch_size=32, gradient_accumulation_steps=1, optim="adamw_torch")


# Tables recorded on an H100 (pythia-160m seq 128, 9 GiB probe ceiling), each searched for a third
# of its probe time, as the GPU phase's protocol asks:
# - checkpointing off: batch 64 runs out of memory uncompiled and fits compiled at 2.2x-3x the speed
#   of any batch-8 configuration, so batch-8 variants must not take the budget from compiling.
#   Accumulating 2 at batch 64 ran out of memory where 1 fits.
# - loader workers 0, compile and checkpointing both in: compiled, checkpointing costs 0.96x at batch
#   64 and cuts the peak to 0.71x, so the best checkpointed configuration (1955 samples/s) is close
#   to the best one (2203, without checkpointing, which fits at batch 64 only compiled); TPE's worst
#   seed there: 0.625.
H100_TABLES = Path(__file__).resolve().parent.parent / "reports" / "gpu" / "nvidia-h100-80gb-hbm3-2026-11-22"


@pytest.mark.parametrize(("table_name", "budget_s"), [
    ("landscape_nvidia-h100-80gb-hbm3-gradient_checkpointing-False.csv.gz", 383.0),
    ("landscape_nvidia-h100-80gb-hbm3-dataloader_num_workers-0.csv.gz", 613.0),
])
def test_bayes_finds_the_best_of_the_h100_tables(table_name: str, budget_s: float) -> None:
    table = load_table(H100_TABLES / table_name)
    ceiling = 9 * GiB
    true_best = float(table.best_under(ceiling)["samples_per_s"])
    found = replay_search(table, budget_s=budget_s, memory_ceiling_bytes=ceiling, strategy="bayes", seed=0)
    assert found.best_samples_per_s / true_best >= 0.95 and found.best_peak_mem_bytes <= ceiling


@dataclass
class _LoaderBound:
    """Compute runs 100 samples/s at any batch; the loader makes 15 samples/s per worker (0 workers:
    loading is serial with compute). Reports the share of time spent waiting, like a probe."""

    clock: VirtualClock = field(default_factory=VirtualClock)
    calls: list[TrialParams] = field(default_factory=list)

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        self.calls.append(params)
        self.clock.advance(30.0)
        compute = 1 / 100.0
        load = 1 / (15.0 * params.dataloader_num_workers) if params.dataloader_num_workers else 1 / 15.0
        per_sample = max(compute, load) if params.dataloader_num_workers else compute + load
        wait = (load - compute if params.dataloader_num_workers else load) / per_sample
        return ProbeResult(status="ok", samples_per_s=1 / per_sample, peak_mem_bytes=GiB, wall_s=30.0,
                           step_time_s=params.effective_batch_size * per_sample, input_wait_fraction=max(wait, 0.0), input_bound=wait > 0.2)


def test_bayes_follows_an_input_bound_incumbent_to_loader_workers() -> None:
    space = parse_space({"per_device_train_batch_size": [8, 16], "dataloader_num_workers": [0, 2, 4, 8], "precision": ["fp32", "bf16"]})
    fake = _LoaderBound()
    run_search(optuna.create_study(direction="maximize"), space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=4),
               baseline=baseline_params(), clock=fake.clock, strategy=BayesStrategy())
    assert fake.calls[0].dataloader_num_workers == 0 and fake.calls[1].dataloader_num_workers > 0
    assert max(p.dataloader_num_workers for p in fake.calls) == 8  # the loader, not compute, sets the pace


@dataclass
class _Contended(_LoaderBound):
    """As :class:`_LoaderBound` on a host whose loader has ``cores`` cores: workers past them add nothing and contend."""

    cores: int = 4

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        self.calls.append(params)
        self.clock.advance(30.0)
        workers = params.dataloader_num_workers
        load_rate = 15.0 * min(workers, self.cores) / (1 + 0.1 * max(workers - self.cores, 0)) if workers else 0.0
        per_sample = max(1 / 100.0, 1 / load_rate) if workers else 1 / 100.0 + 1 / 15.0
        return ProbeResult(status="ok", samples_per_s=1 / per_sample, peak_mem_bytes=GiB, wall_s=30.0, step_time_s=params.effective_batch_size * per_sample)


def test_bayes_expects_no_gain_from_loader_workers_past_the_hosts_cores() -> None:
    """Input-bound on a host whose loader has 4 cores: 2 and 4 workers measured (30 and 60 samples/s).
    Not knowing the cores, 8 workers may load up to compute's 100 samples/s, and bayes asks them;
    knowing them (a run reads its host's), 8 are expected no faster than 4, and not asked next."""
    fake = _Contended(cores=4)
    history = [Probe(i, params, fake.evaluate(params, timeout_s=60.0)) for i, params in enumerate(
        [TrialParams(precision="bf16", per_device_train_batch_size=16, dataloader_num_workers=w) for w in (2, 4)])]
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    predicted, proposed = {}, {}
    for cores in (None, 4):
        state = SearchState(parse_space(_LOADER_SPACE), 40 * GiB, memory, history, {p.params.key() for p in history}, remaining_s=3600.0,
                            loader_cores=cores)
        strategy = BayesStrategy()
        context = strategy.context(state)
        mean = np.broadcast_to(throughput.posterior(context, history)[0], context.grid.shape).reshape(-1)
        eight = context.grid.flat_index(history[1].params.replace(dataloader_num_workers=8))
        predicted[cores] = math.exp(float(mean[eight]))
        proposed[cores] = strategy.propose(state).dataloader_num_workers
    assert predicted[None] > 1.2 * fake.evaluate(history[1].params, timeout_s=60.0).samples_per_s and proposed[None] == 8
    assert predicted[4] == pytest.approx(history[1].result.samples_per_s, rel=0.05) and proposed[4] != 8


_LOADER_SPACE = {"per_device_train_batch_size": [8, 16], "dataloader_num_workers": [0, 2, 4, 8], "precision": ["fp32", "bf16"]}


def _loader_bound_model(workers: tuple[int, ...]) -> tuple[BayesStrategy, SearchState, Callable[[int], float]]:
    """bayes after probes of bf16 bs16 on :class:`_LoaderBound` with these worker counts: the
    strategy, its state, and its predicted samples/s for bf16 bs16 by worker count."""
    strategy, state, posterior = _loader_bound_posterior(workers)
    return strategy, state, lambda count: math.exp(posterior(count)[0])


def _loader_bound_posterior(workers: tuple[int, ...]) -> tuple[BayesStrategy, SearchState, Callable[[int], tuple[float, float]]]:
    """As :func:`_loader_bound_model`, with the posterior mean and sd of log samples/s by worker count."""
    fake = _LoaderBound()
    history = [Probe(i, params, fake.evaluate(params, timeout_s=60.0)) for i, params in enumerate(
        [TrialParams(precision="bf16", per_device_train_batch_size=16, dataloader_num_workers=w) for w in workers])]
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    state = SearchState(parse_space(_LOADER_SPACE), 40 * GiB, memory, history, {p.params.key() for p in history}, remaining_s=3600.0)
    strategy = BayesStrategy()
    context = strategy.context(state)
    mean, sd = (np.broadcast_to(a, context.grid.shape).reshape(-1) for a in throughput.posterior(context, history))

    def posterior(count: int) -> tuple[float, float]:
        index = context.grid.flat_index(TrialParams(precision="bf16", per_device_train_batch_size=16, dataloader_num_workers=count))
        return float(mean[index]), float(sd[index])

    return strategy, state, posterior


def test_bayes_judges_zero_workers_by_a_workers_rate_before_it_measured_them() -> None:
    # Only probes with loader workers ran (the baseline, with 0, failed): loading in the training
    # process is taken as fast as one worker, serial with compute, not free.
    strategy, state, predicted = _loader_bound_model((2, 4))
    serial = 1 / (1 / 100.0 + 1 / 15.0)  # what 0 workers measures on this fake: 13 samples/s
    assert predicted(0) == pytest.approx(serial, rel=0.15)
    assert predicted(0) < predicted(2)
    assert strategy.propose(state).dataloader_num_workers != 0


def test_bayes_predicts_an_input_bound_configuration_at_its_loaders_measured_rate() -> None:
    # bf16 computes 100 samples/s; 2 workers load 30: the probe waited, and the model expects what
    # it measured there (the cap's margin is room for EI, not a prediction 10 % above the rate).
    _, state, predicted = _loader_bound_model((2,))
    assert state.history[0].result.input_bound and predicted(2) == pytest.approx(30.0, rel=0.02)


def test_bayes_reads_a_waiting_probes_compute_rate_off_its_input_wait() -> None:
    # bf16 computes 100 samples/s; 2 workers load 30, and the probe waited 70 % of its step: the wait says
    # the loader, not compute, set the pace, so 8 workers are expected far past 30 (the loader's 4x is ~104,
    # compute's 100), where throughput alone could not tell which of the two limited it.
    _, _, predicted = _loader_bound_model((2,))
    assert predicted(8) > 2.5 * predicted(2)


def test_bayes_learns_main_process_loading_from_throughput_where_probes_report_no_input_wait() -> None:
    # A replay table has no input wait: loading in the training process (0 workers) ran 12 samples/s
    # at batch 64 whatever the rest, 2 workers 75 at batch 24. Without a wait to split it, the 0-worker
    # effect is the compute model's to learn, not 3 % of prior sd: batch 64 with 2 workers is expected
    # near the 75 of 2 workers at batch 24, not the 12 of 0 workers at 64 (a fall past batch 32).
    def probe(number: int, batch: int, workers: int, sps: float) -> Probe:
        params = TrialParams(precision="bf16", per_device_train_batch_size=batch, dataloader_num_workers=workers)
        return Probe(number, params, ProbeResult(status="ok", samples_per_s=sps, peak_mem_bytes=GiB + batch * 2**24, wall_s=40.0,
                                                 step_time_s=batch / sps))
    history = [probe(0, 40, 0, 12.0), probe(1, 64, 0, 12.6), probe(2, 1, 0, 4.9), probe(3, 24, 2, 75.0)]
    space = parse_space({"per_device_train_batch_size": [1, 8, 16, 24, 32, 40, 64], "dataloader_num_workers": [0, 2, 4, 8], "precision": ["fp32", "bf16"]})
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    state = SearchState(space, 40 * GiB, memory, history, {p.params.key() for p in history}, remaining_s=3600.0)
    strategy = BayesStrategy()
    context = strategy.context(state)
    mean, _ = throughput.posterior(context, history)
    flat = np.broadcast_to(mean, context.grid.shape).reshape(-1)
    at_64 = float(np.exp(flat[context.grid.flat_index(TrialParams(precision="bf16", per_device_train_batch_size=64, dataloader_num_workers=2))]))
    assert at_64 > 60.0


def test_the_loaders_scaling_between_two_measured_worker_counts_is_uncertain(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 workers load 30 samples/s (the loader binds), 8 run at compute's 100: how fast 4 load is not
    # known, since workers past the host's free cores contend and the exponent between counts may differ.
    from autotune.search.strategies.bayes import features

    def sds() -> dict[int, float]:
        posterior = _loader_bound_posterior((2, 8))[2]
        return {w: posterior(w)[1] for w in (2, 4, 8)}

    uncertain = sds()
    assert uncertain[4] > 4 * max(uncertain[2], uncertain[8])
    monkeypatch.setattr(features, "CAP_SLOPE_SD", 1e-4)  # the scaling's exponent taken as known
    assert sds()[4] < 2 * uncertain[2]


def test_bayes_learns_the_loaders_cap_from_throughput_where_probes_report_no_input_wait() -> None:
    # A replay table has no input wait: bf16 computes 100 samples/s, fp32 40, one loader worker
    # loads 15 (0 workers: serial with compute). With 2 workers both precisions measure 30, the
    # loader's rate: more workers are expected to lift bf16 well past it, not to leave it where it was.
    def probe(number: int, precision: str, workers: int) -> Probe:
        compute = 1 / (100.0 if precision == "bf16" else 40.0)
        per_sample = max(compute, 1 / (15.0 * workers)) if workers else compute + 1 / 15.0
        params = TrialParams(precision=precision, per_device_train_batch_size=16, dataloader_num_workers=workers)
        return Probe(number, params, ProbeResult(status="ok", samples_per_s=1 / per_sample, peak_mem_bytes=GiB, wall_s=40.0,
                                                 step_time_s=16 * per_sample))
    history = [probe(0, "fp32", 0), probe(1, "bf16", 0), probe(2, "bf16", 2), probe(3, "fp32", 2)]
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    state = SearchState(parse_space(_LOADER_SPACE), 40 * GiB, memory, history, {p.params.key() for p in history}, remaining_s=3600.0)
    context = BayesStrategy().context(state)
    mean, _ = throughput.posterior(context, history)
    flat = np.broadcast_to(mean, context.grid.shape).reshape(-1)

    def predicted(precision: str, workers: int) -> float:
        return float(np.exp(flat[context.grid.flat_index(TrialParams(precision=precision, per_device_train_batch_size=16, dataloader_num_workers=workers))]))

    assert predicted("bf16", 2) == pytest.approx(30.0, rel=0.1)
    assert predicted("bf16", 8) > 2 * predicted("bf16", 2)
    assert predicted("bf16", 8) > 1.5 * predicted("fp32", 8)  # past the loader, compute sets the pace again


def test_bayes_trusts_a_memory_prediction_more_where_the_groups_activation_factors_were_measured() -> None:
    # bf16 sdpa measured with AdamW (peak 2 GiB + 0.5 GiB/sample): Adafactor's group, never measured,
    # shares its activation factors, so its prediction 6 % under the ceiling is likely to fit; eager
    # attention's group at the same predicted margin is not known that well.
    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "optim": ["adamw_torch_fused", "adafactor"],
                         "attn_implementation": ["sdpa", "eager"], "precision": ["bf16"]})
    history = [Probe(i, TrialParams(precision="bf16", per_device_train_batch_size=b),
                     ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=2 * GiB + b * GiB // 2)) for i, b in enumerate((8, 16))]
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    strategy = BayesStrategy()

    def p_fit(params: TrialParams) -> float:
        ceiling = int(memory.predict(params) / 0.94)
        state = SearchState(space, ceiling, memory, history, {p.params.key() for p in history}, remaining_s=3600.0)
        context = strategy.context(state)
        evidence = MemoryEvidence.of(context.groups, context.grid, history, ceiling)
        return fit.p_fits(context, state, evidence, params)

    alike = TrialParams(precision="bf16", optim="adafactor", per_device_train_batch_size=32)
    assert memory.class_measured(alike) and p_fit(alike) > 0.7
    eager = TrialParams(precision="bf16", optim="adafactor", attn_implementation="eager", per_device_train_batch_size=32)
    assert not memory.class_measured(eager) and p_fit(eager) < 0.6


@dataclass
class _PeakedBatch:
    """Everything fits; throughput rises with batch size up to 32 and falls past it."""

    clock: VirtualClock = field(default_factory=VirtualClock)
    calls: list[int] = field(default_factory=list)

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        batch = params.per_device_train_batch_size
        self.calls.append(batch)
        self.clock.advance(30.0)
        sps = 100.0 * batch / (batch + 4) * min(1.0, (32 / batch) ** 0.3)
        return ProbeResult(status="ok", samples_per_s=sps, peak_mem_bytes=GiB + batch * 2**24, wall_s=30.0, step_time_s=batch / sps)


def test_bayes_measures_sizes_below_the_frontier_when_throughput_falls_past_a_middle_batch() -> None:
    space = parse_space({"per_device_train_batch_size": {"multiple_of": 8, "max": 128}})
    fake = _PeakedBatch()
    study = optuna.create_study(direction="maximize")
    run_search(study, space, fake, SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=8), baseline=baseline_params(),
               clock=fake.clock, strategy=BayesStrategy())
    assert ranked_configurations(study, 40 * GiB)[0].params.per_device_train_batch_size == 32


def test_bayes_reads_memory_as_its_memory_model_prunes_measured_first() -> None:
    """One rule for what cannot fit (``fit.memory_prune``): a group's own OOM wins over a fit measured in a
    group needing more memory; such a fit wins over the memory model's prediction; with model dims the
    prediction is the memory model's own per accumulation and batch, not a line through batches 1 and 2
    (there the gradients hide the activations), and bayes's P(fits) agrees with its prune: with a line, a
    second-generator search had 637 proposals rejected for 12 probes."""
    from autotune.search.memory_prior import ModelDims
    from autotune.search.strategies.bayes import fit

    space = parse_space({"per_device_train_batch_size": [1, 2, 4, 8, 16, 32], "gradient_accumulation_steps": [1, 4],
                         "optim": ["adafactor", "adamw_torch"], "precision": ["bf16"]})
    dims = ModelDims(num_parameters=1_500_000_000, num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=32000, intermediate_size=8192)
    memory = MemoryModel(dims, 512)
    heavy = TrialParams(per_device_train_batch_size=4, gradient_accumulation_steps=1, optim="adamw_torch", precision="bf16")
    light = heavy.replace(optim="adafactor")
    ceiling = int(memory.predict(heavy) * 1.02)  # the heavier optimizer fits at batch 4 by a hair
    history = [Probe(0, heavy, ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=ceiling - GiB)),
               Probe(1, light.replace(per_device_train_batch_size=8), ProbeResult(status="oom"))]
    memory.observe_all((p.params, p.result) for p in history)
    state = SearchState(space, ceiling, memory, history, {p.params.key() for p in history}, remaining_s=3600.0)
    strategy = BayesStrategy()
    context = strategy.context(state)
    evidence = MemoryEvidence.of(context.groups, context.grid, history, ceiling)
    assert fit.memory_prune(context, state, evidence, light) is None  # less state than a measured fit: it fits
    assert "OOM at batch 8" in str(strategy.prune(light.replace(per_device_train_batch_size=8), state))  # its own OOM
    # Where the memory model's prediction prunes, P(fits) is low (a line through batches 1 and 2 rose by nothing here).
    for batch in (16, 32):
        for accumulation in (1, 4):
            params = heavy.replace(per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation)
            assert memory.prune_reason(params, ceiling) is not None and fit.p_fits(context, state, evidence, params) < 0.5
    for _ in range(5):  # and proposes nothing it would prune
        proposal = strategy.propose(state)
        assert proposal is not None and strategy.prune(proposal, state) is None
        state.seen.add(proposal.key())


# ---------------------------------------------------------------------------- bayes with other workers' probes in flight

_PARALLEL_SPACE = {"per_device_train_batch_size": [4, 8, 16, 32], "precision": ["fp32", "bf16"], "dataloader_num_workers": [0, 2, 4, 8],
                   "attn_implementation": ["eager", "sdpa"]}


def _measured(number: int, sps: float, per_sample_bytes: int, **values) -> Probe:
    params = TrialParams(**values)
    batch = params.per_device_train_batch_size
    return Probe(number, params, ProbeResult(status="ok", samples_per_s=sps, peak_mem_bytes=GiB + batch * per_sample_bytes, wall_s=40.0,
                                             setup_s=10.0, warmup_s=3 * batch / sps, step_time_s=batch / sps, step_time_ci95_rel=0.01,
                                             input_wait_fraction=0.0))


def _parallel_state(history: list[Probe], in_flight: set, ceiling_bytes: int = 40 * GiB, space: dict | None = None) -> SearchState:
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    return SearchState(parse_space(space or _PARALLEL_SPACE), ceiling_bytes, memory, history,
                       SeenKeys({p.params.key() for p in history}, in_flight), remaining_s=3600.0)


def _stubbed(strategy: BayesStrategy, module: Any, name: str, answer: Any) -> BayesStrategy:
    """``strategy`` with the function ``module.name`` answering ``answer`` during its proposals."""
    propose = strategy.propose

    def stubbed_propose(state: SearchState) -> TrialParams | None:
        with mock.patch.object(module, name, lambda *args, **kwargs: answer):
            return propose(state)

    strategy.propose = stubbed_propose  # type: ignore[method-assign]
    return strategy


def _without_pending() -> BayesStrategy:
    """bayes as it was before it counted probes in flight: they were only excluded."""
    return _stubbed(BayesStrategy(), bayes_strategy, "pending_probes", [])


def test_bayes_with_nothing_in_flight_proposes_as_a_lone_worker() -> None:
    history = [_measured(0, 50.0, 2**27), _measured(1, 90.0, 2**27, precision="bf16", per_device_train_batch_size=16)]
    state = _parallel_state(history, set())
    alone = SearchState(state.space, state.ceiling_bytes, state.memory, history, {p.params.key() for p in history}, remaining_s=3600.0)
    assert BayesStrategy().propose(state) == BayesStrategy().propose(alone) == _without_pending().propose(state)


def test_bayes_asks_another_question_than_a_probe_in_flight() -> None:
    # Another worker probes the proposal; counted as measured at the model's mean, its neighbours
    # that differ only in loader workers (a ~3 % effect, nothing waits on input) lose their
    # expected improvement, and the next proposal changes something else. Only excluded (before),
    # the next proposal was the same probe with another loader worker count. fp16, never measured,
    # is a question worth asking (without it, a calibrated model knows every other change loses);
    # the rule that asks it outright (questions.precision_sibling) is off here: the model's scores are tested.
    space = {**_PARALLEL_SPACE, "precision": ["fp32", "bf16", "fp16"]}
    history = [_measured(0, 50.0, 2**27), _measured(1, 90.0, 2**27, precision="bf16", per_device_train_batch_size=16)]

    def scored_only(strategy: BayesStrategy) -> BayesStrategy:
        return _stubbed(strategy, questions, "precision_sibling", None)

    first = scored_only(BayesStrategy()).propose(_parallel_state(history, set(), space=space))
    assert first is not None
    state = _parallel_state(history, {first.key()}, space=space)

    def loader_only(proposal: TrialParams | None) -> bool:
        assert proposal is not None and proposal != first
        return proposal.replace(dataloader_num_workers=first.dataloader_num_workers) == first

    assert loader_only(scored_only(_without_pending()).propose(state))
    assert not loader_only(scored_only(BayesStrategy()).propose(state))


def test_bayes_counts_a_probe_in_flight_that_likely_overflows_as_out_of_memory() -> None:
    # 1 GiB + 1 GiB per sample, measured at batches 4 and 16: batch 32 needs 33 GiB, over the 32 GiB
    # ceiling but within the prune margin, so it may be proposed. While it is in flight, another
    # worker does not probe batch 32 again with another loader worker count (as it did before):
    # the first OOM would rule out the second.
    history = [_measured(0, 50.0, GiB, precision="bf16", per_device_train_batch_size=4),
               _measured(1, 80.0, GiB, precision="bf16", per_device_train_batch_size=16)]
    first = BayesStrategy().propose(_parallel_state(history, set(), 32 * GiB))
    assert first is not None and first.per_device_train_batch_size == 32
    state = _parallel_state(history, {first.key()}, 32 * GiB)
    strategy = BayesStrategy()
    context = strategy.context(state)
    evidence = MemoryEvidence.of(context.groups, context.grid, history, state.ceiling_bytes)
    assert pending_probes(context, state, evidence) == [(first, False)]
    before = _without_pending().propose(state)
    assert before is not None and before.per_device_train_batch_size == 32
    after = strategy.propose(state)
    assert after is not None and after.per_device_train_batch_size < 32


def test_bayes_brackets_the_memory_frontier_while_nothing_has_run_yet() -> None:
    # At the start of a study every worker proposes before any probe has finished. The first
    # (besides the baseline) takes the most frugal configuration at the smallest batch, for the
    # chance it runs; the next ones keep its frugal memory settings but spread over larger batches
    # (before: all of them at the smallest batch, with other loader worker counts).
    space = parse_space({"per_device_train_batch_size": [1, 4, 8, 16, 32], "precision": ["fp32", "bf16"],
                         "optim": ["adamw_torch_fused", "adafactor"], "gradient_checkpointing": [False, True], "dataloader_num_workers": [0, 2]})
    baseline = space.with_changes(baseline_params())

    def propose(in_flight: set, strategy: BayesStrategy) -> TrialParams:
        proposal = strategy.propose(SearchState(space, 40 * GiB, MemoryModel(), [], SeenKeys(set(), in_flight), 3600.0, baseline=baseline))
        assert proposal is not None
        return proposal

    first = propose({baseline.key()}, BayesStrategy())
    assert (first.per_device_train_batch_size, first.optim, first.gradient_checkpointing) == (1, "adafactor", True)
    second = propose({baseline.key(), first.key()}, BayesStrategy())
    assert (second.optim, second.gradient_checkpointing) == ("adafactor", True) and second.per_device_train_batch_size > 1
    third = propose({baseline.key(), first.key(), second.key()}, BayesStrategy())
    assert third.per_device_train_batch_size not in (1, second.per_device_train_batch_size)
    assert propose({baseline.key(), first.key()}, _without_pending()).per_device_train_batch_size == 1


def test_bayes_asks_the_frugal_end_until_something_fits_not_only_until_something_runs() -> None:
    # Draw 3400035 (0.44 B parameters, seq 4096, 9.5 GiB ceiling): the one probe that ran, checkpointed with fused
    # AdamW at batch 1, peaked at 9.9 GiB, and every other probe ran out of memory. Nothing fits, so the next probe is
    # the frugal end (checkpointing, the least optimizer state, the smallest batch), as before anything ran; it was
    # the model's pick at batch 32 (the memory model had no dims and one peak, at batch 1), and nothing was found.
    space = parse_space({"per_device_train_batch_size": [1, 4, 8, 16, 32], "precision": ["fp32", "bf16"],
                         "optim": ["adamw_torch_fused", "adamw_bnb_8bit", "adafactor"], "gradient_checkpointing": [False, True]})
    ceiling = int(9.5 * GiB)
    over = Probe(1, space.with_changes(TrialParams(), per_device_train_batch_size=1, precision="bf16", gradient_checkpointing=True),
                 ProbeResult(status="ok", samples_per_s=95.0, peak_mem_bytes=int(9.9 * GiB), wall_s=194.0))
    oom = [Probe(n, space.with_changes(TrialParams(), per_device_train_batch_size=b, precision="bf16", optim=o), ProbeResult(status="oom"))
           for n, (b, o) in enumerate([(1, "adamw_torch_fused"), (4, "adamw_bnb_8bit"), (8, "adafactor")], start=2)]
    memory = MemoryModel()
    for probe in (over, *oom):
        memory.observe(probe.params, probe.result)
    state = SearchState(space, ceiling, memory, [over, *oom], SeenKeys({p.params.key() for p in (over, *oom)}), 1200.0)
    proposal = BayesStrategy().propose(state)
    assert proposal is not None
    assert (proposal.per_device_train_batch_size, proposal.optim, proposal.gradient_checkpointing) == (1, "adafactor", True), proposal.short()


def test_bayes_estimates_a_configuration_from_every_probe_not_from_its_own_measurement_alone() -> None:
    # flash attention measured 5 % faster than sdpa at batches 8, 16 and 32; at batch 64 one probe each, and the
    # noise put sdpa 1 % ahead. The estimates pool all eight probes: flash ahead at 64 too (within the noise of
    # each other, the ranking then returns it).
    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "precision": ["bf16"], "attn_implementation": ["sdpa", "flash_attention_2"]})
    history = []
    for batch, sdpa in ((8, 50.0), (16, 70.0), (32, 85.0)):
        for attn, sps in (("sdpa", sdpa), ("flash_attention_2", 1.05 * sdpa)):
            history.append(Probe(len(history), space.with_changes(TrialParams(), per_device_train_batch_size=batch, precision="bf16",
                                                                  attn_implementation=attn),
                                 ProbeResult(status="ok", samples_per_s=sps, peak_mem_bytes=GiB, wall_s=30.0)))
    at_64 = {attn: space.with_changes(TrialParams(), per_device_train_batch_size=64, precision="bf16", attn_implementation=attn)
             for attn in ("sdpa", "flash_attention_2")}
    history += [Probe(6, at_64["sdpa"], ProbeResult(status="ok", samples_per_s=93.0, peak_mem_bytes=GiB, wall_s=30.0)),
                Probe(7, at_64["flash_attention_2"], ProbeResult(status="ok", samples_per_s=92.0, peak_mem_bytes=GiB, wall_s=30.0))]
    state = SearchState(space, 40 * GiB, MemoryModel(), history)
    estimates = BayesStrategy().estimates(state)
    assert set(estimates) == {p.params.key() for p in history}  # every configuration that fits
    assert estimates[at_64["flash_attention_2"].key()] > estimates[at_64["sdpa"].key()]
    assert all(0.8 * p.result.samples_per_s < estimates[p.params.key()] < 1.2 * p.result.samples_per_s for p in history)
    assert make_strategy("tpe").estimates(state) == {}  # no model of throughput, no estimates


def test_the_surrogate_predicts_the_whole_grid_as_its_features_say() -> None:
    space = parse_space({"per_device_train_batch_size": [1, 8, 16, 64], "gradient_accumulation_steps": [1, 4], "precision": ["fp32", "bf16"],
                         "torch_compile": ["off", "inductor", "inductor:max-autotune"], "dataloader_num_workers": [0, 4]})
    strategy = BayesStrategy()
    context = strategy.context(SearchState(space, 40 * GiB, MemoryModel()))
    surrogate, grid = context.surrogate, context.grid
    rng = np.random.default_rng(0)
    points = [grid.params_at(int(i)) for i in rng.choice(grid.size, size=12, replace=False)]
    surrogate.fit_params(points[:8], rng.normal(3.0, 0.5, size=8), np.full(8, 0.01))
    mean, sd = surrogate.predict_grid()
    direct_mean, direct_sd = surrogate.predict_params(points)
    for point, m, s in zip(points, direct_mean, direct_sd):
        index = grid.flat_index(point)
        assert mean.reshape(-1)[index] == pytest.approx(m, abs=1e-4)
        assert sd.reshape(-1)[index] == pytest.approx(s, abs=1e-4)


def test_bayes_treats_tf32_on_top_of_mixed_precision_as_its_16_bit_base():
    """bf16+tf32 / fp16+tf32 store weights, activations and optimizer state as bf16 / fp16 do: the
    bayes memory kernels put them in the mixed-precision class, and their prior is their base's."""
    from autotune.search.strategies.bayes import features, groups

    assert groups.precision_class("bf16+tf32") == groups.precision_class("bf16") == "amp"
    assert groups.precision_class("fp16+tf32") == "amp"
    assert groups.precision_class("tf32") == groups.precision_class("fp32") == "fp32"
    assert features.PRIOR["precision"]["bf16+tf32"] == features.PRIOR["precision"]["bf16"]
    assert "fp16+tf32" in features.KINDS["precision"]["16-bit"]


@pytest.mark.parametrize("acts_on", ["overhead", "per_sample"])
def test_the_step_time_model_learns_whether_compilation_cuts_overhead_or_per_sample_time(acts_on: str) -> None:
    """Throughput from a step's time: micro-step = overhead + batch x per-sample time. Compilation
    measured at batch 1 and 64 says which of the two it cuts, so its predicted gain at batch 8
    follows: large where it cuts the overhead (batch 8 is near saturation), small where it speeds
    the kernels (batch 8 is still overhead-bound). A sum of per-value effects gains the same everywhere."""
    space = parse_space({"per_device_train_batch_size": [1, 2, 4, 8, 16, 32, 64], "gradient_accumulation_steps": [1],
                         "precision": ["bf16"], "torch_compile": ["off", "inductor"], "optim": ["adamw_torch_fused"]})
    context = BayesStrategy().context(SearchState(space, 40 * GiB, MemoryModel()))
    surrogate = context.surrogate
    overhead_s, per_sample_s = 0.08, 0.01  # saturates at batch 8
    cut = {"overhead": (0.3, 1.0), "per_sample": (1.0, 0.6)}[acts_on]

    def log_rate(batch: int, compiled: bool) -> float:
        o, p = (overhead_s * cut[0], per_sample_s * cut[1]) if compiled else (overhead_s, per_sample_s)
        return math.log(batch / (o + batch * p + 0.005))

    measured = [(b, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (False,)] + [(1, True), (64, True)]
    fixed = {"precision": "bf16", "optim": "adamw_torch_fused", "gradient_accumulation_steps": 1}
    points = [space.complete({**fixed, "per_device_train_batch_size": b, "torch_compile": "inductor" if c else "off"}) for b, c in measured]
    targets = np.array([log_rate(b, c) for b, c in measured])
    surrogate.set_scale(points, targets)
    surrogate.fit_params(points, targets, np.full(len(points), 0.02**2))
    at8 = [space.complete({**fixed, "per_device_train_batch_size": 8, "torch_compile": c}) for c in ("off", "inductor")]
    (plain, compiled), _ = surrogate.predict_params(at8)
    true_gain = log_rate(8, True) - log_rate(8, False)
    assert compiled - plain == pytest.approx(true_gain, abs=0.05)
    assert abs(true_gain - (log_rate(64, True) - log_rate(64, False))) > 0.2  # the gain differs by batch: the check can fail


_TWIN_SPACE = {"per_device_train_batch_size": [2, 4, 8], "precision": ["bf16"], "optim": ["adafactor"],
               "attn_implementation": ["eager", "sdpa", "flash_attention_2"],
               "torch_compile": ["off", "inductor", "inductor:max-autotune"], "gradient_checkpointing": [True]}
_TWIN_FIXED = {"precision": "bf16", "optim": "adafactor", "gradient_checkpointing": True}
_TWIN_CEILING = 10 * GiB


def _sdpa_probe(space: SearchSpace, number: int, batch: int, mode: str, peak_of_ceiling: float | None) -> Probe:
    """A probe of sdpa in compile ``mode`` on :data:`_TWIN_SPACE`: out of memory where ``peak_of_ceiling`` is ``None``."""
    params = space.complete({**_TWIN_FIXED, "per_device_train_batch_size": batch, "attn_implementation": "sdpa", "torch_compile": mode})
    if peak_of_ceiling is None:
        return Probe(number, params, ProbeResult(status=ProbeStatus.OOM))
    return Probe(number, params, ProbeResult(status=ProbeStatus.OK, samples_per_s=10.0, peak_mem_bytes=int(peak_of_ceiling * _TWIN_CEILING)))


def _twin_p_fit(space: SearchSpace, history: list[Probe]) -> Callable[[str, str], np.ndarray]:
    """bayes's P(fits) along the batch axis after ``history``, per (attention kernel, compile mode) group."""
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    state = SearchState(space, _TWIN_CEILING, memory, history, {p.params.key() for p in history}, remaining_s=3600.0)
    strategy = BayesStrategy()
    context = strategy.context(state)
    evidence = MemoryEvidence.of(context.groups, context.grid, history, state.ceiling_bytes)

    def p_fit(attn: str, compile_mode: str) -> np.ndarray:
        group = context.groups.index(space.complete({**_TWIN_FIXED, "attn_implementation": attn, "torch_compile": compile_mode}), context.grid)
        return fit.p_fit_block(context, state, evidence, group)[0]  # at the space's one accumulation

    return p_fit


def test_bayes_expects_a_fused_twin_out_of_memory_at_the_batch_where_the_other_fused_kernel_was() -> None:
    # Uncompiled sdpa fitted at batch 4 and ran out of memory at batch 8 (an OOM: no peak). Flash
    # attention stores like sdpa, so batch 8 is unlikely for it too (before: its activations could be
    # 5 % fewer, which left batch 8 open); batch 4 stays likely. Max-autotune holds no less than
    # inductor (its CUDA graphs keep a pool of their own), so inductor's OOM at a batch is its too.
    space = parse_space(_TWIN_SPACE)
    p_fit = _twin_p_fit(space, [_sdpa_probe(space, 0, 4, "off", 0.8), _sdpa_probe(space, 1, 8, "off", None), _sdpa_probe(space, 2, 8, "inductor", None)])
    flash = p_fit("flash_attention_2", "off")
    assert flash[2] < 0.06 and flash[1] > 0.5, flash
    autotuned = p_fit("sdpa", "inductor:max-autotune")
    assert autotuned[2] < 0.06, autotuned


def test_every_dimension_is_asked_near_the_incumbent() -> None:
    """#44: which dimensions no probe varied next to the incumbent, the variant that asks each, and a
    tie across precisions (the loader, not the precision, sets the pace)."""
    from autotune.records import Probe, ProbeResult
    from autotune.search.ranking import rank_configurations
    from autotune.search.strategies import coverage
    from autotune.space import parse_space

    space = parse_space({"per_device_train_batch_size": [8, 16], "precision": ["fp32", "bf16"], "dataloader_num_workers": [0, 2, 8],
                         "optim": ["adamw_torch", "adamw_torch_fused"], "torch_compile": ["off", "inductor"]})
    incumbent = TrialParams(per_device_train_batch_size=16, precision="bf16", dataloader_num_workers=2)

    def ran(number: int, params: TrialParams, sps: float = 100.0) -> Probe:
        return Probe(number, params, ProbeResult(status="ok", samples_per_s=sps, peak_mem_bytes=1, wall_s=30.0))

    history = [ran(0, incumbent), ran(1, incumbent.replace(optim="adamw_torch", torch_compile="inductor"))]  # two changes: asks neither
    assert coverage.unasked(space, incumbent, history) == ["dataloader_num_workers", "optim", "torch_compile"]
    history.append(ran(2, incumbent.replace(per_device_train_batch_size=8, optim="adamw_torch")))  # another batch: still near
    assert coverage.unasked(space, incumbent, history) == ["dataloader_num_workers", "torch_compile"]
    assert [v.dataloader_num_workers for v in coverage.variants(space, incumbent, "dataloader_num_workers")] == [8, 0]
    assert [v.torch_compile for v in coverage.variants(space, incumbent, "torch_compile")] == ["inductor"]
    tied = rank_configurations([ran(0, incumbent, 100.0), ran(3, incumbent.replace(precision="fp32"), 100.5)], 10)
    assert coverage.tie_across_precisions(tied)
    assert not coverage.tie_across_precisions(rank_configurations([ran(0, incumbent, 100.0), ran(3, incumbent.replace(precision="fp32"), 60.0)], 10))


def test_checkpointing_is_asked_only_at_a_batch_larger_than_the_incumbents() -> None:
    """Checkpointing re-runs the forward pass, so at the same batch it is slower (x0.63-0.92 on an H100): its
    question is a larger batch that may not fit without it, the largest first, and at the space's largest
    batch there is none; without it, the incumbent's own batch is the question (it fits, and it is faster)."""
    from autotune.search.strategies import coverage
    from autotune.space import parse_space

    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "gradient_checkpointing": [False, True]})
    incumbent = TrialParams(per_device_train_batch_size=16)
    asked = coverage.variants(space, incumbent, "gradient_checkpointing")
    assert [(v.gradient_checkpointing, v.per_device_train_batch_size) for v in asked] == [(True, 64), (True, 32)]
    assert coverage.variants(space, incumbent.replace(per_device_train_batch_size=64), "gradient_checkpointing") == []
    checkpointed = incumbent.replace(gradient_checkpointing=True)
    assert coverage.variants(space, checkpointed, "gradient_checkpointing") == [incumbent]


def test_loader_workers_are_asked_at_a_neighbouring_count() -> None:
    """Workers past the host's free cores contend, so the throughput may peak inside the range: with
    8 workers the incumbent, a probe with none does not say whether 4 would be faster; 4 is asked."""
    from autotune.records import Probe, ProbeResult
    from autotune.search.strategies import coverage
    from autotune.space import parse_space

    space = parse_space({"per_device_train_batch_size": [8, 16], "dataloader_num_workers": [0, 2, 4, 8], "optim": ["adamw_torch", "adamw_torch_fused"]})
    incumbent = TrialParams(per_device_train_batch_size=16, dataloader_num_workers=8)

    def ran(number: int, workers: int) -> Probe:
        return Probe(number, incumbent.replace(dataloader_num_workers=workers), ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=1, wall_s=30.0))

    first = TrialParams(per_device_train_batch_size=16, dataloader_num_workers=2)
    assert [v.dataloader_num_workers for v in coverage.variants(space, first, "dataloader_num_workers", [])] == [8, 4, 0]  # nothing asked: the most first
    within_five = coverage.variants(space, first, "dataloader_num_workers", [], loader_cores=5)
    assert [v.dataloader_num_workers for v in within_five] == [4, 0, 8]  # the host's cores known: the most they hold first, past them last
    history = [ran(0, 0), ran(1, 8)]
    assert "dataloader_num_workers" in coverage.unasked(space, incumbent, history)
    assert [v.dataloader_num_workers for v in coverage.variants(space, incumbent, "dataloader_num_workers", history)] == [4]
    history.append(Probe(2, incumbent.replace(dataloader_num_workers=4, per_device_train_batch_size=8),
                         ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=1, wall_s=30.0)))  # another batch: near enough
    assert "dataloader_num_workers" not in coverage.unasked(space, incumbent, history)
    middle = incumbent.replace(dataloader_num_workers=4)  # 4 won: 2 or 8, on either side, answers
    assert "dataloader_num_workers" not in coverage.unasked(space, middle, history)
    assert [v.dataloader_num_workers for v in coverage.variants(space, middle, "dataloader_num_workers", history)] == [8, 2]


def test_a_users_own_config_field_is_asked_near_the_incumbent_too() -> None:
    """A field of the user's config class the space lists (TRL's packing) is a dimension like autotune's own."""
    from autotune.config_fields import FieldKind
    from autotune.records import Probe, ProbeResult
    from autotune.search.strategies import coverage
    from autotune.space import parse_space

    fields = {"packing": FieldKind("packing", "bool", default=False)}
    space = parse_space({"per_device_train_batch_size": [8, 16], "optim": ["adamw_torch", "adamw_torch_fused"], "packing": [False, True]},
                        config_fields=fields, config_class="SFTConfig")
    incumbent = space.complete({"per_device_train_batch_size": 16, "packing": False})
    assert incumbent.packing is False and space.config_fields == ("packing",)
    history = [Probe(0, incumbent, ProbeResult(status="ok", samples_per_s=100.0, peak_mem_bytes=1, wall_s=30.0))]
    assert coverage.unasked(space, incumbent, history) == ["optim", "packing"]
    assert [v.packing for v in coverage.variants(space, incumbent, "packing")] == [True]
    history.append(Probe(1, incumbent.replace(packing=True), ProbeResult(status="ok", samples_per_s=250.0, peak_mem_bytes=1, wall_s=30.0)))
    assert coverage.unasked(space, incumbent, history) == ["optim"]


def test_bayes_does_not_propose_what_its_failure_model_expects_to_fail() -> None:
    """Second-generator draw 3000036 (every compile mode crashes): once compilation itself was the likely
    cause (P 0.88), 7 more compiled probes crashed, each given P(runs) 0.001-0.04 and each the best
    proposal left, 790 of 1,800 s. A configuration less likely than 1 in 20 to run is not proposed: here
    every uncompiled one was measured, so nothing is left to ask (without the floor, a compiled one is), and
    the prune applies the same rule to the sampler's picks."""
    space = {"per_device_train_batch_size": [8], "precision": ["fp32", "bf16"], "optim": ["adamw_torch_fused", "adafactor", "adamw_torch"],
             "torch_compile": ["off", "inductor", "inductor:max-autotune"]}
    uncompiled = [TrialParams(precision=p, optim=o) for p in ("fp32", "bf16") for o in ("adamw_torch_fused", "adafactor", "adamw_torch")]
    history = [_measured(i, 50.0 + i, 2**27, **params.flat()) for i, params in enumerate(uncompiled)]
    crashed = [{"torch_compile": "inductor"}, {"torch_compile": "inductor:max-autotune", "precision": "bf16", "optim": "adafactor"},
               {"torch_compile": "inductor", "precision": "bf16", "optim": "adamw_torch"}]
    history += [_probe(len(history) + i, "crash", **values) for i, values in enumerate(crashed)]
    state = _parallel_state(history, set(), space=space)
    grid = Grid(state.space)
    p_ok = np.broadcast_to(BayesStrategy._p_ok(BayesStrategy().context(state), state), grid.shape).reshape(-1)
    unseen = [flat for flat in range(grid.size) if grid.params_at(flat).key() not in state.seen]
    assert unseen and all(0.0 < p_ok[flat] < bayes_strategy.P_RUNS_FLOOR for flat in unseen)  # none certain to fail, none likely to run
    assert BayesStrategy().propose(state) is None
    assert all("unlikely to run" in (BayesStrategy().prune(grid.params_at(flat), state) or "") for flat in unseen)  # nor the sampler's pick
    with mock.patch.object(bayes_strategy, "P_RUNS_FLOOR", 0.0):
        assert BayesStrategy().propose(state).torch_compile != "off"
