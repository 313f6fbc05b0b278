"""The GPU acceptance run (bench/gpu_acceptance.py): its whole harness on the CPU, and its parts."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from autotune.params import TrialParams
from autotune.records import DeviceInfo, ProbeResult
from autotune.search.replay import load_table
from bench import gpu_acceptance, gpu_phases

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {"ok", "flagged", "skipped", "timeout"}  # "error" is a bug in the harness


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "bench.gpu_acceptance", "--device", "cpu", "--quick", "--out", str(out), *extra]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=540)


def _record(out: Path, phase: str) -> dict:
    return json.loads((out / f"{phase}.json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_quick_cpu_run_writes_every_phase_and_a_phase_reruns_alone(tmp_path: Path) -> None:
    out = tmp_path / "acceptance"
    done = _run(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    summary = (out / "summary.md").read_text(encoding="utf-8")
    assert "CPU" in summary and "torch" in summary and "transformers" in summary
    for number, phase in enumerate(gpu_acceptance.PHASES, 1):
        record = _record(out, phase)
        assert record["status"] in ALLOWED, (phase, record["status"], record["reason"])
        assert record["reason"], phase
        assert f"## {number}. {phase}" in summary

    tests = _record(out, "tests")
    assert tests["status"] == "skipped" and "no GPU test ran on the CPU" in tests["reason"]
    assert tests["data"]["passed"] == tests["data"]["failed"] == 0

    run = _record(out, "run")
    if run["status"] == "ok":  # the study and its report sit in the output folder
        assert (out / run["data"]["database"]).is_file() and (out / run["data"]["report"]).is_file()

    landscape = _record(out, "landscape")
    if landscape["data"]["table"]:
        table = load_table(out / landscape["data"]["table"])
        assert len(table) == landscape["data"]["table_rows"] > 0
        table.check_space(table.space())
        failed = {k: v for k, v in landscape["data"]["statuses"].items() if k in ("oom", "crash")}
        for status, count in failed.items():  # OOM and crash rows are kept in the table
            assert (table.frame["status"] == status).sum() == count

    # One phase again: only its JSON is rewritten, the other phases' files stay as they were.
    others = {p: (out / f"{p}.json").read_bytes() for p in gpu_acceptance.PHASES if p != "tests"}
    before = tests["started_at"], (out / "tests.json").stat().st_mtime_ns
    again = _run(out, "--phase", "tests")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "=== repeatability" not in again.stdout
    assert (out / "tests.json").stat().st_mtime_ns != before[1]
    assert {p: (out / f"{p}.json").read_bytes() for p in others} == others
    assert "## 7. landscape" in (out / "summary.md").read_text(encoding="utf-8")


def test_unknown_phase_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_acceptance.parse_args(["--phase", "tests,landscpe"])
    assert exc.value.code == 2
    assert "landscpe" in capsys.readouterr().err
    assert gpu_acceptance.parse_args(["--phase", "landscape,tests"]).phases == ["tests", "landscape"]
    assert tuple(gpu_phases.PHASE_FUNCTIONS) == gpu_acceptance.PHASES  # one function per phase, in the run's order


def test_device_slug_names_the_card() -> None:
    gpu = DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", total_memory_bytes=80 * 2**30)
    assert gpu_acceptance.device_slug(gpu) == "nvidia-h100-80gb-hbm3"
    assert gpu_acceptance.device_slug(DeviceInfo(kind="cpu", name="CPU: AMD EPYC (2 cores)", total_memory_bytes=1)) == "cpu"


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel holding one module, ``name``."""
    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


def test_missing_module_is_installed_from_the_wheelhouse_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    _wheel(wheelhouse, "autotune_acceptance_dep")
    target = tmp_path / "site"
    report = gpu_acceptance.ensure_dependencies(
        {"autotune_acceptance_dep": "autotune_acceptance_dep", "json": "json"}, wheelhouse=wheelhouse, target=target, use_environment=False,
    )
    assert report["missing"] == ["autotune_acceptance_dep"] and report["into"] == str(target)
    import autotune_acceptance_dep

    assert autotune_acceptance_dep.VALUE == 42
    assert str(target) in sys.path and str(target) in __import__("os").environ["PYTHONPATH"]
    # Everything present: nothing to do, even without a wheelhouse.
    assert gpu_acceptance.ensure_dependencies({"json": "json"}, wheelhouse=tmp_path / "none")["installed"] == []


def test_missing_module_without_a_wheelhouse_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(gpu_acceptance.SetupError, match="make wheelhouse"):
        gpu_acceptance.ensure_dependencies({"autotune_no_such_module": "nope"}, wheelhouse=tmp_path / "empty", target=tmp_path / "site")


def test_the_landscape_plan_is_polyglot_at_seq_512_on_the_cards_memory_with_every_dimension_that_moves_speed() -> None:
    plan = gpu_phases.FULL
    configs = gpu_phases.landscape_grid(plan.land_grid)
    assert plan.land_model == "polyglot-ko-1.3b" and plan.land_seq_len >= 512 and plan.land_card_ceiling
    assert len(configs) == len({c.key() for c in configs}) == 960 >= 500
    assert set(plan.land_grid["torch_compile"]) == {"off", "inductor", "inductor:max-autotune"}
    assert all(len(values) >= 2 for values in plan.land_grid.values())
    modes = [c.torch_compile for c in configs]  # uncompiled, then inductor, then max-autotune
    assert modes == sorted(modes, key=plan.land_grid["torch_compile"].index) and modes.count("off") == 320


def test_landscape_grid_is_a_full_factorial_uncompiled_first() -> None:
    grid = gpu_phases.PYTHIA_160M_GRID
    configs = gpu_phases.landscape_grid(grid)
    assert len(configs) == len({c.key() for c in configs}) == 256 >= 200
    assert all(len(values) >= 2 for values in grid.values())  # every dimension varies
    first_compiled = next(i for i, c in enumerate(configs) if c.torch_compile != "off")
    assert first_compiled == 128 and all(c.torch_compile != "off" for c in configs[first_compiled:])
    # Compiled without checkpointing before compiled with it (those recompile each probe, ~45 s on an H100).
    checkpointed = [c.gradient_checkpointing for c in configs[first_compiled:]]
    assert checkpointed == sorted(checkpointed) and checkpointed.count(True) == 64
    done = {c.key() for c in configs[:first_compiled + 5]}
    assert gpu_phases.complete_subgrid(grid, done) == {**grid, "torch_compile": ("off",)}
    assert gpu_phases.narrowing(grid, gpu_phases.complete_subgrid(grid, done)) == "-torch_compile-off"
    assert gpu_phases.complete_subgrid(grid, {c.key() for c in configs}) == grid
    assert gpu_phases.narrowing(grid, grid) == ""
    assert gpu_phases.complete_subgrid(grid, set()) is None
    # Every configuration without checkpointing (compiled or not) but only part of the checkpointed
    # compiled ones: the compiled factorial without checkpointing beats the uncompiled one of equal size.
    no_ckpt = {c.key() for c in configs if not c.gradient_checkpointing}
    some_ckpt = {c.key() for c in configs[:first_compiled + 64 + 10]}
    sub = gpu_phases.complete_subgrid(grid, no_ckpt | some_ckpt)
    assert sub == {**grid, "gradient_checkpointing": (False,)}
    assert gpu_phases.narrowing(grid, sub) == "-gradient_checkpointing-False"
    # One compiled configuration without checkpointing missing: back to the uncompiled factorial.
    one_missing = some_ckpt - {configs[first_compiled].key()}
    assert gpu_phases.complete_subgrid(grid, one_missing) == {**grid, "torch_compile": ("off",)}


class _MemoryBound:
    """An evaluator whose configurations above ``limit`` samples run out of memory (peak = batch bytes)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.batches = limit, []

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        batch = params.per_device_train_batch_size
        self.batches.append(batch)
        if batch > self.limit:
            return ProbeResult(status="oom", error="OutOfMemoryError", wall_s=1.0)
        return ProbeResult(status="ok", samples_per_s=float(batch), peak_mem_bytes=batch, wall_s=1.0, measured_steps=1)


class _Study:
    """A finished run's result with nothing measured: every side-by-side row is probed."""

    def configurations(self) -> Any:
        import pandas as pd

        return pd.DataFrame(columns=["probe_trials"])


def _context(tmp_path: Path) -> gpu_phases.Context:
    device = DeviceInfo(kind="cuda", name="Fake", total_memory_bytes=80 * 2**30, compute_capability=(9, 0))
    return gpu_phases.Context(name="side_by_side", out=tmp_path, device=device, plan=gpu_phases.FULL, box_s=600, slug="fake")


def _table(tmp_path: Path, fake: _MemoryBound, ceiling: int, sizes: list[int] | None = None) -> gpu_phases.SideBySide:
    return gpu_phases.SideBySide(_context(tmp_path), fake, ceiling, sizes or [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64], _Study())


def test_largest_batch_doubles_until_oom_then_bisects(tmp_path: Path) -> None:
    fake = _MemoryBound(limit=37)
    largest, spent, probes, stopped = gpu_phases._largest_batch(_context(tmp_path), _table(tmp_path, fake, 10**9), TrialParams(), ceiling=10**9)
    assert largest == 37 and stopped is None
    assert fake.batches[:4] == [8, 16, 32, 64]  # from transformers' default batch
    assert probes == len(fake.batches) and spent == float(probes)
    assert 37 in fake.batches and 38 in fake.batches  # the boundary itself was measured on both sides


def test_largest_batch_counts_over_the_ceiling_as_not_fitting(tmp_path: Path) -> None:
    fake = _MemoryBound(limit=10**6)  # never runs out of memory; the ceiling (peak = batch bytes) decides
    largest, _, _, stopped = gpu_phases._largest_batch(_context(tmp_path), _table(tmp_path, fake, 20), TrialParams(), ceiling=20)
    assert largest == 20 and stopped is None


def test_largest_batch_reads_what_the_run_measured_instead_of_probing_it_again(tmp_path: Path) -> None:
    fake = _MemoryBound(limit=12)
    table = _table(tmp_path, fake, 10**9)
    table.rows[TrialParams().key()] = {"status": "ok", "peak_mem_bytes": 8, "wall_s": 5.0}  # the run's baseline, bs 8
    largest, spent, probes, stopped = gpu_phases._largest_batch(_context(tmp_path), table, TrialParams(), ceiling=10**9)
    assert largest == 12 and 8 not in fake.batches and stopped is None
    assert probes == len(fake.batches) and spent == float(probes)  # only the probes run here count


class _TimesOutAbove(_MemoryBound):
    """Fits everything, but a probe above ``slow`` samples passes its deadline (the box ending mid-finder)."""

    def __init__(self, slow: int) -> None:
        super().__init__(limit=10**6)
        self.slow = slow

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        if params.per_device_train_batch_size > self.slow:
            self.batches.append(params.per_device_train_batch_size)
            return ProbeResult(status="timeout", error="probe passed its deadline and was killed", wall_s=15.0)
        return super().evaluate(params, timeout_s=timeout_s)


def test_a_finder_stopped_by_a_timeout_gives_no_answer_only_a_lower_bound(tmp_path: Path) -> None:
    # An H200 side by side (2026-11-28) published batch 8 as the largest fp32 batch that fits because the box
    # ended while batch 16 ran; batch 64 fits there. A timeout says nothing about memory.
    fake = _TimesOutAbove(slow=8)
    largest, _, probes, stopped = gpu_phases._largest_batch(_context(tmp_path), _table(tmp_path, fake, 10**9), TrialParams(), ceiling=10**9)
    assert fake.batches == [8, 16] and probes == 2
    assert largest == 8 and stopped is not None and "batch 16 ended timeout" in stopped


def test_the_finder_runs_lightnings_short_untimed_trials_and_the_row_one_full_probe(tmp_path: Path) -> None:
    # Lightning's binsearch runs steps_per_trial=3 steps per batch, untimed; the row's figures come from one probe of
    # the run's protocol at the batch it settles on.
    from autotune.probe.evaluator import ProbeEvaluator

    calls: list[tuple[int, int, int]] = []

    def evaluate(self: ProbeEvaluator, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        calls.append((params.per_device_train_batch_size, self.warmup_steps, self.measure_steps))
        if params.per_device_train_batch_size > 20:
            return ProbeResult(status="oom", error="OutOfMemoryError", wall_s=1.0)
        return ProbeResult(status="ok", samples_per_s=1.0, peak_mem_bytes=params.per_device_train_batch_size, wall_s=1.0, measured_steps=1)

    evaluator = ProbeEvaluator(model={}, seq_len=8, device="cpu", warmup_steps=3, measure_steps=8)
    table = gpu_phases.SideBySide(_context(tmp_path), evaluator, 10**9, [8, 16, 24, 32], _Study())
    with mock.patch.object(ProbeEvaluator, "evaluate", evaluate):
        largest, _, trials, stopped = gpu_phases._largest_batch(_context(tmp_path), table, TrialParams(), ceiling=10**9)
        assert largest == 20 and stopped is None
        assert {(w, m) for _, w, m in calls} == {(1, gpu_phases.FINDER_STEPS - 1)} and trials == len(calls)
        assert not table.rows  # a trial is no row of the table
        row = table.measured_row(TrialParams(per_device_train_batch_size=largest))
    assert calls[-1] == (20, 3, 8) and row["status"] == "ok"


def test_every_row_out_of_memory_steps_down_one_batch_size_of_the_space(tmp_path: Path) -> None:
    fake = _MemoryBound(limit=30)
    table = _table(tmp_path, fake, 10**9)
    row = table.measured_row(TrialParams(per_device_train_batch_size=45), time_to_find_s=3.0)
    assert fake.batches == [45, 40, 32, 24]  # 45 is no size of the space: the next smaller ones are
    assert row["status"] == "ok" and row["per_device_train_batch_size"] == 24
    assert row["stepped_down_from"] == [45, 40, 32] and row["time_to_find_s"] == 3.0
    again = table.measured_row(TrialParams(per_device_train_batch_size=24))
    assert again["samples_per_s"] == 24.0 and fake.batches == [45, 40, 32, 24]  # measured once, shared


def test_a_side_by_side_box_too_small_for_its_run_is_refused_not_shortened(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    ctx.box_s = ctx.plan.sbs_run_budget_s + ctx.plan.sbs_rows_reserve_s - 1
    record = gpu_phases.phase_side_by_side(ctx)
    assert record.data["status"] == "refused"
    assert f"--box side_by_side={ctx.plan.sbs_run_budget_s + ctx.plan.sbs_rows_reserve_s:.0f}" in record.data["reason"]
    assert not (tmp_path / "side_by_side.db").exists()  # nothing ran


def test_landscape_ceiling_puts_the_largest_batch_on_both_sides(tmp_path: Path) -> None:
    from dataclasses import replace

    from autotune.models import resolve_model
    from autotune.plan import CEILING_SAFETY_FRACTION
    from autotune.search.memory import MemoryModel
    from autotune.search.memory_prior import ModelDims

    ctx = _context(tmp_path)
    assert gpu_phases._landscape_ceiling(ctx, resolve_model(ctx.plan.land_model)) == int(CEILING_SAFETY_FRACTION * 80 * 2**30)  # the card's
    ctx.plan = replace(ctx.plan, land_model="pythia-160m", land_seq_len=128, land_grid=gpu_phases.PYTHIA_160M_GRID, land_card_ceiling=False)
    model = resolve_model(ctx.plan.land_model)
    ceiling = gpu_phases._landscape_ceiling(ctx, model)
    assert ceiling is not None and ceiling % (2**30 // 2) == 0
    memory = MemoryModel(ModelDims.from_spec(model), ctx.plan.land_seq_len)
    largest = [c for c in gpu_phases.landscape_grid(ctx.plan.land_grid) if c.per_device_train_batch_size == 64]
    over = sum(memory.predict(c) > ceiling for c in largest)
    assert 0 < over < len(largest)  # OOM rows and fitting rows at the largest batch


def _timed_context(tmp_path: Path, box_s: float, grace_s: float) -> gpu_phases.Context:
    from dataclasses import replace

    device = DeviceInfo(kind="cpu", name="CPU: test", total_memory_bytes=2**34)
    plan = replace(gpu_phases.QUICK, grace_s=grace_s)
    return gpu_phases.Context(name="tests", out=tmp_path, device=device, plan=plan, box_s=box_s, slug="cpu")


def test_a_phase_past_its_box_is_stopped_and_keeps_what_it_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    def endless(ctx: gpu_phases.Context) -> gpu_phases.PhaseOutput:
        ctx.partial["rows"] = [{"measured": 1}]
        time.sleep(30)
        raise AssertionError("not stopped")

    monkeypatch.setitem(gpu_phases.PHASE_FUNCTIONS, "tests", endless)
    record = gpu_acceptance.run_phase("tests", _timed_context(tmp_path, box_s=0.2, grace_s=0.2))
    assert record["status"] == "timeout" and "interrupted" in record["reason"]
    assert record["data"]["rows"] == [{"measured": 1}] and record["wall_s"] < 5
    assert json.loads((tmp_path / "tests.json").read_text())["status"] == "timeout"


def test_a_broken_phase_is_recorded_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: gpu_phases.Context) -> gpu_phases.PhaseOutput:
        raise ValueError("a bug")

    monkeypatch.setitem(gpu_phases.PHASE_FUNCTIONS, "tests", broken)
    record = gpu_acceptance.run_phase("tests", _timed_context(tmp_path, box_s=10, grace_s=1))
    assert record["status"] == "error" and "ValueError: a bug" in record["reason"]
    assert "a bug" in record["data"]["traceback"] and (tmp_path / "tests.json").is_file()


def test_landscape_cut_short_writes_the_complete_half_and_goes_on_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    grid = {**gpu_phases.QUICK.land_grid, "torch_compile": ("off", "inductor")}
    ctx = _timed_context(tmp_path, box_s=60, grace_s=5)
    ctx.plan = replace(ctx.plan, land_grid=grid)
    probed: list[TrialParams] = []

    def fake_probe(self: gpu_phases.Context, evaluator: object, params: TrialParams, *, reserve_s: float = 0.0) -> ProbeResult | None:
        if params.torch_compile != "off" and not allow_compiled:  # the box's end cuts the first compiled probe short
            return ProbeResult(status="timeout", error="probe passed its 5 s deadline and was killed", wall_s=5.0)
        probed.append(params)
        if params.per_device_train_batch_size == 8 and params.gradient_checkpointing:
            return ProbeResult(status="oom", error="OutOfMemoryError", wall_s=1.0)
        return ProbeResult(status="ok", samples_per_s=float(params.per_device_train_batch_size), peak_mem_bytes=2**30, wall_s=1.0, measured_steps=2)

    monkeypatch.setattr(gpu_phases.Context, "probe", fake_probe)
    allow_compiled = False
    first = gpu_phases.phase_landscape(ctx)
    assert first.data["status"] == "timeout" and first.data["probed"] == 4 and first.data["table_rows"] == 4
    rows = [json.loads(line) for line in (tmp_path / "landscape_rows.jsonl").read_text().splitlines()]
    repeats = [row for row in rows if row.get("repeat_of_row")]
    assert [row["status"] for row in rows].count("timeout") == 0 and len(rows) - len(repeats) == 4  # the cut probe is no row
    assert len(repeats) == 1 and first.data["noise"]["pairs"] == 1  # one row probed again after every 3 new ones
    assert first.data["noise"]["median_abs_rel_diff"] == 0.0  # the fake probe repeats exactly
    table = load_table(tmp_path / first.data["table"])
    assert set(table.frame["torch_compile"]) == {"off"} and (table.frame["status"] == "oom").sum() == 1
    assert first.data["bench_search"]["status"] == "ok"

    allow_compiled = True  # run again: only the compiled half is probed, the whole grid is written
    probed.clear()
    again = gpu_phases.phase_landscape(ctx)
    assert again.data["status"] == "ok" and again.data["resumed"] == 4 and again.data["table_rows"] == 8
    compiled = [p for p in probed if p.torch_compile != "off"]
    assert len(compiled) == 4 and len(probed) - len(compiled) == again.data["noise"]["repeats"] - 1  # and one more repeat


def test_bitsandbytes_is_unpacked_with_only_the_cpu_and_one_cuda_major(tmp_path: Path) -> None:
    """bitsandbytes' wheel carries a library per CUDA/ROCm version; the carried copy keeps the CPU one
    and those of the image's CUDA major (a device call carries at most 64 MiB)."""
    import zipfile

    from bench.wheelhouse import unpack_bitsandbytes

    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    libraries = ["cpu", "cuda118", "cuda128", "cuda130", "cuda132", "rocm64", "xpu2025"]
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("bitsandbytes/__init__.py", "")
        archive.writestr("bitsandbytes-0.50.2.dist-info/METADATA", "Name: bitsandbytes\n")
        for lib in libraries:
            archive.writestr(f"bitsandbytes/libbitsandbytes_{lib}.so", b"\0" * 16)
    kept = unpack_bitsandbytes(wheel, tmp_path / "site", cuda_major=13)
    assert kept == ["libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so"]
    assert sorted(p.name for p in (tmp_path / "site" / "bitsandbytes").glob("*.so")) == kept
    assert (tmp_path / "site" / "bitsandbytes" / "__init__.py").exists()
    assert (tmp_path / "site" / "bitsandbytes-0.50.2.dist-info" / "METADATA").exists()


def _landscape_rows(configs: list, speed: Callable[[Any], float]) -> dict:
    return {c.key(): {**c.to_dict(), "status": "ok", "samples_per_s": speed(c)} for c in configs}


def test_table_first_completes_the_table_that_fixes_the_dimension_that_mattered_least() -> None:
    grid = gpu_phases.PYTHIA_160M_GRID
    configs = gpu_phases.landscape_grid(grid)
    first_compiled = 128
    # Measured so far: the uncompiled half and the compiled half without checkpointing. Loader workers
    # change the speed by 1%, everything else by more; among the checkpointed compiled configurations
    # 10 with 2 workers and 3 with none are done.
    def speed(c: Any) -> float:
        return (c.per_device_train_batch_size * (1.3 if c.precision == "bf16" else 1.0) * (1.1 if c.optim == "adafactor" else 1.0)
                * (1.2 if c.attn_implementation == "sdpa" else 1.0) * c.gradient_accumulation_steps ** 0.1
                * (0.8 if c.gradient_checkpointing else 1.0) * (1.5 if c.torch_compile != "off" else 1.0)
                * (1.01 if c.dataloader_num_workers else 1.0))
    checkpointed = [c for c in configs[first_compiled:] if c.gradient_checkpointing]
    done = [c for c in configs if not (c.torch_compile != "off" and c.gradient_checkpointing)]
    done += [c for c in checkpointed if c.dataloader_num_workers == 2][:10] + [c for c in checkpointed if c.dataloader_num_workers == 0][:3]
    rows = _landscape_rows(done, speed)
    assert gpu_phases.least_informative_dimension(grid, rows) == "dataloader_num_workers"
    order = gpu_phases.table_first(grid, configs, rows)
    assert len(order) == 256 - len(done) and not {c.key() for c in order} & set(rows)
    # The 22 missing with 2 workers come first (fewer than the 29 with none), in the grid's own order.
    assert all(c.dataloader_num_workers == 2 for c in order[:22]) and order[22].dataloader_num_workers == 0
    assert [c.key() for c in order[:22]] == [c.key() for c in configs if c.key() in {o.key() for o in order[:22]}]
    rows |= _landscape_rows(order[:22], speed)
    sub = gpu_phases.complete_subgrid(grid, set(rows))
    assert sub == {**grid, "dataloader_num_workers": (2,)} and len(sub["torch_compile"]) == 2
    # No pair of measured rows yet: the grid's own order.
    assert gpu_phases.least_informative_dimension(grid, {}) is None
    assert gpu_phases.table_first(grid, configs, {}) == configs


def test_box_option_sets_a_phase_box_and_refuses_bad_ones() -> None:
    args = gpu_acceptance.parse_args(["--phase", "tests,landscape", "--box", "landscape=400", "--box", "tests=90"])
    assert args.boxes == {"landscape": 400.0, "tests": 90.0}
    for bad in ("landscape", "landscape=soon", "landscap=400", "landscape=-5"):
        with pytest.raises(SystemExit):
            gpu_acceptance.parse_args(["--box", bad])
