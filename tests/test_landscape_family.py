"""The family of synthetic landscapes (bench/family.py) and the benchmark's family mode."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from autotune.params import TrialParams
from autotune.records import ProbeStatus
from autotune.search.loop import VirtualClock
from bench.family import HELDOUT_START, OK, FamilyEvaluator, Landscape, draw_shape, outcomes, params_at
from bench.search import main as bench_main

DESIGN = range(0, 200)


@pytest.fixture(scope="module")
def landscape() -> Landscape:
    return Landscape(3)


def test_a_draw_is_a_pure_function_of_its_number() -> None:
    assert draw_shape(7) == draw_shape(7)
    assert draw_shape(7) != draw_shape(8)
    assert draw_shape(HELDOUT_START).draw == HELDOUT_START


def test_every_design_draw_has_an_optimum_under_its_ceiling() -> None:
    # Drawing re-rolls a world whose frugal configurations all fail, so no draw is empty; checked on
    # the small frugal set here (the whole grid of every draw is what bench.search evaluates).
    for draw in range(0, 200, 7):
        _, sps = Landscape(draw).true_best()
        assert sps > 0


def test_the_family_covers_the_worlds_it_promises() -> None:
    shapes = [draw_shape(d) for d in DESIGN]
    assert sum(s.pre_ampere for s in shapes) >= 10  # bf16 and flash crash at start-up
    assert {s.regime for s in shapes} == {"roomy", "medium", "tight"}
    assert sum(s.batch_peak is not None for s in shapes) >= 30  # throughput falls past a middle batch
    assert any(("precision", "fp16") in s.diverge_values for s in shapes)
    assert any(s.diverge_pairs for s in shapes)
    assert any(s.compile_crash for s in shapes) and any(s.compile_crash_with for s in shapes)
    gains = [s.compile_speed["inductor"] for s in shapes]
    assert min(gains) < 0.9 and max(gains) > 1.25  # compile can lose, or win by a quarter
    assert any(s.compile_speed["inductor:max-autotune"] < s.compile_speed["inductor"] for s in shapes)
    noises = [s.noise for s in shapes]
    assert min(noises) >= 0.005 and max(noises) <= 0.03


def test_the_grid_evaluation_matches_one_configuration_at_a_time(landscape) -> None:
    columns, grid = landscape.grid()
    rng = np.random.default_rng(0)
    for i in rng.choice(len(grid.status), size=25, replace=False):
        params = params_at(columns, i)
        one = landscape.noise_free(params)
        assert one.status[0] == grid.status[i]
        assert one.probe_s[0] == pytest.approx(grid.probe_s[i])
        assert one.peak_bytes[0] == pytest.approx(grid.peak_bytes[i])
        if grid.status[i] == OK:
            assert one.samples_per_s[0] == pytest.approx(grid.samples_per_s[i])


def test_the_true_best_fits_and_beats_every_other_fitting_configuration(landscape) -> None:
    best, sps = landscape.true_best()
    out = landscape.noise_free(best)
    assert out.status[0] == OK and out.peak_bytes[0] <= landscape.ceiling_bytes
    _, grid = landscape.grid()
    fits = (grid.status == OK) & (grid.peak_bytes <= landscape.ceiling_bytes)
    assert sps == pytest.approx(grid.samples_per_s[fits].max())


def test_a_configuration_fits_by_the_whole_bytes_its_probe_reports() -> None:
    # Design draw 45 (family version 2) is tight with its ceiling set at its frugal configuration's peak; the ceiling
    # is whole bytes, so that peak lies a fraction of a byte above it. A probe reports whole bytes
    # (peak at the ceiling: fits), and the score must agree: it counted these "over the ceiling".
    landscape = Landscape(45)
    columns, grid = landscape.grid()
    edge = np.flatnonzero((grid.status == OK) & (grid.peak_bytes > landscape.ceiling_bytes) & (grid.peak_bytes < landscape.ceiling_bytes + 1))
    assert len(edge) > 0
    evaluator = FamilyEvaluator(landscape)
    for i in edge[:4]:
        params = params_at(columns, i)
        reported = evaluator.evaluate(params, timeout_s=10_000)
        assert reported.ok and reported.peak_mem_bytes <= landscape.ceiling_bytes
        assert landscape.fits(landscape.noise_free(params))[0]


def test_a_probe_is_charged_to_the_clock_and_its_noise_is_reproducible(landscape) -> None:
    best, sps = landscape.true_best()
    first, second = FamilyEvaluator(landscape), FamilyEvaluator(landscape, VirtualClock())
    a = first.evaluate(best, timeout_s=10_000)
    assert a.ok and first.clock.now() == pytest.approx(a.wall_s)
    assert a.samples_per_s == pytest.approx(sps, rel=0.15) and a.samples_per_s != sps  # noisy around the truth
    assert second.evaluate(best, timeout_s=10_000).samples_per_s == a.samples_per_s  # same draw, same probe: same noise
    again = first.evaluate(best, timeout_s=10_000)
    assert again.samples_per_s != a.samples_per_s  # a re-measure draws new noise
    other = FamilyEvaluator(landscape, noise_stream=1).evaluate(best, timeout_s=10_000)
    assert other.samples_per_s != a.samples_per_s and other.samples_per_s == pytest.approx(sps, rel=0.15)  # another stream: other noise
    short = first.evaluate(best, timeout_s=1.0)
    assert short.status is ProbeStatus.TIMEOUT and first.clock.now() == pytest.approx(2 * a.wall_s + 1.0)


def test_failures_cost_what_failing_costs() -> None:
    shape = next(draw_shape(d) for d in DESIGN if draw_shape(d).pre_ampere)
    landscape = Landscape(shape)
    bf16 = TrialParams(precision="bf16", per_device_train_batch_size=1, gradient_checkpointing=True, optim="adafactor")
    result = FamilyEvaluator(landscape).evaluate(bf16, timeout_s=10_000)
    assert result.status is ProbeStatus.CRASH
    assert result.wall_s == pytest.approx(shape.startup_s)  # a crash at start-up costs the start-up


def test_loading_in_the_training_process_shows_as_waiting(landscape) -> None:
    columns = {n: np.array([v]) for n, v in TrialParams(per_device_train_batch_size=8).to_dict().items()}
    serial = outcomes(landscape.shape, columns)
    assert serial.input_wait[0] > 0  # 0 workers: every batch is loaded between steps
    columns["dataloader_num_workers"] = np.array([8])
    assert outcomes(landscape.shape, columns).input_wait[0] < serial.input_wait[0]


def test_family_mode_prints_the_figures_per_strategy_and_budget(capsys) -> None:
    assert bench_main(["--family", "design", "--draws", "2", "--budgets", "3m", "--strategies", "bayes,random", "--processes", "1",
                       "--gpu-seeds", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["family"] == "design" and summary["draws"] == 2
    for strategy in ("bayes", "random"):
        figures = summary["strategies"][strategy]["3m"]
        for key in ("median_ratio", "p5_ratio", "worst_ratio", "oom_probes_total", "returned_over_ceiling"):
            assert key in figures
        assert figures["returned_over_ceiling"] == 0
        assert 0.0 <= figures["worst_ratio"] <= figures["median_ratio"] <= 1.0 + 1e-9
        low, high = figures["p5_ratio_90"]  # the bootstrap's resamples hold only the draws' own ratios
        assert figures["worst_ratio"] <= low <= high <= max(figures["median_ratio"], 1.0)


def test_the_held_out_ranges_are_apart_from_the_design_draws_and_each_other() -> None:
    """Design rounds used draws 0-399; each held-out range is 200 draws from a multiple of 100,000
    (bench.trace seeds a draw with its index in its range)."""
    from bench.family import RANGE_SPAN
    from bench.search import family_ranges

    ranges = family_ranges()
    assert ranges["design"] == 0 and set(ranges) >= {"heldout", "heldout2", "heldout3", "heldout4", "heldout5", "heldout6", "heldout7", "heldout8", "heldout9", "heldout10", "heldout11", "heldout12", "heldout13", "heldout14", "heldout15", "heldout16", "heldout17", "heldout18", "heldout19"}
    starts = sorted(start for name, start in ranges.items() if not name.startswith("gen2"))  # gen2: another generator's draws
    assert len(set(starts)) == len(starts) and all(start % RANGE_SPAN == 0 for start in starts)
    assert all(later - earlier >= RANGE_SPAN > 400 for earlier, later in zip(starts, starts[1:]))


def _details(path, ratios: dict[int, float], strategy: str = "bayes") -> str:
    lines = ["strategy,draw,budget_s,seed,ratio"] + [f"{strategy},{d},1800.0,{d},{r}" for d, r in ratios.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_compare_pairs_two_runs_draw_by_draw(tmp_path, capsys) -> None:
    """--compare: draws changed, the sum of changes, each side's figures, the 5th percentile's change
    with a paired bootstrap interval that holds the change itself."""
    rng = np.random.default_rng(7)
    before = {d: float(r) for d, r in enumerate(rng.uniform(0.85, 1.0, 100))}
    after = dict(before)
    worst = sorted(before, key=before.get)[:10]
    for d in worst:  # the tail lifted to 0.90 (under the median): the 5th percentile rises, the median stays
        after[d] = 0.90
    a, b = _details(tmp_path / "a.csv", before), _details(tmp_path / "b.csv", after)
    assert bench_main(["--compare", a, b]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bayes"]["30m"]
    assert figures["draws"] == 100 and figures["changed"] == 10
    assert figures["sum_change"] == pytest.approx(sum(0.90 - before[d] for d in worst), abs=1e-3)
    assert figures["after"]["worst"] > figures["before"]["worst"] and figures["after"]["median"] == figures["before"]["median"]
    low, high = figures["p5_change_90"]
    assert figures["p5_change"] > 0.0 and low <= figures["p5_change"] <= high
    packed = tmp_path / "a.csv.gz"
    packed.write_bytes(gzip.compress((tmp_path / "a.csv").read_bytes()))
    assert bench_main(["--compare", str(packed), a]) == 0  # gzipped, as the committed baselines are; against itself:
    same = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bayes"]["30m"]
    assert same["changed"] == 0 and same["p5_change_90"] == [0.0, 0.0]  # no change, an interval of zero width
    assert bench_main(["--compare", a, a]) == 0
    same = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bayes"]["30m"]
    assert same["changed"] == 0 and same["p5_change_90"] == [0.0, 0.0]


def test_compare_refuses_files_it_cannot_pair(tmp_path, capsys) -> None:
    a = _details(tmp_path / "a.csv", {0: 0.9, 1: 1.0})
    b = _details(tmp_path / "b.csv", {0: 0.9, 1: 1.0}, strategy="tpe")
    assert bench_main(["--compare", a, b]) == 2
    assert "share no strategy" in capsys.readouterr().err
    assert bench_main(["--compare", a, str(tmp_path / "missing.csv")]) == 2
    assert "--details CSV" in capsys.readouterr().err
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(gzip.compress((tmp_path / "a.csv").read_bytes())[:-12])  # a gzipped file cut short
    assert bench_main(["--compare", a, str(cut)]) == 2
    assert "--details CSV" in capsys.readouterr().err
    assert bench_main(["--family", "design", "--draws", "1", "--noise-stream", "-1"]) == 2
    assert "--noise-stream takes 0" in capsys.readouterr().err


def test_family_mode_reports_each_gpu_recorded_table_on_its_own_line(capsys) -> None:
    from bench.search import bench, gpu_tables

    specs = gpu_tables()
    # The H100's landscape tables, committed under reports/gpu/, at the 9 GiB ceiling their phase recorded.
    names = {spec.rpartition(":")[0].rsplit("/", 1)[-1] for spec in specs}
    assert "landscape_nvidia-h100-80gb-hbm3-dataloader_num_workers-0.csv.gz" in names
    assert all(spec.endswith(":9663676416") for spec in specs)
    assert bench_main(["--family", "design", "--draws", "1", "--budgets", "2m", "--strategies", "random", "--processes", "1",
                       "--gpu-seeds", "1"]) == 0
    out = capsys.readouterr().out
    gpu = json.loads(out.strip().splitlines()[-1])["gpu_tables"]["2m"]
    assert set(gpu) == {name.removesuffix(".csv.gz") for name in names}
    for table, figures in gpu.items():
        assert figures["random"]["seeds"] == 1 and 0.0 <= figures["random"]["worst_ratio"] <= 1.0
        assert sum(line.startswith(f"{table} ") for line in out.splitlines()) == 1  # its own line
    assert bench_main(["--family", "design", "--draws", "1", "--gpu-seeds", "-1"]) == 2
    # Replays in worker processes give what they give in one.
    assert bench(specs[:1], ["random"], 2, 120.0, processes=2) == bench(specs[:1], ["random"], 2, 120.0)


def test_gpu_tables_skips_a_table_without_its_recorded_ceiling(tmp_path) -> None:
    from bench.search import gpu_tables

    (tmp_path / "card-a").mkdir()
    (tmp_path / "card-a" / "landscape_card-a.csv.gz").write_bytes(b"")
    (tmp_path / "card-a" / "landscape.json").write_text(json.dumps({"data": {"ceiling_bytes": 2**33}}))
    (tmp_path / "card-b").mkdir()
    (tmp_path / "card-b" / "landscape_card-b.csv.gz").write_bytes(b"")  # no landscape.json beside it
    assert gpu_tables(tmp_path) == [f"{tmp_path / 'card-a' / 'landscape_card-a.csv.gz'}:{2**33}"]


def test_version_2_draws_loader_bound_worlds_and_probes_without_telemetry() -> None:
    """#44: ties across precisions where the loader is the bottleneck, and tables without the
    optional input-wait and CI columns."""
    shapes = [draw_shape(d) for d in DESIGN]
    assert sum(s.loader_bound for s in shapes) >= 20 and sum(not s.telemetry for s in shapes) >= 50
    landscape = Landscape(next(s for s in shapes if s.loader_bound and not s.telemetry))
    few = {n: np.array([v]) for n, v in TrialParams(per_device_train_batch_size=8, dataloader_num_workers=2).to_dict().items()}
    by_precision = [outcomes(landscape.shape, {**few, "precision": np.array([p])}).samples_per_s[0] for p in ("fp32", "bf16")]
    assert by_precision[0] == pytest.approx(by_precision[1], rel=0.01)  # two workers: the loader sets the pace
    result = FamilyEvaluator(landscape).evaluate(landscape.true_best()[0], timeout_s=10_000)
    assert result.ok and result.input_wait_fraction is None and result.step_time_ci95_rel is None
