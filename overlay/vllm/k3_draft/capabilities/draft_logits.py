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

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm.k3_draft import protocol
from vllm.k3_draft.log import init_logger
from vllm.k3_draft.logits_codec import (
    CAPABILITY_FULL,
    CAPABILITY_TOPK,
    REQUEST_FIELDS,
    LogitsFormat,
    logits_frame,
    reply_metadata,
    requested_format,
    sample_positions,
    topk_frame,
)
from vllm.k3_draft.plan import ProposeExtension, register_extension_factory

logger = init_logger(__name__)

# Staging views (one per reply byte count) a DraftLogitsReply keeps at most.
_MAX_HOST_FRAMES = 64


@dataclass(frozen=True)
class _Request:
    fmt: LogitsFormat
    max_model_len: int


class TopkGraphs:
    """Top-k frames of CUDA logits written by CUDA graph replay.

    ``torch.topk`` over vocabulary-wide rows, the id cast and the frame's
    concatenation cost about 200 us of host time in launches on the H200;
    replaying them as one graph costs a tenth (``docs/p2-draft-logits.md``).
    A graph reads the logits where it was captured and writes the frame into
    the host buffer it was captured with, so it serves one (address, shape,
    strides, dtype, k) of the logits and one host buffer. A key is captured
    the second time it is seen: engines with CUDA graphs return their logits
    in the same buffer every step, and an engine whose buffer moves every
    step is never captured (it stays on the eager path). At most
    ``max_graphs`` graphs are captured, in one memory pool, and none is
    dropped to make room (a capture synchronises the device and costs more
    than the eager encode: keys beyond the bound stay eager rather than
    evict each other); a new host buffer drops them all. A failed capture
    turns the graphs off for good, with one warning.
    """

    def __init__(self, max_graphs: int = 256) -> None:
        self.max_graphs = max_graphs
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._seen: set[Hashable] = set()
        self._host_ptr = 0
        self._pool: Any = None
        self.enabled = True

    def __len__(self) -> int:
        """The number of graphs kept."""
        return len(self._graphs)

    def write(self, logits: torch.Tensor, k: int, host: torch.Tensor) -> bool:
        """Queue on the current stream the write of ``topk_frame(logits, k)``
        of CUDA ``logits`` into pinned ``host`` (its exact size); the caller
        waits for the stream before reading ``host``. False, with nothing
        queued, when no graph serves this call."""
        if not self.enabled:
            return False
        if host.data_ptr() != self._host_ptr:
            self._graphs.clear()
            self._seen.clear()
            self._host_ptr = host.data_ptr()
        key = (
            logits.data_ptr(),
            logits.device,
            logits.dtype,
            tuple(logits.shape),
            logits.stride(),
            k,
        )
        graph = self._graphs.get(key)
        if graph is None:
            if len(self._graphs) >= self.max_graphs:
                return False
            if key not in self._seen:
                if len(self._seen) >= 4 * self.max_graphs:
                    self._seen.clear()
                self._seen.add(key)
                return False
            graph = self._capture(logits, k, host)
            if graph is None:
                return False
            self._graphs[key] = graph
        graph.replay()
        return True

    def _capture(
        self, logits: torch.Tensor, k: int, host: torch.Tensor
    ) -> torch.cuda.CUDAGraph | None:
        def frame_to_host() -> None:
            host.copy_(topk_frame(logits, k), non_blocking=True)

        try:
            with torch.cuda.device(logits.device):
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                # Kernels and workspaces load outside the capture.
                warm = torch.cuda.Stream()
                warm.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warm):
                    frame_to_host()
                torch.cuda.current_stream().wait_stream(warm)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=self._pool, capture_error_mode="thread_local"
                ):
                    frame_to_host()
        except RuntimeError as exc:
            logger.warning(
                "Top-k logits frames stay eager: CUDA graph capture failed (%s)", exc
            )
            self.enabled = False
            self._graphs.clear()
            return None
        return graph


class DraftLogitsReply(protocol.ReplyExtension):
    """Server half of one draft-logits capability (full vocabulary or top-k).

    Frames of a device (CUDA) engine are staged in pinned host memory owned
    by the extension, written by work queued on the logits' current stream
    (``wait_frames`` waits for it); the transport sends them before the next
    request runs. Top-k frames of CUDA logits come from ``TopkGraphs`` where
    a graph serves them.
    """

    request_fields = REQUEST_FIELDS
    needs_logits = True

    def __init__(self, topk: bool) -> None:
        self.topk = topk
        self.capability = CAPABILITY_TOPK if topk else CAPABILITY_FULL
        self._staging = torch.empty(0, dtype=torch.uint8)
        # nbytes -> (the staging's first nbytes, their frame).
        self._host_frames: dict[int, tuple[torch.Tensor, memoryview]] = {}
        self._graphs = TopkGraphs()
        self._pending: torch.cuda.Stream | None = None

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
        logits = context.logits
        if logits is None:
            raise RuntimeError("the engine returned no logits")
        expected = (len(context.request_ids), context.num_speculative_tokens)
        if logits.dim() != 3 or tuple(logits.shape[:2]) != expected:
            raise RuntimeError(
                f"the engine returned logits of shape {tuple(logits.shape)}, "
                f"not [{expected[0]}, {expected[1]}, V]"
            )
        positions = sample_positions(
            context.anchor_positions,
            context.num_speculative_tokens,
            options.max_model_len,
        )
        fmt = options.fmt
        meta = reply_metadata(logits, fmt, positions)
        if logits.device.type == "cpu":
            return meta, [protocol.tensor_frame(logits_frame(logits, fmt))]
        host, frame = self._host_frame(meta["nbytes"])
        if not (fmt.topk and self._graphs.write(logits, fmt.topk, host)):
            host.copy_(logits_frame(logits, fmt), non_blocking=True)
        self._pending = torch.cuda.current_stream(logits.device)
        return meta, [frame]

    def wait_frames(self) -> None:
        if self._pending is not None:
            stream, self._pending = self._pending, None
            stream.synchronize()

    def _host_frame(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """The first ``nbytes`` of the pinned staging buffer (grown to fit)
        and their frame."""
        kept = self._host_frames.get(nbytes)
        if kept is not None:
            return kept
        if self._staging.numel() < nbytes:
            # Work a failed PROPOSE left queued may still write the old buffer.
            self.wait_frames()
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._host_frames.clear()
        if len(self._host_frames) >= _MAX_HOST_FRAMES:
            self._host_frames.clear()
        host = self._staging[:nbytes]
        kept = self._host_frames[nbytes] = (host, protocol.tensor_frame(host))
        return kept


def _remote_draft_logits(speculator: Any) -> ProposeExtension | None:
    from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
        make_remote_draft_logits,
    )

    return make_remote_draft_logits(speculator)


protocol.CAPABILITIES.register(DraftLogitsReply(topk=False))
protocol.CAPABILITIES.register(DraftLogitsReply(topk=True))
register_extension_factory(_remote_draft_logits)
