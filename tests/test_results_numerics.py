"""The trials frame's measurement columns: loss drift against the fp32 baseline, and the warnings."""

from __future__ import annotations

from dataclasses import dataclass, field

import optuna
import pytest

from autotune.console import measurement_warnings
from autotune.params import TrialParams, baseline_params
from autotune.records import ProbeResult
from autotune.results import LOSS_DRIFT_TOLERANCE, RESULT_COLUMNS, loss_drift, trials_frame
from autotune.search.loop import SearchSettings, run_search
from autotune.search.strategies.baselines import tpe_sampler as make_sampler
from autotune.space import parse_space
from tests.conftest import GiB

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass
class LossEvaluator:
    """Every configuration fits; its losses depend on precision (fp16 drifts, bf16 barely)."""

    calls: list[TrialParams] = field(default_factory=list)

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        self.calls.append(params)
        offset = {"fp32": 0.0, "bf16": 0.004, "fp16": 0.5}[params.precision]
        losses = tuple(8.0 + offset + 0.01 * step for step in range(4 + params.per_device_train_batch_size // 8))
        return ProbeResult(
            status="ok", samples_per_s=10.0 * params.per_device_train_batch_size, tokens_per_s=1.0, step_time_s=1.0,
            measured_steps=len(losses) - 1, peak_mem_bytes=GiB, losses=losses, stable=True, step_time_ci95_rel=0.01,
            input_wait_fraction=0.5 if params.precision == "fp16" else 0.01, input_bound=params.precision == "fp16",
        )


def test_loss_drift_by_hand() -> None:
    assert loss_drift([8.4, 8.4], [8.0, 8.0, 8.0]) == pytest.approx(0.05)  # common prefix: 2 steps
    assert loss_drift([7.6], [8.0]) == pytest.approx(-0.05)
    assert loss_drift([], [8.0]) is None and loss_drift([float("nan")], [8.0]) is None


def test_trials_frame_flags_configurations_that_change_the_loss(fake_gpu) -> None:
    space = parse_space({"per_device_train_batch_size": [8, 16], "precision": ["fp32", "bf16", "fp16"]}).restrict(fake_gpu)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(0))
    run_search(study, space, LossEvaluator(), SearchSettings(memory_ceiling_bytes=40 * GiB, n_trials=6), baseline=baseline_params())
    frame = trials_frame(study, 40 * GiB)
    assert set(RESULT_COLUMNS) <= set(frame.columns) and {"loss_drift", "numerics_flag"} <= set(frame.columns)
    # The three batch-16 configurations tie (160 samples/s): each is re-measured once.
    assert len(frame[frame["remeasure_of"].isna()]) == 6
    assert len(frame[frame["remeasure_of"].notna()]) == 3
    for _, row in frame.iterrows():
        if row["per_device_train_batch_size"] != 8:  # another batch per step: not comparable
            assert row["loss_drift"] is None or row["loss_drift"] != row["loss_drift"]
            assert not row["numerics_flag"]
        elif row["precision"] == "fp16":
            assert row["loss_drift"] == pytest.approx(0.5 / 8.015, rel=1e-3) and row["numerics_flag"]
        else:
            assert abs(row["loss_drift"]) < LOSS_DRIFT_TOLERANCE and not row["numerics_flag"]
    fp16 = frame[(frame["precision"] == "fp16") & (frame["per_device_train_batch_size"] == 8)].iloc[0]
    warnings = measurement_warnings(fp16)
    assert any("differs from the fp32 baseline's by +6.2%" in w for w in warnings)
    assert any("input-bound: waiting for batches 50%" in w for w in warnings)
    assert measurement_warnings(frame[frame["is_baseline"]].iloc[0]) == []
