"""The probe: one short, real training run, inside a fresh child process.

Run by :mod:`autotune.probe.isolation` as ``python -m autotune.probe.child SPEC.json RESULT.json``. It builds
the model from its config directly on the device (:mod:`autotune.probe.model`), wraps it in the real ``transformers.Trainer``
with exactly the candidate ``TrainingArguments``, runs ``warmup_steps`` optimizer steps, then
measures steps until the mean step time is stable (:mod:`autotune.probe.steady`) or a cap is reached,
on synthetic token batches or a real dataset (:mod:`autotune.data`), and writes a
:class:`~autotune.records.ProbeResult` as JSON (:mod:`autotune.probe.summary`).

What is timed is what the user will get: data loading, forward, backward, optimizer step and the
Trainer's own bookkeeping. Every optimizer step ends with the device synchronised, so each step
time is the device's, not the host's view of queued work. Alongside: time spent waiting for the
next batch (``get_batch_samples``), NVML telemetry over the measured window
(:class:`autotune.probe.telemetry.NvmlSampler`), and model FLOPs (:mod:`autotune.probe.flops`). Nothing is saved
or logged to disk inside the probe.

The trial's fp32 matmul precision is set explicitly just before training (:func:`apply_matmul_precision`),
whatever transformers and accelerate turned on while the Trainer was built, and read back into the
result, which takes the MFU peak from it. On CUDA the memory reported against the ceiling counts what
the process uses outside the caching allocator (:mod:`autotune.probe.memory`), and the allocator's cap
leaves room for it.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.params import fp32_matmul_setting, mixed_precision_dtype
from autotune.probe.memory import CudaBaseline, allocator_cap_bytes, memory_fields, non_allocator_bytes
from autotune.probe.model import build_probe_model, env_folder, matmul_params
from autotune.probe.ranks import FAILED_RANK_EXIT_CODE, agree, local_rank, rank_result_path, this_rank
from autotune.probe.steady import StopRule
from autotune.probe.summary import min_telemetry_window_s, parameter_fields, summarise
from autotune.records import ProbeResult, ProbeSpec, ProbeStatus
from autotune.sharding import deepspeed_collectives_on_gloo
from autotune.sharding import parse as parse_sharding

_ERROR_TAIL_CHARS = 2000
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

    def __init__(self, vocab_size: int, seq_len: int, length: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.length, self.seed = vocab_size, seq_len, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

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


def _init_cuda(spec: ProbeSpec) -> CudaBaseline:
    """Create the context, measure what it takes outside the allocator, cap the allocator under the ceiling."""
    import torch

    from autotune.probe.telemetry import nvml_used_bytes

    used_before = nvml_used_bytes()  # before this process has a context
    torch.cuda.set_device(local_rank())  # a rank of a multi-process probe: its own GPU of the probe's
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
        total = torch.cuda.get_device_properties(local_rank()).total_memory
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
            stop = len(self.step_end_s) > spec.warmup_steps and self.rule.should_stop(self.step_times_s(), self.reference_step_s())
            if spec.nproc > 1:  # every rank stops at the same step, or one waits for the others' gradients forever
                stop = agree(stop or bool(control.should_training_stop))
            if stop:
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
        return SyntheticTokens(vocab_size=vocab_size, seq_len=spec.seq_len, length=length, seed=spec.seed)
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
        if not cuda and parse_sharding(params.sharding).engine == "deepspeed":
            deepspeed_collectives_on_gloo()
        torch.manual_seed(spec.seed)
        if spec.trainer is None:
            model, counts, model_build_s, flops_per_token = build_probe_model(spec, cuda)
        callback = _make_callback(spec, cuda)
        total_steps = spec.warmup_steps + callback.step_budget
        with tempfile.TemporaryDirectory(prefix="autotune-probe-out-", dir=env_folder("AUTOTUNE_PROBE_SCRATCH")) as output_dir:
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
                dataset = _make_dataset(spec, ModelSpec.from_dict(spec.model).vocab_size, total_steps * params.effective_batch_size * spec.nproc)
                trainer = _timed_trainer(callback)(model=model, args=args, train_dataset=dataset, callbacks=[callback])
            trainer.remove_callback(PrinterCallback)  # no printing per step inside the measured window
            # After the Trainer is built (TrainingArguments and accelerate have set TF32 their way), before it trains.
            matmul_precision = apply_matmul_precision(params.precision, cuda)
            applied = applied_arguments(trainer.args, params)
            trainer.train()
        if user is not None:  # FLOPs of the real model at the mean real sequence length of the measured batches
            counted = callback.measured_batches()
            flops_per_token = user.flops_per_token(matmul_params(trainer.model), matmul_params(trainer.model, trainable_only=True),
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
            **parameter_fields(counts),
            **memory_fields(spec, callback, baseline),
        )
    result = summarise(spec, callback, start_s, device_name, model_build_s, flops_per_token, baseline, matmul_precision)
    result = result.replace(extra={**result.extra, "training_arguments": applied})
    if user is not None:
        result = result.replace(extra={**result.extra, **user.extra()})
    return result.replace(**parameter_fields(counts))


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
    rank, world = this_rank()
    result_path = rank_result_path(argv[1], rank) if world > 1 else Path(argv[1])
    result_path.write_text(__import__("json").dumps(result.to_dict()), encoding="utf-8")
    if world > 1 and result.status is not ProbeStatus.OK:
        # The other ranks wait in a collective for this one: leave at once with a failure, so torchrun ends them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAILED_RANK_EXIT_CODE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
