"""Questions the expected improvement per second ranks too late, asked on purpose: every dimension
once near the incumbent (:func:`coverage_question`), and the other 16-bit format once
(:func:`precision_sibling`: fp16 and bf16 are a prior 2 % apart, and the answer carries to every
configuration of that precision).
"""

from __future__ import annotations

import math

import numpy as np

from autotune.params import TrialParams, mixed_precision_dtype
from autotune.records import Probe, ProbeStatus
from autotune.search.ranking import Configuration
from autotune.search.strategies import coverage
from autotune.search.strategies.base import SearchState
from autotune.search.strategies.bayes.context import Context
from autotune.search.strategies.bayes.fit import likely_batch, memory_prune, p_fits
from autotune.search.strategies.bayes.groups import MemoryEvidence

COVERAGE_SHARE = 0.2  # at most this share of the run's budget is kept for asking every dimension near the incumbent
# A 16-bit format that failed once keeps P(runs) of about 0.4 in a context its failure does not hold
# (failures.py); one that failed twice, about 0.05. A context with less is no confirmation.
CONFIRM_P_OK = 0.25


def coverage_question(context: Context, state: SearchState, evidence: MemoryEvidence, feasible: list[Configuration], allowed: np.ndarray,
                      cost_ok: np.ndarray, budget_s: float, *, loader_first: bool = False) -> tuple[TrialParams | None, float, float]:
    """The cheapest question left near the incumbent, its seconds, and the seconds all of them take
    (at most :data:`COVERAGE_SHARE` of ``budget_s``): per unasked dimension its first variant that
    may be proposed, at the largest batch up to the incumbent's likelier to fit than not;
    ``loader_first``: in :data:`coverage.DIMENSIONS`' order (the loader's workers first), not by cost."""
    if not feasible:
        return None, 0.0, 0.0
    grid = context.grid
    incumbent = feasible[0].params
    flat_allowed = allowed.reshape(-1)
    questions: list[tuple[float, int, TrialParams]] = []
    for rank, dimension in enumerate(coverage.unasked(state.space, incumbent, state.history)):
        for variant in coverage.variants(state.space, incumbent, dimension, state.history, state.loader_cores):
            if dimension == "gradient_checkpointing" and variant.gradient_checkpointing:  # the largest batch likelier to fit than not
                if p_fits(context, state, evidence, variant) < 0.5:
                    continue
            elif memory_prune(context, state, evidence, variant) is not None:
                variant = likely_batch(context, state, evidence, variant) or variant
            index = grid.flat_index(variant)
            if index is not None and flat_allowed[index] and memory_prune(context, state, evidence, variant) is None:
                questions.append((float(cost_ok.flat[index]), rank, variant))
                break
    if not questions:
        return None, 0.0, 0.0
    questions.sort(key=lambda q: (q[1], q[0]) if loader_first else (q[0], q[1]))
    most = COVERAGE_SHARE * budget_s if budget_s > 0 else math.inf
    kept = 0.0
    for cost, _, _ in questions:
        if kept + cost > most:
            break
        kept += cost
    return questions[0][2], questions[0][0], kept


def precision_sibling(context: Context, state: SearchState, feasible: list[Configuration], allowed: np.ndarray,
                      history: list[Probe], p_ok: np.ndarray, mean: np.ndarray, evidence: MemoryEvidence) -> int | None:
    """The best uncompiled configuration with the incumbent's 16-bit precision, in the other 16-bit
    format (its flat grid index), once, where nothing ran in it.

    Where the other format's one probe so far crashed or diverged (fp16 with Adafactor, say), that
    is one piece of evidence, not yet a rule: the question is asked once more in a context the
    failure leaves a fair chance to run (:data:`CONFIRM_P_OK`): the best uncompiled configuration
    with its optimizer, attention kernel or checkpointing changed, at the largest batch no larger
    than its own that likely fits; of those, the fastest expected times P(runs). A second failure
    confirms the format's own failure."""
    grid = context.grid
    if not feasible or "precision" not in grid.names:
        return None
    base = mixed_precision_dtype(feasible[0].params.precision)
    if base is None:
        return None
    other = "fp16" if base == "bf16" else "bf16"
    tried = [p for p in history if mixed_precision_dtype(p.params.precision) == other]
    if len(tried) > 1 or any(p.result.status not in (ProbeStatus.CRASH, ProbeStatus.DIVERGED) for p in tried):
        return None  # it ran, ran out of memory, or failed twice: the question was asked
    plain = next((c.params for c in feasible if c.params.torch_compile == "off" and mixed_precision_dtype(c.params.precision) == base), None)
    if plain is None:
        return None
    precision = plain.precision.replace(base, other)
    if precision not in grid.values["precision"]:
        precision = other
        if precision not in grid.values["precision"]:
            return None
    sibling = state.space.with_changes(plain, precision=precision)
    flat_allowed = allowed.reshape(-1)
    if not tried:
        index = grid.flat_index(sibling)
        fits = memory_prune(context, state, evidence, sibling) is None
        return index if index is not None and bool(flat_allowed[index]) and fits else None
    flat_p_ok = np.broadcast_to(p_ok, grid.shape).reshape(-1)
    flat_mean = np.broadcast_to(mean, grid.shape).reshape(-1)
    contexts = [sibling] + [state.space.with_changes(sibling, **{dim: value}) for dim in ("optim", "attn_implementation", "gradient_checkpointing")
                            if dim in grid.names for value in grid.values[dim] if value != getattr(sibling, dim)]
    best_value, best_index = -math.inf, None
    for switched in contexts:
        candidate = likely_batch(context, state, evidence, switched)
        index = None if candidate is None else grid.flat_index(candidate)
        if index is None or not flat_allowed[index] or flat_p_ok[index] < CONFIRM_P_OK:
            continue
        value = float(flat_p_ok[index] * np.exp(flat_mean[index]))
        if value > best_value:
            best_value, best_index = value, index
    return best_index
