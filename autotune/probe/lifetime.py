"""No probe process outlives the run that started it.

The probe server and every probe child run while the driver (``autotune run``, a worker, ``tune()``)
waits for them. If the driver is killed hard (``kill -9``, the OOM killer, a node losing power to
its container), nothing in the driver can clean up; these processes must notice themselves:

* :func:`die_with_parent` asks the kernel (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to kill this
  process when its parent dies; elsewhere a daemon thread polls the parent. The chain driver ->
  probe server -> probe child therefore dies link by link; a probe's DataLoader workers follow their
  probe (torch's worker watchdog polls its parent every 5 s, and the probe's session is killed
  whenever the driver can do it).
* :func:`arm_deadline` gives the probe its own deadline (``SIGALRM``), a backstop for the parent's
  ``wait()``: a probe that never ends cannot run on for ever even if its parent is stuck.

* :func:`children_ignore_sigint`: the probe server is spawned ignoring SIGINT, so a Ctrl-C to the run's
  process group while it starts is the run's to handle, not a traceback from the server.

``DRIVER_PID_ENV`` carries the driver's pid into the children, so one that started after the driver
had already died (a race the death signal cannot see) exits at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import psutil

DRIVER_PID_ENV = "AUTOTUNE_DRIVER_PID"  # the pid of the process that runs the search
DEADLINE_ENV = "AUTOTUNE_PROBE_DEADLINE_S"  # a probe's own deadline, seconds from its start
DEADLINE_GRACE_S = 30.0  # past the parent's deadline: the parent normally kills the probe first
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_POLL_S = 1.0


def die_with_parent() -> None:
    """Be killed (SIGKILL) when the parent process dies, and exit now if the driver is already gone.

    Safe in a ``preexec_fn`` (no allocation beyond ctypes' call) and in a freshly forked child.
    """
    parent_pid = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:  # no parent-death signal: a thread polls for the parent instead
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(_POLL_S)
            os._exit(1)

        threading.Thread(target=watch, name="autotune-parent-watch", daemon=True).start()
    driver = os.environ.get(DRIVER_PID_ENV, "")
    # The parent may have died before the death signal was armed (its pid then changed to a reaper's).
    if os.getppid() != parent_pid or (driver.isdigit() and not psutil.pid_exists(int(driver))):
        os._exit(1)


def arm_deadline() -> None:
    """SIGALRM (which kills) :data:`DEADLINE_GRACE_S` after the deadline in ``DEADLINE_ENV``, if set."""
    value = os.environ.get(DEADLINE_ENV)
    if not value:
        return
    try:
        deadline_s = float(value)
    except ValueError:
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(deadline_s + DEADLINE_GRACE_S)))


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """SIGINT ignored while a child process is spawned (milliseconds; the probe server: ``isolation._start_watched``).
    An ignored signal stays so across fork and exec, so the child ignores a Ctrl-C to the run's process group from its
    first instruction (an interrupted start printed a traceback); the run handles the Ctrl-C. Only the main thread may
    set a handler: from another thread this does nothing (the server's preload.py ignores SIGINT first thing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
