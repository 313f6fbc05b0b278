"""The seven phases of the GPU acceptance run (see :mod:`bench.gpu_acceptance` for how to run them).

Every phase is a function ``phase(ctx: Context) -> PhaseOutput``: ``data`` (status, reason and
figures; it becomes ``<phase>.json``) and ``markdown`` (its section of ``summary.md``). A phase keeps
to ``ctx.box_s``: each probe's deadline is at most what is left of the box, and a phase that runs
out stops where it is and returns status ``timeout`` with what it measured. What a phase measured
so far is also kept in ``ctx.partial``, so that a phase stopped from outside (its box plus a grace
period, by :mod:`bench.gpu_acceptance`) still leaves its rows.

Statuses: ``ok`` (ran, its targets met), ``flagged`` (ran, a target missed: ``reason`` says
which), ``skipped`` (did not apply here: ``reason`` says why), ``timeout`` (stopped at its box),
``refused`` (its box cannot hold what it must run, never run shorter: ``reason`` names the box it needs),
``error`` (a bug in this harness: ``reason`` holds the traceback's last line).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from autotune.models import ModelSpec, resolve_model
from autotune.params import COMPILED_GRAPH_PARAMS, PARAM_DEFAULTS, PARAM_NAMES, PRECISIONS, TrialParams
from autotune.probe.evaluator import ProbeEvaluator
from autotune.records import DeviceInfo, ProbeResult
from autotune.units import GiB, format_bytes, format_duration

REPO = Path(__file__).resolve().parent.parent
COMPILE_MODES = ("off", "inductor", "inductor:max-autotune")
RATIO_TOLERANCE = 0.05  # a plain Trainer must agree with the probe within 5%
CV_TARGET = 0.02
OVERHEAD_TARGET_S = 2.0


# The grid of the H100 tables recorded on 2026-11-22/23 (pythia-160m seq 128 under a 9 GiB ceiling, two values per
# dimension): launch-bound and separating no strategy, kept to read those tables and as the tests' small grid.
PYTHIA_160M_GRID: dict[str, tuple[Any, ...]] = {
    "per_device_train_batch_size": (8, 64),
    "gradient_accumulation_steps": (1, 2),
    "precision": ("fp32", "bf16"),
    "optim": ("adamw_torch_fused", "adafactor"),
    "torch_compile": ("off", "inductor"),
    "attn_implementation": ("eager", "sdpa"),
    "dataloader_num_workers": (0, 2),
    "gradient_checkpointing": (False, True),
}


@dataclass(frozen=True)
class Plan:
    """What every phase runs: the full GPU plan, or :data:`QUICK` (tiny model, seconds per phase)."""

    quick: bool
    total_s: float  # the whole run; the landscape gets what the other phases leave
    boxes_s: dict[str, float]  # per-phase time box (the landscape's: its share when run alone)
    landscape_floor_s: float  # the least the landscape gets in a whole run
    grace_s: float  # past its box (+ this) a phase is stopped from outside
    # Probe lengths: "standard" as autotune runs them, "short" where only fit/no-fit matters.
    warmup_steps: int
    measure_steps: int
    max_measure_steps: int
    max_measure_s: float
    short_warmup_steps: int
    short_measure_steps: int
    probe_cap_s: float  # one probe's deadline at most (compilation included)
    repeat_model: str
    repeat_seq_len: int
    repeat_batch: int
    repeat_runs: int
    pc_model: str
    pc_seq_len: int
    pc_batch: int
    pc_compile_on_cpu: bool
    ceiling_model: str
    ceiling_seq_len: int
    ceiling_bytes: int | None  # None: the memory model's prediction at batch 8 (a boundary near 8)
    ceiling_factors: tuple[float, ...]  # batches probed, relative to the predicted largest batch
    run_model: str
    run_seq_len: int
    run_budget_s: float
    run_space: str
    run_report_reserve_s: float
    sbs_model: str
    sbs_seq_len: int
    auto_find_start: int
    auto_find_steps: int
    finder_start: int
    finder_max: int
    finder_max_trials: int
    sbs_run_budget_s: float  # the side-by-side's own autotune run
    sbs_rows_reserve_s: float  # what its other rows need after the run (the phase is refused in a smaller box)
    bf16_user_batch: int
    timed_measure_steps: int
    land_model: str
    land_seq_len: int
    land_grid: dict[str, tuple[Any, ...]]
    land_card_ceiling: bool  # True: the run's own ceiling on the card's memory; False: one between the largest batches' peaks
    land_repeat_every: int  # after this many new rows, one measured row probed again (the table's own noise)
    land_reserve_s: float  # kept for bench.search at the end of the landscape's box
    bench_seeds: int
    bench_budget_fraction: float  # bench.search's virtual budget: this share of the table's total probe time


FULL = Plan(
    quick=False,
    total_s=25 * 60,
    boxes_s={
        "tests": 180, "repeatability": 100, "precision_compile": 240, "ceiling": 75, "run": 320, "side_by_side": 540,
        "landscape": 540,  # alone (--phase landscape): under 10 minutes a call, it goes on from the rows already probed
    },
    landscape_floor_s=240,
    grace_s=60,
    warmup_steps=3, measure_steps=8, max_measure_steps=50, max_measure_s=8.0,
    short_warmup_steps=1, short_measure_steps=1,
    probe_cap_s=240,
    repeat_model="polyglot-ko-1.3b", repeat_seq_len=512, repeat_batch=16, repeat_runs=5,
    pc_model="pythia-410m", pc_seq_len=512, pc_batch=8, pc_compile_on_cpu=True,
    ceiling_model="pythia-410m", ceiling_seq_len=512, ceiling_bytes=16 * GiB, ceiling_factors=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
    run_model="polyglot-ko-1.3b", run_seq_len=512, run_budget_s=540, run_space="default", run_report_reserve_s=20,  # the box (320 s in a whole run) clamps it
    sbs_model="polyglot-ko-1.3b", sbs_seq_len=512, auto_find_start=64, auto_find_steps=3,
    finder_start=8, finder_max=1024, finder_max_trials=25, sbs_run_budget_s=200, sbs_rows_reserve_s=300, bf16_user_batch=16,
    timed_measure_steps=20,
    # polyglot-ko-1.3b at seq 512 on the card's memory: 960 configurations, about 3 hours of probes, so it is
    # recorded over many 8-minute calls (--phase landscape --box landscape=480 --out DIR goes on where the rows
    # stop). Uncompiled first (5-20 s a probe, out-of-memory rows 3-6 s), then inductor (~85 s a cold
    # compilation, one per graph), then max-autotune; each complete sub-grid is written as a table on the way.
    land_model="polyglot-ko-1.3b", land_seq_len=512,
    land_grid={
        "per_device_train_batch_size": (8, 16, 32, 48, 64),
        "gradient_accumulation_steps": (1, 4),
        "precision": ("fp32", "bf16"),
        "optim": ("adamw_torch_fused", "adafactor"),
        "torch_compile": ("off", "inductor", "inductor:max-autotune"),
        "attn_implementation": ("eager", "sdpa"),
        "dataloader_num_workers": (0, 2),
        "gradient_checkpointing": (False, True),
    },
    land_card_ceiling=True, land_repeat_every=20,
    land_reserve_s=60, bench_seeds=5, bench_budget_fraction=1 / 3,
)

QUICK = replace(
    FULL,
    quick=True,
    total_s=5 * 60,
    boxes_s={"tests": 60, "repeatability": 40, "precision_compile": 60, "ceiling": 40, "run": 30, "side_by_side": 150, "landscape": 60},
    landscape_floor_s=30,
    grace_s=15,
    warmup_steps=1, measure_steps=2, max_measure_steps=2, max_measure_s=2.0,
    probe_cap_s=60,
    repeat_model="tiny-gptneox", repeat_seq_len=32, repeat_batch=4, repeat_runs=2,
    pc_model="tiny-gptneox", pc_seq_len=32, pc_batch=4, pc_compile_on_cpu=False,
    ceiling_model="tiny-gptneox", ceiling_seq_len=32, ceiling_bytes=None, ceiling_factors=(1.0, 2.0),
    run_model="tiny-gptneox", run_seq_len=32, run_budget_s=10, run_space="quick", run_report_reserve_s=10,
    sbs_model="tiny-gptneox", sbs_seq_len=32, auto_find_start=16, auto_find_steps=2,
    finder_start=2, finder_max=8, finder_max_trials=4, sbs_run_budget_s=30, sbs_rows_reserve_s=30, bf16_user_batch=4,
    timed_measure_steps=4,
    land_model="tiny-gptneox", land_seq_len=32, land_card_ceiling=False, land_repeat_every=3,
    land_grid={
        "per_device_train_batch_size": (2, 8),
        "gradient_accumulation_steps": (1,),
        "precision": ("fp32",),
        "optim": ("adamw_torch_fused",),
        "torch_compile": ("off",),
        "attn_implementation": ("sdpa",),
        "dataloader_num_workers": (0,),
        "gradient_checkpointing": (False, True),
    },
    land_reserve_s=20, bench_seeds=2, bench_budget_fraction=1 / 3,
)


class PhaseOutput(NamedTuple):
    """What a phase returns: ``data`` (-> ``<phase>.json``; has ``status`` and ``reason``) and its summary section."""

    data: dict[str, Any]
    markdown: str


@dataclass
class Context:
    """What a phase gets: where to write, the device, the plan, its time box."""

    name: str
    out: Path
    device: DeviceInfo
    plan: Plan
    box_s: float
    slug: str
    started: float = field(default_factory=time.monotonic)
    partial: dict[str, Any] = field(default_factory=dict)  # rows measured so far, for a phase stopped from outside

    @property
    def probe_device(self) -> str:
        return f"cuda:{self.device.index}" if self.device.is_cuda else "cpu"

    @property
    def device_arg(self) -> str:
        """``--device`` as autotune's API takes it."""
        return f"cuda:{self.device.index}" if self.device.is_cuda else "cpu"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def remaining(self) -> float:
        return self.box_s - self.elapsed()

    def log(self, message: str) -> None:
        print(f"[{self.name} {self.elapsed():6.1f}s] {message}", flush=True)

    def evaluator(self, model: ModelSpec, seq_len: int, *, short: bool = False, ceiling: int | None = None) -> ProbeEvaluator:
        plan = self.plan
        return ProbeEvaluator(
            model=model.to_dict(), seq_len=seq_len, device=self.probe_device, memory_ceiling_bytes=ceiling,
            warmup_steps=plan.short_warmup_steps if short else plan.warmup_steps,
            measure_steps=plan.short_measure_steps if short else plan.measure_steps,
            max_measure_steps=plan.short_measure_steps if short else plan.max_measure_steps,
            max_measure_s=plan.max_measure_s,
        )

    def probe(self, evaluator: ProbeEvaluator, params: TrialParams, *, reserve_s: float = 0.0) -> ProbeResult | None:
        """One probe with a deadline inside the box; None when too little of the box is left to start one."""
        timeout_s = min(self.plan.probe_cap_s, self.remaining() - reserve_s)
        if timeout_s < (2.0 if self.plan.quick else 10.0):
            return None
        self.log(f"probe {params.short()} (deadline {timeout_s:.0f}s)")
        result = evaluator.evaluate(params, timeout_s=timeout_s)
        figure = f"{result.samples_per_s:.2f} samples/s" if result.ok and result.samples_per_s else _first_line(result.error)
        self.log(f"  -> {result.status} {figure} ({result.wall_s or 0:.1f}s)")
        return result


# ---------------------------------------------------------------------------------------- formatting


def _first_line(text: str | None, limit: int = 160) -> str:
    if not text:
        return ""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    # A traceback's last line says what went wrong; a one-line error is itself.
    return (lines[-1] if lines else "")[:limit]


def fmt(value: Any, kind: str = "") -> str:
    """A table cell: ``-`` for missing, units by kind."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "bytes":
        return format_bytes(value)
    if kind == "s":
        return format_duration(value)
    if kind == "pct":
        return f"{100 * float(value):.1f}%"
    if kind == "ratio":
        return f"{float(value):.3f}"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value).replace("|", "\\|")


def md_table(headers: Iterable[str], rows: Iterable[Iterable[Any]]) -> str:
    headers = list(headers)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell).replace("\n", " ") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def probe_row(params: TrialParams, result: ProbeResult | None, **extra: Any) -> dict[str, Any]:
    """One probe as a JSON row: its configuration, outcome and every figure the summary shows."""
    row: dict[str, Any] = {"config": params.short(), **params.to_dict(), **extra}
    if result is None:
        row.update(status="not run", error="no time left in the phase's box")
        return row
    row.update(
        status=str(result.status), samples_per_s=result.samples_per_s, tokens_per_s=result.tokens_per_s,
        step_time_s=result.step_time_s, measured_steps=result.measured_steps, step_time_ci95_rel=result.step_time_ci95_rel,
        stable=result.stable, peak_mem_bytes=result.peak_mem_bytes, peak_reserved_bytes=result.peak_reserved_bytes,
        peak_device_used_bytes=result.peak_device_used_bytes, mfu=result.mfu, achieved_tflops=result.achieved_tflops,
        energy_per_sample_j=result.energy_per_sample_j, power_mean_w=result.power_mean_w, gpu_util_mean_pct=result.gpu_util_mean_pct,
        wall_s=result.wall_s, overhead_s=result.overhead_s, model_build_s=result.model_build_s, warmup_s=result.warmup_s,
        matmul_precision=getattr(result, "matmul_precision", None),  # a newer ProbeResult field; absent before it
        compiled_graphs_measured=result.extra.get("compiled_graphs_measured"),
        input_wait_fraction=result.input_wait_fraction,
        error=None if result.ok else _first_line(result.error, 300),
    )
    return row


def output(status: str, reason: str, data: dict[str, Any], markdown: str) -> PhaseOutput:
    return PhaseOutput({"status": status, "reason": reason, **data}, markdown)


def skipped(reason: str, **data: Any) -> PhaseOutput:
    return output("skipped", reason, data, f"Skipped: {reason}.")


def _precision_for(device: DeviceInfo) -> str:
    """The 16-bit precision this device trains in (bf16 from Ampere, else fp16; the CPU: bf16)."""
    if device.supports_bf16:
        return "bf16"
    return "fp16" if device.is_cuda else "fp32"


def _unsupported(device: DeviceInfo, precision: str) -> str | None:
    if precision == "tf32" and not device.supports_tf32:
        return "TF32 needs an Ampere or newer GPU"
    if precision == "bf16" and not device.supports_bf16:
        return "bf16 needs an Ampere or newer GPU"
    if precision == "fp16" and not device.is_cuda:
        return "fp16 mixed precision needs a GPU"
    return None


# ---------------------------------------------------------------------------------------- 1. tests


def phase_tests(ctx: Context) -> PhaseOutput:
    """``pytest -m gpu``: the test suite's CUDA-only tests, passed/failed/skipped."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return skipped("pytest is not installed (`make wheelhouse` brings it)")
    if not ctx.device.is_cuda:  # every gpu-marked test skips itself without CUDA: no nested pytest to learn that
        data = {"returncode": None, "passed": 0, "failed": 0, "error": 0, "skipped": 0, "cases": [], "junit": None}
        return output("skipped", "no GPU test ran on the CPU: the gpu-marked tests need CUDA", data, "Not run: no CUDA device.")
    junit = ctx.out / "tests_junit.xml"
    # Only the files that hold gpu-marked tests: collecting the whole suite to deselect all but a handful costs tens of seconds.
    files = [str(path) for path in sorted(Path("tests").glob("test_*.py")) if "mark.gpu" in path.read_text(encoding="utf-8")]
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *(files or ["tests"])]
    ctx.log(" ".join(command[1:]))
    returncode, stdout = run_command(command, timeout_s=max(ctx.remaining(), 5.0))
    (ctx.out / "tests_output.txt").write_text(stdout, encoding="utf-8")
    if returncode is None:
        return output("timeout", f"pytest passed the {ctx.box_s:.0f}s box", {"output_tail": stdout[-2000:]}, "Stopped at its time box.")
    cases = _junit_cases(junit)
    counts = {k: sum(1 for c in cases if c["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
    data = {"returncode": returncode, **counts, "cases": cases, "junit": junit.name}
    table = md_table(["test", "outcome", "message"], [(c["name"], c["outcome"], fmt(c["message"])) for c in cases])
    ran = counts["passed"] + counts["failed"] + counts["error"]
    if returncode == 5 or not cases:
        return output("skipped", "no test is marked gpu", data, "No test is marked `gpu`.")
    if ran == 0:
        reasons = sorted({c["message"] for c in cases if c["message"]})
        where = "the CPU" if not ctx.device.is_cuda else ctx.device.name
        status = "skipped" if not ctx.device.is_cuda else "flagged"
        reason = f"no GPU test ran on {where}: all {counts['skipped']} gpu tests skipped ({'; '.join(reasons)})"
        return output(status, reason, data, table)
    status = "ok" if counts["failed"] == counts["error"] == 0 and returncode == 0 else "flagged"
    reason = f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, {counts['skipped']} skipped"
    return output(status, reason, data, table)


def _junit_cases(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                outcome, message = name, (element.get("message") or "").strip()
                break
        cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "message": message[:200]})
    return cases


def run_command(command: list[str], *, timeout_s: float, cwd: Path = REPO, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run a command in its own session; on the deadline kill its whole group. (returncode or None, output)."""
    import signal

    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as log:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            returncode: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        if returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.seek(0)
        return returncode, log.read()


# ---------------------------------------------------------------------------------------- 2. repeatability


def phase_repeatability(ctx: Context) -> PhaseOutput:
    """The same configuration probed N times, each in a fresh process: CV of samples/s, fixed overhead, model build."""
    plan = ctx.plan
    model = resolve_model(plan.repeat_model)
    params = TrialParams(per_device_train_batch_size=plan.repeat_batch, precision=_precision_for(ctx.device), attn_implementation="sdpa")
    evaluator = ctx.evaluator(model, plan.repeat_seq_len)
    rows = ctx.partial.setdefault("rows", [])
    for run in range(1, plan.repeat_runs + 1):
        result = ctx.probe(evaluator, params)
        rows.append(probe_row(params, result, run=run))
        if result is None:
            break
    ok = [r for r in rows if r["status"] == "ok"]
    rates = [r["samples_per_s"] for r in ok]
    overheads = [r["overhead_s"] for r in ok if r["overhead_s"] is not None]
    builds = [r["model_build_s"] for r in ok if r["model_build_s"] is not None]
    cv = statistics.stdev(rates) / statistics.fmean(rates) if len(rates) >= 2 else None
    data = {
        "model": model.name, "seq_len": plan.repeat_seq_len, "config": params.short(), "runs": rows, "cv": cv,
        "mean_samples_per_s": statistics.fmean(rates) if rates else None,
        "mean_overhead_s": statistics.fmean(overheads) if overheads else None, "max_overhead_s": max(overheads, default=None),
        "mean_model_build_s": statistics.fmean(builds) if builds else None,
        "cv_target": CV_TARGET, "overhead_target_s": OVERHEAD_TARGET_S,
    }
    table = md_table(
        ["run", "status", "samples/s", "CI95", "steps", "stable", "overhead", "model build", "wall"],
        [(r["run"], r["status"], fmt(r.get("samples_per_s")), fmt(r.get("step_time_ci95_rel"), "pct"), r.get("measured_steps", "-"),
          r.get("stable", "-"), fmt(r.get("overhead_s"), "s"), fmt(r.get("model_build_s"), "s"), fmt(r.get("wall_s"), "s")) for r in rows],
    )
    headline = (
        f"{model.name} seq {plan.repeat_seq_len} {params.short()}: {len(ok)}/{plan.repeat_runs} runs ok, "
        f"CV {fmt(cv, 'pct')} (target <= {CV_TARGET:.0%} on a GPU), fixed overhead mean {fmt(data['mean_overhead_s'], 's')} "
        f"(target <= {OVERHEAD_TARGET_S:.0f}s), model build mean {fmt(data['mean_model_build_s'], 's')}"
    )
    if len(ok) < len(rows) or len(rows) < plan.repeat_runs:
        status = "timeout" if any(r["status"] == "not run" for r in rows) else "flagged"
        return output(status, f"{len(ok)} of {plan.repeat_runs} runs ok", data, f"{headline}.\n\n{table}")
    missed = []
    if ctx.device.is_cuda and cv is not None and cv > CV_TARGET:
        missed.append(f"CV {cv:.1%} > {CV_TARGET:.0%}")
    if data["max_overhead_s"] is not None and data["max_overhead_s"] > OVERHEAD_TARGET_S:
        missed.append(f"fixed overhead up to {data['max_overhead_s']:.2f}s > {OVERHEAD_TARGET_S:.0f}s")
    met = "targets met" if ctx.device.is_cuda else "ran (the CV target is for a GPU)"
    return output("flagged" if missed else "ok", "; ".join(missed) or met, data, f"{headline}.\n\n{table}")


# ---------------------------------------------------------------------------------------- 3. precision x compile


def phase_precision_compile(ctx: Context) -> PhaseOutput:
    """One probe per precision x compile mode: status, samples/s, MFU and the matmul precision in force."""
    plan = ctx.plan
    model = resolve_model(plan.pc_model)
    evaluator = ctx.evaluator(model, plan.pc_seq_len)
    rows = ctx.partial.setdefault("rows", [])
    # Cheapest first: uncompiled, then inductor, then max-autotune (minutes per compile), bf16 first
    # within each (what people compile), so a box that runs out leaves the most informative subset.
    order = [(p, mode) for mode in COMPILE_MODES for p in ("bf16", "fp16", "tf32", "fp32")]
    for precision, mode in order:
        params = TrialParams(per_device_train_batch_size=plan.pc_batch, precision=precision, torch_compile=mode, attn_implementation="sdpa")
        why = _unsupported(ctx.device, precision)
        if why is None and mode != "off" and not ctx.device.is_cuda and not plan.pc_compile_on_cpu:
            why = "quick mode on the CPU: an inductor compile takes minutes on a few cores"
        if why:
            rows.append({**probe_row(params, None), "status": "skipped", "error": why})
            continue
        rows.append(probe_row(params, ctx.probe(evaluator, params)))
    rows.sort(key=lambda r: (PRECISIONS.index(r["precision"]), COMPILE_MODES.index(r["torch_compile"])))
    ran = [r for r in rows if r["status"] not in ("skipped", "not run")]
    crashes = [r for r in ran if r["status"] == "crash"]
    mfu_over = [r for r in ran if r.get("mfu") is not None and r["mfu"] >= 1]
    not_run = [r for r in rows if r["status"] == "not run"]
    data = {
        "model": model.name, "seq_len": plan.pc_seq_len, "batch": plan.pc_batch, "rows": rows,
        "crashes": len(crashes), "mfu_at_or_over_1": len(mfu_over), "not_run": len(not_run),
        "target": "no crash caused by our own settings; MFU < 1 everywhere",
        "target_met": not crashes and not mfu_over,
    }
    table = md_table(
        ["precision", "compile", "status", "samples/s", "MFU", "TFLOP/s", "matmul precision", "graphs in window", "error / reason"],
        [(r["precision"], r["torch_compile"], r["status"], fmt(r.get("samples_per_s")), fmt(r.get("mfu"), "pct"),
          fmt(r.get("achieved_tflops")), fmt(r.get("matmul_precision")), fmt(r.get("compiled_graphs_measured")), fmt(r.get("error"))) for r in rows],
    )
    headline = (
        f"{model.name} seq {plan.pc_seq_len} batch {plan.pc_batch}, sdpa, fused AdamW. Target: no crash caused by our own "
        f"settings, MFU < 1 everywhere: {'met' if data['target_met'] else 'NOT met'} ({len(crashes)} crashes, {len(mfu_over)} with MFU >= 1, "
        f"{len(ran)} probes ran, {len(not_run)} left out by the time box)"
    )
    if crashes or mfu_over:
        status, reason = "flagged", f"{len(crashes)} crashes, {len(mfu_over)} probes with MFU >= 1"
    elif not_run:
        status, reason = "timeout", f"{len(not_run)} probes did not fit in the {ctx.box_s:.0f}s box"
    else:
        status, reason = "ok", "no crash, MFU < 1 everywhere"
    return output(status, reason, data, f"{headline}.\n\n{table}")


# ---------------------------------------------------------------------------------------- 4. ceiling


def phase_ceiling(ctx: Context) -> PhaseOutput:
    """A memory ceiling below the card: batches across the predicted boundary; OOMs are ``oom``, nothing ok is over it."""
    from autotune.search.memory import MemoryModel
    from autotune.search.memory_prior import ModelDims

    plan = ctx.plan
    model = resolve_model(plan.ceiling_model)
    memory = MemoryModel(ModelDims.from_spec(model), plan.ceiling_seq_len)
    base = TrialParams(precision=_precision_for(ctx.device), attn_implementation="sdpa")
    ceiling = plan.ceiling_bytes if plan.ceiling_bytes is not None else memory.predict(base.replace(per_device_train_batch_size=8))
    assert ceiling is not None
    if ctx.device.is_cuda and ctx.device.total_memory_bytes <= ceiling:
        return skipped(f"{ctx.device.name} has {format_bytes(ctx.device.total_memory_bytes)}: not more than the {format_bytes(ceiling)} ceiling")
    predicted_best = memory.largest_batch_that_fits(base, range(1, 4097), ceiling)
    if predicted_best is None:
        return skipped(f"the memory model says not even batch 1 of {model.name} fits under {format_bytes(ceiling)}")
    batches = sorted({max(1, round(predicted_best * f)) for f in plan.ceiling_factors})
    evaluator = ctx.evaluator(model, plan.ceiling_seq_len, short=True, ceiling=ceiling)
    rows = ctx.partial.setdefault("rows", [])
    for batch in batches:
        params = base.replace(per_device_train_batch_size=batch)
        predicted = memory.predict(params)
        row = probe_row(params, ctx.probe(evaluator, params), predicted_peak_bytes=predicted)
        peak = row.get("peak_mem_bytes")
        row["over_ceiling"] = row["status"] == "ok" and peak is not None and peak > ceiling
        row["prediction_error"] = (predicted - peak) / peak if row["status"] == "ok" and peak and predicted else None
        # An out-of-memory error reported as a crash is a misclassification this phase exists to catch.
        row["oom_misclassified"] = row["status"] == "crash" and "out of memory" in (row.get("error") or "").lower()
        rows.append(row)
    ok_over = [r for r in rows if r["over_ceiling"]]
    misclassified = [r for r in rows if r["oom_misclassified"]]
    errors = [abs(r["prediction_error"]) for r in rows if r["prediction_error"] is not None]
    largest_ok = max((r["per_device_train_batch_size"] for r in rows if r["status"] == "ok"), default=None)
    smallest_oom = min((r["per_device_train_batch_size"] for r in rows if r["status"] == "oom"), default=None)
    data = {
        "model": model.name, "seq_len": plan.ceiling_seq_len, "config": base.short(), "ceiling_bytes": ceiling,
        "predicted_largest_batch": predicted_best, "largest_ok_batch": largest_ok, "smallest_oom_batch": smallest_oom,
        "ok_over_ceiling": len(ok_over), "oom_misclassified": len(misclassified),
        "mean_abs_prediction_error": statistics.fmean(errors) if errors else None, "rows": rows,
        "cpu_note": None if ctx.device.is_cuda else "on the CPU the peak is the process RSS and the ceiling a simulated one",
    }
    table = md_table(
        ["batch", "status", "predicted peak", "measured peak", "prediction error", "over ceiling", "error"],
        [(r["per_device_train_batch_size"], r["status"], fmt(r["predicted_peak_bytes"], "bytes"), fmt(r.get("peak_mem_bytes"), "bytes"),
          fmt(r["prediction_error"], "pct"), "YES" if r["over_ceiling"] else "no", fmt(r.get("error"))) for r in rows],
    )
    headline = (
        f"{model.name} seq {plan.ceiling_seq_len} {base.short()} under a {format_bytes(ceiling)} ceiling on {ctx.device.name}: "
        f"memory model's largest batch {predicted_best}, measured largest ok {fmt(largest_ok)}, smallest OOM {fmt(smallest_oom)}; "
        f"ok probes over the ceiling: {len(ok_over)} (target 0); OOMs reported as crashes: {len(misclassified)} (target 0); "
        f"mean |prediction error| {fmt(data['mean_abs_prediction_error'], 'pct')}"
    )
    if data["cpu_note"]:
        headline += f" ({data['cpu_note']})"
    if ok_over or misclassified:
        status, reason = "flagged", f"{len(ok_over)} ok probes over the ceiling, {len(misclassified)} OOMs classified crash"
    elif any(r["status"] == "not run" for r in rows):
        status, reason = "timeout", "not every batch was probed within the box"
    elif smallest_oom is None:
        status, reason = "ok", f"no ok probe over the ceiling; none ran out of memory up to batch {max(batches)}"
    else:
        status, reason = "ok", "OOMs classified oom, no ok probe over the ceiling"
    return output(status, reason, data, f"{headline}.\n\n{table}")


# ---------------------------------------------------------------------------------------- 5. run


def study_storage(out: Path, name: str = "autotune.db") -> str:
    return f"sqlite:///{(out / name).resolve()}"


def phase_run(ctx: Context) -> PhaseOutput:
    """``autotune run --model M --seq-len S --budget B`` through :func:`autotune.api.tune`, study and report in the output folder."""
    plan = ctx.plan
    budget_s = min(plan.run_budget_s, ctx.remaining() - plan.run_report_reserve_s)
    if budget_s < (5 if plan.quick else 60):
        return output("timeout", "no time left in the box for a run", {}, "Not run: no time left in the box.")
    storage = study_storage(ctx.out)
    command = f"autotune run --model {plan.run_model} --seq-len {plan.run_seq_len} --budget {budget_s:.0f}s --space {plan.run_space} --storage {storage}"
    ctx.log(command)
    result, wall_s, _, _ = _tune(ctx, plan.run_model, plan.run_seq_len, budget_s, storage, command)
    data = _tune_figures(result, wall_s)
    data.update(command=command, budget_s=budget_s, storage=storage, database=(ctx.out / "autotune.db").name)
    report = ctx.out / f"{result.study_name}.html"
    data["report"] = report.name if report.exists() else None
    ranked = result.ranked().head(5)
    table = md_table(
        ["rank", "configuration", "samples/s", "tokens/s", "peak memory", "MFU", "probes"],
        [(i + 1, r["config"], fmt(r["samples_per_s"]), fmt(r["tokens_per_s"]), fmt(r["peak_mem_bytes"], "bytes"), fmt(r["mfu"], "pct"),
          r["n_measurements"]) for i, r in enumerate(_ranked_rows(ranked))],
    )
    counts = ", ".join(f"{k} {v}" for k, v in sorted(data["counts"].items()))
    headline = (
        f"`{command}`: stopped because {data['stopped_because']} after {fmt(wall_s, 's')}; trials: {counts}. Best: "
        f"{data['best_config'] or 'nothing fit'} at {fmt(data['best_samples_per_s'])} samples/s, {fmt(data['speedup'], 'ratio')}x the "
        f"transformers defaults, first measured after {fmt(data['time_to_best_s'], 's')}. Study: `{data['database']}` "
        f"(study `{result.study_name}`), report: `{data['report']}`"
    )
    if budget_s < 600 and not plan.quick:
        headline += f". The budget is {format_duration(budget_s)}, not 10 minutes: what the phase's box left (one call runs 10 minutes at most)"
    if data["best_config"] is None:
        return output("flagged", "nothing fit under the ceiling", data, f"{headline}.\n\n{table}")
    if data["report"] is None:
        return output("flagged", "no HTML report was written", data, f"{headline}.\n\n{table}")
    return output("ok", f"best {data['best_config']}, {fmt(data['speedup'], 'ratio')}x the defaults", data, f"{headline}.\n\n{table}")


def _tune(ctx: Context, model: str, seq_len: int, budget_s: float, storage: str, command: str,
          study: str | None = None) -> tuple[Any, float, Any, Any]:
    """:func:`autotune.api.tune`'s own path (``plan_run`` then ``run_plan``); in quick mode its probes
    stop measuring sooner, so that a budget of seconds runs a few of them. (result, wall seconds, the
    run's plan, the evaluator its probes ran with)."""
    from autotune.api import RunOptions, plan_evaluator, plan_run, run_plan

    plan = ctx.plan
    started = time.monotonic()
    run = plan_run(RunOptions.of(
        model=model, seq_len=seq_len, budget=budget_s, space=plan.run_space, device=ctx.device_arg, storage=storage, study=study,
        warmup_steps=plan.warmup_steps, measure_steps=plan.measure_steps, trial_timeout=plan.probe_cap_s,
    ))
    evaluator = plan_evaluator(run)
    if plan.quick:
        evaluator = replace(evaluator, max_measure_steps=plan.max_measure_steps, max_measure_s=plan.max_measure_s)
    result = run_plan(run, evaluator=evaluator, report_dir=ctx.out, command=command).result
    return result, time.monotonic() - started, run, evaluator


def _ranked_rows(frame: Any) -> list[dict[str, Any]]:
    rows = []
    for record in frame.to_dict("records"):
        params = TrialParams.from_dict({n: _plain(record[n]) for n in PARAM_NAMES})
        rows.append({**{k: _plain(v) for k, v in record.items()}, "config": params.short()})
    return rows


def _plain(value: Any) -> Any:
    """numpy/pandas scalars -> Python; NaN -> None."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        try:
            value = value.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _tune_figures(result: Any, wall_s: float | None) -> dict[str, Any]:
    """What the summary reports of a finished study: best, speed-up, outcomes, time until the best was first measured."""
    best = result.best
    time_to_best = None
    best_config = None
    if best is not None:
        trials = result.trials
        first = int(best["probe_trials"][0])
        finished = trials.loc[trials["trial"] == first, "finished_at"].iloc[0]
        started = trials["started_at"].dropna().min()
        if finished is not None and started is not None:
            time_to_best = (finished - started).total_seconds()
        best_config = TrialParams.from_dict(result.best_params).short()
    return {
        "study": result.study_name, "stopped_because": result.stopped_because, "wall_s": wall_s, "counts": result.counts(),
        "best_params": result.best_params, "best_config": best_config,
        "best_samples_per_s": _plain(best["samples_per_s"]) if best is not None else None,
        "speedup": result.speedup, "time_to_best_s": time_to_best,
        "memory_ceiling_bytes": result.memory_ceiling_bytes,
    }


# ---------------------------------------------------------------------------------------- 6. side by side


SBS_METHODS = (  # the table's rows, in this order
    ("defaults", "transformers defaults (the run's baseline)"),
    ("bf16_user", "a bf16 user"),
    ("auto_find", "HF auto_find_batch_size"),
    ("largest", "largest batch that fits"),
    ("expert", "expert rule (the run's reference)"),
    ("autotune", "autotune"),
)


def phase_side_by_side(ctx: Context) -> PhaseOutput:
    """Every row measured alike in this call: an ``autotune run`` first (its baseline is transformers'
    defaults and it measures the expert rule as a reference), then, with the run's own probe protocol and
    ceiling, a bf16 user's settings, HF ``auto_find_batch_size`` (a real ``Trainer.train()``: every batch it
    tried, its steps, peak and log) and the largest batch that fits; a row out of memory steps down one
    batch size of the space, whichever row it is. Then autotune's best re-timed by a plain ``Trainer``
    that runs none of autotune's code. A box that cannot hold the whole run is refused, never shortened."""
    plan = ctx.plan
    needed_s = plan.sbs_run_budget_s + plan.sbs_rows_reserve_s
    if ctx.remaining() < needed_s:
        reason = (f"refused: the {ctx.remaining():.0f}s left in the box cannot hold the {plan.sbs_run_budget_s:.0f}s autotune run and "
                  f"{plan.sbs_rows_reserve_s:.0f}s for the other rows; give it --box side_by_side={needed_s:.0f} or more")
        return output("refused", reason, {}, f"Not run: {reason}.")
    model = resolve_model(plan.sbs_model)
    storage = study_storage(ctx.out, "side_by_side.db")
    command = (f"autotune run --model {plan.sbs_model} --seq-len {plan.sbs_seq_len} --budget {plan.sbs_run_budget_s:.0f}s "
               f"--space {plan.run_space} --storage {storage}")
    ctx.log(command)
    result, run_wall_s, run, evaluator = _tune(ctx, plan.sbs_model, plan.sbs_seq_len, plan.sbs_run_budget_s, storage, command,
                                               study="side-by-side")
    run_figures = {**_tune_figures(result, run_wall_s), "command": command, "database": "side_by_side.db"}
    ceiling = result.memory_ceiling_bytes
    sizes = sorted(run.space.choices["per_device_train_batch_size"])
    table = SideBySide(ctx, evaluator, ceiling, sizes, result)
    rows: dict[str, dict[str, Any]] = ctx.partial.setdefault("rows_by_method", {})
    defaults = TrialParams()

    rows["defaults"] = table.reference_row("baseline")
    rows["expert"] = table.reference_row("expert")
    best_params = TrialParams.from_dict(result.best_params) if result.best_params else None
    rows["autotune"] = (table.study_row(best_params, time_to_find_s=run_figures["time_to_best_s"]) if best_params is not None
                        else {"status": "nothing fit", "error": "autotune found nothing that fits"})

    # The best re-timed by a plain Trainer next, while inductor's cache holds its compiled graphs.
    check: dict[str, Any] = {"status": "not run"}
    best_row = rows["autotune"]
    if best_params is not None and best_row.get("samples_per_s"):
        request = timed_request(model, best_params, evaluator.warmup_steps,
                                max(plan.timed_measure_steps, int(best_row.get("measured_steps") or 0)))
        check = _trainer_run(ctx, model, plan.sbs_seq_len, request, log_name="trainer_timed.log")
        if check.get("status") == "ok":
            check["ratio"] = check["samples_per_s"] / best_row["samples_per_s"]
            check["within_tolerance"] = abs(check["ratio"] - 1) <= RATIO_TOLERANCE

    # HF auto_find_batch_size as users run it, under the run's ceiling; what it settled on, probed like the rest.
    found = _trainer_run(ctx, model, plan.sbs_seq_len, auto_find_request(plan, ceiling), log_name="trainer_auto_find.log")
    auto_find = {k: found.get(k) for k in ("status", "tried_batches", "steps_run", "train_s", "peak_allocated_bytes",
                                           "peak_reserved_bytes", "error")}
    if found.get("status") == "ok" and found.get("batch_size"):
        rows["auto_find"] = table.measured_row(defaults.replace(per_device_train_batch_size=int(found["batch_size"])),
                                               time_to_find_s=found.get("wall_s"))
    else:
        rows["auto_find"] = {"status": found.get("status", "crash"), "error": found.get("error")}
    rows["auto_find"]["auto_find"] = auto_find

    sixteen = _precision_for(ctx.device)
    rows["bf16_user"] = table.measured_row(defaults.replace(precision=sixteen, per_device_train_batch_size=plan.bf16_user_batch))

    # The largest batch at default settings: Lightning's binsearch, each trial a few untimed steps, then one probe of the run's protocol at its answer.
    largest, finder_s, finder_probes, stopped = _largest_batch(ctx, table, defaults, ceiling)
    if stopped is not None:
        bound = f"; batch {largest} fits, so the answer is at least that" if largest else ""
        rows["largest"] = {"status": "not run", "finder_probes": finder_probes, "error": f"the finder stopped: {stopped}{bound}"}
    elif largest is None:
        rows["largest"] = {"status": "nothing fit", "finder_probes": finder_probes, "error": f"batch {plan.finder_start} does not fit"}
    else:
        rows["largest"] = table.measured_row(defaults.replace(per_device_train_batch_size=largest), time_to_find_s=finder_s,
                                             finder_probes=finder_probes)

    ordered = [{"method": _method_label(key, rows[key], plan, sixteen), "key": key, **rows[key]} for key, _ in SBS_METHODS if key in rows]
    peak_tflops_bf16 = _bf16_peak_tflops(ctx.device)
    for row in ordered:
        row["mfu_of_bf16_peak"] = (row["achieved_tflops"] / peak_tflops_bf16
                                   if peak_tflops_bf16 and row.get("achieved_tflops") else None)
        for ref in ("defaults", "bf16_user", "expert"):
            base = rows.get(ref, {}).get("samples_per_s")
            row[f"speedup_vs_{ref}"] = row["samples_per_s"] / base if base and row.get("samples_per_s") else None
    data = {"model": model.name, "seq_len": plan.sbs_seq_len, "memory_ceiling_bytes": ceiling, "run": run_figures,
            "protocol": {"warmup_steps": evaluator.warmup_steps, "measure_steps": evaluator.measure_steps,
                         "max_measure_steps": evaluator.max_measure_steps, "max_measure_s": evaluator.max_measure_s},
            "bf16_peak_tflops": peak_tflops_bf16, "rows": ordered, "plain_trainer_check": check}
    markdown = _side_by_side_markdown(ctx, data, check)
    return _side_by_side_verdict(ctx, data, check, markdown)


def _method_label(key: str, row: dict[str, Any], plan: Plan, sixteen: str) -> str:
    labels = dict(SBS_METHODS)
    if key == "bf16_user":
        return f"a {sixteen} user (batch {plan.bf16_user_batch}, the rest default)"
    if key == "auto_find":
        tried = (row.get("auto_find") or {}).get("tried_batches") or []
        return f"{labels[key]} (from {plan.auto_find_start}; tried {', '.join(map(str, tried)) or 'nothing'})"
    if key == "largest":
        return f"{labels[key]} ({row.get('finder_probes', 0)} trials of {FINDER_STEPS} untimed steps, then one probe)"
    if key == "autotune":
        return f"autotune ({format_duration(plan.sbs_run_budget_s)} run, this call)"
    return labels[key]


def _bf16_peak_tflops(device: DeviceInfo) -> float | None:
    from autotune.probe.flops import peak_tflops

    return peak_tflops(device.name, "bf16") if device.is_cuda else None


FINDER_STEPS = 3  # optimizer steps of one batch-finder trial: Lightning's scale_batch_size(steps_per_trial=3)


class SideBySide:
    """Every row's measurement: a configuration the run measured is read from its study (averaged over its
    probes as the ranking does), any other is probed here with the run's evaluator; one cache, so two
    methods that land on one configuration share its figures."""

    def __init__(self, ctx: Context, evaluator: Any, ceiling: int | None, batch_sizes: list[int], result: Any) -> None:
        self.ctx, self.evaluator, self.ceiling, self.sizes, self.result = ctx, evaluator, ceiling, batch_sizes, result
        self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        # The batch finder's trials: Lightning's, a few untimed steps that say whether a batch fits.
        self.finder_evaluator = (replace(evaluator, warmup_steps=1, measure_steps=FINDER_STEPS - 1, max_measure_steps=FINDER_STEPS - 1)
                                 if isinstance(evaluator, ProbeEvaluator) else evaluator)
        self.fit_rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        for record in _ranked_rows(result.configurations()):
            params = TrialParams.from_dict({n: record[n] for n in PARAM_NAMES})
            self.rows[params.key()] = self._study_figures(params, record)

    def _study_figures(self, params: TrialParams, record: dict[str, Any]) -> dict[str, Any]:
        keep = ("status", "samples_per_s", "tokens_per_s", "step_time_s", "peak_mem_bytes", "peak_reserved_bytes", "mfu", "achieved_tflops",
                "matmul_precision", "step_time_ci95_rel", "input_wait_fraction", "n_measurements", "spread_rel", "reason")
        row = {"config": params.short(), **params.to_dict(), **{k: record.get(k) for k in keep},
               "source": f"the run's study, trials {', '.join(map(str, record.get('probe_trials') or ()))}"}
        if row["status"] == "ok" and self.ceiling is not None and (row.get("peak_mem_bytes") or 0) > self.ceiling:
            row["status"] = "over ceiling"
        return row

    def probe(self, params: TrialParams) -> dict[str, Any] | None:
        """The configuration's figures, probed here if the run did not measure it; None when the box is spent."""
        return self._probed(self.evaluator, self.rows, params, "probed here, the run's protocol")

    def fit_probe(self, params: TrialParams) -> dict[str, Any] | None:
        """Whether ``params`` fits, as a batch finder's trial asks it: read where this call measured it already, else
        :data:`FINDER_STEPS` untimed steps (not a row of the table); None when the box is spent."""
        if params.key() in self.rows:
            return self.rows[params.key()]
        return self._probed(self.finder_evaluator, self.fit_rows, params, f"the finder's trial, {FINDER_STEPS} untimed steps")

    def _probed(self, evaluator: Any, cache: dict[tuple[Any, ...], dict[str, Any]], params: TrialParams, source: str) -> dict[str, Any] | None:
        """``params``' row in ``cache``, probed with ``evaluator`` the first time (an ok probe over the ceiling reads
        "over ceiling"); None when the box is spent."""
        key = params.key()
        if key not in cache:
            result = self.ctx.probe(evaluator, params)
            if result is None:
                return None
            row = probe_row(params, result, source=source)
            if result.ok and not result.fits(self.ceiling):
                row["status"] = "over ceiling"
            cache[key] = row
        return cache[key]

    def fits(self, row: dict[str, Any] | None) -> bool | None:
        """True: ran under the ceiling; False: out of memory or over it; None: says nothing of memory (crash, timeout, not run)."""
        if row is None:
            return None
        if row["status"] == "ok":
            return True
        return False if row["status"] in ("oom", "over ceiling") else None

    def step_down(self, batch: int) -> int | None:
        smaller = [b for b in self.sizes if b < batch]
        return max(smaller) if smaller else None

    def measured_row(self, params: TrialParams, *, time_to_find_s: float | None = None, **extra: Any) -> dict[str, Any]:
        """``params`` measured; out of memory, the next smaller batch of the space, at most three times (the one step-down rule)."""
        tried: list[int] = []
        for _ in range(4):
            row = self.probe(params)
            tried.append(params.per_device_train_batch_size)
            smaller = self.step_down(params.per_device_train_batch_size)
            if row is not None and self.fits(row) is False and smaller is not None and len(tried) < 4:
                params = params.replace(per_device_train_batch_size=smaller)
                continue
            break
        out = dict(row) if row is not None else {"config": params.short(), **params.to_dict(), "status": "not run",
                                                 "error": "no time left in the phase's box"}
        return {**out, "time_to_find_s": time_to_find_s, "stepped_down_from": tried[:-1] or None, **extra}

    def study_row(self, params: TrialParams, *, time_to_find_s: float | None = None) -> dict[str, Any]:
        return {**self.rows[params.key()], "time_to_find_s": time_to_find_s} if params.key() in self.rows else self.measured_row(params)

    def reference_row(self, role: str) -> dict[str, Any]:
        """The run's baseline or expert, stepped down like every row if it ran out of memory."""
        reference = self.result.reference(role)
        if reference is None:
            return {"status": "not run", "error": f"the run measured no {role}"}
        params = TrialParams.from_dict({n: _plain(reference[n]) for n in PARAM_NAMES})
        return self.measured_row(params, time_to_find_s=0.0)


def _largest_batch(ctx: Context, table: Any, params: TrialParams, ceiling: int | None) -> tuple[int | None, float, int, str | None]:
    """Lightning's ``binsearch`` batch finder: double from ``finder_start`` (transformers' default batch, 8, on the GPU) until a trial does not fit,
    then halve the interval until it is one wide; each trial :data:`FINDER_STEPS` untimed steps in a fresh process, as
    Lightning's ``steps_per_trial`` (:meth:`SideBySide.fit_probe`). (largest fitting batch, trial seconds, trials run here,
    why it stopped before its answer: None when it finished). A trial that ends without saying anything of memory (the
    box spent, a timeout, a crash) stops the finder without an answer: the largest batch that fitted is only a lower bound."""
    plan = ctx.plan
    low, high, size = 0, None, plan.finder_start
    spent, probes = 0.0, 0
    for _ in range(plan.finder_max_trials):
        key = params.replace(per_device_train_batch_size=size).key()
        already = key in table.rows or key in table.fit_rows
        row = table.fit_probe(params.replace(per_device_train_batch_size=size))
        if row is None:
            return (low or None), spent, probes, f"no time left in the box for batch {size}"
        if not already:
            probes += 1
            spent += row.get("wall_s") or 0.0
        fits = table.fits(row)
        if fits is None:
            return (low or None), spent, probes, f"batch {size} ended {row['status']}: {row.get('error') or 'no memory figure'}"
        if fits:
            low = size
            if high is None:
                if size >= plan.finder_max:
                    break
                size = min(size * 2, plan.finder_max)
                continue
        else:
            high = size
        if high - low <= 1:
            break
        size = (low + high) // 2
    return (low or None), spent, probes, None


def _side_by_side_markdown(ctx: Context, data: dict[str, Any], check: dict[str, Any]) -> str:
    run, protocol, rows = data["run"], data["protocol"], data["rows"]
    peak = data["bf16_peak_tflops"]
    mfu_header = f"MFU of the bf16 dense peak ({peak:.0f} TFLOP/s)" if peak else "MFU (no known peak here)"
    table = md_table(
        ["method", "configuration", "status", "samples/s", "tokens/s", "peak memory", "TFLOP/s", mfu_header, "vs defaults",
         "vs bf16 user", "vs expert", "time to find", "measured"],
        [(r["method"], r.get("config", "-"), r["status"], fmt(r.get("samples_per_s")), fmt(r.get("tokens_per_s")),
          fmt(r.get("peak_mem_bytes"), "bytes"), fmt(r.get("achieved_tflops")), fmt(r.get("mfu_of_bf16_peak"), "pct"),
          *(f"{r[f'speedup_vs_{k}']:.2f}x" if r.get(f"speedup_vs_{k}") else "-" for k in ("defaults", "bf16_user", "expert")),
          fmt(r.get("time_to_find_s"), "s"), r.get("source") or r.get("error") or "-") for r in rows],
    )
    auto = next((r.get("auto_find") for r in rows if r["key"] == "auto_find"), None) or {}
    auto_line = (f"HF `auto_find_batch_size`: a plain `Trainer.train()` of {auto.get('steps_run')} steps from batch "
                 f"{ctx.plan.auto_find_start} under the same ceiling, tried {auto.get('tried_batches')}, peak allocated "
                 f"{fmt(auto.get('peak_allocated_bytes'), 'bytes')}, {fmt(auto.get('train_s'), 's')}; log `trainer_auto_find.log`"
                 if auto.get("status") == "ok" else f"HF `auto_find_batch_size`: {auto.get('status')} {auto.get('error') or ''}")
    stepped = [f"{r['method']}: out of memory at batch {', '.join(map(str, r['stepped_down_from']))}, measured one size down"
               for r in rows if r.get("stepped_down_from")]
    if check.get("ratio") is not None:
        verdict = "within" if check["within_tolerance"] else "OUTSIDE"
        check_line = (f"Plain `Trainer.train()` of autotune's best (its `TrainingArguments`, none of autotune's code; "
                      f"{check['measured_steps']} steps after {check['warmup_steps']} warm-up, synchronised): {check['samples_per_s']:.2f} "
                      f"samples/s, {check['ratio']:.3f}x the probe's figure: {verdict} the {RATIO_TOLERANCE:.0%} tolerance; log `trainer_timed.log`")
    else:
        check_line = f"Plain `Trainer.train()` re-timing: {check.get('status')} {check.get('error') or ''}".strip()
    return (
        f"{data['model']} seq {data['seq_len']}, one call, one probe protocol (a fresh process each, {protocol['warmup_steps']} warm-up "
        f"steps, at least {protocol['measure_steps']} measured, until stable or {protocol['max_measure_s']:.0f}s), one ceiling "
        f"({fmt(data['memory_ceiling_bytes'], 'bytes')}). `{run['command']}`: stopped because {run['stopped_because']} after "
        f"{fmt(run['wall_s'], 's')}; its baseline (transformers' defaults), its expert-rule reference and its best are read from its "
        f"study; the other rows are probed after it with its evaluator. A row out of memory is measured one batch size of the space "
        f"down, whichever row it is. Time to find: autotune's until its best was first measured; auto_find's whole `Trainer.train()`; "
        f"the finder's trials. MFU: achieved model FLOP/s over one denominator for every row, named in the header.\n\n"
        f"{table}\n\n{auto_line}.\n\n{check_line}." + "".join(f"\n\n{s}." for s in stepped)
    )


def _side_by_side_verdict(ctx: Context, data: dict[str, Any], check: dict[str, Any], markdown: str) -> PhaseOutput:
    rows = data["rows"]
    if any(r["status"] == "not run" for r in rows) or check.get("status") == "not run":
        missing = [r["method"] for r in rows if r["status"] == "not run"] + (["the plain Trainer re-timing"] if check.get("status") == "not run" else [])
        return output("timeout", f"not run within the {ctx.box_s:.0f}s box: {', '.join(missing)}", data, markdown)
    if check.get("within_tolerance") is False:
        return output("flagged", f"plain Trainer / probe = {check['ratio']:.3f}, outside {RATIO_TOLERANCE:.0%}", data, markdown)
    failed = [f"{r['method']}: {r['status']}" for r in rows if r["status"] != "ok"]
    if failed or check.get("status") != "ok":
        return output("flagged", "not ok: " + "; ".join(failed or [f"the plain Trainer re-timing: {check.get('error')}"]), data, markdown)
    best = next(r for r in rows if r["key"] == "autotune")
    fastest = max(rows, key=lambda r: r.get("samples_per_s") or 0.0)
    share = best["samples_per_s"] / fastest["samples_per_s"]
    if share < 0.98:
        return output("flagged", f"autotune's best is {share:.3f} of the fastest row ({fastest['method']})", data, markdown)
    return output("ok", f"autotune {share:.3f} of the fastest row; plain Trainer / probe = {check['ratio']:.3f}", data, markdown)


def timed_request(model: ModelSpec, params: TrialParams, warmup_steps: int, measure_steps: int) -> dict[str, Any]:
    """A :mod:`bench.gpu_trainer` ``timed`` request: ``params`` trained by a plain Trainer with the ``TrainingArguments``
    autotune exports for it, the model from its config."""
    return {"mode": "timed", "config": dict(model.config), "training_arguments": params.training_arguments_kwargs(),
            "attn_implementation": params.attn_implementation, "effective_batch_size": params.effective_batch_size,
            "warmup_steps": warmup_steps, "measure_steps": measure_steps}


def auto_find_request(plan: Plan, ceiling_bytes: int | None) -> dict[str, Any]:
    """A :mod:`bench.gpu_trainer` ``auto_find`` request: HF ``auto_find_batch_size`` from the plan's batch, under the ceiling."""
    return {"mode": "auto_find", "start_batch": plan.auto_find_start, "steps": plan.auto_find_steps, "memory_ceiling_bytes": ceiling_bytes}


def _trainer_run(ctx: Context, model: ModelSpec, seq_len: int, request: dict[str, Any], *, log_name: str) -> dict[str, Any]:
    """A :mod:`bench.gpu_trainer` request in a process of its own: forked from autotune's probe server
    (torch already imported), or a new interpreter where that server is not usable. Its log is kept as
    ``log_name`` in the output folder."""
    import multiprocessing
    import shutil
    import signal

    from autotune.probe.isolation import child_env, start_server
    from autotune.records import ProbeSpec
    from bench import gpu_trainer

    request = {**request, "model": model.to_dict(), "seq_len": seq_len, "device": ctx.probe_device}
    timeout_s = min(ctx.plan.probe_cap_s, ctx.remaining())
    if timeout_s < 2:
        return {"status": "not run", "error": "no time left in the box"}
    # The probes' environment: the same GPU, outside any distributed job, libraries quiet.
    env = child_env(ProbeSpec(model=model.to_dict(), params=TrialParams(), seq_len=seq_len, device=ctx.probe_device))
    forked = start_server() is not False  # False: the server failed its CUDA self-test (older autotune: None)
    ctx.log(f"plain Trainer: {request['mode']} (deadline {timeout_s:.0f}s)")
    with tempfile.TemporaryDirectory(prefix="autotune-acceptance-") as tmp:
        request_path, result_path, log_path = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "log.txt"
        request_path.write_text(json.dumps(request), encoding="utf-8")
        started = time.monotonic()
        if forked:
            process = multiprocessing.get_context("forkserver").Process(
                target=gpu_trainer.forked_main, args=(str(request_path), str(result_path), str(log_path), env),
                name="autotune-acceptance-trainer",
            )
            process.start()
            try:
                process.join(timeout_s)
            finally:
                if process.exitcode is None:
                    try:
                        os.killpg(process.pid, signal.SIGKILL)  # the child and its DataLoader workers
                    except (ProcessLookupError, PermissionError):
                        process.kill()
                    process.join()
            exitcode = process.exitcode
        else:
            command = [sys.executable, "-m", "bench.gpu_trainer", str(request_path), str(result_path)]
            exitcode, text = run_command(command, timeout_s=timeout_s, env=env)
            log_path.write_text(text, encoding="utf-8")
        wall_s = time.monotonic() - started
        if log_path.exists():
            shutil.copyfile(log_path, ctx.out / log_name)
        if result_path.exists():
            result = json.loads(result_path.read_text(encoding="utf-8"))
        else:
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-1500:] if log_path.exists() else ""
            status = "timeout" if wall_s >= timeout_s else "crash"
            result = {"status": status, "error": f"exit code {exitcode}: {_first_line(tail)}"}
    result["wall_s"] = wall_s
    result["log"] = log_name
    ctx.log(f"  -> {json.dumps(result)[:400]}")
    return result


def _read_phase(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get("data")


# ---------------------------------------------------------------------------------------- 7. landscape


def landscape_grid(grid: dict[str, tuple[Any, ...]]) -> list[TrialParams]:
    """Every combination of the grid's values (a replay table must hold them all), cheapest first:
    uncompiled configurations, then compiled ones grouped by compiled graph so each compiles cold once
    and the rest of its group hits inductor's cache."""
    configs = [TrialParams(**dict(zip(PARAM_NAMES, combo)))
               for combo in itertools.product(*(grid.get(n, (PARAM_DEFAULTS[n],)) for n in PARAM_NAMES))]  # a knob the grid does not name: its default

    def key(p: TrialParams) -> tuple[Any, ...]:
        graph = tuple(getattr(p, name) for name in COMPILED_GRAPH_PARAMS)
        # Compiled graphs without checkpointing first: they compile in ~30 s cold and ~10 s from the
        # cache, checkpointed ones in ~45 s cold and, with sdpa, every time (eager: 11-14 s from the
        # cache; H100, pythia-160m), so a lease that cannot probe them all still completes the
        # factorial without checkpointing (complete_subgrid).
        compiled = grid["torch_compile"].index(p.torch_compile)
        return (compiled, compiled > 0 and p.gradient_checkpointing, graph, p.optim, p.gradient_accumulation_steps, p.dataloader_num_workers)

    return sorted(configs, key=lambda p: tuple(str(k) for k in key(p)))


def complete_subgrid(grid: dict[str, tuple[Any, ...]], done: set[tuple[Any, ...]]) -> dict[str, tuple[Any, ...]] | None:
    """The largest full factorial inside the grid whose every combination has been probed (what a
    replay table can be made of), or None: ``torch_compile`` cut to its first values, and at most one
    other dimension fixed to one of its values. Among equally large ones, the one with more compile
    modes (the compiled rows are the costly ones to record), then the one fixing nothing."""
    compile_modes = grid["torch_compile"]
    candidates = []
    for keep in range(len(compile_modes), 0, -1):
        cut = {**grid, "torch_compile": compile_modes[:keep]}
        candidates.append(cut)
        candidates += [{**cut, name: (value,)} for name, values in grid.items() if name != "torch_compile" and len(values) > 1
                       for value in values]
    complete = [sub for sub in candidates if all(c.key() in done for c in landscape_grid(sub))]
    if not complete:
        return None
    return max(complete, key=lambda sub: (math.prod(len(v) for v in sub.values()), len(sub["torch_compile"])))


def least_informative_dimension(grid: dict[str, tuple[Any, ...]], rows: dict[tuple[Any, ...], dict[str, Any]]) -> str | None:
    """The grid dimension (compile mode aside) whose values changed the measured samples/s least:
    the median |log ratio| over pairs of ``ok`` rows that differ in it alone (its first value against
    each other one). None without such pairs."""
    names = [n for n, values in grid.items() if n != "torch_compile" and len(values) > 1]
    # Keyed as the rows are, by TrialParams.key(): the values in PARAM_NAMES order.
    speed = {key: row["samples_per_s"] for key, row in rows.items() if row.get("status") == "ok" and row.get("samples_per_s")}
    effects: dict[str, float] = {}
    for name in names:
        i, first = PARAM_NAMES.index(name), grid[name][0]
        ratios = [abs(math.log(s / speed[other])) for combo, s in speed.items() if combo[i] == first
                  for value in grid[name][1:] if (other := (*combo[:i], value, *combo[i + 1:])) in speed]
        if ratios:
            effects[name] = statistics.median(ratios)
    return min(effects, key=effects.__getitem__) if effects else None


def table_first(grid: dict[str, tuple[Any, ...]], configs: list[TrialParams],
                rows: dict[tuple[Any, ...], dict[str, Any]]) -> list[TrialParams]:
    """``configs`` not yet in ``rows``, those that complete a table with every compile mode first: the
    sub-grid that fixes the dimension which moved throughput least so far
    (``least_informative_dimension``) to its value with fewer configurations missing, so a lease
    too short for the whole grid ends with a table that loses the least (``complete_subgrid``
    accepts it). ``configs``' own order within each part (compiled graphs grouped, for inductor's cache)."""
    todo = [c for c in configs if c.key() not in rows]
    name = least_informative_dimension(grid, rows)
    if name is None:
        return todo
    subs = [[c.key() for c in landscape_grid({**grid, name: (value,)}) if c.key() not in rows] for value in grid[name]]
    first = set(min(subs, key=len))
    return [c for c in todo if c.key() in first] + [c for c in todo if c.key() not in first]


def narrowing(grid: dict[str, tuple[Any, ...]], sub: dict[str, tuple[Any, ...]]) -> str:
    """How ``sub`` cuts ``grid``, as a file-name suffix: ``""`` for the whole grid, else e.g.
    ``"-torch_compile-off"`` or ``"-gradient_checkpointing-False"``."""
    return "".join(f"-{name}-{'-'.join(map(str, sub[name]))}" for name in grid if sub[name] != grid[name])


def write_landscape_table(rows: dict[tuple[Any, ...], dict[str, Any]], grid: dict[str, tuple[Any, ...]], folder: Path,
                          slug: str) -> tuple[Path, dict[str, tuple[Any, ...]]] | None:
    """The replay table of the largest complete sub-grid of ``rows`` (landscape rows by configuration
    key), ``landscape_<slug><narrowing>.csv.gz`` in ``folder``, checked replayable with its own
    space; None while no sub-grid is complete."""
    import pandas as pd

    from autotune.search.replay import OPTIONAL_MEASUREMENT_COLUMNS, load_table

    sub = complete_subgrid(grid, set(rows))
    if sub is None:
        return None
    keys = {c.key() for c in landscape_grid(sub)}
    frame = pd.DataFrame([rows[k] for k in rows if k in keys])
    columns = [*PARAM_NAMES, "status", "samples_per_s", "peak_mem_bytes", "probe_s", "tokens_per_s", "mfu", "error"]
    columns += [c for c in OPTIONAL_MEASUREMENT_COLUMNS if c in frame.columns]  # replayed as a live search sees them
    path = folder / f"landscape_{slug}{narrowing(grid, sub)}.csv.gz"
    frame[columns].to_csv(path, index=False)
    table = load_table(path)
    table.check_space(table.space())  # every combination present: replayable with its own space
    return path, sub


def _landscape_ceiling(ctx: Context, model: ModelSpec) -> int | None:
    """Where half the largest-batch memory groups are predicted to fit: OOM rows on both sides of it."""
    from autotune.search.memory import MemoryModel
    from autotune.search.memory_prior import ModelDims

    if not ctx.device.is_cuda:
        return None  # a simulated ceiling on the CPU compares process RSS: everything would be "oom"
    if ctx.plan.land_card_ceiling:
        from autotune.plan import CEILING_SAFETY_FRACTION

        return int(CEILING_SAFETY_FRACTION * ctx.device.total_memory_bytes)  # what `autotune run` uses by default
    grid = ctx.plan.land_grid
    memory = MemoryModel(ModelDims.from_spec(model), ctx.plan.land_seq_len)
    largest = max(grid["per_device_train_batch_size"])
    peaks = [memory.predict(c) for c in landscape_grid(grid) if c.per_device_train_batch_size == largest]
    median = statistics.median(p for p in peaks if p is not None)
    return int(min(round(median / (GiB / 2)) * (GiB / 2), 0.95 * ctx.device.total_memory_bytes))


def phase_landscape(ctx: Context) -> PhaseOutput:
    """A replay table recorded on this device (every combination of a few values per dimension), then ``bench.search`` on it."""
    plan = ctx.plan
    model = resolve_model(plan.land_model)
    grid = plan.land_grid
    configs = landscape_grid(grid)
    ceiling = _landscape_ceiling(ctx, model)
    identity = {"model": model.name, "seq_len": plan.land_seq_len, "device": ctx.device.name, "ceiling_bytes": ceiling, "quick": plan.quick}
    rows_path = ctx.out / "landscape_rows.jsonl"
    earlier = _read_rows(rows_path, identity)  # resume: a previous run's rows of the same landscape are kept
    done = {TrialParams.from_dict(r).key(): r for r in earlier if not r.get("repeat_of_row")}
    repeats = [r for r in earlier if r.get("repeat_of_row")]
    resumed = len(done)
    # The run's probe protocol (warm-up, then measured until stable or the time cap): a replay row carries the
    # speed, its confidence interval and the loader's wait as a live search sees them.
    evaluator = ctx.evaluator(model, plan.land_seq_len, ceiling=ceiling)
    ctx.log(f"{len(configs)} configurations, {resumed} already probed, ceiling {format_bytes(ceiling)}")
    new_rows = 0
    with rows_path.open("a", encoding="utf-8") as sink:
        for params in table_first(grid, configs, done):
            row = _landscape_probe(ctx, evaluator, params, identity)
            if row is None:
                break  # a probe the box's end cut short is no row of the landscape: the next call probes it again
            done[params.key()] = row
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            ctx.partial["probed"] = len(done)
            new_rows += 1
            if new_rows % plan.land_repeat_every == 0 and (again := _next_repeat(done, repeats)) is not None:
                repeat = _landscape_probe(ctx, evaluator, TrialParams.from_dict(again), identity)
                if repeat is None:
                    break
                repeat["repeat_of_row"] = True
                repeats.append(repeat)
                sink.write(json.dumps(repeat) + "\n")
                sink.flush()
    statuses: dict[str, int] = {}
    for row in done.values():
        statuses[row["status"]] = statuses.get(row["status"], 0) + 1
    written = write_landscape_table(done, grid, ctx.out, ctx.slug)
    data: dict[str, Any] = {
        **identity, "grid": {k: list(v) for k, v in grid.items()}, "configurations": len(configs), "probed": len(done),
        "resumed": resumed, "statuses": statuses, "table": None, "table_rows": 0, "noise": landscape_noise(done, repeats),
    }
    sub = None
    search: dict[str, Any] = {"status": "not run", "error": "no complete table"}
    if written is not None:
        table_path, sub = written
        data.update(table=table_path.name, table_rows=math.prod(len(v) for v in sub.values()), table_space={k: list(v) for k, v in sub.items()})
        search = _bench_search(ctx, table_path, ceiling)
    data["bench_search"] = search
    markdown = _landscape_markdown(ctx, data, search, sub)
    if len(done) < len(configs):
        return output("timeout", f"{len(done)} of {len(configs)} configurations probed: run `--phase landscape` again to go on", data, markdown)
    if search.get("status") != "ok":
        return output("flagged", f"bench.search: {search.get('error')}", data, markdown)
    return output("ok", f"{len(done)} configurations ({', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))})", data, markdown)


def _read_rows(path: Path, identity: dict[str, Any]) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if all(r.get(k) == v for k, v in identity.items())]


def _landscape_probe(ctx: Context, evaluator: ProbeEvaluator, params: TrialParams, identity: dict[str, Any]) -> dict[str, Any] | None:
    """One landscape row, or None where the box's end cut the probe short (or left no time to start it)."""
    plan = ctx.plan
    cut_by_box = ctx.remaining() - plan.land_reserve_s < plan.probe_cap_s
    result = ctx.probe(evaluator, params, reserve_s=plan.land_reserve_s)
    if result is None or (cut_by_box and str(result.status) == "timeout"):
        return None
    return {**identity, **params.to_dict(), "status": str(result.status), "samples_per_s": result.samples_per_s,
            "tokens_per_s": result.tokens_per_s, "peak_mem_bytes": result.peak_mem_bytes, "probe_s": result.wall_s,
            "mfu": result.mfu, "input_wait_fraction": result.input_wait_fraction, "step_time_ci95_rel": result.step_time_ci95_rel,
            "setup_s": result.setup_s, "warmup_s": result.warmup_s, "measured_steps": result.measured_steps, "error": None if result.ok else _first_line(result.error, 200)}


def _next_repeat(done: dict[tuple[Any, ...], dict[str, Any]], repeats: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest measured (ok) row not probed again yet."""
    again = {TrialParams.from_dict(r).key() for r in repeats}
    return next((row for key, row in done.items() if row["status"] == "ok" and key not in again), None)


def landscape_noise(done: dict[tuple[Any, ...], dict[str, Any]], repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """How far a second probe of a row lands from the first: the table's own noise, in relative terms."""
    ratios = []
    for repeat in repeats:
        first = done.get(TrialParams.from_dict(repeat).key())
        if first and first.get("samples_per_s") and repeat.get("samples_per_s"):
            ratios.append(repeat["samples_per_s"] / first["samples_per_s"])
    if not ratios:
        return {"repeats": len(repeats), "pairs": 0}
    deviations = sorted(abs(r - 1) for r in ratios)
    return {"repeats": len(repeats), "pairs": len(ratios), "median_abs_rel_diff": statistics.median(deviations),
            "max_abs_rel_diff": deviations[-1], "ratios": [round(r, 4) for r in ratios]}


def _bench_search(ctx: Context, table: Path, ceiling: int | None) -> dict[str, Any]:
    from autotune.search.replay import load_table

    plan = ctx.plan
    ceiling_text = str(ceiling if ceiling is not None else int(0.95 * ctx.device.total_memory_bytes))
    # A budget relative to the table: with the whole grid's time every strategy would find the best.
    budget_s = max(60, round(float(load_table(table).frame["probe_s"].sum()) * plan.bench_budget_fraction))
    command = [sys.executable, "-m", "bench.search", f"{table}:{ceiling_text}", "--seeds", str(plan.bench_seeds), "--budget", f"{budget_s}s"]
    ctx.log(" ".join(command[1:]))
    returncode, stdout = run_command(command, timeout_s=max(ctx.remaining(), 10.0))
    (ctx.out / "bench_search.txt").write_text(stdout, encoding="utf-8")
    if returncode != 0:
        return {"status": "timeout" if returncode is None else "failed", "error": _first_line(stdout), "command": " ".join(command[1:])}
    try:
        summary = json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"status": "failed", "error": "its last line is not the JSON summary", "command": " ".join(command[1:])}
    return {"status": "ok", "command": " ".join(command[1:]), "ceiling_bytes": int(ceiling_text), "virtual_budget_s": budget_s, **summary}


def _landscape_markdown(ctx: Context, data: dict[str, Any], search: dict[str, Any], sub: dict[str, Any] | None) -> str:
    grid = ", ".join(f"{k} {{{', '.join(map(str, v))}}}" for k, v in data["grid"].items())
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(data["statuses"].items()))
    lines = [
        f"{data['model']} seq {data['seq_len']} on {ctx.device.name}, probe memory ceiling {format_bytes(data['ceiling_bytes'])}: "
        f"{data['probed']} of {data['configurations']} configurations probed ({data['resumed']} from an earlier run); outcomes: {statuses or 'none'}.",
        f"Grid: {grid}.",
    ]
    noise = data.get("noise") or {}
    if noise.get("pairs"):
        lines.append(f"Noise: {noise['pairs']} rows probed twice (one after every {ctx.plan.land_repeat_every} new rows): the second "
                     f"probe's samples/s {100 * noise['median_abs_rel_diff']:.1f} % from the first (median), {100 * noise['max_abs_rel_diff']:.1f} % at most.")
    if sub is None:
        lines.append("No complete full factorial yet, so no replay table: run `--phase landscape` again to go on.")
    else:
        cuts = [f"{name} limited to {list(sub[name])}" for name in data["grid"] if list(sub[name]) != data["grid"][name]]
        narrowed = f" ({', '.join(cuts)}: the rest of the grid is not complete yet)" if cuts else ""
        lines.append(f"Replay table: `{data['table']}`, {data['table_rows']} rows{narrowed}.")
    tables = search.get("tables") or {}
    if search.get("status") == "ok" and tables:
        figures = next(iter(tables.values()))
        rows = [
            (name, fmt(f.get("median_ratio"), "ratio"), fmt(f.get("worst_ratio"), "ratio"), fmt(f.get("median_time_fraction"), "pct"),
             fmt(f.get("oom_probes_median")), fmt(f.get("pruned_median")), fmt(f.get("remeasures_median")), fmt(f.get("returned_over_ceiling")))
            for name, f in figures.items() if isinstance(f, dict)
        ]
        lines.append(
            f"`python {search['command']}` (a virtual budget of {format_duration(search['virtual_budget_s'])}: "
            f"{ctx.plan.bench_budget_fraction:.0%} of the table's probe time, at least a minute; true best {fmt(figures.get('true_best_samples_per_s'))} samples/s under the ceiling):\n\n"
            + md_table(["strategy", "median ratio", "worst ratio", "time / grid", "OOM probes/run", "pruned/run", "re-measures/run",
                        "over ceiling"], rows)
        )
    else:
        lines.append(f"bench.search: {search.get('status')} {search.get('error') or ''}".strip() + ".")
    return "\n\n".join(lines)


PHASE_FUNCTIONS: dict[str, Callable[[Context], PhaseOutput]] = {
    "tests": phase_tests,
    "repeatability": phase_repeatability,
    "precision_compile": phase_precision_compile,
    "ceiling": phase_ceiling,
    "run": phase_run,
    "side_by_side": phase_side_by_side,
    "landscape": phase_landscape,
}
