"""A family of synthetic landscapes: one random device-and-model world per draw, evaluated on the fly.

A hand-made table tests a strategy on the world its author imagined. The family draws the shape
of the world at random instead, so a strategy that leans on assumptions (bf16 is fastest, flash
attention always runs, compile always pays, throughput rises with batch size up to the memory
frontier) meets worlds where they are false.

Each draw is a deterministic function of its number (:func:`draw_shape`): the same draw is the
same world on every machine and in every process. :class:`Landscape` turns a shape into outcomes:
noise-free for the whole grid at once (numpy, to find the true optimum under the ceiling), or one
probe at a time through :class:`FamilyEvaluator` (the loop's Evaluator: it charges the probe's
seconds to a :class:`~autotune.search.loop.VirtualClock` and draws the probe's noise from a seed of
(draw, configuration, how often it was probed), so repeated runs are reproducible).

Design draws are 0, 1, 2...; held-out draws start at :data:`HELDOUT_START`. The generator was
fixed, and the draws split, before the strategy that is judged on them was changed.

What is drawn per landscape (all ranges uniform unless marked log-uniform):

* **model and device**: parameters 50M-3B (log), layers 6-48, seq length 256-4096 (these set
  memory only); a saturated bf16 sdpa sample costs 1-30 ms (log), so one probe of a moderate
  configuration takes 20-60 s and a 30-minute budget buys a few dozen.
* **memory**: static = params x (4 master + 2 AMP copy + 4 grad + optimizer: AdamW 8, 8-bit 2-2.6,
  Adafactor 0.05-0.6 B/param) + a 0.5-1.5 GiB context; activations per sample = layers x seq x
  hidden x 30-40 B at 16 bit (x1.8-2.1 in fp32/tf32), eager attention adds 5 x heads x seq^2 x 2 B
  per layer, checkpointing keeps 10-30 %, compile 75-95 %; all x1.02-1.12 fragmentation. The
  ceiling is set by a regime: *roomy* (40 %: bf16 AdamW fits up to batch 48-400), *medium* (35 %:
  4-48), *tight* (25 %: AdamW does not fit at batch 1, often not at all; only a frugal optimizer
  and/or checkpointing fits). The device holds 1.0-1.15 x the ceiling: above it a probe is ``oom``,
  between the two it runs, over the ceiling.
* **speed factors**: tf32 1.3-2.6 x fp32, fp16 1.8-3.6 x, bf16 = fp16 x 0.92-1.08; sdpa 1.0-1.35 x
  eager, flash = sdpa x 0.93-1.15; checkpointing 0.65-0.85 x; compile per mode 0.85-1.3 x on the
  per-sample time (max-autotune = inductor x 0.9-1.12, so it can lose) and 0.3-0.9 x on the
  per-step overhead.
* **batch curve**: a micro-step costs ``overhead + batch x per_sample``, so throughput saturates at
  a batch of 0.3-8 (log, in fp32 eager; larger for faster kernels); with probability 0.3 it peaks
  at a batch of 16-96 (log) and falls past it (per-sample time x (b / peak)^0.05-0.25).
  Misaligned batches: not a multiple of 8 x0.75-0.97, a multiple of 8 but not of 64 x0.94-1.0.
* **optimizer step**: fused AdamW costs 3-50 % (log) of a bf16 micro-step at batch 8; adamw_torch
  x1.5-3, Adafactor x1.5-4, 8-bit x0.7-1.5; amortised over the accumulation steps, each of which
  but the first adds its gradient (a quarter of a fused AdamW step).
* **input**: one loader worker makes 0.15-4 x (log) half the fastest compute rate; workers scale
  as w^0.8-1.0 and cost 0-0.5 % compute each; with 0 workers loading is serial with compute at
  0.7-1.2 x one worker's rate. ``input_wait_fraction`` is the share of a step spent waiting.
  Version 2 (#44): a *loader-bound* world (25 %) draws one worker at 0.12-0.3 x the fastest compute
  rate instead (few workers: every precision measures the same); half the draws report no
  ``input_wait_fraction`` and no ``step_time_ci95_rel`` (a replay table without those columns);
  off pre-Ampere cards, 12 % draw fp16 and bf16 at 0.97-1.03 x tf32 (a tie across precisions).
* **failures**: a pre-Ampere-like card (12 %) crashes bf16 and flash attention at start-up, with
  tf32 no faster than fp32 (and crashing half the time), fp16 2.5-3.6 x; otherwise bf16 (6 %),
  tf32 (4 %), sdpa (3 %), flash (15 %; in fp32/tf32 only, 50 %) and 8-bit Adam (10 %) crash at
  start-up. fp16 diverges everywhere (12 %) or with Adafactor (25 %) or 8-bit Adam (10 %); bf16 with
  Adafactor (5 %). Each compile mode crashes everywhere (inductor 12 %, max-autotune 15 %, or 70 %
  when inductor does), with checkpointing (15 %), with eager attention (10 %), with flash (10 %).
* **noise and costs**: multiplicative noise 0.5-3 % per probe (its within-run CI is reported as
  that); start-up 8-45 s; 3 warm-up steps and a measured window of 4-10 steps, at least 15-60 s
  when steps are short; compilation inductor 20-180 s (log), max-autotune 1.5-4 x that. A start-up
  crash costs the start-up; a compile crash start-up plus 20-100 % of the compilation; an OOM
  start-up, half the compilation and a step; a divergence the warm-up and 30-100 % of the window.

    python -m bench.family --draws 5           # describe design draws 0-4 and their optima
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.params import KNOBS_ADDED_LATER, PARAM_DEFAULTS, PARAM_NAMES, TrialParams
from autotune.records import ProbeResult, ProbeStatus
from autotune.search.loop import VirtualClock
from autotune.space import SearchSpace, load_space
from autotune.units import GiB

FAMILY_VERSION = 2  # part of every draw's seed: a changed generator is a different family (2: loader-bound draws, silent telemetry, precision ties)
RANGE_SPAN = 100_000  # every range of draws starts at a multiple of this (bench.search's heldoutN at N x RANGE_SPAN)
HELDOUT_START = RANGE_SPAN
RANGES = {"design": 0, "heldout": HELDOUT_START}

OK, OOM, CRASH_START, CRASH_COMPILE, DIVERGED = 0, 1, 2, 3, 4
_STATUS = {OK: ProbeStatus.OK, OOM: ProbeStatus.OOM, CRASH_START: ProbeStatus.CRASH, CRASH_COMPILE: ProbeStatus.CRASH, DIVERGED: ProbeStatus.DIVERGED}
_AMP = ("fp16", "bf16")
WARMUP_STEPS = 3

Value = tuple[str, Any]  # (parameter, value)


@dataclass(frozen=True)
class Shape:
    """Everything that makes one landscape (see the module docstring for the ranges)."""

    draw: int
    pre_ampere: bool
    regime: str
    num_parameters: float
    seq_len: int
    ceiling_bytes: int
    device_bytes: int
    static_bytes: dict[tuple[str, str], float]  # (precision, optim) -> bytes
    act_bytes: float  # per sample, 16-bit, sdpa, no checkpointing, no compile
    eager_act_bytes: float  # added per sample by eager attention (16-bit)
    fp32_act: float
    ckpt_act: float
    compile_act: float
    frag: float
    per_sample_s: float  # fp32, eager, no compile, no checkpointing, batch below any peak
    overhead_s: float  # per micro-step, uncompiled
    precision_speed: dict[str, float]
    attn_speed: dict[str, float]
    compile_speed: dict[str, float]
    compile_overhead: dict[str, float]
    compile_s: dict[str, float]
    ckpt_speed: float
    align8: float
    align64: float
    batch_peak: int | None
    peak_gamma: float
    opt_step_s: dict[str, float]
    grad_accumulate_s: float  # per micro-step after the first
    worker_rate: float  # samples/s of one loader worker
    main_rate: float  # samples/s loading in the training process (0 workers)
    worker_scaling: float
    worker_cost: float
    noise: float
    startup_s: float
    measure_steps: int
    measure_min_s: float
    loader_bound: bool  # the loader limits throughput unless enough workers run (every precision then measures alike)
    telemetry: bool  # probes report input_wait_fraction and step_time_ci95_rel (False: a table without those columns)
    crash_values: frozenset[Value]  # crash at start-up wherever they appear
    crash_pairs: frozenset[tuple[Value, Value]]  # crash at start-up together
    compile_crash: frozenset[str]  # compile modes that crash everywhere
    compile_crash_with: frozenset[tuple[str, Value]]  # compile mode crashes with this value
    diverge_values: frozenset[Value]
    diverge_pairs: frozenset[tuple[Value, Value]]

    def describe(self) -> str:
        fails = sorted(f"{p}={v}" for p, v in self.crash_values)
        fails += sorted(f"{a[0]}={a[1]}+{b[0]}={b[1]}" for a, b in self.crash_pairs)
        comp = sorted(f"{m} crashes" for m in self.compile_crash) + sorted(f"{m} crashes with {p}={v}" for m, (p, v) in self.compile_crash_with)
        div = sorted(f"{p}={v}" for p, v in self.diverge_values) + sorted(f"{a[1]}+{b[1]}" for a, b in self.diverge_pairs)
        speeds = " ".join(f"{k} {v:.2f}" for k, v in self.precision_speed.items())
        return (
            f"draw {self.draw}: {self.num_parameters / 1e9:.2f}B params, seq {self.seq_len}, {self.regime} "
            f"(ceiling {self.ceiling_bytes / GiB:.1f} GiB, device {self.device_bytes / GiB:.1f} GiB)"
            f"{', pre-Ampere' if self.pre_ampere else ''}; precision {speeds}; "
            f"compile {self.compile_speed['inductor']:.2f}/{self.compile_speed['inductor:max-autotune']:.2f} "
            f"({self.compile_s['inductor']:.0f}/{self.compile_s['inductor:max-autotune']:.0f} s); "
            f"saturates at b~{self.overhead_s / self.per_sample_s:.1f} (fp32 eager)"
            f"{f', peaks at {self.batch_peak}' if self.batch_peak else ''}; noise {self.noise:.1%}; "
            f"{'loader-bound; ' if self.loader_bound else ''}{'' if self.telemetry else 'no input-wait/CI columns; '}"
            f"crash: {', '.join(fails + comp) or 'none'}; diverge: {', '.join(div) or 'none'}"
        )


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw_shape(draw: int) -> Shape:
    """The landscape of draw number ``draw`` (a pure function of it).

    A draw where nothing fits under the ceiling (its frugal configurations all crash, diverge or
    run out of memory) is drawn again from the next sub-seed: every landscape has an optimum.
    """
    attempt = 0
    while True:
        shape = _draw(draw, attempt)
        frugal = _frugal_columns()
        out = outcomes(shape, frugal)
        # The generator's own test, frozen with it (FAMILY_VERSION): fractional bytes, unlike
        # Landscape.fits. Whole bytes could keep a draw this one re-draws: another family.
        if ((out.status == OK) & (out.peak_bytes <= shape.ceiling_bytes)).any():
            return shape
        attempt += 1


def _frugal_columns() -> dict[str, np.ndarray]:
    """Small batches, checkpointing, the small optimizers, every precision, attention and compile mode."""
    combos = [
        (b, p, o, c, a) for b in (1, 2) for p in ("fp32", "tf32", "fp16", "bf16") for o in ("adafactor", "adamw_bnb_8bit")
        for c in ("off", "inductor", "inductor:max-autotune") for a in ("eager", "sdpa", "flash_attention_2")
    ]
    n = len(combos)
    return {
        "per_device_train_batch_size": np.array([c[0] for c in combos]), "gradient_accumulation_steps": np.ones(n, dtype=int),
        "precision": np.array([c[1] for c in combos]), "optim": np.array([c[2] for c in combos]),
        "torch_compile": np.array([c[3] for c in combos]), "attn_implementation": np.array([c[4] for c in combos]),
        "dataloader_num_workers": np.zeros(n, dtype=int), "gradient_checkpointing": np.ones(n, dtype=bool),
    }


def _draw(draw: int, attempt: int) -> Shape:
    rng = np.random.default_rng([FAMILY_VERSION, draw, attempt])
    u = rng.uniform
    pre_ampere = bool(u() < 0.12)
    # ------------------------------------------------------------------ model, device, memory
    params = _log_uniform(rng, 5e7, 3e9)
    layers = int(rng.integers(6, 49))
    hidden = max(256.0, math.sqrt(params / (12 * layers)))
    heads = max(4, int(round(hidden / 64)))
    seq_len = int(rng.choice([256, 512, 1024, 2048, 4096], p=[0.15, 0.3, 0.3, 0.17, 0.08]))
    opt_bytes = {"adamw_torch": 8.0, "adamw_torch_fused": 8.0, "adamw_bnb_8bit": u(2.0, 2.6), "adafactor": u(0.05, 0.6)}
    context = u(0.5, 1.5) * GiB
    static = {
        (p, o): params * (4 + (2 if p in _AMP else 0) + 4 + b) + context
        for p in ("fp32", "tf32", "fp16", "bf16") for o, b in opt_bytes.items()
    }
    act = layers * seq_len * hidden * u(30, 40)
    eager_act = layers * 5 * heads * seq_len**2 * 2.0
    fp32_act, ckpt_act, compile_act, frag = u(1.8, 2.1), u(0.1, 0.3), u(0.75, 0.95), u(1.02, 1.12)
    regime_draw = u()
    big = static[("bf16", "adamw_torch_fused")]
    if regime_draw < 0.4:
        regime, ceiling = "roomy", frag * (big + act * _log_uniform(rng, 48, 400))
    elif regime_draw < 0.75:
        regime, ceiling = "medium", frag * (big + act * _log_uniform(rng, 4, 48))
    else:
        regime = "tight"
        frugal = min(static[("fp32", o)] for o in ("adafactor", "adamw_bnb_8bit"))
        floor = frag * (frugal + act * fp32_act * ckpt_act * 2)  # something fits: frugal, fp32, checkpointing, batch 2
        top = frag * (big + act * 0.9) if u() < 0.5 else frag * big * 0.97  # AdamW bf16 does not fit batch 1 / at all
        ceiling = max(floor, top) if top <= floor else float(math.exp(u(math.log(floor), math.log(top))))
    device = ceiling * (1.0 if u() < 0.4 else u(1.0, 1.15))
    # ------------------------------------------------------------------ speed
    if pre_ampere:
        fp16 = u(2.5, 3.6)
        precision_speed = {"fp32": 1.0, "tf32": u(0.97, 1.0), "fp16": fp16, "bf16": fp16 * u(0.92, 1.08)}
    else:
        fp16 = u(1.8, 3.6)
        precision_speed = {"fp32": 1.0, "tf32": u(1.3, 2.6), "fp16": fp16, "bf16": fp16 * u(0.92, 1.08)}
    if not pre_ampere and u() < 0.12:  # version 2: the 16-bit formats gain nothing over tf32 (a real tie across precisions)
        flat = precision_speed["tf32"]
        precision_speed.update(fp16=flat * u(0.97, 1.03), bf16=flat * u(0.97, 1.03))
    sdpa = u(1.0, 1.35)
    attn_speed = {"eager": 1.0, "sdpa": sdpa, "flash_attention_2": sdpa * u(0.93, 1.15)}
    inductor = u(0.85, 1.3)
    compile_speed = {"off": 1.0, "inductor": inductor, "inductor:max-autotune": inductor * u(0.9, 1.12)}
    compile_overhead = {"off": 1.0, "inductor": u(0.3, 0.9)}
    compile_overhead["inductor:max-autotune"] = compile_overhead["inductor"] * u(0.7, 1.0)
    compile_inductor_s = _log_uniform(rng, 20, 180)
    compile_s = {"off": 0.0, "inductor": compile_inductor_s, "inductor:max-autotune": compile_inductor_s * u(1.5, 4.0)}
    # Speed is drawn apart from the model size: the search sees only ratios and probe seconds, and
    # tying the two would fill the family with models whose probes take half the budget.
    bf16_per_sample_s = _log_uniform(rng, 1e-3, 3e-2)  # saturated, bf16, sdpa
    per_sample_s = precision_speed["bf16"] * attn_speed["sdpa"] * bf16_per_sample_s
    overhead_s = _log_uniform(rng, 0.3, 8) * per_sample_s
    has_peak = u() < 0.3
    batch_peak = int(round(_log_uniform(rng, 16, 96))) if has_peak else None
    peak_gamma = u(0.05, 0.25)
    align8, align64 = u(0.75, 0.97), u(0.94, 1.0)
    fused = 8 * bf16_per_sample_s * _log_uniform(rng, 0.03, 0.5)  # a share of a bf16 micro-step at batch 8
    opt_step_s = {"adamw_torch_fused": fused, "adamw_torch": fused * u(1.5, 3), "adafactor": fused * u(1.5, 4), "adamw_bnb_8bit": fused * u(0.7, 1.5)}
    fastest = max(precision_speed.values()) * max(attn_speed.values()) / precision_speed["bf16"] / attn_speed["sdpa"] / bf16_per_sample_s
    worker_rate = 0.5 * fastest * _log_uniform(rng, 0.15, 4)
    main_rate = worker_rate * u(0.7, 1.2)
    worker_scaling, worker_cost = u(0.8, 1.0), u(0.0, 0.005)
    # Version 2: what ten replay landscapes outside the family showed (#44). A loader-bound world: one
    # worker makes 0.12-0.3 x the fastest compute rate, so with few workers every precision measures
    # the same and only enough workers (4-8) let the compute show; and probes that report neither an
    # input wait nor a CI (a table without those optional columns). The 16-bit tie is drawn above.
    loader_bound = bool(u() < 0.25)
    if loader_bound:
        worker_rate = fastest * u(0.12, 0.3)
        main_rate = worker_rate * u(0.7, 1.2)
    telemetry = bool(u() >= 0.5)
    # ------------------------------------------------------------------ failures
    crash: set[Value] = set()
    pairs: set[tuple[Value, Value]] = set()
    if pre_ampere:
        crash |= {("precision", "bf16"), ("attn_implementation", "flash_attention_2")}
        if u() < 0.5:
            crash.add(("precision", "tf32"))
    else:
        if u() < 0.06:
            crash.add(("precision", "bf16"))
        if u() < 0.04:
            crash.add(("precision", "tf32"))
        if u() < 0.15:
            crash.add(("attn_implementation", "flash_attention_2"))
        elif u() < 0.5:
            flash = ("attn_implementation", "flash_attention_2")
            pairs |= {(flash, ("precision", "fp32")), (flash, ("precision", "tf32"))}
    if u() < 0.03:
        crash.add(("attn_implementation", "sdpa"))
    if u() < 0.10:
        crash.add(("optim", "adamw_bnb_8bit"))
    diverge: set[Value] = set()
    diverge_pairs: set[tuple[Value, Value]] = set()
    if u() < 0.12:
        diverge.add(("precision", "fp16"))
    if u() < 0.25:
        diverge_pairs.add((("precision", "fp16"), ("optim", "adafactor")))
    if u() < 0.10:
        diverge_pairs.add((("precision", "fp16"), ("optim", "adamw_bnb_8bit")))
    if u() < 0.05:
        diverge_pairs.add((("precision", "bf16"), ("optim", "adafactor")))
    compile_crash: set[str] = set()
    if u() < 0.12:
        compile_crash.add("inductor")
    if u() < (0.7 if compile_crash else 0.15):
        compile_crash.add("inductor:max-autotune")
    crash_with: set[tuple[str, Value]] = set()
    for value, p in ((("gradient_checkpointing", True), 0.15), (("attn_implementation", "eager"), 0.10), (("attn_implementation", "flash_attention_2"), 0.10)):
        if u() < p:
            crash_with.add(("inductor" if u() < 0.5 else "inductor:max-autotune", value))
    return Shape(
        draw=draw, pre_ampere=pre_ampere, regime=regime, num_parameters=params, seq_len=seq_len,
        ceiling_bytes=int(ceiling), device_bytes=int(device), static_bytes=static, act_bytes=act, eager_act_bytes=eager_act,
        fp32_act=fp32_act, ckpt_act=ckpt_act, compile_act=compile_act, frag=frag, per_sample_s=per_sample_s, overhead_s=overhead_s,
        precision_speed=precision_speed, attn_speed=attn_speed, compile_speed=compile_speed, compile_overhead=compile_overhead,
        compile_s=compile_s, ckpt_speed=u(0.65, 0.85), align8=align8, align64=align64, batch_peak=batch_peak, peak_gamma=peak_gamma,
        opt_step_s=opt_step_s, grad_accumulate_s=fused / 4, worker_rate=worker_rate, main_rate=main_rate, worker_scaling=worker_scaling, worker_cost=worker_cost,
        loader_bound=loader_bound, telemetry=telemetry,
        noise=u(0.005, 0.03), startup_s=u(8, 45), measure_steps=int(rng.integers(4, 11)), measure_min_s=u(15, 60),
        crash_values=frozenset(crash), crash_pairs=frozenset(pairs), compile_crash=frozenset(compile_crash),
        compile_crash_with=frozenset(crash_with), diverge_values=frozenset(diverge), diverge_pairs=frozenset(diverge_pairs),
    )


@dataclass
class Outcomes:
    """Noise-free outcomes of many configurations (arrays of one length)."""

    status: np.ndarray  # OK, OOM, CRASH_START, CRASH_COMPILE, DIVERGED
    samples_per_s: np.ndarray  # noise-free; meaningful where status is OK
    peak_bytes: np.ndarray
    probe_s: np.ndarray  # what a probe costs, by its status
    setup_s: np.ndarray
    warmup_s: np.ndarray  # warm-up steps, compilation included
    input_wait: np.ndarray


def outcomes(s: Shape, columns: dict[str, np.ndarray]) -> Outcomes:
    """Noise-free outcomes of ``s`` for configurations given column-wise (one array per parameter)."""
    b = columns["per_device_train_batch_size"].astype(float)
    acc = columns["gradient_accumulation_steps"].astype(float)
    prec, optim, comp, attn = columns["precision"], columns["optim"], columns["torch_compile"], columns["attn_implementation"]
    workers = columns["dataloader_num_workers"].astype(float)
    ckpt = columns["gradient_checkpointing"].astype(bool)
    amp = np.isin(prec, _AMP)
    compiled = comp != "off"
    # memory
    static = _lookup2(s.static_bytes, prec, optim)
    act = s.act_bytes + np.where(attn == "eager", s.eager_act_bytes, 0.0)
    act = act * np.where(amp, 1.0, s.fp32_act) * np.where(ckpt, s.ckpt_act, 1.0) * np.where(compiled, s.compile_act, 1.0)
    peak = s.frag * (static + b * act)
    # speed of one micro-step
    speed = _lookup(s.precision_speed, prec) * _lookup(s.attn_speed, attn) * _lookup(s.compile_speed, comp) * np.where(ckpt, s.ckpt_speed, 1.0)
    speed = speed * np.where(b % 8 != 0, s.align8, np.where(b % 64 != 0, s.align64, 1.0))
    per_sample = s.per_sample_s / speed
    if s.batch_peak is not None:
        per_sample = per_sample * np.maximum(b / s.batch_peak, 1.0) ** s.peak_gamma
    compute_s = (s.overhead_s * _lookup(s.compile_overhead, comp) + b * per_sample) * (1.0 + s.worker_cost * workers)
    load_s = np.where(workers > 0, b / (s.worker_rate * np.maximum(workers, 1.0) ** s.worker_scaling), b / s.main_rate)
    micro_s = np.where(workers > 0, np.maximum(compute_s, load_s), compute_s + load_s)
    # Adding a micro-batch's gradients to the accumulated ones reads and writes them once more.
    step_s = acc * micro_s + (acc - 1) * s.grad_accumulate_s + _lookup(s.opt_step_s, optim)
    wait = acc * np.where(workers > 0, np.maximum(load_s - compute_s, 0.0), load_s) / step_s  # share of the step
    samples_per_s = b * acc / step_s
    # status, in the order a run meets them: start-up, compilation, first step, the loss
    status = np.full(b.shape, OK)
    crash_start = _any_value(columns, s.crash_values) | _any_pair(columns, s.crash_pairs)
    crash_compile = np.isin(comp, list(s.compile_crash))
    for mode, value in s.compile_crash_with:
        crash_compile |= (comp == mode) & _has(columns, value)
    diverged = _any_value(columns, s.diverge_values) | _any_pair(columns, s.diverge_pairs)
    status = np.where(diverged, DIVERGED, status)
    status = np.where(peak > s.device_bytes, OOM, status)
    status = np.where(crash_compile, CRASH_COMPILE, status)
    status = np.where(crash_start, CRASH_START, status)
    # costs
    compile_s = _lookup(s.compile_s, comp)
    warmup_s = compile_s + WARMUP_STEPS * step_s
    measure_s = np.maximum(s.measure_steps * step_s, np.minimum(s.measure_min_s, 40 * step_s))
    frac = _unit_hash(columns, s.draw)  # where in compilation / the window a failure happens
    probe_s = np.select(
        [status == OK, status == OOM, status == CRASH_START, status == CRASH_COMPILE, status == DIVERGED],
        [
            s.startup_s + warmup_s + measure_s,
            s.startup_s + 0.5 * compile_s + micro_s,
            np.full(b.shape, s.startup_s),
            s.startup_s + (0.2 + 0.8 * frac) * compile_s,
            s.startup_s + warmup_s + (0.3 + 0.7 * frac) * measure_s,
        ],
    )
    return Outcomes(status, samples_per_s, peak, probe_s, np.full(b.shape, s.startup_s), warmup_s, wait)


# The parameters this frozen generator draws landscapes over; knobs added to TrialParams later
# (KNOBS_ADDED_LATER) are held at their defaults, so the family's draws do not change with them.
FAMILY_PARAMS = tuple(n for n in PARAM_NAMES if n not in KNOBS_ADDED_LATER)


def family_space() -> SearchSpace:
    """The built-in default space with the later knobs held at their defaults."""
    space = load_space("default")
    for knob in KNOBS_ADDED_LATER:
        space = space.with_values(knob, (PARAM_DEFAULTS[knob],))
    return space


class Landscape:
    """One drawn world over a search space (default: the built-in ``default`` space)."""

    def __init__(self, shape: Shape | int, space: SearchSpace | None = None) -> None:
        self.shape = shape if isinstance(shape, Shape) else draw_shape(shape)
        self.space = space if space is not None else family_space()
        self._grid: Outcomes | None = None

    @property
    def ceiling_bytes(self) -> int:
        return self.shape.ceiling_bytes

    def outcomes(self, columns: dict[str, np.ndarray]) -> Outcomes:
        """Noise-free outcomes for configurations given column-wise (one array per parameter)."""
        return outcomes(self.shape, columns)

    def grid(self) -> tuple[dict[str, np.ndarray], Outcomes]:
        """Every configuration of the space, column-wise, and its noise-free outcome (cached)."""
        columns = _grid_columns(self.space)
        if self._grid is None:
            self._grid = self.outcomes(columns)
        return columns, self._grid

    def fits(self, out: Outcomes) -> np.ndarray:
        """Which outcomes run and fit under the ceiling, in whole bytes as a probe reports its peak
        (a tight draw's ceiling can sit a fraction of a byte under its frugal configuration's peak)."""
        return (out.status == OK) & (np.floor(out.peak_bytes) <= self.ceiling_bytes)

    def true_best(self) -> tuple[TrialParams, float]:
        """The noise-free fastest configuration under the ceiling, and its samples/s."""
        columns, out = self.grid()
        fits = self.fits(out)
        if not fits.any():
            raise ValueError(f"draw {self.shape.draw}: nothing fits under the ceiling")
        i = int(np.argmax(np.where(fits, out.samples_per_s, -1.0)))
        return params_at(columns, i), float(out.samples_per_s[i])

    def largest_batch_that_fits(self, params: TrialParams, batch_sizes: Any, ceiling_bytes: int) -> int | None:
        """The largest of ``batch_sizes`` whose noise-free peak with ``params``' other settings is under
        ``ceiling_bytes`` (an exact memory model: what :func:`autotune.search.expert.expert_params` reads)."""
        fitting = [b for b in sorted(batch_sizes)
                   if np.floor(self.noise_free(params.replace(per_device_train_batch_size=b)).peak_bytes[0]) <= ceiling_bytes]
        return fitting[-1] if fitting else None

    def noise_free(self, params: TrialParams) -> Outcomes:
        return self.outcomes({name: np.array([getattr(params, name)]) for name in FAMILY_PARAMS})


@dataclass
class FamilyEvaluator:
    """The loop's Evaluator over one landscape: a probe's outcome with seeded noise, charged to ``clock``."""

    landscape: Landscape
    clock: VirtualClock = field(default_factory=VirtualClock)
    probes: int = 0
    oom_probes: int = 0
    log: list[tuple[float, TrialParams, ProbeResult]] | None = None  # (virtual start s, configuration, result) per probe, if a list is given
    noise_stream: int = 0  # 0: the family's probe noise; another number: an independent redraw of it (bench.search --noise-stream)
    _repeats: dict[tuple[Any, ...], int] = field(default_factory=dict)

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        started_s = self.clock.now()
        result = self._evaluate(params, timeout_s=timeout_s)
        if self.log is not None:
            self.log.append((started_s, params, result))
        return result

    def _evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        out = self.landscape.noise_free(params)
        status_code = int(out.status[0])
        probe_s = float(out.probe_s[0])
        self.probes += 1
        if probe_s > timeout_s:
            self.clock.advance(timeout_s)
            return ProbeResult(status=ProbeStatus.TIMEOUT, error=f"probe takes {probe_s:.0f} s > {timeout_s:.0f} s left", wall_s=timeout_s)
        self.clock.advance(probe_s)
        status = _STATUS[status_code]
        setup_s = float(out.setup_s[0])
        if status is ProbeStatus.OOM:
            self.oom_probes += 1
            return ProbeResult(status=status, error="OutOfMemoryError: landscape", wall_s=probe_s, setup_s=setup_s)
        if status is not ProbeStatus.OK:
            where = "at start-up" if status_code == CRASH_START else "while compiling" if status_code == CRASH_COMPILE else "loss went NaN"
            return ProbeResult(status=status, error=f"landscape {status}: {where}", wall_s=probe_s, setup_s=setup_s)
        key = params.key()[: len(FAMILY_PARAMS)]  # the family's parameters come first in PARAM_NAMES
        repeat = self._repeats.get(key, 0)
        self._repeats[key] = repeat + 1
        seed = [FAMILY_VERSION, self.landscape.shape.draw, _key_hash(key), repeat] + ([self.noise_stream] if self.noise_stream else [])
        rng = np.random.default_rng(seed)
        samples_per_s = float(out.samples_per_s[0]) * math.exp(rng.normal(0.0, self.landscape.shape.noise))
        wait = float(out.input_wait[0])
        return ProbeResult(
            status=ProbeStatus.OK,
            samples_per_s=samples_per_s,
            step_time_s=params.effective_batch_size / samples_per_s,
            measured_steps=self.landscape.shape.measure_steps,
            peak_mem_bytes=int(out.peak_bytes[0]),
            setup_s=setup_s,
            warmup_s=float(out.warmup_s[0]),
            wall_s=probe_s,
            step_time_ci95_rel=self.landscape.shape.noise if self.landscape.shape.telemetry else None,
            input_wait_fraction=wait if self.landscape.shape.telemetry else None,
            input_bound=wait > 0.2 and self.landscape.shape.telemetry,
        )


# ---------------------------------------------------------------------- helpers


def _lookup(table: dict[Any, float], values: np.ndarray) -> np.ndarray:
    out = np.empty(values.shape, dtype=float)
    for key, factor in table.items():
        out[values == key] = factor
    return out


def _lookup2(table: dict[tuple[Any, Any], float], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty(a.shape, dtype=float)
    for (ka, kb), value in table.items():
        out[(a == ka) & (b == kb)] = value
    return out


def _has(columns: dict[str, np.ndarray], value: Value) -> np.ndarray:
    return np.asarray(columns[value[0]] == value[1])


def _any_value(columns: dict[str, np.ndarray], values: frozenset[Value]) -> np.ndarray:
    n = len(columns["precision"])
    mask = np.zeros(n, dtype=bool)
    for value in values:
        mask |= _has(columns, value)
    return mask


def _any_pair(columns: dict[str, np.ndarray], pairs: frozenset[tuple[Value, Value]]) -> np.ndarray:
    n = len(columns["precision"])
    mask = np.zeros(n, dtype=bool)
    for a, b in pairs:
        mask |= _has(columns, a) & _has(columns, b)
    return mask


def _unit_hash(columns: dict[str, np.ndarray], draw: int) -> np.ndarray:
    """A number in [0, 1) per configuration, fixed for the draw (where in a probe a failure strikes)."""
    total = np.full(len(columns["precision"]), (draw * 0.6180339887) % 1.0)
    for name in FAMILY_PARAMS:
        values, inverse = np.unique(columns[name], return_inverse=True)
        per_value = np.array([_key_hash((name, v)) % 10007 / 10007.0 for v in values.tolist()])
        total += per_value[inverse.reshape(-1)]
    return total % 1.0


def _key_hash(key: tuple[Any, ...]) -> int:
    """A stable integer for a configuration (Python's hash of a str is salted per process)."""
    text = "|".join(map(str, key)).encode()
    value = 0
    for byte in text:
        value = (value * 131 + byte) % (2**61 - 1)
    return value


_GRID_CACHE: dict[tuple[Any, ...], dict[str, np.ndarray]] = {}


def _grid_columns(space: SearchSpace) -> dict[str, np.ndarray]:
    key = tuple((n, space.choices[n]) for n in space.free_params)
    if key not in _GRID_CACHE:
        names = list(space.free_params)
        index = np.indices([len(space.choices[n]) for n in names]).reshape(len(names), -1)
        columns = {n: np.array(space.choices[n], dtype=object if n in ("precision", "optim", "torch_compile", "attn_implementation") else None)[index[i]]
                   for i, n in enumerate(names)}
        for n in ("precision", "optim", "torch_compile", "attn_implementation"):
            columns[n] = columns[n].astype(str)
        _GRID_CACHE[key] = columns
    return _GRID_CACHE[key]


def params_at(columns: dict[str, np.ndarray], i: int) -> TrialParams:
    """The configuration at index ``i`` of column-wise configurations (:meth:`Landscape.grid`'s)."""
    return TrialParams.from_dict({n: (v.item() if hasattr(v, "item") else v) for n, v in ((n, columns[n][i]) for n in columns)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--range", choices=list(RANGES), default="design")
    parser.add_argument("--draws", type=int, default=5)
    args = parser.parse_args(argv)
    for draw in range(RANGES[args.range], RANGES[args.range] + args.draws):
        landscape = Landscape(draw)
        best, sps = landscape.true_best()
        print(landscape.shape.describe())
        print(f"    true best {sps:.3f} samples/s: {best.short()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
