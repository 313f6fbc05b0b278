"""Several workers, one search: ``autotune run --gpus 0,1,2,3`` and ``autotune worker``.

Optuna is the distributed engine: every worker is an ordinary ``autotune worker`` process that
opens the same study and runs the same loop (:func:`autotune.search.loop.run_search`), which claims
each configuration in the storage before probing it and syncs what the others measured, so N
workers are one search with N probes in flight. Nothing here schedules anything:

* ``autotune run --gpus LIST`` creates the study (as a single run would), stores when the shared
  budget ends (:func:`autotune.studies.record_deadline`), starts one ``autotune worker`` per GPU
  (``--device cuda:N``), follows the study to show one progress display, and writes the report
  and best.json when they are done. It runs no probe itself.
* ``autotune worker --storage URL --study NAME`` joins a study from any machine that reaches the
  storage: it rebuilds the run's options from the study (:func:`options_for_worker`), refuses a
  device of another kind, and works until the shared deadline (or its own ``--budget`` or
  ``--n-trials``).

Ctrl-C reaches every process of the terminal's group; SIGTERM to the ``run`` is passed on to its
workers; each stops like a single run (the probe in flight recorded as interrupted). A worker
started by ``run`` dies with it (:func:`autotune.probe.lifetime.die_with_parent`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna

import autotune.defaults as defaults
from autotune.errors import EXIT_INTERRUPTED, EXIT_NO_RESULT, EXIT_NOTHING_FITS, EXIT_TERMINATED, DeviceError, UsageError
from autotune.params import TrialParams
from autotune.records import ProbeStatus
from autotune.search.loop import SearchOutcome, TrialRecord
from autotune.space import SearchSpace
from autotune.studies import reading, schema
from autotune.studies.settings import StudySettings

PARENT_RUN_ENV = "AUTOTUNE_PARENT_RUN"  # set for workers that `autotune run --gpus` starts: they die with it
HOST_WORKERS_ENV = "AUTOTUNE_HOST_WORKERS"  # set for workers started together: how many probe side by side on this host
FOLLOW_POLL_S = 1.0
MAX_GPUS = 64


def parse_gpus(value: str | Sequence[int] | None) -> list[int] | None:
    """``"0,1,3"`` / ``[0, 1]`` -> GPU numbers as this process sees them; ``"all"``: every visible GPU.

    Raises:
        UsageError: not a list of distinct non-negative numbers.
        DeviceError: ``all`` and no GPU is visible.
    """
    if value is None:
        return None
    if isinstance(value, str) and value.strip() == "all":
        from autotune.probe.device import detect_device

        count = 0
        while count < MAX_GPUS:
            try:
                if not detect_device(f"cuda:{count}").is_cuda:
                    break
            except DeviceError:
                break
            count += 1
        if count == 0:
            raise DeviceError("--gpus all found no GPU: use --device cpu without --gpus, or install a CUDA build of torch")
        return list(range(count))
    words = value.split(",") if isinstance(value, str) else list(value)
    try:
        gpus = [int(str(w).strip()) for w in words]
    except ValueError:
        raise UsageError(f"--gpus {value!r} is not a list of GPU numbers: use e.g. --gpus 0,1,2,3 or --gpus all") from None
    if not gpus or min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise UsageError(f"--gpus {value!r} must name distinct GPU numbers: use e.g. --gpus 0,1,2,3 or --gpus all")
    return gpus


def worker_devices(gpus: Sequence[int], nproc_per_probe: int = 1) -> list[str]:
    """The ``--device`` of each worker of ``--gpus``: one per GPU, or with probes of N processes one per N GPUs in a row
    (``--gpus 0,1,2,3 --nproc-per-probe 2``: cuda:0 probing on GPUs 0-1, cuda:2 on 2-3).

    Raises:
        UsageError: the GPUs do not split into runs of N consecutive numbers.
    """
    n = max(nproc_per_probe, 1)
    groups = [list(gpus[i:i + n]) for i in range(0, len(gpus), n)]
    if len(gpus) % n or any(group != list(range(group[0], group[0] + n)) for group in groups):
        listing = ",".join(str(g) for g in gpus)
        raise UsageError(f"--gpus {listing} does not split into workers of {n} consecutive GPUs (--nproc-per-probe {n}): "
                         f"list them in runs of {n}, e.g. --gpus {','.join(str(i) for i in range(2 * n))}")
    return [f"cuda:{group[0]}" for group in groups]


def require_probe_settings(settings: StudySettings, study: str) -> int:
    """The study's memory ceiling, once it is known to record everything a worker needs to probe as its run does.

    Raises:
        UsageError: it does not (a study made before workers could join one).
    """
    ceiling = settings.memory_ceiling_bytes
    if settings.probe is None or not settings.space or ceiling is None or settings.seq_len is None:
        raise UsageError(f"study {study!r} does not record its run's probe settings (made by an older autotune?): "
                         "start a new study with `autotune run`")
    return int(ceiling)


def options_for_worker(
    settings: StudySettings, *, deadline_unix_s: float | None, storage: str, study: str, device: str, budget: str | float | None,
    n_trials: int | None, seed_offset: int,
) -> dict[str, Any]:
    """The :class:`~autotune.options.RunOptions` (as keywords) of the run that made a study, for a worker that joins it.

    The budget is the time left to the study's shared deadline (``deadline_unix_s``, ``time.time()``; None: none was
    recorded) unless ``budget`` or ``n_trials`` is given.

    Raises:
        UsageError: the study was not made by this version's ``autotune run`` (no probe settings), or
            its shared budget has ended and neither ``budget`` nor ``n_trials`` is given.
    """
    probe, ceiling, seq_len = settings.probe, require_probe_settings(settings, study), settings.seq_len
    if budget is None and n_trials is None:
        left_s = deadline_unix_s - time.time() if deadline_unix_s else 0.0
        if left_s <= 1.0:
            raise UsageError(f"the shared budget of study {study!r} has ended: give --budget (e.g. 30m) or --n-trials to work on")
        budget = left_s
    dataset = settings.dataset or {}
    peft = settings.peft or {}
    targets = peft.get("target_modules")
    trainer, trainer_args, objective = None, None, None
    identity = settings.trainer_identity
    if identity:  # the run's own factory: its model and batches, imported as the run imported it
        from autotune.probe.user_trainer import TrainerRef

        target, _, function = str(identity["reference"]).rpartition(":")
        trainer = TrainerRef(target=target, function=function, sys_path=probe.trainer_sys_path)
        trainer_args, objective = identity.get("args"), identity.get("objective")
    return dict(
        model=None if trainer else settings.model, trainer=trainer, budget=budget, n_trials=n_trials, space=SearchSpace.from_dict(settings.space),
        memory_ceiling=ceiling, effective_batch_size=settings.effective_batch_size,
        seq_len=None if trainer else int(seq_len), device=device, storage=storage, study=study,
        seed=probe.seed + seed_offset, trial_timeout=probe.trial_timeout_s,
        warmup_steps=probe.warmup_steps, measure_steps=probe.measure_steps, max_measure_time=probe.max_measure_s,
        dataset=dataset.get("path"), text_column=dataset.get("text_column", defaults.TEXT_COLUMN), tokenizer=dataset.get("tokenizer"),
        strategy=settings.strategy, isolation=probe.isolation,
        peft=peft.get("method"), lora_r=peft.get("r"), lora_alpha=peft.get("alpha"), lora_dropout=peft.get("dropout"),
        lora_target_modules=list(targets) if targets else None,
        trainer_args=trainer_args, objective=objective, baseline=_baseline_fields(settings.baseline),
        nproc_per_probe=settings.nproc_per_probe,  # the host-memory ceiling is the worker machine's own
    )


def _baseline_fields(stored: dict[str, Any] | None) -> dict[str, Any] | None:
    """The study's baseline as config fields (what ``--baseline`` takes), so a worker plans the same baseline."""
    if not stored:
        return None
    from autotune.config_fields import config_overrides
    from autotune.params import TrialParams

    params = TrialParams.from_dict(stored)
    return {**config_overrides(params), "attn_implementation": params.attn_implementation}


def worker_command(storage: str, study: str, device: str, *, n_trials: int | None = None) -> list[str]:
    """The command line of one worker (``python -m autotune.cli worker ...``), quiet: the run shows progress."""
    command = [sys.executable, "-m", "autotune.cli", "worker", "--storage", storage, "--study", study, "--device", device, "--quiet"]
    if n_trials is not None:
        command += ["--n-trials", str(n_trials)]
    return command


def _records(trials: list[optuna.trial.FrozenTrial], ceiling_bytes: int, shown: set[int]) -> list[TrialRecord]:
    """The probes finished since the last look, as progress records."""
    by_number = {t.number: t for t in trials}
    records = []
    for probe in reading.probes_in(trials):
        if probe.number in shown:
            continue
        shown.add(probe.number)
        attrs = by_number[probe.number].user_attrs
        records.append(TrialRecord(
            number=probe.number, params=probe.params, result=probe.result, feasible=probe.result.fits(ceiling_bytes),
            is_baseline=attrs.get(schema.ATTR_ROLE) == schema.ROLE_BASELINE, remeasure_of=attrs.get(schema.ATTR_REMEASURE_OF),
        ))
    return records


def run_workers(
    study: optuna.Study,
    storage: str,
    devices: Sequence[str],
    ceiling_bytes: int,
    *,
    n_trials: int | None = None,
    on_start: Callable[[int, TrialParams], None] | None = None,
    on_trial: Callable[[TrialRecord], None] | None = None,
    command: Callable[[str], list[str]] | None = None,
) -> SearchOutcome:
    """Start one worker per device on ``study`` and follow the study until all have ended.

    ``command(device)`` gives a worker's command line (default :func:`worker_command`). Ctrl-C or
    SIGTERM (a :class:`KeyboardInterrupt`) is passed on to the workers, which stop as a single run
    does; their exit is awaited, and the search counts as interrupted.

    Returns:
        The search's outcome as the progress display saw it (probes, re-measures, OOM probes).
    """
    make = command or (lambda device: worker_command(storage, study.study_name, device, n_trials=n_trials))
    env = {**os.environ, PARENT_RUN_ENV: str(os.getpid()), HOST_WORKERS_ENV: str(len(devices))}
    procs = [subprocess.Popen(make(device), env=env, stdin=subprocess.DEVNULL) for device in devices]
    outcome = SearchOutcome(stopped_because="n_trials" if n_trials is not None else "budget")
    shown: set[int] = {p.number for p in reading.probes_in(reading.read_trials(study))}  # resumed ones are not news
    started: set[int] = set()

    def follow() -> None:
        trials = reading.read_trials(study)
        for trial in trials:
            if trial.state == optuna.trial.TrialState.RUNNING and trial.number not in started and on_start:
                params = trial.user_attrs.get(schema.ATTR_PARAMS)
                if params:
                    started.add(trial.number)
                    on_start(trial.number, TrialParams.from_dict(params))
        for record in _records(trials, ceiling_bytes, shown):
            outcome.records.append(record)
            outcome.probes_run += 1
            outcome.remeasures += record.remeasure_of is not None
            outcome.oom_probes += record.result.status is ProbeStatus.OOM
            if on_trial:
                on_trial(record)

    try:
        while any(p.poll() is None for p in procs):
            follow()
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        outcome.stopped_because = "interrupted"
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # a Ctrl-C reached them already; SIGTERM may not have
        for proc in procs:
            proc.wait()
    follow()
    codes = [p.returncode for p in procs]
    stopped = (EXIT_INTERRUPTED, EXIT_TERMINATED)
    if any(code in stopped for code in codes):
        outcome.stopped_because = "interrupted"
    # A worker that found nothing (3, 4) has not failed: the study as a whole is what counts.
    failed = [(device, code) for device, code in zip(devices, codes) if code not in (0, *stopped, EXIT_NOTHING_FITS, EXIT_NO_RESULT)]
    if failed:
        raise UsageError("worker(s) failed: " + ", ".join(f"{device} exited with {code}" for device, code in failed)
                         + ": run `autotune worker --storage ... --study ... --device DEVICE` alone to see why")
    return outcome
