"""The one rule for what fits and what is fastest, used by the search, the strategies, results, replay and the report.

A probe is noisy and a configuration can be probed more than once (a near-tie re-measured), so
results are per **configuration**, not per probe:

* a configuration **fits** when every probe of it that ran to an outcome (``ok``, ``oom``,
  ``crash``, ``diverged``: :meth:`~autotune.records.ProbeStatus.is_measured`) finished under the
  memory ceiling (:meth:`~autotune.records.ProbeResult.fits`): one OOM and it does not fit, however
  often it fitted otherwise. Timeouts (often cut short by the budget) say nothing and are left out;
* configurations that fit are **ranked** by the mean samples/s of their probes, fastest first;
* **ties go to the prior, not to chance**: the configurations within the noise of the fastest
  (:func:`tie_band`) are ordered by the prior (:func:`prior_rank`: on a GPU 16-bit over tf32 over
  fp32, on a CPU the reverse, as the expert rule picks), so a loader that makes every precision
  measure alike returns the 16-bit one on a GPU, not whichever noise put first; then by the search's
  **estimate** where it left one for each of them (its throughput model's posterior mean given every
  probe of the run: a measurement pooled with what the other probes say about the same settings,
  which decides within the noise more often than the measurement alone), else by their mean. Exact
  ties left after that go to the first trial (the one found first ranks first).

Near-ties (:func:`near_ties`) are the configurations within the noise of the best
(:func:`noise_band`): the search measures each once more before it declares a best. A
configuration whose probes disagree by more than that band is :attr:`Configuration.unstable`
(the machine moved, not the configuration): it is measured a third time, and flagged.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from autotune.params import TrialParams
from autotune.records import Probe

NOISE_BAND_MIN_REL = 0.02  # near-tie floor: see noise_band
# What orders a tie: the precision's class only (16-bit, then tf32, then fp32: a tie across precisions
# goes to 16 bits). On the design draws (family version 2, 2026-11-27, 30 virtual minutes) ordering
# ties by the expert rule's attention kernel and optimizer too (and by compile mode, checkpointing and
# accumulation) returned configurations measured slower more often than the prior was right: twice the
# loss of the pick among what was measured (median 0.985 and 0.983; 0.988 by precision alone, with a
# later fix to the expert fallback that moved one draw).
PRECISION_CLASS = {"bf16": 0, "fp16": 0, "bf16+tf32": 0, "fp16+tf32": 0, "tf32": 1, "fp32": 2}
MAX_CONTENDERS = 3  # near-ties re-measured at the end of a search, the best included


@dataclass(frozen=True)
class Configuration:
    """A configuration that fits, with all its measurements aggregated."""

    number: int  # its first measured trial
    params: TrialParams
    mean_samples_per_s: float
    n_measurements: int  # its probes (all ok, or it would not fit)
    ci95_rel: float | None  # the largest step_time_ci95_rel of its probes
    wall_s: float | None  # its latest probe's wall time: what probing it again costs
    trials: tuple[int, ...]  # the numbers of its probes, oldest first
    spread_rel: float = 0.0  # (fastest - slowest probe) / mean samples/s; 0 with one probe

    @property
    def unstable(self) -> bool:
        """Its probes disagree by more than the noise band: the machine, not the configuration, moved."""
        return self.n_measurements > 1 and self.spread_rel > noise_band(self.ci95_rel, self.ci95_rel)


def rank_configurations(probes: Iterable[Probe], ceiling_bytes: int | None, *, gpu: bool = True,
                        estimates: Mapping[int, float] | None = None) -> list[Configuration]:
    """The configurations that fit under ``ceiling_bytes`` (every measured probe fits), fastest mean first,
    those within the noise of the fastest (:func:`tie_band`) in the prior's order (:func:`prior_rank`;
    ``gpu``: the probes ran on a GPU), then by ``estimates`` (samples/s per configuration's first trial,
    :attr:`Configuration.number`: the search's, given all its probes) where every one of them has one,
    else by their mean."""
    groups: dict[tuple[Any, ...], list[Probe]] = {}
    for probe in probes:
        if probe.result.status.is_measured():
            groups.setdefault(probe.params.key(), []).append(probe)
    configurations = []
    for group in groups.values():
        group = sorted(group, key=lambda p: p.number)
        results = [p.result for p in group]
        if not all(r.fits(ceiling_bytes) and r.samples_per_s is not None for r in results):
            continue
        cis = [r.step_time_ci95_rel for r in results if r.step_time_ci95_rel is not None]
        speeds = [r.samples_per_s or 0.0 for r in results]
        mean = statistics.fmean(speeds)
        configurations.append(Configuration(
            number=group[0].number,
            params=group[0].params,
            mean_samples_per_s=mean,
            n_measurements=len(results),
            ci95_rel=max(cis) if cis else None,
            wall_s=results[-1].wall_s,
            trials=tuple(p.number for p in group),
            spread_rel=(max(speeds) - min(speeds)) / mean if mean > 0 else 0.0,
        ))
    by_speed = sorted(configurations, key=lambda c: (-c.mean_samples_per_s, c.number))
    if not by_speed:
        return by_speed
    fastest = by_speed[0]
    tied = [c for c in by_speed if fastest.mean_samples_per_s - c.mean_samples_per_s <= tie_band(fastest, c) * fastest.mean_samples_per_s]
    if estimates is None or any(c.number not in estimates for c in tied):
        estimates = {c.number: c.mean_samples_per_s for c in tied}
    tied.sort(key=lambda c: (prior_rank(c.params, gpu=gpu), -estimates[c.number], -c.mean_samples_per_s, c.number))
    members = {id(c) for c in tied}
    return tied + [c for c in by_speed if id(c) not in members]


def prior_rank(params: TrialParams, *, gpu: bool = True) -> int:
    """How the prior orders a configuration among near-equals (lower first): the class of its precision,
    on a GPU 16-bit (0), tf32 (1), fp32 (2); on a CPU, where autocast's 16 bits are emulated on most cores
    and the expert rule keeps fp32 (:func:`autotune.search.expert.expert_params`), the reverse. An unknown
    precision after them."""
    known = PRECISION_CLASS.get(params.precision)
    if known is None:
        return len(PRECISION_CLASS)
    return known if gpu else max(PRECISION_CLASS.values()) - known


def tie_band(a: Configuration, b: Configuration) -> float:
    """The relative gap under which ``a`` and ``b`` measure alike: :func:`noise_band`, narrowed by the
    square root of the fewer measurements of the two (a mean of n probes is that much less noisy)."""
    return noise_band(a.ci95_rel, b.ci95_rel) / math.sqrt(min(a.n_measurements, b.n_measurements))


def noise_band(ci95_rel_a: float | None, ci95_rel_b: float | None) -> float:
    """The relative gap in samples/s under which two measured configurations are a near-tie.

    ``max(2 %, 2 x the larger ci95_rel of the two)``. The difference of two independent means has a
    95 % CI of ``sqrt(ci_a^2 + ci_b^2) <= 1.41 x`` the larger half-width; 2x covers that with room
    for what a probe's within-run CI cannot see (clock boost, thermals, allocator state from one
    process to the next). The 2 % floor is the run-to-run spread of a probe on a GPU
    (``bench/repeatability.py`` targets a CV <= 2 %) and the probe's own stability target
    (``ProbeSpec.target_ci_rel``); replayed and fake results carry no CI, so they get the floor.
    """
    return max(NOISE_BAND_MIN_REL, 2.0 * max(ci95_rel_a or 0.0, ci95_rel_b or 0.0))


def near_ties(ranked: list[Configuration]) -> list[Configuration]:
    """The best configuration and those within :func:`noise_band` of it, best first.

    At most :data:`MAX_CONTENDERS`; an empty list when nothing is within the band of the best.
    """
    if not ranked:
        return []
    best = max(ranked, key=lambda c: c.mean_samples_per_s)  # the fastest (a tie may rank a preferred one first)
    contenders = [ranked[0]] + [
        c for c in ranked[1:]
        if best.mean_samples_per_s - c.mean_samples_per_s <= noise_band(best.ci95_rel, c.ci95_rel) * best.mean_samples_per_s
    ]
    return contenders[:MAX_CONTENDERS] if len(contenders) > 1 else []
