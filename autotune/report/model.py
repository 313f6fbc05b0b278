"""The report's data model: :func:`build_report_model` turns a :class:`TuneResult` into a :class:`ReportModel`.

Every number of the HTML report is computed and formatted here (the charts' data in
:mod:`autotune.report.charts`); :mod:`autotune.report.html` only lays the model out. Optional measurements (MFU, GPU utilisation, energy, the
memory model's prediction, ...) are declared once in :data:`TABLE_COLUMNS`; a column missing from
the trials frame, or holding no value in any trial, is left out rather than shown empty, so a new
column in :data:`autotune.results.RESULT_COLUMNS` appears in the report by adding one line here.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

import autotune.storage as storage_lib
from autotune.config_fields import BATCH_CONTENT_FIELDS
from autotune.errors import NothingFits
from autotune.params import PARAM_DEFAULTS, PARAM_NAMES, fp32_matmul_setting
from autotune.records import ProbeStatus
from autotune.report.charts import (
    Chart,
    chart_history,
    chart_importance,
    chart_memory_vs_batch,
    chart_pareto,
    chart_throughput_vs_batch,
)
from autotune.report.formatting import Kind, format_count, format_value, is_missing, sort_key
from autotune.results import TuneResult, no_result_error, same_params, short_config
from autotune.space import SearchSpace
from autotune.storage import DEFAULT_STORAGE
from autotune.studies.settings import ProbeSettings, RunLog, StudySettings
from autotune.units import format_bytes, format_duration

# A trial's outcome in the report: the probe's status, except that a finished probe over the
# memory ceiling is "over_ceiling" (it ran, but does not fit). Listed in display order.
OVER_CEILING = "over_ceiling"
FAIL = "fail"  # a trial that ended without a probe outcome (interrupted, its run died)
RUNNING = "running"
OUTCOMES: tuple[str, ...] = (
    ProbeStatus.OK.value, OVER_CEILING, ProbeStatus.OOM.value, ProbeStatus.PRUNED.value, ProbeStatus.TIMEOUT.value,
    ProbeStatus.CRASH.value, ProbeStatus.DIVERGED.value, FAIL, RUNNING,
)
OUTCOME_LABELS = dict(zip(OUTCOMES, (
    "fits", "over the ceiling", "out of memory", "pruned (not run)", "timed out", "crashed", "diverged", "failed", "running",
)))
WENT_WRONG = tuple(o for o in OUTCOMES if o not in (ProbeStatus.OK.value, RUNNING))



@dataclass(frozen=True)
class Column:
    """One column of the trials table: where it comes from and how its numbers read."""

    key: str  # a trials-frame column (or a computed one: rank, outcome, flags, vs_baseline)
    label: str
    kind: Kind
    optional: bool = False  # measured only by some probes/devices: left out when absent or all empty
    hidden_at_default: bool = False  # a parameter left out while every configuration holds it at its default


TABLE_COLUMNS: tuple[Column, ...] = (
    Column("rank", "rank", "int"),
    Column("trial", "trial", "int"),
    Column("outcome", "outcome", "text"),
    Column("per_device_train_batch_size", "batch", "int"),
    Column("gradient_accumulation_steps", "accum", "int"),
    Column("precision", "precision", "text"),
    Column("optim", "optim", "text"),
    Column("torch_compile", "compile", "text"),
    Column("attn_implementation", "attention", "text"),
    Column("dataloader_num_workers", "workers", "int"),
    Column("gradient_checkpointing", "ckpt", "bool"),
    Column("use_liger_kernel", "liger", "bool", hidden_at_default=True),
    Column("torch_empty_cache_steps", "empty cache every", "int", hidden_at_default=True),  # "-": never
    Column("dataloader_pin_memory", "pin memory", "bool", hidden_at_default=True),
    Column("dataloader_persistent_workers", "persistent workers", "bool", hidden_at_default=True),
    Column("dataloader_prefetch_factor", "prefetch", "int", hidden_at_default=True),  # "-": torch's 2 per worker
    Column("samples_per_s", "samples/s", "rate"),
    Column("n_probes", "probes", "int"),
    Column("spread_rel", "spread", "fraction", optional=True),
    Column("tokens_per_s", "tokens/s", "rate"),
    Column("vs_baseline", "vs baseline", "ratio"),
    Column("step_time_s", "step time", "seconds"),
    Column("step_time_ci95_rel", "step CI95", "fraction", optional=True),
    Column("peak_mem_bytes", "peak memory", "bytes"),
    Column("predicted_peak_mem_bytes", "predicted memory", "bytes", optional=True),
    Column("mfu", "MFU", "fraction", optional=True),
    Column("achieved_tflops", "TFLOP/s", "tflops", optional=True),
    Column("gpu_util_mean_pct", "GPU util", "percent", optional=True),
    Column("power_mean_w", "power", "watts", optional=True),
    Column("energy_per_sample_j", "energy/sample", "joules", optional=True),
    Column("flags", "flags", "text"),
)
# Boolean/number columns that become words in the "flags" column when true.
FLAG_COLUMNS = (("input_bound", "input-bound"), ("numerics_flag", "numerics drift"))


# ---------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Cell:
    text: str  # what the reader sees, unit included
    sort: float | str | None  # what the table sorts by (None: not measured, sorts last)


@dataclass(frozen=True)
class TableRow:
    """One configuration: its first trial, outcome and cells; ``probes`` expand it to its probes."""

    trial: int
    outcome: str
    cells: tuple[Cell, ...]
    is_best: bool = False
    is_baseline: bool = False
    probes: tuple[str, ...] = ()  # "trial 3: 76.1 samples/s (re-measure)", one per probe, oldest first


@dataclass(frozen=True)
class Comparison:
    """The best configuration against a reference trial."""

    label: str  # "the transformers defaults"
    reference: str  # "trial 0: bs8x1 fp32 adamw_torch_fused sdpa"
    reference_samples_per_s: float | None
    speedup: float | None
    note: str = ""


@dataclass(frozen=True)
class Problem:
    """A trial that did not give a fitting measurement, and why."""

    trial: int
    outcome: str
    config: str
    reason: str  # first line
    detail: str = ""  # the full stored reason (stderr tail of a crash)


@dataclass(frozen=True)
class ReportModel:
    study_name: str
    title: str
    device_kind: str  # "cuda" | "cpu" | "?"
    summary: tuple[tuple[str, str], ...]  # (label, value) pairs
    counts: dict[str, int]  # outcome -> configurations, in OUTCOMES order, zero counts left out
    headline: str  # the best configuration in a sentence (or why there is none)
    comparisons: tuple[Comparison, ...]
    best_metrics: tuple[tuple[str, str], ...]  # MFU, energy per sample... where measured
    notice: str  # a banner: CPU study, empty study, nothing fits ("" when none)
    training_arguments_code: str
    command: str
    columns: tuple[Column, ...]
    rows: tuple[TableRow, ...]
    charts: tuple[Chart, ...]
    problems: tuple[Problem, ...]
    dropped: tuple[str, ...]
    generated_note: str = ""
    regenerate_command: str = ""  # `autotune report ...` that rewrites this file
    n_trials: int = 0  # trials that ran or were pruned (repeats and waiting ones left out)
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def n_configurations(self) -> int:
        return len(self.rows)


# ---------------------------------------------------------------------------------------- calculations


def outcome_of(row: pd.Series) -> str:
    """The report outcome of one trials-frame row (see :data:`OUTCOMES`)."""
    status = str(row.get("status"))
    if status == ProbeStatus.OK.value:
        return status if bool(row.get("feasible")) else OVER_CEILING
    return status if status in OUTCOMES else FAIL


def ordered_configurations(result: TuneResult) -> pd.DataFrame:
    """Every configuration in the order of the ranking (:meth:`TuneResult.configurations`, the rule the
    terminal and the search use), with the computed columns ``outcome`` and ``vs_baseline`` (its mean
    samples/s over the baseline configuration's)."""
    frame = result.configurations()
    if frame.empty:
        return frame.assign(outcome=[], vs_baseline=[])
    frame = frame.copy()
    frame["outcome"] = [outcome_of(row) for _, row in frame.iterrows()]
    base = _baseline_speed(result)
    speeds = pd.to_numeric(frame["samples_per_s"], errors="coerce")
    frame["vs_baseline"] = [s / base if base and not is_missing(s) else None for s in speeds]
    return frame


def _probe_lines(result: TuneResult, frame: pd.DataFrame) -> dict[int, tuple[str, ...]]:
    """First trial -> one line per probe of its configuration (what a table row expands to)."""
    trials = result.trials.set_index("trial", drop=False)
    lines: dict[int, tuple[str, ...]] = {}
    for row in frame.to_dict("records"):
        entries = []
        for trial in row["probe_trials"]:
            probe = trials.loc[trial]
            text = f"trial {trial}: {OUTCOME_LABELS.get(outcome_of(probe), probe['status'])}"
            if not is_missing(probe["samples_per_s"]):
                text += f", {format_value('rate', probe['samples_per_s'])} samples/s"
            if not is_missing(probe.get("remeasure_of")):
                text += " (near-tie re-measure)"
            entries.append(text)
        lines[int(row["trial"])] = tuple(entries)
    return lines


def _baseline_speed(result: TuneResult) -> float | None:
    return result.baseline_samples_per_s


def default_settings_trials(result: TuneResult) -> pd.DataFrame:
    """Trials that differ from the baseline in the batch size (and accumulation) only.

    These are what HF ``auto_find_batch_size`` or Lightning's batch-size finder explore: the
    defaults, with the largest batch that fits.
    """
    baseline = result.baseline
    frame = result.trials
    if not baseline or frame.empty:
        return frame.iloc[0:0]
    fixed = tuple(n for n in PARAM_NAMES if n not in ("per_device_train_batch_size", "gradient_accumulation_steps"))
    mask = same_params(frame, baseline, fixed)
    if not result.study_settings.effective_batch_size:
        mask &= frame["gradient_accumulation_steps"] == baseline.get("gradient_accumulation_steps")
    return frame[mask & frame["duplicate_of"].isna()]


def largest_default_batch(result: TuneResult) -> tuple[pd.Series | None, str]:
    """The configuration at default settings with the largest batch that fits (a row of
    :meth:`TuneResult.ranked`, so its samples/s is its mean, as the best's is), and a note on how
    sure that is."""
    frame = default_settings_trials(result)
    ranked = result.ranked()
    fits = ranked[ranked["trial"].isin(frame["trial"])] if not ranked.empty else ranked
    if fits.empty:
        return None, "no trial at default settings fit"
    best = fits.sort_values(["per_device_train_batch_size", "samples_per_s"], ascending=False).iloc[0]
    batch = int(best["per_device_train_batch_size"])
    bigger = frame[frame["per_device_train_batch_size"] > batch]
    if not bigger.empty:
        failed = int(bigger["per_device_train_batch_size"].min())
        note = f"batch {failed} at default settings did not fit"
    else:
        note = "the largest batch measured at default settings; a larger one may fit"
    return best, note


def time_used(frame: pd.DataFrame) -> tuple[float | None, float | None]:
    """(seconds from the first probe's start to the last one's end, seconds spent inside probes)."""
    if frame.empty:
        return None, None
    starts = pd.to_datetime(frame["started_at"], errors="coerce")
    ends = pd.to_datetime(frame["finished_at"], errors="coerce")
    span = (ends.max() - starts.min()).total_seconds() if not (is_missing(ends.max()) or is_missing(starts.min())) else None
    walls = pd.to_numeric(frame["wall_s"], errors="coerce")
    probes = float(walls.sum()) if walls.notna().any() else None
    return span, probes


# ---------------------------------------------------------------------------------------- code


def model_reference(settings: StudySettings) -> tuple[str, str]:
    """(what to pass to ``from_pretrained``, a comment) for the study's model."""
    name = str(settings.model or "your-model")
    if settings.model_source != "builtin":
        return name, ""
    try:
        from autotune.models import resolve_model

        hub_id = resolve_model(name).hub_id
    except Exception:  # noqa: BLE001 - the comment below says what to do instead
        hub_id = None
    if hub_id:
        return str(hub_id), ""
    return name, "  # a built-in test config: load your own checkpoint here"


def _peft_lines(result: TuneResult) -> list[str]:
    """A LoRA study's adapters, as the probes applied them (TrainingArguments has no field for them)."""
    lora = result.study_settings.lora
    if lora is None:
        return []
    from autotune.lora import QLORA_BASE_CODE, settings_code

    lines = [f"# measured with {lora.describe()}: the same adapters (peft; not tuned)", "from peft import LoraConfig, get_peft_model",
             f"model = get_peft_model(model, {settings_code(lora)})"]
    if lora.quantized:
        lines.insert(1, f"# the base was loaded in 4 bits: {QLORA_BASE_CODE}")
    if result.best is not None and bool(result.best["gradient_checkpointing"]):
        lines.append("model.enable_input_require_grads()  # adapters behind checkpointed layers of a frozen base get gradients")
    return lines


def _literal(value: Any) -> str:
    """A Python literal in the usual style: double-quoted strings."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def training_arguments_code(result: TuneResult) -> str:
    """Python that builds the best configuration: the model line and the ``TrainingArguments(...)`` call.

    Raises:
        NothingFits: if no configuration fit under the memory ceiling.
    """
    kwargs = result.best_kwargs()
    attn = kwargs.pop("attn_implementation")
    settings = result.study_settings
    model, comment = model_reference(settings)
    model_line = f"model = AutoModelForCausalLM.from_pretrained({_literal(model)}, attn_implementation={_literal(attn)}){comment}"
    module, _, class_name = result.config_class.rpartition(".")
    module = "transformers" if module.startswith("transformers.") else "trl" if module.startswith("trl.") else module
    identity = settings.trainer_identity
    if identity:  # a user's factory (--trainer) builds the model and the Trainer from these arguments
        function = str(identity["reference"]).rpartition(":")[2]
        model_line = f"# your factory ({identity['reference']}): trainer = {function}(args, attn_implementation={_literal(attn)})"
        if identity.get("args") is not None:
            model_line = (f"# your factory ({identity['reference']}) parses these; pass attn_implementation={_literal(attn)} to your "
                          "model loading (TRL: --attn_implementation)")
    best = result.best
    speed = f"{float(best['samples_per_s']):,.1f} samples/s" if best is not None else ""
    device = settings.device.get("name", "?")
    precision = str(best["precision"]) if best is not None else "fp32"
    lines = [
        "import torch",
        "from transformers import AutoModelForCausalLM" + (", TrainingArguments" if class_name == "TrainingArguments" else ""),
        *([f"from {module} import {class_name}"] if class_name != "TrainingArguments" else []),
        "",
        f"# autotune study {result.study_name!r}: {speed} on {device}",
        model_line,
        f"args = {class_name}(",
        '    output_dir="trainer_output",',
        *(f"    {k}={_literal(v)}," for k, v in kwargs.items()),
        ")",
        *_peft_lines(result),
        "# trainer = Trainer(model=model, args=args, ...), then, before trainer.train(), the fp32 matmul precision",
        "# autotune measured (transformers and accelerate may turn TF32 on for torch.compile behind the label):",
        f"torch.set_float32_matmul_precision({_literal(fp32_matmul_setting(precision))})",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- the whole model


def _table(
    frame: pd.DataFrame, best_trial: int | None, probes: dict[int, tuple[str, ...]]
) -> tuple[tuple[Column, ...], tuple[TableRow, ...]]:
    """The configurations table; ``best_trial`` (the best configuration's first trial) is highlighted."""
    columns = tuple(
        c for c in TABLE_COLUMNS
        if (not c.optional or (c.key in frame.columns and frame[c.key].map(lambda v: not is_missing(v)).any()))
        and (not c.hidden_at_default or (c.key in frame.columns and frame[c.key].map(
            lambda v, default=PARAM_DEFAULTS[c.key]: (None if is_missing(v) else v) != default).any()))
    )
    rows = []
    for _, row in frame.iterrows():
        cells = []
        for column in columns:
            if column.key == "flags":
                words = [label for key, label in FLAG_COLUMNS if key in frame.columns and not is_missing(row[key]) and bool(row[key])]
                if "loss_drift" in frame.columns and not is_missing(row["loss_drift"]) and "numerics drift" in words:
                    words[words.index("numerics drift")] = f"numerics drift ({float(row['loss_drift']):.2g})"
                if row.get("is_baseline"):
                    words.insert(0, "baseline")
                if bool(row.get("unstable")):
                    words.append(f"unstable (probes {100 * float(row['spread_rel']):.0f}% apart)")
                if isinstance(row.get("interference"), str) and row["interference"]:
                    words.append(f"busy machine ({row['interference']})")
                cells.append(Cell(", ".join(words), ", ".join(words) or None))
            elif column.key == "outcome":
                cells.append(Cell(OUTCOME_LABELS.get(row["outcome"], str(row["outcome"])), OUTCOMES.index(row["outcome"]) if row["outcome"] in OUTCOMES else 99))
            else:
                value = row.get(column.key)
                cells.append(Cell(format_value(column.kind, value), sort_key(column.kind, value)))
        rows.append(TableRow(trial=int(row["trial"]), outcome=str(row["outcome"]), cells=tuple(cells),
                             is_best=best_trial is not None and int(row["trial"]) == best_trial, is_baseline=bool(row.get("is_baseline")),
                             probes=probes.get(int(row["trial"]), ())))
    return columns, tuple(rows)


def _problems(frame: pd.DataFrame) -> tuple[Problem, ...]:
    problems = []
    for _, row in frame.sort_values("trial").iterrows():
        if row["outcome"] not in WENT_WRONG:
            continue
        reason = str(row.get("reason") or "").strip()
        if row["outcome"] == OVER_CEILING and not is_missing(row.get("peak_mem_bytes")):
            reason = f"peak memory {format_bytes(row['peak_mem_bytes'])} is over the memory ceiling"
        first = next((line for line in reason.splitlines() if line.strip()), "no reason recorded")
        if row["outcome"] == ProbeStatus.CRASH.value:  # the last line of a stderr tail is the exception
            first = next((line for line in reversed(reason.splitlines()) if line.strip()), first)
        detail = reason[-1500:] if (row["outcome"] == ProbeStatus.CRASH.value or reason.count("\n") > 0) else ""
        problems.append(Problem(trial=int(row["trial"]), outcome=str(row["outcome"]), config=short_config(row),
                                reason=first[:300], detail=detail))
    return tuple(problems)


def _summary(result: TuneResult, n_trials: int, counts: dict[str, int]) -> tuple[tuple[str, str], ...]:
    s = result.study_settings
    device = s.device
    items: list[tuple[str, str]] = [("Model", str(s.model or "?") + (f" ({s.model_source})" if s.model_source else ""))]
    if s.num_parameters:
        items.append(("Parameters", format_count(s.num_parameters)))
    sizes = s.parameters or {}
    trained = f" ({format_count(sizes['trainable'])} of {format_count(sizes['total'])} parameters trainable)" if sizes.get("total") else ""
    if s.trainer:  # a user's Trainer factory (--trainer): its model as it trains, adapters included
        items.append(("Trainer", f"{s.trainer}{trained}"))
        if sizes.get("dtypes"):
            from autotune.lora import ParameterCounts

            items.append(("Parameter dtypes", ParameterCounts.from_dict(sizes).describe_dtypes()))
    lora = s.lora
    if lora is not None:
        items.append(("Adapters", lora.describe() + trained))
    items.append(("Sequence length", f"{s.seq_len:,} tokens" if s.seq_len else "-"))
    dev = str(device.get("name", "?"))
    if device.get("kind") == "cpu":
        dev += " (CPU study)"
    items.append(("Device", dev))
    details = []
    if device.get("total_memory_bytes"):
        details.append(f"{format_bytes(device['total_memory_bytes'])} memory")
    if device.get("compute_capability"):
        details.append("compute capability " + ".".join(str(v) for v in device["compute_capability"]))
    if device.get("driver_version"):
        details.append(f"driver {device['driver_version']}")
    if device.get("cuda_version"):
        details.append(f"CUDA {device['cuda_version']}")
    if details:
        items.append(("Device details", ", ".join(details)))
    items.append(("Memory ceiling", format_bytes(s.memory_ceiling_bytes)))
    if s.effective_batch_size:
        items.append(("Effective batch size", f"fixed at {s.effective_batch_size}"))
    if s.space and s.space.get("name"):
        space = SearchSpace.from_dict(s.space)  # its size counts as the run's did (accumulation derived or not)
        items.append(("Search space", f"{space.name} ({space.size:,} configurations before pruning)"))
    span, probes = time_used(result.trials)
    if span is not None:
        used = f"{format_duration(span)} from the first probe's start to the last one's end"
        if probes is not None:
            used += f", {format_duration(probes)} inside probes"
        log = RunLog.from_dict(result.settings)
        runs = log.budgets_s
        if len(runs) > 1:  # the span then holds the time between the runs too
            used += f" (budget {format_duration(log.budget_s)} over {len(runs)} runs: {' + '.join(format_duration(b) for b in runs)})"
        elif log.budget_s:
            used += f" (budget {format_duration(log.budget_s)})"
        items.append(("Time used", used))
    total = sum(counts.values())
    items.append(("Configurations", f"{total}: " + ", ".join(f"{n} {OUTCOME_LABELS[o]}" for o, n in counts.items()) if total else "none yet"))
    remeasured = int(result.trials["remeasure_of"].notna().sum()) if "remeasure_of" in result.trials else 0
    again = f", {remeasured} of them probing again a configuration within noise of the best" if remeasured else ""
    items.append(("Trials", f"{n_trials}{again}" if n_trials else "none yet"))
    if result.stopped_because:
        items.append(("Stopped", result.stopped_because))
    versions = s.versions
    if versions:
        items.append(("Versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    return tuple(items)


def _best_metrics(best: pd.Series | None) -> tuple[tuple[str, str], ...]:
    if best is None:
        return ()
    metrics = []
    for key, label, kind in (("mfu", "MFU", "fraction"), ("achieved_tflops", "achieved", "tflops"),
                             ("gpu_util_mean_pct", "GPU utilisation", "percent"),
                             ("energy_per_sample_j", "energy per sample", "joules"), ("power_mean_w", "mean power", "watts")):
        if key in best.index and not is_missing(best[key]):
            metrics.append((label, format_value(kind, best[key])))  # type: ignore[arg-type]
    return tuple(metrics)


def _regenerate_command(result: TuneResult) -> str:
    words = ["autotune", "report", result.study_name]
    option = storage_lib.as_cli_option(result.storage)  # None: an Optuna storage object, which the CLI cannot name
    if option is None:
        return f"autotune.load_result({result.study_name!r}, <the same {type(result.storage).__name__}>)"
    if option != DEFAULT_STORAGE:
        words += ["--storage", option]
    return shlex.join(words)


def build_report_model(result: TuneResult) -> ReportModel:
    """Everything the report shows, computed and formatted (no HTML)."""
    frame = ordered_configurations(result)
    trials = result.trials[result.trials["state"] != "waiting"]  # enqueued, never started: not a trial yet
    trials = trials.assign(outcome=[outcome_of(row) for _, row in trials.iterrows()]) if not trials.empty else trials.assign(outcome=[])
    counts = {o: int((frame["outcome"] == o).sum()) for o in OUTCOMES} if not frame.empty else {}
    counts = {o: n for o, n in counts.items() if n}
    settings = result.study_settings
    device_kind = str(settings.device.get("kind", "?"))
    best = result.best
    comparisons: list[Comparison] = []
    notice = ""
    code = ""
    if best is not None:
        best_sps = float(best["samples_per_s"])
        config = short_config(best)
        probes = int(best["n_measurements"])
        mean = f" Near-tie: the mean of {probes} probes." if probes > 1 else ""
        headline = (f"Best: trial {int(best['trial'])}, {config}, at {best_sps:,.1f} samples/s "
                    f"({float(best['tokens_per_s']):,.0f} tokens/s), peak memory {format_bytes(best['peak_mem_bytes'])}.{mean}")
        for role, label in (("baseline", result.baseline_label), ("expert", "the expert rule (16-bit, fastest attention, "
                                                                        "fused AdamW, compiled, largest batch that fits)")):
            reference = result.reference(role)
            if not reference:
                continue
            ref_sps = result.reference_samples_per_s(role)
            comparisons.append(Comparison(
                label=label, reference=f"trial {reference['trial']}: {short_config(reference)}",
                reference_samples_per_s=ref_sps, speedup=best_sps / ref_sps if ref_sps else None,
                note="" if ref_sps else f"it did not fit ({OUTCOME_LABELS.get(outcome_of(pd.Series(reference)), reference.get('status'))})",
            ))
        order = result.order_note()
        if order:
            headline += f" {order}"
        if result.objective == "tokens":
            headline += (" Ranked by real (non-padding) tokens/s: samples/s is tokens/s over the data's "
                         f"{(settings.probe or ProbeSettings()).tokens_per_sample or 0:.1f} tokens per sequence.")
        changed = [name for name in (result.best_params or {}).get("extra", {}) if name in BATCH_CONTENT_FIELDS]
        if changed:
            headline += f" {', '.join(changed)} change{'s' if len(changed) == 1 else ''} what a training step sees (its sequences and their lengths), not only its speed."
        largest, note = largest_default_batch(result)
        if largest is not None:
            ref_sps = float(largest["samples_per_s"])
            comparisons.append(Comparison(
                label="the largest batch that fits at default settings (auto_find_batch_size, Lightning's finder)",
                reference=f"trial {int(largest['trial'])}: {short_config(largest)}", reference_samples_per_s=ref_sps,
                speedup=best_sps / ref_sps if ref_sps else None, note=note,
            ))
        else:
            comparisons.append(Comparison(label="the largest batch that fits at default settings", reference="-",
                                          reference_samples_per_s=None, speedup=None, note=note))
        code = training_arguments_code(result)
    elif frame.empty:
        headline = "This study has no trials yet: run `autotune run` (or wait for the running one) and regenerate the report."
        notice = "Empty study: no trial has run yet."
    else:
        error = no_result_error(result)
        headline = ("No configuration fits: " if isinstance(error, NothingFits) else "No configuration finished a probe: ") + f"{error}."
        notice = "Only failed trials: no configuration ran under the memory ceiling."
    busy = result.busy_probes()
    if busy:
        notice = (f"{busy} of {len(result.trials)} probes ran while something else used the device (flagged "
                  f"'busy machine' in the table): their figures may be noise. {notice}").strip()
    if device_kind == "cpu":
        cpu = "Measured on the CPU: speeds are CPU speeds, shown to demonstrate the report, not GPU results."
        notice = f"{cpu} {notice}".strip()
    columns, rows = _table(frame, int(best["trial"]) if best is not None else None, _probe_lines(result, frame))
    if frame.empty:
        charts: tuple[Chart, ...] = tuple(
            Chart(key=k, title=t, x_title="", y_title="", empty_reason="no trials yet")
            for k, t in (("throughput_vs_batch", "Samples/s vs batch size, per precision"),
                         ("memory_vs_batch", "Peak memory vs batch size"), ("history", "Optimisation history"),
                         ("importance", "Parameter importance"), ("pareto", "Throughput vs peak memory"))
        )
    else:
        ceiling = result.memory_ceiling_bytes
        charts = (chart_throughput_vs_batch(frame), chart_memory_vs_batch(frame, ceiling), chart_history(frame),
                  chart_importance(frame), chart_pareto(frame, ceiling))
    command = str(settings.command or "")
    if not command and settings.model:
        command = f"autotune run --model {settings.model} --seq-len {settings.seq_len} --study {result.study_name}"
    return ReportModel(
        study_name=result.study_name,
        title=f"autotune: {result.study_name}",
        device_kind=device_kind,
        summary=_summary(result, len(trials), counts),
        counts=counts,
        headline=headline,
        comparisons=tuple(comparisons),
        best_metrics=_best_metrics(best),
        notice=notice,
        training_arguments_code=code,
        command=command,
        columns=columns,
        rows=rows,
        charts=charts,
        problems=_problems(trials) if not trials.empty else (),
        n_trials=len(trials),
        dropped=settings.dropped,
        generated_note=f"study {result.study_name!r} in {storage_lib.describe(result.storage)}",
        regenerate_command=_regenerate_command(result),
    )
