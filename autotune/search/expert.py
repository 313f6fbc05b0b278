"""The expert rule: the configuration an experienced engineer picks in one probe, without searching.

16-bit mixed precision where the device runs it (bf16, else fp16), the fastest attention kernel
that runs (FlashAttention 3, then 2, then PyTorch's SDPA, then eager), fused AdamW, ``torch.compile``
with inductor's default mode, no activation checkpointing, no accumulation (or the accumulation a
fixed effective batch size implies) and the largest batch the memory model says fits under the
ceiling. Every run measures it early as a named reference (the speed-up over it is printed with the
speed-up over the user's baseline), and the search never returns anything measured slower.

This module is the one definition of that rule; it reads the (device-restricted) space, so a value
the device cannot run is never part of it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from autotune.params import TrialParams
from autotune.records import ProbeResult, ProbeStatus
from autotune.search.memory_prior import optimizer_state_rank
from autotune.sharding import NONE
from autotune.space import SearchSpace

# Most preferred first; the first value the space holds wins, else the baseline's value is kept.
EXPERT_PREFERENCES: dict[str, tuple[Any, ...]] = {
    "precision": ("bf16", "fp16", "bf16+tf32", "fp16+tf32", "tf32"),
    "attn_implementation": ("flash_attention_3", "flash_attention_2", "sdpa", "eager"),
    "optim": ("adamw_torch_fused", "adamw_torch"),
    "torch_compile": ("inductor", "inductor:default"),
    "gradient_checkpointing": (False,),
    "gradient_accumulation_steps": (1,),
    "use_liger_kernel": (False,),
    "sharding": (NONE,),
}


def expert_params(space: SearchSpace, base: TrialParams, memory: Any, ceiling_bytes: int,
                  rank_attention: Sequence[str] | None = None, *, gpu: bool = True) -> TrialParams:
    """The expert rule's configuration in ``space``, the other settings as in ``base`` (the run's baseline).

    Args:
        space: the search space as restricted to the device (values it cannot run dropped).
        base: the baseline: what the expert leaves alone (loader settings, the user's own extra fields).
        memory: a :class:`autotune.search.memory.MemoryModel` (``largest_batch_that_fits``); None: the
            largest batch of the space.
        ceiling_bytes: the memory ceiling the batch must fit under.
        rank_attention: the attention kernels in order of preference, if not :data:`EXPERT_PREFERENCES`'s.
        gpu: the device is a GPU. 16 bits is an expert's pick where matrix units run it (Tensor Cores); on a CPU
            autocast's bf16 is emulated on most cores (3x slower than fp32 on this project's machines), so there
            the expert keeps the baseline's precision.

    Returns:
        A point of ``space`` (its batch the largest predicted to fit, else the smallest of the space).
    """
    changes: dict[str, Any] = {}
    for name, preferred in EXPERT_PREFERENCES.items():
        if name == "precision" and not gpu:
            continue
        if name == "attn_implementation" and rank_attention is not None:
            preferred = tuple(rank_attention)
        choices = [v for v in space.choices.get(name, ()) if v not in space.reference_values.get(name, ())]  # the user's values
        value = next((v for v in preferred if v in choices), None)
        if value is not None:
            changes[name] = value
    batches = sorted(space.choices["per_device_train_batch_size"])
    if space.effective_batch_size:  # accumulation is derived: the largest batch dividing N leaves the least
        batches = [b for b in batches if space.effective_batch_size % b == 0] or batches
    expert = space.with_changes(base, **changes, per_device_train_batch_size=batches[0])
    largest = memory.largest_batch_that_fits(expert, batches, ceiling_bytes) if memory is not None else batches[-1]
    return space.with_changes(expert, per_device_train_batch_size=largest or batches[0])


# ---------------------------------------------------------------------- its nearest runnable neighbours

MAX_FALLBACK_PROBES = 6  # neighbours of a failed expert configuration measured at most, before the strategy takes over
# Where even the smallest batch does not fit, an expert lightens one thing at a time, each at the largest batch
# that then fits: checkpointing, else an optimizer with less state (8-bit AdamW keeps AdamW's update, Adafactor
# factors it), the second generator's expert pick's order; then everything together (FRUGAL_CHANGES).
LIGHTER_OPTIMS = ("adamw_bnb_8bit", "adafactor")
# Settings that need less memory, taken together once one at a time did not fit (the optimizer: the
# first the space holds, least state first): one step to the frugal end, where a strategy that found
# nothing running starts too.
FRUGAL_CHANGES: dict[str, tuple[Any, ...]] = {"gradient_checkpointing": (True,), "optim": ("adafactor", "adamw_bnb_8bit")}
# Where even that does not fit, DeepSpeed's ZeRO-Offload (the optimizer state, then the parameters too, on the host), with
# the expert's optimizer: the next step the texts this tool grew from name when one GPU's memory is not enough.
OFFLOAD_CHANGES = ("zero2_offload", "zero3_offload")
# The dimensions a crash or a divergence may come from, each stepped one place down its preferences.
SUSPECTS = ("precision", "attn_implementation", "optim", "torch_compile")


def expert_fallback(space: SearchSpace, expert: TrialParams, outcomes: Mapping[tuple[Any, ...], ProbeResult | None],
                    memory: Any, ceiling_bytes: int, limit: int = MAX_FALLBACK_PROBES,
                    not_counted: Collection[tuple[Any, ...]] = (), p_runs: Callable[[TrialParams], float] | None = None) -> TrialParams | None:
    """The next neighbour of the expert configuration to measure while neither it nor a neighbour ran under the ceiling.

    Neighbours are reached breadth first from the expert (the nearest measured first, or, with ``p_runs``,
    the likeliest to run), each failed one expanded by
    what its failure suggests: out of memory (or over the ceiling) a smaller batch (the largest
    ``memory`` predicts to fit below the failed one, else half of it), at the smallest batch one
    setting lightened at a time (at the largest batch that then fits), then checkpointing and the
    optimizer with the least state together; a crash or a divergence each suspect dimension
    one step down the expert's preferences (the other 16-bit format, the next attention kernel, the
    unfused optimizer, uncompiled), uncompiled first where the failure came after start-up (while
    compiling or training), the precision first where the loss diverged.

    Args:
        outcomes: per ``TrialParams.key()``: the last result of a configuration that ran, ``None`` for
            one that is settled without running (pruned, or in flight elsewhere); absent: not yet asked.
        memory: a :class:`autotune.search.memory.MemoryModel` (``largest_batch_that_fits``) or ``None``.
        limit: the neighbours measured at most while all fail (every failed outcome counts, not only
            the neighbours this walk reaches now: where a neighbour's batch is the memory model's, each
            out-of-memory moves it, and counting visited nodes alone let the walk step down batch after batch).
        not_counted: keys whose failures are not the walk's (the baseline's).
        p_runs: the chance that a configuration runs (no crash, no divergence) given the failures so far;
            where given, of the neighbours not yet asked the likeliest to run is measured (the nearest
            among equals), so that a value that failed in two contexts is not stepped around one
            setting at a time.

    Returns:
        The neighbour not yet asked; ``None`` once one ran and fits, after ``limit`` failed
        probes beside the expert's, or when no neighbour is left.
    """
    failed = sum(1 for key, result in outcomes.items() if key not in not_counted and result is not None
                 and not (result.ok and result.fits(ceiling_bytes)))
    if failed > limit:  # the expert's own and ``limit`` neighbours'
        return None
    queue, visited, unasked = [expert], set(), []
    while queue:
        node = queue.pop(0)
        key = node.key()
        if key in visited:
            continue
        visited.add(key)
        if key not in outcomes:
            if p_runs is None:
                return node
            unasked.append(node)
            continue
        result = outcomes[key]
        if result is not None and result.ok and result.fits(ceiling_bytes):
            return None
        queue.extend(_neighbours(space, node, result, memory, ceiling_bytes))
    return max(unasked, key=p_runs) if unasked and p_runs is not None else None


def _neighbours(space: SearchSpace, node: TrialParams, result: ProbeResult | None, memory: Any, ceiling_bytes: int) -> list[TrialParams]:
    """The neighbours a failure of ``node`` suggests, most likely to run first (``result`` None: pruned, so both kinds)."""
    out_of_memory = result is None or result.status is ProbeStatus.OOM or (result.ok and not result.fits(ceiling_bytes))
    crashed = result is None or not result.ok and result.status is not ProbeStatus.OOM
    found: list[TrialParams] = []
    if out_of_memory:
        batch = node.per_device_train_batch_size
        smaller = [b for b in space.choices["per_device_train_batch_size"] if b < batch]
        if smaller:
            fits = memory.largest_batch_that_fits(node, smaller, ceiling_bytes) if memory is not None else None
            found.append(space.with_changes(node, per_device_train_batch_size=fits or max(b for b in smaller if b <= max(batch // 2, min(smaller)))))
        else:
            found += _one_lighter(space, node, memory, ceiling_bytes)
            frugal = {name: next(v for v in values if v in space.choices[name]) for name, values in FRUGAL_CHANGES.items()
                      if any(v in space.choices.get(name, ()) for v in values)}
            if any(getattr(node, name) != value for name, value in frugal.items()):
                found.append(space.with_changes(node, **frugal))
            elif (offload := next((v for v in OFFLOAD_CHANGES if v in space.choices.get("sharding", ()) and v != node.sharding), None)):
                optim = next((v for v in EXPERT_PREFERENCES["optim"] if v in space.choices["optim"]), node.optim)
                found.append(_fitted(space, space.with_changes(node, sharding=offload, optim=optim, gradient_checkpointing=False),
                                     max(space.choices["per_device_train_batch_size"]), memory, ceiling_bytes))
    if crashed:
        order = list(SUSPECTS)
        if result is not None and result.status is ProbeStatus.DIVERGED:
            order = ["precision", "optim", "attn_implementation", "torch_compile"]
        elif result is not None and result.wall_s and result.setup_s and result.wall_s > 1.1 * result.setup_s:
            order = ["torch_compile", *(d for d in SUSPECTS if d != "torch_compile")]  # it failed after start-up
        for name in order:
            value = _next_preference(space, name, getattr(node, name))
            if value is not None:
                found.append(_fitted(space, space.with_changes(node, **{name: value}), node.per_device_train_batch_size, memory, ceiling_bytes))
    return found


def _one_lighter(space: SearchSpace, node: TrialParams, memory: Any, ceiling_bytes: int) -> list[TrialParams]:
    """``node`` with one setting lightened (checkpointing on, or an optimizer of :data:`LIGHTER_OPTIMS` with less
    state), each at the largest batch ``memory`` predicts to fit (``node``'s own where it cannot tell)."""
    largest = max(space.choices["per_device_train_batch_size"])
    changes: list[dict[str, Any]] = []
    if not node.gradient_checkpointing and True in space.choices.get("gradient_checkpointing", ()):
        changes.append({"gradient_checkpointing": True})
    state = optimizer_state_rank(node.optim)
    changes += [{"optim": o} for o in LIGHTER_OPTIMS if o in space.choices.get("optim", ()) and optimizer_state_rank(o) < state]
    return [_fitted(space, space.with_changes(node, **change), largest, memory, ceiling_bytes) for change in changes]


def _next_preference(space: SearchSpace, name: str, value: Any) -> Any:
    """The value after ``value`` in the expert's preferences (``off`` after the compile modes) that the space holds."""
    preferred = EXPERT_PREFERENCES.get(name, ()) + (("off",) if name == "torch_compile" else ("fp32",) if name == "precision" else ())
    choices = space.choices.get(name, ())
    after = preferred[preferred.index(value) + 1:] if value in preferred else ()
    return next((v for v in after if v in choices and v != value), None)


def _fitted(space: SearchSpace, params: TrialParams, batch: int, memory: Any, ceiling_bytes: int) -> TrialParams:
    """``params`` at the largest batch up to ``batch`` that ``memory`` predicts to fit (its own batch where it cannot tell)."""
    if memory is None:
        return params
    batches = [b for b in space.choices["per_device_train_batch_size"] if b <= batch]
    fits = memory.largest_batch_that_fits(params, batches, ceiling_bytes)
    return space.with_changes(params, per_device_train_batch_size=fits) if fits else params
