"""``bayes``, the default strategy (:class:`.strategy.BayesStrategy`): a model of throughput learnt from the probes picks each next probe.

Every proposal scores the whole grid and runs the configuration with the highest expected
improvement per expected probe second, ``P(runs | x) x P(fits | x) x EI(x) / E[probe seconds of x]``:

* **EI** (:mod:`.throughput`, :mod:`.features`): log samples/s through a step's time (overhead,
  per-sample work, optimizer step, and with 0 loader workers the loading), each part a product of
  per-value factors, capped by the loader's rate, learnt with the rest (a probe's input wait, where
  reported, splits its throughput into compute and waiting). Improvements count beyond a probe's noise, and an
  uncompiled candidate is measured against the best uncompiled configuration.
* **P(runs)**: :class:`~autotune.search.strategies.failures.FailureModel`, once for crashes and once
  for divergences; a configuration holding every suspect of a failure is never run.
* **P(fits)** (:mod:`.fit`, :mod:`.groups`): the calibrated memory model against the ceiling, with an
  error that shrinks as the memory group gets measured; an OOM (or a peak over the ceiling) at batch
  b prunes every batch >= b in every group needing no less memory.
* **Probe seconds** (:mod:`.cost`): start-up, compilation per mode and the measured window, learnt
  from the probes' own timings. A probe that cannot finish in the time left is not proposed.
* **Questions asked on purpose** (:mod:`.questions`): every dimension once near the incumbent, the
  other 16-bit format once.
* **Time kept** (:mod:`.polish`): for polishing the best configurations (another compile mode, more
  accumulation, the model's own pick), and for the loop's near-ties.
* **Several workers**: probes in flight elsewhere count as finished with their likeliest outcome
  (:func:`.strategy.pending_probes`), so N workers ask N different questions.
"""
