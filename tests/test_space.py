"""Search spaces: parsing, validation (every problem at once), and dropping what cannot run."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.errors import SearchSpaceError, UsageError
from autotune.records import DeviceInfo
from autotune.space import builtin_space_names, load_space, parse_space

GiB = 2**30
V100 = DeviceInfo(kind="cuda", name="Tesla V100", total_memory_bytes=32 * GiB, compute_capability=(7, 0))


def test_builtin_spaces_load() -> None:
    assert {"default", "quick"} <= set(builtin_space_names())
    default = load_space("default")
    assert default.choices["per_device_train_batch_size"] == (1, 2, 4, *range(8, 129, 8))
    assert default.choices["torch_compile"] == ("off", "inductor", "inductor:max-autotune")
    assert default.size == 19 * 4 * 4 * 4 * 3 * 3 * 4 * 2


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
    import autotune.api as api
    from autotune.api import RunOptions, plan_run
    from autotune.records import DeviceInfo
    from autotune.space import load_space

    h200 = DeviceInfo(kind="cuda", name="NVIDIA H200", total_memory_bytes=141 * 2**30, index=0, uuid="GPU-x")
    plan = plan_run(RunOptions(model="pythia-160m", seq_len=512, device=h200, n_trials=1, budget=None))
    batches = plan.space.choices["per_device_train_batch_size"]
    assert max(batches) > 128 and all(b % 8 == 0 for b in batches if b > 128)
    # The memory model's bound: the sizes added are those the leanest configuration fits, and the
    # next step up does not fit it.
    largest = api.largest_lean_batch(plan.model, 512, h200.total_memory_bytes, load_space("default"))
    assert max(batches) <= largest
    assert api.largest_lean_batch(plan.model, 512, h200.total_memory_bytes, plan.space) == 0
    cpu = plan_run(RunOptions(model="pythia-160m", seq_len=512, device="cpu", n_trials=1, budget=None))
    assert max(cpu.space.choices["per_device_train_batch_size"]) == 128  # a CPU keeps the file's list
