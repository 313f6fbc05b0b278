"""Trainer factories for tests/test_user_trainer.py: known padding, so the probe's token count is exact.

Every sample has exactly REAL tokens and the collator pads each to PADDED (attention_mask 0, labels
-100 there): a probe must report REAL tokens per sample, and the plan-time check a batch PADDED long.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig, Trainer, TrainingArguments

REAL, PADDED, PAD = 10, 24, 0
CONFIG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64, pad_token_id=PAD)


def collate(features: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    input_ids = torch.full((len(features), PADDED), PAD, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    input_ids[:, :REAL] = torch.stack(features)
    attention_mask[:, :REAL] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def make_trainer(args: TrainingArguments, attn_implementation: str | None) -> Trainer:
    model = AutoModelForCausalLM.from_config(GPTNeoXConfig(**CONFIG), attn_implementation=attn_implementation)
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(1, CONFIG["vocab_size"], (REAL,), generator=generator) for _ in range(64)]
    return Trainer(model=model, args=args, train_dataset=data, data_collator=collate)


def make_trainer_changing_args(args: TrainingArguments, attn_implementation: str | None) -> Trainer:
    """Overrides the learning rate it is given: the run warns, and each probe records the field."""
    return make_trainer(TrainingArguments(**{**args.to_dict(), "learning_rate": 1e-3}), attn_implementation)
