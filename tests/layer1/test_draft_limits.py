# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The server bounds (``DraftLimits``): every rule is checked on creation."""

import dataclasses

import pytest

from vllm.k3_draft.engine import DraftLimits

BOUNDS = dict(
    max_requests=4,
    max_batch_size=2,
    max_speculative_tokens=3,
    max_context_tokens=256,
    max_model_len=4096,
    block_size=16,
    window_size=32,
    prefix_cache_tokens=64,
)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(DraftLimits)])
def test_a_bound_of_zero_is_refused(name):
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        DraftLimits(**{**BOUNDS, name: 0})


def test_a_bool_bound_is_refused():
    with pytest.raises(ValueError, match="max_speculative_tokens must be a positive"):
        DraftLimits(**{**BOUNDS, "max_speculative_tokens": True})
