# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The context rows ``RemotePlan`` puts on the wire."""

from __future__ import annotations

import numpy as np
import torch
from test_plan_fail_closed import NEEDS, WIDTH

from vllm.k3_draft.client import DraftClient
from vllm.k3_draft.plan import RemotePlan, StepInputs, StepRequest, gather_rows

pytest_plugins = ("conftest_client",)


def _special_bf16_rows(count: int) -> torch.Tensor:
    """Random bf16 bit patterns: NaN payloads, infinities, subnormals, -0."""
    rng = np.random.default_rng(0)
    bits = rng.integers(-(2**15), 2**15, size=(count, WIDTH), dtype=np.int16)
    return torch.from_numpy(bits).view(torch.bfloat16)


def test_gather_rows_copies_the_bytes_of_the_selected_rows():
    rows = _special_bf16_rows(12)
    index = np.array([7, 0, 11, 3, 3], dtype=np.int64)
    gathered = gather_rows(rows, index)
    expected = rows.view(torch.int16)[torch.from_numpy(index)]
    assert gathered.tobytes() == expected.numpy().tobytes()


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
