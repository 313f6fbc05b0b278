"""Small studies for the report tests, written by the real driver with a fake GPU (no probes run)."""

from __future__ import annotations

import optuna

from autotune.params import TrialParams, baseline_params
from autotune.plan import package_versions
from autotune.records import DeviceInfo, ProbeResult
from autotune.results import TuneResult, load_result
from autotune.search.loop import SearchSettings, run_search
from autotune.search.strategies.baselines import tpe_sampler as make_sampler
from autotune.space import parse_space
from autotune.studies.schema import ATTR_ROLE, ROLE_BASELINE, STUDY_ATTR
from tests.conftest import FakeEvaluator, GiB

CEILING = 12 * GiB
DEVICE = DeviceInfo(kind="cuda", name="Fake H100", total_memory_bytes=80 * GiB, compute_capability=(9, 0),
                    driver_version="570.00", cuda_version="12.8")
SPACE = {
    "per_device_train_batch_size": [4, 8, 16, 32, 64],
    "precision": ["fp32", "bf16"],
    "gradient_checkpointing": [False, True],
    "optim": ["adamw_torch_fused", "adafactor"],
}


def settings(space_dict: dict, device: DeviceInfo = DEVICE) -> dict:
    space = parse_space(space_dict).restrict(device)
    return {
        "model": "tiny-gptneox", "model_source": "builtin", "num_parameters": 1_450_000, "seq_len": 128,
        "device": device.to_dict(), "memory_ceiling_bytes": CEILING,
        "space": {**space.to_dict(), "dropped": ["precision=fp8: this device cannot run it (test)"]},
        "effective_batch_size": None, "baseline": baseline_params().to_dict(),
        "command": "autotune run --model tiny-gptneox --seq-len 128 --study report-test", "versions": package_versions(),
    }


class ReportFake(FakeEvaluator):
    """The fake GPU, with a crash that leaves a stderr tail like a real one; the first ``busy_first``
    probes see another process on the GPU."""

    busy_first: int = 0

    def evaluate(self, params: TrialParams, *, timeout_s: float) -> ProbeResult:
        result = super().evaluate(params, timeout_s=timeout_s)
        if len(self.calls) <= self.busy_first:
            result = result.replace(interference="1 other process on the GPU")
        if result.status == "crash":
            return result.replace(error="Traceback (most recent call last):\n  File \"probe.py\", line 1\nRuntimeError: boom <b>")
        return result


# One of each outcome, whatever the sampler proposes: (batch, precision, checkpointing) run first.
FORCED = ((4, "fp32", False), (16, "bf16", False), (4, "bf16", False), (32, "fp32", False), (64, "bf16", False))


def make_study(storage: str, name: str = "report-test", *, n_trials: int = 12,
               fail_on: dict | None = None, oom_above_bytes: int = 20 * GiB, busy_first: int = 0) -> TuneResult:
    """A study with every probe outcome: ok, over the ceiling (bs 32 fp32), OOM (bs 64), crash, timeout, diverged."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", sampler=make_sampler(0))
    study.set_user_attr(STUDY_ATTR, settings(SPACE))
    fake = ReportFake(oom_above_bytes=oom_above_bytes, fail_on=fail_on if fail_on is not None else {
        (4, "fp32"): "crash", (16, "bf16"): "timeout", (4, "bf16"): "diverged",
    })
    fake.busy_first = busy_first
    space = parse_space(SPACE).restrict(DEVICE)
    study.enqueue_trial(space.optuna_params(baseline_params()), user_attrs={ATTR_ROLE: ROLE_BASELINE})
    for batch, precision, checkpointing in FORCED:
        params = TrialParams(per_device_train_batch_size=batch, precision=precision, gradient_checkpointing=checkpointing)
        study.enqueue_trial(space.optuna_params(params))
    run_search(study, space, fake, SearchSettings(memory_ceiling_bytes=CEILING, n_trials=n_trials),
               baseline=baseline_params(), clock=fake.clock)
    return load_result(name, storage)


def empty_study(storage: str, name: str = "empty") -> TuneResult:
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    study.set_user_attr(STUDY_ATTR, settings(SPACE))
    return load_result(name, storage)
