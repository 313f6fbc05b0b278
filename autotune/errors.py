"""One error tree for everything a user can get wrong, each with its exit code.

Every error message is a single line that says what is wrong and names the fix. The CLI maps
an :class:`AutotuneError` to ``autotune: error: <message>`` and its ``exit_code``; anything else
is a bug and shows a traceback.
"""

from __future__ import annotations

EXIT_USAGE = 2
EXIT_NOTHING_FITS = 3
EXIT_NO_RESULT = 4
EXIT_STORAGE_FAILED = 5  # the study's storage failed during the run
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: a scheduler (SLURM, Kubernetes) or `kill` stopped the run


class AutotuneError(Exception):
    """Base class of every error autotune raises on purpose."""

    exit_code: int = 1


class UsageError(AutotuneError):
    """Bad input from the user: a flag, a file, a name. Exit code 2."""

    exit_code = EXIT_USAGE


class ModelNotFound(UsageError):
    """The model name is neither built in, a local directory with config.json, nor reachable."""


class SearchSpaceError(UsageError):
    """A search-space file is missing or invalid (the message lists every problem)."""


class BudgetError(UsageError):
    """A malformed duration, byte size, or budget."""


class DeviceError(UsageError):
    """The request does not match the device (e.g. a memory ceiling above its memory)."""


class ReplayTableError(UsageError):
    """A replay table is malformed (missing column, unknown status, duplicate row...)."""


class NothingFits(AutotuneError):
    """Every configuration tried ran out of memory or exceeded the memory ceiling."""

    exit_code = EXIT_NOTHING_FITS


class NoResult(AutotuneError):
    """No probe finished with a measurement: the budget ended first, or every probe crashed, timed out or diverged."""

    exit_code = EXIT_NO_RESULT


class StorageFailed(AutotuneError):
    """The study's storage failed during the run (read-only, full, removed, locked, its server stopped): the
    run stops; every trial it stored before is kept, and the same command resumes once the storage works."""

    exit_code = EXIT_STORAGE_FAILED


class ReaderGone(KeyboardInterrupt):
    """The reader of stdout went away (``autotune run ... | head -3``): the run stops as on Ctrl-C (the probe in
    flight is recorded as interrupted, best.json and the report are written, nothing more is printed) and the CLI
    exits 141, as a tool stopped by SIGPIPE does."""


class Terminated(KeyboardInterrupt):
    """SIGTERM received (:func:`autotune.interrupts.sigterm_interrupts`): handled everywhere exactly as
    Ctrl-C is (the probe in flight is stopped and recorded as interrupted, results and report are
    written), and the CLI exits with :data:`EXIT_TERMINATED`."""
