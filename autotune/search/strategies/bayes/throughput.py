"""Expected throughput: the step-time model's posterior, the loader's cap on it, and the expected
improvement over the incumbent.

A probe's ``input_wait_fraction`` splits its throughput into compute and waiting. The model learns
the compute part; the loader's rate (per worker, and in the training process with 0 workers) is
estimated from the probes that waited and caps or slows the prediction per worker count, so an
input-bound incumbent makes more workers the best bet. Where a probe reports no wait (a replay
table, an evaluator of one's own), the step-time model learns the loader with the rest: serial
loading with 0 workers as a part of the step's time, and the workers' rate as a cap
(:mod:`.features`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

import numpy as np

from autotune.params import TrialParams
from autotune.records import Probe
from autotune.search.ranking import Configuration
from autotune.search.strategies.bayes.context import Context
from autotune.search.strategies.bayes.features import CAP_OFF, CAP_PRIOR, LOADING_OFF, LOADING_PRIOR, WORKER_SCALING, WORKERS
from autotune.search.strategies.surrogate import expected_improvement

MODEL_NOISE = 0.03  # log-scale misfit of the model on top of a probe's own noise
PROBE_NOISE_FLOOR = 0.01
PENDING_NOISE = 0.02  # a pending probe's believed outcome is weighed like a probe with this CI (a real probe's default)
MIN_SD = 0.01  # no point is certain: EI stays positive near the incumbent
MIN_GAIN = 0.015  # log scale: what a probe must be expected to beat the incumbent by to count
NOTHING_YET_SPEED_WEIGHT = 0.3  # before anything fits: how much speed counts next to the chance to run
CAP_MARGIN = 0.1  # a loader's rate read off a waiting probe is a lower bound (the optimizer step hides in it), log scale


def posterior(context: Context, ran: list[Probe], pending: Iterable[TrialParams] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Posterior mean and sd of log samples/s on the grid, loader included, and the loader's cap;
    ``pending`` configurations (in flight elsewhere, expected to fit) count as measured at the
    model's own mean (the "kriging believer"): that takes the uncertainty, so the expected
    improvement, out of them and their neighbours, without moving the mean."""
    surrogate = context.surrogate
    measured: list[TrialParams] = []
    targets: list[float] = []
    noise: list[float] = []
    for probe in ran:
        wait = min(probe.result.input_wait_fraction or 0.0, 0.9)
        measured.append(probe.params)
        targets.append(math.log(probe.result.samples_per_s or 1.0) - math.log1p(-wait))  # the compute part
        probe_noise = max(probe.result.step_time_ci95_rel or 0.02, PROBE_NOISE_FLOOR)
        noise.append(probe_noise**2 + MODEL_NOISE**2 + (wait / (1 - wait) * 0.05) ** 2)
    # Where a probe did not measure its input wait, the loader's part is learnt from throughput.
    unmeasured = any(probe.result.input_wait_fraction is None for probe in ran)
    if context.loading is not None:
        surrogate.prior_mean[context.loading], surrogate.prior_sd[context.loading] = LOADING_PRIOR if unmeasured else LOADING_OFF
    if context.cap is not None:
        surrogate.prior_mean[context.cap], surrogate.prior_sd[context.cap] = CAP_OFF
    surrogate.set_scale(measured, targets)
    if context.cap is not None and unmeasured:
        surrogate.prior_mean[context.cap], surrogate.prior_sd[context.cap] = float(np.median(targets)) + CAP_PRIOR[0], CAP_PRIOR[1]
    surrogate.fit_params(measured, np.array(targets), np.array(noise))
    pending = list(pending)
    if pending:
        believed_mean, _ = surrogate.predict_params(pending)
        measured += pending
        targets += [float(m) for m in believed_mean]
        noise += [PENDING_NOISE**2 + MODEL_NOISE**2] * len(pending)
        surrogate.fit_params(measured, np.array(targets), np.array(noise))
    compute_mean, sd = surrogate.predict_grid()
    mean, cap = _input_model(context, ran, compute_mean)
    return mean, np.maximum(sd, np.float32(MIN_SD)), cap


def _input_model(context: Context, ran: list[Probe], compute_mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean log samples/s with the loader in, and the loader's cap per point (+inf: none known)."""
    grid = context.grid
    shape = grid.broadcast_shape((WORKERS,))
    if WORKERS not in grid.names:
        return compute_mean, np.full(shape, np.inf)
    main_rates, worker_rates, worker_bounds = [], [], []
    for probe in ran:
        wait = probe.result.input_wait_fraction
        sps = probe.result.samples_per_s or 0.0
        count = probe.params.dataloader_num_workers
        if wait is None or sps <= 0:
            continue
        if count == 0:
            if wait > 0.01:
                main_rates.append(sps / wait)  # loading in the training process is serial with compute
        elif wait > 0.05:
            worker_rates.append(sps / count**WORKER_SCALING)  # the loader sets the pace
        else:
            worker_bounds.append(sps / count**WORKER_SCALING)  # the loader kept up: at least this fast
    main_rate = statistics.median(main_rates) if main_rates else None
    # One worker's rate: every probe with workers bounds it from below (a waiting probe's throughput
    # is below its loader's rate: its optimizer step adds to the step), so the largest bound is the estimate.
    fastest_worker = max(worker_rates + worker_bounds, default=None)
    if worker_rates and fastest_worker is not None:  # a probe waited for its loader: the loader's pace was measured
        per_worker = fastest_worker
    elif main_rate is not None:
        per_worker = max(main_rate, max(worker_bounds, default=0.0))  # one worker about as fast as the main process
    else:
        per_worker = math.inf
    workers = np.array(grid.values[WORKERS], dtype=float).reshape(shape)
    if math.isfinite(per_worker):
        cap = np.where(workers > 0, np.log(per_worker * np.maximum(workers, 1.0) ** WORKER_SCALING) + CAP_MARGIN, np.inf)
    else:
        cap = np.full(shape, np.inf)
    cap = cap.astype(np.float32)
    # The expected throughput stops at the rate measured, not at the margin above it: the margin is
    # room for improvement (what EI may count up to), not a prediction.
    mean = np.minimum(compute_mean, cap - np.float32(CAP_MARGIN))
    if main_rate is None and fastest_worker is not None:
        # Nothing measured loading in the training process yet: it loads about as fast as one worker
        # (the same code on one core), serial with compute; where the loader kept up that rate is a
        # lower bound, so 0 workers is, if anything, judged too slow.
        main_rate = fastest_worker
    if main_rate is not None:
        serial = -np.log(np.exp(-compute_mean) + np.float32(1.0 / main_rate))
        mean = np.where(workers == 0, serial, mean)
    return mean.astype(np.float32), cap


def gain(context: Context, feasible: list[Configuration], mean: np.ndarray, sd: np.ndarray, cap: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Expected improvement (log samples/s) over the incumbent, at most up to a point's loader cap."""
    grid = context.grid
    if not feasible:
        # Nothing fits yet: what runs at all matters most (it clears its values of suspicion and
        # gives the memory model its scale); among those, mildly prefer the fast.
        top = float(mean[allowed].max()) if allowed.any() else 0.0
        return np.exp(NOTHING_YET_SPEED_WEIGHT * (mean - top))
    # Improvements within a probe's noise are not worth a probe: count only those beyond it.
    # Compilation multiplies throughput by a factor of its own, so an uncompiled configuration that
    # beats the incumbent's uncompiled self will beat the incumbent once compiled: it is measured
    # against that, at a fraction of the cost of compiling every candidate. The incumbent's
    # uncompiled self is the best uncompiled configuration measured, or, where higher, the incumbent
    # less the compile effect the model expects for it (compiled, a batch can fit that does not uncompiled).
    best_all = math.log(feasible[0].mean_samples_per_s) + MIN_GAIN
    plain = [c for c in feasible if c.params.torch_compile == "off"]
    best_plain = math.log(plain[0].mean_samples_per_s) + MIN_GAIN if plain else best_all
    incumbent = feasible[0].params
    here, uncompiled = grid.flat_index(incumbent), grid.flat_index(incumbent.replace(torch_compile="off"))
    if plain and here is not None and uncompiled is not None and here != uncompiled:
        flat_mean = np.broadcast_to(mean, grid.shape).reshape(-1)
        best_plain = max(best_plain, best_all - max(float(flat_mean[here] - flat_mean[uncompiled]), 0.0))
    best = np.where(context.compile_values == "off", best_plain, best_all).astype(np.float32)
    cap = np.broadcast_to(cap, grid.shape)
    capped = np.isfinite(cap)
    improvement = expected_improvement(mean, sd, best)
    if capped.any():
        improvement = improvement - np.where(capped, expected_improvement(mean, sd, np.where(capped, cap, 0.0)), 0.0)
    return np.where(cap > best, np.maximum(improvement, 0.0), 0.0)
