"""RowTable: per-request rows of ints kept across steps (a request's token ids, its KV block table).

A step never rebuilds them: the scheduler sends only what a row lacks (`ScheduledRequest.new_token_ids` at
`token_start`, `new_block_ids` at `block_start`), and `write` cuts the row there and appends. The step's
inputs are then gathered from the rows with numpy fancy indexing (worker/inputs.py), and those gathered
arrays, not these, travel to the device in the step's one upload (worker/upload.py: one pinned staging
buffer on CUDA), so the rows themselves stay in pageable host memory: pinning them would buy nothing.
"""

from __future__ import annotations

import numpy as np


class RowTable:
    """A [rows, width] int64 array whose rows grow at their tail; `lens[r]` is row r's length."""

    def __init__(self, rows: int, width: int = 16) -> None:
        self.array = np.zeros((rows, width), dtype=np.int64)
        self.lens = np.zeros(rows, dtype=np.int64)

    def write(self, row: int, start: int, values: list[int]) -> None:
        """Cut row `row` to `start` entries, then append `values` (an empty list only cuts)."""
        end = start + len(values)
        if end > self.array.shape[1]:
            self._widen(end)
        if values:
            self.array[row, start:end] = values
        self.lens[row] = end

    def clear(self, row: int) -> None:
        """A freed row (its entries stay, unread: every reader is bounded by lens or by a position)."""
        self.lens[row] = 0

    def grow_rows(self, rows: int) -> None:
        """Room for `rows` rows (new rows are empty)."""
        old = self.array.shape[0]
        if rows > old:
            self.array = np.concatenate([self.array, np.zeros((rows - old, self.array.shape[1]), np.int64)])
            self.lens = np.concatenate([self.lens, np.zeros(rows - old, np.int64)])

    def _widen(self, width: int) -> None:
        new = np.zeros((self.array.shape[0], max(width, 2 * self.array.shape[1])), dtype=np.int64)
        new[:, :self.array.shape[1]] = self.array
        self.array = new
