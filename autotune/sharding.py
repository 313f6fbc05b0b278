"""Sharding and offloading the training state, as a searched dimension (``sharding``): DeepSpeed ZeRO through the
Trainer's own integration (``TrainingArguments(deepspeed=...)``), never a home-made one.

Values (:data:`SHARDINGS`):

* ``none``: the Trainer's own data parallelism (DDP over several processes; nothing with one);
* ``zero1`` / ``zero2`` / ``zero3``: ZeRO stage 1 (optimizer state partitioned over the ranks), 2 (and the
  gradients), 3 (and the parameters, gathered layer by layer in each forward and backward);
* ``zero2_offload``: ZeRO-Offload, the optimizer state and its step on the host (pinned memory), the rest as
  stage 2; ``zero3_offload``: ZeRO-Infinity's CPU offload, the parameters on the host too.

With one process a stage partitions over one rank and saves nothing on the device; its offload variants still
move the optimizer (and parameters) to the host: what lets a model whose optimizer state does not fit on one GPU
train on it. A probe of a sharded configuration runs under torchrun even with one process, as DeepSpeed wants a
process group (:mod:`autotune.probe.ranks`).

The DeepSpeed configuration leaves every size to the Trainer (``"auto"``: micro-batch, accumulation, clipping,
bf16/fp16), which fills them from the trial's own arguments, so the exported ``TrainingArguments`` carry one
self-contained ``deepspeed`` dict. FSDP is not a value yet: accelerate runs FSDP on GPUs only (on a CPU the
Trainer falls back to DDP without a word), so it cannot be tested on this project's CI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NONE = "none"


@dataclass(frozen=True)
class Sharding:
    """One value of the ``sharding`` dimension: what it partitions over the ranks and what it keeps on the host."""

    name: str
    stage: int  # ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters
    offload_optimizer: bool = False  # optimizer state (with the fp32 master weights under mixed precision) and step on the host
    offload_parameters: bool = False  # parameters on the host (stage 3 only)

    @property
    def engine(self) -> str | None:
        """The package that runs it (``deepspeed``), None for ``none``."""
        return "deepspeed" if self.stage else None


SHARDINGS: dict[str, Sharding] = {s.name: s for s in (
    Sharding(NONE, 0),
    Sharding("zero1", 1),
    Sharding("zero2", 2),
    Sharding("zero3", 3),
    Sharding("zero2_offload", 2, offload_optimizer=True),
    Sharding("zero3_offload", 3, offload_optimizer=True, offload_parameters=True),
)}


def parse(value: str) -> Sharding:
    """The :class:`Sharding` of a value.

    Raises:
        ValueError: not one of :data:`SHARDINGS`.
    """
    try:
        return SHARDINGS[value]
    except (KeyError, TypeError):
        raise ValueError(f"{value!r} is not one of {', '.join(SHARDINGS)}") from None


# Optimizers an offloaded ZeRO runs: DeepSpeed's own AdamW on the host (DeepSpeedCPUAdam), which the configuration names,
# as DeepSpeed refuses a client optimizer with offload (zero_force_ds_cpu_optimizer); the Trainer's AdamW flavours are
# the same algorithm. Others (Adafactor, 8-bit and paged states on the GPU) have no such host implementation.
OFFLOAD_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


def incompatible(value: str, optim: str) -> str | None:
    """Why ``value`` cannot train with ``optim`` (one line), or None."""
    if parse(value).offload_optimizer and optim not in OFFLOAD_OPTIMIZERS:
        return f"{value} runs DeepSpeed's own AdamW on the host, not {optim} (use optim {' or '.join(OFFLOAD_OPTIMIZERS)})"
    return None


def deepspeed_config(value: str) -> dict[str, Any]:
    """The ``deepspeed`` dict of ``TrainingArguments`` for a ZeRO value (every size ``"auto"``, filled by the Trainer)."""
    sharding = parse(value)
    zero: dict[str, Any] = {"stage": sharding.stage}
    extra: dict[str, Any] = {}
    if sharding.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        extra["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    if sharding.offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        **extra,
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }


def of_deepspeed_config(config: dict[str, Any]) -> str | None:
    """The value a user's own ``deepspeed`` dict amounts to (its ZeRO stage and CPU offload), None when none is."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    devices = {key: (zero.get(key) or {}).get("device", "none") for key in ("offload_optimizer", "offload_param")}
    if any(device not in ("cpu", "none") for device in devices.values()):
        return None  # NVMe offload: not a value of ours
    on_host = {key: device == "cpu" for key, device in devices.items()}
    for sharding in SHARDINGS.values():
        if sharding.stage and (sharding.stage, sharding.offload_optimizer, sharding.offload_parameters) == (
                stage, on_host["offload_optimizer"], on_host["offload_param"]):
            return sharding.name
    return None


def training_arguments_kwargs(value: str) -> dict[str, Any]:
    """What ``value`` adds to ``TrainingArguments`` (nothing for ``none``)."""
    return {"deepspeed": deepspeed_config(value)} if parse(value).stage else {}


def deepspeed_collectives_on_gloo() -> None:
    """Have DeepSpeed run a CPU probe's collectives on torch's gloo, as it does where its shared-memory op cannot build.

    DeepSpeed otherwise JIT-compiles that op (``deepspeed_shm_comm``, g++ over two files) the first time a process
    group starts on a CPU on a machine: 1-2 minutes on two cores, inside the probe's time box, for a device autotune
    probes only to show that a run works. DeepSpeed reads which ops it may build from ``deepspeed.ops.__compatible_ops__``.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def needs_process_group(value: str) -> bool:
    """Whether a probe of ``value`` must be launched as ranks (torchrun) even with one process."""
    return parse(value).engine is not None


def device_shares(value: str, world: int) -> tuple[float, float, float]:
    """The shares of the model's (weights, gradients, optimizer state) one device keeps under ``value`` over ``world``
    ranks: stage 1 partitions the optimizer state, 2 the gradients too, 3 the weights too; an offloaded part: 0."""
    s, n = parse(value), max(world, 1)
    weights = 0.0 if s.offload_parameters else (1 / n if s.stage >= 3 else 1.0)
    gradients = 1 / n if s.stage >= 2 else 1.0
    optimizer = 0.0 if s.offload_optimizer else (1 / n if s.stage >= 1 else 1.0)
    return weights, gradients, optimizer


def host_shares(value: str) -> tuple[float, float]:
    """The shares of the model's (weights, optimizer state) the host keeps under ``value`` (every rank's part: the whole)."""
    s = parse(value)
    return (1.0 if s.offload_parameters else 0.0), (1.0 if s.offload_optimizer else 0.0)


def needs_no_less_device_memory(x: str, y: str) -> bool:
    """Whether sharding ``x`` keeps no less state on each device than ``y``, whatever the model and rank count."""
    a, b = parse(x), parse(y)
    return (a.stage <= b.stage and (not a.offload_optimizer or b.offload_optimizer)
            and (not a.offload_parameters or b.offload_parameters))
