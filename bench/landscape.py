"""Synthetic replay tables: a documented landscape of throughput, memory and probe time.

    python -m bench.landscape --preset gptneox-1.3b-a100 -o tests/data/landscape_1p3b.csv.gz
    python -m bench.landscape --preset all            # every preset into tests/data/
    python -m bench.landscape --preset pythia-160m-l4 --seed 12 -o /tmp/pythia-12.csv.gz  # another noise draw

Each row is one configuration of the grid (16 batch sizes x 4 accumulations x
4 precisions x 4 optimizers x 3 compile modes x 3 attentions x 4 worker counts x 2 checkpointing
= 73,728 rows for the full presets). The numbers are *made up* but shaped like real GPU training:

* **memory** (deliberately not autotune's own memory model, so the tuner has to calibrate):
  static = params x (4 master + 2 AMP copy + 4 grad + optimizer bytes: AdamW 8, 8-bit 2.5,
  Adafactor 0.1) + 0.8 GiB context; activations per sample = layers x seq x hidden x 36 bytes
  at 16 bit (x2 in fp32/tf32) + eager attention's 5 x heads x seq^2 x 2 bytes per layer, x0.12
  with checkpointing, x0.8 under torch.compile; everything x1.07 for allocator fragmentation.
  Above the device's memory the row is ``oom``; between the ceiling and the device it is an ``ok``
  row over the ceiling.
* **throughput**: compute rate saturating in batch size (``b / (b + b_half)``), multiplied by
  precision (fp32 1, tf32 2.2, fp16 2.9, bf16 3.0), attention (eager 1, sdpa 1.15, flash 1.22),
  compile (inductor 1.10, max-autotune 1.16), checkpointing (x0.74); batch sizes that are not
  multiples of 8 lose 12%, of 32 lose 3% (tensor-core tiles); a fixed optimizer-step time per
  optimizer (fused AdamW fastest, Adafactor slowest) amortised over the accumulation steps; a
  data loader that feeds ``load_rate x max(workers, 0.35)`` samples/s, overlapped with compute
  only when workers > 0 (input-bound at low worker counts); multiplicative noise (sigma 1.5%).
* **probe time**: start-up 8 s + 11 optimizer steps (at most 80 s), plus compilation (inductor 45 s, max-autotune
  110 s); an OOM fails after start-up and half the compilation.
* **failures**: fp16 with Adafactor ``diverged``; max-autotune with checkpointing and eager
  attention ``crash``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from autotune.units import GiB

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160)
ACCUMULATIONS = (1, 2, 4, 8)
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "adamw_bnb_8bit")
COMPILES = ("off", "inductor", "inductor:max-autotune")
ATTENTIONS = ("eager", "sdpa", "flash_attention_2")
WORKERS = (0, 2, 4, 8)
CHECKPOINTING = (False, True)
COLUMNS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "precision", "optim",
    "torch_compile", "attn_implementation", "dataloader_num_workers", "gradient_checkpointing",
)


@dataclass(frozen=True)
class Preset:
    """One landscape: a model on a device."""

    name: str
    num_parameters: float
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    device_bytes: int
    peak_samples_per_s: float  # fp32, eager, no compile, at infinite batch
    b_half: float  # batch size at half the saturated rate
    load_rate: float  # samples/s one loader worker produces
    opt_step_s: float  # fused AdamW step time; others are multiples
    seed: int
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    accumulations: tuple[int, ...] = ACCUMULATIONS
    precisions: tuple[str, ...] = PRECISIONS
    optimizers: tuple[str, ...] = OPTIMIZERS
    compiles: tuple[str, ...] = COMPILES
    attentions: tuple[str, ...] = ATTENTIONS
    workers: tuple[int, ...] = WORKERS
    checkpointing: tuple[bool, ...] = CHECKPOINTING


PRESETS = {
    # A 1.3B GPT-NeoX at 1024 tokens on an 80 GB card: memory-bound, the frontier matters.
    "gptneox-1.3b-a100": Preset("gptneox-1.3b-a100", 1.33e9, 24, 2048, 16, 1024, 80 * GiB, 5.0, 6.0, 60.0, 0.09, seed=1),
    # A 160M model at 512 tokens on a 24 GB card: fast steps, input-bound at few workers.
    "pythia-160m-l4": Preset("pythia-160m-l4", 1.62e8, 12, 768, 12, 512, 24 * GiB, 32.0, 10.0, 40.0, 0.02, seed=2),
    # A 1.2B Llama at 2048 tokens on a 24 GB card: memory-tight, fused AdamW in bf16 does not fit at
    # all; only Adafactor or 8-bit Adam with checkpointing reach useful batch sizes. Added after the
    # strategy was written, as a held-out check.
    "llama-1b-a10g": Preset("llama-1b-a10g", 1.24e9, 16, 2048, 32, 2048, 24 * GiB, 1.5, 3.0, 20.0, 0.15, seed=4),
    # Small grid for tests: 4 x 2 x 2 x 2 x 2 = 64 rows.
    "tiny": Preset(
        "tiny", 1.33e9, 24, 2048, 16, 1024, 80 * GiB, 5.0, 6.0, 60.0, 0.09, seed=3,
        batch_sizes=(8, 16, 32, 64), accumulations=(1,), precisions=("fp32", "bf16"), optimizers=("adamw_torch_fused",),
        compiles=("off", "inductor"), attentions=("sdpa",), workers=(0, 4), checkpointing=(False, True),
    ),
}

_PRECISION_SPEED = {"fp32": 1.0, "tf32": 2.2, "fp16": 2.9, "bf16": 3.0}
_ATTN_SPEED = {"eager": 1.0, "sdpa": 1.15, "flash_attention_2": 1.22}
_COMPILE_SPEED = {"off": 1.0, "inductor": 1.10, "inductor:max-autotune": 1.16}
_COMPILE_S = {"off": 0.0, "inductor": 45.0, "inductor:max-autotune": 110.0}
_OPT_STEP = {"adamw_torch_fused": 1.0, "adamw_torch": 2.5, "adafactor": 3.0, "adamw_bnb_8bit": 1.6}
_OPT_BYTES = {"adamw_torch_fused": 8.0, "adamw_torch": 8.0, "adafactor": 0.1, "adamw_bnb_8bit": 2.5}


def generate(preset: Preset) -> pd.DataFrame:
    """The full grid of ``preset`` as a replay table (deterministic for a preset)."""
    rng = np.random.default_rng(preset.seed)
    grid = list(itertools.product(
        preset.batch_sizes, preset.accumulations, preset.precisions, preset.optimizers, preset.compiles,
        preset.attentions, preset.workers, preset.checkpointing,
    ))
    frame = pd.DataFrame(grid, columns=list(COLUMNS))
    noise = rng.normal(1.0, 0.015, size=len(frame))
    rows = [_row(preset, *values, noise=float(n)) for values, n in zip(grid, noise)]
    frame["status"] = [r[0] for r in rows]
    frame["samples_per_s"] = [r[1] for r in rows]
    frame["peak_mem_bytes"] = pd.array([r[2] for r in rows], dtype="Int64")
    frame["probe_s"] = [r[3] for r in rows]
    return frame


def _row(p: Preset, batch: int, accum: int, precision: str, optim: str, compile_: str, attn: str, workers: int,
         ckpt: bool, *, noise: float) -> tuple[str, float | None, int | None, float]:
    amp = precision in ("fp16", "bf16")
    static = p.num_parameters * (4 + (2 if amp else 0) + 4 + _OPT_BYTES[optim]) + 0.8 * GiB
    act = p.num_layers * p.seq_len * p.hidden_size * 36 * (1 if amp else 2)
    if attn == "eager":
        act += p.num_layers * 5 * p.num_heads * p.seq_len**2 * 2
    act *= (0.12 if ckpt else 1.0) * (0.8 if compile_ != "off" else 1.0)
    peak = int(1.07 * (static + batch * act))
    compile_s = _COMPILE_S[compile_]
    if peak > p.device_bytes:
        return "oom", None, None, round(8.0 + 0.5 * compile_s, 1)
    if precision == "fp16" and optim == "adafactor":
        return "diverged", None, None, round(20.0 + compile_s, 1)
    if compile_ == "inductor:max-autotune" and ckpt and attn == "eager":
        return "crash", None, None, round(8.0 + compile_s, 1)
    rate = p.peak_samples_per_s * _PRECISION_SPEED[precision] * _ATTN_SPEED[attn] * _COMPILE_SPEED[compile_]
    rate *= 0.74 if ckpt else 1.0
    rate *= batch / (batch + p.b_half)
    if batch % 8:
        rate *= 0.88
    elif batch % 32:
        rate *= 0.97
    micro_s = batch / rate
    load_s = batch / (p.load_rate * max(workers, 0.35))
    micro_s = max(micro_s, load_s) if workers > 0 else micro_s + load_s
    step_s = accum * micro_s + p.opt_step_s * _OPT_STEP[optim] * (1.0 if precision != "fp32" else 1.2)
    samples_per_s = batch * accum / step_s * noise
    probe_s = 8.0 + min(11 * step_s, 80.0) + compile_s  # a probe times at most ~80 s of steps
    return "ok", round(samples_per_s, 3), peak, round(probe_s, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="all", choices=[*PRESETS, "all"])
    parser.add_argument("--seed", type=int, default=None, help="noise seed (default: the preset's); other draws test robustness")
    parser.add_argument("-o", "--output", default=None, help="CSV path (.csv.gz compresses); default tests/data/landscape_<preset>.csv.gz")
    args = parser.parse_args()
    names = list(PRESETS) if args.preset == "all" else [args.preset]
    for name in names:
        preset = PRESETS[name] if args.seed is None else dataclasses.replace(PRESETS[name], seed=args.seed)
        frame = generate(preset)
        suffix = ".csv" if name == "tiny" else ".csv.gz"
        path = Path(args.output) if args.output and len(names) == 1 else Path("tests/data") / f"landscape_{name}{suffix}"
        frame.to_csv(path, index=False)
        feasible = frame[frame["status"] == "ok"]
        print(f"{path}: {len(frame):,} rows, {math.ceil(path.stat().st_size / 1024)} KiB, "
              f"{(frame['status'] == 'oom').mean():.0%} oom, best {feasible['samples_per_s'].max():.2f} samples/s")


if __name__ == "__main__":
    main()
