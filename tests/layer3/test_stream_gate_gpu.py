# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stream gate on a CUDA device (layer 3): a kernel enqueued behind a
parked stream does not run before the host releases it; a failing reply still
releases. The gate module is loaded by file path (no vllm needed).

No timed assertions: "not yet run" is observed with ``Event.query()`` after
the host has waited, which can only fail if the gate leaks."""

import threading
import time

import pytest
import torch
from k3_l3_gate import load_stream_gate  # sibling module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: the gate parks a stream",
    ),
]

HOLD_S = 0.2


@pytest.fixture(scope="module")
def gate_module():
    module = load_stream_gate()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    # Load every kernel of these tests before the first park.
    module.warm(lambda: flag.fill_(1), lambda: flag.copy_(host, non_blocking=True))
    return module


def _run_in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_parked_stream_runs_nothing_until_released(gate_module):
    stream = torch.cuda.Stream()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    gate = gate_module.StreamGate()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        gate.park(stream)
        flag.fill_(1)
        done = torch.cuda.Event()
        done.record(stream)
    time.sleep(HOLD_S)
    assert not done.query(), "a kernel behind the gate ran before release"
    releaser = _run_in_thread(gate.release)
    done.synchronize()
    releaser.join(timeout=10)
    assert not releaser.is_alive()
    assert flag.item() == 1


def test_gate_is_reusable(gate_module):
    stream = torch.cuda.Stream()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    gate = gate_module.StreamGate()
    for value in range(1, 4):
        with torch.cuda.stream(stream):
            gate.park(stream)
            flag.fill_(value)
        gate.release()
        stream.synchronize()
        assert flag.item() == value


@pytest.mark.parametrize("fails", [False, True])
def test_reply_gate_copies_staging_after_the_reply(gate_module, fails):
    """The reply thread fills pinned staging (or, failing, stages -1); the
    stream copies it only after ``deliver``, and a failure still releases."""
    stream = torch.cuda.Stream()
    staging = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    device = torch.zeros(4, dtype=torch.int32, device="cuda")
    reply = gate_module.ReplyGate(gate_module.StreamGate())
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        reply.wait(stream)
        device.copy_(staging, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    time.sleep(HOLD_S)
    assert not done.query()

    def fill():
        if fails:
            raise ConnectionError("draft server gone")
        staging.fill_(7)

    thread = _run_in_thread(lambda: reply.deliver(fill, lambda exc: staging.fill_(-1)))
    done.synchronize()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert device.tolist() == ([-1] * 4 if fails else [7] * 4)


def test_reply_already_delivered_does_not_park(gate_module):
    stream = torch.cuda.Stream()
    staging = torch.full((4,), 3, dtype=torch.int32, pin_memory=True)
    device = torch.zeros(4, dtype=torch.int32, device="cuda")
    reply = gate_module.ReplyGate(gate_module.StreamGate())
    reply.deliver(lambda: None, lambda exc: None)
    with torch.cuda.stream(stream):
        reply.wait(stream)
        device.copy_(staging, non_blocking=True)
    stream.synchronize()
    assert device.tolist() == [3] * 4
