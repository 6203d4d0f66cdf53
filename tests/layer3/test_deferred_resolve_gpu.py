# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deferred against immediate resolution on a CUDA device (``-m gpu``; needs
vllm importable, e.g. the stack's Python carried by ``ci/gpu-carry.sh``).

Two real ``RemoteK3DSparkSpeculator`` on the GPU drive the same steps, each
through its own reference draft server: one resolves immediately, one
deferred through the runner's real ``sample_tokens`` and next
``execute_model`` (``k3_l3_runner``), with the real ``StreamGate``. Every
reply is held back after its round trip until the runner has parked its
stream, so the staging copies, layer 2's publish (upstream's Triton Gumbel
sampler, the top-k scatter) and the draft store are enqueued before the
reply is in pinned memory. Draft tokens and draft-logits caches must be
bit-identical to the immediate verifier's after every step; also when every
other step is all greedy (both verifiers bound to the temperatures as the
runner's hook binds them), which asks for no logits and publishes none.
"""

from __future__ import annotations

import copy
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from k3_l3_runner import sample_tokens, scheduler_output
from k3_l3_steps import (
    SLOTS,
    TEMPERATURES,
    K,
    last_sampled,
    propose,
    seeds,
    step_batch,
    temperatures,
)

from vllm.k3_draft import stream_gate
from vllm.k3_draft.deferred import DeferredResolution, install_deferred_resolution
from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
    bind_sampling_states,
)
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    RemoteK3DSparkSpeculator,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest_plugins = ("conftest_client",)

HOLD_S = 0.05


def _config(vllm_config_factory: Any, method: str) -> Any:
    config = copy.copy(vllm_config_factory())
    if method != "greedy":
        config.speculative_config = copy.copy(config.speculative_config)
        config.speculative_config.draft_sample_method = "probabilistic"
    return config


@pytest.fixture
def held_replies(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every deferred reply waits ``HOLD_S`` after its round trip, before it
    fills the staging (``consume`` waits only until the PROPOSE is sent), so
    the runner parks its stream first; records, per reply, whether it did."""
    parked: list[bool] = []
    delivering = threading.local()
    deliver = stream_gate.ReplyGate.deliver
    exchange = RemoteK3DSparkSpeculator.exchange

    def tracked(self: stream_gate.ReplyGate, fill: Any, fail: Any) -> None:
        delivering.gate = self
        try:
            deliver(self, fill, fail)
        finally:
            delivering.gate = None

    def held(self: RemoteK3DSparkSpeculator, step: Any) -> Any:
        result = exchange(self, step)
        gate = getattr(delivering, "gate", None)
        if gate is not None:  # a deferred reply, on its reply thread
            time.sleep(HOLD_S)
            parked.append(gate._parked)
        return result

    monkeypatch.setattr(stream_gate.ReplyGate, "deliver", tracked)
    monkeypatch.setattr(RemoteK3DSparkSpeculator, "exchange", held)
    return parked


@pytest.mark.parametrize("method", ["greedy", "full", "top16", "full-greedy-odd"])
def test_deferred_and_immediate_give_identical_draft_state_on_cuda(
    make_speculator,
    make_runner,
    vllm_config_factory,
    reference_server,
    second_reference_server,
    held_replies,
    monkeypatch,
    method,
):
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", "16" if method == "top16" else "0")
    config = _config(vllm_config_factory, method)
    immediate, _ = make_speculator(reference_server.address, config, device="cuda")
    deferred, _ = make_speculator(
        second_reference_server.address, config, device="cuda"
    )
    strategy = install_deferred_resolution(deferred)
    assert isinstance(strategy, DeferredResolution) and strategy.deferrable
    temperature = temperatures("cuda", greedy=method == "greedy")
    runner = make_runner(deferred, [], K, temperature, seeds("cuda"))
    greedy_odd = method == "full-greedy-odd"
    host = temperature.cpu().numpy()
    if greedy_odd:
        states = SimpleNamespace(temperature=SimpleNamespace(np=host))
        bind_sampling_states(immediate, states)
        bind_sampling_states(deferred, states)
    for step in range(5):
        if greedy_odd:
            host[SLOTS] = 0.0 if step % 2 else TEMPERATURES
            temperature.copy_(torch.from_numpy(host))
        start = 10 + (K + 1) * step
        # Step 0 is the warm-up: synchronous, it loads every kernel that later
        # runs behind a parked stream (as the worker's warm-up does).
        strategy.warmed = step > 0
        want = propose(
            immediate, step_batch(["i0", "i1"], start, "cuda"), step, temperature
        )
        runner.req_states.last_sampled_tokens = last_sampled(step, "cuda")
        sample_tokens(runner, step_batch(["d0", "d1"], start, "cuda"), K, seed=step)
        assert strategy.pending == (step > 0)
        runner.execute_model(scheduler_output(set(), []))
        assert (want >= 0).all(), "the reference server drafted nothing"
        assert torch.equal(runner.req_states.draft_tokens.data[SLOTS], want)
        for ext_d, ext_i in zip(deferred.extensions, immediate.extensions):
            assert torch.equal(ext_d.draft_logits, ext_i.draft_logits)
    assert held_replies == [True] * 4
