"""Evaluators: how the driver turns a configuration into a measurement.

:class:`ProbeEvaluator` runs a real probe training in a fresh child process. Tests and
benchmarks plug in other evaluators (a fake with an OOM threshold, a replay table) through the
same one-method interface, :class:`autotune.search.loop.Evaluator`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import autotune.defaults as defaults
from autotune.params import TrialParams
from autotune.probe.interference import interference
from autotune.probe.isolation import (
    DEFAULT_MODE,
    IsolationMode,
    OrphanedProbe,
    clear_run_cache,
    orphaned_probes,
    run_isolated,
    start_server,
)
from autotune.records import ProbeResult, ProbeSpec, ProbeStatus
from autotune.units import parse_duration_s

# torch.compile compiles on the first step and may recompile on the second (optimizer, grad
# accumulation boundaries): give compiled configurations two more steps before timing.
COMPILE_EXTRA_WARMUP_STEPS = 2


@dataclass
class ProbeEvaluator:
    """Real probes: one fresh process per trial, on ``device``."""

    model: dict[str, Any]  # ModelSpec.to_dict()
    seq_len: int
    device: str  # "cpu", or "cuda[:N]" (N: the parent's view, CUDA_VISIBLE_DEVICES applied)
    memory_ceiling_bytes: int | None = None
    warmup_steps: int = defaults.WARMUP_STEPS
    measure_steps: int = defaults.MEASURE_STEPS  # the minimum; measuring goes on until the mean step time is stable
    seed: int = 0
    dataset: dict[str, Any] | None = None  # DatasetSpec.to_dict(); None: synthetic tokens
    max_measure_steps: int = 50
    max_measure_s: float = parse_duration_s(defaults.MAX_MEASURE_TIME)
    mode: IsolationMode = DEFAULT_MODE
    # NVML UUID of the GPU (DeviceInfo.uuid), which the child is pinned to; None: resolved from device.
    device_uuid: str | None = None
    # Which study the probes belong to ({"study": name, "storage": an id}): kept in each probe's folder
    # with the trial number, so a result finished after this process was killed is recorded later.
    owner_note: dict[str, Any] | None = None
    peft: dict[str, Any] | None = None  # autotune.lora.LoraSettings.to_dict(): train LoRA adapters; None: every weight
    trainer: str | None = None  # the user's Trainer factory (ProbeSpec.trainer); None: the built-in model and data
    trainer_sys_path: str | None = None  # ProbeSpec.trainer_sys_path
    trainer_args: tuple[str, ...] | None = None  # ProbeSpec.trainer_args
    trainer_attn_flag: bool = False  # ProbeSpec.trainer_attn_flag
    objective_tokens_per_sample: float | None = None  # ProbeSpec.objective_tokens_per_sample
    nproc: int = 1  # ProbeSpec.nproc: ranks per probe (torchrun), one GPU each from ``device`` on
    host_memory_ceiling_bytes: int | None = None  # the probe's processes together; a probe over it does not fit (see evaluate)
    _trial_number: int | None = field(default=None, init=False, repr=False)
    _last_probe_end_s: float | None = field(default=None, init=False, repr=False)  # time.time() when our last probe ended

    def spec_for(self, params: TrialParams) -> ProbeSpec:
        extra = COMPILE_EXTRA_WARMUP_STEPS if params.torch_compile != "off" else 0
        return ProbeSpec(
            model=self.model,
            params=params,
            seq_len=self.seq_len,
            device=self.device,
            warmup_steps=self.warmup_steps + extra,
            measure_steps=self.measure_steps,
            max_measure_steps=max(self.max_measure_steps, self.measure_steps),
            max_measure_s=self.max_measure_s,
            memory_ceiling_bytes=self.memory_ceiling_bytes,
            seed=self.seed,
            dataset=self.dataset,
            peft=self.peft,
            trainer=self.trainer,
            trainer_sys_path=self.trainer_sys_path,
            trainer_args=self.trainer_args,
            trainer_attn_flag=self.trainer_attn_flag,
            objective_tokens_per_sample=self.objective_tokens_per_sample,
            nproc=self.nproc,
        )

    def prepare(self) -> None:
        """Start the probe server now (once per process), so the run's budget, not its first probe, pays for it."""
        if self.mode == "forkserver":
            start_server()

    def close(self) -> None:
        """The run is over: remove what its probes shared (:func:`autotune.probe.isolation.run_cache_dir`)."""
        clear_run_cache()

    def label_trial(self, number: int) -> None:
        """The trial the next probe measures (the loop's ``on_start``), for its folder's note."""
        self._trial_number = number

    def orphaned_results(self) -> list[OrphanedProbe]:
        """Results of this study's probes that finished after an earlier driver was killed (the caller
        records each, then discards it); other studies' are left for their own runs."""
        if self.owner_note is None:
            return []
        return [o for o in orphaned_probes() if all(o.note.get(k) == v for k, v in self.owner_note.items())]

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        # Before: our probe is not running yet (nor is the last one's work counted).
        busy = interference(self.device_uuid, cuda=self.device.startswith("cuda"), idle_since_s=self._last_probe_end_s)
        note = None
        if self.owner_note is not None:
            note = {**self.owner_note, "trial": self._trial_number, "params": params.to_dict()}
        self._trial_number = None
        try:
            result = run_isolated(self.spec_for(params), timeout_s=timeout_s, mode=self.mode, device_uuid=self.device_uuid, note=note)
        finally:
            self._last_probe_end_s = time.time()
        result = over_host_ceiling(result, self.host_memory_ceiling_bytes)
        return result.replace(interference=busy) if busy else result


def over_host_ceiling(result: ProbeResult, ceiling_bytes: int | None) -> ProbeResult:
    """A probe whose processes held more host memory than ``ceiling_bytes`` together: out of memory, as one over the device's
    ceiling is (on a real run the kernel's OOM killer would end it, or the machine would swap); otherwise unchanged."""
    if ceiling_bytes is None or not result.ok or result.host_peak_rss_bytes is None or result.host_peak_rss_bytes <= ceiling_bytes:
        return result
    from autotune.units import format_bytes

    return ProbeResult(status=ProbeStatus.OOM, error=f"host memory: the probe's processes peaked at {format_bytes(result.host_peak_rss_bytes)}, "
                       f"over the {format_bytes(ceiling_bytes)} host ceiling", peak_mem_bytes=result.peak_mem_bytes,
                       host_peak_rss_bytes=result.host_peak_rss_bytes, wall_s=result.wall_s, setup_s=result.setup_s,
                       device_name=result.device_name, extra=result.extra)
