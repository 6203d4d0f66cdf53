# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Projected-context cache: the draft's combined hidden rows per request.

Each retained request's slot owns a ring of ``budget`` rows on the engine's
device; position ``p`` lives at row ``p % budget``. Rows are written in
position order from the request's first cached position ``rows_start``, so a
request with valid positions ending at ``end`` whose highest written position
is ``high - 1`` (``high > end`` after a rewind) has the rows
``[covered_start(rows_start, high, budget), end)`` cached. RECONNECT rebuilds a
request's draft KV from these rows.
"""

from __future__ import annotations

import torch


def covered_start(start: int, high: int, budget: int) -> int:
    """First cached position of a request whose rows were written from
    ``start`` up to ``high`` (exclusive)."""
    return max(start, high - budget)


class ContextCache:
    """``num_slots`` rings of ``budget`` rows of width ``hidden_size``, and
    one scratch row after them that writes of padding rows may target."""

    def __init__(
        self,
        num_slots: int,
        budget: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if budget <= 0:
            raise ValueError("the context cache budget must be positive")
        self.budget = budget
        self.scratch_row = num_slots * budget
        self.rows = torch.zeros(
            num_slots * budget + 1, hidden_size, dtype=dtype, device=device
        )

    @staticmethod
    def bytes_needed(
        num_slots: int, budget: int, hidden_size: int, dtype: torch.dtype
    ) -> int:
        return (num_slots * budget + 1) * hidden_size * dtype.itemsize

    def index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat row indices of ``positions`` in ``slots`` (same device)."""
        return slots * self.budget + torch.remainder(positions, self.budget)

    def write(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` at flat ``index`` (see ``index``, or the scratch
        row); indices other than the scratch row's must be distinct, i.e. at
        most ``budget`` consecutive positions per slot."""
        self.rows.index_copy_(0, index, rows.to(self.rows.dtype))

    def _range_index(self, slot: int, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end, device=self.rows.device)
        return slot * self.budget + torch.remainder(positions, self.budget)

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Rows of positions ``[start, end)`` of ``slot`` (at most ``budget``)."""
        if end - start > self.budget:
            raise ValueError("range exceeds the cache budget")
        return self.rows.index_select(0, self._range_index(slot, start, end))

    def copy(self, src_slot: int, dst_slot: int, start: int, end: int) -> None:
        """Copy positions ``[start, end)`` from ``src_slot`` to ``dst_slot``."""
        if src_slot != dst_slot:
            rows = self.read(src_slot, start, end)
            self.write(self._range_index(dst_slot, start, end), rows)
