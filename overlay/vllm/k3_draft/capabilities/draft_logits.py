# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer 2 plugin: draft logits over the wire (``vllm.k3_draft.logits_codec``).

Registers, at import, the server half of ``dflash_logits_bf16_v1`` and
``dflash_logits_topk_bf16_v1`` in ``protocol.CAPABILITIES`` (offered when the
engine returns per-position logits) and the verifier half as a
``plan.ProposeExtension`` factory: ``RemoteDraftLogits`` of
``vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits``, enabled when
the speculative config asks for ``draft_sample_method="probabilistic"``.

For DSpark, an engine's per-position logits follow its own greedy Markov
chain, not the tokens the verifier samples: the rejection test stays exact
for the q that was sampled from, but acceptance is lower than a local
probabilistic DSpark draft.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm.k3_draft import protocol
from vllm.k3_draft.logits_codec import (
    CAPABILITY_FULL,
    CAPABILITY_TOPK,
    REQUEST_FIELDS,
    LogitsFormat,
    encode_logits,
    requested_format,
    sample_positions,
)
from vllm.k3_draft.plan import ProposeExtension, register_extension_factory


@dataclass(frozen=True)
class _Request:
    fmt: LogitsFormat
    max_model_len: int


class DraftLogitsReply(protocol.ReplyExtension):
    """Server half of one draft-logits capability (full vocabulary or top-k).

    Frames of a device (CUDA) engine are staged in pinned host memory owned
    by the extension; the transport sends them before the next request runs.
    """

    request_fields = REQUEST_FIELDS
    needs_logits = True

    def __init__(self, topk: bool) -> None:
        self.topk = topk
        self.capability = CAPABILITY_TOPK if topk else CAPABILITY_FULL
        self._staging = torch.empty(0, dtype=torch.uint8)

    def is_offered(self, server_info: Mapping[str, Any], engine_logits: bool) -> bool:
        return engine_logits

    def parse_request(
        self, header: Mapping[str, Any], server_info: Mapping[str, Any]
    ) -> _Request | None:
        fmt = requested_format(header, server_info["vocab_size"])
        if fmt is None or bool(fmt.topk) != self.topk:
            return None
        return _Request(fmt, server_info["max_model_len"])

    def build_reply(
        self, options: _Request, context: protocol.ReplyContext
    ) -> tuple[dict[str, Any], list[memoryview]]:
        if context.logits is None:
            raise RuntimeError("the engine returned no logits")
        positions = sample_positions(
            context.anchor_positions,
            context.num_speculative_tokens,
            options.max_model_len,
        )
        meta, frame = encode_logits(context.logits, options.fmt, positions)
        return meta, [protocol.tensor_frame(self._to_host(frame))]

    def _to_host(self, frame: torch.Tensor) -> torch.Tensor:
        if frame.device.type == "cpu":
            return frame
        if self._staging.numel() < frame.numel():
            self._staging = torch.empty(
                frame.numel(), dtype=torch.uint8, pin_memory=True
            )
        host = self._staging[: frame.numel()]
        host.copy_(frame)
        return host


def _remote_draft_logits(speculator: Any) -> ProposeExtension | None:
    from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
        make_remote_draft_logits,
    )

    return make_remote_draft_logits(speculator)


protocol.CAPABILITIES.register(DraftLogitsReply(topk=False))
protocol.CAPABILITIES.register(DraftLogitsReply(topk=True))
register_extension_factory(_remote_draft_logits)
