"""Shared fixtures: a fake evaluator that stands in for the GPU, CPU-only test settings, and a
throwaway PostgreSQL server (``postgres_url``)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from autotune.params import TrialParams
from autotune.records import DeviceInfo, ProbeResult
from autotune.search.loop import VirtualClock
from autotune.units import GiB

os.environ.setdefault("HF_HUB_OFFLINE", "1")



@dataclass
class FakeEvaluator:
    """A pretend GPU: OOM above a memory threshold, throughput a simple function of the params.

    Memory = 1 GiB + 0.5 GiB per sample of batch (halved by checkpointing); real OOM (``oom``) above
    ``oom_above_bytes``. Each probe costs ``probe_s`` on the virtual clock.
    """

    oom_above_bytes: int = 20 * GiB
    probe_s: float = 30.0
    clock: VirtualClock = field(default_factory=VirtualClock)
    calls: list[TrialParams] = field(default_factory=list)
    fail_on: dict[tuple[int, str], str] = field(default_factory=dict)  # (batch, precision) -> status

    @staticmethod
    def memory_bytes(params: TrialParams) -> int:
        per_sample = 0.5 * GiB * (0.5 if params.gradient_checkpointing else 1.0)
        return int(1 * GiB + per_sample * params.per_device_train_batch_size)

    @staticmethod
    def samples_per_s(params: TrialParams) -> float:
        speed = {"fp32": 1.0, "tf32": 1.5, "fp16": 2.0, "bf16": 2.2}[params.precision]
        speed *= 0.75 if params.gradient_checkpointing else 1.0
        batch = params.per_device_train_batch_size
        return speed * 100.0 * batch / (batch + 8)

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        self.calls.append(params)
        self.clock.advance(min(self.probe_s, timeout_s))
        if self.probe_s > timeout_s:
            return ProbeResult(status="timeout", error="deadline", wall_s=timeout_s)
        forced = self.fail_on.get((params.per_device_train_batch_size, params.precision))
        if forced:
            return ProbeResult(status=forced, error=f"forced {forced}", wall_s=self.probe_s)  # type: ignore[arg-type]
        memory = self.memory_bytes(params)
        if memory > self.oom_above_bytes:
            return ProbeResult(status="oom", error="OutOfMemoryError: fake", wall_s=self.probe_s)
        sps = self.samples_per_s(params)
        return ProbeResult(
            status="ok", samples_per_s=sps, tokens_per_s=sps * 128, step_time_s=params.effective_batch_size / sps,
            measured_steps=4, peak_mem_bytes=memory, wall_s=self.probe_s,
        )


@dataclass
class NoisyEvaluator:
    """Every configuration fits (1 GiB); its samples/s is the next value of its batch size's script,
    so a second probe of the same configuration can measure something else (or ``"oom"``)."""

    script: dict[int, list[float | str]]
    ci95_rel: float | None = None
    probe_s: float = 30.0
    clock: VirtualClock = field(default_factory=VirtualClock)
    calls: list[int] = field(default_factory=list)  # batch sizes, in order
    interrupt_at_call: int | None = None

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        batch = params.per_device_train_batch_size
        if len(self.calls) == self.interrupt_at_call:
            raise KeyboardInterrupt
        value = self.script[batch][self.calls.count(batch)]
        self.calls.append(batch)
        assert self.probe_s <= timeout_s, "the driver started a probe that cannot finish"
        self.clock.advance(self.probe_s)
        if value == "oom":
            return ProbeResult(status="oom", error="OutOfMemoryError: fake", wall_s=self.probe_s)
        return ProbeResult(
            status="ok", samples_per_s=float(value), tokens_per_s=float(value) * 128, step_time_s=batch / float(value),
            measured_steps=8, peak_mem_bytes=GiB, wall_s=self.probe_s, step_time_ci95_rel=self.ci95_rel,
        )


@pytest.fixture
def fake_gpu() -> DeviceInfo:
    return DeviceInfo(kind="cuda", name="Fake H100", total_memory_bytes=80 * GiB, compute_capability=(9, 0))


@pytest.fixture
def cpu_device() -> DeviceInfo:
    return DeviceInfo(kind="cpu", name="CPU: test", total_memory_bytes=24 * GiB)


# ---------------------------------------------------------------------------------------- PostgreSQL


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_or_fail(message: str) -> None:
    """Skip a test whose tool is missing, except under CI=true, where it fails (as the browser test does)."""
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def _postgres_bin() -> Path | None:
    """The newest PostgreSQL server binaries: Debian's /usr/lib/postgresql/<version>/bin, else pg_ctl on PATH."""
    candidates = [Path(d) for d in glob.glob("/usr/lib/postgresql/*/bin") if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists()]
    candidates.sort(key=lambda d: [int(x) for x in re.findall(r"\d+", d.parent.name)] or [0])
    if candidates:
        return candidates[-1]
    found = shutil.which("pg_ctl")
    return Path(found).resolve().parent if found and (Path(found).resolve().parent / "initdb").exists() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL server for the session: ``postgresql://postgres@127.0.0.1:PORT/autotune_test``.

    ``initdb`` into a temporary folder (trust authentication, only this cluster), ``pg_ctl start``
    listening on 127.0.0.1 only, on a free port; stopped and removed afterwards. PostgreSQL refuses
    to run as root, so as root the server runs as the ``postgres`` user that Debian's package
    creates. Without PostgreSQL (``make test`` installs it as root) the tests that use it skip, and
    fail under CI=true. Tests share the server: use study names (or :func:`postgres_database`) of their own.
    """
    bindir = _postgres_bin()
    if bindir is None:
        skip_or_fail("PostgreSQL not found (/usr/lib/postgresql/*/bin): apt-get install -y postgresql (make test does it as root)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        skip_or_fail("psycopg is missing: pip install -e '.[test]'")
    prefix: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="autotune-pg-"))  # not under pytest's root-only basetemp: the server's user reaches it
    if os.geteuid() == 0:
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(base, ignore_errors=True)
            skip_or_fail("no postgres user to run PostgreSQL as (it refuses root): apt-get install -y postgresql creates it")
        runuser = shutil.which("runuser")
        if runuser is None:
            shutil.rmtree(base, ignore_errors=True)
            skip_or_fail("runuser (util-linux) is missing: it starts PostgreSQL as the postgres user")
        os.chown(base, user.pw_uid, user.pw_gid)
        prefix = [runuser, "-u", "postgres", "--"]
    data, log = base / "data", base / "server.log"

    def run(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=120, cwd=base)

    started = False
    try:
        init = run(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
        if init.returncode != 0:
            skip_or_fail(f"initdb failed: {(init.stderr or init.stdout).strip().splitlines()[-1:]}")
        for _attempt in range(3):  # a free port can be taken between the check and the start
            port = _free_port()
            options = f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            start = run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
            if start.returncode == 0:
                started = True
                break
        if not started:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else start.stderr.strip().splitlines()[-3:]
            skip_or_fail(f"PostgreSQL did not start: {' | '.join(tail)}")
        created = run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "autotune_test")
        if created.returncode != 0:
            skip_or_fail(f"createdb failed: {created.stderr.strip()}")
        yield f"postgresql://postgres@127.0.0.1:{port}/autotune_test"
    finally:
        if started:
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def postgres_database(postgres_url: str, request: pytest.FixtureRequest) -> str:
    """A fresh, empty database on the session's server, for one test: its URL."""
    import psycopg

    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40] + f"_{os.getpid()}_{_free_port()}"
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    return postgres_url.rsplit("/", 1)[0] + "/" + name
