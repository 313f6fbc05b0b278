"""Sharding and offload as a searched dimension (DeepSpeed ZeRO through the Trainer): values, memory, planning, a real run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autotune import sharding
from autotune.errors import EXIT_USAGE, SearchSpaceError, UsageError
from autotune.models import resolve_model
from autotune.options import RunOptions
from autotune.params import TrialParams
from autotune.plan import plan_run
from autotune.records import ProbeResult
from autotune.search.estimate import estimate_table
from autotune.search.memory_prior import CUDA_CONTEXT_BYTES, ModelDims, host_state_bytes, static_memory
from autotune.space import parse_space
from autotune.units import GiB

ZERO_SPACE = Path(__file__).parent / "data" / "spaces" / "zero.yaml"


def test_a_value_names_what_is_partitioned_and_what_lives_on_the_host() -> None:
    assert sharding.device_shares("none", 4) == (1.0, 1.0, 1.0)
    assert sharding.device_shares("zero1", 4) == (1.0, 1.0, 0.25)
    assert sharding.device_shares("zero2", 4) == (1.0, 0.25, 0.25)
    assert sharding.device_shares("zero3", 4) == (0.25, 0.25, 0.25)
    assert sharding.device_shares("zero2_offload", 4) == (1.0, 0.25, 0.0)
    assert sharding.device_shares("zero3_offload", 1) == (0.0, 1.0, 0.0)
    assert sharding.host_shares("zero2_offload") == (0.0, 1.0) and sharding.host_shares("zero3_offload") == (1.0, 1.0)
    assert sharding.host_shares("zero3") == (0.0, 0.0)
    with pytest.raises(ValueError, match="'zero4' is not one of none, zero1"):
        sharding.parse("zero4")


def test_device_memory_orders_shardings_only_where_it_always_holds() -> None:
    assert sharding.needs_no_less_device_memory("none", "zero3_offload")
    assert sharding.needs_no_less_device_memory("zero2", "zero3")
    assert sharding.needs_no_less_device_memory("zero2", "zero2_offload")
    assert not sharding.needs_no_less_device_memory("zero3", "zero2")
    # Over many ranks stage 3 keeps less than stage 2 with offload, over one rank more: no order.
    assert not sharding.needs_no_less_device_memory("zero3", "zero2_offload")
    assert not sharding.needs_no_less_device_memory("zero2_offload", "zero3")


def test_the_trainer_gets_a_self_contained_deepspeed_dict_and_offload_names_deepspeeds_adamw() -> None:
    kwargs = TrialParams(sharding="zero3_offload").training_arguments_kwargs()
    config = kwargs["deepspeed"]
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                           "offload_param": {"device": "cpu", "pin_memory": True}}
    assert config["optimizer"]["type"] == "AdamW"  # DeepSpeed refuses a client optimizer with offload
    assert config["train_micro_batch_size_per_gpu"] == "auto" and config["bf16"] == {"enabled": "auto"}
    assert "optimizer" not in TrialParams(sharding="zero2").training_arguments_kwargs()["deepspeed"]
    assert "deepspeed" not in TrialParams().training_arguments_kwargs()
    assert TrialParams(sharding="zero2").short().endswith(" zero2")


def test_a_users_own_zero_config_reads_as_its_value_and_none_is_no_config_field() -> None:
    from autotune.config_fields import config_overrides, params_from_config

    user = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": "auto"}}
    assert sharding.of_deepspeed_config(user) == "zero2_offload"
    assert sharding.of_deepspeed_config({"zero_optimization": {"stage": 3}}) == "zero3"
    assert sharding.of_deepspeed_config({"zero_optimization": {"stage": 0}}) is None
    assert sharding.of_deepspeed_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}) is None
    assert params_from_config({"deepspeed": user, "per_device_train_batch_size": 4}, TrialParams()).sharding == "zero2_offload"
    # Applied on top of a user's config, a trial without sharding sets no field named sharding (there is none).
    assert "sharding" not in config_overrides(TrialParams()) and "deepspeed" not in config_overrides(TrialParams())
    assert config_overrides(TrialParams(sharding="zero2"))["deepspeed"]["zero_optimization"] == {"stage": 2}


def test_zero_offload_keeps_two_plus_two_bytes_per_parameter_on_the_gpu_and_the_rest_on_the_host() -> None:
    # ZeRO (Rajbhandari et al. 2020), mixed precision with Adam: 2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32
    # master weights and two moments) bytes per parameter; ZeRO-Offload moves the 12 to the host, where the CPU Adam
    # steps on fp32 gradients: 16 bytes per parameter there, 18 with the parameters, DeepSpeed's own estimates.
    dims = ModelDims.from_spec(resolve_model("polyglot-ko-5.8b"))
    p = dims.num_parameters
    offloaded = static_memory(dims, "bf16", "adamw_torch_fused", "zero2_offload", world=1)
    assert offloaded.weights_bytes == 2 * p and offloaded.gradients_bytes == 2 * p and offloaded.optimizer_bytes == 0
    assert offloaded.total_bytes == 4 * p + CUDA_CONTEXT_BYTES
    assert host_state_bytes(dims, TrialParams(precision="bf16", sharding="zero2_offload")) == 16 * p
    assert host_state_bytes(dims, TrialParams(precision="bf16", sharding="zero3_offload")) == 18 * p
    # In fp32 the master is still a copy (DeepSpeed clones the partition): 4 + 4 + 8 on the host, + 4 with the parameters.
    assert host_state_bytes(dims, TrialParams(precision="fp32", sharding="zero2_offload")) == 16 * p
    assert host_state_bytes(dims, TrialParams(precision="fp32", sharding="zero3_offload")) == 20 * p
    # A module stored in bf16 (a user's model loaded so): DeepSpeed's master, optimizer state and host gradients are fp32
    # all the same, and its device gradients 16-bit.
    stored_bf16 = dataclasses.replace(dims, parameter_bytes=2 * p, trainable_bytes=2 * p, fp32_parameters=0)
    assert host_state_bytes(stored_bf16, TrialParams(precision="bf16", sharding="zero2_offload")) == 16 * p
    bf16_module = static_memory(stored_bf16, "bf16", "adamw_torch_fused", "zero2_offload", world=1)
    assert bf16_module.weights_bytes == 2 * p and bf16_module.gradients_bytes == 2 * p
    # Stage 3 over 4 ranks: each holds a quarter of all 16 bytes; nothing on the host.
    quarter = static_memory(dims, "bf16", "adamw_torch_fused", "zero3", world=4)
    assert quarter.total_bytes - CUDA_CONTEXT_BYTES == pytest.approx(16 * p / 4, rel=1e-6)
    assert host_state_bytes(dims, TrialParams(precision="bf16", sharding="zero3")) == 0
    # Without sharding the Trainer's own AMP: fp32 weights and their 16-bit copies, fp32 gradients, AdamW's 8 bytes.
    assert static_memory(dims, "bf16", "adamw_torch_fused").total_bytes == (4 + 2 + 4 + 8) * p + CUDA_CONTEXT_BYTES


def test_estimate_names_the_configurations_that_fit_only_with_offload() -> None:
    # The case: full fine-tuning of polyglot-ko-5.8b on an 80 GiB card with 120 GiB of host memory.
    estimate = estimate_table("polyglot-ko-5.8b", seq_len=512, device_memory_bytes=80 * GiB, host_memory_bytes=120 * GiB)
    rows = {(r.precision, r.optim, r.gradient_checkpointing, r.sharding): r for r in estimate.rows}
    plain = rows[("bf16", "adamw_torch_fused", False, "none")]
    offload = rows[("bf16", "adamw_torch_fused", False, "zero2_offload")]
    assert plain.largest_batch is None  # AdamW's state alone is over 80 GiB
    assert offload.largest_batch is not None and offload.only_with_offload
    assert offload.host_bytes <= 120 * GiB
    # Offload runs DeepSpeed's own AdamW: no offload row for an optimizer it cannot run, whose plain row fits.
    assert rows[("bf16", "adafactor", True, "none")].largest_batch is not None
    assert not [r for r in estimate.rows if r.sharding.endswith("_offload") and r.optim not in ("adamw_torch", "adamw_torch_fused")]
    # Where the same optimizer fits without offload (a larger card), its offload rows are not "only with offload".
    roomy = {(r.precision, r.optim, r.gradient_checkpointing, r.sharding): r
             for r in estimate_table("polyglot-ko-5.8b", seq_len=512, device_memory_bytes=160 * GiB, host_memory_bytes=120 * GiB).rows}
    assert roomy[("bf16", "adamw_torch_fused", True, "none")].largest_batch is not None
    assert not roomy[("bf16", "adamw_torch_fused", True, "zero2_offload")].only_with_offload
    # A host too small for the offloaded state: the row does not fit.
    small_host = estimate_table("polyglot-ko-5.8b", seq_len=512, device_memory_bytes=80 * GiB, host_memory_bytes=32 * GiB)
    assert all(r.largest_batch is None for r in small_host.rows if r.sharding == "zero3_offload" and r.optim == "adamw_torch_fused")
    # Without --host-memory (and one GPU) the table is as it always was.
    assert {r.sharding for r in estimate_table("pythia-160m", seq_len=512, device_memory_bytes=80 * GiB).rows} == {"none"}


def test_estimate_over_several_gpus_adds_the_zero_stages() -> None:
    estimate = estimate_table("polyglot-ko-5.8b", seq_len=512, device_memory_bytes=80 * GiB, nproc=4)
    found = {r.sharding for r in estimate.rows}
    assert found == {"none", "zero1", "zero2", "zero3"}
    with pytest.raises(UsageError, match="at least 1"):
        estimate_table("pythia-160m", seq_len=512, device_memory_bytes=80 * GiB, nproc=0)


def test_a_sharding_value_that_is_not_one_is_a_space_error_naming_the_values() -> None:
    with pytest.raises(SearchSpaceError, match="sharding: 'zero9' is not one of none, zero1, zero2, zero3, zero2_offload, zero3_offload"):
        parse_space({"sharding": ["none", "zero9"]}, name="x", source="space.yaml")


def test_offload_with_an_optimizer_deepspeed_cannot_run_on_the_host_is_refused_or_pruned(tmp_path) -> None:
    only = tmp_path / "offload_adafactor.yaml"
    only.write_text(ZERO_SPACE.read_text().replace("optim: [adamw_torch_fused]", "optim: [adafactor]")
                    .replace("sharding: [zero2, zero3]", "sharding: [zero2_offload]"))
    with pytest.raises(UsageError) as caught:  # every combination of the space is refused: exit 2, one line
        plan_run(RunOptions(model="tiny-gptneox", space=str(only), seq_len=32, device="cpu", n_trials=1, storage="sqlite:///:memory:"))
    assert caught.value.exit_code == EXIT_USAGE and "\n" not in str(caught.value)
    assert "no sharding value of the space can train with its optimizers (zero2_offload runs DeepSpeed's own AdamW on the host, " \
        "not adafactor" in str(caught.value)
    mixed = parse_space({"optim": ["adamw_torch_fused", "adafactor"], "sharding": ["none", "zero2_offload"]}, name="m", source="m")
    assert mixed.unrunnable(TrialParams(optim="adafactor", sharding="zero2_offload")) is not None
    assert mixed.unrunnable(TrialParams(optim="adamw_torch_fused", sharding="zero2_offload")) is None
    assert mixed.unrunnable(TrialParams(optim="adafactor")) is None


def test_without_deepspeed_the_zero_values_are_dropped_with_the_install_line(monkeypatch) -> None:
    import autotune.space as space_module
    from autotune.records import DeviceInfo

    real = space_module.package_available
    monkeypatch.setattr(space_module, "package_available", lambda name: False if name == "deepspeed" else real(name))
    space = parse_space({"sharding": ["none", "zero2"]}, name="s", source="s")
    cpu = DeviceInfo(kind="cpu", name="cpu", total_memory_bytes=16 * GiB)
    restricted = space.restrict(cpu)
    assert restricted.choices["sharding"] == ("none",)
    assert any(d.param == "sharding" and "pip install deepspeed" in d.reason for d in restricted.dropped)
    with pytest.raises(UsageError, match="no value of sharding can run here.*pip install deepspeed"):
        parse_space({"sharding": ["zero2"]}, name="s", source="s").restrict(cpu)


def test_an_expert_that_does_not_fit_even_frugal_falls_back_to_zero_offload_with_its_own_optimizer(fake_gpu) -> None:
    from autotune.search.expert import expert_fallback

    space = parse_space({"per_device_train_batch_size": [1, 2, 4], "optim": ["adamw_torch_fused", "adafactor"],
                         "gradient_checkpointing": [False, True], "sharding": ["none", "zero2_offload", "zero3_offload"]},
                        name="s", source="s").restrict(fake_gpu)
    oom = ProbeResult(status="oom", error="OutOfMemoryError", wall_s=30.0)
    frugal = TrialParams(per_device_train_batch_size=1, optim="adafactor", gradient_checkpointing=True)
    following = expert_fallback(space, frugal, {frugal.key(): oom}, None, 40 * GiB)
    assert following is not None
    assert following.sharding == "zero2_offload" and following.optim == "adamw_torch_fused"


@pytest.mark.slow
def test_a_cpu_run_measures_two_sharding_values_end_to_end(tmp_path, monkeypatch) -> None:
    pytest.importorskip("deepspeed", reason="the zero values need deepspeed (in the test extras)")
    from autotune.api import tune

    extensions = tmp_path / "torch_extensions"  # where a probe's DeepSpeed would JIT-build its ops
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))

    result = tune("tiny-gptneox", space=str(ZERO_SPACE), seq_len=32, device="cpu", nproc_per_probe=2, n_trials=2,
                  warmup_steps=1, measure_steps=3, max_measure_time="3s", storage=f"sqlite:///{tmp_path / 's.db'}", report_dir=None, verbose=False)
    trials = result.trials
    ok = trials[trials["status"] == "ok"]
    found = set(ok["sharding"])
    assert "none" in found and found & {"zero2", "zero3"}  # the baseline (the Trainer's DDP) and a ZeRO stage, both measured
    assert result.settings.get("nproc_per_probe") == 2
    # The best is per device: best.model.json says how to launch it.
    assert "launch with torchrun --nproc-per-node 2" in result.model_json()["autotune_note"]
    # Its collectives ran on gloo: no probe compiled DeepSpeed's shared-memory op inside its time box.
    assert [p.name for p in extensions.rglob("*shm*")] == []


# ---- the host-memory ceiling ------------------------------------------------------------------------


def test_offload_whose_state_cannot_fit_in_the_host_ceiling_is_dropped_and_alone_refused(fake_gpu, tmp_path, monkeypatch) -> None:
    import types

    import psutil
    import yaml

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=128 * GiB))  # the GPU machine's host

    def space_file(values: list[str]) -> str:
        path = tmp_path / f"{'-'.join(values)}.yaml"
        path.write_text(yaml.safe_dump({"precision": ["bf16"], "optim": ["adamw_torch_fused"], "sharding": values}))
        return str(path)

    # polyglot-ko-5.8b, bf16 AdamW: ZeRO-Offload puts 16 B/param (88 GiB) on the host, stage 3's offload 18 B/param.
    plan = plan_run(RunOptions(model="polyglot-ko-5.8b", space=space_file(["none", "zero2_offload", "zero3_offload"]), device=fake_gpu,
                               seq_len=512, n_trials=1, storage="sqlite:///:memory:", host_memory_ceiling="92GiB"))
    assert plan.host_memory_ceiling_bytes == 92 * GiB
    assert plan.space.choices["sharding"] == ("none", "zero2_offload")
    reason = next(d.reason for d in plan.space.dropped if d.param == "sharding")
    assert "needs 98.66 GiB of host memory, over the 92.00 GiB host ceiling (--host-memory-ceiling)" in reason
    with pytest.raises(UsageError, match="no value of sharding can run here.*host ceiling") as caught:
        plan_run(RunOptions(model="polyglot-ko-5.8b", space=space_file(["zero2_offload"]), device=fake_gpu, seq_len=512, n_trials=1,
                            storage="sqlite:///:memory:", host_memory_ceiling="32GiB"))
    assert caught.value.exit_code == EXIT_USAGE
    with pytest.raises(UsageError, match="--host-memory-ceiling is for GPU runs"):
        plan_run(RunOptions(model="tiny-gptneox", space="quick", device="cpu", seq_len=32, n_trials=1, storage="sqlite:///:memory:",
                            host_memory_ceiling="8GiB"))


def test_a_probe_over_the_host_ceiling_does_not_fit() -> None:
    from autotune.probe.evaluator import over_host_ceiling
    from autotune.records import ProbeStatus

    ok = ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=20 * GiB, host_peak_rss_bytes=90 * GiB, wall_s=60.0)
    over = over_host_ceiling(ok, 80 * GiB)
    assert over.status is ProbeStatus.OOM and over.samples_per_s is None
    assert over.error == "host memory: the probe's processes peaked at 90.00 GiB, over the 80.00 GiB host ceiling"
    assert over.host_peak_rss_bytes == 90 * GiB and over.wall_s == 60.0
    assert over_host_ceiling(ok, 100 * GiB) is ok and over_host_ceiling(ok, None) is ok


def test_deepspeed_on_a_cpu_runs_its_collectives_on_gloo_without_compiling_its_shared_memory_op() -> None:
    pytest.importorskip("deepspeed", reason="the zero values need deepspeed (in the test extras)")
    from deepspeed.comm.torch import build_shm_op

    from autotune.sharding import deepspeed_collectives_on_gloo

    deepspeed_collectives_on_gloo()
    assert build_shm_op() is None  # otherwise g++ builds deepspeed_shm_comm and it returns the loaded op
