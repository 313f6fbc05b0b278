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


def _json_for_script(data: Any) -> str:
    # Inside <script>, "</" would end the element early; "<\/" is the same string to JSON.
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


@cache
def _template() -> Any:
    """The page (``assets/report.html.j2``), in a Jinja2 environment that escapes every value."""
    import jinja2

    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    environment.globals["zip"] = zip
    return environment.from_string(_asset("report.html.j2"))


def render_html(model: ReportModel) -> str:
    """The report model as one HTML string."""
    from autotune.version import __version__

    figures = [figure(c) for c in model.charts if not c.empty_reason]
    return _template().render(
        m=model,
        labels=OUTCOME_LABELS,
        figures=figures,
        plotly_packed=plotly_js_packed() if figures else "",
        css=_asset("report.css"),
        js=_asset("report.js"),
        data_json=_json_for_script({"figures": figures}),
        generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        version=__version__,
    )


def render_report(result: TuneResult) -> str:
    """The report of ``result`` as one HTML string."""
    return render_html(build_report_model(result))


def write_report(result: TuneResult, path: str | Path) -> Path:
    """Write the report to ``path`` (folders created), whole or not at all (a full disk or Ctrl-C leaves the old one);
    returns the path."""
    from autotune.results import write_atomically

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, render_report(result))
    return path
