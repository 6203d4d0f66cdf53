# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bind rules of the RPC socket (validated before anything binds)."""

import logging
import threading

import pytest
import zmq
import zmq.auth
from k3_layer1_server import create_certificates, free_tcp_port

from vllm.entrypoints.k3_dspark_standalone import parse_args, run
from vllm.k3_draft.security import (
    BindRefused,
    CurveConfig,
    bind_scope,
    check_bind,
    warn_if_unsafe,
)


@pytest.mark.parametrize(
    "address",
    [
        "ipc:///tmp/x.ipc",
        "inproc://x",
        "tcp://127.0.0.1:5555",
        "tcp://127.3.2.1:1",
        "tcp://[::1]:5555",
        "tcp://localhost:5555",
        "tcp://[::ffff:127.0.0.1]:5555",
        # ZeroMQ drops the zone and binds the loopback address.
        "tcp://127.0.0.1%lo:5555",
        "tcp://localhost%lo:5555",
    ],
)
def test_local_addresses_bind_without_keys(address):
    assert bind_scope(address) == "local"
    check_bind(address, None, allow_unsafe_remote_rpc=False)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://10.1.2.3:5555",
        "tcp://eth0:5555",
        "tcp://draft.example:5555",
        "tcp://\udcff:5555",  # a byte of argv that is not UTF-8
    ],
)
def test_non_loopback_bind_without_keys_is_refused(address):
    with pytest.raises(BindRefused, match="non-loopback"):
        check_bind(address, None, allow_unsafe_remote_rpc=False)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://*:5555",
        "tcp://0.0.0.0:5555",
        "tcp://[::]:5555",
        # Other spellings the resolver reads as the unspecified address.
        "tcp://0:5555",
        "tcp://0.0:5555",
        "tcp://0x0:5555",
        "tcp://000.0.0.0:5555",
        "tcp://[::ffff:0.0.0.0]:5555",
        "tcp://[0:0::0]:5555",
        # ZeroMQ drops a zone from any host and binds all interfaces.
        "tcp://0.0.0.0%lo:5555",
        "tcp://0%1:5555",
        "tcp://*%lo:5555",
        "tcp://[0.0.0.0%lo]:5555",
        "tcp://[::%lo]:5555",
    ],
)
def test_wildcard_bind_without_keys_is_refused_even_when_unsafe_is_allowed(address):
    with pytest.raises(BindRefused, match="all interfaces"):
        check_bind(address, None, allow_unsafe_remote_rpc=True)


def test_non_loopback_bind_is_allowed_with_the_unsafe_flag():
    check_bind("tcp://10.1.2.3:5555", None, allow_unsafe_remote_rpc=True)


@pytest.mark.parametrize("address", ["tcp://10.1.2.3:5555", "tcp://*:5555"])
def test_non_loopback_and_wildcard_binds_are_allowed_with_curve_keys(address, tmp_path):
    _, secret = create_certificates(tmp_path, "server")
    curve = CurveConfig(str(secret), str(tmp_path))
    check_bind(address, curve, allow_unsafe_remote_rpc=False)


@pytest.mark.parametrize(
    "address",
    [
        "udp://127.0.0.1:5",
        "pgm://eth0;239.0.0.1:5",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:70000",
        "tcp://127.0.0.1:65536",
        "127.0.0.1:5555",
        "tcp://:5555",
        "tcp://127.0.0.1:\u0665\u0665",  # digits, but not ASCII ones
    ],
)
def test_unsupported_or_malformed_addresses_are_refused(address):
    with pytest.raises(BindRefused):
        check_bind(address, None, allow_unsafe_remote_rpc=True)


@pytest.mark.parametrize("address", ["tcp://::1:5555", "tcp://fe80::1:5555"])
def test_an_ipv6_address_without_brackets_is_refused(address):
    with pytest.raises(BindRefused, match="IPv6 address without brackets"):
        check_bind(address, None, allow_unsafe_remote_rpc=True)


def test_cli_refuses_a_non_loopback_bind_without_keys(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(
            [
                "--engine",
                "reference",
                "--device",
                "cpu",
                "--address",
                "tcp://10.1.2.3:5555",
            ]
        )
    assert exit_info.value.code == 2
    assert "refusing to bind the non-loopback address" in capsys.readouterr().err


def test_cli_refuses_a_wildcard_bind_with_the_unsafe_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(
            [
                "--engine",
                "reference",
                "--device",
                "cpu",
                "--address",
                "tcp://0.0.0.0:5555",
                "--allow-unsafe-remote-rpc",
            ]
        )
    assert "all interfaces" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["tcp://0.0.0.0%lo:*", "tcp://*%lo:*"])
def test_a_zoned_wildcard_that_zeromq_binds_on_all_interfaces_is_refused(address):
    # What ZeroMQ makes of it: all interfaces.
    context = zmq.Context()
    probe = context.socket(zmq.REP)
    probe.bind(address)
    bound = probe.getsockopt_string(zmq.LAST_ENDPOINT)
    probe.close(linger=0)
    context.term()
    assert bound.startswith("tcp://0.0.0.0:")
    with pytest.raises(BindRefused, match="all interfaces"):
        check_bind(address, None, allow_unsafe_remote_rpc=True)


def test_unsafe_remote_bind_logs_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        warn_if_unsafe("tcp://10.1.2.3:5555", None)
    assert "UNSAFE" in caplog.text


def test_local_bind_logs_no_warning(caplog):
    with caplog.at_level(logging.WARNING):
        warn_if_unsafe("tcp://127.0.0.1:5555", None)
    assert caplog.text == ""


def test_the_server_warns_of_an_unsafe_remote_bind_at_every_start(caplog):
    # An interface name counts as remote (the rules resolve no names); this
    # one binds on any Linux machine, as the CLI checks at parse time.
    address = "tcp://lo:5555"
    argv = ["--engine", "reference", "--device", "cpu", "--address", address]
    argv.append("--allow-unsafe-remote-rpc")
    stop = threading.Event()
    stop.set()  # each start stops as soon as its start-up begins
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            args = parse_args([*argv, "--status-port", str(free_tcp_port())])
            assert run(args, stop) == 0
    warnings = [r.getMessage() for r in caplog.records if "UNSAFE" in r.getMessage()]
    assert len(warnings) == 2 and address in warnings[0]
