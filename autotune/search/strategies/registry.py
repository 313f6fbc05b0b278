"""The strategies by name: what ``--strategy`` and ``tune(strategy=...)`` accept."""

from __future__ import annotations

import difflib

import autotune.defaults as defaults
from autotune.errors import UsageError
from autotune.search.strategies.base import Strategy
from autotune.search.strategies.baselines import RandomStrategy, TPEStrategy
from autotune.search.strategies.bayes.strategy import BayesStrategy

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (BayesStrategy, TPEStrategy, RandomStrategy)}
DEFAULT_STRATEGY = defaults.STRATEGY

def make_strategy(name: str) -> Strategy:
    """A fresh strategy by name.

    Raises:
        UsageError: for an unknown name, listing the known ones.
    """
    cls = STRATEGIES.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, STRATEGIES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"unknown strategy {name!r}: {hint}use one of {', '.join(STRATEGIES)}")
    return cls()
