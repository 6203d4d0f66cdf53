# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HTTP status endpoints."""

import json
import urllib.request

import pytest
from k3_layer1_server import DEFAULT_OPTIONS, entry, free_tcp_port, propose_message
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


def test_status_reports_the_loading_phase(loading_status):
    _, url = loading_status
    assert json.loads(get(url + "/v1/status")[1]) == {
        "phase": "loading",
        "ready": False,
    }


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


def test_metrics_are_prometheus_text(draft_server, raw_client):
    raw_client.call("PING")
    code, body = draft_server.http("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert code == 200 and families["k3_draft_ready"].samples[0].value == 1.0
    requests = {s.labels["op"]: s.value for s in families["k3_draft_requests"].samples}
    assert requests["PING"] >= 1
    assert "k3_draft_propose_latency_ms" in families
