"""Render a study as one self-contained HTML file: summary, code, ranked table, charts, failures.

Works offline: plotly.js (the library Optuna's own visualisations use) is embedded once, and
there is no CDN, web font or external script. It is embedded gzip-compressed and base64-encoded
(1.9 MB instead of 4.8 MB) and unpacked by the browser's own ``DecompressionStream`` (Chrome 80,
Firefox 113, Safari 16.4 and later), so a report of hundreds of trials stays far below 5 MB. What is shown is computed in
:mod:`autotune.report.model` and :mod:`autotune.report.charts`; this module only lays it out
(the page's CSS and script are package files beside it, in ``assets/``).

    autotune report STUDY --storage sqlite:///autotune.db -o reports/STUDY.html
"""

from __future__ import annotations

import base64
import gzip
import html
import importlib.resources
import json
from datetime import datetime, timezone
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from autotune.report.charts import figure
from autotune.report.model import OUTCOME_LABELS, ReportModel, build_report_model
from autotune.results import TuneResult

MAX_REPORT_BYTES = 5 * 10**6  # a report travels as an e-mail or chat attachment, where ~5 MB is a common cap



@lru_cache(maxsize=1)
def plotly_js() -> str:
    """plotly.js, minified, from the installed ``plotly`` package (no network)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


@lru_cache(maxsize=1)
def plotly_js_packed() -> str:
    """plotly.js gzipped (``mtime=0``: the same bytes every time) and base64-encoded, for the page to unpack."""
    return base64.b64encode(gzip.compress(plotly_js().encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")


@cache
def _asset(name: str) -> str:
    """A file of ``assets/`` (the page's CSS and script), read once."""
    return (importlib.resources.files("autotune.report") / "assets" / name).read_text(encoding="utf-8")


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _summary_html(model: ReportModel) -> str:
    items = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in model.summary)
    pills = "".join(f"<span class='o-{_esc(o)}'>{n} {_esc(OUTCOME_LABELS[o])}</span>" for o, n in model.counts.items())
    comparisons = []
    for c in model.comparisons:
        if c.speedup:
            ref = f"{c.reference_samples_per_s:,.1f} samples/s" if c.reference_samples_per_s else ""
            comparisons.append(f"<li><b>{c.speedup:.2f}x</b> the speed of {_esc(c.label)}: {_esc(c.reference)}, {_esc(ref)}"
                               + (f" <span class='muted'>({_esc(c.note)})</span>" if c.note else "") + "</li>")
        else:
            comparisons.append(f"<li>vs {_esc(c.label)}: not measured <span class='muted'>({_esc(c.note)})</span></li>")
    metrics = ", ".join(f"{_esc(k)} {_esc(v)}" for k, v in model.best_metrics)
    return (
        f"<p class='headline' id='headline'>{_esc(model.headline)}</p>"
        + (f"<ul class='cmp'>{''.join(comparisons)}</ul>" if comparisons else "")
        + (f"<p>Best configuration: {metrics}.</p>" if metrics else
           ("<p class='muted'>MFU and energy per sample: not measured in this study.</p>" if model.comparisons else ""))
        + f"<div class='pills'>{pills}</div><dl class='summary'>{items}</dl>"
    )


def _code_html(model: ReportModel) -> str:
    parts = []
    if model.training_arguments_code:
        parts.append("<p>The best configuration, for your own <code>Trainer</code>:</p>"
                     "<div class='code'><button class='copy' data-target='code-best'>copy</button>"
                     f"<pre id='code-best'>{_esc(model.training_arguments_code)}</pre></div>")
    else:
        parts.append("<p class='muted'>No configuration fits, so there is no <code>TrainingArguments</code> to copy.</p>")
    if model.command:
        parts.append("<p>The command that ran this study (the same command resumes it):</p>"
                     "<div class='code'><button class='copy' data-target='code-command'>copy</button>"
                     f"<pre id='code-command'>{_esc(model.command)}</pre></div>")
    return "".join(parts)


def _table_html(model: ReportModel) -> str:
    text_kinds = ("text",)
    head = "".join(f"<th class='{'t' if c.kind in text_kinds else ''}' title='{_esc(c.key)}'>{_esc(c.label)}</th>" for c in model.columns)
    rows = []
    for r in model.rows:
        classes = [f"o-{r.outcome}"] + (["best"] if r.is_best else []) + (["baseline"] if r.is_baseline else [])
        cells = "".join(
            f"<td class='{'t' if c.kind in text_kinds else ''}' data-sort='{'' if cell.sort is None else _esc(cell.sort)}'>"
            + (_probes_html(r.probes, cell.text) if c.key == "n_probes" and r.probes else _esc(cell.text)) + "</td>"
            for c, cell in zip(model.columns, r.cells)
        )
        rows.append(f"<tr class='{' '.join(classes)}' data-trial='{r.trial}'>{cells}</tr>")
    if not rows:
        return "<p class='empty'>No trials yet.</p>"
    return (f"<p class='muted'>{len(rows)} configurations ({model.n_trials} trials); the ones that fit ranked by the mean "
            "of their probes, fastest first. Click a probe count to see its probes, a header to sort.</p>"
            f"<div class='tablewrap'><table id='trials'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def _probes_html(probes: tuple[str, ...], count: str) -> str:
    """A probe count that expands to one line per probe."""
    return f"<details><summary>{_esc(count)}</summary>{'<br>'.join(_esc(p) for p in probes)}</details>"


def _charts_html(model: ReportModel) -> str:
    boxes = []
    for chart in model.charts:
        if chart.empty_reason:
            body = f"<div class='empty' data-empty-chart='{_esc(chart.key)}'>Nothing to plot: {_esc(chart.empty_reason)}.</div>"
        else:
            body = f"<div class='chart' id='chart-{_esc(chart.key)}'></div>"
        note = f"<div class='note'>{_esc(chart.note)}</div>" if chart.note else ""
        boxes.append(f"<div class='chartbox'><h3 style='font-size:.95rem;margin:.2rem .4rem'>{_esc(chart.title)}</h3>{body}{note}</div>")
    return f"<div class='charts'>{''.join(boxes)}</div>"


def _problems_html(model: ReportModel) -> str:
    parts = []
    if model.problems:
        rows = []
        for p in model.problems:
            detail = f"<details><summary>details</summary><pre>{_esc(p.detail)}</pre></details>" if p.detail else ""
            rows.append(f"<tr class='o-{_esc(p.outcome)}'><td>{p.trial}</td><td class='t'>{_esc(OUTCOME_LABELS.get(p.outcome, p.outcome))}</td>"
                        f"<td class='t'>{_esc(p.config)}</td><td class='t' style='white-space:normal'>{_esc(p.reason)}{detail}</td></tr>")
        parts.append("<table id='problems'><thead><tr><th>trial</th><th class='t'>outcome</th><th class='t'>configuration</th>"
                     f"<th class='t'>reason</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")
    else:
        parts.append("<p>No trial ran out of memory, timed out, crashed or diverged.</p>")
    if model.dropped:
        items = "".join(f"<li>{_esc(d)}</li>" for d in model.dropped)
        parts.append(f"<p>Dropped from the search space before searching (this device or these packages cannot run them):</p><ul id='dropped'>{items}</ul>")
    else:
        parts.append("<p class='muted'>Nothing was dropped from the search space before searching.</p>")
    return "".join(parts)


def _json_for_script(data: Any) -> str:
    # Inside <script>, "</" would end the element early; "<\/" is the same string to JSON.
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def render_html(model: ReportModel) -> str:
    """The report model as one HTML string."""
    from autotune.version import __version__

    figures = [figure(c) for c in model.charts if not c.empty_reason]
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    notice = f"<div class='notice' id='notice'>{_esc(model.notice)}</div>" if model.notice else ""
    plotly = f"<script type='application/gzip-base64' id='plotly-js'>{plotly_js_packed()}</script>" if figures else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_esc(model.title)}</title>
<style>{_asset('report.css')}</style>
{plotly}
</head><body><main>
<h1>autotune report: {_esc(model.study_name)}</h1>
{notice}
<section id="summary"><h2>Summary</h2>{_summary_html(model)}</section>
<section id="code"><h2>Use it</h2>{_code_html(model)}</section>
<section id="table"><h2>All configurations</h2>{_table_html(model)}</section>
<section id="charts"><h2>Charts</h2>{_charts_html(model)}</section>
<section id="problems-section"><h2>What went wrong</h2>{_problems_html(model)}</section>
<footer>Generated {generated} by autotune {_esc(__version__)} from {_esc(model.generated_note)}.
Regenerate with <code>{_esc(model.regenerate_command)}</code>. Self-contained: no network needed.</footer>
</main>
<script type="application/json" id="autotune-data">{_json_for_script({"figures": figures})}</script>
<script>{_asset('report.js')}</script>
</body></html>
"""


def render_report(result: TuneResult) -> str:
    """The report of ``result`` as one HTML string."""
    return render_html(build_report_model(result))


def write_report(result: TuneResult, path: str | Path) -> Path:
    """Write the report to ``path`` (folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(result), encoding="utf-8")
    return path
