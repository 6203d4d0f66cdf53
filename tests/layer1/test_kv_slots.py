# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Rolling-window draft KV slots."""

import pytest
import torch

from vllm.k3_draft.kv_slots import SlotAllocator, SlotGeometry


def test_slot_holds_window_over_block_plus_one_blocks():
    geometry = SlotGeometry(block_size=16, window_size=64, num_slots=3)
    assert geometry.blocks_per_slot == 5
    assert geometry.num_blocks == 1 + 3 * 5
    assert geometry.reach == 80


@pytest.mark.parametrize("window", [0, -16, 24, 100])
def test_window_must_be_a_positive_multiple_of_the_block(window):
    with pytest.raises(ValueError, match="multiple"):
        SlotGeometry(block_size=16, window_size=window, num_slots=1)


@pytest.mark.parametrize(("block", "slots"), [(0, 1), (-4, 1), (4, 0), (4, -1)])
def test_block_size_and_slot_count_must_be_positive(block, slots):
    with pytest.raises(ValueError, match="positive"):
        SlotGeometry(block_size=block, window_size=8, num_slots=slots)


def test_physical_block_follows_the_ring_formula():
    geometry = SlotGeometry(block_size=16, window_size=64, num_slots=4)
    for slot in range(4):
        for position in range(0, 500, 7):
            expected = 1 + slot * 5 + (position // 16) % 5
            assert geometry.physical_block(slot, position) == expected


@pytest.mark.parametrize(("slot", "position"), [(-1, 0), (4, 0), (0, -1)])
def test_physical_block_refuses_a_slot_or_position_out_of_range(slot, position):
    geometry = SlotGeometry(block_size=16, window_size=64, num_slots=4)
    with pytest.raises(ValueError, match="out of range"):
        geometry.physical_block(slot, position)


def test_block_zero_is_never_handed_out():
    geometry = SlotGeometry(block_size=4, window_size=8, num_slots=6)
    blocks = {
        geometry.physical_block(slot, position)
        for slot in range(6)
        for position in range(100)
    }
    assert 0 not in blocks and blocks == set(range(1, geometry.num_blocks))


def test_slot_mapping_matches_physical_block_and_offset():
    geometry = SlotGeometry(block_size=16, window_size=32, num_slots=5)
    slots = torch.tensor([0, 4, 2, 3])
    positions = torch.tensor([0, 17, 1000, 47])
    mapping = geometry.slot_mapping(slots, positions).tolist()
    expected = [
        geometry.physical_block(s, p) * 16 + p % 16
        for s, p in zip(slots.tolist(), positions.tolist())
    ]
    assert mapping == expected


def test_positions_within_reach_never_collide():
    geometry = SlotGeometry(block_size=8, window_size=32, num_slots=2)
    positions = torch.arange(123, 123 + geometry.reach)
    mapping = geometry.slot_mapping(torch.ones_like(positions), positions)
    assert mapping.unique().numel() == geometry.reach


def test_slots_never_share_cache_positions():
    geometry = SlotGeometry(block_size=8, window_size=16, num_slots=3)
    positions = torch.arange(0, geometry.reach)
    owned = [
        set(geometry.slot_mapping(torch.full_like(positions, s), positions).tolist())
        for s in range(3)
    ]
    assert not (owned[0] & owned[1] or owned[1] & owned[2] or owned[0] & owned[2])


def test_allocator_hands_out_the_lowest_free_slot():
    allocator = SlotAllocator(3)
    assert [allocator.allocate() for _ in range(3)] == [0, 1, 2]
    allocator.free(1)
    allocator.free(0)
    assert allocator.allocate() == 0 and allocator.num_free == 1


def test_allocator_refuses_when_full():
    allocator = SlotAllocator(1)
    allocator.allocate()
    with pytest.raises(RuntimeError, match="no free"):
        allocator.allocate()


def test_allocator_refuses_a_double_free():
    allocator = SlotAllocator(2)
    allocator.free(allocator.allocate())
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(0)


@pytest.mark.parametrize("slot", [-1, 2])
def test_allocator_refuses_to_free_a_slot_outside_the_pool(slot):
    allocator = SlotAllocator(2)
    allocator.allocate()
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(slot)
