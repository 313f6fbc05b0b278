"""The one definition of what a run records in its study: its settings (:class:`StudySettings`, with how it probes,
:class:`ProbeSettings`), written by the plan (:meth:`autotune.plan.RunPlan.study_attrs`) and read back by workers
joining the study, results, the report and the CLI; and the run log kept beside them (:class:`RunLog`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import autotune.defaults as defaults
from autotune.lora import LoraSettings
from autotune.units import parse_duration_s


@dataclass(frozen=True)
class ProbeSettings:
    """How each probe of a run runs; stored as the study's ``"probe"`` attribute (its keys are a schema: add, never rename)."""

    warmup_steps: int = defaults.WARMUP_STEPS
    measure_steps: int = defaults.MEASURE_STEPS
    trial_timeout_s: float = parse_duration_s(defaults.TRIAL_TIMEOUT)
    seed: int = defaults.SEED
    isolation: str = defaults.ISOLATION
    trainer_sys_path: str | None = None  # where the run imported its --trainer factory from
    trainer_attn_flag: bool = False  # the factory's parser takes --attn_implementation
    tokens_per_sample: float | None = None  # the data's mean real tokens per sequence (--objective tokens)
    max_measure_s: float = parse_duration_s(defaults.MAX_MEASURE_TIME)  # the most time a probe spends timing steps

    def to_dict(self) -> dict[str, Any]:
        """The JSON the study stores."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ProbeSettings:
        """Read a stored ``"probe"`` attribute: a key missing (an older study) or null takes its default; unknown keys are ignored."""
        given = {key: value for key, value in (data or {}).items() if value is not None}
        default = cls()

        def get(name: str) -> Any:
            return given.get(name, getattr(default, name))

        tokens = get("tokens_per_sample")
        sys_path = get("trainer_sys_path")
        return cls(
            warmup_steps=int(get("warmup_steps")), measure_steps=int(get("measure_steps")), max_measure_s=float(get("max_measure_s")),
            trial_timeout_s=parse_duration_s(get("trial_timeout_s")), seed=int(get("seed")), isolation=str(get("isolation")),
            trainer_sys_path=None if sys_path is None else str(sys_path), trainer_attn_flag=bool(get("trainer_attn_flag")),
            tokens_per_sample=None if tokens is None else float(tokens),
        )


TRAINING_ARGUMENTS = defaults.CONFIG_CLASS  # the config class of a run without --trainer


@dataclass(frozen=True)
class StudySettings:
    """A run's settings as its study stores them (the :data:`~autotune.studies.schema.STUDY_ATTR` user attribute):
    written once by :meth:`autotune.plan.RunPlan.study_attrs`, read back by workers, results, the report and the CLI.

    The stored keys are a schema: add, never rename. A key an older study lacks reads as its default here, the value
    readers assumed before the key existed (an identity key's is :data:`autotune.studies.opening.IDENTITY_DEFAULTS`'
    value, or None). Nested parts stay the plain dicts stored (their classes' ``from_dict`` read them where a reader
    needs more than a key or two). The run log (``runs``, ``budget_s``) shares the stored dict: see :class:`RunLog`.
    """

    autotune_version: str | None = None
    model: str | None = None  # the model's name (a --trainer run: what its factory built)
    model_source: str | None = None  # how it was found: "builtin", "hub", "local", "trainer"
    model_config_sha1: str | None = None  # autotune.studies.opening.config_hash of its config
    num_parameters: int | None = None
    seq_len: int | None = None
    device: dict[str, Any] = field(default_factory=dict)  # DeviceInfo.to_dict(); {}: not recorded
    memory_ceiling_bytes: int | None = None  # the latest run's (a resumed run may change it)
    space: dict[str, Any] | None = None  # SearchSpace.to_dict(), with what planning "dropped" from it
    effective_batch_size: int | None = None  # samples per optimizer step over every process of a probe; None: free
    baseline: dict[str, Any] | None = None  # TrialParams.to_dict() of the baseline
    dataset: dict[str, Any] | None = None  # DatasetSpec.to_dict(); None: synthetic tokens
    strategy: str = defaults.STRATEGY
    peft: dict[str, Any] | None = None  # LoraSettings.to_dict() (see :attr:`lora`); None: every weight trained
    parameters: dict[str, Any] | None = None  # ParameterCounts.to_dict() of the model as trained
    trainer: dict[str, Any] | str | None = None  # RunPlan.trainer_identity() (older studies: the reference alone)
    expert: dict[str, Any] | None = None  # TrialParams.to_dict() of the expert rule's configuration
    objective: str = "samples"  # what configurations are ranked by: "samples" or "tokens"
    nproc_per_probe: int = 1  # processes per probe (before the key existed, one)
    host_memory_ceiling_bytes: int | None = None  # a GPU run's host memory for a probe's processes; None on a CPU
    baseline_source: str = "defaults"  # "user" (a factory's own settings), "file" (--baseline), "defaults"
    config_class: str = TRAINING_ARGUMENTS  # the class the configuration is for, module.Class
    user_config: dict[str, Any] | None = None  # a factory's own config fields, the tuned ones go on top
    probe: ProbeSettings | None = None  # how each probe runs; None: a study made before workers could join it
    command: str | None = None  # the command line that made the study
    versions: dict[str, str] = field(default_factory=dict)  # python and the packages that matter, by name

    def to_dict(self) -> dict[str, Any]:
        """The JSON the study stores, its keys in the order the plan has always written them."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**data, "probe": self.probe.to_dict() if self.probe is not None else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StudySettings:
        """Read a stored settings dict: a key missing (an older study) or null takes its default, and so does an empty
        value of a key whose readers always read it so (``strategy``, ``objective``, ``nproc_per_probe``, ...);
        unknown keys (the run log, a newer autotune's) are ignored. Nested dicts are the stored ones, not copies."""
        given = {key: value for key, value in (data or {}).items() if value is not None}
        default = cls()
        values = {f.name: given.get(f.name, getattr(default, f.name)) for f in dataclasses.fields(cls)}

        def or_default(name: str) -> Any:
            return given.get(name) or getattr(default, name)

        return cls(**{
            **values,
            "device": dict(or_default("device")), "strategy": str(or_default("strategy")), "objective": str(or_default("objective")),
            "nproc_per_probe": int(or_default("nproc_per_probe")), "baseline_source": str(or_default("baseline_source")),
            "config_class": str(or_default("config_class")), "versions": dict(or_default("versions")),
            "probe": ProbeSettings.from_dict(given["probe"]) if given.get("probe") else None,
        })

    @property
    def lora(self) -> LoraSettings | None:
        """The adapters the probes trained (None: every weight)."""
        return LoraSettings.from_dict(self.peft) if self.peft else None

    @property
    def trainer_identity(self) -> dict[str, Any] | None:
        """The ``--trainer`` factory's identity as a dict (an older study stored its reference alone); None: no factory."""
        if not self.trainer:
            return None
        return self.trainer if isinstance(self.trainer, dict) else {"reference": self.trainer}

    @property
    def dropped(self) -> tuple[str, ...]:
        """What planning dropped from the space, one line each, with why."""
        return tuple(str(d) for d in (self.space or {}).get("dropped") or ())


@dataclass(frozen=True)
class RunLog:
    """The study's run log, stored in the same dict as :class:`StudySettings` but not part of it: every ``autotune run``
    or worker that opens the study appends an entry (``started_at``, ``budget_s``, ``n_trials``, ``stopped_because``)
    and updates ``budget_s``, their budgets summed (:mod:`autotune.studies.opening`), while the settings are written
    once, by the plan."""

    runs: tuple[dict[str, Any], ...] = ()
    budget_s: float | None = None  # every run's budget summed; None: no run had one

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RunLog:
        """Read the log from a stored settings dict (a study made before the log: empty)."""
        data = data or {}
        return cls(runs=tuple(dict(run) for run in data.get("runs") or ()), budget_s=data.get("budget_s"))

    @property
    def budgets_s(self) -> list[float]:
        """The budget of each run that had one."""
        return [run["budget_s"] for run in self.runs if run.get("budget_s")]

    @property
    def stopped_because(self) -> str | None:
        """Why the latest run stopped (None: it has not said, or no run is logged)."""
        return self.runs[-1].get("stopped_because") if self.runs else None
