# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``DraftClient``: handshake checks, epoch CLEAR, socket renewal and CURVE."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq.auth

from vllm.k3_draft import protocol
from vllm.k3_draft.client import (
    CurveKeys,
    DraftClient,
    IncompatibleServerError,
    ServerRequirements,
    TransportError,
)
from vllm.k3_draft.protocol import ProtocolError
from vllm.k3_draft.security import load_certificate

pytest_plugins = ("conftest_client",)

NEEDS = ServerRequirements(
    method="dflash",
    capabilities=frozenset(),
    context_width=192,
    vocab_size=1024,
    max_model_len=4096,
    max_num_seqs=8,
    num_speculative_tokens=3,
    max_num_batched_tokens=512,
)

# PONG field -> an incompatible value for NEEDS.
INCOMPATIBLE = {
    "method": "dspark",
    "capabilities": [protocol.CAPABILITY_REPLY_SERVER_ID],
    "context_width": 128,
    "vocab_size": 2048,
    "max_model_len": 2048,
    "max_batch_size": 4,
    "max_requests": 4,
    "max_speculative_tokens": 2,
    "max_context_tokens": 256,
}


@pytest.fixture
def client(scripted_server):
    client = DraftClient(scripted_server.address, timeout_ms=300)
    yield client
    client.close()


def test_compatible_server_is_accepted(client, scripted_server):
    info = client.handshake(NEEDS)
    assert info.server_id == "scripted-1" and info.max_requests == 16
    assert scripted_server.ops() == ["PING"]


@pytest.mark.parametrize("field", INCOMPATIBLE)
def test_incompatible_pong_field_is_refused(client, scripted_server, field):
    needs = NEEDS
    if field == "capabilities":
        needs = dataclasses.replace(NEEDS, capabilities=frozenset({"logits_v9"}))
    scripted_server.pong[field] = INCOMPATIBLE[field]
    with pytest.raises(IncompatibleServerError, match=field):
        client.handshake(needs)


def test_server_whose_replies_do_not_name_it_is_refused(client, scripted_server):
    # A protocol-2 server of the previous release names itself in PONG only.
    scripted_server.pong["capabilities"] = []
    with pytest.raises(IncompatibleServerError, match="an older draft server"):
        client.handshake(NEEDS)


@pytest.mark.parametrize(("version", "ok"), [(3, False), (3, True), (1, True)])
def test_server_speaking_another_protocol_version_is_refused(
    client, scripted_server, version, ok
):
    """A draft server of another release answers the PING in its own protocol
    version (its PONG, or the error it gives a request of another version)."""
    reply = {"ok": ok, "protocol": version, "server_id": "scripted-1"}
    if ok:
        reply.update(scripted_server.pong, op=protocol.OP_PONG)
    else:
        reply.update(
            op="ERROR", error=f"ProtocolError: protocol version 2 is not {version}"
        )
    scripted_server.handlers["PING"] = lambda header, frames: [
        json.dumps(reply).encode()
    ]
    with pytest.raises(
        IncompatibleServerError, match=f"speaks wire protocol {version}, this engine 2"
    ):
        client.handshake(NEEDS)


def test_malformed_pong_is_a_protocol_error(client, scripted_server):
    del scripted_server.pong["server_id"]
    with pytest.raises(ProtocolError, match="server_id"):
        client.handshake(NEEDS)


def test_pong_with_extra_frames_is_a_protocol_error(client, scripted_server):
    scripted_server.handlers["PING"] = lambda header, frames: [
        *scripted_server.default(header, frames),
        b"\x00" * 8,
    ]
    with pytest.raises(ProtocolError, match="frames"):
        client.handshake(NEEDS)


def test_requests_of_an_earlier_verifier_are_cleared(client, scripted_server):
    scripted_server.pong["active_requests"] = 3
    client.handshake(NEEDS)
    assert scripted_server.ops() == ["PING", "CLEAR"]


def test_own_requests_survive_a_repeated_handshake(client, scripted_server):
    scripted_server.pong["active_requests"] = 3
    client.handshake(NEEDS, known_server_id="scripted-1")
    assert scripted_server.ops() == ["PING"]


def _free_reply_from(server_id: str | None, ok: bool):
    """A FREE handler whose reply names ``server_id`` (None: no id)."""

    def handler(header, frames):
        if ok:
            reply = protocol.ok_reply("FREE", active_requests=0)
        else:
            reply = protocol.error_reply(ValueError("unknown"), "unused")
        reply.pop("server_id", None)
        if server_id is not None:
            reply["server_id"] = server_id
        return [protocol.encode_header(reply)]

    return handler


@pytest.mark.parametrize("ok", [True, False], ids=["success", "error"])
@pytest.mark.parametrize("server_id", [None, "scripted-2"], ids=["none", "another"])
def test_reply_not_naming_the_accepted_server_is_a_protocol_error(
    client, scripted_server, server_id, ok
):
    client.handshake(NEEDS)
    scripted_server.handlers["FREE"] = _free_reply_from(server_id, ok)
    with pytest.raises(ProtocolError, match="not 'scripted-1'"):
        client.call("FREE", request_ids=["a"])


def test_reply_without_server_id_before_a_handshake_is_refused(client, scripted_server):
    scripted_server.handlers["FREE"] = _free_reply_from(None, ok=True)
    with pytest.raises(ProtocolError, match="FREE reply has no server_id"):
        client.call("FREE", request_ids=["a"])


def test_only_a_new_handshake_accepts_a_restarted_server(client, scripted_server):
    client.handshake(NEEDS)
    scripted_server.pong["server_id"] = "scripted-2"
    for _ in range(2):
        with pytest.raises(ProtocolError, match="restarted"):
            client.call("FREE", request_ids=["a"])
    client.handshake(NEEDS, known_server_id="scripted-1")
    assert client.call("FREE", request_ids=["a"])[0]["server_id"] == "scripted-2"


def test_an_incompatible_server_is_not_accepted_by_its_pong(client, scripted_server):
    client.handshake(NEEDS)
    scripted_server.pong.update(server_id="scripted-2", vocab_size=512)
    with pytest.raises(IncompatibleServerError):
        client.handshake(NEEDS, known_server_id="scripted-1")
    with pytest.raises(ProtocolError, match="restarted"):
        client.call("FREE", request_ids=["a"])


def test_socket_is_renewed_after_a_timeout(client, scripted_server):
    answered = threading.Event()

    def slow(header, frames):
        time.sleep(0.6)
        answered.set()
        return scripted_server.default(header, frames)

    scripted_server.handlers["PING"] = slow
    with pytest.raises(TransportError):
        client.call("PING")
    del scripted_server.handlers["PING"]
    answered.wait()
    header, _ = client.call("PING")
    assert header["op"] == "PONG"


def test_on_sent_runs_once_per_request_before_its_reply_is_awaited(
    client, scripted_server
):
    # The server answers only after on_sent ran: were on_sent called after
    # the receive, every call would time out.
    sent = threading.Event()
    calls = 0

    def after_on_sent(header, frames):
        sent.wait(5)
        sent.clear()
        return scripted_server.default(header, frames)

    scripted_server.handlers["PING"] = after_on_sent
    scripted_server.handlers["FREE"] = after_on_sent

    def on_sent():
        nonlocal calls
        calls += 1
        sent.set()

    client.on_sent = on_sent
    client.handshake(NEEDS)
    header, _ = client.call("FREE", request_ids=["a"])
    assert header["active_requests"] == 0
    assert calls == 2


def test_address_must_be_a_zeromq_endpoint():
    with pytest.raises(ValueError, match="not a ZeroMQ"):
        DraftClient("http://127.0.0.1:5555", timeout_ms=100)


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1", "tcp://127.0.0.1:99999", "tcp://:5555", "tcp://h:0"],
)
def test_tcp_address_needs_a_host_and_a_port(address):
    with pytest.raises(ValueError, match="not tcp://HOST:PORT"):
        DraftClient(address, timeout_ms=100)


@pytest.mark.parametrize("timeout_ms", [0, 2**31])
def test_timeout_must_fit_a_zeromq_option(timeout_ms):
    with pytest.raises(ValueError, match="RPC timeout"):
        DraftClient("tcp://127.0.0.1:5555", timeout_ms=timeout_ms)


def test_client_secret_key_that_is_not_z85_is_refused_naming_the_file(tmp_path):
    from k3_layer1_server import create_certificates

    _, client_secret = create_certificates(tmp_path, "client")
    secret = zmq.auth.load_certificate(client_secret)[1]
    assert secret is not None
    text = Path(client_secret).read_bytes()
    Path(client_secret).write_bytes(text.replace(secret, b"~" + secret[1:]))
    with pytest.raises(ValueError) as refused:
        load_certificate(client_secret, "the client CURVE key", secret=True)
    assert str(refused.value) == (
        f"{client_secret}: malformed secret key (not 40 Z85 characters)"
    )


def test_server_public_key_that_is_not_z85_is_refused_naming_the_file(tmp_path):
    server_public, _ = zmq.auth.create_certificates(tmp_path, "server")
    public = zmq.auth.load_certificate(server_public)[0]
    text = Path(server_public).read_bytes()
    Path(server_public).write_bytes(text.replace(public, public[:10]))
    with pytest.raises(ValueError) as refused:
        load_certificate(server_public, "the draft server's CURVE key", secret=False)
    assert str(refused.value) == (
        f"{server_public}: malformed public key (not 40 Z85 characters)"
    )


def _construct(address: str, server_key: str) -> None:
    """Build a DraftClient(address, 1000 ms, CURVE to ``server_key`` if any)
    and exit with its ValueError's message."""
    curve = None
    if server_key:
        public, secret = zmq.curve_keypair()
        curve = CurveKeys(server_key.encode(), public, secret)
    try:
        DraftClient(address, 1000, curve).close()
    except ValueError as exc:
        sys.exit(str(exc))


@pytest.mark.parametrize(
    "address, server_key, reason",
    [
        ("tcp://bad host:5555", "", "Invalid argument"),
        ("ipc:///tmp/" + "x" * 120, "", "File name too long"),
        ("tcp://127.0.0.1:5555", "y!@JZ9#5)u", "Invalid argument"),
    ],
    ids=["host", "ipc-path-too-long", "truncated-server-key"],
)
def test_client_that_cannot_connect_fails_construction_in_one_line(
    address, server_key, reason, tmp_path
):
    """The socket is closed before the error propagates (left open, it kept
    the context's term() waiting for ever); in a process of its own, so that
    a hang fails on the timeout."""
    from k3_layer1_server import WarmProcess

    log = tmp_path / "construct.log"
    child = WarmProcess(_construct, (address, server_key), log)
    try:
        assert child.wait(timeout=60) == 1, log.read_text()
    finally:
        child.kill()
    assert (
        log.read_text().splitlines()[-1] == f"cannot connect to {address!r}: {reason}"
    )


def test_curve_client_talks_to_a_curve_server(draft_server_factory, tmp_path):
    from k3_layer1_server import create_certificates, free_tcp_port

    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_public, server_secret = create_certificates(keys, "server")
    client_public, client_secret = create_certificates(keys, "client")
    (clients / "client.key").write_bytes(Path(client_public).read_bytes())
    server = draft_server_factory(
        address=f"tcp://127.0.0.1:{free_tcp_port()}",
        curve_secret_key=server_secret,
        curve_authorized_keys=clients,
    )
    keys = CurveKeys(
        load_certificate(server_public, "the server key", secret=False)[0],
        *load_certificate(client_secret, "the client key", secret=True),
    )
    curve = DraftClient(server.address, 5000, keys)
    try:
        assert curve.handshake(NEEDS).max_requests == 16
    finally:
        curve.close()
    plain = DraftClient(server.address, 500)
    try:
        with pytest.raises(TransportError):
            plain.call("PING")
    finally:
        plain.close()


def test_a_server_on_ipv6_loopback_serves_the_client(draft_server_factory):
    from k3_layer1_server import free_tcp_port

    server = draft_server_factory(address=f"tcp://[::1]:{free_tcp_port()}")
    client = DraftClient(server.address, 5000)
    try:
        assert client.handshake(NEEDS).max_requests == 16
    finally:
        client.close()


def test_a_server_below_the_engines_bounds_is_refused_naming_its_flags(
    draft_server_factory,
):
    """The operator fixes a refusal on the draft server's command line: each
    bound it names is named by the server flag that sets it (``max_batch_size``
    is ``--max-num-seqs``)."""
    server = draft_server_factory(
        max_num_seqs=4,
        max_requests=6,
        max_speculative_tokens=2,
        max_context_tokens=256,
        max_model_len=2048,
    )
    needs = dataclasses.replace(NEEDS, max_num_seqs=8)
    client = DraftClient(server.address, 5000)
    try:
        with pytest.raises(IncompatibleServerError) as refused:
            client.handshake(needs)
    finally:
        client.close()
    message = str(refused.value)
    for bound in (
        "max_model_len 2048 (--max-model-len), this engine has 4096",
        "max_batch_size 4 (--max-num-seqs) is below this engine's max_num_seqs 8",
        "max_requests 6 (--max-requests) is below this engine's max_num_seqs 8",
        "max_speculative_tokens 2 (--max-speculative-tokens) is below this "
        "engine's num_speculative_tokens 3",
        "max_context_tokens 256 (--max-context-tokens) is below this engine's "
        "max_num_batched_tokens 512",
    ):
        assert bound in message, message
