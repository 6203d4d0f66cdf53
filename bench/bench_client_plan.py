# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The verifier side's own work per PROPOSE (layer 1's ``RemotePlan.run``).

A real reference-engine draft server process on loopback TCP (as in
``bench_remote_rpc.py``) answers steady-state PROPOSEs of ``batch`` requests,
K = 3, 4 context rows of 3 x 7168 bf16 per request, driven through
``RemotePlan.run`` as the speculator's ``exchange`` drives it (rank 0; on the
reply thread when resolution is deferred, layer 3). Each batch runs twice:
every row kept (the rows frame is a view of the staged rows) and the last
row of every request rejected (the kept rows are gathered). Reported per case (p50
and p90 over the iterations, microseconds): the whole ``run``, the time spent
inside the socket's send and receive (the server's handling and the
transport), and their difference: the client's own work (plan, row gather,
header encode, reply decode and checks). That difference is the reply
thread's own Python work, ``C`` of ``bench_deferred_resolve.py``.

Usage::

    python bench/bench_client_plan.py --iters 300 --out plan.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_remote_rpc import ROWS_PER_REQUEST, WIDTH, K, free_port, start_server  # noqa: E402
from cli_types import device, non_negative_int, output_file, positive_int, run

from vllm.k3_draft.client import DraftClient, ServerRequirements  # noqa: E402
from vllm.k3_draft.plan import RemotePlan, StepInputs, StepRequest  # noqa: E402


class _TimedSocket:
    """Counts the seconds spent in the wrapped socket's send and receive."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.seconds = 0.0

    def _timed(self, method: str, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return getattr(self.socket, method)(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def send_multipart(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("send_multipart", *args, **kwargs)

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("recv_multipart", *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
    }


def measure(plan: RemotePlan, timed: _TimedSocket, batch: int, kept: int, args) -> dict:
    """``args.iters`` steady-state steps of ``batch`` fresh requests, each
    keeping ``kept`` of its ``ROWS_PER_REQUEST`` rows."""
    ids = [f"b{batch}-k{kept}-{i}" for i in range(batch)]
    rows = torch.randn(batch * ROWS_PER_REQUEST, WIDTH).bfloat16()
    first = 0
    run_us, wire_us, own_us = [], [], []
    for step in range(args.warmup + args.iters):
        requests = [
            StepRequest(
                request_id=rid,
                first_position=first,
                num_context=kept,
                anchor_token_id=11,
                row_offset=i * ROWS_PER_REQUEST,
                tokens=None,
            )
            for i, rid in enumerate(ids)
        ]
        timed.seconds = 0.0
        start = time.perf_counter()
        result = plan.run(StepInputs(requests, K, rows))
        elapsed = time.perf_counter() - start
        first += kept
        if (result.tokens < 0).any():
            raise RuntimeError(f"step {step} got no drafts: {result.tokens}")
        if step >= args.warmup:
            run_us.append(elapsed * 1e6)
            wire_us.append(timed.seconds * 1e6)
            own_us.append((elapsed - timed.seconds) * 1e6)
    return {
        "batch": batch,
        "kept_rows": kept,
        "run_us": _quantiles(run_us),
        "send_recv_us": _quantiles(wire_us),
        "client_own_us": _quantiles(own_us),
        "row_bytes": rows.numel() * rows.element_size(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=positive_int, default=300)
    parser.add_argument("--warmup", type=non_negative_int, default=30)
    parser.add_argument(
        "--device", type=device, default="cpu", help="the server's engine device"
    )
    parser.add_argument("--enable-cuda-graph", action="store_true")
    parser.add_argument(
        "--out", type=output_file, help="write the results as JSON here"
    )
    args = parser.parse_args()
    if args.enable_cuda_graph and not args.device.startswith("cuda"):
        parser.error("--enable-cuda-graph needs a CUDA --device")
    address = f"tcp://127.0.0.1:{free_port()}"
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed at exit)
    proc = start_server(args, address, free_port(), log)
    client = DraftClient(address, 5000)
    try:
        pong, _ = client.call("PING")
        needs = ServerRequirements(
            method=pong["method"],
            capabilities=frozenset(),
            context_width=WIDTH,
            vocab_size=pong["vocab_size"],
            max_model_len=pong["max_model_len"],
            max_num_seqs=8,
            num_speculative_tokens=K,
            max_num_batched_tokens=8 * ROWS_PER_REQUEST,
        )
        plan = RemotePlan(client, needs)
        plan.connect()
        # Instrument the client's socket (a private attribute: this is a probe).
        timed = _TimedSocket(client._socket)
        client._socket = timed
        results = [
            measure(plan, timed, batch, kept, args)
            for batch in (1, 8)
            for kept in (ROWS_PER_REQUEST, ROWS_PER_REQUEST - 1)
        ]
    finally:
        client.close()
        proc.terminate()
        proc.wait()
    print(
        f"{'batch':>5} {'kept':>4} {'run p50/p90 us':>16} {'send+recv':>14} "
        f"{'client own':>14}"
    )
    for r in results:
        cells = [
            f"{r[key]['p50']:.0f}/{r[key]['p90']:.0f}"
            for key in ("run_us", "send_recv_us", "client_own_us")
        ]
        print(
            f"{r['batch']:>5} {r['kept_rows']:>4} {cells[0]:>16} {cells[1]:>14} "
            f"{cells[2]:>14}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    run(main)
