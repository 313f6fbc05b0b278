"""The expert rule's configuration in a replay table: what ``bench.search`` and ``bench.landscapes2`` measure searches against."""

from __future__ import annotations

from typing import Any


class TableMemory:
    """A replay table's recorded peaks as the memory model :func:`autotune.search.expert.expert_params`
    reads (``largest_batch_that_fits``): the analytic model a real run has stands in for what was measured."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def largest_batch_that_fits(self, params: Any, batch_sizes: Any, ceiling_bytes: int) -> int | None:
        fitting = None
        for batch in sorted(batch_sizes):
            row = self.table.row(params.replace(per_device_train_batch_size=batch))
            if row is None or row["status"] == "oom" or (row["peak_mem_bytes"] == row["peak_mem_bytes"] and row["peak_mem_bytes"] > ceiling_bytes):
                break  # out of memory, or over the ceiling (a peak that is NaN, a crash's, says nothing)
            fitting = batch
        return fitting


def table_expert(table: Any, ceiling_bytes: int, memory: Any = None) -> Any:
    """The expert rule's configuration in a replay table's space, its batch from ``memory`` (a
    :class:`autotune.search.memory.MemoryModel`, where the replay knows the model's dimensions, as a run
    does), else from the table's recorded peaks."""
    from autotune.search.expert import expert_params

    space = table.space()
    default = space.baseline()
    base = default if space.contains(default) else space.complete({n: space.choices[n][0] for n in space.free_params})
    return expert_params(space, base, memory if memory is not None else TableMemory(table), ceiling_bytes)
