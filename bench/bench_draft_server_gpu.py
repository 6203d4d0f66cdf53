# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reference draft engine behind the draft server on a GPU: CUDA graphs
against eager, per (batch, depth), with the round-trip breakdown.

For eager and for ``--enable-cuda-graph``, one server process (reference
engine on ``--device``, vocabulary 163,840, context width 3 x 7168; with
``--latent-attention`` its MLA variant) serves a steady PROPOSE stream per
(batch, depth) shape: 4 context rows per request and step. Reported per shape
and mode (p50 over the iterations, microseconds): the client round trip and
every ``timing_ms`` field of the reply (decode, lock_wait, context, query,
device_wait, copy_back, total), plus the graph speed-up of query +
device_wait.

Usage::

    python bench/bench_draft_server_gpu.py --device cuda --out gpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import numpy as np
import zmq
from bench_remote_rpc import Case, free_port, start_server
from cli_types import non_negative_int, output_file, positive_int

from vllm.k3_draft.protocol import TIMING_FIELDS

MODEL = ["--vocab-size", "163840", "--hidden-size", "1024", "--num-layers", "2"]
MODEL += ["--num-heads", "8", "--window-size", "1024"]
BATCHES = (1, 2, 4, 8)
DEPTHS = (1, 2, 3, 4)


def run_mode(args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    server_args = argparse.Namespace(device=args.device, enable_cuda_graph=graphs)
    address = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryFile() as log:
        model = MODEL + (["--latent-attention"] if args.latent_attention else [])
        proc = start_server(
            server_args, address, free_port(), log, model, max_k=max(DEPTHS)
        )
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        shapes: dict[str, Any] = {}
        try:
            for batch in BATCHES:
                for depth in DEPTHS:
                    case = Case(batch, f"b{batch}d{depth}", k=depth)
                    samples: dict[str, list[float]] = {"rtt": []}
                    for index in range(args.warmup + args.iters):
                        frames = case.frames()
                        start = time.perf_counter()
                        sock.send_multipart(frames, copy=False)
                        reply = json.loads(sock.recv())
                        elapsed = (time.perf_counter() - start) * 1e6
                        assert reply["ok"], reply
                        if index < args.warmup:
                            continue
                        samples["rtt"].append(elapsed)
                        for key, value in reply["timing_ms"].items():
                            samples.setdefault(key, []).append(value * 1e3)
                    shapes[f"{batch}x{depth}"] = {
                        key: float(np.percentile(values, 50))
                        for key, values in samples.items()
                    }
                    # Free the case's requests before the next shape.
                    sock.send_multipart(
                        [json.dumps({"protocol": 2, "op": "CLEAR"}).encode()]
                    )
                    sock.recv()
        finally:
            sock.close()
            ctx.term()
            proc.terminate()
            proc.wait()
            if args.log_dir:
                log.seek(0)
                _save_log(args, graphs, log.read())
    return shapes


def _save_log(args: argparse.Namespace, graphs: bool, text: bytes) -> None:
    name = "server_graph.log" if graphs else "server_eager.log"
    with open(f"{args.log_dir}/{name}", "wb") as out:
        out.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=positive_int, default=200)
    parser.add_argument("--warmup", type=non_negative_int, default=20)
    parser.add_argument(
        "--out", type=output_file, help="write the results as JSON here"
    )
    parser.add_argument("--log-dir", help="keep the server logs here")
    parser.add_argument(
        "--latent-attention",
        action="store_true",
        help="the reference engine's multi-head latent attention (MLA)",
    )
    args = parser.parse_args()
    results = {"eager": run_mode(args, False), "graph": run_mode(args, True)}
    fields = ["rtt", *TIMING_FIELDS]
    print("shape  mode   " + " ".join(f"{f:>11}" for f in fields) + "  q+wait x")
    for shape in results["eager"]:
        eager, graph = results["eager"][shape], results["graph"][shape]
        speedup = (eager["query"] + eager["device_wait"]) / (
            graph["query"] + graph["device_wait"]
        )
        for mode, row in (("eager", eager), ("graph", graph)):
            values = " ".join(f"{row.get(f, 0.0):>11.1f}" for f in fields)
            tail = f"  {speedup:.2f}" if mode == "graph" else ""
            print(f"{shape:<6} {mode:<6} {values}{tail}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
