"""LoRA fine-tuning with TRL's SFTTrainer: one file that is both your training script and autotune's factory.

Run it as a script (a few steps with default arguments):

    python examples/sft_lora.py

Tune it (autotune calls make_trainer in each probe with the candidate TrainingArguments):

    autotune run --trainer examples/sft_lora.py:make_trainer --budget 10m --output best.json

Then train with the best configuration: ``args, loading = HfArgumentParser((TrainingArguments,
autotune.results.ModelLoadingArguments)).parse_json_file("best.json")`` and
``make_trainer(args, loading.attn_implementation).train()``.

Needs ``pip install trl peft``. Nothing is downloaded: the tokenizer is ``examples/data/tokenizer``
(a 512-token BPE), the data 300 short prompt/completion pairs in ``examples/data/sft.jsonl``, and
the model a tiny GPT-NeoX built from its config with random weights; for your own model, load it
with ``AutoModelForCausalLM.from_pretrained(name, attn_implementation=attn_implementation)``.
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, TrainingArguments
from trl import SFTConfig, SFTTrainer

DATA = Path(__file__).resolve().parent / "data"
MAX_LENGTH = 64  # tokens; longer prompt + completion pairs are truncated (the data's longest is ~50)


def make_trainer(args: TrainingArguments, attn_implementation: str | None) -> SFTTrainer:
    """The whole training set-up: model (with the attention kernel asked for), data, LoRA, Trainer."""
    tokenizer = AutoTokenizer.from_pretrained(DATA / "tokenizer")
    tokenizer.pad_token = tokenizer.eos_token  # the tokenizer has no pad token; batches are padded to their longest
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=256, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    rows = [json.loads(line) for line in (DATA / "sft.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    # SFTTrainer takes an SFTConfig: the TrainingArguments it was given, unchanged, plus SFT's own fields.
    # (to_dict() masks tokens, so the real hub_token is passed on as it is.)
    sft_args = SFTConfig(**{**args.to_dict(), "hub_token": args.hub_token, "max_length": MAX_LENGTH})
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query_key_value"], task_type="CAUSAL_LM")
    return SFTTrainer(model=model, args=sft_args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, peft_config=lora)


if __name__ == "__main__":
    arguments = TrainingArguments(output_dir="sft_lora_output", max_steps=5, per_device_train_batch_size=8, logging_steps=1,
                                  save_strategy="no", report_to="none")
    make_trainer(arguments, attn_implementation=None).train()
