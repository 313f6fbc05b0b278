"""The throughput model's features and their priors (the model: :mod:`..steptime`).

Precision, attention kernel, compile mode and checkpointing act on a micro-step's overhead and on the
per-sample time, the optimizer (and sharding) on the step; values of one kind (the 16-bit precisions,
the compile modes) share an effect. Per-sample hinges, misalignment terms and small residuals
(workers, accumulation, batch size) complete it; the loader is a fourth part of the step with 0
workers and a cap on throughput with more. The expert ordering is only the prior mean.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from autotune.search.strategies.steptime import CAP, LINEAR, OFF, SCALE, StepTimeSurrogate
from autotune.search.strategies.surrogate import ACCUM, BATCH, BlockBuilder, Grid

WORKERS = "dataloader_num_workers"

# Prior means of log samples/s effects: the expert ordering, as a starting point only. Siblings of
# one kind are 0.02 apart: on Ampere and later fp16 and bf16 run the same tensor-core rate, and
# sdpa dispatches to flash kernels itself.
PRIOR: dict[str, dict[Any, float]] = {
    "precision": {"fp32": 0.0, "tf32": 0.5, "fp16": 0.88, "bf16": 0.9, "fp16+tf32": 0.88, "bf16+tf32": 0.9},
    "attn_implementation": {"eager": 0.0, "sdpa": 0.1, "flash_attention_2": 0.12, "flash_attention_3": 0.14},
    "gradient_checkpointing": {False: 0.0, True: -0.25},
    "optim": {"adamw_torch": -0.03, "adamw_torch_fused": 0.0, "adafactor": -0.05, "adamw_bnb_8bit": 0.0},
}
RESIDUAL_SD = {WORKERS: 0.03, ACCUM: 0.05}
KINDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "precision": {"16-bit": ("fp16", "bf16", "fp16+tf32", "bf16+tf32")},
    "attn_implementation": {"fused": ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")},
    "torch_compile": {"compiled": ("inductor", "inductor:default", "inductor:reduce-overhead", "inductor:max-autotune",
                                   "inductor:max-autotune-no-cudagraphs", "cudagraphs", "aot_eager")},
}
_WITHIN_KIND_SD = 0.06
_HINGES = (16.0, 32.0, 64.0)  # throughput may fall past these sizes
# The loader, learnt from throughput (and from the input wait, where probes report it). Workers load
# in parallel with compute: their rate, ``rate x workers^WORKER_SCALING`` (the exponent between two
# neighbouring counts free to differ by CAP_SLOPE_SD), caps the throughput (a soft
# minimum, :data:`~autotune.search.strategies.steptime.CAP`; its prior is set from the measurements:
# one worker loads CAP_PRIOR[0] (log) above their median). Loading in the training process (0 workers)
# is serial with compute: a part of the step's time, ``A x b / (rate x exp(loading))``, a priori
# about as fast as one worker. Where the host's cores for them are known, more workers than the most
# within those cores a priori load no faster (they contend for the same cores).
WORKER_SCALING = 0.9
CAP_PRIOR = (math.log(2.0), 1.5)
CAP_UNKNOWN = 30.0  # the cap's prior mean before anything was measured: none
CAP_SLOPE_SD = 0.5  # workers past the host's free cores contend: more of them may load no faster, or slower
LOADING = "loading"
LOADING_SD = 0.5
# A user-config field's effect on per-sample time (log): unknown before it is measured, and may be
# large (packing sequences instead of padding them: 2.5x tokens/s on TRL's SFT example).
_USER_FIELD_SD = 0.5
# Prior means and sds of per-value effects on a micro-step's overhead (log seconds): kernel launches
# and Python per step; compilation fuses kernels (and CUDA graphs replay them), so its prior is a
# cut, of uncertain size; checkpointing adds the recomputed forward's launches.
_OVERHEAD_PRIOR: dict[str, tuple[dict[Any, float], float, float]] = {  # dim: (means, sd, sd within a kind)
    "precision": ({}, 0.3, 0.06),
    "attn_implementation": ({}, 0.15, 0.06),
    "torch_compile": ({"off": 0.0, "compiled": -0.4}, 0.5, 0.15),  # "compiled": every other mode
    "gradient_checkpointing": ({True: 0.1}, 0.2, 0.2),
}
_PER_SAMPLE_SD = {"precision": 0.35, "attn_implementation": 0.12, "torch_compile": 0.15, "gradient_checkpointing": 0.1}
_STEP_PRIOR = {"adamw_torch": 0.6, "adamw_torch_fused": 0.0, "adafactor": 0.5, "adamw_bnb_8bit": 0.0}
_STEP_SD = 0.5
# Sharding (autotune.sharding): its collectives and host work, before any is measured (log seconds, wide). The optimizer
# step pays the partitioned update's gathers, and an offloaded one runs on the host; a micro-step under stage 3
# gathers each layer's parameters in its forward and backward (from the host when they are offloaded).
_SHARDING_STEP_PRIOR = {"none": 0.0, "zero1": 0.1, "zero2": 0.2, "zero3": 0.3, "zero2_offload": 1.0, "zero3_offload": 1.5}
_SHARDING_OVERHEAD_PRIOR = {"zero3": 0.5, "zero3_offload": 1.5}
_SHARDING_SD = 1.0
_OVERHEAD_AT = math.log(2.0)  # overhead / per-sample time at the base values (fp32, eager): saturation near batch 2
_STEP_AT = math.log(0.7)  # a fused AdamW step / one sample's work at the base values
_STEP_TIME_SD = {SCALE: 3.0, "overhead": 1.5, "step": 1.5}


def prior_mean(dim: str, value: Any) -> float:
    if dim == "torch_compile":
        return 0.0 if value == "off" else 0.05
    return PRIOR.get(dim, {}).get(value, 0.0)


def _one(v: dict[str, Any]) -> list[float]:
    return [1.0]


def _lookup(table: dict[Any, float], default: float) -> Callable[[Any], float]:
    return lambda x: table.get(x, default)


def _of_value(dim: str, functions: list[Callable[..., float]]) -> Callable[[dict[str, Any]], list[float]]:
    def features(v: dict[str, Any]) -> list[float]:
        return [f(v[dim]) for f in functions]

    return features


def _value_blocks(builder: BlockBuilder, dim: str, prefix: str, mean_of: Callable[[Any], float], sd: float, within_sd: float) -> None:
    """One feature per value of ``dim``, plus one per kind shared by its members (:data:`KINDS`):
    values of one kind share an effect, each deviating a little from it, so measuring one says much
    about the others."""
    values = builder.grid.values[dim]
    kinds = [(k, [x for x in values if x in members]) for k, members in KINDS.get(dim, {}).items()]
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


def step_time_surrogate(grid: Grid, accum_dims: tuple[str, ...], accum_values: list[int], accum_of: Callable[[dict[str, Any]], int],
                        batch_values: np.ndarray, accum_grid: np.ndarray, loader_cores: int | None = None) -> StepTimeSurrogate:
    """The step-time model over ``grid``: per-value effects on a micro-step's overhead and
    per-sample time, the optimizer's on its step, and small residuals; ``loader_cores``: the CPU
    cores one probe process's loader workers have (None: unknown, no limit)."""
    terms = {name: BlockBuilder(grid) for name in ("overhead", "per_sample", "step", LINEAR)}
    for name, builder in terms.items():
        if name != LINEAR:
            builder.add((), [SCALE], _one, 0.0, _STEP_TIME_SD[SCALE])
    terms["overhead"].add((), ["overhead"], _one, _OVERHEAD_AT, _STEP_TIME_SD["overhead"])
    terms["step"].add((), ["step"], _one, _STEP_AT, _STEP_TIME_SD["step"])
    for dim in ("precision", "attn_implementation", "torch_compile", "gradient_checkpointing"):
        if len(grid.values[dim]) < 2:
            continue
        prior, sd, within = _OVERHEAD_PRIOR[dim]
        if dim == "torch_compile":
            prior = {x: prior["off" if x == "off" else "compiled"] for x in grid.values[dim]}
        _value_blocks(terms["overhead"], dim, "o:", _lookup(prior, 0.0), sd, within)
        # Per-sample time: the expert ordering of speeds, as log seconds (faster is less).
        per_sample = {x: -prior_mean(dim, x) for x in grid.values[dim]}
        _value_blocks(terms["per_sample"], dim, "p:", _lookup(per_sample, 0.0), _PER_SAMPLE_SD[dim], _WITHIN_KIND_SD)
    if len(grid.values["optim"]) >= 2:
        _value_blocks(terms["step"], "optim", "s:", _lookup(_STEP_PRIOR, 0.3), _STEP_SD, _STEP_SD)
    if "sharding" in grid.names and len(grid.values["sharding"]) >= 2:
        _value_blocks(terms["step"], "sharding", "s:", _lookup(_SHARDING_STEP_PRIOR, 0.5), _SHARDING_SD, _SHARDING_SD)
        _value_blocks(terms["overhead"], "sharding", "o:", _lookup(_SHARDING_OVERHEAD_PRIOR, 0.0), _SHARDING_SD, _SHARDING_SD)
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
        residual.add((WORKERS,), [f"{WORKERS}={x}" for x in values], lambda v: [float(v[WORKERS] == x) for x in values], 0.0, RESIDUAL_SD[WORKERS])
    if accum_dims and len(accum_values) > 1:
        residual.add(accum_dims, [f"accum={a}" for a in accum_values], lambda v: [float(accum_of(v) == a) for a in accum_values], 0.0, RESIDUAL_SD[ACCUM])
    log_accum = np.log(accum_grid)
    log_batch = np.log(batch_values)
    offsets = {"overhead": log_accum, "per_sample": log_accum + log_batch, "step": np.zeros(grid.broadcast_shape(()))}
    cap_offset = None
    if WORKERS in grid.names and len(grid.values[WORKERS]) > 1 and max(grid.values[WORKERS]) > 0:
        terms[CAP] = BlockBuilder(grid)
        terms[CAP].add((WORKERS,), [CAP], lambda v: [float(v[WORKERS] > 0)], CAP_UNKNOWN, CAP_PRIOR[1])
        # The exponent's deviation between each two neighbouring worker counts: a random walk in log workers.
        logs = [math.log(x) for x in sorted(grid.values[WORKERS]) if x > 0]
        segments = list(zip(logs, logs[1:]))
        terms[CAP].add((WORKERS,), [f"{CAP}:slope{k}" for k in range(len(segments))],
                       lambda v: [max(0.0, min(math.log(v[WORKERS]), hi) - lo) if v[WORKERS] > 0 else 0.0 for lo, hi in segments], 0.0, CAP_SLOPE_SD)
        within = max((x for x in grid.values[WORKERS] if 0 < x <= loader_cores), default=loader_cores) if loader_cores else math.inf
        cap_offset = grid.along((WORKERS,), lambda **v: WORKER_SCALING * math.log(min(v[WORKERS], within)) if v[WORKERS] > 0 else OFF)
        if 0 in grid.values[WORKERS]:
            terms[LOADING] = BlockBuilder(grid)
            terms[LOADING].add((), [CAP, LOADING], lambda v: [-1.0, -1.0], [CAP_UNKNOWN, 0.0], [CAP_PRIOR[1], LOADING_SD])
            offsets[LOADING] = log_accum + log_batch + grid.along((WORKERS,), lambda **v: 0.0 if v[WORKERS] == 0 else -OFF)
    return StepTimeSurrogate(grid, {name: builder.blocks for name, builder in terms.items()}, offsets, log_accum + log_batch, cap_offset)
