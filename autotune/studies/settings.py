"""The one definition of what a run records in its study about how it probes: written by the plan
(:meth:`autotune.plan.RunPlan.study_attrs`) and read by workers joining the study (:mod:`autotune.workers`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import autotune.defaults as defaults
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
            warmup_steps=int(get("warmup_steps")), measure_steps=int(get("measure_steps")),
            trial_timeout_s=parse_duration_s(get("trial_timeout_s")), seed=int(get("seed")), isolation=str(get("isolation")),
            trainer_sys_path=None if sys_path is None else str(sys_path), trainer_attn_flag=bool(get("trainer_attn_flag")),
            tokens_per_sample=None if tokens is None else float(tokens),
        )
