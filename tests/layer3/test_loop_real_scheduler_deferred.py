# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deferred resolution driven by vLLM's real async scheduler (CPU).

Layer 1's ``SchedulerLoop`` (``k3_sched_loop``: upstream's ``AsyncScheduler``
with the engine core's batch queue of two, the v2 runner's host bookkeeping,
a real draft server process) with the runner's deferred resolution
(``VLLM_K3_DRAFT_DEFERRED_RESOLVE=1``, ``DeferredMixin``): before the
forward of each step the runner calls ``select_step`` and ``propose`` starts
the reply on the reply thread and returns at once; the next ``execute``
calls ``consume`` first, which stores the drafts (``store_draft_tokens``)
before finished and preempted requests free their slots and new requests
take them, as ``GPUModelRunner.execute_model`` does. On CPU the reply gate
parks no stream: ``consume`` waits on the host for the reply.

The checks are layer 1's and layer 2's, applied to the drafts as ``consume``
stores them: greedy, every draft row is -1 or the server engine's draft for
the request's exact committed context and outputs equal target-only
decoding; probabilistic (``LogitsRunner``, also with the reply reported
outstanding so that rank 0 publishes the staging slot layer 3 selected, as on
CUDA), every draft is the Gumbel draw from its reply's wire logits and every
verified slot reads that reply's wire row.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from k3_l2_sched_loop import LogitsRunner
from k3_sched_loop import (
    BLOCK,
    HostRunner,
    Spec,
    prompt_tokens,
    run_in_order,
    run_random_schedule,
)

from vllm.k3_draft import stream_gate
from vllm.k3_draft.deferred import install_deferred_resolution
from vllm.k3_draft.protocol import MAX_REQUEST_ID_CHARS

pytest_plugins = ("conftest_client", "k3_sched_loop", "k3_l2_sched_loop")

TOPK = 16


class _Outstanding(stream_gate.ReplyGate):
    """A host-blocking reply gate that reports the reply as outstanding when
    ``consume`` asks: rank 0 publishes the selected staging slot, as on CUDA
    when the stream is parked before the reply arrived."""

    @property
    def delivered(self) -> bool:
        return False


class DeferredMixin:
    """A ``HostRunner`` whose steps resolve their drafts deferred, in the
    order of ``GPUModelRunner`` (module docstring)."""

    # What ``select_step`` reads of the runner: no PCP, no verification
    # capacity manager, no pipeline parallelism.
    pcp_manager = None
    adaptive_verification = None
    pp_handler = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        runner: Any = self
        strategy = install_deferred_resolution(runner.spec)
        assert strategy is not None and strategy.deferrable
        strategy.warmed = True  # the worker's kernel warm-up ran
        self.deferred = strategy
        self.scheduler_config = runner.spec.vllm_config.scheduler_config
        self._pending_batch: tuple[list[str], Any] | None = None
        self.deferred_steps = 0
        self.immediate_steps = 0

    def report_outstanding(self) -> None:
        for slot in self.deferred._slots:
            slot.reply = _Outstanding(None)

    def execute(self, so: Any) -> Any:
        # The previous step's reply, before finished requests free their
        # slots and new requests take them.
        self.deferred.consume(self._store_pending)
        return super().execute(so)  # type: ignore[misc]

    def before_propose(self, input_batch: Any) -> None:
        super().before_propose(input_batch)  # type: ignore[misc]
        self.deferred.select_step(self, input_batch)  # type: ignore[arg-type]

    def store(self, req_ids: list[str], idx_np: Any, drafts: Any, k: int) -> None:
        if self.deferred.pending:
            # Stored by the next execute's consume.
            assert self._pending_batch is None
            self._pending_batch = (req_ids, idx_np)
            self.deferred_steps += 1
            return
        self.immediate_steps += 1
        super().store(req_ids, idx_np, drafts, k)  # type: ignore[misc]

    def _store_pending(self, input_batch: Any, drafts: torch.Tensor, k: int) -> None:
        assert self._pending_batch is not None
        req_ids, idx_np = self._pending_batch
        self._pending_batch = None
        assert list(input_batch.req_ids) == req_ids
        super().store(req_ids, idx_np, drafts.clone(), k)  # type: ignore[misc]

    def drain(self) -> None:
        """Consume the last step's reply (checks its drafts)."""
        self.deferred.consume(self._store_pending)


class DeferredRunner(DeferredMixin, HostRunner):
    pass


class DeferredLogitsRunner(DeferredMixin, LogitsRunner):
    pass


@pytest.fixture(autouse=True)
def deferred_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_K3_DRAFT_DEFERRED_RESOLVE", "1")


def _preemption_prefix_hits_stops_and_aborts(
    loop: Any, temperature: float, deferred: bool = True
) -> None:
    """A KV cache too small for every running request, shared prefixes and a
    repeated prompt (prefix-cache hits), a stop token inside an accepted
    block, aborts mid-run, a request the protocol cannot carry; outputs are
    checked by the loop."""
    shared = prompt_tokens(99, 40)
    specs: dict[str, Spec] = {
        "dup0": Spec(prompt_tokens(500, 2 * BLOCK + 1), 12, temperature=temperature)
    }
    specs["dup1"] = Spec(specs["dup0"].prompt, 12, temperature=temperature, seed=1)
    for i in range(8):
        prompt = (
            shared + prompt_tokens(200 + i, 3 + 5 * i)
            if i % 2
            else prompt_tokens(300 + i, 30)
        )
        t = 0.0 if i % 3 == 2 else temperature
        specs[f"p{i}"] = Spec(prompt, 20 + 4 * i, temperature=t, seed=i or None)
    stop_prompt = prompt_tokens(400, 25)
    ninth = loop.target.generate(stop_prompt, 9)[-1]
    specs["stop"] = Spec(stop_prompt, 40, [ninth], temperature=temperature, seed=3)
    # An id longer than the protocol carries: no reply ever covers its row.
    specs["x" * (MAX_REQUEST_ID_CHARS + 1)] = Spec(
        prompt_tokens(20, 30), 30, temperature=temperature
    )
    assert run_in_order(loop, specs, late="dup1", abort=("p5", "p6"))
    loop.runner.drain()
    stats = loop.runner.stats
    assert stats.drafted > 0 and stats.accepted > 0 and stats.rejected > 0
    assert stats.preemptions > 0 and stats.prefix_hits > 0
    assert stats.padded_prefills > 0 and stats.cut_in_block > 0
    runner = loop.runner
    if deferred:
        assert runner.deferred_steps > runner.immediate_steps == 0
    else:
        assert runner.immediate_steps > runner.deferred_steps == 0


def _random_schedule(loop: Any, seed: int, temperatures: tuple[float, ...]) -> None:
    """``run_random_schedule`` over a KV cache that preempts, on three
    prefixes of ``seed``'s."""
    rng = random.Random(seed)
    prefixes = [
        prompt_tokens(600 + seed * 10 + i, rng.randrange(8, 40)) for i in range(3)
    ]
    run_random_schedule(loop, rng, prefixes, temperatures)
    loop.runner.drain()
    stats = loop.runner.stats
    assert stats.drafted > 0 and stats.accepted > 0 and stats.preemptions > 0
    assert loop.runner.deferred_steps > loop.runner.immediate_steps == 0


def test_deferred_greedy_preemption_prefix_hits_stops_and_aborts_match_target(
    make_loop,
):
    loop = make_loop(True, num_blocks=24, runner_cls=DeferredRunner)
    _preemption_prefix_hits_stops_and_aborts(loop, 0.0)


def test_deferred_greedy_random_schedule_matches_target(make_loop):
    loop = make_loop(
        True, num_blocks=12, max_num_batched_tokens=48, runner_cls=DeferredRunner
    )
    _random_schedule(loop, 3, (0.0,))


@pytest.mark.parametrize(
    "topk, outstanding",
    [(0, False), (TOPK, True)],
    ids=["full", f"top{TOPK}-outstanding"],
)
def test_deferred_sampling_preemption_prefix_hits_stops_and_aborts_verify_the_wire_rows(
    make_logits_loop, topk, outstanding
):
    loop = make_logits_loop(True, topk, num_blocks=20, runner_cls=DeferredLogitsRunner)
    if outstanding:
        loop.runner.report_outstanding()
    _preemption_prefix_hits_stops_and_aborts(loop, 0.1)
    assert loop.runner.counts["verified_slots"] > 0


@pytest.mark.parametrize(
    "topk, outstanding",
    [(TOPK, False), (0, True)],
    ids=[f"top{TOPK}", "full-outstanding"],
)
def test_deferred_sampling_random_schedule_verifies_the_wire_rows(
    make_logits_loop, topk, outstanding
):
    loop = make_logits_loop(
        True,
        topk,
        num_blocks=12,
        max_num_batched_tokens=48,
        runner_cls=DeferredLogitsRunner,
    )
    if outstanding:
        loop.runner.report_outstanding()
    _random_schedule(loop, 4, (0.0, 0.02, 0.1, 1.0))
    assert loop.runner.counts["verified_slots"] > 0


def test_under_sync_scheduling_every_step_resolves_at_once_and_matches_target(
    make_loop,
):
    """The synchronous scheduler reads the drafts on the host right after
    each step: with the switch on, no step defers, and drafts and outputs
    stay exact."""
    loop = make_loop(False, num_blocks=24, runner_cls=DeferredRunner)
    _preemption_prefix_hits_stops_and_aborts(loop, 0.0, deferred=False)
