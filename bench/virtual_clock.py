"""Several worker threads on one virtual clock: the multi-worker replay benchmark's (``bench/workers.py``) time.

Each worker runs the product's search loop with its own :class:`WorkerClock`, a view of one
:class:`SharedVirtualClock`, so N workers searching one study are simulated in virtual time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class SharedVirtualClock:
    """One virtual clock for N worker threads: a conservative discrete-event simulation.

    A worker is *deciding* (running loop code: syncing, proposing, telling) or *blocked* in a probe
    until the clock reaches its completion time, or *done*. Deciding costs no virtual time, so the
    clock moves only when no worker is deciding: then it jumps to the earliest pending completion,
    and every worker due then decides again (in the order they started those probes, when
    ``serial``). A worker that returns from the loop calls :meth:`done` and no longer holds the
    clock back.

    ``serial`` (the default) lets one worker decide at a time, handing over whenever it blocks or
    is done: deciding is instantaneous on the virtual clock either way, and this makes a run
    reproducible (the same trial numbers and outcomes for the same seeds). ``serial=False`` lets
    every due worker decide at once, so the storage sees real races between them.

    Each worker talks to the clock through :meth:`view` (a :class:`WorkerClock`: the loop's
    ``clock`` and the evaluator's ``clock``), from its own thread, after :meth:`start`.
    """

    def __init__(self, n_workers: int, *, serial: bool = True) -> None:
        self._cond = threading.Condition()
        self._now_s = 0.0
        self.serial = serial
        self._state = ["new"] * n_workers  # new, ready, deciding, blocked, done
        self._wake_s = [0.0] * n_workers
        self._ready: list[int] = []  # due to decide, in the order they will
        self._order = 0  # orders blocked workers due at the same time: first blocked, first woken
        self._blocked_at = [0] * n_workers
        self.advances = 0  # how often the clock moved

    def now(self) -> float:
        with self._cond:
            return self._now_s

    def view(self, worker: int) -> WorkerClock:
        return WorkerClock(self, worker)

    def start(self, worker: int) -> None:
        """Enter the simulation (from the worker's thread); returns when it may decide."""
        with self._cond:
            self._state[worker] = "ready"
            self._ready.append(worker)
            self._schedule()
            self._wait_turn(worker)

    def sleep(self, worker: int, seconds: float) -> None:
        """Block ``worker`` in a probe until the clock reaches now + ``seconds``."""
        with self._cond:
            if self._state[worker] != "deciding":
                raise RuntimeError(f"worker {worker} is {self._state[worker]}, not deciding: call start() first")
            self._state[worker] = "blocked"
            self._wake_s[worker] = self._now_s + max(0.0, float(seconds))
            self._blocked_at[worker] = self._order
            self._order += 1
            self._schedule()
            self._wait_turn(worker)

    def done(self, worker: int) -> None:
        """``worker`` has left the loop: the clock no longer waits for it."""
        with self._cond:
            if worker in self._ready:
                self._ready.remove(worker)
            self._state[worker] = "done"
            self._schedule()

    def states(self) -> list[str]:
        with self._cond:
            return list(self._state)

    def _wait_turn(self, worker: int) -> None:
        while self._state[worker] != "deciding":
            self._cond.wait()

    def _schedule(self) -> None:
        """Let due workers decide; when none is deciding or due, move the clock to the next completion."""
        while True:
            deciding = self._state.count("deciding")
            if self._ready and (not self.serial or deciding == 0):
                chosen = self._ready if not self.serial else self._ready[:1]
                for worker in chosen:
                    self._state[worker] = "deciding"
                self._ready = [w for w in self._ready if w not in chosen]
                self._cond.notify_all()
                return
            if deciding or self._ready or "new" in self._state:
                return  # someone decides (or has yet to start): the clock stays
            blocked = [w for w, s in enumerate(self._state) if s == "blocked"]
            if not blocked:
                return  # everyone is done
            self._now_s = max(self._now_s, min(self._wake_s[w] for w in blocked))
            self.advances += 1
            due = sorted((w for w in blocked if self._wake_s[w] <= self._now_s), key=lambda w: self._blocked_at[w])
            for worker in due:
                self._state[worker] = "ready"
            self._ready.extend(due)


@dataclass
class WorkerClock:
    """One worker's view of a :class:`SharedVirtualClock`: ``now`` is the shared time, ``advance``
    blocks this worker until the shared clock has moved that far (what a probe costs)."""

    shared: SharedVirtualClock
    worker: int

    @property
    def elapsed_s(self) -> float:
        return self.shared.now()

    def now(self) -> float:
        return self.shared.now()

    def advance(self, seconds: float) -> None:
        self.shared.sleep(self.worker, seconds)
