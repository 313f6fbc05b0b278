"""The study's schema: the user attributes an autotune study and its trials carry in an Optuna storage.

A study holds the run's settings in one study user attribute (:data:`STUDY_ATTR`: model, device,
space, memory ceiling, the run log) and, per trial, the user attributes named ``ATTR_*`` below: the
full :class:`~autotune.params.TrialParams`, the :class:`~autotune.records.ProbeResult`, its status,
and why it ended as it did. Everything a result, a table or a report shows is rebuilt from these,
so they are a schema: add to it, never rename.
"""

from __future__ import annotations

from optuna.trial import TrialState

STUDY_ATTR = "autotune"  # study user attribute holding the run's settings (model, device, space, run log)

# Trial user attributes.
ATTR_PARAMS = "params"  # full TrialParams dict (accumulation included when derived)
ATTR_RESULT = "result"  # ProbeResult.to_dict()
ATTR_STATUS = "status"  # a ProbeStatus value
ATTR_REASON = "reason"  # why it was pruned, failed or is over the ceiling
ATTR_ROLE = "role"  # ROLE_BASELINE for the trial of transformers' defaults
ATTR_DUPLICATE_OF = "duplicate_of"  # not run: a measured configuration's outcome repeated, or the trial holding it (see hold)
ATTR_REMEASURE_OF = "remeasure_of"  # a near-tie probed again: the number of the configuration's first trial
ATTR_OWNER = "owner"  # "host:pid" of the run that asked the trial, to fail it if that run died
ATTR_PREDICTED_PEAK = "predicted_peak_mem_bytes"  # the memory model's prediction when the trial was asked
ATTR_REUSABLE = "reusable"  # False: a later run must not reuse this outcome (cut by the budget, interrupted, pruned)
ATTR_HEARTBEAT = "heartbeat_unix_s"  # while RUNNING: when its worker last said it is alive (time.time())
ATTR_DIED = "died"  # how the process running it died (killed, or its worker went silent): see retry_candidates
ATTR_RETRY_OF = "retry_of"  # probes again the configuration of this trial, whose process died
ATTR_REMEASURE_ROUND = "remeasure_round"  # a re-measure: which probe of the configuration it is (2, 3)
STUDY_DEADLINE_ATTR = "deadline_unix_s"  # study user attribute: when the workers' shared budget ends (time.time())
# Study user attribute: the search's estimates once it ended, {"probes": how many probes they rest on,
# "samples_per_s": {first trial number of a configuration that fits: estimated samples/s}} (ranking.rank_configurations).
STUDY_ESTIMATES_ATTR = "estimates"
ROLE_BASELINE = "baseline"
ROLE_EXPERT = "expert"  # the expert rule's configuration (autotune.search.expert), measured early as a reference

CONSTRAINT_MEMORY = "memory"  # (peak - ceiling) / ceiling: feasible when <= 0
METRIC_NAME = "samples_per_s"  # the objective's name, as optuna-dashboard and Optuna's plots label it
# Scalar copies of what people sort and filter by, beside the full result (ATTR_RESULT, a JSON
# object that the dashboard can only show as text).
SCALAR_RESULT_ATTRS = ("samples_per_s", "tokens_per_s", "peak_mem_bytes", "mfu")
# Optuna 5 keeps each constraint under "constraints:<name>"; optuna-dashboard (0.21) and Optuna 4's
# plots read the list under "constraints". Both are written, so every reader sees the memory constraint.
LEGACY_CONSTRAINTS_KEY = "constraints"
OUTCOME_ATTRS = (ATTR_RESULT, ATTR_STATUS, ATTR_REASON, *SCALAR_RESULT_ATTRS)  # what a repeat copies from the original
FINISHED_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)

# Several workers: see autotune.studies.reading.
HEARTBEAT_INTERVAL_S = 10.0  # a probing worker refreshes its trial's heartbeat this often
HEARTBEAT_GRACE_S = 60.0  # a RUNNING trial with no heartbeat for this long has lost its worker
CLAIM_SETTLE_S = 2.0  # the longest a claim waits for an older trial that is still being given its configuration

# Results stored before ProbeResult.process_lost existed say it only in their error text (autotune.probe.isolation's).
KILLED_PREFIXES = ("probe process killed by SIGKILL", "probe process killed by SIGTERM")
ATTR_RECOVERED_FROM = "recovered_from"  # a result a probe finished after its run was killed: the trial it belonged to
