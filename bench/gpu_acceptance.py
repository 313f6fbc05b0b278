"""The GPU acceptance run: every check autotune owes a GPU, in one command, in at most 25 minutes.

    make wheelhouse                               # once, where PyPI is reachable: wheels an offline GPU image may lack
    python -m bench.gpu_acceptance                # everything, on the first visible GPU -> reports/gpu/<device>-<date>/
    make gpu-check                                # the same
    python -m bench.gpu_acceptance --phase landscape --out reports/gpu/nvidia-h100-80gb-hbm3-2026-01-31  # one phase (again)
    python -m bench.gpu_acceptance --phase run,side_by_side --out DIR              # several
    python -m bench.gpu_acceptance --phase tests,landscape --box landscape=400 --out DIR  # a box that fits a call
    python -m bench.gpu_acceptance --device cpu --quick --out /tmp/acceptance     # the whole harness on a CPU in about a minute

Run it from the checkout, with the Python that has torch (a CUDA build) and transformers. At its
start it looks for the other packages it needs (optuna, plotly, rich, pandas, pyyaml, accelerate,
nvidia-ml-py, pytest) and installs the missing ones from ``wheelhouse/`` with ``pip install
--no-index`` (into the environment when it is writable, else into ``wheelhouse/site``, added to the
path): no network is needed. autotune itself runs from the checkout.

Phases, in order, each time-boxed (seconds of wall time in the full run, 25 minutes in all; the
``--quick`` boxes are 30-90 s):

=====================  ====  =========================================================================
phase                  box   what
=====================  ====  =========================================================================
``tests``              180   ``pytest -m gpu``: passed / failed / skipped (70 s on an H100, after the probe server's start)
``repeatability``      100   polyglot-ko-1.3b bf16 sdpa bs 16 seq 512, 5 fresh probes: CV of samples/s
                             (target <= 2%), fixed overhead ``overhead_s`` (<= 2 s), ``model_build_s``
``precision_compile``  240   pythia-410m bs 8 seq 512, fp32/tf32/bf16/fp16 x compile off/inductor/
                             inductor:max-autotune: status, samples/s, MFU, the matmul precision in force;
                             target: no crash, MFU < 1. Uncompiled first, then inductor, then
                             max-autotune (minutes per compile: the box usually ends before the last
                             ones, which are listed as not run)
``ceiling``            75    pythia-410m bf16 under a 16 GiB ceiling, batches from 1/2 to 2x the memory
                             model's largest: OOMs are ``oom``, no ``ok`` probe over the ceiling, the
                             memory model's error per probe
``run``                320   ``autotune run --model polyglot-ko-1.3b --seq-len 512`` (API) with the box's
                             budget (less 20 s for the report; ``--box run=520`` fits one 10-minute call), its
                             study database and HTML report in the output folder
``side_by_side``       540   polyglot-ko-1.3b seq 512, in one call: ``autotune run --budget 200s`` (its
                             baseline is transformers' defaults, its expert-rule reference measured
                             right after), then with the run's own evaluator and ceiling a bf16 batch-16
                             user, HF ``auto_find_batch_size`` (a real ``Trainer.train()`` from batch 64:
                             every batch it tried, steps, peak, log) and the largest batch that fits
                             (Lightning's binsearch from 8: trials of 3 untimed steps, then one probe); any row out of memory measured one
                             batch size of the space down; the best re-timed by a plain ``Trainer``
                             with its exported ``TrainingArguments`` and none of autotune's code (target:
                             within 5%). A box too small for the whole run is ``refused``
``landscape``          rest  polyglot-ko-1.3b seq 512 on the card's memory (the run's default ceiling):
                             960 configurations (5 batch sizes x 2 accumulations x 2 precisions x 2
                             optimizers x 3 compile modes x 2 attention kernels x 2 loader settings x
                             checkpointing), the run's probe protocol, input waits and confidence
                             intervals recorded, one row in 20 probed twice (the table's noise); the
                             largest complete sub-grid saved as the replay table
                             ``landscape_<device>[-narrowing].csv.gz``, then ``python -m bench.search
                             TABLE:CEILING --seeds 5`` on it
=====================  ====  =========================================================================

The landscape takes about three hours of probes, so it is recorded over many calls: ``--phase
landscape --box landscape=480 --out DIR`` goes on from the rows already probed
(``landscape_rows.jsonl``), uncompiled configurations first (5-20 s a probe on an H100, out-of-memory
ones 3-6 s), then inductor (a cold compilation of polyglot-ko-1.3b took ~85 s there, one per compiled
graph), then max-autotune. A call that goes on first probes what completes a table, fixing the
dimension that moved throughput least so far (``gpu_phases.table_first``). The grid of the tables
recorded on 2026-11-22/23 (pythia-160m seq 128 under a 9 GiB ceiling) is ``gpu_phases.PYTHIA_160M_GRID``.
``bench/README.md`` lists the calls of a GPU lease in priority order.

A phase past its box stops where it is (each probe's deadline is inside the box) and records
``timeout`` with what it measured; one that overruns its box by the grace period (60 s) is
interrupted from outside. Each phase's JSON and ``summary.md`` are written as soon as it ends, so a
killed run keeps its finished phases; ``--phase`` re-runs one phase and keeps the others' files.

Output (``--out``, default ``reports/gpu/<device-slug>-<yyyy-mm-dd>/``): ``summary.md`` (the
device, driver, CUDA, versions, and a section per phase), ``<phase>.json`` (raw figures),
``environment.json``, ``autotune.db`` and ``<study>.html`` (the run phase's study and report),
``landscape_<device-slug>.csv.gz`` and ``bench_search.txt``, ``tests_junit.xml``.
Exit status 1 when a phase broke (status ``error``: a bug in this harness), 2 for bad usage or a
missing dependency, 130 on Ctrl-C, else 0: missed targets are ``flagged`` in the summary, not exit codes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = REPO / "wheelhouse"
PHASES = ("tests", "repeatability", "precision_compile", "ceiling", "run", "side_by_side", "landscape")
# Import name -> distribution in the wheelhouse. pip brings their own dependencies from there too.
REQUIRED_MODULES = {
    "optuna": "optuna", "plotly": "plotly", "rich": "rich", "yaml": "pyyaml", "pandas": "pandas", "accelerate": "accelerate",
    "pynvml": "nvidia-ml-py", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
}
SUMMARY_RESERVE_S = 15.0


class SetupError(Exception):
    """A dependency is missing and cannot be installed here; the message says what to do."""


class PhaseTimeout(KeyboardInterrupt):
    """Raised by the alarm when a phase overruns its box by the grace period. A KeyboardInterrupt, so
    autotune's search stops cleanly (writes its report) as it does on Ctrl-C."""


# ---------------------------------------------------------------------------------------- dependencies


def _add_path(path: Path) -> None:
    """Importable here and in every child (pytest, bench.search, probes started cold)."""
    text = str(path)
    if text not in sys.path:
        sys.path.insert(0, text)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if text not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([text, *parts])


def _distribution_installed(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


def _wheel_distribution(wheel: Path) -> str:
    return wheel.name.split("-", 1)[0]


def ensure_dependencies(
    modules: dict[str, str] | None = None,
    *,
    wheelhouse: Path = WHEELHOUSE,
    target: Path | None = None,
    use_environment: bool | None = None,
) -> dict[str, Any]:
    """Make ``modules`` importable, installing the missing ones from ``wheelhouse`` without network.

    autotune is imported from this checkout. Missing distributions are installed with ``pip install
    --no-index --find-links wheelhouse`` into the running environment when its site-packages is
    writable (pip resolves their dependencies from the wheelhouse and what is installed); otherwise,
    or if that fails, every wheelhouse distribution not installed here goes into ``target``
    (``--no-deps``), which is put on ``sys.path`` and ``PYTHONPATH``.

    Returns:
        ``{"missing": [...], "installed": [...], "into": path or None}``.

    Raises:
        SetupError: a module is missing and the wheelhouse cannot provide it.
    """
    modules = REQUIRED_MODULES if modules is None else modules
    target = target or wheelhouse / "site"
    _add_path(REPO)
    if target.is_dir():
        _add_path(target)  # installed there by an earlier run
    missing = {m: d for m, d in modules.items() if importlib.util.find_spec(m) is None}
    report: dict[str, Any] = {"missing": sorted(set(missing.values())), "installed": [], "into": None}
    if not missing:
        return report
    wheels = sorted(wheelhouse.glob("*.whl")) if wheelhouse.is_dir() else []
    if not wheels:
        raise SetupError(
            f"missing {', '.join(report['missing'])} and no wheels in {wheelhouse}: run `make wheelhouse` where PyPI is reachable "
            "and copy wheelhouse/ into this checkout (or pip install them)"
        )
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index", "--find-links", str(wheelhouse)]
    purelib = sysconfig.get_paths()["purelib"]
    if use_environment is None:
        use_environment = os.access(purelib, os.W_OK)
    errors = []
    if use_environment:
        done = subprocess.run([*pip, *report["missing"]], capture_output=True, text=True)
        if done.returncode == 0:
            report.update(installed=report["missing"], into=purelib)
        else:
            errors.append(_last_line(done.stderr))
    if report["into"] is None:
        absent = [w for w in wheels if not _distribution_installed(_wheel_distribution(w))]
        done = subprocess.run([*pip, "--no-deps", "--target", str(target), *map(str, absent)], capture_output=True, text=True)
        if done.returncode != 0:
            errors.append(_last_line(done.stderr))
            raise SetupError(
                f"pip could not install {', '.join(report['missing'])} from {wheelhouse}: {' / '.join(errors)} "
                f"(wheels for another Python? `make wheelhouse WHEEL_PYTHON={sys.version_info.major}.{sys.version_info.minor}`)"
            )
        _add_path(target)
        report.update(installed=sorted(_wheel_distribution(w) for w in absent), into=str(target))
    importlib.invalidate_caches()
    still = sorted(m for m in missing if importlib.util.find_spec(m) is None)
    if still:
        raise SetupError(f"still missing after installing from {wheelhouse}: {', '.join(still)} (is `make wheelhouse` up to date?)")
    return report


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


# ---------------------------------------------------------------------------------------- environment


def device_slug(device: Any) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``; any CPU -> ``cpu``."""
    if not device.is_cuda:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device.name.lower()).strip("-") or "cuda"


def _torch_cuda_build() -> str | None:
    """The CUDA version torch was built with, read from ``torch/version.py`` without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: Any, dependencies: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "accelerate", "optuna", "pandas", "plotly", "nvidia-ml-py"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    from autotune.version import __version__

    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "device": device.to_dict(), "device_slug": device_slug(device), "torch_cuda_build": _torch_cuda_build(), "versions": versions,
        "autotune": {"version": __version__, "commit": commit, "local_changes": dirty if commit else None},
        "dependencies": dependencies, "command": " ".join(["python -m bench.gpu_acceptance", *argv]),
        "date": dt.date.today().isoformat(), "started_at": dt.datetime.now().isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------- phases


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: a run killed while writing leaves the previous file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_phase(name: str, ctx: Any) -> dict[str, Any]:
    """Run one phase inside its box (plus grace, enforced by an alarm) and write ``<name>.json``."""
    from bench.gpu_phases import PHASE_FUNCTIONS

    started_at = dt.datetime.now().isoformat(timespec="seconds")
    alarm = threading.current_thread() is threading.main_thread()

    def on_alarm(signum: int, frame: Any) -> None:
        raise PhaseTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm) if alarm else None
    if alarm:
        signal.setitimer(signal.ITIMER_REAL, ctx.box_s + ctx.plan.grace_s)
    print(f"=== {name}: box {ctx.box_s:.0f}s", flush=True)
    try:
        data, markdown = PHASE_FUNCTIONS[name](ctx)
    except PhaseTimeout:
        reason = f"interrupted {ctx.plan.grace_s:.0f}s after its {ctx.box_s:.0f}s box"
        data = {"status": "timeout", "reason": reason, **ctx.partial}
        markdown = f"Stopped: {reason}. What it measured before is in `{name}.json`."
    except Exception as exc:  # noqa: BLE001 - a broken phase is recorded and the run goes on
        trace = traceback.format_exc()
        data = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300], "traceback": trace, **ctx.partial}
        markdown = f"The phase broke (a bug in the harness):\n\n```\n{trace[-1500:]}\n```"
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    status, reason = data.pop("status"), data.pop("reason")
    record = {
        "phase": name, "status": status, "reason": reason, "started_at": started_at, "wall_s": round(ctx.elapsed(), 2),
        "box_s": ctx.box_s, "quick": ctx.plan.quick, "device": ctx.device.name, "data": data, "markdown": markdown,
    }
    _write_json(ctx.out / f"{name}.json", record)
    print(f"=== {name}: {status} ({reason}) in {ctx.elapsed():.1f}s", flush=True)
    return record


def write_summary(out: Path) -> Path:
    """``summary.md`` from ``environment.json`` and every phase's JSON in ``out`` (phases not run yet say so)."""
    env = json.loads((out / "environment.json").read_text(encoding="utf-8"))
    device = env["device"]
    records = {}
    for name in PHASES:
        path = out / f"{name}.json"
        if path.exists():
            records[name] = json.loads(path.read_text(encoding="utf-8"))
    from autotune.units import GiB

    quick = any(r.get("quick") for r in records.values())
    gib = device["total_memory_bytes"] / GiB
    capability = ".".join(map(str, device["compute_capability"])) if device.get("compute_capability") else None
    versions = env["versions"]
    autotune = env["autotune"]
    deps = env["dependencies"]
    lines = [
        f"# GPU acceptance run: {device['name']}, {env['date']}",
        "",
        "Quick run (`--quick`): tiny model, seconds per phase; it shows the harness works, its figures are not GPU results."
        if quick else "Full run: `python -m bench.gpu_acceptance` (module docstring: phases, budgets, targets).",
        "",
        "| | |",
        "|---|---|",
        f"| device | {device['name']}, {gib:.1f} GiB" + (f", compute capability {capability}" if capability else "") + " |",
        f"| driver | {device.get('driver_version') or '-'} |",
        f"| CUDA | driver {device.get('cuda_version') or '-'}, torch built with {env.get('torch_cuda_build') or '-'} |",
        f"| torch / transformers | {versions.get('torch')} / {versions.get('transformers')} |",
        f"| accelerate / optuna / python | {versions.get('accelerate')} / {versions.get('optuna')} / {versions.get('python')} |",
        f"| autotune | {autotune['version']}, commit {autotune.get('commit') or '-'}"
        + (" with local changes" if autotune.get("local_changes") else "") + " |",
        "| dependencies | " + (f"installed {', '.join(deps['installed'])} from the wheelhouse into `{deps['into']}`" if deps.get("installed")
                              else "all present") + " |",
        f"| command | `{env['command']}` |",
        "",
        "## Phases",
        "",
        "| # | phase | status | wall | box | |",
        "|---|---|---|---|---|---|",
    ]
    for i, name in enumerate(PHASES, 1):
        record = records.get(name)
        if record is None:
            lines.append(f"| {i} | {name} | not run | - | - | `--phase {name}` runs it |")
        else:
            reason = str(record["reason"]).replace("|", "\\|").replace("\n", " ")[:200]
            lines.append(f"| {i} | {name} | {record['status']} | {record['wall_s']:.0f}s | {record['box_s']:.0f}s | {reason} |")
    for i, name in enumerate(PHASES, 1):
        record = records.get(name)
        lines += ["", f"## {i}. {name}", ""]
        if record is None:
            lines.append(f"Not run yet: `python -m bench.gpu_acceptance --phase {name} --out {out}`.")
        else:
            lines.append(f"Status **{record['status']}**: {record['reason']} ({record['started_at']}, {record['wall_s']:.0f}s of a {record['box_s']:.0f}s box).")
            lines += ["", record["markdown"]]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_acceptance", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the first visible GPU), cuda:N, or cpu (default: cuda)")
    parser.add_argument("--out", type=Path, help="output folder (default: reports/gpu/<device-slug>-<yyyy-mm-dd>/)")
    parser.add_argument("--quick", action="store_true", help="every phase shortened: tiny model, short sequences, seconds per phase")
    parser.add_argument("--phase", help=f"run only these phases, comma-separated: {', '.join(PHASES)}")
    parser.add_argument("--box", action="append", default=[], metavar="PHASE=SECONDS",
                        help="a phase's time box in seconds instead of the plan's (repeatable), e.g. landscape=400 to fit a call")
    args = parser.parse_args(argv)
    args.boxes = {}
    for item in args.box:
        name, _, seconds = item.partition("=")
        try:
            args.boxes[name.strip()] = float(seconds)
        except ValueError:
            parser.error(f"--box {item!r}: give PHASE=SECONDS, e.g. landscape=400")
        if name.strip() not in PHASES or args.boxes[name.strip()] <= 0:
            parser.error(f"--box {item!r}: the phase must be one of {', '.join(PHASES)} and the seconds positive")
    if args.phase:
        names = [n.strip() for n in args.phase.split(",") if n.strip()]
        unknown = [n for n in names if n not in PHASES]
        if unknown or not names:
            parser.error(f"unknown phase {', '.join(unknown) or repr(args.phase)}: use {', '.join(PHASES)}")
        args.phases = [n for n in PHASES if n in names]
    else:
        args.phases = list(PHASES)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.monotonic()
    try:
        dependencies = ensure_dependencies()
    except SetupError as exc:
        print(f"gpu_acceptance: {exc}", file=sys.stderr)
        return 2
    if dependencies["installed"]:
        print(f"installed {', '.join(dependencies['installed'])} from the wheelhouse into {dependencies['into']}", flush=True)

    from autotune.errors import DeviceError
    from autotune.probe.device import detect_device
    from autotune.probe.isolation import start_server
    from bench.gpu_phases import FULL, QUICK, Context

    try:
        device = detect_device(args.device)
    except DeviceError as exc:
        print(f"gpu_acceptance: {exc}", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    slug = device_slug(device)
    out = (args.out or REPO / "reports" / "gpu" / f"{slug}-{dt.date.today().isoformat()}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device, dependencies, argv)
    if set(args.phases) - {"tests"}:
        server_started = time.monotonic()
        # The probe server, once for every phase: no phase pays for its imports. False: it failed its
        # CUDA self-test and probes start cold (an autotune before that check returns None).
        env["probe_server_forks"] = start_server() is not False
        env["probe_server_start_s"] = round(time.monotonic() - server_started, 2)
    _write_json(out / "environment.json", env)
    print(f"device: {device.name}; output: {out}; probe server started in {env.get('probe_server_start_s', '-')}s", flush=True)

    deadline = started + plan.total_s
    broken = False
    try:
        for name in args.phases:
            box = args.boxes.get(name, plan.boxes_s[name])
            if name == "landscape" and name not in args.boxes:  # what the other phases left of the whole run's time, at most its own box
                box = max(plan.landscape_floor_s, min(box, deadline - time.monotonic() - SUMMARY_RESERVE_S))
            ctx = Context(name=name, out=out, device=device, plan=plan, box_s=box, slug=slug)
            record = run_phase(name, ctx)
            broken |= record["status"] == "error"
            write_summary(out)
    except KeyboardInterrupt:  # Ctrl-C: the finished phases are written; the one in flight is not
        print(f"interrupted: {out / 'summary.md'} holds the finished phases", file=sys.stderr)
        return 130
    print(f"summary: {out / 'summary.md'} ({time.monotonic() - started:.0f}s)", flush=True)
    return 1 if broken else 0


if __name__ == "__main__":
    _add_path(REPO)  # run as a script (python bench/gpu_acceptance.py): bench and autotune from this checkout
    sys.exit(main())
