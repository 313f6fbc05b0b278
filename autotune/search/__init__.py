"""The search, parent side: which configuration to probe next, and what was found. Never imports torch.

:mod:`.loop` runs the ask/probe/tell loop over an Optuna study; :mod:`.ranking` is the one rule for
what fits and what is fastest; :mod:`.memory` predicts peak memory before a probe runs;
:mod:`.strategies` choose the next configuration; :mod:`.replay` runs the same search on a recorded
table with a virtual clock; :mod:`.estimate` tabulates the memory model for ``autotune estimate``.
The probes themselves run in child processes (:mod:`autotune.probe`), behind the loop's
:class:`~autotune.search.loop.Evaluator` interface.
"""
