"""The probe settings a study records: one record, written by the plan and read back by joining workers."""

from __future__ import annotations

import autotune.defaults as defaults
from autotune.options import RunOptions
from autotune.plan import plan_run
from autotune.studies.settings import ProbeSettings
from autotune.units import parse_duration_s


def test_round_trip_keeps_every_field():
    probe = ProbeSettings(warmup_steps=5, measure_steps=11, trial_timeout_s=120.0, seed=7, isolation="cold",
                          trainer_sys_path="/tmp/user", trainer_attn_flag=True, tokens_per_sample=41.5)
    data = probe.to_dict()
    assert set(data) == {"warmup_steps", "measure_steps", "trial_timeout_s", "seed", "isolation",
                         "trainer_sys_path", "trainer_attn_flag", "tokens_per_sample"}
    assert ProbeSettings.from_dict(data) == probe


def test_old_study_missing_keys_reads_as_defaults():
    probe = ProbeSettings.from_dict({"warmup_steps": 4})  # an older autotune recorded fewer keys
    assert probe.warmup_steps == 4
    assert probe.measure_steps == defaults.MEASURE_STEPS
    assert probe.seed == defaults.SEED
    assert probe.isolation == defaults.ISOLATION
    assert probe.trial_timeout_s == parse_duration_s(defaults.TRIAL_TIMEOUT)
    assert probe.trainer_sys_path is None and probe.trainer_attn_flag is False and probe.tokens_per_sample is None
    assert ProbeSettings.from_dict({}) == ProbeSettings()


def test_unknown_keys_are_ignored():
    probe = ProbeSettings.from_dict({"seed": 3, "from_a_newer_autotune": [1, 2], "measured_steps": 9})
    assert probe == ProbeSettings(seed=3)
    assert "from_a_newer_autotune" not in probe.to_dict()


def test_plan_writes_what_workers_read():
    plan = plan_run(RunOptions(model="tiny-gptneox", space="quick", seq_len=32, device="cpu", n_trials=1,
                               storage="sqlite:///:memory:", warmup_steps=2))
    stored = plan.study_attrs(None)["probe"]
    probe = ProbeSettings.from_dict(stored)
    assert probe.warmup_steps == 2
    assert probe.measure_steps == defaults.MEASURE_STEPS
    assert stored == probe.to_dict()  # the plan writes exactly the record's JSON
