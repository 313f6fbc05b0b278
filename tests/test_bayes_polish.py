"""bayes: the time kept for polishing, and the probe-cost model."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import numpy as np

from autotune.params import TrialParams
from autotune.records import Probe, ProbeResult
from autotune.search.memory import MemoryModel
from autotune.search.strategies.base import SearchState
from autotune.search.strategies.bayes import polish, throughput
from autotune.search.strategies.bayes.cost import probe_costs
from autotune.search.strategies.bayes.groups import MemoryEvidence
from autotune.search.strategies.bayes.polish import POLISH_PROBES, POLISH_SHARE
from autotune.search.strategies.bayes.strategy import BayesStrategy
from autotune.space import SearchSpace, parse_space
from tests.conftest import GiB

SPACE = {
    "per_device_train_batch_size": [4, 8, 16, 32], "gradient_accumulation_steps": [1, 2, 4, 8],
    "precision": ["fp32", "bf16"], "torch_compile": ["off", "inductor", "inductor:max-autotune"],
    "gradient_checkpointing": [False, True],
}


def _ok(number: int, sps: float, wall_s: float = 40.0, **values) -> Probe:
    params = TrialParams(**values)
    warmup = 3 * params.effective_batch_size / sps + (60.0 if params.torch_compile != "off" else 0.0)
    return Probe(number, params, ProbeResult(status="ok", samples_per_s=sps, peak_mem_bytes=GiB + params.per_device_train_batch_size * 2**27,
                                             wall_s=wall_s, setup_s=10.0, warmup_s=warmup, step_time_s=params.effective_batch_size / sps,
                                             step_time_ci95_rel=0.01, input_wait_fraction=0.0))


def _oom(number: int, **values) -> Probe:
    return Probe(number, TrialParams(**values), ProbeResult(status="oom", wall_s=20.0, setup_s=10.0))


def _state(history: list[Probe], remaining_s: float | None, *, checkpointing: bool = True) -> SearchState:
    space = parse_space(SPACE if checkpointing else {k: v for k, v in SPACE.items() if k != "gradient_checkpointing"})
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    return SearchState(space, 40 * GiB, memory, history, {p.params.key() for p in history}, remaining_s)


def test_the_time_left_for_polishing_goes_to_the_most_valuable_variant_of_the_incumbent_first() -> None:
    incumbent = {"precision": "bf16", "per_device_train_batch_size": 32, "torch_compile": "inductor"}
    history = [_ok(0, 50.0), _ok(1, 100.0, precision="bf16", per_device_train_batch_size=32),
               _ok(2, 120.0, wall_s=120.0, **incumbent), _ok(3, 90.0, precision="bf16", per_device_train_batch_size=16)]
    strategy = BayesStrategy()
    strategy.propose(_state(history, 1800.0, checkpointing=False))  # the run's budget
    state = _state(history, 400.0, checkpointing=False)
    proposal = strategy.propose(state)
    assert proposal is not None
    changed = {name for name in ("per_device_train_batch_size", "precision", "torch_compile", "gradient_checkpointing", "gradient_accumulation_steps")
               if getattr(proposal, name) != getattr(history[2].params, name)}
    # The time left (400 s) is less than what was kept: a polishing probe of the incumbent, one
    # polishing dimension changed (compile mode or accumulation), not the cheapest per second.
    assert len(changed) == 1 and changed <= {"torch_compile", "gradient_accumulation_steps"}
    assert proposal.per_device_train_batch_size == 32 and proposal.precision == "bf16"


def test_the_polishing_reserve_is_at_most_a_share_of_the_budget(monkeypatch) -> None:
    history = [_ok(0, 50.0), _ok(1, 100.0, precision="bf16", per_device_train_batch_size=32),
               _ok(2, 120.0, wall_s=400.0, precision="bf16", per_device_train_batch_size=32, torch_compile="inductor")]
    for budget in (300.0, 1800.0, 7200.0):
        strategy = BayesStrategy()
        state = _state(history, budget, checkpointing=False)
        strategy.propose(state)
        context = strategy.context(state)
        mean, sd = throughput.posterior(context, list(history))
        p_ok = np.ones(context.grid.shape)
        cost_ok, _ = probe_costs(context, list(history), mean)
        allowed = np.ones(context.grid.shape, dtype=bool)
        evidence = MemoryEvidence.of(context.groups, context.grid, history, state.ceiling_bytes)
        picks: list[int] = []
        models_pick = polish.models_pick

        def recording(*args, picks=picks, models_pick=models_pick, **kwargs):
            pick = models_pick(*args, **kwargs)
            picks.extend([pick[1]] if pick is not None else [])
            return pick

        monkeypatch.setattr(polish, "models_pick", recording)
        reserve, keep, order = polish.polish_reserve(context, state, state.feasible(), (mean, sd), p_ok, cost_ok, allowed, evidence, budget)
        assert reserve <= POLISH_SHARE * budget + 1e-6
        assert len(order) == int(keep.sum()) <= POLISH_PROBES
        for index in order:  # a variant of a measured configuration in compile mode or accumulation only, or the model's pick
            params = context.grid.params_at(index)
            variant = any(sum(getattr(params, n) != getattr(p.params, n) for n in ("torch_compile", "gradient_accumulation_steps")) == 1
                          and all(getattr(params, n) == getattr(p.params, n) for n in ("per_device_train_batch_size", "precision", "gradient_checkpointing"))
                          for p in history)
            assert variant or index in picks


def _measured_apart() -> tuple[SearchSpace, list[Probe], MemoryModel]:
    """fp16 beat bf16 uncompiled (110 against 100 samples/s); compiling bf16 gained 30 %."""
    space = parse_space({"per_device_train_batch_size": [8, 16, 32], "precision": ["bf16", "fp16"], "torch_compile": ["off", "inductor"]})
    history = [_ok(0, 100.0, precision="bf16", per_device_train_batch_size=32), _ok(1, 110.0, precision="fp16", per_device_train_batch_size=32),
               _ok(2, 130.0, wall_s=120.0, precision="bf16", per_device_train_batch_size=32, torch_compile="inductor"),
               _ok(3, 90.0, precision="bf16", per_device_train_batch_size=16)]
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    return space, history, memory


def test_polishing_keeps_time_for_the_models_pick_that_combines_factors_measured_apart() -> None:
    # fp16 beat bf16 uncompiled (110 against 100 samples/s); compiling bf16 gained 30 %. No variant
    # of a measured configuration in one dimension holds both; the model's pick, fp16 compiled at
    # the incumbent's batch (known to fit: bf16 stores alike and fitted there), gets polishing time.
    space, history, memory = _measured_apart()
    strategy = BayesStrategy()
    strategy.propose(SearchState(space, 40 * GiB, memory, history, {p.params.key() for p in history}, 1800.0))  # the run's budget
    state = SearchState(space, 40 * GiB, memory, history, {p.params.key() for p in history}, 1200.0)
    context = strategy.context(state)
    model = throughput.posterior(context, list(history))
    cost_ok, _ = probe_costs(context, list(history), model[0])
    allowed = np.ones(context.grid.shape, dtype=bool)
    allowed.reshape(-1)[[context.grid.flat_index(p.params) for p in history]] = False
    evidence = MemoryEvidence.of(context.groups, context.grid, history, state.ceiling_bytes)
    reserve, _, order = polish.polish_reserve(context, state, state.feasible(), model, np.ones(context.grid.shape), cost_ok, allowed, evidence, 1800.0)
    assert reserve > 0 and [context.grid.params_at(i).short() for i in order] == ["bs32x1 fp16 adamw_torch_fused sdpa compile=inductor"]
    late = SearchState(space, 40 * GiB, memory, history, {p.params.key() for p in history}, reserve)
    proposal = strategy.propose(late)  # only the kept time is left: it goes to the pick
    assert proposal is not None and proposal.short() == "bs32x1 fp16 adamw_torch_fused sdpa compile=inductor"


def _polish_inputs(space: SearchSpace, history: list[Probe], memory: MemoryModel, ceiling_bytes: int = 40 * GiB):
    """A strategy that proposed once with 1800 s left (the run's budget), and what its
    ``polish_reserve`` takes: state, context, model, costs, what is allowed (all but the measured),
    the memory evidence."""
    strategy = BayesStrategy()
    state = SearchState(space, ceiling_bytes, memory, history, {p.params.key() for p in history}, 1800.0)
    strategy.propose(state)
    context = strategy.context(state)
    grid = context.grid
    model = throughput.posterior(context, list(history))
    cost_ok, _ = probe_costs(context, list(history), model[0])
    allowed = np.ones(grid.shape, dtype=bool)
    allowed.reshape(-1)[[grid.flat_index(p.params) for p in history]] = False
    evidence = MemoryEvidence.of(context.groups, grid, history, state.ceiling_bytes)
    return strategy, state, context, model, cost_ok, allowed, evidence


def test_the_models_pick_for_polishing_counts_the_chance_that_it_runs() -> None:
    # The same probes, but fp16 has crashed in two contexts (P(runs) 1e-4): the fastest expected
    # configuration known to fit is still fp16 compiled, but the pick is worth its chance to run
    # times its expected gain (1e-4 x 4.4 %), so the time is kept for a bf16 configuration instead
    # (bs16 compiled: 1.6e-5, all of it its chance to run faster than the model expects).
    strategy, state, context, model, cost_ok, allowed, evidence = _polish_inputs(*_measured_apart())
    grid = context.grid
    p_ok = np.array([1e-4 if grid.params_at(i).precision == "fp16" else 1.0 for i in range(grid.size)]).reshape(grid.shape)
    _, _, order = polish.polish_reserve(context, state, state.feasible(), model, p_ok, cost_ok, allowed, evidence, 1800.0)
    assert order and all(grid.params_at(i).precision == "bf16" for i in order)
    _, _, trusting = polish.polish_reserve(context, state, state.feasible(), model, np.ones(grid.shape), cost_ok, allowed, evidence, 1800.0)
    assert any(grid.params_at(i).precision == "fp16" for i in trusting)  # where fp16 runs, it is the pick


def test_the_models_pick_may_be_one_no_probe_showed_to_fit_weighed_by_its_chance_to_fit() -> None:
    # flash beat sdpa uncompiled (110 against 100 samples/s); compiling sdpa gained 30 %. flash
    # compiled needs no memory that a measured group bounds (compile modes and kernels have no
    # order), so it is not known to fit, but the memory model expects it to: it is the pick, its
    # worth its expected gain times its chance to run and to fit.
    space = parse_space({"per_device_train_batch_size": [8, 16, 32], "precision": ["bf16"], "attn_implementation": ["sdpa", "flash_attention_2"],
                         "torch_compile": ["off", "inductor"]})
    history = [_ok(0, 100.0, precision="bf16", per_device_train_batch_size=32), _ok(1, 110.0, precision="bf16", per_device_train_batch_size=32,
                                                                                    attn_implementation="flash_attention_2"),
               _ok(2, 130.0, wall_s=120.0, precision="bf16", per_device_train_batch_size=32, torch_compile="inductor"),
               _ok(3, 90.0, precision="bf16", per_device_train_batch_size=16)]
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    strategy, state, context, model, cost_ok, allowed, evidence = _polish_inputs(space, history, memory)
    grid = context.grid
    flash_compiled = grid.flat_index(history[1].params.replace(torch_compile="inductor"))
    assert not context.batch_grid(evidence.known_fit).reshape(-1)[flash_compiled]
    _, _, order = polish.polish_reserve(context, state, state.feasible(), model, np.ones(grid.shape), cost_ok, allowed, evidence, 1800.0)
    assert order and order[0] == flash_compiled
    worth = np.zeros(grid.size)
    worth[flash_compiled] = 0.01
    assert polish.models_pick(context, state, evidence, worth) == (0.01, flash_compiled)  # 5 GiB measured alike, under 40 GiB: it fits
    tight = SearchState(space, int(5.2 * GiB), memory, history, state.seen, 1800.0)  # the measured bs32 peaked at 5 GiB
    value, index = polish.models_pick(context, tight, evidence, worth)
    assert index == flash_compiled and 0.0 < value < 0.01  # not known to fit: its chance to fit counts


def _compiled(number: int, compile_s: float, **values) -> Probe:
    """A compiled probe whose warm-up held ``compile_s`` of compilation."""
    probe = _ok(number, 100.0, torch_compile="inductor", precision="bf16", **values)
    step_s = probe.result.step_time_s
    # Start-up 10 s, the warm-up with its compilation, then a window of 125 steps.
    return Probe(number, probe.params, replace(probe.result, warmup_s=3 * step_s + compile_s, wall_s=10.0 + 3 * step_s + compile_s + 125 * step_s))


def _compile_cost(history: list[Probe], space: dict | None = None, **values) -> float:
    """bayes' predicted seconds for the compiled bf16 configuration ``values``."""
    strategy = BayesStrategy()
    state = _state(history, 3600.0)
    if space is not None:
        state = SearchState(parse_space(space), state.ceiling_bytes, state.memory, history, state.seen, 3600.0)
    context = strategy.context(state)
    mean, _ = throughput.posterior(context, [p for p in history if p.result.ok])
    cost_ok, _ = probe_costs(context, history, mean)
    return float(cost_ok.reshape(-1)[context.grid.flat_index(state.space.complete(dict(torch_compile="inductor", precision="bf16", **values)))])


def test_a_compiled_probe_that_fails_costs_its_whole_compilation() -> None:
    """An out-of-memory step comes after the compilation: polyglot-ko-1.3b compiled ran out of memory
    after 74 s on an H100 and 49 s on an H200, where compiling took 64 and 63 s. A failed compiled probe
    is charged the compilation its mode measured (40 s here), not half of it; an uncompiled one only
    start-up and a step."""
    strategy = BayesStrategy()
    history = [_ok(0, 50.0), _compiled(1, 40.0, per_device_train_batch_size=16)]
    state = _state(history, 3600.0)
    context = strategy.context(state)
    mean, _ = throughput.posterior(context, [p for p in history if p.result.ok])
    _, cost_fail = probe_costs(context, history, mean)

    def fail_s(**values) -> float:
        return float(cost_fail.reshape(-1)[context.grid.flat_index(state.space.complete(dict(precision="bf16", per_device_train_batch_size=32, **values)))])

    assert 38.0 < fail_s(torch_compile="inductor") - fail_s(torch_compile="off") < 42.0
    assert fail_s(torch_compile="off") < 10.0 + 5.0  # start-up (10 s) and a step


def test_a_graph_compiled_before_costs_what_recompiling_measured() -> None:
    """Inductor's cache serves a graph compiled before in the run (the optimizer, accumulation and
    loader are not part of it): on an H100 ~10 s against ~30-42 s the first time. Until a second
    compilation of one graph is measured, every compilation costs what the first ones did."""
    first = _compiled(0, 40.0, per_device_train_batch_size=16)
    same_graph = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4}
    other_graph = {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 4}
    again = [first, _compiled(1, 8.0, per_device_train_batch_size=16, gradient_accumulation_steps=2)]
    # The second probe recompiled batch 16's graph in 8 s: that graph gets cheaper by about 32 s, batch 32's (never compiled) does not.
    cheaper_same = _compile_cost([first], **same_graph) - _compile_cost(again, **same_graph)
    cheaper_other = _compile_cost([first], **other_graph) - _compile_cost(again, **other_graph)
    assert cheaper_same - cheaper_other > 25.0 and abs(cheaper_other) < 10.0  # (the model mean moves a little)


def test_a_cheap_recompilation_with_one_attention_kernel_says_nothing_of_another() -> None:
    """On the H100 (pythia-160m) a checkpointed graph recompiled from inductor's cache in 11-14 s
    with eager attention and in 36-51 s, as if cold, with sdpa. A cheap recompilation measured with
    eager attention leaves an sdpa graph compiled before at the cold cost until one of its own is measured."""
    space = {**SPACE, "attn_implementation": ["eager", "sdpa"]}
    ckpt = {"per_device_train_batch_size": 16, "gradient_checkpointing": True}
    history = [_compiled(0, 45.0, attn_implementation="eager", **ckpt), _compiled(1, 45.0, attn_implementation="sdpa", **ckpt),
               _compiled(2, 12.0, attn_implementation="eager", gradient_accumulation_steps=2, **ckpt)]
    eager = _compile_cost(history, space, attn_implementation="eager", gradient_accumulation_steps=4, **ckpt)
    sdpa = _compile_cost(history, space, attn_implementation="sdpa", gradient_accumulation_steps=4, **ckpt)
    assert sdpa - eager > 25.0  # ~33 s: the measured 12 s against the cold 45 s
    history.append(_compiled(3, 12.0, attn_implementation="sdpa", gradient_accumulation_steps=2, **ckpt))
    sdpa_again = _compile_cost(history, space, attn_implementation="sdpa", gradient_accumulation_steps=4, **ckpt)
    assert sdpa - sdpa_again > 25.0


def test_the_time_kept_for_near_ties_is_left_by_exploring_probes_not_by_polishing() -> None:
    # With all the time left, bayes explores; when the loop keeps all but a minute of it for
    # re-measuring near-ties (kept_s), an exploring probe would eat that time: only a polishing one
    # (another compile mode, more accumulation, the model's pick) is proposed.
    history = [_ok(0, 50.0), _ok(1, 100.0, precision="bf16", per_device_train_batch_size=32),
               _ok(2, 120.0, wall_s=100.0, precision="bf16", per_device_train_batch_size=32, torch_compile="inductor")]

    def polishing(state: SearchState) -> tuple[TrialParams | None, bool]:
        strategy = BayesStrategy()
        proposal = strategy.propose(state)
        context = strategy.context(state)
        mean, sd = throughput.posterior(context, list(history))
        cost_ok, _ = probe_costs(context, list(history), mean)
        allowed = np.ones(context.grid.shape, dtype=bool)
        evidence = MemoryEvidence.of(context.groups, context.grid, history, state.ceiling_bytes)
        _, keep, _ = polish.polish_reserve(context, state, state.feasible(), (mean, sd), np.ones(context.grid.shape), cost_ok, allowed, evidence, 3600.0)
        index = context.grid.flat_index(proposal) if proposal is not None else None
        return proposal, index is not None and bool(np.broadcast_to(keep, context.grid.shape).reshape(-1)[index])

    free, free_polishes = polishing(_state(history, 3600.0, checkpointing=False))
    assert free is not None and not free_polishes
    kept = replace(_state(history, 3600.0, checkpointing=False), kept_s=3540.0)
    proposal, polishes = polishing(kept)
    assert proposal is not None and polishes


def _precision_state(history: list[Probe], precisions: list[str], **more: list) -> SearchState:
    space = parse_space({"per_device_train_batch_size": [4, 8, 16], "gradient_accumulation_steps": [1, 4],
                         "precision": precisions, "torch_compile": ["off", "inductor"], **more})
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    return SearchState(space, 40 * GiB, memory, history, {p.params.key() for p in history}, 1800.0)


def test_the_other_16_bit_format_is_measured_once_next_to_the_best_uncompiled_configuration() -> None:
    # bf16 runs, fp16 never did: the model's prior keeps them 2 % apart, and either can be several
    # percent faster, so fp16 is measured once, paired with the best uncompiled bf16 configuration
    # (cheap: no compilation), and its answer carries to the compiled ones through the model.
    history = [_ok(0, 100.0, precision="fp32", per_device_train_batch_size=8),
               _ok(1, 300.0, precision="bf16", per_device_train_batch_size=8),
               _ok(2, 320.0, precision="bf16", per_device_train_batch_size=16),
               _ok(3, 360.0, precision="bf16", per_device_train_batch_size=16, torch_compile="inductor")]
    proposal = BayesStrategy().propose(_precision_state(history, ["fp32", "fp16", "bf16"]))
    assert proposal == TrialParams(precision="fp16", per_device_train_batch_size=16)
    # Once anything ran in fp16 (here: it diverged, and this space has no other optimizer, kernel or
    # checkpointing to confirm it in), the question was asked; and with fp16 outside the space
    # there is no other format to ask about.
    diverged = Probe(4, proposal, ProbeResult(status="diverged"))
    for state in (_precision_state([*history, diverged], ["fp32", "fp16", "bf16"]), _precision_state(history, ["fp32", "bf16"])):
        again = BayesStrategy().propose(state)
        assert again is None or again.precision != "fp16"


def test_a_16_bit_format_that_failed_once_is_measured_once_more_in_a_context_its_failure_leaves_likely_to_run() -> None:
    # fp16 diverged next to the best bf16 configuration, with Adafactor: fp16 itself, or fp16 with
    # Adafactor (a common cause) is to blame. One failure is evidence, not a rule: fp16 is
    # measured once more with another optimizer, and a second failure ends the question.
    optims = {"optim": ["adafactor", "adamw_torch_fused"]}
    history = [_ok(0, 100.0, precision="fp32", optim="adafactor", per_device_train_batch_size=8),
               _ok(1, 300.0, precision="bf16", optim="adafactor", per_device_train_batch_size=8),
               _ok(2, 320.0, precision="bf16", optim="adafactor", per_device_train_batch_size=16),
               _ok(3, 360.0, precision="bf16", optim="adafactor", per_device_train_batch_size=16, torch_compile="inductor"),
               Probe(4, TrialParams(precision="fp16", optim="adafactor", per_device_train_batch_size=16), ProbeResult(status="diverged"))]
    proposal = BayesStrategy().propose(_precision_state(history, ["fp32", "fp16", "bf16"], **optims))
    assert proposal is not None and (proposal.precision, proposal.optim, proposal.torch_compile) == ("fp16", "adamw_torch_fused", "off")
    again = Probe(5, proposal, ProbeResult(status="diverged"))
    after = BayesStrategy().propose(_precision_state([*history, again], ["fp32", "fp16", "bf16"], **optims))
    assert after is None or after.precision != "fp16"


def test_a_question_near_the_incumbent_waits_for_the_most_valuable_polishing_probe_it_would_crowd_out() -> None:
    # A compiled incumbent; the loader's workers and accumulation were never changed next to it (two
    # compiled questions), and its max-autotune and accumulation variants keep their polishing time.
    # Where a question would leave too little time for the most valuable polishing probe, that probe
    # goes first (the question may follow in what it leaves); where both fit, the question goes first.
    from autotune.search.strategies.bayes import questions

    space = parse_space({"per_device_train_batch_size": [8, 16, 32], "gradient_accumulation_steps": [1, 4], "precision": ["fp32", "bf16"],
                         "torch_compile": ["off", "inductor", "inductor:max-autotune"], "dataloader_num_workers": [2, 8]})
    incumbent = {"precision": "bf16", "per_device_train_batch_size": 32, "dataloader_num_workers": 2}
    history = [_ok(0, 50.0, dataloader_num_workers=2), _ok(1, 100.0, **incumbent),
               _ok(2, 130.0, wall_s=150.0, torch_compile="inductor", **incumbent), _ok(3, 90.0, **{**incumbent, "per_device_train_batch_size": 16})]
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    strategy, state, context, model, cost_ok, allowed, evidence = _polish_inputs(space, history, memory)
    feasible = state.feasible()
    reserve, _, order = polish.polish_reserve(context, state, feasible, model, np.ones(context.grid.shape), cost_ok, allowed, evidence, 1800.0)
    question, question_s, asking_s = questions.coverage_question(context, state, evidence, feasible, allowed, cost_ok, 1800.0)
    assert order and question is not None and asking_s > question_s > 0 and context.grid.flat_index(question) not in order
    first_s = polish.kept_s(float(cost_ok.flat[order[0]]))

    def proposal(remaining_s: float) -> TrialParams | None:
        return strategy.propose(SearchState(space, 40 * GiB, memory, history, {p.params.key() for p in history}, remaining_s))

    both = question_s + first_s + 1.0
    assert both <= reserve + asking_s  # due: the questions and the polishing take more than is left
    assert proposal(both) == question
    assert proposal(question_s + first_s - 1.0) == context.grid.params_at(order[0])


def test_the_questions_are_asked_near_what_the_search_would_return_not_near_what_noise_put_first() -> None:
    # flash attention measured 5 % faster than sdpa at batches 8, 16 and 32; at batch 64 the noise put sdpa 1 % ahead.
    # Within the noise and equal for the prior, the ranking returns flash at 64 (by the search's estimate), so the
    # questions (here: the loader's workers and the optimizer, which no probe varied) are asked next to flash at 64.
    from autotune.search.strategies.bayes import questions

    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "precision": ["bf16"], "attn_implementation": ["sdpa", "flash_attention_2"],
                         "optim": ["adamw_torch_fused", "adamw_torch"], "dataloader_num_workers": [0, 4]})
    history = []
    for batch, sdpa in ((8, 50.0), (16, 70.0), (32, 85.0), (64, 93.0)):
        for attn, sps in (("sdpa", sdpa), ("flash_attention_2", 0.99 * sdpa if batch == 64 else 1.05 * sdpa)):
            history.append(_ok(len(history), sps, per_device_train_batch_size=batch, precision="bf16", attn_implementation=attn))
    memory = MemoryModel()
    memory.observe_all((p.params, p.result) for p in history)
    state = SearchState(space, 40 * GiB, memory, history, {p.params.key() for p in history}, 600.0)
    assert state.feasible()[0].params.attn_implementation == "sdpa"  # first by its measurement alone
    asked_near = []

    def spy(context, state, evidence, feasible, *args, **kwargs):
        asked_near.append(feasible[0].params)
        return ask(context, state, evidence, feasible, *args, **kwargs)

    ask = questions.coverage_question
    with mock.patch.object(questions, "coverage_question", spy):
        BayesStrategy().propose(state)
    flash_64 = TrialParams(per_device_train_batch_size=64, precision="bf16", attn_implementation="flash_attention_2")
    assert asked_near == [flash_64]


def test_checkpointing_is_not_asked_where_no_larger_batch_fits_with_it() -> None:
    # bf16 at batch 16 is the incumbent (batch 32 ran out of memory); its loader question was asked. Checkpointing
    # would be asked at batch 64, then 32 (a larger batch is what it can buy). Where checkpointed probes at those
    # batches ran out of memory beside another loader setting (which does not ask the question next to the
    # incumbent, and does not change device memory), neither fits: the question is not asked at all.
    from autotune.search.strategies.bayes import questions

    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "precision": ["fp32", "bf16"],
                         "gradient_checkpointing": [False, True], "dataloader_num_workers": [0, 4]})
    incumbent = {"precision": "bf16", "per_device_train_batch_size": 16}
    history = [_ok(0, 100.0, precision="fp32", per_device_train_batch_size=8), _ok(1, 300.0, **incumbent),
               _oom(2, precision="bf16", per_device_train_batch_size=32), _ok(3, 290.0, dataloader_num_workers=4, **incumbent)]
    checkpointed_ooms = [_oom(4 + i, precision="bf16", per_device_train_batch_size=batch, gradient_checkpointing=True, dataloader_num_workers=4)
                         for i, batch in enumerate((64, 32))]

    def question(probes: list[Probe]) -> TrialParams | None:
        memory = MemoryModel()
        memory.observe_all((p.params, p.result) for p in probes)
        _, state, context, _, cost_ok, allowed, evidence = _polish_inputs(space, probes, memory, ceiling_bytes=6 * GiB)
        assert state.feasible()[0].params == TrialParams(**incumbent)
        return questions.coverage_question(context, state, evidence, state.feasible(), allowed, cost_ok, 1800.0)[0]

    assert question(history) == TrialParams(precision="bf16", per_device_train_batch_size=64, gradient_checkpointing=True)
    assert question([*history, *checkpointed_ooms]) is None


def test_checkpointing_is_asked_at_a_larger_batch_only_where_it_likelier_fits_than_not() -> None:
    # GPT-2 at 1,024 tokens in bf16: batch 16 fits (15.6 GiB), batch 32 ran out of memory. The memory model (the
    # model's own dimensions) puts batch 32 checkpointed at 19.8 GiB, batch 64 at 36.5 GiB. Under a 21 GiB ceiling
    # batch 32 checkpointed likely fits and is the question; under 19.5 GiB it is a coin toss against it (P 0.48,
    # too close to rule out by prediction alone): the question is not asked, where a probe would likely be lost.
    from autotune.models import resolve_model
    from autotune.search.memory_prior import ModelDims
    from autotune.search.strategies.bayes import questions

    space = parse_space({"per_device_train_batch_size": [8, 16, 32, 64], "precision": ["fp32", "bf16"],
                         "gradient_checkpointing": [False, True], "dataloader_num_workers": [0, 4]})
    incumbent = TrialParams(precision="bf16", per_device_train_batch_size=16)

    def ran(number: int, sps: float, peak_gib: float, **values) -> Probe:
        probe = _ok(number, sps, **{**incumbent.flat(), **values})
        return replace(probe, result=replace(probe.result, peak_mem_bytes=int(peak_gib * GiB)))

    history = [ran(0, 100.0, 9.35, per_device_train_batch_size=8), ran(1, 150.0, 15.57),
               _oom(2, precision="bf16", per_device_train_batch_size=32),
               ran(3, 140.0, 15.57, dataloader_num_workers=4)]  # the loader's question, asked

    def question(ceiling_gib: float) -> TrialParams | None:
        memory = MemoryModel(ModelDims.from_spec(resolve_model("gpt2")), 1024)
        memory.observe_all((p.params, p.result) for p in history)
        _, state, context, _, cost_ok, allowed, evidence = _polish_inputs(space, history, memory, ceiling_bytes=int(ceiling_gib * GiB))
        assert state.feasible()[0].params == incumbent
        return questions.coverage_question(context, state, evidence, state.feasible(), allowed, cost_ok, 1800.0)[0]

    assert question(21.0) == incumbent.replace(per_device_train_batch_size=32, gradient_checkpointing=True)
    assert question(19.5) is None
