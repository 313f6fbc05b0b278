"""Faults: a run stopped by Ctrl-C or SIGTERM, killed with kill -9, or unable to write its report
loses nothing, leaves no process or probe folder behind, and exits with the code that says why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest

from autotune.api import RunOptions, plan_run, recover_orphans, run_plan
from autotune.errors import UsageError
from autotune.probe import isolation
from autotune.probe.evaluator import ProbeEvaluator
from autotune.records import ProbeResult
from tests.conftest import FakeEvaluator

FAST = ["--model", "tiny-gptneox", "--seq-len", "32", "--warmup-steps", "1", "--measure-steps", "2", "--max-measure-time", "3s",
        "--device", "cpu", "--space", "quick"]


def _start_run(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    """`autotune run` in its own process group, with its temporary folder (probe folders) under tmp_path."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", "run", *FAST, "--storage", f"sqlite:///{tmp_path / 'a.db'}",
         "--report-dir", str(tmp_path / "reports"), "--study", "s", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env, start_new_session=True,
        preexec_fn=_interruptible,
    )


def _interruptible() -> None:
    """Ctrl-C reaches the run as it does in a terminal: a test session started in the background
    (``nohup``, ``cmd &`` without job control) ignores SIGINT, and its children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _probe_folders(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "tmp").glob(isolation.PROBE_DIR_PREFIX + "*"))


def _wait_for(condition, timeout_s: float = 180.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _finished_trial_line(line: str) -> bool:
    """A trial's outcome line (not the line a log gets when a probe starts)."""
    return line.startswith("trial") and " starts " not in line


def _wait_for_second_probe(proc: subprocess.Popen[str], tmp_path: Path) -> list[str]:
    """Wait until the first trial finished and the next probe is running (its folder holds its spec)."""
    lines = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        lines.append(line)
        if _finished_trial_line(line) or not line:
            break
    assert any(_finished_trial_line(line) for line in lines), "".join(lines)
    try:
        _wait_for(lambda: any((f / "spec.json").exists() for f in _probe_folders(tmp_path)) or proc.poll() is not None,
                  what="the second probe")
    finally:
        if proc.poll() is not None:  # the run ended instead: show why
            out, err = proc.communicate()
            raise AssertionError("".join(lines) + out + err)
    return lines


def _gone(processes: list[psutil.Process]) -> bool:
    return not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_signal_mid_probe_stops_cleanly_and_keeps_every_trial(tmp_path, sig, code) -> None:
    proc = _start_run(tmp_path, "--budget", "10m")
    lines = _wait_for_second_probe(proc, tmp_path)
    run_processes = psutil.Process(proc.pid).children(recursive=True)
    assert run_processes  # the probe server and the probe
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    stdout = "".join(lines) + out
    assert proc.returncode == code, err
    assert "Traceback" not in err and "Top configurations" in stdout and "Stopped: interrupted" in stdout
    assert (tmp_path / "reports" / "s.html").exists()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'a.db'}")
    states = [t.state.name for t in study.trials]
    assert states[0] == "COMPLETE" and "RUNNING" not in states
    assert states[-1] == "FAIL" and study.trials[-1].user_attrs["reason"] == "interrupted by the user"
    _wait_for(lambda: _gone(run_processes), timeout_s=15, what="the run's processes to end")
    assert _probe_folders(tmp_path) == []


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_stops_cleanly(tmp_path) -> None:
    proc = _start_run(tmp_path, "--budget", "10m")
    _wait_for_second_probe(proc, tmp_path)
    run_processes = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler does: the driver and the probe server at once
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'a.db'}")
    assert "RUNNING" not in [t.state.name for t in study.trials] and study.trials[0].state.name == "COMPLETE"
    _wait_for(lambda: _gone(run_processes), timeout_s=15, what="the run's processes to end")


@pytest.mark.slow
def test_ctrl_c_while_the_probe_server_starts_exits_130_in_one_line(tmp_path) -> None:
    proc = _start_run(tmp_path, "--budget", "10m")
    # The header is printed once the study is open, just before the probe server imports torch.
    line = ""
    while not line.strip():
        line = proc.stdout.readline()  # type: ignore[union-attr]
    time.sleep(0.5)
    run_processes = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().count("\n") == 0 and err.startswith("autotune: error: interrupted"), err
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'a.db'}")
    assert "RUNNING" not in [t.state.name for t in study.trials]
    _wait_for(lambda: _gone(run_processes), timeout_s=15, what="the run's processes to end")


@pytest.mark.slow
def test_kill_9_of_the_run_leaves_no_process_and_the_next_run_cleans_up(tmp_path) -> None:
    proc = _start_run(tmp_path, "--budget", "10m")
    _wait_for_second_probe(proc, tmp_path)
    run_processes = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()  # kill -9 of the driver only: nothing in it can clean up
    proc.communicate(timeout=30)
    # The probe server and the probe die with it (parent-death signal); the probe's folder stays behind.
    _wait_for(lambda: _gone(run_processes), timeout_s=15, what="the probe server and probe to die with the run")
    assert len(_probe_folders(tmp_path)) == 1
    again = _start_run(tmp_path, "--n-trials", "1", "--budget", "10m")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'a.db'}")
    states = [t.state.name for t in study.trials]
    assert "RUNNING" not in states and states[0] == "COMPLETE"
    assert _probe_folders(tmp_path) == []  # the dead run's folder (no result in it) was removed


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_result_finished_after_its_run_died_is_recorded_by_the_next_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    plan = plan_run(RunOptions(model="tiny-gptneox", space="quick", seq_len=32, device="cpu", storage=storage, study="s",
                               n_trials=1))
    run_plan(plan, evaluator=FakeEvaluator(), report_dir=None)  # the baseline, measured
    study = optuna.load_study(study_name="s", storage=storage)
    # A run asked trial 1 and was killed while its probe finished: the trial is RUNNING, the result on disk.
    study.enqueue_trial(study.trials[0].params)
    dead = study.ask()
    params = plan.baseline.replace(per_device_train_batch_size=4)
    folder = tmp_path / f"{isolation.PROBE_DIR_PREFIX}{_dead_pid()}-x"
    folder.mkdir()
    from autotune.api import storage_id

    (folder / isolation.NOTE_FILE).write_text(json.dumps(
        {"study": "s", "storage": storage_id(storage), "trial": dead.number, "params": params.to_dict()}))
    result = ProbeResult(status="ok", samples_per_s=123.0, peak_mem_bytes=2**30, step_time_s=0.1, measured_steps=8)
    (folder / "result.json").write_text(json.dumps(result.to_dict()))
    other = tmp_path / f"{isolation.PROBE_DIR_PREFIX}{_dead_pid()}-y"  # another study's: left for its own run
    other.mkdir()
    (other / isolation.NOTE_FILE).write_text(json.dumps({"study": "t", "storage": storage_id(storage), "trial": 0, "params": {}}))
    (other / "result.json").write_text(json.dumps(result.to_dict()))
    empty = tmp_path / f"{isolation.PROBE_DIR_PREFIX}{_dead_pid()}-z"  # killed before it finished: removed
    empty.mkdir()

    evaluator = ProbeEvaluator(model={}, seq_len=32, device="cpu", owner_note={"study": "s", "storage": storage_id(storage)})
    assert recover_orphans(study, evaluator, plan.memory_ceiling_bytes) == 1
    trials = optuna.load_study(study_name="s", storage=storage).trials
    assert trials[dead.number].state.name == "FAIL"
    recovered = trials[-1]
    assert recovered.state.name == "COMPLETE" and recovered.value == 123.0
    assert recovered.user_attrs["recovered_from"] == dead.number and recovered.user_attrs["params"] == params.to_dict()
    assert not folder.exists() and not empty.exists() and other.exists()
    assert recover_orphans(study, evaluator, plan.memory_ceiling_bytes) == 0  # nothing twice


def test_best_json_is_written_when_the_report_cannot_be(tmp_path, monkeypatch) -> None:
    import autotune.report.html as html

    def full_disk(result, path):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(html, "write_report", full_disk)
    plan = plan_run(RunOptions(model="tiny-gptneox", space="quick", seq_len=32, device="cpu",
                               storage=f"sqlite:///{tmp_path / 'a.db'}", study="s", n_trials=2))
    done = run_plan(plan, evaluator=FakeEvaluator(), report_dir=tmp_path / "reports", best_json=tmp_path / "best.json")
    assert done.result.best is not None and done.report_path is None
    assert "No space left on device" in (done.report_error or "") and "autotune report s" in (done.report_error or "")
    assert json.loads((tmp_path / "best.json").read_text()) == done.result.best_json()
    assert json.loads((tmp_path / "best.model.json").read_text()) == done.result.model_json()
    assert done.result.model_json()["attn_implementation"] == done.result.best_params["attn_implementation"]


@pytest.mark.parametrize("flag", ["--report-dir", "--output"])
def test_unwritable_outputs_are_refused_before_the_run(tmp_path, flag) -> None:
    from autotune.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = str(blocker) if flag == "--report-dir" else str(tmp_path)  # a file as folder; a folder as file
    code = main(["run", *FAST, "--n-trials", "1", "--storage", f"sqlite:///{tmp_path / 'a.db'}", flag, target])
    assert code == 2
    assert not (tmp_path / "a.db").exists()  # refused before the study was created
    with pytest.raises(UsageError, match=r"--report-dir .*is a file|--output .*is a directory"):
        run_plan(plan_run(RunOptions(model="tiny-gptneox", space="quick", seq_len=32, device="cpu",
                                     storage=f"sqlite:///{tmp_path / 'a.db'}", n_trials=1)),
                 evaluator=FakeEvaluator(), report_dir=target if flag == "--report-dir" else None,
                 best_json=target if flag == "--output" else None)


@pytest.mark.slow
def test_a_probe_killed_with_its_loader_workers_leaks_no_semaphores(tmp_path) -> None:
    """A probe forked from the probe server used to start its DataLoader workers the server's way
    (forkserver), whose named semaphores the run's resource tracker then reported as leaked at exit."""
    script = """
from autotune.models import resolve_model
from autotune.params import TrialParams
from autotune.probe.isolation import run_isolated
from autotune.records import ProbeSpec
spec = ProbeSpec(model=resolve_model("tiny-gptneox").to_dict(), seq_len=32, device="cpu", warmup_steps=1,
                 params=TrialParams(per_device_train_batch_size=4, dataloader_num_workers=2),
                 measure_steps=10_000, max_measure_steps=20_000, max_measure_s=600)
print(run_isolated(spec, timeout_s=12).status.value)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.stdout.strip() == "timeout", done.stderr  # killed at its deadline, workers and all
    assert "leaked semaphore" not in done.stderr, done.stderr


def test_a_full_disk_while_best_json_is_written_leaves_the_old_file_whole(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    plan = plan_run(RunOptions(model="tiny-gptneox", space="quick", seq_len=32, device="cpu",
                               storage=f"sqlite:///{tmp_path / 'a.db'}", study="s", n_trials=2))
    result = run_plan(plan, evaluator=FakeEvaluator(), report_dir=None).result
    target = tmp_path / "best.json"
    target.write_text('{"old": true}\n', encoding="utf-8")
    original = Path.write_text

    def full_disk(self, data, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, data[: len(data) // 2], *args, **kwargs)  # half of it reached the disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        result.write_best_json(target)
    monkeypatch.setattr(Path, "write_text", original)
    assert json.loads(target.read_text(encoding="utf-8")) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no partial file left
