"""Search spaces: parsing, validation (every problem at once), and dropping what cannot run."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.errors import SearchSpaceError, UsageError
from autotune.records import DeviceInfo
from autotune.space import builtin_space_names, load_space, parse_space
from autotune.units import GiB

V100 = DeviceInfo(kind="cuda", name="Tesla V100", total_memory_bytes=32 * GiB, compute_capability=(7, 0))


def test_builtin_spaces_load() -> None:
    assert {"default", "quick"} <= set(builtin_space_names())
    default = load_space("default")
    assert default.choices["per_device_train_batch_size"] == (1, 2, 4, *range(8, 129, 8))
    assert default.choices["torch_compile"] == ("off", "inductor", "inductor:max-autotune")
    assert default.size == 19 * 4 * 4 * 4 * 3 * 3 * 4 * 2 * 2  # ... x checkpointing x Liger kernels


def test_missing_keys_hold_the_transformers_default() -> None:
    space = parse_space({"precision": ["bf16"]})
    assert space.choices["per_device_train_batch_size"] == (8,)
    assert space.choices["optim"] == ("adamw_torch_fused",)
    assert space.choices["gradient_checkpointing"] == (False,)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SearchSpaceError) as info:
        parse_space(
            {
                "precision": ["fp8"],
                "torch_compile": [False, "inductor:fast"],
                "per_device_train_batch_size": {"multiple_of": 8},
                "gradient_checkpointing": ["yes"],
                "attn": ["sdpa"],
            }
        )
    message = str(info.value)
    assert "6 problem(s)" in message
    for fragment in ("'fp8'", 'write "off" in quotes', "unknown compile mode 'fast'", "max must be an integer",
                     "'yes' is not true or false", "attn: unknown parameter (did you mean attn_implementation?)"):
        assert fragment in message
    assert "\n" not in message


def test_restrict_drops_what_the_device_cannot_run_and_says_why(cpu_device) -> None:
    space = load_space("default").restrict(cpu_device)
    dropped = {(d.param, d.value): d.reason for d in space.dropped}
    assert "tf32" not in space.choices["precision"] and "Ampere" in dropped[("precision", "tf32")]
    assert "flash_attention_2" not in space.choices["attn_implementation"]
    assert "adamw_bnb_8bit" not in space.choices["optim"]
    assert {"fp32", "bf16", "adamw_torch_fused"} <= set(space.choices["precision"]) | set(space.choices["optim"])


def test_restrict_on_a_pre_ampere_gpu() -> None:
    space = load_space("default").restrict(V100)
    assert space.choices["precision"] == ("fp32", "fp16")
    reasons = {d.value: d.reason for d in space.dropped}
    assert "Ampere" in reasons["bf16"] and "Ampere" in reasons["tf32"]


def test_restrict_cuda_graphs_off_cuda(cpu_device) -> None:
    space = parse_space({"torch_compile": ["off", "inductor:reduce-overhead", "cudagraphs"]}).restrict(cpu_device)
    assert space.choices["torch_compile"] == ("off",)


def test_model_without_sdpa(cpu_device) -> None:
    space = parse_space({"attn_implementation": ["eager", "sdpa"]}).restrict(cpu_device, model_supports_sdpa=False)
    assert space.choices["attn_implementation"] == ("eager",)


def test_effective_batch_size_keeps_only_divisors(cpu_device) -> None:
    space = load_space("default").restrict(cpu_device, effective_batch_size=48)
    assert space.choices["per_device_train_batch_size"] == (1, 2, 4, 8, 16, 24, 48)
    assert space.effective_batch_size == 48
    with pytest.raises(UsageError, match="divides --effective-batch-size 7"):
        load_space("quick").restrict(cpu_device, effective_batch_size=7)


def test_nothing_runnable_left_is_an_error(cpu_device) -> None:
    with pytest.raises(UsageError, match="no value of precision can run here"):
        parse_space({"precision": ["tf32"]}).restrict(cpu_device)


def test_bad_yaml_and_missing_file(tmp_path) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text("precision: [fp32\n")
    with pytest.raises(SearchSpaceError, match="not valid YAML"):
        load_space(str(bad))
    with pytest.raises(SearchSpaceError, match="not found"):
        load_space(str(tmp_path / "nope.yaml"))


def test_a_growing_batch_rule_adds_sizes_up_to_what_the_memory_model_says_fits() -> None:
    from autotune.space import load_space

    space = load_space("default")
    assert space.grow_batches_by == 8 and max(space.choices["per_device_train_batch_size"]) == 128
    grown = space.with_batches_up_to(600)
    assert grown.choices["per_device_train_batch_size"][-4:] == (128, 192, 256, 384, 512)[-4:]
    assert grown.size == space.size // len(space.choices["per_device_train_batch_size"]) * (len(space.choices["per_device_train_batch_size"]) + 4)
    assert space.with_batches_up_to(100) == space  # nothing above the maximum fits: unchanged
    assert max(space.with_batches_up_to(10**9).choices["per_device_train_batch_size"]) == 4096
    fixed = load_space("quick")
    assert fixed.grow_batches_by is None and fixed.with_batches_up_to(10**6) == fixed  # an explicit list stays
    ebs = dataclasses.replace(space, effective_batch_size=768)
    assert {b for b in ebs.with_batches_up_to(10**6).choices["per_device_train_batch_size"] if b > 128} == {192, 256, 384, 768}


def test_a_gpu_run_grows_the_batch_sizes_of_a_small_model(monkeypatch) -> None:
    from autotune.api import RunOptions, plan_run
    from autotune.plan import largest_lean_batch
    from autotune.records import DeviceInfo
    from autotune.space import load_space

    h200 = DeviceInfo(kind="cuda", name="NVIDIA H200", total_memory_bytes=141 * 2**30, index=0, uuid="GPU-x")
    plan = plan_run(RunOptions(model="pythia-160m", seq_len=512, device=h200, n_trials=1, budget=None))
    batches = plan.space.choices["per_device_train_batch_size"]
    assert max(batches) > 128 and all(b % 8 == 0 for b in batches if b > 128)
    # The memory model's bound: the sizes added are those the leanest configuration fits, and the
    # next step up does not fit it.
    largest = largest_lean_batch(plan.model, 512, h200.total_memory_bytes, load_space("default"))
    assert max(batches) <= largest
    assert largest_lean_batch(plan.model, 512, h200.total_memory_bytes, plan.space) == 0
    cpu = plan_run(RunOptions(model="pythia-160m", seq_len=512, device="cpu", n_trials=1, budget=None))
    assert max(cpu.space.choices["per_device_train_batch_size"]) == 128  # a CPU keeps the file's list


# ---------------------------------------------------------------------------------------- the knobs added later

A100 = DeviceInfo(kind="cuda", name="NVIDIA A100-SXM4-80GB", total_memory_bytes=80 * GiB, compute_capability=(8, 0))


def test_later_knobs_parse_and_default() -> None:
    space = parse_space({
        "precision": ["bf16", "bf16+tf32", "fp16+tf32"], "torch_empty_cache_steps": [None, 4], "use_liger_kernel": [False, True],
        "dataloader_num_workers": [0, 2], "dataloader_pin_memory": [True, False], "dataloader_persistent_workers": [False, True],
        "dataloader_prefetch_factor": [None, 4], "optim": ["paged_adamw_8bit", "paged_adamw_32bit", "adamw_8bit", "paged_lion_8bit"],
    })
    assert space.choices["torch_empty_cache_steps"] == (None, 4)
    assert space.choices["precision"] == ("bf16", "bf16+tf32", "fp16+tf32")
    # Points without workers count once whatever their worker-only settings: 0 workers x 1 + 2 workers x 2 x 2.
    assert space.size == 3 * 2 * 2 * 2 * 4 * (1 + 2 * 2)
    assert parse_space({}).choices["dataloader_pin_memory"] == (True,)
    assert parse_space({}).choices["torch_empty_cache_steps"] == (None,)


def test_bad_later_knob_values_are_named_with_the_fix() -> None:
    with pytest.raises(SearchSpaceError) as info:
        parse_space({"torch_empty_cache_steps": [0, "often"], "dataloader_prefetch_factor": [True], "use_liger_kernel": ["yes"],
                     "dataloader_pin_memory": [1], "precision": ["bf16+fp8"], "optim": ["paged_adamw_16bit"]})
    message = str(info.value)
    for fragment in ("torch_empty_cache_steps: 0 is not null (never) or a positive step count such as 4",
                     "torch_empty_cache_steps: 'often' is not null", "dataloader_prefetch_factor: True is not null (torch's default, 2)",
                     "use_liger_kernel: 'yes' is not true or false", "dataloader_pin_memory: 1 is not true or false",
                     "'bf16+fp8' is not one of fp32, tf32, fp16, bf16, fp16+tf32, bf16+tf32",
                     "'paged_adamw_16bit' is not a TrainingArguments optim (did you mean paged_adamw_8bit?)"):
        assert fragment in message, message


def test_worker_only_knobs_without_any_workers_are_a_problem() -> None:
    with pytest.raises(SearchSpaceError, match="dataloader_prefetch_factor: only applies with DataLoader workers.*add a worker count"):
        parse_space({"dataloader_prefetch_factor": [4]})
    parse_space({"dataloader_prefetch_factor": [4], "dataloader_num_workers": [0, 2]})  # fine: 0 workers hold the default


def test_a_point_without_workers_holds_the_worker_only_knobs_at_their_defaults(cpu_device) -> None:
    space = parse_space({"dataloader_num_workers": [0, 2], "dataloader_prefetch_factor": [2, 4],
                         "dataloader_persistent_workers": [True]}).restrict(cpu_device)
    point = space.complete({"dataloader_num_workers": 0, "dataloader_prefetch_factor": 4, "dataloader_persistent_workers": True})
    assert point.dataloader_prefetch_factor is None and point.dataloader_persistent_workers is False
    # Optuna only takes values of the space: a default the space does not list is given as its first value.
    assert space.optuna_params(point)["dataloader_prefetch_factor"] == 2
    assert space.complete(space.optuna_params(point)) == point
    assert space.size == 1 + 2  # (0 workers) + (2 workers x prefetch 2 or 4)


def test_tf32_under_mixed_precision_is_dropped_where_tf32_is(cpu_device) -> None:
    space = parse_space({"precision": ["fp32", "bf16", "fp16", "bf16+tf32", "fp16+tf32"]})
    dropped = {d.value: d.reason for d in space.restrict(cpu_device).dropped}
    assert "Ampere" in dropped["bf16+tf32"] and "Ampere" in dropped["fp16+tf32"]
    on_v100 = space.restrict(V100)
    assert on_v100.choices["precision"] == ("fp32", "fp16")
    assert space.restrict(A100).choices["precision"] == ("fp32", "bf16", "fp16", "bf16+tf32", "fp16+tf32")


def test_liger_and_8_bit_optimizers_are_dropped_with_a_reason(cpu_device, monkeypatch) -> None:
    import autotune.space as space_module

    space = parse_space({"use_liger_kernel": [False, True], "optim": ["adamw_torch", "paged_adamw_8bit", "paged_adamw_32bit",
                                                                       "adamw_8bit", "paged_lion_8bit", "ademamix"]})
    reasons = {(d.param, d.value): d.reason for d in space.restrict(cpu_device).dropped}
    assert reasons[("use_liger_kernel", True)] == "Liger's Triton kernels need a CUDA GPU"
    monkeypatch.setattr(space_module, "package_available", lambda module: False)
    on_gpu = space.restrict(A100)
    reasons = {(d.param, d.value): d.reason for d in on_gpu.dropped}
    assert reasons[("use_liger_kernel", True)] == "needs the liger_kernel package (pip install liger-kernel)"
    for optim in ("paged_adamw_8bit", "paged_adamw_32bit", "adamw_8bit", "paged_lion_8bit", "ademamix"):
        assert reasons[("optim", optim)] == "needs the bitsandbytes package (pip install bitsandbytes)"
    assert on_gpu.choices["optim"] == ("adamw_torch",) and on_gpu.choices["use_liger_kernel"] == (False,)
    # Installed: kept for a model type liger-kernel patches, dropped for one it has no kernels for.
    monkeypatch.setattr(space_module, "package_available", lambda module: True)
    monkeypatch.setattr(space_module, "liger_model_types", lambda: frozenset({"llama", "qwen2"}))
    assert space.restrict(A100, model_type="llama").choices["use_liger_kernel"] == (False, True)
    reasons = {(d.param, d.value): d.reason for d in space.restrict(A100, model_type="gpt_neox").dropped}
    assert reasons[("use_liger_kernel", True)] == "liger-kernel has no kernels for model type gpt_neox (it would change nothing)"


def test_liger_model_types_are_read_from_its_source_without_importing_it(tmp_path, monkeypatch) -> None:
    import importlib.machinery
    import importlib.util
    import sys

    import autotune.space as space_module

    package = tmp_path / "liger_kernel"
    (package / "transformers").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / "transformers" / "monkey_patch.py").write_text(
        "MODEL_TYPE_TO_APPLY_LIGER_FN = {\n    'llama': f,\n    'qwen2': g,\n}\n")
    spec = importlib.machinery.ModuleSpec("liger_kernel", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "liger_kernel" else None)
    assert space_module.liger_model_types() == frozenset({"llama", "qwen2"})
    assert "liger_kernel" not in sys.modules


def test_settings_without_effect_on_the_cpu_are_held_at_their_default(cpu_device) -> None:
    space = parse_space({"dataloader_pin_memory": [True, False], "torch_empty_cache_steps": [4]}).restrict(cpu_device)
    assert space.choices["dataloader_pin_memory"] == (True,) and space.choices["torch_empty_cache_steps"] == (None,)
    reasons = {d.param: d.reason for d in space.dropped}
    assert "no effect on the CPU" in reasons["dataloader_pin_memory"] and "no effect on the CPU" in reasons["torch_empty_cache_steps"]
    on_gpu = parse_space({"dataloader_pin_memory": [True, False], "torch_empty_cache_steps": [None, 4]}).restrict(A100)
    assert on_gpu.choices["dataloader_pin_memory"] == (True, False) and on_gpu.choices["torch_empty_cache_steps"] == (None, 4)


def test_a_stored_space_from_before_the_later_knobs_resumes_unchanged(cpu_device) -> None:
    from autotune.params import KNOBS_ADDED_LATER
    from autotune.space import SearchSpace

    quick = load_space("quick")
    stored = quick.to_dict()
    assert not set(KNOBS_ADDED_LATER) & set(stored["choices"])  # as a study made before them stored it
    # The default space where Liger cannot run: stored as before, the drop of use_liger_kernel=True included.
    default = load_space("default").restrict(cpu_device)
    assert default.dropped[-1].param == "use_liger_kernel"
    stored_default = default.to_dict()
    assert not set(KNOBS_ADDED_LATER) & set(stored_default["choices"])
    assert not any(d.startswith("use_liger_kernel") for d in stored_default["dropped"]) and len(stored_default["dropped"]) == 3
    again = SearchSpace.from_dict(stored)
    assert again.choices == quick.choices and again.to_dict() == stored
    liger = dataclasses.replace(quick, choices={**quick.choices, "use_liger_kernel": (False, True)})
    assert liger.to_dict()["choices"]["use_liger_kernel"] == [False, True]  # searched: stored


def test_the_default_space_lists_every_knob() -> None:
    from autotune.params import PARAM_NAMES
    from autotune.space import _builtin_spaces_folder

    text = (_builtin_spaces_folder() / "default.yaml").read_text()
    for name in PARAM_NAMES:
        assert f"\n{name}:" in text, name
    for value in ("bf16+tf32", "fp16+tf32", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_8bit", "paged_lion_8bit"):
        assert value in text, value
    default = load_space("default")
    assert default.choices["use_liger_kernel"] == (False, True)
    assert default.choices["torch_empty_cache_steps"] == (None,) and default.choices["dataloader_prefetch_factor"] == (None,)
