"""Probes that span several processes: one per GPU (on a CPU, one per set of cores), launched by
``torch.distributed.run`` (torchrun), trained by the Trainer's own data-parallel set-up (accelerate's
DDP: NCCL on GPUs, gloo on the CPU).

Each rank is the ordinary probe child (:mod:`autotune.probe.child`) and writes its own result file
(:func:`rank_result_path`); the driver combines them (:func:`combine`): throughput is the sum over
the ranks, the peak memory checked against the ceiling the largest of any rank (each rank has its
own device), host memory the sum (they share the host), and any rank's out-of-memory is the probe's.
Ranks stop measuring together (:func:`agree`), or one would wait for the others' gradients forever.
A rank whose probe failed leaves with a non-zero exit code (:data:`FAILED_RANK_EXIT_CODE`), so
torchrun's agent ends the others (which would wait in a collective until their timeout), and the
driver kills the whole process group when the probe ends, as for any probe.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from autotune.records import ProbeResult, ProbeSpec, ProbeStatus

FAILED_RANK_EXIT_CODE = 3  # a rank whose probe failed (its result file says how); torchrun then ends the others
# Which outcome of several ranks is the probe's: the first of these any rank reported. An OOM on any rank
# means the configuration does not fit; a crash or divergence on one rank ends the others as collateral.
_STATUS_ORDER = (ProbeStatus.OOM, ProbeStatus.DIVERGED, ProbeStatus.CRASH, ProbeStatus.TIMEOUT)

# The variables torchrun sets in each worker (torch.distributed.run documentation, "Environment
# Variables"), and those accelerate also reads to find an MPI launch (accelerate/state.py,
# PartialState). A probe started from inside such a job would otherwise see itself as one rank of
# it, and accelerate would set up a process group (NCCL on a GPU) for a one-process probe.
DISTRIBUTED_ENV_VARS = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK",
    "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT",
    "PMI_RANK", "PMI_SIZE",
)
DISTRIBUTED_ENV_PREFIXES = ("TORCHELASTIC_", "OMPI_COMM_WORLD_", "MV2_COMM_WORLD_")


def is_distributed_var(name: str) -> bool:
    return name in DISTRIBUTED_ENV_VARS or name.startswith(DISTRIBUTED_ENV_PREFIXES)


def launched_as_ranks(spec: ProbeSpec) -> bool:
    """Whether a probe runs under torchrun: several processes, or a sharding engine that wants a process group (DeepSpeed)."""
    from autotune.sharding import needs_process_group

    return spec.nproc > 1 or needs_process_group(spec.params.sharding)


def this_rank() -> tuple[int, int]:
    """(rank, world size) as torchrun set them; (0, 1) outside a multi-process launch."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return (int(os.environ.get("RANK", "0") or 0), world) if world > 1 else (0, 1)


def local_rank() -> int:
    """This rank's GPU among the probe's visible ones (torchrun's ``LOCAL_RANK``); 0 outside a launch."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0) if this_rank()[1] > 1 else 0


def rank_result_path(result_path: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a multi-process probe writes its result (``result.json`` -> ``result.rank1.json``)."""
    path = Path(result_path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def probe_gpus(device: str, nproc: int) -> list[str]:
    """The GPUs a probe on ``device`` (``cuda`` or ``cuda:N``) with ``nproc`` ranks runs on: N, N+1, ... (this process's view)."""
    first = int(device.partition(":")[2] or 0)
    return [f"cuda:{first + i}" for i in range(nproc)]


def read_results(result_path: Path, nproc: int) -> list[ProbeResult | None]:
    """Each rank's result (None where a rank wrote none or an unreadable one); [] when no rank wrote any."""
    found: list[ProbeResult | None] = []
    for rank in range(nproc):
        try:
            found.append(ProbeResult.from_dict(json.loads(rank_result_path(result_path, rank).read_text(encoding="utf-8"))))
        except (OSError, json.JSONDecodeError, TypeError, ValueError):
            found.append(None)
    return found if any(r is not None for r in found) else []


def launch_command(python: str, nproc: int, spec_path: Path, result_path: Path, module: str = "autotune.probe") -> list[str]:
    """torchrun on this host alone (a rendezvous on a free local port), ``nproc`` ranks of ``python -m module SPEC RESULT``,
    no restarts (a probe that failed has its answer)."""
    return [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
        "-m", module, str(spec_path), str(result_path),
    ]


def agree(stop: bool) -> bool:
    """Whether any rank wants to stop (every rank calls this at the same optimizer step); ``stop`` alone outside a
    process group. On NCCL the flag travels on this rank's GPU."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return stop
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if stop else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def combine(results: Sequence[ProbeResult | None], nproc: int) -> ProbeResult:
    """The probe's result from its ranks' (None: a rank that wrote none, ended by torchrun after another failed).

    Every rank ok: ok, throughput summed, step time the slowest rank's, device peak the largest, host peak the sum, per-rank
    figures in ``extra["ranks"]``. Otherwise the first failure of :data:`_STATUS_ORDER` any rank reported, its error
    prefixed with the rank; with no rank reporting a failure but some missing, a crash.
    """
    found = {rank: r for rank, r in enumerate(results) if r is not None}
    ranks = [_rank_summary(rank, r) for rank, r in sorted(found.items())]
    for status in _STATUS_ORDER:
        failed = [(rank, r) for rank, r in sorted(found.items()) if r.status is status]
        if failed:
            rank, first = failed[0]
            return first.replace(error=f"rank {rank} of {nproc}: {first.error or status.value}", extra={**first.extra, "ranks": ranks},
                                 host_peak_rss_bytes=_sum_or_none(r.host_peak_rss_bytes for r in found.values()))
    missing = [rank for rank in range(nproc) if rank not in found]
    if missing:
        return ProbeResult(status=ProbeStatus.CRASH, error=f"rank(s) {', '.join(map(str, missing))} of {nproc} wrote no result",
                           extra={"ranks": ranks})
    oks = [found[rank] for rank in range(nproc)]
    lead = oks[0]
    samples = [r.samples_per_s or 0.0 for r in oks]
    total_samples = sum(samples)
    energies = [r.energy_per_sample_j for r in oks]
    energy_j = sum(e * s for e, s in zip(energies, samples) if e is not None)
    return lead.replace(
        samples_per_s=total_samples,
        tokens_per_s=_sum_or_none(r.tokens_per_s for r in oks),
        step_time_s=max(r.step_time_s or 0.0 for r in oks),
        measured_steps=min(r.measured_steps for r in oks),
        step_time_ci95_rel=_max_or_none(r.step_time_ci95_rel for r in oks),
        stable=all(r.stable for r in oks),
        peak_mem_bytes=_max_or_none(r.peak_mem_bytes for r in oks),
        peak_allocated_bytes=_max_or_none(r.peak_allocated_bytes for r in oks),
        peak_reserved_bytes=_max_or_none(r.peak_reserved_bytes for r in oks),
        peak_device_used_bytes=_max_or_none(r.peak_device_used_bytes for r in oks),
        num_alloc_retries=_sum_or_none(r.num_alloc_retries for r in oks),
        host_peak_rss_bytes=_sum_or_none(r.host_peak_rss_bytes for r in oks),
        setup_s=_max_or_none(r.setup_s for r in oks),
        warmup_s=_max_or_none(r.warmup_s for r in oks),
        achieved_tflops=_sum_or_none(r.achieved_tflops for r in oks),
        mfu=_mean_or_none(r.mfu for r in oks),
        gpu_util_mean_pct=_mean_or_none(r.gpu_util_mean_pct for r in oks),
        gpu_util_peak_pct=_max_or_none(r.gpu_util_peak_pct for r in oks),
        power_mean_w=_sum_or_none(r.power_mean_w for r in oks),
        energy_per_sample_j=energy_j / total_samples if total_samples > 0 and None not in energies else None,
        input_wait_fraction=_max_or_none(r.input_wait_fraction for r in oks),
        input_bound=any(r.input_bound for r in oks),
        extra={**lead.extra, "ranks": ranks},
    )


def _rank_summary(rank: int, r: ProbeResult) -> dict[str, object]:
    return {"rank": rank, "status": r.status.value, "samples_per_s": r.samples_per_s, "step_time_s": r.step_time_s,
            "peak_mem_bytes": r.peak_mem_bytes, "host_peak_rss_bytes": r.host_peak_rss_bytes}


def _present(values: object) -> list[float]:
    return [v for v in values if v is not None]  # type: ignore[attr-defined]


def _sum_or_none(values: object) -> float | None:
    present = _present(values)
    return type(present[0])(sum(present)) if present else None


def _max_or_none(values: object) -> float | None:
    present = _present(values)
    return max(present) if present else None


def _mean_or_none(values: object) -> float | None:
    present = _present(values)
    return sum(present) / len(present) if present else None
