"""Which rows of a runner hold a sequence, for continuous batching (the serving engine, specdec_ext/serve/).

``start(prompts)`` fills rows 0..B-1. ``start_rows(rows, prompts)`` prefills some free rows while the
others keep their caches, and ``free_rows(rows)`` releases rows at once. A forward covers rows
0..width-1, where the width is one past the highest row in use; a free row inside it is empty (length
0), and the caller freezes it (it commits nothing). Lowest-free-row allocation by the caller keeps the
width close to the number of rows in use.
"""
from __future__ import annotations

from typing import List, Sequence


class RowsInUse:
    """The set of rows that hold a sequence, and the batch width it implies."""

    def __init__(self, max_rows: int):
        self.max_rows = int(max_rows)
        self._used: set = set()

    @property
    def width(self) -> int:
        """Rows a forward covers: one past the highest row in use (0 when none is)."""
        return max(self._used) + 1 if self._used else 0

    @property
    def rows(self) -> List[int]:
        """The rows in use, ascending."""
        return sorted(self._used)

    def __contains__(self, row: int) -> bool:
        return row in self._used

    def reset(self, batch: int) -> None:
        """``start``: rows 0..batch-1 in use, the rest free."""
        self._used = set(range(batch))

    def check_free(self, op: str, rows: Sequence[int], num_prompts: int) -> List[int]:
        """``rows`` as ints, one per prompt, each free and in range (ValueError naming the row
        otherwise): what a runner checks before it writes a joining row's cache."""
        if len(rows) != num_prompts:
            raise ValueError(f"{op}: {len(rows)} rows for {num_prompts} prompts")
        rows = self._checked(op, rows)
        taken = [r for r in rows if r in self._used]
        if taken:
            raise ValueError(f"{op}: row {taken[0]} is in use (free_rows it first)")
        return rows

    def check_used(self, op: str, rows: Sequence[int], num_chunks: int) -> List[int]:
        """``rows`` as ints, one per chunk, each in use (ValueError naming the row otherwise): what a
        runner checks before it extends a row's cache (``extend_rows``)."""
        if len(rows) != num_chunks:
            raise ValueError(f"{op}: {len(rows)} rows for {num_chunks} chunks")
        rows = self._checked(op, rows)
        idle = [r for r in rows if r not in self._used]
        if idle:
            raise ValueError(f"{op}: row {idle[0]} is not in use (start_rows it first)")
        return rows

    def add(self, rows: Sequence[int]) -> None:
        """Mark rows (checked by ``check_free``) in use."""
        self._used.update(rows)

    def remove(self, op: str, rows: Sequence[int]) -> List[int]:
        """Mark rows free; raises ValueError naming the row when one is not in use."""
        rows = self._checked(op, rows)
        idle = [r for r in rows if r not in self._used]
        if idle:
            raise ValueError(f"{op}: row {idle[0]} is not in use")
        self._used.difference_update(rows)
        return rows

    def _checked(self, op: str, rows: Sequence[int]) -> List[int]:
        rows = [int(r) for r in rows]
        if not rows:
            raise ValueError(f"{op}: no rows")
        if len(set(rows)) != len(rows):
            raise ValueError(f"{op}: rows {rows} repeat a row")
        bad = [r for r in rows if not 0 <= r < self.max_rows]
        if bad:
            raise ValueError(f"{op}: row {bad[0]} is outside [0, {self.max_rows})")
        return rows
