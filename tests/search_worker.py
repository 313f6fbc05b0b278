"""One search worker as a real OS process, for tests/test_workers.py: ``run_search`` on a shared study
with a fake GPU whose probes take real (short) time.

    python -m tests.search_worker STORAGE STUDY OUT.json [--n-trials N] [--probe-s S] ...

STORAGE is an Optuna URL (``sqlite:///...``, ``postgresql://...``) or ``journal:PATH`` (an Optuna
journal file). The worker writes OUT.json when it ends: the probes it ran, its outcome, and the
error if it crashed (it then exits with 1). ``--hang-file`` makes its first probe (after
``--hang-after`` probes) write the trial number there and hang, so a test can kill it mid-probe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import optuna

from autotune.params import TrialParams
from autotune.records import ProbeResult
from autotune.search.loop import SearchSettings, run_search
from autotune.search.strategies.registry import make_strategy
from autotune.space import SearchSpace, load_space
from tests.conftest import FakeEvaluator, GiB

CEILING_BYTES = 12 * GiB
OOM_ABOVE_BYTES = 10 * GiB  # batch 32 without checkpointing runs out of memory


def open_storage(spec: str) -> str | optuna.storages.BaseStorage:
    if spec.startswith("journal:"):
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(spec[len("journal:"):]))
    return spec


def open_study(spec: str, name: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name=name, storage=open_storage(spec), direction="maximize", load_if_exists=True)


@dataclass
class SleepingGPU(FakeEvaluator):
    """The conftest's fake GPU, each probe taking ``sleep_s`` of real time."""

    sleep_s: float = 0.3
    hang_file: Path | None = None
    hang_after: int = 0
    current_trial: int = -1

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        if self.hang_file is not None and len(self.calls) >= self.hang_after:
            self.hang_file.write_text(json.dumps({"trial": self.current_trial, "params": params.to_dict()}))
            time.sleep(3600)
        time.sleep(self.sleep_s)
        return super().evaluate(params, timeout_s=timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("storage")
    parser.add_argument("study")
    parser.add_argument("out", type=Path)
    parser.add_argument("--n-trials", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--probe-s", type=float, default=0.3)
    parser.add_argument("--strategy", default="bayes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat-s", type=float, default=0.25)
    parser.add_argument("--grace-s", type=float, default=3.0)
    parser.add_argument("--hang-file", type=Path, default=None)
    parser.add_argument("--hang-after", type=int, default=0)
    parser.add_argument("--owner", default=None, help="pretend to run on another host: HOST:PID")
    parser.add_argument("--space-json", type=Path, default=None, help="SearchSpace.to_dict() (default: load the quick space)")
    args = parser.parse_args(argv)

    if args.owner:
        from autotune.studies import reading

        reading.owner = lambda: args.owner  # type: ignore[assignment]
    # The quick space, from the test when it passes it: validating it again imports transformers (seconds).
    space = SearchSpace.from_dict(json.loads(args.space_json.read_text())) if args.space_json else load_space("quick")
    evaluator = SleepingGPU(oom_above_bytes=OOM_ABOVE_BYTES, sleep_s=args.probe_s, hang_file=args.hang_file, hang_after=args.hang_after)
    settings = SearchSettings(
        memory_ceiling_bytes=CEILING_BYTES, n_trials=args.n_trials, budget_s=args.budget_s, seed=args.seed,
        heartbeat_interval_s=args.heartbeat_s, heartbeat_grace_s=args.grace_s,
    )
    report: dict[str, object] = {"probes": [], "error": None}
    try:
        study = open_study(args.storage, args.study)

        def on_start(number: int, params: TrialParams) -> None:
            evaluator.current_trial = number

        outcome = run_search(
            study, space, evaluator, settings, baseline=space.baseline(), strategy=make_strategy(args.strategy),
            on_start=on_start, on_trial=lambda r: report["probes"].append([r.number, list(r.params.key())]),  # type: ignore[union-attr]
        )
        report["stopped_because"] = outcome.stopped_because
        report["probes_run"] = outcome.probes_run
    except BaseException:  # noqa: BLE001 - the test reads what went wrong
        report["error"] = traceback.format_exc()
    args.out.write_text(json.dumps(report))
    return 1 if report["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
