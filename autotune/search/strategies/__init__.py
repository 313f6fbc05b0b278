"""Search strategies, one class each: :mod:`.base` is the interface, :mod:`.registry` the names.

``frontier`` (the default) uses the structure of the problem: memory model, batch-size frontier,
coordinate sweeps, compile last. ``tpe`` and ``random`` (:mod:`.baselines`) are the generic baselines.
"""
