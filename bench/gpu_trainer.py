"""Plain ``transformers.Trainer`` runs for the side-by-side of the GPU acceptance run, outside autotune's probe.

Two requests, each in a process of its own (forked from autotune's probe server, or
``python -m bench.gpu_trainer REQUEST.json RESULT.json``):

* ``auto_find``: what a user of ``auto_find_batch_size=True`` gets. A plain ``Trainer`` with
  ``per_device_train_batch_size=64`` and every other argument at its default trains a few steps;
  accelerate's ``find_executable_batch_size`` shrinks the batch after each out-of-memory error, and
  the batch it settled on is read back from ``trainer._train_batch_size``.
* ``timed``: a configuration (``TrialParams``) trained by a plain ``Trainer`` with exactly its
  ``TrainingArguments``; a callback synchronises the device at the end of every optimizer step and
  the measured window is every step after the warm-up. This is the independent check of a probe's
  samples/s: same arguments, same model, same synthetic tokens, none of the probe's code.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _model(request: dict[str, Any], attn_implementation: str | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from autotune.models import ModelSpec

    config = ModelSpec.from_dict(request["model"]).to_config()
    config.use_cache = False
    # Built on the device (as from_pretrained(device_map=...) would place it) so a 1B model does
    # not spend its time in a CPU initialisation that says nothing about training.
    with torch.device("cuda" if request["device"].startswith("cuda") else "cpu"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def _dataset(request: dict[str, Any], length: int) -> Any:
    from autotune.models import ModelSpec
    from autotune.probe.child import SyntheticTokens

    spec = ModelSpec.from_dict(request["model"])
    return SyntheticTokens(vocab_size=spec.vocab_size, seq_len=request["seq_len"], length=length, seed=request.get("seed", 0))


def _arguments(request: dict[str, Any], output_dir: str, max_steps: int, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, max_steps=max_steps, use_cpu=not request["device"].startswith("cuda"), seed=request.get("seed", 0),
        save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True, **kwargs,
    )


def auto_find(request: dict[str, Any]) -> dict[str, Any]:
    """Train ``steps`` steps with ``auto_find_batch_size=True`` from ``start_batch``; the batch it settled on."""
    from transformers import Trainer

    start, steps = int(request.get("start_batch", 64)), int(request.get("steps", 3))
    model = _model(request, attn_implementation=None)  # transformers' default kernel
    with tempfile.TemporaryDirectory(prefix="autotune-auto-find-") as output_dir:
        args = _arguments(request, output_dir, steps, per_device_train_batch_size=start, auto_find_batch_size=True)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(request, steps * start * 2))
        started = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - started
    return {"status": "ok", "batch_size": int(trainer._train_batch_size), "start_batch": start, "steps": steps, "train_s": train_s}


def timed(request: dict[str, Any]) -> dict[str, Any]:
    """Train the request's configuration ``warmup_steps + measure_steps`` steps and time the last ``measure_steps``."""
    import torch
    from transformers import Trainer, TrainerCallback

    from autotune.params import TrialParams

    params = TrialParams.from_dict(request["params"])
    warmup, measure = int(request["warmup_steps"]), int(request["measure_steps"])
    cuda = request["device"].startswith("cuda")
    marks: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    model = _model(request, attn_implementation=params.attn_implementation)
    with tempfile.TemporaryDirectory(prefix="autotune-timed-") as output_dir:
        args = _arguments(request, output_dir, warmup + measure, **params.training_arguments_kwargs())
        dataset = _dataset(request, (warmup + measure) * params.effective_batch_size)
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[StepClock()])
        trainer.train()
    window = marks[warmup - 1 :] if warmup else marks
    if len(window) < 2:
        return {"status": "crash", "error": f"only {len(marks)} steps ran"}
    window_s = window[-1] - window[0]
    steps = len(window) - 1
    samples_per_s = params.effective_batch_size * steps / window_s
    return {
        "status": "ok", "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * request["seq_len"],
        "measured_steps": steps, "window_s": window_s,
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()) if cuda else None,
    }


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one request; an exception is a result (``oom`` or ``crash``), never raised."""
    try:
        return {"auto_find": auto_find, "timed": timed}[request["mode"]](request)
    except Exception as exc:  # noqa: BLE001 - the parent reads every failure as data
        from autotune.probe.device import is_out_of_memory

        status = "oom" if is_out_of_memory(exc, cuda=str(request.get("device", "")).startswith("cuda")) else "crash"
        return {"status": status, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}


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

    hf_logging.set_verbosity_error()
    result = run(json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    Path(argv[1]).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
