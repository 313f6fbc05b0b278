"""The run's defaults, declared once: ``RunOptions``, the CLI's flags, a worker rebuilding a study's
options and the probe read them from here."""

from __future__ import annotations

BUDGET = "30m"  # wall time of the whole run
SPACE = "default"  # the built-in search space
DEVICE = "auto"
SEED = 0
TRIAL_TIMEOUT = "15m"  # the deadline of one probe
WARMUP_STEPS = 3  # optimizer steps before timing starts (compilation happens there)
MEASURE_STEPS = 8  # the fewest optimizer steps timed; more until the step time is stable
MAX_MEASURE_TIME = "30s"  # ... or until this much time was measured (a probe stopped there unstable is flagged)
ISOLATION = "fork"  # each probe forked from the CUDA-clean probe server ("cold": a new interpreter)
TEXT_COLUMN = "text"  # a --dataset's text column
MODEL = "tiny-gptneox"  # the embedded default: a small model, CPU where there is no GPU
SEQ_LEN = 512  # tokens per sample
STORAGE = "sqlite:///autotune.db"  # the built-in SQLite study
WORKERS_STORAGE = "journal:///autotune.journal.log"  # --gpus: a file several processes share without a server
STRATEGY = "bayes"
CONFIG_CLASS = "transformers.training_args.TrainingArguments"  # the class a run's configuration is for without --trainer
STRATEGY_NAMES = ("bayes", "tpe", "random")  # the registry's names (tests/test_strategies.py keeps them equal)
