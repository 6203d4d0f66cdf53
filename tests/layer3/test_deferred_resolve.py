# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deferred resolution on CPU (layer 3): the eligibility table, the gate
protocol with a recording gate, ordering over the real
``GPUModelRunner.sample_tokens`` / ``execute_model`` / ``store_draft_tokens``
and the worker's warm-up (``k3_l3_runner``) with a real
``RemoteK3DSparkSpeculator`` (scripted ZeroMQ server), failure, and
deferred == immediate draft state against a real reference draft server.

On CPU the reply gate has no stream to park, so ``consume`` waits on the host
for the reply; the order of everything else is the runner's own."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from k3_l3_runner import sample_tokens, scheduler_output
from toy_target import HIDDEN, NUM_AUX, make_input_batch

from vllm import envs
from vllm.k3_draft import protocol, stream_gate
from vllm.k3_draft.deferred import (
    DeferredResolution,
    install_deferred_resolution,
    synchronous_reason,
)
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    ImmediateResolution,
)

pytest_plugins = ("conftest_client",)

K = 3
ELIGIBLE = dict(
    warmed=True,
    capturing=False,
    prefill_context_parallel=False,
    capacity_manager=False,
    host_copy_required=False,
    pipeline_parallel=False,
    extensions=False,
)


# ------------------------------------------------------------ eligibility


def test_an_eligible_step_defers():
    assert synchronous_reason(**ELIGIBLE) is None


@pytest.mark.parametrize(
    "flag, value",
    [
        ("warmed", False),
        ("capturing", True),
        ("prefill_context_parallel", True),
        ("capacity_manager", True),
        ("host_copy_required", True),
        ("pipeline_parallel", True),
        ("extensions", True),
    ],
)
def test_each_listed_case_resolves_synchronously(flag, value):
    assert synchronous_reason(**{**ELIGIBLE, flag: value}) is not None


def _runner_view(**overrides: Any) -> Any:
    view = dict(
        pcp_manager=None,
        adaptive_verification=None,
        pp_handler=None,
        scheduler_config=SimpleNamespace(async_scheduling=True),
    )
    return SimpleNamespace(**{**view, **overrides})


@pytest.mark.parametrize(
    "runner, structured, deferred",
    [
        (_runner_view(), False, True),
        (_runner_view(pcp_manager=object()), False, False),
        (_runner_view(adaptive_verification=object()), False, False),
        (_runner_view(pp_handler=object()), False, False),
        (_runner_view(), True, False),
        (
            _runner_view(scheduler_config=SimpleNamespace(async_scheduling=False)),
            False,
            False,
        ),
    ],
)
def test_select_step_reads_the_runner(
    make_speculator, scripted_server, runner, structured, deferred
):
    speculator, _ = make_speculator(scripted_server.address)
    strategy = install_deferred_resolution(speculator)
    assert strategy is not None
    strategy.warmed = True
    batch = _batch(["a", "b"], [3, 5])
    batch.has_structured_output_reqs = structured
    strategy.select_step(runner, batch)
    _propose(speculator, batch)
    assert strategy.pending is deferred
    strategy.consume(lambda *args: None)


def test_a_step_under_cuda_graph_capture_resolves_synchronously(
    make_speculator, scripted_server, monkeypatch
):
    speculator, _ = make_speculator(scripted_server.address)
    strategy = _deferred(speculator)
    batch = _batch(["a", "b"], [3, 5])
    # The runner selects the step while its CUDA stream is capturing.
    monkeypatch.setattr(speculator, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    strategy.select_step(_runner_view(), batch)
    monkeypatch.setattr(speculator, "device", torch.device("cpu"))
    drafts = _propose(speculator, batch)
    assert not strategy.pending
    assert (drafts == 5).all()


def test_switch_zero_keeps_the_synchronous_path(
    make_speculator, scripted_server, monkeypatch
):
    speculator, _ = make_speculator(scripted_server.address)
    monkeypatch.setenv("VLLM_K3_DRAFT_DEFERRED_RESOLVE", "0")
    assert install_deferred_resolution(speculator) is None
    assert type(speculator.resolution) is ImmediateResolution


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("VLLM_K3_DRAFT_DEFERRED_RESOLVE", "0"),
        ("VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US", "100"),
    ],
)
def test_the_deferral_variables_do_not_change_compile_factors(monkeypatch, name, value):
    """When the reply is resolved, and the switch interval, are host-side:
    no torch.compile cache key depends on them."""
    monkeypatch.delenv(name, raising=False)
    before = envs.compile_factors()
    monkeypatch.setenv(name, value)
    assert envs.compile_factors() == before


def test_switch_other_than_0_or_1_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DRAFT_DEFERRED_RESOLVE", "2")
    with pytest.raises(ValueError, match="VLLM_K3_DRAFT_DEFERRED_RESOLVE"):
        _ = envs.VLLM_K3_DRAFT_DEFERRED_RESOLVE


@pytest.fixture
def switch_interval():
    """The interpreter switch interval, restored after the test."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(saved)


def _defer_one_step(speculator: Any) -> torch.Tensor:
    """One deferred step of request "a", consumed; its draft tokens."""
    strategy = _deferred(speculator)
    strategy.select_step(_runner_view(), _batch(["a"], [3]))
    drafts = _propose(speculator, _batch(["a"], [3]))
    assert strategy.pending
    strategy.consume(lambda *args: None)
    return drafts


def test_a_deferred_reply_lowers_the_switch_interval(
    make_speculator, scripted_server, monkeypatch, switch_interval
):
    monkeypatch.setenv("VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US", "100")
    speculator, _ = make_speculator(scripted_server.address)
    _defer_one_step(speculator)
    assert sys.getswitchinterval() == pytest.approx(100e-6)


def test_by_default_a_deferred_reply_lowers_the_switch_interval_to_50_us(
    make_speculator, scripted_server, monkeypatch, switch_interval
):
    monkeypatch.delenv("VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US", raising=False)
    speculator, _ = make_speculator(scripted_server.address)
    _defer_one_step(speculator)
    assert sys.getswitchinterval() == pytest.approx(50e-6)


def test_switch_interval_is_kept_until_a_reply_is_deferred(
    make_speculator, scripted_server, monkeypatch, switch_interval
):
    monkeypatch.setenv("VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US", "100")
    speculator, _ = make_speculator(scripted_server.address)
    strategy = _deferred(speculator)
    # Steps that resolve synchronously (here: before warm-up) keep it.
    strategy.warmed = False
    strategy.select_step(_runner_view(), _batch(["a"], [3]))
    _propose(speculator, _batch(["a"], [3]))
    assert not strategy.pending
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_switch_interval_zero_keeps_the_interpreter_s(
    make_speculator, scripted_server, monkeypatch, switch_interval
):
    monkeypatch.setenv("VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US", "0")
    speculator, _ = make_speculator(scripted_server.address)
    _defer_one_step(speculator)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_switch_interval_is_never_raised(
    make_speculator, scripted_server, monkeypatch, switch_interval
):
    sys.setswitchinterval(20e-6)
    monkeypatch.setenv("VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US", "100")
    speculator, _ = make_speculator(scripted_server.address)
    _defer_one_step(speculator)
    assert sys.getswitchinterval() == pytest.approx(20e-6)


def test_an_interval_beyond_a_float_is_refused_at_start_up(
    make_speculator, scripted_server, monkeypatch, switch_interval
):
    """Not an OverflowError on the first deferred step, mid-serving."""
    monkeypatch.setenv("VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US", "9" * 400)
    speculator, _ = make_speculator(scripted_server.address)
    with pytest.raises(
        ValueError, match=r"VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US=9+ must be at most"
    ):
        install_deferred_resolution(speculator)


@pytest.fixture
def no_cuda_runtime(monkeypatch):
    """As on ROCm: the device is "cuda" but no CUDA runtime can be loaded."""

    def not_found() -> str:
        raise OSError("libcudart not found (torch's bundled runtime or the system's)")

    monkeypatch.setattr(stream_gate, "_runtime", None)
    monkeypatch.setattr(stream_gate, "_find_cudart", not_found)


def test_without_a_cuda_runtime_replies_resolve_synchronously(
    make_speculator, scripted_server, monkeypatch, no_cuda_runtime
):
    speculator, _ = make_speculator(scripted_server.address)
    monkeypatch.setattr(speculator, "device", torch.device("cuda"))
    assert install_deferred_resolution(speculator) is None
    assert type(speculator.resolution) is ImmediateResolution


def test_without_a_cuda_runtime_a_rank_without_plan_resolves_synchronously(
    make_speculator, scripted_server, monkeypatch, no_cuda_runtime
):
    # A TP rank other than 0 has no plan; it must fall back as rank 0 does,
    # or the ranks post the drafts' broadcasts in different steps.
    speculator, _ = make_speculator(scripted_server.address)
    monkeypatch.setattr(speculator, "device", torch.device("cuda"))
    speculator.plan.client.close()
    monkeypatch.setattr(speculator, "plan", None)
    assert install_deferred_resolution(speculator) is None
    assert type(speculator.resolution) is ImmediateResolution


@pytest.mark.parametrize("value", ["-1", "fast", "0.5"])
def test_malformed_switch_interval_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US", value)
    with pytest.raises(ValueError, match="VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US"):
        _ = envs.VLLM_K3_DRAFT_REPLY_SWITCH_INTERVAL_US


@pytest.mark.parametrize("flag", ["dummy_run", "is_profile"])
def test_dummy_and_profile_runs_never_defer(make_speculator, scripted_server, flag):
    speculator, _ = make_speculator(scripted_server.address)
    strategy = _deferred(speculator)
    strategy.select_step(_runner_view(), _batch(["a"], [3]))
    drafts = _propose(speculator, _batch(["a"], [3]), **{flag: True})
    assert not strategy.pending and (drafts == -1).all()


# ------------------------------------------------------------ reply gate


class RecordingGate:
    """Stands in for ``StreamGate``: records park/release."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def park(self, stream: Any = None) -> None:
        self.events.append("park")

    def release(self) -> None:
        self.events.append("release")


@pytest.mark.parametrize("fails", [False, True])
def test_a_parked_reply_is_released_even_when_it_fails(fails):
    gate = RecordingGate()
    reply = stream_gate.ReplyGate(gate)
    staged: list[int] = []
    reply.wait()
    assert gate.events == ["park"]

    def fill() -> None:
        if fails:
            raise ConnectionError("gone")
        staged.append(7)

    reply.deliver(fill, lambda exc: staged.append(-1))
    assert gate.events == ["park", "release"]
    assert staged == ([-1] if fails else [7])


class FailingParkGate(RecordingGate):
    """A ``StreamGate`` whose ``park`` fails (a CUDA launch error)."""

    def park(self, stream: Any = None) -> None:
        raise RuntimeError("cudaLaunchHostFunc failed with CUDA error 35")


def test_a_reply_whose_park_failed_releases_no_gate():
    """No stream reached the gate, so ``release`` (a barrier wait) would
    block the reply thread forever."""
    gate = FailingParkGate()
    reply = stream_gate.ReplyGate(gate)
    with pytest.raises(RuntimeError, match="cudaLaunchHostFunc"):
        reply.wait()
    reply.deliver(lambda: None, lambda exc: None)
    assert gate.events == []
    assert reply.delivered


def test_a_reply_delivered_before_the_wait_parks_nothing():
    gate = RecordingGate()
    reply = stream_gate.ReplyGate(gate)
    reply.deliver(lambda: None, lambda exc: None)
    reply.wait()
    assert gate.events == []
    reply.reset()
    reply.wait()
    assert gate.events == ["park"]


def test_a_reused_reply_releases_only_a_stream_parked_for_its_own_reply():
    """A staging slot's reply gate over three steps: parked before the reply,
    the reply before the wait, parked again. Each parked step releases once
    and the unparked one releases nothing: ``release`` with no stream parked
    is a barrier wait that never returns, hanging the reply thread."""
    gate = RecordingGate()
    reply = stream_gate.ReplyGate(gate)
    for wait_first in (True, False, True):
        reply.reset()
        before = len(gate.events)
        if wait_first:
            reply.wait()
            reply.deliver(lambda: None, lambda exc: None)
        else:
            reply.deliver(lambda: None, lambda exc: None)
            reply.wait()
        assert gate.events[before:] == (["park", "release"] if wait_first else [])


# ------------------------------------------------------------ helpers


def _batch(req_ids: list[str], slots: list[int], start: int = 10) -> Any:
    n, per = len(req_ids), K + 1
    positions = torch.cat(
        [torch.arange(start + 10 * i, start + 10 * i + per) for i in range(n)]
    )
    return make_input_batch(
        req_ids,
        np.array(slots),
        np.arange(n + 1, dtype=np.int32) * per,
        positions,
        n * per,
    )


def _propose(speculator: Any, batch: Any, **kwargs: Any) -> torch.Tensor:
    n = batch.num_reqs
    rows = batch.num_tokens
    gen = torch.Generator().manual_seed(int(batch.positions[0]))
    aux = [torch.randn(rows, HIDDEN, generator=gen) for _ in range(NUM_AUX)]
    return speculator.propose(
        batch,
        {},
        {},
        aux[0],
        aux,
        torch.ones(n, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int32),
        torch.arange(8, dtype=torch.int64).reshape(8, 1) + 40,
        torch.zeros(1, 8, dtype=torch.int32),
        torch.zeros(8),
        torch.zeros(8, dtype=torch.int64),
        num_speculative_tokens=K,
        **kwargs,
    )


def _runner_of_request_a(
    make_speculator: Any, scripted_server: Any, make_runner: Any
) -> tuple[Any, int, list[tuple]]:
    """A runner whose speculator resolves deferred (not warmed up: every
    step synchronous) with request "a" added; its slot and the runner's log."""
    log: list[tuple] = []
    speculator, _ = make_speculator(scripted_server.address)
    install_deferred_resolution(speculator)
    runner = make_runner(speculator, log, K)
    runner.execute_model(scheduler_output(set(), ["a"]))
    return runner, runner.req_states.req_id_to_index["a"], log


def _deferred(speculator: Any) -> DeferredResolution:
    strategy = install_deferred_resolution(speculator)
    assert strategy is not None
    strategy.warmed = True
    return strategy


def _sample_tokens(runner: GPUModelRunner, batch: Any) -> None:
    """The runner's real ``sample_tokens`` for a step of ``batch``."""
    sample_tokens(runner, batch, K, seed=int(batch.positions[0]))


# ------------------------------------------------------------ ordering


def test_pending_reply_is_stored_before_finish_free_and_add(
    make_speculator, scripted_server, make_runner
):
    log: list[tuple] = []
    speculator, _ = make_speculator(scripted_server.address)
    _deferred(speculator)
    runner = make_runner(speculator, log, K)
    runner.execute_model(scheduler_output(set(), ["old", "keep"]))
    slots = [runner.req_states.req_id_to_index[r] for r in ("old", "keep")]
    batch = _batch(["old", "keep"], slots)
    _sample_tokens(runner, batch)
    assert runner.k3_deferred.pending
    assert not [e for e in log if e[0] in ("store", "output_copy")]

    # "old" finishes and "new" takes its slot in the same step.
    runner.execute_model(scheduler_output({"old"}, ["new"]))
    events = [e for e in log if e[0] != "add" or e[1] == "new"]
    kinds = [e[0] for e in events]
    assert kinds == ["store", "output_copy", "remove", "add"]
    store, _, remove, add = events
    assert store[1] == ["old", "keep"]  # every draft landed in its own slot
    assert remove[1:] == ("old", slots[0]) and add[1:] == ("new", slots[0])
    assert (runner.req_states.draft_tokens.data[slots] == 5).all()


class TwoRankBroadcasts:
    """The TP group of two ranks in one process: rank 0's broadcasts are
    posted and rank 1's receive them in posting order (collectives pair in
    the order each rank posts them). Each broadcast is logged."""

    def __init__(self) -> None:
        self.posted: list[torch.Tensor] = []

    def group(self, rank: int, log: list[tuple]) -> Any:
        def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
            log.append(("broadcast",))
            if rank == 0:
                self.posted.append(tensor.clone())
            elif self.posted:
                tensor.copy_(self.posted.pop(0))
            return tensor

        return SimpleNamespace(rank_in_group=rank, broadcast=broadcast)


def test_a_rank_without_a_plan_defers_in_the_same_order_as_rank_0(
    make_speculator, scripted_server, make_runner, monkeypatch
):
    """A TP rank other than 0 has no plan and no reply to wait for; it still
    records the pending proposal and resolves it (broadcast from rank 0,
    store, output copy) at the next ``execute_model``, as rank 0 does."""
    broadcasts = TwoRankBroadcasts()
    logs: list[list[tuple]] = [[], []]
    runners = []
    for rank in (0, 1):
        speculator, _ = make_speculator(scripted_server.address)
        if rank == 1:
            speculator.plan.client.close()
            monkeypatch.setattr(speculator, "plan", None)
        monkeypatch.setattr(speculator, "tp_group", broadcasts.group(rank, logs[rank]))
        _deferred(speculator)
        runners.append(make_runner(speculator, logs[rank], K))
    for runner in runners:
        runner.execute_model(scheduler_output(set(), ["a", "b"]))
    slots = [runners[0].req_states.req_id_to_index[r] for r in ("a", "b")]

    for runner in runners:
        _sample_tokens(runner, _batch(["a", "b"], slots))
    assert [runner.k3_deferred.pending for runner in runners] == [True, True]
    assert logs[1] == logs[0]

    for runner in runners:
        runner.execute_model(scheduler_output({"a"}, ["c"]))
    kinds = [e[0] for e in logs[1] if e[0] != "add" or e[1] == "c"]
    assert kinds == ["broadcast", "store", "output_copy", "remove", "add"]
    assert logs[1] == logs[0]
    # Rank 0's drafts (the scripted server's 5s) reached rank 1's slots.
    assert (runners[1].req_states.draft_tokens.data[slots] == 5).all()


def test_a_reused_slot_never_receives_the_old_draft(
    make_speculator, scripted_server, make_runner
):
    """Over several steps with churn, every store lands only in slots owned
    by the requests the draft was proposed for."""
    log: list[tuple] = []
    speculator, _ = make_speculator(scripted_server.address)
    _deferred(speculator)
    runner = make_runner(speculator, log, K)
    live = ["r0", "r1"]
    runner.execute_model(scheduler_output(set(), live))
    for step in range(1, 5):
        slots = [runner.req_states.req_id_to_index[r] for r in live]
        _sample_tokens(runner, _batch(live, slots, start=10 * step))
        gone, fresh = live[0], f"r{step + 1}"
        runner.execute_model(scheduler_output({gone}, [fresh]))
        live = [*live[1:], fresh]
    for event in log:
        if event[0] == "store":
            assert None not in event[1]
    stores = [e for e in log if e[0] == "store"]
    assert [e[1] for e in stores] == [
        ["r0", "r1"],
        ["r1", "r2"],
        ["r2", "r3"],
        ["r3", "r4"],
    ]


def test_failed_reply_yields_no_draft_and_disables_the_requests(
    make_speculator, scripted_server, monkeypatch, make_runner
):
    log: list[tuple] = []
    speculator, _ = make_speculator(scripted_server.address)
    _deferred(speculator)
    runner = make_runner(speculator, log, K)
    runner.execute_model(scheduler_output(set(), ["a", "b"]))
    slots = [runner.req_states.req_id_to_index[r] for r in ("a", "b")]
    _sample_tokens(runner, _batch(["a", "b"], slots))
    runner.execute_model(scheduler_output(set(), []))
    assert (runner.req_states.draft_tokens.data[slots] == 5).all()
    assert not any(s.stale for s in speculator.plan.retained.values())

    def broken(step: Any) -> None:
        raise RuntimeError("reply thread crashed")

    monkeypatch.setattr(speculator, "exchange", broken)
    _sample_tokens(runner, _batch(["a", "b"], slots, start=20))
    step = threading.Thread(
        target=runner.execute_model, args=(scheduler_output(set(), []),), daemon=True
    )
    step.start()
    step.join(30)
    assert not step.is_alive(), "a failed reply did not release the gate"
    assert (runner.req_states.draft_tokens.data[slots] == -1).all()
    assert log[-1] == ("output_copy", ["a", "b"])
    assert all(speculator.plan.retained[r].stale for r in ("a", "b"))


def test_a_step_that_resolves_synchronously_stores_its_drafts_at_once(
    make_speculator, scripted_server, make_runner
):
    runner, slot, log = _runner_of_request_a(
        make_speculator, scripted_server, make_runner
    )
    _sample_tokens(runner, _batch(["a"], [slot]))
    assert runner.k3_deferred is not None and not runner.k3_deferred.pending
    assert log[-2:] == [("store", ["a"], [slot]), ("output_copy", ["a"])]
    assert (runner.req_states.draft_tokens.data[slot] == 5).all()


def test_steps_defer_only_after_the_worker_s_kernel_warm_up(
    make_speculator, scripted_server, make_runner, make_worker
):
    """Warm-up steps resolve synchronously (a kernel first loaded behind a
    parked stream hangs the process); the steps after the warm-up defer."""
    runner, slot, _ = _runner_of_request_a(
        make_speculator, scripted_server, make_runner
    )
    deferred_in_warm_up: list[bool] = []

    def warm_up(model_runner: Any, execute_model: Any, sample_tokens: Any) -> None:
        _sample_tokens(model_runner, _batch(["a"], [slot]))
        deferred_in_warm_up.append(model_runner.k3_deferred.pending)

    make_worker(runner, warm_up).compile_or_warm_up_model()
    assert deferred_in_warm_up == [False]
    _sample_tokens(runner, _batch(["a"], [slot], start=20))
    assert runner.k3_deferred is not None and runner.k3_deferred.pending
    runner.execute_model(scheduler_output(set(), []))


def test_without_the_kernel_warm_up_no_step_defers_and_the_worker_says_so(
    make_speculator, scripted_server, make_runner, make_worker, caplog
):
    """enforce_eager turns the JIT warm-up off: every reply then resolves
    synchronously, and a warning says why."""
    runner, slot, log = _runner_of_request_a(
        make_speculator, scripted_server, make_runner
    )
    worker = make_worker(runner, lambda *args: None)
    worker.vllm_config.kernel_config.enable_jit_warmup = False
    with caplog.at_level(logging.WARNING, logger="vllm.k3_draft.deferred"):
        worker.compile_or_warm_up_model()
    _sample_tokens(runner, _batch(["a"], [slot], start=20))
    assert runner.k3_deferred is not None and not runner.k3_deferred.pending
    assert log[-2:] == [("store", ["a"], [slot]), ("output_copy", ["a"])]
    (record,) = caplog.records
    assert "Deferred draft resolution stays off" in record.getMessage()


@pytest.mark.parametrize(
    ("error", "traceback"),
    [(RuntimeError("plan bug"), True), (protocol.ProtocolError("bad reply"), False)],
)
def test_a_failed_reply_is_logged_with_a_traceback_unless_the_server_s(
    make_speculator, scripted_server, monkeypatch, caplog, error, traceback
):
    speculator, _ = make_speculator(scripted_server.address)

    def failing(step: Any) -> None:
        raise error

    monkeypatch.setattr(speculator, "exchange", failing)
    with caplog.at_level(logging.WARNING, logger="vllm.k3_draft.deferred"):
        drafts = _defer_one_step(speculator)
    assert (drafts == -1).all()
    (record,) = [r for r in caplog.records if "reply failed" in r.getMessage()]
    assert (record.exc_info is not None) is traceback


def test_a_reply_failure_that_recurs_every_step_is_logged_once_an_interval(
    make_speculator, scripted_server, monkeypatch, caplog
):
    """A bug that fails every reply would log a traceback per step: the
    same failure is logged once a minute; another kind is logged at once."""
    speculator, _ = make_speculator(scripted_server.address)
    errors = [RuntimeError("plan bug")] * 5 + [KeyError("other bug")]

    def failing(step: Any) -> None:
        raise errors.pop(0)

    monkeypatch.setattr(speculator, "exchange", failing)
    strategy = _deferred(speculator)
    with caplog.at_level(logging.WARNING, logger="vllm.k3_draft.deferred"):
        for step in range(6):
            strategy.select_step(_runner_view(), _batch(["a"], [3]))
            drafts = _propose(speculator, _batch(["a"], [3], start=10 + 10 * step))
            strategy.consume(lambda *args: None)
            assert (drafts == -1).all()
    failed = [r for r in caplog.records if "reply failed" in r.getMessage()]
    assert [repr(r.exc_info and r.exc_info[1]) for r in failed] == [
        "RuntimeError('plan bug')",
        "KeyError('other bug')",
    ]


def test_staging_slots_alternate(make_speculator, scripted_server):
    speculator, _ = make_speculator(scripted_server.address)
    strategy = _deferred(speculator)
    used = []
    for step in range(4):
        strategy.select_step(_runner_view(), _batch(["a"], [3]))
        _propose(speculator, _batch(["a"], [3], start=10 + 10 * step))
        assert strategy._pending is not None and strategy._pending.slot is not None
        used.append(id(strategy._pending.slot.tokens))
        strategy.consume(lambda *args: None)
    assert used[0] == used[2] != used[1] == used[3]
    with pytest.raises(AssertionError, match="not consumed"):
        strategy.select_step(_runner_view(), _batch(["a"], [3]))
        _propose(speculator, _batch(["a"], [3], start=60))
        _propose(speculator, _batch(["a"], [3], start=70))
    strategy.consume(lambda *args: None)


def _slow_propose(scripted_server: Any, delay_s: float) -> None:
    def slow(header: dict[str, Any], frames: list[bytes]) -> list:
        time.sleep(delay_s)
        return scripted_server.default(header, frames)

    scripted_server.handlers[protocol.OP_PROPOSE] = slow


def _non_blocking_gates(strategy: DeferredResolution) -> list[RecordingGate]:
    """Give every staging slot a gate whose ``park`` returns at once, as on
    CUDA: ``consume`` then no longer waits for the reply on the host."""
    gates = []
    for slot in strategy._slots:
        gate = RecordingGate()
        gates.append(gate)
        slot.reply = stream_gate.ReplyGate(gate)
    return gates


def test_a_reused_staging_slot_waits_for_its_reply_thread(
    make_speculator, scripted_server
):
    speculator, _ = make_speculator(scripted_server.address, timeout_ms=5000)
    strategy = _deferred(speculator)
    gates = _non_blocking_gates(strategy)
    _slow_propose(scripted_server, 0.3)
    for step in range(3):  # step 2 reuses slot 0 while its reply may run
        batch = _batch(["a"], [3], start=10 + 10 * step)
        strategy.select_step(_runner_view(), batch)
        _propose(speculator, batch)
        strategy.consume(lambda *args: None)
    strategy._drain()
    # A parked stream that is never released never runs again.
    for gate in gates:
        assert gate.events.count("park") == gate.events.count("release")


def test_a_synchronous_step_waits_for_the_pending_reply_thread(
    make_speculator, scripted_server
):
    speculator, _ = make_speculator(scripted_server.address, timeout_ms=5000)
    strategy = _deferred(speculator)
    _non_blocking_gates(strategy)
    _slow_propose(scripted_server, 0.3)
    strategy.select_step(_runner_view(), _batch(["a"], [3], start=10))
    _propose(speculator, _batch(["a"], [3], start=10))
    strategy.consume(lambda *args: None)  # parks and returns at once
    strategy.warmed = False  # the next step resolves synchronously
    strategy.select_step(_runner_view(), _batch(["a"], [3], start=20))
    drafts = _propose(speculator, _batch(["a"], [3], start=20)).clone()
    strategy._drain()
    # Its RPCs ran after the reply thread's, not beside them on one socket.
    assert (drafts == 5).all()
    assert not any(state.stale for state in speculator.plan.retained.values())


def _hold_propose(scripted_server: Any, release: threading.Event) -> None:
    """The server answers a PROPOSE only once ``release`` is set."""

    def held(header: dict[str, Any], frames: list[bytes]) -> list:
        release.wait(10)
        return scripted_server.default(header, frames)

    scripted_server.handlers[protocol.OP_PROPOSE] = held


def test_consume_waits_until_the_reply_thread_sent_its_propose(
    make_speculator, scripted_server, monkeypatch
):
    speculator, _ = make_speculator(scripted_server.address, timeout_ms=5000)
    strategy = _deferred(speculator)
    _non_blocking_gates(strategy)
    release = threading.Event()
    _hold_propose(scripted_server, release)
    exchange = speculator.exchange
    prepared = threading.Event()

    def slow_exchange(step: Any) -> Any:
        time.sleep(0.2)  # the reply thread's work before its send
        prepared.set()
        return exchange(step)

    monkeypatch.setattr(speculator, "exchange", slow_exchange)
    batch = _batch(["a"], [3])
    strategy.select_step(_runner_view(), batch)
    _propose(speculator, batch)
    slot = strategy._pending.slot
    strategy.consume(lambda *args: None)
    sent_first = prepared.is_set()
    # It waited for the send only: the reply is still with the server.
    answered = slot.reply.delivered
    release.set()
    strategy._drain()
    assert sent_first
    assert not answered


class _DeviceEvent:
    """A staged-inputs event whose device copies finish when ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()


def test_consume_does_not_wait_for_a_reply_whose_inputs_are_still_on_the_device(
    make_speculator, scripted_server, monkeypatch
):
    speculator, _ = make_speculator(scripted_server.address, timeout_ms=5000)
    strategy = _deferred(speculator)
    _non_blocking_gates(strategy)
    event = _DeviceEvent()
    stage = speculator.stage

    def stage_on_device(*args: Any) -> Any:
        staged = stage(*args)
        staged.event = event
        return staged

    monkeypatch.setattr(speculator, "stage", stage_on_device)
    batch = _batch(["a"], [3])
    strategy.select_step(_runner_view(), batch)
    _propose(speculator, batch)
    # If consume waited for the reply thread, only this would end the wait.
    watchdog = threading.Timer(5.0, event.done.set)
    watchdog.start()
    strategy.consume(lambda *args: None)
    returned_before_the_copies = not event.done.is_set()
    event.done.set()
    watchdog.cancel()
    strategy._drain()
    assert returned_before_the_copies
    assert scripted_server.ops().count(protocol.OP_PROPOSE) == 1


# ------------------------------------------------------------ exit


def test_a_pending_reply_does_not_delay_interpreter_exit(scripted_server, tmp_path):
    """A child process returns from its main thread while the server holds
    the PROPOSE answer (the child's RPC timeout is 10 min): it exits at once."""
    flag = tmp_path / "propose_received"
    received, answer = threading.Event(), threading.Event()

    def held(header: dict[str, Any], frames: list[bytes]) -> list:
        flag.touch()
        received.set()
        answer.wait(120)
        return scripted_server.default(header, frames)

    scripted_server.handlers[protocol.OP_PROPOSE] = held
    child = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("k3_l3_pending_exit.py")),
            scripted_server.address,
            str(flag),
        ],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS": "600000",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Start-up (imports) may be slow; the exit after the PROPOSE is not.
        received.wait(120)
        out, _ = child.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
    finally:
        answer.set()
    assert child.returncode == 0, out
    assert "returns with a pending reply" in out


# ------------------------------------------------------------ numerics


def test_deferred_and_immediate_give_identical_draft_state(
    make_speculator, reference_server, second_reference_server
):
    """Two verifiers drive the same steps (different request ids), each
    through its own reference draft server: one immediate, one deferred."""
    immediate, _ = make_speculator(reference_server.address)
    deferred_spec, _ = make_speculator(second_reference_server.address)
    strategy = _deferred(deferred_spec)
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    for step in range(4):
        start = 10 + (K + 1) * step
        want.append(_propose(immediate, _batch(["i0", "i1"], [3, 5], start)).clone())
        strategy.select_step(_runner_view(), _batch(["d0", "d1"], [3, 5]))
        _propose(deferred_spec, _batch(["d0", "d1"], [3, 5], start))
        assert strategy.pending
        strategy.consume(lambda batch, drafts, k: got.append(drafts.clone()))
    assert all((w >= 0).all() for w in want), "the reference server drafted nothing"
    for w, g in zip(want, got):
        assert torch.equal(w, g)
