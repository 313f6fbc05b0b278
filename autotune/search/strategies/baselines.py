"""Generic samplers kept as baselines for the benchmark: plain Optuna TPE and random search."""

from __future__ import annotations

import optuna

from autotune.search.strategies.base import Strategy


def tpe_sampler(seed: int) -> optuna.samplers.BaseSampler:
    """Multivariate TPE with the memory constraint (the ``tpe`` strategy; ``bayes`` falls back to it)."""
    # Constraints come from each trial's `set_constraint` (Optuna >= 5 reads them from the trial).
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8)


class TPEStrategy(Strategy):
    """Plain multivariate TPE, no memory model: OOMs are learned only by running them."""

    name = "tpe"

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return tpe_sampler(seed)


class RandomStrategy(Strategy):
    """Uniform random search over the space."""

    name = "random"

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.RandomSampler(seed=seed)
