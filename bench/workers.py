"""Several workers on one study, in the replay benchmark: how much sooner N workers find a configuration within 2 % of the optimum.

    python -m bench.workers                              # design draws 0-49, 1/2/4/8 workers, 120 virtual minutes
    python -m bench.workers --first-draw 300             # draws 300-349, held out (no one designed on them)
    python -m bench.workers --draws 10 --workers 1,4 --budget 60m --details rows.csv
    python -m bench.workers --tables                     # the shipped replay tables instead of the family

Each search is N threads, each running :func:`autotune.search.loop.run_search` with its own
strategy instance (seed ``draw index * 1000 + worker``), its own ``optuna.Study`` object and its own
evaluator, all on one study in one ``optuna.storages.InMemoryStorage`` (``--storage journal``: an
Optuna journal file in a temporary folder), all on one :class:`~bench.virtual_clock.SharedVirtualClock`:
a worker that starts a probe costing c virtual seconds blocks until the shared clock reaches its
start + c, and the clock moves to the earliest pending completion only when no worker is deciding
(deciding costs no virtual time). Every worker's budget deadline is on that clock (``clock=`` and
``started_s=0``). The family's evaluators share one repeat count per configuration, so a
re-measure draws fresh noise whichever worker runs it.

Real-time waits in the loop are set so that they cannot distort the simulation:

* ``heartbeat_grace_s`` = 1e9 and ``heartbeat_interval_s`` = 3600: the grace is compared with real
  time, which has nothing to do with virtual time (a worker blocked for one virtual hour may be
  blocked a real millisecond, or a worker blocked a few virtual seconds may wait real seconds while
  another's strategy computes); no worker dies in a simulation, so no trial may be failed as dead.
  (All threads share one ``host:pid`` owner anyway, which the loop never fails.)
* ``claim_settle_s`` = 5 (real seconds, an upper bound only): a claim waits for an older trial that
  has no configuration yet, i.e. a worker between ``ask`` and ``suggest``. That worker is deciding,
  so the clock cannot move during the wait and the wait ends as soon as it records its
  configuration; with ``--serial`` (the default) only one worker decides at a time and never
  hands over between ``ask`` and ``suggest``, so the wait never happens at all.

**Time to 0.98**: after each probe's outcome is stored (``on_trial``), the study's best is
ranked by the loop's rule (:func:`autotune.search.ranking.rank_configurations` over the stored
probes); the first virtual time at which that configuration's noise-free samples/s (as
``bench.search`` scores it; 0 unless it runs and fits) reaches 0.98 of the landscape's noise-free
optimum under the ceiling is the time to target. A search stops once it is reached (``--full``:
runs the whole budget, to check duplicates over whole runs): each worker's next probe start, or
the end of the probe it is blocked in, raises ``KeyboardInterrupt``, which the loop treats as
Ctrl-C (its trial is failed as interrupted; nothing after the target counts).

**Duplicates**: configurations probed by more than one exploring trial (trials with ``remeasure_of``
are deliberate; two re-measures of the same (configuration, round) count), from the study.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from autotune.params import TrialParams  # noqa: E402
from autotune.search.loop import Evaluator, SearchOutcome, SearchSettings, TrialRecord, run_search  # noqa: E402
from autotune.search.ranking import rank_configurations  # noqa: E402
from autotune.search.strategies.registry import DEFAULT_STRATEGY, make_strategy  # noqa: E402
from autotune.space import SearchSpace  # noqa: E402
from autotune.studies import reading, schema  # noqa: E402
from autotune.units import parse_bytes, parse_duration_s  # noqa: E402
from bench.virtual_clock import SharedVirtualClock, WorkerClock  # noqa: E402

TARGET = 0.98
DESIGN_DRAWS = 200  # draws 0-199 are the family's design range (bench/search.py); later ones are held out
HEARTBEAT_INTERVAL_S = 3600.0  # real seconds: no heartbeat write during a simulated probe
HEARTBEAT_GRACE_S = 1e9  # real seconds: no trial is ever failed as dead (no worker dies here)
CLAIM_SETTLE_S = 5.0  # real seconds, an upper bound: the worker waited for is deciding, the clock stands still
DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
DEFAULT_TABLES = (
    f"{DATA / 'landscape_gptneox-1.3b-a100.csv.gz'}:40GiB",
    f"{DATA / 'landscape_pythia-160m-l4.csv.gz'}:16GiB",
    f"{DATA / 'landscape_llama-1b-a10g.csv.gz'}:22GiB",
)


@dataclass
class World:
    """What a simulated search runs on: a space, a ceiling, an evaluator per worker, and the truth."""

    name: str
    space: SearchSpace
    ceiling_bytes: int
    true_samples_per_s: float
    make_evaluator: Callable[[WorkerClock, dict[str, Any]], Evaluator]  # one per worker (clock view, the run's shared state)
    noise_free: Callable[[TrialParams], float]  # samples/s; 0 unless it runs and fits under the ceiling
    baseline: TrialParams | None = None


def family_world(draw: int, space: SearchSpace | None = None) -> World:
    """Draw ``draw`` of bench/family.py over ``space`` (default: the built-in ``default`` space); a
    run's evaluators share one repeat count per configuration."""
    from bench.family import OK, FamilyEvaluator, Landscape

    landscape = Landscape(draw, space)
    _, true_sps = landscape.true_best()
    def noise_free(params: TrialParams) -> float:
        out = landscape.noise_free(params)
        fits = int(out.status[0]) == OK and out.peak_bytes[0] <= landscape.ceiling_bytes
        return float(out.samples_per_s[0]) if fits else 0.0

    def make_evaluator(view: WorkerClock, run: dict[str, Any]) -> Evaluator:
        repeats = run.setdefault("repeats", {})  # how often each configuration was probed, in this run
        evaluator = FamilyEvaluator(landscape, clock=view, _repeats=repeats)  # type: ignore[arg-type]
        return _Locked(evaluator, run.setdefault("lock", threading.Lock()), view)

    default = landscape.space.baseline()
    return World(f"draw {draw}", landscape.space, landscape.ceiling_bytes, true_sps, make_evaluator, noise_free,
                 default if landscape.space.contains(default) else None)


def table_world(spec: str) -> World:
    """A replay table TABLE[:CEILING] (default ceiling 40GiB)."""
    from autotune.search.replay import ReplayEvaluator, load_table

    path, _, ceiling_text = spec.partition(":")
    ceiling = (int(ceiling_text) if ceiling_text.isdigit() else parse_bytes(ceiling_text or "40GiB"))  # TABLE:BYTES, or a size
    table = load_table(path)
    space = table.space()
    best = table.best_under(ceiling)
    if best is None:
        raise SystemExit(f"{path}: nothing fits under the ceiling")
    def noise_free(params: TrialParams) -> float:
        row = table.row(params)
        if row is None or row["status"] != "ok" or not row["peak_mem_bytes"] <= ceiling:
            return 0.0
        return float(row["samples_per_s"])

    def make_evaluator(view: WorkerClock, run: dict[str, Any]) -> Evaluator:
        return _Locked(ReplayEvaluator(table, clock=view), run.setdefault("lock", threading.Lock()), view)  # type: ignore[arg-type]

    default = space.baseline()
    return World(table.name, space, ceiling, float(best["samples_per_s"]), make_evaluator, noise_free,
                 default if space.contains(default) else None)


@dataclass
class _Locked:
    """An evaluator whose outcome is computed under a lock shared by the workers (the family keeps a
    repeat count per configuration), and whose charge to the clock is made outside it."""

    inner: Any
    lock: threading.Lock
    view: WorkerClock
    stop: threading.Event = field(default_factory=threading.Event)

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> Any:
        if self.stop.is_set():
            raise KeyboardInterrupt  # the target was reached: nothing after it counts
        charged: list[float] = []
        self.inner.clock = _Meter(charged)
        with self.lock:
            result = self.inner.evaluate(params, timeout_s=timeout_s)
        self.view.advance(sum(charged))
        if self.stop.is_set():
            raise KeyboardInterrupt
        return result


@dataclass
class _Meter:
    """Stands in for the evaluator's clock while it computes an outcome: notes what it charges."""

    charged: list[float]

    def advance(self, seconds: float) -> None:
        self.charged.append(seconds)

    def now(self) -> float:
        return 0.0


@dataclass
class Run:
    """One simulated search with N workers."""

    world: str
    n_workers: int
    seed: int
    time_to_target_s: float | None  # None: never within the budget
    final_ratio: float
    virtual_s: float  # when the last worker finished
    probes: int
    remeasures: int
    held: int
    repeats: int
    pruned: int
    duplicate_probes: int  # configurations probed again, deliberate re-measures excepted
    unfinished_trials: int  # RUNNING or WAITING when every worker had returned
    interrupted_trials: int
    stopped: list[str]
    errors: list[str]
    cpu_s: float


def simulate(world: World, n_workers: int, *, budget_s: float, strategy: str = DEFAULT_STRATEGY, seed: int = 0,
             serial: bool = True, full: bool = False, storage: str = "memory", min_probe_s: float = 1.0) -> Run:
    """N worker threads on one study and one shared virtual clock; see the module docstring."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started_cpu_s = time.process_time()
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        if storage == "journal":
            backend = optuna.storages.journal.JournalFileBackend(str(Path(tmp) / "study.log"))
            shared_storage: optuna.storages.BaseStorage = optuna.storages.JournalStorage(backend)
        else:
            shared_storage = optuna.storages.InMemoryStorage()
        name = "bench-workers"
        optuna.create_study(study_name=name, storage=shared_storage, direction="maximize")
        clock = SharedVirtualClock(n_workers, serial=serial)
        stop = threading.Event()
        check = threading.Lock()
        reached: list[float] = []
        outcomes: list[SearchOutcome | None] = [None] * n_workers
        errors: list[str] = []
        shared: dict[str, Any] = {"repeats": {}, "lock": threading.Lock()}  # the evaluators' state in this run

        def on_trial(study: optuna.Study, record: TrialRecord) -> None:
            """Right after a probe's outcome is stored: is the study's best within the target?"""
            with check:
                if reached:
                    return
                ranked = rank_configurations(reading.stored_probes(study), world.ceiling_bytes)
                if ranked and world.noise_free(ranked[0].params) >= TARGET * world.true_samples_per_s:
                    reached.append(clock.now())
                    if not full:
                        stop.set()

        def work(worker: int) -> None:
            view = clock.view(worker)
            try:
                clock.start(worker)
                study = optuna.load_study(study_name=name, storage=shared_storage)
                evaluator = world.make_evaluator(view, shared)
                evaluator.stop = stop  # type: ignore[attr-defined]
                settings = SearchSettings(
                    memory_ceiling_bytes=world.ceiling_bytes, budget_s=budget_s, seed=seed * 1000 + worker, min_probe_s=min_probe_s,
                    heartbeat_interval_s=HEARTBEAT_INTERVAL_S, heartbeat_grace_s=HEARTBEAT_GRACE_S, claim_settle_s=CLAIM_SETTLE_S,
                )
                outcomes[worker] = run_search(
                    study, world.space, evaluator, settings, baseline=world.baseline, clock=view, started_s=0.0,
                    strategy=make_strategy(strategy), on_trial=lambda record: on_trial(study, record),
                )
            except BaseException:  # noqa: BLE001 - reported, and the others go on
                errors.append(f"worker {worker}: {traceback.format_exc()}")
            finally:
                clock.done(worker)

        threads = [threading.Thread(target=work, args=(w,), name=f"bench-worker-{w}", daemon=True) for w in range(n_workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        study = optuna.load_study(study_name=name, storage=shared_storage)
        trials = study.get_trials()
        probes = reading.stored_probes(study)
        ranked = rank_configurations(probes, world.ceiling_bytes)
        final = world.noise_free(ranked[0].params) / world.true_samples_per_s if ranked else 0.0
        done = [o for o in outcomes if o is not None]
        return Run(
            world=world.name, n_workers=n_workers, seed=seed,
            time_to_target_s=reached[0] if reached else None, final_ratio=round(final, 4), virtual_s=clock.now(),
            probes=len(probes), remeasures=sum(o.remeasures for o in done), held=sum(o.held for o in done),
            repeats=sum(o.duplicates for o in done), pruned=sum(o.pruned for o in done),
            duplicate_probes=duplicate_probes(trials),
            unfinished_trials=sum(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials),
            interrupted_trials=sum(t.user_attrs.get(schema.ATTR_REASON) == "interrupted by the user" for t in trials),
            stopped=sorted(o.stopped_because for o in done), errors=errors, cpu_s=round(time.process_time() - started_cpu_s, 2),
        )


def duplicate_probes(trials: list[optuna.trial.FrozenTrial]) -> int:
    """Probes of a configuration beyond its first, deliberate re-measures excepted (but a (configuration,
    round) re-measured twice counts): what a correct multi-worker search never does."""
    ran = [t for t in trials if schema.ATTR_RESULT in t.user_attrs and schema.ATTR_DUPLICATE_OF not in t.user_attrs]
    exploring = collections.Counter(reading.config_key(t) for t in ran if schema.ATTR_REMEASURE_OF not in t.user_attrs)
    rounds = collections.Counter(
        (t.user_attrs[schema.ATTR_REMEASURE_OF], t.user_attrs.get(schema.ATTR_REMEASURE_ROUND)) for t in ran if schema.ATTR_REMEASURE_OF in t.user_attrs
    )
    return sum(n - 1 for n in exploring.values()) + sum(n - 1 for n in rounds.values())


# ---------------------------------------------------------------------- the benchmark


def _task(task: tuple[str, Any, int, int, float, str, bool, bool, str]) -> dict[str, Any]:
    kind, what, n_workers, seed, budget_s, strategy, serial, full, storage = task
    world = _world(kind, what)
    run = simulate(world, n_workers, budget_s=budget_s, strategy=strategy, seed=seed, serial=serial, full=full, storage=storage)
    return run.__dict__


_WORLDS: dict[tuple[str, Any], World] = {}


def _world(kind: str, what: Any) -> World:
    if (kind, what) not in _WORLDS:
        _WORLDS.clear()  # tasks come ordered by world: one (and its grid) at a time
        _WORLDS[(kind, what)] = family_world(what) if kind == "family" else table_world(what)
    return _WORLDS[(kind, what)]


def summary(rows: list[dict[str, Any]], budget_s: float) -> dict[str, dict[str, Any]]:
    """Per N: median and 75th percentile time to target (a search that never reached it counts as
    never: infinite), speed-up of the medians versus the smallest N, and the checks."""
    by_n: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        by_n[row["n_workers"]].append(row)
    out: dict[str, dict[str, Any]] = {}
    base: float | None = None
    base_times: dict[tuple[str, int], float] = {}
    for n in sorted(by_n):
        mine = by_n[n]
        times = np.array([math.inf if r["time_to_target_s"] is None else r["time_to_target_s"] for r in mine])
        median, p75 = _percentile(times, 50), _percentile(times, 75)
        if base is None:
            base = median
            base_times = {(r["world"], r["seed"]): t for r, t in zip(mine, times)}
        pairs = [(base_times.get((r["world"], r["seed"]), math.inf), t) for r, t in zip(mine, times)]
        per_world = [t1 / t for t1, t in pairs if math.isfinite(t1) and math.isfinite(t) and t > 0]
        out[str(n)] = {
            "searches": len(mine),
            "median_time_to_target_min": _minutes(median),
            "p75_time_to_target_min": _minutes(p75),
            "speedup_median": round(base / median, 2) if math.isfinite(base) and math.isfinite(median) and median > 0 else None,
            "speedup_per_landscape_median": round(statistics.median(per_world), 2) if per_world else None,
            "never_reached": int(np.isinf(times).sum()),
            "duplicate_probes": int(sum(r["duplicate_probes"] for r in mine)),
            "unfinished_trials": int(sum(r["unfinished_trials"] for r in mine)),
            "errors": int(sum(len(r["errors"]) for r in mine)),
            "probes_mean": round(statistics.fmean(r["probes"] for r in mine), 1),
            "held_mean": round(statistics.fmean(r["held"] for r in mine), 2),
            "final_ratio_median": round(statistics.median(r["final_ratio"] for r in mine), 4),
            "cpu_s_per_search": round(statistics.fmean(r["cpu_s"] for r in mine), 2),
        }
    return out


def _percentile(values: np.ndarray, q: float) -> float:
    """The q-th percentile, nearest-rank on the sorted values (so an infinite 'never' stays infinite)."""
    ordered = np.sort(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def _minutes(seconds: float) -> float | None:
    return round(seconds / 60, 2) if math.isfinite(seconds) else None


def print_summary(figures: dict[str, dict[str, Any]], what: str, budget_s: float) -> None:
    print(f"{what}: time to {TARGET:.2f} of the optimum, {budget_s / 60:g} virtual minutes per search")
    header = (f"{'workers':>7} {'searches':>8} {'median min':>10} {'p75 min':>8} {'speed-up':>8} {'per-land':>8} {'never':>6} "
              f"{'dup probes':>10} {'unfinished':>10} {'probes/run':>10} {'held/run':>8} {'cpu s/run':>9}")
    print(header)
    print("-" * len(header))
    for n, f in figures.items():
        def show(value: float | None, width: int) -> str:
            return f"{value:>{width}.2f}" if value is not None else f"{'never':>{width}}"

        print(f"{n:>7} {f['searches']:>8} {show(f['median_time_to_target_min'], 10)} {show(f['p75_time_to_target_min'], 8)} "
              f"{show(f['speedup_median'], 8)} {show(f['speedup_per_landscape_median'], 8)} {f['never_reached']:>6} "
              f"{f['duplicate_probes']:>10} {f['unfinished_trials']:>10} {f['probes_mean']:>10.1f} {f['held_mean']:>8.2f} {f['cpu_s_per_search']:>9.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-workers", description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=50, help="family design draws 0..N-1 (default 50)")
    parser.add_argument("--first-draw", type=int, default=0)
    parser.add_argument("--tables", nargs="*", default=None, help="replay tables TABLE[:CEILING] instead of the family (none named: the shipped ones)")
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--budget", default="120m")
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY)
    parser.add_argument("--seeds", type=int, default=1, help="searches per landscape (seeds 0..N-1; tables only, a draw's seed is its index)")
    parser.add_argument("--concurrent", action="store_true", help="let every due worker decide at once (default: one at a time, reproducible)")
    parser.add_argument("--full", action="store_true", help="run every search to its budget instead of stopping at the target")
    parser.add_argument("--storage", choices=("memory", "journal"), default="memory")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--details", default=None, help="write one CSV row per search here")
    args = parser.parse_args(argv)
    budget_s = parse_duration_s(args.budget)
    counts = [int(n) for n in args.workers.split(",")]
    if args.tables is not None:
        specs = args.tables or list(DEFAULT_TABLES)
        worlds = [("table", spec, seed) for spec in specs for seed in range(args.seeds)]
        what = f"{len(specs)} replay table(s) x {args.seeds} seed(s)"
    else:
        worlds = [("family", args.first_draw + i, i) for i in range(args.draws)]
        last = args.first_draw + args.draws - 1
        what = f"family {'design ' if last < DESIGN_DRAWS else ''}draws {args.first_draw}-{last}"
    tasks = [(kind, item, n, seed, budget_s, args.strategy, not args.concurrent, args.full, args.storage) for kind, item, seed in worlds for n in counts]
    started = time.monotonic()
    if args.processes <= 1:
        rows = [_task(t) for t in tasks]
    else:
        with multiprocessing.get_context("fork").Pool(args.processes) as pool:
            rows = list(pool.imap(_task, tasks, chunksize=len(counts)))
    elapsed_s = time.monotonic() - started
    for row in rows:
        if row["errors"]:
            print(f"{row['world']} with {row['n_workers']} workers: {row['errors'][0]}", file=sys.stderr)
    if args.details:
        with open(args.details, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    figures = summary(rows, budget_s)
    print_summary(figures, what, budget_s)
    print(f"runtime {elapsed_s:.0f} s with {args.processes} process(es), strategy {args.strategy}, "
          f"{'concurrent' if args.concurrent else 'serial'} deciding, {'full budget' if args.full else 'stopping at the target'}")
    print(json.dumps({
        "what": what, "budget_s": budget_s, "target": TARGET, "strategy": args.strategy, "serial": not args.concurrent, "full": args.full,
        "storage": args.storage, "runtime_s": round(elapsed_s), "workers": figures,
    }, sort_keys=True))
    failed = any(row["errors"] or row["duplicate_probes"] or row["unfinished_trials"] for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
