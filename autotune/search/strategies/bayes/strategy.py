"""The ``bayes`` strategy: each proposal scores the whole grid by expected improvement per expected
probe second, ``P(runs) x P(fits) x EI / E[probe seconds]``, after the questions asked on purpose
(:mod:`.questions`) and within the time kept for polishing (:mod:`.polish`) and for the loop's
near-ties (``SearchState.kept_s``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optuna

from autotune.params import TrialParams
from autotune.records import Probe, ProbeResult, ProbeStatus
from autotune.search.ranking import Configuration
from autotune.search.strategies import coverage
from autotune.search.strategies.base import SearchState, SeenKeys, Strategy
from autotune.search.strategies.baselines import tpe_sampler
from autotune.search.strategies.bayes import fit, polish, questions, throughput
from autotune.search.strategies.bayes.context import Context
from autotune.search.strategies.bayes.cost import probe_costs
from autotune.search.strategies.bayes.groups import MemoryEvidence
from autotune.search.strategies.failures import KINDS, FailureModel, p_ok_grid
from autotune.search.strategies.surrogate import Grid

PENDING_NUMBER = 10**9  # pending probes' numbers: after every real trial's
P_RUNS_FLOOR = 0.05  # a configuration less likely than one in twenty to run (crash, divergence) is not proposed


class BayesStrategy(Strategy):
    """Expected improvement per probe second under a learnt throughput, failure and memory model."""

    name = "bayes"

    def __init__(self) -> None:
        self._context: Context | None = None
        self._budget_s = 0.0  # the most time left seen: this run's budget

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return tpe_sampler(seed)

    def context(self, state: SearchState) -> Context:
        """The grid, features and caches of ``state.space`` (built once per space)."""
        if self._context is None or self._context.grid.space != state.space or self._context.loader_cores != state.loader_cores:
            self._context = Context.of(state.space, state.loader_cores)
        return self._context

    def prune(self, params: TrialParams, state: SearchState) -> str | None:
        context = self.context(state)
        grid = context.grid
        reason = fit.memory_prune(context, state, MemoryEvidence.of(context.groups, grid, state.history, state.ceiling_bytes), params)
        if reason is not None or grid.flat_index(params) is None:
            return reason
        for kind in KINDS:
            failed = FailureModel.from_history(grid, state.history, kind).certain_failure(params)
            if failed is not None:
                return f"holds every suspect of the {kind.name} of {failed.short()}"
        p_runs = float(np.broadcast_to(self._p_ok(context, state), grid.shape).reshape(-1)[grid.flat_index(params)])
        if p_runs < P_RUNS_FLOOR:
            return f"unlikely to run after the crashes and divergences so far (P {p_runs:.3f})"
        return None

    def propose(self, state: SearchState) -> TrialParams | None:
        context = self.context(state)
        grid = context.grid
        history = list(state.history)
        ran = _measured(grid, history)
        evidence = measured = MemoryEvidence.of(context.groups, grid, history, state.ceiling_bytes)
        pending = pending_probes(context, state, evidence)
        mean, sd = throughput.posterior(context, ran, [params for params, fits in pending if fits])
        feasible = state.feasible()
        nothing_fits = not feasible  # what was measured, not what is believed: a pending probe only likely fits
        if pending:
            # Other workers' probes in flight count as finished with the outcome the model expects,
            # so this proposal complements them instead of repeating their question.
            believed = _believed(context, state, pending, mean)
            ran = ran + [p for p in believed if p.result.ok]
            history = history + believed
            evidence = MemoryEvidence.of(context.groups, grid, history, state.ceiling_bytes)
            feasible = state.feasible(history)
        p_ok = np.broadcast_to(self._p_ok(context, state), grid.shape)
        cost_ok, cost_fail = probe_costs(context, history, mean)
        # What may be proposed at all.
        allowed = (p_ok >= P_RUNS_FLOOR) & context.user_space
        allowed = allowed & ~context.batch_grid(evidence.ruled_out)
        if state.remaining_s is not None:
            allowed = allowed & (cost_ok <= state.remaining_s)
        allowed = allowed.copy()
        allowed.reshape(-1)[context.seen_flat(state, history)] = False
        if nothing_fits:
            # Until something fits, the frugal end (checkpointing, the least optimizer state, the smallest
            # batch) while any of it is left: a search that finds nothing that fits returns nothing at all.
            smallest = context.frugal_mask().reshape(-1)  # being probed elsewhere: bracket the frontier instead
            any_batch = any(smallest[grid.flat_index(params)] for params, _ in pending)
            frugal = allowed & context.frugal_mask(any_batch=any_batch)
            allowed = frugal if frugal.any() else allowed
        if not allowed.any():
            return None
        if state.remaining_s is not None:
            self._budget_s = max(self._budget_s, state.remaining_s)
        sibling = questions.precision_sibling(context, state, feasible, allowed, history, p_ok, mean, evidence)
        if sibling is not None:
            return grid.params_at(sibling)
        gain = throughput.gain(feasible, mean, sd, allowed)
        if state.remaining_s is not None:
            # A probe that would eat into the time kept for polishing is not started.
            reserve, polishing, order = polish.polish_reserve(context, state, feasible, (mean, sd), p_ok, cost_ok, allowed, evidence, self._budget_s)
            # Every dimension asked once near what the search would return now (the near-equals by the
            # model's estimate, as the ranking orders them at the end), cheapest first: its time is kept
            # like polishing's, and it is asked at once where precisions tie. Once due, a question that
            # would leave no time for the most valuable polishing probe waits for it (not where
            # precisions tie: then the loader, not the compile mode, is the likelier limit).
            tie = coverage.tie_across_precisions(feasible)
            picked = state.feasible(history, _estimates(context, feasible, mean))
            question, question_s, asking_s = questions.coverage_question(context, state, measured, picked, allowed, cost_ok, self._budget_s, loader_first=tie)
            due = tie or asking_s + reserve + state.kept_s >= state.remaining_s
            first_s = 0.0 if tie or not order else polish.kept_s(float(cost_ok.flat[order[0]]))
            if question is not None and due and question_s + first_s + state.kept_s <= state.remaining_s:  # not the near-ties' time
                return question
            reserve += asking_s
            if order and reserve >= state.remaining_s:
                # Only the kept time is left: polish, the most valuable probe first.
                return grid.params_at(order[0])
            # Nor an exploring one that would eat into the time the loop keeps for the near-ties (kept_s).
            allowed = allowed & (polishing | (cost_ok + reserve + state.kept_s <= state.remaining_s))
            if not allowed.any():
                return None
        # Upper bound of the score (P(fits) = 1 wherever no evidence says otherwise), then the exact
        # score group by group, best bound first.
        bound = _score(gain, p_ok, np.ones(1), cost_ok, cost_fail, allowed)
        best = fit.best_over_groups(context, state, evidence, bound, lambda cells, p_fit: _score(
            gain[cells], p_ok[cells], p_fit, cost_ok[cells], cost_fail[cells], allowed[cells]))
        return None if best is None else grid.params_at(best[1])

    def estimates(self, state: SearchState) -> dict[tuple[Any, ...], float]:
        """The throughput model's posterior mean at each configuration that fits, fitted to every probe:
        a measurement pooled with what the other probes say about its settings."""
        context = self.context(state)
        grid = context.grid
        ran = _measured(grid, state.history)
        if not ran:
            return {}
        mean, _ = throughput.posterior(context, ran)
        feasible = state.feasible()
        by_number = _estimates(context, feasible, mean)
        return {c.params.key(): by_number[c.number] for c in feasible if c.number in by_number}

    @staticmethod
    def _p_ok(context: Context, state: SearchState) -> np.ndarray:
        """P(runs) over the grid (broadcastable over every axis but the batch): no crash and no divergence,
        from what ran (a pending probe may still crash), each kind's prediction kept while its failures stay the same."""
        return p_ok_grid(context.grid, state.history, context.p_ok)


def _score(gain: Any, p_ok: Any, p_fit: Any, cost_ok: Any, cost_fail: Any, allowed: Any) -> np.ndarray:
    """Expected improvement per expected probe second (increasing in P(fits), so 1 bounds it)."""
    p_run = p_ok * p_fit
    expected_cost = p_run * cost_ok + (1.0 - p_run) * cost_fail
    return np.where(allowed, p_run * gain / np.maximum(expected_cost, 1.0), -np.inf)


def _estimates(context: Context, feasible: list[Configuration], mean: np.ndarray) -> dict[int, float]:
    """The throughput model's samples/s (its posterior ``mean``, log scale over the grid) at each configuration
    of ``feasible`` in the grid, by :attr:`Configuration.number`."""
    flat = np.broadcast_to(mean, context.grid.shape).reshape(-1)
    indices = {c.number: context.grid.flat_index(c.params) for c in feasible}
    return {number: float(np.exp(flat[index])) for number, index in indices.items() if index is not None}


def _measured(grid: Grid, history: Sequence[Probe]) -> list[Probe]:
    """The probes of ``history`` in ``grid`` that ran and measured a throughput: what the throughput model is fitted to."""
    return [p for p in history if p.result.status is ProbeStatus.OK and p.result.samples_per_s and grid.flat_index(p.params) is not None]


def pending_probes(context: Context, state: SearchState, evidence: MemoryEvidence) -> list[tuple[TrialParams, bool]]:
    """The configurations in flight in other workers (``state.seen.in_flight``) and whether each is
    expected to fit: known to fit, or likelier to fit than not (and not ruled out).

    Without them N workers deciding on the same finished probes ask N near-copies of one question;
    counting each as finished with its likeliest outcome (a fit at the model's mean, else an OOM)
    makes the next proposal complement them. With one worker nothing is in flight.
    """
    in_flight = state.seen.in_flight if isinstance(state.seen, SeenKeys) else ()
    if not in_flight:
        return []
    grid = context.grid
    context.refresh_lines(len(state.history))
    pending: list[tuple[TrialParams, bool]] = []
    for key in sorted(in_flight, key=repr):  # a stable order: the storage's set order is not
        params = TrialParams.from_key(key)
        if grid.flat_index(params) is None:
            continue
        group, (a, j) = context.groups.index(params, grid), MemoryEvidence.cell(grid, params)
        if evidence.known_fit[group, a, j] or evidence.ruled_out[group, a, j]:
            fits = bool(evidence.known_fit[group, a, j])
        else:
            fits = fit.p_fits(context, state, evidence, params) >= 0.5
        pending.append((params, fits))
    return pending


def _believed(context: Context, state: SearchState, pending: list[tuple[TrialParams, bool]], mean: np.ndarray) -> list[Probe]:
    """Pending configurations as probes with their believed outcome: a fit at the posterior mean
    (its peak at the memory model's prediction, at most the ceiling), or an OOM."""
    grid = context.grid
    flat_mean = np.broadcast_to(mean, grid.shape).reshape(-1)
    believed = []
    for i, (params, fits) in enumerate(pending):
        if fits:
            predicted = state.memory.predict(params)
            peak = state.ceiling_bytes if predicted is None else int(min(max(predicted, 1), state.ceiling_bytes))
            result = ProbeResult(ProbeStatus.OK, samples_per_s=float(np.exp(flat_mean[grid.flat_index(params)])), peak_mem_bytes=peak)
        else:
            result = ProbeResult(ProbeStatus.OOM)
        believed.append(Probe(PENDING_NUMBER + i, params, result))
    return believed
