"""Repeatability benchmark: probe one configuration N times, each in a fresh process, and report the spread.

Run:
    python bench/repeatability.py                                   # tiny-gptneox, the GPU if there is one
    python bench/repeatability.py --model pythia-160m --seq-len 512 --batch-size 8 --precision bf16
    python bench/repeatability.py --device cpu --mode cold          # compare the cold-start overhead

Prints per-run samples/s, the 95% CI of each run's mean step time, measured steps, the fixed
per-trial overhead (process start, imports, Trainer set-up: everything but model build, warm-up
and the measured window) and model build time; then the coefficient of variation of samples/s
across runs and the device. Targets: CV <= 2% on a CUDA GPU; fixed overhead <= 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from autotune.models import resolve_model
from autotune.params import PRECISIONS, TrialParams
from autotune.probe.device import detect_device
from autotune.probe.isolation import run_isolated, start_server
from autotune.records import ProbeSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-gptneox")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--attn", default="sdpa", help="eager | sdpa | flash_attention_2 ...")
    parser.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mode", default="forkserver", choices=("forkserver", "cold"))
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--measure-steps", type=int, default=8, help="fewest measured steps")
    parser.add_argument("--max-measure-steps", type=int, default=50)
    parser.add_argument("--max-measure-s", type=float, default=30.0)
    args = parser.parse_args(argv)

    device = detect_device(args.device)
    params = TrialParams(per_device_train_batch_size=args.batch_size, precision=args.precision, attn_implementation=args.attn)
    spec = ProbeSpec(
        model=resolve_model(args.model).to_dict(), params=params, seq_len=args.seq_len,
        device=f"cuda:{device.index}" if device.is_cuda else "cpu",
        warmup_steps=args.warmup_steps, measure_steps=args.measure_steps,
        max_measure_steps=args.max_measure_steps, max_measure_s=args.max_measure_s,
    )
    print(f"device: {device.name}")
    print(f"config: {args.model} seq {args.seq_len} {params.short()}, {args.runs} runs, {args.mode} processes")
    if args.mode == "forkserver":
        started = time.monotonic()
        start_server()
        print(f"probe server started in {time.monotonic() - started:.2f} s (once per run of autotune)")
    print(f"{'run':>3} {'samples/s':>10} {'ci95':>7} {'steps':>5} {'stable':>6} {'overhead s':>10} {'build s':>7} {'wall s':>7}")
    rates, overheads = [], []
    for run in range(1, args.runs + 1):
        result = run_isolated(spec, timeout_s=600, mode=args.mode)
        if not result.ok:
            print(f"{run:>3} {result.status}: {(result.error or '').splitlines()[-1:]}")
            continue
        rates.append(result.samples_per_s)
        overheads.append(result.overhead_s)
        print(
            f"{run:>3} {result.samples_per_s:>10.2f} {100 * (result.step_time_ci95_rel or 0):>6.1f}% {result.measured_steps:>5} "
            f"{'yes' if result.stable else 'no':>6} {result.overhead_s:>10.2f} {result.model_build_s:>7.2f} {result.wall_s:>7.2f}"
        )
    if len(rates) >= 2:
        cv = statistics.stdev(rates) / statistics.fmean(rates)
        print(f"samples/s: mean {statistics.fmean(rates):.2f}, CV {100 * cv:.2f}% (target <= 2% on a CUDA GPU)")
        print(f"fixed overhead: mean {statistics.fmean(overheads):.2f} s, max {max(overheads):.2f} s (target <= 2 s)")
    return 0 if len(rates) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
