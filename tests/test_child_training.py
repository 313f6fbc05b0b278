"""The probe trains as the user will: TrainingArguments at their defaults where the probe has no
reason to differ, and divergence detected without the host syncs a user's run does not have."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import TrainerControl, TrainingArguments

from autotune.models import resolve_model
from autotune.params import TrialParams
from autotune.probe.child import _make_callback, probe_training_arguments
from autotune.records import ProbeSpec


def _spec(**overrides) -> ProbeSpec:
    return ProbeSpec(
        model=resolve_model("tiny-gptneox").to_dict(), seq_len=32,
        **{"params": TrialParams(per_device_train_batch_size=4), "warmup_steps": 1, "measure_steps": 3, **overrides},
    )


def test_probe_keeps_the_nan_inf_logging_filter_at_its_default(tmp_path) -> None:
    default = TrainingArguments.__dataclass_fields__["logging_nan_inf_filter"].default
    args = probe_training_arguments(_spec(), str(tmp_path), max_steps=4, cuda=False)
    assert args.logging_nan_inf_filter == default
    assert default is True  # the filter's isnan check, a host sync per micro-batch, is in the user's run too


def test_probe_arguments_are_the_trials_own(tmp_path) -> None:
    params = TrialParams(per_device_train_batch_size=3, gradient_accumulation_steps=2, optim="adamw_torch")
    args = probe_training_arguments(_spec(params=params), str(tmp_path), max_steps=7, cuda=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_steps) == (3, 2, 7)
    assert args.optim == "adamw_torch"


def _end_step(callback) -> TrainerControl:
    control = TrainerControl()
    callback.on_step_end(None, None, control)
    return control


def test_non_finite_micro_batch_loss_stops_training_at_that_step() -> None:
    callback = _make_callback(_spec(warmup_steps=0, measure_steps=5), cuda=False)
    callback.on_train_begin(None, None, TrainerControl())
    for loss in (2.0, 1.9):  # step 1: two finite micro-batches
        callback.count_non_finite(torch.tensor(loss))
    assert not _end_step(callback).should_training_stop and not callback.diverged
    callback.count_non_finite(torch.tensor(1.8))
    callback.count_non_finite(torch.tensor(float("nan")))  # step 2: one micro-batch diverged
    assert _end_step(callback).should_training_stop
    assert callback.diverged and callback.diverged_at_step == 2


@pytest.mark.parametrize("loss", [float("inf"), float("-inf")])
def test_infinite_loss_is_divergence_too(loss) -> None:
    callback = _make_callback(_spec(warmup_steps=0, measure_steps=5), cuda=False)
    callback.on_train_begin(None, None, TrainerControl())
    callback.count_non_finite(torch.tensor(loss))
    assert _end_step(callback).should_training_stop and callback.diverged_at_step == 1


def test_counting_does_not_read_the_loss_on_the_host(monkeypatch) -> None:
    # The count is a device tensor, read once per optimizer step in on_step_end, never per micro-batch.
    callback = _make_callback(_spec(), cuda=False)
    reads = []
    for read in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, read, lambda self, read=read: reads.append(read))
    for _ in range(4):
        callback.count_non_finite(torch.tensor(float("nan")))
    assert reads == [] and isinstance(callback.non_finite, torch.Tensor)
    monkeypatch.undo()
    assert int(callback.non_finite) == 4


def test_step_budget_allows_the_telemetry_window_on_cuda_only() -> None:
    spec = dataclasses.replace(_spec(), max_measure_steps=12)
    assert _make_callback(spec, cuda=False).step_budget == 12
    # On CUDA the window may stretch to the telemetry minimum: the Trainer must allow the steps.
    assert _make_callback(spec, cuda=True).step_budget > 12
