# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The draft server's proposal transport: a ZeroMQ REP socket.

Wire protocol: ``vllm.k3_draft.protocol`` (version 2). Frames are received
without copies (``copy=False``) and handed to ``DraftServer.handle``, which
validates everything and never raises; tensor frames of the reply are sent
without copies and tracked, so the next request cannot touch the buffers they
alias before ZeroMQ has sent them. A peer that stops taking its reply for
``reply_send_timeout_s`` has its connection dropped with the socket, which is
bound again on the endpoint it had, a wildcard's port or path included, with
the CURVE keys read at the first bind (the other clients' requests in flight
are lost with it: their clients time out and fail closed), so one stalled
verifier cannot stop the server from answering or from shutting down. A peer
whose connection goes silent (its host lost power or its network path went
dark: no FIN or RST ever arrives) is dropped once it misses ZeroMQ heartbeats
for ``heartbeat_timeout_s`` (the peer's ZeroMQ I/O thread answers them,
however busy the verifier is), so connections of vanished verifiers do not
pile up. A ZeroMQ failure ends ``serve`` with the error: the process then
stops instead of reporting ready over a dead socket.
With ``busy_poll_us``, ``serve`` polls the socket without sleeping for that
long after each reply, then sleeps in a blocking receive: a request within
the window skips the wake-up of a sleeping thread (up to about 150 us of a
round trip on the H200 hosts measured) for one core kept busy while requests
keep coming.
``ipc://*`` binds a socket in a new temporary directory. An ipc socket file
removed or replaced while the server runs (a temporary-file cleaner, another
server) ends ``serve`` with ``SocketFileLost`` within a second (plus the
busy poll): no client could connect any more. ``close`` removes the ipc
socket file bound, unless another server has bound the path since, and that
directory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from vllm.k3_draft.log import init_logger
from vllm.k3_draft.security import (
    CurveConfig,
    check_bind,
    claim_ipc_path,
    ipc_path,
    make_curve_server,
    needs_ipv6,
    secure_socket,
)
from vllm.k3_draft.server import DraftServer

logger = init_logger(__name__)

_STOP_CHECK_MS = 100
# How often ``serve`` checks that its ipc socket file is still its own.
_SOCKET_FILE_CHECK_S = 1.0


class SocketFileLost(RuntimeError):
    """The ipc socket file the server bound was removed or replaced."""


def _file_identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path`` itself (a link is not followed); None
    when nothing is there."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


# How long a peer may take to receive its reply before its connection is
# dropped (a multi-megabyte logits reply takes milliseconds on loopback).
_REPLY_SEND_TIMEOUT_S = 10.0
# A connection is dropped when no ZeroMQ heartbeat, sent every third of it,
# is answered within this.
_HEARTBEAT_TIMEOUT_S = 30.0
# Bytes of a message part beyond which ZeroMQ drops the peer's connection.
_FRAME_SLACK_BYTES = 1 << 20
# Longest busy poll after a reply (the ipc socket file is checked between
# receives, not during one).
MAX_BUSY_POLL_US = 1_000_000


class RpcTransport:
    """Serves ``server`` on ``address`` (see ``vllm.k3_draft.security``)."""

    def __init__(
        self,
        server: DraftServer,
        address: str,
        curve: CurveConfig | None,
        allow_unsafe_remote_rpc: bool = False,
        reply_send_timeout_s: float = _REPLY_SEND_TIMEOUT_S,
        busy_poll_us: int = 0,
        heartbeat_timeout_s: float = _HEARTBEAT_TIMEOUT_S,
    ) -> None:
        check_bind(address, curve, allow_unsafe_remote_rpc)
        if not 0 <= busy_poll_us <= MAX_BUSY_POLL_US:
            raise ValueError(
                f"busy_poll_us must be in [0, {MAX_BUSY_POLL_US}], got {busy_poll_us}"
            )
        self.server = server
        self.address = address
        self.curve = curve
        self.reply_send_timeout_s = reply_send_timeout_s
        self.busy_poll_s = busy_poll_us / 1e6
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.context = zmq.Context()
        self.socket: zmq.Socket | None = None
        # The endpoint bound (a wildcard resolved), which a rebind binds again.
        self.endpoint: str | None = None
        self.authenticator: ThreadAuthenticator | None = None
        # The server's CURVE key pair as bind read it, which a rebind keeps
        # (the key file may have changed since, as the authorized keys may).
        self._server_keys: tuple[bytes, bytes] | None = None
        # The ipc socket file bound and its (st_dev, st_ino).
        self._socket_file: tuple[str, tuple[int, int]] | None = None
        self._ipc_dir: str | None = None

    def max_frame_bytes(self) -> int:
        """Largest message part accepted (ZMQ_MAXMSGSIZE): the context-row or
        positions frame at full staging, or the header limit, plus slack;
        larger parts would be refused anyway, so ZeroMQ drops them before
        they are buffered."""
        limits, spec = self.server.limits, self.server.engine.spec
        rows = limits.max_context_tokens * spec.context_width * 2
        positions = limits.max_context_tokens * 8
        largest = max(rows, positions, self.server.max_header_bytes)
        return largest + _FRAME_SLACK_BYTES

    def bind(self) -> None:
        claim_ipc_path(self.address)
        address = self.address
        if address == "ipc://*":
            # ZeroMQ's own ipc wildcard removes its directory when the socket
            # closes, so a rebind could not bind the path again.
            self._ipc_dir = tempfile.mkdtemp(prefix="k3-draft-rpc-")
            address = f"ipc://{self._ipc_dir}/socket"
        socket = self._socket()
        try:
            if self.curve is not None:
                self._server_keys = self.curve.load_server_keys()
                self.authenticator = secure_socket(
                    self.context, socket, self.curve, self._server_keys
                )
            socket.bind(address)
        except BaseException:
            # An open socket would keep close()'s context.term() waiting.
            socket.close(linger=0)
            raise
        self._bound(socket)
        logger.info(
            "Draft RPC serving on %s%s", self.endpoint, " (CURVE)" if self.curve else ""
        )

    def _bound(self, socket: zmq.Socket) -> None:
        """Serve on ``socket``, just bound; note its ipc socket file."""
        self.socket = socket
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        path = ipc_path(self.endpoint)
        if path is not None:
            status = os.stat(path)
            self._socket_file = (path, (status.st_dev, status.st_ino))

    def _socket(self) -> zmq.Socket:
        socket = self.context.socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        # A blocking receive that wakes up to look at the stop flag: cheaper
        # per message than polling.
        socket.setsockopt(zmq.RCVTIMEO, _STOP_CHECK_MS)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes())
        timeout_ms = max(1, round(self.heartbeat_timeout_s * 1e3))
        socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, timeout_ms // 3))
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        if needs_ipv6(self.address):
            socket.setsockopt(zmq.IPV6, 1)
        return socket

    def _sent(self, tracker: zmq.MessageTracker, stop: threading.Event) -> bool:
        """Wait for the tracked reply to leave; False if the peer did not take
        it within the timeout or ``stop`` was set."""
        deadline = time.monotonic() + self.reply_send_timeout_s
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                tracker.wait(_STOP_CHECK_MS / 1e3)
                return True
            except zmq.NotDone:
                continue
        return tracker.done

    def _rebind(self, tracker: zmq.MessageTracker) -> zmq.Socket:
        """Drop every connection with the socket (the stalled reply with
        them), wait until ZeroMQ released the reply's buffers, bind the same
        endpoint again."""
        assert self.socket is not None and self.endpoint is not None
        logger.warning(
            "A draft client did not take its reply within %.0f s; dropping the "
            "connections of %s and binding again",
            self.reply_send_timeout_s,
            self.endpoint,
        )
        self.socket.close(linger=0)
        tracker.wait(self.reply_send_timeout_s)
        socket = self._socket()
        try:
            if self._server_keys is not None:
                make_curve_server(socket, self._server_keys)
            # The closed socket releases its endpoint in ZeroMQ's I/O thread.
            deadline = time.monotonic() + self.reply_send_timeout_s
            while True:
                try:
                    socket.bind(self.endpoint)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        raise
                    time.sleep(_STOP_CHECK_MS / 1e4)
            self._bound(socket)
        except BaseException:
            # An open socket would keep close()'s context.term() waiting.
            socket.close(linger=0)
            raise
        return socket

    def serve(self, stop: threading.Event, on_serving: Callable[[], None]) -> None:
        """Answer requests until ``stop`` is set; ZeroMQ errors propagate."""
        socket = self.socket
        assert socket is not None, "bind() first"
        on_serving()
        tracker: zmq.MessageTracker | None = None
        handle = self.server.handle
        next_file_check = 0.0
        poll_until = 0.0
        while not stop.is_set():
            if self._socket_file is not None and time.monotonic() >= next_file_check:
                self._check_socket_file()
                next_file_check = time.monotonic() + _SOCKET_FILE_CHECK_S
            try:
                frames = self._receive(socket, poll_until, stop)
            except zmq.Again:
                continue
            if tracker is not None:
                if not self._sent(tracker, stop):
                    if stop.is_set():
                        break
                    # The request just received goes with the old socket.
                    socket = self._rebind(tracker)
                    tracker = None
                    continue
                tracker = None
            reply = handle(frames)
            if len(reply) == 1:
                socket.send(reply[0])
            else:
                tracker = socket.send_multipart(reply, copy=False, track=True)
            if self.busy_poll_s:
                poll_until = time.perf_counter() + self.busy_poll_s

    @staticmethod
    def _receive(
        socket: zmq.Socket, poll_until: float, stop: threading.Event
    ) -> list[zmq.Frame]:
        """The next request's frames: polled without sleeping until
        ``poll_until`` (``perf_counter`` seconds) or ``stop``, then by a
        blocking receive (``zmq.Again`` at its stop-check timeout)."""
        while time.perf_counter() < poll_until and not stop.is_set():
            try:
                return socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
        return socket.recv_multipart(copy=False)

    def _check_socket_file(self) -> None:
        assert self._socket_file is not None
        path, identity = self._socket_file
        now = _file_identity(path)
        if now != identity:
            how = "removed" if now is None else "replaced"
            raise SocketFileLost(
                f"the ipc socket file {path} was {how}; no client can connect"
            )

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
        if self.socket is not None and not self.socket.closed:
            self.socket.close(linger=0)
        self.context.term()
        if self._socket_file is not None:
            path, identity = self._socket_file
            # Not a file that another server has bound since.
            if _file_identity(path) == identity:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        if self._ipc_dir is not None:
            # Left if anything else was put there.
            with contextlib.suppress(OSError):
                os.rmdir(self._ipc_dir)
