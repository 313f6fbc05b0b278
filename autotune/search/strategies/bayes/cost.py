"""Probe seconds: start-up, compilation per mode and the measured window, learnt from the probes'
own timings (priors until then). A graph compiled before in the run costs what such recompilations
measured (inductor's cache, shared by the run's probes); a failure costs what failing costs."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from autotune.defaults import WARMUP_STEPS  # the probe's: compilation happens there
from autotune.params import COMPILED_GRAPH_PARAMS
from autotune.records import Probe, ProbeStatus
from autotune.search.strategies.bayes.context import Context

STARTUP_PRIOR_S = 30.0
COMPILE_PRIOR_S = {"default": 60.0, "max-autotune": 200.0}  # before a compiled probe was timed
MAX_AUTOTUNE_COMPILE_FACTOR = 3.0  # max-autotune's compilation over the plain mode's, until timed
WINDOW_PRIOR = (20.0, 8.0)  # measured window: at least this many seconds, or this many steps


def probe_costs(context: Context, history: list[Probe], mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Seconds a probe takes if it runs, and if it fails (start-up, the compilation, a step: an
    out-of-memory step comes after compiling), on the grid; ``mean`` is the expected log samples/s."""
    grid = context.grid
    setups = [p.result.setup_s for p in history if p.result.setup_s]
    startup = statistics.median(setups) if setups else STARTUP_PRIOR_S
    # Compilations, per mode: of a graph compiled for the first time in this run, and of one compiled
    # before, which inductor's cache may serve; the latter apart per checkpointing and attention
    # kernel (recompiling from the cache took 11-14 s or, as if cold, 36-51 s by those on an H100).
    cold_s: dict[str, list[float]] = {}
    cached_s: dict[tuple[Any, ...], list[float]] = {}
    graph_dims = [d for d in COMPILED_GRAPH_PARAMS if d in grid.names]
    cache_dims = tuple(d for d in ("gradient_checkpointing", "attn_implementation") if d in grid.names)
    compiled: set[tuple[Any, ...]] = set()
    windows, steps = [], []
    for probe in history:
        r = probe.result
        if probe.params.torch_compile != "off" and not r.ok and r.status is not ProbeStatus.TIMEOUT and r.wall_s:
            # Failed after its compilation (out of memory or a crash in a step): what it ran past
            # start-up is its compilation and a step or two, the best estimate until one runs.
            graph = tuple(getattr(probe.params, d) for d in graph_dims)
            if graph not in compiled and r.wall_s > (r.setup_s or startup):
                cold_s.setdefault(probe.params.torch_compile, []).append(r.wall_s - (r.setup_s or startup))
                compiled.add(graph)
            continue
        if not (r.ok and r.wall_s and r.step_time_s):
            continue
        warmup = r.warmup_s if r.warmup_s is not None else WARMUP_STEPS * r.step_time_s
        if probe.params.torch_compile != "off":
            graph = tuple(getattr(probe.params, d) for d in graph_dims)
            compile_s = max(warmup - WARMUP_STEPS * r.step_time_s, 0.0)
            if graph in compiled:
                cached_s.setdefault((probe.params.torch_compile, *(getattr(probe.params, d) for d in cache_dims)), []).append(compile_s)
            else:
                cold_s.setdefault(probe.params.torch_compile, []).append(compile_s)
            compiled.add(graph)
        window = r.wall_s - (r.setup_s or startup) - warmup
        if window > 0:
            windows.append(window)
            steps.append(window / r.step_time_s)
    # The window is the longer of a time floor and a step count: the smallest of each seen bounds them.
    window_s, window_steps = (min(windows), min(steps)) if windows else WINDOW_PRIOR
    known = {m: statistics.median(v) for m, v in cold_s.items() if v}
    table = []
    for mode in grid.values["torch_compile"]:
        if mode == "off":
            table.append(0.0)
        elif mode in known:
            table.append(known[mode])
        elif "max-autotune" in mode:
            # Autotuning benchmarks kernel candidates: several times the plain mode's compilation.
            table.append(MAX_AUTOTUNE_COMPILE_FACTOR * max(known.values()) if known else COMPILE_PRIOR_S["max-autotune"])
        else:
            table.append(statistics.median(list(known.values())) if known else COMPILE_PRIOR_S["default"])
    modes = list(grid.values["torch_compile"])
    compile_grid = np.array(table).reshape(grid.broadcast_shape(("torch_compile",)))

    def again(**v: Any) -> float:
        """A graph compiled before: what such recompilations measured (no cheaper until one was)."""
        first = table[modes.index(v["torch_compile"])]
        measured = cached_s.get((v["torch_compile"], *(v[d] for d in cache_dims)))
        return min(statistics.median(measured), first) if measured else first

    if compiled and cached_s:
        seen = grid.along(graph_dims, lambda **v: float(tuple(v[d] for d in graph_dims) in compiled)) > 0
        compile_grid = np.where(seen, grid.along(("torch_compile", *cache_dims), again), compile_grid)
    step_s = context.accum_values * context.batch_values / np.exp(mean)
    cost_ok = startup + compile_grid + WARMUP_STEPS * step_s + np.maximum(window_s, window_steps * step_s)
    # A compiled probe out of memory compiled first (polyglot-ko-1.3b: 74 s on an H100 and 49 s on an H200,
    # where compiling took 64 and 63 s), as the learning above reads a failed compiled probe's time.
    cost_fail = startup + compile_grid + step_s / np.maximum(context.accum_values, 1.0)
    return np.broadcast_to(cost_ok, grid.shape), np.broadcast_to(cost_fail, grid.shape)
