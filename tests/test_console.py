"""The terminal display: the ranked table fits the terminal without cutting a value short."""

from __future__ import annotations

import pytest
from rich.console import Console

from autotune.console import print_summary, ranked_table
from tests.report_studies import make_study


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return make_study(f"sqlite:///{tmp_path_factory.mktemp('console') / 'c.db'}")


def _render(result, width: int) -> str:
    console = Console(width=width, record=True, force_terminal=False)
    print_summary(console, result)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 120])
def test_the_table_fits_the_width_and_names_what_it_left_out(result, width) -> None:
    text = _render(result, width)
    table_lines = [line for line in text.splitlines() if "│" in line or "┃" in line]
    assert table_lines and max(len(line) for line in table_lines) <= width
    assert "…" not in text  # no value cut short: adamw_torch_fused and adafactor stay readable
    for optim in set(result.ranked()["optim"]):
        assert optim in text
    configurations = [line for line in text.splitlines() if line.startswith("│ 1 ")]
    assert configurations  # the best row is there, whatever the layout


def test_a_narrow_terminal_folds_the_configuration_into_one_column(result) -> None:
    full = ranked_table(result)
    assert len(full.columns) == 14 and full.caption is None
    narrow = ranked_table(result, width=80)
    headers = [c.header for c in narrow.columns]
    assert headers[:4] == ["#", "configuration", "samples/s", "vs baseline"]
    text = _render(result, 80)
    # Every configuration is told apart in full (checkpointing included), not by columns that were dropped.
    for params in result.ranked()[["per_device_train_batch_size", "precision", "optim", "gradient_checkpointing"]].itertuples():
        assert f"bs{params.per_device_train_batch_size}x1 {params.precision} {params.optim}" in text
    rows = "\n".join(line for line in text.splitlines() if line.startswith("│"))
    assert rows.count(" ckpt") == int(result.ranked()["gradient_checkpointing"].sum())
    tiny = ranked_table(result, width=50)
    assert "tokens/s" in (tiny.caption or "") and "samples/s" in [c.header for c in tiny.columns]


def test_no_empty_table_when_nothing_fits(tmp_path) -> None:
    failed = make_study(f"sqlite:///{tmp_path / 'f.db'}", "failed", n_trials=3,
                        fail_on={(b, p): "crash" for b in (4, 8, 16, 32, 64) for p in ("fp32", "bf16")})
    assert ranked_table(failed) is None
    assert "Top configurations" not in _render(failed, 100)


@pytest.mark.parametrize("terminal", [False, True])
def test_a_log_says_when_each_probe_starts_a_terminal_shows_it_live(terminal) -> None:
    """Under nohup or in CI a compiled probe may run for minutes: the log says which, and the time left."""
    import io

    from autotune.console import LiveProgress
    from autotune.params import TrialParams

    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=120)
    live = LiveProgress(console, budget_s=600, n_trials=None, ceiling_bytes=2**30)
    live.on_start(3, TrialParams(per_device_train_batch_size=16))
    text = out.getvalue()
    if terminal:
        assert "starts" not in text  # the live line shows it (started with the display)
    else:
        import re

        assert re.search(r"trial   3 starts   bs16x1 fp32 adamw_torch_fused sdpa, \S+ left", text), text
