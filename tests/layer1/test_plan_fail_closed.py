# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fail-closed behaviour of ``RemotePlan`` per failure kind, against a
scripted REP server on loopback (real ZeroMQ) that returns what a healthy
server never would."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from k3_layer1_server import free_tcp_port

from vllm.k3_draft import plan as plan_module
from vllm.k3_draft import protocol
from vllm.k3_draft.client import DraftClient, ServerRequirements
from vllm.k3_draft.plan import (
    NO_DRAFT,
    ProposeExtension,
    RemotePlan,
    StepInputs,
    StepRequest,
)

pytest_plugins = ("conftest_client",)

K = 3
WIDTH = 192
# The scripted server's id (ScriptedServer.pong) that its replies name.
SERVER_ID = "scripted-1"
NEEDS = ServerRequirements(
    method="dflash",
    capabilities=frozenset(),
    context_width=WIDTH,
    vocab_size=1024,
    max_model_len=4096,
    max_num_seqs=8,
    num_speculative_tokens=K,
    max_num_batched_tokens=512,
)


@pytest.fixture
def fresh_plan(scripted_server):
    """A plan that has not shaken hands yet."""
    client = DraftClient(scripted_server.address, timeout_ms=300)
    plan = RemotePlan(client, NEEDS, retry_interval_s=0.0)
    yield plan
    client.close()


@pytest.fixture
def plan(scripted_server):
    """A plan online from its first step (its first step would otherwise
    wait only 20 ms for the PONG: offline on a loaded machine), logging the
    timings of every proposal."""
    client = DraftClient(scripted_server.address, timeout_ms=300)
    plan = RemotePlan(client, NEEDS, timing_log_interval=1, retry_interval_s=0.0)
    plan.connect()
    yield plan
    client.close()


def _step(ids: list[str], first: int = 0, count: int = 4) -> StepInputs:
    tokens = np.arange(64, dtype=np.int32)
    requests = [
        StepRequest(rid, first, count, 9, i * count, tokens)
        for i, rid in enumerate(ids)
    ]
    rows = torch.zeros(len(ids) * count, WIDTH, dtype=torch.bfloat16)
    return StepInputs(requests, K, rows)


def _reply(**fields: Any) -> list[bytes]:
    base = {
        "tokens": [[1, 2, 3], [4, 5, 6]],
        "latency_ms": 0.1,
        "timing_ms": dict.fromkeys(protocol.TIMING_FIELDS, 0.0),
    }
    reply = protocol.ok_reply("PROPOSE", server_id=SERVER_ID, **{**base, **fields})
    return [protocol.encode_header(reply)]


MALFORMED = {
    "error reply": [
        protocol.encode_header(
            protocol.error_reply(ValueError("engine on fire"), SERVER_ID)
        )
    ],
    "not json": [b"\xff{"],
    "wrong protocol": [b'{"ok": true, "protocol": 1, "op": "PROPOSE"}'],
    "wrong op": [
        protocol.encode_header(protocol.ok_reply("FREE", server_id=SERVER_ID))
    ],
    "too few rows": _reply(tokens=[[1, 2, 3]]),
    "too many rows": _reply(tokens=[[1, 2, 3], [4, 5, 6], [7, 8, 9]]),
    "short row": _reply(tokens=[[1, 2, 3], [4, 5]]),
    "long row": _reply(tokens=[[1, 2, 3], [4, 5, 6, 7]]),
    "out of vocabulary": _reply(tokens=[[1, 2, 3], [4, 5, 1024]]),
    "negative id": _reply(tokens=[[1, 2, 3], [4, -1, 6]]),
    "bool id": _reply(tokens=[[1, 2, 3], [4, True, 6]]),
    "float id": _reply(tokens=[[1, 2, 3], [4, 5.0, 6]]),
    "no timings": _reply(timing_ms=None),
    "timings lack a field": _reply(timing_ms={}),
    "latency beyond a float": _reply(latency_ms=10**400),
    "timing beyond a float": _reply(
        timing_ms={**dict.fromkeys(protocol.TIMING_FIELDS, 0.0), "total": -(10**400)}
    ),
    "infinite latency": [
        _reply()[0].replace(b'"latency_ms":0.1', b'"latency_ms":1e999')
    ],
    "extra frame": [*_reply(), b"\x00" * 8],
}


@pytest.mark.parametrize("reply", MALFORMED.values(), ids=MALFORMED.keys())
def test_bad_propose_reply_gives_no_draft_and_marks_stale(plan, scripted_server, reply):
    scripted_server.handlers["PROPOSE"] = lambda header, frames: reply
    result = plan.run(_step(["a", "b"]))
    assert (result.tokens == -1).all() and result.payloads == {}
    assert plan.retained["a"].stale and plan.retained["b"].stale


# Values a fuzzed reply puts in place of a field or a token.
FUZZ_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    1023,
    1024,
    2**63,
    1.5,
    float("nan"),
    "",
    "x",
    [],
    {},
    [[1, 2, 3]],
]


def _fuzzed_reply(rng: random.Random) -> list[bytes]:
    """A PROPOSE reply to two requests broken one way or another: bytes
    changed, cut short, a field or a token replaced, frames added (now and
    then, by chance, still well-formed)."""
    header = _reply()[0]
    kind = rng.randrange(5)
    if kind == 0:
        data = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return [bytes(data)]
    if kind == 1:
        return [header[: rng.randrange(len(header))]]
    fields = json.loads(header)
    if kind == 2:
        fields[rng.choice(sorted(fields))] = rng.choice(FUZZ_VALUES)
    elif kind == 3:
        fields["tokens"][rng.randrange(2)][rng.randrange(K)] = rng.choice(FUZZ_VALUES)
    else:
        extra = [rng.randbytes(rng.randrange(16)) for _ in range(rng.randint(1, 3))]
        return [header, *extra]
    return [json.dumps(fields).encode()]


def test_thousands_of_fuzzed_propose_replies_never_pass_a_wrong_draft(
    plan, scripted_server
):
    rng = random.Random(20261204)
    drafted = 0
    for _ in range(2000):
        reply = _fuzzed_reply(rng)
        scripted_server.handlers["PROPOSE"] = lambda header, frames, r=reply: r
        tokens = plan.run(_step(["a", "b"])).tokens
        if (tokens == NO_DRAFT).all():
            continue
        # Drafts come only from a reply that is whole and well-formed, and
        # are exactly its tokens.
        drafted += 1
        assert len(reply) == 1
        assert tokens.tolist() == json.loads(reply[0])["tokens"]
        assert ((tokens >= 0) & (tokens < NEEDS.vocab_size)).all()
    # Some mutations leave the reply valid (a timing's value, a token's
    # digit): those steps draft, and the plan comes back for them.
    assert drafted > 0
    # Most steps got to their PROPOSE (a step whose retry's PONG came late
    # does not send one).
    assert scripted_server.ops().count("PROPOSE") >= 1000


def test_timeout_gives_no_draft_and_renews_the_socket(plan, scripted_server):
    answered = threading.Event()

    def slow(header, frames):
        time.sleep(0.6)
        answered.set()
        return scripted_server.default(header, frames)

    scripted_server.handlers["PROPOSE"] = slow
    assert (plan.run(_step(["a"])).tokens == -1).all()
    assert plan.server is None and plan.retained["a"].stale
    del scripted_server.handlers["PROPOSE"]
    answered.wait()
    result = plan.run(_step(["a"]))
    assert (result.tokens == 5).all()
    assert scripted_server.ops()[-3:] == ["PING", "FREE", "PROPOSE"]


def test_unreachable_server_never_blocks_a_step_for_the_timeout():
    client = DraftClient(f"tcp://127.0.0.1:{free_tcp_port()}", timeout_ms=5000)
    plan = RemotePlan(client, NEEDS, retry_interval_s=0.0)
    try:
        for _ in range(3):
            start = time.monotonic()
            assert (plan.run(_step(["a"])).tokens == -1).all()
            # Far below the 5 s timeout: the retry waited only for its probe.
            assert time.monotonic() - start < 2.5
    finally:
        client.close()


def test_late_pong_brings_the_client_back_on_a_later_step(fresh_plan, scripted_server):
    ping = scripted_server.handlers["PING"] = _answer_after(scripted_server, 0.15)
    assert (fresh_plan.run(_step(["a"])).tokens == -1).all()
    assert fresh_plan.server is None and scripted_server.ops() == ["PING"]
    ping.answered.wait()
    time.sleep(0.05)
    assert (fresh_plan.run(_step(["a"])).tokens == 5).all()
    assert scripted_server.ops() == ["PING", "PROPOSE"]


def test_pong_not_come_within_the_timeout_is_given_up(fresh_plan, scripted_server):
    ping = scripted_server.handlers["PING"] = _answer_after(scripted_server, 0.6)
    fresh_plan.run(_step(["a"]))
    time.sleep(0.35)
    # Past the 300 ms timeout: the PING is dropped with its socket.
    assert (fresh_plan.run(_step(["a"])).tokens == -1).all()
    retry = scripted_server.handlers["PING"] = _answer_after(scripted_server, 0.0)
    ping.answered.wait()
    # The retry's PING leaves with the next step, which waits only 20 ms for
    # its PONG: on a loaded machine it is the step after that one that drafts.
    fresh_plan.run(_step(["a"]))
    retry.answered.wait()
    time.sleep(0.05)
    assert (fresh_plan.run(_step(["a"])).tokens == 5).all()
    assert scripted_server.ops()[:3] == ["PING", "PING", "PROPOSE"]


def _answer_after(server: Any, delay_s: float) -> Any:
    """A PING handler that answers after ``delay_s``; ``.answered`` is set
    once it has."""
    answered = threading.Event()

    def handler(header, frames):
        time.sleep(delay_s)
        answered.set()
        return server.default(header, frames)

    handler.answered = answered  # type: ignore[attr-defined]
    return handler


def test_stale_requests_are_freed_before_they_are_reset(plan, scripted_server):
    scripted_server.handlers["PROPOSE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["a", "b"]))
    del scripted_server.handlers["PROPOSE"]
    scripted_server.log.clear()
    result = plan.run(_step(["a", "b"], first=4))
    assert (result.tokens == 5).all()
    ops = scripted_server.ops()
    assert ops.index("FREE") < ops.index("PROPOSE")
    free = scripted_server.log[ops.index("FREE")][1]
    assert sorted(free["request_ids"]) == ["a", "b"]
    propose = scripted_server.log[ops.index("PROPOSE")][1]
    assert all(r["reset"] and r["reset_position"] == 4 for r in propose["requests"])


def test_failing_free_keeps_requests_stale(plan, scripted_server):
    scripted_server.handlers["PROPOSE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["a"]))
    del scripted_server.handlers["PROPOSE"]
    scripted_server.handlers["FREE"] = lambda h, f: MALFORMED["error reply"]
    result = plan.run(_step(["a", "b"], first=4))
    assert (result.tokens[0] == -1).all() and (result.tokens[1] == 5).all()
    assert plan.retained["a"].stale
    del scripted_server.handlers["FREE"]
    assert (plan.run(_step(["a", "b"], first=8)).tokens[0] == 5).all()
    assert not plan.retained["a"].stale


def _hold_at_most(plan: RemotePlan, server: Any, max_requests: int) -> None:
    """Shake hands again with a server that holds ``max_requests`` requests,
    for an engine of as many sequences."""
    plan.needs = dataclasses.replace(plan.needs, max_num_seqs=max_requests)
    server.pong["max_requests"] = max_requests
    plan.connect()


def test_request_whose_eviction_failed_is_freed_and_reset_when_it_returns(
    plan, scripted_server
):
    _hold_at_most(plan, scripted_server, 1)
    plan.run(_step(["a"]))
    scripted_server.handlers["FREE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["b"]))  # a is evicted for b; its FREE fails
    del scripted_server.handlers["FREE"]
    scripted_server.log.clear()
    assert (plan.run(_step(["a"], first=4)).tokens == 5).all()
    assert scripted_server.ops() == ["FREE", "PROPOSE"]
    assert scripted_server.log[1][1]["requests"][0]["reset"]


def test_eviction_never_frees_a_request_of_the_batch(plan, scripted_server):
    _hold_at_most(plan, scripted_server, 2)
    plan.run(_step(["a"]))  # a holds [0, 4)
    scripted_server.log.clear()
    tokens = np.arange(64, dtype=np.int32)
    requests = [
        StepRequest("a", 4, 4, 9, 0, tokens),
        StepRequest("b", 0, 4, 9, 4, tokens),
        StepRequest("c", 0, 4, 9, 8, tokens),
    ]
    rows = torch.zeros(12, WIDTH, dtype=torch.bfloat16)
    result = plan.run(StepInputs(requests, K, rows))
    # No room for c: it gets no draft; a continues where it was.
    assert result.tokens.tolist() == [[5] * K, [5] * K, [NO_DRAFT] * K]
    assert scripted_server.ops() == ["PROPOSE"]
    assert not scripted_server.log[0][1]["requests"][0]["reset"]


def test_request_anchored_at_the_model_length_is_not_sent(plan, scripted_server):
    anchored = StepRequest("a", NEEDS.max_model_len - 4, 4, 9, 0, None)
    rows = torch.zeros(4, WIDTH, dtype=torch.bfloat16)
    result = plan.run(StepInputs([anchored], K, rows))
    assert (result.tokens == NO_DRAFT).all()
    assert scripted_server.ops() == ["PING"]


def test_refused_reconnect_cold_bootstraps_and_is_not_retried_below_its_end(
    plan, scripted_server
):
    plan.run(_step(["src"], count=40))
    scripted_server.handlers["RECONNECT"] = lambda h, f: MALFORMED["error reply"]
    scripted_server.log.clear()
    result = plan.run(_step(["new"], first=32, count=4))
    assert (result.tokens == 5).all()
    assert scripted_server.ops() == ["RECONNECT", "PROPOSE"]
    entry = scripted_server.log[1][1]["requests"][0]
    assert entry["reset"] and entry["reset_position"] == 32
    scripted_server.log.clear()
    # Only the refused source covers position 20: its cache lost it.
    plan.run(_step(["other"], first=20, count=4))
    assert scripted_server.ops() == ["PROPOSE"]


def test_source_refused_at_a_prefix_end_is_not_retried_at_it(plan, scripted_server):
    _hold_at_most(plan, scripted_server, 2)
    plan.run(_step(["src"], count=40))
    scripted_server.handlers["RECONNECT"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["new"], first=32, count=4))  # refused: new holds [32, 36)
    scripted_server.log.clear()
    # new is evicted for other, which leaves src the only source reaching 32.
    tokens = np.arange(64, dtype=np.int32)
    requests = [
        StepRequest("src", 40, 4, 9, 0, tokens),
        StepRequest("other", 32, 4, 9, 4, tokens),
    ]
    plan.run(StepInputs(requests, K, torch.zeros(8, WIDTH, dtype=torch.bfloat16)))
    assert scripted_server.ops() == ["FREE", "PROPOSE"]
    assert scripted_server.log[0][1]["request_ids"] == ["new"]


def test_source_refused_at_one_prefix_end_still_serves_a_later_one(
    plan, scripted_server
):
    plan.run(_step(["src"], count=40))
    scripted_server.handlers["RECONNECT"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["new"], first=16, count=4))
    del scripted_server.handlers["RECONNECT"]
    scripted_server.log.clear()
    # The source's own resume past the refused end (a preempted request).
    plan.run(_step(["src"], first=36, count=4))
    assert scripted_server.ops() == ["RECONNECT", "PROPOSE"]
    assert not scripted_server.log[1][1]["requests"][0]["reset"]


# Replies to the RECONNECT of "new" at prefix end 32: header fields, frames.
MALFORMED_RECONNECT: dict[str, tuple[dict[str, Any], list[bytes]]] = {
    "no restored_start": ({}, []),
    "restored after the prefix end": ({"restored_start": 33}, []),
    "negative restored_start": ({"restored_start": -1}, []),
    "another prefix end": ({"restored_start": 16, "prefix_end": 24}, []),
    "extra frame": ({"restored_start": 0}, [b"\x00" * 8]),
}


@pytest.mark.parametrize(
    "fields, frames", MALFORMED_RECONNECT.values(), ids=MALFORMED_RECONNECT.keys()
)
def test_malformed_reconnect_reply_gives_no_draft_and_marks_stale(
    plan, scripted_server, fields, frames
):
    plan.run(_step(["src"], count=40))
    scripted_server.handlers["RECONNECT"] = lambda h, f: [
        protocol.encode_header(
            protocol.ok_reply(
                "RECONNECT",
                server_id=SERVER_ID,
                **{"prefix_end": h["prefix_end"], **fields},
            )
        ),
        *frames,
    ]
    result = plan.run(_step(["new"], first=32, count=4))
    assert (result.tokens == NO_DRAFT).all()
    assert plan.retained["new"].stale
    assert not plan.retained["src"].reconnectable


def test_retained_request_reconnects_from_another_source(plan, scripted_server):
    plan.run(_step(["a"], count=8))  # a holds [0, 8)
    plan.run(_step(["src"], count=40))  # src holds [0, 40); a not in this step
    scripted_server.log.clear()
    # a resumes at 32 (a prefix-cache hit past its own end): RECONNECT from src.
    result = plan.run(_step(["a"], first=32, count=4))
    assert scripted_server.ops() == ["RECONNECT", "PROPOSE"]
    assert (result.tokens == 5).all()
    state = plan.retained["a"]
    assert (state.end, state.stale) == (36, False)
    tokens = np.arange(64, dtype=np.int32)
    assert state.tokens is not None and state.tokens.prefix_equals(tokens, 36)


def test_reconnect_prefers_the_source_holding_the_most_history(plan, scripted_server):
    def restore_8_back(header, frames):
        reply = protocol.ok_reply(
            "RECONNECT",
            server_id=SERVER_ID,
            restored_start=header["prefix_end"] - 8,
            prefix_end=header["prefix_end"],
            latency_ms=0.1,
        )
        return [protocol.encode_header(reply)]

    scripted_server.handlers["RECONNECT"] = restore_8_back
    plan.run(_step(["src"], count=40))  # src holds [0, 40)
    plan.run(_step(["late"], first=24, count=12))  # from src: late holds [16, 36)
    assert plan.retained["late"].start == 16
    scripted_server.log.clear()
    # late is the most recently used, but src's K/V reaches further back.
    plan.run(_step(["new"], first=32, count=4))
    assert scripted_server.log[0][1]["source_request_id"] == "src"


def test_without_shared_prefixes_another_source_is_not_used(plan, scripted_server):
    plan.share_prefixes = False
    plan.run(_step(["a"], count=8))
    plan.run(_step(["src"], count=40))
    scripted_server.log.clear()
    result = plan.run(_step(["a"], first=32, count=4))
    assert scripted_server.ops() == ["PROPOSE"]
    assert scripted_server.log[0][1]["requests"][0]["reset"]
    assert (result.tokens == 5).all()


def test_request_id_the_protocol_cannot_carry_gets_no_draft(plan, scripted_server):
    long_id = "x" * (protocol.MAX_REQUEST_ID_CHARS + 1)
    for _ in range(3):
        result = plan.run(_step(["a", long_id]))
        assert (result.tokens[0] == 5).all() and (result.tokens[1] == NO_DRAFT).all()
    assert "FREE" not in scripted_server.ops()
    for _, header in scripted_server.log:
        assert [r["request_id"] for r in header.get("requests", [])] in ([], ["a"])
    assert long_id not in plan.retained


# The first and the last token of the prefix [0, 32).
@pytest.mark.parametrize("position", [3, 31])
def test_reconnect_needs_identical_tokens(plan, scripted_server, position):
    plan.run(_step(["src"], count=40))
    scripted_server.log.clear()
    step = _step(["new"], first=32, count=4)
    changed = step.requests[0].tokens.copy()
    changed[position] += 1
    step = StepInputs([StepRequest("new", 32, 4, 9, 0, changed)], K, step.rows)
    plan.run(step)
    assert scripted_server.ops() == ["PROPOSE"]
    assert scripted_server.log[0][1]["requests"][0]["reset"]


def test_server_restart_forgets_retained_requests(plan, scripted_server):
    plan.run(_step(["a"]))
    scripted_server.handlers["PROPOSE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["a"], first=4))
    del scripted_server.handlers["PROPOSE"]
    scripted_server.pong["server_id"] = "scripted-2"
    scripted_server.log.clear()
    plan.run(_step(["a"], first=8))
    assert scripted_server.ops() == ["PING", "PROPOSE"]
    assert scripted_server.log[1][1]["requests"][0]["reset"]


def test_a_free_answered_by_a_restarted_server_ends_the_step(plan, scripted_server):
    scripted_server.handlers["PROPOSE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["a"]))
    del scripted_server.handlers["PROPOSE"]
    scripted_server.handlers["FREE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["b"]))  # a stays stale: every step FREEs it first
    del scripted_server.handlers["FREE"]
    scripted_server.pong["server_id"] = "scripted-2"
    scripted_server.log.clear()
    result = plan.run(_step(["c"]))
    assert (result.tokens == NO_DRAFT).all()
    assert scripted_server.ops() == ["FREE"]
    result = plan.run(_step(["c"]))
    assert (result.tokens == 5).all()
    assert scripted_server.ops()[1:] == ["PING", "PROPOSE"]


class _ConsumeBugOnce(ProposeExtension):
    """A propose extension whose first ``consume`` fails with a bug (an
    exception other than ``ProtocolError``)."""

    capability = "test_cap_v1"

    def __init__(self) -> None:
        self.calls = 0

    def request_fields(self, num_speculative_tokens: int) -> dict[str, Any]:
        return {}

    def consume(self, metadata, frames, proposal):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("extension bug")
        return None


def test_requests_of_a_propose_that_raised_unexpectedly_are_freed_next_step(
    scripted_server,
):
    # The server answered, so it holds "a"; the error escapes the plan (a
    # deferred reply thread logs it and goes on), and "a" never comes back.
    scripted_server.pong["capabilities"].append(_ConsumeBugOnce.capability)
    scripted_server.handlers["PROPOSE"] = lambda header, frames: _reply(
        tokens=[[1, 2, 3]] * len(header["requests"]),
        extensions=[{"capability": _ConsumeBugOnce.capability, "num_frames": 0}],
    )
    client = DraftClient(scripted_server.address, timeout_ms=300)
    needs = dataclasses.replace(
        NEEDS, capabilities=frozenset({_ConsumeBugOnce.capability})
    )
    plan = RemotePlan(client, needs, [_ConsumeBugOnce()], retry_interval_s=0.0)
    try:
        with pytest.raises(ValueError, match="extension bug"):
            plan.run(_step(["a"]))
        scripted_server.log.clear()
        assert plan.run(_step(["b"])).tokens.tolist() == [[1, 2, 3]]
    finally:
        client.close()
    frees = [header for op, header in scripted_server.log if op == "FREE"]
    assert [free["request_ids"] for free in frees] == [["a"]]


def _free_reply(active: int):
    return lambda header, frames: [
        protocol.encode_header(
            protocol.ok_reply("FREE", server_id=SERVER_ID, active_requests=active)
        )
    ]


def test_requests_the_server_holds_past_the_plans_knowledge_are_cleared(
    plan, scripted_server
):
    """A PROPOSE that reached the server after the FREE of its requests (late,
    past a timeout) left a request there that no FREE will ever name: the
    server is cleared and every request starts afresh."""
    plan.run(_step(["a", "b"]))
    scripted_server.handlers["PROPOSE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["a", "b"], first=4))
    del scripted_server.handlers["PROPOSE"]
    # After the FREE of the stale a and b, the server still holds one.
    scripted_server.handlers["FREE"] = _free_reply(1)
    scripted_server.log.clear()
    result = plan.run(_step(["c"], first=0))
    assert (result.tokens == 5).all()
    assert scripted_server.ops()[-3:] == ["FREE", "CLEAR", "PROPOSE"]
    assert list(plan.retained) == ["c"]


def test_a_server_holding_only_the_plans_requests_is_not_cleared(plan, scripted_server):
    plan.run(_step(["a", "b"]))
    scripted_server.handlers["PROPOSE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["a"], first=4))
    del scripted_server.handlers["PROPOSE"]
    scripted_server.handlers["FREE"] = _free_reply(1)  # b
    scripted_server.log.clear()
    result = plan.run(_step(["b"], first=4))
    assert (result.tokens == 5).all()
    assert "CLEAR" not in scripted_server.ops()
    assert list(plan.retained) == ["b"]


def test_a_refused_clear_leaves_every_retained_request_stale(plan, scripted_server):
    plan.run(_step(["a", "b"]))
    scripted_server.handlers["PROPOSE"] = lambda h, f: MALFORMED["error reply"]
    plan.run(_step(["a"], first=4))
    del scripted_server.handlers["PROPOSE"]
    # The FREE of the stale a finds more requests than b: CLEAR, refused.
    scripted_server.handlers["FREE"] = _free_reply(2)
    scripted_server.handlers["CLEAR"] = lambda h, f: MALFORMED["error reply"]
    plan.connect()
    plan.run(_step(["a"], first=4))
    assert scripted_server.ops()[-2:] == ["FREE", "CLEAR"]
    assert list(plan.retained) == ["b"] and plan.retained["b"].stale
    del scripted_server.handlers["FREE"], scripted_server.handlers["CLEAR"]
    plan.connect()
    scripted_server.log.clear()
    assert (plan.run(_step(["b"], first=4)).tokens == 5).all()
    assert scripted_server.ops() == ["FREE", "PROPOSE"]
    free, propose = (header for _, header in scripted_server.log)
    assert free["request_ids"] == ["b"] and propose["requests"][0]["reset"]


def _failing_propose(header, frames):
    error = protocol.error_reply(RuntimeError("sticky fault"), SERVER_ID)
    return [protocol.encode_header(error)]


@pytest.fixture
def online_plan(scripted_server):
    """``online_plan(retry_interval_s)``: a plan that has shaken hands."""
    clients = []

    def make(retry_interval_s: float) -> RemotePlan:
        client = DraftClient(scripted_server.address, timeout_ms=300)
        clients.append(client)
        plan = RemotePlan(client, NEEDS, retry_interval_s=retry_interval_s)
        plan.connect()
        return plan

    yield make
    for client in clients:
        client.close()


def test_error_replies_in_a_row_back_off_as_an_unreachable_server(
    online_plan, scripted_server
):
    plan = online_plan(60.0)
    scripted_server.handlers["PROPOSE"] = _failing_propose
    for _ in range(6):
        assert (plan.run(_step(["a"])).tokens == -1).all()
    # The first failure is retried at once; the second backs off.
    assert scripted_server.ops().count("PROPOSE") == 2
    assert plan.server is None


def _slow_propose(scripted_server, answered: threading.Event):
    """A PROPOSE handler that answers after the plan's 300 ms timeout."""

    def slow(header, frames):
        time.sleep(0.5)
        answered.set()
        return scripted_server.default(header, frames)

    return slow


def test_a_single_timeout_costs_one_step_not_the_retry_interval(
    online_plan, scripted_server
):
    plan = online_plan(60.0)
    answered = threading.Event()
    scripted_server.handlers["PROPOSE"] = _slow_propose(scripted_server, answered)
    assert (plan.run(_step(["a"])).tokens == -1).all()
    del scripted_server.handlers["PROPOSE"]
    assert answered.wait(5)
    # Retried at once (handshake, FREE of the stale request, PROPOSE), not
    # after the 60 s interval.
    assert (plan.run(_step(["a"])).tokens == 5).all()
    assert scripted_server.ops()[-3:] == ["PING", "FREE", "PROPOSE"]


def test_timeouts_in_a_row_back_off_as_an_unreachable_server(
    online_plan, scripted_server
):
    plan = online_plan(60.0)
    answered = threading.Event()
    scripted_server.handlers["PROPOSE"] = _slow_propose(scripted_server, answered)
    for _ in range(2):
        answered.clear()
        assert (plan.run(_step(["a"])).tokens == -1).all()
        assert answered.wait(5), "the second step did not retry the PROPOSE"
    calls = len(scripted_server.ops())
    for _ in range(3):
        assert (plan.run(_step(["a"])).tokens == -1).all()
    assert len(scripted_server.ops()) == calls and plan.server is None


def test_a_successful_propose_forgives_earlier_error_replies(
    online_plan, scripted_server
):
    plan = online_plan(0.05)
    scripted_server.handlers["PROPOSE"] = _failing_propose
    plan.run(_step(["a"]))
    plan.run(_step(["a"]))  # second in a row: offline for 0.05 s
    del scripted_server.handlers["PROPOSE"]
    time.sleep(0.1)
    for _ in range(100):  # the retry's PONG may come a step late
        if (plan.run(_step(["a"])).tokens >= 0).all():
            break
        time.sleep(0.05)
    else:
        pytest.fail("the plan never came back online")
    scripted_server.handlers["PROPOSE"] = _failing_propose
    plan.run(_step(["a"]))
    proposes = scripted_server.ops().count("PROPOSE")
    # One failure since the success: retried on the very next step.
    plan.run(_step(["a"]))
    assert scripted_server.ops().count("PROPOSE") == proposes + 1


class _Clock:
    """``plan``'s ``time``, its monotonic clock set by the test."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("max_retry_interval_s", "pings"),
    [(60.0, [0, 2, 5, 10, 19]), (4.0, [0, 2, 5, 10, 15, 20])],
)
def test_retries_of_an_unreachable_server_back_off_doubling_to_the_maximum(
    monkeypatch, max_retry_interval_s, pings
):
    """Each PING goes unanswered for the 1 s timeout; the next is due 1 s
    after the first failure, then twice as long after each (capped)."""
    clock = _Clock()
    monkeypatch.setattr(plan_module, "time", clock)
    client = DraftClient(f"tcp://127.0.0.1:{free_tcp_port()}", timeout_ms=1000)
    plan = RemotePlan(
        client,
        NEEDS,
        retry_interval_s=1.0,
        max_retry_interval_s=max_retry_interval_s,
    )
    sent: list[float] = []
    start_handshake = client.start_handshake

    def record_ping(watch: bool = False) -> None:
        sent.append(clock.now)
        start_handshake(watch)

    monkeypatch.setattr(client, "start_handshake", record_ping)
    try:
        for tick in range(81):
            clock.now = tick / 4
            assert (plan.run(_step(["a"])).tokens == -1).all()
    finally:
        client.close()
    assert sent == pings


def test_a_server_that_answers_pings_but_fails_every_propose_is_retried_doubling(
    monkeypatch, scripted_server
):
    """Each retry's handshake succeeds and its PROPOSE fails: the handshake
    does not reset the backoff, so in 20 s the server sees a handful of
    PROPOSEs (1, 2, 4, 8 s apart), not one per retry interval."""
    clock = _Clock()
    monkeypatch.setattr(plan_module, "time", clock)
    scripted_server.handlers["PROPOSE"] = _failing_propose
    client = DraftClient(scripted_server.address, timeout_ms=1000)
    plan = RemotePlan(client, NEEDS, retry_interval_s=1.0, max_retry_interval_s=60.0)
    try:
        plan.connect()
        for tick in range(81):
            clock.now = tick / 4
            assert (plan.run(_step(["a"])).tokens == -1).all()
    finally:
        client.close()
    assert 4 <= scripted_server.ops().count("PROPOSE") <= 8, scripted_server.ops()
