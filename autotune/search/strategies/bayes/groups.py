"""Memory groups and what the probes measured about them.

A memory group is one combination of the values that decide a configuration's static memory and
activations per sample (:data:`~autotune.search.memory.GROUP_KEYS`); within a group the peak is a
line in the batch size. This module relates groups to one another (which needs no less memory,
which store alike, how far an OOM in one says something about another) and collects the measured
peaks and OOMs (:class:`MemoryEvidence`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.params import TrialParams, mixed_precision_dtype
from autotune.records import Probe, ProbeStatus
from autotune.search.memory import GROUP_KEYS, needs_no_less_memory
from autotune.search.memory_prior import optimizer_state_rank
from autotune.search.strategies.surrogate import ACCUM, BATCH, Grid
from autotune.sharding import needs_no_less_device_memory


def precision_class(value: Any) -> str:
    """How a precision stores: ``amp`` (16-bit, bf16+tf32 stores as bf16) or ``fp32`` (fp32 and tf32)."""
    return "amp" if mixed_precision_dtype(str(value)) is not None else "fp32"


def _needs_no_less(dim: str, x: Any, y: Any) -> bool:
    """Value ``x`` of a memory-group dimension needs at least the memory of ``y`` (by construction)."""
    if x == y:
        return True
    if dim == "precision":
        return precision_class(x) == precision_class(y)
    if dim == "optim":
        return optimizer_state_rank(x) >= optimizer_state_rank(y)
    if dim == "gradient_checkpointing":
        return bool(y) and not bool(x)
    if dim == "attn_implementation":
        return x == "eager"  # the only kernel that stores the attention scores
    if dim == "sharding":
        return needs_no_less_device_memory(str(x), str(y))
    return False  # compile modes: no order that always holds


def _activation_ratio(dim: str, x: Any, y: Any) -> float:
    """A plausible lower bound of activations per sample with ``x`` over those with ``y``; 0 where
    ``x`` may hold less static memory (so no bound on the total follows)."""
    if x == y:
        return 1.0
    if dim == "precision":
        return 1.0 if precision_class(x) == precision_class(y) else 0.0
    if dim in ("optim", "sharding"):  # the same activations; the static part orders as the state does
        return 1.0 if _needs_no_less(dim, x, y) else 0.0
    if dim == "attn_implementation":
        return 1.0 if x == "eager" else (0.3 if y == "eager" else 1.0)  # fused kernels store alike
    if dim == "torch_compile":
        if "off" in (x, y):
            return 0.7  # compiling fuses away some activations
        return 1.0 if "max-autotune" in str(x) else 0.95  # max-autotune's CUDA graphs keep their own pool
    if dim == "gradient_checkpointing":
        return 1.0 if not x else 0.05
    return 0.5


def _pairwise(grid: Grid, dims: tuple[str, ...], codes: np.ndarray, relation: Any) -> np.ndarray:
    """``relation`` of every two groups, the product over the dimensions (groups x groups)."""
    table = np.ones((len(codes), len(codes)))
    for d, dim in enumerate(dims):
        values = grid.values[dim]
        per_dim = np.array([[relation(dim, x, y) for y in values] for x in values])
        table = table * per_dim[codes[:, d][:, None], codes[:, d][None, :]]
    return table


@dataclass
class Groups:
    """The memory groups of a grid (one per combination of :data:`GROUP_KEYS` values), in C order."""

    dims: tuple[str, ...]
    codes: np.ndarray  # groups x dims: value index per dimension
    values: list[tuple[Any, ...]]
    dominance: list[np.ndarray]  # per dim: [i, j] = value i needs no less memory than value j
    activation_ratio: np.ndarray  # [g, h]: a lower bound of g's activations per sample over h's (0: g's static may be smaller)
    _masks: dict[tuple[int, bool], np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, grid: Grid) -> Groups:
        dims = tuple(n for n in grid.names if n in GROUP_KEYS)
        sizes = [len(grid.values[d]) for d in dims]
        codes = np.array(list(np.ndindex(*sizes)), dtype=int).reshape(-1, len(dims))
        values = [tuple(grid.values[d][i] for d, i in zip(dims, row)) for row in codes]
        dominance = [np.array([[_needs_no_less(d, x, y) for y in grid.values[d]] for x in grid.values[d]]) for d in dims]
        ratio = _pairwise(grid, dims, codes, _activation_ratio)
        return cls(dims, codes, values, dominance, ratio)

    def index(self, params: TrialParams, grid: Grid) -> int:
        codes = [grid.values[d].index(getattr(params, d)) for d in self.dims]
        return int(np.ravel_multi_index(tuple(codes), [len(grid.values[d]) for d in self.dims])) if codes else 0

    def needing_no_less_than(self, group: int) -> np.ndarray:
        return self._dominated(group, no_less=True)

    def needing_no_more_than(self, group: int) -> np.ndarray:
        return self._dominated(group, no_less=False)

    def _dominated(self, group: int, *, no_less: bool) -> np.ndarray:
        """The groups needing no less (``no_less``), or no more, memory than ``group`` (read-only, kept)."""
        mask = self._masks.get((group, no_less))
        if mask is None:
            mask = np.ones(len(self.codes), dtype=bool)
            for d, table in enumerate(self.dominance):
                mask &= table[self.codes[:, d], self.codes[group, d]] if no_less else table[self.codes[group, d], self.codes[:, d]]
            mask.setflags(write=False)
            self._masks[(group, no_less)] = mask
        return mask


@dataclass
class MemoryEvidence:
    """Measured peaks and OOMs per memory group, spread to the groups they say something about.

    ``ruled_out[g, a, j]``: an OOM, or a peak over the ceiling, at a batch and accumulation (indices
    j and a; one accumulation index where the grid has none) needing no more memory
    (:func:`~autotune.search.memory.needs_no_less_memory`) in a group needing no more memory than g.
    ``known_fit[g, a, j]``: a peak under the ceiling at one needing no less in a group needing no
    less (this wins over another group's OOM; g's own OOM wins over it, as in
    :meth:`~autotune.search.memory.MemoryModel.known_outcome`).
    """

    fits: dict[int, dict[int, int]]  # group -> batch index -> measured peak
    over: list[tuple[int, int]]  # (group, batch index) out of memory or measured over the ceiling
    ruled_out: np.ndarray  # groups x accumulations x batches
    known_fit: np.ndarray

    @classmethod
    def of(cls, groups: Groups, grid: Grid, history: Iterable[Probe], ceiling: int) -> MemoryEvidence:
        batches = tuple(grid.values[BATCH])
        accums: tuple[int, ...] = tuple(grid.values[ACCUM]) if ACCUM in grid.names else (1,)
        fits: dict[int, dict[int, int]] = {}
        over: list[tuple[int, int]] = []
        ruled_out = np.zeros((len(groups.codes), len(accums), len(batches)), dtype=bool)
        known_fit, own = np.zeros_like(ruled_out), np.zeros_like(ruled_out)
        for probe in history:
            batch, accum = probe.params.per_device_train_batch_size, probe.params.gradient_accumulation_steps if ACCUM in grid.names else 1
            if batch not in batches or accum not in accums:
                continue
            group = groups.index(probe.params, grid)
            j = batches.index(batch)
            if probe.result.ok and probe.result.peak_mem_bytes is not None:
                peak = int(probe.result.peak_mem_bytes)
                mine = fits.setdefault(group, {})
                mine[j] = max(mine.get(j, 0), peak)
                if peak <= ceiling:
                    known_fit[groups.needing_no_more_than(group)] |= _cells(accums, batches, batch, accum, no_less=False)
                    continue
            elif probe.result.status is not ProbeStatus.OOM:
                continue
            over.append((group, j))  # out of memory, or measured over the ceiling
            cells = _cells(accums, batches, batch, accum, no_less=True)
            ruled_out[groups.needing_no_less_than(group)] |= cells
            own[group] |= cells
        return cls(fits, over, (ruled_out & ~known_fit) | own, known_fit & ~own)

    @staticmethod
    def cell(grid: Grid, params: TrialParams) -> tuple[int, int]:
        """``params``' (accumulation, batch) indices into the second and third axes."""
        a = grid.values[ACCUM].index(params.gradient_accumulation_steps) if ACCUM in grid.names else 0
        return a, grid.values[BATCH].index(params.per_device_train_batch_size)


@functools.lru_cache(maxsize=4096)
def _cells(accums: tuple[int, ...], batches: tuple[int, ...], batch: int, accum: int, *, no_less: bool) -> np.ndarray:
    """An accumulations x batches mask: the cells needing no less memory than ``batch`` x ``accum``
    (``no_less``), or no more (read-only, kept)."""
    mask = np.array([[needs_no_less_memory(b, a, batch, accum) if no_less else needs_no_less_memory(batch, accum, b, a) for b in batches]
                     for a in accums], dtype=bool)
    mask.setflags(write=False)
    return mask
