# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The remote speculator in a greedy verifier loop against a real draft server
(reference engine, its own process, ipc on this host).

Each test scripts a run of ``toy_target.VerifierLoop`` (real ``InputBatch``,
real ``RemoteK3DSparkSpeculator.propose``; the request table is the host token
table only) and checks, every step, that each draft row is -1 or the server
engine's draft for the request's exact committed context, and at the end that
the output equals target-only decoding.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest
from toy_target import ToyTarget, VerifierLoop

pytest_plugins = ("conftest_client",)

K = 3


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 1 for i in range(length)]


def _run_to_completion(loop: VerifierLoop, max_steps: int = 400) -> dict[str, list]:
    """Step every running request until all finished; their tokens by id."""
    finished = {}
    for _ in range(max_steps):
        for rid in [rid for rid, r in loop.requests.items() if r.done]:
            finished[rid] = loop.remove(rid).tokens
        if not loop.requests:
            return finished
        loop.step(list(loop.requests))
    raise AssertionError("requests did not finish")


def _server_id(speculator) -> str | None:
    """The server the speculator's plan is connected to (None: offline)."""
    info = speculator.plan.server
    return None if info is None else info.server_id


def _status(server) -> dict:
    code, body = server.http("/v1/status")
    assert code == 200
    return json.loads(body)


def test_drafts_are_exact_and_output_matches_target(
    draft_server, make_speculator, oracle
):
    """Accepted and rejected rows, chunked prefill, finish and slot reuse."""
    speculator, table = make_speculator(draft_server.address)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    prompts = {f"a{i}": _prompt(i, 20 + 13 * i) for i in range(10)}
    finished = {}
    pending = list(prompts)
    for _ in range(400):
        for rid in [rid for rid, r in loop.requests.items() if r.done]:
            finished[rid] = loop.remove(rid).tokens
        while pending and len(loop.requests) < 4:
            rid = pending.pop(0)
            loop.add(rid, prompts[rid], max_tokens=24)
        if not loop.requests:
            break
        loop.step(list(loop.requests))
    assert finished.keys() == prompts.keys()
    for rid, tokens in finished.items():
        assert tokens == target.generate(prompts[rid], 24)
    stats = loop.stats
    assert stats.accepted > 0 and stats.rejected > 0 and stats.drafted > 0


def test_lru_eviction_frees_idle_requests(
    draft_server_factory, make_speculator, oracle
):
    """With as many retained slots as sequences, finished requests are freed
    least recently used first to make room for new ones."""
    server = draft_server_factory(max_requests=8)
    speculator, table = make_speculator(server.address)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    first, second = [f"l{i}" for i in range(8)], [f"l{i}" for i in range(8, 14)]
    for i, rid in enumerate(first):
        loop.add(rid, _prompt(100 + i, 12), max_tokens=4 + i)
    _run_to_completion(loop)
    last_used = {rid: s.last_used for rid, s in speculator.plan.retained.items()}
    for i, rid in enumerate(second):
        loop.add(rid, _prompt(200 + i, 12), max_tokens=6)
    _run_to_completion(loop)
    retained = speculator.plan.retained
    evicted = set(first) - retained.keys()
    assert len(retained) == 8 and set(second) <= retained.keys()
    assert len(evicted) == 6
    assert max(last_used[r] for r in evicted) <= min(
        last_used[r] for r in set(first) - evicted
    )
    status = _status(server)
    assert status["requests_by_op"]["FREE"] >= 1
    assert status["active_requests"] == 8
    assert loop.stats.drafted > 0


def test_prefix_hit_reconnects_from_a_retained_prefix(
    draft_server, make_speculator, oracle
):
    """A new request whose first 40 tokens are a prefix-cache hit of a finished
    request's tokens is restored by RECONNECT instead of a cold bootstrap."""
    speculator, table = make_speculator(draft_server.address)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    loop.add("src", _prompt(7, 30), max_tokens=20)
    _run_to_completion(loop)
    shared = target.generate(_prompt(7, 30), 20)[:44]
    before = _status(draft_server)["reconnects"]
    loop.add("hit", shared, max_tokens=16, computed=40)
    loop.step(["hit"])
    state = speculator.plan.retained["hit"]
    assert state.start < 40
    assert _status(draft_server)["reconnects"] == before + 1
    finished = _run_to_completion(loop)
    assert finished["hit"] == target.generate(shared, 16)
    assert loop.stats.drafted > 0


@pytest.mark.parametrize("host_view", [True, False], ids=["host-view", "no-host-view"])
@pytest.mark.parametrize("old_max_tokens", [30, 1], ids=["decoded", "prefilled"])
def test_reused_request_id_is_not_continued_from_the_finished_request(
    draft_server, make_speculator, oracle, host_view, old_max_tokens
):
    """A new request that takes a finished one's id in the very next step,
    with a prefix-cache hit at the old request's end but other tokens, is
    not drafted from the old request's draft KV, with or without a host view
    of the token table (without one there are no tokens to compare), whether
    the old one finished while decoding or with the token its last prefill
    chunk sampled (the loop checks every draft against the context it was
    asked for)."""
    speculator, table = make_speculator(draft_server.address)
    if not host_view:
        speculator._token_table = None
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    loop.add("a", _prompt(1, 20), max_tokens=old_max_tokens)
    while not loop.requests["a"].done:
        loop.step(["a"])
    end = speculator.plan.retained["a"].end
    loop.remove("a")
    prompt = _prompt(2, end + 10)
    loop.add("a", prompt, max_tokens=8, computed=end)
    finished = _run_to_completion(loop)
    assert finished["a"] == target.generate(prompt, 8)
    assert loop.stats.drafted > 0


def test_own_resume_reconnects_after_a_refused_reconnect_from_it(
    draft_server, make_speculator, oracle
):
    """A RECONNECT from a long request refused for another request's short
    prefix (its context cache no longer holds it) does not stop the long
    request's own resume near its end from reconnecting."""
    speculator, table = make_speculator(draft_server.address)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    loop.add("src", _prompt(11, 200), max_tokens=60)
    for _ in range(10):
        loop.step(["src"])
    shared = list(loop.requests["src"].tokens[:40]) + _prompt(5, 10)
    before = _status(draft_server)
    loop.add("hit", shared, max_tokens=4, computed=32)
    loop.step(["src", "hit"])
    mid = _status(draft_server)
    assert mid["reconnect_failures"] == before["reconnect_failures"] + 1
    preempted = loop.remove("src")
    end = speculator.plan.retained["src"].end
    loop.resume(preempted, computed=end - 5)
    loop.step(["src"])
    assert _status(draft_server)["reconnects"] == mid["reconnects"] + 1


def test_preempted_request_resumes_by_rewinding(draft_server, make_speculator, oracle):
    """A request preempted and resumed at an earlier cached position rewinds
    its own retained state (RECONNECT from itself) and keeps exact drafts."""
    speculator, table = make_speculator(draft_server.address)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    prompt = _prompt(11, 40)
    loop.add("p", prompt, max_tokens=40)
    for _ in range(6):
        loop.step(["p"])
    preempted = loop.remove("p")
    end = speculator.plan.retained["p"].end
    before = _status(draft_server)["reconnects"]
    loop.resume(preempted, computed=end - 5)
    loop.step(["p"])
    assert _status(draft_server)["reconnects"] == before + 1
    _run_to_completion(loop)
    assert preempted.tokens == target.generate(prompt, 40)


def test_server_restart_fails_closed_then_recovers(
    draft_server_factory, make_speculator, oracle
):
    """Killing the draft server mid-run gives -1 drafts (never wrong ones);
    after the restart the client sees the new server_id, forgets the old
    state and cold-bootstraps the running requests."""
    server = draft_server_factory()
    speculator, table = make_speculator(server.address, timeout_ms=500)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    prompts = {f"r{i}": _prompt(30 + i, 16) for i in range(3)}
    for rid, prompt in prompts.items():
        loop.add(rid, prompt, max_tokens=60)
    for _ in range(4):
        loop.step(list(loop.requests))
    old_id = _server_id(speculator)
    server.proc.kill()
    server.stop()
    drafted = loop.stats.drafted
    loop.step(list(loop.requests))
    assert loop.stats.drafted == drafted
    assert _server_id(speculator) is None
    server.start()
    for _ in range(200):
        loop.step(list(loop.requests))
        if loop.stats.drafted > drafted:
            break
        time.sleep(0.05)
    assert _server_id(speculator) not in (None, old_id)
    finished = _run_to_completion(loop)
    for rid, prompt in prompts.items():
        assert finished[rid] == target.generate(prompt, 60)


def _step_until_drafted(loop: VerifierLoop, rid: str, max_steps: int = 200) -> None:
    """Step ``rid`` until a step drafts for it (a retry's PONG may come a
    step late)."""
    drafted = loop.stats.drafted
    for _ in range(max_steps):
        loop.step([rid])
        if loop.stats.drafted > drafted:
            return
        time.sleep(0.05)
    raise AssertionError("drafting never resumed")


def test_a_restarted_server_is_handshaken_before_its_drafts_are_used(
    draft_server_factory, make_speculator, oracle
):
    """A server restarted while the verifier is idle (same address: ZeroMQ
    reconnects by itself) answers the next PROPOSE under a new server_id: that
    step has no drafts, and drafting resumes only after a PING and the CLEAR of
    what the refused PROPOSE left there."""
    server = draft_server_factory()
    speculator, table = make_speculator(server.address)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    loop.add("a", _prompt(50, 20), max_tokens=12)
    _run_to_completion(loop)
    old_id = _server_id(speculator)
    server.restart()
    loop.add("b", _prompt(51, 20), max_tokens=60)
    drafted = loop.stats.drafted
    loop.step(["b"])
    assert loop.stats.drafted == drafted
    assert _status(server)["requests_by_op"] == {"PROPOSE": 1}
    _step_until_drafted(loop, "b")
    ops = _status(server)["requests_by_op"]
    assert ops["PING"] >= 1 and ops["CLEAR"] == 1
    assert _server_id(speculator) not in (None, old_id)
    assert _run_to_completion(loop)["b"] == target.generate(_prompt(51, 20), 60)


def test_a_restarted_incompatible_server_is_refused_until_a_compatible_one_is_back(
    draft_server_factory, make_speculator, oracle, caplog
):
    """A server restarted with bounds this engine cannot use is refused by the
    handshake that its first reply forces, and never drafts; a compatible
    server back at the address is handshaken, then drafts."""
    server = draft_server_factory()
    speculator, table = make_speculator(server.address)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    loop.add("a", _prompt(60, 20), max_tokens=12)
    _run_to_completion(loop)
    compatible = dict(server.options)
    server.stop()
    server.options.update(method="dspark", max_model_len=2048)
    server.start()
    loop.add("b", _prompt(61, 20), max_tokens=80)
    drafted = loop.stats.drafted
    with caplog.at_level(logging.ERROR, logger="vllm.k3_draft.plan"):
        for _ in range(200):
            loop.step(["b"])
            if "cannot serve this engine" in caplog.text:
                break
            time.sleep(0.05)
    assert "method 'dspark', this engine drafts with 'dflash'" in caplog.text
    assert "max_model_len 2048 (--max-model-len), this engine has 4096" in caplog.text
    assert loop.stats.drafted == drafted
    assert _status(server)["requests_by_op"].get("PROPOSE", 0) <= 1
    server.stop()
    server.options = compatible
    server.start()
    _step_until_drafted(loop, "b")
    assert _status(server)["requests_by_op"]["PING"] >= 1
    assert _run_to_completion(loop)["b"] == target.generate(_prompt(61, 20), 80)


def test_reused_id_prefilled_while_offline_is_not_continued_from_the_finished_request(
    draft_server_factory, make_speculator, oracle
):
    """A finished request's id taken by a new request (other tokens) that is
    admitted and prefilled while the draft server does not answer, up to the
    old request's committed end, is not continued from the old request's
    draft KV once the server answers again (the loop checks every draft
    against the context it was asked for)."""
    server = draft_server_factory()
    speculator, table = make_speculator(server.address, timeout_ms=1000)
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K)
    loop.add("a", _prompt(1, 20), max_tokens=12)
    _run_to_completion(loop)
    end = speculator.plan.retained["a"].end
    loop.add("b", _prompt(3, 20), max_tokens=40)
    loop.step(["b"])
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        loop.step(["b"])  # times out: "b" is stale, the client retries
        prompt = _prompt(2, end)
        loop.add("a", prompt, max_tokens=8)
        loop.step(["a", "b"])  # the retry's PING finds no PONG: no RPC
        assert speculator.plan.server is None
        assert loop.requests["a"].num_computed == end
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    # Its PONG comes: the next step is back online.
    assert speculator.plan.client._socket.poll(30_000)
    drafted = loop.stats.drafted
    loop.step(["a", "b"])
    assert loop.stats.drafted > drafted
    finished = _run_to_completion(loop)
    assert finished["a"] == target.generate(prompt, 8)


def test_chunked_prefill_without_a_host_view_continues_chunk_to_chunk(
    draft_server, make_speculator, oracle
):
    """Without a host view, each prefill chunk of a request continues the
    draft state of its previous chunk (no cold bootstrap at every chunk)."""
    speculator, table = make_speculator(draft_server.address)
    speculator._token_table = None
    target = ToyTarget(oracle)
    loop = VerifierLoop(speculator, target, table, max_num_reqs=8, k=K, chunk=16)
    prompt = _prompt(4, 50)
    loop.add("c", prompt, max_tokens=12)
    while loop.requests["c"].num_computed < len(prompt):
        loop.step(["c"])
    assert speculator.plan.retained["c"].start == 0
    finished = _run_to_completion(loop)
    assert finished["c"] == target.generate(prompt, 12)
    assert loop.stats.drafted > 0
