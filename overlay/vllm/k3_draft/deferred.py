# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deferred resolution of the remote draft reply (layer 3).

``DeferredResolution`` is a ``ResolutionStrategy`` of
``RemoteK3DSparkSpeculator``. For a step the runner found eligible
(``synchronous_reason`` is None), ``resolve`` returns at once: rank 0 runs the
speculator's ``exchange`` on a reply thread that fills pinned staging memory
(the draft tokens here; each ``ProposeExtension``'s ``consume`` fills its own
staging, e.g. layer 2's logits and sample positions), and every rank records
the pending proposal. The next ``execute_model`` calls ``consume`` before any
request slot is freed or reused: rank 0 parks its stream behind a
``ReplyGate`` (CUDA: a ``stream_gate.StreamGate``), then every rank enqueues,
in the same order, behind the gate:

1. the copy of the draft tokens from staging (rank 0);
2. their TP broadcast from rank 0;
3. the ``publish`` of each extension the step asks for, in registration
   order (layer 2: copy of its staging, broadcasts, top-k scatter, masked
   Gumbel sampling that rewrites the draft tokens and the draft-logits
   cache);
4. the runner's store of the draft tokens into the request state, the input
   ids and their output copy.

That is the order of ``ImmediateResolution`` (``speculator.publish``), so
deferred and immediate resolution give the same draft state.

Two staging slots alternate; a slot is reused only after its proposal was
consumed and its reply thread returned. Its draft tokens need no copy event
before they are refilled: the device copy that read them precedes, on the
same stream, the staged inputs of the next deferred step (a proposal is
consumed before the next is resolved), and that step's reply thread waits for
those inputs (``exchange``) before the refilling one starts (replies run one
at a time, in order).

Rank 0 enqueues an extension's ``publish`` before its reply may have
arrived, so it must know at enqueue time which staging the reply thread's
``consume`` will fill: layer 3 drives that choice (``_ExtensionStaging``). An
extension is deferral-safe when it declares ``deferral_safe`` and offers that
choice (``DeferrableExtension``; layer 2's ``RemoteDraftLogits`` does); any
other extension keeps the synchronous path.

The reply thread needs the GIL between its blocking calls while the runner's
Python prepares the next step; CPython hands it over only after its switch
interval (5 ms by default), so rank 0 lowers the process's switch interval to
``VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US`` (never raises it) when it first
defers a reply. Its work up to the PROPOSE leaving (plan, context rows,
header) lies on the reply's critical path, and sharing the GIL with the
runner would take it about twice as long: so ``consume`` on rank 0, once the
step's staged inputs are on the host (the reply thread can run), waits until
the reply thread has sent its first request of the step or finished, then
prepares the next step while the reply thread only waits for the server.
Where the stream gate cannot be built (no CUDA runtime, as on ROCm) replies
resolve synchronously.

A failing reply (exchange raises, the PROPOSE fails, or an extension's
``consume`` raises ``ProtocolError``) stages no draft (-1) for the whole step,
empties every extension's staging of the slot, still releases the gate, and
marks the step's requests stale in the plan (layer 1's fail-closed path: FREE
and cold bootstrap). Rank 0 publishes ``None`` when the failure is known at
enqueue time, else the emptied staging (same device effect: no sample
position, no draft, cache rows untouched).
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from vllm import envs
from vllm.k3_draft.plan import (
    FAILURE_LOG_INTERVAL_S,
    NO_DRAFT,
    FailureLog,
    ProposeExtension,
)
from vllm.k3_draft.protocol import ProtocolError
from vllm.k3_draft.stream_gate import ReplyGate, StreamGate, require_runtime
from vllm.logger import init_logger
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    ImmediateResolution,
    PublishContext,
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
    ``extensions``: a ``ProposeExtension`` that is not deferral-safe (see
    ``extension_staging``) is enabled.
    """
    reasons = (
        (not warmed, "kernels not warmed up"),
        (capturing, "CUDA graph capture"),
        (prefill_context_parallel, "prefill context parallelism"),
        (capacity_manager, "verification-capacity manager"),
        (host_copy_required, "host copy of the draft required"),
        (pipeline_parallel, "pipeline parallelism"),
        (extensions, "propose extensions that are not deferral-safe"),
    )
    return next((reason for applies, reason in reasons if applies), None)


@runtime_checkable
class DeferrableExtension(Protocol):
    """What a ``ProposeExtension`` offers to be published behind the gate.

    Staging slots are numbered. Rank 0's stream owner calls
    ``prepare_staging(i)`` before it starts the reply thread that fills slot
    ``i``: it waits for any device copy still reading the slot. The reply
    thread calls ``select_staging(i)`` before the step's RPCs, so that
    ``consume`` fills slot ``i`` and returns ``staged_payload(i)``;
    ``clear_staging(i)`` makes slot ``i`` publish no draft (failed or absent
    reply). Neither waits for a device copy: ``staged_payload(i)`` is handed
    to ``publish`` on rank 0 while the reply is still outstanding, and the
    copy it enqueues runs behind the gate that only the reply thread
    releases, after it filled or cleared the slot."""

    deferral_safe: bool

    def prepare_staging(self, index: int) -> None: ...

    def select_staging(self, index: int) -> None: ...

    def staged_payload(self, index: int) -> Any: ...

    def clear_staging(self, index: int) -> None: ...


class _ExtensionStaging:
    """Layer 3's handle on one deferral-safe extension's staging slots."""

    def __init__(self, extension: ProposeExtension) -> None:
        self.extension = extension
        self.capability = extension.capability

    def prepare(self, index: int) -> None:
        assert isinstance(self.extension, DeferrableExtension)
        self.extension.prepare_staging(index)

    def select(self, index: int) -> None:
        assert isinstance(self.extension, DeferrableExtension)
        self.extension.select_staging(index)

    def staged(self, index: int) -> Any:
        assert isinstance(self.extension, DeferrableExtension)
        return self.extension.staged_payload(index)

    def clear(self, index: int) -> None:
        assert isinstance(self.extension, DeferrableExtension)
        self.extension.clear_staging(index)


def extension_staging(extension: ProposeExtension) -> _ExtensionStaging | None:
    """The staging handle of a deferral-safe ``extension``, else None."""
    if getattr(extension, "deferral_safe", False) and isinstance(
        extension, DeferrableExtension
    ):
        return _ExtensionStaging(extension)
    return None


_Job = tuple[Future[None], Callable[[], None]]


def _run_job(done: Future[None], job: Callable[[], None]) -> None:
    if not done.set_running_or_notify_cancel():
        return
    try:
        job()
    except BaseException as exc:
        done.set_exception(exc)
    else:
        done.set_result(None)


def _run_jobs(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (item := jobs.get()) is not None:
        _run_job(*item)
        # Hold no job while waiting: it may keep the worker's owner alive.
        del item


class _ReplyWorker:
    """One daemon thread that runs the submitted jobs in order. Interpreter
    exit never waits for it: a pending reply is abandoned (its stream, if
    parked, is gone with the process)."""

    def __init__(self) -> None:
        jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._jobs = jobs
        threading.Thread(
            target=_run_jobs, args=(jobs,), name="k3-draft-reply", daemon=True
        ).start()
        # The thread ends once this worker is garbage.
        weakref.finalize(self, jobs.put, None)

    def submit(self, job: Callable[[], None]) -> Future[None]:
        """Queue ``job``; the future completes when it returned or raised."""
        done: Future[None] = Future()
        self._jobs.put((done, job))
        return done


@dataclass
class _Slot:
    """Rank 0's staging of one deferred reply: the draft tokens here, the
    extensions' payloads in their own staging slot ``index``."""

    index: int
    tokens: torch.Tensor
    reply: ReplyGate
    done: Future[None] | None = None
    # By capability, set by the reply thread for a reply that arrived whole.
    payloads: dict[str, Any] = field(default_factory=dict)
    # ``tokens`` for the reply thread: numpy writes never release the GIL,
    # whose every retake waits while the runner's Python holds it.
    host_tokens: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.host_tokens = self.tokens.numpy()


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
        self._worker: _ReplyWorker | None = None
        self._switch_interval_us = envs.VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US
        self._failures = FailureLog(FAILURE_LOG_INTERVAL_S)
        # Same on every rank (the extensions are built from the same config).
        handles = [extension_staging(e) for e in speculator.extensions]
        self.deferrable = all(handle is not None for handle in handles)
        self._staging = [handle for handle in handles if handle is not None]
        cuda = speculator.device.type == "cuda"
        if cuda:
            # On every rank, planning or not, so that all fall back alike.
            require_runtime()
        if speculator.plan is None:
            return
        gates = [
            ReplyGate(StreamGate() if cuda else None) for _ in range(NUM_STAGING_SLOTS)
        ]
        shape = (speculator.max_num_reqs, speculator.num_speculative_steps)
        self._slots = [
            _Slot(
                index,
                torch.full(shape, NO_DRAFT, dtype=torch.int64, pin_memory=cuda),
                gate,
            )
            for index, gate in enumerate(gates)
        ]
        self._worker = _ReplyWorker()

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
            extensions=not self.deferrable,
        )
        self._defer_next = reason is None

    def resolve(
        self, speculator: RemoteK3DSparkSpeculator, step: RemoteStep
    ) -> torch.Tensor:
        assert self._pending is None, "a pending draft reply was not consumed"
        defer, self._defer_next = self._defer_next, False
        if not defer:
            # The plan runs on one thread at a time, in step order.
            self._drain()
            return super().resolve(speculator, step)
        slot = None
        if self._slots:
            # Only a process that defers pays for the shorter interval.
            lower_switch_interval(self._switch_interval_us)
            slot = self._slots[self._next_slot]
            self._next_slot = (self._next_slot + 1) % NUM_STAGING_SLOTS
            if slot.done is not None:
                slot.done.result()
            for handle in self._staging:
                handle.prepare(slot.index)
            slot.reply.reset()
            assert self._worker is not None
            slot.done = self._worker.submit(lambda: self._reply(step, slot))
        self._pending = _Pending(step, slot)
        return speculator.draft_tokens[: step.num_reqs]

    def _drain(self) -> None:
        """Wait for every reply thread (rank 0; they never wait for us)."""
        for slot in self._slots:
            if slot.done is not None:
                slot.done.result()

    def consume(self, store: Callable[[InputBatch, torch.Tensor, int], None]) -> None:
        """Every rank, before request slots are freed or reused: enqueue the
        pending reply (gate, staging copy, broadcast, each extension's
        ``publish``), then ``store(input_batch, drafts, num_speculative_tokens)``
        of its step. No-op without one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step = pending.step
        drafts = self.speculator.draft_tokens[: step.num_reqs]
        slot = pending.slot
        if slot is not None:
            event = step.staged.event if step.staged is not None else None
            if event is None or event.query():
                # The reply thread can run: its send goes first (module doc).
                slot.reply.wait_sent()
            slot.reply.wait()
            drafts.copy_(slot.tokens[: step.num_reqs], non_blocking=True)
        self.speculator.tp_group.broadcast(drafts, src=0)
        context = PublishContext(step, drafts)
        for extension, handle in zip(self.speculator.extensions, self._staging):
            if extension not in step.extensions:
                continue
            payload = None
            if slot is not None:
                if slot.reply.delivered:
                    # Known now: the consumed payload, None when it failed.
                    payload = slot.payloads.get(handle.capability)
                else:
                    # Still outstanding: the staging the reply thread fills
                    # (or empties) before it releases the gate.
                    payload = handle.staged(slot.index)
            extension.publish(payload, context)
        store(step.input_batch, drafts, step.num_speculative_tokens)

    # ------------------------------------------------ reply thread (rank 0)

    def _reply(self, step: RemoteStep, slot: _Slot) -> None:
        """Deliver ``step``'s reply into ``slot``, marking it sent once the
        first request of the step is on its way."""
        assert self.speculator.plan is not None
        with self.speculator.plan.client.reporting_sent(slot.reply.mark_sent):
            slot.reply.deliver(
                lambda: self._fill(step, slot),
                lambda exc: self._fail(step, slot, exc),
            )

    def _fill(self, step: RemoteStep, slot: _Slot) -> None:
        staged = slot.host_tokens[: step.num_reqs]
        staged.fill(NO_DRAFT)
        slot.payloads = {}
        for handle in self._staging:
            handle.select(slot.index)
        result = self.speculator.exchange(step)
        payloads = {} if result is None else result.payloads
        for handle in self._staging:
            payload = payloads.get(handle.capability)
            if payload is None:
                # No reply for it (failed PROPOSE, nothing sent): no draft.
                handle.clear(slot.index)
            elif payload is not handle.staged(slot.index):
                raise ProtocolError(
                    f"{handle.capability} consumed into another staging slot "
                    f"than slot {slot.index} that its publish reads"
                )
        if result is not None:
            staged[:, : result.tokens.shape[1]] = result.tokens
        slot.payloads = dict(payloads)

    def _fail(self, step: RemoteStep, slot: _Slot, exc: BaseException) -> None:
        slot.host_tokens[: step.num_reqs].fill(NO_DRAFT)
        slot.payloads = {}
        for handle in self._staging:
            try:
                handle.clear(slot.index)
            except Exception:
                logger.exception("Clearing %s staging failed", handle.capability)
        plan = self.speculator.plan
        request_ids = [] if step.staged is None else step.staged.request_ids
        # A failure that recurs every step is logged once an interval.
        suffix = self._failures.admit(type(exc).__name__)
        if suffix is not None:
            logger.warning(
                "Deferred draft reply failed (%r); no drafts for %d requests%s",
                exc,
                len(request_ids),
                suffix,
                # A protocol failure is the server's; anything else a bug here.
                exc_info=None if isinstance(exc, ProtocolError) else exc,
            )
        if plan is None:
            return
        for request_id in request_ids:
            state = plan.retained.get(request_id)
            if state is not None:
                state.stale = True


def lower_switch_interval(interval_us: int) -> None:
    """Make the interpreter switch interval at most ``interval_us`` (0: keep)."""
    if interval_us and sys.getswitchinterval() > interval_us / 1e6:
        sys.setswitchinterval(interval_us / 1e6)
        logger.info(
            "Interpreter switch interval lowered to %d us for the draft reply "
            "thread (VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US)",
            interval_us,
        )


def install_deferred_resolution(speculator: object) -> DeferredResolution | None:
    """Make ``speculator`` resolve deferred if it is remote and
    ``VLLM_K3_DRAFT_DEFERRED_RESOLVE`` is on; the strategy, else None."""
    if not (
        isinstance(speculator, RemoteK3DSparkSpeculator)
        and envs.VLLM_K3_DRAFT_DEFERRED_RESOLVE
    ):
        return None
    try:
        strategy = DeferredResolution(speculator)
    except OSError as exc:
        # The stream gate needs CUDA's runtime (not on ROCm, say).
        logger.warning(
            "Deferred draft resolution is unavailable (%s); resolving draft "
            "replies synchronously",
            exc,
        )
        return None
    speculator.resolution = strategy
    return strategy


def kernels_warmed_up(model_runner: object, ran: bool) -> None:
    """Worker, after its kernel warm-up (``ran``) or instead of one: steps of
    ``model_runner`` may defer only once every kernel of a step has run, so
    without the warm-up (``enforce_eager`` turns it off) every draft reply
    resolves synchronously, which is said once here."""
    strategy = getattr(model_runner, "k3_deferred", None)
    if strategy is None:
        return
    if ran:
        strategy.warmed = True
        return
    logger.warning(
        "Deferred draft resolution stays off: the kernel warm-up did not run "
        "(enforce_eager or kernel_config.enable_jit_warmup=False), so draft "
        "replies resolve synchronously"
    )
