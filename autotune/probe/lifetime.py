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

``DRIVER_PID_ENV`` carries the driver's pid into the children, so one that started after the driver
had already died (a race the death signal cannot see) exits at once.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import threading
import time

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
