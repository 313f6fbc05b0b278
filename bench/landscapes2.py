"""A second landscape generator, written independently of the first, whose draws are only ever held out.

    python -m bench.landscapes2 7                       # describe draw 7: device, model, ceiling, optimum, expert rule
    python -m bench.landscapes2 7 --write draw7.csv.gz  # write draw 7 as a replay table (its ceiling is printed)
    python -m bench.search --family gen2-heldout --draws 200 --budgets 30m --strategies bayes,tpe,random --processes 1 --gpu-seeds 0

Held out only: no strategy, rule or threshold may be designed or tuned on these draws. Every
range in :data:`RANGES` is a held-out range; once a range has been run and looked at it is spent
(record that in ``reports/search_benchmark.md``), and the next comparison takes a fresh range.
Changing any functional form or range below means bumping :data:`GEN2_VERSION`.

What a draw is (:class:`Draw`, built by :func:`draw`): one device (16-141 GiB, a compute peak, a
memory bandwidth, a host CPU speed and core count, some cards pre-Ampere-like), one decoder model
(50 M - 7 B parameters, sequence 128-4096, vocabulary 32 k - 256 k), a data loader (cheap, or
input-bound), an allocator cap (the ceiling: the card's usable memory or a lower probe cap), and
failure traits. Its table (:meth:`Draw.frame`) holds every configuration of :data:`GRID` with the
columns :mod:`autotune.search.replay` reads plus ``true_samples_per_s`` and ``true_peak_mem_bytes``
(noise-free, for scoring; replay ignores them), ``probe_warm_s`` (the probe's cost when its
compiled graph is already in inductor's cache; :class:`CachedReplayEvaluator` charges it), and the
start-up and warm-up seconds (compilation included) a live probe reports, ``setup_s`` and ``warmup_s``.

The functional forms, from first principles of GPU training and the 231 H100 probes of pythia-160m
(``reports/gpu/nvidia-h100-80gb-hbm3-2026-11-22/landscape_rows.jsonl``), not from a log-additive model:

* Time of one optimizer step = accumulation x micro-step + optimizer update + a fixed Trainer
  overhead per step. A micro-step = host work per micro-step + max(CPU dispatch, GPU time) (a
  roofline: the CPU queues kernels while the GPU runs them). GPU time = matmul FLOPs / (peak of the
  precision x a saturating efficiency curve of the tokens per micro-batch) + memory-bound
  elementwise and cross-entropy traffic / bandwidth. CPU dispatch = kernels x launch cost, larger
  under eager autocast (the cast kernels and the autocast dispatch of every op). Compilation cuts the
  dispatch and fuses the elementwise traffic (less so with checkpointing), so it gains little where
  the fixed host overhead dominates (small batches) and most at large batches; it also removes
  autocast's penalty, so 16-bit gains more from it than fp32, and eager bf16 can lose to fp32 at
  small batches. Checkpointing re-runs the forward (FLOPs, kernels and traffic), so its cost depends
  on where the step is bound.
* Input: the loader costs ``c_in`` seconds of one CPU core per sample. Without workers that time
  adds to every step; with ``w`` workers the step is max(compute, samples / worker rate) (workers
  beyond the free cores give nothing and contend). Input-bound draws make that term dominate
  unless enough workers run, so there every precision measures the same. No input-wait column.
* Peak memory = fp32 weights + optimizer state + (16-bit weight casts) + activations (per layer and
  token, barely dependent on precision; an S x S term for eager attention; only layer inputs with
  checkpointing) + the logits (tokens x vocabulary x 4 B x copies: fp32 upcast, softmax, gradient)
  + the fp32 gradients that coexist with the activations: a fraction of them at accumulation 1, all
  of them (and part of the last logits' buffers, cached) once accumulation keeps gradients between
  micro-steps. Over the allocator cap (less a fragmentation margin) a probe is an OOM, reporting
  the memory it held when it failed; never a slow success.
* Probe cost: start-up (model load, worker spawn) + compile (cold 30-45 s scaled by depth, several
  times that for max-autotune; ~10 s from inductor's cache; checkpointed graphs pay in full every
  time) + warm-up and measured steps. An OOM ends at the first step, a crash at start-up or compile.
* Failures: cards where bf16 and flash-attention crash (pre-Ampere-like), flash-attention crashing
  on fp32/tf32 anywhere, models whose compile crashes (every mode, or only max-autotune), and
  models whose fp16 training diverges.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from autotune.params import COMPILED_GRAPH_PARAMS, TrialParams
from autotune.records import ProbeStatus
from autotune.search.memory import MemoryModel
from autotune.search.memory_prior import ModelDims
from autotune.search.replay import ReplayEvaluator, ReplayTable, load_table
from autotune.units import GiB as GIB

GEN2_VERSION = 1  # bump with any change to a functional form, a range or the grid
_SALT = 0x6E2  # keeps this generator's random streams apart from any other seeded by the same integers
# Held-out ranges: name -> first draw. Each is run once and then spent; add a fresh one for the next comparison.
RANGES = {"gen2-heldout": 0, "gen2-heldout2": 200_000, "gen2-heldout3": 400_000, "gen2-heldout4": 600_000, "gen2-heldout5": 800_000, "gen2-heldout6": 1_000_000, "gen2-heldout7": 1_200_000, "gen2-heldout8": 1_400_000,
          "gen2-heldout9": 1_600_000, "gen2-heldout10": 1_800_000, "gen2-heldout11": 2_000_000, "gen2-heldout12": 2_200_000, "gen2-heldout13": 2_400_000, "gen2-heldout14": 2_600_000,
          "gen2-heldout15": 2_800_000, "gen2-heldout16": 3_000_000, "gen2-heldout17": 3_200_000, "gen2-heldout18": 3_400_000,
          "gen2-heldout19": 3_600_000, "gen2-heldout20": 3_800_000, "gen2-heldout21": 4_000_000,
          "gen2-heldout22": 4_200_000, "gen2-heldout23": 4_400_000,
          "gen2-heldout24": 4_600_000, "gen2-heldout25": 4_800_000,
          "gen2-heldout26": 5_000_000, "gen2-heldout27": 5_200_000}
# 100000-100001: a smoke test of the harness, seen; gen2-heldout4: for the simplified bayes package (2026-11-27);
# gen2-heldout5: the correlated-misses rule of P(fits), with against without (2026-11-27, defined before any run);
# gen2-heldout6: the figures of whatever that comparison keeps, run once on 2026-11-28 (spent);
# gen2-heldout7: spent on 2026-11-28 (the replays told the parameter count, paired with and without);
# gen2-heldout8: spent on 2026-11-28 (the loader learnt from throughput, run once);
# gen2-heldout9: spent on 2026-11-28 (one loader model, run once, with the day's first strategy for the before/after);
# gen2-heldout10: spent on 2026-11-28 (the memory model's scale and OOM bounds, run once, with 3cb706e for the before/after);
# gen2-heldout11: spent on 2026-11-28 (accumulation polished both ways, run once, with 021240d for the before/after);
# gen2-heldout12: spent on 2026-11-28 (questions wait for the polishing probes, run once, with 7dbc0a7 for the before/after);
# gen2-heldout13: spent on 2026-11-28 (e400d1b's figures, run once);
# gen2-heldout14: spent on 2026-11-28 (2125cff's figures, run once, with 69606a6 for the before/after);
# gen2-heldout15: spent on 2026-11-28 (92d525d's figures, run once, with 8377477 for the before/after); traced on 2026-11-29 (design data);
# gen2-heldout16: spent on 2026-11-29 (2f9f5dc's figures, run once, with 69e21f2 for the before/after); traced after (design data);
# gen2-heldout17: spent on 2026-11-29 (5c3683a's figures, run once, with a56cab2 for the before/after); traced after (design data);
# gen2-heldout18: spent on 2026-11-29 (feb47ef's figures, bayes alone, with the replays' start-up and warm-up times and the model's
# dimensions, run once; no before/after: 5c3683a's strategy with model dims rejects up to 3,017 proposals a search);
# gen2-heldout19: spent on 2026-11-29 (88d0977's figures, bayes alone, run once; no before/after: time);
# gen2-heldout20: spent on 2026-11-29 (d913c08's figures, the loader's cores known, bayes alone, run once); traced after (design data);
# gen2-heldout21: spent on 2026-11-29 (d913c08's figures with 9f44905's bench: the expert's batch from the memory model; run once);
# gen2-heldout22: spent on 2026-11-29 (632316b's figures, the same strategy as gen2-heldout21's, bayes alone, run once);
# gen2-heldout23: spent on 2026-12-01 (a130f71's figures, bayes alone, run once);
# gen2-heldout24: spent on 2026-12-02 (a7a9f75's figures, bayes alone, run once, with e726a04 for the before/after);
# gen2-heldout25: spent on 2026-12-02 (25c6bee's figures, bayes alone, run once; no before/after: time);
# gen2-heldout26: spent on 2026-12-07 (5d7ac0a's figures, bayes alone, run once, with 4e7a530 for the before/after);
# gen2-heldout27: the next comparison (defined before any run)

GRID: dict[str, tuple[Any, ...]] = {
    "per_device_train_batch_size": (1, 2, 4, 8, 16, 32, 64, 128),
    "gradient_accumulation_steps": (1, 2, 4),
    "precision": ("fp32", "tf32", "fp16", "bf16"),
    "optim": ("adamw_torch", "adamw_torch_fused", "adafactor", "adamw_bnb_8bit"),
    "torch_compile": ("off", "inductor", "inductor:max-autotune"),
    "attn_implementation": ("eager", "sdpa", "flash_attention_2"),
    "dataloader_num_workers": (0, 2, 4, 8),
    "gradient_checkpointing": (False, True),
}
# The expert rule's choices, in its order of preference (see expert_params).
EXPERT_PRECISIONS = ("bf16", "fp16", "fp32")
EXPERT_ATTENTION = ("flash_attention_2", "sdpa", "eager")
EXPERT_OPTIMS = ("adamw_torch_fused", "adamw_bnb_8bit", "adafactor")  # the rule's, then lighter ones where it cannot fit
EXPERT_COMPILE = ("inductor", "off")
EXPERT_WORKERS = 4
# A row runs out of memory over the ceiling less fragmentation x a factor drawn per row from this range.
MARGIN_SPREAD = (0.5, 1.5)


@dataclass
class Draw:
    """One drawn device + model + loader + ceiling; :meth:`frame` is its replay table."""

    index: int
    noise_stream: int = 0
    traits: dict[str, Any] = field(default_factory=dict)
    _frame: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def ceiling_bytes(self) -> int:
        return int(self.traits["ceiling_bytes"])

    @property
    def name(self) -> str:
        return f"gen2-v{GEN2_VERSION}-draw{self.index}"

    def frame(self) -> pd.DataFrame:
        if self._frame is None:
            self._frame = _build_frame(self)
        return self._frame

    def table(self) -> ReplayTable:
        """The draw as a validated replay table (written to a temporary CSV and read by ``load_table``)."""
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"{self.name}.csv"
            self.write(path)
            return load_table(path)

    def write(self, path: str | Path) -> None:
        self.frame().to_csv(path, index=False)

    def model_dims(self) -> ModelDims:
        """The drawn model's dimensions, as a run reads them from the model's config (the memory model's analytic prior)."""
        t = self.traits
        return ModelDims(num_parameters=int(t["params"]), num_layers=int(t["layers"]), hidden_size=int(t["hidden"]),
                         num_attention_heads=int(t["heads"]), vocab_size=int(t["vocab"]), intermediate_size=4 * int(t["hidden"]))

    def true_best(self) -> pd.Series:
        """The fastest ok row under the ceiling, noise-free."""
        frame = self.frame()
        ok = frame[(frame["status"] == "ok") & (frame["true_peak_mem_bytes"] <= self.ceiling_bytes)]
        return ok.loc[ok["true_samples_per_s"].idxmax()]

    def margin_proof_best_sps(self) -> float:
        """The noise-free samples/s of the fastest configuration that runs and fits under the ceiling
        whatever its row's out-of-memory margin (each row draws its own: the ceiling less
        :data:`MARGIN_SPREAD` x the draw's fragmentation), 0 where none does."""
        frame = self.frame()
        proof = ~frame["status"].isin(["crash", "diverged"]) & (frame["true_peak_mem_bytes"] <= _margin_proof_ceiling(self.traits))
        return float(frame.loc[proof, "true_samples_per_s"].max()) if proof.any() else 0.0

    def true_samples_per_s(self, params: TrialParams) -> float:
        """Noise-free samples/s of ``params`` (0 where it does not run or does not fit)."""
        row = self.frame().iloc[self._position(params)]
        fits = row["status"] == "ok" and row["true_peak_mem_bytes"] <= self.ceiling_bytes
        return float(row["true_samples_per_s"]) if fits else 0.0

    def _position(self, params: TrialParams) -> int:
        if not hasattr(self, "_positions"):
            keys = zip(*(self.frame()[n].tolist() for n in GRID))
            self._positions = {key: i for i, key in enumerate(keys)}
        return self._positions[tuple(getattr(params, n) for n in GRID)]


def draw(index: int, noise_stream: int = 0) -> Draw:
    """Draw ``index`` (deterministic); ``noise_stream`` redraws only the measurement noise."""
    rng = np.random.default_rng([_SALT, GEN2_VERSION, index])
    return Draw(index=index, noise_stream=noise_stream, traits=_draw_traits(rng))


# ---------------------------------------------------------------------- the draw's traits


def _draw_traits(rng: np.random.Generator) -> dict[str, Any]:
    t: dict[str, Any] = {}
    # Device: memory class, then compute and bandwidth loosely tied to it.
    mem_gib = float(rng.choice([16, 20, 24, 24, 32, 40, 48, 48, 80, 80, 94, 141]))
    t["device_gib"] = mem_gib
    big = mem_gib >= 80
    t["pre_ampere"] = bool(mem_gib <= 32 and rng.random() < 0.3)
    if t["pre_ampere"]:
        half_tflops = rng.uniform(25, 125)  # fp16 tensor cores only
        t["fp32_tflops"] = half_tflops / rng.uniform(4, 9)
        t["tf32_tflops"] = t["fp32_tflops"]  # no TF32: tf32 runs as fp32
        t["bandwidth_gbs"] = rng.uniform(300, 900)
    else:
        half_tflops = rng.uniform(400, 1000) if big else rng.uniform(60, 330)
        t["fp32_tflops"] = half_tflops / math.exp(rng.uniform(math.log(2), math.log(16)))  # 2x (consumer, inference cards) to 16x
        t["tf32_tflops"] = half_tflops / rng.uniform(1.8, 2.2)
        t["bandwidth_gbs"] = rng.uniform(2000, 4800) if big else rng.uniform(300, 1500)
    t["half_tflops"] = half_tflops
    t["matmul_eff_max"] = rng.uniform(0.4, 0.7)
    t["tokens_half_eff"] = rng.uniform(1.0, 6.0)  # x peak FLOPs / bandwidth: the tokens per micro-batch at half the efficiency
    t["launch_us"] = rng.uniform(4, 10)  # CPU dispatch per kernel, eager
    t["autocast_cpu"] = rng.uniform(0.2, 0.6)  # extra dispatch per op under eager autocast
    t["host_step_s"] = rng.uniform(0.004, 0.02)  # Trainer's own work per optimizer step (logging, zero_grad, scheduler, syncs)
    t["host_micro_s"] = rng.uniform(0.001, 0.006)  # per micro-step (collation, moving the batch, loss bookkeeping)
    t["cores"] = int(rng.choice([4, 6, 8, 12, 16, 32]))
    # Allocator cap: the card's usable memory, or a lower probe cap (a shared card, a safety margin).
    cap_fraction = rng.uniform(0.88, 0.95) if rng.random() < 0.7 else rng.uniform(0.15, 0.6)
    t["ceiling_bytes"] = int(mem_gib * GIB * cap_fraction)
    t["fragmentation"] = rng.uniform(0.0, 0.04)

    # Model: vocabulary, sequence and a size such that batch 1 trains with adafactor and checkpointing under the cap.
    for _ in range(200):
        t["vocab"] = int(rng.choice([32000, 50304, 65536, 128256, 151936, 256000]))
        t["seq"] = int(rng.choice([128, 256, 512, 512, 1024, 1024, 2048, 4096]))
        params = math.exp(rng.uniform(math.log(5e7), math.log(7e9)))
        if params * 11.0 + t["seq"] * t["vocab"] * 4.0 * 3.5 <= 0.7 * t["ceiling_bytes"]:
            break
    else:
        t["vocab"], t["seq"], params = 32000, 128, 5e7
    layers = int(np.clip(round(rng.uniform(0.6, 1.4) * 8 * (params / 1e8) ** 0.3), 4, 64))
    hidden = int(max(256, 64 * round(math.sqrt(max(params - t["vocab"] * 512, 1e6) / (12 * layers)) / 64)))
    t["layers"], t["hidden"], t["heads"] = layers, hidden, max(4, hidden // int(rng.choice([64, 128])))
    t["tied_embeddings"] = bool(rng.random() < 0.5)
    t["params"] = 12 * layers * hidden**2 + t["vocab"] * hidden * (1 if t["tied_embeddings"] else 2)
    t["param_tensors"] = 12 * layers + 4
    # Memory coefficients (bytes per token per layer per hidden unit, copies of the logits).
    t["act_coeff"] = rng.uniform(26, 40)
    t["act_fp32_over_half"] = rng.uniform(1.0, 1.15)  # activation memory barely moves with precision
    t["logit_copies"] = rng.uniform(1.6, 3.0)
    t["grad_overlap"] = rng.uniform(0.25, 0.6)  # share of the gradients alive at the peak at accumulation 1
    t["accum_logit_cached"] = rng.uniform(0.0, 0.6)  # share of one logits buffer the allocator keeps between micro-steps
    t["compile_act_factor"] = rng.uniform(0.7, 0.95)
    t["cudagraph_pool"] = rng.uniform(0.05, 0.25)
    t["workspace_bytes"] = rng.uniform(0.15, 0.6) * GIB
    # Throughput coefficients.
    t["kernels_per_layer"] = rng.uniform(35, 70)  # forward + backward
    t["elementwise_bytes"] = rng.uniform(80, 250)  # passes over a hidden-sized vector per token per layer, eager
    t["eager_attn_traffic"] = rng.uniform(4, 10)  # S x S reads and writes per head, eager
    t["sdpa_quality"] = math.exp(rng.normal(0.1, 0.5))  # > 1: sdpa's kernel slower than eager's path here
    t["sdpa_fp32_penalty"] = rng.uniform(1.0, 2.0)  # fp32 sdpa falls back to a slower kernel
    t["flash_gain"] = rng.uniform(0.3, 0.8)
    t["compile_dispatch"] = rng.uniform(0.15, 0.35)
    t["compile_fuse"] = rng.uniform(0.3, 0.55)
    t["compile_ckpt_fuse_loss"] = rng.uniform(0.4, 0.9)  # how much of the fusion checkpointing undoes
    t["autotune_matmul"] = rng.uniform(0.95, 1.1)
    t["compile_matmul"] = rng.uniform(1.0, 1.6)  # fused epilogues, no layout copies around the matmuls
    t["ce_traffic"] = rng.uniform(3, 7)  # logits passes of the cross-entropy, eager
    t["adafactor_us_per_tensor"] = rng.uniform(60, 200)
    t["scaler_s"] = rng.uniform(0.0005, 0.003)  # fp16's GradScaler: inf check sync
    t["noise_sigma"] = rng.uniform(0.005, 0.03)
    # Loader: usually cheap; input-bound draws need several workers to keep up with the best compute.
    t["input_bound"] = bool(rng.random() < 0.25)
    t["worker_ipc_s"] = rng.uniform(0.0002, 0.0015)  # handing one batch over from a worker
    t["loader_s_per_sample"] = rng.uniform(2e-6, 3e-5) * t["seq"] / 128
    t["workers_needed"] = float(rng.uniform(1.5, 9.0))  # input-bound draws: workers that match the best compute
    # Failures.
    t["compile_crash"] = str(rng.choice(["none", "all", "max-autotune"], p=[0.82, 0.1, 0.08]))
    t["fp16_diverges"] = bool(rng.random() < 0.1)
    # Probe costs.
    t["load_s"] = rng.uniform(2, 6) + t["params"] * 4 / rng.uniform(1e9, 3e9)
    t["compile_cold_s"] = rng.uniform(28, 45) * (0.5 + 0.5 * layers / 12) ** 0.7
    t["compile_warm_s"] = rng.uniform(7, 13)
    t["autotune_compile_factor"] = rng.uniform(3, 8)
    t["worker_spawn_s"] = rng.uniform(0.3, 1.5)
    t["measured_steps"] = int(rng.integers(8, 20))
    return t


# ---------------------------------------------------------------------- the table


def _grid_arrays() -> dict[str, np.ndarray]:
    combos = list(itertools.product(*GRID.values()))
    columns = list(zip(*combos))
    return {name: np.array(values, dtype=object if isinstance(values[0], str) else None) for name, values in zip(GRID, columns)}


_GRID_CACHE: dict[str, np.ndarray] = {}


def _grid() -> dict[str, np.ndarray]:
    if not _GRID_CACHE:
        _GRID_CACHE.update(_grid_arrays())
    return _GRID_CACHE


def model(t: dict[str, Any], g: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Noise-free step time parts, samples/s and peak memory for the grid ``g`` under traits ``t``."""
    b = g["per_device_train_batch_size"].astype(float)
    acc = g["gradient_accumulation_steps"].astype(float)
    prec, optim, comp, attn = g["precision"], g["optim"], g["torch_compile"], g["attn_implementation"]
    workers = g["dataloader_num_workers"].astype(float)
    ckpt = g["gradient_checkpointing"].astype(bool)
    half = (prec == "fp16") | (prec == "bf16")
    compiled = comp != "off"
    autotuned = comp == "inductor:max-autotune"
    flash = attn == "flash_attention_2"
    eager_attn = attn == "eager"
    S, V, L, d, H, N = t["seq"], t["vocab"], t["layers"], t["hidden"], t["heads"], t["params"]
    tokens = b * S

    # --- memory
    weights = 4.0 * N
    opt_state = np.select([optim == "adafactor", optim == "adamw_bnb_8bit"], [0.03 * 4 * N, 2.0 * N], 8.0 * N)
    casts = np.where(half, 2.0 * N, 0.0)
    grads = 4.0 * N
    act_per_token_layer = t["act_coeff"] * d * np.where(half, 1.0, t["act_fp32_over_half"])
    ckpt_per_token_layer = 4.0 * d  # the fp32 residual stream at each layer's input
    layer_acts = np.where(ckpt, L * ckpt_per_token_layer + act_per_token_layer, L * act_per_token_layer) * tokens
    scores = np.where(eager_attn, 5.0 * H * S * S * b * np.where(half, 2.0, 4.0) * np.where(ckpt, 1.0, L), 0.0)
    acts = (layer_acts + scores) * np.where(compiled, t["compile_act_factor"], 1.0) * np.where(autotuned, 1 + t["cudagraph_pool"], 1.0)
    logits_buffer = tokens * V * 4.0
    logits = logits_buffer * t["logit_copies"] + np.where(half, tokens * V * 2.0, 0.0)
    grads_live = np.where(acc > 1, grads + t["accum_logit_cached"] * logits_buffer, t["grad_overlap"] * grads)
    peak = weights + opt_state + casts + acts + logits + grads_live + t["workspace_bytes"]

    # --- time of one micro-step
    peak_tflops = np.select([half, prec == "tf32"], [t["half_tflops"], t["tf32_tflops"]], t["fp32_tflops"]) * 1e12
    bw = t["bandwidth_gbs"] * 1e9
    # Efficiency saturates with the tokens of a micro-batch, later where the peak is high against the bandwidth.
    tokens_half = t["tokens_half_eff"] * peak_tflops / bw
    eff = t["matmul_eff_max"] * tokens / (tokens + tokens_half) * np.where(autotuned, t["autotune_matmul"], 1.0)
    eff = eff * np.where(compiled, t["compile_matmul"], 1.0)
    body = 12.0 * L * d * d
    matmul_flops = 6.0 * (body + V * d) * tokens + np.where(ckpt, 2.0 * body * tokens, 0.0)
    attn_flops = 12.0 * L * S * d * tokens * np.where(ckpt, 4 / 3, 1.0)
    attn_speed = np.select([flash, eager_attn], [1.0 / t["flash_gain"], 1.0],
                           1.0 / t["sdpa_quality"] / np.where(half, 1.0, t["sdpa_fp32_penalty"]))
    elem = np.where(half, 3.0, 4.0)  # bytes per element: 16-bit autocast keeps norms and residuals in fp32
    ew_bytes = t["elementwise_bytes"] * L * d * tokens * elem * np.where(ckpt, 1.4, 1.0)
    eager_scores_bytes = np.where(eager_attn, t["eager_attn_traffic"] * L * H * S * tokens * elem / 2, 0.0)
    fuse = np.where(compiled, np.where(ckpt, t["compile_fuse"] + (1 - t["compile_fuse"]) * t["compile_ckpt_fuse_loss"], t["compile_fuse"]), 1.0)
    ce_bytes = t["ce_traffic"] * tokens * V * 4.0 * np.where(compiled, 0.6, 1.0)
    cast_bytes = np.where(half & ~compiled, 6.0 * N, 0.0)  # eager autocast re-casts every weight each micro-step
    gpu_s = (matmul_flops / (peak_tflops * eff) + attn_flops / (peak_tflops * eff * attn_speed)
             + (ew_bytes * fuse + eager_scores_bytes * np.where(compiled, 0.7, 1.0) + ce_bytes + cast_bytes) / bw)
    kernels = (t["kernels_per_layer"] * L + 30) * np.where(ckpt, 1.35, 1.0) * np.where(eager_attn, 1.15, 1.0)
    dispatch = kernels * t["launch_us"] * 1e-6 * np.where(half & ~compiled, 1 + t["autocast_cpu"], 1.0)
    dispatch = dispatch * np.where(compiled, np.where(autotuned, 0.05, t["compile_dispatch"]), 1.0)
    micro_s = t["host_micro_s"] + np.maximum(dispatch, gpu_s)

    # --- optimizer step
    update_bytes = np.select([optim == "adafactor", optim == "adamw_bnb_8bit"], [14.0 * N, 22.0 * N], 28.0 * N)
    update_cpu = np.select(
        [optim == "adamw_torch_fused", optim == "adamw_torch", optim == "adafactor"],
        [0.0003, 0.0003 + t["param_tensors"] * 4e-6, t["param_tensors"] * t["adafactor_us_per_tensor"] * 1e-6],
        t["param_tensors"] * 12e-6,
    )
    update_gpu = update_bytes / bw * np.where(optim == "adamw_torch_fused", 0.8, 1.0) * np.where(optim == "adafactor", 1.5, 1.0)
    opt_s = t["host_step_s"] + np.maximum(update_cpu, update_gpu) + np.where(prec == "fp16", t["scaler_s"] + 8.0 * N / bw, 0.0)
    compute_step_s = acc * micro_s + opt_s

    # --- input
    c_in = t["loader_s_per_sample"]
    samples = b * acc
    useful = np.minimum(workers, max(1, t["cores"] - 2))
    contention = 1.0 / (1.0 + 0.04 * np.maximum(workers - (t["cores"] - 2), 0) + 0.02 * workers)
    rate = np.where(workers > 0, useful * contention / c_in, np.inf)
    step_s = np.where(workers > 0,
                      np.maximum(compute_step_s, samples / rate) + acc * t["worker_ipc_s"],
                      compute_step_s + samples * c_in)
    return {"step_s": step_s, "compute_step_s": compute_step_s, "input_step_s": np.where(workers > 0, samples / rate, samples * c_in), "samples_per_s": samples / step_s, "peak_bytes": peak,
            "micro_s": micro_s, "gpu_s": gpu_s, "dispatch_s": dispatch, "logits_bytes": logits, "acts_bytes": acts}


def _statuses(t: dict[str, Any], g: dict[str, np.ndarray], peak: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    prec, comp, attn = g["precision"], g["torch_compile"], g["attn_implementation"]
    status = np.full(len(prec), "ok", dtype=object)
    crash = np.zeros(len(prec), dtype=bool)
    if t["pre_ampere"]:
        crash |= (prec == "bf16") | (attn == "flash_attention_2")
    crash |= (attn == "flash_attention_2") & ((prec == "fp32") | (prec == "tf32"))
    if t["compile_crash"] == "all":
        crash |= comp != "off"
    elif t["compile_crash"] == "max-autotune":
        crash |= comp == "inductor:max-autotune"
    margin = t["ceiling_bytes"] * (1 - t["fragmentation"] * rng.uniform(*MARGIN_SPREAD, len(prec)))
    oom = ~crash & (peak > margin)
    diverged = ~crash & ~oom & (prec == "fp16") if t["fp16_diverges"] else np.zeros(len(prec), dtype=bool)
    status[crash] = "crash"
    status[oom] = "oom"
    status[diverged] = "diverged"
    return status


def _margin_proof_ceiling(traits: dict[str, Any]) -> float:
    """The peak under which a row fits whatever out-of-memory margin it draws (:func:`_statuses`)."""
    return float(traits["ceiling_bytes"]) * (1 - traits["fragmentation"] * MARGIN_SPREAD[1])


def _build_frame(d: Draw) -> pd.DataFrame:
    t, g = dict(d.traits), _grid()
    if t["input_bound"]:
        # Input-bound: the loader's cost is set against the best compute this draw reaches under its cap,
        # so that about workers_needed workers keep up with it and fewer leave the GPU waiting.
        free = model({**t, "loader_s_per_sample": 1e-12}, g)
        fits = free["peak_bytes"] <= _margin_proof_ceiling(t)
        best = float(np.max(np.where(fits, free["samples_per_s"], 0.0))) or 1.0
        t["loader_s_per_sample"] = t["workers_needed"] / best
        d.traits["loader_s_per_sample"] = t["loader_s_per_sample"]
    parts = model(t, g)
    noise_rng = np.random.default_rng([_SALT, GEN2_VERSION, d.index, 1, d.noise_stream])
    status = _statuses(t, g, parts["peak_bytes"], np.random.default_rng([_SALT, GEN2_VERSION, d.index, 2]))
    n = len(status)
    ok = status == "ok"
    true_sps = parts["samples_per_s"]
    measured = true_sps * np.exp(noise_rng.normal(0.0, t["noise_sigma"], n))
    true_peak = parts["peak_bytes"]
    measured_peak = np.where(ok, np.minimum(true_peak * (1 + noise_rng.uniform(-0.003, 0.003, n)), t["ceiling_bytes"]),
                             np.minimum(true_peak, t["ceiling_bytes"]) * noise_rng.uniform(0.75, 0.99, n))
    # Probe cost.
    comp, ckpt = g["torch_compile"], g["gradient_checkpointing"].astype(bool)
    workers = g["dataloader_num_workers"].astype(float)
    compile_cold = np.select([comp == "inductor", comp == "inductor:max-autotune"],
                             [t["compile_cold_s"], t["compile_cold_s"] * t["autotune_compile_factor"]], 0.0)
    compile_cold = compile_cold * np.where(ckpt, 1.2, 1.0)
    compile_warm = np.where(comp == "off", 0.0, np.where(ckpt, compile_cold, t["compile_warm_s"]))
    start = t["load_s"] + workers * t["worker_spawn_s"]
    steps_s = (3 + t["measured_steps"]) * parts["step_s"]
    probe_cold = np.select([status == "ok", status == "oom", status == "diverged"],
                           [start + compile_cold + steps_s, start + 0.5 * compile_cold + 1.0 + parts["step_s"],
                            start + compile_cold + 5 * parts["step_s"]],
                           start + 0.6 * compile_cold + 1.0)
    probe_warm = probe_cold - (compile_cold - compile_warm) * np.select([status == "ok", status == "oom", status == "diverged"], [1.0, 0.5, 1.0], 0.6)
    frame = pd.DataFrame({name: g[name] for name in GRID})
    frame["status"] = status
    frame["samples_per_s"] = np.where(ok, measured, np.nan)
    frame["peak_mem_bytes"] = measured_peak.astype(np.int64)
    frame["probe_s"] = np.round(probe_cold, 3)
    frame["probe_warm_s"] = np.round(probe_warm, 3)
    # What a live probe reports besides (autotune.records.ProbeResult): start-up, and the warm-up steps with the
    # compilation (cold; the cached evaluator's cheaper compile is taken off by the replay).
    frame["setup_s"] = np.round(start, 3)
    frame["warmup_s"] = np.where(ok, np.round(compile_cold + 3 * parts["step_s"], 3), np.nan)
    frame["true_samples_per_s"] = true_sps
    frame["true_peak_mem_bytes"] = true_peak.astype(np.int64)
    return frame


# ---------------------------------------------------------------------- the expert rule


def expert_params(d: Draw) -> TrialParams:
    """The expert rule's configuration on draw ``d``, or its first runnable neighbour.

    The rule: bf16 where it runs, else fp16, else fp32; the fastest attention kernel that runs, in an
    expert's order of preference (flash_attention_2, sdpa, eager: no measuring); adamw_torch_fused;
    compiled with inductor (default mode); no checkpointing; accumulation 1; 4 loader workers; the
    largest batch whose row is ok under the ceiling. Where no batch of that runs, its neighbours in
    the same order of preference: the next precision or kernel, then compile off, then checkpointing
    on, then a lighter optimizer (adamw_bnb_8bit, adafactor) where the model's state does not fit. "Runs" reads the table's status (crash, diverged), as an expert who has tried would know.
    """
    frame = d.frame()
    runs = ~frame["status"].isin(["crash", "diverged"])
    ok = (frame["status"] == "ok") & (frame["true_peak_mem_bytes"] <= d.ceiling_bytes)
    base = (frame["gradient_accumulation_steps"] == 1) & (frame["dataloader_num_workers"] == EXPERT_WORKERS)
    choice = []  # precision, kernel and compile by what runs; then what fits
    for precision, attn, compile_ in itertools.product(EXPERT_PRECISIONS, EXPERT_ATTENTION, EXPERT_COMPILE):
        mask = (frame["precision"] == precision) & (frame["attn_implementation"] == attn) & (frame["torch_compile"] == compile_)
        if (runs & mask).any():
            choice.append(mask)
    for mask in choice:
        for optim, ckpt in itertools.product(EXPERT_OPTIMS, (False, True)):
            fits = ok & base & mask & (frame["optim"] == optim) & (frame["gradient_checkpointing"] == ckpt)
            if fits.any():
                row = frame[fits].sort_values("per_device_train_batch_size").iloc[-1]
                return TrialParams.from_dict({n: _python(row[n]) for n in GRID})
    raise ValueError(f"draw {d.index}: nothing of the expert rule's family runs")


def _python(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


# ---------------------------------------------------------------------- replaying with inductor's cache


class CachedReplayEvaluator(ReplayEvaluator):
    """A :class:`~autotune.search.replay.ReplayEvaluator` that charges ``probe_warm_s`` instead of
    ``probe_s`` to a probe whose compiled graph (:data:`autotune.params.COMPILED_GRAPH_PARAMS`) an
    earlier probe of the same search compiled (inductor's cache: ~10 s against 30-45 s cold; a
    checkpointed graph pays in full every time). A compile that crashed leaves nothing cached.
    Everything else is the replay's own :meth:`ReplayEvaluator.evaluate`; only :meth:`probe_cost_s` differs."""

    def __init__(self, table: ReplayTable, log: list[Any] | None = None) -> None:
        super().__init__(table)
        self._compiled: set[tuple[Any, ...]] = set()
        self._log = log

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> Any:
        started_s = self.clock.now()
        result = super().evaluate(params, timeout_s=timeout_s)
        if self._log is not None:
            self._log.append((started_s, params, result))
        return result

    def probe_cost_s(self, params: TrialParams, row: pd.Series) -> float:
        if params.torch_compile == "off":
            return super().probe_cost_s(params, row)
        graph = tuple(getattr(params, n) for n in COMPILED_GRAPH_PARAMS)
        warm = graph in self._compiled
        if row["status"] != ProbeStatus.CRASH.value:
            self._compiled.add(graph)
        return float(row["probe_warm_s"]) if warm else super().probe_cost_s(params, row)


# ---------------------------------------------------------------------- one scored search


def search_draw(strategy: Any, index: int, budget_s: float, seed: int, noise_stream: int = 0, log: list[Any] | None = None) -> dict[str, Any]:
    """One search of ``strategy`` on draw ``index``; the returned configuration scored noise-free,
    against the draw's optimum under its ceiling and against the expert rule's configuration.
    ``log``, if given, receives ``(virtual start s, configuration, result)`` per probe."""
    import optuna

    from autotune.probe.device import loader_cores
    from autotune.search.loop import SearchSettings, ranked_configurations, run_search
    from autotune.search.strategies.registry import make_strategy
    from autotune.studies import reading

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    d = _cached_draw(index, noise_stream)
    table = _cached_table(d)
    space = table.space()
    best_sps = float(d.true_best()["true_samples_per_s"])
    try:
        expert: TrialParams | None = expert_params(d)
    except ValueError:  # no configuration of the rule's family runs on this draw: nothing to be slower than
        expert = None
    expert_sps = d.true_samples_per_s(expert) if expert is not None else 0.0
    evaluator = CachedReplayEvaluator(table, log)
    chosen = make_strategy(strategy) if isinstance(strategy, str) else strategy
    study = optuna.create_study(direction="maximize", sampler=chosen.sampler(seed))
    # The host's cores, as a run reads them (autotune.probe.device.loader_cores).
    settings = SearchSettings(memory_ceiling_bytes=d.ceiling_bytes, budget_s=budget_s, seed=seed, min_probe_s=1.0,
                              loader_cores=loader_cores(1, host_cpus=int(d.traits["cores"])))
    started = time.process_time()
    from bench.table_expert import table_expert

    # The search runs the product's own expert rule, its batch from the memory model of the model's dimensions
    # (a crashed row's recorded peak says nothing of fitting), and its memory model starts from them, as a run's do.
    memory = MemoryModel(d.model_dims(), int(d.traits["seq"]))
    outcome = run_search(study, space, evaluator, settings, baseline=space.baseline(), expert=table_expert(table, d.ceiling_bytes, memory),
                         clock=evaluator.clock, strategy=chosen, memory=memory)
    cpu_s = time.process_time() - started
    ranked = ranked_configurations(study, d.ceiling_bytes)
    row: dict[str, Any] = {
        "strategy": chosen.name, "draw": index, "budget_s": budget_s, "seed": seed, "ratio": 0.0, "over_ceiling": 0,
        "oom_probes": evaluator.oom_probes, "probes": outcome.probes_run, "pruned": outcome.pruned,
        "virtual_s": evaluator.clock.now(), "cpu_s": round(cpu_s, 3), "found": "", "true_best": _short(d.true_best()),
        "measured_ratio": 0.0, "expert": expert.short() if expert is not None else "", "expert_ratio": expert_sps / best_sps, "found_precision": "",
    }
    scored = [d.true_samples_per_s(c.params) for c in ranked]
    row["measured_ratio"] = max(scored, default=0.0) / best_sps
    row["unasked"] = ""
    if ranked:
        found = ranked[0].params
        peak = int(d.frame().iloc[d._position(found)]["peak_mem_bytes"])
        row["ratio"] = scored[0] / best_sps
        row["over_ceiling"] = int(peak > d.ceiling_bytes)
        row["found"] = found.short()
        row["found_precision"] = found.precision
        row["unasked"] = " ".join(unasked_runnable(d, space, found, reading.stored_probes(study), settings.loader_cores))
    return row


def unasked_runnable(d: Draw, space: Any, found: TrialParams, probes: list[Any], loader_cores: int | None) -> list[str]:
    """#44's "every dimension asked near the incumbent": the dimensions no probe asked near the returned
    configuration (:func:`autotune.search.strategies.coverage.unasked`) although one of their variants
    there (:func:`~autotune.search.strategies.coverage.variants`, at its batch; checkpointing on, at a larger one) runs and fits on the draw:
    the noise-free truth stands in for what the memory model or the failures may rule out."""
    from autotune.search.strategies import coverage

    return [dim for dim in coverage.unasked(space, found, probes)
            if any(d.true_samples_per_s(v) > 0 for v in coverage.variants(space, found, dim, probes, loader_cores))]


def _short(row: pd.Series) -> str:
    return TrialParams.from_dict({n: _python(row[n]) for n in GRID}).short()


_DRAWS: dict[tuple[int, int], Draw] = {}
_TABLES: dict[str, ReplayTable] = {}


def _cached_draw(index: int, noise_stream: int) -> Draw:
    key = (index, noise_stream)
    if key not in _DRAWS:
        _DRAWS.clear()  # searches come ordered by draw: one at a time
        _TABLES.clear()
        _DRAWS[key] = draw(index, noise_stream)
    return _DRAWS[key]


def _cached_table(d: Draw) -> ReplayTable:
    if d.name not in _TABLES:
        _TABLES[d.name] = d.table()
    return _TABLES[d.name]


def describe(d: Draw) -> str:
    t = d.traits
    best = d.true_best()
    expert = expert_params(d)
    frame = d.frame()
    counts = frame["status"].value_counts().to_dict()
    lines = [
        f"{d.name}: {t['device_gib']:.0f} GiB card{' (pre-Ampere-like)' if t['pre_ampere'] else ''}, ceiling {d.ceiling_bytes / GIB:.1f} GiB, "
        f"{t['cores']} cores; model {t['params'] / 1e6:.0f} M params ({t['layers']} layers x {t['hidden']}), seq {t['seq']}, vocab {t['vocab']}",
        f"input-bound: {t['input_bound']}; compile crash: {t['compile_crash']}; fp16 diverges: {t['fp16_diverges']}; statuses {counts}",
        f"optimum {best['true_samples_per_s']:.1f} samples/s: {_short(best)}",
        f"expert rule {d.true_samples_per_s(expert):.1f} samples/s ({d.true_samples_per_s(expert) / best['true_samples_per_s']:.3f}): {expert.short()}",
    ]
    return "\n".join(lines)


def margin_proof_figures(details: pd.DataFrame) -> dict[str, float]:
    """Median, 5th percentile, worst and draws below 0.95 of ``bench.search --details`` rows (one strategy and
    budget) scored against each draw's :meth:`Draw.margin_proof_best_sps` instead of its optimum (a returned
    row faster than that, one that fitted by its margin's luck, counts as 1)."""
    ratios = []
    for _, row in details.iterrows():
        d = draw(int(row["draw"]))
        proof_sps = d.margin_proof_best_sps()
        found_sps = float(row["ratio"]) * float(d.true_best()["true_samples_per_s"])
        ratios.append(min(1.0, found_sps / proof_sps) if proof_sps > 0 else 1.0)
    values = np.array(ratios)
    return {"median": round(float(np.median(values)), 3), "p5": round(float(np.percentile(values, 5)), 3),
            "worst": round(float(values.min()), 3), "below_095": int((values < 0.95).sum())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.landscapes2", description=__doc__.splitlines()[0])
    parser.add_argument("draw", type=int, nargs="?", default=None)
    parser.add_argument("--write", default=None, help="write the draw's replay table here (.csv or .csv.gz)")
    parser.add_argument("--margin-proof", default=None, metavar="DETAILS.csv",
                        help="score a bench.search --details file of this generator against each draw's optimum that fits whatever its margin")
    args = parser.parse_args(argv)
    if args.margin_proof:
        details = pd.read_csv(args.margin_proof)
        for (strategy, budget_s), rows in details.groupby(["strategy", "budget_s"]):
            print(f"{strategy} {budget_s:.0f} s: against the margin-proof optimum {margin_proof_figures(rows)}")
        return 0
    if args.draw is None:
        parser.error("give a draw number, or --margin-proof DETAILS.csv")
    d = draw(args.draw)
    print(describe(d))
    if args.write:
        d.write(args.write)
        print(f"wrote {args.write}: replay it at the ceiling {d.ceiling_bytes} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
