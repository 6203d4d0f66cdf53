# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deferred resolution (layer 3) on one GPU: step period synchronous vs
deferred, and the stream gate's overhead. Self-contained: torch, pyzmq and
``vllm/k3_draft/stream_gate.py`` loaded by file path (no vllm needed).

A synthetic step has GPU work ``T`` (``torch.cuda._sleep``), host preparation
``H`` (a host spin in Python, holding the GIL as the runner's own Python does)
and a draft round trip ``L`` to a ZeroMQ REP server in its own process that
answers after ``L`` ms with K token ids. The round trip also does ``C`` of
Python work holding the GIL (half before the send: plan and header; half after
the receive: reply checks), as the speculator's ``exchange`` does:

* synchronous: prep H, copy the draft in, GPU work T, wait for the step's
  output, then the round trip on the host: period ~ H + T + L + C;
* deferred, as layer 3 runs it: after the step's output, the round trip is
  submitted to one long-lived reply thread (a one-worker executor) that fills
  pinned staging and releases the gate; the host prepares the next step at
  once, parks the stream behind the gate, then enqueues the staging copy and
  the GPU work: period ~ T + max(H, L + C) when the two threads interleave.

The reply thread needs the GIL between its blocking calls while the host
thread runs Python, so the grid repeats over interpreter switch intervals
(``sys.setswitchinterval``; CPython's default is 5 ms).

Reported per (T, H, L, switch interval): period p50 of both (ms), the time
saved and the hidden fraction ``saved / min(L, H)`` (1.0: all overlappable
time hidden), also with each mode's measured GPU time taken out of its period
(``torch.cuda._sleep`` counts cycles, and the SM clock differs between the
modes); and the gate's release-to-kernel-done p50/p99 against an
ungated launch (us).

Usage::

    python bench/bench_deferred_resolve.py --steps 60 --out deferred.json \
        [--switch-interval-us 5000 50]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import statistics
import sys
import time
import types
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import torch
import zmq

GATE_PATH = Path(__file__).resolve().parents[1] / "overlay/vllm/k3_draft/stream_gate.py"
K = 3
NUM_REQS = 8


def load_stream_gate(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("k3_stream_gate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def delay_server(address: str, ready: EventType) -> None:
    """REP loop: a request is the delay in ms; the reply K int64 ids per
    request, sent after that delay."""
    socket = zmq.Context().socket(zmq.REP)
    socket.bind(address)
    ready.set()
    reply = torch.arange(NUM_REQS * K, dtype=torch.int64).numpy().tobytes()
    while True:
        message = socket.recv()
        if message == b"stop":
            socket.send(b"")
            return
        spin(float(message))
        socket.send(reply)


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class Step:
    """The synthetic verifier step and its draft round trip."""

    def __init__(
        self,
        address: str,
        t_ms: float,
        h_ms: float,
        l_ms: float,
        c_ms: float,
        cycles_per_ms: float,
    ) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
        self.socket.connect(address)
        self.t_cycles = int(t_ms * cycles_per_ms)
        self.h_ms, self.l_ms, self.c_ms = h_ms, l_ms, c_ms
        self.staging = torch.zeros(NUM_REQS, K, dtype=torch.int64, pin_memory=True)
        self.drafts = torch.zeros(NUM_REQS, K, dtype=torch.int64, device="cuda")
        self.kernel_start = torch.cuda.Event(enable_timing=True, blocking=True)
        self.output = torch.cuda.Event(enable_timing=True, blocking=True)
        # Measured duration (ms) of each step's GPU work: torch.cuda._sleep
        # counts clock cycles and the SM clock differs between the two modes.
        self.kernel_ms: list[float] = []

    def round_trip(self) -> None:
        spin(self.c_ms / 2)
        self.socket.send(str(self.l_ms).encode())
        reply = self.socket.recv()
        spin(self.c_ms / 2)
        self.staging.copy_(
            torch.frombuffer(bytearray(reply), dtype=torch.int64).view(NUM_REQS, K)
        )

    def gpu_work(self) -> None:
        self.drafts.copy_(self.staging, non_blocking=True)
        self.kernel_start.record()
        torch.cuda._sleep(self.t_cycles)
        self.output.record()

    def wait_output(self) -> None:
        self.output.synchronize()
        self.kernel_ms.append(self.kernel_start.elapsed_time(self.output))

    def synchronous(self, steps: int) -> list[float]:
        periods = []
        last = time.perf_counter()
        for _ in range(steps):
            spin(self.h_ms)
            self.gpu_work()
            self.wait_output()
            self.round_trip()
            now = time.perf_counter()
            periods.append(now - last)
            last = now
        return periods

    def deferred(self, gate_module: types.ModuleType, steps: int) -> list[float]:
        replies = [gate_module.ReplyGate(gate_module.StreamGate()) for _ in range(2)]
        done: list[Future[None] | None] = [None, None]
        periods = []
        with ThreadPoolExecutor(1, thread_name_prefix="reply") as executor:
            last = time.perf_counter()
            for i in range(steps):
                spin(self.h_ms)
                if i:
                    replies[(i - 1) % 2].wait()
                self.gpu_work()
                self.wait_output()
                slot = i % 2
                previous = done[slot]
                if previous is not None:
                    previous.result()
                replies[slot].reset()
                done[slot] = executor.submit(
                    replies[slot].deliver,
                    self.round_trip,
                    lambda exc: self.staging.fill_(-1),
                )
                now = time.perf_counter()
                periods.append(now - last)
                last = now
            replies[(steps - 1) % 2].wait()
            torch.cuda.synchronize()
        return periods


def calibrate_sleep() -> float:
    """``torch.cuda._sleep`` cycles per millisecond."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def gate_overhead(gate_module: types.ModuleType, iters: int) -> dict[str, float]:
    """Release-to-kernel-done of a gated tiny kernel vs an ungated launch."""
    flag = torch.zeros(1, device="cuda")
    gate = gate_module.StreamGate()
    gated, ungated = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        done = torch.cuda.Event(blocking=False)
        gate.park()
        flag.add_(1)
        done.record()
        start = time.perf_counter()
        gate.release()
        while not done.query():
            pass
        gated.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        flag.add_(1)
        done.record()
        while not done.query():
            pass
        ungated.append(time.perf_counter() - start)
    return {
        "gated_p50_us": statistics.median(gated) * 1e6,
        "gated_p99_us": sorted(gated)[int(0.99 * (iters - 1))] * 1e6,
        "ungated_p50_us": statistics.median(ungated) * 1e6,
    }


def run_cell(
    args: argparse.Namespace,
    gate_module: types.ModuleType,
    address: str,
    cycles_per_ms: float,
    t_ms: float,
    h_ms: float,
    l_ms: float,
) -> dict[str, float]:
    """Synchronous and deferred period of one (T, H, L)."""
    step = Step(address, t_ms, h_ms, l_ms, args.reply_cpu_ms, cycles_per_ms)
    step.synchronous(5)
    step.kernel_ms.clear()
    sync = statistics.median(step.synchronous(args.steps)[1:]) * 1e3
    sync_kernel = statistics.median(step.kernel_ms[1:])
    step.kernel_ms.clear()
    deferred = statistics.median(step.deferred(gate_module, args.steps)[2:]) * 1e3
    deferred_kernel = statistics.median(step.kernel_ms[2:])
    step.socket.close(linger=0)
    saved = sync - deferred
    # The same comparison without the GPU work each mode measured.
    host_saved = (sync - sync_kernel) - (deferred - deferred_kernel)
    return {
        "T_ms": t_ms,
        "H_ms": h_ms,
        "L_ms": l_ms,
        "sync_period_ms": sync,
        "deferred_period_ms": deferred,
        "sync_gpu_ms": sync_kernel,
        "deferred_gpu_ms": deferred_kernel,
        "saved_ms": saved,
        "hidden_fraction": saved / min(l_ms, h_ms),
        "hidden_fraction_gpu_corrected": host_saved / min(l_ms, h_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--gate-iters", type=int, default=2000)
    parser.add_argument("--t-ms", type=float, nargs="+", default=[2.0, 10.0])
    parser.add_argument("--h-ms", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--l-ms", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument(
        "--reply-cpu-ms",
        type=float,
        default=0.2,
        help="Python work of one round trip on the reply thread (C)",
    )
    parser.add_argument(
        "--switch-interval-us",
        type=float,
        nargs="+",
        default=[5000.0, 50.0],
        help="interpreter switch intervals to run the grid at",
    )
    parser.add_argument("--gate", type=Path, default=GATE_PATH)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_deferred_resolve needs a CUDA GPU")
    gate_module = load_stream_gate(args.gate)
    cycles_per_ms = calibrate_sleep()
    warm = torch.zeros(NUM_REQS, K, dtype=torch.int64, pin_memory=True)
    # Every kernel that runs behind a gate is loaded before the first park.
    gate_module.warm(
        lambda: torch.cuda._sleep(1000),
        lambda: torch.zeros(1, device="cuda").add_(1),
        lambda: torch.empty_like(warm, device="cuda").copy_(warm, non_blocking=True),
    )

    address = "ipc:///tmp/k3_bench_deferred_resolve.ipc"
    ready = mp.get_context("spawn").Event()
    server = mp.get_context("spawn").Process(
        target=delay_server, args=(address, ready), daemon=True
    )
    server.start()
    ready.wait(30)

    rows = []
    default_interval = sys.getswitchinterval()
    for interval_us in args.switch_interval_us:
        sys.setswitchinterval(interval_us / 1e6)
        for t_ms in args.t_ms:
            for h_ms in args.h_ms:
                for l_ms in args.l_ms:
                    row = run_cell(
                        args, gate_module, address, cycles_per_ms, t_ms, h_ms, l_ms
                    )
                    row["switch_interval_us"] = interval_us
                    rows.append(row)
                    print(
                        f"switch {interval_us:6.0f} us  T {t_ms:5.1f}  H {h_ms:4.1f}  "
                        f"L {l_ms:4.1f}  sync {row['sync_period_ms']:7.3f} ms  "
                        f"deferred {row['deferred_period_ms']:7.3f} ms  "
                        f"hidden {row['hidden_fraction']:5.2f} "
                        f"(GPU-time corrected "
                        f"{row['hidden_fraction_gpu_corrected']:5.2f}; GPU "
                        f"{row['sync_gpu_ms']:.2f}/{row['deferred_gpu_ms']:.2f} ms)",
                        flush=True,
                    )
    sys.setswitchinterval(default_interval)
    overhead = gate_overhead(gate_module, args.gate_iters)
    print(
        "gate: release-to-done p50 {gated_p50_us:.1f} us (p99 {gated_p99_us:.1f}), "
        "ungated launch p50 {ungated_p50_us:.1f} us".format(**overhead)
    )
    stopper: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    stopper.connect(address)
    stopper.send(b"stop")
    stopper.recv()
    server.join(10)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steps": args.steps,
        "reply_cpu_ms": args.reply_cpu_ms,
        "grid": rows,
        "gate": overhead,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
