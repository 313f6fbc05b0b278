"""One search on one drawn landscape, probe by probe: what it ran, when, and what it missed.

    python -m bench.trace 42                          # design draw 42, bayes, 30 virtual minutes
    python -m bench.trace 42 --budget 10m --strategy tpe
    python -m bench.trace 24,35,91                    # several draws, one after another
    python -m bench.trace 13 --noise-stream 1         # the search bench.search --noise-stream 1 scored
    python -m bench.trace 0-99 --calibration          # bayes only: how well its model predicted its probes
    python -m bench.trace 2200112 --gen2              # a draw of the second generator (bench.landscapes2)

The search is the one ``python -m bench.search --family ...`` scores for that draw (same strategy,
budget and seed: the draw's index in its range), so a figure in its ``--details`` CSV can be
traced here. Per draw it prints the landscape (``bench.family.Shape.describe``), the true optimum
under the ceiling, one line per probe (virtual start and seconds, status, configuration, measured
samples/s, its noise-free samples/s as a fraction of the optimum, its noise-free peak memory),
the configuration the search returned, and **what it missed**: for each parameter where the
returned configuration differs from the optimum, the returned configuration with only that value
changed to the optimum's, as a factor on the returned one's samples/s (``!``: it does not run, or
it does not fit under the ceiling). A miss that one such change repairs is a comparison the search
did not make; one that none repairs needs several changes at once (a memory group, a batch size
that fits only with another optimizer).

``--calibration`` runs ``bayes`` on the draws and, for every probe that measured a throughput,
compares the measured log samples/s with what the model predicted for that configuration when it
proposed it: z = (measured - predicted mean) / sqrt(predicted sd^2 + the probe's noise^2). A
calibrated model gives z with mean 0 and sd 1; it prints the mean, sd and percentiles of z, the
share beyond 2 and 3, and the probes it was most wrong about.

Use it on design draws only (``bench.search`` documents the ranges): tracing a held-out draw is
looking at it.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

from autotune.units import GiB, parse_duration_s
from bench.family import RANGE_SPAN  # a draw's seed is its index in its range


def trace(draw: int, budget_s: float, strategy: str = "bayes", out: Any = None, noise_stream: int = 0) -> dict[str, Any]:
    """Run and print one traced search; returns ``bench.search.family_search``'s row with
    ``found_params`` (the returned configuration, or ``None``) and ``missed``:
    ``[(parameter, optimum's value, factor, runs and fits)]`` for the one-value changes.
    ``noise_stream`` redraws the probes' noise as ``bench.search --noise-stream`` does."""
    from bench.family import FAMILY_PARAMS, OK
    from bench.search import _landscape, family_search

    out = out if out is not None else sys.stdout
    log: list[Any] = []
    row = family_search(strategy, draw, budget_s, draw % RANGE_SPAN, log=log, noise_stream=noise_stream)
    landscape = _landscape(draw)
    true_params, true_sps = landscape.true_best()
    print(landscape.shape.describe(), file=out)
    print(f"optimum  {true_params.short()}  {true_sps:.2f} samples/s", file=out)

    def probe(params: Any, result: Any) -> str:  # the noise-free samples/s and peak
        noise_free = landscape.noise_free(params)
        return f"{result.samples_per_s or 0.0:9.2f}  x{float(noise_free.samples_per_s[0]) / true_sps:5.3f}  {float(noise_free.peak_bytes[0]) / GiB:6.1f} GiB"

    def changed(found: Any, name: str, value: Any) -> tuple[float, bool]:
        other = landscape.noise_free(found.replace(**{name: value}))
        runs_and_fits = int(other.status[0]) == OK and float(other.peak_bytes[0]) <= landscape.ceiling_bytes
        return float(other.samples_per_s[0]) / float(landscape.noise_free(found).samples_per_s[0]), runs_and_fits

    return _print_search(out, row, log, probe, "", {n: getattr(true_params, n) for n in FAMILY_PARAMS}, changed)


def trace_gen2(draw: int, budget_s: float, strategy: str = "bayes", out: Any = None, noise_stream: int = 0) -> dict[str, Any]:
    """As :func:`trace`, on a draw of the second generator (:mod:`bench.landscapes2`): the search
    ``bench.search --family gen2-...`` scores (same seed), probe by probe, with the draw's description
    (host cores, input-bound, failures, its expert pick) and the one-value changes it missed."""
    from bench.landscapes2 import GRID, _cached_draw, _python, describe, search_draw

    out = out if out is not None else sys.stdout
    log: list[Any] = []
    row = search_draw(strategy, draw, budget_s, draw % RANGE_SPAN, noise_stream=noise_stream, log=log)
    d = _cached_draw(draw, noise_stream)
    best = d.true_best()
    best_sps = float(best["true_samples_per_s"])
    print(describe(d), file=out)

    def probe(params: Any, result: Any) -> str:  # the noise-free samples/s, the measured peak
        return f"{result.samples_per_s or 0.0:9.2f}  x{d.true_samples_per_s(params) / best_sps:5.3f}  {(result.peak_mem_bytes or 0) / GiB:6.1f} GiB"

    def changed(found: Any, name: str, value: Any) -> tuple[float, bool]:
        other = d.true_samples_per_s(found.replace(**{name: value}))
        return other / (d.true_samples_per_s(found) or math.nan), other > 0

    return _print_search(out, row, log, probe, f", the expert pick x{row['expert_ratio']:.3f}", {n: _python(best[n]) for n in GRID}, changed)


def _print_search(out: Any, row: dict[str, Any], log: list[Any], probe: Any, found_note: str, optimum: dict[str, Any],
                  changed: Any) -> dict[str, Any]:
    """One line per probe (``probe(params, result)`` ends it), the returned configuration, and per
    parameter where it differs from ``optimum`` (name: the optimum's value) ``changed(found, name, value)``:
    the factor that value gives and whether it runs and fits; fills ``row["found_params"]`` and ``row["missed"]``."""
    for started_s, params, result in log:
        print(f"{started_s:7.0f} +{result.wall_s or 0.0:5.0f} s  {result.status.value:<9} {params.short():<84} {probe(params, result)}", file=out)
    row["missed"] = []
    found = next((p for _, p, _ in log if p.short() == row["found"]), None)
    row["found_params"] = found
    if found is None:
        print("found    nothing", file=out)
        return row
    print(f"found    {row['found']}  x{row['ratio']:.3f} of the optimum{found_note}", file=out)
    for name, value in optimum.items():
        if getattr(found, name) == value:
            continue
        factor, runs_and_fits = changed(found, name, value)
        row["missed"].append((name, value, factor, runs_and_fits))
        print(f"missed   {name}={value}: x{factor:.3f}{'' if runs_and_fits else ' !'}", file=out)
    return row


def calibration(draws: list[int], budget_s: float, out: Any = None) -> dict[str, Any]:
    """``bayes``'s prediction errors over the probes of one search per draw (see the module text)."""
    import math

    import numpy as np

    from autotune.search.strategies.bayes import throughput
    from autotune.search.strategies.bayes.strategy import BayesStrategy
    from bench.family import FamilyEvaluator
    from bench.search import _landscape, family_search

    out = out if out is not None else sys.stdout
    records: list[tuple[int, float, float, str]] = []

    class Recording(BayesStrategy):
        """bayes, keeping the grid and the model's mean and sd of its last proposal."""

        model: Any = None

        def propose(self, state: Any) -> Any:
            posterior = throughput.posterior

            def recorded(context: Any, ran: Any, pending: Any = ()) -> Any:
                mean, sd = posterior(context, ran, pending)
                self.model = (context.grid, mean, sd)
                return mean, sd

            throughput.posterior = recorded
            try:
                return super().propose(state)
            finally:
                throughput.posterior = posterior

    @dataclass
    class Scoring(FamilyEvaluator):
        """The family's evaluator, scoring each measured probe against ``strategy``'s prediction."""

        strategy: Any = None

        def evaluate(self, params: Any, *, timeout_s: float) -> Any:
            result = super().evaluate(params, timeout_s=timeout_s)
            model = self.strategy.model
            index = model[0].flat_index(params) if model is not None else None
            if result.ok and result.samples_per_s and index is not None:
                grid, mean, sd = model
                mu = float(np.broadcast_to(mean, grid.shape).reshape(-1)[index])
                sigma = float(np.broadcast_to(sd, grid.shape).reshape(-1)[index])
                noise = self.landscape.shape.noise
                records.append((self.landscape.shape.draw, (math.log(result.samples_per_s) - mu) / math.hypot(sigma, noise), sigma, params.short()))
            return result

    for draw in draws:
        strategy = Recording()
        family_search(strategy, draw, budget_s, draw % RANGE_SPAN, evaluator=Scoring(_landscape(draw), strategy=strategy))
    z = np.array([r[1] for r in records])
    summary = {
        "probes": len(z), "mean_z": float(z.mean()), "sd_z": float(z.std()),
        "beyond_2": float((abs(z) > 2).mean()), "beyond_3": float((abs(z) > 3).mean()),
        "percentiles": {q: float(np.percentile(z, q)) for q in (1, 5, 25, 50, 75, 95, 99)},
        "median_predicted_sd": float(np.median([r[2] for r in records])),
    }
    print(f"{len(z)} probes over {len(draws)} draws: z mean {summary['mean_z']:.2f}, sd {summary['sd_z']:.2f}; "
          f"|z| > 2: {summary['beyond_2']:.1%}, > 3: {summary['beyond_3']:.1%}; median predicted sd {summary['median_predicted_sd']:.3f}", file=out)
    print("percentiles of z: " + ", ".join(f"p{q} {v:.2f}" for q, v in summary["percentiles"].items()), file=out)
    for draw, zi, sigma, short in sorted(records, key=lambda r: -abs(r[1]))[:10]:
        print(f"  draw {draw:>6}  z {zi:7.2f}  predicted sd {sigma:.3f}  {short}", file=out)
    return summary


def _draws(text: str) -> list[int]:
    draws: list[int] = []
    for part in text.split(","):
        first, dash, last = part.partition("-")
        draws += list(range(int(first), int(last) + 1)) if dash else [int(first)]
    return draws


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-trace", description=__doc__.splitlines()[0])
    parser.add_argument("draws", help="draw numbers: 42, 24,35,91 or 0-99")
    parser.add_argument("--budget", default="30m", help="virtual budget (default: 30m)")
    parser.add_argument("--strategy", default="bayes", help="a strategy name (default: bayes)")
    parser.add_argument("--noise-stream", type=int, default=0, help="redraw the probes' noise, as bench.search --noise-stream (default: 0)")
    parser.add_argument("--calibration", action="store_true", help="bayes's prediction errors over the draws instead of traces")
    parser.add_argument("--gen2", action="store_true", help="draws of the second generator (bench.landscapes2), e.g. 2200112")
    args = parser.parse_args(argv)
    from bench.search import noise_stream_problem

    problem = noise_stream_problem(args.noise_stream)
    if problem is not None:
        parser.error(problem)
    try:
        draws = _draws(args.draws)
    except ValueError:
        parser.error(f"draws must be whole numbers or ranges separated by commas (42, 24,35 or 0-99), not {args.draws!r}")
    if args.calibration:
        calibration(draws, parse_duration_s(args.budget))
        return 0
    for i, draw in enumerate(draws):
        if i:
            print()
        (trace_gen2 if args.gen2 else trace)(draw, parse_duration_s(args.budget), args.strategy, noise_stream=args.noise_stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
