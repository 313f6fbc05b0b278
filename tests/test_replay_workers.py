"""N virtual workers on one shared virtual clock (issue #12): the clock itself, and a small
end-to-end run of bench/workers.py. No wall-clock asserts."""

from __future__ import annotations

import threading

import pytest

from autotune.space import SearchSpace
from bench.virtual_clock import SharedVirtualClock
from bench.workers import TARGET, World, family_world, simulate


def _run_workers(clock: SharedVirtualClock, plans: list[list[float]], log: list[tuple[float, int, str]]) -> None:
    """Worker i sleeps plans[i][0], then plans[i][1], ... and leaves; ``log`` gets (time, worker, event)."""

    def work(worker: int) -> None:
        clock.start(worker)
        try:
            for cost in plans[worker]:
                log.append((clock.now(), worker, "start"))
                clock.sleep(worker, cost)
                log.append((clock.now(), worker, "end"))
        finally:
            clock.done(worker)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(len(plans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "the simulation deadlocked"


@pytest.mark.parametrize("serial", [True, False])
def test_probes_complete_in_order_of_their_end_time(serial: bool) -> None:
    clock = SharedVirtualClock(3, serial=serial)
    log: list[tuple[float, int, str]] = []
    _run_workers(clock, [[30.0], [10.0, 5.0], [20.0]], log)
    ends = [(t, w) for t, w, event in log if event == "end"]
    assert sorted(ends) == [(10.0, 1), (15.0, 1), (20.0, 2), (30.0, 0)]
    assert [w for _, w in ends] == [1, 1, 2, 0]  # the log is in completion order
    assert clock.now() == 30.0 and clock.states() == ["done"] * 3


def test_the_clock_moves_only_when_every_worker_waits() -> None:
    clock = SharedVirtualClock(2)
    released = threading.Event()
    times: dict[str, float] = {}

    def slow_decider() -> None:  # blocks at once for 10 s, after which it decides
        clock.start(0)
        clock.sleep(0, 10.0)
        times["0 woke"] = clock.now()
        clock.done(0)

    def deciding() -> None:  # decides (in real time) until released, then probes 1 s
        clock.start(1)
        released.wait(timeout=30)
        times["1 decided"] = clock.now()
        clock.sleep(1, 1.0)
        times["1 woke"] = clock.now()
        clock.done(1)

    threads = [threading.Thread(target=slow_decider, daemon=True), threading.Thread(target=deciding, daemon=True)]
    for thread in threads:
        thread.start()
    for _ in range(50):  # worker 0 is blocked, worker 1 still decides: the clock stands still
        assert clock.now() == 0.0
        threading.Event().wait(0.002)
    assert "0 woke" not in times
    released.set()
    for thread in threads:
        thread.join(timeout=30)
    assert times == {"1 decided": 0.0, "1 woke": 1.0, "0 woke": 10.0}


def test_a_worker_that_has_not_started_holds_the_clock() -> None:
    clock = SharedVirtualClock(2)
    log: list[tuple[float, int, str]] = []

    def work() -> None:
        clock.start(0)
        clock.sleep(0, 5.0)
        log.append((clock.now(), 0, "end"))
        clock.done(0)

    first = threading.Thread(target=work, daemon=True)
    first.start()
    threading.Event().wait(0.05)
    assert clock.now() == 0.0 and not log  # worker 1 has not entered yet
    clock.done(1)  # it never will: leaving releases the clock
    first.join(timeout=30)
    assert log == [(5.0, 0, "end")]


def test_a_finished_worker_releases_the_others() -> None:
    clock = SharedVirtualClock(3)
    log: list[tuple[float, int, str]] = []
    _run_workers(clock, [[], [7.0], [3.0, 3.0]], log)  # worker 0 leaves at once, 2 before 1
    assert [(t, w) for t, w, event in log if event == "end"] == [(3.0, 2), (6.0, 2), (7.0, 1)]
    assert clock.states() == ["done"] * 3


def test_workers_due_at_the_same_time_decide_one_at_a_time_in_the_order_they_blocked() -> None:
    clock = SharedVirtualClock(3)
    deciding_now: list[int] = []
    overlaps: list[int] = []
    order: list[int] = []

    def work(worker: int) -> None:
        clock.start(worker)
        clock.sleep(worker, 4.0)
        deciding_now.append(worker)
        overlaps.append(len(deciding_now))
        order.append(worker)
        threading.Event().wait(0.01)  # decide a while in real time: nobody else may meanwhile
        deciding_now.remove(worker)
        clock.done(worker)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert overlaps == [1, 1, 1] and clock.now() == 4.0
    assert sorted(order) == [0, 1, 2]


def test_sleep_needs_a_deciding_worker() -> None:
    clock = SharedVirtualClock(1)
    with pytest.raises(RuntimeError, match="not deciding"):
        clock.sleep(0, 1.0)


# ---------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def draw_1() -> World:
    """Design draw 1 over a 2,304-configuration space (load_space would import transformers: seconds)."""
    space = SearchSpace(name="workers-test", choices={
        "per_device_train_batch_size": (1, 2, 4, 8, 16, 32), "gradient_accumulation_steps": (1,),
        "precision": ("fp32", "tf32", "bf16", "fp16"), "optim": ("adamw_torch", "adamw_torch_fused", "adafactor"),
        "torch_compile": ("off", "inductor"), "attn_implementation": ("eager", "sdpa"), "dataloader_num_workers": (0, 2),
        "gradient_checkpointing": (False, True),
    })
    return family_world(1, space)


@pytest.mark.parametrize("serial", [True, False])
def test_two_workers_on_one_family_draw_probe_no_configuration_twice(serial: bool, draw_1: World) -> None:
    run = simulate(draw_1, 2, budget_s=30 * 60, seed=0, serial=serial, full=True)
    assert run.errors == []
    assert run.duplicate_probes == 0
    assert run.unfinished_trials == 0 and run.interrupted_trials == 0  # every trial finished, none cut
    assert sorted(run.stopped) == ["budget", "budget"]
    assert run.probes >= 10
    assert run.virtual_s <= 30 * 60  # the budget is on the shared clock
    assert run.repeats == 0
    assert run.remeasures > 0  # near-ties were re-measured, each (configuration, round) by one worker only


def test_the_time_to_target_is_when_the_study_first_held_a_configuration_within_2_percent(draw_1: World) -> None:
    run = simulate(draw_1, 2, budget_s=120 * 60, seed=0)
    assert run.errors == [] and run.duplicate_probes == 0 and run.unfinished_trials == 0
    assert run.time_to_target_s is not None and 0 < run.time_to_target_s <= run.virtual_s
    assert run.final_ratio >= TARGET  # it stopped at the target
    assert run.interrupted_trials <= 2  # at most the probe each worker had started when it was reached
