"""Replay tables: loading, bad input (one line naming the column or row), the evaluator, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from autotune.cli import main
from autotune.errors import ReplayTableError
from autotune.params import TrialParams
from autotune.search.loop import VirtualClock
from autotune.search.replay import ReplayEvaluator, load_table, replay_search
from autotune.space import parse_space
from tests.conftest import GiB

DATA = Path(__file__).parent / "data"
TINY = DATA / "landscape_tiny.csv"
BIG = DATA / "landscape_gptneox-1.3b-a100.csv.gz"


def _write(tmp_path: Path, frame: pd.DataFrame) -> Path:
    path = tmp_path / "table.csv"
    frame.to_csv(path, index=False)
    return path


def _error(path: Path) -> str:
    with pytest.raises(ReplayTableError) as info:
        load_table(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_tiny_table_loads_with_its_own_space() -> None:
    table = load_table(TINY)
    assert len(table) == 64
    space = table.space()
    assert space.size == 64
    assert space.choices["per_device_train_batch_size"] == (8, 16, 32, 64)
    assert space.choices["gradient_checkpointing"] == (False, True)
    table.check_space(space)


def test_a_70k_row_table_loads() -> None:
    table = load_table(BIG)
    assert len(table) == 73_728
    assert table.space().size == 73_728


def test_missing_column_is_named(tmp_path) -> None:
    frame = pd.read_csv(TINY).drop(columns=["probe_s"])
    assert "missing column 'probe_s'" in _error(_write(tmp_path, frame))


def test_unknown_status_names_line_and_column(tmp_path) -> None:
    frame = pd.read_csv(TINY)
    frame.loc[1, "status"] = "exploded"
    assert "line 3, column status: unknown status 'exploded'" in _error(_write(tmp_path, frame))


def test_duplicate_configuration_names_both_rows(tmp_path) -> None:
    frame = pd.read_csv(TINY)
    frame = pd.concat([frame, frame.iloc[[5]]], ignore_index=True)
    assert "rows 7 and 66 are the same configuration" in _error(_write(tmp_path, frame))


def test_ok_row_without_throughput_is_named(tmp_path) -> None:
    frame = pd.read_csv(TINY)
    row = int(frame.index[frame["status"] == "ok"][0])
    frame.loc[row, "samples_per_s"] = None
    assert f"line {row + 2}, column samples_per_s: an ok row needs a value" in _error(_write(tmp_path, frame))


def test_space_that_does_not_match_the_table() -> None:
    table = load_table(TINY)
    with pytest.raises(ReplayTableError, match="column precision has no row with 'fp16'"):
        table.check_space(parse_space({"precision": ["fp32", "fp16"], "per_device_train_batch_size": [8]}))


def test_missing_configuration_is_an_error(tmp_path) -> None:
    frame = pd.read_csv(TINY).drop(index=3)
    table = load_table(_write(tmp_path, frame))
    with pytest.raises(ReplayTableError, match="no row for per_device_train_batch_size=8"):
        table.check_space(table.space())
    missing = TrialParams.from_dict({k: v.item() if hasattr(v, "item") else v for k, v in pd.read_csv(TINY).iloc[3].items()})
    with pytest.raises(ReplayTableError, match="has no row for"):
        ReplayEvaluator(table).evaluate(missing, timeout_s=1000)


def test_replayed_trial_returns_its_row_and_charges_probe_s() -> None:
    table = load_table(TINY)
    clock = VirtualClock()
    evaluator = ReplayEvaluator(table, clock)
    row = table.frame[table.frame["status"] == "ok"].iloc[0]
    params = TrialParams.from_dict({k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()})
    result = evaluator.evaluate(params, timeout_s=10_000)
    assert result.ok and result.samples_per_s == row["samples_per_s"] and result.peak_mem_bytes == row["peak_mem_bytes"]
    assert clock.now() == row["probe_s"]
    short = evaluator.evaluate(params, timeout_s=1.0)  # a probe longer than the time left
    assert short.status == "timeout" and clock.now() == row["probe_s"] + 1.0


def test_replay_json_output(capsys) -> None:
    code = main(["replay", str(TINY), "--budget", "2h", "--memory-ceiling", "40GiB", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("best_params", "best_samples_per_s", "best_peak_mem_bytes", "virtual_s", "trials_run", "oom_probes", "pruned"):
        assert key in data
    table = load_table(TINY)
    assert data["best_samples_per_s"] == table.best_under(40 * GiB)["samples_per_s"]
    assert data["best_peak_mem_bytes"] <= 40 * GiB


def test_replay_bad_table_is_one_line_exit_2(tmp_path, capsys) -> None:
    frame = pd.read_csv(TINY)
    frame.loc[0, "status"] = "exploded"
    assert main(["replay", str(_write(tmp_path, frame))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autotune: error: replay table") and "\n" not in err




def test_a_replayed_near_tie_is_probed_again_and_charged_again(tmp_path) -> None:
    frame = pd.read_csv(TINY)
    fits = frame.index[(frame["status"] == "ok") & (frame["peak_mem_bytes"] <= 40 * GiB)]
    frame.loc[frame["status"] == "ok", "samples_per_s"] = 1.0
    frame.loc[fits[0], "samples_per_s"] = 100.0
    frame.loc[fits[1], "samples_per_s"] = 99.5  # within 2%: a near-tie
    table = load_table(_write(tmp_path, frame))
    outcome = replay_search(table, budget_s=24 * 3600, memory_ceiling_bytes=40 * GiB, strategy="random", seed=0)
    assert outcome.stopped_because == "exhausted"
    # Every configuration once, the two near-ties twice; each probe charged its probe_s.
    assert outcome.remeasures == 2 and outcome.trials_run == len(frame) + 2
    again_s = frame.loc[fits[0], "probe_s"] + frame.loc[fits[1], "probe_s"]
    assert outcome.virtual_s == pytest.approx(frame["probe_s"].sum() + again_s)
    # A table is deterministic: the re-measure returns the same row, so the mean is the row's value.
    assert outcome.best_samples_per_s == 100.0


# ---------------------------------------------------------------------------------------- the knobs added later


def test_a_shipped_table_without_the_later_columns_reads_them_at_their_defaults() -> None:
    from autotune.params import KNOBS_ADDED_LATER

    table = load_table(DATA / "landscape_pythia-160m-l4.csv.gz")
    assert not set(KNOBS_ADDED_LATER) & set(pd.read_csv(DATA / "landscape_pythia-160m-l4.csv.gz", nrows=1).columns)
    space = table.space()
    defaults = TrialParams()
    for name in KNOBS_ADDED_LATER:
        assert space.choices[name] == (getattr(defaults, name),), name
    row = table.frame[table.frame["status"] == "ok"].iloc[0]
    params = TrialParams.from_dict({k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()})
    assert params.use_liger_kernel is False and params.torch_empty_cache_steps is None and params.dataloader_pin_memory is True
    assert table.row(params) is not None
    assert ReplayEvaluator(table).evaluate(params, timeout_s=10_000).samples_per_s == row["samples_per_s"]


def test_a_table_with_the_later_columns(tmp_path) -> None:
    frame = pd.read_csv(TINY)
    liger = frame.assign(use_liger_kernel=True, samples_per_s=frame["samples_per_s"] * 1.2)
    frame = pd.concat([frame.assign(use_liger_kernel=False), liger], ignore_index=True)
    frame["torch_empty_cache_steps"] = ""  # empty: None, never
    frame.loc[frame.index[-1], "torch_empty_cache_steps"] = "4"
    frame["dataloader_prefetch_factor"] = "none"
    table = load_table(_write(tmp_path, frame))
    space = table.space()
    assert space.choices["use_liger_kernel"] == (False, True)
    assert space.choices["torch_empty_cache_steps"] == (None, 4) and space.choices["dataloader_prefetch_factor"] == (None,)
    last = frame.iloc[-1]
    params = TrialParams.from_dict({k: (v.item() if hasattr(v, "item") else v) for k, v in last.items()
                                    if k not in ("torch_empty_cache_steps", "dataloader_prefetch_factor")})
    assert table.row(params.replace(torch_empty_cache_steps=4)) is not None
    outcome = replay_search(table, budget_s=24 * 3600, memory_ceiling_bytes=40 * GiB, space=parse_space(
        {"per_device_train_batch_size": [8, 16], "use_liger_kernel": [False, True], "precision": sorted(set(frame["precision"]))}),
        strategy="random", seed=0)
    assert outcome.best_params is not None and outcome.best_params["use_liger_kernel"] is True


def test_bad_later_column_values_name_line_and_column(tmp_path) -> None:
    frame = pd.read_csv(TINY).assign(use_liger_kernel="maybe")
    assert "line 2, column use_liger_kernel: 'maybe' is not true or false" in _error(_write(tmp_path, frame))
    frame = pd.read_csv(TINY).assign(torch_empty_cache_steps="0")
    assert "line 2, column torch_empty_cache_steps: '0' is not empty (none) or a positive integer" in _error(_write(tmp_path, frame))


def test_worker_only_columns_without_workers_read_as_their_defaults(tmp_path) -> None:
    frame = pd.read_csv(TINY)
    table = load_table(_write(tmp_path, frame.assign(dataloader_prefetch_factor=4)))
    prefetch = dict(zip(table.frame["dataloader_num_workers"], table.frame["dataloader_prefetch_factor"]))
    assert prefetch == {0: None, 4: 4}  # without workers: the same trainings as in a table without the column
    no_workers = frame.index[frame["dataloader_num_workers"] == 0][0]
    both = pd.concat([frame.assign(dataloader_prefetch_factor=4), frame.iloc[[no_workers]]], ignore_index=True)
    assert "are the same configuration" in _error(_write(tmp_path, both))


def test_a_table_with_input_waits_and_confidence_intervals_replays_them_as_a_probe_reports_them(tmp_path) -> None:
    frame = pd.read_csv(TINY)
    frame["input_wait_fraction"] = pd.Series([None] * len(frame), dtype=object)
    frame["step_time_ci95_rel"] = 0.015
    ok = frame.index[frame["status"] == "ok"]
    frame.loc[ok[0], "input_wait_fraction"] = 0.35
    frame.loc[ok[1], "input_wait_fraction"] = 0.05
    table = load_table(_write(tmp_path, frame))
    evaluator = ReplayEvaluator(table, VirtualClock())

    def replayed(position: int):
        row = frame.loc[position]
        params = TrialParams.from_dict({k: (v.item() if hasattr(v, "item") else v) for k, v in row.items() if k in TrialParams.__dataclass_fields__})
        return evaluator.evaluate(params, timeout_s=10_000)

    waiting, feeding = replayed(ok[0]), replayed(ok[1])
    assert waiting.input_wait_fraction == 0.35 and waiting.input_bound  # past the probe's 20 % rule
    assert feeding.input_wait_fraction == 0.05 and not feeding.input_bound
    assert waiting.step_time_ci95_rel == 0.015
    assert replayed(ok[2]).input_wait_fraction is None  # an empty cell: not measured
    without = load_table(TINY)  # a table without the columns: nothing is made up
    plain = ReplayEvaluator(without, VirtualClock()).evaluate(TrialParams.from_dict(
        {k: (v.item() if hasattr(v, "item") else v) for k, v in frame.loc[ok[0]].items() if k in TrialParams.__dataclass_fields__}), timeout_s=10_000)
    assert plain.input_wait_fraction is None and plain.step_time_ci95_rel is None and not plain.input_bound


def test_a_table_with_start_up_and_warm_up_times_replays_them_as_a_probe_reports_them(tmp_path) -> None:
    frame = pd.read_csv(TINY)
    frame["setup_s"] = 12.5
    frame["warmup_s"] = 40.0
    table = load_table(_write(tmp_path, frame))
    evaluator = ReplayEvaluator(table, VirtualClock())

    def params_of(position: int) -> TrialParams:
        return TrialParams.from_dict({k: (v.item() if hasattr(v, "item") else v) for k, v in frame.loc[position].items() if k in TrialParams.__dataclass_fields__})

    ran = evaluator.evaluate(params_of(frame.index[frame["status"] == "ok"][0]), timeout_s=10_000)
    assert (ran.setup_s, ran.warmup_s) == (12.5, 40.0)  # what the strategy's probe-cost model learns from
    failed = evaluator.evaluate(params_of(frame.index[frame["status"] == "oom"][0]), timeout_s=10_000)
    assert failed.setup_s == 12.5 and failed.warmup_s is None  # a failure reports its start-up, as a live one does
    plain = ReplayEvaluator(load_table(TINY), VirtualClock()).evaluate(params_of(frame.index[frame["status"] == "ok"][0]), timeout_s=10_000)
    assert plain.setup_s is None and plain.warmup_s is None  # a table without the columns: nothing is made up


def test_bad_input_wait_values_name_line_and_column(tmp_path) -> None:
    frame = pd.read_csv(TINY).assign(input_wait_fraction=1.5)
    assert "line 2, column input_wait_fraction: 1.5 is not empty or a fraction in [0, 1]" in _error(_write(tmp_path, frame))
    frame = pd.read_csv(TINY).assign(step_time_ci95_rel="wide")
    assert "line 2, column step_time_ci95_rel: 'wide' is not empty or a non-negative number" in _error(_write(tmp_path, frame))
