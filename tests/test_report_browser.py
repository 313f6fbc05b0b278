"""The report in a real browser: headless Chromium opens a generated report, offline.

Checks: no console errors, no network request beyond file:/data:, every chart drawn (a plotly SVG
with traces), the table holding every trial. Saves ``test-artifacts/report.png``.

Needs Debian's ``chromium`` and ``chromium-driver`` (``make test`` installs them when root). Where
they are missing the test skips, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import pytest

from tests.report_studies import make_study

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
# Without these Chromium phones home (updates, sync, QUIC probes) and floods a closed network.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1400,1000",
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # starts Chromium: ~10 s


def _require(name: str, *candidates: str) -> str:
    for candidate in candidates:
        path = shutil.which(candidate)
        if path:
            return path
    message = f"{name} not found ({', '.join(candidates)}): apt-get install -y chromium chromium-driver (make test does it as root)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def browser(tmp_path):
    chromium = _require("Chromium", "chromium", "chromium-browser", "google-chrome")
    chromedriver = _require("chromedriver", "chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("selenium is missing: pip install -e '.[test]'")
        pytest.skip("selenium is missing: pip install -e '.[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _requested_urls(driver) -> list[str]:
    import json

    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def test_report_opens_offline_with_every_chart_and_trial(browser, tmp_path) -> None:
    from autotune.report.html import write_report

    result = make_study(f"sqlite:///{tmp_path / 'r.db'}", n_trials=16)
    path = write_report(result, tmp_path / "report.html")
    browser.get(path.as_uri())
    browser.set_script_timeout(30)
    # Wait until the page has unpacked plotly.js and drawn every chart (or give up after 20 s).
    drawn = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const start = Date.now();
        (function check() {
          const state = document.body.getAttribute('data-charts');  // set once plotly.js is unpacked and drew
          if (state || Date.now() - start > 20000) {
            done([state, document.querySelectorAll('div.chart').length]);
          } else { setTimeout(check, 100); }
        })();
    """)
    assert drawn == ["drawn", 5]

    charts = browser.execute_script("""
        return Array.from(document.querySelectorAll('div.chart')).map(c => {
          const svg = c.querySelector('svg.main-svg'), box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
          return {id: c.id, width: box.width, height: box.height,
                  traces: c.querySelectorAll('.trace').length, points: c.querySelectorAll('.point, path.js-line, .bars path').length};
        });
    """)
    for chart in charts:
        assert chart["width"] > 300 and chart["height"] > 200, chart
        assert chart["traces"] > 0 and chart["points"] > 0, chart
    assert {c["id"] for c in charts} == {f"chart-{k}" for k in ("throughput_vs_batch", "memory_vs_batch", "history", "importance", "pareto")}

    rows = browser.execute_script("return document.querySelectorAll('#trials tbody tr').length")
    n_rows = len(result.configurations())  # one row per configuration; its probes expand from the row
    assert len(result.trials) == 16 and rows == n_rows

    # Sorting by a header click keeps every row and puts unmeasured cells last.
    browser.execute_script("""
        const th = Array.from(document.querySelectorAll('#trials th')).find(h => h.textContent.trim() === 'peak memory');
        th.click(); th.click();""")
    memory = browser.execute_script("""
        const i = Array.from(document.querySelectorAll('#trials th')).findIndex(h => h.textContent.trim() === 'peak memory');
        return Array.from(document.querySelectorAll('#trials tbody tr')).map(r => r.cells[i].getAttribute('data-sort'));""")
    measured = [float(v) for v in memory if v]
    assert len(memory) == n_rows and measured == sorted(measured) and memory[len(measured):] == [""] * (n_rows - len(measured))

    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []
    urls = _requested_urls(browser)
    assert path.as_uri() in urls  # the network log works: it saw the report itself
    # chrome:// and friends are the browser's own start page, not the report's doing.
    remote = [u for u in urls if not u.startswith(("file:", "data:", "blob:", "about:", "chrome:", "chrome-untrusted:", "devtools:"))]
    assert remote == []

    ARTIFACTS.mkdir(exist_ok=True)
    browser.execute_script("window.scrollTo(0, 0)")
    shot = browser.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    (ARTIFACTS / "report.png").write_bytes(base64.b64decode(shot["data"]))
    assert (ARTIFACTS / "report.png").stat().st_size > 10_000
