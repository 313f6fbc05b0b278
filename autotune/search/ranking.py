"""The one rule for what fits and what is fastest, used by the search, the strategies, results, replay and the report.

A probe is noisy and a configuration can be probed more than once (a near-tie re-measured), so
results are per **configuration**, not per probe:

* a configuration **fits** when every probe of it that ran to an outcome (``ok``, ``oom``,
  ``crash``, ``diverged``: :meth:`~autotune.records.ProbeStatus.is_measured`) finished under the
  memory ceiling (:meth:`~autotune.records.ProbeResult.fits`): one OOM and it does not fit, however
  often it fitted otherwise. Timeouts (often cut short by the budget) say nothing and are left out;
* configurations that fit are **ranked** by the mean samples/s of their probes, fastest first, ties
  broken by their first trial (the one found first ranks first).

Near-ties (:func:`near_ties`) are the configurations within the noise of the best
(:func:`noise_band`): the search measures each once more before it declares a best. A
configuration whose probes disagree by more than that band is :attr:`Configuration.unstable`
(the machine moved, not the configuration): it is measured a third time, and flagged.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from autotune.params import TrialParams
from autotune.records import Probe

NOISE_BAND_MIN_REL = 0.02  # near-tie floor: see noise_band
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


def rank_configurations(probes: Iterable[Probe], ceiling_bytes: int | None) -> list[Configuration]:
    """The configurations that fit under ``ceiling_bytes`` (every measured probe fits), fastest mean first."""
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
    return sorted(configurations, key=lambda c: (-c.mean_samples_per_s, c.number))


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
    best = ranked[0]
    contenders = [best] + [
        c for c in ranked[1:]
        if best.mean_samples_per_s - c.mean_samples_per_s <= noise_band(best.ci95_rel, c.ci95_rel) * best.mean_samples_per_s
    ]
    return contenders[:MAX_CONTENDERS] if len(contenders) > 1 else []
