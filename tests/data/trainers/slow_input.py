"""Trainer factories for tests/test_probe.py: an input pipeline of known slowness, through the real ``--trainer`` path.

Each sample takes the factory's delay to load (a sleep in ``__getitem__``, as a slow disk or tokenizer
would): a probe of it waits for its batches (input-bound), can be cut by its deadline while training,
and forks loader workers that must die with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig, Trainer, TrainingArguments

SEQ_LEN = 32
CONFIG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64)


class SlowTokens(torch.utils.data.Dataset):
    """Random token sequences, each ``delay_s`` slow to load."""

    def __init__(self, delay_s: float, length: int = 256) -> None:
        self.delay_s = delay_s
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.delay_s)
        ids = torch.randint(1, CONFIG["vocab_size"], (SEQ_LEN,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def _factory(delay_s: float) -> Callable[[TrainingArguments, str | None], Trainer]:
    def make_trainer(args: TrainingArguments, attn_implementation: str | None) -> Trainer:
        model = AutoModelForCausalLM.from_config(GPTNeoXConfig(**CONFIG), attn_implementation=attn_implementation)
        return Trainer(model=model, args=args, train_dataset=SlowTokens(delay_s))

    return make_trainer


make_trainer_200ms = _factory(0.2)
make_trainer_500ms = _factory(0.5)
make_trainer_30s = _factory(30.0)
