"""The probe's CUDA memory accounting, as pure functions of NVML and allocator readings (fake numbers)."""

from __future__ import annotations

import pytest

from autotune.probe.memory import (
    NON_ALLOCATOR_HEADROOM_BYTES,
    allocator_cap_bytes,
    non_allocator_bytes,
    reported_peak_bytes,
)
from autotune.records import ProbeResult

MiB, GiB = 2**20, 2**30


def test_baseline_is_what_nvml_sees_outside_the_allocator() -> None:
    # 1 GiB used by others before our context; after init and a matmul NVML says 2.6 GiB, of which
    # the allocator holds 32 MiB (the cuBLAS workspace and the test tensors' block).
    assert non_allocator_bytes(1 * GiB, int(2.6 * GiB), 32 * MiB) == int(2.6 * GiB) - GiB - 32 * MiB
    assert non_allocator_bytes(None, 2 * GiB, 0) is None  # no NVML: unknown, not zero
    assert non_allocator_bytes(1 * GiB, None, 0) is None
    assert non_allocator_bytes(2 * GiB, 1 * GiB, 0) == 0  # another process freed memory meanwhile


def test_allocator_cap_leaves_room_for_everything_outside_it() -> None:
    ceiling = 40 * GiB
    cap = allocator_cap_bytes(ceiling, used_before_cuda_bytes=1 * GiB, non_allocator=600 * MiB)
    assert cap == ceiling - 1 * GiB - 600 * MiB - NON_ALLOCATOR_HEADROOM_BYTES
    assert allocator_cap_bytes(ceiling, None, None, headroom_bytes=0) == ceiling
    assert allocator_cap_bytes(1 * GiB, 1 * GiB, 600 * MiB) == 0  # nothing left: every allocation OOMs


@pytest.mark.parametrize("outside_later", [0, NON_ALLOCATOR_HEADROOM_BYTES])
def test_an_allocator_filled_to_its_cap_stays_under_the_ceiling(outside_later) -> None:
    # The case that used to finish ok over the ceiling: the allocator fills its cap, then kernels and
    # handles loaded later take up to the headroom outside it.
    ceiling, before, outside = 20 * GiB, 700 * MiB, 1100 * MiB
    cap = allocator_cap_bytes(ceiling, before, outside)
    nvml_peak = before + outside + outside_later + cap
    peak = reported_peak_bytes(nvml_peak, before, outside, max_reserved_bytes=cap)
    assert peak == nvml_peak <= ceiling
    assert ProbeResult(status="ok", peak_mem_bytes=peak).fits(ceiling)


def test_reported_peak_never_undercounts() -> None:
    before, outside, reserved = 500 * MiB, 1 * GiB, 10 * GiB
    # NVML sampled between two allocator peaks: the allocator's peak plus the outside memory wins.
    assert reported_peak_bytes(8 * GiB, before, outside, reserved) == before + outside + reserved
    # NVML saw more than we accounted for (memory taken outside the allocator after the baseline).
    assert reported_peak_bytes(13 * GiB, before, outside, reserved) == 13 * GiB
    assert reported_peak_bytes(None, None, None, reserved) == reserved  # no NVML at all


def test_over_the_ceiling_is_reported_as_such() -> None:
    # If more than the headroom appears outside the allocator, the number says so and the probe does not fit.
    ceiling, before, outside = 20 * GiB, 0, 1 * GiB
    cap = allocator_cap_bytes(ceiling, before, outside)
    nvml_peak = before + outside + cap + NON_ALLOCATOR_HEADROOM_BYTES + 64 * MiB
    peak = reported_peak_bytes(nvml_peak, before, outside, cap)
    assert peak > ceiling and not ProbeResult(status="ok", peak_mem_bytes=peak).fits(ceiling)
