# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HTTP status of the draft server.

* ``GET /healthz``: 200 as soon as this HTTP server runs (loading the model can
  take long; a liveness probe must not kill the process meanwhile).
* ``GET /readyz``: 200 only while the model is loaded and the RPC transport
  serves, else 503.
* ``GET /v1/status``: JSON: ``phase`` and ``ready``, plus the server's counters
  (``DraftServer.snapshot``) once it exists.
* ``GET /metrics``: Prometheus text format from a private
  ``CollectorRegistry``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from vllm.k3_draft.log import init_logger
from vllm.k3_draft.server import DraftServer

logger = init_logger(__name__)


class StatusState:
    """What the endpoints report; set by the process as it starts and stops."""

    def __init__(self) -> None:
        self.phase = "loading"
        self.server: DraftServer | None = None
        self._ready = threading.Event()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def set_ready(self, ready: bool) -> None:
        if ready:
            self.phase = "serving"
            self._ready.set()
        else:
            self._ready.clear()

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {"phase": self.phase, "ready": self.ready}
        if self.server is not None:
            status.update(self.server.snapshot())
        return status


class _ServerCollector(Collector):
    def __init__(self, state: StatusState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("k3_draft_ready", "1 while the draft server serves")
        ready.add_metric([], float(self.state.ready))
        yield ready
        if self.state.server is None:
            return
        snap = self.state.server.snapshot()
        for name, key, doc in (
            ("k3_draft_requests", "requests_by_op", "Requests received, by op"),
            ("k3_draft_errors", "errors_by_op", "Error replies, by op"),
        ):
            family = CounterMetricFamily(name, doc, labels=["op"])
            for op, count in sorted(snap[key].items()):
                family.add_metric([op], count)
            yield family
        for name, value, doc in (
            (
                "k3_draft_proposed_requests",
                snap["proposed_requests"],
                "Requests drafted",
            ),
            ("k3_draft_context_rows", snap["context_rows"], "Context rows received"),
            ("k3_draft_reconnects", snap["reconnects"], "Successful RECONNECTs"),
            (
                "k3_draft_reconnect_failures",
                snap["reconnect_failures"],
                "Refused or failed RECONNECTs",
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, value, doc in (
            ("k3_draft_active_requests", snap["active_requests"], "Retained requests"),
            (
                "k3_draft_prefix_cache_tokens",
                snap["prefix_cache"]["cached_tokens"],
                "Projected-context rows cached",
            ),
            (
                "k3_draft_cuda_graphs",
                len(snap["cuda_graph_shapes"]),
                "Captured (batch, depth) CUDA graphs",
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        latency = snap["latency_ms"]
        cumulative, buckets = 0, []
        for bound, count in zip(
            [*latency["buckets"], float("inf")], latency["bucket_counts"]
        ):
            cumulative += count
            buckets.append(
                (str(bound) if bound != float("inf") else "+Inf", cumulative)
            )
        yield HistogramMetricFamily(
            "k3_draft_propose_latency_ms",
            "Server-side PROPOSE latency in milliseconds",
            buckets=buckets,
            sum_value=latency["sum"],
        )


def _handler(state: StatusState, registry: CollectorRegistry) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ready = state.ready
                self._send(
                    200 if ready else 503,
                    b"ready\n" if ready else b"not ready\n",
                    "text/plain",
                )
            elif path == "/v1/status":
                body = json.dumps(state.status()).encode()
                self._send(200, body, "application/json")
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("status %s", format % args)

    return Handler


class StatusServer:
    """The HTTP status endpoints on ``host:port``, served from a daemon thread."""

    def __init__(self, state: StatusState, host: str, port: int) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ServerCollector(state))
        self.httpd = ThreadingHTTPServer((host, port), _handler(state, registry))
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="k3-draft-status", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        host, port = self.httpd.server_address[:2]
        logger.info("Draft server status on http://%s:%s", host, port)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
