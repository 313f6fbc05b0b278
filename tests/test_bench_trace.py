"""bench.trace: the traced search is the one bench.search scores, and what it says was missed is so."""

from __future__ import annotations

import io

import pytest

from bench.family import FAMILY_PARAMS, OK, Landscape
from bench.search import family_search
from bench.trace import _draws, calibration, main, trace

BUDGET_S = 300.0  # five virtual minutes: a few probes, and something left to miss


def test_the_trace_is_the_search_bench_search_scores() -> None:
    out = io.StringIO()
    row = trace(2, BUDGET_S, out=out)
    scored = family_search("bayes", 2, BUDGET_S, 2)
    assert (row["ratio"], row["found"], row["probes"]) == (scored["ratio"], scored["found"], scored["probes"])
    lines = out.getvalue().splitlines()
    probe_lines = [line for line in lines if " s  " in line and line.endswith("GiB")]
    assert len(probe_lines) >= row["probes"] > 0  # every probe, timed-out ones included
    assert any(line.startswith("found ") and row["found"] in line for line in lines)


def test_a_second_generator_trace_is_the_search_bench_search_scores_and_its_misses_are_one_value_changes() -> None:
    from bench.landscapes2 import draw, search_draw
    from bench.trace import trace_gen2

    index = 900_006  # a range no benchmark reads
    out = io.StringIO()
    row = trace_gen2(index, BUDGET_S, out=out)
    scored = search_draw("bayes", index, BUDGET_S, index % 200_000)
    assert (row["ratio"], row["found"], row["probes"]) == (scored["ratio"], scored["found"], scored["probes"])
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"gen2-v1-draw{index}:") and "cores" in lines[0]
    assert len([line for line in lines if " s  " in line and line.endswith("GiB")]) >= row["probes"] > 0
    d = draw(index)
    for name, value, factor, runs in row["missed"]:
        changed = d.true_samples_per_s(row["found_params"].replace(**{name: value}))
        assert runs == (changed > 0) and factor == pytest.approx(changed / d.true_samples_per_s(row["found_params"]))


def test_a_trace_on_another_noise_stream_is_that_streams_scored_search() -> None:
    out, default_out = io.StringIO(), io.StringIO()
    row = trace(2, BUDGET_S, out=out, noise_stream=1)
    scored = family_search("bayes", 2, BUDGET_S, 2, noise_stream=1)
    assert (row["ratio"], row["found"], row["probes"]) == (scored["ratio"], scored["found"], scored["probes"])
    trace(2, BUDGET_S, out=default_out)
    assert out.getvalue() != default_out.getvalue()  # other noise: other measured samples/s


def test_each_miss_is_the_found_configuration_with_one_value_of_the_optimum() -> None:
    row = trace(2, BUDGET_S, out=io.StringIO())
    landscape = Landscape(2)
    optimum, _ = landscape.true_best()
    found = row["found_params"]
    assert row["ratio"] < 1.0 and row["missed"]
    # Every missed value changed at once gives the optimum: the misses are all the differences.
    all_changed = found.replace(**{name: value for name, value, _, _ in row["missed"]})
    assert all(getattr(all_changed, n) == getattr(optimum, n) for n in FAMILY_PARAMS)
    found_sps = float(landscape.noise_free(found).samples_per_s[0])
    for name, value, factor, runs_and_fits in row["missed"]:
        one = landscape.noise_free(found.replace(**{name: value}))
        assert factor == pytest.approx(float(one.samples_per_s[0]) / found_sps)
        assert runs_and_fits == (int(one.status[0]) == OK and float(one.peak_bytes[0]) <= landscape.ceiling_bytes)


def test_bad_draw_numbers_are_one_line_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["4,x"])
    assert exit_info.value.code == 2
    assert "whole numbers or ranges separated by commas" in capsys.readouterr().err


def test_a_negative_noise_stream_is_a_one_line_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["2", "--noise-stream", "-1"])
    assert exit_info.value.code == 2
    assert "--noise-stream takes 0" in capsys.readouterr().err


def test_calibration_scores_every_probe_that_measured_a_throughput() -> None:
    out = io.StringIO()
    summary = calibration([2, 5], BUDGET_S, out=out)
    # The baseline, the expert rule's configuration and, where it fails, its neighbours up to the first
    # that runs under the ceiling run before the strategy proposes anything: no prediction to score.
    measured = sum(1 for draw in (2, 5) for _, _, result in _after_the_references(draw) if result.ok and result.samples_per_s)
    assert summary["probes"] == measured > 0
    assert summary["percentiles"][5] <= summary["percentiles"][50] <= summary["percentiles"][95]
    assert f"{summary['probes']} probes over 2 draws" in out.getvalue()


@pytest.mark.slow
def test_the_throughput_models_stated_uncertainty_matches_its_errors() -> None:
    # The first ten design draws from 100 (steptime.SD_CALIBRATION was read off family version 1's
    # draws 0-99) whose probes report their input wait and whose loader keeps up, the world the model
    # was calibrated in, 30 virtual minutes: a probe's error over its predicted sd has sd near 1 (0.92).
    # On version 2's draws 100-109, half silent or loader-bound, it is 1.6 (3.3 with #44's coverage
    # probes, which ask exactly where the model is blind): its stated uncertainty is too small there.
    from bench.family import draw_shape

    draws = [d for d in range(100, 200) if draw_shape(d).telemetry and not draw_shape(d).loader_bound][:10]
    summary = calibration(draws, 1800.0, out=io.StringIO())
    assert summary["probes"] > 100
    assert 0.8 <= summary["sd_z"] <= 1.3


def test_draw_ranges() -> None:
    assert _draws("3,7-9,12") == [3, 7, 8, 9, 12]


def _log(draw: int) -> list:
    log: list = []
    family_search("bayes", draw, BUDGET_S, draw, log=log)
    return log


def _after_the_references(draw: int) -> list:
    """The probes after the baseline and the expert rule's chain (the first of them after the baseline that fits)."""
    log, ceiling = _log(draw), Landscape(draw).ceiling_bytes
    first_fit = next(i for i, (_, _, result) in enumerate(log) if i >= 1 and result.ok and result.fits(ceiling))
    return log[first_fit + 1:]


def test_the_measured_ratio_is_the_best_noise_free_configuration_the_search_measured() -> None:
    # The best of what the search measured (noise-free, fitting under the ceiling), recomputed from
    # its probes: never below what it returned.
    for draw in (2, 5):
        log: list = []
        row = family_search("bayes", draw, BUDGET_S, draw, log=log)
        landscape = Landscape(draw)
        _, true_sps = landscape.true_best()
        failed = {params.key() for _, params, result in log
                  if result.status.is_measured() and not result.fits(landscape.ceiling_bytes)}
        measured = [landscape.noise_free(params) for _, params, result in log if result.ok and params.key() not in failed]
        best = max(float(o.samples_per_s[0]) / true_sps for o in measured if landscape.fits(o)[0])
        assert row["measured_ratio"] == pytest.approx(best)
        assert row["measured_ratio"] >= row["ratio"] > 0


def test_the_family_summary_says_where_the_loss_lies() -> None:
    # Three searches: one returned its best measured (0.99), one returned 0.90 having measured 0.97,
    # one returned 0.90 having measured nothing better. One of the two below 0.95 had measured >= 0.95.
    from bench.search import family_summary

    base = {"strategy": "bayes", "budget_s": 1800.0, "oom_probes": 0, "over_ceiling": 0, "found": "x", "probes": 5, "cpu_s": 1.0}
    rows = [{**base, "draw": 0, "ratio": 0.99, "measured_ratio": 0.99},
            {**base, "draw": 1, "ratio": 0.90, "measured_ratio": 0.97},
            {**base, "draw": 2, "ratio": 0.90, "measured_ratio": 0.90}]
    figures = family_summary(rows)["bayes"]["30m"]
    assert figures["below_095"] == 2 and figures["below_095_measured"] == 1
    assert figures["measured_p5_ratio"] == pytest.approx(0.907)  # numpy's linear 5th percentile of 0.90, 0.97, 0.99
    assert figures["p5_ratio"] == pytest.approx(0.90)
