# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draft-server transport overhead against raw ZeroMQ, one run.

A real draft server process (reference engine, context width 3 x 7168) and a
raw ZeroMQ REP echo process listen on loopback TCP. For each case the client
alternates, request by request, between the two with the same bytes:

* ``ping``: an empty PING against an empty raw request;
* ``propose bN``: a steady-state PROPOSE of N requests, K=3, 4 context rows
  per request (bf16 rows of 3 x 7168: 172 KB per request), against a raw
  request of the same frames answered by a reply of the same size.

Reported per case (p50 and p99 over the iterations, microseconds): the raw
round trip, the server round trip, the server's engine time (``timing_ms``
context + query + device_wait + copy_back), the round trip minus the engine
time, and its ratio to the raw round trip (target: at most 1.15 at p50). The
JSON also holds the server's own handling time (``timing_ms.total``) and the
round trip minus it (the transport's share).

A third request per iteration asks the raw echo to spin for the server's
engine time of that iteration before replying: its round trip minus that hold
(``held_raw_minus_hold_us``, ``held_ratio_p50``) is the floor of a server that
computes as long as the engine, so what an idle wait costs both sides (threads
and cores waking up after it) is not counted against the protocol.

``--curve`` runs both over CurveZMQ, as any bind beyond loopback must: the
draft server with a fresh server certificate and one authorized client's
(its ZAP authenticator included), the raw echo with the same server key, the
client with the client's. The raw round trip is then CurveZMQ's own floor for
the same bytes (ZeroMQ encrypts and decrypts every frame in its I/O threads).

Usage::

    python bench/bench_remote_rpc.py --iters 2000 --out rpc.json [--device cuda]
        [--server-busy-poll-us N] [--curve]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np
import torch
import zmq
from cli_types import (
    device,
    int_at_most,
    non_negative_int,
    output_file,
    popen,
    positive_int,
    refusal,
    run,
    zmq_timeout_s,
)
from curve_certificates import CurveCertificates

from vllm.entrypoints.k3_dspark_rpc import MAX_BUSY_POLL_US
from vllm.k3_draft import protocol
from vllm.k3_draft.security import load_certificate, make_curve_server

WIDTH = 3 * 7168
K = 3
ROWS_PER_REQUEST = 4
ENGINE_TIMINGS = ("context", "query", "device_wait", "copy_back")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def raw_echo(address: str, curve_key_file: str | None) -> None:
    """Serve raw REP: reply with as many zero bytes as the first 8 bytes of
    the last frame say (so the client controls the reply size), after
    spinning for as many nanoseconds as its next 8 bytes say (the hold).
    ``curve_key_file``: serve CurveZMQ with that server certificate."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    if curve_key_file:
        keys = load_certificate(curve_key_file, "the CURVE key", secret=True)
        make_curve_server(sock, keys)
    sock.bind(address)
    replies: dict[int, bytes] = {}
    while True:
        frames = sock.recv_multipart(copy=False)
        received = time.perf_counter()
        control = frames[-1].buffer
        size = int.from_bytes(control[:8], "little")
        hold = int.from_bytes(control[8:16], "little") / 1e9
        if size not in replies:
            replies[size] = b"\0" * size
        while time.perf_counter() - received < hold:
            pass
        sock.send(replies[size], copy=False)


def raw_frames(
    frames: list[Any], last_tail: bytes, reply_bytes: int, hold_s: float
) -> list[Any]:
    """``frames`` with the last one replaced by the raw echo's 16 bytes of
    control fields followed by ``last_tail`` (its bytes after the first 16:
    same sizes)."""
    hold_ns = int(hold_s * 1e9)
    control = reply_bytes.to_bytes(8, "little") + hold_ns.to_bytes(8, "little")
    return [*frames[:-1], control + last_tail]


# A minimal draft: the engine's time is subtracted, its size is not what this
# measures.
SMALL_MODEL = ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2"]
SMALL_MODEL += ["--window-size", "64"]


def reference_engine(model: list[str] = SMALL_MODEL) -> list[str]:
    """Server flags of the reference engine at this benchmark's context
    width, with ``model``'s flags."""
    return ["--engine", "reference", "--context-width", str(WIDTH), *model]


def start_server(
    args: argparse.Namespace,
    address: str,
    status_port: int,
    log: Any,
    engine: list[str] | None = None,
    max_k: int = K,
    busy_poll_us: int = 0,
    curve: CurveCertificates | None = None,
) -> subprocess.Popen:
    """A draft server process, ready: ``engine``'s flags, by default those
    of ``reference_engine()``; with ``curve``, serving CurveZMQ."""
    command = [
        *(sys.executable, "-m", "vllm.entrypoints.k3_dspark_standalone"),
        *(engine or reference_engine()),
        *("--device", args.device),
        *("--address", address, "--status-port", str(status_port)),
        *("--max-num-seqs", "8", "--max-requests", "16"),
        *("--max-speculative-tokens", str(max_k), "--max-context-tokens", "64"),
        *("--max-model-len", str(1 << 20)),
        *("--busy-poll-us", str(busy_poll_us)),
        *(curve.server_flags if curve else ()),
    ]
    if args.enable_cuda_graph:
        command.append("--enable-cuda-graph")
    # One engine thread: idle OpenMP workers would spin against the client.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{status_port}/readyz"
    # A way out of here leaves it to cli_types.run to stop.
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"the draft server did not start: {refusal(proc, log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return proc
        except OSError:
            time.sleep(0.1)
    raise SystemExit("the draft server did not become ready")


class Case:
    """The request stream of one PROPOSE case."""

    def __init__(self, batch: int, prefix: str, k: int = K) -> None:
        self.batch = batch
        self.k = k
        self.ids = [f"{prefix}-{i}" for i in range(batch)]
        self.end = 0
        generator = torch.Generator().manual_seed(batch)
        self.rows = protocol.tensor_frame(
            torch.randn(batch * ROWS_PER_REQUEST, WIDTH, generator=generator).bfloat16()
        )

    def frames(self) -> list[Any]:
        reset = self.end == 0
        start, self.end = self.end, self.end + ROWS_PER_REQUEST
        requests = [
            {
                "request_id": rid,
                "reset": reset,
                "reset_position": 0,
                "context_count": ROWS_PER_REQUEST,
                "anchor_token_id": 11,
                "anchor_position": self.end,
            }
            for rid in self.ids
        ]
        header = protocol.request_header(
            protocol.OP_PROPOSE, num_speculative_tokens=self.k, requests=requests
        )
        positions = torch.arange(start, self.end).repeat(self.batch)
        return [
            protocol.encode_header(header),
            protocol.tensor_frame(positions),
            self.rows,
        ]


def connect(
    ctx: zmq.Context,
    address: str,
    timeout_s: float,
    curve: CurveCertificates | None = None,
) -> zmq.Socket:
    """A REQ socket to ``address`` (with ``curve``: as its client) whose
    sends and receives give up after ``timeout_s`` with ``zmq.Again``: a
    process that stopped answering ends the run instead of hanging it."""
    sock = ctx.socket(zmq.REQ)
    if curve:
        curve.client_keys.apply_to(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1e3))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1e3))
    sock.connect(address)
    return sock


def no_answer(timeout_s: float, processes: dict[str, subprocess.Popen]) -> SystemExit:
    """The one line that ends a run whose ``processes`` (by name) stopped
    answering: which of them exited, and how."""
    exited = [
        f"{name} exited (status {proc.poll()})"
        for name, proc in processes.items()
        if proc.poll() is not None
    ]
    if not exited:
        exited = [" or ".join(processes) + " stopped answering"]
    return SystemExit(f"no answer within {timeout_s:g} s: " + "; ".join(exited))


def percentiles(values: list[float]) -> dict[str, float]:
    array = np.asarray(values) * 1e6
    return {
        "p50": float(np.percentile(array, 50)),
        "p99": float(np.percentile(array, 99)),
    }


def measure(args, server, raw, name, next_frames) -> dict[str, Any]:
    raw_rtt, held_rtt, rtt, engine, handled = [], [], [], [], []
    for index in range(args.warmup + args.iters):
        frames = next_frames()
        start = time.perf_counter()
        server.send_multipart(frames, copy=False)
        reply = server.recv_multipart(copy=False)
        elapsed = time.perf_counter() - start
        header = json.loads(reply[0].bytes)
        assert header["ok"], header
        timing = header.get("timing_ms", {})
        engine_s = sum(timing.get(key, 0.0) for key in ENGINE_TIMINGS) / 1e3
        handled_s = timing.get("total", 0.0) / 1e3
        size = len(reply[0].bytes)
        # Built before each timer starts: a copy of the rows is not transport.
        tail = bytes(frames[-1])[16:]
        plain = raw_frames(frames, tail, size, 0.0)
        held = raw_frames(frames, tail, size, engine_s)
        start = time.perf_counter()
        raw.send_multipart(plain, copy=False)
        raw.recv_multipart(copy=False)
        raw_elapsed = time.perf_counter() - start
        start = time.perf_counter()
        raw.send_multipart(held, copy=False)
        raw.recv_multipart(copy=False)
        held_elapsed = time.perf_counter() - start
        if index >= args.warmup:
            rtt.append(elapsed)
            engine.append(engine_s)
            handled.append(handled_s)
            raw_rtt.append(raw_elapsed)
            held_rtt.append(held_elapsed - engine_s)
    overhead = [r - e for r, e in zip(rtt, engine)]
    result = {
        "case": name,
        "request_bytes": sum(len(memoryview(f)) for f in next_frames()),
        "raw_us": percentiles(raw_rtt),
        "rtt_us": percentiles(rtt),
        "engine_us": percentiles(engine),
        "server_total_us": percentiles(handled),
        "rtt_minus_server_total_us": percentiles([r - h for r, h in zip(rtt, handled)]),
        "rtt_minus_engine_us": percentiles(overhead),
        "held_raw_minus_hold_us": percentiles(held_rtt),
    }
    ours, raw_floor = result["rtt_minus_engine_us"], result["raw_us"]
    result["ratio_p50"] = ours["p50"] / raw_floor["p50"]
    result["ratio_p99"] = ours["p99"] / raw_floor["p99"]
    result["held_ratio_p50"] = ours["p50"] / result["held_raw_minus_hold_us"]["p50"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=positive_int, default=2000)
    parser.add_argument("--warmup", type=non_negative_int, default=200)
    parser.add_argument("--device", type=device, default="cpu")
    parser.add_argument("--enable-cuda-graph", action="store_true")
    parser.add_argument(
        "--server-busy-poll-us",
        type=int_at_most(MAX_BUSY_POLL_US),
        default=0,
        help="the server's busy poll after each reply (microseconds)",
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="the draft server and the raw echo over CurveZMQ",
    )
    parser.add_argument(
        "--out", type=output_file, help="write the results as JSON here"
    )
    parser.add_argument(
        "--reply-timeout-s",
        type=zmq_timeout_s,
        default=60.0,
        help="give up when the draft server or the raw echo has not answered "
        "for this long (default: %(default)s)",
    )
    parser.add_argument("--raw-echo", help=argparse.SUPPRESS)
    parser.add_argument("--raw-echo-curve-key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.enable_cuda_graph and not args.device.startswith("cuda"):
        parser.error("--enable-cuda-graph needs a CUDA --device")
    if args.raw_echo:
        # The benchmark stops it with SIGTERM: no line of its own.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raw_echo(args.raw_echo, args.raw_echo_curve_key)
        return
    server_address = f"tcp://127.0.0.1:{free_port()}"
    raw_address = f"tcp://127.0.0.1:{free_port()}"
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed at exit)
    echo_command = [sys.executable, __file__, "--raw-echo", raw_address]
    curve = None
    if args.curve:
        keys_dir = tempfile.TemporaryDirectory()  # noqa: SIM115 (removed at exit)
        curve = CurveCertificates(keys_dir.name)
        echo_command += ["--raw-echo-curve-key", curve.server_secret_file]
    # Its own session: a Ctrl-C while it imports would print its traceback;
    # this process stops it on every way out.
    echo = popen(echo_command, start_new_session=True)
    proc = start_server(
        args,
        server_address,
        free_port(),
        log,
        busy_poll_us=args.server_busy_poll_us,
        curve=curve,
    )
    ctx = zmq.Context()
    sockets = []
    try:
        for address in (server_address, raw_address):
            sockets.append(connect(ctx, address, args.reply_timeout_s, curve))
        server, raw = sockets
        ping = protocol.encode_header(protocol.request_header(protocol.OP_PING))
        results = [measure(args, server, raw, "ping", lambda: [ping])]
        for batch in (1, 8):
            case = Case(batch, f"b{batch}")
            results.append(measure(args, server, raw, f"propose b{batch}", case.frames))
    except zmq.Again:
        raise no_answer(
            args.reply_timeout_s, {"the draft server": proc, "the raw echo": echo}
        ) from None
    finally:
        for sock in sockets:
            sock.close()
        ctx.term()
        proc.terminate()
        echo.terminate()
        proc.wait()
        echo.wait()
    print(
        f"{'case':<12} {'bytes':>9} {'raw p50/p99 us':>16} {'rtt p50/p99':>16} "
        f"{'engine p50':>10} {'rtt-eng p50/p99':>16} {'ratio p50/p99':>14} "
        f"{'held raw p50':>12} {'held ratio':>10}"
    )
    for r in results:
        overhead = r["rtt_minus_engine_us"]
        print(
            f"{r['case']:<12} {r['request_bytes']:>9} "
            f"{r['raw_us']['p50']:>7.1f}/{r['raw_us']['p99']:<8.1f} "
            f"{r['rtt_us']['p50']:>7.1f}/{r['rtt_us']['p99']:<8.1f} "
            f"{r['engine_us']['p50']:>10.1f} "
            f"{overhead['p50']:>7.1f}/{overhead['p99']:<8.1f} "
            f"{r['ratio_p50']:>6.2f}/{r['ratio_p99']:<6.2f} "
            f"{r['held_raw_minus_hold_us']['p50']:>12.1f} {r['held_ratio_p50']:>10.2f}"
        )
    if args.out:
        meta = {
            "cpus": os.cpu_count(),
            "device": args.device,
            "cuda_graph": args.enable_cuda_graph,
            "server_busy_poll_us": args.server_busy_poll_us,
            "curve": args.curve,
            "iters": args.iters,
        }
        with open(args.out, "w") as out:
            json.dump({"meta": meta, "results": results}, out, indent=2)


if __name__ == "__main__":
    run(main)
