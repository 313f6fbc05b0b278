"""`autotune worker` and `--gpus`: workers join one study from its stored settings, share its deadline,
refuse another device kind, and never probe a configuration twice by accident."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from unittest import mock

import optuna
import pytest

from autotune.api import RunOptions, open_study, plan_run
from autotune.errors import DeviceError, UsageError
from autotune.records import DeviceInfo
from autotune.storage import to_optuna
from autotune.studies import opening, reading, schema, writing
from autotune.workers import options_for_worker, parse_gpus, run_workers, worker_command

FAST = ["--model", "tiny-gptneox", "--seq-len", "32", "--warmup-steps", "1", "--measure-steps", "2", "--max-measure-time", "3s",
        "--device", "cpu", "--space", "quick"]
COMMON = {"model": "tiny-gptneox", "space": "quick", "seq_len": 32, "warmup_steps": 1, "measure_steps": 2, "max_measure_time": "3s"}


def test_gpu_lists_are_parsed_or_refused_in_one_line() -> None:
    assert parse_gpus("0,1, 3") == [0, 1, 3] and parse_gpus([2]) == [2] and parse_gpus(None) is None
    for bad in ("0,0", "a,b", "", "-1"):
        with pytest.raises(UsageError, match="--gpus"):
            parse_gpus(bad)


def test_gpus_of_different_kinds_are_refused(monkeypatch) -> None:
    import autotune.plan as plan_module

    cards = {"cuda:0": ("NVIDIA H100 80GB HBM3", 80), "cuda:1": ("NVIDIA A100-SXM4-40GB", 40)}

    def fake_detect(name: str) -> DeviceInfo:
        card, gib = cards[name]
        return DeviceInfo(kind="cuda", name=card, total_memory_bytes=gib * 2**30, index=int(name[-1]), uuid=f"GPU-{name}")

    monkeypatch.setattr(plan_module, "detect_device", fake_detect)
    with pytest.raises(DeviceError, match="different kinds.*one study per kind"):
        plan_run(RunOptions(gpus="0,1", n_trials=1, **COMMON))
    cards["cuda:1"] = cards["cuda:0"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    plan = plan_run(RunOptions(gpus="0,1", n_trials=1, **COMMON))
    assert plan.gpus == [0, 1] and plan.storage == plan_module.WORKERS_STORAGE and plan.device.name == "NVIDIA H100 80GB HBM3"
    assert plan.settings.loader_cores == 7  # 16 cores, two probes at once, each keeping one for its training process
    with pytest.raises(UsageError, match="drop --device"):
        plan_run(RunOptions(gpus="0", device="cpu", n_trials=1, **COMMON))


def test_a_worker_rebuilds_the_run_from_the_study_and_its_deadline(tmp_path) -> None:
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    plan = plan_run(RunOptions(storage=storage, study="s", budget="20m", device="cpu", trial_timeout="2m", seed=5, **COMMON))
    study = open_study(plan)
    settings = opening.study_settings(study)
    options = options_for_worker(settings, deadline_unix_s=time.time() + 600, storage=storage, study="s", device="cpu", budget=None,
                                 n_trials=None, seed_offset=3)
    joined = plan_run(RunOptions(**options))
    assert joined.study_name == "s" and joined.space.to_dict() == plan.space.to_dict()
    assert joined.seq_len == 32 and joined.warmup_steps == 1 and joined.settings.trial_timeout_s == 120
    assert joined.settings.seed == 8 and 590 < joined.settings.budget_s <= 600  # the study's deadline, not its own
    assert opening.mismatch(opening.settings_of(study), joined.study_attrs(None), ("model_config_sha1", "space", "seq_len")) is None
    with pytest.raises(UsageError, match="shared budget .* has ended: give --budget"):
        options_for_worker(settings, deadline_unix_s=time.time() - 5, storage=storage, study="s", device="cpu",
                           budget=None, n_trials=None, seed_offset=1)
    # A device of another kind does not join: one line, nothing written.
    other = DeviceInfo(kind="cpu", name="CPU: another machine (64 cores)", total_memory_bytes=plan.device.total_memory_bytes)
    before = len(study.trials)
    with pytest.raises(UsageError, match="was measured on CPU"):
        open_study(plan_run(RunOptions(**{**options, "device": other})))
    assert len(optuna.load_study(study_name="s", storage=storage).trials) == before


def test_the_worker_command_refuses_a_study_it_cannot_join(tmp_path, capsys) -> None:
    from autotune.cli import main

    storage = f"sqlite:///{tmp_path / 'a.db'}"
    open_study(plan_run(RunOptions(storage=storage, study="s", n_trials=1, budget=None, device="cpu", **COMMON)))
    assert main(["worker", "--storage", storage, "--study", "s", "--device", "cpu"]) == 2  # no budget was ever set
    assert "shared budget" in capsys.readouterr().err
    assert main(["worker", "--storage", storage, "--study", "nope", "--device", "cpu"]) == 2
    assert "no study 'nope'" in capsys.readouterr().err
    # A study made before workers could join one records no probe settings: --gpus refuses it before starting any worker.
    old = optuna.create_study(study_name="old", storage=storage)
    recorded = dict(optuna.load_study(study_name="s", storage=storage).user_attrs[schema.STUDY_ATTR])
    old.set_user_attr(schema.STUDY_ATTR, {k: v for k, v in recorded.items() if k != "probe"})
    with mock.patch("autotune.workers.run_workers") as started:
        assert main(["worker", "--storage", storage, "--study", "old", "--gpus", "0,1"]) == 2
    assert not started.called
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not record its run's probe settings" in err[0] and "autotune run" in err[0]


def _assert_one_search(storage: str) -> Counter[tuple]:
    trials = optuna.load_study(study_name="s", storage=storage).trials
    assert not [t.number for t in trials if t.state.name in ("RUNNING", "WAITING")]
    probes = reading.probes_in(trials)
    remeasures = {t.number for t in trials if schema.ATTR_REMEASURE_OF in t.user_attrs}
    counts = Counter(p.params.key() for p in probes if p.number not in remeasures)
    assert counts and max(counts.values()) == 1, counts  # no configuration probed twice by accident
    return counts


@pytest.mark.slow
def test_a_run_and_a_joining_worker_are_one_search(tmp_path) -> None:
    storage = f"journal:///{tmp_path / 's.log'}"  # an absolute path: journal:////tmp/...
    run = subprocess.Popen([sys.executable, "-m", "autotune.cli", "run", *FAST, "--storage", storage, "--study", "s",
                            "--budget", "4m", "--n-trials", "2", "--report-dir", str(tmp_path / "reports")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not (tmp_path / "s.log").exists() or writing.deadline_unix_s(
            optuna.load_study(study_name="s", storage=to_optuna(storage, write=False))) is None):
        time.sleep(0.5)
    worker = subprocess.run([sys.executable, "-m", "autotune.cli", "worker", "--storage", storage, "--study", "s",
                             "--device", "cpu", "--n-trials", "2", "--quiet"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err
    assert worker.returncode == 0, worker.stderr
    counts = _assert_one_search(to_optuna(storage, write=False))
    assert len(counts) >= 3  # the run's probes and the worker's


def test_workers_started_together_share_the_hosts_cores_for_their_loaders(tmp_path, monkeypatch) -> None:
    from autotune.workers import HOST_WORKERS_ENV

    shares = tmp_path / "shares"
    script = f"import os, sys; open(sys.argv[1], 'a').write(os.environ[{HOST_WORKERS_ENV!r}] + ' ')"
    run_workers(optuna.create_study(), "unused", ["cpu", "cpu", "cpu"], 1, command=lambda device: [sys.executable, "-c", script, str(shares)])
    assert shares.read_text().split() == ["3", "3", "3"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv(HOST_WORKERS_ENV, "3")  # one of those three workers plans its run
    assert plan_run(RunOptions(device="cpu", n_trials=1, **COMMON)).settings.loader_cores == 4  # 16 cores: 5 each, less the trainer's own
    monkeypatch.delenv(HOST_WORKERS_ENV)
    assert plan_run(RunOptions(device="cpu", n_trials=1, **COMMON)).settings.loader_cores == 15
    monkeypatch.setenv(HOST_WORKERS_ENV, "two")
    with pytest.raises(UsageError, match="AUTOTUNE_HOST_WORKERS='two' is not a number of workers: unset it"):
        plan_run(RunOptions(device="cpu", n_trials=1, **COMMON))


@pytest.mark.slow
def test_run_workers_starts_one_worker_per_device_and_follows_the_study(tmp_path) -> None:
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    plan = plan_run(RunOptions(storage=storage, study="s", budget="5m", device="cpu", **COMMON))
    study = open_study(plan)
    writing.record_deadline(study, time.time() + 240)
    seen = []
    outcome = run_workers(study, storage, ["cpu", "cpu"], plan.memory_ceiling_bytes, on_trial=seen.append,
                          command=lambda device: worker_command(storage, "s", device, n_trials=1))
    counts = _assert_one_search(storage)
    # One display saw every worker's probes (near-ties re-measured at the end come on top of the distinct configurations).
    assert outcome.probes_run == len(seen) == sum(counts.values()) + outcome.remeasures and sum(counts.values()) >= 2
    assert any(record.is_baseline for record in seen)
