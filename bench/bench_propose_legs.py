# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a PROPOSE's round trip goes, leg by leg, across both processes.

The cases of ``bench_draft_logits.py`` for one batch size (full vocabulary,
top-16/64/256, greedy), in its order and with its table server, which here
records where each request's time goes (``k3_l2_engines.record_stamps``).
The client records ``perf_counter`` times where its call starts, where its
receive returns and where the reply's header is decoded. Both processes read
the same monotonic clock, so the legs are differences across them; a leg
below zero means they did not, and fails the run. Per case, p50 over the
iterations, microseconds:

- ``request``: the call's start until the server's receive returns;
- ``until_handle``: until ``DraftServer.handle`` starts (the wait for the
  previous reply's send);
- ``handle``, and within it ``engine`` (the engine's ``propose``),
  ``build`` and ``wait`` (the draft-logits extension's ``build_reply`` and
  ``wait_frames``);
- ``until_send``: until the server's send of the reply starts;
- ``reply``: until the client's receive returns, and within it
  ``send_call``, the server's send call (the client may have the reply
  before that call returns);
- ``decode``: until the reply's header is decoded and checked;
- ``rtt``: the whole call, the sum of the legs not within another.

Each wrapper adds a call and a clock read. The client checks each reply's
header but does not stage the logits (``bench_draft_logits.py
--no-consume``), so it runs without vllm installed, as on a GPU box.

Usage::

    python bench/bench_propose_legs.py --device cuda --server-busy-poll-us 2000 \\
        --context-rows 1 --context-width 21504 [--batch 8] [--out legs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import zmq
from bench_draft_logits import (
    BATCHES,
    ENGINES,
    TOPKS,
    Case,
    add_run_arguments,
    seeded_table,
    start_server,
)
from cli_types import output_file, run

from vllm.k3_draft.client import DraftClient, TransportError

sys.path.insert(0, str(ENGINES))
from k3_l2_engines import STAMP_FIELDS  # noqa: E402
from k3_layer1_server import free_tcp_port  # noqa: E402

LEGS = (
    "request",
    "until_handle",
    "handle",
    "engine",
    "build",
    "wait",
    "until_send",
    "reply",
    "send_call",
    "decode",
    "rtt",
)


def legs_of(client: list[float], server: list[float]) -> dict[str, float]:
    """One request's legs (seconds) from the client's (start, received,
    decoded) and the server's ``STAMP_FIELDS`` row."""
    start, received, decoded = client
    stamps = dict(zip(STAMP_FIELDS, server))
    return {
        "request": stamps["received"] - start,
        "until_handle": stamps["handle_start"] - stamps["received"],
        "handle": stamps["handle_end"] - stamps["handle_start"],
        "engine": stamps["engine_s"],
        "build": stamps["build_s"],
        "wait": stamps["wait_s"],
        "until_send": stamps["send_start"] - stamps["handle_end"],
        "reply": received - stamps["send_start"],
        "send_call": stamps["send_end"] - stamps["send_start"],
        "decode": decoded - received,
        "rtt": decoded - start,
    }


def stamp_client(client: DraftClient, calls: list[list[float]]) -> None:
    """Append (start, received, decoded) of each of ``client``'s calls to
    ``calls``."""
    receive = zmq.Socket.recv_multipart
    received = [0.0]

    def stamped_receive(self: zmq.Socket, *args: Any, **kwargs: Any) -> Any:
        frames = receive(self, *args, **kwargs)
        received[0] = time.perf_counter()
        return frames

    call = client.call_encoded

    def stamped_call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = call(*args, **kwargs)
        calls.append([start, received[0], time.perf_counter()])
        return result

    setattr(zmq.Socket, "recv_multipart", stamped_receive)  # noqa: B010
    client.call_encoded = stamped_call  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, choices=BATCHES, default=max(BATCHES))
    add_run_arguments(parser)
    parser.add_argument(
        "--out", type=output_file, help="write the results as JSON here"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = seeded_table()
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    calls: list[list[float]] = []
    names: list[str | None] = []
    with tempfile.TemporaryDirectory() as scratch:
        stamps_file = os.path.join(scratch, "stamps.json")
        server = start_server(table, scratch, address, args, stamps=stamps_file)
        client = DraftClient(address, round(args.reply_timeout_s * 1e3))
        stamp_client(client, calls)
        try:
            cases = []
            for topk in (0, *TOPKS, None):
                cases.append(
                    Case(
                        client,
                        args.batch,
                        topk,
                        False,
                        args.context_rows,
                        args.context_width,
                        table,
                    )
                )
                names.append(None)
            for index in range(args.warmup + args.iters):
                for case in cases:
                    case.run(record=False)
                    names.append(case.name if index >= args.warmup else None)
        except TransportError as exc:
            raise SystemExit(str(exc)) from None
        finally:
            client.close()
            server.terminate()
            server.wait()
        if not os.path.exists(stamps_file):
            raise SystemExit(
                f"the table server wrote no stamps (exit status {server.returncode})"
            )
        with open(stamps_file) as stamps:
            rows = json.load(stamps)
    if len(rows) != len(calls):
        raise SystemExit(
            f"the server stamped {len(rows)} replies, the client made {len(calls)} "
            "calls"
        )
    samples: dict[str, dict[str, list[float]]] = {}
    for name, client_times, server_times in zip(names, calls, rows):
        if name is None:
            continue
        legs = legs_of(client_times, server_times)
        if legs["request"] < 0 or legs["reply"] < 0:
            raise SystemExit(
                "a leg between the processes is negative: they do not share a clock"
            )
        per_case = samples.setdefault(name, {leg: [] for leg in LEGS})
        for leg, seconds in legs.items():
            per_case[leg].append(seconds * 1e6)
    p50 = {
        name: {leg: float(np.percentile(v, 50)) for leg, v in legs.items()}
        for name, legs in samples.items()
    }
    print(f"{'case':<12}" + "".join(f"{leg:>13}" for leg in LEGS))
    for name, legs in p50.items():
        print(f"{name:<12}" + "".join(f"{legs[leg]:>13.1f}" for leg in LEGS))
    if args.out:
        meta = {
            "cpus": os.cpu_count(),
            "device": args.device,
            "batch": args.batch,
            "server_busy_poll_us": args.server_busy_poll_us,
            "context_rows": args.context_rows,
            "context_width": args.context_width,
            "iters": args.iters,
        }
        with open(args.out, "w") as out:
            json.dump({"meta": meta, "p50_us": p50}, out, indent=2)


if __name__ == "__main__":
    run(main)
