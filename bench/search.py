"""Benchmark the search strategies on replay tables: how close to the true optimum, at what cost.

    python -m bench.search                                   # the shipped synthetic tables, 20 seeds
    python -m bench.search TABLE.csv.gz:40GiB --seeds 5 --strategies frontier,tpe
    autotune bench-search ...                                 # the same

Every strategy runs over every seed on every table (TABLE[:CEILING], default ceiling 40GiB) with a
virtual budget (default 30 minutes). Per table and strategy it prints the median and worst ratio of
the found best's samples/s to the table's true best under the ceiling, the median virtual time as
a fraction of the whole grid's probe time, the OOM probes launched (total and median per run),
configurations pruned without running, near-ties re-measured (median per run), and whether any returned configuration exceeds the
ceiling. The last line is one JSON object with those figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from autotune.search.replay import load_table, replay_search
from autotune.units import format_bytes, parse_bytes, parse_duration_s

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
DEFAULT_TABLES = (
    f"{DATA / 'landscape_gptneox-1.3b-a100.csv.gz'}:40GiB",
    f"{DATA / 'landscape_pythia-160m-l4.csv.gz'}:16GiB",
    f"{DATA / 'landscape_llama-1b-a10g.csv.gz'}:22GiB",
)
STRATEGY_NAMES = ("frontier", "tpe", "random")


def bench(tables: list[str], strategies: list[str], seeds: int, budget_s: float) -> dict[str, Any]:
    """Run every strategy x seed x table; returns ``{table: {strategy: figures}}``."""
    summary: dict[str, Any] = {}
    for spec in tables:
        path, _, ceiling_text = spec.partition(":")
        ceiling = parse_bytes(ceiling_text or "40GiB")
        table = load_table(path)
        true_best = table.best_under(ceiling)
        if true_best is None:
            raise SystemExit(f"{path}: no configuration fits under {format_bytes(ceiling)}")
        grid_s = float(table.frame["probe_s"].sum())
        summary[table.name] = {"ceiling_bytes": ceiling, "true_best_samples_per_s": float(true_best["samples_per_s"])}
        for strategy in strategies:
            ratios, fractions, ooms, pruned, remeasures, over = [], [], [], [], [], 0
            for seed in range(seeds):
                outcome = replay_search(table, budget_s=budget_s, memory_ceiling_bytes=ceiling, strategy=strategy, seed=seed)
                ratios.append((outcome.best_samples_per_s or 0.0) / float(true_best["samples_per_s"]))
                fractions.append(outcome.virtual_s / grid_s)
                ooms.append(outcome.oom_probes)
                pruned.append(outcome.pruned)
                remeasures.append(outcome.remeasures)
                over += int(outcome.best_peak_mem_bytes is not None and outcome.best_peak_mem_bytes > ceiling)
            summary[table.name][strategy] = {
                "median_ratio": round(statistics.median(ratios), 4),
                "worst_ratio": round(min(ratios), 4),
                "median_time_fraction": statistics.median(fractions),
                "oom_probes_total": sum(ooms),
                "oom_probes_median": statistics.median(ooms),
                "pruned_median": statistics.median(pruned),
                "remeasures_median": statistics.median(remeasures),
                "returned_over_ceiling": over,
                "seeds": seeds,
            }
    return summary


def print_table(summary: dict[str, Any], budget_s: float) -> None:
    print(f"budget {budget_s / 60:.0f} virtual minutes per run")
    header = f"{'table':<28} {'strategy':<9} {'median':>7} {'worst':>7} {'time/grid':>10} {'OOMs':>6} {'OOM/run':>8} {'pruned/run':>11} {'re-meas/run':>12} {'over ceiling':>13}"
    print(header)
    print("-" * len(header))
    for table, figures in summary.items():
        for strategy, f in figures.items():
            if not isinstance(f, dict):
                continue
            print(
                f"{table:<28} {strategy:<9} {f['median_ratio']:>7.3f} {f['worst_ratio']:>7.3f} "
                f"{f['median_time_fraction']:>10.5%} {f['oom_probes_total']:>6} {f['oom_probes_median']:>8} "
                f"{f['pruned_median']:>11} {f['remeasures_median']:>12} {f['returned_over_ceiling']:>13}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-search", description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="*", default=list(DEFAULT_TABLES), help="TABLE.csv[.gz][:CEILING] (default: the shipped synthetic tables)")
    parser.add_argument("--strategies", default=",".join(STRATEGY_NAMES), help="comma-separated (default: all)")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--budget", default="30m")
    args = parser.parse_args(argv)
    budget_s = parse_duration_s(args.budget)
    summary = bench(args.tables, args.strategies.split(","), args.seeds, budget_s)
    print_table(summary, budget_s)
    print(json.dumps({"budget_s": budget_s, "tables": summary}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
