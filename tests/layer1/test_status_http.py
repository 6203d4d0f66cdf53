# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HTTP status endpoints."""

import json
import logging
import socket
import struct
import time
import urllib.error
import urllib.request

import pytest
from k3_layer1_server import (
    DEFAULT_OPTIONS,
    RawClient,
    entry,
    free_tcp_port,
    propose_message,
)
from prometheus_client.parser import text_string_to_metric_families

from vllm.k3_draft.status import StatusServer, StatusState

WIDTH = DEFAULT_OPTIONS["context_width"]


@pytest.fixture
def loading_status():
    state = StatusState()
    server = StatusServer(state, "127.0.0.1", free_tcp_port())
    server.start()
    yield state, f"http://127.0.0.1:{server.httpd.server_address[1]}"
    server.stop()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_healthz_is_200_while_loading(loading_status):
    _, url = loading_status
    assert get(url + "/healthz")[0] == 200


def test_readyz_is_503_until_ready(loading_status):
    state, url = loading_status
    assert get(url + "/readyz")[0] == 503
    state.set_ready(True)
    assert get(url + "/readyz")[0] == 200


def test_readyz_is_503_again_once_not_ready(loading_status):
    state, url = loading_status
    state.set_ready(True)
    state.set_ready(False)
    assert get(url + "/readyz")[0] == 503


def test_status_reports_the_loading_phase(loading_status):
    _, url = loading_status
    assert json.loads(get(url + "/v1/status")[1]) == {
        "phase": "loading",
        "ready": False,
    }


def test_status_reports_the_serving_phase_once_ready(loading_status):
    state, url = loading_status
    state.set_ready(True)
    assert json.loads(get(url + "/v1/status")[1]) == {
        "phase": "serving",
        "ready": True,
    }


def test_a_query_string_does_not_change_the_endpoint(loading_status):
    _, url = loading_status
    assert get(url + "/healthz?probe=1")[0] == 200


def test_unknown_path_is_404(loading_status):
    _, url = loading_status
    assert get(url + "/nope")[0] == 404


def test_ready_server_answers_readyz_200(draft_server):
    assert draft_server.http("/readyz")[0] == 200


def test_status_counts_proposals_and_errors(draft_server, raw_client):
    before = json.loads(draft_server.http("/v1/status")[1])
    raw_client.call("CLEAR")
    raw_client.send_frames(propose_message([entry("s", 4, 4, reset=True)], 2, WIDTH))
    raw_client.call("NOT_AN_OP")
    after = json.loads(draft_server.http("/v1/status")[1])
    assert after["proposals"] == before["proposals"] + 1
    assert (
        after["errors_by_op"].get("INVALID", 0)
        == before["errors_by_op"].get("INVALID", 0) + 1
    )
    assert after["latency_ms"]["count"] == before["latency_ms"]["count"] + 1
    assert set(after["last_timing_ms"]) >= {"decode", "context", "query", "total"}


def test_metrics_report_not_ready_while_loading(loading_status):
    _, url = loading_status
    code, body = get(url + "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert code == 200 and families["k3_draft_ready"].samples[0].value == 0.0


def test_metrics_are_prometheus_text(draft_server, raw_client):
    raw_client.call("PING")
    code, body = draft_server.http("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert code == 200 and families["k3_draft_ready"].samples[0].value == 1.0
    requests = {s.labels["op"]: s.value for s in families["k3_draft_requests"].samples}
    assert requests["PING"] >= 1
    assert "k3_draft_propose_latency_seconds" in families


def test_metrics_export_every_ops_counters_before_its_first_error(
    draft_server_factory,
):
    """Each op's request and error counters are exported at 0 from the start
    (prometheus_client's advice for labelled metrics): a series that appears
    only with its first error hides that error from rate() and increase()."""
    server = draft_server_factory()
    client = RawClient(server.address)
    try:
        client.call("PING")
    finally:
        client.close()
    body = server.http("/metrics")[1].decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    ops = ("CLEAR", "FREE", "INVALID", "PING", "PROPOSE", "RECONNECT", "RESET")
    series = {
        name: {s.labels["op"]: s.value for s in families[name].samples}
        for name in ("k3_draft_requests", "k3_draft_errors")
    }
    assert series["k3_draft_requests"] == {op: float(op == "PING") for op in ops}
    assert series["k3_draft_errors"] == dict.fromkeys(ops, 0.0)


def test_metrics_count_what_the_status_counts(draft_server, raw_client):
    raw_client.call("PING")
    raw_client.call("PING")
    raw_client.call("CLEAR")
    raw_client.send_frames(propose_message([entry("m", 4, 4, reset=True)], 2, WIDTH))
    status = json.loads(draft_server.http("/v1/status")[1])
    body = draft_server.http("/metrics")[1].decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    requests = {
        s.labels["op"]: s.value
        for s in families["k3_draft_requests"].samples
        if s.name == "k3_draft_requests_total" and s.value
    }
    assert requests == status["requests_by_op"]
    latency = {
        s.labels["le"]: s.value
        for s in families["k3_draft_propose_latency_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert latency["+Inf"] == status["latency_ms"]["count"] >= 1


def test_the_latency_histogram_is_in_seconds(draft_server, raw_client):
    raw_client.send_frames(propose_message([entry("s", 4, 4, reset=True)], 2, WIDTH))
    status = json.loads(draft_server.http("/v1/status")[1])["latency_ms"]
    body = draft_server.http("/metrics")[1].decode()
    family = {f.name: f for f in text_string_to_metric_families(body)}[
        "k3_draft_propose_latency_seconds"
    ]
    bounds = [
        float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")
    ]
    (total,) = (s.value for s in family.samples if s.name.endswith("_sum"))
    assert bounds == [b / 1e3 for b in status["buckets"]] + [float("inf")]
    assert total == pytest.approx(status["sum"] / 1e3) and total > 0


def request(url: str, method: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, method=method), timeout=5
        ) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/v1/status", "/metrics"])
def test_head_answers_like_get_without_a_body(loading_status, path):
    _, url = loading_status
    code, headers, body = request(url + path, "HEAD")
    get_code, get_body = get(url + path)
    assert (code, body) == (get_code, b"")
    assert int(headers["Content-Length"]) == len(get_body)


@pytest.mark.parametrize(
    "method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "BREW"]
)
def test_other_methods_are_405_with_the_allowed_ones(loading_status, method):
    _, url = loading_status
    code, headers, _ = request(url + "/healthz", method)
    assert (code, headers.get("Allow")) == (405, "GET, HEAD")


def test_head_sends_no_body_on_the_wire(loading_status):
    _, url = loading_status
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"HEAD /healthz HTTP/1.0\r\n\r\n")
        client.settimeout(5)
        reply = b""
        while chunk := client.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 200") and reply.endswith(b"\r\n\r\n")


def test_a_client_that_hangs_up_early_leaves_no_traceback(
    loading_status, capfd, caplog
):
    _, url = loading_status
    port = int(url.rsplit(":", 1)[1])
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            # Reset (not close) the connection: the reply meets ECONNRESET.
            client.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
    time.sleep(0.5)
    assert get(url + "/healthz")[0] == 200
    assert "Traceback" not in capfd.readouterr().err
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_an_idle_connection_is_closed_after_the_request_timeout():
    server = StatusServer(StatusState(), "127.0.0.1", 0, request_timeout_s=0.5)
    server.start()
    try:
        with socket.create_connection(server.httpd.server_address[:2]) as idle:
            idle.settimeout(10)
            start = time.monotonic()
            assert idle.recv(1) == b""
            assert time.monotonic() - start < 5
    finally:
        server.stop()


def test_status_serves_on_an_ipv6_host():
    server = StatusServer(StatusState(), "::1", 0)
    server.start()
    try:
        assert get(f"http://[::1]:{server.httpd.server_address[1]}/healthz")[0] == 200
    finally:
        server.stop()
