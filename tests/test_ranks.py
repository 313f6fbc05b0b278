"""Probes of several processes (``--nproc-per-probe``): torchrun, DDP on gloo, one result from the ranks' results."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from autotune.api import plan_evaluator
from autotune.errors import EXIT_USAGE, UsageError
from autotune.models import resolve_model
from autotune.options import RunOptions
from autotune.params import TrialParams
from autotune.plan import plan_run
from autotune.probe import isolation, ranks
from autotune.records import ProbeResult, ProbeSpec, ProbeStatus
from autotune.studies import opening
from autotune.studies.reading import killed

RANK_OOM = Path(__file__).parent / "data" / "trainers" / "rank_oom.py"


def _ok(samples_per_s: float, peak: int, host: int, step_s: float) -> ProbeResult:
    return ProbeResult(status=ProbeStatus.OK, samples_per_s=samples_per_s, tokens_per_s=samples_per_s * 32, step_time_s=step_s,
                       measured_steps=5, peak_mem_bytes=peak, host_peak_rss_bytes=host, stable=True, extra={"step_times_s": [step_s]})


# ---- combining the ranks' results (pure) -------------------------------------------------------------


def test_ranks_that_all_ran_add_throughput_and_host_memory_and_take_the_largest_device_peak() -> None:
    combined = ranks.combine([_ok(50.0, 700, 900, 0.16), _ok(48.0, 750, 950, 0.17)], 2)
    assert combined.status is ProbeStatus.OK
    assert combined.samples_per_s == pytest.approx(98.0)
    assert combined.tokens_per_s == pytest.approx(98.0 * 32)
    assert combined.peak_mem_bytes == 750  # each rank has its own device: the ceiling binds the fullest
    assert combined.host_peak_rss_bytes == 1850  # they share the host
    assert combined.step_time_s == pytest.approx(0.17)
    assert [r["rank"] for r in combined.extra["ranks"]] == [0, 1]


def test_an_oom_on_any_rank_is_the_probes_oom_whatever_the_others_said() -> None:
    # Rank 0 lost its peer in the all-reduce (a crash), rank 1 ran out of memory: the configuration does not fit.
    crash = ProbeResult(status=ProbeStatus.CRASH, error="gloo: connection closed by peer", host_peak_rss_bytes=400)
    oom = ProbeResult(status=ProbeStatus.OOM, error="OutOfMemoryError: CUDA out of memory", host_peak_rss_bytes=500)
    combined = ranks.combine([crash, oom], 2)
    assert combined.status is ProbeStatus.OOM
    assert combined.error.startswith("rank 1 of 2: OutOfMemoryError")
    assert combined.host_peak_rss_bytes == 900


def test_a_rank_without_a_result_and_no_failure_reported_is_a_crash() -> None:
    combined = ranks.combine([_ok(50.0, 700, 900, 0.16), None], 2)
    assert combined.status is ProbeStatus.CRASH
    assert "rank(s) 1 of 2 wrote no result" in combined.error


def test_each_rank_writes_its_own_result_file_and_the_driver_reads_them_all(tmp_path) -> None:
    result = tmp_path / "result.json"
    assert ranks.rank_result_path(result, 1) == tmp_path / "result.rank1.json"
    assert ranks.read_results(result, 2) == []  # no rank wrote: the caller reads the launcher's output instead
    ranks.rank_result_path(result, 1).write_text(__import__("json").dumps(_ok(1.0, 1, 1, 1.0).to_dict()))
    found = ranks.read_results(result, 2)
    assert found[0] is None and found[1] is not None and found[1].samples_per_s == 1.0


def test_the_launch_is_torchrun_on_this_host_without_restarts(tmp_path) -> None:
    argv = ranks.launch_command("/usr/bin/python3", 4, tmp_path / "s.json", tmp_path / "r.json")
    assert argv[:3] == ["/usr/bin/python3", "-m", "torch.distributed.run"]
    assert "--standalone" in argv and "--nproc-per-node=4" in argv and "--max-restarts=0" in argv
    assert argv[-4:] == ["-m", "autotune.probe", str(tmp_path / "s.json"), str(tmp_path / "r.json")]
    assert ranks.probe_gpus("cuda:2", 3) == ["cuda:2", "cuda:3", "cuda:4"]
    assert ranks.probe_gpus("cuda", 2) == ["cuda:0", "cuda:1"]


def test_outside_a_launch_a_process_is_rank_0_of_1_and_decides_alone(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert ranks.this_rank() == (0, 1) and ranks.local_rank() == 0
    assert ranks.agree(True) is True and ranks.agree(False) is False
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.this_rank() == (3, 4) and ranks.local_rank() == 1


# ---- planning ------------------------------------------------------------------------------------


def _options(**overrides) -> RunOptions:
    return RunOptions(**{"model": "tiny-gptneox", "space": "quick", "seq_len": 32, "device": "cpu", "n_trials": 1,
                         "storage": "sqlite:///:memory:", **overrides})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"nproc_per_probe": 0}, "--nproc-per-probe must be at least 1"),
    ({"nproc_per_probe": (os.cpu_count() or 1) + 1}, "each process needs a core"),
    ({"nproc_per_probe": 2, "effective_batch_size": 15}, "--effective-batch-size 15 is not a multiple of --nproc-per-probe 2"),
])
def test_processes_per_probe_this_machine_cannot_run_are_one_line_naming_the_fix(overrides, message) -> None:
    with pytest.raises(UsageError, match=message) as caught:
        plan_run(_options(**overrides))
    assert caught.value.exit_code == EXIT_USAGE
    assert "\n" not in str(caught.value)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two probe processes need two cores")
def test_the_processes_per_probe_reach_the_probe_and_the_studys_identity() -> None:
    one, two = plan_run(_options()), plan_run(_options(nproc_per_probe=2))
    assert plan_evaluator(two).spec_for(TrialParams()).nproc == 2
    assert plan_evaluator(one).spec_for(TrialParams()).nproc == 1
    assert two.study_name.endswith("-cpux2") and not one.study_name.endswith("x2")
    # On a CPU the ranks share the host: each gets its share of the default ceiling.
    assert two.memory_ceiling_bytes == pytest.approx(one.memory_ceiling_bytes / 2, rel=1e-6)
    attrs_one, attrs_two = one.study_attrs(None), two.study_attrs(None)
    assert opening.mismatch(attrs_one, attrs_two) == "was made with a different nproc_per_probe"
    # --effective-batch-size counts the samples of every process: each of two ranks takes half of it.
    shared = plan_run(_options(nproc_per_probe=2, effective_batch_size=16))
    assert shared.space.effective_batch_size == 8 and shared.study_attrs(None)["effective_batch_size"] == 16
    assert shared.baseline.effective_batch_size == 8 and shared.study_name.endswith("-cpux2-ebs16")
    legacy = {k: v for k, v in attrs_one.items() if k != "nproc_per_probe"}  # a study made before the key existed
    assert opening.mismatch(legacy, attrs_one) is None
    assert opening.mismatch(legacy, attrs_two) is not None


# ---- real probes of two processes (torchrun, DDP on gloo) -----------------------------------------------


def _probe_processes() -> list[psutil.Process]:
    """Every process on this machine still running a probe of this test process (its folder names our pid)."""
    mark = f"{isolation.PROBE_DIR_PREFIX}{os.getpid()}-"
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(mark in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


@pytest.mark.slow
def test_a_two_process_probe_trains_data_parallel_and_sums_its_ranks() -> None:
    spec = ProbeSpec(model=resolve_model("tiny-gptneox").to_dict(), params=TrialParams(per_device_train_batch_size=4),
                     seq_len=32, device="cpu", warmup_steps=1, measure_steps=3, nproc=2)
    result = isolation.run_isolated(spec, timeout_s=600)
    assert result.status is ProbeStatus.OK, result.error
    per_rank = result.extra["ranks"]
    assert [r["status"] for r in per_rank] == ["ok", "ok"]
    assert result.samples_per_s == pytest.approx(sum(r["samples_per_s"] for r in per_rank))
    assert result.peak_mem_bytes == max(r["peak_mem_bytes"] for r in per_rank)
    assert result.host_peak_rss_bytes == sum(r["host_peak_rss_bytes"] for r in per_rank)
    assert _probe_processes() == []


@pytest.mark.slow
def test_an_oom_on_rank_1_ends_every_rank_and_comes_back_as_the_probes_oom() -> None:
    # Rank 0 waits for rank 1's gradients, which never come: the probe must still end, as an OOM, with no process left.
    spec = ProbeSpec(model={}, params=TrialParams(per_device_train_batch_size=4), seq_len=32, device="cpu",
                     warmup_steps=1, measure_steps=3, nproc=2, trainer=f"{RANK_OOM}:make_trainer")
    result = isolation.run_isolated(spec, timeout_s=600)
    assert result.status is ProbeStatus.OOM, result.error
    assert result.error.startswith("rank 1 of 2: OutOfMemoryError")
    assert {r["rank"]: r["status"] for r in result.extra["ranks"]}.get(1) == "oom"
    assert _probe_processes() == []


@pytest.mark.slow
@pytest.mark.parametrize("nproc, sharding", [(2, "none"), (1, "zero2")])
def test_a_rank_killed_by_sigkill_is_named_so_and_probed_once_more(nproc, sharding, monkeypatch) -> None:
    # torchrun exits 1 when a rank dies of a signal; the probe says which, as a lone process's exit code does (an
    # H200's fp32 zero3_offload probe, 2026-11-28, said "exited with code 1").
    monkeypatch.setattr(isolation, "host_oom_kills", lambda: 0)  # the kernel's OOM killer ended nothing meanwhile
    spec = ProbeSpec(model={}, params=TrialParams(per_device_train_batch_size=4, sharding=sharding), seq_len=32, device="cpu",
                     warmup_steps=1, measure_steps=3, nproc=nproc, trainer=f"{RANK_OOM}:make_killed_trainer")
    result = isolation.run_isolated(spec, timeout_s=600)
    assert killed(result), result.error  # says nothing yet of the configuration: probed once more
    assert result.error.startswith("probe process killed by SIGKILL (the kernel's OOM killer?)"), result.error
    assert _probe_processes() == []


@pytest.mark.slow
@pytest.mark.parametrize("nproc, sharding", [(1, "none"), (2, "none")])
def test_a_probe_the_kernels_oom_killer_ended_is_out_of_host_memory(nproc, sharding, monkeypatch) -> None:
    # Where the machine's count of OOM kills went up while the probe ran, its SIGKILL was the kernel's OOM killer: the
    # configuration does not fit this host (not probed again), whether one process or a rank of several died.
    counts = iter([7, 8])
    monkeypatch.setattr(isolation, "host_oom_kills", lambda: next(counts))
    spec = ProbeSpec(model={}, params=TrialParams(per_device_train_batch_size=4, sharding=sharding), seq_len=32, device="cpu",
                     warmup_steps=1, measure_steps=3, nproc=nproc, trainer=f"{RANK_OOM}:make_killed_trainer")
    result = isolation.run_isolated(spec, timeout_s=600)
    assert result.status is ProbeStatus.OOM and not killed(result), result.error
    assert result.error.startswith("host memory: the kernel's OOM killer ended the probe (oom_kill in /proc/vmstat 7 -> 8)")
    assert _probe_processes() == []


def test_gpus_split_into_workers_of_as_many_consecutive_gpus_as_a_probe_spans() -> None:
    from autotune.workers import worker_devices

    assert worker_devices([0, 1, 2, 3]) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert worker_devices([0, 1, 2, 3], 2) == ["cuda:0", "cuda:2"]  # each worker probes on its GPU and the next
    assert worker_devices([4, 5, 6, 7], 4) == ["cuda:4"]
    for gpus, n in (([0, 1, 2], 2), ([0, 2, 4, 6], 2), ([1, 0], 2)):
        with pytest.raises(UsageError, match=f"does not split into workers of {n} consecutive GPUs"):
            worker_devices(gpus, n)
