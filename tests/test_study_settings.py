"""The settings a study records (#42): one record, written by the plan and read back by workers, results, the report
and the CLI; how it probes (ProbeSettings) is one part of it, the run log stored beside it another."""

from __future__ import annotations

import json

import pandas as pd
import pytest

import autotune.defaults as defaults
from autotune.api import plan_evaluator
from autotune.errors import UsageError
from autotune.options import RunOptions
from autotune.plan import package_versions, plan_run
from autotune.results import TuneResult
from autotune.studies import opening
from autotune.studies.settings import TRAINING_ARGUMENTS, ProbeSettings, RunLog, StudySettings
from autotune.units import parse_duration_s
from autotune.version import __version__
from autotune.workers import options_for_worker


def test_round_trip_keeps_every_field():
    probe = ProbeSettings(warmup_steps=5, measure_steps=11, trial_timeout_s=120.0, seed=7, isolation="cold",
                          trainer_sys_path="/tmp/user", trainer_attn_flag=True, tokens_per_sample=41.5, max_measure_s=4.5)
    data = probe.to_dict()
    assert set(data) == {"warmup_steps", "measure_steps", "trial_timeout_s", "seed", "isolation",
                         "trainer_sys_path", "trainer_attn_flag", "tokens_per_sample", "max_measure_s"}
    assert ProbeSettings.from_dict(data) == probe


def test_old_study_missing_keys_reads_as_defaults():
    probe = ProbeSettings.from_dict({"warmup_steps": 4})  # an older autotune recorded fewer keys
    assert probe.warmup_steps == 4
    assert probe.measure_steps == defaults.MEASURE_STEPS
    assert probe.seed == defaults.SEED
    assert probe.isolation == defaults.ISOLATION
    assert probe.trial_timeout_s == parse_duration_s(defaults.TRIAL_TIMEOUT)
    assert probe.trainer_sys_path is None and probe.trainer_attn_flag is False and probe.tokens_per_sample is None
    assert probe.max_measure_s == parse_duration_s(defaults.MAX_MEASURE_TIME)
    assert ProbeSettings.from_dict({}) == ProbeSettings()


def test_unknown_keys_are_ignored():
    probe = ProbeSettings.from_dict({"seed": 3, "from_a_newer_autotune": [1, 2], "measured_steps": 9})
    assert probe == ProbeSettings(seed=3)
    assert "from_a_newer_autotune" not in probe.to_dict()


def test_plan_writes_what_workers_read():
    plan = plan_run(RunOptions(model="tiny-gptneox", space="quick", seq_len=32, device="cpu", n_trials=1,
                               storage="sqlite:///:memory:", warmup_steps=2, max_measure_time="4s"))
    stored = plan.study_attrs(None)["probe"]
    probe = ProbeSettings.from_dict(stored)
    assert probe.warmup_steps == 2 and probe.max_measure_s == plan.max_measure_s == 4.0
    assert probe.measure_steps == defaults.MEASURE_STEPS
    assert plan_evaluator(plan).max_measure_s == 4.0  # what each probe's spec gets
    joined = options_for_worker(plan.study_settings(None), deadline_unix_s=None, storage="sqlite:///:memory:", study="s", device="cpu",
                                budget="1m", n_trials=None, seed_offset=1)
    assert plan_run(RunOptions(**joined)).max_measure_s == 4.0  # a worker joining the study probes as the run does
    with pytest.raises(UsageError, match="--max-measure-time 0 is not a positive duration: use e.g. 30s"):
        plan_run(RunOptions(model="tiny-gptneox", seq_len=32, device="cpu", n_trials=1, storage="sqlite:///:memory:", max_measure_time=0))
    assert stored == probe.to_dict()  # the plan writes exactly the record's JSON


# The keys RunPlan.study_attrs() wrote before the record existed, in their order: a schema (add, never rename).
STORED_KEYS = [
    "autotune_version", "model", "model_source", "model_config_sha1", "num_parameters", "seq_len", "device", "memory_ceiling_bytes",
    "space", "effective_batch_size", "baseline", "dataset", "strategy", "peft", "parameters", "trainer", "expert", "objective",
    "nproc_per_probe", "host_memory_ceiling_bytes", "baseline_source", "config_class", "user_config", "probe", "command", "versions",
]
# A study as an autotune before workers, LoRA, --trainer and several processes per probe stored it.
OLDER = {
    "model": "tiny-gptneox", "model_source": "builtin", "model_config_sha1": "da1fa2fd4e2c", "num_parameters": 1_445_376, "seq_len": 32,
    "device": {"kind": "cpu", "name": "CPU: test (2 cores)", "total_memory_bytes": 24 * 2**30}, "memory_ceiling_bytes": 20 * 2**30,
    "space": {"name": "quick", "choices": {"per_device_train_batch_size": [4, 8]}, "dropped": ["precision=bf16: not here (test)"]},
    "effective_batch_size": None, "baseline": {"per_device_train_batch_size": 8}, "dataset": None,
    "command": "autotune run --model tiny-gptneox", "runs": [{"budget_s": 60.0, "n_trials": None, "stopped_because": "budget"}], "budget_s": 60.0,
}


def _full() -> StudySettings:
    """A record with every field set to something other than its default."""
    return StudySettings(
        autotune_version="9.9.9", model="m", model_source="trainer", model_config_sha1="abc123abc123", num_parameters=12_704, seq_len=24,
        device={"kind": "cuda", "name": "Fake H100", "total_memory_bytes": 80 * 2**30, "compute_capability": [9, 0]},
        memory_ceiling_bytes=70 * 2**30, space={"name": "quick", "choices": {"precision": ["fp32", "bf16"]}, "dropped": ["fp8: no"]},
        effective_batch_size=32, baseline={"per_device_train_batch_size": 4}, dataset={"path": "/data/c.csv", "text_column": "body"},
        strategy="tpe", peft={"method": "lora", "r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ["dense"]},
        parameters={"total": 100, "trainable": 10, "frozen": 90, "quantized": 0}, trainer={"reference": "mypkg.train:make", "args": ["--x", "1"]},
        expert={"per_device_train_batch_size": 16}, objective="tokens", nproc_per_probe=2, host_memory_ceiling_bytes=100 * 2**30,
        baseline_source="user", config_class="trl.trainer.sft_config.SFTConfig", user_config={"learning_rate": 1e-4},
        probe=ProbeSettings(warmup_steps=5, measure_steps=11, trial_timeout_s=120.0, seed=7, isolation="cold", tokens_per_sample=41.5),
        command="autotune run --trainer mypkg.train:make", versions={"python": "3.11.7", "torch": "2.13.0"},
    )


def test_the_whole_record_round_trips_through_its_json():
    record = _full()
    data = record.to_dict()
    assert list(data) == STORED_KEYS
    assert data["probe"] == record.probe.to_dict()
    assert StudySettings.from_dict(data) == record
    assert StudySettings.from_dict(json.loads(json.dumps(data))) == record  # through the storage's JSON
    assert StudySettings.from_dict({**data, "runs": [], "budget_s": 1.0, "from_a_newer_autotune": 3}) == record  # ignored


def test_an_older_study_reads_as_its_readers_read_it_before():
    record = StudySettings.from_dict(OLDER)
    assert (record.model, record.seq_len, record.memory_ceiling_bytes, record.dropped) == ("tiny-gptneox", 32, 20 * 2**30, ("precision=bf16: not here (test)",))
    # The keys it lacks: what each reader took for a missing key.
    assert record.nproc_per_probe == 1 and record.host_memory_ceiling_bytes is None and record.objective == "samples"
    assert record.strategy == defaults.STRATEGY and record.baseline_source == "defaults" and record.config_class == TRAINING_ARGUMENTS
    assert record.probe is None and record.trainer is None and record.trainer_identity is None and record.lora is None
    assert record.expert is None and record.user_config is None and record.versions == {} and record.autotune_version is None
    result = TuneResult("old", "memory", pd.DataFrame(), settings=dict(OLDER))
    assert (result.objective, result.config_class, result.baseline_label) == ("samples", TRAINING_ARGUMENTS, "transformers' defaults")
    assert result.ranks_note() is None and result.peft_note() is None and result.measured_on_cpu
    # A worker refuses it (no probe settings), as before; a null or empty value reads as a missing one where readers said `or`.
    with pytest.raises(UsageError, match="does not record its run's probe settings"):
        options_for_worker(record, deadline_unix_s=None, storage="sqlite://", study="old", device="cpu", budget="1m", n_trials=None, seed_offset=1)
    empty = StudySettings.from_dict({"nproc_per_probe": None, "strategy": "", "objective": None, "probe": {}, "device": None, "user_config": {}})
    assert (empty.nproc_per_probe, empty.strategy, empty.objective, empty.probe, empty.device) == (1, defaults.STRATEGY, "samples", None, {})
    assert empty.user_config == {}  # read as `is not None` (the user's own config, empty): kept
    assert StudySettings.from_dict({}) == StudySettings() == StudySettings.from_dict(None)
    # The older trainer identity, its reference alone.
    assert StudySettings.from_dict({"trainer": "mypkg.train:make"}).trainer_identity == {"reference": "mypkg.train:make"}


def test_a_missing_identity_key_reads_as_the_identity_rule_reads_it():
    """opening.mismatch compares stored dicts, a missing key as IDENTITY_DEFAULTS says: the record agrees, so an older
    study read and written again keeps its identity."""
    missing = StudySettings.from_dict({}).to_dict()
    assert {key: missing[key] for key in opening.IDENTITY_KEYS} == {key: opening.IDENTITY_DEFAULTS.get(key) for key in opening.IDENTITY_KEYS}
    assert opening.mismatch(OLDER, StudySettings.from_dict(OLDER).to_dict()) is None


def test_the_run_log_is_read_beside_the_record():
    log = RunLog.from_dict({**OLDER, "runs": [*OLDER["runs"], {"budget_s": None, "stopped_because": None}, {"budget_s": 30.0}]})
    assert log.budgets_s == [60.0, 30.0] and log.budget_s == 60.0 and log.stopped_because is None
    assert RunLog.from_dict(OLDER).stopped_because == "budget" == opening.last_stop(OLDER)
    assert RunLog.from_dict({}) == RunLog() and opening.last_stop({}) is None
    assert "runs" not in StudySettings.from_dict(OLDER).to_dict()


def test_the_plan_writes_what_it_wrote_before_the_record():
    from autotune.models import count_parameters

    plan = plan_run(RunOptions(model="tiny-gptneox", space="quick", seq_len=32, device="cpu", n_trials=1,
                               storage="sqlite:///:memory:", warmup_steps=2))
    attrs = plan.study_attrs("autotune run --model tiny-gptneox")
    assert list(attrs) == STORED_KEYS
    assert attrs == {
        "autotune_version": __version__, "model": "tiny-gptneox", "model_source": "builtin",
        "model_config_sha1": opening.config_hash(plan.model.config), "num_parameters": count_parameters(plan.model), "seq_len": 32,
        "device": plan.device.to_dict(), "memory_ceiling_bytes": plan.memory_ceiling_bytes, "space": plan.space.to_dict(),
        "effective_batch_size": None, "baseline": plan.baseline.to_dict(), "dataset": None, "strategy": defaults.STRATEGY, "peft": None,
        "parameters": None, "trainer": None, "expert": plan.expert.to_dict(), "objective": "samples", "nproc_per_probe": 1,
        "host_memory_ceiling_bytes": None, "baseline_source": "defaults", "config_class": "transformers.training_args.TrainingArguments",
        "user_config": None, "probe": {"warmup_steps": 2, "measure_steps": defaults.MEASURE_STEPS,
                                       "trial_timeout_s": parse_duration_s(defaults.TRIAL_TIMEOUT), "seed": defaults.SEED,
                                       "isolation": defaults.ISOLATION, "trainer_sys_path": None, "trainer_attn_flag": False,
                                       "tokens_per_sample": None, "max_measure_s": parse_duration_s(defaults.MAX_MEASURE_TIME)},
        "command": "autotune run --model tiny-gptneox", "versions": package_versions(),
    }
    assert StudySettings.from_dict(attrs) == plan.study_settings("autotune run --model tiny-gptneox")
