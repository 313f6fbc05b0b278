"""The Python API: :func:`tune` runs a whole search and returns a :class:`~autotune.results.TuneResult`.

``autotune run`` and :func:`tune` take the same :class:`~autotune.options.RunOptions` and go through the same two
functions: :func:`~autotune.plan.plan_run` validates every input before any study is created or touched (so bad
input never leaves a broken study), and :func:`run_plan` opens the study, runs the search, writes
the report and returns the result. The CLI adds only argument parsing and display. ``RunOptions``,
``RunPlan`` and ``plan_run`` are importable from here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from autotune.errors import StorageFailed, UsageError
from autotune.options import RunOptions
from autotune.params import TrialParams
from autotune.plan import ISOLATION_MODES, RunPlan, plan_run
from autotune.results import TuneResult, load_result
from autotune.search.loop import Evaluator, SearchOutcome, TrialRecord, run_search
from autotune.search.strategies.registry import make_strategy
from autotune.studies import opening, schema, writing

FINISH_RESERVE_S = 3.0  # of the budget (at most 10% of it), for loading the result and writing the report


def open_study(plan: RunPlan, command: str | None = None) -> optuna.Study:
    """Create the plan's study, or resume it after checking it was made for the same model, device and space.

    Raises:
        UsageError: if the storage URL is unusable or the existing study was made for another setup.
    """
    return opening.open_or_create(
        plan.storage, plan.study_name, plan.study_attrs(command),
        sampler=make_strategy(plan.strategy).sampler(plan.settings.seed),
        budget_s=plan.settings.budget_s, n_trials=plan.settings.n_trials,
    )


def plan_evaluator(plan: RunPlan) -> Evaluator:
    """Real probes for the plan: a fresh child process per trial, started as ``plan.isolation`` says,
    pinned to the plan's device (its NVML UUID on a GPU)."""
    from autotune.probe.evaluator import ProbeEvaluator

    device = "cpu" if not plan.device.is_cuda else f"cuda:{plan.device.index}"
    return ProbeEvaluator(
        model=plan.model.to_dict(),
        seq_len=plan.seq_len,
        device=device,
        memory_ceiling_bytes=plan.memory_ceiling_bytes,
        warmup_steps=plan.warmup_steps,
        measure_steps=plan.measure_steps,
        max_measure_s=plan.max_measure_s,
        seed=plan.settings.seed,
        dataset=plan.dataset.to_dict() if plan.dataset else None,
        mode=ISOLATION_MODES[plan.isolation],
        device_uuid=plan.device.uuid if plan.device.is_cuda else None,
        owner_note={"study": plan.study_name, "storage": storage_id(plan.storage)},
        peft=plan.peft.to_dict() if plan.peft else None,
        trainer=plan.trainer.ref.reference if plan.trainer else None,
        trainer_sys_path=plan.trainer.ref.sys_path if plan.trainer else None,
        trainer_args=plan.trainer.trainer_args if plan.trainer else None,
        trainer_attn_flag=bool(plan.trainer and plan.trainer.takes_attn_flag),
        objective_tokens_per_sample=plan.tokens_per_sample,
        nproc=plan.nproc_per_probe,
        host_memory_ceiling_bytes=plan.host_memory_ceiling_bytes,
    )


def finish_reserve_s(budget_s: float) -> float:
    """What a run keeps of its budget for loading the result and writing the report."""
    return min(FINISH_RESERVE_S, 0.1 * budget_s)


def execute(
    plan: RunPlan,
    study: optuna.Study,
    evaluator: Evaluator,
    *,
    on_trial: Callable[[TrialRecord], None] | None = None,
    on_start: Callable[[int, TrialParams], None] | None = None,
    started_s: float | None = None,
) -> SearchOutcome:
    """Run the search loop for a planned, opened study, with the plan's strategy and a memory model of its model.

    ``started_s`` (``time.monotonic()``): when the run began, so its set-up counts against the budget,
    and the search leaves :data:`FINISH_RESERVE_S` of it for loading the result and writing the report.
    """
    memory = plan.memory_model()
    settings = plan.settings
    if settings.budget_s:
        settings = dataclasses.replace(settings, budget_s=settings.budget_s - finish_reserve_s(settings.budget_s))
    prepare = getattr(evaluator, "prepare", None)
    if prepare is not None:
        prepare()  # the probe server's start, inside the budget rather than after it
    recover_orphans(study, evaluator, plan.memory_ceiling_bytes)
    label_trial = getattr(evaluator, "label_trial", None)

    def started(number: int, params: TrialParams) -> None:
        if label_trial is not None:
            label_trial(number)  # the probe's folder names its trial, should this process be killed
        if on_start:
            on_start(number, params)

    try:
        outcome = run_search(
            study, plan.space, evaluator, settings, baseline=plan.baseline, expert=plan.expert, on_trial=on_trial, on_start=started,
            strategy=make_strategy(plan.strategy), memory=memory, started_s=started_s,
        )
    finally:
        close = getattr(evaluator, "close", None)
        if close is not None:
            close()  # files the probes shared (a QLoRA base checkpoint: gigabytes) go now, not at exit
    opening.record_stop(study, outcome.stopped_because)
    return outcome


def recover_orphans(study: optuna.Study, evaluator: Evaluator, ceiling_bytes: int) -> int:
    """Record the results this study's probes finished after an earlier run was killed (their folders
    outlive a ``kill -9``; see :func:`autotune.probe.isolation.orphaned_probes`); returns how many."""
    found = getattr(evaluator, "orphaned_results", None)
    recorded = 0
    for orphan in found() if found is not None else []:
        number, params = orphan.note.get("trial"), orphan.note.get("params")
        if isinstance(number, int) and isinstance(params, dict):
            recorded += writing.record_recovered(study, number, TrialParams.from_dict(params), orphan.result, ceiling_bytes) is not None
        orphan.discard()
    return recorded


def storage_id(storage: Any) -> str:
    """A short, stable name of a storage that does not reveal it (a URL may hold a password)."""
    return hashlib.sha1(str(storage).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class RunOutcome:
    """What :func:`run_plan` did: the result, how the search went, and where the report and best.json are.

    ``report_error``: why the report could not be written (the result and the study do not depend on it).
    """

    result: TuneResult
    search: SearchOutcome
    report_path: Path | None
    best_json_path: Path | None = None
    report_error: str | None = None


def check_writable_dir(path: str | Path, flag: str) -> None:
    """Fail now, before any probe, if ``path`` cannot hold the files a run writes at its end.

    Raises:
        UsageError: ``path`` is a file, or it (or the folder it would be made in) is not writable.
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder} is a file, not a folder: pass another {flag} or move the file away")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {folder}: {existing} is not writable: pass a {flag} you can write to")


def check_writable_file(path: str | Path, flag: str) -> None:
    """Like :func:`check_writable_dir`, for a file to be written at the end of the run.

    Raises:
        UsageError: ``path`` is a folder, or cannot be written.
    """
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {target} is a directory: give a file name like best.json")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {target} is not writable: pass another {flag}")
    check_writable_dir(target.parent if str(target.parent) else ".", flag)


def finished_trials(study: optuna.Study) -> int:
    """Probes a resumed study already holds (repeats and re-measures not counted)."""
    return sum(
        1 for t in study.get_trials(deepcopy=False)
        if t.state.is_finished() and not {schema.ATTR_DUPLICATE_OF, schema.ATTR_REMEASURE_OF} & set(t.user_attrs)
    )


def run_plan(
    plan: RunPlan,
    *,
    evaluator: Evaluator | None = None,
    on_open: Callable[[RunPlan, int], None] | None = None,
    on_start: Callable[[int, TrialParams], None] | None = None,
    on_trial: Callable[[TrialRecord], None] | None = None,
    report_dir: str | Path | None = "reports",
    command: str | None = None,
    best_json: str | Path | None = None,
    join: bool = False,
) -> RunOutcome:
    """Open the plan's study, run the search, write the report: the one path of ``autotune run`` and :func:`tune`.

    Args:
        plan: from :func:`plan_run`.
        evaluator: replaces the real probes (tests, replays).
        on_open: called once the study is open, with the plan and how many finished probes it resumes.
        on_start: called before every probe with the trial number and its parameters.
        on_trial: called after each finished trial.
        report_dir: where ``<study>.html`` is written (None: no report).
        command: the command line to record in the study, for the report.
        best_json: write the best configuration's TrainingArguments JSON here (before the report).
        join: this is a worker joining the study (``autotune worker``): the shared deadline stays as
            the run that made it set it.

    Ctrl-C (or SIGTERM, under :func:`autotune.interrupts.sigterm_interrupts`) during the search stops
    it cleanly (the run's result and report are written and :attr:`SearchOutcome.stopped_because` is
    ``"interrupted"``); Ctrl-C outside a probe writes best.json and the report of what was measured
    and re-raises. The study and best.json never depend on the report: a report that cannot be
    written is a warning (:attr:`RunOutcome.report_error`).
    """
    # The budget is the whole run's wall time: planning and set-up included.
    started_s = plan.started_s if plan.started_s is not None and not join else time.monotonic()
    if report_dir is not None:
        check_writable_dir(report_dir, "--report-dir")
    if best_json is not None:
        check_writable_file(best_json, "--output")
    study = open_study(plan, command)
    if plan.settings.budget_s and not join:  # when the shared budget ends, for workers (this run's, or joining later)
        writing.record_deadline(study, time.time() - (time.monotonic() - started_s) + plan.settings.budget_s
                                - finish_reserve_s(plan.settings.budget_s))
    if on_open:
        on_open(plan, finished_trials(study))
    report_path = Path(report_dir) / opening.report_file_name(plan.study_name) if report_dir is not None else None
    try:
        with opening.storage_errors(plan.storage, during_run=True):
            if plan.gpus:
                from autotune.workers import run_workers, worker_devices

                outcome = run_workers(study, plan.storage, worker_devices(plan.gpus, plan.nproc_per_probe), plan.memory_ceiling_bytes,
                                      n_trials=plan.settings.n_trials, on_start=on_start, on_trial=on_trial)
                opening.record_stop(study, outcome.stopped_because)
            else:
                outcome = execute(plan, study, evaluator or plan_evaluator(plan), on_trial=on_trial, on_start=on_start,
                                  started_s=started_s)
    except KeyboardInterrupt:
        _write_outputs(load_result(plan.study_name, plan.storage, stopped_because="interrupted"), report_path, best_json)
        raise
    except StorageFailed:
        with contextlib.suppress(Exception):  # a storage that still reads (read-only, full): what it holds is written out
            _write_outputs(load_result(plan.study_name, plan.storage, stopped_because="storage failed"), report_path, best_json)
        raise
    result = load_result(plan.study_name, plan.storage, stopped_because=outcome.stopped_because)
    best_json_path, report_error = _write_outputs(result, report_path, best_json)
    return RunOutcome(result=result, search=outcome, report_path=None if report_error else report_path,
                      best_json_path=best_json_path, report_error=report_error)


def _write_outputs(result: TuneResult, report_path: Path | None, best_json: str | Path | None) -> tuple[Path | None, str | None]:
    """best.json first (the result a user acts on), then the report; a report that cannot be written
    is returned as a one-line reason, never raised. Returns best.json's path and that reason."""
    best_json_path = result.write_best_json(best_json) if best_json is not None and result.best is not None else None
    if report_path is None:
        return best_json_path, None
    from autotune.report.html import write_report

    try:
        write_report(result, report_path)
    except OSError as exc:  # a full disk, a folder made read-only during the run: the study has everything
        return best_json_path, f"the report could not be written to {report_path} ({exc.strerror or exc}); " \
            f"`autotune report {result.study_name}` writes it again"
    return best_json_path, None


def user_dir() -> Path:
    """Where :func:`tune` keeps its studies and reports unless told otherwise: ``$AUTOTUNE_HOME``, else
    ``$XDG_CACHE_HOME/autotune``, else ``~/.cache/autotune``. Not the current directory: a notebook or
    a script calling ``tune()`` should not leave files beside itself (the CLI, run from a project, does:
    ``./autotune.db`` and ``reports/``)."""
    if os.environ.get("AUTOTUNE_HOME"):
        return Path(os.environ["AUTOTUNE_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "autotune"


_DEFAULT = object()


def tune(
    model: str | None = None,
    *,
    evaluator: Evaluator | None = None,
    on_trial: Callable[[TrialRecord], None] | None = None,
    report_dir: str | Path | None | object = _DEFAULT,
    command: str | None = None,
    verbose: bool = True,
    **options: Any,
) -> TuneResult:
    """Find the fastest training configuration of ``model`` that fits under the memory ceiling.

    Args:
        model: a built-in name (``autotune models``), a Hugging Face hub id, or a local directory
            with a ``config.json`` (default :data:`~autotune.plan.DEFAULT_MODEL`); leave it out with ``trainer=``.
        evaluator: replaces the real probes (tests, replays).
        on_trial: called after each finished trial.
        report_dir: where ``<study>.html`` is written (None: no report); default ``reports/`` under
            :func:`user_dir`.
        command: the command line to record in the study, for the report.
        verbose: show progress (a live display in a terminal, a progress bar in Jupyter), a line per
            trial and the ranked table at the end; False: silent.
        **options: any field of :class:`RunOptions`: ``budget="30m"``, ``n_trials``, ``space``,
            ``memory_ceiling``, ``effective_batch_size``, ``seq_len``, ``device``, ``storage``
            (default: ``sqlite:///<user_dir()>/autotune.db``), ``study``, ``seed``, ``trial_timeout``,
            ``warmup_steps``, ``measure_steps``, ``max_measure_time``, ``dataset``, ``text_column``, ``tokenizer``,
            ``strategy``, ``isolation``, ``peft``, ``lora_r``, ``lora_alpha``, ``lora_dropout``,
            ``lora_target_modules``, ``trainer="my_train.py:make_trainer"`` (your own Trainer; each documented there).

    Returns:
        The :class:`TuneResult`: ``best_training_arguments()``, ``best_params``, ``baseline``,
        ``trials`` (a DataFrame), ``speedup``.

    Raises:
        UsageError: bad input, before anything is run or stored.
    """
    if options.get("storage") is None or report_dir is _DEFAULT:
        user_dir().mkdir(parents=True, exist_ok=True)
    if options.get("storage") is None:
        options["storage"] = f"sqlite:///{user_dir() / 'autotune.db'}"
    if report_dir is _DEFAULT:
        report_dir = user_dir() / "reports"
    plan = plan_run(RunOptions.of(model=model, **options))
    if command is None:
        command = "python -c 'autotune.tune(...)'" if "autotune" not in sys.argv[0] else shlex.join(["autotune", *sys.argv[1:]])
    if not verbose:
        return run_plan(plan, evaluator=evaluator, on_trial=on_trial, report_dir=report_dir, command=command).result  # type: ignore[arg-type]
    from rich.console import Console

    from autotune.console import LiveProgress, print_header, print_summary

    console = Console(highlight=False)
    live = LiveProgress(console, budget_s=plan.settings.budget_s, n_trials=plan.settings.n_trials, ceiling_bytes=plan.memory_ceiling_bytes)

    def trial_done(record: TrialRecord) -> None:
        live.on_trial(record)
        if on_trial:
            on_trial(record)

    with live:
        done = run_plan(plan, evaluator=evaluator, on_open=lambda p, resumed: print_header(console, p, resumed),
                        on_start=live.on_start, on_trial=trial_done, report_dir=report_dir, command=command)  # type: ignore[arg-type]
    print_summary(console, done.result)
    if done.report_error:
        console.print(f"warning: {done.report_error}", style="yellow")
    elif done.report_path is not None:
        console.print(f"report: {done.report_path}")
    return done.result
