"""Search strategies, one class each: :mod:`.base` is the interface, :mod:`.registry` the names.

``bayes`` (the default, :mod:`.bayes`) picks each probe by expected improvement per probe second
under a model learnt from the probes: throughput (:mod:`.steptime`, a step's time as overhead,
per-sample work and optimizer step, over the grid of :mod:`.surrogate`), crashes and divergences
(:mod:`.failures`), memory (the calibrated memory model) and probe cost, and asks every dimension
near the incumbent at least once (:mod:`.coverage`). ``tpe`` and ``random`` (:mod:`.baselines`) are
the generic baselines.
"""
