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

``HEAD`` answers as ``GET`` without the body; other methods get 405. A
connection that sends no request within the request timeout is closed, and a
client that hangs up before its reply is logged at debug level only.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Callable, Iterator
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

# Seconds a connection may take to send its request (each serving thread).
_REQUEST_TIMEOUT_S = 10.0


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
            # Every op from the start, at 0 until counted: a series that
            # appears with its first error hides it from rate() and increase().
            counts = snap[key]
            family = CounterMetricFamily(name, doc, labels=["op"])
            for op in sorted(self.state.server.counted_ops | counts.keys()):
                family.add_metric([op], counts.get(op, 0))
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
        # In seconds, Prometheus' base unit (the JSON status keeps ms).
        latency = snap["latency_ms"]
        cumulative, buckets = 0, []
        for bound_ms, count in zip(
            [*latency["buckets"], float("inf")], latency["bucket_counts"]
        ):
            cumulative += count
            bound = "+Inf" if bound_ms == float("inf") else repr(bound_ms / 1e3)
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            "k3_draft_propose_latency_seconds",
            "Server-side PROPOSE latency in seconds",
            buckets=buckets,
            sum_value=latency["sum"] / 1e3,
        )


def _handler(state: StatusState, registry: CollectorRegistry, timeout_s: float) -> type:
    class Handler(BaseHTTPRequestHandler):
        # A connection that sends no complete request in time is closed.
        timeout = timeout_s

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def __getattr__(self, name: str) -> Callable[[], None]:
            # http.server answers a method without a do_ handler 501 (TRACE,
            # CONNECT, any unknown one): every method but GET and HEAD is
            # refused alike instead.
            if name.startswith("do_"):
                return self._refuse_method
            raise AttributeError(name)

        def _refuse_method(self) -> None:
            self.send_response(405)
            self.send_header("Allow", "GET, HEAD")
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _answer(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, b"ok\n", "text/plain", body)
            elif path == "/readyz":
                ready = state.ready
                self._send(
                    200 if ready else 503,
                    b"ready\n" if ready else b"not ready\n",
                    "text/plain",
                    body,
                )
            elif path == "/v1/status":
                text = json.dumps(state.status()).encode()
                self._send(200, text, "application/json", body)
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST, body)
            else:
                self._send(404, b"not found\n", "text/plain", body)

        def _send(
            self, code: int, content: bytes, content_type: str, body: bool
        ) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if body:
                self.wfile.write(content)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("status %s", format % args)

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        # IPv4 or IPv6, as the host resolves (a bad host: socket.gaierror).
        self.address_family = socket.getaddrinfo(
            *address, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0][0]
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up is routine (a probe that timed out); anything
        else is logged, not printed to stderr."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            logger.debug("status client %s went away: %s", client_address, error)
        else:
            logger.exception("status request from %s failed", client_address)


class StatusServer:
    """The HTTP status endpoints on ``host:port``, served from a daemon thread."""

    def __init__(
        self,
        state: StatusState,
        host: str,
        port: int,
        request_timeout_s: float = _REQUEST_TIMEOUT_S,
    ) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ServerCollector(state))
        self.httpd = _HTTPServer(
            (host, port), _handler(state, registry, request_timeout_s)
        )
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="k3-draft-status", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        host, port = self.httpd.socket.getsockname()[:2]
        if ":" in host:
            host = f"[{host}]"
        logger.info("Draft server status on http://%s:%s", host, port)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
