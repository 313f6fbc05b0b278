"""The default strategy: expert seed, batch-size frontier per memory group, coordinate sweeps, compile last.

Why this shape: a 30-minute budget buys 20-100 probes in a space of ~74,000 points, so the search
has to use what is known about training throughput rather than learn it from scratch:

1. **Seed**: after the baseline, an expert configuration (bf16 if allowed, the fastest attention
   kernel, fused AdamW, no compile, no checkpointing, a few loader workers) at the largest batch
   size the memory model says fits. A good answer exists within the first minutes. While nothing
   fits, the expert with checkpointing and the smallest optimizer state, at the smallest batch.
2. **Frontier**: throughput rises with batch size until memory runs out, so every configuration
   tried in a memory group (precision, optimizer, compile, attention, checkpointing) is tried at
   that group's predicted largest fitting batch (:meth:`~autotune.search.memory.MemoryModel.largest_batch_that_fits`).
   A wrong prediction costs one probe and is corrected by the measurement.
3. **Sweeps**: one dimension at a time from the incumbent (the fastest configuration under the
   ceiling), memory-relevant dimensions first because they move the frontier: batch size (the
   frontier, one size above it, aligned sizes below it), checkpointing, optimizer, accumulation,
   loader workers, attention, precision. A dimension that does not move memory is swept once.
   Expected gain prunes the neighbourhood: precisions and attention kernels more than one step
   below the incumbent's in the usual speed order (bf16 > fp16 > tf32 > fp32) are not probed.
4. **Compile last**: torch.compile costs 30-120 s of compilation per probe and its gain is
   roughly a multiplier, so it is tried on the best configuration (most aggressive mode first),
   with time reserved for it: when the budget left falls to that reserve, compilation comes first.
5. Then a second round around the best three (batch size and compile first), and finally the
   study's TPE sampler.

Configurations the memory model rules out (known OOM, measured over the ceiling at a smaller
batch of the same group, or predicted over the ceiling) are pruned without running.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterator
from typing import Any

import optuna

from autotune.params import TrialParams
from autotune.search.memory import GROUP_KEYS
from autotune.search.strategies.base import SearchState, Strategy
from autotune.search.strategies.baselines import tpe_sampler

# Most likely fastest first; values not in the space are skipped.
_PREFERRED: dict[str, tuple[Any, ...]] = {
    "precision": ("bf16", "bf16+tf32", "fp16", "fp16+tf32", "tf32", "fp32"),
    "attn_implementation": ("flash_attention_3", "flash_attention_2", "sdpa", "flex_attention", "eager"),
    "optim": ("adamw_torch_fused", "adamw_torch", "adamw_bnb_8bit", "adafactor"),
    "torch_compile": ("off",),
    "gradient_checkpointing": (False, True),
    "dataloader_num_workers": (4, 8, 2, 6, 16, 1, 0),
    "gradient_accumulation_steps": (1,),
}
SWEEP_ORDER = (
    "per_device_train_batch_size",
    "gradient_checkpointing",
    "optim",
    "gradient_accumulation_steps",
    "dataloader_num_workers",
    "attn_implementation",
    "precision",
)
# Around the best configurations found, the cheap refinements first.
SECOND_ROUND_ORDER = (
    "per_device_train_batch_size",
    "optim",  # a smaller optimizer state can move the compiled group's frontier up
    "gradient_accumulation_steps",
    "dataloader_num_workers",
    "torch_compile",
    "gradient_checkpointing",
    "attn_implementation",
    "precision",
)
# Optimizers by state size, smallest first (Adafactor factored, 8-bit Adam 2 B/param, AdamW 8 B/param).
_FRUGAL_OPTIMIZERS = ("adafactor", "lion_8bit", "paged_lion_8bit", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit",
                      "adamw_torch_fused", "adamw_torch")
COMPILE_PRIOR_S = 90.0  # expected compilation time before any compiled probe was measured
MAX_TRIES_PER_MOVE = 3  # a move whose predicted frontier keeps running out of memory is dropped


class FrontierStrategy(Strategy):
    """Expert seed, per-group batch frontier, coordinate sweeps, compile on the top candidates."""

    name = "frontier"

    def __init__(self) -> None:
        self._swept: set[str] = set()
        self._tries: Counter[tuple[Any, ...]] = Counter()

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return tpe_sampler(seed)

    def prune(self, params: TrialParams, state: SearchState) -> str | None:
        return state.memory.prune_reason(params, state.ceiling_bytes)

    def propose(self, state: SearchState) -> TrialParams | None:
        for candidate in self._candidates(state):
            if self._runnable(candidate, state):
                self._tries[_move_key(candidate)] += 1
                return candidate
        return None

    # ------------------------------------------------------------------ phases

    def _candidates(self, state: SearchState) -> Iterator[TrialParams]:
        yield from self._seed(state)
        ranked = [o.params for o in state.feasible()]
        plain = [p for p in ranked if p.torch_compile == "off"]
        if not ranked:
            return
        if not self._compile_due(state) and plain:
            # First round, without compilation: a compiled probe costs minutes, compile is a multiplier.
            for dim in SWEEP_ORDER:
                if dim in self._swept:
                    continue
                moves = [m for m in self._moves(state, plain[0], dim, extremes=True) if self._runnable(m, state)]
                if moves:
                    yield from moves
                    return
                if dim not in GROUP_KEYS and dim != "per_device_train_batch_size":
                    self._swept.add(dim)  # workers and accumulation barely interact: swept once
        yield from self._compile_moves(state, plain[:1])
        for incumbent in ranked[:3]:
            for dim in SECOND_ROUND_ORDER:
                yield from self._moves(state, incumbent, dim)

    def _seed(self, state: SearchState) -> Iterator[TrialParams]:
        values = {}
        for name, choices in state.space.choices.items():
            preferred = [v for v in _PREFERRED.get(name, ()) if v in choices]
            values[name] = preferred[0] if preferred else choices[0]
        expert = _with(state, TrialParams.from_dict(values), per_device_train_batch_size=min(_batch_sizes(state)))
        at_frontier = self._at_frontier(state, expert)
        if at_frontier is not None and not any(_move_key(o.params) == _move_key(expert) and o.result.fits(state.ceiling_bytes) for o in state.history):
            yield at_frontier  # again at the corrected frontier if it ran out of memory or over the ceiling
        if state.feasible():
            return
        # Nothing fits yet: the expert with the memory savers, most frugal first (checkpointing and
        # the smallest optimizer state at the smallest batch fit if anything does).
        savers = [o for o in _FRUGAL_OPTIMIZERS if o in state.space.choices.get("optim", ())]
        ckpt = [c for c in (True, False) if c in state.space.choices.get("gradient_checkpointing", ())]
        for optim in savers or [expert.optim]:
            for checkpointing in ckpt:
                rescue = _with(state, expert, optim=optim, gradient_checkpointing=checkpointing)
                yield self._at_frontier(state, rescue) or rescue

    def _moves(self, state: SearchState, incumbent: TrialParams, dim: str, *, extremes: bool = False) -> Iterator[TrialParams]:
        """Neighbours of ``incumbent`` along ``dim``; ``extremes``: accumulation and workers only at
        their smallest and largest values (their effect is nearly monotone; the rest comes later)."""
        if dim == "per_device_train_batch_size":
            yield from self._batch_moves(state, incumbent)
            return
        values = state.space.choices.get(dim, ())
        if dim in ("gradient_accumulation_steps", "dataloader_num_workers") and len(values) > 2:
            current = values.index(getattr(incumbent, dim)) if getattr(incumbent, dim) in values else 0
            # First round: the two ends; later: the two neighbours of the incumbent's value.
            values = (max(values), min(values)) if extremes else tuple(v for i, v in enumerate(values) if abs(i - current) == 1)
        for value in values:
            if value == getattr(incumbent, dim) or not _worth_trying(dim, getattr(incumbent, dim), value):
                continue
            moved: TrialParams | None = _with(state, incumbent, **{dim: value})
            if dim in GROUP_KEYS and moved is not None:
                moved = self._at_frontier(state, moved)
                # Accumulation and workers do not change memory and barely interact with the
                # group: a group already measured at this batch size is known well enough.
                if moved is not None and _group_batch(moved) in _measured_group_batches(state):
                    continue
            if moved is not None:
                yield moved

    def _batch_moves(self, state: SearchState, incumbent: TrialParams) -> Iterator[TrialParams]:
        """Around the frontier: one size above it, and the largest sizes aligned to 32 and 8 below it."""
        sizes = sorted(_batch_sizes(state))
        frontier = state.memory.largest_batch_that_fits(incumbent, sizes, state.ceiling_bytes)
        if frontier is None:
            return
        above = [b for b in sizes if b > frontier][:1]
        aligned = [max((b for b in sizes if b <= frontier and b % m == 0), default=None) for m in (32, 8)]
        measured = _measured_group_batches(state)
        for batch in (*above, frontier, *aligned):
            if batch is not None and batch != incumbent.per_device_train_batch_size:
                moved = _with(state, incumbent, per_device_train_batch_size=batch)
                if _group_batch(moved) not in measured:
                    yield moved

    def _compile_moves(self, state: SearchState, ranked: list[TrialParams]) -> Iterator[TrialParams]:
        # Most aggressive mode first (spaces list modes from plain to max-autotune): a probe times
        # the steady state, where the longer compilation usually pays off.
        modes = [m for m in reversed(state.space.choices.get("torch_compile", ())) if m != "off"]
        for incumbent in [p for p in ranked if p.torch_compile == "off"][:1]:
            if any(o.result.ok and o.params.torch_compile != "off" and _move_key(_with(state, o.params, torch_compile="off")) == _move_key(incumbent)
                   and (o.result.samples_per_s or 0) > _speed(state, incumbent) for o in state.history):
                return  # one mode already beats the plain incumbent: the others wait for the second round
            for mode in modes:
                # Compilation saves activation memory: the compiled group's frontier may be higher.
                moved = self._at_frontier(state, _with(state, incumbent, torch_compile=mode))
                if moved is not None:
                    yield moved

    # ------------------------------------------------------------------ budget

    def _compile_due(self, state: SearchState) -> bool:
        """Whether the time left is down to what compiling the top candidates needs."""
        modes = [m for m in state.space.choices.get("torch_compile", ()) if m != "off"]
        if not modes or state.remaining_s is None:
            return False
        reserve = (len(modes) + 1) * self._cost_s(state, compiled=True)  # +1: the compiled group's frontier
        return state.remaining_s <= reserve + self._cost_s(state, compiled=False)

    def _cost_s(self, state: SearchState, *, compiled: bool) -> float:
        """Expected wall time of a probe, from the probes measured so far (compiled ones apart)."""
        same = [o.result.wall_s for o in state.history if o.result.wall_s and (o.params.torch_compile != "off") == compiled]
        if same:
            return float(statistics.median(same))
        plain = [o.result.wall_s for o in state.history if o.result.wall_s and o.params.torch_compile == "off"]
        base = float(statistics.median(plain)) if plain else 30.0
        return base + (COMPILE_PRIOR_S if compiled else 0.0)

    def _runnable(self, params: TrialParams, state: SearchState) -> bool:
        if params.key() in state.seen or not state.space.contains(params):
            return False
        if self._tries[_move_key(params)] >= MAX_TRIES_PER_MOVE:
            return False
        if state.remaining_s is not None and self._cost_s(state, compiled=params.torch_compile != "off") > state.remaining_s:
            return False
        return state.memory.prune_reason(params, state.ceiling_bytes) is None

    def _at_frontier(self, state: SearchState, params: TrialParams) -> TrialParams | None:
        """``params`` at the largest batch size its memory group is predicted to fit (unchanged if unknown)."""
        sizes = _batch_sizes(state)
        if state.memory.predict(params) is None:
            return params
        batch = state.memory.largest_batch_that_fits(params, sizes, state.ceiling_bytes)
        return None if batch is None else _with(state, params, per_device_train_batch_size=batch)


def _worth_trying(dim: str, current: Any, value: Any) -> bool:
    """Expected gain: for precision and attention, only values at most one step below the current
    one in :data:`_PREFERRED` (fp32 after bf16, eager after flash-attention are slower and use no
    less memory, so a probe of them buys nothing)."""
    if dim not in ("precision", "attn_implementation"):
        return True
    order = _PREFERRED[dim]
    if current not in order or value not in order:
        return True
    return order.index(value) <= order.index(current) + 1


def _group_key(params: TrialParams) -> tuple[Any, ...]:
    return tuple(getattr(params, name) for name in GROUP_KEYS)


def _speed(state: SearchState, params: TrialParams) -> float:
    key = params.key()
    return max((o.result.samples_per_s or 0.0 for o in state.history if o.params.key() == key), default=0.0)


def _move_key(params: TrialParams) -> tuple[Any, ...]:
    """A configuration up to its batch size: a move retried at a smaller batch is the same move."""
    return (*_group_key(params), params.gradient_accumulation_steps, params.dataloader_num_workers)


def _group_batch(params: TrialParams) -> tuple[Any, ...]:
    return (*_group_key(params), params.per_device_train_batch_size)


def _measured_group_batches(state: SearchState) -> set[tuple[Any, ...]]:
    return {_group_batch(o.params) for o in state.history}


def _batch_sizes(state: SearchState) -> tuple[int, ...]:
    return tuple(state.space.choices["per_device_train_batch_size"])


def _with(state: SearchState, params: TrialParams, **changes: Any) -> TrialParams:
    return state.space.with_changes(params, **changes)
