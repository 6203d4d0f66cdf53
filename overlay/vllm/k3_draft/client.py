# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verifier-side ZeroMQ client of the draft server (wire protocol version 2).

``DraftClient`` owns one REQ socket (LINGER 0, send and receive timeouts = the
RPC timeout). A REQ socket that missed a reply is wedged, so after any send or
receive failure the client closes it, connects a fresh one and raises
``TransportError``. ``check_server`` is the handshake's compatibility check of
a PONG against this engine (``ServerRequirements``); a server that answers the
PING in another protocol version cannot serve this engine either.

Every reply names the server process that wrote it (``server_id``). Once a
handshake accepted a server, a reply from any other (a restarted process at
the same address: ZeroMQ reconnects by itself) or without an id raises
``ServerChangedError`` until a new handshake accepts the one that answers:
no reply of a server this engine has not checked is used. A server that does
not advertise ``CAPABILITY_REPLY_SERVER_ID`` (a protocol-2 server of the
previous release names itself in PONG only) is refused at the handshake.

A server whose security handshake refuses this client (CURVE keys on one side
only, a client key it does not authorize, another server's public key) never
answers, like an unreachable one; but it never will. So a handshake watches
its socket's ZeroMQ handshakes (a socket monitor, until the PONG or
``abandon``: libzmq blocks its I/O thread on a monitor nobody reads):
``handshake`` raises ``IncompatibleServerError`` naming the cause of a
refusal ZeroMQ does not retry (a protocol or an authentication failure)
instead of ``TransportError``, whose message names the likely cause of
connections closed in their security handshake (another server's public key;
but a TCP forwarder whose server still loads, or a server restarting, closes
them too: such a server may serve later). ``handshake_refusal`` names the
cause to a caller that probes with ``start_handshake(watch=True)``.

``on_sent``, when set, is called (and must not raise) on the calling thread
after each request has been handed to ZeroMQ and before its reply is
awaited: another thread may resume once this one only waits for the server.
``reporting_sent`` sets it for a block.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm.k3_draft.log import init_logger
from vllm.k3_draft.protocol import (
    CAPABILITY_REPLY_SERVER_ID,
    METHODS,
    OP_CLEAR,
    OP_PING,
    PONG_FIELDS,
    PROTOCOL_VERSION,
    ForeignProtocolError,
    ProtocolError,
    check_reply,
    decode_header,
    encode_header,
    request_header,
)
from vllm.k3_draft.security import needs_ipv6

logger = init_logger(__name__)

# Largest reply header accepted (a PROPOSE reply lists R x K token ids).
MAX_REPLY_HEADER_BYTES = 16 << 20
_TRANSPORTS = ("tcp", "ipc", "inproc")
# ZeroMQ socket timeouts are C ints (milliseconds).
_MAX_TIMEOUT_MS = 2**31 - 1
# What a watched socket's monitor reports: how its security handshakes end.
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# The ZAP status of a client that the server's authenticator denies.
_ZAP_DENIED = 400
_CURVE_VARIABLES = "VLLM_K3_DRAFT_CURVE_SERVER_KEY, VLLM_K3_DRAFT_CURVE_CLIENT_KEY"


class TransportError(RuntimeError):
    """No reply arrived (timeout or socket failure); the socket was renewed."""


class IncompatibleServerError(RuntimeError):
    """The draft server cannot serve this engine (handshake refusal)."""


class ServerChangedError(ProtocolError):
    """A reply is not from the server the last handshake accepted (another
    ``server_id``, or none): it restarted; only a new handshake may accept
    the one that answers now."""


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ keys of the client: the server's public key and the client's
    key pair, read from certificate files as ``zmq.auth`` writes them."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes

    def apply_to(self, socket: zmq.Socket) -> None:
        """Set ``socket`` (not yet connected) to connect with these keys."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.client_public
        socket.curve_secretkey = self.client_secret


@dataclass(frozen=True)
class ServerRequirements:
    """What this engine needs from a draft server (checked against PONG)."""

    method: str
    capabilities: frozenset[str]
    context_width: int
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_speculative_tokens: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class ServerInfo:
    """The PONG facts the client uses after the handshake."""

    server_id: str
    max_requests: int
    active_requests: int
    capabilities: frozenset[str]


def _pong_int(pong: Mapping[str, Any], name: str) -> int:
    value = pong[name]
    if type(value) is not int or value < 0:
        raise ProtocolError(f"PONG {name} is not a non-negative integer: {value!r}")
    return value


# The draft server's flag that sets each PONG bound, named in a refusal so that
# the operator knows what to change on the server's command line.
_SERVER_FLAGS = {
    "max_model_len": "--max-model-len",
    "max_batch_size": "--max-num-seqs",
    "max_requests": "--max-requests",
    "max_speculative_tokens": "--max-speculative-tokens",
    "max_context_tokens": "--max-context-tokens",
}


def _flag(name: str) -> str:
    flag = _SERVER_FLAGS.get(name)
    return f" ({flag})" if flag else ""


def check_server(pong: Mapping[str, Any], needs: ServerRequirements) -> ServerInfo:
    """Check a PONG header against ``needs``.

    Raises ``ProtocolError`` for a malformed PONG and ``IncompatibleServerError``
    listing every field that cannot serve this engine.
    """
    missing = [name for name in PONG_FIELDS if name not in pong]
    if missing:
        raise ProtocolError(f"PONG lacks {missing}")
    method = pong["method"]
    capabilities = pong["capabilities"]
    server_id = pong["server_id"]
    if method not in METHODS:
        raise ProtocolError(f"PONG method {method!r} is not one of {METHODS}")
    if not isinstance(capabilities, list) or not all(
        isinstance(name, str) for name in capabilities
    ):
        raise ProtocolError("PONG capabilities is not a list of strings")
    if not isinstance(server_id, str) or not server_id:
        raise ProtocolError("PONG server_id is not a non-empty string")
    problems = []
    if method != needs.method:
        problems.append(f"method {method!r}, this engine drafts with {needs.method!r}")
    if CAPABILITY_REPLY_SERVER_ID not in capabilities:
        problems.append(
            "it does not name itself in its replies (an older draft server): upgrade it"
        )
    lacking = sorted(needs.capabilities - set(capabilities))
    if lacking:
        problems.append(f"capabilities {capabilities} lack {lacking}")
    for name, ours in (
        ("context_width", needs.context_width),
        ("vocab_size", needs.vocab_size),
        ("max_model_len", needs.max_model_len),
    ):
        theirs = _pong_int(pong, name)
        if theirs != ours:
            problems.append(f"{name} {theirs}{_flag(name)}, this engine has {ours}")
    for name, ours, what in (
        ("max_batch_size", needs.max_num_seqs, "max_num_seqs"),
        ("max_requests", needs.max_num_seqs, "max_num_seqs"),
        (
            "max_speculative_tokens",
            needs.num_speculative_tokens,
            "num_speculative_tokens",
        ),
        ("max_context_tokens", needs.max_num_batched_tokens, "max_num_batched_tokens"),
    ):
        theirs = _pong_int(pong, name)
        if theirs < ours:
            problems.append(
                f"{name} {theirs}{_flag(name)} is below this engine's {what} {ours}"
            )
    if problems:
        raise IncompatibleServerError(
            "the draft server cannot serve this engine: " + "; ".join(problems)
        )
    return ServerInfo(
        server_id=server_id,
        max_requests=_pong_int(pong, "max_requests"),
        active_requests=_pong_int(pong, "active_requests"),
        capabilities=frozenset(capabilities),
    )


def check_server_address(address: str) -> None:
    """A ``ValueError`` unless ``address`` has the form of a draft server
    address to connect to: ``tcp://HOST:PORT`` (port 1..65535, not the bind
    wildcard ``*``), ``ipc://PATH`` or ``inproc://NAME``. Reads no network."""
    transport, _, endpoint = address.partition("://")
    if transport not in _TRANSPORTS or not endpoint:
        raise ValueError(
            f"draft server address {address!r} is not a ZeroMQ "
            "tcp://, ipc:// or inproc:// address"
        )
    if transport == "tcp":
        host, sep, port = endpoint.rpartition(":")
        numeric_port = port.isascii() and port.isdigit()
        if not (sep and host and numeric_port and 0 < int(port) < 65536):
            raise ValueError(
                f"draft server address {address!r} is not tcp://HOST:PORT "
                "with a port in 1..65535"
            )
        if host == "*":
            raise ValueError(
                f"draft server address {address!r} names the bind wildcard "
                "'*', not a host to connect to"
            )


class DraftClient:
    """One REQ connection to a draft server; every call is one round trip."""

    def __init__(
        self, address: str, timeout_ms: int, curve: CurveKeys | None = None
    ) -> None:
        check_server_address(address)
        if not 1 <= timeout_ms <= _MAX_TIMEOUT_MS:
            raise ValueError(
                f"RPC timeout {timeout_ms} ms must be in 1..{_MAX_TIMEOUT_MS}"
            )
        self.address = address
        self.timeout_ms = timeout_ms
        self.curve = curve
        # The server_id the last accepted handshake saw (None: none yet).
        self.server_id: str | None = None
        self.on_sent: Callable[[], None] | None = None
        self._context = zmq.Context()
        # The socket's handshake monitor while a handshake is watched.
        self._monitor: zmq.Socket | None = None
        # Why the watched handshake's security handshakes failed (None: they
        # did not, or said nothing).
        self.handshake_refusal: str | None = None
        # Whether that failure is one ZeroMQ does not retry (a closed
        # connection is not: a forwarder or a restarting server closes it too).
        self._refusal_final = False
        try:
            self._socket = self._connect()
        except zmq.ZMQError as exc:
            self._context.term()
            # strerror alone: pyzmq's message of a connect repeats the address.
            reason = zmq.strerror(exc.errno or 0)
            raise ValueError(f"cannot connect to {address!r}: {reason}") from None

    def _connect(self, monitor: bool = False) -> zmq.Socket:
        """A fresh REQ socket connected to the server (``monitor``: with
        ``_monitor`` watching its handshakes from the first); on failure it is
        closed before the error propagates (an open one keeps ``close``'s
        ``context.term()`` waiting for ever)."""
        socket = self._context.socket(zmq.REQ)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            socket.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            if needs_ipv6(self.address):
                socket.setsockopt(zmq.IPV6, 1)
            if self.curve is not None:
                self.curve.apply_to(socket)
            if monitor:
                self._monitor = socket.get_monitor_socket(_HANDSHAKE_EVENTS)
            socket.connect(self.address)
        except BaseException:
            if self._monitor is not None:
                self._monitor.close(linger=0)
                self._monitor = None
            socket.close(linger=0)
            raise
        return socket

    def _stop_monitor(self) -> None:
        if self._monitor is None:
            return
        # Read out first: with its queue full, libzmq's I/O thread waits
        # holding the lock that disable_monitor takes (with the GIL held).
        while self._monitor.poll(0):
            self._monitor.recv_multipart()
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._monitor = None

    def _renew(self, monitor: bool = False) -> None:
        self._stop_monitor()
        self._socket.close(linger=0)
        self._socket = self._connect(monitor)
        self.handshake_refusal = None
        self._refusal_final = False

    def _failed(self, op: str, exc: zmq.ZMQError) -> TransportError:
        """The error of a failed round trip, after renewing the socket (a REQ
        socket cannot send again until it has received); a timeout says so."""
        self._renew()
        if isinstance(exc, zmq.Again):
            return TransportError(
                f"{op} to the draft server {self.address} timed out after "
                f"{self.timeout_ms} ms"
            )
        return TransportError(f"{op} to the draft server {self.address} failed: {exc}")

    def call(
        self, op: str, frames: Sequence[Any] = (), **fields: Any
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send ``op`` with ``fields`` and tensor ``frames``; return the checked
        reply header and its further frames (valid until the next call).

        Raises ``TransportError`` (no reply), ``ProtocolError`` (malformed
        reply) or ``protocol.RemoteError`` (``ok: false``).
        """
        return self.call_encoded(
            op, encode_header(request_header(op, **fields)), frames
        )

    def call_encoded(
        self, op: str, header: bytes, frames: Sequence[Any] = ()
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """``call`` with the request header already encoded (frame 0)."""
        message = [header, *frames]
        try:
            self._socket.send_multipart(message, copy=False)
            self._sent()
            reply = self._socket.recv_multipart(copy=False)
        except zmq.ZMQError as exc:
            raise self._failed(op, exc) from exc
        decoded = decode_header(reply[0].buffer, MAX_REPLY_HEADER_BYTES)
        self._check_server_id(decoded, op)
        return check_reply(decoded, op), reply[1:]

    def _check_server_id(self, header: Mapping[str, Any], op: str) -> None:
        """Refuse a reply (error replies too) that does not name the server
        the handshake accepted, or none without a handshake."""
        theirs = header.get("server_id")
        if self.server_id is None:
            if not isinstance(theirs, str) or not theirs:
                raise ProtocolError(f"{op} reply has no server_id")
        elif theirs != self.server_id:
            raise ServerChangedError(
                f"{op} reply from draft server {theirs!r}, not {self.server_id!r} "
                "that the handshake accepted: it restarted"
            )

    def handshake(
        self, needs: ServerRequirements, known_server_id: str | None = None
    ) -> ServerInfo:
        """PING and check the server against ``needs``, waiting up to the RPC
        timeout; the replies that follow must come from that server. A server
        other than ``known_server_id`` that holds requests holds them for an
        earlier verifier: CLEAR them (fresh epoch). A security handshake
        that refuses this client for good (ZeroMQ does not retry it) raises
        ``IncompatibleServerError`` at once; one whose connections were only
        closed names its likely cause in the ``TransportError``."""
        self.start_handshake(watch=True)
        try:
            self._await_pong()
            info = self.finish_handshake(needs, known_server_id, 0)
        finally:
            self._stop_monitor()
        if info is None:
            if self._refusal_final:
                refusal = self.handshake_refusal
                self.abandon()
                raise IncompatibleServerError(
                    f"the security handshake with the draft server {self.address} "
                    f"failed: {refusal}"
                )
            raise self.abandon_handshake()
        return info

    def _await_pong(self) -> None:
        """Wait up to the RPC timeout for the PING's reply, reading the
        monitor meanwhile; a final handshake refusal ends the wait."""
        assert self._monitor is not None
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout_ms / 1e3
        try:
            while True:
                wait_ms = max(0, round((deadline - time.monotonic()) * 1e3))
                ready = dict(poller.poll(wait_ms))
                if self._socket in ready or self._monitor not in ready:
                    return
                if self._read_monitor():
                    return
        except zmq.ZMQError as exc:
            raise self._failed(OP_PING, exc) from exc

    def _read_monitor(self) -> bool:
        """The monitor's events so far taken into ``handshake_refusal`` (a
        final refusal is kept until a handshake succeeds); whether it holds
        a final one."""
        assert self._monitor is not None
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_refusal, self._refusal_final = None, False
            elif not self._refusal_final:
                self.handshake_refusal, self._refusal_final = self._handshake_refusal(
                    event["event"], event["value"]
                )
        return self._refusal_final

    def _handshake_refusal(self, event: int, value: int) -> tuple[str | None, bool]:
        """What a failed security handshake says about the configuration, and
        whether it is final (ZeroMQ does not retry a protocol or an
        authentication failure); None where it says nothing."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                return f"ZeroMQ protocol error {value:#x}", True
            if self.curve is not None:
                return (
                    f"the server does not use CURVE, but {_CURVE_VARIABLES} are "
                    "set: unset them, or start the server with --curve-secret-key "
                    "and --curve-authorized-keys",
                    True,
                )
            return (
                f"the server requires CURVE: set {_CURVE_VARIABLES} to its public "
                "certificate and this verifier's secret certificate",
                True,
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if value == _ZAP_DENIED:
                return (
                    "the server refused this verifier's CURVE key "
                    "(VLLM_K3_DRAFT_CURVE_CLIENT_KEY): add its public certificate "
                    "to the server's --curve-authorized-keys and restart it",
                    True,
                )
            return f"the server's authentication failed (ZAP status {value})", False
        if self.curve is not None:
            return (
                "the server closed every CURVE handshake: is "
                "VLLM_K3_DRAFT_CURVE_SERVER_KEY that server's public certificate?",
                False,
            )
        return None, False

    def start_handshake(self, watch: bool = False) -> None:
        """Send a PING without waiting; ``finish_handshake`` takes its PONG.
        ``watch``: on a fresh socket whose security handshakes are read into
        ``handshake_refusal`` until the reply or ``abandon``."""
        if watch:
            self._renew(monitor=True)
        try:
            self._socket.send(encode_header(request_header(OP_PING)))
        except zmq.ZMQError as exc:
            raise self._failed(OP_PING, exc) from exc
        self._sent()

    def _sent(self) -> None:
        if self.on_sent is not None:
            self.on_sent()

    @contextlib.contextmanager
    def reporting_sent(self, callback: Callable[[], None]) -> Iterator[None]:
        """``on_sent = callback`` for the block, cleared however it ends."""
        self.on_sent = callback
        try:
            yield
        finally:
            self.on_sent = None

    def finish_handshake(
        self, needs: ServerRequirements, known_server_id: str | None, wait_ms: int
    ) -> ServerInfo | None:
        """The outstanding PING's PONG checked as ``handshake`` does, or None
        if it has not arrived within ``wait_ms`` (the PING stays outstanding
        until a later call or ``abandon``)."""
        try:
            if not self._socket.poll(wait_ms, zmq.POLLIN):
                if self._monitor is not None:
                    self._read_monitor()
                return None
            reply = self._socket.recv_multipart(copy=False)
        except zmq.ZMQError as exc:
            raise self._failed(OP_PING, exc) from exc
        self._stop_monitor()
        try:
            header = decode_header(reply[0].buffer, MAX_REPLY_HEADER_BYTES)
        except ForeignProtocolError as exc:
            # A server of another protocol version answers (in its own
            # version, an error most likely): it cannot serve this engine,
            # whatever it says.
            raise IncompatibleServerError(
                "the draft server cannot serve this engine: it speaks wire "
                f"protocol {exc.version}, this engine {PROTOCOL_VERSION}"
            ) from None
        pong = check_reply(header, OP_PING)
        if len(reply) > 1:
            raise ProtocolError(f"PONG carries {len(reply) - 1} unexpected frames")
        info = check_server(pong, needs)
        self.server_id = info.server_id
        if info.active_requests and info.server_id != known_server_id:
            logger.info(
                "Draft server %s holds %d requests of an earlier verifier; "
                "clearing them",
                info.server_id,
                info.active_requests,
            )
            self.call(OP_CLEAR)
        return info

    def abandon(self) -> None:
        """Drop an outstanding request: its reply, if any, is never read."""
        self._renew()

    def abandon_handshake(self) -> TransportError:
        """Drop the outstanding PING, unanswered within the RPC timeout; the
        error saying so, with what its security handshakes said if watched."""
        refusal = self.handshake_refusal
        self.abandon()
        return TransportError(
            f"no PONG from the draft server {self.address} within "
            f"{self.timeout_ms} ms"
            + (f": the security handshake failed: {refusal}" if refusal else "")
        )

    def close(self) -> None:
        self._stop_monitor()
        self._socket.close(linger=0)
        self._context.term()
