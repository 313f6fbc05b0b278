"""``--peft lora|qlora``: adapters on every built-in model, parameter counts against peft's own, the
static memory of a frozen base against what the Trainer allocates, a real LoRA probe, study identity,
best.json's note, and bad input refused in ``plan_run``."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from autotune import lora
from autotune.api import RunOptions, plan_run
from autotune.errors import EXIT_USAGE, UsageError
from autotune.lora import LoraSettings, ParameterCounts, count_model_parameters, parameter_counts
from autotune.models import BUILTIN_MODELS, build_model, resolve_model
from autotune.params import TrialParams
from autotune.search.memory_prior import ModelDims, static_memory

peft = pytest.importorskip("peft")

TINY_MODELS = ("tiny-gptneox", "tiny-gpt2", "tiny-llama")
# Adapters of peft's default targets at rank 8, by hand: layers x r x (fan in + fan out) per target.
HAND_TRAINABLE = {
    "tiny-gptneox": 2 * 8 * (128 + 384),  # query_key_value 128 -> 3*128
    "tiny-gpt2": 2 * 8 * (128 + 384),  # c_attn (Conv1D) 128 -> 3*128
    "tiny-llama": 2 * 8 * ((128 + 128) + (128 + 64)),  # q_proj 128 -> 128, v_proj 128 -> 2 kv heads x 32
    "pythia-160m": 12 * 8 * (768 + 3 * 768),
    "gpt2": 12 * 8 * (768 + 3 * 768),
    "llama-3.2-1b": 16 * 8 * ((2048 + 2048) + (2048 + 512)),
    "polyglot-ko-1.3b": 24 * 8 * (2048 + 3 * 2048),
}


def _one_line_usage_error(error: pytest.ExceptionInfo[UsageError]) -> str:
    message = str(error.value)
    assert message and "\n" not in message and error.value.exit_code == EXIT_USAGE
    return message


def _peft_counts(model: torch.nn.Module, settings: LoraSettings) -> tuple[int, int]:
    """peft's own (trainable, total) for ``model`` wrapped by peft directly, not through autotune."""
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, task_type="CAUSAL_LM",
                                                         target_modules=list(settings.target_modules) if settings.target_modules else None))
    return wrapped.get_nb_trainable_parameters()


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_trainable_count_equals_peft_own_on_every_builtin_model(name: str) -> None:
    spec = resolve_model(name)
    settings = LoraSettings("lora")
    counts = parameter_counts(spec, settings)
    config = spec.to_config()
    config.use_cache = False
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    trainable, total = _peft_counts(model, settings)
    assert (counts.trainable, counts.total) == (trainable, total)
    assert counts.frozen == total - trainable > counts.trainable > 0
    if name in HAND_TRAINABLE:
        assert counts.trainable == HAND_TRAINABLE[name]


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_train_only_their_adapters(name: str) -> None:
    """Built for real on the CPU, wrapped as the probe does (checkpointing on): only the adapters get
    gradients, the counts the probe reports are peft's, and the rank and targets are the user's."""
    from autotune.lora import count_model_parameters
    from autotune.probe.model import _wrap_in_adapters

    spec = resolve_model(name)
    settings = LoraSettings("lora", r=4, alpha=8.0)
    torch.manual_seed(0)
    model = _wrap_in_adapters(build_model(spec, attn_implementation="sdpa", device="cpu"), settings, gradient_checkpointing=True)
    model.gradient_checkpointing_enable()
    model.train()
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # B starts at 0, A's grad is 0
    counts = count_model_parameters(model)
    assert (counts.trainable, counts.total) == model.get_nb_trainable_parameters()
    assert counts.trainable == parameter_counts(spec, settings).trainable == HAND_TRAINABLE[name] // 2


def _measured_static_bytes(name: str, settings: LoraSettings | None, optim: str, dtype: torch.dtype | None = None,
                           counted: list | None = None) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes after one real Trainer step on the CPU (the optimizer
    made by the Trainer, as in a probe), then one more backward for the gradients (the Trainer frees them).
    ``dtype``: the dtype the model is built in (a user's model loaded in bf16); ``counted`` gets the
    built model's :func:`count_model_parameters`, as a probe of a user's Trainer counts it."""
    from transformers import Trainer

    from autotune.probe.child import SyntheticTokens, probe_training_arguments
    from autotune.probe.model import _wrap_in_adapters
    from autotune.records import ProbeSpec

    spec = resolve_model(name)
    params = TrialParams(per_device_train_batch_size=2, optim=optim)
    model = build_model(spec, attn_implementation="sdpa", device="cpu", dtype=dtype)
    if settings is not None:
        model = _wrap_in_adapters(model, settings, gradient_checkpointing=False)
    if counted is not None:
        counted.append(count_model_parameters(model))
    probe = ProbeSpec(model=spec.to_dict(), params=params, seq_len=16)
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        args = probe_training_arguments(probe, out, max_steps=1, cuda=False)
        trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(spec.vocab_size, 16, 4, seed=0))
        trainer.train()
    state = [t for s in trainer.optimizer.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)]
    tokens = torch.randint(0, spec.vocab_size, (1, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    unique = {id(p): p for p in model.parameters()}.values()
    return {
        "weights": sum(p.numel() * p.element_size() for p in unique),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in unique if p.grad is not None),
        "optimizer": sum(t.numel() * t.element_size() for t in state),
    }


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "sgd"])
def test_static_memory_estimate_matches_what_the_trainer_allocates(optim: str) -> None:
    """fp32 on the CPU: weights, gradients and optimizer state, predicted vs allocated, with and without LoRA."""
    spec = resolve_model("tiny-gptneox")
    settings = LoraSettings("lora")
    full = static_memory(ModelDims.from_spec(spec), "fp32", optim)
    adapted = static_memory(ModelDims.from_spec(spec, counts=parameter_counts(spec, settings)), "fp32", optim)
    measured_full = _measured_static_bytes("tiny-gptneox", None, optim)
    measured_lora = _measured_static_bytes("tiny-gptneox", settings, optim)
    for predicted, measured in ((full, measured_full), (adapted, measured_lora)):
        assert (predicted.weights_bytes, predicted.gradients_bytes, predicted.optimizer_bytes) == (
            measured["weights"], measured["gradients"], measured["optimizer"])
    # 1,445,376 base + 8,192 adapter parameters: gradients and AdamW state only for the adapters.
    if optim == "adamw_torch_fused":
        assert measured_full["optimizer"] == 8 * 1_445_376 and measured_lora["optimizer"] == 8 * 8_192
    assert measured_lora["gradients"] == 4 * 8_192 < measured_full["gradients"] == 4 * 1_445_376


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "sgd", "adafactor"])
@pytest.mark.parametrize("lora_on", [False, True], ids=["full", "lora"])
def test_static_memory_follows_the_dtypes_the_users_model_is_stored_in(optim: str, lora_on: bool) -> None:
    """A model loaded in bf16 (as users often load theirs): its counted dtypes make the static estimate
    equal what the Trainer allocates (bf16 weights, and gradients and AdamW/SGD state in the dtype of
    what is trained: peft keeps the adapters in fp32 on a bf16 base), where the float32 assumption
    would be about twice too high."""
    spec = resolve_model("tiny-gptneox")
    settings = LoraSettings("lora") if lora_on else None
    counted: list = []
    measured = _measured_static_bytes("tiny-gptneox", settings, optim, dtype=torch.bfloat16, counted=counted)
    counts = counted[0]
    assert counts.dtypes["bfloat16"] == 1_445_376  # the base
    if lora_on:
        assert counts.trainable_dtypes == {"float32": 8_192}  # peft upcasts the adapters
    else:
        assert counts.trainable_dtypes == {"bfloat16": counts.total}
    predicted = static_memory(ModelDims.from_spec(spec, counts=counts), "fp32", optim)
    assert (predicted.weights_bytes, predicted.gradients_bytes) == (measured["weights"], measured["gradients"])
    if optim != "adafactor":  # Adafactor's factored moments are an estimate (2 / hidden floats per parameter)
        assert predicted.optimizer_bytes == measured["optimizer"]
    assumed_fp32 = static_memory(ModelDims.from_spec(spec, counts=dataclasses.replace(counts, dtypes={}, trainable_dtypes={})), "fp32", optim)
    assert assumed_fp32.weights_bytes > 1.9 * predicted.weights_bytes


def test_parameter_counts_round_trip_and_describe_their_dtypes() -> None:
    counts = ParameterCounts(total=10, trainable=2, quantized=4, dtypes={"bfloat16": 4, "float32": 2}, trainable_dtypes={"float32": 2})
    assert ParameterCounts.from_dict(counts.to_dict()) == counts
    assert ParameterCounts.from_dict({"total": 3, "trainable": 1}) == ParameterCounts(3, 1)  # an older record
    assert counts.describe_dtypes() == "4 bfloat16, 2 float32, 4 4-bit"  # largest first, the quantized last
    assert (counts.stored_bytes(), counts.trainable_bytes(), counts.fp32_parameters()) == (4 * 2 + 2 * 4, 2 * 4, 2)
    assert ParameterCounts(3, 1).stored_bytes() is None


def test_estimate_prints_the_lora_figures(capsys) -> None:
    from autotune.cli import main

    assert main(["estimate", "--model", "tiny-llama", "--seq-len", "64", "--space", "quick", "--peft", "lora", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trainable_parameters"] == HAND_TRAINABLE["tiny-llama"] and data["num_parameters"] == 1_016_448 + 7_168
    assert data["peft"].startswith("LoRA r=8")
    plain = {r["optim"]: r for r in json.loads(_estimate_json(capsys, "tiny-llama"))["rows"] if r["precision"] == "fp32"}
    for row in data["rows"]:
        if row["precision"] == "fp32" and not row["gradient_checkpointing"]:
            assert row["gradients_bytes"] == 4 * 7_168 and row["optimizer_bytes"] < plain[row["optim"]]["optimizer_bytes"]
    assert main(["estimate", "--model", "tiny-llama", "--seq-len", "64", "--space", "quick", "--peft", "lora", "--lora-r", "16"]) == 0
    assert "LoRA r=16 alpha=8 dropout=0 on peft's default modules: 14,336 trainable" in capsys.readouterr().out


def _estimate_json(capsys, model: str) -> str:
    from autotune.cli import main

    main(["estimate", "--model", model, "--seq-len", "64", "--space", "quick", "--json"])
    return capsys.readouterr().out


def test_qlora_estimate_counts_4bit_linear_weights() -> None:
    from autotune.search.estimate import estimate_table

    estimate = estimate_table("tiny-llama", seq_len=64, device_memory_bytes=2**30, space="quick", peft="qlora")
    # Every linear weight but the (tied) head: 2 x (2*128^2 + 2*128*64 + 3*128*512).
    assert estimate.quantized_parameters == 2 * (2 * 128**2 + 2 * 128 * 64 + 3 * 128 * 512)
    # 4 B for the rest (embeddings, norms, adapters), ~0.52 B for each 4-bit weight: 2,381,946 B, not 4,094,464.
    from autotune.search.memory_prior import QLORA_BYTES_PER_QUANTIZED_PARAM

    q = estimate.quantized_parameters
    assert estimate.rows[0].weights_bytes == 4 * (estimate.num_parameters - q) + int(q * QLORA_BYTES_PER_QUANTIZED_PARAM) == 2_381_946


# ------------------------------------------------------------------------------------------ the run


def _options(tmp_path, **values) -> RunOptions:
    return RunOptions.of(**{"model": "tiny-gptneox", "budget": None, "n_trials": 1, "space": "quick", "seq_len": 32,
                            "device": "cpu", "storage": f"sqlite:///{tmp_path / 'a.db'}", **values})


def test_plan_records_the_adapters_as_study_identity(tmp_path) -> None:
    from autotune.studies import opening
    from autotune.studies.settings import StudySettings
    from autotune.workers import options_for_worker

    plan = plan_run(_options(tmp_path, peft="lora", lora_r=16, lora_alpha=32, lora_target_modules="query_key_value,dense"))
    assert plan.peft == LoraSettings("lora", r=16, alpha=32.0, target_modules=("query_key_value", "dense"))
    assert plan.study_name.endswith("-lora-r16")
    attrs = plan.study_attrs(None)
    assert attrs["peft"]["r"] == 16 and attrs["parameters"]["trainable"] == plan.parameters.trainable
    assert attrs["parameters"]["trainable"] == 2 * 16 * ((128 + 384) + (128 + 128))
    assert "peft" in opening.IDENTITY_KEYS
    other = plan_run(_options(tmp_path, peft="lora", lora_r=16, lora_alpha=16, lora_target_modules="query_key_value,dense"))
    assert opening.mismatch(attrs, other.study_attrs(None)) == "was made with a different peft (alpha: 32.0 then, 16.0 now)"
    assert opening.mismatch({**attrs, "peft": None}, plan_run(_options(tmp_path)).study_attrs(None)) is None
    # A worker joining the study probes with the same adapters.
    joined = options_for_worker(StudySettings.from_dict(attrs), deadline_unix_s=None, storage="sqlite://", study=plan.study_name,
                                device="cpu", budget="1m", n_trials=None, seed_offset=1)
    assert plan_run(RunOptions(**{**joined, "storage": f"sqlite:///{tmp_path / 'a.db'}"})).peft == plan.peft


def test_lora_study_best_json_carries_a_note_hf_can_parse(tmp_path, cpu_device, capsys) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    import autotune
    from autotune.report.model import training_arguments_code
    from autotune.results import ModelLoadingArguments
    from tests.conftest import FakeEvaluator

    result = autotune.tune("tiny-gptneox", budget=None, n_trials=2, space="quick", device=cpu_device, seq_len=64, peft="lora",
                           storage=f"sqlite:///{tmp_path / 'a.db'}", report_dir=tmp_path, evaluator=FakeEvaluator(), command="test")
    out = " ".join(capsys.readouterr().out.split())
    assert "LoRA r=8 alpha=8 dropout=0 on peft's default modules: 8,192 of 1,453,568 parameters trainable" in out
    assert "autotune_note" not in result.best_kwargs()  # TrainingArguments' kwargs stay TrainingArguments'
    assert result.best_training_arguments().per_device_train_batch_size == result.best_params["per_device_train_batch_size"]
    path = result.write_best_json(tmp_path / "best.json")
    TrainingArguments(**json.loads(path.read_text(encoding="utf-8")))  # best.json: TrainingArguments' fields alone
    (loading,) = HfArgumentParser(ModelLoadingArguments).parse_json_file(str(tmp_path / "best.model.json"))
    assert "LoRA r=8" in loading.autotune_note and "get_peft_model(model, LoraConfig(r=8" in loading.autotune_note
    code = training_arguments_code(result)
    assert "model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, lora_dropout=0, task_type=\"CAUSAL_LM\"))" in code
    compile(code, "export", "exec")
    report = (tmp_path / f"{result.study_name}.html").read_text(encoding="utf-8")
    assert "Adapters" in report and "8.19 k of 1.45 M parameters trainable" in report


# ------------------------------------------------------------------------------------------ bad input


def test_qlora_on_the_cpu_is_refused_naming_the_fix(tmp_path) -> None:
    with pytest.raises(UsageError) as error:
        plan_run(_options(tmp_path, peft="qlora"))
    message = _one_line_usage_error(error)
    assert "CUDA GPU" in message and "--peft lora" in message
    assert not (tmp_path / "a.db").exists()


def test_qlora_without_bitsandbytes_names_it(tmp_path, fake_gpu, monkeypatch) -> None:
    monkeypatch.setattr(lora, "bitsandbytes_available", lambda: False)
    with pytest.raises(UsageError) as error:
        plan_run(_options(tmp_path, peft="qlora", device=fake_gpu))
    message = _one_line_usage_error(error)
    assert "pip install bitsandbytes" in message and "CUDA GPU" not in message


def test_missing_peft_names_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # importlib finds no peft, `import peft` fails
    with pytest.raises(UsageError) as error:
        plan_run(_options(tmp_path, peft="lora"))
    assert "pip install 'autotune[lora]'" in _one_line_usage_error(error)


@pytest.mark.parametrize(("values", "expected"), [
    ({"peft": "lora", "lora_r": 0}, "--lora-r 0 must be a whole number of at least 1"),
    ({"peft": "lora", "lora_alpha": -1.0}, "--lora-alpha -1.0 must be a positive number"),
    ({"peft": "lora", "lora_dropout": 1.0}, "--lora-dropout 1.0 must be in [0, 1)"),
    ({"peft": "dora"}, "--peft 'dora' is not a method"),
    ({"lora_r": 4}, "--lora-r only applies with --peft lora"),
    ({"peft": "lora", "lora_target_modules": "q_proj"}, "pass --lora-target-modules with some of this model's layers: query_key_value,dense"),
])
def test_bad_lora_settings_are_one_line_errors(tmp_path, values, expected) -> None:
    with pytest.raises(UsageError) as error:
        plan_run(_options(tmp_path, **values))
    assert expected in _one_line_usage_error(error)
    assert not (tmp_path / "a.db").exists()


def test_cli_refuses_qlora_on_the_cpu(tmp_path, capsys) -> None:
    from autotune.cli import main

    code = main(["run", "--model", "tiny-gptneox", "--device", "cpu", "--peft", "qlora", "--storage", f"sqlite:///{tmp_path / 'a.db'}",
                 "--n-trials", "1"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.count("\n") == 1 and "--peft qlora" in err


# ------------------------------------------------------------------------------------------ a real probe


@pytest.mark.slow
def test_lora_probe_end_to_end_on_the_cpu() -> None:
    from autotune.probe import isolation
    from autotune.records import ProbeResult, ProbeSpec

    spec = resolve_model("tiny-gptneox")
    settings = LoraSettings("lora")
    probe = ProbeSpec(model=spec.to_dict(), params=TrialParams(per_device_train_batch_size=4, gradient_checkpointing=True),
                      seq_len=32, device="cpu", warmup_steps=1, measure_steps=3, peft=settings.to_dict())
    result = isolation.run_isolated(probe, timeout_s=180)
    assert result.status == "ok", result.error
    counts = parameter_counts(spec, settings)
    assert (result.parameters_total, result.parameters_trainable, result.parameters_frozen) == (counts.total, counts.trainable, counts.frozen)
    assert result.parameters_trainable < result.parameters_total
    # The old results (without counts) still read back.
    old = {k: v for k, v in result.to_dict().items() if not k.startswith("parameters_")}
    assert ProbeResult.from_dict(old).parameters_total is None


@pytest.mark.slow
def test_unknown_target_module_in_a_probe_is_a_clear_crash_reason() -> None:
    """A spec the parent did not check (a hand-written one): the probe crashes with the reason."""
    from autotune.probe.child import run_probe
    from autotune.records import ProbeSpec

    probe = ProbeSpec(model=resolve_model("tiny-gptneox").to_dict(), params=TrialParams(per_device_train_batch_size=2),
                      seq_len=16, warmup_steps=1, measure_steps=1, peft=LoraSettings("lora", target_modules=("q_proj",)).to_dict())
    result = run_probe(probe)
    assert result.status == "crash" and "--lora-target-modules q_proj" in result.error and "query_key_value" in result.error


def test_the_qlora_base_is_written_once_per_run_and_reused(tmp_path, monkeypatch) -> None:
    """QLoRA's random-weight bf16 checkpoint is built by the first probe of a run and read by the next
    (on an H100 a polyglot-ko-1.3b QLoRA probe took 82 s when each built its own, 11 s reusing it)."""
    from transformers import AutoModelForCausalLM

    import autotune.models as models
    from autotune.probe.model import qlora_base_checkpoint

    builds = []
    original = models.build_model  # the child imports it where it builds: counted here

    def counting_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        builds.append(kwargs.get("dtype"))
        return original(*args, **kwargs)

    monkeypatch.setattr(models, "build_model", counting_build)
    monkeypatch.setenv("AUTOTUNE_RUN_CACHE", str(tmp_path))
    spec = resolve_model("tiny-llama")
    with qlora_base_checkpoint(spec) as first:
        assert first.parent == tmp_path and (first / "config.json").exists()
    with qlora_base_checkpoint(spec) as second:
        assert second == first
    assert builds == [torch.bfloat16]  # built once, in bf16
    loaded = AutoModelForCausalLM.from_pretrained(first)
    assert loaded.dtype == torch.bfloat16
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in build_model(spec, attn_implementation=None, device="cpu").parameters())
    with qlora_base_checkpoint(resolve_model("tiny-gptneox")) as other:
        assert other != first  # one checkpoint per model
    assert not list(tmp_path.glob("*.partial-*"))  # nothing half-written left


def test_outside_a_run_the_qlora_base_is_temporary(tmp_path, monkeypatch) -> None:
    from autotune.probe.model import qlora_base_checkpoint

    monkeypatch.delenv("AUTOTUNE_RUN_CACHE", raising=False)
    monkeypatch.setenv("AUTOTUNE_PROBE_SCRATCH", str(tmp_path))
    with qlora_base_checkpoint(resolve_model("tiny-gptneox")) as folder:
        assert folder.parent == tmp_path and (folder / "config.json").exists()
    assert not folder.exists()


def test_a_qlora_note_says_how_the_base_was_loaded() -> None:
    """best.json's note for a QLoRA study tells the user's script to load the base in 4 bits as the probes did."""
    qlora = lora.note(LoraSettings(method="qlora"), {"trainable": 10, "total": 100})
    plain = lora.note(LoraSettings(method="lora"))
    assert qlora is not None and plain is not None
    assert "(10 of 100 parameters trainable): load the base in 4 bits with" in qlora
    assert 'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"' in qlora and "prepare_model_for_kbit_training" in qlora
    assert "4 bits" not in plain and plain.endswith("before Trainer")
