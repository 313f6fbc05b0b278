"""TrialParams: the knobs added later reach a real TrainingArguments, the worker-only rule, compact names."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autotune.params import (
    KNOBS_ADDED_LATER,
    PARAM_NAMES,
    TrialParams,
    fp32_matmul_setting,
    mixed_precision_dtype,
    uses_tf32,
)


def _training_arguments(params: TrialParams, tmp_path):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **params.training_arguments_kwargs())


@pytest.mark.parametrize("changes", [
    {"torch_empty_cache_steps": 4},
    {"dataloader_pin_memory": False},
    {"dataloader_num_workers": 2, "dataloader_persistent_workers": True},
    {"dataloader_num_workers": 2, "dataloader_prefetch_factor": 4},
    {"use_liger_kernel": True},
    {"optim": "paged_adamw_8bit"},
    {"optim": "paged_adamw_32bit"},
    {"optim": "adamw_8bit"},
    {"optim": "paged_lion_8bit"},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_each_later_knob_reaches_a_real_training_arguments(changes, tmp_path) -> None:
    args = _training_arguments(TrialParams(**changes), tmp_path)  # transformers accepts the kwargs
    for name, value in changes.items():
        assert getattr(args, name) == value


@pytest.mark.parametrize("precision, amp", [("bf16+tf32", "bf16"), ("fp16+tf32", "fp16")])
def test_tf32_under_mixed_precision_is_both_flags(precision, amp, tmp_path, monkeypatch) -> None:
    import transformers.training_args as training_args

    kwargs = TrialParams(precision=precision).training_arguments_kwargs()
    assert kwargs[amp] is True and kwargs["tf32"] is True
    assert mixed_precision_dtype(precision) == amp and uses_tf32(precision) and fp32_matmul_setting(precision) == "high"
    # TrainingArguments refuses tf32=True without an Ampere GPU: stand one in to check the kwargs themselves.
    monkeypatch.setattr(training_args, "is_torch_tf32_available", lambda: True)
    monkeypatch.setattr(training_args, "enable_tf32", lambda enable: None)
    args = _training_arguments(TrialParams(precision=precision), tmp_path)
    assert getattr(args, amp) is True and args.tf32 is True


def test_the_16_bit_precisions_alone_keep_fp32_matmuls_ieee() -> None:
    assert fp32_matmul_setting("bf16") == "highest" and fp32_matmul_setting("tf32") == "high"
    assert mixed_precision_dtype("tf32") is None and not uses_tf32("bf16")


def test_worker_only_settings_collapse_to_their_defaults_without_workers(tmp_path) -> None:
    params = TrialParams(dataloader_num_workers=0, dataloader_prefetch_factor=4, dataloader_persistent_workers=True)
    assert params == TrialParams()  # the same training, the same key
    assert "dataloader_prefetch_factor" not in params.training_arguments_kwargs()
    _training_arguments(params, tmp_path)  # transformers raises for a prefetch factor with 0 workers
    with_workers = params.replace(dataloader_num_workers=2, dataloader_prefetch_factor=4)
    assert with_workers.dataloader_prefetch_factor == 4
    assert with_workers.replace(dataloader_num_workers=0).dataloader_prefetch_factor is None


def test_defaults_add_nothing_to_the_kwargs_and_old_dicts_read_as_defaults() -> None:
    old = {"per_device_train_batch_size": 16, "precision": "bf16", "optim": "adafactor", "gradient_checkpointing": True}
    params = TrialParams.from_dict(old)
    assert all(getattr(params, name) == getattr(TrialParams(), name) for name in KNOBS_ADDED_LATER)
    assert not set(KNOBS_ADDED_LATER) & set(params.training_arguments_kwargs())
    assert PARAM_NAMES[-len(KNOBS_ADDED_LATER):] == KNOBS_ADDED_LATER  # appended: older keys are a prefix


def test_values_read_back_from_a_data_frame_become_python_values() -> None:
    params = TrialParams(dataloader_num_workers=2, torch_empty_cache_steps=np.float64(4.0), dataloader_prefetch_factor=math.nan,
                         use_liger_kernel=np.bool_(True))
    assert params.torch_empty_cache_steps == 4 and type(params.torch_empty_cache_steps) is int
    assert params.dataloader_prefetch_factor is None and params.use_liger_kernel is True
    assert params.key() == TrialParams(dataloader_num_workers=2, torch_empty_cache_steps=4, use_liger_kernel=True).key()


def test_short_names_the_knobs_that_differ_from_their_defaults() -> None:
    assert TrialParams().short() == "bs8x1 fp32 adamw_torch_fused sdpa"
    params = TrialParams(dataloader_num_workers=2, dataloader_prefetch_factor=4, dataloader_persistent_workers=True,
                         dataloader_pin_memory=False, torch_empty_cache_steps=4, use_liger_kernel=True, precision="bf16+tf32")
    assert params.short() == "bs8x1 bf16+tf32 adamw_torch_fused sdpa w2 prefetch4 persistent no-pin empty-cache/4 liger"


def test_a_users_own_config_fields_ride_along_in_every_form() -> None:
    """TrialParams.extra: a user's config fields (TRL's packing) read as attributes, round-trip through to_dict (the
    study), flat (Optuna, tables) and key (equal configurations), and reach the Trainer's kwargs."""
    params = TrialParams(per_device_train_batch_size=16, extra={"packing": True, "max_length": 512})
    assert params.packing is True and params.max_length == 512 and params.extra == (("max_length", 512), ("packing", True))
    assert TrialParams.from_dict(params.to_dict()) == params and TrialParams.from_key(params.key()) == params
    assert TrialParams.from_flat(params.flat(), ("packing", "max_length")) == params
    assert params.replace(packing=False).packing is False and params.replace(packing=False) != params
    assert params.training_arguments_kwargs()["packing"] is True and "packing=true" in params.short()
    assert "extra" not in TrialParams().to_dict() and TrialParams().key()[-1] == ()  # studies from before read unchanged
    with pytest.raises(AttributeError, match="no parameter 'padding_free'"):
        _ = params.padding_free


def test_a_trial_as_config_fields_says_every_setting_it_decides() -> None:
    """config_overrides: applied over a user's own config (bf16=True, compiled), it gives exactly the trial."""
    from autotune.config_fields import as_flags, config_overrides

    fp32 = config_overrides(TrialParams())
    assert (fp32["bf16"], fp32["fp16"], fp32["tf32"], fp32["torch_compile"], fp32["use_liger_kernel"]) == (False, False, False, False, False)
    assert "torch_empty_cache_steps" not in fp32 and "dataloader_prefetch_factor" not in fp32  # None: no flag can say it
    compiled = config_overrides(TrialParams(precision="bf16+tf32", torch_compile="inductor:max-autotune", dataloader_num_workers=2,
                                            extra={"packing": True}))
    assert (compiled["bf16"], compiled["fp16"], compiled["tf32"], compiled["torch_compile"]) == (True, False, True, True)
    assert (compiled["torch_compile_mode"], compiled["dataloader_persistent_workers"], compiled["packing"]) == ("max-autotune", False, True)
    assert as_flags({"bf16": True, "optim": "adamw_torch"}) == ["--bf16", "true", "--optim", "adamw_torch"]
