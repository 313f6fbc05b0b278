"""A plain transformers Trainer with a custom collator: one file that is both your training script and autotune's factory.

Run it as a script (a few steps with default arguments):

    python examples/custom_collator.py

Tune it (autotune calls make_trainer in each probe with the candidate TrainingArguments):

    autotune run --trainer examples/custom_collator.py:make_trainer --budget 10m --output best.json

The collator pads each batch to its longest sequence, with ``attention_mask`` 0 and labels -100 on the
padding, so a batch of short texts costs less than one of long ones: the speed autotune measures, and
the tokens/s it reports (non-padding tokens only), are those of your batches. Nothing is downloaded: the
tokenizer is ``examples/data/tokenizer``, the texts the prompt/completion pairs of ``examples/data/sft.jsonl``
joined, the model a tiny Llama built from its config with random weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Trainer, TrainingArguments

DATA = Path(__file__).resolve().parent / "data"
MAX_LENGTH = 64  # tokens; longer texts are truncated


@dataclass
class PadToLongest:
    """Pads a list of ``{"input_ids": [...]}`` to the batch's longest: ``attention_mask`` 0 and labels -100 on padding."""

    pad_token_id: int

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        input_ids = torch.full((len(features), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
        for row, feature in enumerate(features):
            ids = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_trainer(args: TrainingArguments, attn_implementation: str | None) -> Trainer:
    """The whole training set-up: model (with the attention kernel asked for), tokenised data, collator, Trainer."""
    tokenizer = AutoTokenizer.from_pretrained(DATA / "tokenizer")
    pad_id = tokenizer.eos_token_id  # the tokenizer has no pad token; padding is masked out anyway
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=384, max_position_embeddings=256, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    rows = [json.loads(line) for line in (DATA / "sft.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = [row["prompt"] + row["completion"] + tokenizer.eos_token for row in rows]
    dataset = [{"input_ids": ids} for ids in tokenizer(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]]
    return Trainer(model=model, args=args, train_dataset=dataset, data_collator=PadToLongest(pad_id))


if __name__ == "__main__":
    arguments = TrainingArguments(output_dir="custom_collator_output", max_steps=5, per_device_train_batch_size=8, logging_steps=1,
                                  save_strategy="no", report_to="none")
    make_trainer(arguments, attn_implementation=None).train()
