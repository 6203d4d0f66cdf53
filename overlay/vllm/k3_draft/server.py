# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Transport-independent core of the draft server.

``DraftServer.handle`` takes the frames of one request and returns the frames
of its reply, whose header names this process (``server_id``, new at every
start); it never raises. Every request is validated whole before any state
changes (``validation``); one lock serialises the request table, the engine
and its staging buffers. If the engine fails after a PROPOSE or
RECONNECT has changed state, the requests involved are dropped, so the client
re-creates them (it treats the error reply as a failed step).
"""

from __future__ import annotations

import bisect
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vllm.k3_draft.context_cache import covered_start
from vllm.k3_draft.engine import DraftEngine, ProposeBatch
from vllm.k3_draft.kv_slots import SlotAllocator
from vllm.k3_draft.log import init_logger
from vllm.k3_draft.protocol import (
    CAPABILITIES,
    CAPABILITY_REPLY_SERVER_ID,
    OP_CLEAR,
    OP_FREE,
    OP_PING,
    OP_PONG,
    OP_PROPOSE,
    OP_RECONNECT,
    OP_RESET,
    CapabilityRegistry,
    ProtocolError,
    ReplyContext,
    decode_header,
    encode_header,
    encode_propose_reply,
    error_reply,
    ok_reply,
    propose_reply_body,
    propose_reply_head,
)
from vllm.k3_draft.validation import (
    ParsedPropose,
    ProposeParser,
    RequestState,
    check_fields,
    check_frame_count,
    check_propose,
    plan_reconnect,
    request_ids,
)

logger = init_logger(__name__)

# Upper bounds (ms) of the PROPOSE latency histogram buckets.
LATENCY_BUCKETS_MS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 500.0)
_RECENT = 1024
# Header bytes allowed per request entry / id, plus a fixed allowance.
_HEADER_BYTES_PER_ENTRY = 8192
_HEADER_BYTES_BASE = 65536


class ServerStats:
    """Counters behind /v1/status and /metrics (updated under the lock)."""

    def __init__(self) -> None:
        self.requests_by_op: dict[str, int] = {}
        self.errors_by_op: dict[str, int] = {}
        self.proposed_requests = 0
        self.context_rows = 0
        self.reconnects = 0
        self.reconnect_failures = 0
        self.latency_bucket_counts = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.latency_sum_ms = 0.0
        self.recent_latency_ms: deque[float] = deque(maxlen=_RECENT)
        self.last_timing_ms: dict[str, float] = {}

    def observe_propose(self, latency_ms: float, timing_ms: dict[str, float]) -> None:
        self.latency_bucket_counts[
            bisect.bisect_left(LATENCY_BUCKETS_MS, latency_ms)
        ] += 1
        self.latency_sum_ms += latency_ms
        self.recent_latency_ms.append(latency_ms)
        self.last_timing_ms = timing_ms


class DraftServer:
    """Request table, validation and dispatch in front of a loaded engine."""

    def __init__(
        self,
        engine: DraftEngine,
        cuda_graph_shapes: Sequence[tuple[int, int]] = (),
        capabilities: CapabilityRegistry = CAPABILITIES,
    ) -> None:
        self.engine = engine
        self.limits = engine.limits
        self.lock = threading.Lock()
        self.requests: dict[str, RequestState] = {}
        self.allocator = SlotAllocator(self.limits.max_requests)
        self.stats = ServerStats()
        self.server_id = uuid.uuid4().hex
        # Every reply names this process (a client sees a restart in it).
        self._propose_head = propose_reply_head(self.server_id)
        self.started = time.time()
        self.cuda_graph_shapes = [list(shape) for shape in cuda_graph_shapes]
        # A rewind reads K/V written before it: the ring holds the last
        # window + block positions (less what the query pass writes past the
        # end), a long PROPOSE writes the last prefix_cache_tokens of them.
        self.max_rewind = min(
            self.limits.block_size - engine.spec.query_kv_overhang,
            self.limits.prefix_cache_tokens - self.limits.window_size + 1,
        )
        if self.max_rewind < 0:
            raise ValueError(
                f"block_size {self.limits.block_size} is below the engine's query "
                f"K/V overhang {engine.spec.query_kv_overhang}"
            )
        # A restore spans up to window + block - 1 positions (from the
        # block-aligned window start), all of which the source's cache holds.
        full_restore = self.limits.window_size + self.limits.block_size - 1
        if self.limits.prefix_cache_tokens < full_restore:
            logger.warning(
                "prefix_cache_tokens %d is below window + block - 1 = %d: a "
                "RECONNECT at a prefix end that is not block-aligned, near the "
                "source's end, will be refused",
                self.limits.prefix_cache_tokens,
                full_restore,
            )
        self.max_header_bytes = _HEADER_BYTES_BASE + _HEADER_BYTES_PER_ENTRY * max(
            self.limits.max_batch_size, self.limits.max_requests
        )
        self.server_info = self._static_info()
        self.extensions = [
            extension
            for extension in capabilities
            if extension.is_offered(self.server_info, engine.spec.supports_logits)
        ]
        self.server_info["capabilities"] = [
            CAPABILITY_REPLY_SERVER_ID,
            *(e.capability for e in self.extensions),
        ]
        # PONG is static but for the trailing active_requests field.
        self._pong_prefix = encode_header(ok_reply(OP_PONG, **self.server_info))[:-1]
        self.parser = ProposeParser(
            self.limits,
            engine.spec.vocab_size,
            engine.spec.context_width,
            self.extensions,
            self.server_info,
        )
        self._handlers: dict[str, Callable[[dict[str, Any], list[Any]], list[Any]]] = {
            OP_PING: self._ping,
            OP_PROPOSE: self._propose,
            OP_RESET: self._reset,
            OP_FREE: self._free,
            OP_CLEAR: self._clear,
            OP_RECONNECT: self._reconnect,
        }

    @property
    def counted_ops(self) -> frozenset[str]:
        """Every op the stats count by: the handled ones and INVALID."""
        return frozenset((*self._handlers, "INVALID"))

    def _static_info(self) -> dict[str, Any]:
        limits, spec = self.limits, self.engine.spec
        return {
            "method": spec.method,
            "capabilities": [],
            "max_requests": limits.max_requests,
            "max_batch_size": limits.max_batch_size,
            "max_speculative_tokens": limits.max_speculative_tokens,
            "max_context_tokens": limits.max_context_tokens,
            "context_width": spec.context_width,
            "vocab_size": spec.vocab_size,
            "max_model_len": limits.max_model_len,
            "block_size": limits.block_size,
            "window_size": limits.window_size,
            "prefix_cache_tokens": limits.prefix_cache_tokens,
            "cuda_graph_shapes": self.cuda_graph_shapes,
            "server_id": self.server_id,
        }

    # ------------------------------------------------------------ dispatch

    def handle(self, frames: Sequence[Any]) -> list[Any]:
        """Reply frames (header first) for one request's frames."""
        start = time.perf_counter()
        op = "INVALID"
        try:
            if not frames:
                raise ProtocolError("empty message")
            header = decode_header(frames[0], self.max_header_bytes)
            op = header["op"]
            handler = self._handlers.get(op)
            if handler is None:
                op = "INVALID"
                raise ProtocolError(f"unknown op {header['op']!r}")
            decoded = time.perf_counter()
            with self.lock:
                locked = time.perf_counter()
                self._count(self.stats.requests_by_op, op)
                try:
                    reply = handler(header, list(frames[1:]))
                except Exception:
                    self._count(self.stats.errors_by_op, op)
                    raise
                if op == OP_PROPOSE:
                    self._finish_propose(reply, start, decoded, locked)
            return reply
        except Exception as exc:
            if op == "INVALID":
                with self.lock:
                    self._count(self.stats.requests_by_op, op)
                    self._count(self.stats.errors_by_op, op)
            if not isinstance(exc, ProtocolError):
                logger.exception("%s failed", op)
            return [encode_header(error_reply(exc, self.server_id))]

    @staticmethod
    def _count(table: dict[str, int], op: str) -> None:
        table[op] = table.get(op, 0) + 1

    def _finish_propose(
        self, reply: list[Any], start: float, decoded: float, locked: float
    ) -> None:
        """Fill the PROPOSE reply's timings and complete its header."""
        body, timing = reply[0]
        timing["decode"] = (decoded - start) * 1e3
        timing["lock_wait"] = (locked - decoded) * 1e3
        total = (time.perf_counter() - start) * 1e3
        timing["total"] = total
        self.stats.observe_propose(total, timing)
        reply[0] = encode_propose_reply(body, timing)

    # ----------------------------------------------------------------- ops

    def _ping(self, header: dict[str, Any], frames: list[Any]) -> list[Any]:
        check_fields(header, frozenset())
        check_frame_count(frames, 0, OP_PING)
        return [self._pong_prefix + b',"active_requests":%d}' % len(self.requests)]

    def _propose(self, header: dict[str, Any], frames: list[Any]) -> list[Any]:
        parsed = self.parser.parse(header, frames)
        check_propose(
            parsed,
            self.requests,
            self.allocator.num_free,
            self.max_rewind,
            self.limits.window_size,
        )
        batch = self._apply_propose(parsed)
        try:
            output = self.engine.propose(batch)
            frames_out: list[Any] = []
            entries = None
            if parsed.extensions:
                context = ReplyContext(
                    request_ids=tuple(e.request_id for e in parsed.entries),
                    anchor_positions=tuple(batch.ends),
                    num_speculative_tokens=parsed.num_speculative_tokens,
                    tokens=output.tokens,
                    logits=output.logits,
                )
                entries = []
                for extension, options in parsed.extensions:
                    meta, ext_frames = extension.build_reply(options, context)
                    entries.append(
                        {
                            **meta,
                            "capability": extension.capability,
                            "num_frames": len(ext_frames),
                        }
                    )
                    frames_out.extend(ext_frames)
            # Formatted while the extensions' device work runs.
            body = propose_reply_body(
                self._propose_head, output.tokens.tolist(), entries
            )
            for extension, _ in parsed.extensions:
                extension.wait_frames()
        except Exception:
            self._drop([e.request_id for e in parsed.entries])
            raise
        self.stats.proposed_requests += len(parsed.entries)
        self.stats.context_rows += int(batch.positions.shape[0])
        # _finish_propose completes the header with the timings.
        return [(body, dict(output.timings)), *frames_out]

    def _apply_propose(self, parsed: ParsedPropose) -> ProposeBatch:
        slots, starts, ends = [], [], []
        for entry in parsed.entries:
            state = self.requests.get(entry.request_id)
            if entry.reset:
                slot = self.allocator.allocate() if state is None else state.slot
                position = entry.reset_position
                state = RequestState(
                    slot, position, position, position, position, position
                )
                self.requests[entry.request_id] = state
            assert state is not None
            state.end = entry.anchor_position
            state.high = max(state.high, state.end)
            slots.append(state.slot)
            starts.append(state.start)
            ends.append(state.end)
        return ProposeBatch(
            num_speculative_tokens=parsed.num_speculative_tokens,
            slots=slots,
            starts=starts,
            ends=ends,
            anchor_token_ids=[e.anchor_token_id for e in parsed.entries],
            counts=[e.context_count for e in parsed.entries],
            positions=parsed.positions,
            rows=parsed.rows,
            want_logits=any(ext.needs_logits for ext, _ in parsed.extensions),
        )

    def _drop(self, ids: Sequence[str]) -> None:
        for rid in ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self.allocator.free(state.slot)

    def _reset(self, header: dict[str, Any], frames: list[Any]) -> list[Any]:
        check_fields(header, frozenset({"request_ids"}))
        check_frame_count(frames, 0, OP_RESET)
        ids = request_ids(header)
        unknown = [rid for rid in ids if rid not in self.requests]
        if unknown:
            raise ProtocolError(f"unknown requests {unknown[:8]}")
        for rid in ids:
            slot = self.requests[rid].slot
            self.requests[rid] = RequestState(slot, 0, 0, 0, 0, 0)
        return self._active_reply(OP_RESET)

    def _free(self, header: dict[str, Any], frames: list[Any]) -> list[Any]:
        check_fields(header, frozenset({"request_ids"}))
        check_frame_count(frames, 0, OP_FREE)
        self._drop(request_ids(header))
        return self._active_reply(OP_FREE)

    def _clear(self, header: dict[str, Any], frames: list[Any]) -> list[Any]:
        check_fields(header, frozenset())
        check_frame_count(frames, 0, OP_CLEAR)
        self._drop(list(self.requests))
        return self._active_reply(OP_CLEAR)

    def _active_reply(self, op: str) -> list[Any]:
        reply = ok_reply(
            op, server_id=self.server_id, active_requests=len(self.requests)
        )
        return [encode_header(reply)]

    def _reconnect(self, header: dict[str, Any], frames: list[Any]) -> list[Any]:
        start = time.perf_counter()
        try:
            check_frame_count(frames, 0, OP_RECONNECT)
            plan = plan_reconnect(
                header,
                self.requests,
                self.allocator.num_free,
                self.limits,
            )
        except ProtocolError:
            self.stats.reconnect_failures += 1
            raise
        target = self.requests.get(plan.request_id)
        slot = self.allocator.allocate() if target is None else target.slot
        self.requests[plan.request_id] = RequestState(
            slot,
            plan.restored_start,
            plan.prefix_end,
            plan.prefix_end,
            plan.source.origin,
            plan.rows_start,
        )
        try:
            self.engine.restore(
                plan.source.slot,
                slot,
                plan.restored_start,
                plan.prefix_end,
            )
        except Exception:
            self.stats.reconnect_failures += 1
            self._drop([plan.request_id])
            raise
        self.stats.reconnects += 1
        reply = ok_reply(
            OP_RECONNECT,
            server_id=self.server_id,
            restored_start=plan.restored_start,
            prefix_end=plan.prefix_end,
            latency_ms=(time.perf_counter() - start) * 1e3,
        )
        return [encode_header(reply)]

    # -------------------------------------------------------------- status

    def snapshot(self) -> dict[str, Any]:
        """Counters and bounds for /v1/status (JSON-able)."""
        budget = self.limits.prefix_cache_tokens
        with self.lock:
            stats = self.stats
            cached = sum(
                state.end - covered_start(state.rows_start, state.high, budget)
                for state in self.requests.values()
            )
            recent = np.array(stats.recent_latency_ms or [0.0])
            proposals = stats.requests_by_op.get(
                OP_PROPOSE, 0
            ) - stats.errors_by_op.get(OP_PROPOSE, 0)
            return {
                "server_id": self.server_id,
                "uptime_s": time.time() - self.started,
                "method": self.engine.spec.method,
                "active_requests": len(self.requests),
                "max_requests": self.limits.max_requests,
                "requests_by_op": dict(stats.requests_by_op),
                "errors_by_op": dict(stats.errors_by_op),
                "proposals": proposals,
                "proposed_requests": stats.proposed_requests,
                "context_rows": stats.context_rows,
                "reconnects": stats.reconnects,
                "reconnect_failures": stats.reconnect_failures,
                "latency_ms": {
                    "count": sum(stats.latency_bucket_counts),
                    "sum": stats.latency_sum_ms,
                    "p50_recent": float(np.percentile(recent, 50)),
                    "p99_recent": float(np.percentile(recent, 99)),
                    "buckets": list(LATENCY_BUCKETS_MS),
                    "bucket_counts": list(stats.latency_bucket_counts),
                },
                "last_timing_ms": dict(stats.last_timing_ms),
                "prefix_cache": {
                    "cached_tokens": cached,
                    "capacity_tokens": self.limits.prefix_cache_tokens
                    * self.limits.max_requests,
                },
                "cuda_graph_shapes": self.cuda_graph_shapes,
            }
