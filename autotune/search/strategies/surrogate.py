"""The grid of a search space and the machinery a model over it is built from.

:class:`Grid` maps configurations to grid indices and evaluates functions of a few dimensions as
broadcastable arrays. A model's features come in blocks (:class:`Block`: features depending on the same
few dimensions, a tensor over those axes), so predictions over the whole grid (~90,000 points) are
sums of small tensors broadcast into the grid (:class:`TermSum`), never a grid-sized feature matrix.
Normal-distribution helpers (CDF, expected improvement) close it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autotune.params import TrialParams
from autotune.space import SearchSpace

BATCH = "per_device_train_batch_size"
ACCUM = "gradient_accumulation_steps"


class Grid:
    """The points of a space as an n-dimensional array, one axis per free parameter."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.names: tuple[str, ...] = tuple(space.free_params)
        self.values: dict[str, tuple[Any, ...]] = {n: tuple(space.choices[n]) for n in self.names}
        self.shape: tuple[int, ...] = tuple(len(self.values[n]) for n in self.names)
        self.size = int(np.prod(self.shape))
        self._codes = {n: {v: i for i, v in enumerate(self.values[n])} for n in self.names}
        self.axis = {n: i for i, n in enumerate(self.names)}

    def codes(self, params: TrialParams) -> tuple[int, ...]:
        """The index of each of a grid configuration's values along its axis."""
        return tuple(self._codes[n][getattr(params, n)] for n in self.names)

    @staticmethod
    def at(array: np.ndarray, codes: tuple[int, ...]) -> Any:
        """A grid-broadcastable array's entry at a point (axes of size 1 are read at 0)."""
        return array[tuple(c if array.shape[i] > 1 else 0 for i, c in enumerate(codes))]

    def flat_index(self, params: TrialParams) -> int | None:
        codes = []
        for name in self.names:
            code = self._codes[name].get(getattr(params, name))
            if code is None:
                return None
            codes.append(code)
        return int(np.ravel_multi_index(tuple(codes), self.shape))

    def params_at(self, flat: int) -> TrialParams:
        codes = np.unravel_index(flat, self.shape)
        return self.space.complete({n: self.values[n][int(c)] for n, c in zip(self.names, codes)})

    def accumulation(self, batch: Any, accum: Any) -> int:
        """The accumulation of a point (derived from the batch under a fixed effective batch size)."""
        derived = None if ACCUM in self.names else self.space.accumulation_for(int(batch))
        if derived is None:
            return int(accum if accum is not None else 1)
        return derived

    def broadcast_shape(self, dims: Sequence[str]) -> tuple[int, ...]:
        """The grid's shape with 1 on every axis not in ``dims``."""
        return tuple(self.shape[i] if n in dims else 1 for i, n in enumerate(self.names))

    def along(self, dims: Sequence[str], function: Callable[..., float]) -> np.ndarray:
        """``function(**values of dims)`` at every combination, as an array broadcastable to the grid."""
        dims = [d for d in self.names if d in dims]
        out = np.empty([len(self.values[d]) for d in dims], dtype=float)
        for index in np.ndindex(*out.shape):
            out[index] = function(**{d: self.values[d][i] for d, i in zip(dims, index)})
        return out.reshape(self.broadcast_shape(dims))


@dataclass
class Block:
    """Features that depend on the same few dimensions: a tensor over those axes, features last."""

    dims: tuple[str, ...]
    names: tuple[str, ...]
    tensor: np.ndarray  # grid.broadcast_shape(dims) + (n_features,)
    prior_mean: np.ndarray
    prior_sd: np.ndarray


FeatureFn = Callable[[dict[str, Any]], list[float]]


class BlockBuilder:
    """Collects feature blocks for a grid; each block is evaluated once per combination of its dims."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.blocks: list[Block] = []

    def add(self, dims: Sequence[str], names: Sequence[str], function: FeatureFn, mean: Sequence[float] | float, sd: Sequence[float] | float) -> None:
        dims = tuple(d for d in self.grid.names if d in dims)
        n = len(names)
        if n == 0:
            return
        sizes = [len(self.grid.values[d]) for d in dims]
        tensor = np.empty([*sizes, n], dtype=float)
        for index in np.ndindex(*sizes):
            tensor[index] = function({d: self.grid.values[d][i] for d, i in zip(dims, index)})
        tensor = tensor.reshape((*self.grid.broadcast_shape(dims), n))
        means = np.broadcast_to(np.asarray(mean, dtype=float), (n,)).copy()
        sds = np.broadcast_to(np.asarray(sd, dtype=float), (n,)).copy()
        self.blocks.append(Block(dims, tuple(names), tensor, means, sds))


def _merged(grid: Grid, blocks: list[Block]) -> list[Block]:
    """Blocks over a subset of another block's dims folded into it: fewer, larger blocks make fewer
    pairs of blocks to sum over (the cost of a prediction is per pair, not per feature)."""
    blocks = sorted(blocks, key=lambda b: -len(b.dims))
    merged: list[Block] = []
    for block in blocks:
        host = next((i for i, m in enumerate(merged) if set(block.dims) <= set(m.dims)), None)
        if host is None:
            merged.append(block)
            continue
        target = merged[host]
        shape = target.tensor.shape[:-1]
        tensor = np.concatenate([target.tensor, np.broadcast_to(block.tensor, (*shape, block.tensor.shape[-1]))], axis=-1)
        merged[host] = Block(target.dims, target.names + block.names, tensor, np.concatenate([target.prior_mean, block.prior_mean]),
                             np.concatenate([target.prior_sd, block.prior_sd]))
    return merged


class TermSum:
    """The sum of broadcastable terms as float32 over a grid's shape, the small terms added into the
    larger ones that cover their axes before any is broadcast (the plan cached per list of shapes)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self._plans: dict[tuple[tuple[int, ...], ...], tuple[list[tuple[int, int]], list[int]]] = {}

    def __call__(self, terms: list[np.ndarray]) -> np.ndarray:
        shapes = tuple(t.shape for t in terms)
        plan = self._plans.get(shapes)
        if plan is None:
            plan = self._plans[shapes] = _collapse_plan(shapes)
        hosts, roots = plan
        terms = list(terms)
        for source, target in hosts:
            terms[target] = terms[target] + terms[source]
        out = np.zeros(self.shape, dtype=np.float32)
        for root in roots:
            out += terms[root]
        return out


def _collapse_plan(shapes: tuple[tuple[int, ...], ...]) -> tuple[list[tuple[int, int]], list[int]]:
    """Which term to add into which (smallest first, into the smallest larger one covering its axes), and which remain."""
    order = sorted(range(len(shapes)), key=lambda i: int(np.prod(shapes[i])))
    hosts, roots = [], []
    for position, i in enumerate(order):
        host = next((j for j in order[position + 1:] if all(a == b or a == 1 for a, b in zip(shapes[i], shapes[j]))), None)
        if host is None:
            roots.append(i)
        else:
            hosts.append((i, host))
    return hosts, roots


def normal_cdf(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz & Stegun 7.1.26 for erf, absolute error < 1.5e-7)."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def normal_pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def expected_improvement(mean: np.ndarray, sd: np.ndarray, best: float | np.ndarray) -> np.ndarray:
    """E[max(Y - best, 0)] for Y ~ N(mean, sd^2)."""
    sd = np.maximum(sd, 1e-9)
    z = (mean - best) / sd
    return sd * (z * normal_cdf(z) + normal_pdf(z))
