"""Terminal display: a live progress line while the search runs, then the ranked table.

Calculation lives in :mod:`autotune.results`; this module only renders.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn
from rich.table import Table
from rich.text import Text

from autotune.params import TrialParams
from autotune.records import ProbeStatus
from autotune.results import TuneResult, baseline_label, row_params
from autotune.search.loop import TrialRecord
from autotune.storage import describe as describe_storage
from autotune.units import format_bytes, format_duration


class PipeConsole(Console):
    """A console whose reader may go away (``autotune run ... | head``): the first write to a closed pipe goes
    quiet and raises :class:`~autotune.errors.ReaderGone`, which stops the run as Ctrl-C does, where rich's own
    console would exit 1 at once, with nothing written."""

    reader_gone = False

    def on_broken_pipe(self) -> None:
        import os
        import sys

        from autotune.errors import ReaderGone

        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # as rich does: no second error at exit
        if not self.reader_gone:
            self.reader_gone = True
            raise ReaderGone()


class _TimeLeftColumn(ProgressColumn):
    def render(self, task: Any) -> Text:
        deadline = task.fields.get("deadline")
        if deadline is None:
            return Text("")
        return Text(f"{format_duration(max(0.0, deadline - time.monotonic()))} left", style="cyan")


class LiveProgress:
    """Progress display: trials done, best so far, time left; one log line per finished trial."""

    def __init__(self, console: Console, *, budget_s: float | None, n_trials: int | None, ceiling_bytes: int) -> None:
        self.console = console
        self.ceiling_bytes = ceiling_bytes
        self.best_samples_per_s: float | None = None
        self.baseline_samples_per_s: float | None = None
        self.done = 0
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            _TimeLeftColumn(),
            console=console,
            transient=True,
        )
        total = budget_s if budget_s else float(n_trials or 1)
        self.budget_s = budget_s
        self.start_s = time.monotonic()
        self.task = self.progress.add_task(
            "starting", total=total, status="",
            deadline=(self.start_s + budget_s) if budget_s else None,
        )

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def _status(self) -> str:
        if self.best_samples_per_s is None:
            return "no fitting configuration yet"
        text = f"best {self.best_samples_per_s:,.1f} samples/s"
        if self.baseline_samples_per_s:
            text += f" ({self.best_samples_per_s / self.baseline_samples_per_s:.2f}x baseline)"
        return text

    def on_start(self, number: int, params: TrialParams) -> None:
        if not self.console.is_terminal:  # a log (nohup, CI, a pipe) has no live line: say what runs, with the time left
            left = f", {format_duration(max(0.0, self.start_s + self.budget_s - time.monotonic()))} left" if self.budget_s else ""
            self.console.print(f"trial {number:>3} starts   {params.short()}{left}", style="dim", highlight=False)
        completed = time.monotonic() - self.start_s if self.budget_s else self.done
        self.progress.update(
            self.task, description=f"trial {number}: {params.short()}", completed=completed, status=self._status()
        )

    def on_trial(self, record: TrialRecord) -> None:
        self.done += 1
        result = record.result
        if record.feasible and result.samples_per_s:
            if record.is_baseline:
                self.baseline_samples_per_s = result.samples_per_s
            self.best_samples_per_s = max(result.samples_per_s, self.best_samples_per_s or 0.0)
        if result.ok:
            detail = f"{result.samples_per_s:,.1f} samples/s, peak {format_bytes(result.peak_mem_bytes)}"
            if not record.feasible:
                detail += " [yellow](over the ceiling)[/]"
        else:
            detail = (result.error or "").strip().splitlines()[0][:100] if result.error else ""
        style = {ProbeStatus.OK: "green", ProbeStatus.OOM: "yellow"}.get(result.status, "red")
        tag = " (baseline)" if record.is_baseline else ""
        if record.remeasure_of is not None:
            tag = f" (near-tie: re-measure of trial {record.remeasure_of})"
        if result.interference:
            detail += f" [yellow](busy machine: {result.interference})[/]"
        self.console.print(
            f"trial {record.number:>3}{tag} [{style}]{result.status:<8}[/] {record.params.short()}  {detail}"
            f"  [dim]{format_duration(result.wall_s)}[/]",
            highlight=False,
        )
        completed = time.monotonic() - self.start_s if self.budget_s else self.done
        self.progress.update(self.task, completed=completed, status=self._status())


def print_header(console: Console, plan: Any, resumed: int) -> None:
    """What is about to be tuned, where the study lives, and what the space dropped (an ``autotune.plan.RunPlan``)."""
    console.print(
        f"[bold]autotune[/] {plan.model.name} seq-len {plan.seq_len} on {plan.device.name}"
        + (f" x{plan.nproc_per_probe} processes per probe (torchrun, DDP; samples/s summed over them)" if plan.nproc_per_probe > 1 else "")
        + ", "
        f"ceiling {format_bytes(plan.memory_ceiling_bytes)}, space '{plan.space.name}' ({plan.space.size:,} configurations)"
        + (f", resuming {resumed} finished trials" if resumed else ""),
        soft_wrap=True,
    )
    if getattr(plan, "peft", None) is not None:
        counts = plan.parameters
        trained = f": {counts.trainable:,} of {counts.total:,} parameters trainable" if counts is not None else ""
        console.print(f"  {plan.peft.describe()}{trained} (the adapters are fixed, not tuned)", soft_wrap=True)
    trainer = getattr(plan, "trainer", None)  # a user's Trainer factory (--trainer): autotune.probe.trainer_check.UserTrainer
    if trainer is not None:
        counts = plan.parameters
        dtypes = counts.describe_dtypes()
        stored = f" (stored as {dtypes})" if dtypes else ""
        length = (f"sequences up to {plan.seq_len} tokens (max_length)" if trainer.max_length == plan.seq_len
                  else f"{plan.seq_len} tokens per sequence in the first batch")
        real = f", {trainer.tokens_per_sequence:.1f} real tokens each" if trainer.tokens_per_sequence else ""
        console.print(f"  your {trainer.trainer_class.rsplit('.', 1)[-1]} from {trainer.ref.reference}: "
                      f"{counts.trainable:,} of {counts.total:,} parameters trainable{stored}, {length}{real}", soft_wrap=True)
        if trainer.args_changed:
            console.print(f"warning: {trainer.ref.function} changes TrainingArguments it is given ({', '.join(trainer.args_changed)}): "
                          "the probes measure what your Trainer runs, so those are not tuned", style="yellow", soft_wrap=True)
    if getattr(plan, "expert", None) is not None:
        console.print(f"  ranked by {plan.objective}/s; the best is measured against {baseline_label(getattr(plan, 'baseline_source', None))} "
                      f"({plan.baseline.short()}) and the expert rule ({plan.expert.short()})", soft_wrap=True)
    console.print(f"study '{plan.study_name}' in {describe_storage(plan.storage)}", style="dim")
    for warning in getattr(plan, "warnings", ()):
        console.print(f"warning: {warning}", style="yellow", soft_wrap=True)
    for dropped in plan.space.dropped:
        console.print(f"  dropped {dropped}", style="yellow")
    if plan.space.effective_batch_size:
        ebs, n = plan.space.effective_batch_size, getattr(plan, "nproc_per_probe", 1)
        if n > 1:
            console.print(f"  effective batch size fixed at {ebs * n} over {n} processes: accumulation = {ebs} / batch size")
        else:
            console.print(f"  effective batch size fixed at {ebs}: accumulation = {ebs} / batch size")


# The ranked table: every parameter in its own column where the terminal is wide enough (the knobs
# added later share an "other" column, shown when a row sets one: TrialParams.other_settings); else one
# "configuration" column (folded over lines, never cut short) and the figures, the least needed
# figures left out first (the caption names them).
_WIDE = (
    ("#", "right"), ("trial", "right"), ("batch x accum", "left"), ("precision", "left"), ("optim", "left"),
    ("compile", "left"), ("attention", "left"), ("workers", "right"), ("ckpt", "left"), ("other", "left"), ("samples/s", "right"),
    ("probes", "right"), ("tokens/s", "right"), ("peak memory", "right"), ("vs baseline", "right"),
)
_COMPACT = (("#", "right"), ("configuration", "left"), ("samples/s", "right"), ("vs baseline", "right"),
            ("peak memory", "right"), ("probes", "right"), ("tokens/s", "right"))
_COMPACT_DROP_ORDER = ("tokens/s", "probes", "peak memory")
_MIN_CONFIG_WIDTH = 24  # narrower, "bs16x1 bf16 adamw_torch_fused" folds over too many lines


def ranked_table(result: TuneResult, top: int = 10, *, width: int | None = None) -> Table | None:
    """The top configurations with samples/s (the mean of their probes: near-ties are probed twice),
    peak memory and speed-up over the baseline; None when no configuration fits.

    In ``width`` characters (None: no limit) no value is cut short: when the columns of every
    parameter do not fit, one folded configuration column replaces them, and figures that still
    do not fit are left out and named in the caption.
    """
    ranked = result.ranked().head(top)
    if ranked.empty:
        return None
    base_sps = result.baseline_samples_per_s
    figures = []
    for rank, row in ranked.iterrows():
        params = row_params(row)
        figures.append({
            "#": str(rank + 1),
            "trial": f"{int(row['trial'])}" + (" (baseline)" if row["is_baseline"] else " (expert)" if row.get("role") == "expert" else ""),
            "batch x accum": f"{params.per_device_train_batch_size} x {params.gradient_accumulation_steps}",
            "precision": params.precision,
            "optim": params.optim,
            "compile": params.torch_compile,
            "attention": params.attn_implementation,
            "workers": str(params.dataloader_num_workers),
            "ckpt": "yes" if params.gradient_checkpointing else "no",
            "other": params.other_settings(),
            "configuration": params.short() + (" (baseline)" if row["is_baseline"] else ""),
            "samples/s": f"{row['samples_per_s']:,.1f}",
            "probes": str(int(row["n_measurements"])),
            "tokens/s": f"{row['tokens_per_s']:,.0f}",
            "peak memory": format_bytes(row["peak_mem_bytes"]),
            "vs baseline": f"{row['samples_per_s'] / base_sps:.2f}x" if base_sps else "-",
        })
    columns, hidden = _layout(figures, width)
    caption = f"not shown at this width: {', '.join(hidden)} (widen the terminal, or see the report)" if hidden else None
    table = Table(title=f"Top configurations - {result.study_name}", title_justify="left", caption=caption, caption_justify="left")
    for header, justify in columns:
        table.add_column(header, justify=justify, overflow="fold", no_wrap=header != "configuration",  # type: ignore[arg-type]
                         min_width=_MIN_CONFIG_WIDTH if header == "configuration" else None)
    for values in figures:
        table.add_row(*(values[header] for header, _ in columns))
    return table


def _layout(figures: list[dict[str, str]], width: int | None) -> tuple[list[tuple[str, str]], list[str]]:
    """The columns to show and the figures left out."""

    def needed(columns: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> int:
        # rich's box: a space either side of each value and a rule between columns and at both ends
        return sum(max(len(h), *(len(f[h]) for f in figures)) + 3 for h, _ in columns) + 1

    wide = tuple(c for c in _WIDE if c[0] != "other" or any(f["other"] for f in figures))
    if width is None or needed(wide) <= width:
        return list(wide), []
    columns = list(_COMPACT)
    hidden: list[str] = []
    for header in _COMPACT_DROP_ORDER:
        config = max(len(f["configuration"]) for f in figures)
        if needed(columns) - config + min(config, _MIN_CONFIG_WIDTH) <= width:
            break
        columns = [c for c in columns if c[0] != header]
        hidden.append(header)
    return columns, hidden


def print_summary(console: Console, result: TuneResult, *, dropped: tuple[Any, ...] = ()) -> None:
    """The ranked table, outcome counts and the best configuration in a sentence."""
    counts = ", ".join(f"{n} {s}" for s, n in sorted(result.counts().items())) or "no trials"
    table = ranked_table(result, width=console.width)
    if table is not None:
        console.print(table)
    console.print(f"Trials: {counts}. Memory ceiling: {format_bytes(result.memory_ceiling_bytes)}.")
    if result.stopped_because:
        console.print(f"Stopped: {result.stopped_because}.")
    unstable = int(result.ranked()["unstable"].astype(bool).sum()) if not result.ranked().empty else 0
    if unstable:
        console.print(f"[yellow]{unstable} configuration{'s' if unstable != 1 else ''} unstable: {'their' if unstable != 1 else 'its'} "
                      "probes disagree beyond the noise band and were measured a third time (see the report's flags).[/]",
                      highlight=False)
    busy = result.busy_probes()
    if busy:
        console.print(f"[yellow]{busy} of {len(result.trials)} probes ran while something else used the device: "
                      "their figures may be noise; re-run the command when the machine is idle (finished probes are kept).[/]",
                      highlight=False)
    best = result.best
    if best is not None:
        params = TrialParams.from_dict(result.best_params or {})
        speedups = result.speedups_line()
        speed = (f"{best['tokens_per_s']:,.0f} tokens/s" if result.objective == "tokens" and best.get("tokens_per_s")
                 else f"{best['samples_per_s']:,.1f} samples/s")
        console.print(
            f"[bold green]Best:[/] {params.short()} - {speed}, "
            f"peak {format_bytes(best['peak_mem_bytes'])}{', ' + speedups if speedups else ''}.",
            highlight=False,
        )
        for warning in measurement_warnings(best):
            console.print(f"  [yellow]{warning}[/]", highlight=False)
        note = result.order_note()
        if note:
            console.print(f"  {note}", highlight=False)


def measurement_warnings(row: Any) -> list[str]:
    """What a user should know about how a trial's numbers were measured (one line each)."""
    warnings = []
    if _get(row, "numerics_flag"):
        warnings.append(
            f"its mean loss differs from the fp32 baseline's by {100 * float(row['loss_drift']):+.1f}% on the same data: "
            "it changes the maths, not only the speed"
        )
    if _get(row, "input_bound"):
        warnings.append(
            f"input-bound: waiting for batches {100 * float(row['input_wait_fraction']):.0f}% of the time "
            "(more dataloader_num_workers may help)"
        )
    if _get(row, "unstable"):
        warnings.append(f"unstable: its probes disagree by {100 * float(row['spread_rel']):.0f}% (measured "
                        f"{int(row['n_measurements'])} times; the machine, not the configuration, moved)")
    if _get(row, "interference"):
        warnings.append(f"measured on a busy machine ({row['interference']}): the figure may be noise")
    stable = _get(row, "stable")
    if stable is not None and not bool(stable) and _get(row, "step_time_ci95_rel") is not None:
        warnings.append(f"step time not stable: 95% CI +-{100 * float(row['step_time_ci95_rel']):.1f}% of the mean")
    return warnings


def _get(row: Any, name: str) -> Any:
    value = row.get(name) if hasattr(row, "get") else None
    return None if value is None or (isinstance(value, float) and value != value) else value
