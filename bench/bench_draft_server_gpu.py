# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A draft engine behind the draft server on a GPU: CUDA graphs against
eager, per (batch, depth), with the round-trip breakdown.

For eager and for ``--enable-cuda-graph``, one server process serves a
steady PROPOSE stream per (batch, depth) shape: 4 context rows of 3 x 7168
per request and step. The engine is the reference engine on ``--device``
(vocabulary 163,840; with ``--latent-attention`` its MLA variant), or with
``--draft-model`` and ``--target-model`` the production engine on those
checkpoints (``bench/k3_draft_checkpoint.py`` writes Kimi-K3-shaped ones).
Reported per shape and mode (p50 over the iterations, microseconds): the
client round trip and every ``timing_ms`` field of the reply (decode,
lock_wait, context, query, device_wait, copy_back, total), plus the graph
speed-up of query + device_wait.

Usage::

    python bench/bench_draft_server_gpu.py --device cuda --out gpu.json
    python bench/k3_draft_checkpoint.py /tmp/k3
    python bench/bench_draft_server_gpu.py --draft-model /tmp/k3/draft \
        --target-model /tmp/k3/target --out k3.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import numpy as np
import zmq
from bench_remote_rpc import (
    Case,
    connect,
    free_port,
    no_answer,
    reference_engine,
    start_server,
)
from cli_types import (
    device,
    existing_dir,
    non_negative_int,
    output_file,
    positive_int,
    run,
)

from vllm.k3_draft.protocol import TIMING_FIELDS

MODEL = ["--vocab-size", "163840", "--hidden-size", "1024", "--num-layers", "2"]
MODEL += ["--num-heads", "8"]
WINDOW = ["--window-size", "1024"]
BATCHES = (1, 2, 4, 8)
# A draft server that stopped answering ends the run (a graphed step takes
# milliseconds).
REPLY_TIMEOUT_S = 60.0
DEPTHS = (1, 2, 3, 4)


def run_mode(args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    server_args = argparse.Namespace(device=args.device, enable_cuda_graph=graphs)
    address = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryFile() as log:
        proc = start_server(
            server_args, address, free_port(), log, engine_flags(args), max(DEPTHS)
        )
        ctx = zmq.Context()
        sock = connect(ctx, address, REPLY_TIMEOUT_S)
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
        except zmq.Again:
            raise no_answer(REPLY_TIMEOUT_S, {"the draft server": proc}) from None
        finally:
            sock.close()
            ctx.term()
            proc.terminate()
            proc.wait()
            if args.log_dir:
                log.seek(0)
                _save_log(args, graphs, log.read())
    return shapes


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The server's engine flags for the benchmark's arguments."""
    if args.draft_model:
        return [
            *("--engine", "production", "--draft-model", args.draft_model),
            *("--target-model", args.target_model, *WINDOW),
        ]
    latent = ["--latent-attention"] if args.latent_attention else []
    return reference_engine(MODEL + WINDOW + latent)


def _save_log(args: argparse.Namespace, graphs: bool, text: bytes) -> None:
    name = "server_graph.log" if graphs else "server_eager.log"
    with open(f"{args.log_dir}/{name}", "wb") as out:
        out.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=device, default="cuda")
    parser.add_argument("--iters", type=positive_int, default=200)
    parser.add_argument("--warmup", type=non_negative_int, default=20)
    parser.add_argument(
        "--out", type=output_file, help="write the results as JSON here"
    )
    parser.add_argument(
        "--log-dir", type=existing_dir, help="keep the server logs here"
    )
    parser.add_argument(
        "--latent-attention",
        action="store_true",
        help="the reference engine's multi-head latent attention (MLA)",
    )
    production = parser.add_argument_group("production engine")
    production.add_argument(
        "--draft-model", type=existing_dir, help="draft checkpoint directory"
    )
    production.add_argument(
        "--target-model", type=existing_dir, help="target checkpoint directory"
    )
    args = parser.parse_args()
    if not args.device.startswith("cuda"):
        # The graph run needs one; the eager run alone is not this comparison.
        parser.error("--device: CUDA graphs against eager need a CUDA device")
    if bool(args.draft_model) != bool(args.target_model):
        parser.error("--draft-model and --target-model go together")
    if args.draft_model and args.latent_attention:
        parser.error("--latent-attention is the reference engine's")
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
    run(main)
