# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The draft server as a real process behind its ZeroMQ transport."""

import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq
import zmq.auth
from k3_layer1_server import (
    DEFAULT_OPTIONS,
    DraftServerProcess,
    RawClient,
    create_certificates,
    entry,
    free_tcp_port,
    propose_message,
)
from zmq.utils.monitor import recv_monitor_message

from vllm.entrypoints.k3_dspark_rpc import RpcTransport, SocketFileLost
from vllm.entrypoints.k3_dspark_standalone import parse_args, run
from vllm.k3_draft import protocol
from vllm.k3_draft.engine import DraftLimits
from vllm.k3_draft.reference_engine import ReferenceEngine, ReferenceModelConfig
from vllm.k3_draft.security import BindRefused, CurveConfig
from vllm.k3_draft.server import DraftServer

WIDTH = DEFAULT_OPTIONS["context_width"]


def first_proposal(client: RawClient) -> list[list[int]]:
    frames = propose_message([entry("r", 30, 30, reset=True)], 3, WIDTH, seed=5)
    reply = json.loads(client.send_frames(frames)[0])
    assert reply["ok"], reply
    return reply["tokens"]


def test_pong_describes_the_server(raw_client):
    pong, frames = raw_client.call("PING")
    assert frames == [] and pong["op"] == "PONG"
    assert set(pong) == {"ok", "protocol", "op", *protocol.PONG_FIELDS}
    options = DEFAULT_OPTIONS
    # Each bound as the server's flags set it (--max-num-seqs: the batch).
    expected = {
        "method": options["method"],
        "context_width": WIDTH,
        "vocab_size": options["vocab_size"],
        "max_requests": options["max_requests"],
        "max_batch_size": options["max_num_seqs"],
        "max_speculative_tokens": options["max_speculative_tokens"],
        "max_context_tokens": options["max_context_tokens"],
        "max_model_len": options["max_model_len"],
        "block_size": options["block_size"],
        "window_size": options["window_size"],
        "prefix_cache_tokens": options["prefix_cache_tokens"],
        # On CPU nothing is captured.
        "cuda_graph_shapes": [],
    }
    assert {key: pong[key] for key in expected} == expected


def test_greedy_propose_reply_is_a_single_frame(raw_client):
    raw_client.call("CLEAR")
    frames = propose_message([entry("a", 8, 8, reset=True)], 2, WIDTH)
    assert len(raw_client.send_frames(frames)) == 1


@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    """A server these tests may stop and restart."""
    server = DraftServerProcess(tmp_path_factory.mktemp("own")).start()
    yield server
    server.stop()


def test_restart_changes_server_id_and_forgets_requests(own_server):
    client = RawClient(own_server.address)
    client.call("CLEAR")
    first_proposal(client)
    before = client.call("PING")[0]
    own_server.restart()
    after = client.call("PING")[0]
    client.close()
    assert after["server_id"] != before["server_id"]
    assert (before["active_requests"], after["active_requests"]) == (1, 0)


def test_same_seed_gives_the_same_proposals_after_restart(own_server):
    client = RawClient(own_server.address)
    client.call("CLEAR")
    before = first_proposal(client)
    own_server.restart()
    after = first_proposal(client)
    client.close()
    assert after == before


def test_sigterm_stops_the_program_cleanly_after_it_served(tmp_path):
    server = DraftServerProcess(tmp_path, as_program=True).start()
    client = RawClient(server.address)
    first_proposal(client)
    client.close()
    code = server.stop()
    log = server.log_tail()
    assert code == 0, log
    assert "Draft server stopped" in log and "Traceback" not in log


def test_the_server_raises_its_soft_open_file_limit_to_the_hard_one(tmp_path):
    """Every connection holds a descriptor: a soft limit of 256 would let a
    few hundred idle connections keep new clients out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        server = DraftServerProcess(tmp_path, as_program=True).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert server.proc is not None
    try:
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    finally:
        server.stop()
    (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
    expected = 65535 if hard == resource.RLIM_INFINITY else min(hard, 65535)
    assert line.split()[3] == str(expected), line


def test_dspark_server_drafts_k_tokens_from_k_query_rows(draft_server_factory):
    server = draft_server_factory(method="dspark")
    client = RawClient(server.address)
    assert client.call("PING")[0]["method"] == "dspark"
    assert [len(row) for row in first_proposal(client)] == [3]
    client.close()


def test_tcp_loopback_server_serves(draft_server_factory):
    server = draft_server_factory(address=f"tcp://127.0.0.1:{free_tcp_port()}")
    client = RawClient(server.address)
    assert client.call("PING")[0]["ok"]
    client.close()


def test_transport_failure_ends_serve_with_the_error():
    engine = ReferenceEngine(
        DraftLimits(2, 1, 1, 8, 64, 16, 16, 16),
        ReferenceModelConfig(),
        torch.device("cpu"),
    )
    engine.load()
    transport = RpcTransport(DraftServer(engine), "inproc://dead", None)
    transport.bind()
    assert transport.socket is not None
    transport.socket.close()
    served = []
    with pytest.raises(zmq.ZMQError):
        transport.serve(threading.Event(), lambda: served.append(True))
    transport.close()
    assert served == [True]


class _LargeReplyServer:
    """What the transport sees of a draft server whose replies carry a large
    zero-copy frame (as a PROPOSE with draft logits does), after 0.5 s of
    engine time."""

    limits = SimpleNamespace(max_context_tokens=8)
    engine = SimpleNamespace(spec=SimpleNamespace(context_width=8))
    max_header_bytes = 1 << 16
    frame = bytearray(64 << 20)

    def handle(self, frames):
        time.sleep(0.5)
        return [b'{"ok": true}', memoryview(self.frame)]


class _AtOnceServer:
    """What the transport sees of a draft server that answers at once."""

    limits = SimpleNamespace(max_context_tokens=8)
    engine = SimpleNamespace(spec=SimpleNamespace(context_width=8))
    max_header_bytes = 1 << 16

    def handle(self, frames):
        return [b'{"ok": true}']


class _LargeHeaderServer(_AtOnceServer):
    """What the transport sees of a draft server whose header limit is above
    its context-row frame at full staging."""

    max_header_bytes = 4 << 20


class _NarrowRowsServer(_AtOnceServer):
    """What the transport sees of a draft server whose context rows are
    narrower than their int64 positions."""

    limits = SimpleNamespace(max_context_tokens=1 << 18)
    engine = SimpleNamespace(spec=SimpleNamespace(context_width=1))


@contextlib.contextmanager
def _served(
    transport: RpcTransport,
) -> Iterator[tuple[zmq.Socket, threading.Event, threading.Thread]]:
    """``transport`` bound and served in a thread; yields a REQ client
    connected to it, the serve loop's stop flag and its thread; stops and
    closes it after."""
    transport.bind()
    assert transport.endpoint is not None
    stop = threading.Event()
    thread = threading.Thread(target=transport.serve, args=(stop, lambda: None))
    thread.start()
    context = zmq.Context()
    client = context.socket(zmq.REQ)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        client.connect(transport.endpoint)
        yield client, stop, thread
    finally:
        client.close()
        context.term()
        stop.set()
        thread.join()
        transport.close()


def test_a_header_within_the_servers_header_limit_reaches_the_server(tmp_path):
    address = f"ipc://{tmp_path}/draft.ipc"
    transport = RpcTransport(_LargeHeaderServer(), address, None)
    with _served(transport) as (client, _, _):
        client.send(b" " * (2 << 20))
        assert client.recv() == b'{"ok": true}'


def test_a_positions_frame_at_full_staging_reaches_the_server(tmp_path):
    address = f"ipc://{tmp_path}/draft.ipc"
    transport = RpcTransport(_NarrowRowsServer(), address, None)
    with _served(transport) as (client, _, _):
        client.send_multipart([b"{}", bytes(8 << 18), bytes(2 << 18)])
        assert client.recv() == b'{"ok": true}'


def test_requests_within_and_after_a_busy_poll_are_answered(tmp_path):
    transport = RpcTransport(
        _AtOnceServer(), f"ipc://{tmp_path}/draft.ipc", None, busy_poll_us=20_000
    )
    with _served(transport) as (client, _, _):
        answers = []
        for pause_s in (0.0, 0.0, 0.2):  # the last one after the poll ended
            time.sleep(pause_s)
            client.send(b"request")
            answers.append(client.recv())
    assert answers == [b'{"ok": true}'] * 3


def test_stop_ends_a_busy_poll(tmp_path):
    transport = RpcTransport(
        _AtOnceServer(), f"ipc://{tmp_path}/draft.ipc", None, busy_poll_us=1_000_000
    )
    with _served(transport) as (client, stop, thread):
        client.send(b"request")
        client.recv()
        stop.set()  # inside the one-second poll
        thread.join(0.6)
        stopped = not thread.is_alive()
    assert stopped


def _relay(source: socket.socket, sink: socket.socket, open_: threading.Event) -> None:
    """Copy ``source`` to ``sink`` while ``open_`` is set."""
    with contextlib.suppress(OSError):
        while (data := source.recv(65536)) and open_.is_set():
            sink.sendall(data)


def test_a_peer_that_vanishes_without_closing_is_dropped():
    """A verifier whose host vanishes sends no FIN: its path goes dark (here a
    relay that stops relaying but keeps both connections open). The server
    drops that connection instead of holding it, and its descriptor, for
    good."""
    transport = RpcTransport(
        _AtOnceServer(),
        f"tcp://127.0.0.1:{free_tcp_port()}",
        None,
        heartbeat_timeout_s=0.3,
    )
    transport.bind()
    assert transport.socket is not None and transport.endpoint is not None
    monitor = transport.socket.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
    )
    # Not a timing bound: only keeps a failing run from hanging.
    monitor.setsockopt(zmq.RCVTIMEO, 60_000)
    stop = threading.Event()
    thread = threading.Thread(target=transport.serve, args=(stop, lambda: None))
    thread.start()
    host, port = transport.endpoint.removeprefix("tcp://").rsplit(":", 1)
    relay = socket.create_server(("127.0.0.1", 0))
    context = zmq.Context()
    client = context.socket(zmq.REQ)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.RCVTIMEO, 10_000)
    open_ = threading.Event()
    open_.set()
    held: list[socket.socket] = []
    try:
        client.connect(f"tcp://127.0.0.1:{relay.getsockname()[1]}")
        verifier_side, _ = relay.accept()
        server_side = socket.create_connection((host, int(port)))
        held += [verifier_side, server_side]
        for pair in ((verifier_side, server_side), (server_side, verifier_side)):
            threading.Thread(target=_relay, args=(*pair, open_), daemon=True).start()
        client.send(b"request")
        assert client.recv() == b'{"ok": true}'
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        open_.clear()  # the path goes dark; neither connection closes
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        open_.clear()
        for sock in held:
            sock.close()
        relay.close()
        client.close()
        monitor.close()
        context.term()
        stop.set()
        thread.join()
        transport.close()


@contextlib.contextmanager
def _standalone_server(tmp_path: Path, *flags: str) -> Iterator[tuple[RawClient, int]]:
    """The standalone server (reference engine, CPU, an ipc address, more
    ``flags``) run in a thread; yields a client whose PING it answered and
    its status port."""
    path = tmp_path / "draft.ipc"
    status_port = free_tcp_port()
    args = parse_args(
        ["--engine", "reference", "--device", "cpu", "--window-size", "64"]
        + ["--status-port", str(status_port), "--address", f"ipc://{path}"]
        + list(flags)
    )
    stop = threading.Event()
    server = threading.Thread(target=run, args=(args, stop))
    server.start()
    client = RawClient(f"ipc://{path}")
    try:
        while not path.exists() and server.is_alive():
            time.sleep(0.05)
        assert client.call("PING")[0]["ok"]
        yield client, status_port
    finally:
        client.close()
        stop.set()
        server.join()


def test_the_busy_poll_flag_keeps_a_core_busy_only_within_its_window(tmp_path):
    with _standalone_server(tmp_path, "--busy-poll-us", "800000"):
        start = time.process_time()
        time.sleep(0.6)
        polling = time.process_time() - start
        time.sleep(0.4)  # the poll ends
        start = time.process_time()
        time.sleep(0.4)
        sleeping = time.process_time() - start
    assert polling > 0.15
    assert sleeping < 0.05


def test_the_status_server_answers_while_the_rpc_socket_is_polled(tmp_path):
    with _standalone_server(tmp_path, "--busy-poll-us", "1000000") as (_, port):
        start = time.monotonic()
        url = f"http://127.0.0.1:{port}/v1/status"
        with urllib.request.urlopen(url, timeout=5) as reply:
            status = json.load(reply)
        elapsed = time.monotonic() - start
    assert status["requests_by_op"]["PING"] == 1
    assert elapsed < 0.5  # within the one-second poll


@pytest.mark.parametrize("busy_poll_us", [-1, 1_000_001])
def test_a_busy_poll_outside_its_bounds_is_refused(busy_poll_us):
    with pytest.raises(ValueError, match=r"busy_poll_us must be in \[0, 1000000\]"):
        RpcTransport(_AtOnceServer(), "inproc://never", None, busy_poll_us=busy_poll_us)


# With CURVE keys (client public, client secret, server public) the client is
# a DEALER with two requests in flight: CURVE encrypts a reply into a copy as
# soon as ZeroMQ takes it, so only a reply queued behind one the stopped
# client does not read stays unsent.
_STALLING_CLIENT = """
import sys, time, zmq
curve = len(sys.argv) > 2
socket = zmq.Context().socket(zmq.DEALER if curve else zmq.REQ)
if curve:
    public, secret, server = (key.encode() for key in sys.argv[2:])
    socket.curve_publickey, socket.curve_secretkey = public, secret
    socket.curve_serverkey = server
socket.connect(sys.argv[1])
if curve:
    socket.send_multipart([b"", b"request"])
    socket.send_multipart([b"", b"request"])
else:
    socket.send(b"request")
time.sleep(0.3)  # ZeroMQ's I/O thread sends it
print("sent", flush=True)
time.sleep(3600)
"""


@contextlib.contextmanager
def _serving_past_a_stalled_client(
    transport: RpcTransport, curve: tuple[bytes, bytes, bytes] | None = None
) -> Iterator[threading.Thread]:
    """Serve ``transport`` (bound) in the thread yielded, while a client whose
    request it received (with the CURVE keys ``curve``: client public, client
    secret, server public) stops taking the reply; then stop and close it."""
    assert transport.socket is not None
    endpoint = transport.socket.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()
    served = threading.Thread(target=transport.serve, args=(stop, lambda: None))
    served.start()
    stalled = subprocess.Popen(
        [sys.executable, "-c", _STALLING_CLIENT, endpoint]
        + [key.decode() for key in curve or ()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stalled.stdout is not None and stalled.stdout.readline() == "sent\n"
        # Stopped before its reply (0.5 s of engine time) is sent.
        os.kill(stalled.pid, signal.SIGSTOP)
        time.sleep(1.0)
        yield served
    finally:
        os.kill(stalled.pid, signal.SIGKILL)
        stalled.wait()
        if stalled.stdout is not None:
            stalled.stdout.close()
        stop.set()
        served.join(10)
        # Bounded: a socket left open keeps close()'s context.term() waiting.
        closing = threading.Thread(target=transport.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "close() hangs: a socket was left open"


def _answered(
    endpoint: str,
    curve: tuple[bytes, bytes, bytes] | None = None,
    timeout_ms: int = 5000,
) -> bool:
    """Whether a healthy client on ``endpoint`` (with the CURVE keys
    ``curve``) gets its reply: its first request may go with the dropped
    connections; like the verifier's client it renews and retries."""
    context = zmq.Context()
    answered = False
    for _ in range(2):
        client = context.socket(zmq.REQ)
        client.setsockopt(zmq.LINGER, 0)
        client.setsockopt(zmq.RCVTIMEO, timeout_ms)
        if curve is not None:
            client.curve_publickey, client.curve_secretkey = curve[:2]
            client.curve_serverkey = curve[2]
        client.connect(endpoint)
        client.send(b"request")
        with contextlib.suppress(zmq.Again):
            answered = client.recv_multipart()[0] == b'{"ok": true}'
        client.close()
        if answered:
            break
    context.term()
    return answered


def test_a_client_that_stops_taking_its_reply_does_not_stall_the_server():
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    transport = RpcTransport(
        _LargeReplyServer(), address, None, reply_send_timeout_s=1.0
    )
    transport.bind()
    with _serving_past_a_stalled_client(transport) as served:
        assert _answered(address)
    assert not served.is_alive()


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:*", "ipc://*"])
def test_a_wildcard_address_keeps_its_endpoint_past_a_stalled_client(address):
    transport = RpcTransport(
        _LargeReplyServer(), address, None, reply_send_timeout_s=1.0
    )
    transport.bind()
    assert transport.socket is not None
    endpoint = transport.socket.getsockopt_string(zmq.LAST_ENDPOINT)
    with _serving_past_a_stalled_client(transport):
        assert _answered(endpoint)


def _bound_curve_transport(
    tmp_path: Path,
) -> tuple[RpcTransport, tuple[bytes, bytes, bytes], str, str]:
    """A CURVE transport bound on loopback that stalls past 1 s, one
    authorized client's keys (public, secret, server public), the address
    and the server's key file."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    _, server_secret = create_certificates(tmp_path, "server")
    _, client_secret = create_certificates(authorized, "client")
    server_public, _ = zmq.auth.load_certificate(server_secret)
    public, secret = zmq.auth.load_certificate(client_secret)
    assert secret is not None
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    curve = CurveConfig(str(server_secret), str(authorized))
    transport = RpcTransport(
        _LargeReplyServer(), address, curve, reply_send_timeout_s=1.0
    )
    transport.bind()
    return transport, (public, secret, server_public), address, str(server_secret)


def test_the_socket_bound_again_past_a_stalled_client_keeps_curve(tmp_path):
    transport, keys, address, _ = _bound_curve_transport(tmp_path)
    first = transport.socket
    with _serving_past_a_stalled_client(transport, keys):
        # The authorized client's request makes the server bind again.
        assert _answered(address, keys)
        assert transport.socket is not first
        assert not _answered(address, None, timeout_ms=1500)


@pytest.mark.parametrize("change", ["removed", "replaced"])
def test_the_socket_bound_again_keeps_the_keys_read_at_start_up(tmp_path, change):
    """The server's key file changed on disk after the bind: the socket bound
    again past a stalled client keeps the key pair clients know it by (the
    authorized keys are not read again either)."""
    transport, keys, address, server_secret = _bound_curve_transport(tmp_path)
    first = transport.socket
    os.unlink(server_secret)
    if change == "replaced":
        os.rename(create_certificates(tmp_path, "rotated")[1], server_secret)
    with _serving_past_a_stalled_client(transport, keys) as served:
        assert _answered(address, keys)
        assert transport.socket is not first
        assert served.is_alive()


def test_a_failed_bind_past_a_stalled_client_leaves_close_unblocked(monkeypatch):
    """Another listener takes the port while the server binds again past a
    stalled client: serve ends with the bind's error, and close() returns
    (the socket that could not bind is closed, not left open to keep
    ``context.term()`` waiting)."""
    port = free_tcp_port()
    transport = RpcTransport(
        _LargeReplyServer(), f"tcp://127.0.0.1:{port}", None, reply_send_timeout_s=1.0
    )
    transport.bind()
    failed: list[zmq.ZMQError] = []
    serve = transport.serve

    def serve_recording(stop: threading.Event, on_serving: Callable[[], None]) -> None:
        try:
            serve(stop, on_serving)
        except zmq.ZMQError as exc:
            failed.append(exc)

    monkeypatch.setattr(transport, "serve", serve_recording)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    zmq_bind = zmq.Socket.bind

    def bind_after_the_port_is_taken(self, address):
        # The old socket releases the port in ZeroMQ's I/O thread.
        deadline = time.monotonic() + 5
        while squatter.getsockname()[1] != port:
            try:
                squatter.bind(("127.0.0.1", port))
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        squatter.listen()
        return zmq_bind(self, address)

    context = zmq.Context()
    client = context.socket(zmq.REQ)
    client.setsockopt(zmq.LINGER, 0)
    try:
        with _serving_past_a_stalled_client(transport) as served:
            monkeypatch.setattr(zmq.Socket, "bind", bind_after_the_port_is_taken)
            # Its request makes the server bind again.
            client.connect(f"tcp://127.0.0.1:{port}")
            client.send(b"request")
            served.join(10)
            assert not served.is_alive()
            assert [exc.errno for exc in failed] == [zmq.EADDRINUSE]
    finally:
        client.close()
        context.term()
        squatter.close()


def test_a_stopped_server_removes_the_directory_of_its_ipc_wildcard():
    transport = RpcTransport(_LargeReplyServer(), "ipc://*", None)
    transport.bind()
    assert transport.socket is not None
    endpoint = transport.socket.getsockopt_string(zmq.LAST_ENDPOINT)
    directory = os.path.dirname(endpoint.removeprefix("ipc://"))
    transport.close()
    assert not os.path.exists(directory)


def test_an_ipc_path_that_became_a_file_after_parsing_is_not_bound(tmp_path):
    notes = tmp_path / "notes.txt"
    transport = RpcTransport(_LargeReplyServer(), f"ipc://{notes}", None)
    notes.write_text("kept\n")
    try:
        with pytest.raises(BindRefused, match="exists and is not a socket"):
            transport.bind()
    finally:
        transport.close()
    assert notes.read_text() == "kept\n"


def test_a_second_server_on_a_served_ipc_path_is_refused_in_one_line(
    draft_server_factory,
):
    first = draft_server_factory()
    second = draft_server_factory(address=first.address, start=False)
    code = second.launch().wait(timeout=120)
    log = second.log_tail()
    assert code == 1, log
    assert (
        f"Refusing to serve: cannot bind {first.address}: Address already in use"
    ) in log
    assert "Traceback" not in log
    client = RawClient(first.address)
    server_id = client.call("PING")[0]["server_id"]
    client.close()
    assert server_id == json.loads(first.http("/v1/status")[1])["server_id"]


def test_a_stale_ipc_socket_file_is_bound_over(tmp_path):
    path = tmp_path / "draft.ipc"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # left behind: nobody listens on it
    transport = RpcTransport(_LargeReplyServer(), f"ipc://{path}", None)
    try:
        transport.bind()
    finally:
        transport.close()


def test_a_stopped_server_removes_its_ipc_socket_file(draft_server_factory):
    server = draft_server_factory()
    path = server.address.removeprefix("ipc://")
    assert os.path.exists(path)
    assert server.stop() == 0
    assert not os.path.exists(path)


def _remove(path: Path) -> None:
    path.unlink()


def _replace(path: Path) -> None:
    other = path.with_name("other")
    other.write_text("another file\n")
    os.replace(other, path)


@pytest.mark.parametrize(
    ("lose", "how"), [(_remove, "removed"), (_replace, "replaced")]
)
def test_a_lost_ipc_socket_file_ends_serve_with_the_error(tmp_path, lose, how):
    path = tmp_path / "draft.ipc"
    transport = RpcTransport(_LargeReplyServer(), f"ipc://{path}", None)
    transport.bind()
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            transport.serve(threading.Event(), lambda: None)
        except SocketFileLost as exc:
            failed.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    lose(path)
    thread.join(timeout=30)
    transport.close()
    assert not thread.is_alive()
    assert f"was {how}; no client can connect" in str(failed[0])


def test_an_abstract_ipc_address_binds_without_a_socket_file():
    address = f"ipc://@k3-draft-test-{os.getpid()}-{time.monotonic_ns()}"
    transport = RpcTransport(_LargeReplyServer(), address, None)
    try:
        transport.bind()
        assert transport.endpoint == address
    finally:
        transport.close()


def test_a_stopped_server_leaves_the_socket_file_of_a_later_bind(tmp_path):
    path = tmp_path / "draft.ipc"
    transport = RpcTransport(_LargeReplyServer(), f"ipc://{path}", None)
    transport.bind()
    context = zmq.Context()
    later = context.socket(zmq.REP)
    try:
        later.bind(f"ipc://{path}")  # ZeroMQ unlinks the path and binds again
        inode = path.stat().st_ino
        transport.close()
        assert path.stat().st_ino == inode
    finally:
        later.close(linger=0)
        context.term()


# Runs the server as ``python -m`` does, sending the signal argv[1] to itself
# when the server module imports its transport module: during its imports.
_SIGNAL_DURING_IMPORTS = """
import os, runpy, sys
signum = int(sys.argv[1])

class SignalOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm.entrypoints.k3_dspark_rpc":
            os.kill(os.getpid(), signum)
        return None

sys.meta_path.insert(0, SignalOnImport())
sys.argv = ["k3_dspark_standalone", *sys.argv[2:]]
runpy.run_module(
    "vllm.entrypoints.k3_dspark_standalone", run_name="__main__", alter_sys=True
)
"""


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT], ids=lambda signum: signum.name
)
def test_a_stop_signal_during_the_imports_stops_the_server_cleanly(tmp_path, signum):
    server = DraftServerProcess(tmp_path)
    with open(server.log_path, "ab") as log_file:
        code = subprocess.run(
            [
                sys.executable,
                "-c",
                _SIGNAL_DURING_IMPORTS,
                str(int(signum)),
                *server.arguments(),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            timeout=120,
        ).returncode
    log = server.log_tail()
    assert code == 0, log
    assert "Stopped during start-up" in log and "Traceback" not in log


def test_sigterm_during_start_up_stops_the_server_before_it_serves(tmp_path):
    # A draft large enough that loading takes a few seconds on CPU.
    server = DraftServerProcess(
        tmp_path,
        as_program=True,
        hidden_size=1024,
        num_layers=16,
        vocab_size=32768,
        num_heads=8,
    )
    proc = server.launch()
    try:
        deadline = time.monotonic() + 120
        while server.http("/healthz")[0] != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        server.stop()
    log = server.log_tail()
    assert code == 0, log
    assert "Stopped during start-up" in log and "Draft RPC serving" not in log


def test_vllm_logging_level_debug_logs_the_status_requests(
    draft_server_factory, monkeypatch
):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    server = draft_server_factory()
    assert server.http("/healthz")[0] == 200
    server.stop()
    log = server.log_path.read_text()
    assert re.search(r"^DEBUG .*status .*GET /healthz", log, re.MULTILINE), log


def test_a_vllm_logging_level_that_names_no_level_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "LOUD")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--engine", "reference", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "VLLM_LOGGING_LEVEL='LOUD' is not a logging level" in capsys.readouterr().err
