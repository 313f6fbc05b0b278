"""autotune: find the fastest training configuration that fits your GPU, by measuring it.

    >>> import autotune
    >>> result = autotune.tune("polyglot-ko-1.3b", budget="30m")
    >>> args = result.best_training_arguments(output_dir="out")
"""

from __future__ import annotations

from autotune.version import __version__

__all__ = ["__version__", "tune", "TuneResult", "load_result"]


def __getattr__(name: str):  # lazy: `autotune --help` and the probe child start fast
    if name == "tune":
        from autotune.api import tune

        return tune
    if name in ("TuneResult", "load_result"):
        import autotune.results

        return getattr(autotune.results, name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
