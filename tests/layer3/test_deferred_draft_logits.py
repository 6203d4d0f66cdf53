# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deferred resolution with layer 2's probabilistic draft logits, on CPU.

Two real ``RemoteK3DSparkSpeculator`` with ``draft_sample_method=
"probabilistic"`` (layer 2's ``RemoteDraftLogits`` extension) drive the same
steps through a real reference draft server (loopback ZeroMQ, logits
capability on): one resolves immediately, one deferred through the runner's
real ``sample_tokens`` and next ``execute_model`` (``k3_l3_runner``). Their
draft tokens and their whole draft-logits caches must be bit-identical after
every step, at temperatures > 0, full vocabulary and top-k. Upstream's Triton Gumbel
sampler is replaced by layer 2's CPU reference (``k3_l2_reference``).

On CPU ``consume`` waits on the host for the reply, so rank 0 publishes the
consumed payload; ``outstanding=True`` makes it publish what it would on CUDA
when the reply has not arrived yet (the staging slot layer 3 selected for the
reply thread), which proves that layer 2's and layer 3's staging slots stay in
step, also across a failed step that never reached layer 2's ``consume``.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import k3_l2_reference
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
from vllm.k3_draft.deferred import (
    NUM_STAGING_SLOTS,
    DeferredResolution,
    extension_staging,
    install_deferred_resolution,
)
from vllm.k3_draft.plan import ProposeExtension
from vllm.k3_draft.protocol import ProtocolError
from vllm.v1.worker.gpu.spec_decode.dspark import remote_draft_logits
from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
    FILL,
    RemoteDraftLogits,
    bind_sampling_states,
)

pytest_plugins = ("conftest_client",)


@pytest.fixture(autouse=True)
def reference_gumbel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        remote_draft_logits, "gumbel_sample", k3_l2_reference.gumbel_sample
    )


@pytest.fixture
def probabilistic(vllm_config_factory, monkeypatch) -> Any:
    monkeypatch.delenv("VLLM_K3_DRAFT_LOGITS_TOPK", raising=False)
    config = copy.copy(vllm_config_factory())
    config.speculative_config = copy.copy(config.speculative_config)
    config.speculative_config.draft_sample_method = "probabilistic"
    return config


class _Runner:
    """The runner surface ``select_step`` reads: an eligible step."""

    pcp_manager = adaptive_verification = pp_handler = None
    scheduler_config = type("S", (), {"async_scheduling": True})()


class _Outstanding(stream_gate.ReplyGate):
    """A host-blocking reply gate that reports the reply as outstanding when
    ``consume`` asks: rank 0 then publishes the selected staging slot, as on
    CUDA when the stream is parked before the reply arrived."""

    @property
    def delivered(self) -> bool:
        return False


def _propose(speculator: Any, batch: Any, step: int) -> torch.Tensor:
    return propose(speculator, batch, step, temperatures())


def _runner(make_runner: Any, speculator: Any) -> Any:
    """A runner of ``speculator`` with the sampling state ``_propose`` uses."""
    return make_runner(speculator, [], K, temperatures(), seeds())


def _sample_tokens(runner: Any, batch: Any, step: int) -> None:
    """The runner's real ``sample_tokens``: the step ``_propose`` makes."""
    runner.req_states.last_sampled_tokens = last_sampled(step)
    sample_tokens(runner, batch, K, seed=step)


def _deferred(speculator: Any, outstanding: bool) -> DeferredResolution:
    strategy = install_deferred_resolution(speculator)
    assert strategy is not None and strategy.deferrable
    strategy.warmed = True
    if outstanding:
        for slot in strategy._slots:
            slot.reply = _Outstanding(None)
    return strategy


def _extension(speculator: Any) -> RemoteDraftLogits:
    (extension,) = speculator.extensions
    assert isinstance(extension, RemoteDraftLogits)
    return extension


def _record_publish(extension: RemoteDraftLogits, monkeypatch) -> list[Any]:
    payloads: list[Any] = []
    publish = extension.publish

    def recording(payload: Any, context: Any) -> None:
        payloads.append(payload)
        publish(payload, context)

    monkeypatch.setattr(extension, "publish", recording)
    return payloads


def _fail_consume(
    extension: RemoteDraftLogits, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise ProtocolError("injected: logits frame refused")

    monkeypatch.setattr(extension, "consume", broken)


# ------------------------------------------------------------ eligibility


def test_layer_2_extension_is_deferral_safe_others_are_not(
    make_speculator, probabilistic, reference_server
):
    speculator, _ = make_speculator(reference_server.address, probabilistic)
    assert extension_staging(_extension(speculator)) is not None

    class Opaque(ProposeExtension):
        capability = "opaque_v1"

        def request_fields(self, num_speculative_tokens: int) -> dict[str, Any]:
            return {}

        def consume(self, metadata: Any, frames: Any, proposal: Any) -> Any:
            return None

    assert extension_staging(Opaque()) is None
    speculator.extensions.append(Opaque())
    strategy = install_deferred_resolution(speculator)
    assert strategy is not None and not strategy.deferrable
    strategy.warmed = True
    batch = step_batch(["a", "b"], 10)
    strategy.select_step(_Runner(), batch)
    assert not strategy._defer_next


# ------------------------------------------------------------ numerics


@pytest.mark.parametrize("outstanding", [False, True])
@pytest.mark.parametrize("topk", [0, 16])
def test_deferred_and_immediate_give_identical_drafts_and_logits_cache(
    make_speculator,
    make_runner,
    probabilistic,
    reference_server,
    second_reference_server,
    monkeypatch,
    topk,
    outstanding,
):
    """Over several steps, including one whose logits ``consume`` fails in
    both verifiers (layer 2's staging cursor does not advance there); each
    verifier has its own reference draft server. The deferred one runs the
    runner's ``sample_tokens`` and the next ``execute_model``."""
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", str(topk))
    immediate, _ = make_speculator(reference_server.address, probabilistic)
    deferred_spec, _ = make_speculator(second_reference_server.address, probabilistic)
    strategy = _deferred(deferred_spec, outstanding)
    runner = _runner(make_runner, deferred_spec)
    ext_i, ext_d = _extension(immediate), _extension(deferred_spec)
    published = _record_publish(ext_d, monkeypatch)
    failing_step = 2
    for step in range(6):
        start = 10 + (K + 1) * step
        with pytest.MonkeyPatch.context() as failing:
            if step == failing_step:
                _fail_consume(ext_i, failing)
                _fail_consume(ext_d, failing)
            want = _propose(immediate, step_batch(["i0", "i1"], start), step).clone()
            _sample_tokens(runner, step_batch(["d0", "d1"], start), step)
            assert strategy.pending
            runner.execute_model(scheduler_output(set(), []))
        if step == failing_step:
            assert (want == -1).all()
        else:
            assert (want >= 0).all(), "the reference server drafted nothing"
            assert published[-1] is not None
        assert torch.equal(runner.req_states.draft_tokens.data[SLOTS], want)
        assert torch.equal(ext_d.draft_logits, ext_i.draft_logits)
    assert not (ext_d.draft_logits[SLOTS] == FILL).all()


def test_all_greedy_steps_deferred_keep_the_servers_drafts_as_immediate_ones(
    make_speculator,
    make_runner,
    probabilistic,
    reference_server,
    second_reference_server,
    monkeypatch,
):
    """Sampling and all-greedy steps alternate (the runner's temperatures
    change in place); both verifiers are bound to them as the runner's hook
    binds. A greedy step publishes no logits: the server's drafts stand and
    the cache keeps the last sampling step's rows."""
    immediate, _ = make_speculator(reference_server.address, probabilistic)
    deferred_spec, _ = make_speculator(second_reference_server.address, probabilistic)
    strategy = _deferred(deferred_spec, outstanding=True)
    runner = _runner(make_runner, deferred_spec)
    states = runner.sampler.sampling_states
    bind_sampling_states(immediate, states)
    bind_sampling_states(deferred_spec, states)
    ext_i, ext_d = _extension(immediate), _extension(deferred_spec)
    published = _record_publish(ext_d, monkeypatch)
    for step in range(4):
        greedy = step % 2 == 1
        states.temperature.np[SLOTS] = 0.0 if greedy else TEMPERATURES
        cache = ext_d.draft_logits.clone()
        start = 10 + (K + 1) * step
        temperature = torch.from_numpy(states.temperature.np)
        want = propose(immediate, step_batch(["i0", "i1"], start), step, temperature)
        want = want.clone()
        _sample_tokens(runner, step_batch(["d0", "d1"], start), step)
        assert strategy.pending
        runner.execute_model(scheduler_output(set(), []))
        assert (want >= 0).all(), "the reference server drafted nothing"
        assert torch.equal(runner.req_states.draft_tokens.data[SLOTS], want)
        assert torch.equal(ext_d.draft_logits, ext_i.draft_logits)
        assert len(published) == step // 2 + 1
        if greedy:
            assert torch.equal(ext_d.draft_logits, cache)


# ------------------------------------------------------------ failure


@pytest.mark.parametrize("outstanding", [False, True])
@pytest.mark.parametrize("failure", ["reply_thread", "consume", "other_slot"])
def test_failed_reply_with_logits_publishes_nothing_stale(
    make_speculator,
    make_runner,
    probabilistic,
    reference_server,
    monkeypatch,
    failure,
    outstanding,
):
    """The failed reply reuses a staging slot that an earlier good reply
    filled: the failure must empty it, not leave that reply to publish.
    ``other_slot``: layer 2 consumes into another slot than the one layer 3
    selected (and rank 0 publishes), which fails the reply."""
    speculator, _ = make_speculator(reference_server.address, probabilistic)
    strategy = _deferred(speculator, outstanding)
    runner = _runner(make_runner, speculator)
    extension = _extension(speculator)
    published = _record_publish(extension, monkeypatch)
    # Good replies in every staging slot; the failing step reuses the first.
    for step in range(NUM_STAGING_SLOTS):
        _sample_tokens(runner, step_batch(["a", "b"], 10 + (K + 1) * step), step)
        runner.execute_model(scheduler_output(set(), []))
    cache = extension.draft_logits.clone()
    assert not (cache[SLOTS] == FILL).all()
    assert not any(s.stale for s in speculator.plan.retained.values())

    if failure == "reply_thread":

        def broken(step: Any) -> None:
            raise RuntimeError("reply thread crashed")

        monkeypatch.setattr(speculator, "exchange", broken)
    elif failure == "other_slot":
        select = extension.select_staging

        def select_other(index: int) -> None:
            select((index + 1) % NUM_STAGING_SLOTS)

        monkeypatch.setattr(extension, "select_staging", select_other)
    else:
        _fail_consume(extension, monkeypatch)
    failing = NUM_STAGING_SLOTS
    _sample_tokens(runner, step_batch(["a", "b"], 10 + (K + 1) * failing), failing)
    assert strategy.pending
    worker = threading.Thread(
        target=runner.execute_model,
        args=(scheduler_output(set(), []),),
        daemon=True,
    )
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "a failed reply did not release the gate"
    assert (runner.req_states.draft_tokens.data[SLOTS] == -1).all()
    assert torch.equal(extension.draft_logits, cache)
    if outstanding:
        # The selected staging, emptied by the reply thread: no sample position.
        assert (published[-1].rows.positions.numpy() == -1).all()
    else:
        assert published[-1] is None
    assert all(speculator.plan.retained[r].stale for r in ("a", "b"))
