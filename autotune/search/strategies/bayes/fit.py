"""P(fits): the calibrated memory model's prediction per memory group against the ceiling, with an
error that shrinks as the group gets measured (:data:`MEMORY_SD`). Where a group needing no more
memory went over the ceiling at a smaller batch, a fit is unlikely (:data:`OOM_IMPLIED`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from autotune.params import TrialParams
from autotune.search.strategies.base import SearchState
from autotune.search.strategies.bayes.context import Context
from autotune.search.strategies.bayes.groups import MemoryEvidence
from autotune.search.strategies.surrogate import BATCH, normal_cdf

OOM_IMPLIED = 0.05  # P(fits) left where an OOM elsewhere implies this one, given plausible activation ratios
# Relative error of a predicted peak, by what was measured: the group's line, one point of it, a
# group with its activation factors (MemoryModel.class_measured), nothing alike.
MEMORY_SD = {"line": 0.03, "point": 0.10, "class": 0.10, "none": 0.30}


def predicted_block(context: Context, state: SearchState, group: int) -> np.ndarray | None:
    """The memory model's peak for ``group`` at each accumulation x batch size of the grid (read-only);
    ``None`` before any scale.

    Each cell is predicted, not a line through two batch sizes: with model dims the peak is not linear
    in the batch (at accumulation 1 the gradients and the activations do not coexist, and a line through
    batches 1 and 2, where the gradients hide the activations, rose by nothing), and accumulating holds
    the gradients."""
    if group not in context.lines:
        params = context.params_of_group(group)
        grid = context.grid
        cells = [(int(b), grid.accumulation(b, a)) for a in context.accumulations() for b in grid.values[BATCH]]
        peaks = state.memory.predict_cells(params, cells)
        block = None if any(p is None for p in peaks) else np.array(peaks, dtype=float).reshape(len(context.accumulations()), -1)
        if block is not None:
            block.setflags(write=False)
        context.lines[group] = block
    return context.lines[group]


def _memory_sd(context: Context, state: SearchState, evidence: MemoryEvidence, group: int) -> float:
    """The relative error of the memory model's peak for ``group``, by what was measured (:data:`MEMORY_SD`)."""
    fits = evidence.fits.get(group, {})
    if len(fits) >= 2:
        return MEMORY_SD["line"]
    if fits:
        return MEMORY_SD["point"]
    return MEMORY_SD["class" if state.memory.class_measured(context.params_of_group(group)) else "none"]


def p_fit_block(context: Context, state: SearchState, evidence: MemoryEvidence, group: int) -> np.ndarray:
    """P(peak <= ceiling) for ``group`` by accumulation x batch (read-only: kept while the evidence,
    the ceiling and the memory model's predictions stay the same, as they do through one proposal)."""
    held, ceiling, lines_at = context.p_fit_for
    if held is not evidence or (ceiling, lines_at) != (state.ceiling_bytes, context.lines_at):
        context.p_fit_rows, context.p_fit_for = {}, (evidence, state.ceiling_bytes, context.lines_at)
    block = context.p_fit_rows.get(group)
    if block is None:
        block = context.p_fit_rows[group] = _p_fit_block_of(context, state, evidence, group)
        block.setflags(write=False)
    return block


def _p_fit_block_of(context: Context, state: SearchState, evidence: MemoryEvidence, group: int) -> np.ndarray:
    ceiling = state.ceiling_bytes
    model = predicted_block(context, state, group)
    if model is None:
        return np.full((len(context.accumulations()), len(context.grid.values[BATCH])), 0.5)
    fits = evidence.fits.get(group, {})
    sd = _memory_sd(context, state, evidence, group)
    margin = np.log(ceiling / np.maximum(model, 1.0)) / sd  # how far under the ceiling the model puts each cell, in sds
    p_fit = normal_cdf(margin)
    for j, peak in fits.items():
        p_fit[:, j] = float(peak <= ceiling)
    # Over the ceiling at batch b0 (OOM or measured) in a group with no more static memory,
    # whose activations per sample are at most 1/ratio of ours: ours is over from b0 / ratio on.
    batches = context.batch_values.reshape(-1)
    for other, j in evidence.over:
        ratio = context.groups.activation_ratio[group, other]
        if ratio > 0:
            p_fit = np.where(batches >= batches[j] / ratio, p_fit * OOM_IMPLIED, p_fit)
    return p_fit


def _pruned_block(context: Context, state: SearchState, group: int) -> np.ndarray:
    """What :meth:`MemoryModel.prune_reason` rules out by prediction, by accumulation x batch."""
    model = predicted_block(context, state, group)
    margin = state.memory.prune_margin(context.params_of_group(group))
    if model is None or margin is None:
        return np.zeros((len(context.accumulations()), len(context.grid.values[BATCH])), dtype=bool)
    return model > state.ceiling_bytes * (1 + margin)


def memory_prune(context: Context, state: SearchState, evidence: MemoryEvidence, params: TrialParams) -> str | None:
    """Why ``params`` cannot fit, or ``None``: its own group's measurements (:meth:`MemoryModel.known_outcome`),
    then an OOM in a group needing no more memory; the memory model's prediction only where no fit in a group
    needing no less memory says it fits (:class:`MemoryEvidence`: measured beats predicted)."""
    known = state.memory.known_outcome(params, state.ceiling_bytes)
    if known is not None or context.grid.flat_index(params) is None:  # off the grid: the memory model's own rule
        return known or state.memory.prune_reason(params, state.ceiling_bytes)
    cell = (context.groups.index(params, context.grid), *MemoryEvidence.cell(context.grid, params))
    if evidence.ruled_out[cell]:
        return "out of memory, or over the ceiling, at a batch and accumulation no larger in a group needing no more memory"
    return None if evidence.known_fit[cell] else state.memory.prune_reason(params, state.ceiling_bytes)


def p_fits(context: Context, state: SearchState, evidence: MemoryEvidence, params: TrialParams) -> float:
    """P(fits) of one configuration (its memory group's, at its accumulation and batch)."""
    context.refresh_lines(len(state.history))
    a, j = MemoryEvidence.cell(context.grid, params)
    return float(p_fit_block(context, state, evidence, context.groups.index(params, context.grid))[a, j])


def likely_batch(context: Context, state: SearchState, evidence: MemoryEvidence, params: TrialParams) -> TrialParams | None:
    """``params`` at the largest batch no larger than its own that is likelier to fit than not
    (``None`` where none is)."""
    grid = context.grid
    context.refresh_lines(len(state.history))
    a, _ = MemoryEvidence.cell(grid, params)
    p_fit = p_fit_block(context, state, evidence, context.groups.index(params, grid))[a]
    likely = [b for b, p in zip(grid.values[BATCH], p_fit) if p >= 0.5 and b <= params.per_device_train_batch_size]
    return state.space.with_changes(params, per_device_train_batch_size=max(likely)) if likely else None


def best_over_groups(context: Context, state: SearchState, evidence: MemoryEvidence, bound: np.ndarray,
                     exact: Callable[[tuple[Any, ...], np.ndarray], np.ndarray]) -> tuple[float, int] | None:
    """The largest ``exact(cells, p_fit)`` over the grid (``cells`` one memory group's index into
    grid-shaped arrays, ``p_fit`` its P(fits): 1 where known to fit), and its flat index; ``None``
    where no group's ``bound`` (grid-shaped, ``exact`` with P(fits) = 1) is finite. What the memory
    model prunes and no probe showed to fit is never the largest. P(fits) needs two memory-model
    predictions per group, the slowest part, so groups are visited best bound first, and the visit
    stops when no group left can beat the best found (exact, since ``exact`` rises with P(fits))."""
    known = context.batch_grid(evidence.known_fit)
    per_group = bound.max(axis=context.other_axes).reshape(-1)
    context.refresh_lines(len(state.history))
    best_value, best_index = -np.inf, None
    for group in np.argsort(-per_group, kind="stable"):
        if per_group[group] <= best_value or not np.isfinite(per_group[group]):
            break
        cells = context.group_cells(int(group))
        p_fit = np.where(known[cells], 1.0, context.memory_cells(p_fit_block(context, state, evidence, int(group))))
        value = np.where(context.memory_cells(_pruned_block(context, state, int(group))) & ~known[cells], -np.inf, exact(cells, p_fit))
        local = int(np.argmax(value))
        if value.reshape(-1)[local] > best_value:
            best_value, best_index = float(value.reshape(-1)[local]), context.flat_of(int(group), local)
    return None if best_index is None else (best_value, best_index)
