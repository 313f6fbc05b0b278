"""Imported once by the probe server (a multiprocessing forkserver), so each probe forks warm.

Everything here is import-only: importing torch does not initialise CUDA, and nothing here may run
a tensor operation (that would start thread pools that do not survive a fork). The server process
is started fresh by ``multiprocessing`` (never forked from the parent, which may have imported
anything), so it is CUDA-clean; each probe forked from it initialises CUDA itself.
"""

# ruff: noqa: E402 - the statements before the heavy imports must run before them
from __future__ import annotations

import os
import signal

from autotune.probe.lifetime import die_with_parent

# First, before the slow imports: Ctrl-C belongs to the driver, which stops the probes it started
# (the server shares the driver's process group, so the terminal's SIGINT reaches it too, and an
# interrupted import would print a traceback); and the server dies with the driver, even kill -9'd.
# multiprocessing's forkserver ignores SIGINT itself, but only once its preload has finished.
signal.signal(signal.SIGINT, signal.SIG_IGN)
die_with_parent()

# Read at import time by the libraries below, so they are set here, in the server, before them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# torch.cuda.is_available() through NVML, so that an availability check during an import cannot
# initialise the CUDA driver in the server (forking after cuInit is undefined behaviour).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: F401

from autotune.probe.device import import_bitsandbytes_without_cuda

import_bitsandbytes_without_cuda()  # before transformers, whose Trainer imports peft, which imports it

import transformers  # noqa: F401
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: F401

import autotune.data
import autotune.models
import autotune.probe.child
import autotune.probe.device
import autotune.probe.telemetry  # noqa: F401

# The architectures of the built-in models (transformers imports each lazily on first use).
for _module in ("gpt_neox", "llama", "gpt2"):
    try:
        __import__(f"transformers.models.{_module}.modeling_{_module}")
    except ImportError:
        pass
