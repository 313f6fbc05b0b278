"""Trainer factories for tests/test_ranks.py: a training that runs out of memory on one rank only, and one whose last
rank is killed by SIGKILL (as the kernel's OOM killer kills a process that fills the host), through the real
``--trainer`` path of a multi-process probe.

On rank 1 (torchrun's ``RANK``) the third micro-batch raises ``torch.OutOfMemoryError``, as a GPU that fills up
on one rank would (a longer sequence there, a fragmented allocator); rank 0 then waits for rank 1's gradients
in the data-parallel all-reduce, which never come.
"""

from __future__ import annotations

import os
import signal

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig, Trainer, TrainingArguments

SEQ_LEN = 32
CONFIG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64)
OOM_RANK, OOM_AT_MICRO_BATCH = 1, 3


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, CONFIG["vocab_size"], (SEQ_LEN,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


class OneRankRunsOut(Trainer):
    micro_batches = 0

    def training_step(self, *args, **kwargs):
        self.micro_batches += 1
        if int(os.environ.get("RANK", "0")) == OOM_RANK and self.micro_batches >= OOM_AT_MICRO_BATCH:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's rank 1)")
        return super().training_step(*args, **kwargs)


def make_trainer(args: TrainingArguments, attn_implementation: str | None) -> Trainer:
    model = AutoModelForCausalLM.from_config(GPTNeoXConfig(**CONFIG), attn_implementation=attn_implementation)
    return OneRankRunsOut(model=model, args=args, train_dataset=Tokens())


class LastRankKilled(Trainer):
    micro_batches = 0

    def training_step(self, *args, **kwargs):
        self.micro_batches += 1
        if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1 and self.micro_batches >= OOM_AT_MICRO_BATCH:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(*args, **kwargs)


def make_killed_trainer(args: TrainingArguments, attn_implementation: str | None) -> Trainer:
    model = AutoModelForCausalLM.from_config(GPTNeoXConfig(**CONFIG), attn_implementation=attn_implementation)
    return LastRankKilled(model=model, args=args, train_dataset=Tokens())
