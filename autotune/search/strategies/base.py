"""The strategy interface: what to run next, what not to run at all, and what the measurements are worth.

A strategy is one class with up to four methods, called by :func:`autotune.search.loop.run_search`:

* :meth:`Strategy.sampler` - the Optuna sampler the study asks when the strategy proposes nothing;
* :meth:`Strategy.propose` - a configuration to run next (enqueued into the study), or ``None``;
* :meth:`Strategy.prune` - a reason not to run a configuration (recorded as a pruned trial that
  costs no probe time), or ``None``;
* :meth:`Strategy.estimates` - once the search ended, its estimate of each measured configuration's
  samples/s given every probe (a strategy with a model of throughput; the others return none): the
  ranking orders configurations within the noise of each other by it.

The loop owns the state every strategy may read (:class:`SearchState`): the space, the memory
ceiling, the probes so far, the calibrated memory model, the time left. What fits and what is
fastest is :func:`autotune.search.ranking.rank_configurations`, the rule every other part uses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import optuna

from autotune.params import TrialParams
from autotune.records import Probe
from autotune.search.memory import MemoryModel
from autotune.search.ranking import Configuration, rank_configurations
from autotune.space import SearchSpace


class SeenKeys(Collection[tuple[Any, ...]]):
    """What a strategy must not propose (``TrialParams.key()``s): the configurations measured or
    pruned (``measured``, the loop's record, this worker's and the others') and those in flight in
    other workers (``in_flight``, read from the study before each proposal): N workers search as
    one search with N probes in flight. Iterates ``measured`` first, in its order."""

    def __init__(self, measured: Collection[tuple[Any, ...]], in_flight: Collection[tuple[Any, ...]] = frozenset()) -> None:
        self.measured = measured
        self.in_flight = in_flight

    def __contains__(self, key: object) -> bool:
        return key in self.measured or key in self.in_flight

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        yield from self.measured
        yield from (key for key in self.in_flight if key not in self.measured)

    def __len__(self) -> int:
        return len(self.measured) + sum(1 for key in self.in_flight if key not in self.measured)


@dataclass
class SearchState:
    """What the loop knows, shared with the strategy (read-only for it)."""

    space: SearchSpace
    ceiling_bytes: int
    memory: MemoryModel
    history: Sequence[Probe] = field(default_factory=list)  # the probes that ran, oldest first
    # TrialParams.key() of measured or pruned configurations, and of those in flight in other workers (SeenKeys)
    seen: Container[tuple[Any, ...]] = field(default_factory=set)
    remaining_s: float | None = None  # budget left; None without a time budget
    baseline: TrialParams | None = None
    expert: TrialParams | None = None  # the expert rule's configuration (autotune.search.expert), measured early
    # Of remaining_s, what the loop keeps for re-measuring the near-ties so far (each measured once):
    # a strategy that knows which of its probes pay more than that (bayes's polish) spends it on those only.
    kept_s: float = 0.0
    gpu: bool = True  # the probes run on a GPU (the ranking's prior among near-ties)
    loader_cores: int | None = None  # CPU cores one probe process's loader workers have; None: unknown

    def feasible(self, history: Sequence[Probe] | None = None, estimates: Mapping[int, float] | None = None) -> list[Configuration]:
        """The configurations that fit, fastest mean first: the one ranking rule, over ``history`` (default: the probes
        that ran), near-equals ordered by ``estimates`` (samples/s by :attr:`Configuration.number`) where given."""
        return rank_configurations(self.history if history is None else history, self.ceiling_bytes, gpu=self.gpu, estimates=estimates)


class Strategy(ABC):
    """How the search picks configurations. Subclasses set ``name`` and implement :meth:`sampler`."""

    name: ClassVar[str]

    @abstractmethod
    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        """The Optuna sampler used whenever :meth:`propose` returns ``None``."""

    def propose(self, state: SearchState) -> TrialParams | None:
        """A configuration of ``state.space`` to run next, not in ``state.seen``; ``None`` lets the sampler choose."""
        return None

    def prune(self, params: TrialParams, state: SearchState) -> str | None:
        """Why ``params`` should not be run (e.g. predicted over the memory ceiling), or ``None`` to run it."""
        return None

    def estimates(self, state: SearchState) -> dict[tuple[Any, ...], float]:
        """Samples/s per ``TrialParams.key()`` of the configurations in ``state.feasible()``, as the strategy's
        model estimates them from every probe in ``state.history``; empty without such a model."""
        return {}
