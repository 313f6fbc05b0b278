"""Benchmark the search strategies on replay tables or on a family of landscapes: how close to the true optimum, at what cost.

    python -m bench.search                                   # the shipped synthetic tables, 20 seeds
    python -m bench.search TABLE.csv.gz:40GiB --seeds 5 --strategies bayes,tpe
    autotune bench-search ...                                 # the same
    python -m bench.search --family design --draws 200 --budgets 10m,30m,60m   # the family (bench/family.py)
    python -m bench.search --family heldout --draws 200 --budgets 10m,30m,60m  # only once the design is frozen
    python -m bench.search --family heldout2 --draws 200 --budgets 10m,30m,60m # a second, fresh held-out range
    python -m bench.search --family heldout3 --draws 200 --budgets 10m,30m,60m # a third, untouched until round 6 was frozen
    python -m bench.search --family heldout4 --draws 200 --budgets 10m,30m,60m # a fourth, run once after round 8 was frozen
    python -m bench.search --family heldout5 --draws 200 --budgets 10m,30m,60m # a fifth, run once on round 8's strategy (2026-11-23)
    python -m bench.search --family heldout6 --draws 200 --budgets 10m,30m,60m # a sixth, run once on round 11's strategy
    python -m bench.search --family heldout7 --draws 200 --budgets 10m,30m,60m # a seventh, run once on round 13's strategy
    python -m bench.search --family heldout8 --draws 200 --budgets 10m,30m,60m # an eighth, run once on round 14's strategy
    python -m bench.search --family heldout9 --draws 200 --budgets 10m,30m,60m # a ninth, run once on round 16's strategy
    python -m bench.search --family heldout10 --draws 200 --budgets 10m,30m,60m # a tenth, run once on round 16's strategy (round 17)
    python -m bench.search --family heldout11 --draws 200 --budgets 10m,30m,60m # an eleventh, run once on round 17's strategy
    python -m bench.search --family heldout12 --draws 200 --budgets 10m,30m,60m # a twelfth, run once on round 18's strategy
    python -m bench.search --family heldout15 --draws 200 --budgets 10m,30m,60m # a fifteenth, run once on round 22's strategy
    python -m bench.search --family heldout16 --draws 200 --budgets 10m,30m,60m # a sixteenth, run once on round 22's final strategy (V25)
    python -m bench.search --family heldout17 --draws 200 --budgets 30m       # a seventeenth, run once on round 22's final strategy (a second check)
    python -m bench.search --family heldout18 --draws 200 --budgets 10m,30m,60m # an eighteenth: design data since #44 was filed
    python -m bench.search --family heldout19 --draws 200 --budgets 30m --strategies bayes,tpe --processes 1 # #44's held-out range (family version 2), run once
    python -m bench.search --family design --draws 400 --budgets 30m --strategies bayes --details after.csv
    python -m bench.search --compare before.csv after.csv    # paired, draw by draw, with the 5th percentile's bootstrap interval
    python -m bench.search --family design --draws 400 --budgets 30m --strategies bayes --noise-stream 1  # the same, other probe noise
    python -m bench.search --family heldout6 --gpu-seeds 20     # the GPU-recorded tables with 20 seeds (default 5; 0: none)
    python -m bench.search --family gen2-heldout --draws 200 --budgets 30m --strategies bayes,tpe,random --processes 1 --gpu-seeds 0
                                                             # the second generator (bench/landscapes2.py): held out only

Ranges: ``design`` = draws from 0 (design on these only: rounds 1-3 of #14 used 0-199, rounds 4-7 0-399), ``heldout`` = draws 100000-100199 (seen
once with ``bayes``, after its first design), ``heldout2`` = draws 200000-200199 (added before the
second design round and run only once it was frozen), ``heldout3`` = draws 300000-300199 (kept
untouched through design rounds 3-6, run once the sixth was frozen), ``heldout4`` = draws
400000-400199 (defined before design round 8, run once after it was frozen), ``heldout5`` = draws
500000-500199 (defined after round 8, run once on round 8's strategy, unchanged, to see how far two
ranges differ), ``heldout6`` = draws 600000-600199 (defined then, run once on round 11's strategy), ``heldout7`` =
draws 700000-700199 (defined after round 11, run once on round 13's strategy), ``heldout8`` = draws
800000-800199 (defined after round 13, run once on round 14's strategy), ``heldout9`` = draws
900000-900199 (defined after round 14, run once on round 16's strategy), ``heldout10`` = draws
1000000-1000199 (defined after round 16, run once on round 16's strategy in round 17), ``heldout11`` =
draws 1100000-1100199 (defined after round 16's strategy was run on heldout10, run once on round 17's
strategy), ``heldout12`` = draws 1200000-1200199 (defined after round 17, run once on round 18's strategy),
``heldout13`` = draws 1300000-1300199 (run once after round 19); ``heldout14`` = draws 1400000-1400199 (run once after round 20); ``heldout15`` = draws 1500000-1500199
(defined after round 20, run once after round 22); ``heldout16`` = draws 1600000-1600199 (defined in round 22, run once on its final strategy);
``heldout17`` = draws 1700000-1700199 (run once on it too, a second check); ``heldout18`` = draws
1800000-1800199 (run once when #44 was filed: design data since); ``heldout19`` = draws 1900000-1900199
(defined with family version 2 for #44, untouched until its final code); ``heldout20`` = draws
2000000-2000199 (defined for the simplified ``bayes`` package, run once on its final code). Each range is drawn by the
generator of its time (``bench.family.FAMILY_VERSION``, part of every draw's seed: version 2 redrew them
all); ``heldout2`` to ``heldout20`` are defined here
(``heldoutN`` starts at draw N x 100,000), not in ``bench.family``.

Family mode runs one search per strategy, draw and budget (separate searches, seed = the draw's
index in its range), two processes by default, and prints per strategy and budget the median, 5th
percentile and worst ratio of the found configuration's noise-free samples/s to the landscape's
noise-free optimum under its ceiling (with a 90 % bootstrap interval of the 5th percentile over
the draws: it rests on the dozen worst), the OOM probes launched, and the configurations returned
over the ceiling; and where the loss lies: ``measured p5``, the 5th percentile had each search
returned the best configuration it measured (noise-free; the ``measured_ratio`` column of
``--details``), and ``<0.95 measured``, the draws below 0.95 whose search had measured one at 0.95
or more (the pick among noisy measurements lost it, not exploring). ``--details FILE.csv`` keeps one row per search. ``--noise-stream N`` redraws
every probe's noise (an independent repeat of the same searches: what chance alone moves);
``--compare BEFORE.csv AFTER.csv`` pairs two ``--details`` files draw by draw
(:func:`compare_details`) and runs no search. After the family's figures, family mode replays every
table recorded on a GPU under ``reports/gpu/`` (:func:`gpu_tables`, at its recorded probe ceiling)
with each strategy at each budget, ``--gpu-seeds`` seeds (default 5), each table on its own line.

Every strategy runs over every seed on every table (TABLE[:CEILING], default ceiling 40GiB) with a
virtual budget (default 30 minutes). Per table and strategy it prints the median and worst ratio of
the found best's samples/s to the table's true best under the ceiling, the median virtual time as
a fraction of the whole grid's probe time, the OOM probes launched (total and median per run),
configurations pruned without running, near-ties re-measured (median per run), and whether any returned configuration exceeds the
ceiling. The last line is one JSON object with those figures.
"""

from __future__ import annotations

import os

# One BLAS thread per process: the family runs one process per core, and OpenBLAS threads spinning
# against each other there turned a 100 x 100 matrix inverse from 0.3 ms into 100 ms.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from autotune.search.replay import load_table, replay_search  # noqa: E402
from autotune.units import format_bytes, parse_bytes, parse_duration_s  # noqa: E402
from bench.table_expert import table_expert  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
DEFAULT_TABLES = (
    f"{DATA / 'landscape_gptneox-1.3b-a100.csv.gz'}:40GiB",
    f"{DATA / 'landscape_pythia-160m-l4.csv.gz'}:16GiB",
    f"{DATA / 'landscape_llama-1b-a10g.csv.gz'}:22GiB",
)
STRATEGY_NAMES = ("bayes", "tpe", "random")
GPU_REPORTS = Path(__file__).resolve().parent.parent / "reports" / "gpu"
GPU_SEEDS = 5  # family mode: seeds per GPU-recorded table and budget
# Further held-out ranges: heldoutN starts at draw N x bench.family.RANGE_SPAN (heldout, from
# bench.family, is the first). Each was added when the one before it had been seen, and is run once a
# design is frozen.
LAST_HELDOUT = 39  # heldout19 (1900000-...): defined for #44 (family version 2), run once on its final code; heldout20: for the simplified package (2026-11-27); heldout21: spent on 2026-11-28 (the strategy with the median out-of-memory step); heldout22: spent on 2026-11-28 (the replays told the parameter count, paired with and without); heldout23: spent on 2026-11-28 (the loader learnt from throughput, run once); heldout24: spent on 2026-11-28 (one loader model, run once, with the day's first strategy for the before/after); heldout25: spent on 2026-11-28 (the memory model's scale and OOM bounds, run once, with 3cb706e for the before/after); heldout26: spent on 2026-11-28 (accumulation polished both ways, run once, with 021240d for the before/after); heldout27: spent on 2026-11-28 (questions wait for the polishing probes, run once, with 7dbc0a7 for the before/after); heldout28: spent on 2026-11-28 (e400d1b's figures, run once, with 7dbc0a7 for the before/after); heldout29: spent on 2026-11-28 (2125cff's figures, run once, with 69606a6 for the before/after); heldout30: spent on 2026-11-28 (92d525d's figures, run once, with 8377477 for the before/after); heldout31: spent on 2026-11-29 (2f9f5dc's figures, run once, with 69e21f2 for the before/after), traced after (design data); heldout32: spent on 2026-11-29 (5c3683a's figures, run once, with a56cab2 for the before/after); heldout33: spent on 2026-11-29 (d913c08's figures, which for this family, without a host, are 88d0977's; run once); heldout34: spent on 2026-11-29 (632316b's figures, for this family 88d0977's strategy; run once); heldout35: spent on 2026-12-01 (a130f71's figures, run once); heldout36: spent on 2026-12-02 (a7a9f75's figures, run once, with e726a04 for the before/after); heldout37: spent on 2026-12-02 (25c6bee's figures, run once; no before/after: time); heldout38: spent on 2026-12-07 (5d7ac0a's figures, run once, with 4e7a530 for the before/after); heldout39: the next comparison (defined before any run)
LOW_RATIO = 0.95  # #14's target for the 5th percentile: draws below it are counted ("<0.95")
CHANGED = 0.005  # --compare: a draw whose ratio moved more than this changed
BOOTSTRAP_RESAMPLES = 2000


def _budget_label(budget_s: float) -> str:
    """A budget as the summaries key it: ``1800.0`` -> ``"30m"``."""
    return f"{budget_s / 60:g}m"


def noise_stream_problem(stream: int) -> str | None:
    """What is wrong with ``--noise-stream stream`` (``None``: nothing); bench.trace takes the same."""
    return None if stream >= 0 else "--noise-stream takes 0 (the family's own noise) or a positive number"


def family_ranges() -> dict[str, int]:
    """``{range name: first draw}``: ``design``, ``heldout`` (from bench.family), ``heldout2`` to ``heldout20``,
    and the second generator's held-out ranges (``gen2-heldout``, ... from bench.landscapes2)."""
    from bench.family import RANGE_SPAN, RANGES
    from bench.landscapes2 import RANGES as GEN2_RANGES

    return {**RANGES, **{f"heldout{n}": n * RANGE_SPAN for n in range(2, LAST_HELDOUT + 1)}, **GEN2_RANGES}


def gpu_tables(root: Path = GPU_REPORTS) -> list[str]:
    """``TABLE:CEILING`` for every replay table recorded on a GPU under ``root`` (the acceptance
    run's ``landscape_*.csv.gz``), at the probe ceiling its phase recorded in ``landscape.json``
    beside it; sorted by path. A table without that ceiling is left out."""
    specs = []
    for path in sorted(root.glob("*/landscape_*.csv.gz")):
        try:
            ceiling = json.loads((path.parent / "landscape.json").read_text(encoding="utf-8"))["data"]["ceiling_bytes"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(ceiling, int) and ceiling > 0:
            specs.append(f"{path}:{ceiling}")
    return specs


def _map(function: Any, tasks: list[Any], processes: int, chunksize: int = 1) -> list[Any]:
    """``function`` over ``tasks`` in order: in this process, or in ``processes`` forked ones."""
    if processes <= 1:
        return [function(t) for t in tasks]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return list(pool.imap(function, tasks, chunksize=chunksize))


_TABLES: dict[str, Any] = {}


def _table(path: str) -> Any:
    """A replay table, read once per process (forked workers inherit the parent's)."""
    if path not in _TABLES:
        _TABLES[path] = load_table(path)
    return _TABLES[path]


def _table_task(task: tuple[str, int, float, str, int]) -> Any:
    path, ceiling, budget_s, strategy, seed = task
    table = _table(path)
    return replay_search(table, budget_s=budget_s, memory_ceiling_bytes=ceiling, strategy=strategy, seed=seed,
                         expert=table_expert(table, ceiling))


def bench(tables: list[str], strategies: list[str], seeds: int, budget_s: float, processes: int = 1) -> dict[str, Any]:
    """Run every strategy x seed x table (``processes`` at a time); returns ``{table: {strategy: figures}}``."""
    summary: dict[str, Any] = {}
    tasks, specs = [], []
    for spec in tables:
        path, _, ceiling_text = spec.partition(":")
        ceiling = (int(ceiling_text) if ceiling_text.isdigit() else parse_bytes(ceiling_text or "40GiB"))  # TABLE:BYTES, or a size
        table = _table(path)
        true_best = table.best_under(ceiling)
        if true_best is None:
            raise SystemExit(f"{path}: no configuration fits under {format_bytes(ceiling)}")
        row = table.row(table_expert(table, ceiling))
        expert_sps = float(row["samples_per_s"]) if row is not None and row["status"] == "ok" and row["peak_mem_bytes"] <= ceiling else 0.0
        specs.append((table, ceiling, float(true_best["samples_per_s"]), float(table.frame["probe_s"].sum()), expert_sps))
        tasks += [(path, ceiling, budget_s, strategy, seed) for strategy in strategies for seed in range(seeds)]
    runs = iter(_map(_table_task, tasks, processes))
    for table, ceiling, true_best_sps, grid_s, expert_sps in specs:
        summary[table.name] = {"ceiling_bytes": ceiling, "true_best_samples_per_s": true_best_sps, "expert_ratio": round(expert_sps / true_best_sps, 4)}
        for strategy in strategies:
            ratios, fractions, ooms, pruned, remeasures, over, below = [], [], [], [], [], 0, 0
            for _ in range(seeds):
                outcome = next(runs)
                ratios.append((outcome.best_samples_per_s or 0.0) / true_best_sps)
                fractions.append(outcome.virtual_s / grid_s)
                ooms.append(outcome.oom_probes)
                pruned.append(outcome.pruned)
                remeasures.append(outcome.remeasures)
                over += int(outcome.best_peak_mem_bytes is not None and outcome.best_peak_mem_bytes > ceiling)
                below += int((outcome.best_samples_per_s or 0.0) < expert_sps)
            summary[table.name][strategy] = {
                "median_ratio": round(statistics.median(ratios), 4),
                "worst_ratio": round(min(ratios), 4),
                "median_time_fraction": statistics.median(fractions),
                "oom_probes_total": sum(ooms),
                "oom_probes_median": statistics.median(ooms),
                "pruned_median": statistics.median(pruned),
                "remeasures_median": statistics.median(remeasures),
                "returned_over_ceiling": over,
                "below_expert": below,
                "seeds": seeds,
            }
    return summary


def print_table(summary: dict[str, Any], budget_s: float) -> None:
    print(f"budget {budget_s / 60:.0f} virtual minutes per run")
    header = f"{'table':<28} {'strategy':<9} {'median':>7} {'worst':>7} {'time/grid':>10} {'OOMs':>6} {'OOM/run':>8} {'pruned/run':>11} {'re-meas/run':>12} {'over ceiling':>13} {'<expert':>8}"
    print(header)
    print("-" * len(header))
    for table, figures in summary.items():
        for strategy, f in figures.items():
            if not isinstance(f, dict):
                continue
            print(
                f"{table:<28} {strategy:<9} {f['median_ratio']:>7.3f} {f['worst_ratio']:>7.3f} "
                f"{f['median_time_fraction']:>10.5%} {f['oom_probes_total']:>6} {f['oom_probes_median']:>8} "
                f"{f['pruned_median']:>11} {f['remeasures_median']:>12} {f['returned_over_ceiling']:>13} {f['below_expert']:>8}"
            )


# ---------------------------------------------------------------------- the family


def family_search(strategy: Any, draw: int, budget_s: float, seed: int, log: list[Any] | None = None, evaluator: Any = None,
                  noise_stream: int = 0) -> dict[str, Any]:
    """One search on one drawn landscape; the found configuration scored noise-free.

    ``strategy`` is a name, or a strategy instance (``bench.trace`` passes one that records its
    model); ``log``, if given, receives ``(virtual start s, configuration, result)`` per probe;
    ``evaluator`` replaces the draw's :class:`~bench.family.FamilyEvaluator` (one over the same
    landscape, :func:`_landscape`); ``noise_stream`` redraws the probes' noise (0: the family's own)."""
    import optuna

    from autotune.search.loop import SearchSettings, ranked_configurations, run_search
    from autotune.search.strategies.registry import make_strategy
    from bench.family import FamilyEvaluator

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    landscape = _landscape(draw)
    true_params, true_sps = landscape.true_best()
    expert = expert_of(landscape)
    expert_out = landscape.noise_free(expert)
    expert_ratio = float(expert_out.samples_per_s[0]) / true_sps if landscape.fits(expert_out)[0] else 0.0
    if evaluator is None:
        evaluator = FamilyEvaluator(landscape, log=log, noise_stream=noise_stream)
    chosen = make_strategy(strategy) if isinstance(strategy, str) else strategy
    study = optuna.create_study(direction="maximize", sampler=chosen.sampler(seed))
    settings = SearchSettings(memory_ceiling_bytes=landscape.ceiling_bytes, budget_s=budget_s, seed=seed, min_probe_s=1.0)
    started = time.process_time()
    outcome = run_search(study, landscape.space, evaluator, settings, baseline=landscape.space.baseline(), expert=expert,
                         clock=evaluator.clock, strategy=chosen)
    cpu_s = time.process_time() - started
    ranked = ranked_configurations(study, landscape.ceiling_bytes)
    row: dict[str, Any] = {
        "strategy": chosen.name, "draw": draw, "budget_s": budget_s, "seed": seed, "ratio": 0.0, "over_ceiling": 0,
        "oom_probes": evaluator.oom_probes, "probes": outcome.probes_run, "pruned": outcome.pruned,
        "virtual_s": evaluator.clock.now(), "cpu_s": round(cpu_s, 3), "found": "", "true_best": true_params.short(),
        "measured_ratio": 0.0, "expert_ratio": expert_ratio, "below_expert": 0,
    }
    # Each configuration the search ranked, noise-free; the best of those that fit is what a pick free
    # of noise would have returned (no less than the found ratio wherever the found one fits).
    scored = [landscape.noise_free(configuration.params) for configuration in ranked]
    row["measured_ratio"] = max((float(o.samples_per_s[0]) / true_sps for o in scored if landscape.fits(o)[0]), default=0.0)
    if ranked:
        found = scored[0]
        row["ratio"] = float(found.samples_per_s[0]) / true_sps
        row["over_ceiling"] = int(not landscape.fits(found)[0])
        row["found"] = ranked[0].params.short()
    row["below_expert"] = int(row["ratio"] < expert_ratio)
    return row


def expert_of(landscape: Any) -> Any:
    """The expert rule's configuration on a drawn landscape (:func:`autotune.search.expert.expert_params`),
    its batch the largest whose noise-free peak fits: the landscape stands in for the analytic memory
    model a real run has (model dimensions), which a replay's own memory model lacks."""
    from autotune.search.expert import expert_params

    return expert_params(landscape.space, landscape.space.baseline(), landscape, landscape.ceiling_bytes)


_LANDSCAPES: dict[int, Any] = {}


def _landscape(draw: int) -> Any:
    from bench.family import Landscape

    if draw not in _LANDSCAPES:
        _LANDSCAPES.clear()  # tasks come ordered by draw: one landscape (and its grid) at a time
        _LANDSCAPES[draw] = Landscape(draw)
    return _LANDSCAPES[draw]


def _family_task(task: tuple[str, int, float, int, int]) -> dict[str, Any]:
    strategy, draw, budget_s, seed, noise_stream = task
    return family_search(strategy, draw, budget_s, seed, noise_stream=noise_stream)


def _gen2_task(task: tuple[str, int, float, int, int]) -> dict[str, Any]:
    from bench.landscapes2 import search_draw

    strategy, draw, budget_s, seed, noise_stream = task
    return search_draw(strategy, draw, budget_s, seed, noise_stream=noise_stream)


def bench_family(family: str, draws: int, strategies: list[str], budgets_s: list[float], processes: int, noise_stream: int = 0) -> list[dict[str, Any]]:
    """Every strategy x budget on ``draws`` landscapes of the range ``family`` (``design``, ``heldout``, ``heldout2`` to ``heldout20``;
    ``gen2-*``: the second generator, whose rows also score the expert rule's configuration)."""
    start = family_ranges()[family]
    tasks = [(strategy, start + i, budget_s, i, noise_stream) for i in range(draws) for strategy in strategies for budget_s in budgets_s]
    task = _gen2_task if family.startswith("gen2") else _family_task
    return _map(task, tasks, processes, chunksize=max(1, len(strategies) * len(budgets_s)))


def family_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{strategy: {budget: figures}}`` over the draws."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        for budget_s in sorted({r["budget_s"] for r in rows}):
            mine = [r for r in rows if r["strategy"] == strategy and r["budget_s"] == budget_s]
            ratios = np.array([r["ratio"] for r in mine])
            ooms = [r["oom_probes"] for r in mine]
            figures = _figures(ratios)
            # How far the 5th percentile rests on which draws came up: a bootstrap over them.
            p5_90 = np.percentile(_p5(ratios[_resamples(len(ratios), np.random.default_rng(0))]), [5, 95])
            summary.setdefault(strategy, {})[_budget_label(budget_s)] = {
                "draws": len(mine),
                "median_ratio": figures["median"],
                "p5_ratio": figures["p5"],
                "p5_ratio_90": [round(float(x), 4) for x in p5_90],
                "worst_ratio": figures["worst"],
                "below_095": figures["below_095"],
                # Where the loss lies: the 5th percentile had each search returned the best of what it
                # measured, and the draws below 0.95 that had measured a configuration at 0.95 or more.
                "measured_p5_ratio": round(float(_p5(np.array([r["measured_ratio"] for r in mine]))), 4),
                "below_095_measured": int(sum(r["ratio"] < LOW_RATIO <= r["measured_ratio"] for r in mine)),
                "oom_probes_total": int(sum(ooms)),
                "oom_probes_mean": round(statistics.fmean(ooms), 2),
                "returned_over_ceiling": int(sum(r["over_ceiling"] for r in mine)),
                "nothing_found": int(sum(not r["found"] for r in mine)),
                "probes_mean": round(statistics.fmean(r["probes"] for r in mine), 1),
                "cpu_s_per_search": round(statistics.fmean(r["cpu_s"] for r in mine), 3),
                # #44: the returned configuration below the expert rule's own (noise-free, where it runs and fits)
                "below_expert": int(sum(r.get("below_expert", 0) for r in mine)),
                "below_expert_fraction": round(statistics.fmean(r.get("below_expert", 0) for r in mine), 4),
                # the expert's own ratio where it runs under the ceiling (0.0 where it never does), and where it does not
                "expert_median_ratio": round(float(np.median([r["expert_ratio"] for r in mine if r.get("expert_ratio")] or [0.0])), 4),
                "expert_fails": int(sum(not r.get("expert_ratio") for r in mine)),
            }
            if "found_precision" in mine[0]:  # the second generator: against the expert rule's configuration
                figures = summary[strategy][_budget_label(budget_s)]
                figures["slower_than_expert"] = int(sum(r["ratio"] < r["expert_ratio"] * (1 - 1e-9) for r in mine))
                figures["slower_than_expert_by_2pct"] = int(sum(r["ratio"] < r["expert_ratio"] * 0.98 for r in mine))
                figures["fp32_or_tf32_returned"] = int(sum(r["found_precision"] in ("fp32", "tf32") for r in mine))
                # #44: a dimension no probe asked near the returned configuration, where a variant there runs and fits
                figures["unasked_runnable"] = int(sum(bool(r.get("unasked")) for r in mine))
    return summary


def _interval(bounds: list[float]) -> str:
    return f"[{bounds[0]:.3f}, {bounds[1]:.3f}]"


def print_family(summary: dict[str, dict[str, dict[str, Any]]], family: str, draws: int) -> None:
    print(f"family {family}: {draws} draws, one search per strategy, draw and budget")
    header = (f"{'strategy':<9} {'budget':>6} {'median':>7} {'p5':>7} {'p5 90% bootstrap':>17} {'worst':>7} {'<0.95':>6} {'OOMs':>6} {'OOM/run':>8} "
              f"{'over ceiling':>13} {'none found':>11} {'probes/run':>11} {'cpu s/run':>10} {'measured p5':>12} {'<0.95 measured':>15} "
              f"{'<expert':>8} {'expert median':>14} {'expert fails':>13}")
    print(header)
    print("-" * len(header))
    for strategy, budgets in summary.items():
        for budget, f in budgets.items():
            print(
                f"{strategy:<9} {budget:>6} {f['median_ratio']:>7.3f} {f['p5_ratio']:>7.3f} {_interval(f['p5_ratio_90']):>17} "
                f"{f['worst_ratio']:>7.3f} {f['below_095']:>6} "
                f"{f['oom_probes_total']:>6} {f['oom_probes_mean']:>8.2f} {f['returned_over_ceiling']:>13} {f['nothing_found']:>11} "
                f"{f['probes_mean']:>11.1f} {f['cpu_s_per_search']:>10.3f} {f['measured_p5_ratio']:>12.3f} {f['below_095_measured']:>15} "
                f"{f['below_expert_fraction']:>8.1%} {f['expert_median_ratio']:>14.3f} {f['expert_fails']:>13}"
            )


def print_expert(rows: list[dict[str, Any]], summary: dict[str, dict[str, dict[str, Any]]]) -> None:
    """The second generator: the expert rule's own figures, and how often each search returned less."""
    expert = np.array([r["expert_ratio"] for r in {r["draw"]: r for r in rows}.values()])
    f = _figures(expert)
    print(f"expert rule: median {f['median']:.3f}, p5 {f['p5']:.3f}, worst {f['worst']:.3f}, <0.95 {f['below_095']} of {len(expert)} draws")
    for strategy, budgets in summary.items():
        for budget, g in budgets.items():
            print(f"{strategy:<9} {budget:>6} slower than the expert rule's configuration: {g['slower_than_expert']} draws "
                  f"({g['slower_than_expert_by_2pct']} by more than 2 %); returned fp32/tf32: {g['fp32_or_tf32_returned']}; "
                  f"a dimension left unasked near it that runs there: {g['unasked_runnable']}")


def read_details(path: str) -> dict[tuple[str, float], dict[int, float]]:
    """A ``--details`` CSV (gzipped where its name ends in ``.gz``) as ``{(strategy, budget s): {draw: ratio}}``."""
    import gzip

    out: dict[tuple[str, float], dict[int, float]] = {}
    with (gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")) as handle:
        for row in csv.DictReader(handle):
            out.setdefault((row["strategy"], float(row["budget_s"])), {})[int(row["draw"])] = float(row["ratio"])
    return out


def compare_details(before: dict[tuple[str, float], dict[int, float]], after: dict[tuple[str, float], dict[int, float]],
                    seed: int = 0) -> dict[str, dict[str, dict[str, Any]]]:
    """Two runs on the same draws, paired draw by draw, per strategy and budget they share.

    The 5th percentile of a few hundred draws rests on its dozen worst, so any change to a strategy
    moves it by chance as well: a paired bootstrap over the draws (the same resample scored before
    and after) gives a 90 % interval of its change. Also: draws changed beyond :data:`CHANGED`, the
    sum of every draw's change, and each side's median, 5th percentile, worst and count below 0.95.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for key in [k for k in before if k in after]:
        draws = sorted(set(before[key]) & set(after[key]))
        if not draws:
            continue
        a = np.array([before[key][d] for d in draws])
        b = np.array([after[key][d] for d in draws])
        picks = _resamples(len(draws), rng)
        delta_p5 = _p5(b[picks]) - _p5(a[picks])
        moved = b - a
        out.setdefault(key[0], {})[_budget_label(key[1])] = {
            "draws": len(draws),
            "changed": int((np.abs(moved) > CHANGED).sum()),
            "sum_change": round(float(moved.sum()), 3),
            "before": _figures(a),
            "after": _figures(b),
            "p5_change": round(float(_p5(b) - _p5(a)), 4),
            "p5_change_90": [round(float(x), 4) for x in np.percentile(delta_p5, [5, 95])],
        }
    return out


def _figures(ratios: np.ndarray) -> dict[str, Any]:
    """Median, 5th percentile, worst and count below 0.95 of one run's ratios: #14's figures, for the
    family summary and both sides of a comparison."""
    return {"median": round(float(np.median(ratios)), 4), "p5": round(float(_p5(ratios)), 4),
            "worst": round(float(ratios.min()), 4), "below_095": int((ratios < LOW_RATIO).sum())}


def _p5(ratios: np.ndarray) -> np.ndarray:
    """The 5th percentile along the last axis (one per bootstrap resample, or one of a run)."""
    return np.percentile(ratios, 5, axis=-1)


def _resamples(draws: int, rng: np.random.Generator) -> np.ndarray:
    """:data:`BOOTSTRAP_RESAMPLES` resamples of ``draws`` indices, with replacement."""
    return rng.integers(0, draws, size=(BOOTSTRAP_RESAMPLES, draws))


def print_comparison(comparison: dict[str, dict[str, dict[str, Any]]]) -> None:
    header = f"{'strategy':<9} {'budget':>6} {'draws':>6} {'changed':>8} {'sum':>7}  {'median':>13} {'p5':>13} {'worst':>13} {'<0.95':>9}  p5 change (90% paired bootstrap)"
    print(header)
    print("-" * len(header))
    for strategy, budgets in comparison.items():
        for budget, f in budgets.items():
            x, y = f["before"], f["after"]
            low, high = f["p5_change_90"]
            print(f"{strategy:<9} {budget:>6} {f['draws']:>6} {f['changed']:>8} {f['sum_change']:>+7.2f}  {x['median']:.3f}->{y['median']:.3f} "
                  f"{x['p5']:.3f}->{y['p5']:.3f} {x['worst']:.3f}->{y['worst']:.3f} {x['below_095']:>4}->{y['below_095']:<4}  "
                  f"{f['p5_change']:+.3f} [{low:+.3f}, {high:+.3f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-search", description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="*", default=list(DEFAULT_TABLES), help="TABLE.csv[.gz][:CEILING] (default: the shipped synthetic tables)")
    parser.add_argument("--strategies", default=",".join(STRATEGY_NAMES), help="comma-separated (default: all)")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--budget", default="30m")
    parser.add_argument("--family", choices=tuple(family_ranges()), default=None, help="run on a family of drawn landscapes instead of tables")
    parser.add_argument("--draws", type=int, default=200, help="family mode: landscapes drawn from the range (default: 200)")
    parser.add_argument("--budgets", default="10m,30m,60m", help="family mode: comma-separated budgets, one search each")
    parser.add_argument("--processes", type=int, default=2, help="family mode: worker processes (default: 2)")
    parser.add_argument("--details", default=None, help="family mode: write one CSV row per search here")
    parser.add_argument("--noise-stream", type=int, default=0,
                        help="family mode: redraw the probes' noise (0: the family's own; another number: an independent draw of it)")
    parser.add_argument("--gpu-seeds", type=int, default=GPU_SEEDS,
                        help=f"family mode: seeds per GPU-recorded table under reports/gpu/ and budget, each table on its own line (default: {GPU_SEEDS}; 0: none)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE.csv", "AFTER.csv"), default=None,
                        help="compare two --details files of the same draws, paired (no search runs)")
    args = parser.parse_args(argv)
    problem = noise_stream_problem(args.noise_stream)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.gpu_seeds < 0:
        print("error: --gpu-seeds takes 0 (no GPU tables) or a positive number of seeds", file=sys.stderr)
        return 2
    if args.compare:
        try:
            before, after = (read_details(path) for path in args.compare)
        except (OSError, EOFError, KeyError, ValueError) as error:  # EOFError: a gzipped file cut short
            print(f"error: --compare needs two --details CSV files from bench.search --family: {error}", file=sys.stderr)
            return 2
        comparison = compare_details(before, after)
        if not comparison:
            print("error: the two files share no strategy, budget and draw: compare runs of the same --family range", file=sys.stderr)
            return 2
        print_comparison(comparison)
        print(json.dumps(comparison, sort_keys=True))
        return 0
    if args.family:
        started = time.monotonic()
        budgets_s = [parse_duration_s(b) for b in args.budgets.split(",")]
        rows = bench_family(args.family, args.draws, args.strategies.split(","), budgets_s, args.processes, args.noise_stream)
        elapsed_s = time.monotonic() - started
        if args.details:
            with open(args.details, "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        summary = family_summary(rows)
        print_family(summary, args.family, args.draws)
        if "found_precision" in rows[0]:  # the second generator's per-draw expert figures
            print_expert(rows, summary)
        print(f"runtime {elapsed_s:.0f} s with {args.processes} process(es)")
        gpu: dict[str, Any] = {}
        tables = gpu_tables() if args.gpu_seeds else []
        for budget_s in budgets_s if tables else []:  # the rule: a GPU-recorded table is reported, on its own line
            gpu[_budget_label(budget_s)] = bench(tables, args.strategies.split(","), args.gpu_seeds, budget_s, args.processes)
            print(f"GPU-recorded replay tables under reports/gpu/, {args.gpu_seeds} seeds each:")
            print_table(gpu[_budget_label(budget_s)], budget_s)
        print(json.dumps({"family": args.family, "draws": args.draws, "runtime_s": round(elapsed_s), "strategies": summary, "gpu_tables": gpu},
                         sort_keys=True))
        return 0
    budget_s = parse_duration_s(args.budget)
    summary = bench(args.tables, args.strategies.split(","), args.seeds, budget_s)
    print_table(summary, budget_s)
    print(json.dumps({"budget_s": budget_s, "tables": summary}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
