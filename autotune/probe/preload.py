"""Imported once by the probe server (a multiprocessing forkserver), so each probe forks warm.

Everything here is import-only: importing torch does not initialise CUDA, and nothing here may run
a tensor operation (that would start thread pools that do not survive a fork). The server process
is started fresh by ``multiprocessing`` (never forked from the parent, which may have imported
anything), so it is CUDA-clean; each probe forked from it initialises CUDA itself.
"""

from __future__ import annotations

import os

# Read at import time by the libraries below, so they are set here, in the server, before them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# torch.cuda.is_available() through NVML, so that an availability check during an import cannot
# initialise the CUDA driver in the server (forking after cuInit is undefined behaviour).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402,F401

import autotune.data  # noqa: E402,F401
import autotune.models  # noqa: E402,F401
import autotune.probe.child  # noqa: E402,F401
import autotune.probe.device  # noqa: E402,F401
import autotune.probe.telemetry  # noqa: E402,F401

# The architectures of the built-in models (transformers imports each lazily on first use).
for _module in ("gpt_neox", "llama", "gpt2"):
    try:
        __import__(f"transformers.models.{_module}.modeling_{_module}")
    except ImportError:
        pass
