"""A finished (or resumed, or still running) study as data: :class:`TuneResult`.

Everything here is computed from the Optuna storage alone, so a result, a table or a report can
be rebuilt at any time with ``load_result(study_name, storage)``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from autotune.errors import NoResult, NothingFits
from autotune.params import KNOBS_ADDED_LATER, PARAM_DEFAULTS, PARAM_NAMES, TrialParams
from autotune.records import Probe, ProbeResult, ProbeStatus
from autotune.search.ranking import prior_rank, rank_configurations
from autotune.sharding import NONE as NO_SHARDING
from autotune.sharding import parse as sharding_of
from autotune.studies import opening, reading, schema
from autotune.studies.schema import ATTR_DUPLICATE_OF, ATTR_PARAMS, ATTR_PREDICTED_PEAK, ATTR_REASON, ATTR_REMEASURE_OF, ATTR_RESULT, ATTR_STATUS
from autotune.studies.settings import StudySettings

RESULT_COLUMNS = (
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "peak_mem_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "peak_device_used_bytes",
    "setup_s",
    "wall_s",
    "measured_steps",
    "step_time_ci95_rel",
    "stable",
    "mfu",
    "achieved_tflops",
    "model_flops_per_token",
    "gpu_util_mean_pct",
    "gpu_util_peak_pct",
    "power_mean_w",
    "sm_clock_mean_mhz",
    "energy_per_sample_j",
    "input_wait_fraction",
    "input_bound",
    "interference",
    "overhead_s",
    "model_build_s",
    "parameters_total",
    "parameters_trainable",
    "parameters_frozen",
)

# A configuration whose mean probe loss differs from the fp32 baseline's (same data, same seed,
# same effective batch) by more than this is flagged: it changes the maths, not only the speed
# (fp16 overflow, an 8-bit optimizer, a broken kernel). Precision noise over a few steps of a
# freshly initialised model is orders of magnitude below this.
LOSS_DRIFT_TOLERANCE = 0.02


def trials_frame(study: optuna.Study, memory_ceiling_bytes: int | None, *, include_repeats: bool = False) -> pd.DataFrame:
    """One row per trial: its parameters, outcome, measurements, and whether it fits the ceiling.

    ``status`` is the probe's outcome (ok, oom, timeout, crash, diverged), or ``pruned`` for a
    configuration the strategy ruled out without running it (``reason`` says why; no measurements).
    ``predicted_peak_mem_bytes`` is the memory model's prediction when the trial was asked, to
    compare with the measured ``peak_mem_bytes``. A near-tie probed again at the end of the search
    is a row of its own, with ``remeasure_of`` = the number of the configuration's first trial.
    ``estimated_samples_per_s``, on the first trial of each configuration that fits, is the search's
    estimate from every probe when it ended (its throughput model's; none where the study went on since,
    or its strategy has no model): the ranking orders configurations within the noise of each other by it.

    Args:
        include_repeats: also list the trials that repeated an already measured configuration
            (the sampler proposed it again; it was not re-run).
    """
    rows: list[dict[str, Any]] = []
    trials = study.get_trials(deepcopy=False)
    estimates = reading.estimates(study, len(reading.probes_in(trials))) or {}
    for trial in trials:
        attrs = trial.user_attrs
        if not include_repeats and ATTR_DUPLICATE_OF in attrs:
            continue
        params = attrs.get(ATTR_PARAMS) or {}
        if params:  # a trial from before a knob existed ran at its default
            params = {**{name: PARAM_DEFAULTS[name] for name in KNOBS_ADDED_LATER}, **params}
        result = attrs.get(ATTR_RESULT) or {}
        state = trial.state.name.lower()
        row: dict[str, Any] = {
            "trial": trial.number,
            "state": state,
            "status": attrs.get(ATTR_STATUS, "running" if state == "running" else state),
            "is_baseline": reading.is_baseline(trial),
            "role": attrs.get(schema.ATTR_ROLE),
            "duplicate_of": attrs.get(ATTR_DUPLICATE_OF),
            "remeasure_of": attrs.get(ATTR_REMEASURE_OF),
        }
        for name in PARAM_NAMES:
            row[name] = params.get(name, trial.params.get(name))
        extra = params.get("extra") or {}  # the user's own config fields the space searched
        row["extra"] = tuple(sorted(extra.items()))
        row.update(extra)
        bs, accum = row["per_device_train_batch_size"], row["gradient_accumulation_steps"]
        row["effective_batch_size"] = bs * accum if bs is not None and accum is not None else None
        for name in RESULT_COLUMNS:
            row[name] = result.get(name)
        row["predicted_peak_mem_bytes"] = attrs.get(ATTR_PREDICTED_PEAK)
        row["estimated_samples_per_s"] = estimates.get(trial.number)
        row["feasible"] = bool(result) and ProbeResult.from_dict(result).fits(memory_ceiling_bytes)
        row["reason"] = attrs.get(ATTR_REASON)
        row["losses"] = result.get("losses") or []
        row["started_at"] = trial.datetime_start
        row["finished_at"] = trial.datetime_complete
        rows.append(row)
    _add_loss_drift(rows)
    extra_names = sorted({name for row in rows for name, _ in row["extra"]})
    columns = [
        "trial", "state", "status", "is_baseline", "role", "duplicate_of", "remeasure_of", *PARAM_NAMES, "extra", *extra_names,
        "effective_batch_size",
        *RESULT_COLUMNS, "loss_drift", "numerics_flag", "predicted_peak_mem_bytes", "estimated_samples_per_s", "feasible", "reason", "losses",
        "started_at", "finished_at",
    ]
    return pd.DataFrame(rows, columns=columns)


def loss_drift(losses: list[float], baseline_losses: list[float]) -> float | None:
    """Relative difference of the mean loss against the baseline's, over the steps both ran.

    None when either has no finite loss. Probes stop at different step counts (steady state), so
    only the common prefix of steps is compared: the same batches in the same order.
    """
    steps = min(len(losses), len(baseline_losses))
    if steps == 0:
        return None
    mine, base = losses[:steps], baseline_losses[:steps]
    if not all(math.isfinite(x) for x in (*mine, *base)):
        return None
    base_mean = sum(base) / steps
    if base_mean == 0:
        return None
    return (sum(mine) / steps - base_mean) / abs(base_mean)


def _add_loss_drift(rows: list[dict[str, Any]]) -> None:
    """Fill ``loss_drift``/``numerics_flag`` against the baseline trial (same effective batch only:
    a different batch per step is different data per step, so the losses are not comparable)."""
    ok = ProbeStatus.OK.value
    baseline = next((r for r in rows if r["is_baseline"] and r["status"] == ok and r["duplicate_of"] is None), None)
    for row in rows:
        drift = None
        if (
            baseline is not None
            and row["status"] == ok
            and row["effective_batch_size"] == baseline["effective_batch_size"]
        ):
            drift = loss_drift(row["losses"], baseline["losses"])
        row["loss_drift"] = drift
        row["numerics_flag"] = bool(drift is not None and abs(drift) > LOSS_DRIFT_TOLERANCE)


_MEAN_COLUMNS = ("samples_per_s", "tokens_per_s", "step_time_s", "achieved_tflops", "mfu")
_MAX_COLUMNS = ("peak_mem_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "peak_device_used_bytes", "step_time_ci95_rel")


def _frame_probes(trials: pd.DataFrame) -> list[Probe]:
    """The rows of probes that ran (repeats, pruned, running and failed-without-a-probe rows left out)."""
    ran = trials[trials["duplicate_of"].isna() & trials["status"].isin(ProbeStatus.values(ran=True))]
    probes = []
    for row in ran.to_dict("records"):
        params = row_params(row)
        result = ProbeResult.from_dict({k: _py(row[k]) for k in ("status", "samples_per_s", "peak_mem_bytes", "step_time_ci95_rel", "wall_s")})
        probes.append(Probe(int(row["trial"]), params, result))
    return probes


def _frame_estimates(trials: pd.DataFrame) -> dict[int, float] | None:
    """The search's estimates by configuration's first trial (:func:`trials_frame`), None where there are none."""
    if "estimated_samples_per_s" not in trials.columns:  # a frame from before they were stored
        return None
    rows = trials[trials["estimated_samples_per_s"].notna()]
    return {int(t): float(v) for t, v in zip(rows["trial"], rows["estimated_samples_per_s"])} or None


# A configuration that does not fit takes the outcome of its worst probe, in this order.
_WORST_FIRST = (ProbeStatus.OOM, ProbeStatus.CRASH, ProbeStatus.DIVERGED, ProbeStatus.OK, ProbeStatus.TIMEOUT)
CONFIG_COLUMNS = ("probe_trials", "n_probes", "n_measurements", "samples_per_s_min", "samples_per_s_max", "spread_rel", "unstable", "fits", "rank")


def configurations_frame(trials: pd.DataFrame, memory_ceiling_bytes: int | None, *, gpu: bool = True) -> pd.DataFrame:
    """One row per configuration, in the order of the ranking: what every display shows.

    Configurations that fit (:func:`autotune.search.ranking.rank_configurations`, the one rule)
    come first, fastest mean first, with ``rank`` 1, 2, ...; then the others by first trial. A row
    is its first trial's, with ``samples_per_s``, ``tokens_per_s``, ``step_time_s``,
    ``achieved_tflops`` and ``mfu`` the means over its ok probes, the peak-memory columns and
    ``step_time_ci95_rel`` the largest, ``status`` its worst probe's outcome (``ok`` when it fits;
    ``pruned``/``running`` when nothing ran), ``probe_trials`` the trial numbers of its probes,
    ``n_probes`` how many ran, ``n_measurements`` how many were ok, ``samples_per_s_min``/``max``
    and ``spread_rel`` ((max - min) / mean) the spread of its ok probes, and ``fits``.
    Repeats of a measured configuration (not run) and enqueued trials that never started are left out.
    """
    columns = [*trials.columns, *CONFIG_COLUMNS]
    frame = trials[trials["duplicate_of"].isna() & (trials["state"] != "waiting")]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    ranked = rank_configurations(_frame_probes(frame), memory_ceiling_bytes, gpu=gpu, estimates=_frame_estimates(frame))
    rank_of = {c.params.key(): i + 1 for i, c in enumerate(ranked)}
    unstable = {c.params.key() for c in ranked if c.unstable}
    groups: dict[tuple[Any, ...], list[int]] = {}
    for position, record in enumerate(frame[[*PARAM_NAMES, "extra"]].to_dict("records")):
        try:
            key = row_params(record).key()
        except (TypeError, ValueError):  # a trial asked before its parameters were stored
            key = ("trial", position)
        groups.setdefault(key, []).append(position)
    rows = []
    ran_statuses = set(ProbeStatus.values(ran=True))
    for key, positions in groups.items():
        group = frame.iloc[positions].sort_values("trial")
        ran = group[group["status"].isin(ran_statuses)]
        ok = ran[ran["status"] == ProbeStatus.OK.value]
        row = (ran.iloc[0] if not ran.empty else group.iloc[0]).copy()
        for name in _MEAN_COLUMNS:
            values = pd.to_numeric(ok[name], errors="coerce").dropna()
            row[name] = float(values.mean()) if len(values) else None
        for name in _MAX_COLUMNS:
            values = pd.to_numeric(ran[name], errors="coerce").dropna()
            row[name] = values.max() if len(values) else None
        speeds = pd.to_numeric(ok["samples_per_s"], errors="coerce").dropna()
        row["samples_per_s_min"] = float(speeds.min()) if len(speeds) else None
        row["samples_per_s_max"] = float(speeds.max()) if len(speeds) else None
        row["spread_rel"] = float((speeds.max() - speeds.min()) / speeds.mean()) if len(speeds) > 1 and speeds.mean() else None
        busy = [str(v) for v in ran["interference"] if isinstance(v, str) and v]
        row["interference"] = busy[0] if busy else None  # any probe of it ran on a busy machine
        row["probe_trials"] = tuple(int(t) for t in ran["trial"])
        row["n_probes"] = len(ran)
        row["n_measurements"] = len(ok)
        row["rank"] = rank_of.get(key)
        row["unstable"] = key in unstable  # its probes disagree beyond the noise band (ranking.Configuration.unstable)
        row["fits"] = row["rank"] is not None
        row["feasible"] = row["fits"]
        row["is_baseline"] = bool(group["is_baseline"].any())
        if not ran.empty and not row["fits"]:
            statuses = set(ran["status"])
            worst = next((s for s in _WORST_FIRST if s.value in statuses), ProbeStatus(row["status"]))
            row["status"] = worst.value
            row["reason"] = ran[ran["status"] == worst.value].iloc[0]["reason"]
        elif row["fits"]:
            row["status"] = ProbeStatus.OK.value
        rows.append(row)
    configurations = pd.DataFrame(rows, columns=columns)
    configurations["_order"] = [(r if r is not None and not pd.isna(r) else len(rows) + 1) for r in configurations["rank"]]
    configurations = configurations.sort_values(["_order", "trial"], kind="stable").drop(columns=["_order"])
    return configurations.reset_index(drop=True)


@dataclass
class TuneResult:
    """What a tuning run found. ``trials`` has one row per trial (see :func:`trials_frame`)."""

    study_name: str
    storage: Any  # the storage string, or the Optuna storage object tune() was given (autotune.storage.describe shows it)
    trials: pd.DataFrame
    settings: dict[str, Any] = field(default_factory=dict)  # as stored (opening.settings_of): read them as study_settings
    stopped_because: str | None = None
    _configurations: tuple[Any, pd.DataFrame] | None = field(default=None, repr=False, compare=False)

    @property
    def study_settings(self) -> StudySettings:
        """The run's settings, read from :attr:`settings` (each time: they may be changed in place)."""
        return StudySettings.from_dict(self.settings)

    # ------------------------------------------------------------------ rankings

    @property
    def measured_on_cpu(self) -> bool:
        """Whether the study's probes ran on a CPU (a study that records no device: as on a GPU)."""
        return self.study_settings.device.get("kind") == "cpu"

    @property
    def memory_ceiling_bytes(self) -> int | None:
        return self.study_settings.memory_ceiling_bytes

    def configurations(self) -> pd.DataFrame:
        """One row per configuration (its probes aggregated), ranked: see :func:`configurations_frame`."""
        # Computed once per trials frame: best, baseline, speed-up and every display read it.
        key = (id(self.trials), len(self.trials), self.memory_ceiling_bytes)
        if self._configurations is None or self._configurations[0] != key:
            self._configurations = (key, configurations_frame(self.trials, self.memory_ceiling_bytes, gpu=not self.measured_on_cpu))
        return self._configurations[1]

    def ranked(self) -> pd.DataFrame:
        """One row per configuration that fits under the ceiling, fastest mean samples/s first (those within
        the noise of each other in the ranking's order: :func:`autotune.search.ranking.rank_configurations`).

        A configuration's measurements are its probes that ran to an outcome (ok, oom, crash,
        diverged; not repeats, pruned trials or timeouts); it fits when every one of them fits.
        The rows of :meth:`configurations` that fit: the means of their ok probes, ``n_measurements``
        probes, ``probe_trials`` their trial numbers, ``spread_rel`` their spread.
        """
        configurations = self.configurations()
        return configurations[configurations["fits"].astype(bool)].reset_index(drop=True)

    @property
    def best(self) -> pd.Series | None:
        ranked = self.ranked()
        return None if ranked.empty else ranked.iloc[0]

    def order_note(self) -> str | None:
        """Why the best ranks first where another configuration that fits measured faster (they are within the
        noise of each other: :func:`autotune.search.ranking.rank_configurations`); None where it measured fastest."""
        ranked = self.ranked()
        if len(ranked) < 2:
            return None
        best = ranked.iloc[0]
        faster = ranked[ranked["samples_per_s"] > best["samples_per_s"]]
        if faster.empty:
            return None
        top = faster.loc[faster["samples_per_s"].idxmax()]
        first, other = row_params(best), row_params(top)
        gpu = not self.measured_on_cpu
        if prior_rank(first, gpu=gpu) < prior_rank(other, gpu=gpu):
            why = ("16-bit ranks before tf32 and fp32 on a GPU" if gpu else
                   "fp32 ranks first on a CPU, where autocast's 16 bits are emulated")
        elif _py(best.get("estimated_samples_per_s")) is not None and _py(top.get("estimated_samples_per_s")) is not None:
            ahead = float(best["estimated_samples_per_s"]) / float(top["estimated_samples_per_s"]) - 1.0
            why = f"the search's throughput model, fitted to all {len(_frame_probes(self.trials))} probes of the study, puts it {ahead:.1%} ahead"
        else:
            return None
        gap = float(top["samples_per_s"]) / float(best["samples_per_s"]) - 1.0
        return f"Ranked first although {other.short()} measured {gap:.1%} faster: they are within the noise of each other, and {why}."

    @property
    def best_params(self) -> dict[str, Any] | None:
        """The fastest fitting configuration, by parameter name (``None`` if nothing fit)."""
        best = self.best
        if best is None:
            return None
        return row_params(best).to_dict()

    @property
    def baseline(self) -> dict[str, Any] | None:
        """The baseline trial's row (the user's settings, ``--baseline``, or transformers' defaults), or None if it has not run."""
        return self.reference("baseline")

    def reference(self, role: str) -> dict[str, Any] | None:
        """The row of the first trial of a reference role (``baseline``, ``expert``), or None if none ran."""
        if role == "baseline":
            rows = self.trials[self.trials["is_baseline"]]
        else:
            rows = self.trials[self.trials["role"] == role] if "role" in self.trials.columns else self.trials.iloc[0:0]
            stored = self.study_settings.expert if role == schema.ROLE_EXPERT else None
            if rows.empty and isinstance(stored, dict) and not self.trials.empty:  # measured under another role (the expert
                rows = self.trials[same_params(self.trials, stored) & self.trials["duplicate_of"].isna()]  # rule is the baseline)
        return None if rows.empty else {k: _py(v) for k, v in rows.iloc[0].to_dict().items()}

    def reference_samples_per_s(self, role: str) -> float | None:
        """A reference configuration's samples/s, averaged like :meth:`ranked` (None if it did not run or fit)."""
        row = self.reference(role)
        if row is None:
            return None
        ranked = self.ranked()
        matches = ranked[same_params(ranked, row)]
        return None if matches.empty else float(matches.iloc[0]["samples_per_s"])

    @property
    def baseline_samples_per_s(self) -> float | None:
        """The baseline configuration's samples/s, averaged like :meth:`ranked` (None if it did not fit)."""
        return self.reference_samples_per_s("baseline")

    @property
    def speedup(self) -> float | None:
        """Best samples/s over the baseline's (both averaged over their probes), when both ran and fit."""
        return self.speedup_over("baseline")

    def speedup_over(self, role: str) -> float | None:
        """Best over a reference (``baseline``, ``expert``), both measured in this study, when both ran and fit."""
        best, base = self.best, self.reference_samples_per_s(role)
        if best is None or not base:
            return None
        return float(best["samples_per_s"]) / base

    @property
    def baseline_label(self) -> str:
        """What the baseline is, for a sentence: ``your settings``, ``your --baseline``, ``transformers' defaults``."""
        return baseline_label(self.study_settings.baseline_source)

    @property
    def objective(self) -> str:
        """What configurations are ranked by: ``tokens`` (samples/s is tokens/s over the data's tokens per sequence) or ``samples``."""
        return self.study_settings.objective

    def speedups_line(self) -> str:
        """``1.49x your settings, 1.02x the expert rule``: the best against every reference this study measured."""
        parts = []
        for role, label in (("baseline", self.baseline_label), ("expert", "the expert rule")):
            row = self.reference(role)
            if row is None:
                continue
            value = self.speedup_over(role)
            parts.append(f"{value:.2f}x {label}" if value is not None else f"{label}: {row.get('status')}")
        return ", ".join(parts)

    def busy_probes(self) -> int:
        """Probes that ran while something else used the device (see :mod:`autotune.probe.interference`)."""
        if "interference" not in self.trials.columns:
            return 0
        return int(self.trials["interference"].map(lambda v: isinstance(v, str) and bool(v)).sum())

    def counts(self) -> dict[str, int]:
        """Trials by outcome (repeats of a measured configuration and enqueued trials never started not counted)."""
        frame = self.trials[self.trials["duplicate_of"].isna() & (self.trials["state"] != "waiting")]
        return {str(k): int(v) for k, v in frame["status"].value_counts().items()}

    # ------------------------------------------------------------------ outputs

    def best_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the best configuration for the user's config class (``TrainingArguments``, or the
        ``SFTConfig`` their factory parses), plus ``attn_implementation`` (a model-loading setting, not a config field).

        For a ``make_trainer(argv)`` factory these are the user's own settings (as their inputs gave them) with the
        tuned fields on top, so ``SFTConfig(**kwargs)`` is the configuration that was measured.

        Raises:
            NothingFits: if no configuration fit under the memory ceiling.
            NoResult: if no probe finished at all (the budget ended first, or every probe failed).
        """
        from autotune.config_fields import PROBE_FIELDS, config_overrides

        params = self.best_params
        if params is None:
            raise no_result_error(self)
        trial_params = TrialParams.from_dict(params)
        own = self.study_settings.user_config
        if own is not None:  # the user's own config, the tuned fields on top
            kwargs = {k: v for k, v in own.items() if k not in PROBE_FIELDS}
            kwargs.update(config_overrides(trial_params))
        else:
            kwargs = trial_params.training_arguments_kwargs()
        if self.measured_on_cpu:
            kwargs["use_cpu"] = True  # measured on the CPU: the Trainer must not look for a GPU
        return {**kwargs, "attn_implementation": trial_params.attn_implementation}

    @property
    def config_class(self) -> str:
        """The class the configuration is for, ``module.Class`` (``transformers.training_args.TrainingArguments`` for a --model run)."""
        return self.study_settings.config_class

    def best_training_arguments(self, output_dir: str = "trainer_output", **overrides: Any) -> Any:
        """The best configuration as an instance of the user's config class (``TrainingArguments``, TRL's ``SFTConfig``...).

        Args:
            output_dir: where the user's Trainer will write checkpoints.
            **overrides: any other fields (learning rate, epochs...).

        Raises:
            NothingFits: if no configuration fit under the memory ceiling.
        """
        import importlib

        module, _, name = self.config_class.rpartition(".")
        config_class = getattr(importlib.import_module(module), name)
        kwargs = self.best_kwargs()
        kwargs.pop("attn_implementation")
        return config_class(output_dir=output_dir, **{**kwargs, **overrides})

    def peft_note(self) -> str | None:
        """What the probes wrapped the model in (LoRA adapters), as one line naming the ``peft`` call
        to repeat; None for a study that trained every weight (see :mod:`autotune.lora`)."""
        settings = self.study_settings
        lora = settings.lora
        if lora is None:
            return None
        from autotune.lora import note

        return note(lora, settings.parameters)

    def ranks_note(self) -> str | None:
        """For a study whose probes ran several processes: how to launch the best (its batch is per device)."""
        n = self.study_settings.nproc_per_probe
        return f"per device, measured as {n} data-parallel processes: launch with torchrun --nproc-per-node {n}" if n > 1 else None

    def best_json(self) -> dict[str, Any]:
        """best.json: fields of the user's config class only (``TrainingArguments(**best)``, ``SFTConfig(**best)``,
        ``trl sft --config best.json`` load it); the model-loading half is :meth:`model_json`."""
        kwargs = self.best_kwargs()
        kwargs.pop("attn_implementation")
        return kwargs

    def model_json(self) -> dict[str, Any]:
        """best.model.json: what loading the model takes (:class:`ModelLoadingArguments`): ``attn_implementation``,
        and ``autotune_note``: the best's speed-ups over the references this study measured, and for a LoRA study
        the adapters the probes trained."""
        loading: dict[str, Any] = {"attn_implementation": self.best_kwargs()["attn_implementation"]}
        speedups = self.speedups_line()
        notes = [f"measured in study {self.study_name!r}: {speedups}" if speedups else "", self.peft_note() or "", self.ranks_note() or ""]
        note = "; ".join(n for n in notes if n)
        return {**loading, "autotune_note": note} if note else loading

    def write_best_json(self, path: str | Path) -> Path:
        """Write best.json (the config class's fields) and, beside it, ``<stem>.model.json`` (:meth:`model_json`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(self.best_json(), indent=2) + "\n")
        write_atomically(model_json_path(path), json.dumps(self.model_json(), indent=2) + "\n")
        return path


def baseline_label(source: Any) -> str:
    """What a study's baseline is (its ``baseline_source``), for a sentence."""
    return {"user": "your settings", "file": "your --baseline"}.get(str(source), "transformers' defaults")


def model_json_path(best_json: str | Path) -> Path:
    """``best.json`` -> ``best.model.json``: where the model-loading settings go beside it."""
    path = Path(best_json)
    return path.with_name(f"{path.stem}.model.json")


def write_atomically(path: Path, text: str) -> None:
    """The whole file or the old one: written beside it, then renamed over it (a full disk leaves no empty file)."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def no_result_error(result: TuneResult) -> NothingFits | NoResult:
    """Why ``result`` has no best configuration, as the error to raise, with advice that can be followed.

    "Nothing fits" (exit 3) only when memory was the reason: a probe ran out of memory, finished
    over the ceiling, or was pruned as predicted over it. Otherwise nothing finished a probe (exit
    4): the budget ended first, or every probe crashed, timed out or diverged.
    """
    from autotune.space import package_available
    from autotune.units import format_bytes, format_duration

    counts = result.counts()
    ran_over = bool(counts.get(ProbeStatus.OK)) and result.ranked().empty
    # A probe cut short (timed out, interrupted, not started) might have fit: then "nothing fits" is not known.
    unresolved = counts.get(ProbeStatus.TIMEOUT, 0) + counts.get("fail", 0)
    if (counts.get(ProbeStatus.OOM) or counts.get(ProbeStatus.PRUNED) or ran_over) and not unresolved:
        ceiling = format_bytes(result.memory_ceiling_bytes)
        smallest = result.trials["per_device_train_batch_size"].min()
        return NothingFits(f"nothing fits under the {ceiling} memory ceiling (smallest batch size tried: {smallest}): "
                           + ", ".join(_memory_advice(result, package_available)))
    summary = ", ".join(f"{n} {s}" for s, n in counts.items()) or "no trial ran"
    timeouts = result.trials[result.trials["status"] == ProbeStatus.TIMEOUT.value]
    if result.stopped_because == "budget" and (counts.get(ProbeStatus.TIMEOUT) or not len(result.trials)):
        longest = pd.to_numeric(timeouts["wall_s"], errors="coerce").max() if not timeouts.empty else None
        cut = f"; the longest probe ran {format_duration(longest)} before it was cut" if longest and longest == longest else ""
        return NoResult(f"the budget ended before any probe finished ({summary}{cut}): give a larger --budget")
    if counts.get("fail"):
        return NoResult(f"no configuration finished a probe under the ceiling before the run was stopped ({summary}): "
                        "run the same command again, the study resumes where it stopped")
    return NoResult(
        f"no configuration finished a probe ({summary}): see each trial's reason in the report, "
        "or the traceback with `autotune --debug run ...`"
    )


def _memory_advice(result: TuneResult, package_available: Any) -> list[str]:
    """What could make a configuration fit, naming only changes this study has not tried."""
    settings = result.study_settings
    space = (settings.space or {}).get("choices") or {}
    advice = []
    if True not in space.get("gradient_checkpointing", [True]):
        advice.append("allow gradient_checkpointing: [true] in the space")
    optims = space.get("optim", [])
    gpu = not result.measured_on_cpu
    if "adafactor" not in optims:
        advice.append("allow optim adafactor (a factored optimizer state) in the space")
    if gpu and not any("8bit" in str(o) for o in optims):
        if package_available("bitsandbytes"):
            advice.append("allow an 8-bit optimizer (adamw_bnb_8bit) in the space")
        else:
            advice.append("pip install bitsandbytes and allow adamw_bnb_8bit in the space")
    dropped = " ".join(settings.dropped)
    if (gpu and True not in space.get("use_liger_kernel", [False]) and "use_liger_kernel=" not in dropped
            and package_available("liger_kernel")):
        advice.append("allow use_liger_kernel: [true] in the space (its fused cross-entropy keeps no logits)")
    if gpu and not any(sharding_of(str(s)).offload_optimizer for s in space.get("sharding", [NO_SHARDING])):
        install = "" if package_available("deepspeed") else "pip install deepspeed and "
        advice.append(f"{install}allow sharding: [none, zero2_offload] in the space (ZeRO-Offload keeps AdamW's state on the host)")
    batches = [b for b in space.get("per_device_train_batch_size", []) if isinstance(b, int)]
    if batches and min(batches) > 1:
        advice.append(f"allow per_device_train_batch_size below {min(batches)}")
    advice.append("use a shorter --seq-len")
    total = settings.device.get("total_memory_bytes")
    if total and result.memory_ceiling_bytes and result.memory_ceiling_bytes < total:
        advice.append("or raise --memory-ceiling")
    return advice


def same_params(frame: pd.DataFrame, params: dict[str, Any], names: tuple[str, ...] = PARAM_NAMES) -> pd.Series:
    """Rows of ``frame`` whose parameters ``names`` (and user-config fields) equal ``params``' (None equals a missing
    value: ``torch_empty_cache_steps`` and ``dataloader_prefetch_factor`` are None at their defaults). ``params``: a
    frame row, or :meth:`TrialParams.to_dict`."""
    mask = pd.Series(True, index=frame.index)
    for name in names:
        want = _py(params.get(name))
        mask &= pd.Series([_py(v) == want for v in frame[name]], index=frame.index, dtype=bool)
    if "extra" in frame.columns:
        extra = params.get("extra")
        want_extra = tuple(sorted(extra.items())) if isinstance(extra, dict) else tuple(extra or ())
        mask &= pd.Series([tuple(v or ()) == want_extra for v in frame["extra"]], index=frame.index, dtype=bool)
    return mask


def row_params(row: Any) -> TrialParams:
    """The configuration of a trials or configurations frame row (a Series, a dict, an ``itertuples`` row)."""
    if hasattr(row, "_asdict"):
        row = row._asdict()
    values = {name: _py(row.get(name)) for name in PARAM_NAMES}
    extra = row.get("extra")
    return TrialParams.from_dict({**{k: v for k, v in values.items() if v is not None},
                                  "extra": dict(extra) if isinstance(extra, (tuple, list)) else {}})


def _py(value: Any) -> Any:
    """numpy/pandas scalars -> plain Python (JSON and TrainingArguments want them)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def load_result(study_name: str, storage: Any, *, stopped_because: str | None = None) -> TuneResult:
    """Rebuild a :class:`TuneResult` from the storage (the study may still be running).

    ``storage``: a storage string (``sqlite:///...``, ``postgresql://...``, ``journal:///...``) or an
    Optuna storage object; it is kept as given in :attr:`TuneResult.storage`.

    Raises:
        UsageError: bad storage, no such study (the message lists the ones there are), or a study
            that autotune did not make.
    """
    study = opening.load_existing(study_name, storage)
    settings = opening.settings_of(study)
    return TuneResult(
        study_name=study_name,
        storage=storage,
        trials=trials_frame(study, StudySettings.from_dict(settings).memory_ceiling_bytes),
        settings=settings,
        stopped_because=stopped_because or opening.last_stop(settings),
    )


@dataclass(frozen=True)
class StudyRow:
    """One line of ``autotune list``."""

    name: str
    model: str
    device: str
    n_trials: int
    counts: dict[str, int]
    best_samples_per_s: float | None
    best_config: str
    foreign: bool = False  # made by plain Optuna (or another tool): listed, never read as autotune's


def list_studies(storage: Any) -> list[StudyRow]:
    """Every study in ``storage`` with its trial counts and best fitting speed (a study autotune did
    not make is listed as ``foreign``, with its trial count only).

    Raises:
        UsageError: bad storage.
    """
    rows = []
    for stored in opening.stored_studies(storage):
        name = stored.name
        if not stored.ours:
            rows.append(StudyRow(name=name, model="-", device="-", n_trials=stored.n_trials, counts={}, best_samples_per_s=None,
                                 best_config="-", foreign=True))
            continue
        result = load_result(name, storage)
        settings = result.study_settings
        best = result.best
        rows.append(StudyRow(
            name=name,
            model=str(settings.model or "?"),
            device=str(settings.device.get("name", "?")),
            n_trials=len(result.trials),
            counts=result.counts(),
            best_samples_per_s=float(best["samples_per_s"]) if best is not None else None,
            best_config=short_config(best) if best is not None else "-",
        ))
    return rows


def short_config(row: Any) -> str:
    """``bs8x1 fp32 adamw_torch_fused sdpa`` for a frame row, an ``itertuples`` row or a dict."""
    try:
        return row_params(row).short()
    except (TypeError, ValueError):
        return "-"


@dataclass
class ModelLoadingArguments:
    """``best.model.json``, the model-loading half of the result, for ``HfArgumentParser(ModelLoadingArguments)``
    (best.json holds the config class's fields)."""

    attn_implementation: str = field(default="sdpa", metadata={"help": "from_pretrained(attn_implementation=...)"})
    autotune_note: str | None = field(default=None, metadata={"help": "its speed-ups, and what else it was measured with (LoRA adapters)"})
