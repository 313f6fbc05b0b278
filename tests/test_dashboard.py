"""optuna-dashboard reads an autotune study: the metric's name, scalar attributes, the memory constraint.

A real dashboard server (the ``optuna-dashboard`` test dependency) on 127.0.0.1, asked through its
JSON API, stopped afterwards.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from autotune.api import tune
from tests.conftest import FakeEvaluator, GiB


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def dashboard(tmp_path, fake_gpu):
    storage = f"sqlite:///{tmp_path / 'dash.db'}"
    tune("tiny-gptneox", budget=None, n_trials=6, space="quick", memory_ceiling="10GiB", device=fake_gpu, seq_len=128,
         storage=storage, study="dash", evaluator=FakeEvaluator(oom_above_bytes=12 * GiB), report_dir=None, command="test")
    port = _free_port()
    code = f"from optuna_dashboard import run_server; run_server({storage!r}, host='127.0.0.1', port={port})"
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # up to 30 s for the server to listen
            try:
                _get(f"{base}/api/studies")
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail("optuna-dashboard exited before it served")
                time.sleep(0.1)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_dashboard_shows_the_metric_name_scalar_attributes_and_the_constraint(dashboard) -> None:
    studies = _get(f"{dashboard}/api/studies")["study_summaries"]
    (study,) = [s for s in studies if s["study_name"] == "dash"]
    detail = _get(f"{dashboard}/api/studies/{study['study_id']}?after=0")
    assert detail["objective_names"] == ["samples_per_s"]
    complete = [t for t in detail["trials"] if t["state"] == "Complete"]
    assert complete
    for trial in complete:
        attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
        assert float(attrs["samples_per_s"]) == pytest.approx(trial["values"][0])
        assert float(attrs["peak_mem_bytes"]) > 0 and attrs["status"] == "ok"
        assert len(trial["constraints"]) == 1  # (peak - ceiling) / ceiling
        assert (trial["constraints"][0] <= 0) == (float(attrs["peak_mem_bytes"]) <= 10 * GiB)
    sortable = {a["key"] for a in detail["union_user_attrs"] if a["sortable"]}
    assert {"samples_per_s", "tokens_per_s", "peak_mem_bytes"} <= sortable
