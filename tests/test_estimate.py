"""`autotune estimate` and `python -m bench.search`: the same numbers as the tuner, machine-readable output."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.cli import main
from autotune.models import resolve_model
from autotune.params import TrialParams
from autotune.search.memory import MemoryModel
from autotune.search.memory_prior import ModelDims
from autotune.space import load_space
from tests.conftest import GiB

DATA = Path(__file__).parent / "data"


def test_estimate_json_gives_the_tuners_numbers(capsys) -> None:
    assert main(["estimate", "--model", "pythia-160m", "--seq-len", "512", "--device-memory", "24GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    space = load_space("default")
    assert len(data["rows"]) == len(space.choices["precision"]) * len(space.choices["optim"]) * 2
    memory = MemoryModel(ModelDims.from_spec(resolve_model("pythia-160m")), 512)
    for row in data["rows"]:
        params = TrialParams(precision=row["precision"], optim=row["optim"], gradient_checkpointing=row["gradient_checkpointing"])
        assert row["largest_batch"] == memory.largest_batch_that_fits(params, space.choices["per_device_train_batch_size"], 24 * GiB)
        if row["largest_batch"]:
            assert row["peak_bytes_at_largest"] <= 24 * GiB
    by_key = {(r["precision"], r["optim"], r["gradient_checkpointing"]): r for r in data["rows"]}
    # Checkpointing and a smaller optimizer state never make the largest batch smaller.
    assert by_key[("bf16", "adamw_torch", True)]["largest_batch"] >= by_key[("bf16", "adamw_torch", False)]["largest_batch"]
    assert by_key[("bf16", "adafactor", False)]["largest_batch"] >= by_key[("bf16", "adamw_torch", False)]["largest_batch"]


def test_estimate_table_and_bad_model(capsys) -> None:
    assert main(["estimate", "--model", "tiny-gpt2", "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "largest batch" in out and "bf16" in out
    assert main(["estimate", "--model", "no-such-model-xyz", "--seq-len", "128"]) == 2
    assert capsys.readouterr().err.startswith("autotune: error:")


def test_bench_search_last_line_is_a_json_summary(capsys) -> None:
    from bench.search import main as bench_main

    assert bench_main([f"{DATA / 'landscape_tiny.csv'}:40GiB", "--seeds", "2", "--strategies", "tpe,random", "--budget", "30m"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)["tables"]["landscape_tiny"]
    for strategy in ("tpe", "random"):
        figures = summary[strategy]
        for key in ("median_ratio", "worst_ratio", "median_time_fraction", "oom_probes_total", "returned_over_ceiling"):
            assert key in figures
        assert figures["returned_over_ceiling"] == 0


def test_estimate_with_liger_kernels_drops_the_logits(capsys) -> None:
    # llama-3.2-1b: a 128k vocabulary, whose logits Liger's fused cross-entropy never builds.
    argv = ["estimate", "--model", "llama-3.2-1b", "--seq-len", "1024", "--device-memory", "80GiB", "--space", "quick", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--liger-kernel"]) == 0
    liger = json.loads(capsys.readouterr().out)
    assert liger["use_liger_kernel"] is True and plain["use_liger_kernel"] is False
    for a, b in zip(plain["rows"], liger["rows"]):
        assert all(b[k] == a[k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes"))  # the state is Liger's as well
        vocab, hidden = 128_256, 2048
        width = 2 if a["precision"] == "bf16" else 4
        assert a["activation_bytes_per_sample"] - b["activation_bytes_per_sample"] == 1024 * (vocab * (width + 8) - hidden * width)
    assert main([*argv[:-1], "--liger-kernel"]) == 0
    assert "Liger kernels" in capsys.readouterr().out.splitlines()[0]
