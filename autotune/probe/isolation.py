"""Run one probe in a fresh child process, with a deadline.

A fresh process per trial means an OOM, a segfault, a leaked CUDA context or a hung kernel in one
trial cannot affect the next one (the reason Lightning's in-process finder needs hand-written
state resets). The child runs in its own process group, so on a timeout or a Ctrl-C the whole
group (DataLoader workers, compile workers) is killed.

Two ways to start the child (:data:`IsolationMode`):

* ``forkserver`` (default; ``--isolation fork``): a probe server started once per parent process
  imports torch, transformers and autotune (:mod:`autotune.probe.preload`) and then forks one child
  per probe. The server is a fresh interpreter that must never initialise CUDA (a child forked after
  that cannot use the GPU), so when it starts, a first forked child reports what CUDA state it
  inherited (:func:`check_server`); a server that is not clean is not used: every probe of the
  process then starts cold, with one warning.
* ``cold`` (``--isolation cold``): ``python -m autotune.probe SPEC.json RESULT.json``, a new
  interpreter per probe.

Either way the child gets its own session (``setsid``), writes its stdout/stderr to a file (the
tail is the error of a crash), and writes a :class:`ProbeResult` as JSON; the parent adds
``wall_s`` and ``overhead_s``. On a GPU the child sees exactly one device, the one the parent
resolved (:func:`autotune.probe.device.detect_device`), by its NVML UUID (:func:`child_env`).

No probe process outlives the run (:mod:`autotune.probe.lifetime`): the server and each child die
with their parent even when it is killed with ``kill -9``, and each child has its own deadline. A
probe's folder (spec, result, output, scratch) is named after the driver's pid
(``autotune-probe-<pid>-*`` in the temporary directory) and removed when the probe ends; one left by
a driver that was killed is found by :func:`orphaned_probes` on the next run, which records a result
the probe finished after its driver died and removes the folder. Files the probes of one run share
(:func:`run_cache_dir`) live in ``autotune-cache-<pid>``, removed with the driver or, after a kill,
by that sweep.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import spawn
from pathlib import Path
from typing import Any, Literal, Protocol

import psutil

from autotune.probe import ranks
from autotune.probe.lifetime import DEADLINE_ENV, DRIVER_PID_ENV, arm_deadline, die_with_parent
from autotune.probe.spawning import children_ignore_sigint, short_socket_dir
from autotune.records import ProbeResult, ProbeSpec, ProbeStatus

IsolationMode = Literal["forkserver", "cold"]
DEFAULT_MODE: IsolationMode = "forkserver"
PRELOAD_MODULES = ["autotune.probe.preload"]

_STDERR_TAIL_CHARS = 2000
SCRATCH_ENV = "AUTOTUNE_PROBE_SCRATCH"  # the folder a probe child keeps its scratch files in
RUN_CACHE_ENV = "AUTOTUNE_RUN_CACHE"  # a folder every probe of this driver shares (run_cache_dir)
_FORK_TIMEOUT_S = 120.0  # a running server forks a probe in well under a second; a loaded machine is slower
_SERVER_START_TIMEOUT_S = 600.0  # its imports (torch, transformers) and its first fork, on a loaded machine too
_SELF_TEST_TIMEOUT_S = 120.0  # the self-test child only reads two flags (the server's imports finish before it forks)


_log = logging.getLogger(__name__)


class _Child(Protocol):
    """A started probe process: its pid, a bounded wait, and a kill of its whole group."""

    pid: int

    def wait(self, timeout_s: float) -> int | None:
        """The exit code (negative: killed by that signal), or None if still running at the deadline."""

    def kill_group(self) -> None: ...


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_tree(pid: int) -> None:
    """Kill the probe ``pid`` (the leader of its own session), its session, and every descendant
    psutil still finds, including any that moved to a session of their own (a DataLoader worker's
    helper, a compile worker pool)."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # already gone (its orphans, if any, are still in its session)
        descendants = []
    _killpg(pid)
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(descendants, timeout=5)


class _ColdChild:
    def __init__(self, spec_path: Path, result_path: Path, log_path: Path, env: dict[str, str], python: str,
                 module: str = "autotune.probe", argv: list[str] | None = None) -> None:
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv or [python, "-m", module, str(spec_path), str(result_path)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.pid = self.proc.pid

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill_group(self) -> None:
        _kill_tree(self.pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _set_environ(env: dict[str, str]) -> None:
    """Make this process's environment exactly ``env``: a forked child inherits the server's, which
    dates from the server's start and may hold variables (RANK, an old CUDA_VISIBLE_DEVICES) the
    child must not see."""
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


def enter_probe_process(log_path: str, env: dict[str, str]) -> None:
    """First thing in a child forked from the probe server: its own session (so its whole group can be
    killed), its output to ``log_path``, and exactly the probes' environment, before anything
    initialises CUDA (``CUDA_VISIBLE_DEVICES`` pins the GPU); then it dies with the server (which
    dies with the driver) and keeps its own deadline (:mod:`autotune.probe.lifetime`)."""
    os.setsid()
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as error:
        # The run removed the probe's folder while this child was starting (Ctrl-C, SIGTERM): it is
        # stopping and waits for nothing, so leave quietly, not with a traceback on the run's
        # terminal. Any other reason is one line there; the run sees the exit code and no log.
        if os.path.isdir(os.path.dirname(log_path)):
            print(f"autotune probe: cannot write its log {log_path}: {error.strerror}", file=sys.stderr, flush=True)
        os._exit(1)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _set_environ(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it; a probe need not
    die_with_parent()
    arm_deadline()


def _forked_main(spec_path: str, result_path: str, log_path: str, env: dict[str, str]) -> None:
    """The probe child forked from the server: own session, output to a file, run, write the result."""
    enter_probe_process(log_path, env)
    import torch

    if getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
        raise RuntimeError("the probe server initialised CUDA before forking: use --isolation cold and report this")
    from autotune.probe.child import main

    main([spec_path, result_path])


def _server_context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD_MODULES)
    return context


def _report_server_cuda(report_path: str) -> None:
    """Runs in a child forked from the server: the CUDA state it inherited, as JSON.

    torch marks a process forked after it initialised CUDA as a bad fork (``_is_in_bad_fork``;
    torch/csrc/cuda/Module.cpp registers that at CUDA init), and the module flag
    ``torch.cuda._initialized`` is inherited as the server left it (``is_initialized()`` itself
    reads False in a bad fork).
    """
    import torch

    state = {
        "bad_fork": bool(getattr(torch.cuda, "_is_in_bad_fork", lambda: False)()),
        "initialized": bool(getattr(torch.cuda, "_initialized", False)),
    }
    Path(report_path).write_text(json.dumps(state), encoding="utf-8")


def _probe_server_cuda() -> dict[str, Any]:
    """Start the probe server (once per process; this waits for its imports) and fork one child
    from it that reports the CUDA state it inherited.

    Raises:
        RuntimeError: the server or the child failed, or the child wrote no report in time.
    """
    context = _server_context()
    with tempfile.TemporaryDirectory(prefix="autotune-server-check-") as tmp:
        report = Path(tmp) / "cuda.json"
        child = context.Process(target=_report_server_cuda, args=(str(report),), name="autotune-probe-server-check")
        _start_watched(child, _SERVER_START_TIMEOUT_S)  # returns once the server has finished its imports and forked
        child.join(_SELF_TEST_TIMEOUT_S)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise RuntimeError(f"its self-test did not finish in {_SELF_TEST_TIMEOUT_S:.0f} s")
        if child.exitcode != 0 or not report.exists():
            raise RuntimeError(f"its self-test exited with code {child.exitcode} without a report")
        return dict(json.loads(report.read_text(encoding="utf-8")))


@dataclass(frozen=True)
class ServerCheck:
    """Whether probes may fork from the probe server, and why not."""

    clean: bool
    reason: str = ""


_server_check: ServerCheck | None = None


def check_server() -> ServerCheck:
    """Start the probe server and self-test it, once per parent process; the verdict is kept.

    A server that is not CUDA-clean (or did not start) is never forked from: the caller starts
    probes cold instead, and one warning says so.
    """
    global _server_check
    if _server_check is not None:
        return _server_check
    try:
        state = _probe_server_cuda()
    except Exception as exc:  # noqa: BLE001 - whatever stops the server stops forking, not the run
        if _server_check is not None:  # given up while it started (abandon_server warned once)
            return _server_check
        check = ServerCheck(False, "it did not start cleanly: " + " ".join(str(exc).split()))  # one line
    else:
        if state.get("bad_fork") or state.get("initialized"):
            check = ServerCheck(False, f"CUDA was initialised in it before it forked ({json.dumps(state, sort_keys=True)})")
        else:
            check = ServerCheck(True)
    if not check.clean:
        _log.warning(
            "autotune: the probe server is not usable (%s): every probe starts cold instead "
            "(a few seconds more per probe, same measurements); --isolation cold skips the server", check.reason,
        )
    _server_check = check
    return check


def start_server() -> bool:
    """Start the probe server and wait until it has imported everything, so no trial pays for it.

    The server starts and is checked at most once per parent process; later calls return at once.

    Returns:
        Whether probes can fork from it (see :func:`check_server`).
    """
    return check_server().clean


def _server_pid() -> int | None:
    """The probe server's process id, once multiprocessing has started it."""
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def _process_state(pid: int) -> str | None:
    """The state letter ``/proc`` gives process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` a zombie...), ``"gone"``
    where it has no entry, or None where ``/proc`` cannot tell (another system, an unreadable entry)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone" if Path("/proc/self/stat").exists() else None
    except (OSError, IndexError):
        return None


def server_problem() -> str | None:
    """Why the running probe server cannot fork a probe now (stopped, or gone), or None: it can, or it has not
    started (then the next fork starts it). Read from ``/proc``; elsewhere nothing is known, so None."""
    pid = _server_pid()
    state = _process_state(pid) if pid is not None else None
    if state == "gone":
        return "it is gone (killed?)"
    if state in ("T", "t"):
        return "it is stopped (SIGSTOP?)"
    if state in ("Z", "X"):
        return "it died (killed?)"
    return None


def _start_watched(process: Any, limit_s: float) -> None:
    """``process.start()`` for a child of the probe server, which blocks until the server has forked it: watched,
    so that a server that is stopped (SIGSTOP), dies or does not answer within ``limit_s`` is given up (and
    killed) and the start fails, instead of blocking the run for ever.

    Raises:
        ConnectionError: the server stopped working; the caller starts the probe cold.
    """
    from multiprocessing import forkserver

    # The server itself is started from this thread (at once: its imports run in it), not from the watched one:
    # a server started from a thread that then ends failed every fork (exit code 255, Python 3.11, Linux).
    with children_ignore_sigint(), short_socket_dir():
        forkserver.ensure_running()
    failed: list[BaseException] = []

    def start() -> None:
        try:
            with _without_main_module():
                process.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=start, name="autotune-probe-server-start", daemon=True)
    thread.start()
    deadline_s = time.monotonic() + limit_s
    while thread.is_alive():
        thread.join(0.5)
        problem = server_problem() if thread.is_alive() else None
        if problem is None and time.monotonic() < deadline_s:
            continue
        if thread.is_alive():
            abandon_server(problem or f"it did not fork a probe within {limit_s:.0f} s")  # kills it: the start fails at once
            thread.join(30)
            raise ConnectionError(f"the probe server stopped working ({problem or 'no answer'})")
    if failed:
        raise failed[0]


def abandon_server(reason: str) -> None:
    """Never fork from the probe server again in this process: every later probe starts cold (one warning).
    A stopped server is killed, so that it does not outlive the run."""
    global _server_check
    _server_check = ServerCheck(False, reason)
    _log.warning("autotune: the probe server stopped working (%s): every later probe starts cold instead "
                 "(a few seconds more per probe, same measurements)", reason)
    pid = _server_pid()
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _without_main_module() -> Iterator[None]:
    """Start children without re-running the parent's ``__main__`` in them.

    multiprocessing's spawn and forkserver children re-import the parent's main script (so that
    functions defined there unpickle). Our child's target lives in autotune, and re-running a
    user's script without an ``if __name__ == "__main__"`` guard would start their whole tuning
    run again inside the probe. So the main module is left out of the child's preparation data.
    """
    original = spawn.get_preparation_data

    def preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        spawn.get_preparation_data = original


class _ForkedChild:
    def __init__(self, spec_path: Path, result_path: Path, log_path: Path, env: dict[str, str], target: Any = _forked_main) -> None:
        self.process = _server_context().Process(
            target=target, args=(str(spec_path), str(result_path), str(log_path), env), name="autotune-probe"
        )
        _start_watched(self.process, _FORK_TIMEOUT_S)
        assert self.process.pid is not None
        self.pid = self.process.pid

    def wait(self, timeout_s: float) -> int | None:
        """The child's exit code, or None at the deadline. Its exit is reported by the server that forked it: a
        server stopped or killed meanwhile never reports, so the child's own process is looked at too."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            self.process.join(max(0.0, min(1.0, deadline_s - time.monotonic())))
            if self.process.exitcode is not None:
                return self.process.exitcode
            if not _running(self.pid):
                return UNREPORTED_EXIT_CODE
            if time.monotonic() >= deadline_s:
                return None

    def kill_group(self) -> None:
        _kill_tree(self.pid)  # the child's session: it and its DataLoader workers
        if self.process.exitcode is None and _running(self.pid):
            self.process.kill()  # killed before it called setsid
        self.process.join(5.0)  # bounded: a stopped server never reports the exit


UNREPORTED_EXIT_CODE = 255  # a forked probe ended, but the server that forked it could not say how (stopped or killed)
LOST_WITH_SERVER = "probe process lost with its probe server (stopped or killed while the probe ran)"


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (not ended, not a zombie waiting for its parent); True where /proc cannot tell."""
    return _process_state(pid) not in ("gone", "Z", "X")


def _launch(
    mode: IsolationMode, spec_path: Path, result_path: Path, log_path: Path, env: dict[str, str], python: str,
    *, target: Any = _forked_main, module: str = "autotune.probe",
) -> _Child:
    """Start a child: forked from the probe server to run ``target``, or cold as ``python -m module``; both get
    ``SPEC RESULT`` (the plan-time check of a user's Trainer, :mod:`autotune.probe.trainer_check`, has its own)."""
    if mode == "cold":
        return _ColdChild(spec_path, result_path, log_path, env, python, module)
    return _ForkedChild(spec_path, result_path, log_path, env, target)


def _tail(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-_STDERR_TAIL_CHARS:]
    except OSError:
        return ""


_TORCHRUN_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\b", re.MULTILINE)  # its failure summary: "exitcode  : -9 (pid: 1210)"


def _rank_signal(log_path: Path) -> int | None:
    """The signal that killed a rank of a torchrun probe, from torchrun's failure summary in the probe's log (the ranks it
    saw fail before it stopped the others, each with its exit code, negative for a signal); None if none died so. Its
    "first observed failure" is no guide: a peer that crashed on the lost connection can be observed first."""
    signals = {-int(code) for code in _TORCHRUN_EXITCODE.findall(_tail(log_path)) if int(code) < 0} & {s.value for s in signal.Signals}
    if not signals:
        return None
    return signal.SIGKILL.value if signal.SIGKILL.value in signals else min(signals)


def host_oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended since boot (``oom_kill`` in ``/proc/vmstat``, Linux 4.13+);
    None where it is not kept. A probe killed by SIGKILL while it grew tells a host out-of-memory from a kill from outside."""
    try:
        with open("/proc/vmstat", encoding="ascii") as vmstat:
            for line in vmstat:
                name, _, count = line.partition(" ")
                if name == "oom_kill":
                    return int(count)
    except (OSError, ValueError):
        return None
    return None


def _host_oom(signal_number: int | None, kills_before: int | None) -> str | None:
    """The error of a probe the kernel's OOM killer ended (SIGKILL while the machine's OOM kills went up), or None."""
    if signal_number != signal.SIGKILL or kills_before is None or (kills_after := host_oom_kills()) is None or kills_after <= kills_before:
        return None
    return (f"host memory: the kernel's OOM killer ended the probe (oom_kill in /proc/vmstat {kills_before} -> {kills_after}): "
            "its processes outgrew this machine's memory")


def _killed_reason(signal_number: int) -> tuple[str, bool]:
    """What a probe process killed by ``signal_number`` says, and whether it was killed from outside (then it is probed once
    more: :func:`autotune.studies.reading.killed`)."""
    hint = " (the kernel's OOM killer?)" if signal_number == signal.SIGKILL else ""
    return f"probe process killed by {signal.Signals(signal_number).name}{hint}", signal_number in (signal.SIGKILL, signal.SIGTERM)


_uuid_cache: dict[tuple[str, str | None, str | None], str] = {}


def resolve_device_uuid(device: str) -> str:
    """The NVML UUID of ``cuda[:N]`` as this process sees it (``CUDA_VISIBLE_DEVICES`` applied), resolved once.

    Raises:
        DeviceError: no such GPU (see :func:`autotune.probe.device.detect_device`).
    """
    from autotune.errors import DeviceError
    from autotune.probe.device import detect_device

    key = (device, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))
    if key not in _uuid_cache:
        uuid = detect_device(device).uuid
        if uuid is None:
            raise DeviceError(f"--device {device}: NVML reports no UUID for it: use --device cpu")
        _uuid_cache[key] = uuid
    return _uuid_cache[key]


def child_env(spec: ProbeSpec, device_uuid: str | None = None) -> dict[str, str]:
    """The child's environment: the user's, pinned to one GPU, out of any distributed job, with libraries kept quiet.

    On a GPU the child sees one device (a probe of ``spec.nproc`` ranks: that many, :func:`autotune.probe.ranks.probe_gpus`), named by
    its NVML UUID (``device_uuid``, comma-separated for several, else resolved from ``spec.device``; a DeepSpeed probe: by
    its ordinal in PCI bus order, :func:`_ordinals_for_deepspeed`), so it is always ``cuda:0`` there (a rank:
    ``cuda:LOCAL_RANK``), and NVML finds the same GPU.
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes the child's CUDA and NVML number GPUs alike, should
    anything in it count them.
    """
    env = {key: value for key, value in os.environ.items() if not ranks.is_distributed_var(key)}
    if spec.device.startswith("cuda"):
        pinned = device_uuid or ",".join(resolve_device_uuid(d) for d in ranks.probe_gpus(spec.device, spec.nproc))
        env["CUDA_VISIBLE_DEVICES"] = _ordinals_for_deepspeed(spec, pinned)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _ordinals_for_deepspeed(spec: ProbeSpec, uuids: str) -> str:
    """``uuids`` as the child's ``CUDA_VISIBLE_DEVICES``; for a DeepSpeed probe, the same GPUs by their PCI-order ordinals
    where they have them: DeepSpeed's CUDA accelerator parses that variable as integers and crashes on a UUID
    (``ValueError: invalid literal for int()`` in ``_get_nvml_gpu_id``, from ZeRO's optimizer set-up)."""
    from autotune.probe.device import pci_ordinals
    from autotune.sharding import needs_process_group

    if not needs_process_group(spec.params.sharding):
        return uuids
    ordinals = pci_ordinals(uuids.split(","))
    return uuids if ordinals is None else ",".join(str(ordinal) for ordinal in ordinals)


def fixed_overhead_s(result: ProbeResult) -> float | None:
    """What a probe cost beyond building the model, warming up and measuring: process start,
    imports, Trainer set-up, teardown. Needs ``wall_s``; None where the probe measured nothing."""
    if result.wall_s is None or result.step_time_s is None:
        return None
    window_s = result.step_time_s * result.measured_steps
    return max(result.wall_s - (result.model_build_s or 0.0) - (result.warmup_s or 0.0) - window_s, 0.0)


PROBE_DIR_PREFIX = "autotune-probe-"  # + "<driver pid>-<random>", in the temporary directory
NOTE_FILE = "note.json"  # what the driver wants to know about a probe it could not wait for
_PROBE_DIR = re.compile(re.escape(PROBE_DIR_PREFIX) + r"(\d+)-")
STALE_PROBE_DIR_S = 7 * 24 * 3600.0  # an orphaned result nobody came back for is removed after this


@contextlib.contextmanager
def _probe_folder(note: dict[str, Any] | None, root: str | None = None) -> Iterator[Path]:
    """The probe's folder, named after this process; removed afterwards (a ``kill -9`` leaves it, for
    :func:`orphaned_probes`). ``note`` (JSON) is written into it for whoever finds it orphaned."""
    folder = Path(tempfile.mkdtemp(prefix=f"{PROBE_DIR_PREFIX}{os.getpid()}-", dir=root))
    try:
        if note is not None:
            (folder / NOTE_FILE).write_text(json.dumps(note), encoding="utf-8")
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


RUN_CACHE_PREFIX = "autotune-cache-"  # + "<driver pid>", in the temporary directory
_RUN_CACHE_DIR = re.compile(re.escape(RUN_CACHE_PREFIX) + r"(\d+)$")
_run_cache: dict[str | None, Path] = {}


def run_cache_dir(root: str | None = None) -> Path:
    """The folder this driver's probes share for files worth building once per run (QLoRA's
    random-weight base checkpoint): ``autotune-cache-<pid>`` in the temporary directory, created on
    first use and removed when this process exits; one left by a killed driver is removed by
    :func:`orphaned_probes`. A probe finds it in ``$AUTOTUNE_RUN_CACHE``."""
    if root not in _run_cache:
        folder = Path(root or tempfile.gettempdir()) / f"{RUN_CACHE_PREFIX}{os.getpid()}"
        folder.mkdir(parents=True, exist_ok=True)
        _run_cache[root] = folder
    return _run_cache[root]


def clear_run_cache(root: str | None = None) -> None:
    """Remove this driver's run cache now (the end of a run: an API caller's process may live on and
    run again; the next probe creates a fresh one)."""
    folder = _run_cache.pop(root, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@atexit.register
def _clear_run_caches() -> None:
    """At exit: the run caches this process still holds (a run that ended cleared its own)."""
    for root in list(_run_cache):
        clear_run_cache(root)


def _remove_dead_run_caches(base: Path) -> None:
    for folder in base.glob(RUN_CACHE_PREFIX + "*"):
        match = _RUN_CACHE_DIR.match(folder.name)
        if match is not None and int(match.group(1)) != os.getpid() and not psutil.pid_exists(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class OrphanedProbe:
    """A probe whose driver died before it could record the result: the driver's note and the result."""

    folder: Path
    note: dict[str, Any]
    result: ProbeResult

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def orphaned_probes(root: str | None = None) -> list[OrphanedProbe]:
    """Clean up the probe folders of drivers that are gone, and return the finished results among them.

    A folder whose driver's pid is dead and that holds no result, or that is older than
    :data:`STALE_PROBE_DIR_S`, is removed. A folder with a note and a result is returned (oldest first)
    for the caller to record in the note's study and then :meth:`~OrphanedProbe.discard`; a caller
    that does not own the note's study leaves it for the run that does.
    """
    base = Path(root or tempfile.gettempdir())
    _remove_dead_run_caches(base)
    found: list[OrphanedProbe] = []
    now_s = time.time()
    for folder in sorted(base.glob(PROBE_DIR_PREFIX + "*"), key=lambda p: p.stat().st_mtime if p.exists() else 0.0):
        match = _PROBE_DIR.match(folder.name)
        if match is None or not folder.is_dir() or int(match.group(1)) == os.getpid() or psutil.pid_exists(int(match.group(1))):
            continue
        note_path, result_path = folder / NOTE_FILE, folder / "result.json"
        try:
            stale = now_s - folder.stat().st_mtime > STALE_PROBE_DIR_S
            if stale or not (note_path.exists() and result_path.exists()):
                raise ValueError("nothing to recover")
            note = json.loads(note_path.read_text(encoding="utf-8"))
            result = ProbeResult.from_dict(json.loads(result_path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):  # no result, unreadable or stale: nothing to keep
            shutil.rmtree(folder, ignore_errors=True)
            continue
        found.append(OrphanedProbe(folder, dict(note), result))
    return found


def run_isolated(
    spec: ProbeSpec,
    *,
    timeout_s: float,
    python: str = sys.executable,
    mode: IsolationMode = DEFAULT_MODE,
    device_uuid: str | None = None,
    note: dict[str, Any] | None = None,
) -> ProbeResult:
    """Run ``spec`` in a new process and return its result; never raises for a failed probe.

    Args:
        spec: the probe to run.
        timeout_s: wall-clock deadline for the whole child, start-up included.
        python: interpreter to run a ``cold`` child with.
        mode: ``forkserver`` (fork from a pre-imported probe server; cold when the server failed its
            self-test) or ``cold`` (a new interpreter).
        device_uuid: the NVML UUID of the GPU to run on (:attr:`DeviceInfo.uuid`); None: resolved
            from ``spec.device`` (``cuda:N`` as this process sees it).
        note: JSON kept in the probe's folder (the study and trial it belongs to), for the run that
            finds the folder orphaned (:func:`orphaned_probes`) after this process was killed.

    Returns:
        The child's :class:`ProbeResult` with ``wall_s`` and ``overhead_s`` set; ``timeout`` if the
        deadline passed, ``oom`` if the kernel's OOM killer ended it (:func:`host_oom_kills`), ``crash`` with the
        output tail if the child died without writing a result otherwise.

    Raises:
        KeyboardInterrupt: after killing the child, so the caller can stop cleanly.
        DeviceError: ``spec.device`` names no GPU here (only when ``device_uuid`` is None).
    """
    env = child_env(spec, device_uuid)
    child_spec = spec
    if spec.device.startswith("cuda:"):
        child_spec = dataclasses.replace(spec, device="cuda")  # the one GPU the child sees
    with _probe_folder(note) as folder:
        spec_path, result_path, log_path = folder / "spec.json", folder / "result.json", folder / "output.txt"
        spec_path.write_text(child_spec.to_json(), encoding="utf-8")
        # The child's scratch (the Trainer's output_dir) goes inside this folder, which is removed here
        # even when the child is killed before it can remove its own. The child knows the driver (to die
        # with it) and its own deadline.
        env = {**env, SCRATCH_ENV: str(folder), RUN_CACHE_ENV: str(run_cache_dir()), DRIVER_PID_ENV: str(os.getpid()), DEADLINE_ENV: f"{timeout_s:.0f}"}
        as_ranks = ranks.launched_as_ranks(spec)
        if as_ranks:  # torchrun starts fresh interpreters, one per rank
            mode = "cold"
        if mode == "forkserver" and not start_server():  # once per process; not charged to this trial
            mode = "cold"
        if mode == "forkserver" and (problem := server_problem()) is not None:  # forking from it would hang or fail
            abandon_server(problem)
            mode = "cold"
        start_s = time.monotonic()
        oom_kills_before = host_oom_kills()
        try:
            child: _Child
            if as_ranks:  # torchrun, starting that many ranks of the probe (autotune.probe.ranks)
                child = _ColdChild(spec_path, result_path, log_path, env, python,
                                   argv=ranks.launch_command(python, spec.nproc, spec_path, result_path))
            else:
                child = _launch(mode, spec_path, result_path, log_path, env, python)
        except (EOFError, ConnectionError, OSError) as exc:
            if mode != "forkserver":
                raise
            abandon_server(f"forking a probe failed: {type(exc).__name__}: {exc}")  # it died as we asked it
            mode = "cold"
            start_s = time.monotonic()
            child = _launch(mode, spec_path, result_path, log_path, env, python)
        try:
            returncode = child.wait(timeout_s)
        except BaseException:
            child.kill_group()
            raise
        wall_s = time.monotonic() - start_s
        # On a timeout the whole group dies; otherwise workers the child left behind die with it.
        child.kill_group()
        if returncode is None:
            return ProbeResult(
                status=ProbeStatus.TIMEOUT, error=f"probe passed its {timeout_s:.0f} s deadline and was killed", wall_s=wall_s
            )
        # torchrun exits 1 when a rank dies of a signal: its failure summary says which, as a lone process's exit code would.
        killed_by = _rank_signal(log_path) if as_ranks and returncode != 0 else None
        if spec.nproc > 1 and (reported := ranks.read_results(result_path, spec.nproc)):
            result = ranks.combine(reported, spec.nproc).replace(wall_s=wall_s)
            if killed_by is not None and result.status is ProbeStatus.CRASH:  # the others' crashes followed from it (a peer gone)
                if (host_oom := _host_oom(killed_by, oom_kills_before)) is not None:
                    return result.replace(status=ProbeStatus.OOM, error=f"{host_oom}\n{result.error}", overhead_s=None)
                reason, lost = _killed_reason(killed_by)
                result = result.replace(error=f"{reason}: {result.error}", process_lost=lost)
            if not any(r is not None and r.status is not ProbeStatus.OK for r in reported) and result.status is not ProbeStatus.OK:
                result = result.replace(error=f"{result.error}\n{_tail(log_path)}".strip())  # a rank died without a word
            return result.replace(overhead_s=fixed_overhead_s(result))
        if result_path.exists():
            try:
                data = json.loads(result_path.read_text(encoding="utf-8"))
                result = ProbeResult.from_dict(data).replace(wall_s=wall_s)
            except (json.JSONDecodeError, TypeError) as exc:
                return ProbeResult(status=ProbeStatus.CRASH, error=f"unreadable probe result: {exc}", wall_s=wall_s)
            return result.replace(overhead_s=fixed_overhead_s(result))
        lost = False
        if killed_by is not None:
            returncode = -killed_by
        if (host_oom := _host_oom(-returncode, oom_kills_before)) is not None:
            return ProbeResult(status=ProbeStatus.OOM, error=f"{host_oom}\n{_tail(log_path)}".strip(), wall_s=wall_s)
        if returncode == UNREPORTED_EXIT_CODE and isinstance(child, _ForkedChild) and server_problem() is not None:
            reason, lost = LOST_WITH_SERVER, True
        elif returncode < 0:
            reason, lost = _killed_reason(-returncode)
        else:
            reason = f"probe process exited with code {returncode} without a result"
        tail = _tail(log_path)
        return ProbeResult(status=ProbeStatus.CRASH, error=f"{reason}\n{tail}".strip(), wall_s=wall_s, process_lost=lost)
