"""The memory model: what fits under the ceiling, before running it. Never imports torch.

It starts from the analytic prior of :mod:`autotune.search.memory_prior` (peak = static + batch x
activations per sample, from the model's dimensions; relative factors without them) and learns from
every measured peak and out-of-memory probe.

Batch size is the parameter of a *memory group* (precision, optim, compile, attention,
checkpointing, Liger kernels) that changes peak memory; the DataLoader settings do not (pinned memory
is host memory). Gradient accumulation adds a little (the gradients are kept between micro-batches):
the model predicts the same peak for it, but the measured rules treat more accumulation at the same
batch as needing no less memory (:func:`needs_no_less_memory`). ``torch_empty_cache_steps`` is not modelled: it
returns the allocator's cached blocks to the device between steps, which lowers what other
processes see and can avoid a fragmentation OOM near the ceiling, but not the peak inside a step;
it costs time (each step after it allocates afresh), which the probes measure.

:class:`MemoryModel` calibrates this online from measured peaks: one global least-squares fit of
two scales (static and activation bytes, relative to the analytic model, or to generic relative
factors when no model config is known, as in a replay: then with a constant of its own for the CUDA
context, and from the peaks without checkpointing where they suffice); then the fixed activation factors (fp32,
eager attention, checkpointing, compile, Liger) are learnt from the data, one scale per measured
combination of them and a log-linear model of the factors for the combinations never measured,
with out-of-memory probes as lower bounds (``MemoryModel._learn_classes``); overridden per group
by that group's own line (peak against batch size) once it has two batch sizes measured.
Measurements always win over predictions: an OOM at batch b means OOM for every larger b of the
group, and for b itself at no less accumulation (monotone inference), and a measured peak over the
ceiling likewise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.params import TrialParams, mixed_precision_dtype
from autotune.records import ProbeResult, ProbeStatus
from autotune.search.memory_prior import (
    CUDA_CONTEXT_BYTES,
    ModelDims,
    StaticMemory,
    activation_bytes_per_sample,
    generic_features,
    peak_static_bytes,
    static_memory,
)
from autotune.units import GiB

BASE_PRIOR_SD_BYTES = 0.5 * GiB  # without model dims: the prior sd of that memory, fitted as a constant (MemoryModel._fitted_scales)
GROUP_KEYS = ("precision", "optim", "torch_compile", "attn_implementation", "gradient_checkpointing", "use_liger_kernel", "sharding")
# What a sibling group shares (MemoryModel._sibling_slope): precision, attention, checkpointing, Liger.
_SIBLING_KEYS = tuple(GROUP_KEYS.index(k) for k in ("precision", "attn_implementation", "gradient_checkpointing", "use_liger_kernel"))
PRUNE_MARGIN = 0.05  # prune only when predicted over the ceiling by more than this fraction
UNCALIBRATED_PRUNE_MARGIN = 0.25  # the same for a group never measured, predicted from generic factors

# Learning the activation factors from measurements (MemoryModel._learn_classes):
PEAK_SD = 0.05  # relative error of a measured peak as a sample of the linear model (allocator rounding, fragmentation)
SCALE_PRIOR_SD = 1.0  # prior sd of the static scale and of each class's activation scale, around the global fit
FACTOR_SD_GENERIC = 0.4  # prior sd of a fixed activation factor's log error, without model dims
FACTOR_SD_ANALYTIC = 0.2  # the same with model dims (the analytic factors are closer)
CLASS_SD = 0.1  # a class's log deviation from the product of its factors
BOUND_SD = 0.3  # an out-of-memory bound on a class's log activation scale, taken as a measurement this uncertain
MAX_BOUND_LOG = math.log(20.0)  # at most 20x the fixed factors (eager attention's scores at long sequences reach ~10x)

MemoryGroup = tuple[Any, ...]
ActivationClass = tuple[bool, bool, bool, bool, bool]


def memory_group(params: TrialParams) -> MemoryGroup:
    """The parameters that change peak memory other than batch size."""
    return tuple(getattr(params, name) for name in GROUP_KEYS)


def activation_class(params: TrialParams) -> ActivationClass:
    """Which fixed activation factors apply: fp32 storage, eager attention, checkpointing, compile, Liger."""
    return (mixed_precision_dtype(params.precision) is None, params.attn_implementation == "eager",
            bool(params.gradient_checkpointing), params.torch_compile != "off", bool(params.use_liger_kernel))


# ------------------------------------------------------------------------------ calibration


def needs_no_less_memory(batch: int, accumulation: int, other_batch: int, other_accumulation: int) -> bool:
    """Whether a step at ``batch`` x ``accumulation`` needs no less memory than one at the other pair
    (same memory group): a larger batch always does, and the same batch with no less accumulation
    (accumulating keeps the gradients between micro-batches: on an H100, pythia-160m at batch 64
    compiled peaked 1.5 GiB higher accumulating 2 than 1, and AdamW ran at 1 and ran out of memory
    at 2). A batch step up is taken to cost more than accumulating (there, 8 samples ~0.6 GiB)."""
    return batch > other_batch or (batch == other_batch and accumulation >= other_accumulation)


@dataclass
class _GroupData:
    peaks: dict[tuple[int, int], int] = field(default_factory=dict)  # (batch, accumulation) -> measured peak (ok probes)
    ooms: set[tuple[int, int]] = field(default_factory=set)  # (batch, accumulation) that ran out of memory
    fits: dict[int, int] = field(default_factory=dict)  # batch -> the largest peak measured at it, at any accumulation
    line: tuple[float, float] | None = None  # (intercept, slope) through ``fits`` (:func:`_line`), the group's line

    def add_peak(self, cell: tuple[int, int], peak: int) -> None:
        self.peaks[cell] = max(self.peaks.get(cell, 0), peak)
        self.fits[cell[0]] = max(self.fits.get(cell[0], 0), peak)
        self.line = _line(self.fits)

    @property
    def oom_from(self) -> int | None:
        """The smallest batch that ran out of memory, at any accumulation."""
        return min((b for b, _ in self.ooms), default=None)


@dataclass
class MemoryModel:
    """Predicts peak memory per configuration and learns from every measurement.

    Args:
        dims: model dimensions for the analytic prior; ``None`` (a replay) fits generic factors.
        seq_len: tokens per sample (needed with ``dims``).
    """

    dims: ModelDims | None = None
    seq_len: int = 512
    world: int = 1  # ranks per probe: a sharding partitions the state over them
    oom_floor_bytes: int = 0  # an out-of-memory probe's peak was above this (the ceiling: probes enforce it)
    _groups: dict[MemoryGroup, _GroupData] = field(default_factory=dict)
    _scales: tuple[float, float] | None = None  # fitted (static, activation) scales
    _class_log_scale: dict[ActivationClass, float] | None = None  # learnt log correction per activation class
    _factor_model: tuple[float, np.ndarray] | None = None  # (intercept, per-factor log corrections) for classes never measured
    _static_factor: float = 1.0  # the static scale's refinement by the per-class fit
    _base_bytes: float = 0.0  # without model dims: memory that is neither per parameter nor per sample (see _fitted_scales)
    _observations: list[tuple[TrialParams, int]] = field(default_factory=list)
    _classes_measured: set[ActivationClass] = field(default_factory=set)  # the activation classes of _observations

    # ---------------------------------------------------------------- learning

    def observe(self, params: TrialParams, result: ProbeResult) -> None:
        """Record a measured outcome (``ok`` with a peak, or ``oom``); other outcomes carry no memory information."""
        group = self._groups.setdefault(memory_group(params), _GroupData())
        cell = (params.per_device_train_batch_size, params.gradient_accumulation_steps)
        if result.status is ProbeStatus.OOM:
            group.ooms.add(cell)
            self._class_log_scale = None  # an OOM bounds its activation class
        elif result.ok and result.peak_mem_bytes is not None:
            group.add_peak(cell, int(result.peak_mem_bytes))
            self._observations.append((params, int(result.peak_mem_bytes)))
            self._classes_measured.add(activation_class(params))
            self._scales = None
            self._class_log_scale = None

    def observe_all(self, items: Iterable[tuple[TrialParams, ProbeResult]]) -> None:
        for params, result in items:
            self.observe(params, result)

    def _features(self, params: TrialParams) -> tuple[float, float]:
        if self.dims is None:
            return generic_features(params, self.world)
        parts = self._analytic_parts(params)
        return self._static_feature(params, params.per_device_train_batch_size, parts), parts[1]

    def _static_feature(self, params: TrialParams, batch: int, parts: tuple[StaticMemory, float] | None) -> float:
        """The static feature of ``params`` at ``batch`` (``parts``: :meth:`_analytic_parts` of ``params``, ``None``
        without model dims): with dims, what is not activations beside that batch's activations."""
        if parts is None:
            return generic_features(params, self.world)[0]
        return peak_static_bytes(parts[0], params, batch * parts[1])

    def _analytic_parts(self, params: TrialParams) -> tuple[StaticMemory, float]:
        """With model dims: the static memory and the activation bytes per sample (neither depends on the batch)."""
        assert self.dims is not None
        return static_memory(self.dims, params.precision, params.optim, params.sharding, self.world), \
            float(activation_bytes_per_sample(self.dims, params, self.seq_len))

    def _fitted_scales(self) -> tuple[float, float] | None:
        """Least-squares (static, activation) scales over every ok measurement; the prior is (1, 1).

        Without model dims the static feature counts bytes per parameter, and what every training
        process holds whatever it trains (the CUDA context, the cuBLAS handles and workspaces:
        :data:`CUDA_CONTEXT_BYTES`) is not per parameter: it is a constant of its own
        (:attr:`_base_bytes`), fitted around that prior (at most half the smallest peak). Folded
        into the static scale, it inflated every optimizer's state by the context's share: on a
        drawn landscape with a 1 GiB context and a 50M-parameter model, 8-bit Adam's 2 B/param were
        predicted at 0.4 GiB more than Adafactor's, not 0.1, and never run under a tight ceiling.
        """
        if not self._observations:
            return None if self.dims is None else (1.0, 1.0)
        if self._scales is None:
            self._scales = self._fit_scales()
        return self._scales

    def _fit_scales(self) -> tuple[float, float]:
        rows = [(*self._features(p), float(p.per_device_train_batch_size), float(m)) for p, m in self._observations]
        x = np.array([[s, b * a] for s, a, b, _ in rows])
        y = np.array([m for *_, m in rows])
        if self.dims is not None:  # ridge toward the analytic model: a few points refine it, never flip it
            weight = float(np.median(y)) * 0.3  # worth ~0.1 of a measurement per scale
            coef, *_ = np.linalg.lstsq(np.vstack([x, [[weight, 0.0], [0.0, weight]]]), np.concatenate([y, [weight, weight]]), rcond=None)
            return max(float(coef[0]), 0.0), max(float(coef[1]), 1e-12)
        base_prior = min(float(CUDA_CONTEXT_BYTES), 0.5 * float(y.min()))
        # Checkpointing's fixed factor (15 % of the activations kept) is the least certain
        # (models keep 10-50 %), and checkpointed probes run at the largest batches, where a
        # wrong factor moves the fit most: on drawn landscapes their peaks left 0-2 % of the
        # bytes to an activation, every batch of a group measured once was predicted near its
        # one peak, and a search ran out of memory at 5-30 batches in a row. Where the peaks
        # without checkpointing can carry the fit (two directions), it is theirs;
        # _learn_classes learns what checkpointing keeps.
        plain = np.array([not p.gradient_checkpointing for p, _ in self._observations])
        weight = PEAK_SD * float(np.median(y)) / BASE_PRIOR_SD_BYTES  # the constant's prior's worth against a peak's error
        coef = None
        if np.linalg.matrix_rank(x[plain]) >= 2:
            coef = self._fit_with_base(x[plain], y[plain], base_prior, weight)
        elif np.linalg.matrix_rank(x) >= 2:
            coef = self._fit_with_base(x, y, base_prior, weight)
            if coef[2] <= 0 and plain.any():  # the checkpointed peaks leave the activations nothing: their factor is off
                coef = None
        if coef is None:
            # Points of one kind only (or only one without checkpointing worth believing): the
            # prior's constant, one common scale for both features through the last such point.
            s, a, b, m = rows[int(np.flatnonzero(plain)[-1]) if plain.any() else -1]
            self._base_bytes = base_prior
            return ((m - base_prior) / (s + b * a),) * 2
        self._base_bytes = min(max(float(coef[0]), 0.0), float(y.min()))
        return max(float(coef[1]), 0.0), max(float(coef[2]), 1e-12)

    @staticmethod
    def _fit_with_base(x: np.ndarray, y: np.ndarray, base_prior: float, weight: float) -> np.ndarray:
        """Least-squares (constant, static scale, activation scale) for rows ``x`` of (static,
        activation) features, the constant ridged toward ``base_prior`` with ``weight``."""
        design = np.vstack([np.hstack([np.ones((len(y), 1)), x]), [[weight, 0.0, 0.0]]])
        coef, *_ = np.linalg.lstsq(design, np.concatenate([y, [weight * base_prior]]), rcond=None)
        return coef

    # ---------------------------------------------------------------- predicting

    def predict(self, params: TrialParams) -> int | None:
        """Predicted peak bytes of ``params``; ``None`` before anything is known (no dims, no measurement)."""
        return self.predict_cells(params, [(params.per_device_train_batch_size, params.gradient_accumulation_steps)])[0]

    def predict_cells(self, params: TrialParams, cells: Sequence[tuple[int, int]]) -> list[int | None]:
        """:meth:`predict` of ``params`` at each (batch, accumulation) of ``cells``, with what they share
        (the group, its activation slope, its static memory) worked out once."""
        group = self._groups.get(memory_group(params))
        fits = group.fits if group else {}
        if group is not None and group.line is not None:  # the group's own line
            intercept, slope = group.line
            return [fits[b] if b in fits else int(intercept + slope * b) for b, _ in cells]
        scales = self._fitted_scales()
        if scales is None:
            return [fits.get(b) for b, _ in cells]
        slope = self._activation_slope(params)
        if len(fits) == 1:
            # One point: a sibling group's slope, else the fitted model's through the point.
            (b0, m0), = fits.items()
            sibling = self._sibling_slope(params, slope)
            return [fits[b] if b in fits else int(m0 + (b - b0) * (sibling if sibling is not None else slope)) for b, _ in cells]
        parts = None if self.dims is None else self._analytic_parts(params)
        at = {params.gradient_accumulation_steps: params}  # params at each accumulation
        peaks: list[int | None] = []
        for batch, accumulation in cells:
            if batch in fits:
                peaks.append(fits[batch])
                continue
            if accumulation not in at:
                at[accumulation] = params.replace(gradient_accumulation_steps=accumulation)
            static = self._static_feature(at[accumulation], batch, parts)
            peaks.append(int(self._base_bytes + scales[0] * self._static_factor * static + batch * slope))
        return peaks

    def _activation_slope(self, params: TrialParams) -> float:
        """Predicted activation bytes per sample: the fitted scale times the learnt correction of the
        configuration's activation class (:meth:`_learn_classes`)."""
        scales = self._fitted_scales()
        assert scales is not None
        return self._features(params)[1] * scales[1] * math.exp(self._class_correction(activation_class(params)))

    def _class_correction(self, key: ActivationClass) -> float:
        if self._class_log_scale is None:
            self._learn_classes()
        assert self._class_log_scale is not None
        if key in self._class_log_scale:
            return self._class_log_scale[key]
        return self._predicted_log_scale(key)

    def _learn_classes(self) -> None:
        """Learn how far each activation factor (fp32, eager attention, checkpointing, compile, Liger)
        is off in the measured data, so a group never measured is predicted from what its factors did
        elsewhere instead of from the fixed factors alone.

        The fixed factors are guesses (checkpointing keeps 15 % of the activations without model
        dims, where models keep 10-30 %; eager attention 1.5x, where the scores of long sequences
        take many times the rest), and one global scale fitted mostly on checkpointed groups then
        overestimates every group without checkpointing: the search never tries the fast
        small-batch configuration that fits. Three linear steps:

        1. every measured peak, ``m = s.static + b.act.A.u_c``: a Bayesian least-squares fit of the
           static scale ``s`` and one activation scale ``u_c`` per activation class measured (priors
           1, peaks with :data:`PEAK_SD` relative error);
        2. ``log u_c = c + sum_f delta_f [class has factor f]`` over the measured classes (each
           weighted by its own uncertainty plus :data:`CLASS_SD`), the ``delta_f`` with prior sd
           ``FACTOR_SD_*`` (0: the fixed factors are right). An out-of-memory probe's peak was above
           the ceiling (:attr:`oom_floor_bytes`) and every peak measured (the device held those):
           where that needs more activation than the class is predicted, the bound counts as a
           measurement of the class (at most :data:`MAX_BOUND_LOG`), and step 2 is redone;
        3. a measured class keeps its own ``u_c`` shrunk toward step 2's prediction; a class never
           measured gets step 2's prediction; either, at least its out-of-memory bound (a class
           measured at one batch size cannot split its peak between static memory and activations).

        With one class measured and no OOM, or every peak at one batch size, nothing changes but the
        scale; a group's own line wins.
        """
        self._class_log_scale, self._factor_model, self._static_factor = {}, None, 1.0
        scales = self._fitted_scales()
        if scales is None or len({p.per_device_train_batch_size for p, _ in self._observations}) < 2:
            return  # peaks at one batch size cannot tell activations from static memory
        static_scale, act_scale = scales
        keys = sorted({activation_class(p) for p, _ in self._observations})
        column = {k: i for i, k in enumerate(keys)}
        x = np.zeros((len(self._observations), 1 + len(keys)))
        y = np.zeros(len(self._observations))
        for row, (params, peak) in enumerate(self._observations):
            static, act = self._features(params)
            x[row, 0] = static * static_scale
            x[row, 1 + column[activation_class(params)]] = params.per_device_train_batch_size * act * act_scale
            y[row] = peak
        weights = 1.0 / (PEAK_SD * np.maximum(y, 1.0)) ** 2
        y = y - self._base_bytes
        prior_precision = np.full(1 + len(keys), 1.0 / SCALE_PRIOR_SD**2)
        precision = (x * weights[:, None]).T @ x + np.diag(prior_precision)
        covariance = np.linalg.inv(precision)
        theta = covariance @ ((x * weights[:, None]).T @ y + prior_precision)  # prior means 1
        self._static_factor = max(float(theta[0]), 0.0)
        scale = np.maximum(theta[1:], 0.05)
        measured = dict(zip(keys, zip(np.log(scale), np.diag(covariance)[1:] / scale**2)))  # class -> (log scale, its variance)
        self._factor_model = self._fit_factors(measured)
        # Out-of-memory bounds: the peak exceeded the ceiling and the largest peak measured.
        most = max(max(peak for _, peak in self._observations), self.oom_floor_bytes)
        bounds: dict[ActivationClass, float] = {}
        for group, data in self._groups.items():
            if data.oom_from is None:
                continue
            params = TrialParams.from_dict({**dict(zip(GROUP_KEYS, group)), "per_device_train_batch_size": data.oom_from})
            static, act = self._features(params)
            needed = (most - self._base_bytes - static_scale * self._static_factor * static) / (data.oom_from * act * act_scale)
            if needed > 0:
                key = activation_class(params)
                bounds[key] = max(bounds.get(key, -math.inf), min(math.log(needed), MAX_BOUND_LOG))
        binding = {k: (b, BOUND_SD**2) for k, b in bounds.items() if k not in measured and b > self._predicted_log_scale(k)}
        if binding:
            self._factor_model = self._fit_factors({**measured, **binding})
        for key in set(measured) | set(bounds):
            estimate = self._predicted_log_scale(key)
            if key in measured:
                # The class's own estimate, shrunk toward what its factors predict (precision-weighted).
                own, prior = 1.0 / measured[key][1], 1.0 / CLASS_SD**2
                estimate = (own * measured[key][0] + prior * estimate) / (own + prior)
            self._class_log_scale[key] = float(max(estimate, bounds.get(key, -math.inf)))

    def _fit_factors(self, classes: dict[ActivationClass, tuple[float, float]]) -> tuple[float, np.ndarray]:
        """Ridge regression of classes' log activation scales on their factors: (intercept, effects)."""
        keys = sorted(classes)
        design = np.hstack([np.ones((len(keys), 1)), np.array(keys, dtype=float)])
        target = np.array([classes[k][0] for k in keys])
        w = 1.0 / (np.array([classes[k][1] for k in keys]) + CLASS_SD**2)
        factor_sd = FACTOR_SD_ANALYTIC if self.dims is not None else FACTOR_SD_GENERIC
        prior = np.diag([1.0] + [1.0 / factor_sd**2] * (design.shape[1] - 1))
        beta = np.linalg.solve((design * w[:, None]).T @ design + prior, (design * w[:, None]).T @ target)
        return float(beta[0]), beta[1:]

    def _predicted_log_scale(self, key: ActivationClass) -> float:
        if self._factor_model is None:
            return 0.0
        intercept, effects = self._factor_model
        return float(intercept + effects @ np.array(key, dtype=float))

    def _sibling_slope(self, params: TrialParams, own_slope: float) -> float | None:
        """Activation bytes per sample from groups with their own line and the same precision,
        attention, checkpointing and Liger kernels (they differ in optimizer or compile only), scaled
        by the model's activation ratio between the two groups (``own_slope``: the model's for
        ``params``, :meth:`_activation_slope`)."""
        own = memory_group(params)
        slopes = []
        for key, data in self._groups.items():
            if data.line is None or key == own or any(key[i] != own[i] for i in _SIBLING_KEYS):
                continue
            sibling = params.replace(**dict(zip(GROUP_KEYS, key)))
            slopes.append(data.line[1] * own_slope / self._activation_slope(sibling))
        if not slopes:
            return None
        slopes.sort()
        return slopes[len(slopes) // 2]

    def known_outcome(self, params: TrialParams, ceiling_bytes: int) -> str | None:
        """A reason this configuration cannot fit, inferred from measurements of its group (monotone
        in batch and accumulation: :func:`needs_no_less_memory`)."""
        group = self._groups.get(memory_group(params))
        if group is None:
            return None
        batch, accumulation = params.per_device_train_batch_size, params.gradient_accumulation_steps

        def at(b: int, a: int) -> str:
            return f"batch {b}" + (f" x{a}" if a != accumulation else "")

        for b, a in sorted(group.ooms):
            if needs_no_less_memory(batch, accumulation, b, a):
                return f"OOM at {at(b, a)} in the same group"
        for (b, a), peak in sorted(group.peaks.items()):
            if needs_no_less_memory(batch, accumulation, b, a) and peak > ceiling_bytes:
                return f"measured {peak / GiB:.1f} GiB at {at(b, a)} > ceiling {ceiling_bytes / GiB:.1f} GiB in the same group"
        return None

    def known_to_fit(self, params: TrialParams, ceiling_bytes: int) -> bool:
        """True when a configuration of the same group needing no less memory (:func:`needs_no_less_memory`) was measured under the ceiling."""
        group = self._groups.get(memory_group(params))
        batch, accumulation = params.per_device_train_batch_size, params.gradient_accumulation_steps
        return group is not None and any(needs_no_less_memory(b, a, batch, accumulation) and m <= ceiling_bytes
                                         for (b, a), m in group.peaks.items())

    def prune_reason(self, params: TrialParams, ceiling_bytes: int) -> str | None:
        """Why ``params`` should not be run (it cannot fit under the ceiling), or ``None``."""
        known = self.known_outcome(params, ceiling_bytes)
        if known or self.known_to_fit(params, ceiling_bytes):
            return known
        predicted = self.predict(params)
        margin = self.prune_margin(params)
        if predicted is not None and margin is not None and predicted > ceiling_bytes * (1 + margin):
            return f"predicted {predicted / GiB:.1f} GiB > ceiling {ceiling_bytes / GiB:.1f} GiB"
        return None

    def prune_margin(self, params: TrialParams) -> float | None:
        """How far over the ceiling a prediction for ``params`` must be to prune it: :data:`PRUNE_MARGIN` where
        calibrated (:meth:`is_calibrated`), else :data:`UNCALIBRATED_PRUNE_MARGIN`; ``None`` (no pruning by
        prediction) before any peak was measured on this device (the analytic prior alone is off by a
        factor: a second-generator model's peaks at 0.68x its prediction, where pruning at the tight
        margin left nothing to run), and while one group is measured without model dims, its generic
        factors not fitted yet."""
        if not self._observations:
            return None
        if self.is_calibrated(params):
            return PRUNE_MARGIN
        if len({memory_group(p) for p, _ in self._observations}) < 2:
            return None
        return UNCALIBRATED_PRUNE_MARGIN

    def class_measured(self, params: TrialParams) -> bool:
        """Whether a group with the activation factors of ``params`` (:func:`activation_class`) has a
        measured peak: then its activations per sample are learnt, not only the fixed factors'."""
        return activation_class(params) in self._classes_measured

    def is_calibrated(self, params: TrialParams) -> bool:
        """Whether a prediction for ``params`` is trusted to within :data:`PRUNE_MARGIN`.

        With model dims the analytic prior is; without them, the group needs a measurement (a
        global fit of generic factors alone can be off by a group-specific factor, so it prunes
        only beyond :data:`UNCALIBRATED_PRUNE_MARGIN`).
        """
        if self.dims is not None:
            return True
        group = self._groups.get(memory_group(params))
        return bool(group and group.fits)

    def _limit_after_oom(self, params: TrialParams, oom_batch: int, ceiling_bytes: int) -> int:
        """The largest batch worth trying after ``oom_batch`` ran out of memory in a group where nothing fit yet.

        The out-of-memory probe says the prediction's per-sample part was low by at least ``r = (ceiling -
        static) / (predicted - static)``. The model's own uncertainty of that part (a heavy-tailed log
        error of scale :meth:`_activation_log_sd`, :func:`median_error_beyond`) conditioned on the error
        being at least ``r`` has a median ``f``; the limit is the batch that fits with that median error,
        ``oom_batch * r / f``: even odds of fitting, and the nearest such batch. A small miss of a confident
        model steps down little (x0.88 at r = 1.1 with model dims); a miss far beyond the model's
        uncertainty says the model is wrong there, so it steps down more (x0.6 at r = 4). By at
        least one (a model that already predicted the OOM has nothing to correct). With no prediction, or
        a static part over the ceiling, it halves. On an H100 (polyglot-ko-1.3b bf16 compiled, seq 512,
        2026-11-27 and -28) the fp32 baseline's one peak left the prediction at 56 at least 25 % low: the
        median rule tries 48 (68.2 GiB under the 75.7 GiB ceiling, the expert's batch); dividing by ``r``
        once more tried 40, 0.96 of it.
        """
        candidate = TrialParams.from_dict({**params.to_dict(), "per_device_train_batch_size": oom_batch})
        predicted = self.predict(candidate)
        if predicted is None or self._fitted_scales() is None:
            return oom_batch // 2
        static = predicted - oom_batch * self._activation_slope(candidate)
        if static >= ceiling_bytes or predicted <= static:
            return oom_batch // 2
        if predicted >= ceiling_bytes:
            return oom_batch - 1
        ratio = (ceiling_bytes - static) / (predicted - static)
        median_error = median_error_beyond(ratio, self._activation_log_sd())
        return max(1, min(oom_batch - 1, int(oom_batch * ratio / median_error)))

    def _activation_log_sd(self) -> float:
        """The prior sd of the log error of a group's predicted activations: its class's factors and its own deviation."""
        factor_sd = FACTOR_SD_ANALYTIC if self.dims is not None else FACTOR_SD_GENERIC
        return math.hypot(factor_sd, CLASS_SD)

    def largest_batch_that_fits(self, params: TrialParams, batch_sizes: Iterable[int], ceiling_bytes: int) -> int | None:
        """The largest of ``batch_sizes`` predicted (or measured) to fit ``params``' group under the ceiling."""
        best = None
        group = self._groups.get(memory_group(params))
        fits, oom_from = (group.fits, group.oom_from) if group else ({}, None)  # derived from the group's cells: once here
        limit = self._limit_after_oom(params, oom_from, ceiling_bytes) if oom_from and not fits else None
        if self.dims is None and len(fits) == 1 and self._sibling_slope(params, self._activation_slope(params)) is None:
            # Without model dims, one point cannot split static from activation memory: grow at
            # most 4x past it, so the next probe measures the slope instead of running out of memory.
            limit = 4 * max(fits)
        for batch in sorted(batch_sizes):
            if limit is not None and batch > limit:
                break
            candidate = TrialParams.from_dict({**params.to_dict(), "per_device_train_batch_size": batch})
            if self.known_outcome(candidate, ceiling_bytes):
                break
            if self.known_to_fit(candidate, ceiling_bytes):
                best = batch
                continue
            predicted = self.predict(candidate)
            if predicted is None or predicted > ceiling_bytes:
                break
            best = batch
        return best


def median_error_beyond(ratio: float, log_sd: float) -> float:
    """The median of the model's error factor given that it is at least ``ratio``: the log error a
    Student-t of 3 degrees of freedom and scale ``log_sd`` (heavy-tailed: a miss far beyond the
    model's uncertainty says the model is wrong there, not by how little)."""
    low = math.log(ratio) / log_sd
    target = (1.0 + _t3_cdf(low)) / 2
    high = max(low, 1.0)
    while _t3_cdf(high) < target:
        high *= 2
    for _ in range(60):  # bisection to well under a batch size's resolution
        middle = (low + high) / 2
        low, high = (middle, high) if _t3_cdf(middle) < target else (low, middle)
    return max(ratio, math.exp(log_sd * high))


def _t3_cdf(t: float) -> float:
    """Student's t distribution with 3 degrees of freedom: its cumulative distribution at ``t``."""
    x = t / math.sqrt(3.0)
    return 0.5 + (x / (1.0 + x * x) + math.atan(x)) / math.pi


def _line(fits: dict[int, int]) -> tuple[float, float] | None:
    """(intercept, slope) of a group's peak against batch size (``_GroupData.fits``), from two or more batch sizes."""
    if len(fits) < 2:
        return None
    b = np.array(list(fits), dtype=float)
    m = np.array(list(fits.values()), dtype=float)
    slope, intercept = np.polyfit(b, m, 1)
    return (float(intercept), float(slope)) if slope > 0 else None
