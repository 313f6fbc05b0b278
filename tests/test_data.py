"""Datasets: every file format, the packing Dataset, bad input before any study, and a real probe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.api import RunOptions, plan_run
from autotune.data import FORMATS, DatasetSpec, TextDataset, read_texts
from autotune.errors import UsageError
from autotune.models import resolve_model
from autotune.params import TrialParams
from autotune.probe import isolation
from autotune.records import ProbeSpec

TEXT = Path(__file__).parent / "data" / "text"
TOKENIZER = str(TEXT / "tokenizer")


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.csv", "corpus.parquet", "corpus.txt"])
def test_every_format_reads_the_same_documents(name: str) -> None:
    texts = read_texts(TEXT / name, "text")
    assert texts == read_texts(TEXT / "corpus.txt")
    assert len(texts) == 120 and texts[0].startswith("The GPU reads short sentences")


def test_formats_cover_the_documented_extensions() -> None:
    assert {".jsonl", ".csv", ".parquet", ".txt"} <= set(FORMATS)


@pytest.mark.parametrize(
    ("path", "column", "message"),
    [
        ("missing.jsonl", "text", "does not exist"),
        ("corpus.jsonl", "body", "no column 'body': pass --text-column with one of id, text"),
        ("corpus.csv", "body", "no column 'body': pass --text-column with one of id, text"),
        ("corpus.parquet", "body", "no column 'body': pass --text-column with one of id, text"),
        ("make_data.py", "text", "unknown extension '.py'"),
    ],
)
def test_bad_files_are_one_line_usage_errors(path: str, column: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")) as info:
        read_texts(TEXT / path, column)
    assert "\n" not in str(info.value)


def test_packing_gives_exactly_seq_len_real_tokens() -> None:
    spec = DatasetSpec(path=str(TEXT / "corpus.jsonl"), tokenizer=TOKENIZER)
    dataset = TextDataset(spec, seq_len=64, length=10)
    sample = dataset[3]
    assert sample["input_ids"].shape == (64,) and sample["labels"].tolist() == sample["input_ids"].tolist()
    eos = dataset._tokenizer.eos_token_id
    ids = sample["input_ids"].tolist()
    assert eos in ids  # documents 3, 4, ... packed, separated by EOS
    first_doc = dataset._tokenizer(dataset.texts[3], add_special_tokens=False)["input_ids"]
    assert ids[: len(first_doc)] == first_doc[:64]
    assert dataset[3]["input_ids"].tolist() == ids  # deterministic per index
    # A sequence longer than the whole file wraps around it.
    assert TextDataset(spec, seq_len=6000, length=1)[0]["input_ids"].shape == (6000,)


def test_plan_run_checks_the_dataset_before_any_study(tmp_path) -> None:
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    common = {"device": "cpu", "n_trials": 1, "storage": storage, "seq_len": 32}
    plan = plan_run(RunOptions(model="tiny-gptneox", dataset=str(TEXT / "corpus.csv"), tokenizer=TOKENIZER, **common))
    assert plan.dataset.path == str((TEXT / "corpus.csv").resolve()) and plan.dataset.text_column == "text"
    with pytest.raises(UsageError, match="pass --text-column"):
        plan_run(RunOptions(model="tiny-gptneox", dataset=str(TEXT / "corpus.csv"), text_column="body", tokenizer=TOKENIZER, **common))
    with pytest.raises(UsageError, match="no tokenizer of its own: pass --tokenizer"):
        plan_run(RunOptions(model="tiny-gptneox", dataset=str(TEXT / "corpus.csv"), **common))
    with pytest.raises(UsageError, match="cannot load tokenizer"):
        plan_run(RunOptions(model="tiny-gptneox", dataset=str(TEXT / "corpus.csv"), tokenizer=str(tmp_path), **common))
    with pytest.raises(UsageError, match="only used with --dataset"):
        plan_run(RunOptions(model="tiny-gptneox", tokenizer=TOKENIZER, **common))
    assert not (tmp_path / "a.db").exists()


def test_a_tokenizer_that_cannot_encode_the_data_is_refused(tmp_path) -> None:
    """A model directory without tokenizer files loads as an empty tokenizer that encodes every document
    to nothing (transformers 5): the run must stop and name --tokenizer, not train on zeros."""
    import shutil

    from autotune.models import resolve_model

    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(resolve_model("tiny-gptneox").config))
    common = {"device": "cpu", "n_trials": 1, "storage": f"sqlite:///{tmp_path / 'a.db'}", "seq_len": 32}
    with pytest.raises(UsageError, match=r"cannot encode this data \(0% of its tokens are known.*pass --tokenizer"):
        plan_run(RunOptions(model=str(model_dir), dataset=str(TEXT / "corpus.csv"), **common))
    shutil.copytree(TOKENIZER, model_dir, dirs_exist_ok=True)  # with the tokenizer beside the config, it runs
    assert plan_run(RunOptions(model=str(model_dir), dataset=str(TEXT / "corpus.csv"), **common)).dataset is not None
    assert not (tmp_path / "a.db").exists()


def test_cli_names_the_fix_for_a_missing_dataset(tmp_path, capsys) -> None:
    from autotune.cli import main

    code = main(["run", "--device", "cpu", "--n-trials", "1", "--storage", f"sqlite:///{tmp_path / 'a.db'}",
                 "--dataset", str(tmp_path / "nope.jsonl"), "--tokenizer", TOKENIZER])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autotune: error: --dataset") and "does not exist" in err and "\n" not in err
    assert not (tmp_path / "a.db").exists()


@pytest.mark.slow
def test_probe_trains_on_real_data_in_dataloader_workers() -> None:
    spec = ProbeSpec(
        model=resolve_model("tiny-gptneox").to_dict(),
        params=TrialParams(per_device_train_batch_size=4, dataloader_num_workers=2),
        seq_len=64, device="cpu", warmup_steps=1, measure_steps=4,
        dataset=DatasetSpec(path=str(TEXT / "corpus.parquet"), tokenizer=TOKENIZER).to_dict(),
    )
    result = isolation.run_isolated(spec, timeout_s=120)
    assert result.status == "ok", result.error
    assert result.measured_steps == 4 and result.tokens_per_s == pytest.approx(result.samples_per_s * 64)
    assert len(result.losses) == 5 and all(7.0 < loss < 9.5 for loss in result.losses)  # a fresh model: ~ln(4096)
    assert result.input_wait_fraction is not None
