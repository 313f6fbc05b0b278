"""The side-by-side's two plain-``Trainer`` rows again, beside the probe they are compared with, in one short call.

    python -m bench.gpu_recheck --out DIR [--ceiling-bytes N]

On the first GPU, for polyglot-ko-1.3b seq 512: HF ``auto_find_batch_size`` from batch 64 under the
ceiling (a plain ``Trainer.train()``: every batch it tried, its steps, peak and log), then autotune's
probe of the compiled expert configuration (bf16, sdpa, fused AdamW, inductor, batch 48) and the same
configuration re-timed by a plain ``Trainer`` (none of autotune's code), so that probe and re-timing
run on one machine in one call. Writes ``recheck.json`` and the Trainer logs into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from autotune.models import resolve_model
from autotune.params import TrialParams
from autotune.records import DeviceInfo
from bench import gpu_phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ceiling-bytes", type=int, default=81244769484)  # the side-by-side run's ceiling on an H100 80GB, 2026-11-27
    parser.add_argument("--batch", type=int, default=48)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from autotune.probe.device import detect_device

    device: DeviceInfo = detect_device("cuda:0")
    plan = gpu_phases.FULL
    ctx = gpu_phases.Context(name="recheck", out=args.out, device=device, plan=plan, box_s=560, slug="gpu")
    model = resolve_model(plan.sbs_model)
    started = time.monotonic()
    found = gpu_phases._trainer_run(ctx, model, plan.sbs_seq_len, gpu_phases.auto_find_request(plan, args.ceiling_bytes),
                                    log_name="trainer_auto_find.log")
    params = TrialParams(per_device_train_batch_size=args.batch, precision="bf16", optim="adamw_torch_fused", attn_implementation="sdpa",
                         torch_compile="inductor")
    evaluator = ctx.evaluator(model, plan.sbs_seq_len, ceiling=args.ceiling_bytes)
    result = ctx.probe(evaluator, params)
    probe = gpu_phases.probe_row(params, result)
    request = gpu_phases.timed_request(model, params, evaluator.warmup_steps, max(plan.timed_measure_steps, probe.get("measured_steps") or 0))
    timed = gpu_phases._trainer_run(ctx, model, plan.sbs_seq_len, request, log_name="trainer_timed.log")
    if timed.get("status") == "ok" and probe.get("samples_per_s"):
        timed["ratio"] = timed["samples_per_s"] / probe["samples_per_s"]
    data = {"device": device.name, "ceiling_bytes": args.ceiling_bytes, "auto_find": found, "probe": probe, "plain_trainer": timed,
            "wall_s": time.monotonic() - started}
    (args.out / "recheck.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    print(json.dumps({"auto_find": {k: found.get(k) for k in ("status", "batch_size", "tried_batches", "steps_run", "train_s", "peak_allocated_bytes")},
                      "probe": {k: probe.get(k) for k in ("status", "samples_per_s", "peak_mem_bytes", "wall_s")},
                      "plain_trainer": {k: timed.get(k) for k in ("status", "samples_per_s", "ratio", "wall_s")}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
