"""How a probe's process starts: the probe server's CUDA self-test and the cold fallback, the child's
environment (its one GPU by UUID, no distributed job), and --isolation from the CLI to the evaluator."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.models import resolve_model
from autotune.params import TrialParams
from autotune.probe import device, isolation
from autotune.records import ProbeResult, ProbeSpec
from tests.test_device import FakeNvml, gpu_uuid, mig_uuid

DISTRIBUTED = {
    "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500", "GROUP_RANK": "0", "ROLE_RANK": "3", "TORCHELASTIC_RUN_ID": "job", "OMPI_COMM_WORLD_SIZE": "8",
}


def _spec(device_name: str = "cpu") -> ProbeSpec:
    return ProbeSpec(model=resolve_model("tiny-gptneox").to_dict(), params=TrialParams(per_device_train_batch_size=4),
                     seq_len=32, device=device_name, warmup_steps=1, measure_steps=3)


# ---- the child's environment ------------------------------------------------------------------------


def test_child_env_pins_the_uuid_and_leaves_the_distributed_job(monkeypatch) -> None:
    for key, value in DISTRIBUTED.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("MY_SETTING", "kept")
    env = isolation.child_env(_spec("cuda:0"), device_uuid=gpu_uuid(3))
    assert env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(3) and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert not set(DISTRIBUTED) & set(env)
    assert env["MY_SETTING"] == "kept" and env["TOKENIZERS_PARALLELISM"] == "false"


def test_child_env_resolves_the_users_gpu_when_not_given(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml().module())
    monkeypatch.setattr(device, "_torch_has_cuda", lambda: True)
    monkeypatch.setattr(isolation, "_uuid_cache", {})
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    # cuda:1 of a process that sees GPUs 2 and 0 is physical GPU 0, never "CUDA_VISIBLE_DEVICES=1".
    assert isolation.child_env(_spec("cuda:1"))["CUDA_VISIBLE_DEVICES"] == gpu_uuid(0)
    assert isolation.child_env(_spec("cuda"))["CUDA_VISIBLE_DEVICES"] == gpu_uuid(2)


def test_a_deepspeed_probe_names_its_gpus_by_pci_ordinal_as_deepspeed_parses_integers(monkeypatch) -> None:
    # NVML numbers GPU 0 at PCI bus 7, GPU 1 at bus 3, GPU 2 at bus 5: PCI order is NVML 1, 2, 0, (3).
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(pci_bus=[7, 3, 5, 9]).module())
    sharded = replace(_spec("cuda:0"), params=TrialParams(per_device_train_batch_size=4, sharding="zero2_offload"))
    assert isolation.child_env(sharded, device_uuid=gpu_uuid(0))["CUDA_VISIBLE_DEVICES"] == "2"
    assert isolation.child_env(replace(sharded, nproc=2), device_uuid=f"{gpu_uuid(1)},{gpu_uuid(0)}")["CUDA_VISIBLE_DEVICES"] == "0,2"
    # Without DeepSpeed the UUID stays (it cannot name another GPU); so it does for a MIG instance, which no integer names.
    assert isolation.child_env(_spec("cuda:0"), device_uuid=gpu_uuid(0))["CUDA_VISIBLE_DEVICES"] == gpu_uuid(0)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(migs={0: 2}).module())
    assert isolation.child_env(sharded, device_uuid=mig_uuid(0, 1))["CUDA_VISIBLE_DEVICES"] == mig_uuid(0, 1)


def test_a_cpu_probe_keeps_the_visible_devices_but_not_the_job(monkeypatch) -> None:
    for key, value in DISTRIBUTED.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    env = isolation.child_env(_spec("cpu"))  # no GPU to resolve: NVML is not asked
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "CUDA_DEVICE_ORDER" not in env
    assert not set(DISTRIBUTED) & set(env)


def test_a_forked_child_drops_what_the_server_had_but_the_child_env_has_not(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "3")  # in the server's copy, from the parent at the time it started
    env = {key: value for key, value in os.environ.items() if key != "RANK"}
    env["CUDA_VISIBLE_DEVICES"] = gpu_uuid(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    isolation._set_environ(env)
    assert "RANK" not in os.environ and os.environ["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)


def test_the_evaluator_passes_its_uuid_and_mode(monkeypatch) -> None:
    from autotune.probe import evaluator as evaluator_module
    from autotune.probe.evaluator import ProbeEvaluator

    seen = {}

    def fake_run(spec, **kwargs):
        seen.update(kwargs, device=spec.device)
        return ProbeResult(status="crash", error="fake")

    monkeypatch.setattr(evaluator_module, "run_isolated", fake_run)
    probe = ProbeEvaluator(model=resolve_model("tiny-gptneox").to_dict(), seq_len=32, device="cuda:1", mode="cold",
                           device_uuid=gpu_uuid(0))
    probe.evaluate(TrialParams(per_device_train_batch_size=4), timeout_s=60)
    assert seen == {"timeout_s": 60, "mode": "cold", "device_uuid": gpu_uuid(0), "device": "cuda:1", "note": None}
    # With an owner, each probe's folder gets a note naming its study, trial and configuration.
    probe.owner_note = {"study": "s", "storage": "x"}
    probe.label_trial(7)
    probe.evaluate(TrialParams(per_device_train_batch_size=4), timeout_s=60)
    assert seen["note"] == {"study": "s", "storage": "x", "trial": 7, "params": TrialParams(per_device_train_batch_size=4).to_dict()}


# ---- the probe server's self-test ---------------------------------------------------------------


@pytest.mark.slow
def test_the_server_self_test_passes_on_a_clean_server(monkeypatch) -> None:
    monkeypatch.setattr(isolation, "_server_check", None)
    state = isolation._probe_server_cuda()  # starts the server if this process has none yet
    assert state == {"bad_fork": False, "initialized": False}
    assert isolation.check_server() == isolation.ServerCheck(clean=True)
    assert isolation.start_server()


class _WritesOk:
    """A probe child that at once writes an ok result: what the launcher was asked for is the point."""

    pid = 0

    def __init__(self, result_path: Path) -> None:
        result_path.write_text(json.dumps(ProbeResult(status="ok").to_dict()), encoding="utf-8")

    def wait(self, timeout_s: float) -> int:
        return 0

    def kill_group(self) -> None:
        pass


def _record_launches(monkeypatch) -> list[str]:
    modes: list[str] = []

    def launch(mode, spec_path, result_path, log_path, env, python):
        modes.append(mode)
        return _WritesOk(result_path)

    monkeypatch.setattr(isolation, "_launch", launch)
    return modes


@pytest.mark.parametrize(
    ("report", "reason"),
    [
        ({"bad_fork": False, "initialized": True}, "CUDA was initialised in it"),
        ({"bad_fork": True, "initialized": False}, "CUDA was initialised in it"),
        (RuntimeError("its self-test exited with code 1 without a report"), "did not start cleanly"),
    ],
)
def test_a_dirty_server_means_cold_children_and_one_warning(monkeypatch, caplog, report, reason) -> None:
    calls = []

    def dirty_server() -> dict:
        calls.append(1)
        if isinstance(report, Exception):
            raise report
        return report

    monkeypatch.setattr(isolation, "_server_check", None)
    monkeypatch.setattr(isolation, "_probe_server_cuda", dirty_server)
    modes = _record_launches(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="autotune.probe.isolation"):
        first = isolation.run_isolated(_spec(), timeout_s=60)  # the default: fork, if the server allows
        second = isolation.run_isolated(_spec(), timeout_s=60, mode="forkserver")
    assert first.ok and second.ok
    assert modes == ["cold", "cold"]
    assert len(calls) == 1  # checked once; the verdict is kept for the process
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and reason in warnings[0] and "\n" not in warnings[0]
    assert "every probe starts cold" in warnings[0]
    assert not isolation.start_server()


def test_a_clean_verdict_forks(monkeypatch) -> None:
    monkeypatch.setattr(isolation, "_server_check", isolation.ServerCheck(clean=True))
    modes = _record_launches(monkeypatch)
    isolation.run_isolated(_spec(), timeout_s=60)
    isolation.run_isolated(_spec(), timeout_s=60, mode="cold")
    assert modes == ["forkserver", "cold"]


def test_a_stopped_or_dead_probe_server_is_seen_before_forking_from_it(monkeypatch) -> None:
    """kill -STOP of the server made the next fork block for ever; kill -9 made it fail with EOFError."""
    import signal
    from multiprocessing import forkserver

    server = subprocess.Popen(["sleep", "60"])  # stands in for the server: its pid is what is looked at
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", server.pid)
    try:
        assert isolation.server_problem() is None  # running
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert "stopped" in (isolation.server_problem() or "")
        os.kill(server.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert "died" in (isolation.server_problem() or "")  # killed, not reaped yet
        server.wait()
        assert "gone" in (isolation.server_problem() or "")
    finally:
        server.kill()
        server.wait()


def test_a_probe_server_that_stopped_working_is_abandoned_for_cold_probes_with_one_warning(monkeypatch, caplog) -> None:
    from multiprocessing import forkserver

    server = subprocess.Popen(["sleep", "60"])
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", server.pid)
    monkeypatch.setattr(isolation, "_server_check", isolation.ServerCheck(clean=True))
    monkeypatch.setattr(isolation, "server_problem", lambda: "it is stopped (SIGSTOP?)")
    modes = _record_launches(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="autotune.probe.isolation"):
        first = isolation.run_isolated(_spec(), timeout_s=60)
    assert first.ok and modes == ["cold"] and not isolation.start_server()  # and every later probe is cold
    assert server.wait(timeout=10) == -9  # a stopped server does not outlive the run
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "stopped" in warnings[0] and "every later probe starts cold" in warnings[0]


def test_a_fork_that_fails_as_the_server_dies_is_run_cold(monkeypatch) -> None:
    monkeypatch.setattr(isolation, "_server_check", isolation.ServerCheck(clean=True))
    monkeypatch.setattr(isolation, "server_problem", lambda: None)
    monkeypatch.setattr(isolation, "abandon_server", lambda reason: monkeypatch.setattr(isolation, "_server_check",
                                                                                        isolation.ServerCheck(False, reason)))
    modes: list[str] = []

    def launch(mode, spec_path, result_path, log_path, env, python):
        modes.append(mode)
        if mode == "forkserver":
            raise EOFError("unexpected EOF")  # what multiprocessing raised when the server was killed between probes
        return _WritesOk(result_path)

    monkeypatch.setattr(isolation, "_launch", launch)
    assert isolation.run_isolated(_spec(), timeout_s=60).ok
    assert modes == ["forkserver", "cold"] and "EOFError" in isolation._server_check.reason


def test_a_probe_whose_server_died_under_it_is_probed_once_more_not_blamed(monkeypatch) -> None:
    """kill -9 of the server while a probe ran: its exit is never reported (255); that is the server's fault."""
    from autotune.studies import reading
    class Lost(isolation._ForkedChild):
        def __init__(self) -> None:
            self.pid = 0

        def wait(self, timeout_s: float) -> int:
            return isolation.UNREPORTED_EXIT_CODE

        def kill_group(self) -> None:
            pass

    monkeypatch.setattr(isolation, "_server_check", isolation.ServerCheck(clean=True))
    monkeypatch.setattr(isolation, "_launch", lambda *args, **kwargs: Lost())
    problems = iter([None, "it died (killed?)"])  # fine when the probe started, dead when it ended
    monkeypatch.setattr(isolation, "server_problem", lambda: next(problems))
    result = isolation.run_isolated(_spec(), timeout_s=60)
    assert result.status == "crash" and result.error.startswith(isolation.LOST_WITH_SERVER) and result.process_lost
    assert reading.killed(result)  # what the loop retries once


def test_a_child_spawned_under_children_ignore_sigint_starts_ignoring_it() -> None:
    """#42/#45: the probe server is spawned so (isolation._start_watched): a Ctrl-C to the run's process group while
    its interpreter starts is ignored there from its first instruction (it printed a traceback), and the run keeps its
    own handler."""
    import signal

    from autotune.probe.spawning import children_ignore_sigint

    show = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"]
    # As a run in a terminal has it (a background job of a script starts with SIGINT ignored, and CI may run so).
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with children_ignore_sigint():
            inside = subprocess.run(show, capture_output=True, text=True, check=True).stdout
        outside = subprocess.run(show, capture_output=True, text=True, check=True).stdout
        assert (inside.strip(), outside.strip()) == ("True", "False")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's own handler is back
    finally:
        signal.signal(signal.SIGINT, original)


def test_a_temporary_folder_too_long_for_the_servers_socket_is_swapped_for_tmp_while_it_starts(tmp_path, monkeypatch) -> None:
    """multiprocessing binds the server's AF_UNIX socket under TMPDIR: past 107 bytes the bind fails ("AF_UNIX path too
    long") and every probe started cold; a short TMPDIR is left alone."""
    import tempfile

    from autotune.probe.spawning import short_socket_dir

    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with short_socket_dir():
        assert tempfile.gettempdir() == "/tmp"
    assert tempfile.gettempdir() == str(deep)
    short = tempfile.mkdtemp(prefix="at-", dir="/tmp")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        with short_socket_dir():
            assert tempfile.gettempdir() == short
    finally:
        os.rmdir(short)


def test_a_process_that_ended_is_not_running_even_before_its_parent_reaps_it() -> None:
    running = subprocess.Popen(["sleep", "30"])
    ended = subprocess.Popen(["true"])
    time.sleep(0.5)  # ended, not waited for: a zombie, as a probe whose stopped server cannot reap it
    try:
        assert isolation._running(running.pid) and not isolation._running(ended.pid)
    finally:
        running.kill()
        running.wait()
        ended.wait()
    assert not isolation._running(ended.pid)  # reaped: gone


# ---- --isolation: CLI and API -------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "mode"), [([], "forkserver"), (["--isolation", "fork"], "forkserver"), (["--isolation", "cold"], "cold")])
def test_the_isolation_flag_reaches_the_evaluator(tmp_path, monkeypatch, flag, mode) -> None:
    import autotune.api
    from autotune.cli import main
    from autotune.errors import UsageError

    built = {}

    def run_plan(plan, **kwargs):
        built["evaluator"] = autotune.api.plan_evaluator(plan)
        raise UsageError("stopped before any probe")

    monkeypatch.setattr(autotune.api, "run_plan", run_plan)
    code = main(["run", "--model", "tiny-gptneox", "--seq-len", "32", "--device", "cpu", "--n-trials", "1",
                 "--storage", f"sqlite:///{tmp_path / 'a.db'}", "--report-dir", str(tmp_path), *flag])
    assert code == 2
    assert built["evaluator"].mode == mode and built["evaluator"].device == "cpu" and built["evaluator"].device_uuid is None


def test_an_unknown_isolation_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    from autotune.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["run", "--device", "cpu", "--isolation", "spawn", "--storage", f"sqlite:///{tmp_path / 'a.db'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--isolation 'spawn' is not a way to start probes: use fork" in err


def test_the_api_plans_the_gpu_by_uuid(fake_gpu) -> None:
    import dataclasses

    from autotune.api import RunOptions, plan_evaluator, plan_run

    gpu = dataclasses.replace(fake_gpu, index=1, uuid=gpu_uuid(0))
    evaluator = plan_evaluator(plan_run(RunOptions(model="tiny-gptneox", seq_len=32, device=gpu, isolation="cold")))
    assert evaluator.device == "cuda:1" and evaluator.device_uuid == gpu_uuid(0) and evaluator.mode == "cold"


# ---- on a real GPU ---------------------------------------------------------------------------------


def _has_cuda() -> bool:
    try:
        return device.detect_device("auto").is_cuda
    except Exception:  # noqa: BLE001 - a misconfigured host is no GPU to test on
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_gpu_a_forked_probe_runs_on_the_resolved_uuid(monkeypatch) -> None:
    import pynvml

    info = device.detect_device("cuda")
    assert info.uuid is not None and info.uuid.startswith(("GPU-", "MIG-"))
    monkeypatch.setattr(isolation, "_server_check", None)
    assert isolation.check_server().clean, isolation.check_server().reason

    pynvml.nvmlInit()
    target = pynvml.nvmlDeviceGetHandleByUUID(info.uuid)
    others = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def pids(handle) -> set[int]:
        try:
            return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        except pynvml.NVMLError:
            return set()

    before = pids(target)
    real_launch = isolation._launch
    seen: dict[str, object] = {"on_target": set(), "anywhere": set()}
    done = threading.Event()

    def launch_and_watch(*args, **kwargs):
        child = real_launch(*args, **kwargs)
        seen["pid"] = child.pid

        def watch() -> None:
            while not done.is_set():
                seen["on_target"] |= pids(target) - before
                for handle in others:
                    seen["anywhere"] |= pids(handle)
                time.sleep(0.05)

        threading.Thread(target=watch, daemon=True).start()
        return child

    monkeypatch.setattr(isolation, "_launch", launch_and_watch)
    slow_input = Path(__file__).parent / "data" / "trainers" / "slow_input.py"  # samples slow to load: a probe NVML can see
    spec = ProbeSpec(model={}, params=TrialParams(per_device_train_batch_size=4), seq_len=32, device=f"cuda:{info.index}",
                     warmup_steps=1, measure_steps=3, trainer=f"{slow_input}:make_trainer_200ms")
    try:
        result = isolation.run_isolated(spec, timeout_s=300, mode="forkserver", device_uuid=info.uuid)
    finally:
        done.set()
    assert result.status == "ok", result.error
    assert seen["on_target"], "no new compute process appeared on the resolved GPU during the probe"
    if seen["pid"] in seen["anywhere"]:  # NVML shows this PID namespace's numbers (not always so in a container)
        assert seen["pid"] in seen["on_target"]


def test_the_run_cache_is_one_folder_per_driver_and_a_dead_drivers_is_swept(tmp_path) -> None:
    """Files the probes of one run share live in autotune-cache-<pid>; a killed driver's is removed by the next run's sweep."""
    from autotune.probe import isolation

    root = str(tmp_path)
    isolation._run_cache.pop(root, None)
    first = isolation.run_cache_dir(root)
    assert first == tmp_path / f"autotune-cache-{os.getpid()}" and first.is_dir()
    assert isolation.run_cache_dir(root) == first  # the same folder for every probe
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"autotune-cache-{dead.pid}"
    (stale / "qlora-base-x").mkdir(parents=True)
    alive = tmp_path / f"autotune-cache-{os.getppid()}"
    alive.mkdir()
    isolation.orphaned_probes(root)
    assert not stale.exists() and alive.is_dir() and first.is_dir()
    isolation._run_cache.pop(root, None)


def test_probes_are_told_the_run_cache(monkeypatch) -> None:
    from autotune.probe import isolation

    seen = {}

    def launch(mode, spec_path, result_path, log_path, env, python):  # type: ignore[no-untyped-def]
        seen.update(env)
        raise KeyboardInterrupt

    monkeypatch.setattr(isolation, "_launch", launch)
    spec = ProbeSpec(model=resolve_model("tiny-gptneox").to_dict(), params=TrialParams(), seq_len=16, device="cpu")
    with pytest.raises(KeyboardInterrupt):
        isolation.run_isolated(spec, timeout_s=5, mode="cold")
    assert seen[isolation.RUN_CACHE_ENV] == str(isolation.run_cache_dir())


def test_the_server_imports_bitsandbytes_with_the_capability_from_nvml(monkeypatch) -> None:
    """bitsandbytes asks torch for each GPU's compute capability on import, which initialises CUDA
    (peft imports it, and the Trainer imports peft): the server reads it from NVML instead, so it
    can still fork probes; torch's own function is back afterwards."""
    import types

    import torch

    from autotune.probe import device as preload

    # Four GPUs, the one at NVML index 1 a Hopper, the others Ampere; the device is found as CUDA
    # numbers the visible ones (device.resolve_gpu): by UUID or index in CUDA_VISIBLE_DEVICES.
    fake = FakeNvml().module()
    fake.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0) if handle[1] == 1 else (8, 6)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpu_uuid(2)},{gpu_uuid(1)}")
    assert preload.nvml_compute_capability(types.SimpleNamespace(idx=1)) == (9, 0)
    assert preload.nvml_compute_capability(0) == (8, 6)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert preload.nvml_compute_capability(None) == (9, 0)

    asked = []
    module = types.ModuleType("bitsandbytes")
    original = torch.cuda.get_device_capability

    def find_spec(name):  # type: ignore[no-untyped-def]
        return object() if name == "bitsandbytes" else None

    def fake_import(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "bitsandbytes":
            asked.append(torch.cuda.get_device_capability(torch.cuda.device(1)))
            return module
        return real_import(name, *args, **kwargs)

    import builtins
    import importlib.util

    real_import = builtins.__import__
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpu_uuid(2)},{gpu_uuid(1)}")
    preload.import_bitsandbytes_without_cuda()
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert asked == [(9, 0)]
    assert torch.cuda.get_device_capability is original and not torch.cuda.is_initialized()


def test_a_finished_run_removes_its_run_cache(tmp_path, monkeypatch) -> None:
    """The evaluator's close (called when the search ends, Ctrl-C included) removes the shared files
    at once: an API caller's process lives on; the next run gets a fresh folder."""
    from autotune.probe import isolation
    from autotune.probe.evaluator import ProbeEvaluator

    monkeypatch.setattr(isolation.tempfile, "gettempdir", lambda: str(tmp_path))
    isolation._run_cache.pop(None, None)
    cache = isolation.run_cache_dir()
    (cache / "qlora-base-x").mkdir()
    ProbeEvaluator(model=resolve_model("tiny-gptneox").to_dict(), seq_len=16, device="cpu").close()
    assert not cache.exists()
    assert isolation.run_cache_dir() == cache and cache.is_dir() and not any(cache.iterdir())
    isolation.clear_run_cache()


def test_a_probe_whose_folder_was_removed_while_it_started_leaves_without_a_traceback(tmp_path) -> None:
    # Ctrl-C while the server forks a probe: the run removes the probe's folder before the child
    # opens its log there. The child exits non-zero and prints nothing on the run's terminal.
    def start_probe(log_path: Path) -> subprocess.CompletedProcess[str]:
        code = f"import os; from autotune.probe.isolation import enter_probe_process; enter_probe_process({str(log_path)!r}, dict(os.environ))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    done = start_probe(tmp_path / "autotune-probe-1" / "output.txt")
    assert done.returncode == 1 and done.stderr == ""
    # A folder that is there but cannot be written: one line that names the log.
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "output.txt").mkdir()  # a folder where the log file should go: open fails for root too
    done = start_probe(locked / "output.txt")
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "cannot write its log" in done.stderr and "Traceback" not in done.stderr
