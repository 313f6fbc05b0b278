"""The ``autotune`` command line: thin commands over the Python API.

The entry point only registers commands; each command is one small function; one table maps
exceptions to a one-line message and an exit code (``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import autotune.defaults as defaults
from autotune.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, AutotuneError, Terminated
from autotune.interrupts import received_sigterm, sigterm_interrupts
from autotune.version import __version__

# Usage examples live beside each command, as data.
EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "run": [
        ("autotune run", "the embedded default: a tiny model, the CPU if there is no GPU, ./autotune.db"),
        ("autotune run --model polyglot-ko-1.3b --budget 30m", "tune a built-in model on the GPU for 30 minutes"),
        ("autotune run --model EleutherAI/pythia-410m --memory-ceiling 16GiB", "tune for a 16 GiB card on a bigger one"),
        ("autotune run --model ./my-model --effective-batch-size 64 --output best.json", "keep bs x accum = 64"),
        ("autotune run --space quick --n-trials 10", "a quick look with the small built-in space"),
        ("autotune run --model ./my-model --dataset train.jsonl --text-column text", "probe on real data (tokenised in the workers)"),
        ("autotune run --model polyglot-ko-1.3b --gpus 0,1,2,3 --budget 30m", "one worker per GPU, one search (a journal file study)"),
        ("autotune run --trainer sft.py:make_trainer --trainer-args \"--model_name_or_path my-model --use_peft\" --budget 30m",
         "tune your own TRL/Trainer script: make_trainer(argv) parses its inputs and returns its Trainer"),
        ("autotune run --trainer sft.py:make_trainer --trainer-args \"--config sft.yaml\" --space my_space.yaml",
         "search SFTConfig fields too (packing: [true, false] in the space), against your own settings"),
    ],
    "estimate": [
        ("autotune estimate --model polyglot-ko-1.3b --seq-len 1024", "predicted peak memory and largest batch, on an 80 GiB card"),
        ("autotune estimate --model pythia-410m --seq-len 512 --device-memory 24GiB --json", "the same for scripts"),
    ],
    "replay": [
        ("autotune replay tests/data/landscape_pythia-160m-l4.csv.gz --budget 30m --memory-ceiling 16GiB", "search a replay table"),
        ("autotune replay TABLE.csv --strategy tpe --seed 3 --json", "another strategy, one JSON object"),
    ],
    "models": [("autotune models", "list the built-in models")],
    "spaces": [("autotune spaces", "list the built-in search spaces")],
    "report": [
        ("autotune report tiny-gptneox-seq512-cpu", "rewrite reports/tiny-gptneox-seq512-cpu.html (also while it runs)"),
        ("autotune report my-study --storage sqlite:///runs.db -o /tmp/my-study.html", "another storage and file"),
    ],
    "export": [
        ("autotune export my-study --format json > best.json", "TrainingArguments JSON (HfArgumentParser reads it)"),
        ("autotune export my-study --format python", "the TrainingArguments(...) call to paste into a script"),
    ],
    "worker": [
        ("autotune worker --storage postgresql://tuner@db.internal/autotune --study my-study",
         "join a study from another machine (its first GPU), until the study's shared budget ends"),
        ("autotune worker --storage postgresql://tuner@db.internal/autotune --study my-study --gpus all",
         "one worker per GPU of this machine"),
    ],
    "list": [("autotune list", "studies in ./autotune.db"), ("autotune list --storage sqlite:///runs.db", "another storage")],
}


def _epilog(command: str) -> str:
    lines = ["examples:"]
    for example, what in EXAMPLES.get(command, []):
        lines.append(f"  {example}\n      {what}")
    return "\n".join(lines)


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="search for the fastest configuration that fits",
        description="Run probe trainings (one fresh process each) and rank configurations by measured samples/s.",
        epilog=_epilog("run"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help=f"built-in name, hub id or local dir (default: {defaults.MODEL})")
    p.add_argument("--trainer", default=None,
                   help="your own training instead of --model: FILE.py:FUNC or package.module:FUNC, a function FUNC(argv) "
                   "that parses argv with your parser (HfArgumentParser, TrlParser) and returns your transformers.Trainer "
                   "(any subclass, e.g. TRL's SFTTrainer); or FUNC(args, attn_implementation), given TrainingArguments")
    p.add_argument("--trainer-args", default=None,
                   help="the inputs of FUNC(argv), as you would pass them to your script, in one quoted string: "
                   "\"--model_name_or_path m --lora_r 64\" or \"--config sft.yaml\"; your settings in them are the baseline")
    p.add_argument("--baseline", default=None,
                   help="a JSON or YAML file of the settings you run today ({\"per_device_train_batch_size\": 16, \"bf16\": true}): "
                   "the speed-up is measured against them (default: your factory's own settings, else transformers' defaults)")
    p.add_argument("--objective", default=None, choices=None,
                   help="rank by tokens (real, non-padding tokens/s) or samples (sequences/s) "
                   "(default: tokens with --trainer, whose batches' lengths vary; samples otherwise)")
    p.add_argument("--budget", default=defaults.BUDGET, help=f"wall time of the whole run: 90s, 30m, 2h (default: {defaults.BUDGET})")
    p.add_argument("--n-trials", type=int, default=None, help="at most this many exploring probes (near-tie re-measures come on top)")
    p.add_argument("--space", default=defaults.SPACE, help=f"built-in space name or YAML path (default: {defaults.SPACE})")
    p.add_argument("--memory-ceiling", default=None, help="e.g. 40GiB or 0.8 of the device (default: 95%% of it)")
    p.add_argument("--effective-batch-size", type=int, default=None, help="keep batch x accumulation = N")
    p.add_argument("--seq-len", type=int, default=None, help=f"tokens per sample (default: {defaults.SEQ_LEN})")
    p.add_argument("--device", default=defaults.DEVICE, help=f"auto, cuda, cuda:N or cpu (default: {defaults.DEVICE})")
    p.add_argument("--storage", default=None,
                   help=f"sqlite:///FILE, postgresql://user@host/db, journal:///FILE.log or another Optuna storage URL "
                   f"(default: {defaults.STORAGE}; with --gpus {defaults.WORKERS_STORAGE})")
    p.add_argument("--gpus", default=None,
                   help="one worker per GPU on this machine, one search: 0,1,2,3 or all (default: one probe at a time on --device)")
    p.add_argument("--nproc-per-probe", "--gpus-per-probe", type=int, default=1, dest="nproc_per_probe",
                   help="processes per probe, one per GPU from --device on, started by torchrun, trained data-parallel (DDP); "
                   "on a CPU each gets its share of the cores and memory (default: 1)")
    p.add_argument("--host-memory-ceiling", default=None,
                   help="GPU runs: host memory the probe's processes may hold together, e.g. 120GiB or 0.8 (default: 95%% of this "
                   "machine's); offloaded state must fit in it")
    p.add_argument("--study", default=None, help="study name; the same name resumes (default: from model/seq-len/device)")
    p.add_argument("--output", "-o", default=None, help="write the best configuration as TrainingArguments JSON")
    p.add_argument("--report-dir", default="reports", help="where <study>.html goes (default: reports)")
    p.add_argument("--seed", type=int, default=defaults.SEED)
    p.add_argument("--trial-timeout", default=defaults.TRIAL_TIMEOUT, help=f"deadline of one probe (default: {defaults.TRIAL_TIMEOUT})")
    p.add_argument("--warmup-steps", type=int, default=defaults.WARMUP_STEPS, help=f"optimizer steps before timing (default: {defaults.WARMUP_STEPS})")
    p.add_argument("--measure-steps", type=int, default=defaults.MEASURE_STEPS,
                   help=f"fewest optimizer steps timed; more until stable (default: {defaults.MEASURE_STEPS})")
    p.add_argument("--max-measure-time", default=defaults.MAX_MEASURE_TIME,
                   help=f"most time a probe spends timing steps, stable or not (default: {defaults.MAX_MEASURE_TIME})")
    p.add_argument("--dataset", default=None, help="train probes on this .jsonl/.csv/.parquet/.txt file (default: synthetic tokens)")
    p.add_argument("--text-column", default=defaults.TEXT_COLUMN, help=f"the dataset's text column (default: {defaults.TEXT_COLUMN})")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir or hub id for --dataset (default: the model's)")
    p.add_argument(
        "--isolation", default=defaults.ISOLATION,
        help="how each probe's process starts: fork (from a pre-imported, CUDA-clean probe server) or cold "
        f"(a new interpreter each; slower) (default: {defaults.ISOLATION})",
    )
    _add_strategy_flag(p)
    _add_peft_flags(p)
    p.set_defaults(func=cmd_run)


def _add_peft_flags(p: argparse.ArgumentParser, *, dropout: bool = True) -> None:
    from autotune.lora import DEFAULT_LORA_ALPHA, DEFAULT_LORA_DROPOUT, DEFAULT_LORA_R

    p.add_argument("--peft", default=None,
                   help="train LoRA adapters on a frozen base (pip install 'autotune[lora]'); qlora: on a 4-bit base "
                   "(CUDA and bitsandbytes) (default: train every weight)")
    p.add_argument("--lora-r", type=int, default=None, help=f"the adapters' rank, not tuned (default: {DEFAULT_LORA_R}, peft's)")
    p.add_argument("--lora-alpha", type=float, default=None, help=f"LoRA alpha, updates scaled by alpha/r (default: {DEFAULT_LORA_ALPHA:g}, peft's)")
    if dropout:
        p.add_argument("--lora-dropout", type=float, default=None, help=f"dropout on the adapters' input (default: {DEFAULT_LORA_DROPOUT:g})")
    p.add_argument("--lora-target-modules", default=None,
                   help="comma-separated module names to wrap, e.g. q_proj,v_proj (default: peft's for the architecture)")


def _add_strategy_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strategy", default=defaults.STRATEGY,
        help=f"search strategy: {', '.join(defaults.STRATEGY_NAMES)} (default: {defaults.STRATEGY}; tpe and random are baselines)",
    )


def stopped_exit_code() -> int:
    """The exit code of a run stopped before its end: 143 after SIGTERM, else 130 (Ctrl-C)."""
    return EXIT_TERMINATED if received_sigterm() else EXIT_INTERRUPTED


def recorded_command(argv: Sequence[str]) -> str:
    """The command line as the study and its report keep it, a storage password masked (``--storage URL``)."""
    from autotune.storage import describe

    words = list(argv)
    for i, word in enumerate(words):
        if word == "--storage" and i + 1 < len(words):
            words[i + 1] = describe(words[i + 1])
        elif word.startswith("--storage="):
            words[i] = "--storage=" + describe(word.split("=", 1)[1])
    return shlex.join(["autotune", *words])


def cmd_run(args: argparse.Namespace) -> int:
    import dataclasses

    from autotune.api import RunOptions, plan_run, run_plan
    from autotune.console import LiveProgress, PipeConsole, print_header, print_summary
    from autotune.results import no_result_error
    from autotune.studies import opening

    console = PipeConsole(highlight=False)
    if not console.is_terminal:  # logs and CI: wide enough for the ranked table
        console = PipeConsole(highlight=False, width=180)
    options = RunOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RunOptions)})
    plan = plan_run(options)
    command = recorded_command(sys.argv[1:]) if sys.argv[1:2] == ["run"] else None
    live = LiveProgress(console, budget_s=plan.settings.budget_s, n_trials=plan.settings.n_trials,
                        ceiling_bytes=plan.memory_ceiling_bytes)
    try:
        with live:
            done = run_plan(plan, on_open=lambda p, resumed: print_header(console, p, resumed), on_start=live.on_start,
                            on_trial=live.on_trial, report_dir=args.report_dir, command=command, best_json=args.output)
    except KeyboardInterrupt:  # outside a probe (inside one the loop stops cleanly): best.json and the report are written
        if console.reader_gone:
            return EXIT_BROKEN_PIPE
        report = Path(args.report_dir) / opening.report_file_name(plan.study_name)
        console.print(f"interrupted; report: {report}" if report.is_file() else
                      f"interrupted before the report was written: `autotune report {plan.study_name} --storage {plan.storage}` writes it")
        raise
    result = done.result
    if done.search.pruned:
        pruned = done.search.pruned
        console.print(f"{pruned} configuration{'s' if pruned != 1 else ''} pruned without running (the memory model ruled "
                      f"{'them' if pruned != 1 else 'it'} out)", style="dim")
    print_summary(console, result)
    if done.report_error:
        console.print(f"warning: {done.report_error}", style="yellow")
    else:
        console.print(f"report: {done.report_path}")
    if done.best_json_path is not None:
        console.print(f"best configuration written to {done.best_json_path}")
    if done.search.stopped_because == "interrupted":  # stopped by the user, a scheduler or stdout's reader, whatever was found
        return EXIT_BROKEN_PIPE if console.reader_gone else stopped_exit_code()
    if result.best is None:
        raise no_result_error(result)  # nothing fits (exit 3), or no probe finished (exit 4)
    return 0


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker", help="join a running study: probe on this machine's GPU(s) too",
        description="Join a study that `autotune run` made (on a storage every machine reaches: PostgreSQL, or a journal "
        "file on a shared disk) and probe configurations for it until its shared budget ends. The run's options come from "
        "the study; the device must be of the study's kind.",
        epilog=_epilog("worker"), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--storage", required=True, help="the storage of the study (the URL `autotune run` used)")
    p.add_argument("--study", required=True, help="the study name (see `autotune list`)")
    p.add_argument("--device", default=defaults.DEVICE, help=f"auto, cuda, cuda:N or cpu (default: {defaults.DEVICE})")
    p.add_argument("--gpus", default=None, help="one worker per GPU of this machine: 0,1 or all")
    p.add_argument("--budget", default=None, help="work this long (default: until the study's shared budget ends)")
    p.add_argument("--n-trials", type=int, default=None, help="at most this many exploring probes")
    p.add_argument("--quiet", action="store_true", help="no progress display (what `autotune run --gpus` starts)")
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    from rich.console import Console

    from autotune.api import RunOptions, plan_run, run_plan
    from autotune.console import LiveProgress
    from autotune.studies import opening, writing
    from autotune.workers import PARENT_RUN_ENV, options_for_worker, parse_gpus, require_probe_settings, run_workers, worker_devices

    if os.environ.get(PARENT_RUN_ENV):  # started by `autotune run --gpus`: end with it, even if it is kill -9'd
        from autotune.probe.lifetime import die_with_parent

        die_with_parent()
    study = opening.load_existing(args.study, args.storage)
    settings = opening.study_settings(study)
    gpus = parse_gpus(args.gpus)
    if gpus is not None:  # one worker process per GPU, each of them this command with --device cuda:N
        # The study's probes span nproc_per_probe GPUs: one worker per group.
        outcome = run_workers(study, args.storage, worker_devices(gpus, settings.nproc_per_probe),
                              require_probe_settings(settings, args.study),
                              n_trials=args.n_trials)
        return stopped_exit_code() if outcome.stopped_because == "interrupted" else 0
    options = options_for_worker(settings, deadline_unix_s=writing.deadline_unix_s(study), storage=args.storage, study=args.study,
                                 device=args.device, budget=args.budget, n_trials=args.n_trials, seed_offset=1 + os.getpid() % 10_000)
    plan = plan_run(RunOptions(**options))
    console = Console(highlight=False, quiet=args.quiet)
    live = LiveProgress(console, budget_s=plan.settings.budget_s, n_trials=plan.settings.n_trials, ceiling_bytes=plan.memory_ceiling_bytes)
    with live:
        done = run_plan(plan, on_start=live.on_start, on_trial=live.on_trial, report_dir=None, command=None, join=True)
    console.print(f"worker done: {done.search.probes_run} probes ({done.search.stopped_because}); "
                  f"`autotune report {args.study} --storage ...` shows the whole study")
    if done.search.stopped_because == "interrupted":
        return stopped_exit_code()
    return 0


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate", help="predicted peak memory and the largest batch that fits, without a GPU",
        description="Predict peak training memory per precision x optimizer x checkpointing from the model config "
        "(meta device, nothing allocated), and the largest batch size that fits. The tuner uses the same numbers.",
        epilog=_epilog("estimate"), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="built-in name, hub id or local dir")
    p.add_argument("--seq-len", type=int, default=defaults.SEQ_LEN, help=f"tokens per sample (default: {defaults.SEQ_LEN})")
    p.add_argument("--device-memory", default="80GiB", help="memory the batch must fit in (default: 80GiB)")
    p.add_argument("--space", default="default", help="space whose precisions, optimizers and batch sizes to tabulate (default: default)")
    p.add_argument("--attn", default="sdpa", help="attention implementation assumed: eager, sdpa, flash_attention_2, flash_attention_3 "
                   "or flex_attention (default: sdpa)")
    p.add_argument("--liger-kernel", action="store_true",
                   help="assume use_liger_kernel (Liger's fused linear cross-entropy keeps no logits tensor)")
    p.add_argument("--host-memory", default=None,
                   help="add DeepSpeed ZeRO-Offload rows, whose offloaded optimizer state (and parameters) must fit in this much "
                   "host memory, e.g. 120GiB; rows that fit only with offload are marked (default: no offload rows)")
    p.add_argument("--nproc-per-probe", "--gpus-per-probe", type=int, default=1, dest="nproc_per_probe",
                   help="GPUs the training is data-parallel over: adds the ZeRO stages, which partition the state over them (default: 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    _add_peft_flags(p, dropout=False)
    p.set_defaults(func=cmd_estimate)


def cmd_estimate(args: argparse.Namespace) -> int:
    import json

    from autotune.search.estimate import estimate_table
    from autotune.sharding import NONE
    from autotune.units import format_bytes, parse_bytes

    estimate = estimate_table(args.model, seq_len=args.seq_len, device_memory_bytes=parse_bytes(args.device_memory),
                              space=args.space, attn_implementation=args.attn, peft=args.peft, lora_r=args.lora_r,
                              lora_alpha=args.lora_alpha, lora_target_modules=args.lora_target_modules,
                              use_liger_kernel=args.liger_kernel,
                              host_memory_bytes=parse_bytes(args.host_memory) if args.host_memory is not None else None,
                              nproc=args.nproc_per_probe)
    if args.json:
        print(json.dumps(estimate.to_dict()))
        return 0
    print(f"{estimate.model}: {estimate.num_parameters:,} parameters, seq-len {estimate.seq_len}, attention {estimate.attn_implementation}"
          f"{', Liger kernels' if estimate.use_liger_kernel else ''}, fits in {format_bytes(estimate.device_memory_bytes)}"
          + (f" per GPU of {estimate.nproc}" if estimate.nproc > 1 else "")
          + (f", host {format_bytes(estimate.host_memory_bytes)}" if estimate.host_memory_bytes is not None else ""))
    if estimate.peft is not None:
        quantized = f", {estimate.quantized_parameters:,} of them in 4 bits" if estimate.quantized_parameters else ""
        print(f"{estimate.peft}: {estimate.trainable_parameters:,} trainable ({estimate.trainable_parameters / estimate.num_parameters:.3%}), "
              f"{estimate.num_parameters - estimate.trainable_parameters:,} frozen{quantized}: "
              "no gradient or optimizer state for the frozen ones")
    sharded = any(row.sharding != NONE for row in estimate.rows)
    header = f"{'precision':<9} {'optim':<20} {'ckpt':<5} " + (f"{'sharding':<14} " if sharded else "") + \
        f"{'static':>10} {'per sample':>11} {'largest batch':>14} {'peak at it':>11}" + (f" {'host':>10}" if sharded else "")
    print(header)
    print("-" * len(header))
    for row in estimate.rows:
        batch = str(row.largest_batch) if row.largest_batch is not None else "none fits"
        line = (f"{row.precision:<9} {row.optim:<20} {'yes' if row.gradient_checkpointing else 'no':<5} "
                + (f"{row.sharding:<14} " if sharded else "")
                + f"{format_bytes(row.static_bytes):>10} {format_bytes(row.activation_bytes_per_sample):>11} {batch:>14} "
                f"{format_bytes(row.peak_bytes_at_largest):>11}")
        if sharded:
            line += f" {format_bytes(row.host_bytes) if row.host_bytes else '-':>10}" + ("  fits only with offload" if row.only_with_offload else "")
        print(line)
    print("static: weights, optimizer state and context at the peak, with the gradients only where they are held then "
          "(accumulation, a ZeRO stage, or more gradients than activations); peak = static + batch x per sample")
    return 0


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="run the search on a replay table (no GPU): what would it find?",
        description="Search a replay table (CSV: one row per configuration with status, samples_per_s, peak_mem_bytes, "
        "probe_s) on a virtual clock, and print the best configuration found.",
        epilog=_epilog("replay"), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("table", help="replay table, .csv or .csv.gz")
    p.add_argument("--budget", default="30m", help="virtual time of the search (default: 30m)")
    p.add_argument("--memory-ceiling", default="40GiB", help="peak memory allowed (default: 40GiB)")
    p.add_argument("--space", default=None, help="space name or YAML path (default: the table's own columns and values)")
    p.add_argument("--seed", type=int, default=defaults.SEED)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_strategy_flag(p)
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    import json

    from autotune.search.replay import load_table, replay_search
    from autotune.space import load_space
    from autotune.units import format_bytes, format_duration, parse_bytes, parse_duration_s

    budget_s, ceiling = parse_duration_s(args.budget), parse_bytes(args.memory_ceiling)
    table = load_table(args.table)
    space = load_space(args.space) if args.space else None
    outcome = replay_search(table, budget_s=budget_s, memory_ceiling_bytes=ceiling, space=space, strategy=args.strategy, seed=args.seed)
    if args.json:
        print(json.dumps(outcome.to_dict()))
        return 0
    print(f"{table.name}: {len(table):,} configurations, strategy {outcome.strategy}, seed {outcome.seed}, "
          f"ceiling {format_bytes(ceiling)}, budget {format_duration(budget_s)} (virtual)")
    print(f"{outcome.trials_run} probes in {format_duration(outcome.virtual_s)}, {outcome.oom_probes} OOM, "
          f"{outcome.pruned} pruned without running (stopped: {outcome.stopped_because})")
    if outcome.best_params is None:
        print("nothing fits under the ceiling")
        return 3
    from autotune.params import TrialParams

    print(f"best: {TrialParams.from_dict(outcome.best_params).short()}  {outcome.best_samples_per_s:.3f} samples/s, "
          f"peak {format_bytes(outcome.best_peak_mem_bytes)}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from autotune.models import BUILTIN_MODELS

    width = max(len(n) for n in BUILTIN_MODELS)
    for name, description in BUILTIN_MODELS.items():
        print(f"{name:<{width}}  {description}")
    return 0


def cmd_spaces(args: argparse.Namespace) -> int:
    from autotune.space import builtin_space_names, load_space

    def text(value: object) -> str:  # as in the YAML file
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    for name in builtin_space_names():
        space = load_space(name)
        print(f"{name:<10} {space.size:>7,} configurations")
        for key, values in space.choices.items():
            note = "  (fixed)" if len(values) == 1 else ""
            if key == "per_device_train_batch_size" and space.grow_batches_by:
                note = "  (and more on a GPU while they fit: grow: memory)"
            print(f"  {key:<30} {', '.join(text(v) for v in values)}{note}")
    return 0


def _add_study_command(sub: argparse._SubParsersAction, name: str, help_text: str, description: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=description, epilog=_epilog(name),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    if name != "list":
        p.add_argument("study", metavar="STUDY", help="study name (see `autotune list`)")
    p.add_argument("--storage", default=defaults.STORAGE,
                   help=f"sqlite:///FILE, postgresql://user@host/db, journal:///FILE.log or another Optuna storage URL (default: {defaults.STORAGE})")
    return p


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = _add_study_command(sub, "report", "write a study's HTML report",
                           "Write the self-contained HTML report of a stored study (it may still be running).")
    p.add_argument("--output", "-o", default=None, help="the HTML file (default: reports/STUDY.html)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from autotune.report.html import write_report
    from autotune.results import load_result
    from autotune.units import format_bytes

    result = load_result(args.study, args.storage)
    from autotune.studies.opening import report_file_name

    path = write_report(result, args.output or Path("reports") / report_file_name(args.study))
    print(f"report: {path} ({format_bytes(path.stat().st_size)}, {len(result.trials)} trials)")
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = _add_study_command(sub, "export", "print a study's best configuration",
                           "Print the best configuration of a stored study as TrainingArguments JSON or Python code.")
    p.add_argument("--format", choices=("json", "python"), default="json", help="json (default) or python")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    import json

    from autotune.report.model import training_arguments_code
    from autotune.results import load_result

    result = load_result(args.study, args.storage)
    if args.format == "python":
        print(training_arguments_code(result), end="")
    else:
        print(json.dumps(result.best_json(), indent=2))
    return 0


def _add_list(sub: argparse._SubParsersAction) -> None:
    p = _add_study_command(sub, "list", "list stored studies", "List the studies in a storage with their best samples/s.")
    p.set_defaults(func=cmd_list)


def cmd_list(args: argparse.Namespace) -> int:
    from autotune.results import list_studies
    from autotune.storage import describe

    rows = list_studies(args.storage)
    if not rows:
        print(f"no studies in {describe(args.storage)}: run `autotune run` first")
        return 0
    width = max(len("study"), *(len(r.name) for r in rows))
    print(f"{'study':<{width}}  {'best samples/s':>14}  {'trials':>6}  outcomes / best configuration / device")
    for r in rows:
        if r.foreign:
            print(f"{r.name:<{width}}  {'-':>14}  {r.n_trials:>6}  not made by autotune (a plain Optuna study): open it with optuna-dashboard")
            continue
        best = f"{r.best_samples_per_s:,.1f}" if r.best_samples_per_s is not None else "-"
        counts = ", ".join(f"{n} {s}" for s, n in sorted(r.counts.items())) or "no trials"
        print(f"{r.name:<{width}}  {best:>14}  {r.n_trials:>6}  {counts} / {r.best_config} / {r.model} on {r.device}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotune",
        description="Find the fastest training configuration that fits your GPU, by measuring it.",
        epilog=_epilog("run"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    _add_worker(sub)
    _add_estimate(sub)
    _add_replay(sub)
    for name, func, help_text in (("models", cmd_models, "list built-in models"), ("spaces", cmd_spaces, "list built-in search spaces")):
        p = sub.add_parser(name, help=help_text, epilog=_epilog(name), formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
    _add_report(sub)
    _add_export(sub)
    _add_list(sub)
    for command in sub.choices.values():  # `autotune run --debug ...` works as well as `autotune --debug run ...`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks instead of one-line errors")
    return parser


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool whose reader closed the pipe

# One table: exception type -> (exit code, message prefix). AutotuneError carries its own code.
ERROR_TABLE: list[tuple[type[BaseException], Callable[[BaseException], tuple[int, str]]]] = [
    (AutotuneError, lambda e: (e.exit_code, str(e))),  # type: ignore[attr-defined]
    (Terminated, lambda e: (EXIT_TERMINATED, "terminated (SIGTERM); what was measured is kept: run the same command to resume")),
    (KeyboardInterrupt, lambda e: (EXIT_INTERRUPTED, "interrupted; what was measured is kept: run the same command to resume")),
]


def attach_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--budget -5m`` -> ``--budget=-5m`` (``-o -x`` -> ``-o-x``) for every option that takes a value.

    argparse reads a word starting with '-' after such an option as another option and answers
    "expected one argument"; attached, the value reaches the option's own parser, whose message
    names the fix ("duration '-5m' must be positive"). A following word that is itself an option of
    the command (``--study --storage x``: a forgotten value) is left alone, and so is all after ``--``.
    """
    def options(p: argparse.ArgumentParser) -> tuple[set[str], set[str], dict[str, argparse.ArgumentParser]]:
        known, valued, commands = set(), set(), {}
        for action in p._actions:
            known.update(action.option_strings)
            if action.option_strings and action.nargs is None:
                valued.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                commands.update(action.choices)
        return known, valued, commands

    known, valued, commands = options(parser)
    out: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            out.extend(words[i:])
            break
        if word in commands:
            known, valued, commands = options(commands[word])
        elif word in valued and i + 1 < len(words):
            value = words[i + 1]
            if value.startswith("-") and value != "-" and value != "--" and value.split("=", 1)[0] not in known:
                out.append(f"{word}={value}" if word.startswith("--") else f"{word}{value}")
            else:
                out.extend((word, value))
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_dash_values(parser, sys.argv[1:] if argv is None else argv))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with sigterm_interrupts():  # a scheduler's SIGTERM stops the run as Ctrl-C does (exit 143)
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`autotune estimate ... | head -3`): stop quietly, as a tool killed by
        # SIGPIPE does, and keep Python from failing again on flushing stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except BaseException as exc:
        if args.debug or isinstance(exc, SystemExit):
            raise
        for exc_type, describe in ERROR_TABLE:
            if isinstance(exc, exc_type):
                code, message = describe(exc)
                print(f"autotune: error: {message}", file=sys.stderr)
                return code
        raise


if __name__ == "__main__":
    sys.exit(main())
