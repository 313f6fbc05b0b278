"""Search strategies, one class each: :mod:`.base` is the interface, :mod:`.registry` the names.

``bayes`` (the default, :mod:`.bayes`) picks each probe by expected improvement per probe second
under a model learnt from the probes: throughput (:mod:`.surrogate`), crashes and divergences
(:mod:`.failures`), memory (the calibrated memory model) and probe cost. ``frontier`` uses the
structure of the problem as a fixed sequence of moves: memory model, batch-size frontier,
coordinate sweeps, compile last. ``tpe`` and ``random`` (:mod:`.baselines`) are the generic baselines.
"""
