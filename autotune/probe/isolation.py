"""Run one probe in a fresh child process, with a deadline.

A fresh process per trial means an OOM, a segfault, a leaked CUDA context or a hung kernel in one
trial cannot affect the next one (the reason Lightning's in-process finder needs hand-written
state resets). The child runs in its own process group, so on a timeout or a Ctrl-C the whole
group (DataLoader workers, compile workers) is killed.

Two ways to start the child (:data:`IsolationMode`):

* ``forkserver`` (default): a probe server started once per parent process imports torch,
  transformers and autotune (:mod:`autotune.probe.preload`) and then forks one child per probe. The
  server is a fresh interpreter that never initialised CUDA, so each forked child is as clean as a
  cold one, without paying ~seconds of imports per trial.
* ``cold``: ``python -m autotune.probe.child SPEC.json RESULT.json``, a new interpreter per probe.

Either way the child gets its own session (``setsid``), writes its stdout/stderr to a file (the
tail is the error of a crash), and writes a :class:`ProbeResult` as JSON; the parent adds
``wall_s`` and ``overhead_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing import spawn
from pathlib import Path
from typing import Any, Literal, Protocol

from autotune.records import ProbeResult, ProbeSpec, ProbeStatus

IsolationMode = Literal["forkserver", "cold"]
DEFAULT_MODE: IsolationMode = "forkserver"
PRELOAD_MODULES = ["autotune.probe.preload"]

_STDERR_TAIL_CHARS = 2000


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


class _ColdChild:
    def __init__(self, spec_path: Path, result_path: Path, log_path: Path, env: dict[str, str], python: str) -> None:
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "autotune.probe.child", str(spec_path), str(result_path)],
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
        _killpg(self.pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _forked_main(spec_path: str, result_path: str, log_path: str, env: dict[str, str]) -> None:
    """The probe child forked from the server: own session, output to a file, run, write the result."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)  # before anything initialises CUDA: CUDA_VISIBLE_DEVICES pins the GPU
    import torch

    if getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
        raise RuntimeError("the probe server initialised CUDA before forking: use mode='cold' and report this")
    from autotune.probe.child import main

    main([spec_path, result_path])


def _server_context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD_MODULES)
    return context


_server_ready = False


def _noop() -> None:
    pass


def start_server() -> None:
    """Start the probe server and wait until it has imported everything, so no trial pays for it.

    The server starts at most once per parent process; later calls return at once.
    """
    global _server_ready
    if _server_ready:
        return
    context = _server_context()
    with _without_main_module():
        warm_up = context.Process(target=_noop, name="autotune-probe-server-warm-up")
        warm_up.start()  # returns once the server has finished its imports and forked
    warm_up.join()
    _server_ready = True


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
    def __init__(self, spec_path: Path, result_path: Path, log_path: Path, env: dict[str, str]) -> None:
        self.process = _server_context().Process(
            target=_forked_main, args=(str(spec_path), str(result_path), str(log_path), env), name="autotune-probe"
        )
        with _without_main_module():
            self.process.start()
        assert self.process.pid is not None
        self.pid = self.process.pid

    def wait(self, timeout_s: float) -> int | None:
        self.process.join(timeout_s)
        return self.process.exitcode

    def kill_group(self) -> None:
        _killpg(self.pid)  # the child's session: it and its DataLoader workers
        if self.process.exitcode is None:
            self.process.kill()  # killed before it called setsid
        self.process.join()


def _launch(
    mode: IsolationMode, spec_path: Path, result_path: Path, log_path: Path, env: dict[str, str], python: str
) -> _Child:
    if mode == "cold":
        return _ColdChild(spec_path, result_path, log_path, env, python)
    return _ForkedChild(spec_path, result_path, log_path, env)


def _tail(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-_STDERR_TAIL_CHARS:]
    except OSError:
        return ""


def child_env(spec: ProbeSpec) -> dict[str, str]:
    """The child's environment: the user's, pinned to one GPU, with libraries kept quiet."""
    env = dict(os.environ)
    if spec.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = spec.device.split(":", 1)[1]
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def fixed_overhead_s(result: ProbeResult) -> float | None:
    """What a probe cost beyond building the model, warming up and measuring: process start,
    imports, Trainer set-up, teardown. Needs ``wall_s``; None where the probe measured nothing."""
    if result.wall_s is None or result.step_time_s is None:
        return None
    window_s = result.step_time_s * result.measured_steps
    return max(result.wall_s - (result.model_build_s or 0.0) - (result.warmup_s or 0.0) - window_s, 0.0)


def run_isolated(
    spec: ProbeSpec, *, timeout_s: float, python: str = sys.executable, mode: IsolationMode = DEFAULT_MODE
) -> ProbeResult:
    """Run ``spec`` in a new process and return its result; never raises for a failed probe.

    Args:
        spec: the probe to run.
        timeout_s: wall-clock deadline for the whole child, start-up included.
        python: interpreter to run a ``cold`` child with.
        mode: ``forkserver`` (fork from a pre-imported probe server) or ``cold`` (a new interpreter).

    Returns:
        The child's :class:`ProbeResult` with ``wall_s`` and ``overhead_s`` set; ``timeout`` if the
        deadline passed, ``crash`` with the output tail if the child died without writing a result.

    Raises:
        KeyboardInterrupt: after killing the child, so the caller can stop cleanly.
    """
    child_spec = spec
    if spec.device.startswith("cuda:"):
        child_spec = dataclasses.replace(spec, device="cuda")
    with tempfile.TemporaryDirectory(prefix="autotune-probe-") as tmp:
        folder = Path(tmp)
        spec_path, result_path, log_path = folder / "spec.json", folder / "result.json", folder / "output.txt"
        spec_path.write_text(child_spec.to_json(), encoding="utf-8")
        if mode == "forkserver":
            start_server()  # once per parent process; not charged to this trial's deadline or overhead
        start_s = time.monotonic()
        child = _launch(mode, spec_path, result_path, log_path, child_env(spec), python)
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
        if result_path.exists():
            try:
                data = json.loads(result_path.read_text(encoding="utf-8"))
                result = ProbeResult.from_dict(data).replace(wall_s=wall_s)
            except (json.JSONDecodeError, TypeError) as exc:
                return ProbeResult(status=ProbeStatus.CRASH, error=f"unreadable probe result: {exc}", wall_s=wall_s)
            return result.replace(overhead_s=fixed_overhead_s(result))
        if returncode < 0:
            name = signal.Signals(-returncode).name
            hint = " (the kernel's OOM killer?)" if -returncode == signal.SIGKILL else ""
            reason = f"probe process killed by {name}{hint}"
        else:
            reason = f"probe process exited with code {returncode} without a result"
        tail = _tail(log_path)
        return ProbeResult(status=ProbeStatus.CRASH, error=f"{reason}\n{tail}".strip(), wall_s=wall_s)
