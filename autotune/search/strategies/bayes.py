"""Evidence over preference: a model of throughput learned from the probes picks each next probe.

Every proposal scores the whole grid and runs the configuration with the highest expected
improvement per expected probe second:

    score(x) = P(runs | x) x P(fits | x) x EI(x) / E[probe seconds of x]

* **EI** comes from :class:`~autotune.search.strategies.steptime.StepTimeSurrogate`: log
  samples/s through a training step's time, ``A x (overhead + b x per-sample) + optimizer step``,
  each part a product of per-value factors (precision, attention kernel, compile mode and
  checkpointing act on the micro-step's overhead and per-sample time, the optimizer on its step;
  values of one kind, such as the 16-bit precisions or the compile modes, share an effect), per-sample
  hinges (so a peak at a middle batch size is learnt, and sizes below the frontier get measured when
  the curve flattens) and misalignment terms, with small residuals (loader workers, accumulation,
  per size). So a dimension's effect depends on where the batch sits on its curve, and the data say
  where: compilation that cuts overhead gains most at small batches, compilation that speeds the
  kernels at large ones (round 11; the log-additive :class:`~autotune.search.strategies.surrogate.Surrogate`
  of rounds 1-10 stays behind :data:`THROUGHPUT_MODEL` for comparison). The expert ordering (bf16 >
  fp16 > tf32 > fp32, flash > sdpa > eager, checkpointing slower) is only its prior mean: it decides
  what is tried first, never what may be measured. Improvements count beyond :data:`MIN_GAIN` (a
  probe's noise), and an uncompiled candidate is measured against the best uncompiled
  configuration: compilation multiplies what it improves.
* **Input**: a probe's ``input_wait_fraction`` splits its throughput into compute and waiting. The
  model learns the compute part; the loader's rate (per worker, and in the training process with
  0 workers) is estimated from the probes that waited and caps or slows the prediction for each
  worker count, so an input-bound incumbent makes more workers the best bet.
* **P(runs)**: :class:`~autotune.search.strategies.failures.FailureModel`, once for crashes and
  once for divergences: a failure is evidence against its suspect values and pairs everywhere,
  confirmed by a second failure in another context; a configuration holding every suspect of a
  failure is never run (a compile mode that crashed is not retried in the same context).
* **P(fits)**: the calibrated :class:`~autotune.search.memory.MemoryModel`'s prediction against
  the ceiling, with an error that shrinks as the memory group gets measured (a group never
  measured whose twin was, storing alike: fused attention kernels, compile modes, fp16 and bf16,
  reads its peaks off the twin's, give or take :data:`TWIN_SD`); where a group alike
  went over the ceiling against the prediction, the two share part of their error (correlated
  normals: the miss shifts and narrows this group's error, a truncated normal for the group
  itself), and where a group with no more memory went over at a smaller batch, a fit is unlikely. What
  cannot fit is pruned without running (:meth:`BayesStrategy.prune`): what the memory model rules
  out, and an OOM (or a peak over the ceiling) at batch b rules out every batch >= b in every group
  that needs no less memory (more optimizer state, no checkpointing, eager attention).
* **Probe seconds**: start-up, compilation per mode and the measured window, learnt from the
  probes' own timings (priors until then), a graph compiled before in the run at what such
  recompilations measured (inductor's cache); a failure is charged what failing costs. A probe that
  cannot finish in the time left is not proposed, nor an exploring one that would eat the time the
  loop keeps for re-measuring near-ties (``SearchState.kept_s``), nor one that would eat the time kept for
  polishing the best configurations (another compile mode, more accumulation, one at a time, and
  the model's own pick, which combines factors measured apart:
  :meth:`BayesStrategy._polish_reserve`), which rank late per second and pay off most; the
  ones worth most (P(runs) x expected improvement, and for the model's pick x P(fits)) keep their
  time (at most half the budget), and once only that time is left the most valuable runs first.
* **Memory groups compared before polishing**: checkpointing lets larger batches fit, so the
  group with it and the group without run different batch sizes, and a small batch pays its
  optimizer step over few samples. Once exploring has had its time, the other group's best is
  measured accumulating as many samples per optimizer step as the incumbent
  (:meth:`BayesStrategy._comparison`), so the polish goes to the group that wins amortised.
* **The other 16-bit format, once**: fp16 and bf16 are a prior 2 % apart and either can be several
  percent faster, a question that ranks late per second but whose answer carries to every
  configuration of that precision; once a 16-bit configuration leads and nothing ran in the other
  format, the best uncompiled one is measured in it (:meth:`BayesStrategy._precision_sibling`).
  Where the other format's one probe crashed or diverged (fp16 with Adafactor), that is evidence,
  not yet a rule: it is measured once more in a context the failure leaves likely to run (another
  optimizer, attention kernel or checkpointing), and a second failure confirms it.

* **Other workers' probes in flight** (``state.seen.in_flight``) count as finished with their
  likeliest outcome: a fit at the model's mean where a fit is likelier than not (the "kriging
  believer": the variance around them shrinks, so near-copies lose their expected improvement),
  else an OOM (what it would rule out is not probed meanwhile). N workers deciding on the same
  finished probes then ask N different questions (:meth:`BayesStrategy._pending`). With one
  worker nothing is in flight and nothing changes.

``P(fits)`` needs two memory-model predictions per memory group, the slowest part; the other
factors bound the score from above, so groups are visited best bound first and the visit stops
when no group left can beat the best score found (exact, and usually a few groups).

While nothing has run (every probe so far ran out of memory or failed), the model has no memory
scale: the most frugal memory settings (checkpointing, the optimizer with the least state, the
smallest batch) come first, chosen for the chance they run; once that is being probed by another
worker, the next ones keep its frugal memory settings at larger batches (bracketing the frontier).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna

from autotune.params import COMPILED_GRAPH_PARAMS, TrialParams, mixed_precision_dtype
from autotune.records import Probe, ProbeResult, ProbeStatus
from autotune.search.memory import GROUP_KEYS, PRUNE_MARGIN, UNCALIBRATED_PRUNE_MARGIN, needs_no_less_memory, optimizer_state_bytes
from autotune.search.ranking import Configuration, rank_configurations
from autotune.search.strategies import coverage
from autotune.search.strategies.base import SearchState, SeenKeys, Strategy
from autotune.search.strategies.baselines import tpe_sampler
from autotune.search.strategies.failures import KINDS, FailureModel
from autotune.search.strategies.steptime import LINEAR, SCALE, StepTimeSurrogate
from autotune.search.strategies.surrogate import ACCUM, BATCH, BlockBuilder, Grid, Surrogate, expected_improvement, normal_cdf, normal_cdf_given_above

WORKERS = "dataloader_num_workers"
WARMUP_STEPS = 3  # the probe's default warm-up (ProbeSpec.warmup_steps): compilation happens there
STARTUP_PRIOR_S = 30.0
COMPILE_PRIOR_S = {"default": 60.0, "max-autotune": 200.0}  # before a compiled probe was timed
MAX_AUTOTUNE_COMPILE_FACTOR = 3.0  # max-autotune's compilation over the plain mode's, until timed
WINDOW_PRIOR = (20.0, 8.0)  # measured window: at least this many seconds, or this many steps
MODEL_NOISE = 0.03  # log-scale misfit of the model on top of a probe's own noise
PROBE_NOISE_FLOOR = 0.01
MIN_GAIN = 0.015  # log scale: what a probe must be expected to beat the incumbent by to count
NOTHING_YET_SPEED_WEIGHT = 0.3  # before anything fits: how much speed counts next to the chance to run
POLISH_PROBES = 3  # polishing probes of the best configurations whose time is kept to the end
POLISH_MARGIN = 1.3  # their predicted cost is a guess until their compile mode was timed: keep some more
POLISH_SHARE = 0.5  # at most this share of the run's budget is kept for polishing
COVERAGE_SHARE = 0.2  # at most this share of the run's budget is kept for asking every dimension near the incumbent
MIN_SD = 0.01  # no point is certain: EI stays positive near the incumbent
WORKER_SCALING = 0.9  # loader throughput ~ workers^0.9
CAP_MARGIN = 0.1  # a loader's rate read off a waiting probe is a lower bound (the optimizer step hides in it), log scale
OOM_IMPLIED = 0.05  # P(fits) left where an OOM elsewhere implies this one, given plausible activation ratios
# Relative error of a predicted peak, by what was measured: the group's line, one point of it, a
# group with its activation factors (MemoryModel.class_measured), nothing alike.
MEMORY_SD = {"line": 0.03, "point": 0.10, "class": 0.10, "none": 0.30}
# A twin of a measured group (:func:`_twin`: the same static memory and activation factors, so the
# memory model predicts both alike) differs from it by what the values it differs in store apart:
# fused attention kernels and compile modes keep activations within about 5 % of each other
# (_activation_ratio), fp16 and bf16 store alike. Relative sd of its peak around the twin's.
TWIN_SD = 0.03
# A value that failed once keeps P(runs) of about 0.4 in a context its failure does not hold
# (failures.py: the value, or a pair around it, is to blame); one that failed twice, about 0.05.
# Where a failed 16-bit format is confirmed once more, a context with less is no confirmation.
CONFIRM_P_OK = 0.25
PENDING_NOISE = 0.02  # a pending probe's believed outcome is weighed like a probe with this CI (a real probe's default)
PENDING_NUMBER = 10**9  # pending probes' numbers: after every real trial's

# Prior means of log samples/s effects: the expert ordering, as a starting point only. Siblings of
# one kind are 0.02 apart: on Ampere and later fp16 and bf16 run the same tensor-core rate (bf16 is
# preferred for needing no loss scaling), and sdpa dispatches to flash kernels itself; a wider gap
# kept the sibling from being measured where it is the faster one.
_PRIOR: dict[str, dict[Any, float]] = {
    "precision": {"fp32": 0.0, "tf32": 0.5, "fp16": 0.88, "bf16": 0.9, "fp16+tf32": 0.88, "bf16+tf32": 0.9},
    "attn_implementation": {"eager": 0.0, "sdpa": 0.1, "flash_attention_2": 0.12, "flash_attention_3": 0.14},
    "gradient_checkpointing": {False: 0.0, True: -0.25},
    "optim": {"adamw_torch": -0.03, "adamw_torch_fused": 0.0, "adafactor": -0.05, "adamw_bnb_8bit": 0.0},
}
_PRIOR_SD = {"precision": 0.35, "attn_implementation": 0.12, "torch_compile": 0.15, "gradient_checkpointing": 0.1,
             "optim": 0.05, WORKERS: 0.03, ACCUM: 0.05}
_SATURATION = (1.0, 4.0, 16.0)  # batch sizes at half the saturated rate, as a basis
_HINGES = (16.0, 32.0, 64.0)  # throughput may fall past these sizes
_STEP_SATURATION = (2.0, 8.0, 32.0)  # samples per optimizer step at which its step costs as much as the samples
_TILT_AT = 4.0
_KINDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "precision": {"16-bit": ("fp16", "bf16", "fp16+tf32", "bf16+tf32")},
    "attn_implementation": {"fused": ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")},
    "torch_compile": {"compiled": ("inductor", "inductor:default", "inductor:reduce-overhead", "inductor:max-autotune",
                                   "inductor:max-autotune-no-cudagraphs", "cudagraphs", "aot_eager")},
}
_WITHIN_KIND_SD = 0.06
# Loading in the training process (0 workers) is serial with compute. A probe that measures its input
# wait lets the input model account for that; where probes do not (a replay table, an evaluator of
# one's own), the 0-worker effect is the compute model's to learn, and it can be several-fold.
_MAIN_PROCESS_LOADING_SD = 0.7
_TILT_SD = {"torch_compile": 0.2}  # compilation mostly cuts per-step overhead: its gain depends on the batch
# A user-config field's effect on per-sample time (log): unknown before it is measured, and may be large
# (packing sequences instead of padding them: 2.5x tokens/s on TRL's SFT example).
_USER_FIELD_SD = 0.5
THROUGHPUT_MODEL = "steptime"  # or "linear": rounds 1-10's log-additive model (bench comparisons)
_REFERENCE_BATCH = 8.0  # features are zero here (transformers' default batch size): no variance at the baseline's size


def _curve(b: float, beta: float) -> float:
    return -math.log1p(beta / b) + math.log1p(beta / _REFERENCE_BATCH)


def _tilt(b: float) -> float:
    return _curve(b, _TILT_AT)


def _of_value(dim: str, functions: list[Callable[..., float]], *, tilted: bool = False) -> Callable[[dict[str, Any]], list[float]]:
    """Features of one dimension's value (times the batch tilt if ``tilted``)."""

    def features(v: dict[str, Any]) -> list[float]:
        scale = _tilt(float(v[BATCH])) if tilted else 1.0
        return [f(v[dim]) * scale for f in functions]

    return features


def _prior_mean(dim: str, value: Any) -> float:
    if dim == "torch_compile":
        return 0.0 if value == "off" else 0.05
    return _PRIOR.get(dim, {}).get(value, 0.0)


# ---------------------------------------------------------------------- memory groups


def _precision_class(value: Any) -> str:
    return "amp" if mixed_precision_dtype(str(value)) is not None else "fp32"  # bf16+tf32 stores as bf16


def _needs_no_less(dim: str, x: Any, y: Any) -> bool:
    """Value ``x`` of a memory-group dimension needs at least the memory of ``y`` (by construction)."""
    if x == y:
        return True
    if dim == "precision":
        return _precision_class(x) == _precision_class(y)  # fp32 and tf32 store alike, as do fp16 and bf16
    if dim == "optim":
        return optimizer_state_bytes(x, 10**9, 2048) >= optimizer_state_bytes(y, 10**9, 2048)
    if dim == "gradient_checkpointing":
        return bool(y) and not bool(x)
    if dim == "attn_implementation":
        return x == "eager"  # the only kernel that stores the attention scores
    return False  # compile modes: no order that always holds


def _activation_ratio(dim: str, x: Any, y: Any) -> float:
    """A plausible lower bound of activations per sample with ``x`` over those with ``y``; 0 where
    ``x`` may hold less static memory (so no bound on the total follows)."""
    if x == y:
        return 1.0
    if dim == "precision":
        return 1.0 if _precision_class(x) == _precision_class(y) else 0.0
    if dim == "optim":
        return 1.0 if _needs_no_less(dim, x, y) else 0.0
    if dim == "attn_implementation":
        return 1.0 if x == "eager" else (0.3 if y == "eager" else 1.0)  # fused kernels store alike: over at b, over at b
    if dim == "torch_compile":
        if "off" in (x, y):
            return 0.7  # compiling fuses away some activations
        return 1.0 if "max-autotune" in str(x) else 0.95  # compile modes share the graph; max-autotune's CUDA graphs keep their own pool
    if dim == "gradient_checkpointing":
        return 1.0 if not x else 0.05
    return 0.5


def _twin(dim: str, x: Any, y: Any) -> bool:
    """Values ``x`` and ``y`` of a memory-group dimension store alike, as far as the memory model
    tells: 16-bit or 32-bit storage, fused attention kernels, compile modes (but not compiling or not)."""
    if x == y:
        return True
    if dim == "precision":
        return _precision_class(x) == _precision_class(y)
    if dim == "attn_implementation":
        return "eager" not in (x, y)
    if dim == "torch_compile":
        return "off" not in (x, y)
    return False


def _similarity(dim: str, x: Any, y: Any) -> float:
    """How much memory evidence about a group with value ``y`` carries to one with value ``x`` (0..1)."""
    if x == y:
        return 1.0
    if dim == "precision":
        return 1.0 if _precision_class(x) == _precision_class(y) else 0.0  # AMP adds a weight copy, halves activations
    if dim == "optim":
        return 1.0 if _needs_no_less(dim, x, y) else 0.5  # more state: at least as short of memory
    if dim == "attn_implementation":
        return 0.8 if "eager" not in (x, y) else (1.0 if x == "eager" else 0.5)
    if dim == "torch_compile":
        return 0.8  # compiled activations differ by some tens of percent
    if dim == "gradient_checkpointing":
        return 1.0 if not x else 0.5  # checkpointing frees most activations
    return 0.5


@dataclass
class _Groups:
    """The memory groups of a grid (one per combination of :data:`GROUP_KEYS` values), in C order."""

    dims: tuple[str, ...]
    codes: np.ndarray  # groups x dims: value index per dimension
    values: list[tuple[Any, ...]]
    dominance: list[np.ndarray]  # per dim: [i, j] = value i needs no less memory than value j
    similarity: np.ndarray  # groups x groups: how far an OOM in one says something about the other's memory (0..1)
    activation_ratio: np.ndarray  # [g, h]: a lower bound of g's activations per sample over h's (0: g's static may be smaller)
    twin: np.ndarray  # groups x groups: every value stores alike (_twin)

    @classmethod
    def of(cls, grid: Grid) -> _Groups:
        dims = tuple(n for n in grid.names if n in GROUP_KEYS)
        sizes = [len(grid.values[d]) for d in dims]
        codes = np.array(list(np.ndindex(*sizes)), dtype=int).reshape(-1, len(dims))
        values = [tuple(grid.values[d][i] for d, i in zip(dims, row)) for row in codes]
        dominance = [np.array([[_needs_no_less(d, x, y) for y in grid.values[d]] for x in grid.values[d]]) for d in dims]
        similarity = np.ones((len(codes), len(codes)))
        for d, dim in enumerate(dims):
            table = np.array([[_similarity(dim, x, y) for y in grid.values[dim]] for x in grid.values[dim]])
            similarity *= table[codes[:, d][:, None], codes[:, d][None, :]]
        ratio = np.ones((len(codes), len(codes)))
        for d, dim in enumerate(dims):
            table = np.array([[_activation_ratio(dim, x, y) for y in grid.values[dim]] for x in grid.values[dim]])
            ratio *= table[codes[:, d][:, None], codes[:, d][None, :]]
        twin = np.ones((len(codes), len(codes)), dtype=bool)
        for d, dim in enumerate(dims):
            table = np.array([[_twin(dim, x, y) for y in grid.values[dim]] for x in grid.values[dim]])
            twin &= table[codes[:, d][:, None], codes[:, d][None, :]]
        return cls(dims, codes, values, dominance, similarity, ratio, twin)

    def index(self, params: TrialParams, grid: Grid) -> int:
        codes = [grid.values[d].index(getattr(params, d)) for d in self.dims]
        return int(np.ravel_multi_index(tuple(codes), [len(grid.values[d]) for d in self.dims])) if codes else 0

    def needing_no_less_than(self, group: int) -> np.ndarray:
        mask = np.ones(len(self.codes), dtype=bool)
        for d, table in enumerate(self.dominance):
            mask &= table[self.codes[:, d], self.codes[group, d]]
        return mask

    def needing_no_more_than(self, group: int) -> np.ndarray:
        mask = np.ones(len(self.codes), dtype=bool)
        for d, table in enumerate(self.dominance):
            mask &= table[self.codes[group, d], self.codes[:, d]]
        return mask


@dataclass
class MemoryEvidence:
    """Measured peaks and OOMs per memory group, spread to the groups they say something about.

    ``ruled_out[g, a, j]``: an OOM, or a peak over the ceiling, at a batch and accumulation (indices
    j and a; one accumulation index where the grid has none) needing no more memory
    (:func:`~autotune.search.memory.needs_no_less_memory`: a smaller batch, or the same batch with
    no more accumulation) in a group needing no more memory than g. ``known_fit[g, a, j]``: a peak
    under the ceiling at one needing no less in a group needing no less (this wins: measurements of
    g's own are exact).
    """

    fits: dict[int, dict[int, int]]  # group -> batch -> measured peak
    ooms: list[tuple[int, int]]  # (group, batch index) out of memory
    over: list[tuple[int, int]]  # (group, batch index) out of memory or measured over the ceiling
    ruled_out: np.ndarray  # groups x accumulations x batches
    known_fit: np.ndarray

    @classmethod
    def of(cls, groups: _Groups, grid: Grid, history: Iterable[Probe], ceiling: int) -> MemoryEvidence:
        batches = list(grid.values[BATCH])
        accums: list[int] = list(grid.values[ACCUM]) if ACCUM in grid.names else [1]
        fits: dict[int, dict[int, int]] = {}
        ooms: list[tuple[int, int]] = []
        over: list[tuple[int, int]] = []
        ruled_out = np.zeros((len(groups.codes), len(accums), len(batches)), dtype=bool)
        known_fit = np.zeros_like(ruled_out)
        for probe in history:
            batch, accum = probe.params.per_device_train_batch_size, probe.params.gradient_accumulation_steps if ACCUM in grid.names else 1
            if batch not in batches or accum not in accums:
                continue
            group = groups.index(probe.params, grid)
            j = batches.index(batch)
            if probe.result.status is ProbeStatus.OOM:
                ooms.append((group, j))
                over.append((group, j))
                ruled_out[groups.needing_no_less_than(group)] |= _cells(accums, batches, batch, accum, no_less=True)
            elif probe.result.ok and probe.result.peak_mem_bytes is not None:
                peak = int(probe.result.peak_mem_bytes)
                mine = fits.setdefault(group, {})
                mine[j] = max(mine.get(j, 0), peak)
                if peak > ceiling:
                    over.append((group, j))
                    ruled_out[groups.needing_no_less_than(group)] |= _cells(accums, batches, batch, accum, no_less=True)
                else:
                    known_fit[groups.needing_no_more_than(group)] |= _cells(accums, batches, batch, accum, no_less=False)
        return cls(fits, ooms, over, ruled_out & ~known_fit, known_fit)

    @staticmethod
    def cell(grid: Grid, params: TrialParams) -> tuple[int, int]:
        """``params``' (accumulation, batch) indices into the second and third axes."""
        a = grid.values[ACCUM].index(params.gradient_accumulation_steps) if ACCUM in grid.names else 0
        return a, grid.values[BATCH].index(params.per_device_train_batch_size)


def _cells(accums: list[int], batches: list[int], batch: int, accum: int, *, no_less: bool) -> np.ndarray:
    """An accumulations x batches mask: the cells needing no less memory than ``batch`` x ``accum``
    (``no_less``), or no more."""
    return np.array([[needs_no_less_memory(b, a, batch, accum) if no_less else needs_no_less_memory(batch, accum, b, a) for b in batches]
                     for a in accums], dtype=bool)


# ---------------------------------------------------------------------- the strategy


@dataclass
class _Context:
    """What depends on the space only: the grid, the surrogate's features, the memory groups."""

    grid: Grid
    surrogate: Surrogate | StepTimeSurrogate
    groups: _Groups
    batch_values: np.ndarray  # grid-broadcastable
    accum_values: np.ndarray  # grid-broadcastable (derived from the batch under a fixed effective batch size)
    compile_values: np.ndarray  # grid-broadcastable
    other_axes: tuple[int, ...]  # the grid axes that are not memory-group dimensions
    lines: dict[int, tuple[float, float] | None] = field(default_factory=dict)  # per group, for one history length
    lines_at: int = -1
    p_fit_rows: dict[int, np.ndarray] = field(default_factory=dict)  # per group, for the evidence, ceiling and lines in p_fit_for
    p_fit_misses: dict[int, tuple[float, float]] | None = None  # per group gone over the ceiling: its largest margin missed (sds), its sd
    p_fit_for: tuple[Any, ...] = (None, -1, -1)
    p_ok: dict[str, tuple[tuple[Any, ...], np.ndarray]] = field(default_factory=dict)  # per kind of failure, its last prediction by its key
    flat_of_key: dict[tuple[Any, ...], int | None] = field(default_factory=dict)
    group_params: dict[int, TrialParams] = field(default_factory=dict)  # per group, a configuration of it
    main_process_loading: int | None = None  # the surrogate's feature of 0 loader workers, if the space has it


class BayesStrategy(Strategy):
    """Expected improvement per probe second under a learnt throughput, failure and memory model."""

    name = "bayes"

    def __init__(self) -> None:
        self._context: _Context | None = None
        self._budget_s = 0.0  # the most time left seen: this run's budget

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return tpe_sampler(seed)

    def prune(self, params: TrialParams, state: SearchState) -> str | None:
        reason = state.memory.prune_reason(params, state.ceiling_bytes)
        if reason is not None:
            return reason
        context = self._get_context(state)
        grid = context.grid
        if grid.flat_index(params) is None:
            return None
        evidence = MemoryEvidence.of(context.groups, grid, state.history, state.ceiling_bytes)
        if evidence.ruled_out[(context.groups.index(params, grid),) + MemoryEvidence.cell(grid, params)]:
            return "out of memory, or over the ceiling, at a batch and accumulation no larger in a group needing no more memory"
        for kind in KINDS:
            failed = FailureModel.from_history(grid, state.history, kind).certain_failure(params)
            if failed is not None:
                return f"holds every suspect of the {kind.name} of {failed.short()}"
        return None

    # ------------------------------------------------------------------ proposing

    def propose(self, state: SearchState) -> TrialParams | None:
        context = self._get_context(state)
        grid = context.grid
        history = list(state.history)
        ran = [p for p in history if p.result.status is ProbeStatus.OK and p.result.samples_per_s and grid.flat_index(p.params) is not None]
        evidence = MemoryEvidence.of(context.groups, grid, history, state.ceiling_bytes)
        pending = self._pending(context, state, evidence)
        mean, sd, cap = self._throughput(context, ran, [params for params, fits in pending if fits])
        feasible = state.feasible()
        nothing_ran = not ran
        if pending:
            # Other workers' probes in flight count as finished with the outcome the model expects
            # (see _pending), so this proposal complements them instead of repeating their question.
            believed = self._believed(context, state, pending, mean)
            ran = ran + [p for p in believed if p.result.ok]
            history = history + believed
            evidence = MemoryEvidence.of(context.groups, grid, history, state.ceiling_bytes)
            feasible = rank_configurations(history, state.ceiling_bytes)
        p_ok: np.ndarray = np.ones(1)
        for kind in KINDS:
            failures = FailureModel.from_history(grid, state.history, kind)  # what ran: a pending probe may still crash
            cached = context.p_ok.get(kind.name)
            if cached is None or cached[0] != failures.key():
                cached = context.p_ok[kind.name] = (failures.key(), failures.p_ok_grid(grid))
            p_ok = p_ok * cached[1]  # over every axis but the batch: broadcast where used
        p_ok = np.broadcast_to(p_ok, grid.shape)
        cost_ok, cost_fail = self._costs(context, history, mean)
        # What may be proposed at all.
        allowed = p_ok > 0.0
        allowed = allowed & ~self._batch_grid(context, evidence.ruled_out)
        if state.remaining_s is not None:
            allowed = allowed & (cost_ok <= state.remaining_s)
        if nothing_ran:  # what ran, not what is believed to: a pending probe's fit is only likelier than not
            frugal = allowed & self._frugal_mask(context, any_batch=self._frugal_pending(context, pending))
            allowed = frugal if frugal.any() else allowed
        allowed = allowed.copy()
        allowed.reshape(-1)[self._seen_flat(context, state, history)] = False
        if not allowed.any():
            return None
        if state.remaining_s is not None:
            self._budget_s = max(self._budget_s, state.remaining_s)
        sibling = self._precision_sibling(context, state, feasible, allowed, history, p_ok, mean, evidence)
        if sibling is not None:
            return grid.params_at(sibling)
        comparison = self._comparison(context, state, feasible, allowed, evidence, history)
        if comparison is not None and state.remaining_s is None:
            return grid.params_at(comparison)
        gain = self._gain(context, feasible, mean, sd, cap, allowed)
        if state.remaining_s is not None:
            # A probe that would eat into the time kept for polishing is not started.
            reserve, polish, order = self._polish_reserve(context, state, feasible, (mean, sd, cap), p_ok, cost_ok, allowed, evidence)
            if comparison is not None:
                # The groups are compared once exploring has had its time to find each one's best
                # (what is left is twice what polishing and the comparison need: time to polish the
                # winner, and to explore around it), and the comparison's time is kept meanwhile.
                compare_s = float(np.broadcast_to(cost_ok, grid.shape).reshape(-1)[comparison])
                if state.remaining_s <= 2.0 * (reserve + compare_s):
                    return grid.params_at(comparison)
                reserve += compare_s
            # Every dimension asked once near the incumbent (coverage), cheapest first: its time is
            # kept like polishing's, and it is asked at once where precisions tie.
            tie = coverage.tie_across_precisions(feasible)
            question, question_s, asking_s = self._coverage(context, state, feasible, allowed, cost_ok, loader_first=tie)
            due = tie or asking_s + reserve + state.kept_s >= state.remaining_s
            if question is not None and due and question_s + state.kept_s <= state.remaining_s:  # not the near-ties' time
                return question
            reserve += asking_s
            if order and reserve >= state.remaining_s:
                # The time left is what was kept: polish, the most valuable probe first (cheaper ones
                # rank first per second, and the one that pays most would no longer fit after them).
                return grid.params_at(order[0])
            # Nor an exploring one that would eat into the time the loop keeps for the near-ties (kept_s).
            allowed = allowed & (polish | (cost_ok + reserve + state.kept_s <= state.remaining_s))
            if not allowed.any():
                return None
        # Upper bound of the score (P(fits) = 1 wherever no evidence says otherwise), then the exact
        # score group by group, best bound first.
        bound = self._score(gain, p_ok, np.ones(1), cost_ok, cost_fail, allowed)
        best = self._best_over_groups(context, state, evidence, bound, lambda cells, p_fit: self._score(
            gain[cells], p_ok[cells], p_fit, cost_ok[cells], cost_fail[cells], allowed[cells]))
        return None if best is None else grid.params_at(best[1])

    def _coverage(self, context: _Context, state: SearchState, feasible: list[Configuration], allowed: np.ndarray,
                  cost_ok: np.ndarray, *, loader_first: bool = False) -> tuple[TrialParams | None, float, float]:
        """The cheapest question left near the incumbent (:mod:`~autotune.search.strategies.coverage`),
        its seconds, and the seconds all of them take: per unasked dimension its first variant that may be proposed
        (not ruled out by the memory model or a measured failure), at the largest batch up to the
        incumbent's likelier to fit than not; ``loader_first``: in :data:`coverage.DIMENSIONS`' order
        (the loader's workers first), not by cost."""
        if not feasible:
            return None, 0.0, 0.0
        grid = context.grid
        incumbent = feasible[0].params
        flat_allowed = allowed.reshape(-1)
        flat_cost = np.broadcast_to(cost_ok, grid.shape).reshape(-1)
        questions: list[tuple[float, int, TrialParams]] = []
        evidence: MemoryEvidence | None = None
        for rank, dimension in enumerate(coverage.unasked(state.space, incumbent, state.history)):
            for variant in coverage.variants(state.space, incumbent, dimension):
                if dimension == "gradient_checkpointing" and variant.gradient_checkpointing:  # its point: a larger batch
                    evidence = evidence or MemoryEvidence.of(context.groups, grid, state.history, state.ceiling_bytes)
                    largest = state.space.with_changes(variant, per_device_train_batch_size=max(grid.values[BATCH]))
                    variant = self._likely_batch(context, state, evidence, largest) or variant
                if state.memory.prune_reason(variant, state.ceiling_bytes) is not None:
                    evidence = evidence or MemoryEvidence.of(context.groups, grid, state.history, state.ceiling_bytes)
                    variant = self._likely_batch(context, state, evidence, variant) or variant
                index = grid.flat_index(variant)
                if index is not None and flat_allowed[index] and state.memory.prune_reason(variant, state.ceiling_bytes) is None:
                    questions.append((float(flat_cost[index]), rank, variant))
                    break
        if not questions:
            return None, 0.0, 0.0
        questions.sort(key=lambda q: (q[1], q[0]) if loader_first else (q[0], q[1]))
        # At most COVERAGE_SHARE of the run's budget is kept for them, the first ones (cheapest, or the loader's) first.
        most = COVERAGE_SHARE * self._budget_s if self._budget_s > 0 else math.inf
        kept = 0.0
        for cost, _, _ in questions:
            if kept + cost > most:
                break
            kept += cost
        return questions[0][2], questions[0][0], kept

    def _best_over_groups(self, context: _Context, state: SearchState, evidence: MemoryEvidence, bound: np.ndarray,
                          exact: Callable[[tuple[Any, ...], np.ndarray], np.ndarray]) -> tuple[float, int] | None:
        """The largest ``exact(cells, p_fit)`` over the grid (``cells`` one memory group's index into
        grid-shaped arrays, ``p_fit`` its P(fits): 1 where known to fit), and its flat index; ``None``
        where no group's ``bound`` (grid-shaped, ``exact`` with P(fits) = 1) is finite. What the
        memory model prunes and no probe showed to fit is never the largest. P(fits) needs two
        memory-model predictions per group, the slowest part, so groups are visited best bound
        first, and the visit stops when no group left can beat the best found (exact, since
        ``exact`` rises with P(fits))."""
        known = self._batch_grid(context, evidence.known_fit)
        per_group = bound.max(axis=context.other_axes).reshape(-1)
        shape = self._batch_shape(context)
        self._refresh_lines(context, state, len(state.history))
        best_value, best_index = -np.inf, None
        for group in np.argsort(-per_group, kind="stable"):
            if per_group[group] <= best_value or not np.isfinite(per_group[group]):
                break
            cells = self._group_cells(context, int(group))
            p_fit = np.where(known[cells], 1.0, self._p_fit_row(context, state, evidence, int(group)).reshape(shape))
            value = np.where(self._pruned_row(context, state, evidence, int(group)).reshape(shape) & ~known[cells], -np.inf, exact(cells, p_fit))
            local = int(np.argmax(value))
            if value.reshape(-1)[local] > best_value:
                best_value, best_index = float(value.reshape(-1)[local]), self._flat_of(context, int(group), local)
        return None if best_index is None else (best_value, best_index)

    # ------------------------------------------------------------------ the throughput model

    def _throughput(self, context: _Context, ran: list[Probe], pending: Iterable[TrialParams] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Posterior mean and sd of log samples/s on the grid, loader included, and the loader's cap;
        ``pending`` configurations (in flight elsewhere, expected to fit) count as measured at the
        model's own mean (the "kriging believer"): that takes the uncertainty, so the expected
        improvement, out of them and their neighbours, without moving the mean."""
        surrogate = context.surrogate
        measured: list[TrialParams] = []
        targets: list[float] = []
        noise: list[float] = []
        for probe in ran:
            wait = min(probe.result.input_wait_fraction or 0.0, 0.9)
            measured.append(probe.params)
            targets.append(math.log(probe.result.samples_per_s or 1.0) - math.log1p(-wait))  # the compute part
            probe_noise = max(probe.result.step_time_ci95_rel or 0.02, PROBE_NOISE_FLOOR)
            noise.append(probe_noise**2 + MODEL_NOISE**2 + (wait / (1 - wait) * 0.05) ** 2)
        surrogate.set_scale(measured, targets)
        if context.main_process_loading is not None:
            unmeasured = any(probe.result.input_wait_fraction is None for probe in ran)
            surrogate.prior_sd[context.main_process_loading] = _MAIN_PROCESS_LOADING_SD if unmeasured else _PRIOR_SD[WORKERS]
        surrogate.fit_params(measured, np.array(targets), np.array(noise))
        pending = list(pending)
        if pending:
            believed_mean, _ = surrogate.predict_params(pending)
            measured += pending
            targets += [float(m) for m in believed_mean]
            noise += [PENDING_NOISE**2 + MODEL_NOISE**2] * len(pending)
            surrogate.fit_params(measured, np.array(targets), np.array(noise))
        compute_mean, sd = surrogate.predict_grid()
        mean, cap = self._input_model(context, ran, compute_mean)
        return mean, np.maximum(sd, np.float32(MIN_SD)), cap

    def _pending(self, context: _Context, state: SearchState, evidence: MemoryEvidence) -> list[tuple[TrialParams, bool]]:
        """The configurations in flight in other workers (``state.seen.in_flight``) and whether each
        is expected to fit: known to fit, or likelier to fit than not (and not ruled out).

        Without them N workers deciding on the same finished probes ask N near-copies of one
        question: the same memory cell with another loader worker count, three probes of a batch
        whose first OOM would rule out the other two. Counting each as finished with its likeliest
        outcome (a fit at the model's mean, else an OOM) makes the next proposal complement them.
        """
        in_flight = state.seen.in_flight if isinstance(state.seen, SeenKeys) else ()
        if not in_flight:
            return []
        grid = context.grid
        self._refresh_lines(context, state, len(state.history))
        pending: list[tuple[TrialParams, bool]] = []
        for key in sorted(in_flight, key=repr):  # a stable order: the storage's set order is not
            params = TrialParams.from_key(key)
            if grid.flat_index(params) is None:
                continue
            group, (a, j) = context.groups.index(params, grid), MemoryEvidence.cell(grid, params)
            if evidence.known_fit[group, a, j] or evidence.ruled_out[group, a, j]:
                fits = bool(evidence.known_fit[group, a, j])
            else:
                fits = bool(self._p_fit_row(context, state, evidence, group)[j] >= 0.5)
            pending.append((params, fits))
        return pending

    def _believed(self, context: _Context, state: SearchState, pending: list[tuple[TrialParams, bool]], mean: np.ndarray) -> list[Probe]:
        """Pending configurations as probes with their believed outcome: a fit at the posterior
        mean (its peak at the memory model's prediction, at most the ceiling), or an OOM."""
        grid = context.grid
        flat_mean = np.broadcast_to(mean, grid.shape).reshape(-1)
        believed = []
        for i, (params, fits) in enumerate(pending):
            if fits:
                result = ProbeResult(ProbeStatus.OK, samples_per_s=float(np.exp(flat_mean[grid.flat_index(params)])),
                                     peak_mem_bytes=self._believed_peak(context, state, params))
            else:
                result = ProbeResult(ProbeStatus.OOM)
            believed.append(Probe(PENDING_NUMBER + i, params, result))
        return believed

    def _believed_peak(self, context: _Context, state: SearchState, params: TrialParams) -> int:
        ceiling = state.ceiling_bytes
        line = self._line(context, state, context.groups.index(params, context.grid))
        if line is None:
            return ceiling
        return int(min(max(line[0] + line[1] * params.per_device_train_batch_size, 1.0), ceiling))

    def _input_model(self, context: _Context, ran: list[Probe], compute_mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean log samples/s with the loader in, and the loader's cap per point (+inf: none known)."""
        grid = context.grid
        shape = grid.broadcast_shape((WORKERS,))
        if WORKERS not in grid.names:
            return compute_mean, np.full(shape, np.inf)
        main_rates, worker_rates, worker_bounds = [], [], []
        for probe in ran:
            wait = probe.result.input_wait_fraction
            sps = probe.result.samples_per_s or 0.0
            count = probe.params.dataloader_num_workers
            if wait is None or sps <= 0:
                continue
            if count == 0:
                if wait > 0.01:
                    main_rates.append(sps / wait)  # loading in the training process is serial with compute
            elif wait > 0.05:
                worker_rates.append(sps / count**WORKER_SCALING)  # the loader sets the pace
            else:
                worker_bounds.append(sps / count**WORKER_SCALING)  # the loader kept up: at least this fast
        main_rate = statistics.median(main_rates) if main_rates else None
        # One worker's rate: every probe with workers bounds it from below (a waiting probe's
        # throughput is below its loader's rate: its optimizer step adds to the step), so the
        # largest bound is the estimate.
        fastest_worker = max(worker_rates + worker_bounds, default=None)
        if worker_rates and fastest_worker is not None:  # a probe waited for its loader: the loader's pace was measured
            per_worker = fastest_worker
        elif main_rate is not None:
            per_worker = max(main_rate, max(worker_bounds, default=0.0))  # one worker about as fast as the main process
        else:
            per_worker = math.inf
        workers = np.array(grid.values[WORKERS], dtype=float).reshape(shape)
        if math.isfinite(per_worker):
            cap = np.where(workers > 0, np.log(per_worker * np.maximum(workers, 1.0) ** WORKER_SCALING) + CAP_MARGIN, np.inf)
        else:
            cap = np.full(shape, np.inf)
        cap = cap.astype(np.float32)
        # The expected throughput stops at the rate measured, not at the margin above it: the
        # margin is room for improvement (what EI may count up to), not a prediction.
        mean = np.minimum(compute_mean, cap - np.float32(CAP_MARGIN))
        if main_rate is None and fastest_worker is not None:
            # Nothing measured loading in the training process yet: it loads about as fast as one
            # worker (the same code on one core), serial with compute; where the loader kept up
            # that rate is a lower bound, so 0 workers is, if anything, judged too slow.
            main_rate = fastest_worker
        if main_rate is not None:
            serial = -np.log(np.exp(-compute_mean) + np.float32(1.0 / main_rate))
            mean = np.where(workers == 0, serial, mean)
        return mean.astype(np.float32), cap

    def _gain(self, context: _Context, feasible: list[Configuration], mean: np.ndarray, sd: np.ndarray, cap: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """Expected improvement (log samples/s) over the incumbent, at most up to a point's loader cap."""
        grid = context.grid
        if not feasible:
            # Nothing fits yet: what runs at all matters most (it clears its values of suspicion and
            # gives the memory model its scale); among those, mildly prefer the fast.
            top = float(mean[allowed].max()) if allowed.any() else 0.0
            return np.exp(NOTHING_YET_SPEED_WEIGHT * (mean - top))
        # Improvements within a probe's noise are not worth a probe: count only those beyond it.
        # Compilation multiplies throughput by a factor of its own, so an uncompiled configuration
        # that beats the incumbent's uncompiled self will beat the incumbent once compiled: it is
        # measured against that, at a fraction of the cost of compiling every candidate. The
        # incumbent's uncompiled self is the best uncompiled configuration measured, or, where
        # higher, the incumbent less the compile effect the model expects for it (its uncompiled
        # self may never have run: compiled, a batch can fit that does not uncompiled).
        best_all = math.log(feasible[0].mean_samples_per_s) + MIN_GAIN
        plain = [c for c in feasible if c.params.torch_compile == "off"]
        best_plain = math.log(plain[0].mean_samples_per_s) + MIN_GAIN if plain else best_all
        incumbent = feasible[0].params
        here, uncompiled = grid.flat_index(incumbent), grid.flat_index(incumbent.replace(torch_compile="off"))
        if plain and here is not None and uncompiled is not None and here != uncompiled:
            flat_mean = np.broadcast_to(mean, grid.shape).reshape(-1)
            best_plain = max(best_plain, best_all - max(float(flat_mean[here] - flat_mean[uncompiled]), 0.0))
        best = np.where(context.compile_values == "off", best_plain, best_all).astype(np.float32)
        cap = np.broadcast_to(cap, grid.shape)
        capped = np.isfinite(cap)
        gain = expected_improvement(mean, sd, best)
        if capped.any():
            gain = gain - np.where(capped, expected_improvement(mean, sd, np.where(capped, cap, 0.0)), 0.0)
        return np.where(cap > best, np.maximum(gain, 0.0), 0.0)

    def _comparison(self, context: _Context, state: SearchState, feasible: list[Configuration], allowed: np.ndarray,
                    evidence: MemoryEvidence, history: list[Probe]) -> int | None:
        """The other checkpointing group's best configuration accumulating as many samples per
        optimizer step as the incumbent (its flat grid index), once per group.

        Checkpointing trades speed for memory, so the two groups run different batch sizes: the
        group without it runs smaller batches, whose optimizer step weighs more per sample, and a
        probe at accumulation 1 charges it the whole step. Compared at equal samples per optimizer
        step (accumulation amortises the step, as polishing would), the group that looked slower
        may win; the throughput model cannot tell a batch's overhead from an optimizer step's until
        such a probe measures the difference. Where nothing without checkpointing has fitted yet,
        the candidate is the best uncompiled configuration with checkpointing switched off, at the
        largest batch no larger than its own that is likelier to fit than not. Not proposed where
        the other group already has a probe amortising its step over as many samples. When it runs
        is :meth:`propose`'s choice (with a time budget: once exploring has had its time).
        """
        grid = context.grid
        if not feasible or ACCUM not in grid.names or "gradient_checkpointing" not in grid.names:
            return None
        incumbent = feasible[0].params
        target = incumbent.effective_batch_size
        flat_allowed = allowed.reshape(-1)
        for value in grid.values["gradient_checkpointing"]:
            if value == incumbent.gradient_checkpointing:
                continue
            if any(p.params.gradient_checkpointing == value and p.params.effective_batch_size >= target
                   for p in history):
                continue
            best = next((c.params for c in feasible if c.params.gradient_checkpointing == value), None)
            if best is None:
                if value:
                    continue  # checkpointing pays only at larger batches, which the measured group's OOMs say nothing about
                plain = next((c.params for c in feasible if c.params.torch_compile == "off"), incumbent)
                likely = self._likely_batch(context, state, evidence, state.space.with_changes(plain, gradient_checkpointing=value, torch_compile="off"))
                if likely is None:
                    continue
                best = state.space.with_changes(likely, **{ACCUM: min(grid.values[ACCUM])})
            accums = [a for a in sorted(grid.values[ACCUM]) if a >= best.gradient_accumulation_steps]
            accum = next((a for a in accums if a * best.per_device_train_batch_size >= target), accums[-1] if accums else None)
            if accum is None:
                continue
            index = grid.flat_index(state.space.with_changes(best, **{ACCUM: accum}))
            if index is not None and flat_allowed[index]:
                return index
        return None

    def _precision_sibling(self, context: _Context, state: SearchState, feasible: list[Configuration], allowed: np.ndarray,
                           history: list[Probe], p_ok: np.ndarray, mean: np.ndarray, evidence: MemoryEvidence) -> int | None:
        """The best uncompiled configuration with the incumbent's 16-bit precision, in the other
        16-bit format (fp16 for bf16 and back; its flat grid index), once, where nothing ran in it.

        The two formats run the same tensor-core rate on paper, and either can be several percent
        faster for a model (loss scaling, kernels that differ), which only a measurement tells; the
        model prefers neither by more than its prior, so per second of probe time the question
        ranks late, while its answer carries to every configuration of that precision (compiled
        ones too, where a probe costs many times more). One uncompiled probe asks it.

        Where the other format's one probe so far crashed or diverged (fp16 with Adafactor, say),
        the failure is one piece of evidence, not yet a rule: the question is asked once more, in a
        context the failure leaves a fair chance to run (:data:`CONFIRM_P_OK`), the best uncompiled configuration
        with one of its code-path values changed (optimizer, attention kernel, checkpointing), at
        the largest batch no larger than its own that likely fits; of those, the fastest expected
        times P(runs). A second failure there confirms the format's own failure."""
        grid = context.grid
        if not feasible or "precision" not in grid.names:
            return None
        incumbent = feasible[0].params
        base = mixed_precision_dtype(incumbent.precision)
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
            return index if index is not None and bool(flat_allowed[index]) else None
        flat_p_ok = np.broadcast_to(p_ok, grid.shape).reshape(-1)
        flat_mean = np.broadcast_to(mean, grid.shape).reshape(-1)
        contexts = [sibling] + [state.space.with_changes(sibling, **{dim: value}) for dim in ("optim", "attn_implementation", "gradient_checkpointing")
                                if dim in grid.names for value in grid.values[dim] if value != getattr(sibling, dim)]
        best_value, best_index = -math.inf, None
        for switched in contexts:
            candidate = self._likely_batch(context, state, evidence, switched)
            index = None if candidate is None else grid.flat_index(candidate)
            if index is None or not flat_allowed[index] or flat_p_ok[index] < CONFIRM_P_OK:
                continue
            value = float(flat_p_ok[index] * np.exp(flat_mean[index]))
            if value > best_value:
                best_value, best_index = value, index
        return best_index

    def _likely_batch(self, context: _Context, state: SearchState, evidence: MemoryEvidence, params: TrialParams) -> TrialParams | None:
        """``params`` at the largest batch no larger than its own that is likelier to fit than not
        (``None`` where none is)."""
        grid = context.grid
        self._refresh_lines(context, state, len(state.history))
        p_fit = self._p_fit_row(context, state, evidence, context.groups.index(params, grid))
        likely = [b for b, p in zip(grid.values[BATCH], p_fit) if p >= 0.5 and b <= params.per_device_train_batch_size]
        return state.space.with_changes(params, per_device_train_batch_size=max(likely)) if likely else None

    def _polish_reserve(self, context: _Context, state: SearchState, feasible: list[Configuration], model: tuple[np.ndarray, np.ndarray, np.ndarray],
                        p_ok: np.ndarray, cost_ok: np.ndarray, allowed: np.ndarray, evidence: MemoryEvidence) -> tuple[float, np.ndarray, list[int]]:
        """Seconds to keep for polishing the best configurations, the polishing probes themselves (a
        grid mask, and their flat indices, most valuable first).

        Compilation and accumulation multiply throughput and cost a probe many times over (a compile
        mode's compilation, a step of many micro-batches), so per second they rank late, and a run
        that explores until its end never gets to them. Their most promising variants of the
        incumbent and of the best configuration with and without checkpointing, one polishing
        dimension changed (another compile mode, or more accumulation), and the model's own pick
        (:meth:`_models_pick`: fp16 measured faster than bf16 in one place, a compile mode in
        another: no one-dimension variant holds both), keep their time: the best of each
        dimension, the one worth most first, its worth P(runs) x its expected improvement over the
        incumbent, for the model's pick x P(fits) (a variant of a configuration that fits: the
        memory model's doubt about an unmeasured compile mode cost more than the rare OOM, round
        14) (per probe, not per second: the time is kept for them anyway; and over the incumbent
        itself, not over the best uncompiled configuration, which guides exploring, not the final
        choice), at their predicted cost, which follows the measured compile and step times, and at
        most :data:`POLISH_SHARE` of the run's budget; two that differ only in the loader's workers
        ask one question and keep time once. Compile variants of other uncompiled
        configurations are left to exploring, which measures those against the best uncompiled.
        """
        grid = context.grid
        if not feasible:
            return 0.0, np.zeros(grid.shape, dtype=bool), []
        bases = [feasible[0].params]
        for value in grid.values.get("gradient_checkpointing", ()):
            bases += [c.params for c in feasible if c.params.gradient_checkpointing == value][:1]
        bases = list(dict.fromkeys(bases))
        mean, sd, cap = model
        flat = {name: np.broadcast_to(a, grid.shape).reshape(-1) for name, a in
                (("mean", mean), ("sd", sd), ("cap", cap), ("p_ok", p_ok), ("cost_ok", cost_ok), ("allowed", allowed))}
        best = math.log(feasible[0].mean_samples_per_s) + MIN_GAIN

        # A polishing probe's value, if it fits: P(runs) x expected improvement over the incumbent, up to the loader's cap.
        top = np.minimum(flat["cap"], flat["mean"]).astype(np.float64)
        worth = np.where(flat["allowed"], flat["p_ok"] * expected_improvement(top, flat["sd"].astype(np.float64), best), 0.0)

        # One polishing dimension changed at a time (a compile mode, or more accumulation): the
        # best of each keeps its time, so an expensive compilation is not crowded out by a
        # combination that costs both.
        best_of: dict[str, tuple[float, float, int]] = {}
        for base in bases:
            variants: list[tuple[str, dict[str, Any]]] = [("torch_compile", {"torch_compile": m}) for m in grid.values["torch_compile"] if m != base.torch_compile]
            if ACCUM in grid.names:
                variants += [(ACCUM, {ACCUM: a}) for a in grid.values[ACCUM] if a > base.gradient_accumulation_steps]
            for dim, changes in variants:
                index = grid.flat_index(state.space.with_changes(base, **changes))
                if index is None or not flat["allowed"][index]:
                    continue
                value = float(worth[index])
                if value > 0 and value > best_of.get(dim, (0.0, 0.0, -1))[0]:
                    best_of[dim] = (value, float(flat["cost_ok"][index]), index)
        pick = self._models_pick(context, state, evidence, worth)
        if pick is not None:  # where it is a variant already, that entry is worth no less (no P(fits)) and keeps the time
            best_of["model"] = (pick[0], float(flat["cost_ok"][pick[1]]), pick[1])
        most = POLISH_SHARE * self._budget_s if self._budget_s > 0 else math.inf
        keep = np.zeros(grid.size, dtype=bool)
        reserve, order = 0.0, []
        # One question, one probe: candidates that are the same configuration, or differ only in the
        # loader's workers (the model's pick next to a variant, say), keep their time once, the one worth more.
        candidates: list[tuple[float, int]] = []
        questions: set[TrialParams] = set()
        for _, cost, index in sorted(best_of.values(), reverse=True):
            question = grid.params_at(index).replace(**{WORKERS: 0})
            if question not in questions:
                questions.add(question)
                candidates.append((cost, index))
        for cost, index in candidates[:POLISH_PROBES]:
            if reserve + POLISH_MARGIN * cost <= most and cost <= (state.remaining_s or math.inf):
                keep[index] = True
                order.append(index)
                reserve += POLISH_MARGIN * cost
        return reserve, keep.reshape(grid.shape), order

    def _models_pick(self, context: _Context, state: SearchState, evidence: MemoryEvidence, worth: np.ndarray) -> tuple[float, int] | None:
        """The model's own pick for polishing: the configuration with the largest ``worth`` (flat, a
        probe's value if it fits) times P(fits), and that value (``None`` where none is worth anything).

        It combines factors measured in different places (fp16 beat bf16 uncompiled, max-autotune
        beat inductor with bf16; flash beat sdpa uncompiled, a compile mode ran with sdpa; a batch
        without checkpointing that the memory model now expects to fit), which no one-dimension
        variant of a measured configuration does. Its worth counts the chance that it runs (the
        fastest expected configuration may hold a value that crashed twice) and that it fits (1
        where a configuration needing no more memory fitted at a batch no smaller), so a long shot
        does not take the kept time. Found like a proposal (:meth:`_best_over_groups`).
        """
        shaped = worth.reshape(context.grid.shape)
        best = self._best_over_groups(context, state, evidence, np.where(shaped > 0.0, shaped, -np.inf),
                                      lambda cells, p_fit: shaped[cells] * p_fit)
        return best if best is not None and best[0] > 0.0 else None

    @staticmethod
    def _score(gain: Any, p_ok: Any, p_fit: Any, cost_ok: Any, cost_fail: Any, allowed: Any) -> np.ndarray:
        """Expected improvement per expected probe second (increasing in P(fits), so 1 bounds it)."""
        p_run = p_ok * p_fit
        expected_cost = p_run * cost_ok + (1.0 - p_run) * cost_fail
        return np.where(allowed, p_run * gain / np.maximum(expected_cost, 1.0), -np.inf)

    # ------------------------------------------------------------------ memory, per group

    def _refresh_lines(self, context: _Context, state: SearchState, stamp: int) -> None:
        if context.lines_at != stamp:
            context.lines, context.lines_at = {}, stamp

    def _line(self, context: _Context, state: SearchState, group: int) -> tuple[float, float] | None:
        """The memory model's peak for ``group`` as (bytes at batch 0, bytes per sample); ``None`` before any scale."""
        if group not in context.lines:
            params = self._group_params(context, group)
            one = state.memory.predict(params.replace(per_device_train_batch_size=1))
            two = state.memory.predict(params.replace(per_device_train_batch_size=2))
            context.lines[group] = None if one is None or two is None else (2.0 * one - two, float(two - one))
        return context.lines[group]

    @staticmethod
    def _group_params(context: _Context, group: int) -> TrialParams:
        """A configuration of ``group`` (its other values: the grid's first)."""
        if group not in context.group_params:
            context.group_params[group] = context.grid.params_at(0).replace(**dict(zip(context.groups.dims, context.groups.values[group])))
        return context.group_params[group]

    def _predicted_row(self, context: _Context, state: SearchState, group: int) -> np.ndarray | None:
        line = self._line(context, state, group)
        if line is None:
            return None
        return line[0] + line[1] * context.batch_values.reshape(-1)

    def _memory_sd(self, context: _Context, state: SearchState, evidence: MemoryEvidence, group: int) -> float:
        """The relative error of the memory model's peak for ``group``, by what was measured (:data:`MEMORY_SD`)."""
        fits = evidence.fits.get(group, {})
        if len(fits) >= 2:
            return MEMORY_SD["line"]
        if fits:
            return MEMORY_SD["point"]
        return MEMORY_SD["class" if state.memory.class_measured(self._group_params(context, group)) else "none"]

    def _p_fit_row(self, context: _Context, state: SearchState, evidence: MemoryEvidence, group: int) -> np.ndarray:
        """P(peak <= ceiling) along the batch axis for ``group`` (read-only: kept while the evidence,
        the ceiling and the memory model's lines stay the same, as they do through one proposal)."""
        held, ceiling, lines_at = context.p_fit_for
        if held is not evidence or (ceiling, lines_at) != (state.ceiling_bytes, context.lines_at):
            context.p_fit_rows, context.p_fit_misses, context.p_fit_for = {}, None, (evidence, state.ceiling_bytes, context.lines_at)
        row = context.p_fit_rows.get(group)
        if row is None:
            row = context.p_fit_rows[group] = self._p_fit_row_of(context, state, evidence, group)
            row.setflags(write=False)
        return row

    def _p_fit_row_of(self, context: _Context, state: SearchState, evidence: MemoryEvidence, group: int) -> np.ndarray:
        ceiling = state.ceiling_bytes
        model = self._predicted_row(context, state, group)
        if model is None:
            return np.full(len(context.grid.values[BATCH]), 0.5)
        fits = evidence.fits.get(group, {})
        sd = self._memory_sd(context, state, evidence, group)
        margin = np.log(ceiling / np.maximum(model, 1.0)) / sd  # how far under the ceiling the model puts each batch, in sds
        p_fit = normal_cdf(margin)
        if not fits:
            twins = [t for t in evidence.fits if context.groups.twin[group, t]]
            if twins:
                # A measured twin is closer evidence than the class: its peaks, give or take TWIN_SD.
                p_fit = np.min([self._twin_p_fit(context, state, evidence, t) for t in twins], axis=0)
            # The model's log error r on a group it has not measured is ~ N(0, sd^2). Going over the
            # ceiling where it predicted a margin m says that group's error r' > m there (r' ~
            # N(0, sd'^2)); groups alike (similarity w) share errors: r = w r' + what is ours alone,
            # so r and r' correlate by w sd' / sd (at most 1). The least likely fit over those
            # conditions counts (the group itself: w = 1, a truncated normal).
            # Per group alike, its largest margin missed binds (P(fits) falls as the margin rises).
            if context.p_fit_misses is None:
                context.p_fit_misses = self._misses(context, state, evidence)
            live = p_fit > 1e-12  # a miss alike only lowers P(fits) (rho >= 0): what cannot fit stays so
            for other, (other_margin, other_sd) in context.p_fit_misses.items():
                if context.groups.similarity[group, other] > 0:
                    rho = min(1.0, float(context.groups.similarity[group, other]) * other_sd / sd)
                    p_fit[live] = np.minimum(p_fit[live], normal_cdf_given_above(margin[live], other_margin, rho))
        for j, peak in fits.items():
            p_fit[j] = float(peak <= ceiling)
        # Over the ceiling at batch b0 (OOM or measured) in a group with no more static memory,
        # whose activations per sample are at most 1/ratio of ours: ours is over from b0 / ratio on.
        batches = context.batch_values.reshape(-1)
        for other, j in evidence.over:
            ratio = context.groups.activation_ratio[group, other]
            if ratio > 0:
                p_fit = np.where(batches >= batches[j] / ratio, p_fit * OOM_IMPLIED, p_fit)
        return p_fit

    def _twin_p_fit(self, context: _Context, state: SearchState, evidence: MemoryEvidence, twin: int) -> np.ndarray:
        """P(fits) along the batch axis for a group that stores like the measured group ``twin``: the
        twin's peaks where measured, its memory model's line elsewhere, each give or take :data:`TWIN_SD`."""
        row = self._predicted_row(context, state, twin)
        assert row is not None  # the twin has a measured peak
        sd = np.full(len(row), math.hypot(TWIN_SD, self._memory_sd(context, state, evidence, twin)))
        row = row.astype(float).copy()
        for j, peak in evidence.fits[twin].items():
            row[j], sd[j] = peak, TWIN_SD
        return normal_cdf(np.log(state.ceiling_bytes / np.maximum(row, 1.0)) / sd)

    def _misses(self, context: _Context, state: SearchState, evidence: MemoryEvidence) -> dict[int, tuple[float, float]]:
        """Per group gone over the ceiling (an OOM, or a peak measured over it) where the memory model
        has a prediction: the largest margin under the ceiling it predicted there, in its sds, and that sd."""
        margins: dict[int, float] = {}
        for other, j in evidence.over:
            other_row = self._predicted_row(context, state, other)
            if other_row is not None:
                margins[other] = max(margins.get(other, -math.inf), math.log(state.ceiling_bytes / max(float(other_row[j]), 1.0)))
        misses = {}
        for other, margin in margins.items():
            other_sd = self._memory_sd(context, state, evidence, other)
            misses[other] = (margin / other_sd, other_sd)
        return misses

    def _pruned_row(self, context: _Context, state: SearchState, evidence: MemoryEvidence, group: int) -> np.ndarray:
        """What :meth:`MemoryModel.prune_reason` rules out by prediction, along the batch axis."""
        model = self._predicted_row(context, state, group)
        if model is None:
            return np.zeros(len(context.grid.values[BATCH]), dtype=bool)
        fits = evidence.fits.get(group)
        if not fits and len(evidence.fits) < 2:
            return np.zeros(len(model), dtype=bool)  # the memory model prunes an unmeasured group only once two are measured
        margin = PRUNE_MARGIN if fits else UNCALIBRATED_PRUNE_MARGIN
        return model > state.ceiling_bytes * (1 + margin)

    # ------------------------------------------------------------------ grid plumbing

    def _batch_shape(self, context: _Context) -> tuple[int, ...]:
        """The shape of one group's cells with the batch axis kept and the others of size 1."""
        grid = context.grid
        return tuple(len(grid.values[BATCH]) if grid.names[a] == BATCH else 1 for a in context.other_axes)

    def _group_cells(self, context: _Context, group: int) -> tuple[Any, ...]:
        """An index into grid-shaped arrays selecting one memory group (its other axes kept)."""
        grid = context.grid
        codes = dict(zip(context.groups.dims, context.groups.codes[group]))
        return tuple(int(codes[n]) if n in codes else slice(None) for n in grid.names)

    def _flat_of(self, context: _Context, group: int, local: int) -> int:
        grid = context.grid
        codes = dict(zip(context.groups.dims, context.groups.codes[group]))
        other = np.unravel_index(local, [grid.shape[a] for a in context.other_axes])
        other_codes = dict(zip([grid.names[a] for a in context.other_axes], other))
        full = tuple(int(codes[n]) if n in codes else int(other_codes[n]) for n in grid.names)
        return int(np.ravel_multi_index(full, grid.shape))

    def _batch_grid(self, context: _Context, table: np.ndarray) -> np.ndarray:
        """A groups x accumulations x batches table (:class:`MemoryEvidence`'s) as a grid-broadcastable array."""
        grid = context.grid
        dims = (*context.groups.dims, *((ACCUM,) if ACCUM in grid.names else ()), BATCH)
        shaped = table.reshape([len(grid.values[d]) for d in dims])
        order = np.argsort([grid.axis[d] for d in dims])
        return np.broadcast_to(shaped.transpose(order).reshape(grid.broadcast_shape(dims)), grid.shape)

    @staticmethod
    def _seen_flat(context: _Context, state: SearchState, history: list[Probe]) -> list[int]:
        """Grid indices of what ran or was pruned: never proposed again."""
        keys = [p.params.key() for p in history]
        if isinstance(state.seen, Iterable):
            keys += list(state.seen)
        indices = []
        for key in keys:
            if key not in context.flat_of_key:
                context.flat_of_key[key] = context.grid.flat_index(TrialParams.from_key(key))
            index = context.flat_of_key[key]
            if index is not None:
                indices.append(index)
        return indices

    def _frugal_pending(self, context: _Context, pending: list[tuple[TrialParams, bool]]) -> bool:
        """A configuration of the frugal mask (the smallest batch) is in flight elsewhere."""
        mask = self._frugal_mask(context).reshape(-1)
        return any(mask[context.grid.flat_index(params)] for params, _ in pending)

    def _frugal_mask(self, context: _Context, *, any_batch: bool = False) -> np.ndarray:
        """Before anything ran: checkpointing, the optimizer with the least state, the smallest batch
        (``any_batch``: at any batch size, once the smallest is being probed elsewhere: the next
        workers bracket the memory frontier instead of asking again whether the smallest runs)."""
        grid = context.grid
        mask = np.ones(grid.shape, dtype=bool)
        if True in grid.values["gradient_checkpointing"]:
            mask = mask & np.array([v is True for v in grid.values["gradient_checkpointing"]]).reshape(grid.broadcast_shape(("gradient_checkpointing",)))
        states = [optimizer_state_bytes(o, 10**9, 2048) for o in grid.values["optim"]]
        mask = mask & (np.array(states) == min(states)).reshape(grid.broadcast_shape(("optim",)))
        return mask if any_batch else mask & (context.batch_values == min(grid.values[BATCH]))

    def _costs(self, context: _Context, history: list[Probe], mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Seconds a probe takes if it runs, and if it fails early (start-up, half the compilation, a step)."""
        grid = context.grid
        setups = [p.result.setup_s for p in history if p.result.setup_s]
        startup = statistics.median(setups) if setups else STARTUP_PRIOR_S
        # Compilations, per mode: of a graph compiled for the first time in this run, and of one
        # compiled before, which inductor's cache (shared by the run's probes) may serve; the latter
        # apart per checkpointing and attention kernel (on the H100, pythia-160m, checkpointed
        # graphs recompiled from the cache in 11-14 s with eager attention and in 36-51 s, as if
        # cold, with sdpa; without checkpointing both took ~10 s).
        cold_s: dict[str, list[float]] = {}
        cached_s: dict[tuple[Any, ...], list[float]] = {}
        graph_dims = [d for d in COMPILED_GRAPH_PARAMS if d in grid.names]
        cache_dims = tuple(d for d in ("gradient_checkpointing", "attn_implementation") if d in grid.names)
        compiled: set[tuple[Any, ...]] = set()
        windows, steps = [], []
        for probe in history:
            r = probe.result
            if probe.params.torch_compile != "off" and not r.ok and r.status is not ProbeStatus.TIMEOUT and r.wall_s:
                # Failed after its compilation (out of memory or a crash in a step): what it ran past
                # start-up is its compilation and a step or two, the best estimate there is until one
                # runs (on an H100 a compiled polyglot-ko-1.3b probe ran out of memory after 92 s).
                graph = tuple(getattr(probe.params, d) for d in graph_dims)
                if graph not in compiled and r.wall_s > (r.setup_s or startup):
                    cold_s.setdefault(probe.params.torch_compile, []).append(r.wall_s - (r.setup_s or startup))
                    compiled.add(graph)
                continue
            if not (r.ok and r.wall_s and r.step_time_s):
                continue
            warmup = r.warmup_s if r.warmup_s is not None else WARMUP_STEPS * r.step_time_s
            if probe.params.torch_compile != "off":
                graph = tuple(getattr(probe.params, d) for d in graph_dims)
                compile_s = max(warmup - WARMUP_STEPS * r.step_time_s, 0.0)
                if graph in compiled:
                    cached_s.setdefault((probe.params.torch_compile, *(getattr(probe.params, d) for d in cache_dims)), []).append(compile_s)
                else:
                    cold_s.setdefault(probe.params.torch_compile, []).append(compile_s)
                compiled.add(graph)
            window = r.wall_s - (r.setup_s or startup) - warmup
            if window > 0:
                windows.append(window)
                steps.append(window / r.step_time_s)
        # The window is the longer of a time floor and a step count: the smallest of each seen bounds them.
        window_s, window_steps = (min(windows), min(steps)) if windows else WINDOW_PRIOR
        known = {m: statistics.median(v) for m, v in cold_s.items() if v}
        table = []
        for mode in grid.values["torch_compile"]:
            if mode == "off":
                table.append(0.0)
            elif mode in known:
                table.append(known[mode])
            elif "max-autotune" in mode:
                # Autotuning benchmarks kernel candidates: several times the plain mode's compilation.
                table.append(MAX_AUTOTUNE_COMPILE_FACTOR * max(known.values()) if known else COMPILE_PRIOR_S["max-autotune"])
            else:
                table.append(statistics.median(list(known.values())) if known else COMPILE_PRIOR_S["default"])
        modes = list(grid.values["torch_compile"])
        compile_grid = np.array(table).reshape(grid.broadcast_shape(("torch_compile",)))

        def again(**v: Any) -> float:
            """A graph compiled before: what such recompilations measured (no cheaper until one was)."""
            first = table[modes.index(v["torch_compile"])]
            measured = cached_s.get((v["torch_compile"], *(v[d] for d in cache_dims)))
            return min(statistics.median(measured), first) if measured else first

        if compiled and cached_s:
            seen = grid.along(graph_dims, lambda **v: float(tuple(v[d] for d in graph_dims) in compiled)) > 0
            compile_grid = np.where(seen, grid.along(("torch_compile", *cache_dims), again), compile_grid)
        step_s = context.accum_values * context.batch_values / np.exp(mean)
        cost_ok = startup + compile_grid + WARMUP_STEPS * step_s + np.maximum(window_s, window_steps * step_s)
        cost_fail = startup + 0.5 * compile_grid + step_s / np.maximum(context.accum_values, 1.0)
        return np.broadcast_to(cost_ok, grid.shape), np.broadcast_to(cost_fail, grid.shape)

    # ------------------------------------------------------------------ features

    def _get_context(self, state: SearchState) -> _Context:
        if self._context is not None and self._context.grid.space == state.space:
            return self._context
        grid = Grid(state.space)

        def accum_of(v: dict[str, Any]) -> int:
            return grid.accumulation(v.get(BATCH, 1), v.get(ACCUM))

        accum_dims = (ACCUM,) if ACCUM in grid.names else ((BATCH,) if state.space.effective_batch_size else ())
        accum_values = sorted({grid.accumulation(b, a) for b in grid.values[BATCH] for a in grid.values.get(ACCUM, (1,))})
        batch_values = grid.along((BATCH,), lambda **v: float(v[BATCH]))
        accum_grid = grid.along(accum_dims, lambda **v: float(accum_of(v))) if accum_dims else np.ones(grid.broadcast_shape(()))
        surrogate: Surrogate | StepTimeSurrogate
        if THROUGHPUT_MODEL == "steptime":
            surrogate = _step_time_surrogate(grid, accum_dims, accum_values, accum_of, batch_values, accum_grid)
        else:
            surrogate = _linear_surrogate(grid, accum_dims, accum_values, accum_of)
        groups = _Groups.of(grid)
        other_axes = tuple(i for i, n in enumerate(grid.names) if n not in groups.dims)
        compile_values = np.array(grid.values["torch_compile"], dtype=object).reshape(grid.broadcast_shape(("torch_compile",)))
        self._context = _Context(grid, surrogate, groups, batch_values, accum_grid, compile_values, other_axes)
        if WORKERS in grid.names and 0 in grid.values[WORKERS] and len(grid.values[WORKERS]) > 1:
            self._context.main_process_loading = surrogate.index_of(f"{WORKERS}=0")
        return self._context


# ---------------------------------------------------------------------- rounds 1-10's log-additive model's features


def _linear_surrogate(grid: Grid, accum_dims: tuple[str, ...], accum_values: list[int], accum_of: Callable[[dict[str, Any]], int]) -> Surrogate:
    """Per-value effects on log samples/s, a saturating batch curve, per-dimension tilts of it and
    the optimizer step amortised over the samples per step (see :mod:`.surrogate`)."""
    builder = BlockBuilder(grid)
    batch_features: list[tuple[str, Any, float, float]] = [("intercept", lambda b: 1.0, 0.0, 3.0)]
    batch_features += [(f"curve{beta:g}", (lambda b, beta=beta: _curve(b, beta)), 1.0 / len(_SATURATION), 0.35) for beta in _SATURATION]
    batch_features += [(f"hinge{k:g}", (lambda b, k=k: -max(0.0, math.log(b / k))), 0.0, 0.1) for k in _HINGES]
    batch_features += [("misaligned8", lambda b: float(b % 8 != 0), -0.1, 0.1), ("misaligned64", lambda b: float(b % 64 != 0 and b % 8 == 0), -0.02, 0.03)]
    batch_features += [(f"batch{b}", (lambda x, b=b: float(x == b)), 0.0, 0.02) for b in grid.values[BATCH]]
    builder.add(
        (BATCH,), [f[0] for f in batch_features], lambda v: [f[1](float(v[BATCH])) for f in batch_features],
        [f[2] for f in batch_features], [f[3] for f in batch_features],
    )
    for dim in ("precision", "attn_implementation", "torch_compile", "gradient_checkpointing", "optim", WORKERS):
        values = grid.values[dim]
        if len(values) < 2:
            continue
        names, functions, sds = _value_blocks(builder, dim, "", functools.partial(_prior_mean, dim), _PRIOR_SD.get(dim, 0.1), _WITHIN_KIND_SD)
        if dim not in ("optim", WORKERS):  # faster kernels saturate at larger batches
            tilt_sd = _TILT_SD.get(dim, 0.08)
            builder.add((dim, BATCH), [f"{n}:tilt" for n in names],
                        _of_value(dim, functions, tilted=True),
                        0.0, [tilt_sd if not n.startswith(f"{dim}=") or sd != _WITHIN_KIND_SD else tilt_sd / 3 for n, sd in zip(names, sds)])
    if accum_dims and len(accum_values) > 1:  # per-micro-batch overheads of accumulating
        builder.add(accum_dims, [f"accum={a}" for a in accum_values], lambda v: [float(accum_of(v) == a) for a in accum_values],
                    0.0, _PRIOR_SD[ACCUM])
    # The optimizer step is paid once per optimizer step, so its share falls with the samples per
    # step (batch x accumulation) like a step's overhead falls with the batch: the same saturating
    # curve, in samples per step, one per optimizer (their steps differ several-fold).
    optims = grid.values["optim"]
    step_dims = (*accum_dims, BATCH, "optim")

    def per_step(v: dict[str, Any]) -> list[float]:
        samples = float(v[BATCH]) * accum_of(v)
        curves = [_curve(samples, beta) for beta in _STEP_SATURATION]
        return curves + [c * float(v["optim"] == o) for o in optims for c in curves]

    builder.add(step_dims, [f"step{b:g}" for b in _STEP_SATURATION] + [f"step{b:g}:{o}" for o in optims for b in _STEP_SATURATION],
                per_step, [0.05] * len(_STEP_SATURATION) + [0.0] * (len(optims) * len(_STEP_SATURATION)),
                [0.15] * len(_STEP_SATURATION) + [0.1] * (len(optims) * len(_STEP_SATURATION)))
    return Surrogate(grid, builder.blocks)


# ---------------------------------------------------------------------- the step-time model's features

# Prior means and sds of per-value effects on a micro-step's overhead (log seconds): kernel launches
# and Python per step; compilation fuses kernels (and max-autotune's CUDA graphs replay them), so
# its prior is a cut, of uncertain size; checkpointing adds the recomputed forward's launches.
_OVERHEAD_PRIOR: dict[str, tuple[dict[Any, float], float, float]] = {  # dim: (means, sd, sd within a kind)
    "precision": ({}, 0.3, 0.06),
    "attn_implementation": ({}, 0.15, 0.06),
    "torch_compile": ({"off": 0.0, "compiled": -0.4}, 0.5, 0.15),  # "compiled": every other mode
    "gradient_checkpointing": ({True: 0.1}, 0.2, 0.2),
}
_PER_SAMPLE_SD = {"precision": 0.35, "attn_implementation": 0.12, "torch_compile": 0.15, "gradient_checkpointing": 0.1}
_STEP_PRIOR = {"adamw_torch": 0.6, "adamw_torch_fused": 0.0, "adafactor": 0.5, "adamw_bnb_8bit": 0.0}
_STEP_SD = 0.5
_OVERHEAD_AT = math.log(2.0)  # overhead / per-sample time at the base values (fp32, eager): saturation near batch 2
_STEP_AT = math.log(0.7)  # a fused AdamW step / one sample's work at the base values
_STEP_TIME_SD = {SCALE: 3.0, "overhead": 1.5, "step": 1.5}


def _ONE(v: dict[str, Any]) -> list[float]:
    return [1.0]


def _lookup(table: dict[Any, float], default: float) -> Callable[[Any], float]:
    return lambda x: table.get(x, default)


def _value_blocks(builder: BlockBuilder, dim: str, prefix: str, mean_of: Callable[[Any], float], sd: float,
                  within_sd: float) -> tuple[list[str], list[Callable[..., float]], list[float]]:
    """One feature per value of ``dim``, plus one per kind shared by its members (see _KINDS):
    values of one kind (16-bit precisions, fused attention kernels, compile modes) share an effect,
    each deviating a little from it, so measuring one says much about the others. Returns the
    features' names, functions and prior sds."""
    values = builder.grid.values[dim]
    kinds = [(k, [x for x in values if x in members]) for k, members in _KINDS.get(dim, {}).items()]
    kinds = [(k, inside) for k, inside in kinds if len(inside) >= 2]
    names: list[str] = []
    functions: list[Callable[..., float]] = []
    means: list[float] = []
    sds: list[float] = []
    for kind, inside in kinds:
        names.append(f"{prefix}{dim}:{kind}")
        functions.append(lambda x, inside=inside: float(x in inside))
        means.append(statistics.fmean(mean_of(x) for x in inside))
        sds.append(sd)
    for x in values:
        kind_at = next((m for (k, inside), m in zip(kinds, means) if x in inside), None)
        names.append(f"{prefix}{dim}={x}")
        functions.append(lambda v, x=x: float(v == x))
        means.append(mean_of(x) - (kind_at or 0.0))
        sds.append(within_sd if kind_at is not None else sd)
    builder.add((dim,), names, _of_value(dim, functions), means, sds)
    return names, functions, sds


def _step_time_surrogate(grid: Grid, accum_dims: tuple[str, ...], accum_values: list[int], accum_of: Callable[[dict[str, Any]], int],
                         batch_values: np.ndarray, accum_grid: np.ndarray) -> StepTimeSurrogate:
    """The step-time model's features (see :mod:`.steptime`): per-value effects on a micro-step's
    overhead and per-sample time, the optimizer's on its step, and small residuals."""
    terms = {name: BlockBuilder(grid) for name in ("overhead", "per_sample", "step", LINEAR)}
    for name, builder in terms.items():
        if name != LINEAR:
            builder.add((), [SCALE], _ONE, 0.0, _STEP_TIME_SD[SCALE])
    terms["overhead"].add((), ["overhead"], _ONE, _OVERHEAD_AT, _STEP_TIME_SD["overhead"])
    terms["step"].add((), ["step"], _ONE, _STEP_AT, _STEP_TIME_SD["step"])
    for dim in ("precision", "attn_implementation", "torch_compile", "gradient_checkpointing"):
        if len(grid.values[dim]) < 2:
            continue
        prior, sd, within = _OVERHEAD_PRIOR[dim]
        if dim == "torch_compile":
            prior = {x: prior["off" if x == "off" else "compiled"] for x in grid.values[dim]}
        _value_blocks(terms["overhead"], dim, "o:", _lookup(prior, 0.0), sd, within)
        # Per-sample time: the expert ordering of speeds, as log seconds (faster is less).
        per_sample = {x: -_prior_mean(dim, x) for x in grid.values[dim]}
        _value_blocks(terms["per_sample"], dim, "p:", _lookup(per_sample, 0.0), _PER_SAMPLE_SD[dim], _WITHIN_KIND_SD)
    if len(grid.values["optim"]) >= 2:
        _value_blocks(terms["step"], "optim", "s:", _lookup(_STEP_PRIOR, 0.3), _STEP_SD, _STEP_SD)
    for dim in grid.space.config_fields:  # the user's own config fields (TRL's packing...): no prior but a wide one
        if len(grid.values[dim]) >= 2:
            _value_blocks(terms["per_sample"], dim, "p:", _lookup({}, 0.0), _USER_FIELD_SD, _USER_FIELD_SD)
    # Past a middle size a sample may cost more (the hinges), and misaligned batches run slower kernels.
    batch_features: list[tuple[str, Any, float, float]] = [
        (f"hinge{k:g}", (lambda b, k=k: max(0.0, math.log(b / k))), 0.0, 0.1) for k in _HINGES]
    batch_features += [("misaligned8", lambda b: float(b % 8 != 0), 0.1, 0.1), ("misaligned64", lambda b: float(b % 64 != 0 and b % 8 == 0), 0.02, 0.03)]
    terms["per_sample"].add((BATCH,), [f[0] for f in batch_features], lambda v: [f[1](float(v[BATCH])) for f in batch_features],
                            [f[2] for f in batch_features], [f[3] for f in batch_features])
    residual = terms[LINEAR]
    residual.add((BATCH,), [f"batch{b}" for b in grid.values[BATCH]], lambda v: [float(v[BATCH] == b) for b in grid.values[BATCH]], 0.0, 0.02)
    if WORKERS in grid.names and len(grid.values[WORKERS]) >= 2:
        values = grid.values[WORKERS]
        residual.add((WORKERS,), [f"{WORKERS}={x}" for x in values], lambda v: [float(v[WORKERS] == x) for x in values], 0.0, _PRIOR_SD[WORKERS])
    if accum_dims and len(accum_values) > 1:
        residual.add(accum_dims, [f"accum={a}" for a in accum_values], lambda v: [float(accum_of(v) == a) for a in accum_values], 0.0, _PRIOR_SD[ACCUM])
    log_accum = np.log(accum_grid)
    log_batch = np.log(batch_values)
    offsets = {"overhead": log_accum, "per_sample": log_accum + log_batch, "step": np.zeros(grid.broadcast_shape(()))}
    return StepTimeSurrogate(grid, {name: builder.blocks for name, builder in terms.items()}, offsets, log_accum + log_batch)
