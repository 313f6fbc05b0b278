"""How the probe server is spawned, so that its start survives what the run's environment throws at it.

* :func:`children_ignore_sigint`: it starts ignoring SIGINT, so a Ctrl-C to the run's process group
  while its interpreter starts is the run's to handle, not a traceback from the server.
* :func:`short_socket_dir`: multiprocessing binds the server's AF_UNIX socket under the temporary
  folder (``TMPDIR``); a path longer than the kernel's 107 bytes fails the bind and every probe
  would start cold, so a long temporary folder is swapped for ``/tmp`` while the server starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator

# sun_path holds 108 bytes with its NUL; multiprocessing's socket is <tmp>/pymp-XXXXXXXX/listener-XXXXXXXX (32 more).
_AF_UNIX_PATH_MAX = 107
_SOCKET_SUFFIX_CHARS = len("/pymp-12345678/listener-12345678")


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


@contextlib.contextmanager
def short_socket_dir() -> Iterator[None]:
    """``/tmp`` as the temporary folder while the server starts, where ``TMPDIR`` is too long for its socket path
    (multiprocessing picks its own folder once per process, at the first need: the server's start)."""
    if len(tempfile.gettempdir()) + _SOCKET_SUFFIX_CHARS <= _AF_UNIX_PATH_MAX or not os.access("/tmp", os.W_OK):
        yield
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        yield
    finally:
        tempfile.tempdir = saved
