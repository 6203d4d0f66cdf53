# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The draft server's own work per PROPOSE, phase by phase, in one process.

The server of ``bench_remote_rpc.py`` (reference engine, context width
3 x 7168, K = 3, CPU unless ``--device``) handles the same steady-state
PROPOSE stream through ``DraftServer.handle`` without a socket; each phase is
timed with ``perf_counter`` around the call that does it. Reported: p50 per
phase (microseconds) and ``outside_engine``, the handling time minus the
engine's call: what the protocol's Python costs right after an engine step
(several times its cost in a warm loop). The wrappers add about a microsecond
per phase.

``--engine-at-once`` replaces the engine's ``propose`` by one that returns the
same tokens at once: no engine step runs between two PROPOSEs, so the phases
are the server's own work in a warm loop, the least its Python costs on this
machine.

Usage::

    python bench/bench_server_phases.py --batch 8 [--device cuda] [--engine-at-once]
        [--out phases.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from bench_remote_rpc import ENGINE_TIMINGS, SMALL_MODEL, WIDTH, Case, K
from cli_types import non_negative_int, output_file, positive_int

from vllm.entrypoints import k3_dspark_standalone as standalone
from vllm.k3_draft import server as server_module
from vllm.k3_draft import validation
from vllm.k3_draft.engine import ProposeOutput
from vllm.k3_draft.protocol import load_capability_plugins


def timed(owner: Any, name: str, label: str, spent: dict[str, float]) -> None:
    """Replace ``owner.name`` by a wrapper adding its seconds to ``spent``."""
    function: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, choices=range(1, 9), default=1)
    parser.add_argument("--iters", type=positive_int, default=500)
    parser.add_argument("--warmup", type=non_negative_int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--engine-at-once",
        action="store_true",
        help="the engine returns the same tokens at once (the server's work, warm)",
    )
    parser.add_argument(
        "--out", type=output_file, help="write the p50 per phase as JSON here"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    server_args = standalone.parse_args(
        [
            *("--engine", "reference", "--device", args.device),
            *("--address", "tcp://127.0.0.1:1", "--context-width", str(WIDTH)),
            *SMALL_MODEL,
            *("--max-num-seqs", "8", "--max-requests", "16"),
            *("--max-speculative-tokens", "3", "--max-context-tokens", "64"),
            *("--max-model-len", str(1 << 20)),
        ]
    )
    engine = standalone.build_engine(server_args)
    engine.load()
    load_capability_plugins()
    if args.engine_at_once:
        output = ProposeOutput(
            torch.zeros(args.batch, K, dtype=torch.int64),
            None,
            dict.fromkeys(ENGINE_TIMINGS, 0.0),
        )
        engine.propose = lambda batch: output  # type: ignore[method-assign]
    server = server_module.DraftServer(engine)
    spent: dict[str, float] = {}
    timed(server_module, "decode_header", "decode", spent)
    timed(server.parser, "_entry", "entries", spent)
    timed(server.parser, "_check_positions", "positions", spent)
    timed(validation, "frame_tensor", "frame tensors", spent)
    timed(server.parser, "parse", "parse (all)", spent)
    timed(server_module, "check_propose", "table checks", spent)
    timed(server, "_apply_propose", "apply", spent)
    timed(engine, "propose", "engine", spent)
    timed(server, "_finish_propose", "reply header", spent)
    case = Case(args.batch, "phases")
    samples: dict[str, list[float]] = {}
    for index in range(args.warmup + args.iters):
        frames = case.frames()
        # Writable buffers, as received with copy=False: aliased, not copied.
        received = [bytes(frames[0]), *(bytearray(f) for f in frames[1:])]
        spent.clear()
        start = time.perf_counter()
        reply = server.handle(received)
        spent["handle"] = time.perf_counter() - start
        assert json.loads(reply[0])["ok"], reply[0]
        spent["outside_engine"] = spent["handle"] - spent["engine"]
        if index >= args.warmup:
            for label, seconds in spent.items():
                samples.setdefault(label, []).append(seconds * 1e6)
    p50 = {label: float(np.percentile(v, 50)) for label, v in samples.items()}
    engine_name = "at once" if args.engine_at_once else "reference"
    print(
        f"batch {args.batch}, device {args.device}, engine {engine_name}, "
        f"p50 us over {args.iters}"
    )
    for label, value in p50.items():
        print(f"  {label:<16} {value:9.1f}")
    if args.out:
        meta = {
            "batch": args.batch,
            "device": args.device,
            "engine_at_once": args.engine_at_once,
            "iters": args.iters,
        }
        with open(args.out, "w") as out:
            json.dump({"meta": meta, "p50_us": p50}, out, indent=2)


if __name__ == "__main__":
    main()
