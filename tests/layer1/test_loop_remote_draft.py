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

from conftest_client import (  # noqa: F401  (fixtures)
    make_speculator,
    oracle,
    tp_world,
    vllm_config_factory,
)
from toy_target import ToyTarget, VerifierLoop

K = 3


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 1 for i in range(length)]


def _run_to_completion(loop: VerifierLoop, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        running = [rid for rid, r in loop.requests.items() if not r.done]
        for rid in [rid for rid, r in loop.requests.items() if r.done]:
            loop.remove(rid)
        if not running:
            return
        loop.step(running)
    raise AssertionError("requests did not finish")


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
