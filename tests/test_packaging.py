"""A non-editable install: the built wheel holds every module, space and model config as real
files, and the installed package runs from another directory without the checkout."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Build outputs, caches and virtual environments are not sources: copying them would let a stale
# build/ leak into the wheel (setuptools reuses build/lib) or copy gigabytes.
_NOT_SOURCES_AT_TOP = {".git", "build", "dist", ".pytest_cache", ".ruff_cache", "test-artifacts", "reports"}


def _ignore(folder: str, names: list[str]) -> set[str]:
    top = Path(folder) == ROOT
    return {
        n for n in names
        if (top and n in _NOT_SOURCES_AT_TOP) or n == "__pycache__" or n.endswith(".egg-info")
        or Path(folder, n, "pyvenv.cfg").exists()
    }


def _expected_files() -> set[str]:
    """What the wheel must hold, named from the checkout: every module, model config, asset and space."""
    package = ROOT / "autotune"
    expected = {p.relative_to(ROOT).as_posix() for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    expected |= {p.relative_to(ROOT).as_posix() for p in (package / "model_configs").glob("*.json")}
    expected |= {f"autotune/report/assets/{p.name}" for p in (package / "report" / "assets").iterdir() if p.is_file()}
    expected |= {f"autotune/spaces/{p.name}" for p in (ROOT / "search_spaces").glob("*.yaml")}
    return expected


@pytest.mark.slow
def test_wheel_holds_everything_and_runs_without_the_checkout(tmp_path: Path) -> None:
    expected = _expected_files()
    # The files the issue names, so that an emptied folder cannot make the check vacuous.
    assert {
        "autotune/spaces/default.yaml",
        "autotune/spaces/quick.yaml",
        "autotune/model_configs/tiny-gptneox.json",
        "autotune/search/strategies/bayes/strategy.py",
        "autotune/probe/child.py",
        "autotune/report/html.py",
    } <= expected

    # Build from a clean copy of the checkout, as CI's fresh clone would.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, symlinks=True, ignore=_ignore)
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("autotune-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        infos = archive.infolist()
    names = {info.filename for info in infos}
    missing = expected - names
    assert not missing, f"missing from the wheel: {sorted(missing)}"
    links = [info.filename for info in infos if stat.S_ISLNK(info.external_attr >> 16)]
    assert not links, f"symlinks in the wheel: {links}"
    assert not any(n.startswith("search_spaces/") for n in names), "the spaces belong under autotune/spaces/"

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import autotune, importlib.resources as r; print(autotune.__file__); print(r.files('autotune.spaces'))"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )
    assert where.returncode == 0, where.stderr
    package_file, spaces_folder = where.stdout.splitlines()
    assert Path(package_file).resolve().is_relative_to(target.resolve()), package_file
    assert str(target / "autotune" / "spaces") in spaces_folder, spaces_folder

    spaces = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "spaces"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )
    assert spaces.returncode == 0, spaces.stdout + spaces.stderr
    listed = {line.split()[0] for line in spaces.stdout.splitlines() if line.strip()}
    assert {"default", "quick"} <= listed, spaces.stdout
