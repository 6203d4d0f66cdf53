# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Rolling-window draft KV slots.

Each retained request owns one slot: ``blocks_per_slot = window / block + 1``
physical KV blocks used as a ring, so position ``p`` of slot ``s`` lives in
block ``1 + s * blocks_per_slot + (p // block) % blocks_per_slot`` at offset
``p % block``. A slot therefore holds the last ``reach = window + block``
positions, enough for a full attention window at any block alignment. Block 0
is never handed out (reserved; padding rows of the reference engine's graphs
use slot 0 with no visible context and write nothing).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotGeometry:
    """Block layout of the draft KV cache for ``num_slots`` retained requests."""

    block_size: int
    window_size: int
    num_slots: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_slots <= 0:
            raise ValueError("block size and slot count must be positive")
        if self.window_size <= 0 or self.window_size % self.block_size:
            raise ValueError(
                f"window size {self.window_size} is not a positive multiple of "
                f"the block size {self.block_size}"
            )

    @property
    def blocks_per_slot(self) -> int:
        return self.window_size // self.block_size + 1

    @property
    def num_blocks(self) -> int:
        """Physical blocks including the reserved block 0."""
        return 1 + self.num_slots * self.blocks_per_slot

    @property
    def reach(self) -> int:
        """Positions a slot holds at once (``p`` and ``p + reach`` collide)."""
        return self.blocks_per_slot * self.block_size

    def physical_block(self, slot: int, position: int) -> int:
        """Physical block of ``position`` in ``slot``."""
        if not 0 <= slot < self.num_slots or position < 0:
            raise ValueError(f"slot {slot} / position {position} out of range")
        ring = (position // self.block_size) % self.blocks_per_slot
        return 1 + slot * self.blocks_per_slot + ring

    def slot_mapping(
        self, slots: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Flat cache indices (``block * block_size + offset``) of
        ``positions`` in ``slots`` (same shape, int64, any device)."""
        ring = torch.div(positions, self.block_size, rounding_mode="floor")
        ring = torch.remainder(ring, self.blocks_per_slot)
        block = 1 + slots * self.blocks_per_slot + ring
        return block * self.block_size + torch.remainder(positions, self.block_size)


class SlotAllocator:
    """Free-slot pool handing out the lowest free slot first."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots))
        self._num_slots = num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free draft KV slot")
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        if not 0 <= slot < self._num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        heapq.heappush(self._free, slot)
