"""SIGTERM as Ctrl-C: one way to stop a run, whoever stops it.

A batch scheduler (SLURM, Kubernetes) preempts a job with SIGTERM and kills it a grace period later.
Python's default for SIGTERM is to die at once: no trial recorded as interrupted, no report, probe
processes left running. :func:`sigterm_interrupts` makes SIGTERM raise :class:`~autotune.errors.Terminated`,
a ``KeyboardInterrupt``, so every path that handles Ctrl-C (the loop fails the trial in flight, the
probe's process group is killed, the result and report are written) handles it too; the CLI then
exits 143 (128 + SIGTERM).

Only the CLI and its worker processes install it: a library must not take over a notebook's signals.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from autotune.errors import Terminated

_received: list[int] = []


def received_sigterm() -> bool:
    """Whether SIGTERM arrived while :func:`sigterm_interrupts` was active in this process."""
    return bool(_received)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    # Once is enough: a second SIGTERM during the clean-up (writing the report) would abort it half-way.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While active, SIGTERM raises :class:`~autotune.errors.Terminated` in the main thread (a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
