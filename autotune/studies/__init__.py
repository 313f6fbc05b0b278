"""The storage: how an autotune study lives in an Optuna storage, and every call that touches it.

* :mod:`~autotune.studies.schema`: the user attributes a study and its trials carry (a schema: add to
  it, never rename);
* :mod:`~autotune.studies.opening`: opening, creating or resuming a study, its settings and identity,
  the storage's errors in one line, the run log;
* :mod:`~autotune.studies.settings`: the run's settings a study stores, as one record (``StudySettings``,
  ``ProbeSettings``), and the run log beside them;
* :mod:`~autotune.studies.reading`: what one iteration of a worker reads from the trials (probes,
  reusable outcomes, claims in flight, dead workers, retries);
* :mod:`~autotune.studies.writing`: claims, outcomes, repeats, heartbeats, re-measures, recovered results.

Optuna's private calls (``study._storage``, ``trial._trial_id``) are made in this package and nowhere
else. Callers import the module they need (``from autotune.studies import writing``).
"""
