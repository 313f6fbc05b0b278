"""Replay tables: measure the search without a GPU.

A replay table is a CSV (optionally gzipped) with one row per configuration: one column per
search-space parameter (the names in :data:`autotune.params.PARAM_NAMES`), ``status`` (ok, oom,
timeout, crash, diverged), ``samples_per_s``, ``peak_mem_bytes`` and ``probe_s`` (the wall seconds
the probe took, compilation included). Other columns are kept but not read. A table without the
column of a knob added later (:data:`autotune.params.KNOBS_ADDED_LATER`: ``use_liger_kernel``,
``torch_empty_cache_steps``, ``dataloader_pin_memory``, ``dataloader_persistent_workers``,
``dataloader_prefetch_factor``) was measured at that knob's default, and reads so. In the columns
of ``torch_empty_cache_steps`` and ``dataloader_prefetch_factor`` an empty cell (or ``none``,
``null``) is None, transformers' default.

:class:`ReplayEvaluator` implements the loop's :class:`~autotune.search.loop.Evaluator`: a replayed
trial returns its row and charges ``probe_s`` to a :class:`~autotune.search.loop.VirtualClock`, which
the loop's budget reads. A configuration missing from the table is an error, as is any
malformed table (one line naming the column or the row). A re-measured near-tie returns its row
again (a table is deterministic) and is charged its ``probe_s`` again, like any probe run.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from autotune.errors import ReplayTableError
from autotune.params import (
    BOOL_PARAMS,
    KNOBS_ADDED_LATER,
    OPTIONAL_INT_PARAMS,
    PARAM_DEFAULTS,
    PARAM_NAMES,
    WORKER_ONLY_PARAMS,
    TrialParams,
)
from autotune.records import INPUT_BOUND_FRACTION, ProbeResult, ProbeStatus
from autotune.search.loop import SearchSettings, VirtualClock, ranked_configurations, run_search
from autotune.search.strategies.registry import DEFAULT_STRATEGY, make_strategy
from autotune.space import SearchSpace

MEASUREMENT_COLUMNS = ("status", "samples_per_s", "peak_mem_bytes", "probe_s")
# What a live probe also reports, replayed where a table records it (a search reads them: the loader's wait
# says when workers matter, the confidence interval how far to trust a figure, the start-up and the warm-up
# (compilation included) what the next probe will cost). Absent: unknown, as before.
OPTIONAL_MEASUREMENT_COLUMNS = ("input_wait_fraction", "step_time_ci95_rel", "setup_s", "warmup_s")
REQUIRED_COLUMNS = (*(n for n in PARAM_NAMES if n not in KNOBS_ADDED_LATER), *MEASUREMENT_COLUMNS)
_INT_PARAMS = ("per_device_train_batch_size", "gradient_accumulation_steps", "dataloader_num_workers")
_STR_PARAMS = ("precision", "optim", "torch_compile", "attn_implementation")
_NONE_TEXT = ("", "none", "null")


@dataclass
class ReplayTable:
    """A validated replay table, indexed by configuration."""

    name: str
    frame: pd.DataFrame
    _index: dict[tuple[Any, ...], int] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.frame)

    def row(self, params: TrialParams) -> pd.Series | None:
        position = self._index.get(params.key())
        return None if position is None else self.frame.iloc[position]

    def space(self) -> SearchSpace:
        """The table's own space: its parameter columns and their distinct values."""
        choices: dict[str, tuple[Any, ...]] = {}
        for name in PARAM_NAMES:
            values = list(dict.fromkeys(self.frame[name].tolist()))
            if name in _INT_PARAMS or name in OPTIONAL_INT_PARAMS:
                values.sort(key=lambda v: (v is not None, v or 0))  # None (the default) first
            choices[name] = tuple(values)
        return SearchSpace(name=self.name, choices=choices)

    def check_space(self, space: SearchSpace) -> None:
        """Raise unless every configuration of ``space`` has a row.

        Raises:
            ReplayTableError: naming the first parameter value, or configuration, without a row.
        """
        if space.effective_batch_size:
            raise ReplayTableError("replay does not support a fixed effective batch size: leave it out of the space")
        table_values = {name: set(self.frame[name].tolist()) for name in PARAM_NAMES}
        for name, values in space.choices.items():
            for value in values:
                if value not in table_values[name]:
                    raise ReplayTableError(
                        f"the space does not match the replay table {self.name}: column {name} has no row with {value!r} "
                        f"(the table has {sorted(map(str, table_values[name]))})"
                    )
        mask = pd.Series(True, index=self.frame.index)
        for name, values in space.choices.items():
            mask &= self.frame[name].isin(list(values))
        if int(mask.sum()) < space.size:
            for combo in itertools.product(*(space.choices[n] for n in PARAM_NAMES)):
                if (*combo, ()) not in self._index:
                    missing = ", ".join(f"{n}={v}" for n, v in zip(PARAM_NAMES, combo))
                    raise ReplayTableError(f"the space does not match the replay table {self.name}: no row for {missing}")

    def best_under(self, ceiling_bytes: int, space: SearchSpace | None = None) -> pd.Series | None:
        """The fastest ok row at or under the ceiling (within ``space`` if given): the true optimum."""
        frame = self.frame
        mask = (frame["status"] == ProbeStatus.OK.value) & (frame["peak_mem_bytes"] <= ceiling_bytes)
        if space is not None:
            for name, values in space.choices.items():
                mask &= frame[name].isin(list(values))
        feasible = frame[mask]
        return None if feasible.empty else feasible.loc[feasible["samples_per_s"].idxmax()]


def load_table(path: str | Path) -> ReplayTable:
    """Read and validate a replay table (``.csv`` or ``.csv.gz``); 70,000 rows load in about a second.

    Raises:
        ReplayTableError: a missing file or column, an unknown status, a bad value, a duplicate configuration.
    """
    path = Path(path)
    if not path.is_file():
        raise ReplayTableError(f"replay table {path} not found: pass a CSV file (see bench/landscape.py to make one)")
    name = path.name.removesuffix(".gz").removesuffix(".csv")
    try:
        frame = pd.read_csv(path, dtype={n: str for n in _STR_PARAMS + OPTIONAL_INT_PARAMS + ("status",)}, keep_default_na=False,
                            na_values=[""])
    except pd.errors.EmptyDataError:
        raise ReplayTableError(f"replay table {path} is empty: write a CSV with a header row ({', '.join(REQUIRED_COLUMNS)}) "
                               "and one row per configuration (bench/landscape.py makes one)") from None
    except (pd.errors.ParserError, UnicodeDecodeError, EOFError, OSError, zlib.error) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReplayTableError(f"cannot read replay table {path} ({reason}): write a CSV with a header row") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise ReplayTableError(f"replay table {path}: missing column {missing[0]!r} (a table needs {', '.join(REQUIRED_COLUMNS)})")
    if frame.empty:
        raise ReplayTableError(f"replay table {path} has a header but no rows: add one row per configuration (bench/landscape.py makes a table)")
    defaults = PARAM_DEFAULTS
    for knob in KNOBS_ADDED_LATER:  # a table from before the knob: measured at its default
        if knob not in frame.columns:
            frame[knob] = pd.Series([defaults[knob]] * len(frame), index=frame.index, dtype=object)
    _check_rows(frame, path)
    for column in BOOL_PARAMS:
        frame[column] = frame[column].map(_to_bool)
    for column in _INT_PARAMS:
        frame[column] = frame[column].astype(int)
    for column in OPTIONAL_INT_PARAMS:
        frame[column] = pd.Series([_optional_int(v) for v in frame[column].tolist()], index=frame.index, dtype=object)
    # Rows whose worker-only settings mean nothing (no workers) read as TrialParams holds them: at the default.
    odd = pd.Series(False, index=frame.index)
    for knob in WORKER_ONLY_PARAMS:
        odd |= frame[knob].map(lambda v, default=defaults[knob]: v != default).astype(bool)
    for position in (odd & (frame["dataloader_num_workers"] == 0)).to_numpy().nonzero()[0]:
        params = TrialParams.from_dict({n: frame[n].iloc[position] for n in PARAM_NAMES})
        for knob in WORKER_ONLY_PARAMS:
            frame.iat[position, frame.columns.get_loc(knob)] = getattr(params, knob)
    index: dict[tuple[Any, ...], int] = {}
    columns = [frame[n].tolist() for n in PARAM_NAMES]
    for position, key in enumerate(zip(*columns)):
        first = index.setdefault((*key, ()), position)  # TrialParams.key(): a replay table has no user-config fields
        if first != position:
            raise ReplayTableError(
                f"replay table {path}: rows {first + 2} and {position + 2} are the same configuration "
                f"({', '.join(f'{n}={v}' for n, v in zip(PARAM_NAMES, key))}): keep one"
            )
    return ReplayTable(name=name, frame=frame, _index=index)


def _to_bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or str(value).strip().lower() in _NONE_TEXT


def _optional_float(value: Any) -> float | None:
    return None if _is_none(value) else float(value)


def _optional_int(value: Any) -> int | None:
    return None if _is_none(value) else int(float(value))


def _check_rows(frame: pd.DataFrame, path: Path) -> None:
    """Every problem names its column and its line in the file (the header is line 1)."""

    def fail(position: int, column: str, message: str) -> None:
        raise ReplayTableError(f"replay table {path}, line {position + 2}, column {column}: {message}")

    statuses = ProbeStatus.values(ran=True)
    bad = ~frame["status"].isin(statuses)
    if bad.any():
        i = int(bad.to_numpy().nonzero()[0][0])
        fail(i, "status", f"unknown status {frame['status'].iloc[i]!r} (use one of {', '.join(statuses)})")
    for column in (*(n for n in PARAM_NAMES if n not in OPTIONAL_INT_PARAMS), "probe_s"):
        empty = frame[column].isna()
        if empty.any():
            fail(int(empty.to_numpy().nonzero()[0][0]), column, "empty value")
    for column in OPTIONAL_INT_PARAMS:
        for i, value in enumerate(frame[column].tolist()):
            if _is_none(value):
                continue
            number = pd.to_numeric(value, errors="coerce")
            if pd.isna(number) or number != round(number) or number < 1:
                fail(i, column, f"{value!r} is not empty (none) or a positive integer")
    for column in _INT_PARAMS:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = values.isna() | (values != values.round()) | (values < (0 if column == "dataloader_num_workers" else 1))
        if bad.any():
            i = int(bad.to_numpy().nonzero()[0][0])
            fail(i, column, f"{frame[column].iloc[i]!r} is not a valid integer")
    for column in BOOL_PARAMS:
        text = frame[column].astype(str).str.strip().str.lower()
        bad = ~text.isin(["true", "false", "1", "0"])
        if bad.any():
            i = int(bad.to_numpy().nonzero()[0][0])
            fail(i, column, f"{frame[column].iloc[i]!r} is not true or false")
    for column in ("samples_per_s", "peak_mem_bytes", "probe_s"):
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = frame[column].notna() & (values.isna() | (values < 0))
        if bad.any():
            i = int(bad.to_numpy().nonzero()[0][0])
            fail(i, column, f"{frame[column].iloc[i]!r} is not a non-negative number")
        frame[column] = values
    for column in OPTIONAL_MEASUREMENT_COLUMNS:
        if column not in frame.columns:
            continue
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = frame[column].notna() & (values.isna() | (values < 0) | ((values > 1) if column == "input_wait_fraction" else False))
        if bad.any():
            i = int(bad.to_numpy().nonzero()[0][0])
            limits = "a fraction in [0, 1]" if column == "input_wait_fraction" else "a non-negative number"
            raw = frame[column].iloc[i]
            fail(i, column, f"{raw.item() if hasattr(raw, 'item') else raw!r} is not empty or {limits}")
        frame[column] = values
    ok = frame["status"] == ProbeStatus.OK.value
    for column in ("samples_per_s", "peak_mem_bytes"):
        bad = ok & frame[column].isna()
        if bad.any():
            fail(int(bad.to_numpy().nonzero()[0][0]), column, "an ok row needs a value")


@dataclass
class ReplayEvaluator:
    """Replays a table: each trial returns its row and charges ``probe_s`` to ``clock``."""

    table: ReplayTable
    clock: VirtualClock = field(default_factory=VirtualClock)
    probes: int = 0
    oom_probes: int = 0

    def probe_cost_s(self, params: TrialParams, row: pd.Series) -> float:
        """What probing ``params`` costs on the clock: its row's ``probe_s``."""
        return float(row["probe_s"])

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        """Return the row of ``params`` as a ProbeResult, charging :meth:`probe_cost_s` to the clock.

        Raises:
            ReplayTableError: if the table has no row for ``params``.
        """
        row = self.table.row(params)
        if row is None:
            raise ReplayTableError(f"replay table {self.table.name} has no row for {params.short()}: the space and the table disagree")
        probe_s = self.probe_cost_s(params, row)
        self.probes += 1
        if probe_s > timeout_s:
            self.clock.advance(timeout_s)
            return ProbeResult(status=ProbeStatus.TIMEOUT, error=f"replayed probe takes {probe_s:.0f} s > {timeout_s:.0f} s left", wall_s=timeout_s)
        self.clock.advance(probe_s)
        status = ProbeStatus(row["status"])
        if status is ProbeStatus.OOM:
            self.oom_probes += 1
        wait, ci, setup_s, warmup_s = (_optional_float(row.get(c)) for c in OPTIONAL_MEASUREMENT_COLUMNS)
        if not status.is_ok():
            return ProbeResult(status=status, error=f"replayed {status}", wall_s=probe_s, setup_s=setup_s)
        if warmup_s is not None:  # charged less than its row (a compiled graph from the cache): it warmed up that much sooner
            warmup_s = max(warmup_s - (float(row["probe_s"]) - probe_s), 0.0)
        samples_per_s = float(row["samples_per_s"])
        peak = row["peak_mem_bytes"]
        return ProbeResult(
            status=ProbeStatus.OK,
            samples_per_s=samples_per_s,
            step_time_s=params.effective_batch_size / samples_per_s if samples_per_s else None,
            peak_mem_bytes=None if _is_none(peak) else int(peak),
            wall_s=probe_s,
            measured_steps=1,
            input_wait_fraction=wait,
            input_bound=bool(wait is not None and wait > INPUT_BOUND_FRACTION),
            step_time_ci95_rel=ci,
            setup_s=setup_s,
            warmup_s=warmup_s,
        )


@dataclass(frozen=True)
class ReplayOutcome:
    """What one replayed search found (the fields of ``autotune replay --json``)."""

    table: str
    strategy: str
    seed: int
    best_params: dict[str, Any] | None
    best_samples_per_s: float | None
    best_peak_mem_bytes: int | None
    virtual_s: float
    trials_run: int  # probes run, re-measures included
    remeasures: int  # near-ties probed a second time
    oom_probes: int
    pruned: int
    stopped_because: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def replay_search(
    table: ReplayTable,
    *,
    budget_s: float,
    memory_ceiling_bytes: int,
    space: SearchSpace | None = None,
    strategy: str = DEFAULT_STRATEGY,
    seed: int = 0,
    baseline: TrialParams | None = None,
    expert: TrialParams | None = None,
) -> ReplayOutcome:
    """Run one search on a replay table, on a virtual clock, in an in-memory study.

    Args:
        table: the validated table.
        budget_s: virtual seconds the search may charge.
        memory_ceiling_bytes: configurations above it do not count as found.
        space: the space to search (checked against the table); default: the table's own.
        strategy: a name from :data:`autotune.search.strategies.registry.STRATEGIES`.
        seed: sampler seed.
        baseline: the first trial; default transformers' defaults where the space has them, else none.
        expert: the expert rule's configuration (:func:`autotune.search.expert.expert_params`), run
            right after the baseline; default none.

    Raises:
        ReplayTableError: if the space does not match the table.
        UsageError: for an unknown strategy.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    search_space = space if space is not None else table.space()
    table.check_space(search_space)
    chosen = make_strategy(strategy)
    if baseline is None:
        default = search_space.baseline()
        baseline = default if search_space.contains(default) else None
    evaluator = ReplayEvaluator(table)
    study = optuna.create_study(direction="maximize", sampler=chosen.sampler(seed))
    settings = SearchSettings(memory_ceiling_bytes=memory_ceiling_bytes, budget_s=budget_s, seed=seed, min_probe_s=1.0)
    outcome = run_search(study, search_space, evaluator, settings, baseline=baseline, expert=expert, clock=evaluator.clock,
                         strategy=chosen)
    configurations = ranked_configurations(study, memory_ceiling_bytes)
    best = configurations[0] if configurations else None
    peak = max((r.result.peak_mem_bytes or 0 for r in outcome.records if best and r.params == best.params), default=None)
    return ReplayOutcome(
        table=table.name,
        strategy=chosen.name,
        seed=seed,
        best_params=best.params.to_dict() if best else None,
        best_samples_per_s=best.mean_samples_per_s if best else None,
        best_peak_mem_bytes=peak if best else None,
        virtual_s=evaluator.clock.now(),
        trials_run=outcome.probes_run,
        remeasures=outcome.remeasures,
        oom_probes=evaluator.oom_probes,
        pruned=outcome.pruned,
        stopped_because=outcome.stopped_because,
    )
