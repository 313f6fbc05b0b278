"""Several workers on one study (issue #12): real OS processes (tests/search_worker.py) on SQLite, an
Optuna journal file and PostgreSQL; dead workers, killed probes and a killed baseline."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autotune.params import TrialParams
from autotune.records import ProbeResult
from autotune.results import trials_frame
from autotune.search.loop import SearchSettings, run_search
from autotune.search.strategies.base import SeenKeys
from autotune.search.strategies.registry import make_strategy
from autotune.space import SearchSpace, load_space
from autotune.studies import reading, schema, writing
from tests import conftest
from tests.search_worker import CEILING_BYTES, OOM_ABOVE_BYTES, SleepingGPU, open_study

REPO = Path(__file__).resolve().parent.parent
N_TRIALS = 4  # exploring probes per worker
HEARTBEAT_S, GRACE_S = 0.2, 2.0
STORAGES = ["sqlite", "journal", *(["postgres"] if hasattr(conftest, "postgres_url") else [])]

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def quick() -> SearchSpace:
    return load_space("quick")


@pytest.fixture
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage spec as tests/search_worker.py takes it."""
    kind = getattr(request, "param", "sqlite")
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    if kind == "journal":
        return f"journal:{tmp_path / 'study.log'}"
    return str(request.getfixturevalue("postgres_database"))


def _new_study(storage: str) -> str:
    """Create the study before any worker starts (workers creating a fresh SQLite file at once race on its tables)."""
    name = f"workers-{uuid.uuid4().hex[:8]}"
    open_study(storage, name)
    return name


def _start(storage: str, name: str, out: Path, space_file: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "tests.search_worker", storage, name, str(out), "--space-json", str(space_file),
        "--heartbeat-s", str(HEARTBEAT_S), "--grace-s", str(GRACE_S), *extra,
    ]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _space_file(space: SearchSpace, tmp_path: Path) -> Path:
    path = tmp_path / "space.json"
    path.write_text(json.dumps(space.to_dict()))
    return path


def _probes(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that ran a probe (held and repeated trials excluded), re-measures included."""
    return [t for t in study.get_trials() if schema.ATTR_RESULT in t.user_attrs and schema.ATTR_DUPLICATE_OF not in t.user_attrs]


def _key(trial: optuna.trial.FrozenTrial) -> tuple[Any, ...]:
    return TrialParams.from_dict(trial.user_attrs[schema.ATTR_PARAMS]).key()


def _settings(**changes: Any) -> SearchSettings:
    values: dict[str, Any] = {
        "memory_ceiling_bytes": CEILING_BYTES, "n_trials": N_TRIALS, "heartbeat_interval_s": HEARTBEAT_S, "heartbeat_grace_s": GRACE_S,
    }
    return SearchSettings(**{**values, **changes})


# ---------------------------------------------------------------------------------------- several workers


@pytest.mark.slow
@pytest.mark.parametrize("n_workers", [2, 3])
@pytest.mark.parametrize("storage", STORAGES, indirect=True)
def test_workers_search_one_study_as_one_search(storage: str, n_workers: int, quick: SearchSpace, tmp_path: Path) -> None:
    name = _new_study(storage)
    space_file = _space_file(quick, tmp_path)
    outs = [tmp_path / f"worker{i}.json" for i in range(n_workers)]
    workers = [_start(storage, name, out, space_file, "--n-trials", str(N_TRIALS), "--probe-s", "0.3", "--seed", str(i))
               for i, out in enumerate(outs)]
    logs = [w.communicate(timeout=180)[0].decode(errors="replace") for w in workers]
    reports = [json.loads(out.read_text()) for out in outs]
    assert [r["error"] for r in reports] == [None] * n_workers, logs  # no worker crashed
    assert [w.returncode for w in workers] == [0] * n_workers

    study = open_study(storage, name)
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    probes = _probes(study)
    exploring = [t for t in probes if schema.ATTR_REMEASURE_OF not in t.user_attrs]
    # No configuration probed twice: only deliberate re-measures repeat one.
    assert len({_key(t) for t in exploring}) == len(exploring)
    rounds = collections.Counter((t.user_attrs[schema.ATTR_REMEASURE_OF], t.user_attrs.get(schema.ATTR_REMEASURE_ROUND))
                                 for t in probes if schema.ATTR_REMEASURE_OF in t.user_attrs)
    assert all(n == 1 for n in rounds.values()), rounds
    # Each worker ran its N_TRIALS exploring probes; they add up, the baseline once among them.
    assert len(exploring) == n_workers * N_TRIALS == sum(len(r["probes"]) for r in reports) - sum(rounds.values())
    assert sum(reading.is_baseline(t) for t in exploring) == 1
    # Held trials (claims lost to another worker) are no probe, outcome or failure to any reader.
    frame = trials_frame(study, CEILING_BYTES)
    assert "fail" not in set(frame["status"])
    assert len(frame) == len([t for t in trials if schema.ATTR_DUPLICATE_OF not in t.user_attrs])
    assert sum(frame["status"].isin(["ok", "oom"])) == len(probes)


# ---------------------------------------------------------------------------------------- dead workers


def _kill_mid_probe(storage: str, name: str, tmp_path: Path, space: SearchSpace, *extra: str) -> dict[str, Any]:
    """Start a worker whose probe hangs, wait until it is in it, kill -9 it; what it was probing."""
    hang = tmp_path / "hang.json"
    worker = _start(storage, name, tmp_path / "killed.json", _space_file(space, tmp_path), "--hang-file", str(hang), *extra)
    deadline_s = time.monotonic() + 120
    while not hang.exists() or not hang.read_text():
        assert worker.poll() is None, worker.communicate()[0].decode(errors="replace")
        assert time.monotonic() < deadline_s, "the worker never started its probe"
        time.sleep(0.05)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=30)
    return dict(json.loads(hang.read_text()))


FAULT_STORAGES = ["sqlite", "postgres"]  # fault injection on a file and on a server


@pytest.mark.slow
@pytest.mark.parametrize("storage", FAULT_STORAGES, indirect=True)
@pytest.mark.parametrize("host", ["this host", "another host"])
def test_a_killed_worker_is_failed_and_its_configuration_probed_once_more(
    storage: str, host: str, quick: SearchSpace, tmp_path: Path
) -> None:
    name = _new_study(storage)
    # It runs the baseline, then hangs in its second probe. On another host only the heartbeat tells it died.
    owner = ["--owner", "elsewhere:12345"] if host == "another host" else []
    hung = _kill_mid_probe(storage, name, tmp_path, quick, "--hang-after", "1", *owner)
    study = open_study(storage, name)
    assert study.get_trials()[hung["trial"]].state == TrialState.RUNNING

    started_s = time.monotonic()
    gpu = SleepingGPU(oom_above_bytes=OOM_ABOVE_BYTES, sleep_s=0.3)
    # TPE: no memory model, so the retry is probed, not pruned as bayes may once its model says it cannot fit.
    run_search(study, quick, gpu, _settings(n_trials=10), baseline=quick.baseline(), strategy=make_strategy("tpe"))
    dead = study.get_trials()[hung["trial"]]
    assert dead.state == TrialState.FAIL
    assert schema.ATTR_DIED in dead.user_attrs and dead.user_attrs[schema.ATTR_REUSABLE] is False
    assert ("gone" if host == "this host" else "no heartbeat") in dead.user_attrs[schema.ATTR_REASON]
    retries = [t for t in study.get_trials() if t.user_attrs.get(schema.ATTR_RETRY_OF) == dead.number]
    assert len(retries) == 1 and retries[0].user_attrs[schema.ATTR_STATUS] in ("ok", "oom"), retries[0].user_attrs
    params = TrialParams.from_dict(hung["params"])
    assert gpu.calls.count(params) == 1  # probed once more, once
    assert not [t for t in study.get_trials() if t.state == TrialState.RUNNING]
    if host == "another host":  # the dead trial was left alone for the grace
        assert time.monotonic() - started_s > GRACE_S - 1.0


@pytest.mark.slow
@pytest.mark.parametrize("storage", FAULT_STORAGES, indirect=True)
def test_a_run_killed_during_the_baseline_runs_it_again_on_resume(storage: str, quick: SearchSpace, tmp_path: Path) -> None:
    name = _new_study(storage)
    hung = _kill_mid_probe(storage, name, tmp_path, quick, "--hang-after", "0")
    study = open_study(storage, name)
    assert reading.is_baseline(study.get_trials()[hung["trial"]])
    assert writing.fail_orphaned_trials(study) == 1  # its process is gone: failed at once, not after the grace
    assert not reading.has_baseline(study)  # the killed run's baseline never finished

    gpu = SleepingGPU(oom_above_bytes=OOM_ABOVE_BYTES, sleep_s=0.0)
    run_search(study, quick, gpu, _settings(n_trials=2), baseline=quick.baseline(), strategy=make_strategy("bayes"))
    assert gpu.calls[0] == quick.baseline()
    baselines = [t for t in study.get_trials() if reading.is_baseline(t)]
    assert [t.state for t in baselines] == [TrialState.FAIL, TrialState.COMPLETE]
    assert baselines[1].user_attrs[schema.ATTR_RETRY_OF] == baselines[0].number
    assert reading.has_baseline(study)


# ---------------------------------------------------------------------------------------- killed probes


class KilledProbes(SleepingGPU):
    """The first configuration probed is killed (SIGKILL) ``kills`` times, then measures normally."""

    kills: int = 1
    victim: TrialParams | None = None

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        self.victim = self.victim or params
        if params == self.victim and self.calls.count(params) < self.kills:
            self.calls.append(params)
            # As a study stored before ProbeResult.process_lost holds it: the error text alone says it was killed.
            return ProbeResult(status="crash", error="probe process killed by SIGKILL (the kernel's OOM killer?)\ntail", wall_s=1.0)
        return super().evaluate(params, timeout_s=timeout_s)


@pytest.mark.parametrize("kills", [1, 2, 3])
def test_a_killed_probe_is_retried_once_and_a_second_kill_is_final(kills: int, quick: SearchSpace) -> None:
    study = optuna.create_study(direction="maximize")
    gpu = KilledProbes(oom_above_bytes=OOM_ABOVE_BYTES, sleep_s=0.0)
    gpu.kills = kills
    outcome = run_search(study, quick, gpu, _settings(n_trials=6), strategy=make_strategy("bayes"))
    assert gpu.victim is not None
    assert gpu.calls.count(gpu.victim) == min(kills, 2) + (kills == 1)  # a second kill is final: never a third probe
    victim = [t for t in study.get_trials() if t.user_attrs.get(schema.ATTR_PARAMS) == gpu.victim.to_dict()]
    first, retry = victim[0], victim[1]
    assert first.state == TrialState.FAIL and first.user_attrs[schema.ATTR_REUSABLE] is False
    assert schema.ATTR_RESULT not in first.user_attrs  # it measured nothing about the configuration
    assert retry.user_attrs[schema.ATTR_RETRY_OF] == first.number
    assert retry.user_attrs[schema.ATTR_STATUS] == ("ok" if kills == 1 else "crash")
    assert len(victim) == 2 and outcome.retries == 1
    assert [p.number for p in reading.stored_probes(study) if p.params == gpu.victim] == [retry.number]


# ---------------------------------------------------------------------------------------- claims


def _claim(study: optuna.Study, space: SearchSpace, params: TrialParams, **kwargs: Any) -> optuna.Trial:
    from autotune.search.loop import _distributions

    return writing.claim(study, params, space.optuna_params(params), _distributions(space), **kwargs)


def test_the_lowest_numbered_claim_holds_a_configuration_and_the_other_is_no_probe(quick: SearchSpace) -> None:
    study = optuna.create_study(direction="maximize")
    params = quick.baseline()
    first, second = _claim(study, quick, params), _claim(study, quick, params)
    assert writing.holder(study, first) is None
    holding = writing.holder(study, second)
    assert holding is not None and holding.number == first.number
    writing.hold(study, second, params, holding)
    held = study.get_trials()[second.number]
    assert held.state == TrialState.FAIL and held.user_attrs[schema.ATTR_DUPLICATE_OF] == first.number
    assert reading.in_flight(study.get_trials()) == {params.key()}  # the holder, still running
    frame = trials_frame(study, CEILING_BYTES)
    assert list(frame["trial"]) == [first.number]  # not a row, an outcome or a failure
    assert reading.stored_probes(study) == [] and reading.reusable_outcomes(study) == {}


def test_a_held_trial_that_another_worker_failed_as_dead_meanwhile_is_left_as_it_is(quick: SearchSpace) -> None:
    # Under load a worker can be silent past the heartbeat grace while it decides to hold: another
    # worker fails its trial as dead, and recording the hold then met UpdateFinishedTrialError.
    study = optuna.create_study(direction="maximize")
    params = quick.baseline()
    first, second, third = (_claim(study, quick, params) for _ in range(3))
    holding = writing.holder(study, second)
    assert holding is not None and holding.number == first.number
    for trial in (second, third):
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)  # what the dead-trial sweep does
    writing.hold(study, second, params, holding)  # a running holder: named as duplicate
    study.tell(first, 1.0)
    writing.hold(study, third, params, study.get_trials()[first.number])  # a finished one: its outcome repeated
    for trial in (second, third):
        left = study.get_trials()[trial.number]
        assert left.state == TrialState.FAIL and schema.ATTR_DUPLICATE_OF not in left.user_attrs


def test_an_outcome_for_a_trial_another_worker_failed_as_dead_is_dropped_with_a_warning(quick: SearchSpace, caplog) -> None:
    from autotune.search.loop import _record

    study = optuna.create_study(direction="maximize")
    params = quick.baseline()
    trial = _claim(study, quick, params)
    study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)  # what the dead-trial sweep does
    result = ProbeResult(status="ok", samples_per_s=10.0, peak_mem_bytes=1, wall_s=1.0)
    with caplog.at_level("WARNING"):
        assert _record(study, trial, params, result, _settings(), reusable=True) is None
    assert f"trial {trial.number} was failed by another worker" in caplog.text and "its outcome is dropped" in caplog.text
    assert study.get_trials()[trial.number].state == TrialState.FAIL and schema.ATTR_STATUS not in study.get_trials()[trial.number].user_attrs


def test_a_popped_trial_yields_to_any_other_claim(quick: SearchSpace) -> None:
    study = optuna.create_study(direction="maximize")
    params = quick.baseline()
    study.enqueue_trial(quick.optuna_params(params))
    claimed = _claim(study, quick, params)
    popped = writing.ask(study)
    assert quick.suggest(popped) == params and popped.number < claimed.number
    writing.record_params(popped, params)
    holding = writing.holder(study, popped)
    assert holding is not None and holding.number == claimed.number


def test_a_claim_waits_for_an_older_trial_without_a_configuration_yet(quick: SearchSpace) -> None:
    study = optuna.create_study(direction="maximize")
    params = quick.baseline()
    older = writing.ask(study)  # a sampler's trial between ask and suggest
    mine = _claim(study, quick, params)
    started_s = time.monotonic()
    assert writing.holder(study, mine, settle_s=0.3) is None  # it never got one: decided after the wait
    assert time.monotonic() - started_s >= 0.3
    writing.record_params(older, params)
    holding = writing.holder(study, mine, settle_s=0.3)
    assert holding is not None and holding.number == older.number


def test_a_configuration_running_in_another_worker_is_seen_by_the_strategy(quick: SearchSpace) -> None:
    study = optuna.create_study(direction="maximize")
    elsewhere = _claim(study, quick, quick.baseline(), baseline=True)  # the baseline, running in a live worker
    gpu = SleepingGPU(oom_above_bytes=OOM_ABOVE_BYTES, sleep_s=0.0)
    run_search(study, quick, gpu, _settings(n_trials=3), baseline=quick.baseline(), strategy=make_strategy("bayes"))
    assert quick.baseline() not in gpu.calls and len(gpu.calls) == 3
    assert study.get_trials()[elsewhere.number].state == TrialState.RUNNING  # alive: its heartbeat is fresh


def test_seen_keys_is_what_was_measured_and_what_is_in_flight() -> None:
    seen = SeenKeys({("a",): 1, ("b",): 2}, {("b",), ("c",)})
    assert ("c",) in seen and ("d",) not in seen
    assert list(seen) == [("a",), ("b",), ("c",)] and len(seen) == 3


def test_the_shared_deadline_is_stored_with_the_study() -> None:
    study = optuna.create_study(direction="maximize")
    assert writing.deadline_unix_s(study) is None
    writing.record_deadline(study, 1_900_000_000.5)
    assert writing.deadline_unix_s(study) == 1_900_000_000.5
