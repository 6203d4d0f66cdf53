# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Projected-context cache and RECONNECT planning."""

import pytest
import torch

from vllm.k3_draft.context_cache import ContextCache, covered_start
from vllm.k3_draft.engine import DraftLimits
from vllm.k3_draft.protocol import ProtocolError
from vllm.k3_draft.validation import RequestState, plan_reconnect

LIMITS = DraftLimits(
    max_requests=4,
    max_batch_size=2,
    max_speculative_tokens=4,
    max_context_tokens=512,
    max_model_len=4096,
    block_size=16,
    window_size=64,
    prefix_cache_tokens=96,
)


def make_cache(budget: int = 8) -> ContextCache:
    return ContextCache(3, budget, 4, torch.float32, torch.device("cpu"))


def rows_for(positions: torch.Tensor) -> torch.Tensor:
    return positions.float()[:, None].repeat(1, 4)


def test_written_rows_are_read_back_by_position():
    cache = make_cache()
    positions = torch.arange(10, 16)
    cache.write(
        cache.index(torch.full_like(positions, 1), positions), rows_for(positions)
    )
    assert torch.equal(cache.read(1, 10, 16), rows_for(positions))


def test_ring_keeps_the_last_budget_positions():
    cache = make_cache(budget=8)
    for start in (0, 8):
        positions = torch.arange(start, start + 8)
        cache.write(
            cache.index(torch.zeros_like(positions), positions), rows_for(positions)
        )
    assert torch.equal(cache.read(0, 8, 16), rows_for(torch.arange(8, 16)))


def test_copy_moves_a_range_between_slots():
    cache = make_cache()
    positions = torch.arange(20, 26)
    cache.write(
        cache.index(torch.zeros_like(positions), positions), rows_for(positions)
    )
    cache.copy(0, 2, 21, 25)
    assert torch.equal(cache.read(2, 21, 25), rows_for(torch.arange(21, 25)))


def test_read_beyond_the_budget_is_refused():
    with pytest.raises(ValueError, match="budget"):
        make_cache(budget=8).read(0, 0, 9)


@pytest.mark.parametrize("budget", [0, -8])
def test_a_budget_below_one_row_is_refused(budget):
    with pytest.raises(ValueError, match="budget must be positive"):
        make_cache(budget=budget)


def test_coverage_starts_at_the_later_of_start_and_high_minus_budget():
    assert covered_start(start=5, high=50, budget=96) == 5
    assert covered_start(start=5, high=500, budget=96) == 404


def plan(source: RequestState, prefix_end: int, request_id: str = "new", free=1):
    header = {
        "protocol": 2,
        "op": "RECONNECT",
        "source_request_id": "src",
        "request_id": request_id,
        "prefix_end": prefix_end,
    }
    return plan_reconnect(header, {"src": source}, free, LIMITS)


def test_restore_starts_at_the_block_aligned_window_start():
    result = plan(RequestState(0, 0, 160, 160, 0, 0), prefix_end=150)
    assert result.restored_start == 80


def test_restore_starts_no_earlier_than_the_source_start():
    result = plan(RequestState(0, 140, 200, 200, 140, 140), prefix_end=150)
    assert result.restored_start == 140


def test_restore_of_a_short_prefix_starts_at_zero():
    assert plan(RequestState(0, 0, 40, 40, 0, 0), prefix_end=30).restored_start == 0


def test_uncovered_restore_is_refused():
    # budget 96: rows [404, 500) are cached; prefix_end 460 needs 384.
    with pytest.raises(ProtocolError, match="not covered"):
        plan(RequestState(0, 0, 500, 500, 0, 0), prefix_end=460)


def test_restore_one_position_before_the_cached_rows_is_refused():
    # budget 96: rows [401, 497) are cached; prefix_end 464 needs 400.
    with pytest.raises(ProtocolError, match="not covered"):
        plan(RequestState(0, 0, 497, 497, 0, 0), prefix_end=464)


def test_restore_from_the_first_cached_row_is_accepted():
    # budget 96: rows [400, 496) are cached; prefix_end 464 needs 400.
    assert (
        plan(RequestState(0, 0, 496, 496, 0, 0), prefix_end=464).restored_start == 400
    )


def test_rows_overwritten_after_a_rewind_do_not_count_as_covered():
    # Rewound to 450 after writing up to 500: positions < 404 were overwritten.
    with pytest.raises(ProtocolError, match="not covered"):
        plan(RequestState(0, 0, 450, 500, 0, 0), prefix_end=450)


def test_prefix_end_beyond_the_source_end_is_refused():
    with pytest.raises(ProtocolError, match="outside"):
        plan(RequestState(0, 0, 100, 100, 0, 0), prefix_end=101)


def test_reconnect_without_a_free_slot_is_refused():
    with pytest.raises(ProtocolError, match="no free slot"):
        plan(RequestState(0, 0, 100, 100, 0, 0), prefix_end=90, free=0)


def test_reconnect_onto_an_existing_request_needs_no_free_slot():
    result = plan(
        RequestState(0, 0, 100, 100, 0, 0), prefix_end=90, request_id="src", free=0
    )
    assert result.request_id == "src"


def test_reconnect_into_the_source_itself_keeps_the_rows_it_holds():
    # budget 96: rows [104, 200) are cached; the restore for 190 starts at 112.
    source = RequestState(0, 0, 200, 200, 0, 0)
    assert plan(source, prefix_end=190, request_id="src").rows_start == 104
    assert plan(source, prefix_end=190).rows_start == 112


def test_a_source_serves_a_restore_from_rows_it_holds_before_its_start():
    # Valid from 112 (restored into itself) but rows [80, 170) are cached.
    source = RequestState(0, 112, 170, 170, 0, 80)
    assert plan(source, prefix_end=150).restored_start == 80
    with pytest.raises(ProtocolError, match="restore from 64 is not covered"):
        plan(source, prefix_end=140)
