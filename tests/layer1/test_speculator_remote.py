# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``RemoteK3DSparkSpeculator`` with a real VllmConfig, real InputBatch and a
scripted server (real ZeroMQ): what reaches the server and what propose()
returns. The request table is ``toy_target.TokenTable`` (upstream's
``RequestState`` needs a CUDA driver to build)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import socket
import threading
import time
from typing import Any, cast

import numpy as np
import pytest
import torch
import zmq
import zmq.auth
from k3_layer1_server import DraftServerProcess, create_certificates, free_tcp_port
from toy_target import (
    HIDDEN,
    NUM_AUX,
    TokenTable,
    make_input_batch,
    make_vllm_config,
)
from tp_replay import RecordingRank0, ReplayingRank1
from zmq.auth.thread import ThreadAuthenticator

from vllm.k3_draft.client import IncompatibleServerError
from vllm.k3_draft.plan import RemotePlan
from vllm.v1.worker.gpu.spec_decode import init_speculator
from vllm.v1.worker.gpu.spec_decode.dspark import remote_speculator
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    ImmediateResolution,
    NoDraftIds,
)
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

pytest_plugins = ("conftest_client",)

K = 3


def _propose(speculator, **kwargs):
    """One step of two decoding requests (rows 3 and 5 of the table)."""
    n, per = 2, K + 1
    input_batch = make_input_batch(
        ["a", "b"],
        np.array([3, 5]),
        np.array([0, per, 2 * per], dtype=np.int32),
        torch.cat([torch.arange(10, 10 + per), torch.arange(20, 20 + per)]),
        n * per,
    )
    aux = [torch.zeros(n * per, HIDDEN) for _ in range(NUM_AUX)]
    return speculator.propose(
        input_batch,
        {},
        {},
        aux[0],
        aux,
        torch.tensor([2, 1], dtype=torch.int32),
        torch.tensor([2, 3], dtype=torch.int32),
        torch.zeros(8, 1, dtype=torch.int64),
        torch.zeros(1, 8, dtype=torch.int32),
        torch.zeros(8),
        torch.zeros(8, dtype=torch.int64),
        **kwargs,
    )


def test_is_a_base_speculator_with_conforming_graph_hooks(
    make_speculator, scripted_server
):
    speculator, _ = make_speculator(scripted_server.address)
    assert isinstance(speculator, BaseSpeculator)
    assert isinstance(speculator.resolution, ImmediateResolution)
    assert isinstance(speculator.plan, RemotePlan)
    speculator.init_cudagraph_manager(None)
    speculator.capture()
    assert speculator.draft_logits is None
    assert scripted_server.ops() == ["PING"]


def test_propose_sends_valid_rows_and_returns_contiguous_drafts(
    make_speculator, scripted_server
):
    speculator, _ = make_speculator(scripted_server.address)
    drafts = _propose(speculator)
    assert drafts.shape == (2, K) and drafts.dtype == torch.int64
    assert drafts.is_contiguous() and (drafts == 5).all()
    propose = scripted_server.log[-1][1]
    assert [
        (r["anchor_position"], r["context_count"]) for r in propose["requests"]
    ] == [
        (12, 2),
        (21, 1),
    ]


def test_every_tp_rank_returns_rank_0s_drafts_by_broadcast(
    make_speculator, scripted_server, monkeypatch
):
    rank0, _ = make_speculator(scripted_server.address)
    rank0.tp_group = recorder = RecordingRank0()
    drafts = _propose(rank0).clone()
    assert (drafts == 5).all()
    ops = scripted_server.ops()
    monkeypatch.setattr(
        remote_speculator, "get_tp_group", lambda: ReplayingRank1(recorder.sent)
    )
    rank1, _ = make_speculator(scripted_server.address)
    assert rank1.plan is None
    assert torch.equal(_propose(rank1), drafts)
    # Only rank 0 talks to the draft server.
    assert scripted_server.ops() == ops


@pytest.mark.parametrize("flag", ["dummy_run", "is_profile"])
def test_dummy_and_profile_runs_do_not_reach_the_server(
    make_speculator, scripted_server, flag
):
    speculator, _ = make_speculator(scripted_server.address)
    assert (_propose(speculator) == 5).all()
    # No draft of the step before may survive into the dummy one.
    drafts = _propose(speculator, **{flag: True})
    assert drafts.shape == (2, K) and (drafts == -1).all()
    assert scripted_server.ops() == ["PING", "PROPOSE"]


def test_zero_tokens_keeps_the_server_in_sync_without_drafts(
    make_speculator, scripted_server
):
    speculator, _ = make_speculator(scripted_server.address)
    drafts = _propose(speculator, num_speculative_tokens=0)
    assert drafts.shape == (2, K) and (drafts == -1).all()
    assert scripted_server.log[-1][1]["num_speculative_tokens"] == 1


def test_fewer_tokens_fill_the_rest_with_no_draft(make_speculator, scripted_server):
    speculator, _ = make_speculator(scripted_server.address)
    assert (_propose(speculator) == 5).all()
    drafts = _propose(speculator, num_speculative_tokens=2)
    assert (drafts[:, :2] == 5).all() and (drafts[:, 2] == -1).all()
    assert scripted_server.log[-1][1]["num_speculative_tokens"] == 2


def _timing_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("Remote draft over ")
    ]


def test_timing_is_logged_every_interval_proposals(
    make_speculator, scripted_server, monkeypatch, caplog
):
    monkeypatch.setenv("VLLM_K3_DRAFT_TIMING_LOG_INTERVAL", "2")
    speculator, _ = make_speculator(scripted_server.address)
    counts = []
    with caplog.at_level(logging.INFO, logger="vllm.k3_draft.plan"):
        for _ in range(4):
            _propose(speculator)
            counts.append(len(_timing_lines(caplog)))
    assert counts == [0, 1, 1, 2]
    # The means over the interval: the scripted server reports 0.1 ms.
    assert "Remote draft over 2 proposals" in _timing_lines(caplog)[0]
    assert "server 0.100 ms" in _timing_lines(caplog)[0]


def test_timing_is_not_logged_by_default(make_speculator, scripted_server, caplog):
    speculator, _ = make_speculator(scripted_server.address)
    with caplog.at_level(logging.INFO, logger="vllm.k3_draft.plan"):
        for _ in range(3):
            _propose(speculator)
    assert scripted_server.ops().count("PROPOSE") == 3
    assert _timing_lines(caplog) == []


def test_incompatible_server_is_refused_at_init(make_speculator, scripted_server):
    scripted_server.pong["context_width"] = 4096
    with pytest.raises(IncompatibleServerError, match="context_width"):
        make_speculator(scripted_server.address)


def test_server_of_another_protocol_version_is_refused_at_init(
    make_speculator, scripted_server
):
    """A draft server of another release answers the PING with an error in
    its own protocol version: the verifier fails to start, as for any server
    that answers and cannot serve it (not "did not answer", drafting never)."""
    reply = {
        "ok": False,
        "protocol": 3,
        "op": "ERROR",
        "server_id": "scripted-1",
        "error": "ProtocolError: protocol version 2 is not 3",
    }
    scripted_server.handlers["PING"] = lambda header, frames: [
        json.dumps(reply).encode()
    ]
    with pytest.raises(IncompatibleServerError, match="wire protocol 3"):
        make_speculator(scripted_server.address)


def test_another_speculative_method_with_a_remote_address_is_refused_at_init(
    make_speculator, vllm_config_factory, scripted_server
):
    # A copy: the factory's configs are shared between tests.
    config = copy.deepcopy(vllm_config_factory())
    config.speculative_config.method = "eagle"
    with pytest.raises(ValueError, match=r"serves methods .*, not 'eagle'"):
        make_speculator(scripted_server.address, config)
    assert scripted_server.ops() == []


def test_watermarking_is_refused_at_init(tmp_path, make_speculator, scripted_server):
    from vllm.config import WatermarkConfig

    config = make_vllm_config(tmp_path)
    config.speculative_config.draft_sample_method = "probabilistic"
    config.watermark_config = WatermarkConfig(key=1, algorithm="dual_key_gumbel")
    # Upstream accepts it: its model runner then watermarks the drafts
    # through the speculator, which a remote draft cannot do.
    config._check_supports_watermarking()
    with pytest.raises(ValueError, match="does not support watermarking"):
        make_speculator(scripted_server.address, config=config)


@pytest.mark.parametrize(
    "setting, match",
    [
        ("data_parallel_size", "data_parallel_size=2 is not supported"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ],
    ids=["data", "prefill-context"],
)
def test_parallelism_a_remote_draft_cannot_serve_is_refused_at_init(
    tmp_path, make_speculator, scripted_server, setting, match
):
    config = make_vllm_config(tmp_path)
    setattr(config.parallel_config, setting, 2)
    with pytest.raises(ValueError, match=match):
        make_speculator(scripted_server.address, config=config)
    assert scripted_server.ops() == []


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_every_rank_of_a_dense_data_parallel_engine_is_refused_at_init(
    tmp_path, make_speculator, scripted_server, dp_rank
):
    config = copy.deepcopy(make_vllm_config(tmp_path, data_parallel_size=2))
    assert not config.model_config.is_moe
    parallel_config = config.parallel_config
    # What EngineCoreProc.run_engine_core does for a dense model before its
    # workers (and so the speculator) are built: every DP rank becomes an
    # independent engine that its workers see as data_parallel_size=1.
    parallel_config.data_parallel_index = dp_rank
    parallel_config.data_parallel_rank_local = dp_rank
    parallel_config.reconfigure_for_independent_dp_rank()
    assert parallel_config.data_parallel_size == 1
    with pytest.raises(ValueError, match="data_parallel_size=2 is not supported"):
        make_speculator(scripted_server.address, config=config)
    assert scripted_server.ops() == []


def _enable_prompt_embeds(config: Any) -> None:
    config.model_config.enable_prompt_embeds = True


def _enable_lora(config: Any) -> None:
    from vllm.config import LoRAConfig

    config.lora_config = LoRAConfig()


def _make_multimodal(config: Any) -> None:
    from vllm.config import MultiModalConfig

    config.model_config.multimodal_config = MultiModalConfig()


@pytest.mark.parametrize(
    "enable", [_enable_prompt_embeds, _enable_lora, _make_multimodal]
)
def test_inputs_beyond_token_ids_keep_reconnects_within_a_request(
    tmp_path, make_speculator, scripted_server, enable
):
    # Equal token ids need not mean equal hidden states once prompt
    # embeddings, LoRA adapters or multimodal inputs feed the target.
    config = make_vllm_config(tmp_path)
    shared, _ = make_speculator(scripted_server.address, config=config)
    assert shared.plan.share_prefixes
    enable(config)
    speculator, _ = make_speculator(scripted_server.address, config=config)
    assert not speculator.plan.share_prefixes


def test_the_verifier_drafts_through_curve_with_its_key_variables(
    make_speculator, monkeypatch, curve_setup
):
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_SERVER_KEY", str(curve_setup["server"]))
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", str(curve_setup["client"]))
    speculator, _ = make_speculator(curve_setup["curve"])
    # Without the keys the server never answers: no drafts at all.
    assert (_propose(speculator) >= 0).all()


@pytest.mark.parametrize(
    "variable", ["VLLM_K3_DRAFT_CURVE_SERVER_KEY", "VLLM_K3_DRAFT_CURVE_CLIENT_KEY"]
)
def test_one_curve_key_variable_without_the_other_is_refused_at_init(
    tmp_path, make_speculator, scripted_server, monkeypatch, variable
):
    public, _ = create_certificates(tmp_path, "server")
    monkeypatch.setenv(variable, str(public))
    with pytest.raises(ValueError, match="Set both VLLM_K3_DRAFT_CURVE_SERVER_KEY"):
        make_speculator(scripted_server.address)


@pytest.fixture(scope="module")
def curve_setup(tmp_path_factory):
    """A CURVE draft server on loopback TCP with one authorized client, a plain
    one, and key files: the server's, another server's, the authorized
    client's and a client the server does not know."""
    root = tmp_path_factory.mktemp("curve")
    keys = {}
    keys["server"], server_secret = create_certificates(root, "server")
    keys["other_server"], _ = create_certificates(root, "other")
    authorized = root / "authorized"
    authorized.mkdir()
    _, keys["client"] = create_certificates(authorized, "client")
    _, keys["unknown_client"] = create_certificates(root, "unknown")
    curve = DraftServerProcess(
        root / "curve",
        f"tcp://127.0.0.1:{free_tcp_port()}",
        curve_secret_key=server_secret,
        curve_authorized_keys=authorized,
    ).start()
    plain = DraftServerProcess(
        root / "plain", f"tcp://127.0.0.1:{free_tcp_port()}"
    ).start()
    yield {"curve": curve.address, "plain": plain.address, **keys}
    curve.stop()
    plain.stop()


@pytest.mark.parametrize(
    "server, server_key, client_key, match",
    [
        ("plain", "server", "client", "does not use CURVE"),
        ("curve", None, None, "requires CURVE"),
        ("curve", "server", "unknown_client", "refused this verifier's CURVE key"),
    ],
    ids=["keys-to-a-plain-server", "no-keys", "unknown-client"],
)
def test_curve_keys_the_server_refuses_fail_start_up_in_one_line(
    make_speculator, monkeypatch, curve_setup, server, server_key, client_key, match
):
    """Keys that can never work (set for a server without CURVE, missing for
    one with it, a client key the server does not authorize) are not an
    unreachable server that may come up later: the verifier fails to start,
    saying which."""
    for variable, key in (
        ("VLLM_K3_DRAFT_CURVE_SERVER_KEY", server_key),
        ("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", client_key),
    ):
        if key is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, str(curve_setup[key]))
    # A final refusal ends the wait at once.
    with pytest.raises(IncompatibleServerError, match=match) as info:
        make_speculator(curve_setup[server], timeout_ms=60_000)
    assert "\n" not in str(info.value)


def test_another_servers_key_is_named_in_the_start_up_warning(
    make_speculator, monkeypatch, curve_setup, caplog
):
    """A server that closes every CURVE handshake (another server's public
    key, most likely; but a forwarder closes connections alike) leaves the
    verifier without drafts, its warning naming the key variable."""
    monkeypatch.setenv(
        "VLLM_K3_DRAFT_CURVE_SERVER_KEY", str(curve_setup["other_server"])
    )
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", str(curve_setup["client"]))
    with caplog.at_level(logging.WARNING):
        speculator, _ = make_speculator(curve_setup["curve"], timeout_ms=2000)
    assert speculator.plan.server is None
    assert "VLLM_K3_DRAFT_CURVE_SERVER_KEY" in caplog.text
    assert (_propose(speculator) == -1).all()


class _Forwarder:
    """A TCP forwarder on loopback to ``backend_port``, as ``ssh -L`` or
    ``socat`` forward: it accepts every connection and closes it at once
    while nothing listens on the backend port (a server still loading)."""

    def __init__(self, backend_port: int) -> None:
        self.backend_port = backend_port
        self.listener = socket.create_server(("127.0.0.1", free_tcp_port()))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                backend = socket.create_connection(("127.0.0.1", self.backend_port))
            except OSError:
                client.close()
                continue
            self.connections += (client, backend)
            for source, sink in ((client, backend), (backend, client)):
                threading.Thread(
                    target=self._pump, args=(source, sink), daemon=True
                ).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        # Wakes the accepting thread (close alone leaves it blocked).
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()


def test_a_curve_server_still_loading_behind_a_forwarder_is_waited_for(
    make_speculator, monkeypatch, tmp_path
):
    """A CURVE verifier that reaches its server through a forwarder, which
    closes every connection while the server still loads, is not refused at
    start-up as if its keys were wrong (a closed connection says nothing
    about them): it starts without drafts and drafts once the server serves."""
    server_public, server_secret = create_certificates(tmp_path, "server")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    _, client_secret = create_certificates(authorized, "client")
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_SERVER_KEY", str(server_public))
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", str(client_secret))
    backend_port = free_tcp_port()
    forwarder = _Forwarder(backend_port)
    try:
        speculator, _ = make_speculator(forwarder.address, timeout_ms=1000)
        assert speculator.plan.server is None
        server = DraftServerProcess(
            tmp_path / "server",
            f"tcp://127.0.0.1:{backend_port}",
            curve_secret_key=server_secret,
            curve_authorized_keys=authorized,
        ).start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and speculator.plan.server is None:
                _propose(speculator)
                time.sleep(0.05)
            assert (_propose(speculator) >= 0).all()
        finally:
            server.stop()
    finally:
        forwarder.close()


def test_a_server_that_comes_up_refusing_the_key_is_named_in_the_warning(
    make_speculator, monkeypatch, tmp_path, caplog
):
    """A verifier that started while its server was down, and whose server
    then comes up refusing this verifier's CURVE key, says why it gets no
    PONG (not only that none came), and keeps running without drafts."""
    server_public, server_secret = create_certificates(tmp_path, "server")
    _, client_secret = create_certificates(tmp_path, "client")
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_SERVER_KEY", str(server_public))
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", str(client_secret))
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    speculator, _ = make_speculator(address, timeout_ms=200)
    assert speculator.plan.server is None
    # The server comes up, authorizing no client.
    context = zmq.Context()
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(tmp_path / "none"))
    server = context.socket(zmq.REP)
    server.setsockopt(zmq.LINGER, 0)
    server.curve_server = True
    server.curve_publickey, server.curve_secretkey = zmq.auth.load_certificate(
        server_secret
    )
    server.bind(address)
    refused = "the server refused this verifier's CURVE key"
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.k3_draft.plan"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(
                refused in r.getMessage() for r in caplog.records
            ):
                assert (_propose(speculator) == -1).all()
                time.sleep(0.05)
    finally:
        server.close()
        authenticator.stop()
        context.term()
    (warning,) = [r.getMessage() for r in caplog.records if refused in r.getMessage()]
    assert warning.startswith(
        f"Remote draft unavailable (no PONG from the draft server {address} "
        "within 200 ms: the security handshake failed: "
    )


def _start_up_refusal(config: Any) -> str:
    """The one-line ValueError with which ``init_speculator`` refuses
    ``config`` under the environment's remote variables."""
    table = TokenTable(torch.zeros(8, 16, dtype=torch.int32))
    with pytest.raises(ValueError) as info:
        init_speculator(config, torch.device("cpu"), cast(Any, table))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "address, reason",
    [
        ("tcp://draft host:5555", "Invalid argument"),
        ("ipc:///tmp/" + "x" * 200, "File name too long"),
    ],
)
@pytest.mark.parametrize(
    "variable, method",
    [
        ("VLLM_K3_DRAFT_REMOTE_ADDRESS", "dflash"),
        ("VLLM_K3_DSPARK_REMOTE_ADDRESS", "dspark"),
    ],
)
def test_an_address_zeromq_cannot_connect_to_is_refused_naming_its_variable(
    tp_world, vllm_config_factory, monkeypatch, variable, method, address, reason
):
    """Well-formed for the config's check, refused by ZeroMQ's connect."""
    for name in ("VLLM_K3_DRAFT_REMOTE_ADDRESS", "VLLM_K3_DSPARK_REMOTE_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, address)
    message = _start_up_refusal(vllm_config_factory(method=method))
    assert message == f"{variable}: cannot connect to {address!r}: {reason}"


@pytest.mark.parametrize(
    "variable, path, problem",
    [
        ("VLLM_K3_DRAFT_CURVE_SERVER_KEY", "missing", "cannot load"),
        ("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", "missing", "cannot load"),
        ("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", "server_public", "holds no secret key"),
    ],
)
def test_an_unusable_curve_key_file_is_refused_naming_its_variable(
    tp_world, vllm_config_factory, monkeypatch, tmp_path, variable, path, problem
):
    public, secret = create_certificates(tmp_path, "key")
    files = {"server_public": str(public), "missing": str(tmp_path / "missing")}
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", "tcp://127.0.0.1:5555")
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_SERVER_KEY", str(public))
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", str(secret))
    monkeypatch.setenv(variable, files[path])
    message = _start_up_refusal(vllm_config_factory())
    assert message.startswith(f"{variable}: ")
    assert files[path] in message
    assert problem in message


def test_a_client_secret_key_open_to_other_users_is_refused_naming_its_variable(
    tp_world, vllm_config_factory, monkeypatch, tmp_path
):
    public, secret = create_certificates(tmp_path, "key")
    os.chmod(secret, 0o644)
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", "tcp://127.0.0.1:5555")
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_SERVER_KEY", str(public))
    monkeypatch.setenv("VLLM_K3_DRAFT_CURVE_CLIENT_KEY", str(secret))
    message = _start_up_refusal(vllm_config_factory())
    assert message == (
        f"VLLM_K3_DRAFT_CURVE_CLIENT_KEY: {secret}: secret key file has mode "
        "0644, open to other users (chmod 600 it)"
    )


def test_unreachable_server_starts_without_drafts(make_speculator):
    speculator, _ = make_speculator(
        f"tcp://127.0.0.1:{free_tcp_port()}", timeout_ms=200
    )
    assert speculator.plan.server is None
    assert (_propose(speculator) == -1).all()


def test_empty_draft_slots_are_hidden_from_the_embedding_until_sampling(
    make_speculator,
):
    # A step after a failed-closed proposal: last sampled token, then K -1s;
    # then the real token 0, which must come back as itself.
    speculator, _ = make_speculator(
        f"tcp://127.0.0.1:{free_tcp_port()}", timeout_ms=200
    )
    drafts = _propose(speculator)[0]
    input_ids = torch.cat([torch.tensor([42]), drafts, torch.tensor([0, 8])])
    embedding = torch.randn(64, 4)
    with pytest.raises(IndexError):
        torch.nn.functional.embedding(input_ids, embedding)
    ids = NoDraftIds()
    ids.hide(input_ids)
    torch.nn.functional.embedding(input_ids, embedding)
    assert input_ids.tolist() == [42, 0, 0, 0, 0, 8]
    ids.show()
    assert input_ids.tolist() == [42, -1, -1, -1, 0, 8]
    ids.show()
    assert input_ids.tolist() == [42, -1, -1, -1, 0, 8]


def test_request_state_exposes_the_host_token_table(monkeypatch):
    """The states.py hook: ``all_token_ids_cpu`` is the UVA buffer's host side
    (UVA itself is faked: it needs a CUDA driver)."""
    from k3_runner_init import HostUvaBuffer

    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(buffer_utils, "UvaBuffer", HostUvaBuffer)
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: True)
    states = RequestState(4, 64, 32, K, 1024, torch.device("cpu"))
    assert states.all_token_ids_cpu is states.all_token_ids._uva_buf.cpu
    dense = RequestState(
        4, 64, 32, K, 1024, torch.device("cpu"), use_dense_all_token_ids=True
    )
    assert dense.all_token_ids_cpu is None
