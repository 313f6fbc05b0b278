"""Every dimension asked at least once near the incumbent.

A model learns only what was measured: where the loader sets the pace and no probe reports its input
wait, every precision measures the same and nothing points to more workers. So each dimension of
:data:`DIMENSIONS` is asked once near the incumbent: some probe differs from it in that dimension
alone (the batch size aside; for the loader's workers, at a neighbouring count), or the memory model
and the failures rule every such variant out. This module says what is unasked and which variant
asks it; the strategy decides when.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from autotune.params import TrialParams, mixed_precision_dtype
from autotune.records import Probe
from autotune.search.expert import EXPERT_PREFERENCES
from autotune.search.ranking import Configuration, tie_band
from autotune.space import SearchSpace

# Cheapest question first: the loader's workers, accumulation and the optimizer leave the compiled
# graph alone; another attention kernel or compile mode compiles anew; checkpointing moves the memory frontier.
DIMENSIONS = ("dataloader_num_workers", "gradient_accumulation_steps", "optim", "attn_implementation", "torch_compile",
              "gradient_checkpointing")
_BATCH = "per_device_train_batch_size"
# Workers past the host's free cores contend for them: throughput may peak inside the range of worker
# counts, so once one count was asked, only a neighbour of the incumbent's count answers the question.
_PEAKED = ("dataloader_num_workers",)


def unasked(space: SearchSpace, incumbent: TrialParams, history: Iterable[Probe]) -> list[str]:
    """The dimensions of :data:`DIMENSIONS` (and the user's own config fields) the space varies in which no probe
    differs from ``incumbent`` in that dimension alone (the batch size aside; in a :data:`_PEAKED` one, at a neighbouring value)."""
    # The user's own config fields (TRL's packing...) come after autotune's: the space lists them because they matter.
    free = [d for d in (*DIMENSIONS, *space.config_fields) if d in space.free_params and len(space.choices[d]) > 1]
    base = incumbent.flat()
    asked: set[str] = set()
    for name, value in _alone(incumbent, history):
        if name not in _PEAKED or value in _neighbours(space.choices[name], base[name]):
            asked.add(name)
    return [d for d in free if d not in asked]


def _alone(incumbent: TrialParams, history: Iterable[Probe]) -> list[tuple[str, Any]]:
    """Per probe that differs from ``incumbent`` in one dimension alone (the batch size aside): that dimension and its value."""
    base = incumbent.flat()
    found = []
    for probe in history:
        other = probe.params.flat()
        differing = [name for name in base if name != _BATCH and other.get(name) != base[name]]
        if len(differing) == 1:
            found.append((differing[0], other.get(differing[0])))
    return found


def _neighbours(choices: Sequence[Any], value: Any) -> list[Any]:
    """The values next to ``value`` in the sorted ``choices``, the larger first."""
    ordered = sorted(choices)
    i = ordered.index(value)
    return [ordered[j] for j in (i + 1, i - 1) if 0 <= j < len(ordered)]


def variants(space: SearchSpace, incumbent: TrialParams, dimension: str, history: Iterable[Probe] = (),
             loader_cores: int | None = None) -> list[TrialParams]:
    """The incumbent with ``dimension`` changed, the most informative value first: the most loader
    workers (a loader-bound run gains most there; once a count was asked, its neighbours), where
    ``loader_cores`` is known the most that do not outnumber those cores, the next accumulation up,
    the prior's order for the optimizer and attention kernel, the next compile mode (uncompiled
    last), checkpointing off, or on at each larger batch, the largest first (none at the largest)."""
    current = getattr(incumbent, dimension)
    choices = [v for v in space.choices[dimension] if v != current]
    if dimension == "gradient_checkpointing" and not current:
        # It trades compute for memory, so it is slower at the same batch: a question only at a larger one.
        larger = sorted((b for b in space.choices[_BATCH] if b > incumbent.per_device_train_batch_size), reverse=True)
        return [space.with_changes(incumbent, gradient_checkpointing=True, per_device_train_batch_size=b) for b in larger]
    if dimension in _PEAKED and any(name == dimension for name, _ in _alone(incumbent, history)):
        ordered: list[Any] = _neighbours(space.choices[dimension], current)
    elif dimension in ("dataloader_num_workers", "gradient_accumulation_steps"):
        up = sorted((v for v in choices if v > current), reverse=dimension == "dataloader_num_workers")
        ordered = up + sorted((v for v in choices if v < current), reverse=True)
    elif dimension == "torch_compile":
        ordered = sorted(choices, key=lambda v: (v == "off", v))
    else:
        preferred = EXPERT_PREFERENCES.get(dimension, ())
        ordered = sorted(choices, key=lambda v: preferred.index(v) if v in preferred else len(preferred))
    if dimension == "dataloader_num_workers" and loader_cores:  # the most within the cores first; past them, the fewest
        ordered = sorted(ordered, key=lambda v: (v > loader_cores, v if v > loader_cores else -v))
    return [space.with_changes(incumbent, **{dimension: v}) for v in ordered]


def tie_across_precisions(feasible: list[Configuration]) -> bool:
    """Whether configurations of 16 bits and of 32 bits measure alike (within :func:`tie_band` of the
    fastest): then precision is not what limits throughput, and the other dimensions are asked at once."""
    if len(feasible) < 2:
        return False
    fastest = max(feasible, key=lambda c: c.mean_samples_per_s)
    tied = [c for c in feasible if fastest.mean_samples_per_s - c.mean_samples_per_s <= tie_band(fastest, c) * fastest.mean_samples_per_s]
    return len({mixed_precision_dtype(c.params.precision) is not None for c in tied}) == 2
