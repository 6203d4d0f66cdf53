# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A synthetic draft engine and a draft server around it, on loopback.

``TableEngine`` is a ``DraftEngine`` whose pre-temperature logits are looked
up, per request, from a table by the request's anchor token: request ``r``
drafts from ``table[anchor_token_id[r], :K]``. Tests set the table to the
draft distributions they need; ``bench/bench_draft_logits.py`` fills it with
logits of the Kimi vocabulary. It keeps no context state.

``LoopbackServer`` runs layer 1's ``DraftServer`` and ``RpcTransport`` (real
ZeroMQ on a loopback TCP port) around an engine in a thread of this process;
``python k3_l2_engines.py --address ADDR ...`` serves a ``TableEngine`` in a
process of its own (the benchmark's server); with ``--stamps FILE`` it records
where each request's time goes (``record_stamps``) for
``bench/bench_propose_legs.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from vllm.entrypoints.k3_dspark_rpc import RpcTransport
from vllm.k3_draft.engine import (
    DraftEngine,
    DraftLimits,
    EngineSpec,
    MemoryPlan,
    ProposeBatch,
    ProposeOutput,
    StepTimer,
)
from vllm.k3_draft.protocol import load_capability_plugins
from vllm.k3_draft.security import CurveConfig
from vllm.k3_draft.server import DraftServer

# Fields of one request's row of ``record_stamps``, in order.
STAMP_FIELDS = (
    "received",
    "handle_start",
    "handle_end",
    "send_start",
    "send_end",
    "engine_s",
    "build_s",
    "wait_s",
)
CONTEXT_WIDTH = 8
# Anchor batches whose outputs ``TableEngine`` keeps.
KEPT_BATCHES = 4


def table_limits(
    max_batch_size: int,
    max_speculative_tokens: int,
    max_model_len: int,
    max_requests: int | None = None,
    max_context_tokens: int = 16,
) -> DraftLimits:
    """Bounds of a table server (default: as many retained requests as a
    batch)."""
    return DraftLimits(
        max_requests=max_requests or max_batch_size,
        max_batch_size=max_batch_size,
        max_speculative_tokens=max_speculative_tokens,
        max_context_tokens=max_context_tokens,
        max_model_len=max_model_len,
        block_size=16,
        window_size=16,
        prefix_cache_tokens=16,
    )


class TableEngine(DraftEngine):
    """Logits by anchor token from ``table`` ``[anchors, K_max, V]`` (fixed
    once the engine is built). The logits and tokens of the last
    ``KEPT_BATCHES`` batches of anchors are kept, as a device engine keeps its
    output buffers: a repeated batch costs the engine nothing, so a benchmark
    that alternates a few batches measures the transport."""

    def __init__(
        self,
        limits: DraftLimits,
        table: torch.Tensor,
        device: torch.device | None = None,
        context_width: int = CONTEXT_WIDTH,
    ) -> None:
        self.limits = limits
        self.device = device or torch.device("cpu")
        self.table = table.to(self.device)
        self.tokens = table.argmax(-1)
        self.spec = EngineSpec(
            method="dflash",
            vocab_size=table.shape[-1],
            context_width=context_width,
            hidden_size=context_width,
            supports_logits=True,
            query_kv_overhang=0,
        )
        # (anchors, k) -> (logits, tokens), the most recent last.
        self._kept: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, ...]] = {}

    def memory_plan(self) -> MemoryPlan:
        return MemoryPlan(0, 0, self.table.numel() * self.table.element_size(), 0)

    def load(self) -> None:
        pass

    def capture_cuda_graphs(self) -> list[tuple[int, int]]:
        return []

    def propose(self, batch: ProposeBatch) -> ProposeOutput:
        timer = StepTimer()
        timer.mark("context")
        anchors = tuple(batch.anchor_token_ids)
        k = batch.num_speculative_tokens
        kept = self._kept.pop((anchors, k), None)
        if kept is None:
            kept = (
                self.table[torch.tensor(anchors, device=self.device), :k],
                self.tokens[torch.tensor(anchors), :k],
            )
            if len(self._kept) >= KEPT_BATCHES:
                del self._kept[next(iter(self._kept))]
        self._kept[(anchors, k)] = kept
        logits, tokens = kept
        timer.mark("query")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        timer.mark("device_wait")
        timer.mark("copy_back")
        return ProposeOutput(
            tokens, logits if batch.want_logits else None, timer.timings
        )

    def restore(self, src_slot: int, dst_slot: int, start: int, end: int) -> None:
        pass


class LoopbackServer:
    """``DraftServer(engine)`` on ``address`` (by default a loopback TCP port
    that ZeroMQ picks at the bind), served by a thread."""

    def __init__(
        self,
        engine: DraftEngine,
        address: str = "tcp://127.0.0.1:*",
        busy_poll_us: int = 0,
        curve: CurveConfig | None = None,
    ) -> None:
        load_capability_plugins()
        self.server = DraftServer(engine)
        self.transport = RpcTransport(
            self.server, address, curve, busy_poll_us=busy_poll_us
        )
        self.transport.bind()
        assert self.transport.endpoint is not None
        self.address = self.transport.endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self.transport.serve, args=(self._stop, lambda: None), daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.transport.close()


def record_stamps(path: str) -> None:
    """Record, for every request this process serves, ``STAMP_FIELDS``:
    ``perf_counter`` times where the transport's receive returned, where
    ``DraftServer.handle`` started and ended and where the reply's send
    started and returned, and the seconds spent in the engine's
    ``propose`` and in the draft-logits extension's ``build_reply`` and
    ``wait_frames``. The rows are written to ``path`` as JSON when the
    process gets SIGTERM, and the process exits. Wraps the classes'
    methods: call before serving."""
    from vllm.k3_draft.capabilities.draft_logits import DraftLogitsReply

    rows: list[list[float]] = []
    current: dict[str, float] = {}

    receive = RpcTransport._receive

    def stamped_receive(*args: Any, **kwargs: Any) -> Any:
        frames = receive(*args, **kwargs)
        current["received"] = time.perf_counter()
        return frames

    def add_seconds(owner: Any, name: str, field: str) -> None:
        function: Callable[..., Any] = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                current[field] = current.get(field, 0.0) + seconds

        setattr(owner, name, wrapper)

    handle = DraftServer.handle

    def stamped_handle(self: DraftServer, frames: Any) -> list[Any]:
        current["handle_start"] = time.perf_counter()
        try:
            return handle(self, frames)
        finally:
            current["handle_end"] = time.perf_counter()

    # The serve loop sends a one-frame reply with send, others with
    # send_multipart, which calls send per frame. The client may have the
    # reply before its row is kept: SIGTERM's handler waits for the row.
    send, send_multipart = zmq.Socket.send, zmq.Socket.send_multipart
    nested = threading.local()
    sending = threading.Lock()

    def sent(start: float) -> None:
        current["send_end"] = time.perf_counter()
        current["send_start"] = start
        rows.append([current.pop(field, 0.0) for field in STAMP_FIELDS])

    def stamped_send(self: zmq.Socket, *args: Any, **kwargs: Any) -> Any:
        if getattr(nested, "multipart", False):
            return send(self, *args, **kwargs)
        with sending:
            start = time.perf_counter()
            result = send(self, *args, **kwargs)
            sent(start)
        return result

    def stamped_send_multipart(self: zmq.Socket, *args: Any, **kwargs: Any) -> Any:
        with sending:
            start = time.perf_counter()
            nested.multipart = True
            try:
                result = send_multipart(self, *args, **kwargs)
            finally:
                nested.multipart = False
            sent(start)
        return result

    setattr(RpcTransport, "_receive", staticmethod(stamped_receive))  # noqa: B010
    DraftServer.handle = stamped_handle  # type: ignore[method-assign]
    setattr(zmq.Socket, "send", stamped_send)  # noqa: B010
    setattr(zmq.Socket, "send_multipart", stamped_send_multipart)  # noqa: B010
    add_seconds(TableEngine, "propose", "engine_s")
    add_seconds(DraftLogitsReply, "build_reply", "build_s")
    add_seconds(DraftLogitsReply, "wait_frames", "wait_s")

    def write_and_exit(signum: int, frame: Any) -> None:
        with sending, open(path, "w") as out:
            json.dump(rows, out)
        os._exit(0)

    signal.signal(signal.SIGTERM, write_and_exit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--table", required=True, help="a torch.save'd table")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1 << 20)
    parser.add_argument("--device", default="cpu", help="where the logits live")
    parser.add_argument("--busy-poll-us", type=int, default=0)
    parser.add_argument("--context-width", type=int, default=CONTEXT_WIDTH)
    parser.add_argument("--max-context-tokens", type=int, default=16)
    parser.add_argument("--curve-secret-key", help="serve CurveZMQ with this key")
    parser.add_argument("--curve-authorized-keys", help="and these clients")
    parser.add_argument(
        "--stamps", help="record where each request's time goes (record_stamps)"
    )
    args = parser.parse_args()
    if args.stamps:
        record_stamps(args.stamps)
    table = torch.load(args.table)
    limits = table_limits(
        args.max_batch_size,
        table.shape[1],
        args.max_model_len,
        args.max_requests,
        args.max_context_tokens,
    )
    engine = TableEngine(limits, table, torch.device(args.device), args.context_width)
    curve = None
    if args.curve_secret_key:
        curve = CurveConfig(args.curve_secret_key, args.curve_authorized_keys)
    LoopbackServer(engine, args.address, args.busy_poll_us, curve)
    print("serving", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
