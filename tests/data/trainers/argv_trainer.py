"""A ``make_trainer(argv)`` factory for tests/test_user_trainer.py: a script's own parser, its own settings.

It parses ``argv`` with ``HfArgumentParser`` into ``TrainingArguments`` and its own ``ModelArguments``
(the model's width and attention kernel), then builds padded.py's model and data: every sample has
REAL real tokens in a batch padded to PADDED.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig, HfArgumentParser, Trainer, TrainingArguments

from padded import CONFIG, REAL, collate


@dataclass
class ModelArguments:
    hidden_size: int = field(default=32, metadata={"help": "the model's width"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "from_config(attn_implementation=...)"})


def make_trainer(argv: list[str]) -> Trainer:
    args, model_args = HfArgumentParser((TrainingArguments, ModelArguments)).parse_args_into_dataclasses(argv)
    config = GPTNeoXConfig(**{**CONFIG, "hidden_size": model_args.hidden_size})
    model = AutoModelForCausalLM.from_config(config, attn_implementation=model_args.attn_implementation)
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(1, CONFIG["vocab_size"], (REAL,), generator=generator) for _ in range(64)]
    return Trainer(model=model, args=args, train_dataset=data, data_collator=collate)


def make_trainer_without_parser(argv: list[str]) -> Trainer:
    """Ignores its inputs: autotune cannot set anything through them."""
    return make_trainer_from(TrainingArguments(output_dir="out", use_cpu=True))


def make_trainer_from(args: TrainingArguments) -> Trainer:
    model = AutoModelForCausalLM.from_config(GPTNeoXConfig(**CONFIG))
    data = [torch.randint(1, CONFIG["vocab_size"], (REAL,)) for _ in range(64)]
    return Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
