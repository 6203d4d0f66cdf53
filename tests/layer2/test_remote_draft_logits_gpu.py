# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer 2's verifier half on a CUDA device (``-m gpu``; needs vllm
importable, e.g. the stack's Python carried by ``ci/gpu-carry.sh``).

A pinned staging slot is refilled on the host only once the device copy that
``publish`` enqueued from it has read it, whether the next ``consume`` takes
the slot round robin or the stream owner prepared it for the reply thread.
The copy is held back behind a device sleep, so that a refill that does not
wait for it lands first and the cache gets the later reply's logits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from k3_l2_publish import publish_context, reply_for

from vllm.k3_draft.logits_codec import LogitsFormat
from vllm.k3_draft.plan import Proposal
from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
    RemoteDraftLogits,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

K = 3
VOCAB = 64
ROW = 2  # the request's state row
# Device clock cycles the copy waits behind (about 0.1 s on Hopper):
# far longer than the host takes to decode and stage two replies.
HOLD_CYCLES = 200_000_000


def _extension(topk: int, one_rank: Any) -> RemoteDraftLogits:
    fmt = LogitsFormat(VOCAB, topk)
    return RemoteDraftLogits(fmt, K, 8, 64, torch.device("cuda"), False, one_rank)


def _proposal(anchor: int) -> Proposal:
    return Proposal(("x",), np.array([0]), np.array([anchor]), K)


def _published(extension: RemoteDraftLogits, payload: Any) -> torch.Tensor:
    """The drafts of ``payload``'s publish, once the device ran it."""
    drafts = torch.full((1, K), -1, device="cuda")
    extension.publish(payload, publish_context(drafts, [ROW]))
    torch.cuda.synchronize()
    return drafts


@pytest.mark.parametrize("topk", [0, 5])
@pytest.mark.parametrize("refill", ["round robin", "prepared"])
def test_a_slot_is_refilled_only_after_its_published_copy_read_it(
    one_rank: Any, topk: int, refill: str
) -> None:
    first, later = _proposal(9), _proposal(10)
    reference = _extension(topk, one_rank)
    want = _published(
        reference, reference.consume(*reply_for(reference.format, first, 1), first)
    )
    extension = _extension(topk, one_rank)
    fmt = extension.format
    payload = extension.consume(*reply_for(fmt, first, 1), first)  # slot 0
    got = torch.full((1, K), -1, device="cuda")
    # Built before the sleep: its host-to-device copies wait for the stream.
    context = publish_context(got, [ROW])
    torch.cuda._sleep(HOLD_CYCLES)
    extension.publish(payload, context)
    if refill == "round robin":
        extension.consume(*reply_for(fmt, later, 2), later)  # slot 1
        extension.consume(*reply_for(fmt, later, 3), later)  # slot 0
    else:
        extension.prepare_staging(0)
        extension.select_staging(0)
        extension.consume(*reply_for(fmt, later, 3), later)
    torch.cuda.synchronize()
    assert (want >= 0).all()
    assert torch.equal(got, want)
    assert torch.equal(extension.draft_logits[ROW], reference.draft_logits[ROW])
