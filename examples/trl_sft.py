# Copyright 2020-2026 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""TRL's own SFT script (``trl/scripts/sft.py`` of TRL 1.16), adapted as an autotune factory.

Run it as TRL's script (here on the offline example: a tiny Llama built from its config, 300
prompt/completion pairs):

    python examples/trl_sft.py --model_name_or_path examples/data/tiny-llama \
        --dataset_name examples/data/sft --max_length 128 --max_steps 5 --output_dir out

Tune it with the same inputs, and search SFTConfig's own fields too:

    autotune run --trainer examples/trl_sft.py:make_trainer \
        --trainer-args "--model_name_or_path examples/data/tiny-llama --dataset_name examples/data/sft --max_length 128" \
        --space examples/trl_space.yaml --budget 5m --output best.json

Then train with the result: ``python examples/trl_sft.py --config best.json <the same inputs>``
(best.json holds SFTConfig fields; the attention kernel, a ModelConfig field, is in
best.model.json: pass it as ``--attn_implementation``).

The changes to TRL's script, each marked ``autotune:`` below:

1. ``main(script_args, training_args, model_args, dataset_args)`` became ``make_trainer(argv)``: it
   parses ``argv`` with TRL's own parser and returns the trainer instead of training.
2. Training, saving and pushing moved under ``__main__``.
3. For the offline example only: a model folder with a config and no weights is built from its
   config with random weights (throughput and memory do not depend on the weights).
"""

import argparse
from pathlib import Path


def make_trainer(argv=None):  # autotune: was main(script_args, training_args, model_args, dataset_args)
    import transformers  # noqa: F401
    from accelerate.logging import get_logger
    from datasets import load_dataset

    from trl import SFTTrainer, get_dataset, get_peft_config, get_quantization_config

    # autotune: parse the factory's own inputs (TRL's __main__ did this with sys.argv)
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(argv, fail_with_unknown_args=False)[:4]

    logger = get_logger(__name__)

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    # Load the dataset
    if dataset_args.datasets and script_args.dataset_name:
        logger.warning(
            "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
            "dataset and `dataset_name` will be ignored."
        )
        dataset = get_dataset(dataset_args)
    elif dataset_args.datasets and not script_args.dataset_name:
        dataset = get_dataset(dataset_args)
    elif not dataset_args.datasets and script_args.dataset_name:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")

    model = model_args.model_name_or_path
    folder = Path(model)
    if folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        # autotune: the offline example's model has a config and no weights: build it with random weights
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                                 attn_implementation=model_args.attn_implementation)
        training_args.model_init_kwargs = None  # TRL refuses init kwargs with a model object
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    else:
        tokenizer = None

    # Initialize the SFT trainer
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=tokenizer,
        quantization_config=get_quantization_config(model_args) if isinstance(model, str) else None,
        peft_config=get_peft_config(model_args),
    )
    return trainer  # autotune: the trainer, not trained yet


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        parser = subparsers.add_parser("sft", help="Run the SFT training script", dataclass_types=dataclass_types)
    else:
        parser = TrlParser(dataclass_types, prog=prog)
    return parser


if __name__ == "__main__":
    import transformers
    from packaging.version import Version

    trainer = make_trainer()  # autotune: what main() did after building the trainer, below
    training_args = trainer.args
    # Train the model
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Log training complete
    trainer.accelerator.print("✅ Training completed.")

    # Save and push to Hub
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"💾 Model saved to {training_args.output_dir}.")

    if training_args.push_to_hub:
        trainer.push_to_hub()
        trainer.accelerator.print(f"🤗 Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")

    # Finish the trackers and destroy the process group
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()
