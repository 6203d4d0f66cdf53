# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A ``RemoteDraftLogits`` driven outside a speculator (layer-2 tests):
the reply a server sends for a proposal, and the publish context of a
step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from vllm.k3_draft import protocol
from vllm.k3_draft.logits_codec import LogitsFormat, encode_logits, sample_positions
from vllm.k3_draft.plan import Proposal
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    PublishContext,
    RemoteStep,
)

# The model length sample positions are computed against, and the request
# state rows of the step's temperatures and seeds.
MAX_MODEL_LEN = 64
MAX_NUM_REQS = 8


def reply_for(
    fmt: LogitsFormat, proposal: Proposal, seed: int
) -> tuple[dict[str, Any], list[bytes]]:
    """The metadata and frames of a reply in ``fmt`` to ``proposal``, of
    logits drawn with ``seed``."""
    logits = torch.randn(
        len(proposal.request_ids),
        proposal.num_speculative_tokens,
        fmt.vocab_size,
        generator=torch.Generator().manual_seed(seed),
    )
    positions = sample_positions(
        proposal.anchor_positions, proposal.num_speculative_tokens, MAX_MODEL_LEN
    )
    meta, frame = encode_logits(logits, fmt, positions)
    meta.update(capability=fmt.capability, num_frames=1)
    return meta, [bytes(protocol.tensor_frame(frame))]


def publish_context(
    drafts: torch.Tensor,
    idx: list[int],
    structured: bool = False,
) -> PublishContext:
    """Publishing into ``drafts`` ``[len(idx), K]`` for the requests of
    state rows ``idx`` (temperature 0.9; tensors on ``drafts``' device)."""
    device = drafts.device
    step = RemoteStep(
        input_batch=SimpleNamespace(
            idx_mapping=torch.tensor(idx, device=device),
            has_structured_output_reqs=structured,
        ),
        num_reqs=len(idx),
        num_speculative_tokens=drafts.shape[1],
        temperature=torch.full((MAX_NUM_REQS,), 0.9, device=device),
        seeds=torch.arange(MAX_NUM_REQS, device=device) * 1000,
        staged=None,
        # The tests call an extension's publish themselves, which does not
        # read which extensions the step asks for.
        extensions=(),
    )
    return PublishContext(step, drafts)
