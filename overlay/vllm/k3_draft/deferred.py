# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deferred resolution of the remote draft reply (layer 3).

``DeferredResolution`` is a ``ResolutionStrategy`` of
``RemoteK3DSparkSpeculator``. For a step the runner found eligible
(``synchronous_reason`` is None), ``resolve`` returns at once: rank 0 runs the
speculator's ``exchange`` on a reply thread that fills pinned staging memory,
and every rank records the pending proposal. The next ``execute_model`` calls
``consume`` before any request slot is freed or reused: rank 0 parks its
stream behind a ``ReplyGate`` (CUDA: a ``stream_gate.StreamGate``), then every
rank enqueues, in the same order, the copy from staging, the TP broadcast and
the runner's store of the draft tokens and their output copy. The host never
waits for the reply.

Two staging slots alternate; a slot is reused only after its proposal was
consumed and its reply thread returned. A failing reply stages no draft (-1)
for the whole step, still releases the gate, and marks the step's requests
stale in the plan (layer 1's fail-closed path: FREE and cold bootstrap).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm import envs
from vllm.k3_draft.plan import NO_DRAFT
from vllm.k3_draft.stream_gate import ReplyGate, StreamGate
from vllm.logger import init_logger
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    ImmediateResolution,
    RemoteK3DSparkSpeculator,
    RemoteStep,
)

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

logger = init_logger(__name__)

NUM_STAGING_SLOTS = 2


def synchronous_reason(
    *,
    warmed: bool,
    capturing: bool,
    prefill_context_parallel: bool,
    capacity_manager: bool,
    host_copy_required: bool,
    pipeline_parallel: bool,
    extensions: bool,
) -> str | None:
    """Why a step must resolve its draft synchronously (None: it may defer).

    Every input is the same on every TP rank, so every rank picks the same
    path. ``warmed``: the runner's warm-up ran (synchronously) every kernel a
    step may enqueue behind a parked stream. ``prefill_context_parallel`` and
    ``capacity_manager`` read the draft tokens before attention metadata is
    built (input ids not combined late);
    ``host_copy_required``: the scheduler reads the draft ids on the host
    right after the step (structured outputs, synchronous scheduling);
    ``extensions``: a ``ProposeExtension`` publishes host payloads that
    cannot be staged behind the gate.
    """
    reasons = (
        (not warmed, "kernels not warmed up"),
        (capturing, "CUDA graph capture"),
        (prefill_context_parallel, "prefill context parallelism"),
        (capacity_manager, "verification-capacity manager"),
        (host_copy_required, "host copy of the draft required"),
        (pipeline_parallel, "pipeline parallelism"),
        (extensions, "propose extensions"),
    )
    return next((reason for applies, reason in reasons if applies), None)


@dataclass
class _Slot:
    """Rank 0's staging of one deferred reply."""

    tokens: torch.Tensor
    reply: ReplyGate
    done: Future[None] | None = None


@dataclass
class _Pending:
    step: RemoteStep
    slot: _Slot | None


class DeferredResolution(ImmediateResolution):
    """Resolves eligible steps on the next ``execute_model`` (module doc);
    the others like ``ImmediateResolution``."""

    def __init__(self, speculator: RemoteK3DSparkSpeculator) -> None:
        self.speculator = speculator
        # Set by the worker once its warm-up steps ran (synchronously).
        self.warmed = False
        self._defer_next = False
        self._pending: _Pending | None = None
        self._slots: list[_Slot] = []
        self._next_slot = 0
        self._executor: ThreadPoolExecutor | None = None
        if speculator.plan is None:
            return
        cuda = speculator.device.type == "cuda"
        shape = (speculator.max_num_reqs, speculator.num_speculative_steps)
        self._slots = [
            _Slot(
                torch.full(shape, NO_DRAFT, dtype=torch.int64, pin_memory=cuda),
                ReplyGate(StreamGate() if cuda else None),
            )
            for _ in range(NUM_STAGING_SLOTS)
        ]
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="k3-draft-reply")

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def select_step(self, runner: GPUModelRunner, input_batch: InputBatch) -> None:
        """Runner, before ``propose``: defer this step if it is eligible."""
        device = self.speculator.device
        reason = synchronous_reason(
            warmed=self.warmed,
            capturing=device.type == "cuda"
            and torch.cuda.is_current_stream_capturing(),
            prefill_context_parallel=runner.pcp_manager is not None,
            capacity_manager=runner.adaptive_verification is not None,
            host_copy_required=input_batch.has_structured_output_reqs
            or not runner.scheduler_config.async_scheduling,
            pipeline_parallel=runner.pp_handler is not None,
            extensions=bool(self.speculator.extensions),
        )
        self._defer_next = reason is None

    def resolve(
        self, speculator: RemoteK3DSparkSpeculator, step: RemoteStep
    ) -> torch.Tensor:
        assert self._pending is None, "a pending draft reply was not consumed"
        defer, self._defer_next = self._defer_next, False
        if not defer:
            return super().resolve(speculator, step)
        slot = None
        if self._slots:
            slot = self._slots[self._next_slot]
            self._next_slot = (self._next_slot + 1) % NUM_STAGING_SLOTS
            if slot.done is not None:
                slot.done.result()
            slot.reply.reset()
            assert self._executor is not None
            slot.done = self._executor.submit(
                slot.reply.deliver,
                lambda: self._fill(step, slot),
                lambda exc: self._fail(step, slot, exc),
            )
        self._pending = _Pending(step, slot)
        return speculator.draft_tokens[: step.num_reqs]

    def consume(self, store: Callable[[InputBatch, torch.Tensor, int], None]) -> None:
        """Every rank, before request slots are freed or reused: enqueue the
        pending reply (gate, staging copy, broadcast), then ``store(input_batch,
        drafts, num_speculative_tokens)`` of its step. No-op without one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step = pending.step
        drafts = self.speculator.draft_tokens[: step.num_reqs]
        if pending.slot is not None:
            pending.slot.reply.wait()
            drafts.copy_(pending.slot.tokens[: step.num_reqs], non_blocking=True)
        self.speculator.tp_group.broadcast(drafts, src=0)
        store(step.input_batch, drafts, step.num_speculative_tokens)

    # ------------------------------------------------ reply thread (rank 0)

    def _fill(self, step: RemoteStep, slot: _Slot) -> None:
        staged = slot.tokens[: step.num_reqs]
        staged.fill_(NO_DRAFT)
        result = self.speculator.exchange(step)
        if result is not None:
            width = result.tokens.shape[1]
            staged[:, :width].copy_(torch.from_numpy(result.tokens))

    def _fail(self, step: RemoteStep, slot: _Slot, exc: BaseException) -> None:
        slot.tokens[: step.num_reqs].fill_(NO_DRAFT)
        plan = self.speculator.plan
        request_ids = [] if step.staged is None else step.staged.request_ids
        logger.warning(
            "Deferred draft reply failed (%r); no drafts for %d requests",
            exc,
            len(request_ids),
        )
        if plan is None:
            return
        for request_id in request_ids:
            state = plan.retained.get(request_id)
            if state is not None:
                state.stale = True


def install_deferred_resolution(speculator: object) -> DeferredResolution | None:
    """Make ``speculator`` resolve deferred if it is remote and
    ``VLLM_K3_DRAFT_DEFERRED_RESOLVE`` is on; the strategy, else None."""
    if not (
        isinstance(speculator, RemoteK3DSparkSpeculator)
        and envs.VLLM_K3_DRAFT_DEFERRED_RESOLVE
    ):
        return None
    strategy = DeferredResolution(speculator)
    speculator.resolution = strategy
    return strategy
