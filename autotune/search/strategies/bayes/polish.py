"""Time kept for polishing the best configurations.

Compilation and accumulation multiply throughput and cost a probe many times over, so per second
they rank late, and a run that explores until its end never gets to them. The most promising
variants of the incumbent and of the best configuration with and without checkpointing (one
polishing dimension changed: another compile mode, or more accumulation), and the model's own pick
(:func:`models_pick`, which combines factors measured apart), keep their time to the end.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from autotune.search.ranking import Configuration
from autotune.search.strategies.base import SearchState
from autotune.search.strategies.bayes.context import Context
from autotune.search.strategies.bayes.fit import best_over_groups, memory_prune
from autotune.search.strategies.bayes.groups import MemoryEvidence
from autotune.search.strategies.bayes.throughput import MIN_GAIN
from autotune.search.strategies.surrogate import ACCUM, expected_improvement

POLISH_PROBES = 3  # polishing probes of the best configurations whose time is kept to the end
POLISH_MARGIN = 1.3  # their predicted cost is a guess until their compile mode was timed: keep some more
POLISH_SHARE = 0.5  # at most this share of the run's budget is kept for polishing


def kept_s(cost_s: float) -> float:
    """The seconds a polishing probe of this predicted cost keeps (:data:`POLISH_MARGIN` more)."""
    return POLISH_MARGIN * cost_s


def polish_reserve(context: Context, state: SearchState, feasible: list[Configuration], model: tuple[np.ndarray, np.ndarray],
                   p_ok: np.ndarray, cost_ok: np.ndarray, allowed: np.ndarray, evidence: MemoryEvidence,
                   budget_s: float) -> tuple[float, np.ndarray, list[int]]:
    """Seconds to keep for polishing, the polishing probes themselves (a grid mask, and their flat
    indices, most valuable first).

    The best variant per polishing dimension and the model's pick keep their time, the one worth
    most first, its worth P(runs) x its expected improvement over the incumbent (for the model's
    pick x P(fits)), per probe, not per second (the time is kept for them anyway), at their predicted
    cost, at most :data:`POLISH_PROBES` of them and :data:`POLISH_SHARE` of ``budget_s`` (a
    configuration that is both keeps its time once).
    """
    grid = context.grid
    if not feasible:
        return 0.0, np.zeros(grid.shape, dtype=bool), []
    bases = [feasible[0].params]
    for value in grid.values.get("gradient_checkpointing", ()):
        bases += [c.params for c in feasible if c.params.gradient_checkpointing == value][:1]
    bases = list(dict.fromkeys(bases))
    mean, sd = model
    flat = {name: np.broadcast_to(a, grid.shape).reshape(-1) for name, a in
            (("mean", mean), ("sd", sd), ("p_ok", p_ok), ("cost_ok", cost_ok), ("allowed", allowed))}
    best = math.log(feasible[0].mean_samples_per_s) + MIN_GAIN
    # A polishing probe's value, if it fits: P(runs) x expected improvement over the incumbent.
    worth = np.where(flat["allowed"], flat["p_ok"] * expected_improvement(flat["mean"].astype(np.float64), flat["sd"].astype(np.float64), best), 0.0)
    # One polishing dimension changed at a time: the best of each keeps its time, so an expensive
    # compilation is not crowded out by a combination that costs both.
    best_of: dict[str, tuple[float, float, int]] = {}
    for base in bases:
        variants: list[tuple[str, dict[str, Any]]] = [("torch_compile", {"torch_compile": m}) for m in grid.values["torch_compile"] if m != base.torch_compile]
        if ACCUM in grid.names:
            variants += [(ACCUM, {ACCUM: a}) for a in grid.values[ACCUM] if a > base.gradient_accumulation_steps]
        for dim, changes in variants:
            variant = state.space.with_changes(base, **changes)
            index = grid.flat_index(variant)
            if index is None or not flat["allowed"][index] or memory_prune(context, state, evidence, variant) is not None:
                continue
            value = float(worth[index])
            if value > 0 and value > best_of.get(dim, (0.0, 0.0, -1))[0]:
                best_of[dim] = (value, float(flat["cost_ok"][index]), index)
    pick = models_pick(context, state, evidence, worth)
    if pick is not None:  # where it is a variant already, that entry is worth no less (no P(fits)) and keeps the time
        best_of["model"] = (pick[0], float(flat["cost_ok"][pick[1]]), pick[1])
    most = POLISH_SHARE * budget_s if budget_s > 0 else math.inf
    keep = np.zeros(grid.size, dtype=bool)
    reserve, order = 0.0, []
    candidates = list(dict.fromkeys((cost, index) for _, cost, index in sorted(best_of.values(), reverse=True)))
    for cost, index in candidates[:POLISH_PROBES]:
        if reserve + kept_s(cost) <= most and cost <= (state.remaining_s or math.inf):
            keep[index] = True
            order.append(index)
            reserve += kept_s(cost)
    return reserve, keep.reshape(grid.shape), order


def models_pick(context: Context, state: SearchState, evidence: MemoryEvidence, worth: np.ndarray) -> tuple[float, int] | None:
    """The model's own pick for polishing: the configuration with the largest ``worth`` (flat, a
    probe's value if it fits) times P(fits), and that value (``None`` where none is worth anything).

    It combines factors measured in different places (fp16 beat bf16 uncompiled, max-autotune beat
    inductor with bf16), which no one-dimension variant of a measured configuration does; P(fits)
    keeps a long shot from taking the kept time."""
    shaped = worth.reshape(context.grid.shape)
    best = best_over_groups(context, state, evidence, np.where(shaped > 0.0, shaped, -np.inf), lambda cells, p_fit: shaped[cells] * p_fit)
    return best if best is not None and best[0] > 0.0 else None
