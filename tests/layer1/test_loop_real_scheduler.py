# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The remote speculator driven by vLLM's real v1 scheduler (CPU), greedy:
``k3_sched_loop``'s ``SchedulerLoop`` and ``HostRunner`` (see its docstring).

Every step checks that each draft row is -1 or the server engine's draft for
the request's exact committed context, and that each request's output so far
is a prefix of target-only greedy decoding; each finished request's output
equals target-only decoding up to its stop.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from typing import Any

import pytest
from k3_sched_loop import (
    BLOCK,
    MAX_NUM_SEQS,
    Spec,
    run_in_order,
    run_random_schedule,
    run_together,
)
from k3_sched_loop import prompt_tokens as _prompt
from toy_target import MAX_MODEL_LEN

pytest_plugins = ("conftest_client", "k3_sched_loop")


SCHEDULING = pytest.mark.parametrize(
    "async_scheduling", [False, True], ids=["sync", "async"]
)


@SCHEDULING
@pytest.mark.parametrize("dynamic_k", [False, True], ids=["fixed-k", "dynamic-k"])
def test_chunked_prefill_and_arrivals_every_step_match_target(
    make_loop, async_scheduling, dynamic_k
):
    """New requests arrive every step, long prompts are chunked by a small
    token budget, with K fixed or chosen per step by batch size (dynamic
    speculative decoding: 3 drafts up to 2 requests, 2 up to 4, then 1):
    drafts are exact and outputs equal target-only decoding."""
    schedule = [(1, 2, 3), (3, 4, 2), (5, MAX_NUM_SEQS, 1)] if dynamic_k else None
    loop = make_loop(async_scheduling, k_per_batch_size=schedule)
    specs = {f"c{i}": Spec(_prompt(i, 10 + 17 * (i % 5)), 8 + 3 * i) for i in range(12)}
    pending = list(specs)

    def arrive(n: int) -> None:
        if pending:
            rid = pending.pop(0)
            loop.add(rid, specs[rid])

    loop.run(each=arrive)
    assert loop.finished.keys() == specs.keys()
    stats = loop.runner.stats
    assert stats.drafted > 0 and stats.accepted > 0 and stats.rejected > 0
    assert stats.chunks > 0
    assert len(stats.k_used) == (3 if dynamic_k else 1)


def _status(server: Any) -> dict:
    code, body = server.http("/v1/status")
    assert code == 200
    return json.loads(body)


@SCHEDULING
def test_preemption_prefix_hits_stops_and_aborts_match_target(
    make_loop, tight_server, async_scheduling
):
    """A KV cache too small for every running request (preemption and resume
    by recompute), prompts sharing a prefix (prefix-cache hits, RECONNECT),
    stop tokens and max_tokens ending requests inside an accepted draft block,
    and aborts mid-run: drafts are exact and outputs equal target-only
    decoding."""
    loop = make_loop(async_scheduling, num_blocks=24)
    target = loop.target
    reconnects = _status(tight_server)["reconnects"]
    shared = _prompt(99, 40)
    # The same prompt twice, one token past a block boundary: the second is a
    # full prefix-cache hit whose last prompt token is padded with drafts.
    specs: dict[str, Spec] = {"dup0": Spec(_prompt(500, 2 * BLOCK + 1), 12)}
    specs["dup1"] = specs["dup0"]
    for i in range(10):
        prompt = shared + _prompt(200 + i, 3 + 5 * i) if i % 2 else _prompt(300 + i, 30)
        specs[f"p{i}"] = Spec(prompt, 20 + 4 * i)
    # Stop on the 9th output token of target-only decoding.
    stop_prompt = _prompt(400, 25)
    ninth = target.generate(stop_prompt, 9)[-1]
    specs["stop"] = Spec(stop_prompt, 40, stop_token_ids=[ninth])
    assert run_in_order(loop, specs, late="dup1", abort=("p6", "p7"))
    stats = loop.runner.stats
    assert stats.drafted > 0 and stats.accepted > 0 and stats.rejected > 0
    assert stats.preemptions > 0 and stats.prefix_hits > 0
    assert stats.padded_prefills > 0 and stats.cut_in_block > 0
    assert _status(tight_server)["reconnects"] > reconnects


@SCHEDULING
@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedule_matches_target(make_loop, async_scheduling, seed):
    """Seeded random arrivals (shared prefixes, repeated prompts), stop
    tokens, aborts and finished ids taken by new requests, over a KV cache
    that preempts: drafts are exact and outputs equal target-only decoding."""
    rng = random.Random(seed)
    loop = make_loop(async_scheduling, num_blocks=12, max_num_batched_tokens=48)
    prefixes = [_prompt(600 + seed * 10 + i, rng.randrange(8, 40)) for i in range(3)]
    run_random_schedule(loop, rng, prefixes, (0.0,), requests=24)
    stats = loop.runner.stats
    assert stats.drafted > 0 and stats.accepted > 0 and stats.preemptions > 0
    assert stats.prefix_hits > 0


@SCHEDULING
def test_model_length_inside_a_draft_block_matches_target(make_loop, async_scheduling):
    """Requests that reach the model length (the scheduler trims their draft
    slots on the way) next to a short one: drafts are exact and outputs equal
    target-only decoding up to the model length."""
    loop = make_loop(async_scheduling, max_num_batched_tokens=1024)
    specs = {
        f"m{i}": Spec(_prompt(700 + i, MAX_MODEL_LEN - 9 - 2 * i), 40) for i in range(3)
    }
    specs["short"] = Spec(_prompt(710, 20), 30)
    run_together(loop, specs)
    for i in range(3):
        assert len(loop.finished[f"m{i}"]) == 9 + 2 * i
    stats = loop.runner.stats
    assert stats.drafted > 0 and stats.short_verifies > 0


@SCHEDULING
def test_draft_server_stall_mid_run_fails_closed_and_matches_target(
    make_loop, tight_server, async_scheduling
):
    """The draft server stops answering for a few steps while the scheduler
    preempts, resumes and admits prefix-cache hits: those steps get no
    drafts (never wrong ones), drafting resumes once it answers again, and
    outputs equal target-only decoding."""
    loop = make_loop(async_scheduling, num_blocks=16, timeout_ms=1000)
    shared = _prompt(800, 36)
    specs = {f"s{i}": Spec(shared + _prompt(810 + i, 4 + 3 * i), 50) for i in range(8)}
    pending = list(specs)
    proc = tight_server.proc
    assert proc is not None
    drafted: list[int] = []
    # The step the server is stopped at: from step 8, once drafts came (on a
    # loaded machine an early PROPOSE may time out and back off).
    stopped_at: list[int] = []

    def drive(n: int) -> None:
        if pending and n % 2 == 0:
            rid = pending.pop(0)
            loop.add(rid, specs[rid])
        if not stopped_at and n >= 8 and loop.runner.stats.drafted:
            stopped_at.append(n)
            drafted.append(loop.runner.stats.drafted)
            os.kill(proc.pid, signal.SIGSTOP)
        elif stopped_at and n == stopped_at[0] + 3:
            os.kill(proc.pid, signal.SIGCONT)
            drafted.append(loop.runner.stats.drafted)
        if len(drafted) == 2 and loop.runner.stats.drafted == drafted[-1]:
            time.sleep(0.05)  # the client's retry backoff

    try:
        loop.run(each=drive)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert loop.finished.keys() == specs.keys()
    stats = loop.runner.stats
    assert drafted[0] > 0 and drafted[1] == drafted[0]
    assert stats.drafted > drafted[1] and stats.preemptions > 0
