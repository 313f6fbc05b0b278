"""The probe: one short, real training run, inside a fresh child process.

Run by :mod:`autotune.probe.isolation` as ``python -m autotune.probe.child SPEC.json RESULT.json``. It builds
the model from its config directly on the device, wraps it in the real ``transformers.Trainer``
with exactly the candidate ``TrainingArguments``, runs ``warmup_steps`` optimizer steps, then
measures steps until the mean step time is stable (:mod:`autotune.probe.steady`) or a cap is reached,
on synthetic token batches or a real dataset (:mod:`autotune.data`), and writes a
:class:`~autotune.records.ProbeResult` as JSON.

What is timed is what the user will get: data loading, forward, backward, optimizer step and the
Trainer's own bookkeeping. Every optimizer step ends with the device synchronised, so each step
time is the device's, not the host's view of queued work. Alongside: time spent waiting for the
next batch (``get_batch_samples``), NVML telemetry over the measured window
(:class:`autotune.probe.telemetry.NvmlSampler`), and model FLOPs (:mod:`autotune.probe.flops`). Nothing is saved
or logged to disk inside the probe.

The trial's fp32 matmul precision is set explicitly just before training (:func:`apply_matmul_precision`),
whatever transformers and accelerate turned on while the Trainer was built, and read back into the
result, which takes the MFU peak from it. On CUDA the memory reported against the ceiling counts what
the process uses outside the caching allocator (:func:`non_allocator_bytes`, :func:`reported_peak_bytes`),
and the allocator's cap leaves room for it (:func:`allocator_cap_bytes`).

Outcomes are data: an OOM (by type, see :func:`autotune.probe.device.is_out_of_memory`) is ``oom``, a
NaN/inf loss is ``diverged``, any other exception is ``crash`` with its traceback tail.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.params import fp32_matmul_setting, mixed_precision_dtype
from autotune.probe.flops import achieved_tflops, mfu, model_flops_per_token
from autotune.probe.steady import StopRule, ci95_rel
from autotune.records import INPUT_BOUND_FRACTION, ProbeResult, ProbeSpec, ProbeStatus

_ERROR_TAIL_CHARS = 2000
# Device memory the process still takes outside the caching allocator after its baseline is measured:
# kernels loaded on first use (CUDA lazy loading, the default since CUDA 12.2: CUDA C++ Programming
# Guide, "Lazy Loading"), cuBLASLt/cuDNN handles and the workspaces cuBLAS takes with cudaMallocAsync
# outside PyTorch's allocator for new streams and shapes (CUDA >= 12.2, pytorch#124250), the Triton
# kernels of a compiled model. The allocator's cap leaves this much room for it under the ceiling.
NON_ALLOCATOR_HEADROOM_BYTES = 256 * 2**20
# On CUDA the measured window is stretched to the telemetry's minimum (NVML power and utilisation are
# ~1 s averages) by at most this many steps; a Trainer step costs milliseconds of host work at least.
TELEMETRY_MAX_STEPS = 2000
# The sampler's window opens just after the last warm-up step and closes just after the last measured
# step (NvmlSampler samples every 50 ms): measure this much longer than the minimum window.
TELEMETRY_WINDOW_MARGIN_S = 0.25


class SimulatedOutOfMemory(MemoryError):
    """Raised on the CPU when the process's memory passes the simulated ceiling."""


class SyntheticTokens:
    """An endless-enough map-style dataset of random token sequences, reproducible per index."""

    def __init__(self, vocab_size: int, seq_len: int, length: int, seed: int, delay_s: float = 0.0) -> None:
        self.vocab_size, self.seq_len, self.length, self.seed = vocab_size, seq_len, length, seed
        self.delay_s = delay_s  # a deliberately slow input pipeline, for tests and benchmarks

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        if self.delay_s:
            time.sleep(self.delay_s)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.randint(0, self.vocab_size, (self.seq_len,), generator=generator)
        return {"input_ids": tokens, "labels": tokens.clone()}


@dataclass(frozen=True)
class WindowStopRule(StopRule):
    """:class:`StopRule` that also measures at least ``min_measure_s``: while less has been measured
    it keeps going, past ``max_steps`` up to ``window_max_steps``, and never past ``max_s``."""

    min_measure_s: float = 0.0
    window_max_steps: int = 0

    @property
    def step_budget(self) -> int:
        """The most steps this rule can measure (what the Trainer's ``max_steps`` must allow)."""
        return max(self.max_steps, self.window_max_steps) if self.min_measure_s > 0 else self.max_steps

    def should_stop(self, step_times_s: Sequence[float], *args: Any, **kwargs: Any) -> bool:
        n = len(step_times_s)
        short = sum(step_times_s) < min(self.min_measure_s, self.max_s)
        if short and self.min_steps <= n < self.step_budget:
            return False
        return super().should_stop(step_times_s, *args, **kwargs)


def stop_rule(spec: ProbeSpec, min_measure_s: float = 0.0) -> WindowStopRule:
    """The spec's stopping rule; without ``max_measure_steps`` exactly ``measure_steps`` are measured
    (more only to reach ``min_measure_s``, when that is given)."""
    max_steps = spec.max_measure_steps if spec.max_measure_steps is not None else spec.measure_steps
    max_steps = max(max_steps, spec.measure_steps)
    return WindowStopRule(
        min_steps=spec.measure_steps,
        max_steps=max_steps,
        max_s=spec.max_measure_s,
        target_rel=spec.target_ci_rel,
        min_measure_s=min_measure_s,
        window_max_steps=max(max_steps, TELEMETRY_MAX_STEPS) if min_measure_s > 0 else 0,
    )


def min_telemetry_window_s() -> float:
    """The shortest window whose NVML power and utilisation means we report (telemetry's constant)."""
    from autotune.probe import telemetry

    return float(getattr(telemetry, "MIN_TELEMETRY_WINDOW_S", 2.0))


def telemetry_fields(telemetry: Any, samples: int, min_window_s: float) -> dict[str, Any]:
    """The result's telemetry fields from the window's :class:`~autotune.probe.telemetry.Telemetry`.

    ``samples``: training samples processed in the window. Energy comes from the GPU's energy counter
    over the window (``energy_j``), not mean power x time: NVML power is a ~1 s average on Hopper, so
    over a short window it mostly reflects the warm-up. Power and utilisation (also averaged over up
    to a second) are reported only for a window of at least ``min_window_s``; the SM clock is an
    instantaneous reading and is always reported.
    """
    sampled = telemetry.samples > 0
    window_s = float(getattr(telemetry, "window_s", 0.0) or 0.0)
    energy_j = getattr(telemetry, "energy_j", None)
    reliable = sampled and window_s >= min_window_s
    return {
        "gpu_util_mean_pct": telemetry.gpu_util_mean_pct if reliable else None,
        "gpu_util_peak_pct": telemetry.gpu_util_peak_pct if reliable else None,
        "power_mean_w": telemetry.power_mean_w if reliable else None,
        "sm_clock_mean_mhz": telemetry.sm_clock_mean_mhz,
        "energy_per_sample_j": energy_j / samples if energy_j is not None and energy_j > 0 and samples > 0 else None,
        "telemetry_window_s": window_s if sampled else None,
        "telemetry_reliable": reliable,
    }


def apply_matmul_precision(precision: str, cuda: bool) -> str:
    """Set the fp32 matmul precision the trial's ``precision`` says, consistently for the legacy and
    the new torch APIs, and return the precision then in force (:func:`matmul_precision_in_force`).

    Called after the Trainer is built and before it trains. For ``torch_compile`` transformers'
    TrainingArguments turns TF32 on for fp32 and bf16 through the new ``torch.backends.fp32_precision``
    (transformers#42371) and accelerate sets the legacy ``torch.backends.cuda.matmul.allow_tf32``
    for fp32 on CUDA: an "fp32" trial would run TF32 matmuls, and inductor's legacy getter
    ``torch.get_float32_matmul_precision()`` raises after a new-API write it cannot name
    (pytorch#166387), so every compiled bf16 trial would crash.

    Each step below writes the legacy flag and the new API's leaves together, so the legacy and the
    new getters agree afterwards, whatever was written before: the new API's generic level first
    (torch >= 2.9; some releases copy it onto every leaf, so nothing that falls back to it still
    says TF32), then ``torch.set_float32_matmul_precision``, which sets the legacy value and the CUDA
    and oneDNN matmul leaves (torch's ``Context::setFloat32MatmulPrecision``), then the legacy cuDNN
    flag, which sets the cuDNN conv and RNN leaves with it, back to PyTorch's default (TF32 for
    cuDNN convolutions, as in a user's run; the models here have no convolutions).
    """
    import torch

    setting = fp32_matmul_setting(precision)
    if hasattr(torch.backends, "fp32_precision"):  # the new API (torch >= 2.9)
        torch.backends.fp32_precision = "tf32" if setting == "high" else "ieee"
    torch.set_float32_matmul_precision(setting)
    torch.backends.cudnn.allow_tf32 = True
    return matmul_precision_in_force(cuda)


def matmul_precision_in_force(cuda: bool) -> str:
    """The internal precision of fp32 matmuls in force now, in the new API's names ("ieee", "tf32",
    "bf16" on oneDNN only), for the device's matmul backend (cuBLAS, or oneDNN on the CPU).

    Reads the legacy getter too, which inductor calls: a state it cannot name raises here, before
    training, rather than as an InductorError in the first compiled step.
    """
    import torch

    legacy = torch.get_float32_matmul_precision()
    backend = getattr(torch.backends.cuda if cuda else torch.backends.mkldnn, "matmul", None)
    new = getattr(backend, "fp32_precision", None)
    if new in ("ieee", "tf32", "bf16"):
        return str(new)
    # torch < 2.9, or a leaf left at "none": the legacy setting ("medium" is TF32 on CUDA, bf16 on oneDNN).
    return {"highest": "ieee", "high": "tf32"}.get(legacy, "tf32" if cuda else "bf16")


def non_allocator_bytes(used_before_cuda_bytes: int | None, used_after_init_bytes: int | None, reserved_bytes: int) -> int | None:
    """Device memory this process uses outside the caching allocator: NVML's used memory after CUDA
    init and a first matmul, less NVML's before CUDA init (other processes, driver reservations), less
    what the allocator holds (``torch.cuda.memory_reserved()``). That is the context, the library
    handles and the kernels loaded so far. None without NVML."""
    if used_before_cuda_bytes is None or used_after_init_bytes is None:
        return None
    return max(used_after_init_bytes - used_before_cuda_bytes - reserved_bytes, 0)


def allocator_cap_bytes(
    ceiling_bytes: int, used_before_cuda_bytes: int | None, non_allocator: int | None,
    headroom_bytes: int = NON_ALLOCATOR_HEADROOM_BYTES,
) -> int:
    """What the caching allocator may reserve so the whole device stays under ``ceiling_bytes``: the
    ceiling less what was used before this process (NVML counts it in the peak too), less this
    process's memory outside the allocator, less headroom for what it takes later."""
    return max(ceiling_bytes - (used_before_cuda_bytes or 0) - (non_allocator or 0) - headroom_bytes, 0)


def reported_peak_bytes(
    nvml_peak_bytes: int | None, used_before_cuda_bytes: int | None, non_allocator: int | None, max_reserved_bytes: int
) -> int:
    """Peak device memory, as the ceiling is checked against: NVML's peak over the probe, or the
    allocator's peak reserved plus what NVML saw outside it, whichever is larger (NVML is sampled,
    so it can miss the allocator's peak between two samples)."""
    accounted = (used_before_cuda_bytes or 0) + (non_allocator or 0) + max_reserved_bytes
    return max(nvml_peak_bytes or 0, accounted)


@dataclass(frozen=True)
class CudaBaseline:
    """Device memory around CUDA init: NVML's used before this process's context, and this process's
    memory outside the caching allocator after init and a first matmul (None without NVML)."""

    used_before_cuda_bytes: int | None
    non_allocator_bytes: int | None


def _init_cuda(spec: ProbeSpec) -> CudaBaseline:
    """Create the context, measure what it takes outside the allocator, cap the allocator under the ceiling."""
    import torch

    from autotune.probe.telemetry import nvml_used_bytes

    used_before = nvml_used_bytes()  # before this process has a context
    x = torch.ones(64, 64, device="cuda")
    torch.nn.functional.linear(x, x, x[0])  # cuBLAS(Lt) handle and workspace
    amp = mixed_precision_dtype(spec.params.precision)  # bf16+tf32 autocasts to bf16 too
    if amp is not None:
        y = x.to(torch.bfloat16 if amp == "bf16" else torch.float16)
        torch.nn.functional.linear(y, y, y[0])
    torch.cuda.synchronize()
    baseline = non_allocator_bytes(used_before, nvml_used_bytes(), int(torch.cuda.memory_reserved()))
    if spec.memory_ceiling_bytes is not None:
        cap = allocator_cap_bytes(spec.memory_ceiling_bytes, used_before, baseline)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0))
    torch.cuda.reset_peak_memory_stats()
    return CudaBaseline(used_before_cuda_bytes=used_before, non_allocator_bytes=baseline)


def _make_callback(spec: ProbeSpec, cuda: bool) -> Any:
    import torch
    from transformers import TrainerCallback

    from autotune.probe.device import cpu_peak_rss_bytes
    from autotune.probe.telemetry import NvmlSampler, Telemetry, nvml_used_bytes

    plain_rule = stop_rule(spec)
    window_rule = stop_rule(spec, min_measure_s=min_telemetry_window_s() + TELEMETRY_WINDOW_MARGIN_S)

    class ProbeCallback(TrainerCallback):
        """Timestamps optimizer steps with the device synchronised; stops once the mean is stable
        (and, with telemetry, the window is long enough); watches the loss, memory and (over the
        measured window) NVML telemetry."""

        def __init__(self) -> None:
            self.train_begin_s: float | None = None
            self.step_end_s: list[float] = []
            self.fetch_s: list[float] = []  # per optimizer step: host time blocked fetching its batches
            # A user's Trainer (--trainer): per optimizer step, its real batches' sequences and non-padding
            # tokens (a tensor on the device, read once at the end: no host sync per step). None: not counted.
            self.batches: list[tuple[Any, Any]] | None = [] if spec.trainer is not None else None
            self.pad_id: int | None = None
            self.losses: list[float] = []
            self.diverged = False
            self.diverged_at_step: int | None = None
            self.non_finite: Any = None  # tensor on the loss's device: non-finite micro-batch losses so far
            self.peak_device_used_bytes: int | None = None
            self.graphs_at_step: list[int] = []  # torch.compile graphs compiled so far, at each step's end
            self.sampler = NvmlSampler() if cuda else None
            self.telemetry = Telemetry(samples=0)
            self.rule = plain_rule  # the window rule once telemetry is sampling
            # Steps the Trainer must allow: with telemetry (CUDA) the window may stretch past max_measure_steps.
            self.step_budget = (window_rule if cuda else plain_rule).step_budget

        def reference_step_s(self) -> float | None:
            """The last warm-up step's time (compilation and first allocations are in the earlier
            ones): a measured window much slower than it started inside a stall (see steady.has_jump)."""
            if spec.warmup_steps < 2 or len(self.step_end_s) < spec.warmup_steps:
                return None
            return self.step_end_s[spec.warmup_steps - 1] - self.step_end_s[spec.warmup_steps - 2]

        def step_times_s(self) -> list[float]:
            """Durations of the measured steps (after warm-up), one per optimizer step."""
            if spec.warmup_steps:
                marks = self.step_end_s[spec.warmup_steps - 1 :]
            else:
                marks = [self.train_begin_s or 0.0, *self.step_end_s]
            return [b - a for a, b in zip(marks, marks[1:])]

        def measured_fetch_s(self) -> float:
            """Host time blocked fetching batches during the measured steps."""
            return sum(self.fetch_s[spec.warmup_steps : len(self.step_end_s)])

        def count_batches(self, batch_samples: Any, trainer: Any) -> None:
            """Record one optimizer step's sequences and non-padding tokens (a user's Trainer only)."""
            if self.batches is None:
                return
            from autotune.probe.user_trainer import batch_sequences, batch_tokens, pad_token_id

            if not self.batches:
                self.pad_id = pad_token_id(trainer)
            batches = list(batch_samples) if isinstance(batch_samples, (list, tuple)) else []
            self.batches.append((sum(batch_sequences(b) for b in batches), sum(batch_tokens(b, self.pad_id) for b in batches)))

        def measured_batches(self) -> tuple[int, int] | None:
            """Sequences and non-padding tokens of the measured steps' batches (None: not counted)."""
            if self.batches is None:
                return None
            measured = self.batches[spec.warmup_steps : len(self.step_end_s)]
            return sum(int(n) for n, _ in measured), sum(int(t) for _, t in measured)

        def count_non_finite(self, loss: Any) -> None:
            """Count a micro-batch's non-finite loss on its device, without a host sync (read once
            per optimizer step, in ``on_step_end``, where the device is synchronised anyway)."""
            if not isinstance(loss, torch.Tensor):
                return
            count = torch.isfinite(loss.detach()).logical_not().sum()
            self.non_finite = count if self.non_finite is None else self.non_finite + count

        def _check_finite(self, control: Any) -> None:
            if not self.diverged and self.non_finite is not None and int(self.non_finite) > 0:
                self.diverged = True
                self.diverged_at_step = len(self.step_end_s)
                control.should_training_stop = True

        def _check_memory(self) -> None:
            if cuda:
                used = nvml_used_bytes()
                if used is not None:
                    self.peak_device_used_bytes = max(used, self.peak_device_used_bytes or 0)
            elif spec.memory_ceiling_bytes is not None and cpu_peak_rss_bytes() > spec.memory_ceiling_bytes:
                raise SimulatedOutOfMemory(
                    f"peak RSS {cpu_peak_rss_bytes()} B passed the simulated ceiling {spec.memory_ceiling_bytes} B"
                )

        def _start_sampler(self) -> None:
            if self.sampler is not None and self.sampler.start():
                self.rule = window_rule

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin_s = time.perf_counter()
            if spec.warmup_steps == 0:
                self._start_sampler()

        def on_substep_end(self, args, state, control, **kwargs):
            self._check_memory()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.step_end_s.append(time.perf_counter())
            self.graphs_at_step.append(compiled_graphs())
            self._check_memory()
            self._check_finite(control)
            if len(self.step_end_s) == spec.warmup_steps:
                self._start_sampler()
            if len(self.step_end_s) > spec.warmup_steps and self.rule.should_stop(self.step_times_s(), self.reference_step_s()):
                control.should_training_stop = True
                self.stop_sampler()  # the telemetry window ends with the last measured step

        def on_train_end(self, args, state, control, **kwargs):
            self.stop_sampler()

        def stop_sampler(self) -> None:
            if self.sampler is not None:
                self.telemetry = self.sampler.stop()
                self.sampler = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            loss = (logs or {}).get("loss")
            if loss is None:
                return
            self.losses.append(float(loss))
            if not math.isfinite(float(loss)):
                self.diverged = True
                control.should_training_stop = True

    return ProbeCallback()


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (0 when it never ran)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_counts(spec: ProbeSpec, callback: Any) -> dict[str, int]:
    """Graphs compiled during the warm-up and during the measured window: a compilation inside the
    window would be timed as a slow step, so a compiled probe should show none there."""
    graphs = callback.graphs_at_step
    if not graphs:
        return {}
    at_warmup_end = graphs[spec.warmup_steps - 1] if spec.warmup_steps else 0
    return {"compiled_graphs_warmup": at_warmup_end, "compiled_graphs_measured": graphs[-1] - at_warmup_end}


def _matmul_params(model: Any, *, trainable_only: bool = False) -> int:
    """N of the FLOPs formula: every parameter except input embedding tables; a tied output
    projection is counted (it is a real matmul), once. ``trainable_only``: of those, the ones trained."""
    import torch

    params = {id(p): p.numel() for p in model.parameters() if p.requires_grad or not trainable_only}
    embeddings = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and id(output.weight) in embeddings:
        del embeddings[id(output.weight)]
    return sum(params.values()) - sum(n for key, n in embeddings.items() if key in params)


def _timed_trainer(callback: Any, base: Any = None) -> Any:
    """A Trainer that records how long the training loop blocks on ``next()`` for each step's batches,
    and counts non-finite micro-batch losses on the device (divergence, without a host sync).

    ``base``: the class to derive from, default ``transformers.Trainer``; a user's Trainer (``--trainer``)
    gets a subclass of its own class, swapped in at run time (:func:`run_probe`), which also counts each
    step's real sequences and non-padding tokens (``ProbeCallback.count_batches``).
    """
    from transformers import Trainer

    class TimedTrainer(base or Trainer):  # type: ignore[misc]
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            start_s = time.perf_counter()
            try:
                fetched = super().get_batch_samples(epoch_iterator, num_batches, device)
            finally:
                callback.fetch_s.append(time.perf_counter() - start_s)
            callback.count_batches(fetched[0] if isinstance(fetched, tuple) else fetched, self)
            return fetched

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            callback.count_non_finite(loss)
            return loss

    return TimedTrainer


def probe_training_arguments(spec: ProbeSpec, output_dir: str, max_steps: int, cuda: bool) -> Any:
    """The probe's ``TrainingArguments``: the trial's own plus what a probe needs (no saving, no
    reporting, a loss log every step, no progress bar).

    ``logging_nan_inf_filter`` stays at its default, as in the user's run: its per-micro-batch
    ``isnan``/``isinf`` check is a host sync that the user's run pays, so the probe pays it too.
    It replaces a non-finite loss in the logs, so divergence is detected from ``training_step``'s
    losses instead (``ProbeCallback.count_non_finite``).
    """
    from transformers import TrainingArguments

    return TrainingArguments(**probe_fields(spec, output_dir, max_steps, cuda), **spec.params.training_arguments_kwargs())


def probe_fields(spec: ProbeSpec, output_dir: str, max_steps: int, cuda: bool) -> dict[str, Any]:
    """The fields every probe sets whatever the trial (see :func:`probe_training_arguments`)."""
    return {"output_dir": output_dir, "max_steps": max_steps, "use_cpu": not cuda, "seed": spec.seed, "save_strategy": "no",
            "report_to": "none", "logging_strategy": "steps", "logging_steps": 1, "disable_tqdm": True}


def applied_arguments(args: Any, params: Any) -> dict[str, Any]:
    """The trial's TrainingArguments fields as the Trainer holds them (JSON values), read back after it
    was built: what the probe ran with, e.g. ``dataloader_pin_memory`` False on the CPU, where
    transformers turns it off, or a field a user's Trainer factory changed."""
    applied = {}
    for name in params.training_arguments_kwargs():
        value = getattr(args, name, None)
        applied[name] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
    return applied


def _make_dataset(spec: ProbeSpec, vocab_size: int, length: int) -> Any:
    if spec.dataset is None:
        return SyntheticTokens(
            vocab_size=vocab_size, seq_len=spec.seq_len, length=length, seed=spec.seed, delay_s=spec.synthetic_sample_delay_s
        )
    from autotune.data import DatasetSpec, TextDataset

    return TextDataset(DatasetSpec.from_dict(spec.dataset), seq_len=spec.seq_len, length=length)


def run_probe(spec: ProbeSpec) -> ProbeResult:
    """Run one probe in this process and return what it measured (never raises for a failed trial)."""
    start_s = time.perf_counter()
    callback = None
    device_name = None
    model_build_s = None
    flops_per_token = None
    baseline: CudaBaseline | None = None
    matmul_precision: str | None = None
    counts = None
    user = None  # a user's Trainer (spec.trainer): autotune.probe.user_trainer.ProbedTrainer
    try:
        import torch
        from transformers import PrinterCallback, ProgressCallback
        from transformers.utils import logging as hf_logging

        from autotune.models import ModelSpec

        hf_logging.set_verbosity_error()
        cuda = spec.device.startswith("cuda")
        if cuda:
            baseline = _init_cuda(spec)
            device_name = torch.cuda.get_device_name(0)
        params = spec.params
        torch.manual_seed(spec.seed)
        if spec.trainer is None:
            model, counts, model_build_s, flops_per_token = _build_model(spec, cuda)
        callback = _make_callback(spec, cuda)
        total_steps = spec.warmup_steps + callback.step_budget
        with tempfile.TemporaryDirectory(prefix="autotune-probe-out-", dir=_env_folder("AUTOTUNE_PROBE_SCRATCH")) as output_dir:
            # A make_trainer(argv) factory builds its own config class from flags (autotune.probe.user_trainer.factory_argv).
            args = probe_training_arguments(spec, output_dir, total_steps, cuda) if spec.trainer_args is None else None
            if spec.trainer is not None:  # the user's own model, data and Trainer, from their factory
                from autotune.probe.user_trainer import build_trainer

                user = build_trainer(spec, args, cuda) if args is not None else \
                    build_trainer(spec, None, cuda, probe=probe_fields(spec, output_dir, total_steps, cuda))
                trainer, counts, model_build_s = user.trainer, user.counts, user.build_s
                trainer.__class__ = _timed_trainer(callback, type(trainer))  # timed as a built-in model's Trainer is
                trainer.add_callback(callback)
                trainer.remove_callback(ProgressCallback)
            else:
                dataset = _make_dataset(spec, ModelSpec.from_dict(spec.model).vocab_size, total_steps * params.effective_batch_size)
                trainer = _timed_trainer(callback)(model=model, args=args, train_dataset=dataset, callbacks=[callback])
            trainer.remove_callback(PrinterCallback)  # no printing per step inside the measured window
            # After the Trainer is built (TrainingArguments and accelerate have set TF32 their way), before it trains.
            matmul_precision = apply_matmul_precision(params.precision, cuda)
            applied = applied_arguments(trainer.args, params)
            trainer.train()
        if user is not None:  # FLOPs of the real model at the mean real sequence length of the measured batches
            counted = callback.measured_batches()
            flops_per_token = user.flops_per_token(_matmul_params(trainer.model), _matmul_params(trainer.model, trainable_only=True),
                                                   counted[1] / counted[0] if counted and counted[0] else None)
    except BaseException as exc:
        from autotune.probe.device import is_out_of_memory

        if isinstance(exc, KeyboardInterrupt):
            raise
        if callback is not None:
            callback.stop_sampler()
        status = ProbeStatus.OOM if is_out_of_memory(exc, cuda=spec.device.startswith("cuda")) else ProbeStatus.CRASH
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        error = message if status is ProbeStatus.OOM else traceback.format_exc()[-_ERROR_TAIL_CHARS:]
        return ProbeResult(
            status=status,
            error=f"{type(exc).__name__}: {message}" if status is ProbeStatus.OOM else error,
            losses=tuple(callback.losses) if callback else (),
            device_name=device_name,
            setup_s=(callback.train_begin_s - start_s) if callback and callback.train_begin_s else None,
            model_build_s=model_build_s,
            model_flops_per_token=flops_per_token,
            matmul_precision=matmul_precision,
            **_parameter_fields(counts),
            **_memory_fields(spec, callback, baseline),
        )
    result = _summarise(spec, callback, start_s, device_name, model_build_s, flops_per_token, baseline, matmul_precision)
    result = result.replace(extra={**result.extra, "training_arguments": applied})
    if user is not None:
        result = result.replace(extra={**result.extra, **user.extra()})
    return result.replace(**_parameter_fields(counts))


def _build_model(spec: ProbeSpec, cuda: bool) -> tuple[Any, Any, float, float]:
    """The built-in path's model, from its config on the device (in LoRA adapters with ``spec.peft``):
    (model, its parameter counts, seconds to build it, model FLOPs per token)."""
    import torch

    from autotune.lora import LoraSettings, count_model_parameters
    from autotune.models import ModelSpec, build_model

    params = spec.params
    model_spec = ModelSpec.from_dict(spec.model)
    lora = LoraSettings.from_dict(spec.peft) if spec.peft else None
    build_start_s = time.perf_counter()
    if lora is not None and lora.quantized:
        model = _build_4bit_model(model_spec, params, spec)
    else:
        model = build_model(model_spec, attn_implementation=params.attn_implementation, device="cuda" if cuda else "cpu")
    if lora is not None:
        model = _wrap_in_adapters(model, lora, params.gradient_checkpointing)
    counts = count_model_parameters(model)
    if cuda:
        torch.cuda.synchronize()
    model_build_s = time.perf_counter() - build_start_s
    matmul_params = _matmul_params(model)
    flops_per_token = model_flops_per_token(
        matmul_params, model_spec.num_layers, model_spec.num_attention_heads, model_spec.head_dim, spec.seq_len,
        frozen_params=matmul_params - _matmul_params(model, trainable_only=True),
    )
    return model, counts, model_build_s, flops_per_token


def _parameter_fields(counts: Any) -> dict[str, int | None]:
    """The result's parameter counts (an :class:`autotune.lora.ParameterCounts`, or None before the model was built)."""
    if counts is None:
        return {}
    return {"parameters_total": counts.total, "parameters_trainable": counts.trainable, "parameters_frozen": counts.frozen}


def _wrap_in_adapters(model: Any, lora: Any, gradient_checkpointing: bool) -> Any:
    """The model in its LoRA adapters (base weights frozen).

    With activation checkpointing the embeddings' output is made to require grad
    (``enable_input_require_grads``, as peft's ``prepare_model_for_kbit_training`` does): under
    reentrant checkpointing (transformers' default before 5.x) a checkpointed layer whose inputs and
    weights are all frozen gets no backward at all, so its adapters would never be trained; with
    transformers 5's non-reentrant default it costs one small extra gradient.
    """
    from autotune.lora import apply_lora

    wrapped = apply_lora(model, lora)
    if gradient_checkpointing:
        wrapped.enable_input_require_grads()
    return wrapped


def _build_4bit_model(model_spec: Any, params: Any, spec: ProbeSpec) -> Any:
    """QLoRA's base: the model with random weights loaded in 4 bits (NF4, double quantization) by
    bitsandbytes on the GPU, prepared for k-bit training (norms and the head upcast to fp32).

    transformers quantizes while loading a checkpoint, never in ``from_config``: the random-weight
    model is saved once per run (bf16, in the driver's run cache, :func:`qlora_base_checkpoint`) and
    each probe loads it with the quantization config.
    """
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision_dtype(params.precision) or "", torch.float32)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=compute)
    with qlora_base_checkpoint(model_spec) as folder:
        load_start_s = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=torch.bfloat16,
                                                     device_map={"": 0}, attn_implementation=params.attn_implementation)
        print(f"autotune: QLoRA base loaded in 4 bits in {time.perf_counter() - load_start_s:.1f}s", file=sys.stderr)
    model.config.use_cache = False
    # Checkpointing is the Trainer's to enable, as for every trial; _wrap_in_adapters makes inputs require grad.
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _env_folder(name: str) -> str | None:
    """The folder the parent names in ``$name`` (isolation.SCRATCH_ENV: this probe's scratch;
    isolation.RUN_CACHE_ENV: what the run's probes share), or None when unset or gone."""
    folder = os.environ.get(name)
    return folder if folder and os.path.isdir(folder) else None


@contextmanager
def qlora_base_checkpoint(model_spec: Any) -> Iterator[Path]:
    """A folder holding ``model_spec`` with random weights saved in bf16, for a 4-bit load.

    Inside a run (``$AUTOTUNE_RUN_CACHE``, :func:`autotune.probe.isolation.run_cache_dir`) it is
    written by the first probe that needs it and read by the others (a 1.3B model: 2.6 GB written
    once instead of per probe); it appears under its final name in one rename, so a probe killed while
    writing leaves no half checkpoint behind for the next. Outside a run, a temporary folder.
    """
    import hashlib
    import json
    import shutil

    import torch

    from autotune.models import build_model

    def save(folder: str) -> None:
        save_start_s = time.perf_counter()
        build_model(model_spec, attn_implementation=None, device="cpu", dtype=torch.bfloat16).save_pretrained(folder)
        print(f"autotune: QLoRA base built and saved in {time.perf_counter() - save_start_s:.1f}s", file=sys.stderr)

    cache = _env_folder("AUTOTUNE_RUN_CACHE")
    if cache is None:
        with tempfile.TemporaryDirectory(prefix="autotune-qlora-base-", dir=_env_folder("AUTOTUNE_PROBE_SCRATCH")) as folder:
            save(folder)
            yield Path(folder)
        return
    key = hashlib.sha256(json.dumps(model_spec.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]
    final = Path(cache) / f"qlora-base-{key}"
    if not final.is_dir():
        partial = Path(tempfile.mkdtemp(prefix=f"{final.name}.partial-", dir=cache))
        try:
            save(str(partial))
            os.replace(partial, final)  # another probe may have won the race: then its copy is used
        except OSError:
            if not final.is_dir():
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    yield final


def _memory_fields(spec: ProbeSpec, callback: Any, baseline: CudaBaseline | None) -> dict[str, Any]:
    import torch

    from autotune.probe.device import cpu_peak_rss_bytes

    if spec.device.startswith("cuda") and torch.cuda.is_initialized():
        reserved = int(torch.cuda.max_memory_reserved())
        device_used = callback.peak_device_used_bytes if callback else None
        sampled = callback.telemetry.mem_used_peak_bytes if callback else None
        if sampled is not None:
            device_used = max(sampled, device_used or 0)
        used_before = baseline.used_before_cuda_bytes if baseline else None
        outside = baseline.non_allocator_bytes if baseline else None
        retries = torch.cuda.memory_stats().get("num_alloc_retries")
        return {
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": reserved,
            "peak_device_used_bytes": device_used,
            "non_allocator_bytes": outside,
            "num_alloc_retries": int(retries) if retries is not None else None,
            # The ceiling is checked against what runs out: the whole device, context included.
            "peak_mem_bytes": reported_peak_bytes(device_used, used_before, outside, reserved),
        }
    return {"peak_mem_bytes": cpu_peak_rss_bytes()}


def _summarise(
    spec: ProbeSpec, callback: Any, start_s: float, device_name: str | None, model_build_s: float | None,
    flops_per_token: float | None, baseline: CudaBaseline | None, matmul_precision: str | None,
) -> ProbeResult:
    memory = _memory_fields(spec, callback, baseline)
    setup_s = callback.train_begin_s - start_s if callback.train_begin_s else None
    common: dict[str, Any] = {
        "losses": tuple(callback.losses),
        "setup_s": setup_s,
        "model_build_s": model_build_s,
        "model_flops_per_token": flops_per_token,
        "device_name": device_name,
        "matmul_precision": matmul_precision,
        **memory,
    }
    if callback.diverged:
        if callback.diverged_at_step is not None:
            error = f"non-finite loss at step {callback.diverged_at_step}"
        else:
            error = f"non-finite loss at step {len(callback.losses)}: {callback.losses[-1]}"
        return ProbeResult(status=ProbeStatus.DIVERGED, error=error, **common)
    step_times = callback.step_times_s()
    if len(step_times) < spec.measure_steps:
        return ProbeResult(status=ProbeStatus.CRASH, error=f"training stopped after {len(callback.step_end_s)} steps", **common)
    window_s = sum(step_times)
    step_time_s = window_s / len(step_times)
    samples_per_step = spec.params.effective_batch_size
    samples_per_s = samples_per_step / step_time_s
    tokens_per_s = samples_per_s * spec.seq_len
    counted = callback.measured_batches()
    extra: dict[str, Any] = {}
    if counted is not None and counted[0] > 0:  # a user's Trainer: its real batches, padding not counted as tokens
        samples_per_step = round(counted[0] / len(step_times))
        samples_per_s, tokens_per_s = counted[0] / window_s, counted[1] / window_s
        if spec.objective_tokens_per_sample:  # ranked by tokens: sequences of the data's mean length per second
            extra["sequences_per_s_counted"] = samples_per_s
            samples_per_s = tokens_per_s / spec.objective_tokens_per_sample
    wait_fraction = min(callback.measured_fetch_s() / window_s, 1.0) if window_s > 0 else None
    telemetry = telemetry_fields(callback.telemetry, samples_per_step * len(step_times), min_telemetry_window_s())
    return ProbeResult(
        status=ProbeStatus.OK,
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        step_time_s=step_time_s,
        measured_steps=len(step_times),
        step_time_ci95_rel=_finite_or_none(ci95_rel(step_times)),
        stable=callback.rule.is_stable(step_times, callback.reference_step_s()),
        warmup_s=(callback.step_end_s[spec.warmup_steps - 1] - callback.train_begin_s) if spec.warmup_steps else 0.0,
        achieved_tflops=achieved_tflops(flops_per_token, tokens_per_s) if flops_per_token else None,
        mfu=mfu(flops_per_token, tokens_per_s, device_name, spec.params.precision, matmul_precision) if flops_per_token else None,
        **telemetry,
        input_wait_fraction=wait_fraction,
        input_bound=bool(wait_fraction is not None and wait_fraction > INPUT_BOUND_FRACTION),
        extra={"step_times_s": step_times, "torch_threads": _torch_threads(), **_compile_counts(spec, callback), **extra},
        **common,
    )


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m autotune.probe SPEC.json RESULT.json", file=sys.stderr)
        return 2
    if sys.platform.startswith("linux"):
        # DataLoader workers fork from the probe, Linux's default. A probe forked from the probe server
        # would otherwise inherit the server's start method (forkserver), whose named semaphores are
        # registered with the run's resource tracker: a probe killed at its deadline leaked them, and the
        # run ended with "There appear to be 14 leaked semaphore objects" warnings.
        import multiprocessing

        multiprocessing.set_start_method("fork", force=True)
    spec = ProbeSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    result = run_probe(spec)
    Path(argv[1]).write_text(__import__("json").dumps(result.to_dict()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
