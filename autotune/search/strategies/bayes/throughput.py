"""Expected throughput: the step-time model's posterior (the loader's part included) and the
expected improvement over the incumbent.

The loader is learnt with the rest (:mod:`.features`): loading with 0 workers as a part of the step's
time, the workers' rate as a cap on throughput. A probe's ``input_wait_fraction``, where reported,
splits its throughput into compute and waiting, so a probe that waited measures both; where no
probe reports it (a replay table, an evaluator of one's own) throughput alone decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from autotune.params import TrialParams
from autotune.records import Probe
from autotune.search.ranking import Configuration
from autotune.search.strategies.bayes.context import Context
from autotune.search.strategies.bayes.features import CAP_PRIOR, CAP_UNKNOWN
from autotune.search.strategies.surrogate import expected_improvement

MODEL_NOISE = 0.03  # log-scale misfit of the model on top of a probe's own noise
PROBE_NOISE_FLOOR = 0.01
PENDING_NOISE = 0.02  # a pending probe's believed outcome is weighed like a probe with this CI (a real probe's default)
MIN_SD = 0.01  # no point is certain: EI stays positive near the incumbent
MIN_GAIN = 0.015  # log scale: what a probe must be expected to beat the incumbent by to count
NOTHING_YET_SPEED_WEIGHT = 0.3  # before anything fits: how much speed counts next to the chance to run


def posterior(context: Context, ran: list[Probe], pending: Iterable[TrialParams] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Posterior mean and sd of log samples/s on the grid, loader included; ``pending``
    configurations (in flight elsewhere, expected to fit) count as measured at the model's own mean
    (the "kriging believer"): that takes the uncertainty, so the expected improvement, out of them
    and their neighbours, without moving the mean.

    A probe that reports its input wait also measured its compute part alone (its throughput
    without the wait): so it says both how fast it computes and whether its loader kept up."""
    surrogate = context.surrogate
    measured: list[TrialParams] = []
    targets: list[float] = []
    noise: list[float] = []
    compute: list[bool] = []
    for probe in ran:
        wait = min(probe.result.input_wait_fraction or 0.0, 0.9)
        probe_noise = max(probe.result.step_time_ci95_rel or 0.02, PROBE_NOISE_FLOOR)
        for alone in (False, True) if probe.result.input_wait_fraction is not None else (False,):
            measured.append(probe.params)
            targets.append(math.log(probe.result.samples_per_s or 1.0) - (math.log1p(-wait) if alone else 0.0))
            noise.append(probe_noise**2 + MODEL_NOISE**2 + ((wait / (1 - wait) * 0.05) ** 2 if alone else 0.0))
            compute.append(alone)
    # The scale is centred on the step's time without the loader (the cap's prior at "none", which also
    # takes the 0-worker loading, one worker's time, out), then the cap's prior is set from the measurements.
    if context.cap is not None:
        surrogate.prior_mean[context.cap] = CAP_UNKNOWN
    surrogate.set_scale(measured, targets)
    if context.cap is not None and targets:
        surrogate.prior_mean[context.cap] = float(np.median(targets)) + CAP_PRIOR[0]
    surrogate.fit_params(measured, np.array(targets), np.array(noise), compute)
    pending = list(pending)
    if pending:
        believed_mean, _ = surrogate.predict_params(pending)
        measured += pending
        targets += [float(m) for m in believed_mean]
        noise += [PENDING_NOISE**2 + MODEL_NOISE**2] * len(pending)
        surrogate.fit_params(measured, np.array(targets), np.array(noise), compute)
    mean, sd = surrogate.predict_grid()
    return mean, np.maximum(sd, np.float32(MIN_SD))


def gain(feasible: list[Configuration], mean: np.ndarray, sd: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Expected improvement (log samples/s) over the incumbent, beyond a probe's noise."""
    if not feasible:
        # Nothing fits yet: what runs at all matters most (it clears its values of suspicion and
        # gives the memory model its scale); among those, mildly prefer the fast.
        top = float(mean[allowed].max()) if allowed.any() else 0.0
        return np.exp(NOTHING_YET_SPEED_WEIGHT * (mean - top))
    return expected_improvement(mean, sd, np.float32(math.log(feasible[0].mean_samples_per_s) + MIN_GAIN))
