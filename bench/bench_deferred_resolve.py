# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deferred resolution (layer 3) on one GPU: step period synchronous vs
deferred, and the stream gate's overhead. Runs without vllm: torch, pyzmq,
``overlay/`` on ``PYTHONPATH`` (layer 1's ``vllm.k3_draft``) and
``vllm/k3_draft/stream_gate.py`` loaded by file path.

A synthetic step has GPU work ``T`` (``torch.cuda._sleep``) and host
preparation ``H`` (a host spin in Python, holding the GIL as the runner's own
Python does). Its draft round trip is the product's: layer 1's ``RemotePlan.run``
(the plan, the gather of 4 context rows of 3 x 7168 bf16 per request, the
header, the reply's decode and checks; 8 requests, K = 3) against a real
``DraftServer`` behind layer 1's ``RpcTransport`` in its own process, whose
engine has no model and answers each PROPOSE after ``L`` ms (the injected
delay). So the reply thread's own Python work is the plan's, not a model of it.

* synchronous: prep H, copy the draft in, GPU work T, wait for the step's
  output, then the round trip on the host;
* deferred, as layer 3 runs it: after the step's output, the round trip is
  submitted to one long-lived reply thread (a one-worker executor) that fills
  pinned staging and releases the gate; the host waits until the reply
  thread has sent its PROPOSE (layer 3's ``consume`` does so once the step's
  inputs are on the host, as they are here), then prepares the next step,
  parks the stream behind the gate and enqueues the staging copy and the GPU
  work.

The reply thread needs the GIL between its blocking calls while the host
thread runs Python, so the grid repeats over interpreter switch intervals
(``sys.setswitchinterval``; CPython's default is 5 ms).

Reported per (T, H, L, switch interval): period p50 of both (ms), the time
saved and the hidden fraction ``saved / min(L, H)`` (1.0: all overlappable
time hidden), also with each mode's measured GPU time taken out of its period
(``torch.cuda._sleep`` counts cycles, and the SM clock differs between the
modes); the synchronous round trip p50 (``L`` plus transport, server and plan
work); and the gate's release-to-kernel-done p50/p99 against an ungated
launch (us).

Usage (``PYTHONPATH=overlay``)::

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
import tempfile
import threading
import time
import types
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_remote_rpc import ENGINE_TIMINGS, ROWS_PER_REQUEST, WIDTH, K
from cli_types import existing_file, output_file, positive_float, positive_int, run

from vllm.entrypoints.k3_dspark_rpc import RpcTransport
from vllm.k3_draft.client import DraftClient, ServerRequirements
from vllm.k3_draft.engine import (
    DraftEngine,
    DraftLimits,
    EngineSpec,
    MemoryPlan,
    ProposeBatch,
    ProposeOutput,
)
from vllm.k3_draft.plan import RemotePlan, StepInputs, StepRequest
from vllm.k3_draft.server import DraftServer

GATE_PATH = Path(__file__).resolve().parents[1] / "overlay/vllm/k3_draft/stream_gate.py"
NUM_REQS = 8
VOCAB_SIZE = 163_840
MAX_MODEL_LEN = 1 << 24


def load_stream_gate(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("k3_stream_gate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class DelayEngine(DraftEngine):
    """No model: drafts each request's anchor K times after ``delay_ms`` of
    host spin (the injected round trip ``L``)."""

    def __init__(self, delay_ms: float) -> None:
        self.delay_ms = delay_ms
        self.device = torch.device("cpu")
        self.spec = EngineSpec(
            method="dspark",
            vocab_size=VOCAB_SIZE,
            context_width=WIDTH,
            hidden_size=1024,
            supports_logits=False,
            query_kv_overhang=0,
        )
        self.limits = DraftLimits(
            max_requests=2 * NUM_REQS,
            max_batch_size=NUM_REQS,
            max_speculative_tokens=K,
            max_context_tokens=NUM_REQS * ROWS_PER_REQUEST,
            max_model_len=MAX_MODEL_LEN,
            block_size=16,
            window_size=64,
            prefix_cache_tokens=128,
        )

    def memory_plan(self) -> MemoryPlan:
        return MemoryPlan(0, 0, 0, 0)

    def load(self) -> None:
        pass

    def capture_cuda_graphs(self) -> list[tuple[int, int]]:
        return []

    def propose(self, batch: ProposeBatch) -> ProposeOutput:
        spin(self.delay_ms)
        anchors = torch.tensor(batch.anchor_token_ids, dtype=torch.int64)
        tokens = anchors[:, None].expand(-1, batch.num_speculative_tokens)
        timings = dict.fromkeys(ENGINE_TIMINGS, 0.0)
        timings["query"] = self.delay_ms
        return ProposeOutput(tokens.contiguous(), None, timings)

    def restore(self, src_slot: int, dst_slot: int, start: int, end: int) -> None:
        raise NotImplementedError("the benchmark never reconnects")


def delay_server(address: str, delay_ms: float, ready: EventType) -> None:
    """Layer 1's server and transport on ``address`` over a ``DelayEngine``;
    runs until the process is terminated."""
    transport = RpcTransport(DraftServer(DelayEngine(delay_ms)), address, None)
    transport.bind()
    transport.serve(threading.Event(), ready.set)


class Drafter:
    """The verifier's half: a ``RemotePlan`` on one delay server, stepping
    the same ``NUM_REQS`` requests by ``ROWS_PER_REQUEST`` positions."""

    def __init__(self, address: str) -> None:
        self.client = DraftClient(address, 5000)
        needs = ServerRequirements(
            method="dspark",
            capabilities=frozenset(),
            context_width=WIDTH,
            vocab_size=VOCAB_SIZE,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=NUM_REQS,
            num_speculative_tokens=K,
            max_num_batched_tokens=NUM_REQS * ROWS_PER_REQUEST,
        )
        self.plan = RemotePlan(self.client, needs)
        self.plan.connect()
        # Pinned, as the runner stages them from the device.
        rows = torch.randn(NUM_REQS * ROWS_PER_REQUEST, WIDTH).bfloat16()
        self.rows = rows.pin_memory() if torch.cuda.is_available() else rows
        self.position = 0
        self.failures = 0

    def round_trip(self) -> np.ndarray:
        requests = [
            StepRequest(
                request_id=f"r{i}",
                first_position=self.position,
                num_context=ROWS_PER_REQUEST,
                anchor_token_id=11 + i,
                row_offset=i * ROWS_PER_REQUEST,
                tokens=None,
            )
            for i in range(NUM_REQS)
        ]
        result = self.plan.run(StepInputs(requests, K, self.rows))
        self.position += ROWS_PER_REQUEST
        if (result.tokens < 0).any():
            self.failures += 1
        return result.tokens


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class Step:
    """The synthetic verifier step and its draft round trip."""

    def __init__(
        self, drafter: Drafter, t_ms: float, h_ms: float, cycles_per_ms: float
    ) -> None:
        self.drafter = drafter
        self.t_cycles = int(t_ms * cycles_per_ms)
        self.h_ms = h_ms
        self.staging = torch.zeros(NUM_REQS, K, dtype=torch.int64, pin_memory=True)
        # Filled through numpy on the reply thread, as layer 3 does.
        self.staging_host = self.staging.numpy()
        self.drafts = torch.zeros(NUM_REQS, K, dtype=torch.int64, device="cuda")
        self.kernel_start = torch.cuda.Event(enable_timing=True, blocking=True)
        self.output = torch.cuda.Event(enable_timing=True, blocking=True)
        # Measured duration (ms) of each step's GPU work: torch.cuda._sleep
        # counts clock cycles and the SM clock differs between the two modes.
        self.kernel_ms: list[float] = []
        # Durations of the round trips (s), on whichever thread ran them.
        self.round_trips: list[float] = []

    def round_trip(self) -> None:
        start = time.perf_counter()
        self.staging_host[:] = self.drafter.round_trip()
        self.round_trips.append(time.perf_counter() - start)

    def failed(self, exc: BaseException) -> None:
        self.staging_host.fill(-1)
        self.drafter.failures += 1

    def reply(self, gate: Any) -> None:
        """Reply thread: the round trip into staging, then release ``gate``
        (a ``ReplyGate``), marked sent once the PROPOSE left (layer 3's
        ``DeferredResolution._reply``)."""
        with self.drafter.client.reporting_sent(gate.mark_sent):
            gate.deliver(self.round_trip, self.failed)

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
                done[slot] = executor.submit(self.reply, replies[slot])
                replies[slot].wait_sent()
                now = time.perf_counter()
                periods.append(now - last)
                last = now
            replies[(steps - 1) % 2].wait()
            torch.cuda.synchronize()
        return periods


def calibrate_sleep() -> float:
    """``torch.cuda._sleep`` cycles per millisecond (after a warm-up sleep
    that lets an idle GPU raise its SM clock)."""
    cycles = 10_000_000
    torch.cuda._sleep(10 * cycles)
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
    drafter: Drafter,
    cycles_per_ms: float,
    t_ms: float,
    h_ms: float,
    l_ms: float,
) -> dict[str, float]:
    """Synchronous and deferred period of one (T, H, L)."""
    step = Step(drafter, t_ms, h_ms, cycles_per_ms)
    step.synchronous(5)
    step.kernel_ms.clear()
    sync = statistics.median(step.synchronous(args.steps)[1:]) * 1e3
    sync_kernel = statistics.median(step.kernel_ms[1:])
    sync_round_trip = statistics.median(step.round_trips[6:]) * 1e3
    step.kernel_ms.clear()
    step.round_trips.clear()
    deferred = statistics.median(step.deferred(gate_module, args.steps)[2:]) * 1e3
    deferred_kernel = statistics.median(step.kernel_ms[2:])
    deferred_round_trip = statistics.median(step.round_trips[1:]) * 1e3
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
        "sync_round_trip_ms": sync_round_trip,
        "deferred_round_trip_ms": deferred_round_trip,
        "saved_ms": saved,
        "hidden_fraction": saved / min(l_ms, h_ms),
        "hidden_fraction_gpu_corrected": host_saved / min(l_ms, h_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=60)
    parser.add_argument("--gate-iters", type=positive_int, default=2000)
    parser.add_argument("--t-ms", type=positive_float, nargs="+", default=[2.0, 10.0])
    parser.add_argument("--h-ms", type=positive_float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--l-ms", type=positive_float, nargs="+", default=[1.0, 4.0])
    parser.add_argument(
        "--switch-interval-us",
        type=positive_float,
        nargs="+",
        default=[5000.0, 50.0],
        help="interpreter switch intervals to run the grid at",
    )
    parser.add_argument("--gate", type=existing_file, default=GATE_PATH)
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    if args.steps < 3:
        # The deferred period drops its first two steps (the pipeline fills).
        parser.error("--steps: give at least 3")
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

    spawn = mp.get_context("spawn")
    # A folder of this run's own: a run beside another would find its
    # socket paths in use.
    sockets = tempfile.TemporaryDirectory(prefix="k3_bench_deferred_resolve_")
    servers, drafters = [], {}
    for index, l_ms in enumerate(args.l_ms):
        address = f"ipc://{sockets.name}/{index}.ipc"
        ready = spawn.Event()
        server = spawn.Process(
            target=delay_server, args=(address, l_ms, ready), daemon=True
        )
        server.start()
        servers.append(server)
        if not ready.wait(120):
            sys.exit(f"the delay server for L = {l_ms} ms did not start")
        drafters[l_ms] = Drafter(address)

    rows = []
    default_interval = sys.getswitchinterval()
    for interval_us in args.switch_interval_us:
        sys.setswitchinterval(interval_us / 1e6)
        for t_ms in args.t_ms:
            for h_ms in args.h_ms:
                for l_ms in args.l_ms:
                    row = run_cell(
                        args,
                        gate_module,
                        drafters[l_ms],
                        cycles_per_ms,
                        t_ms,
                        h_ms,
                        l_ms,
                    )
                    row["switch_interval_us"] = interval_us
                    rows.append(row)
                    print(
                        f"switch {interval_us:6.0f} us  T {t_ms:5.1f}  H {h_ms:4.1f}  "
                        f"L {l_ms:4.1f}  sync {row['sync_period_ms']:7.3f} ms  "
                        f"deferred {row['deferred_period_ms']:7.3f} ms  "
                        f"round trip {row['sync_round_trip_ms']:6.3f}/"
                        f"{row['deferred_round_trip_ms']:6.3f} ms  "
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
    failures = sum(drafter.failures for drafter in drafters.values())
    for drafter in drafters.values():
        drafter.client.close()
    for server in servers:
        server.terminate()
        server.join(10)
    sockets.cleanup()
    if failures:
        sys.exit(f"{failures} round trips returned no drafts")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steps": args.steps,
        "grid": rows,
        "gate": overhead,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    run(main)
