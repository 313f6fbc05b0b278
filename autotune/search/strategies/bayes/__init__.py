"""``bayes``, the default strategy (:class:`.strategy.BayesStrategy`).

Each proposal runs the configuration with the highest ``P(runs) x P(fits) x EI / E[probe seconds]``
over the whole grid: EI from the step-time model (:mod:`.throughput`, :mod:`.features`), P(runs) from
the failures so far (:mod:`..failures`; below 1 in 20 a configuration is not proposed), P(fits) from the memory model (:mod:`.fit`, :mod:`.groups`),
probe seconds from the probes' own timings (:mod:`.cost`); some questions are asked on purpose
(:mod:`.questions`) and time is kept for polishing the best (:mod:`.polish`). How it works, and why:
``docs/how-it-works.md``; its measurements: ``reports/search_benchmark.md``.
"""
