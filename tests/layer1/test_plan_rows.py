# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The context rows ``RemotePlan`` puts on the wire."""

from __future__ import annotations

import numpy as np
import torch
from test_plan_fail_closed import NEEDS, WIDTH

from vllm.k3_draft.client import DraftClient
from vllm.k3_draft.plan import RemotePlan, StepInputs, StepRequest, rows_frame

pytest_plugins = ("conftest_client",)


def _special_bf16_rows(count: int) -> torch.Tensor:
    """Random bf16 bit patterns: NaN payloads, infinities, subnormals, -0."""
    rng = np.random.default_rng(0)
    bits = rng.integers(-(2**15), 2**15, size=(count, WIDTH), dtype=np.int16)
    return torch.from_numpy(bits).view(torch.bfloat16)


def test_adjacent_spans_are_sent_as_a_view_of_the_staged_rows():
    rows = _special_bf16_rows(12)
    frame = rows_frame(rows, [(2, 5), (5, 9)])
    assert np.shares_memory(frame, rows.view(torch.int16).numpy())
    assert frame.tobytes() == rows[2:9].view(torch.int16).numpy().tobytes()


def test_separate_spans_are_gathered_in_order():
    rows = _special_bf16_rows(12)
    frame = rows_frame(rows, [(8, 11), (0, 2), (4, 8)])
    expected = torch.cat([rows[8:11], rows[0:2], rows[4:8]]).view(torch.int16)
    assert frame.tobytes() == expected.numpy().tobytes()


def test_propose_carries_each_requests_rows_without_the_rejected_ones(
    scripted_server,
):
    received: list[bytes] = []

    def propose(header, frames):
        received.append(bytes(frames[1]))
        return scripted_server.default(header, frames)

    scripted_server.handlers["PROPOSE"] = propose
    client = DraftClient(scripted_server.address, timeout_ms=2000)
    rows = _special_bf16_rows(12)
    # Three requests of 4 verified rows each; the first and last keep 2 and
    # 3 of them (the rest were rejected), so their spans are not adjacent.
    requests = [
        StepRequest("a", 0, 2, 9, 0, None),
        StepRequest("b", 0, 4, 9, 4, None),
        StepRequest("c", 0, 3, 9, 8, None),
    ]
    try:
        RemotePlan(client, NEEDS, retry_interval_s=0.0).run(
            StepInputs(requests, 3, rows)
        )
    finally:
        client.close()
    expected = torch.cat([rows[0:2], rows[4:8], rows[8:11]]).view(torch.int16)
    assert received == [expected.numpy().tobytes()]
