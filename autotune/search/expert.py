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

from collections.abc import Sequence
from typing import Any

from autotune.params import TrialParams
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
}


def expert_params(space: SearchSpace, base: TrialParams, memory: Any, ceiling_bytes: int,
                  rank_attention: Sequence[str] | None = None) -> TrialParams:
    """The expert rule's configuration in ``space``, the other settings as in ``base`` (the run's baseline).

    Args:
        space: the search space as restricted to the device (values it cannot run dropped).
        base: the baseline: what the expert leaves alone (loader settings, the user's own extra fields).
        memory: a :class:`autotune.search.memory.MemoryModel` (``largest_batch_that_fits``); None: the
            largest batch of the space.
        ceiling_bytes: the memory ceiling the batch must fit under.
        rank_attention: the attention kernels in order of preference, if not :data:`EXPERT_PREFERENCES`'s.

    Returns:
        A point of ``space`` (its batch the largest predicted to fit, else the smallest of the space).
    """
    changes: dict[str, Any] = {}
    for name, preferred in EXPERT_PREFERENCES.items():
        if name == "attn_implementation" and rank_attention is not None:
            preferred = tuple(rank_attention)
        choices = space.choices.get(name, ())
        value = next((v for v in preferred if v in choices), None)
        if value is not None:
            changes[name] = value
    batches = sorted(space.choices["per_device_train_batch_size"])
    if space.effective_batch_size:  # accumulation is derived: the largest batch dividing N leaves the least
        batches = [b for b in batches if space.effective_batch_size % b == 0] or batches
    expert = space.with_changes(base, **changes, per_device_train_batch_size=batches[0])
    largest = memory.largest_batch_that_fits(expert, batches, ceiling_bytes) if memory is not None else batches[-1]
    return space.with_changes(expert, per_device_train_batch_size=largest or batches[0])
