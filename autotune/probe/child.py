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

Outcomes are data: an OOM (by type, see :func:`autotune.probe.device.is_out_of_memory`) is ``oom``, a
NaN/inf loss is ``diverged``, any other exception is ``crash`` with its traceback tail.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from autotune.probe.flops import achieved_tflops, mfu, model_flops_per_token
from autotune.probe.steady import StopRule, ci95_rel
from autotune.records import ProbeResult, ProbeSpec, ProbeStatus

_ERROR_TAIL_CHARS = 2000
# A trial that waits for its batches more than this share of the measured window is input-bound:
# a faster input pipeline (more dataloader workers) would make it faster.
INPUT_BOUND_FRACTION = 0.2


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


def stop_rule(spec: ProbeSpec) -> StopRule:
    """The spec's stopping rule; without ``max_measure_steps`` exactly ``measure_steps`` are measured."""
    max_steps = spec.max_measure_steps if spec.max_measure_steps is not None else spec.measure_steps
    return StopRule(
        min_steps=spec.measure_steps,
        max_steps=max(max_steps, spec.measure_steps),
        max_s=spec.max_measure_s,
        target_rel=spec.target_ci_rel,
    )


def _make_callback(spec: ProbeSpec, cuda: bool) -> Any:
    import torch
    from transformers import TrainerCallback

    from autotune.probe.device import cpu_peak_rss_bytes
    from autotune.probe.telemetry import NvmlSampler, Telemetry, nvml_used_bytes

    rule = stop_rule(spec)

    class ProbeCallback(TrainerCallback):
        """Timestamps optimizer steps with the device synchronised; stops once the mean is stable;
        watches loss, memory and (over the measured window) NVML telemetry."""

        def __init__(self) -> None:
            self.train_begin_s: float | None = None
            self.step_end_s: list[float] = []
            self.fetch_s: list[float] = []  # per optimizer step: host time blocked fetching its batches
            self.losses: list[float] = []
            self.diverged = False
            self.peak_device_used_bytes: int | None = None
            self.graphs_at_step: list[int] = []  # torch.compile graphs compiled so far, at each step's end
            self.sampler = NvmlSampler() if cuda else None
            self.telemetry = Telemetry(samples=0)

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

        def _check_memory(self) -> None:
            if cuda:
                used = nvml_used_bytes()
                if used is not None:
                    self.peak_device_used_bytes = max(used, self.peak_device_used_bytes or 0)
            elif spec.memory_ceiling_bytes is not None and cpu_peak_rss_bytes() > spec.memory_ceiling_bytes:
                raise SimulatedOutOfMemory(
                    f"peak RSS {cpu_peak_rss_bytes()} B passed the simulated ceiling {spec.memory_ceiling_bytes} B"
                )

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin_s = time.perf_counter()
            if spec.warmup_steps == 0 and self.sampler is not None:
                self.sampler.start()

        def on_substep_end(self, args, state, control, **kwargs):
            self._check_memory()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.step_end_s.append(time.perf_counter())
            self.graphs_at_step.append(compiled_graphs())
            self._check_memory()
            if len(self.step_end_s) == spec.warmup_steps and self.sampler is not None:
                self.sampler.start()
            if len(self.step_end_s) > spec.warmup_steps and rule.should_stop(self.step_times_s()):
                control.should_training_stop = True

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


def _limit_cuda_memory(ceiling_bytes: int) -> None:
    """Make the allocator OOM at the ceiling, counting what is already used outside it (context)."""
    import torch

    from autotune.probe.telemetry import nvml_used_bytes

    torch.zeros(1, device="cuda")  # create the context so NVML sees its footprint
    total = torch.cuda.get_device_properties(0).total_memory
    used = nvml_used_bytes() or int(torch.cuda.memory_reserved())
    budget = max(ceiling_bytes - used, 0)
    torch.cuda.set_per_process_memory_fraction(min(budget / total, 1.0))


def _matmul_params(model: Any) -> int:
    """N of the FLOPs formula: every parameter except input embedding tables; a tied output
    projection is counted (it is a real matmul), once."""
    import torch

    params = {id(p): p.numel() for p in model.parameters()}
    embeddings = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and id(output.weight) in embeddings:
        del embeddings[id(output.weight)]
    return sum(params.values()) - sum(n for key, n in embeddings.items() if key in params)


def _timed_trainer(callback: Any) -> Any:
    """A Trainer that records how long the training loop blocks on ``next()`` for each step's batches."""
    from transformers import Trainer

    class TimedTrainer(Trainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            start_s = time.perf_counter()
            try:
                return super().get_batch_samples(epoch_iterator, num_batches, device)
            finally:
                callback.fetch_s.append(time.perf_counter() - start_s)

    return TimedTrainer


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
    try:
        import torch
        from transformers import PrinterCallback, TrainingArguments
        from transformers.utils import logging as hf_logging

        from autotune.models import ModelSpec, build_model

        hf_logging.set_verbosity_error()
        cuda = spec.device.startswith("cuda")
        if cuda:
            device_name = torch.cuda.get_device_name(0)
            if spec.memory_ceiling_bytes is not None:
                _limit_cuda_memory(spec.memory_ceiling_bytes)
            torch.cuda.reset_peak_memory_stats()
        params = spec.params
        torch.manual_seed(spec.seed)
        model_spec = ModelSpec.from_dict(spec.model)
        build_start_s = time.perf_counter()
        model = build_model(model_spec, attn_implementation=params.attn_implementation, device="cuda" if cuda else "cpu")
        if cuda:
            torch.cuda.synchronize()
        model_build_s = time.perf_counter() - build_start_s
        head_dim = int(model_spec.config.get("head_dim") or model_spec.hidden_size // model_spec.num_attention_heads)
        flops_per_token = model_flops_per_token(
            _matmul_params(model), model_spec.num_layers, model_spec.num_attention_heads, head_dim, spec.seq_len
        )
        rule = stop_rule(spec)
        total_steps = spec.warmup_steps + rule.max_steps
        dataset = _make_dataset(spec, model_spec.vocab_size, total_steps * params.effective_batch_size)
        callback = _make_callback(spec, cuda)
        with tempfile.TemporaryDirectory(prefix="autotune-probe-out-") as output_dir:
            args = TrainingArguments(
                output_dir=output_dir,
                max_steps=total_steps,
                use_cpu=not cuda,
                seed=spec.seed,
                save_strategy="no",
                report_to="none",
                logging_strategy="steps",
                logging_steps=1,
                logging_nan_inf_filter=False,  # a NaN loss must reach us, not be filtered
                disable_tqdm=True,
                **params.training_arguments_kwargs(),
            )
            trainer = _timed_trainer(callback)(model=model, args=args, train_dataset=dataset, callbacks=[callback])
            trainer.remove_callback(PrinterCallback)  # no printing per step inside the measured window
            trainer.train()
    except BaseException as exc:
        from autotune.probe.device import is_out_of_memory

        if isinstance(exc, KeyboardInterrupt):
            raise
        if callback is not None:
            callback.stop_sampler()
        status = ProbeStatus.OOM if is_out_of_memory(exc) else ProbeStatus.CRASH
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
            **_memory_fields(spec, callback),
        )
    return _summarise(spec, callback, start_s, device_name, model_build_s, flops_per_token)


def _memory_fields(spec: ProbeSpec, callback: Any) -> dict[str, Any]:
    import torch

    from autotune.probe.device import cpu_peak_rss_bytes

    if spec.device.startswith("cuda") and torch.cuda.is_initialized():
        reserved = int(torch.cuda.max_memory_reserved())
        device_used = callback.peak_device_used_bytes if callback else None
        sampled = callback.telemetry.mem_used_peak_bytes if callback else None
        if sampled is not None:
            device_used = max(sampled, device_used or 0)
        return {
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": reserved,
            "peak_device_used_bytes": device_used,
            # The ceiling is checked against what runs out: the whole device, context included.
            "peak_mem_bytes": device_used if device_used is not None else reserved,
        }
    return {"peak_mem_bytes": cpu_peak_rss_bytes()}


def _summarise(
    spec: ProbeSpec, callback: Any, start_s: float, device_name: str | None, model_build_s: float | None,
    flops_per_token: float | None,
) -> ProbeResult:
    memory = _memory_fields(spec, callback)
    setup_s = callback.train_begin_s - start_s if callback.train_begin_s else None
    common: dict[str, Any] = {
        "losses": tuple(callback.losses),
        "setup_s": setup_s,
        "model_build_s": model_build_s,
        "model_flops_per_token": flops_per_token,
        "device_name": device_name,
        **memory,
    }
    if callback.diverged:
        return ProbeResult(
            status=ProbeStatus.DIVERGED, error=f"non-finite loss at step {len(callback.losses)}: {callback.losses[-1]}", **common
        )
    step_times = callback.step_times_s()
    if len(step_times) < spec.measure_steps:
        return ProbeResult(status=ProbeStatus.CRASH, error=f"training stopped after {len(callback.step_end_s)} steps", **common)
    window_s = sum(step_times)
    step_time_s = window_s / len(step_times)
    samples_per_step = spec.params.effective_batch_size
    samples_per_s = samples_per_step / step_time_s
    tokens_per_s = samples_per_s * spec.seq_len
    rule = stop_rule(spec)
    wait_fraction = min(callback.measured_fetch_s() / window_s, 1.0) if window_s > 0 else None
    telemetry = callback.telemetry
    energy = telemetry.power_mean_w * window_s / (samples_per_step * len(step_times)) if telemetry.power_mean_w else None
    return ProbeResult(
        status=ProbeStatus.OK,
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        step_time_s=step_time_s,
        measured_steps=len(step_times),
        step_time_ci95_rel=_finite_or_none(ci95_rel(step_times)),
        stable=rule.is_stable(step_times),
        warmup_s=(callback.step_end_s[spec.warmup_steps - 1] - callback.train_begin_s) if spec.warmup_steps else 0.0,
        achieved_tflops=achieved_tflops(flops_per_token, tokens_per_s) if flops_per_token else None,
        mfu=mfu(flops_per_token, tokens_per_s, device_name, spec.params.precision) if flops_per_token else None,
        gpu_util_mean_pct=telemetry.gpu_util_mean_pct,
        gpu_util_peak_pct=telemetry.gpu_util_peak_pct,
        power_mean_w=telemetry.power_mean_w,
        sm_clock_mean_mhz=telemetry.sm_clock_mean_mhz,
        energy_per_sample_j=energy,
        input_wait_fraction=wait_fraction,
        input_bound=bool(wait_fraction is not None and wait_fraction > INPUT_BOUND_FRACTION),
        extra={"step_times_s": step_times, "torch_threads": _torch_threads(), **_compile_counts(spec, callback)},
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
        print("usage: python -m autotune.probe.child SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = ProbeSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    result = run_probe(spec)
    Path(argv[1]).write_text(__import__("json").dumps(result.to_dict()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
