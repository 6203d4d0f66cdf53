# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the verifier logs while a draft fault lasts for many steps: a
production verifier runs 10-100 steps per second for weeks, so a fault is
logged when it starts, at most about once a minute (or once per backoff
retry) while it lasts, and once when drafting resumes; never once per step.

Real draft server processes and the real speculator in ``VerifierLoop``, or
a scripted server for replies a real server never sends; log lines are
counted on the ``vllm`` logger."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from k3_layer1_server import RawClient, free_tcp_port
from test_plan_fail_closed import NEEDS
from toy_target import ToyTarget, VerifierLoop

from vllm.k3_draft import plan as plan_module
from vllm.k3_draft import protocol
from vllm.k3_draft.client import DraftClient
from vllm.k3_draft.plan import RemotePlan, StepInputs, StepRequest

pytest_plugins = ("conftest_client",)

K = 3
RESUMED = "Remote drafting re-enabled"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, containing: str = "") -> list[str]:
        return [r.getMessage() for r in self.records if containing in r.getMessage()]


@pytest.fixture
def lines() -> Iterator[_Lines]:
    """INFO and above of the ``vllm`` loggers (whatever handlers vLLM set)."""
    handler = _Lines()
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _prompt(seed: int, length: int = 16) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 1 for i in range(length)]


def _keep_running(loop: VerifierLoop, steps: int, each=None) -> None:
    """``steps`` steps of three running requests, each finished one replaced."""
    for n in range(steps):
        for rid in [rid for rid, r in loop.requests.items() if r.done]:
            loop.remove(rid)
        while len(loop.requests) < 3:
            loop.add(f"r{n}-{len(loop.requests)}", _prompt(n), max_tokens=30)
        loop.step(list(loop.requests))
        if each is not None:
            each()


def test_a_fault_that_fails_every_other_step_is_not_logged_per_step(
    draft_server_factory, make_speculator, oracle, lines
):
    """A server whose requests are cleared after every step (another verifier
    on it, say) fails the PROPOSE of every continued request, and the next
    step cold-bootstraps them: failure and success alternate, so no backoff
    paces the warnings. One warning, one line when drafting resumes, then
    silence for the rest of the minute."""
    server = draft_server_factory()
    speculator, table = make_speculator(server.address)
    loop = VerifierLoop(speculator, ToyTarget(oracle), table, 8, K)
    _keep_running(loop, 3)
    other = RawClient(server.address)
    before = len(lines.records)
    try:
        _keep_running(loop, 120, each=lambda: other.call(protocol.OP_CLEAR))
    finally:
        other.close()
    assert loop.stats.drafted > 0 and loop.stats.no_draft > 100
    logged = [r.getMessage() for r in lines.records[before:]]
    failed = [m for m in logged if m.startswith("Draft PROPOSE failed")]
    assert len(failed) == 1, logged
    assert "unknown request" in failed[0]
    assert len([m for m in logged if m.startswith(RESUMED)]) == 1, logged
    assert len(logged) == 2, logged


def test_drafting_that_resumes_after_an_outage_is_said_once(
    draft_server_factory, make_speculator, oracle, lines
):
    """A verifier started before its server warns at start-up and at each
    retry; once the server serves, the first step that drafts says so in one
    line naming the server, and the steps after it log nothing."""
    server = draft_server_factory(
        address=f"tcp://127.0.0.1:{free_tcp_port()}", start=False
    )
    speculator, table = make_speculator(server.address, timeout_ms=500)
    assert speculator.plan.server is None
    loop = VerifierLoop(speculator, ToyTarget(oracle), table, 8, K)
    _keep_running(loop, 5)
    server.start()
    deadline = time.monotonic() + 60
    while loop.stats.drafted == 0 and time.monotonic() < deadline:
        _keep_running(loop, 1)
        time.sleep(0.05)
    assert loop.stats.drafted > 0
    logged = lines.messages()
    assert any("did not answer the handshake" in m for m in logged)
    (resumed,) = [m for m in logged if m.startswith(RESUMED)]
    assert server.address in resumed
    assert logged[-1] == resumed
    _keep_running(loop, 30)
    assert lines.messages()[-1] == resumed


def _step(rid: str) -> StepInputs:
    """A cold request ``rid`` with four context rows."""
    tokens = np.arange(64, dtype=np.int32)
    return StepInputs(
        [StepRequest(rid, 0, 4, 9, 0, tokens)],
        K,
        torch.zeros(4, 192, dtype=torch.bfloat16),
    )


def _refuse(header, frames):
    return [
        protocol.encode_header(
            protocol.error_reply(protocol.ProtocolError("refused"), "scripted-1")
        )
    ]


def _new_requests_for_a_while(
    scripted_server: Any, monkeypatch: pytest.MonkeyPatch, free: Any
) -> int:
    """With a 1 s failure-log interval, fill the server's retained slots,
    let ``free`` answer FREE, then run a new request a step (each makes room
    by a FREE) for 1.5 s; the number of those steps."""
    monkeypatch.setattr(plan_module, "FAILURE_LOG_INTERVAL_S", 1.0)
    client = DraftClient(scripted_server.address, timeout_ms=300)
    plan = RemotePlan(client, NEEDS, retry_interval_s=0.0)
    try:
        plan.connect()
        assert plan.server is not None
        for i in range(plan.server.max_requests):
            plan.run(_step(f"fill{i}"))
        scripted_server.handlers[protocol.OP_FREE] = free
        started = time.monotonic()
        steps = 0
        while time.monotonic() - started < 1.5:
            plan.run(_step(f"new{steps}"))
            steps += 1
    finally:
        client.close()
    return steps


def test_a_free_refused_at_every_step_is_logged_once_an_interval(
    scripted_server, lines, monkeypatch
):
    """A server that refuses every FREE: the requests stay stale and every
    step retries the FREE (its drafts go on). One warning per interval, the
    next counting the refusals left out."""
    steps = _new_requests_for_a_while(scripted_server, monkeypatch, _refuse)
    refused = lines.messages("Draft FREE failed")
    assert steps > 20
    assert len(refused) == 2, refused
    assert "more in the 1 s before, not logged" in refused[1]


def test_an_outage_whose_first_failure_was_left_out_is_resumed_from_once(
    scripted_server, lines
):
    """A PROPOSE fails, is logged, and drafting resumes; within the minute it
    fails again twice in a row: the first failure is left out, the second
    takes the server offline with a warning, so the step that drafts again
    says so once more."""
    client = DraftClient(scripted_server.address, timeout_ms=300)
    plan = RemotePlan(client, NEEDS, retry_interval_s=0.0)
    steps = itertools.count()

    def drafts() -> bool:
        return bool((plan.run(_step(f"r{next(steps)}")).tokens >= 0).all())

    def until_drafted() -> None:
        assert any(drafts() for _ in range(20))

    try:
        plan.connect()
        until_drafted()
        scripted_server.handlers[protocol.OP_PROPOSE] = _refuse
        assert not drafts()
        del scripted_server.handlers[protocol.OP_PROPOSE]
        until_drafted()
        scripted_server.handlers[protocol.OP_PROPOSE] = _refuse
        for _ in range(20):
            assert not drafts()
            if lines.messages("Remote draft unavailable"):
                break
        del scripted_server.handlers[protocol.OP_PROPOSE]
        until_drafted()
    finally:
        client.close()
    assert len(lines.messages("Remote draft unavailable")) == 1
    assert len(lines.messages("Draft PROPOSE failed")) == 1
    assert len(lines.messages(RESUMED)) == 2, lines.messages()


def test_a_propose_that_times_out_is_logged_as_such(scripted_server, lines):
    """The warning names the call that timed out and says it timed out (not
    ZeroMQ's "Resource temporarily unavailable"): an operator tells a slow
    PROPOSE from a failed FREE, a RECONNECT or a refused connection."""
    client = DraftClient(scripted_server.address, timeout_ms=300)
    plan = RemotePlan(client, NEEDS, retry_interval_s=0.0)
    answered = threading.Event()

    def slow(header, frames):
        time.sleep(0.5)
        answered.set()
        return scripted_server.default(header, frames)

    try:
        plan.connect()
        scripted_server.handlers[protocol.OP_PROPOSE] = slow
        assert (plan.run(_step("a")).tokens == -1).all()
        assert answered.wait(5)
    finally:
        client.close()
    (failed,) = lines.messages("Draft PROPOSE failed")
    address = scripted_server.address
    assert f"PROPOSE to the draft server {address} timed out after 300 ms" in failed


def test_each_failure_line_counts_only_the_failures_left_out_since_the_last():
    log = plan_module.FailureLog(0.1)
    assert log.admit("call") == ""
    for _ in range(3):
        assert log.admit("call") is None
    time.sleep(0.12)
    assert (log.admit("call") or "").startswith(" (3 more in the ")
    assert log.admit("call") is None
    time.sleep(0.12)
    assert (log.admit("call") or "").startswith(" (1 more in the ")
    time.sleep(0.12)
    assert log.admit("call") == ""


def test_the_resumed_line_counts_every_failed_call_logged_or_not(lines):
    log = plan_module.FailureLog(60.0)
    log.failed_and_logged()
    log.failed()
    log.failed()
    log.resumed("tcp://127.0.0.1:1")
    (resumed,) = lines.messages(RESUMED)
    assert "3 failed calls since" in resumed
    log.failed_and_logged()
    log.resumed("tcp://127.0.0.1:1")
    assert "1 failed calls since" in lines.messages(RESUMED)[1]


def test_a_server_that_another_verifier_fills_is_cleared_with_a_line_an_interval(
    scripted_server, lines, monkeypatch
):
    """Every FREE's reply counts requests this verifier does not know of
    (another verifier on the server): every step clears the server, and
    one warning per interval says so."""
    steps = _new_requests_for_a_while(
        scripted_server,
        monkeypatch,
        lambda h, f: scripted_server.reply(protocol.OP_FREE, active_requests=99),
    )
    assert steps > 20 and scripted_server.ops().count(protocol.OP_CLEAR) > 20
    clearing = lines.messages("clearing it")
    assert len(clearing) == 2, clearing
    assert "more in the 1 s before, not logged" in clearing[1]
