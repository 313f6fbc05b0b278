"""What crashes and what diverges, inferred from the probes that did.

A failure is caused by a value (bf16 on a card without it) or a pair of values (flash attention in
fp32), deterministically. A probe that ran clears its values and pairs, so each failure's *suspects*
are its uncleared values and pairs, one of them a cause. The posterior is computed over *worlds*
(which suspected values, and which pairs suspected twice or more, are causes), so one failure makes
its lone suspect likely, not certain; a second in another context makes it near certain; a
configuration holding every suspect of a failure is never run. Compile modes share one more cause,
compilation itself (:data:`COMPILED`), until a compiled probe runs. Crashes and divergences are two
:data:`KINDS`: an out-of-memory or a divergence got past start-up, so it clears crash suspicion only.
Batch size (its failures are out-of-memory) and a value every configuration holds are no suspects;
pairs form among the dimensions that select code paths (:data:`PAIR_DIMS`) and the user's own fields.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.params import PARAM_NAMES, TrialParams
from autotune.records import Probe, ProbeStatus
from autotune.search.strategies.surrogate import BATCH, Grid
from autotune.space import SearchSpace

PAIR_DIMS = ("precision", "optim", "torch_compile", "attn_implementation", "gradient_checkpointing")

@dataclass(frozen=True)
class Kind:
    """One kind of failure: which statuses it is, which outcomes prove a configuration free of it, its priors."""

    name: str
    failed: tuple[ProbeStatus, ...]
    cleared_by: tuple[ProbeStatus, ...]
    value_prior: dict[str, float]
    other_value_prior: float  # dimensions not in value_prior
    pair_prior: dict[frozenset[str], float]
    other_pair_prior: float
    compiled_prior: float = 0.0  # of COMPILED, the cause every compile mode holds (none where 0)

    def prior(self, cause: Cause) -> float:
        if len(cause) == 1:
            if cause[0] == COMPILED:
                return self.compiled_prior
            return self.value_prior.get(cause[0][0], self.other_value_prior)
        return self.pair_prior.get(frozenset(v[0] for v in cause), self.other_pair_prior)


# Compilation itself (tracing, lowering), which every compile mode goes through: where one mode
# crashed, the other is suspect too (a graph that dynamo cannot trace breaks in every mode), until
# a compiled probe ran.
COMPILED: Value = ("torch_compile", "*")

# A crash happens at start-up or while compiling: a probe that got to run a step (ok, out of memory
# at the first step, or diverged later) is free of it.
# Attention kernels that need a 16-bit precision, and compile modes that break on a code path,
# make pairs with those dimensions likelier.
CRASH = Kind(
    "crash", (ProbeStatus.CRASH,), (ProbeStatus.OK, ProbeStatus.OOM, ProbeStatus.DIVERGED),
    {"precision": 0.1, "attn_implementation": 0.1, "torch_compile": 0.05, "optim": 0.08}, 0.03,
    {frozenset({"precision", "attn_implementation"}): 0.1, frozenset({"torch_compile", "attn_implementation"}): 0.05,
     frozenset({"torch_compile", "gradient_checkpointing"}): 0.05}, 0.02, compiled_prior=0.06,
)
# A divergence shows in the loss: only a probe that trained through its window is free of it.
# Mostly a matter of precision (fp16's range) and of the optimizer's numerics with it.
DIVERGENCE = Kind("divergence", (ProbeStatus.DIVERGED,), (ProbeStatus.OK,), {"precision": 0.05, "optim": 0.03}, 0.01,
                  {frozenset({"precision", "optim"}): 0.1}, 0.01)
KINDS = (CRASH, DIVERGENCE)
HIGHER_ORDER = 0.02  # a failure none of whose values or pairs is left to blame: three or more together
MAX_ENUMERATED = 14  # causes enumerated exactly, the most suspected first
MAX_WORLDS = 64  # the most likely worlds kept for predictions (their weight renormalised)

def _pairable(dim: str) -> bool:
    """A dimension whose values may fail together with another's: the PAIR_DIMS, and the user's own config fields
    (TRL's padding_free fails without packing)."""
    return dim in PAIR_DIMS or dim not in PARAM_NAMES


Value = tuple[str, Any]
Pair = tuple[Value, Value]
Cause = tuple[Value, ...]  # one value, or two




@dataclass
class FailureModel:
    """Cleared values and pairs, and the suspects of every failure so far."""

    dims: tuple[str, ...]  # the grid's dimensions that hold a choice, but batch size: a value every configuration holds is no suspect
    kind: Kind = CRASH
    cleared_values: set[Value] = field(default_factory=set)
    cleared_pairs: set[Pair] = field(default_factory=set)
    failures: list[TrialParams] = field(default_factory=list)

    @classmethod
    def from_history(cls, grid: Grid, history: Iterable[Probe], kind: Kind = CRASH) -> FailureModel:
        model = cls(tuple(n for n in grid.names if n != BATCH and len(grid.values[n]) > 1), kind)
        for probe in history:
            if probe.result.status in kind.cleared_by:
                model.cleared_values.update(model.values_of(probe.params))
                model.cleared_pairs.update(model.pairs_of(probe.params))
            elif probe.result.status in kind.failed:
                model.failures.append(probe.params)
        return model


    @property
    def shares_compilation(self) -> bool:
        """Whether :data:`COMPILED` is a cause here (this kind gives it a prior, the grid compiles)."""
        return self.kind.compiled_prior > 0.0 and "torch_compile" in self.dims

    def values_of(self, params: TrialParams) -> list[Value]:
        values = [(d, getattr(params, d)) for d in self.dims]
        if self.shares_compilation and params.torch_compile != "off":
            values.append(COMPILED)
        return values

    def pairs_of(self, params: TrialParams) -> list[Pair]:
        dims = [d for d in self.dims if _pairable(d)]
        return [((a, getattr(params, a)), (b, getattr(params, b))) for a, b in itertools.combinations(dims, 2)]

    def suspects(self, params: TrialParams) -> list[Cause]:
        values: list[Cause] = [(v,) for v in self.values_of(params) if v not in self.cleared_values]
        pairs: list[Cause] = [p for p in self.pairs_of(params) if p not in self.cleared_pairs]
        return values + pairs

    # ------------------------------------------------------------------ posterior over worlds

    def worlds(self) -> tuple[list[Cause], np.ndarray, np.ndarray, list[list[Cause]]]:
        """The enumerated causes, the likely worlds (bitmasks over them) with their weights, and
        each failure's private pairs (suspected by it alone; one of them explains it when its
        world does not)."""
        suspects = [self.suspects(f) for f in self.failures]
        counts: dict[Cause, int] = {}
        for causes in suspects:
            for cause in causes:
                counts[cause] = counts.get(cause, 0) + 1
        shared = [c for c in counts if len(c) == 1 or counts[c] >= 2]
        enumerated = sorted(shared, key=lambda c: (-counts[c], len(c), str(c)))[:MAX_ENUMERATED]
        position = {c: i for i, c in enumerate(enumerated)}
        private = [[c for c in causes if c not in position] for causes in suspects]
        k = len(enumerated)
        masks = np.arange(2**k, dtype=np.int64)
        bits = (masks[:, None] >> np.arange(k)[None, :]) & 1
        priors = np.array([self.kind.prior(c) for c in enumerated])
        log_w = (bits * np.log(priors) + (1 - bits) * np.log1p(-priors)).sum(axis=1) if k else np.zeros(1)
        for causes, own in zip(suspects, private):
            mask = sum(1 << position[c] for c in causes if c in position)
            hit = (masks & mask) != 0
            by_pairs = 1.0 - float(np.prod([1.0 - self.kind.prior(c) for c in own])) if own else HIGHER_ORDER
            log_w = log_w + np.where(hit, 0.0, math.log(by_pairs))
        weights = np.exp(log_w - log_w.max())
        order = np.argsort(-weights)[:MAX_WORLDS]
        weights = weights[order] / weights.sum()
        keep = weights > 1e-3 * weights[0]
        return enumerated, masks[order][keep], weights[keep], private

    def cause_probability(self) -> dict[Cause, float]:
        """Posterior probability of each enumerated cause (for display and tests)."""
        enumerated, masks, weights, _ = self.worlds()
        total = weights.sum()
        return {c: float(weights[(masks >> i) & 1 == 1].sum() / total) for i, c in enumerate(enumerated)}

    # ------------------------------------------------------------------ over the grid

    def key(self) -> tuple[Any, ...]:
        """Everything the predictions depend on: equal keys, equal predictions."""
        return (self.kind.name, frozenset(self.cleared_values), frozenset(self.cleared_pairs), tuple(f.key() for f in self.failures))

    def p_ok_grid(self, grid: Grid) -> np.ndarray:
        """P(no crash and no divergence) at every grid point, broadcastable to the grid (batch axis 1)."""
        shape = grid.broadcast_shape(self.dims)
        enumerated, masks, weights, private = self.worlds()
        # Causes nobody has suspected yet: every uncleared value and pair keeps its prior.
        log_prior = np.zeros(shape)
        for dim in self.dims:
            row = [0.0 if (dim, v) in self.cleared_values or (((dim, v),) in enumerated) else math.log1p(-self.kind.prior(((dim, v),)))
                   for v in grid.values[dim]]
            log_prior = log_prior + np.array(row).reshape(grid.broadcast_shape([dim]))
        if self.shares_compilation and COMPILED not in self.cleared_values and (COMPILED,) not in enumerated:
            log_prior = log_prior + self._holds(grid, (COMPILED,)) * math.log1p(-self.kind.compiled_prior)
        known = set(enumerated) | {c for own in private for c in own}
        for a, b in itertools.combinations([d for d in self.dims if _pairable(d)], 2):
            table = np.zeros((len(grid.values[a]), len(grid.values[b])))
            for i, va in enumerate(grid.values[a]):
                for j, vb in enumerate(grid.values[b]):
                    pair = ((a, va), (b, vb))
                    if pair not in self.cleared_pairs and pair not in known:
                        table[i, j] = math.log1p(-self.kind.prior(pair))
            log_prior = log_prior + table.reshape(grid.broadcast_shape([a, b]))
        holds = {c: self._holds(grid, c) for c in {*enumerated, *(c for own in private for c in own)}}
        # Per failure: the share of its private pairs a point avoids (if its world leaves it to them).
        avoid = []
        for own, failed in zip(private, self.failures):
            if own:
                odds = [self.kind.prior(c) for c in own]  # which of its pairs explains it, by prior
                inside = sum((holds[c] * w for c, w in zip(own, odds)), np.zeros(shape))
                avoid.append(1.0 - inside / sum(odds))
            else:  # an interaction of three or more: the same code path fails again
                avoid.append(1.0 - self._holds(grid, tuple((d, getattr(failed, d)) for d in self.dims if _pairable(d))).astype(float))
        suspects = [self.suspects(f) for f in self.failures]
        failure_masks = [sum(1 << enumerated.index(c) for c in causes if c in enumerated) for causes in suspects]
        survive = np.zeros(shape)
        for mask, weight in zip(masks.tolist(), weights.tolist()):
            alive = np.ones(shape)
            for i, cause in enumerate(enumerated):
                if mask >> i & 1:
                    alive = alive * (~holds[cause])
            for j, failure_mask in enumerate(failure_masks):
                if not mask & failure_mask:
                    alive = alive * avoid[j]
            survive = survive + weight * alive
        # What certainly fails is never proposed: the rule the prune applies (certain_failure), on the grid, so a
        # proposal the prune then rejects is not made again and again (311 of them on one design draw, 44.6 CPU s).
        return np.exp(log_prior) * survive * ~self.certain_failure_grid(grid)

    def _failure_causes(self, failed: TrialParams) -> list[Cause]:
        """What must hold for a configuration to fail as ``failed`` did: its suspects, else all its pairable values."""
        return self.suspects(failed) or [tuple((d, getattr(failed, d)) for d in self.dims if _pairable(d))]

    def certain_failure_grid(self, grid: Grid) -> np.ndarray:
        """Where :meth:`certain_failure` finds a failure (broadcastable over :attr:`dims`)."""
        out = np.zeros(grid.broadcast_shape(self.dims), dtype=bool)
        for failed in self.failures:
            every = np.ones(grid.broadcast_shape(self.dims), dtype=bool)
            for cause in self._failure_causes(failed):
                every = every & self._holds(grid, cause)
            out = out | every
        return out

    def _holds(self, grid: Grid, cause: Cause) -> np.ndarray:
        """Where the grid's points hold every value of ``cause`` (broadcastable over :attr:`dims`)."""
        out = np.ones(grid.broadcast_shape(self.dims), dtype=bool)
        for dim, value in cause:
            if (dim, value) == COMPILED:
                out = out & np.array([v != "off" for v in grid.values[dim]]).reshape(grid.broadcast_shape([dim]))
                continue
            out = out & np.array([v == value and type(v) is type(value) for v in grid.values[dim]]).reshape(grid.broadcast_shape([dim]))
        return out

    def certain_failure(self, params: TrialParams) -> TrialParams | None:
        """A failed configuration whose every suspect ``params`` holds (so it fails too), or ``None``."""
        mine = set(self.values_of(params))
        for failed in self.failures:
            if all(all(v in mine for v in cause) for cause in self._failure_causes(failed)):
                return failed
        return None


def p_ok_grid(grid: Grid, history: Sequence[Probe], cache: dict[str, tuple[tuple[Any, ...], np.ndarray]] | None = None) -> np.ndarray:
    """P(no crash and no divergence) over ``grid`` (broadcastable, batch axis 1) given ``history``: every
    kind's prediction multiplied; with ``cache`` (per kind, its last prediction by its key), a kind's is kept
    while its failures stay the same."""
    p_ok: np.ndarray = np.ones(1)
    for kind in KINDS:
        failures = FailureModel.from_history(grid, history, kind)
        cached = None if cache is None else cache.get(kind.name)
        if cached is None or cached[0] != failures.key():
            cached = (failures.key(), failures.p_ok_grid(grid))
            if cache is not None:
                cache[kind.name] = cached
        p_ok = p_ok * cached[1]
    return p_ok


def p_runs(space: SearchSpace, history: Sequence[Probe]) -> Callable[[TrialParams], float]:
    """P(no crash and no divergence) of a configuration of ``space`` given ``history`` (1 off its grid),
    computed over the grid at the first question only."""
    @functools.cache
    def over_grid() -> tuple[Grid, np.ndarray]:
        grid = Grid(space)
        return grid, p_ok_grid(grid, history)

    def p(params: TrialParams) -> float:
        grid, p_ok = over_grid()
        return 1.0 if grid.flat_index(params) is None else float(Grid.at(p_ok, grid.codes(params)))

    return p
