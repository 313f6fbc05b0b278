"""Log samples/s through a training step's time: ``A x (overhead + b x per_sample) + optimizer_step``.

For ``A`` micro-batches of ``b`` samples, ``log samples/s = log(A b) - logsumexp(L_overhead,
L_per_sample, L_step) + residual``; each ``L`` is a sum of per-value effects (precision, attention,
compile mode and checkpointing on the micro-step; the optimizer on its step) plus its offset
(``log A``, ``log A + log b``, 0), and the residual holds small terms that do not split that way. So a
dimension's gain depends on where the batch sits on its curve, and the saturation point is learnt.
A model may add parts to the step's time and a *cap* (the loader's rate) joined by a soft minimum;
the posterior is then bimodal where the data allow both readings (the precisions tie because the
loader sets the pace, or because they compute alike), so the mode is also sought from the lowest cap
the measurements allow.

Inference is Laplace's: the mode by damped Gauss-Newton under Gaussian priors, the covariance from
the Hessian there; over the grid the mean is exact and the variance ``J S J'`` is summed over pairs of
feature blocks, never building the grid's Jacobian. The sd is scaled by :data:`SD_CALIBRATION` so that
the model's errors on its own probes match it (``python -m bench.trace 0-99 --calibration``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autotune.params import TrialParams
from autotune.search.strategies.surrogate import Block, Grid, TermSum, _merged

TERMS = ("overhead", "per_sample", "step")  # the parts of a step's time, in the log-sum-exp (a model may add more)
LINEAR = "residual"  # added to log samples/s directly
CAP = "cap"  # a rate the step's throughput cannot pass (the loader's, with its workers), joined by a soft minimum
CAP_SHARPNESS = 10.0  # the soft minimum's: log(2) / 10 under the lower of the two where they meet
OFF = 60.0  # a log offset that takes a part out: a term at -OFF, a cap at +OFF
SCALE = "scale"  # the feature every term shares: the log seconds of one sample's work at the base values
_GN_ITERATIONS = 30
_GN_TOLERANCE = 1e-7
SD_CALIBRATION = 0.6  # the posterior sd, times this, matches the model's errors (module text)


@dataclass
class _Placed:
    """A block with the global index of each of its features."""

    block: Block
    index: np.ndarray
    tensor32: np.ndarray


class StepTimeSurrogate:
    """Laplace-approximated Bayesian regression of log samples/s through a step-time model.

    ``components`` maps each of :data:`TERMS` and :data:`LINEAR` to its feature blocks; a feature
    named alike in two components is one parameter (the intercepts of the three terms share one
    scale). ``offsets`` maps each term to a grid-broadcastable array added to it (``log A``, ``log A
    + log b``, 0), and ``base`` is ``log(A b)``.
    """

    def __init__(self, grid: Grid, components: dict[str, list[Block]], offsets: dict[str, np.ndarray], base: np.ndarray,
                 cap_offset: np.ndarray | None = None) -> None:
        self.grid = grid
        names: list[str] = []
        means: dict[str, float] = {}
        sds: dict[str, float] = {}
        self.components: dict[str, list[_Placed]] = {}
        self.terms = tuple(offsets)  # TERMS, and any other part of the step's time the model adds
        self.cap_offset = None if cap_offset is None else np.asarray(cap_offset, dtype=float)
        self.offset_names = (*self.terms, CAP) if cap_offset is not None else self.terms  # what carries an offset per configuration
        for component in (*self.terms, LINEAR, *self.offset_names[len(self.terms):]):
            placed = []
            for block in _merged(grid, components.get(component, [])):
                for name, mean, sd in zip(block.names, block.prior_mean, block.prior_sd):
                    if name not in means:
                        names.append(name)
                        means[name], sds[name] = float(mean), float(sd)
                placed.append(_Placed(block, np.array([names.index(n) for n in block.names]), block.tensor.astype(np.float32)))
            self.components[component] = placed
        self.names = tuple(names)
        self.n_features = len(names)
        self.prior_mean = np.array([means[n] for n in names])
        self.prior_sd = np.array([sds[n] for n in names])
        self.offsets = {t: np.asarray(offsets[t], dtype=float) for t in self.terms}
        self.base = np.asarray(base, dtype=float)
        self.mean = self.prior_mean.copy()
        self.cov = np.diag(self.prior_sd**2)
        self._mode: np.ndarray | None = None  # the last mode found: the next fit starts there
        self._collapse = TermSum(grid.shape)
        self._row_cache: dict[tuple[int, ...], tuple[dict[str, np.ndarray], dict[str, float], float]] = {}

    def index_of(self, name: str) -> int:
        return self.names.index(name)

    def set_scale(self, params: Sequence[TrialParams], targets: Sequence[float]) -> None:
        """Centre the shared scale's prior so that the prior's predictions match the measurements' median.

        The scale is in all three terms, so it shifts every prediction by minus itself."""
        scale = self.index_of(SCALE)
        self.prior_mean[scale] = 0.0
        if len(targets):
            rows, offsets, base = self._rows(params)
            value, _ = self._evaluate(self.prior_mean, rows, offsets, base, capped=False)
            self.prior_mean[scale] = float(np.median(value - np.asarray(targets, dtype=float)))

    # ------------------------------------------------------------------ one configuration at a time

    def _rows(self, params: Sequence[TrialParams], compute: Sequence[bool] = ()) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
        """Per component, the feature rows (configurations x parameters); per term, its offsets; the base.
        Rows flagged in ``compute`` are the compute part alone: without the cap and the terms beyond :data:`TERMS`."""
        cached = [self._row(self.grid.codes(p)) for p in params]
        rows = {c: np.array([row[c] for row, _, _ in cached]).reshape(len(params), self.n_features) for c in self.components}
        picked = {name: np.array([offsets[name] for _, offsets, _ in cached], dtype=float) for name in self.offset_names}
        base = np.array([b for _, _, b in cached], dtype=float)
        alone = np.zeros(len(params), dtype=bool)
        alone[:len(compute)] = compute
        for name, offset in picked.items():
            if name not in TERMS:
                offset[alone] = OFF if name == CAP else -OFF
        return rows, picked, base

    def _row(self, codes: tuple[int, ...]) -> tuple[dict[str, np.ndarray], dict[str, float], float]:
        """One configuration's feature row per component, its offset per term (and the cap's), and its base (kept per configuration)."""
        cached = self._row_cache.get(codes)
        if cached is None:
            rows = {c: np.zeros(self.n_features) for c in self.components}
            for component, placed in self.components.items():
                for item in placed:
                    rows[component][item.index] += Grid.at(item.block.tensor, codes)
            offsets = {t: float(Grid.at(self.offsets[t], codes)) for t in self.terms}
            if self.cap_offset is not None:
                offsets[CAP] = float(Grid.at(self.cap_offset, codes))
            cached = self._row_cache[codes] = (rows, offsets, float(Grid.at(self.base, codes)))
        return cached

    def _evaluate(self, theta: np.ndarray, rows: dict[str, np.ndarray], offsets: dict[str, np.ndarray], base: np.ndarray,
                  capped: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Predictions and their Jacobian at ``theta`` (``capped``: past the cap's soft minimum, where the model has one)."""
        logs = np.stack([rows[t] @ theta + offsets[t] for t in self.terms])
        top = logs.max(axis=0)
        weights = np.exp(logs - top)
        total = weights.sum(axis=0)
        shares = weights / total
        value = base - (top + np.log(total)) + rows[LINEAR] @ theta
        jacobian = rows[LINEAR] - sum(shares[k][:, None] * rows[t] for k, t in enumerate(self.terms))
        if capped and CAP in offsets:
            cap = rows[CAP] @ theta + offsets[CAP]
            below = _below(value, cap)
            value = _soft_min(value, cap)
            jacobian = below[:, None] * jacobian + (1.0 - below)[:, None] * rows[CAP]
        return value, jacobian

    def fit_params(self, params: Sequence[TrialParams], targets: np.ndarray, noise_var: np.ndarray, compute: Sequence[bool] = ()) -> None:
        """The posterior mode and its Laplace covariance given measured log samples/s (where ``compute``
        flags a row: of the compute part alone, see :meth:`_rows`)."""
        precision_prior = 1.0 / self.prior_sd**2
        theta = self.prior_mean.copy() if self._mode is None or len(self._mode) != self.n_features else self._mode.copy()
        if len(targets) == 0:
            self.mean, self.cov = self.prior_mean.copy(), np.diag(self.prior_sd**2)
            return
        rows, offsets, base = self._rows(params, compute)
        weights = 1.0 / np.asarray(noise_var, dtype=float)
        targets = np.asarray(targets, dtype=float)

        def objective(t: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
            value, jacobian = self._evaluate(t, rows, offsets, base)
            residual = targets - value
            return 0.5 * float(weights @ residual**2 + precision_prior @ (t - self.prior_mean) ** 2), residual, jacobian

        theta, loss, jacobian = _gauss_newton(objective, theta, weights, precision_prior, self.prior_mean)
        cap = self._binding_cap(rows, offsets, targets)
        if cap is not None and np.all(_below(targets, rows[CAP] @ theta + offsets[CAP]) > 0.9):
            # The cap binds nowhere: a mode where the loader sets the pace is far, past a flat
            # stretch, so it is searched from the lowest cap the measurements allow as well.
            start = theta.copy()
            start[cap[0]] = cap[1]
            other = _gauss_newton(objective, start, weights, precision_prior, self.prior_mean)
            if other[1] < loss:
                theta, loss, jacobian = other
        hessian = (jacobian * weights[:, None]).T @ jacobian + np.diag(precision_prior)
        chol = np.linalg.cholesky(hessian)
        inverse = np.linalg.inv(chol)
        self.cov = inverse.T @ inverse
        self.mean = theta
        self._mode = theta.copy()

    def _binding_cap(self, rows: dict[str, np.ndarray], offsets: dict[str, np.ndarray], targets: np.ndarray) -> tuple[int, float] | None:
        """The cap's feature and its value where the cap meets the highest measurement it covers (``None``: no cap, or none covered)."""
        if self.cap_offset is None or CAP not in self.names:
            return None
        feature = self.index_of(CAP)
        covered = (rows[CAP][:, feature] > 0) & (offsets[CAP] < OFF)
        return (feature, float(np.max(targets[covered] - offsets[CAP][covered]))) if covered.any() else None

    def predict_params(self, params: Sequence[TrialParams]) -> tuple[np.ndarray, np.ndarray]:
        rows, offsets, base = self._rows(params)
        value, jacobian = self._evaluate(self.mean, rows, offsets, base)
        var = np.einsum("ij,jk,ik->i", jacobian, self.cov, jacobian)
        return value, SD_CALIBRATION * np.sqrt(np.maximum(var, 0.0))

    # ------------------------------------------------------------------ the whole grid

    def _sum(self, placed: list[_Placed], vector: np.ndarray) -> np.ndarray:
        return self._collapse([p.tensor32 @ vector[p.index] for p in placed])

    def predict_grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation of log samples/s at every grid point (grid-shaped)."""
        theta32 = self.mean.astype(np.float32)
        logs = [self._sum(self.components[t], theta32) + self.offsets[t].astype(np.float32) for t in self.terms]
        top = functools.reduce(np.maximum, logs)
        exps = [np.exp(log - top) for log in logs]
        total = functools.reduce(np.add, exps)
        shares = [e / total for e in exps]
        mean = self.base.astype(np.float32) - (top + np.log(total)) + self._sum(self.components[LINEAR], theta32)
        # J = F_linear - sum_k share_k F_k, and past a cap below x J + (1 - below) F_cap;
        # Var = sum over pairs of components of c_k c_l (F_k S F_l').
        coefficient: dict[str, np.ndarray | None] = {LINEAR: None, **{t: -shares[k] for k, t in enumerate(self.terms)}}
        if self.cap_offset is not None:
            cap = self._sum(self.components[CAP], theta32) + self.cap_offset.astype(np.float32)
            below = _below(mean, cap).astype(np.float32)
            mean = _soft_min(mean, cap).astype(np.float32)
            coefficient = {name: below if c is None else below * c for name, c in coefficient.items()}
            coefficient[CAP] = 1.0 - below
        cov32 = self.cov.astype(np.float32)
        names = list(coefficient)
        var = np.zeros(self.grid.shape, dtype=np.float32)
        for i, a in enumerate(names):
            for b in names[i:]:
                terms = []
                for pa in self.components[a]:
                    for pb in self.components[b]:
                        terms.append(((pa.tensor32 @ cov32[np.ix_(pa.index, pb.index)]) * pb.tensor32).sum(-1))
                if not terms:
                    continue
                part = self._collapse(terms) * (1.0 if a == b else 2.0)
                for c in (coefficient[a], coefficient[b]):
                    if c is not None:
                        part = part * c
                var += part
        return mean, np.float32(SD_CALIBRATION) * np.sqrt(np.maximum(var, 0.0))


def _gauss_newton(objective: Any, theta: np.ndarray, weights: np.ndarray, precision_prior: np.ndarray,
                  prior_mean: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """Damped Gauss-Newton from ``theta`` on ``objective`` (loss, residuals, Jacobian): the mode, its loss and Jacobian."""
    loss, residual, jacobian = objective(theta)
    for _ in range(_GN_ITERATIONS):
        hessian = (jacobian * weights[:, None]).T @ jacobian + np.diag(precision_prior)
        gradient = jacobian.T @ (weights * residual) - precision_prior * (theta - prior_mean)
        step = np.linalg.solve(hessian, gradient)
        scale, improved = 1.0, False
        while scale > 1e-4:
            candidate = theta + scale * step
            new_loss, new_residual, new_jacobian = objective(candidate)
            if new_loss <= loss:
                improved = True
                break
            scale *= 0.5
        if not improved:
            break
        done = loss - new_loss < _GN_TOLERANCE * max(1.0, loss)
        theta, loss, residual, jacobian = candidate, new_loss, new_residual, new_jacobian
        if done:
            break
    return theta, loss, jacobian


def _soft_min(value: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """The lower of ``value`` and ``cap`` (logs), smoothly (:data:`CAP_SHARPNESS`)."""
    return -np.logaddexp(-CAP_SHARPNESS * value, -CAP_SHARPNESS * cap) / CAP_SHARPNESS


def _below(value: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """How much of the soft minimum follows ``value``: 1 well below the cap, 0 well above it."""
    return 0.5 * (1.0 + np.tanh(0.5 * CAP_SHARPNESS * (cap - value)))
