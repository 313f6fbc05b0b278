"""Records that cross a module or process boundary: what a probe runs, what it measured, on what.

All are frozen dataclasses serialised as JSON. An outcome is data (:class:`ProbeStatus`), not text.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import autotune.defaults as defaults
from autotune.params import TrialParams
from autotune.units import parse_duration_s

DeviceKind = Literal["cuda", "cpu"]


class ProbeStatus(str, enum.Enum):
    """The outcome of one trial, as stored in the study (``status`` user attribute) and replay tables.

    The first five are what a probe that ran can end in; ``PRUNED`` is a configuration the strategy
    ruled out without running it (the memory model predicted it over the ceiling). A ``str`` enum,
    so a member compares equal to its stored text (``ProbeStatus.OK == "ok"``).
    """

    OK = "ok"
    OOM = "oom"
    TIMEOUT = "timeout"  # the deadline passed: says nothing about speed or memory
    CRASH = "crash"
    DIVERGED = "diverged"  # finished, but the loss went NaN/inf
    PRUNED = "pruned"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # as its text's, so a member finds the text's entry in a dict or set
        return str.__hash__(self)

    def ran(self) -> bool:
        """A probe ran (every status but ``PRUNED``)."""
        return self is not ProbeStatus.PRUNED

    def is_measured(self) -> bool:
        """The probe ran to an outcome that says something about this configuration.

        A timeout (often cut short by the budget) and a pruned trial do not; ``oom``, ``crash`` and
        ``diverged`` do: a configuration that ran out of memory once does not fit, however often
        it fitted elsewhere.
        """
        return self in (ProbeStatus.OK, ProbeStatus.OOM, ProbeStatus.CRASH, ProbeStatus.DIVERGED)

    def is_ok(self) -> bool:
        return self is ProbeStatus.OK

    @classmethod
    def values(cls, *, ran: bool = False) -> tuple[str, ...]:
        """The stored texts, in declaration order (``ran``: only the outcomes of a probe that ran)."""
        return tuple(s.value for s in cls if s.ran() or not ran)


@dataclass(frozen=True)
class ProbeSpec:
    """Everything the child process needs to run one probe training."""

    model: dict[str, Any]  # ModelSpec.to_dict(): name, source and the config dict
    params: TrialParams
    seq_len: int
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    warmup_steps: int = defaults.WARMUP_STEPS  # optimizer steps excluded from timing (compilation, first allocations)
    measure_steps: int = defaults.MEASURE_STEPS  # the minimum number of optimizer steps timed
    max_measure_steps: int | None = None  # keep measuring until stable, up to this (None: measure_steps, fixed)
    max_measure_s: float = parse_duration_s(defaults.MAX_MEASURE_TIME)  # ... or until this much measured time
    target_ci_rel: float = 0.02  # stable when the 95% CI of the mean step time is within +-2%
    memory_ceiling_bytes: int | None = None  # enforced inside the child so OOMs happen at the ceiling
    seed: int = 0
    dataset: dict[str, Any] | None = None  # DatasetSpec.to_dict(); None: synthetic tokens
    peft: dict[str, Any] | None = None  # autotune.lora.LoraSettings.to_dict(): wrap the model in adapters; None: full training
    # The user's Trainer factory (``--trainer``): "/abs/path/my_train.py:make_trainer" or "package.module:make_trainer";
    # it builds the model, data and Trainer (autotune.probe.user_trainer). None: the built-in model on synthetic or --dataset data.
    trainer: str | None = None
    trainer_sys_path: str | None = None  # for a module reference: the folder put first on sys.path (the user's directory)
    # The factory's own command-line inputs (``--trainer-args``), for a factory ``make_trainer(argv)``: it is called with
    # these, then the probe's and the trial's settings as flags. None: a factory ``make_trainer(args, attn_implementation)``.
    trainer_args: tuple[str, ...] | None = None
    trainer_attn_flag: bool = False  # the factory's parser takes --attn_implementation: the trial's kernel goes there
    # Rank by tokens: samples_per_s is tokens_per_s over this (the data's mean real tokens per sequence, from the
    # plan-time check), so configurations that change what a batch holds (packing) compare by the tokens they train.
    objective_tokens_per_sample: float | None = None
    # The plan-time check only: user-config fields of the space and their values, each tried on the user's config class.
    check_values: dict[str, list[Any]] | None = None
    # Processes the probe runs, one per GPU (on a CPU, each with its share of the cores), launched by torchrun and
    # trained data-parallel by the Trainer (autotune.probe.ranks); 1: one process, no process group.
    nproc: int = 1

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["params"] = self.params.to_dict()
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> ProbeSpec:
        data = json.loads(text)
        data["params"] = TrialParams.from_dict(data["params"])
        if data.get("trainer_args") is not None:
            data["trainer_args"] = tuple(data["trainer_args"])
        return cls(**data)


# A trial that waits for its batches more than this share of the measured window is input-bound:
# a faster input pipeline (more dataloader workers) would make it faster.
INPUT_BOUND_FRACTION = 0.2


@dataclass(frozen=True)
class ProbeResult:
    """What one probe measured. Throughput fields are None unless the status is ``ok``."""

    status: ProbeStatus
    samples_per_s: float | None = None  # whole optimizer steps (all accumulation micro-batches)
    tokens_per_s: float | None = None
    step_time_s: float | None = None  # mean optimizer-step time over the measured window
    measured_steps: int = 0
    peak_mem_bytes: int | None = None  # what the memory ceiling is checked against
    peak_allocated_bytes: int | None = None  # CUDA allocator peak allocated
    peak_reserved_bytes: int | None = None  # CUDA allocator peak reserved
    peak_device_used_bytes: int | None = None  # NVML: whole device, context and workspaces included
    # CUDA: device memory this process uses outside the caching allocator (context, library handles and
    # kernels), measured after CUDA init and a first matmul; part of peak_mem_bytes.
    non_allocator_bytes: int | None = None
    num_alloc_retries: int | None = None  # CUDA: allocator cudaMalloc retries (cache flushed to fit); >0 near the cap
    # Host memory: the peak resident set of the probe's process, summed over its ranks (they share the host). On a CPU
    # run it is also the device memory (peak_mem_bytes: the largest rank's).
    host_peak_rss_bytes: int | None = None
    setup_s: float | None = None  # child start to first training step: imports, model build, Trainer
    warmup_s: float | None = None
    wall_s: float | None = None  # the whole probe as the parent saw it, process start included
    losses: tuple[float, ...] = ()
    error: str | None = None  # reason for a non-ok status (stderr tail for a crash)
    device_name: str | None = None
    # Steady state (see autotune.probe.steady).
    step_time_ci95_rel: float | None = None  # half-width of the 95% CI of the mean step time, relative
    stable: bool = False  # the CI met the target before a step/time cap
    # Model FLOPs (see autotune.probe.flops).
    model_flops_per_token: float | None = None  # 6N + 12·L·H·Q·T, PaLM Appendix B
    achieved_tflops: float | None = None
    mfu: float | None = None  # 0..1; None for a device without a known peak
    # fp32 matmul precision in force during training, read back from torch ("ieee" | "tf32", torch's
    # fp32_precision names); picks the MFU peak (autotune.probe.flops.peak_precision).
    matmul_precision: str | None = None
    # NVML telemetry over the measured window (None on the CPU).
    gpu_util_mean_pct: float | None = None
    gpu_util_peak_pct: float | None = None
    power_mean_w: float | None = None
    sm_clock_mean_mhz: float | None = None
    energy_per_sample_j: float | None = None  # from the GPU's energy counter over the window
    telemetry_window_s: float | None = None  # length of the NVML-sampled window
    # The window was long enough for NVML's ~1 s power/utilisation averages (otherwise those stay None).
    telemetry_reliable: bool = False
    # What else used the device just before the probe (other GPU processes or utilisation, CPU load
    # above the core count): its figures may be noise (autotune.probe.interference). None: idle.
    interference: str | None = None
    # The probe's process was killed from outside (SIGKILL: a person or the kernel's OOM killer; SIGTERM) or lost with
    # the probe server that forked it: the outcome says nothing of the configuration, which is probed once more.
    process_lost: bool = False
    # Input pipeline.
    input_wait_fraction: float | None = None  # share of the measured window spent waiting for batches
    input_bound: bool = False
    # Fixed per-trial cost, apart from the measured window.
    overhead_s: float | None = None  # process start, imports, Trainer set-up: setup_s less model_build_s
    model_build_s: float | None = None
    # Parameters of the model as trained (LoRA adapters included in the total; frozen = total - trainable).
    # None in results written before these were recorded.
    parameters_total: int | None = None
    parameters_trainable: int | None = None
    parameters_frozen: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", ProbeStatus(self.status))  # text from JSON or a table: checked here

    @property
    def ok(self) -> bool:
        return self.status is ProbeStatus.OK

    def fits(self, ceiling_bytes: int | None) -> bool:
        """This probe finished under the memory ceiling (the per-probe half of the feasibility rule,
        :func:`autotune.search.ranking.rank_configurations`, which holds the other half)."""
        return self.ok and self.peak_mem_bytes is not None and (ceiling_bytes is None or self.peak_mem_bytes <= ceiling_bytes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["losses"] = list(self.losses)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in names}
        data["losses"] = tuple(data.get("losses") or ())
        return cls(**data)

    def replace(self, **changes: Any) -> ProbeResult:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Probe:
    """One probe that ran, as the search and the ranking read it: its trial number, configuration and outcome."""

    number: int
    params: TrialParams
    result: ProbeResult


@dataclass(frozen=True)
class DeviceInfo:
    """What the probes will run on."""

    kind: DeviceKind
    name: str
    total_memory_bytes: int
    compute_capability: tuple[int, int] | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    index: int = 0  # cuda:N as the parent sees it: its place in the user's CUDA_VISIBLE_DEVICES list
    uuid: str | None = None  # NVML UUID (GPU-... or MIG-...) the probes are pinned to; None: the CPU, or an older record

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def is_mig(self) -> bool:
        """A MIG compute instance: a slice of a GPU that shares its power and clocks with other slices."""
        return bool(self.uuid and self.uuid.startswith("MIG-"))

    @property
    def supports_bf16(self) -> bool:
        # bf16 Tensor Cores arrive with Ampere (sm_80); CPUs run bf16 autocast in software.
        return not self.is_cuda or (self.compute_capability or (0, 0)) >= (8, 0)

    @property
    def supports_tf32(self) -> bool:
        return self.is_cuda and (self.compute_capability or (0, 0)) >= (8, 0)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceInfo:
        data = dict(data)
        if data.get("compute_capability"):
            data["compute_capability"] = tuple(data["compute_capability"])
        return cls(**data)
