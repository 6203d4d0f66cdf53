# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CurveZMQ on a real server process (forced on a loopback TCP bind)."""

import pytest
import zmq
import zmq.auth
from k3_layer1_server import (
    DraftServerProcess,
    RawClient,
    create_certificates,
    free_tcp_port,
)

from vllm.k3_draft.security import CurveConfig, secure_socket

_FAIL_TIMEOUT_MS = 1500


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    authorized = root / "authorized"
    authorized.mkdir()
    server_public, server_secret = create_certificates(root, "server")
    client_public, client_secret = create_certificates(authorized, "client")
    stranger_public, stranger_secret = create_certificates(root, "stranger")
    load = zmq.auth.load_certificate
    return {
        "server_secret_file": server_secret,
        "authorized_dir": authorized,
        "server": load(server_secret),
        "client": load(client_secret),
        "stranger": load(stranger_secret),
    }


@pytest.fixture(scope="module")
def curve_server(tmp_path_factory, keys):
    server = DraftServerProcess(
        tmp_path_factory.mktemp("curve"),
        f"tcp://127.0.0.1:{free_tcp_port()}",
        curve_secret_key=keys["server_secret_file"],
        curve_authorized_keys=keys["authorized_dir"],
    ).start()
    yield server
    server.stop()


def ping(server, curve, timeout_ms=10000):
    client = RawClient(server.address, timeout_ms=timeout_ms, curve=curve)
    try:
        return client.call("PING")[0]
    finally:
        client.close()


def test_authorized_client_is_served(curve_server, keys):
    public, secret = keys["client"]
    assert ping(curve_server, (public, secret, keys["server"][0]))["op"] == "PONG"


def test_client_without_curve_gets_no_reply(curve_server):
    with pytest.raises(zmq.Again):
        ping(curve_server, None, _FAIL_TIMEOUT_MS)


def test_client_with_an_unauthorized_key_gets_no_reply(curve_server, keys):
    public, secret = keys["stranger"]
    with pytest.raises(zmq.Again):
        ping(curve_server, (public, secret, keys["server"][0]), _FAIL_TIMEOUT_MS)


def test_client_expecting_another_server_key_gets_no_reply(curve_server, keys):
    public, secret = keys["client"]
    with pytest.raises(zmq.Again):
        ping(curve_server, (public, secret, keys["stranger"][0]), _FAIL_TIMEOUT_MS)


def test_server_keeps_serving_authorized_clients_after_refusals(curve_server, keys):
    with pytest.raises(zmq.Again):
        ping(curve_server, None, _FAIL_TIMEOUT_MS)
    public, secret = keys["client"]
    assert ping(curve_server, (public, secret, keys["server"][0]))["ok"]


def test_authorized_keys_gone_before_bind_refuse_the_curve_socket(tmp_path):
    """The directory read at parse time may be emptied before the bind."""
    (tmp_path / "clients").mkdir()
    _, secret = create_certificates(str(tmp_path), "server")
    curve = CurveConfig(str(secret), str(tmp_path / "clients"))
    context = zmq.Context()
    socket = context.socket(zmq.REP)
    try:
        with pytest.raises(ValueError, match="no client certificate"):
            authenticator = secure_socket(
                context, socket, curve, curve.load_server_keys()
            )
            authenticator.stop()  # not refused: stop its thread
    finally:
        socket.close(linger=0)
        context.term()
