# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The draft server's proposal transport: a ZeroMQ REP socket.

Wire protocol: ``vllm.k3_draft.protocol`` (version 2). Frames are received
without copies (``copy=False``) and handed to ``DraftServer.handle``, which
validates everything and never raises; tensor frames of the reply are sent
without copies and tracked, so the next request cannot touch the buffers they
alias before ZeroMQ has sent them. A ZeroMQ failure ends ``serve`` with the
error: the process then stops instead of reporting ready over a dead socket.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from vllm.k3_draft.log import init_logger
from vllm.k3_draft.security import CurveConfig, check_bind, secure_socket
from vllm.k3_draft.server import DraftServer

logger = init_logger(__name__)

_STOP_CHECK_MS = 100
# Bytes of a message part beyond which ZeroMQ drops the peer's connection.
_FRAME_SLACK_BYTES = 1 << 20


class RpcTransport:
    """Serves ``server`` on ``address`` (see ``vllm.k3_draft.security``)."""

    def __init__(
        self,
        server: DraftServer,
        address: str,
        curve: CurveConfig | None,
        allow_unsafe_remote_rpc: bool = False,
    ) -> None:
        check_bind(address, curve, allow_unsafe_remote_rpc)
        self.server = server
        self.address = address
        self.curve = curve
        self.context = zmq.Context()
        self.socket: zmq.Socket | None = None
        self.authenticator: ThreadAuthenticator | None = None

    def max_frame_bytes(self) -> int:
        """Largest message part accepted (ZMQ_MAXMSGSIZE): the context-row frame
        at full staging, or the header limit, plus slack; larger parts would
        be refused anyway, so ZeroMQ drops them before they are buffered."""
        limits, spec = self.server.limits, self.server.engine.spec
        rows = limits.max_context_tokens * spec.context_width * 2
        return max(rows, self.server.max_header_bytes) + _FRAME_SLACK_BYTES

    def bind(self) -> None:
        socket = self.context.socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        # A blocking receive that wakes up to look at the stop flag: cheaper
        # per message than polling.
        socket.setsockopt(zmq.RCVTIMEO, _STOP_CHECK_MS)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes())
        self.authenticator = secure_socket(self.context, socket, self.curve)
        socket.bind(self.address)
        self.socket = socket
        logger.info(
            "Draft RPC serving on %s%s",
            socket.getsockopt_string(zmq.LAST_ENDPOINT),
            " (CURVE)" if self.curve else "",
        )

    def serve(self, stop: threading.Event, on_serving: Callable[[], None]) -> None:
        """Answer requests until ``stop`` is set; ZeroMQ errors propagate."""
        socket = self.socket
        assert socket is not None, "bind() first"
        on_serving()
        tracker: zmq.MessageTracker | None = None
        handle = self.server.handle
        while not stop.is_set():
            try:
                frames = socket.recv_multipart(copy=False)
            except zmq.Again:
                continue
            if tracker is not None:
                tracker.wait()
                tracker = None
            reply = handle(frames)
            if len(reply) == 1:
                socket.send(reply[0])
            else:
                tracker = socket.send_multipart(reply, copy=False, track=True)

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
        if self.socket is not None and not self.socket.closed:
            self.socket.close(linger=0)
        self.context.term()
