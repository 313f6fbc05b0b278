"""What depends on the space only (the grid, the throughput model's features, the memory groups),
the caches that live for one history, and the grid plumbing between a memory group's cells and the
whole grid."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.params import TrialParams
from autotune.records import Probe
from autotune.search.memory_prior import optimizer_state_rank
from autotune.search.strategies.base import SearchState
from autotune.search.strategies.bayes.features import step_time_surrogate
from autotune.search.strategies.bayes.groups import Groups
from autotune.search.strategies.steptime import CAP, StepTimeSurrogate
from autotune.search.strategies.surrogate import ACCUM, BATCH, Grid
from autotune.space import SearchSpace


@dataclass
class Context:
    """The grid of one space, its throughput model and memory groups, and per-history caches."""

    grid: Grid
    surrogate: StepTimeSurrogate
    groups: Groups
    batch_values: np.ndarray  # grid-broadcastable
    accum_values: np.ndarray  # grid-broadcastable (derived from the batch under a fixed effective batch size)
    other_axes: tuple[int, ...]  # the grid axes that are not memory-group dimensions
    lines: dict[int, np.ndarray | None] = field(default_factory=dict)  # per group: predicted peaks by accumulation x batch, for one history length
    lines_at: int = -1
    p_fit_rows: dict[int, np.ndarray] = field(default_factory=dict)  # per group, for the evidence, ceiling and lines in p_fit_for
    p_fit_for: tuple[Any, ...] = (None, -1, -1)
    p_ok: dict[str, tuple[tuple[Any, ...], np.ndarray]] = field(default_factory=dict)  # per kind of failure, its last prediction by its key
    flat_of_key: dict[tuple[Any, ...], int | None] = field(default_factory=dict)
    group_params: dict[int, TrialParams] = field(default_factory=dict)  # per group, a configuration of it
    cap: int | None = None  # the surrogate's feature of one loader worker's rate, if the space has workers
    user_space: np.ndarray | bool = True  # grid-broadcastable: no value only the baseline's (SearchSpace.reference_values)
    loader_cores: int | None = None  # what the throughput model's loader prior was built with

    @classmethod
    def of(cls, space: SearchSpace, loader_cores: int | None = None) -> Context:
        """``loader_cores``: the CPU cores one probe process's loader workers have (None: unknown)."""
        grid = Grid(space)

        def accum_of(v: dict[str, Any]) -> int:
            return grid.accumulation(v.get(BATCH, 1), v.get(ACCUM))

        accum_dims = (ACCUM,) if ACCUM in grid.names else ((BATCH,) if space.effective_batch_size else ())
        accum_values = sorted({grid.accumulation(b, a) for b in grid.values[BATCH] for a in grid.values.get(ACCUM, (1,))})
        batch_values = grid.along((BATCH,), lambda **v: float(v[BATCH]))
        accum_grid = grid.along(accum_dims, lambda **v: float(accum_of(v))) if accum_dims else np.ones(grid.broadcast_shape(()))
        surrogate = step_time_surrogate(grid, accum_dims, accum_values, accum_of, batch_values, accum_grid, loader_cores)
        groups = Groups.of(grid)
        other_axes = tuple(i for i, n in enumerate(grid.names) if n not in groups.dims)
        context = cls(grid, surrogate, groups, batch_values, accum_grid, other_axes, loader_cores=loader_cores)
        if CAP in surrogate.names:
            context.cap = surrogate.index_of(CAP)
        for name, values in space.reference_values.items():
            if name in grid.names:
                searched = np.array([v not in values for v in grid.values[name]]).reshape(grid.broadcast_shape((name,)))
                context.user_space = context.user_space & searched
        return context

    def refresh_lines(self, stamp: int) -> None:
        """Forget the memory model's predictions when the history (of length ``stamp``) changed."""
        if self.lines_at != stamp:
            self.lines, self.lines_at = {}, stamp

    def params_of_group(self, group: int) -> TrialParams:
        """A configuration of ``group`` (its other values: the grid's first)."""
        if group not in self.group_params:
            self.group_params[group] = self.grid.params_at(0).replace(**dict(zip(self.groups.dims, self.groups.values[group])))
        return self.group_params[group]

    def accumulations(self) -> list[Any]:
        """The accumulation axis of a memory group's blocks (:mod:`.fit`): the grid's values, or one (none, or derived from the batch)."""
        return list(self.grid.values[ACCUM]) if ACCUM in self.grid.names else [None]

    def memory_cells(self, block: np.ndarray) -> np.ndarray:
        """An accumulation x batch block of one group as its cells' shape (the other axes of size 1)."""
        names = [self.grid.names[a] for a in self.other_axes]
        if ACCUM in names and names.index(ACCUM) > names.index(BATCH):
            block = block.T
        return block.reshape(tuple(self.grid.shape[a] if self.grid.names[a] in (ACCUM, BATCH) else 1 for a in self.other_axes))

    def group_cells(self, group: int) -> tuple[Any, ...]:
        """An index into grid-shaped arrays selecting one memory group (its other axes kept)."""
        codes = dict(zip(self.groups.dims, self.groups.codes[group]))
        return tuple(int(codes[n]) if n in codes else slice(None) for n in self.grid.names)

    def flat_of(self, group: int, local: int) -> int:
        """The flat grid index of cell ``local`` (flat over the other axes) of ``group``."""
        grid = self.grid
        codes = dict(zip(self.groups.dims, self.groups.codes[group]))
        other = np.unravel_index(local, [grid.shape[a] for a in self.other_axes])
        other_codes = dict(zip([grid.names[a] for a in self.other_axes], other))
        full = tuple(int(codes[n]) if n in codes else int(other_codes[n]) for n in grid.names)
        return int(np.ravel_multi_index(full, grid.shape))

    def batch_grid(self, table: np.ndarray) -> np.ndarray:
        """A groups x accumulations x batches table (:class:`MemoryEvidence`'s) as a grid-broadcastable array."""
        grid = self.grid
        dims = (*self.groups.dims, *((ACCUM,) if ACCUM in grid.names else ()), BATCH)
        shaped = table.reshape([len(grid.values[d]) for d in dims])
        order = np.argsort([grid.axis[d] for d in dims])
        return np.broadcast_to(shaped.transpose(order).reshape(grid.broadcast_shape(dims)), grid.shape)

    def seen_flat(self, state: SearchState, history: list[Probe]) -> list[int]:
        """Grid indices of what ran or was pruned: never proposed again."""
        keys = [p.params.key() for p in history]
        if isinstance(state.seen, Iterable):
            keys += list(state.seen)
        indices = []
        for key in keys:
            if key not in self.flat_of_key:
                self.flat_of_key[key] = self.grid.flat_index(TrialParams.from_key(key))
            index = self.flat_of_key[key]
            if index is not None:
                indices.append(index)
        return indices

    def frugal_mask(self, *, any_batch: bool = False) -> np.ndarray:
        """Before anything ran: checkpointing, the optimizer with the least state, the smallest batch
        (``any_batch``: at any batch size, once the smallest is being probed elsewhere: the next
        workers bracket the memory frontier instead of asking again whether the smallest runs)."""
        grid = self.grid
        mask = np.ones(grid.shape, dtype=bool)
        if True in grid.values["gradient_checkpointing"]:
            mask = mask & np.array([v is True for v in grid.values["gradient_checkpointing"]]).reshape(grid.broadcast_shape(("gradient_checkpointing",)))
        states = [optimizer_state_rank(o) for o in grid.values["optim"]]
        mask = mask & (np.array(states) == min(states)).reshape(grid.broadcast_shape(("optim",)))
        return mask if any_batch else mask & (self.batch_values == min(grid.values[BATCH]))
