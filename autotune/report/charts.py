"""The report's charts: their data from the trials frame (:class:`Chart`), and their plotly figures.

Charts are drawn with plotly.js, the library Optuna's own visualisations use; :func:`figure` turns
a :class:`Chart` into the figure JSON the page hands to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd

from autotune.params import PARAM_NAMES
from autotune.records import ProbeStatus
from autotune.report.formatting import is_missing
from autotune.results import short_config
from autotune.units import GiB, format_bytes

CEILING_DRAW_FACTOR = 4.0  # draw the ceiling line when it is at most this many times the highest peak
COLORWAY = ["#3b6fd8", "#e0762d", "#2e9f5b", "#c23b4e", "#8a5cc7", "#7a6a55", "#d45fb0", "#6b7385"]
GROUP_COLORS = {"fp32": "#3b6fd8", "tf32": "#8a5cc7", "fp16": "#e0762d", "bf16": "#2e9f5b",  # per precision (+tf32: a darker shade)
                "fp16+tf32": "#a8531a", "bf16+tf32": "#1d6b3c", ProbeStatus.OOM.value: "#c23b4e"}  # and OOMs


@dataclass(frozen=True)
class Series:
    """One trace of a chart, in the chart's own units."""

    name: str
    x: tuple[Any, ...]
    y: tuple[Any, ...]
    text: tuple[str, ...] = ()
    style: Literal["markers", "lines", "lines+markers", "bar", "step"] = "markers"
    emphasis: bool = False  # drawn on top, larger (the best, the Pareto front)
    symbol: str = "circle"
    group: str = ""  # series of one group share a colour (the precision, in every chart)


@dataclass(frozen=True)
class Chart:
    """A chart's data; ``empty_reason`` says why there is nothing to draw (then ``series`` is empty)."""

    key: str
    title: str
    x_title: str
    y_title: str
    series: tuple[Series, ...] = ()
    x_log2: bool = False
    horizontal_lines: tuple[tuple[float, str], ...] = ()  # (y, label), e.g. the memory ceiling
    vertical_lines: tuple[tuple[float, str], ...] = ()  # (x, label)
    note: str = ""
    empty_reason: str = ""


def pareto_front(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """Points ``(memory, speed, trial)`` that no other point beats on both (less memory, more speed).

    Returned by increasing memory (so by increasing speed too).
    """
    front: list[tuple[float, float, int]] = []
    for memory, speed, trial in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or speed > front[-1][1]:
            front.append((memory, speed, trial))
    return front


IMPORTANCE_TARGET_QUANTILE = 0.25  # "what it takes to reach the top quarter": with tens of configurations, a few of them


def param_importance(frame: pd.DataFrame) -> dict[str, float]:
    """How much each parameter matters for reaching the fastest configurations, summing to 1.

    Optuna's PED-ANOVA (Watanabe et al., IJCAI 2023), which suits the few tens of configurations a
    study has, over log samples/s of the configurations that finished (one value each), targeting
    the top :data:`IMPORTANCE_TARGET_QUANTILE`. Parameters that took a single value are left out.
    """
    import warnings

    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    ok = frame[(frame["status"] == ProbeStatus.OK.value) & frame["samples_per_s"].notna()]
    varied = [name for name in PARAM_NAMES if name in ok.columns and ok[name].astype(str).nunique() > 1]
    if len(ok) < 3 or not varied:
        return {}
    choices = {name: sorted(set(ok[name].astype(str))) for name in varied}
    distributions = {name: CategoricalDistribution(values) for name, values in choices.items()}
    study = optuna.create_study(direction="maximize")
    for row in ok.to_dict("records"):
        study.add_trial(optuna.trial.create_trial(
            params={name: str(row[name]) for name in varied}, distributions=distributions,
            value=math.log(max(float(row["samples_per_s"]), 1e-12)),
        ))
    with warnings.catch_warnings():  # PED-ANOVA is "experimental" in Optuna
        warnings.simplefilter("ignore")
        evaluator = PedAnovaImportanceEvaluator(target_quantile=IMPORTANCE_TARGET_QUANTILE)
        importance = get_param_importances(study, evaluator=evaluator, target=lambda t: -t.values[0], normalize=True)
    kept = {k: float(v) for k, v in importance.items() if v > 1e-9}
    return dict(sorted(kept.items(), key=lambda kv: -kv[1]))


def _minutes_since_start(frame: pd.DataFrame) -> list[float | None]:
    starts = pd.to_datetime(frame["started_at"], errors="coerce")
    ends = pd.to_datetime(frame["finished_at"], errors="coerce")
    origin = starts.min()
    if is_missing(origin):
        return [None] * len(frame)
    return [None if is_missing(e) else (e - origin).total_seconds() / 60.0 for e in ends]



# ---------------------------------------------------------------------------------------- chart data


def _ok_rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["status"] == ProbeStatus.OK.value) & frame["samples_per_s"].notna()]


def chart_throughput_vs_batch(frame: pd.DataFrame) -> Chart:
    ok = _ok_rows(frame)
    base = dict(key="throughput_vs_batch", title="Samples/s vs batch size, per precision", x_title="per-device batch size",
                y_title="samples/s", x_log2=True)
    if ok.empty:
        return Chart(**base, empty_reason="no probe finished, so there is no throughput to plot")
    series: list[Series] = []
    for precision, group in ok.groupby("precision", sort=True):
        group = group.sort_values("per_device_train_batch_size")
        series.append(Series(
            name=f"{precision}: every trial", x=tuple(int(b) for b in group["per_device_train_batch_size"]),
            y=tuple(float(v) for v in group["samples_per_s"]),
            text=tuple(f"trial {int(r.trial)}: {short_config(r)}" for r in group.itertuples()), group=str(precision),
        ))
        best = group.groupby("per_device_train_batch_size")["samples_per_s"].max()
        series.append(Series(name=f"{precision}: best per batch", x=tuple(int(b) for b in best.index),
                             y=tuple(float(v) for v in best.values), style="lines", group=str(precision)))
    return Chart(**base, series=tuple(series), note="lines join the fastest configuration at each batch size")


def chart_memory_vs_batch(frame: pd.DataFrame, ceiling_bytes: int | None) -> Chart:
    base = dict(key="memory_vs_batch", title="Peak memory vs batch size", x_title="per-device batch size",
                y_title="peak memory (GiB)", x_log2=True)
    measured = frame[frame["peak_mem_bytes"].notna()].sort_values("per_device_train_batch_size")
    series: list[Series] = []
    for precision, group in measured.groupby("precision", sort=True):
        series.append(Series(
            name=f"measured, {precision}", x=tuple(int(b) for b in group["per_device_train_batch_size"]),
            y=tuple(float(v) / GiB for v in group["peak_mem_bytes"]),
            text=tuple(f"trial {int(r.trial)}: {short_config(r)}" for r in group.itertuples()), group=str(precision),
        ))
    if "predicted_peak_mem_bytes" in frame.columns:
        predicted = frame[frame["predicted_peak_mem_bytes"].notna()].sort_values("per_device_train_batch_size")
        for precision, group in predicted.groupby("precision", sort=True):
            series.append(Series(
                name=f"predicted, {precision}", x=tuple(int(b) for b in group["per_device_train_batch_size"]),
                y=tuple(float(v) / GiB for v in group["predicted_peak_mem_bytes"]),
                text=tuple(f"trial {int(r.trial)}: {short_config(r)}" for r in group.itertuples()),
                style="lines+markers", symbol="diamond-open", group=str(precision),
            ))
    oom = frame[frame["status"] == ProbeStatus.OOM.value]
    if not oom.empty and ceiling_bytes:
        series.append(Series(
            name="out of memory (drawn at the ceiling)", x=tuple(int(b) for b in oom["per_device_train_batch_size"]),
            y=tuple(ceiling_bytes / GiB for _ in range(len(oom))),
            text=tuple(f"trial {int(r.trial)}: {short_config(r)}" for r in oom.itertuples()), symbol="x", group=ProbeStatus.OOM.value,
        ))
    if not series:
        return Chart(**base, empty_reason="no probe measured its peak memory")
    notes = [] if "predicted_peak_mem_bytes" in frame.columns else ["no memory-model prediction stored in this study"]
    lines: tuple[tuple[float, str], ...] = ()
    highest = max((max(s.y) for s in series if s.y), default=0.0)
    if ceiling_bytes and ceiling_bytes / GiB <= CEILING_DRAW_FACTOR * highest:
        lines = ((ceiling_bytes / GiB, "memory ceiling"),)
    elif ceiling_bytes:  # drawn to scale it would flatten every point into the x axis
        notes.append(f"the memory ceiling ({format_bytes(ceiling_bytes)}) is far above every trial, so it is not drawn")
    return Chart(**base, series=tuple(series), horizontal_lines=lines, note="; ".join(notes))


def chart_history(frame: pd.DataFrame) -> Chart:
    base = dict(key="history", title="Optimisation history", x_title="minutes since the first probe started",
                y_title="samples/s")
    minutes = _minutes_since_start(frame)
    timed = frame.assign(at_minutes=minutes)
    timed = timed[timed["at_minutes"].notna()].sort_values("at_minutes")
    ok = timed[(timed["status"] == ProbeStatus.OK.value) & timed["samples_per_s"].notna()]
    if ok.empty:
        return Chart(**base, empty_reason="no probe finished yet")
    best_x, best_y, best_so_far = [], [], None
    for r in timed.itertuples():
        if bool(r.feasible) and not is_missing(r.samples_per_s):
            best_so_far = max(best_so_far or 0.0, float(r.samples_per_s))
        if best_so_far is not None:
            best_x.append(round(float(r.at_minutes), 3))
            best_y.append(best_so_far)
    series = [Series(
        name="each trial", x=tuple(round(float(m), 3) for m in ok["at_minutes"]), y=tuple(float(v) for v in ok["samples_per_s"]),
        text=tuple(f"trial {int(r.trial)}: {short_config(r)}" for r in ok.itertuples()),
    )]
    if best_x:
        series.append(Series(name="best that fits, so far", x=tuple(best_x), y=tuple(best_y), style="step", emphasis=True))
    return Chart(**base, series=tuple(series))


def chart_importance(frame: pd.DataFrame) -> Chart:
    base = dict(key="importance", title="Parameter importance", x_title="share of the spread of log samples/s",
                y_title="")
    importance = param_importance(frame)
    if not importance:
        return Chart(**base, empty_reason="needs at least 3 finished probes that differ in some parameter")
    names = list(reversed(importance))
    return Chart(**base, series=(Series(name="importance", x=tuple(round(importance[n], 4) for n in names),
                                        y=tuple(names), style="bar"),),
                 note="PED-ANOVA (Optuna) of log samples/s: how much each parameter matters to reach the top quarter of configurations")


def chart_pareto(frame: pd.DataFrame, ceiling_bytes: int | None) -> Chart:
    base = dict(key="pareto", title="Throughput vs peak memory", x_title="peak memory (GiB)", y_title="samples/s")
    ok = _ok_rows(frame)
    ok = ok[ok["peak_mem_bytes"].notna()]
    if ok.empty:
        return Chart(**base, empty_reason="no probe finished with a measured peak memory")
    points = [(float(r.peak_mem_bytes) / GiB, float(r.samples_per_s), int(r.trial)) for r in ok.itertuples()]
    # The front is the trade-off the user can choose from: configurations over the ceiling are shown
    # as points, but none of them can be on it.
    fitting = [p for p in points if not ceiling_bytes or p[0] * GiB <= ceiling_bytes]
    front = pareto_front(fitting)
    by_trial = {int(r.trial): r for r in ok.itertuples()}
    series = (
        Series(name="every finished trial", x=tuple(p[0] for p in points), y=tuple(p[1] for p in points),
               text=tuple(f"trial {p[2]}: {short_config(by_trial[p[2]])}" for p in points)),
        Series(name="Pareto front (under the ceiling)", x=tuple(p[0] for p in front), y=tuple(p[1] for p in front),
               text=tuple(f"trial {p[2]}: {short_config(by_trial[p[2]])}" for p in front),
               style="lines+markers", emphasis=True),
    )
    lines: tuple[tuple[float, str], ...] = ()
    note = ""
    if ceiling_bytes and ceiling_bytes / GiB <= CEILING_DRAW_FACTOR * max(p[0] for p in points):
        lines = ((ceiling_bytes / GiB, "memory ceiling"),)
    elif ceiling_bytes:
        note = f"the memory ceiling ({format_bytes(ceiling_bytes)}) is far to the right of every trial, so it is not drawn"
    return Chart(**base, series=series, vertical_lines=lines, note=note)


# ---------------------------------------------------------------------------------------- plotly figures


def figure(chart: Chart) -> dict[str, Any]:
    """A plotly figure (``data`` and ``layout``) for one chart of the model."""
    traces = []
    for i, s in enumerate(chart.series):
        color = GROUP_COLORS.get(s.group) or COLORWAY[i % len(COLORWAY)]
        if s.style == "bar":
            traces.append({"type": "bar", "orientation": "h", "x": list(s.x), "y": list(s.y), "name": s.name,
                           "marker": {"color": COLORWAY[0]}, "hovertemplate": "%{y}: %{x:.0%}<extra></extra>"})
            continue
        trace: dict[str, Any] = {"type": "scatter", "x": list(s.x), "y": list(s.y), "name": s.name}
        if s.style == "step":
            trace.update(mode="lines", line={"shape": "hv", "width": 3, "color": COLORWAY[2]})
        else:
            trace["mode"] = s.style
            trace["marker"] = {"size": 11 if s.emphasis else 8, "symbol": s.symbol, "color": color,
                               "opacity": 1.0 if s.emphasis or s.style != "markers" else 0.75}
            if "lines" in s.style:
                trace["line"] = {"width": 3 if s.emphasis else 1.5, "color": color}
        if s.emphasis and s.style != "step":
            trace["marker"]["color"] = COLORWAY[3]
            trace["line"] = {"width": 3, "color": COLORWAY[3]}
        if s.text:
            trace["text"] = list(s.text)
            trace["hovertemplate"] = "%{text}<br>%{x}, %{y:,.1f}<extra>" + s.name + "</extra>"
        traces.append(trace)
    layout: dict[str, Any] = {
        "margin": {"l": 64, "r": 16, "t": 16, "b": 52},
        "xaxis": {"title": {"text": chart.x_title}, "gridcolor": "#eceff4", "zeroline": False},
        "yaxis": {"title": {"text": chart.y_title}, "gridcolor": "#eceff4", "zeroline": False, "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": -0.22, "font": {"size": 11}},
        "plot_bgcolor": "#ffffff",
        "paper_bgcolor": "#ffffff",
        "font": {"family": "system-ui, sans-serif", "size": 12, "color": "#1d2330"},
        "hovermode": "closest",
        "colorway": COLORWAY,
    }
    if chart.x_log2:
        ticks = sorted({x for s in chart.series for x in s.x if isinstance(x, (int, float)) and x > 0})
        layout["xaxis"].update(type="log", tickvals=ticks, ticktext=[str(t) for t in ticks])
    if chart.key == "importance":
        layout["xaxis"].update(tickformat=".0%", rangemode="tozero")
        layout["yaxis"].update(automargin=True, rangemode=None)
        layout["showlegend"] = False
        layout["margin"]["l"] = 10
    if chart.key == "pareto":
        layout["xaxis"]["rangemode"] = "tozero"
    line = {"color": "#c23b4e", "dash": "dash", "width": 2}
    font = {"color": "#c23b4e", "size": 11}
    layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": y, "y1": y, "line": line}
                        for y, _ in chart.horizontal_lines]
    layout["shapes"] += [{"type": "line", "yref": "paper", "y0": 0, "y1": 1, "x0": x, "x1": x, "line": line}
                         for x, _ in chart.vertical_lines]
    layout["annotations"] = [{"xref": "paper", "x": 0.01, "y": y, "yanchor": "bottom", "xanchor": "left",
                              "text": f"{label} {y:.2f} GiB", "showarrow": False, "font": font}
                             for y, label in chart.horizontal_lines]
    layout["annotations"] += [{"yref": "paper", "y": 0.98, "x": x, "yanchor": "top", "xanchor": "right",
                               "text": f"{label} {x:.2f} GiB", "showarrow": False, "font": font, "textangle": -90}
                              for x, label in chart.vertical_lines]
    return {"key": chart.key, "data": traces, "layout": layout}
