"""Plain ``transformers.Trainer`` runs for the side-by-side of the GPU acceptance run, outside autotune's probe.

Two requests, each in a process of its own (forked from autotune's probe server, or
``python -m bench.gpu_trainer REQUEST.json RESULT.json``):

* ``auto_find``: what a user of ``auto_find_batch_size=True`` gets. A plain ``Trainer`` with
  ``per_device_train_batch_size=start_batch`` and every other argument at its default trains a few
  steps; accelerate's ``find_executable_batch_size`` shrinks the batch after each out-of-memory error.
  A callback records every batch it started training with (``TrainerState.train_batch_size`` at each
  ``on_train_begin``) and the steps the last one ran; the allocator is capped under the run's memory
  ceiling exactly as autotune's probes cap it, so this row and the others share one ceiling.
* ``timed``: a configuration trained by a plain ``Trainer`` with the ``TrainingArguments`` autotune
  exports for it (``training_arguments``), a model built from its config and random tokens, and none of
  autotune's code; a callback synchronises the device at the end of every optimizer step and the
  measured window is every step after the warm-up. This is the independent check of a probe's samples/s.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_NON_MODEL_KEYS = ("model_type", "transformers_version", "_name_or_path", "_commit_hash")


def _model(config_dict: dict[str, Any], device: str, attn_implementation: str | None) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(config_dict["model_type"], **{k: v for k, v in config_dict.items() if k not in _NON_MODEL_KEYS})
    config.use_cache = False
    # Built on the device (as from_pretrained(device_map=...) would place it) so a 1B model does
    # not spend its time in a CPU initialisation that says nothing about training. In float32, the
    # master-weight dtype mixed precision expects, as autotune's probe builds it: from transformers 5
    # from_config takes the config's saved dtype (float16 for polyglot-ko), and a model in float16
    # trains in pure half precision, faster, smaller and diverging (seen on an H100, 2026-11-27).
    with torch.device("cuda" if device.startswith("cuda") else "cpu"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)


class RandomTokens:
    """``length`` sequences of ``seq_len`` random token ids, labels = inputs (causal LM)."""

    def __init__(self, vocab_size: int, seq_len: int, length: int, seed: int = 0) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (length, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _arguments(request: dict[str, Any], output_dir: str, max_steps: int, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, max_steps=max_steps, use_cpu=not request["device"].startswith("cuda"), seed=request.get("seed", 0),
        save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True, **kwargs,
    )


def _cap_under_ceiling(request: dict[str, Any]) -> None:
    """The allocator capped as autotune's probe caps it (its CUDA set-up, the same arithmetic)."""
    ceiling = request.get("memory_ceiling_bytes")
    if ceiling is None or not request["device"].startswith("cuda"):
        return
    from autotune.params import TrialParams
    from autotune.probe.child import _init_cuda
    from autotune.records import ProbeSpec

    _init_cuda(ProbeSpec(model=request["model"], params=TrialParams(), seq_len=request["seq_len"], device=request["device"],
                         memory_ceiling_bytes=int(ceiling)))


def auto_find(request: dict[str, Any]) -> dict[str, Any]:
    """Train ``steps`` steps with ``auto_find_batch_size=True`` from ``start_batch``: every batch tried, the one it settled on."""
    import torch
    from transformers import Trainer, TrainerCallback

    start, steps = int(request.get("start_batch", 64)), int(request.get("steps", 3))
    cuda = request["device"].startswith("cuda")
    _cap_under_ceiling(request)
    tried: list[int] = []
    steps_run: list[int] = []

    class Attempts(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            tried.append(int(state.train_batch_size))
            steps_run.append(0)
            print(f"auto_find: training starts at batch {state.train_batch_size}", file=sys.stderr, flush=True)

        def on_step_end(self, args, state, control, **kwargs):
            steps_run[-1] += 1

    config = request["model"]["config"]
    model = _model(config, request["device"], attn_implementation=None)  # transformers' default kernel
    with tempfile.TemporaryDirectory(prefix="autotune-auto-find-") as output_dir:
        args = _arguments(request, output_dir, steps, per_device_train_batch_size=start, auto_find_batch_size=True)
        dataset = RandomTokens(int(config["vocab_size"]), int(request["seq_len"]), steps * start * 2, request.get("seed", 0))
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Attempts()])
        started = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - started
    return {
        "status": "ok", "batch_size": int(trainer._train_batch_size), "tried_batches": tried, "steps_run": steps_run[-1] if steps_run else 0,
        "start_batch": start, "steps": steps, "train_s": train_s,
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()) if cuda else None,
    }


def timed(request: dict[str, Any]) -> dict[str, Any]:
    """Train ``warmup_steps + measure_steps`` optimizer steps with the request's ``TrainingArguments``; time the last ``measure_steps``."""
    import torch
    from transformers import Trainer, TrainerCallback

    warmup, measure = int(request["warmup_steps"]), int(request["measure_steps"])
    effective_batch = int(request["effective_batch_size"])
    cuda = request["device"].startswith("cuda")
    marks: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    config = request["config"]
    model = _model(config, request["device"], attn_implementation=request.get("attn_implementation"))
    with tempfile.TemporaryDirectory(prefix="autotune-timed-") as output_dir:
        args = _arguments(request, output_dir, warmup + measure, **request["training_arguments"])
        dataset = RandomTokens(int(config["vocab_size"]), int(request["seq_len"]), (warmup + measure) * effective_batch, request.get("seed", 0))
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[StepClock()])
        trainer.train()
    window = marks[warmup - 1 :] if warmup else marks
    if len(window) < 2:
        return {"status": "crash", "error": f"only {len(marks)} steps ran"}
    window_s = window[-1] - window[0]
    steps = len(window) - 1
    samples_per_s = effective_batch * steps / window_s
    return {
        "status": "ok", "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * request["seq_len"],
        "warmup_steps": warmup, "measured_steps": steps, "window_s": window_s,
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()) if cuda else None,
    }


def _is_out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one request; an exception is a result (``oom`` or ``crash``), never raised."""
    try:
        return {"auto_find": auto_find, "timed": timed}[request["mode"]](request)
    except Exception as exc:  # noqa: BLE001 - the parent reads every failure as data
        import traceback

        traceback.print_exc()
        return {"status": "oom" if _is_out_of_memory(exc) else "crash", "error": f"{type(exc).__name__}: {str(exc)[:500]}"}


def forked_main(request_path: str, result_path: str, log_path: str, env: dict[str, str]) -> None:
    """Entry point in a child forked from autotune's probe server: own session, output to a file."""
    from autotune.probe.isolation import enter_probe_process

    enter_probe_process(log_path, env)
    main([request_path, result_path])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m bench.gpu_trainer REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()
    result = run(json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    Path(argv[1]).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
