# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draft server semantics per op, on the real server core and reference engine
(in process; the transport is covered by test_server_process.py)."""

import dataclasses
import json
import logging
import threading
from typing import Any

import pytest
import torch
from k3_layer1_server import DEFAULT_OPTIONS, entry, propose_message

from vllm.k3_draft import protocol
from vllm.k3_draft.engine import DraftLimits
from vllm.k3_draft.reference_engine import ReferenceEngine, ReferenceModelConfig
from vllm.k3_draft.server import DraftServer, ServerStats

WIDTH = DEFAULT_OPTIONS["context_width"]
LIMITS = DraftLimits(
    max_requests=4,
    max_batch_size=3,
    max_speculative_tokens=4,
    max_context_tokens=256,
    max_model_len=1024,
    block_size=16,
    window_size=64,
    prefix_cache_tokens=128,
)


def make_server() -> DraftServer:
    engine = ReferenceEngine(
        LIMITS, ReferenceModelConfig(context_width=WIDTH), torch.device("cpu")
    )
    engine.load()
    return DraftServer(engine)


@pytest.fixture
def server() -> DraftServer:
    return make_server()


def call(server: DraftServer, op: str, **fields: Any) -> dict[str, Any]:
    header = protocol.encode_header(protocol.request_header(op, **fields))
    return json.loads(server.handle([header])[0])


def propose(server: DraftServer, entries, k: int = 3, seed: int = 0, **fields):
    reply = server.handle(propose_message(entries, k, WIDTH, seed, **fields))
    return json.loads(bytes(reply[0]))


def error_of(reply: dict[str, Any]) -> str:
    assert reply["ok"] is False and reply["op"] == "ERROR"
    return reply["error"]


def state(server: DraftServer) -> dict[str, tuple[int, int, int, int]]:
    return {rid: (s.slot, s.start, s.end, s.high) for rid, s in server.requests.items()}


def full_state(server: DraftServer) -> dict[str, tuple[int, ...]]:
    return {rid: dataclasses.astuple(s) for rid, s in server.requests.items()}


def test_pong_carries_every_pong_field(server):
    pong = call(server, "PING")
    assert set(pong) == {"ok", "protocol", "op", *protocol.PONG_FIELDS}
    assert pong["op"] == "PONG" and pong["max_requests"] == 4


def test_every_reply_names_the_server_process(server):
    replies = [
        call(server, "PING"),
        propose(server, [entry("a", 20, 20, reset=True)]),
        call(server, "RECONNECT", source_request_id="a", request_id="b", prefix_end=20),
        call(server, "RESET", request_ids=["a"]),
        call(server, "FREE", request_ids=["a"]),
        call(server, "CLEAR"),
        call(server, "FREE", request_ids=[""]),
        propose(server, [entry("c", 3, 0)]),
        json.loads(server.handle([b"\xff"])[0]),
    ]
    assert [reply["ok"] for reply in replies] == [True] * 6 + [False] * 3
    assert {reply["server_id"] for reply in replies} == {server.server_id}
    assert make_server().server_id != server.server_id


def test_propose_returns_k_tokens_per_request_and_timings(server):
    reply = propose(
        server, [entry("a", 20, 20, reset=True), entry("b", 9, 9, reset=True)]
    )
    assert [len(t) for t in reply["tokens"]] == [3, 3]
    assert set(reply["timing_ms"]) == set(protocol.TIMING_FIELDS)
    assert reply["latency_ms"] == reply["timing_ms"]["total"]


def test_a_status_snapshot_waits_for_a_propose_in_the_engine(server, monkeypatch):
    # The status thread reads the request table and counters only under the
    # lock a PROPOSE holds while its engine runs.
    inside, release = threading.Event(), threading.Event()
    engine_propose = server.engine.propose

    def held_propose(batch):
        inside.set()
        assert release.wait(30)
        return engine_propose(batch)

    monkeypatch.setattr(server.engine, "propose", held_propose)
    replies: list[dict[str, Any]] = []
    proposer = threading.Thread(
        target=lambda: replies.append(propose(server, [entry("a", 20, 20, reset=True)]))
    )
    proposer.start()
    snapshots: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: snapshots.append(server.snapshot()))
    try:
        assert inside.wait(30)
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and not snapshots
    finally:
        release.set()
        proposer.join(30)
    reader.join(30)
    assert replies[0]["ok"] and snapshots[0]["active_requests"] == 1


def test_propose_advances_the_committed_end(server):
    propose(server, [entry("a", 20, 20, reset=True)])
    propose(server, [entry("a", 24, 4)])
    assert state(server)["a"] == (0, 0, 24, 24)


def test_reset_position_starts_a_request_mid_sequence(server):
    propose(server, [entry("a", 110, 10, reset=True, reset_position=100)])
    assert state(server)["a"] == (0, 100, 110, 110)


def test_reset_with_context_not_at_reset_position_is_refused(server):
    reply = propose(server, [entry("a", 110, 10, reset=True, reset_position=99)])
    assert "resets at 99" in error_of(reply)


def test_unknown_request_without_reset_is_refused(server):
    assert "unknown request" in error_of(propose(server, [entry("x", 4, 4)]))


def test_anchor_must_equal_the_committed_end_without_context(server):
    propose(server, [entry("a", 20, 20, reset=True)])
    assert "committed end 20" in error_of(propose(server, [entry("a", 21)]))


def test_context_after_the_committed_end_is_refused(server):
    propose(server, [entry("a", 20, 20, reset=True)])
    # Rows from 21 would leave position 20 without KV.
    reply = propose(server, [entry("a", 26, 5)])
    assert "starts at 21, after its committed end 20" in error_of(reply)
    assert state(server)["a"] == (0, 0, 20, 20)


def test_rewind_overwrites_rejected_rows(server):
    propose(server, [entry("a", 20, 20, reset=True)])
    reply = propose(server, [entry("a", 19, 3)])
    assert reply["ok"] and state(server)["a"] == (0, 0, 19, 20)


def test_rewind_beyond_the_block_is_refused(server):
    propose(server, [entry("a", 40, 40, reset=True)])
    assert "rewinds to 23" in error_of(propose(server, [entry("a", 25, 2)]))


def overhanging_server(overhang: int) -> DraftServer:
    """A server whose engine says its query pass writes K/V ``overhang``
    positions at or past a request's end."""
    engine = ReferenceEngine(
        LIMITS, ReferenceModelConfig(context_width=WIDTH), torch.device("cpu")
    )
    engine.spec = dataclasses.replace(engine.spec, query_kv_overhang=overhang)
    engine.load()
    return DraftServer(engine)


def test_rewind_is_shortened_by_the_engines_query_kv_overhang():
    # Block 16 less an overhang of 4: a rewind from 40 reaches back to 28.
    server = overhanging_server(4)
    propose(server, [entry("a", 40, 40, reset=True)])
    assert "rewinds to 27" in error_of(propose(server, [entry("a", 29, 2)]))
    assert propose(server, [entry("a", 30, 2)])["ok"]


def test_an_overhang_of_a_whole_block_serves_without_rewinds():
    server = overhanging_server(LIMITS.block_size)
    propose(server, [entry("a", 40, 40, reset=True)])
    assert "rewinds to 39" in error_of(propose(server, [entry("a", 40, 1)]))
    assert propose(server, [entry("a", 41, 1)])["ok"]


def test_an_overhang_beyond_the_block_is_refused_at_start_up():
    with pytest.raises(ValueError, match="below the engine's query K/V overhang"):
        overhanging_server(LIMITS.block_size + 1)


def test_rewind_is_bounded_from_the_highest_position_written(server):
    # The ring still holds what was written up to 40, not up to the end an
    # earlier rewind left: a second rewind is measured from 40.
    propose(server, [entry("a", 40, 40, reset=True)])
    assert propose(server, [entry("a", 35, 2)])["ok"]
    assert "rewinds to 22" in error_of(propose(server, [entry("a", 24, 2)]))
    assert state(server)["a"] == (0, 0, 35, 40)


def test_rewind_reaches_no_further_back_than_a_long_propose_wrote_kv():
    # A cache of one window: a 100-row PROPOSE keeps (and writes K/V for) its
    # last 64 rows, so a rewind may only resend the last row.
    limits = dataclasses.replace(LIMITS, prefix_cache_tokens=LIMITS.window_size)
    engine = ReferenceEngine(
        limits, ReferenceModelConfig(context_width=WIDTH), torch.device("cpu")
    )
    engine.load()
    small = DraftServer(engine)
    propose(small, [entry("a", 100, 100, reset=True)])
    assert "rewinds to 98" in error_of(propose(small, [entry("a", 99, 1)]))
    assert propose(small, [entry("a", 100, 1)])["ok"]


def test_rewind_before_the_valid_start_is_refused(server):
    propose(server, [entry("a", 104, 4, reset=True, reset_position=100)])
    assert "rewinds to 99" in error_of(propose(server, [entry("a", 105, 6)]))


def test_same_proposal_twice_gives_the_same_tokens(server):
    propose(server, [entry("a", 50, 50, reset=True)])
    first = propose(server, [entry("a", 50)])["tokens"]
    assert propose(server, [entry("a", 50)])["tokens"] == first


def test_tokens_do_not_depend_on_batch_companions(server):
    rows_a, rows_b = (
        torch.randn(30, WIDTH).bfloat16(),
        torch.randn(12, WIDTH).bfloat16(),
    )
    header_a = protocol.request_header(
        "PROPOSE", num_speculative_tokens=3, requests=[entry("a", 30, 30, reset=True)]
    )
    alone = server.handle(
        [
            protocol.encode_header(header_a),
            protocol.tensor_frame(torch.arange(30)),
            protocol.tensor_frame(rows_a),
        ]
    )
    header_ba = protocol.request_header(
        "PROPOSE",
        num_speculative_tokens=3,
        requests=[entry("b", 12, 12, reset=True), entry("a2", 30, 30, reset=True)],
    )
    batch = server.handle(
        [
            protocol.encode_header(header_ba),
            protocol.tensor_frame(torch.cat((torch.arange(12), torch.arange(30)))),
            protocol.tensor_frame(torch.cat((rows_b, rows_a))),
        ]
    )
    tokens_alone = json.loads(alone[0])["tokens"]
    assert json.loads(batch[0])["tokens"][1] == tokens_alone[0]


def test_invalid_entry_rejects_the_whole_batch(server):
    propose(server, [entry("a", 20, 20, reset=True)])
    before = state(server)
    reply = propose(server, [entry("new", 5, 5, reset=True), entry("a", 99)])
    assert "committed end" in error_of(reply) and state(server) == before


def test_an_engine_failure_drops_the_requests_of_its_batch(server, monkeypatch):
    propose(server, [entry("a", 20, 20, reset=True), entry("b", 9, 9, reset=True)])

    def fault(batch):
        raise RuntimeError("device fault")

    monkeypatch.setattr(server.engine, "propose", fault)
    assert "device fault" in error_of(propose(server, [entry("a", 24, 4)]))
    # Rows 20..24 of "a" may never have reached its K/V: "a" is dropped (a
    # client must reset it), its slot is free, "b" is kept.
    assert list(state(server)) == ["b"]
    assert server.allocator.num_free == LIMITS.max_requests - 1


def test_request_ids_of_up_to_512_characters_are_served(server):
    longest = "x" * protocol.MAX_REQUEST_ID_CHARS
    assert len(propose(server, [entry(longest, 2, 2, reset=True)])["tokens"]) == 1
    assert call(server, "FREE", request_ids=[longest])["active_requests"] == 0


@pytest.mark.parametrize("op", ["PROPOSE", "FREE"])
def test_a_request_id_of_513_characters_is_refused(server, op):
    too_long = "x" * (protocol.MAX_REQUEST_ID_CHARS + 1)
    propose(server, [entry("a", 2, 2, reset=True)])
    before = full_state(server)
    if op == "PROPOSE":
        reply = propose(server, [entry(too_long, 2, 2, reset=True)])
    else:
        reply = call(server, "FREE", request_ids=["a", too_long])
    assert "at most 512 characters" in error_of(reply)
    assert full_state(server) == before


def test_more_new_requests_than_free_slots_are_refused(server):
    propose(server, [entry(f"r{i}", 2, 2, reset=True) for i in range(3)])
    reply = propose(
        server, [entry("x", 2, 2, reset=True), entry("y", 2, 2, reset=True)]
    )
    assert "free slots" in error_of(reply)


def test_batch_above_max_batch_size_is_refused(server):
    entries = [entry(f"r{i}", 2, 2, reset=True) for i in range(4)]
    assert "1 to 3 entries" in error_of(propose(server, entries))


def test_k_above_the_maximum_is_refused(server):
    reply = propose(server, [entry("a", 2, 2, reset=True)], k=5)
    assert "num_speculative_tokens" in error_of(reply)


def test_duplicate_request_ids_are_refused(server):
    reply = propose(
        server, [entry("a", 2, 2, reset=True), entry("a", 2, 2, reset=True)]
    )
    assert "twice" in error_of(reply)


def test_anchor_token_outside_the_vocabulary_is_refused(server):
    reply = propose(server, [entry("a", 2, 2, reset=True, anchor_token_id=1024)])
    assert "anchor_token_id" in error_of(reply)


def test_anchor_beyond_the_model_length_is_refused(server):
    reply = propose(server, [entry("a", 1024, 0, reset=True, reset_position=1000)])
    assert "anchor_position must be an integer in [0, 1024)" in error_of(reply)


def test_context_above_max_context_tokens_is_refused(server):
    reply = propose(server, [entry("a", 300, 257, reset=True, reset_position=43)])
    assert "context_count" in error_of(reply)


def test_batch_context_above_max_context_tokens_is_refused(server):
    # Each entry is within the limit; together they hold one row too many.
    reply = propose(
        server, [entry("a", 200, 200, reset=True), entry("b", 57, 57, reset=True)]
    )
    assert "257 context rows exceed max_context_tokens 256" in error_of(reply)
    assert state(server) == {}


def test_non_contiguous_positions_are_refused(server):
    frames = propose_message([entry("a", 4, 4, reset=True)], 3, WIDTH)
    frames[1] = protocol.tensor_frame(torch.tensor([0, 1, 3, 4]))
    assert "contiguous" in error_of(json.loads(server.handle(frames)[0]))


def test_truncated_rows_frame_is_refused(server):
    frames = propose_message([entry("a", 4, 4, reset=True)], 3, WIDTH)
    frames[2] = bytes(frames[2])[:-2]
    assert "context rows frame has" in error_of(json.loads(server.handle(frames)[0]))


def test_missing_frames_are_refused(server):
    frames = propose_message([entry("a", 4, 4, reset=True)], 3, WIDTH)
    reply = json.loads(server.handle(frames[:2])[0])
    assert "1 tensor frames, expected 2" in error_of(reply)


def test_unknown_header_field_is_refused(server):
    reply = propose(server, [entry("a", 2, 2, reset=True)], surprise=1)
    assert "unknown header fields ['surprise']" in error_of(reply)


def test_unknown_op_is_refused(server):
    assert "unknown op" in error_of(call(server, "SHUTDOWN"))


def test_reset_op_empties_known_requests_and_keeps_their_slots(server):
    propose(server, [entry("a", 20, 20, reset=True)])
    assert call(server, "RESET", request_ids=["a"])["active_requests"] == 1
    assert state(server)["a"] == (0, 0, 0, 0)


def test_reset_op_with_an_unknown_id_changes_nothing(server):
    propose(server, [entry("a", 20, 20, reset=True)])
    assert "unknown requests" in error_of(call(server, "RESET", request_ids=["a", "z"]))
    assert state(server)["a"] == (0, 0, 20, 20)


def test_free_releases_slots_and_ignores_unknown_ids(server):
    propose(server, [entry("a", 2, 2, reset=True), entry("b", 2, 2, reset=True)])
    assert call(server, "FREE", request_ids=["a", "zzz"])["active_requests"] == 1
    assert server.allocator.num_free == 3


def test_clear_drops_every_request(server):
    propose(server, [entry("a", 2, 2, reset=True), entry("b", 2, 2, reset=True)])
    assert call(server, "CLEAR") == {
        "ok": True,
        "protocol": 2,
        "op": "CLEAR",
        "server_id": server.server_id,
        "active_requests": 0,
    }


def test_reconnect_reproduces_the_source_proposal(server):
    propose(server, [entry("src", 100, 100, reset=True)])
    expected = propose(server, [entry("src", 100)])["tokens"]
    reply = call(
        server, "RECONNECT", source_request_id="src", request_id="dst", prefix_end=100
    )
    assert reply["restored_start"] == 32 and reply["prefix_end"] == 100
    assert propose(server, [entry("dst", 100)])["tokens"] == expected


def test_rewind_after_reconnect_drafts_as_the_whole_history_or_is_refused(server):
    # B reconnects from A at 128 (K/V restored from 64), then rewinds as far
    # as the server allows (16 positions). An anchor whose window [a - 64, a)
    # reaches before 64 is refused; any other drafts as a fresh server given
    # B's 128 rows directly.
    history = torch.randn(160, WIDTH, generator=torch.Generator().manual_seed(3))

    def send(target: DraftServer, rid: str, first: int, anchor: int, reset=False):
        request = entry(rid, anchor, anchor - first, reset, first if reset else 0)
        header = protocol.request_header(
            "PROPOSE", num_speculative_tokens=4, requests=[request]
        )
        reply = target.handle(
            [
                protocol.encode_header(header),
                protocol.tensor_frame(torch.arange(first, anchor)),
                protocol.tensor_frame(history[first:anchor].bfloat16()),
            ]
        )
        return json.loads(bytes(reply[0]))

    fresh = make_server()
    send(server, "A", 0, 160, reset=True)
    assert server.max_rewind == 16
    refused = accepted = 0
    for first in range(112, 128):
        for anchor in (first + 1, 128):
            reply = call(
                server,
                "RECONNECT",
                source_request_id="A",
                request_id="B",
                prefix_end=128,
            )
            assert reply["restored_start"] == 64
            before = full_state(server)
            got = send(server, "B", first, anchor)
            if anchor - LIMITS.window_size < 64:
                assert "before the restored start 64" in error_of(got)
                assert full_state(server) == before
                refused += 1
                continue
            send(fresh, "B", 0, 128, reset=True)
            assert got["tokens"] == send(fresh, "B", first, anchor)["tokens"]
            accepted += 1
    assert (refused, accepted) == (15, 17)


def test_reconnect_from_a_source_restored_after_the_window_start_is_refused(server):
    # B holds K/V from 80 only (restored from A at 150): it cannot restore the
    # window [32, 100) that C at 100 needs, though A's history has it.
    propose(server, [entry("A", 200, 200, reset=True)])
    reply = call(
        server, "RECONNECT", source_request_id="A", request_id="B", prefix_end=150
    )
    assert reply["restored_start"] == 80
    before = full_state(server)
    reply = call(
        server, "RECONNECT", source_request_id="B", request_id="C", prefix_end=100
    )
    assert "is not covered" in error_of(reply)
    assert full_state(server) == before


def test_a_request_reconnected_into_itself_still_serves_the_rows_it_holds(server):
    # A writes [0, 200) (its cache keeps [72, 200)), then resumes at 190 by a
    # RECONNECT from itself (K/V rebuilt from 112). Its cache still holds
    # [72, 190): a restore for B at 150 (from 80) drafts as a request that
    # stopped there; C at 140 needs 64, which the cache no longer holds.
    history = torch.randn(200, WIDTH, generator=torch.Generator().manual_seed(5))

    def send(rid: str, anchor: int, count: int = 0) -> dict[str, Any]:
        request = entry(rid, anchor, count, reset=count > 0)
        header = protocol.request_header(
            "PROPOSE", num_speculative_tokens=4, requests=[request]
        )
        frames = [protocol.encode_header(header)]
        if count:
            frames += [
                protocol.tensor_frame(torch.arange(anchor - count, anchor)),
                protocol.tensor_frame(history[anchor - count : anchor].bfloat16()),
            ]
        return json.loads(bytes(server.handle(frames)[0]))

    send("A", 200, 200)
    reply = call(
        server, "RECONNECT", source_request_id="A", request_id="A", prefix_end=190
    )
    assert reply["restored_start"] == 112
    reply = call(
        server, "RECONNECT", source_request_id="A", request_id="B", prefix_end=150
    )
    assert reply["ok"] and reply["restored_start"] == 80, reply
    send("ref", 150, 150)
    assert send("B", 150)["tokens"] == send("ref", 150)["tokens"]
    before = full_state(server)
    reply = call(
        server, "RECONNECT", source_request_id="A", request_id="C", prefix_end=140
    )
    assert "restore from 64 is not covered" in error_of(reply)
    assert full_state(server) == before


def test_cached_tokens_count_the_rows_a_request_reconnected_into_itself_kept(
    server,
):
    # A's cache keeps [72, 200); resumed at 190 from itself (K/V from 112), it
    # still holds rows [72, 190) for later restores.
    propose(server, [entry("A", 200, 200, reset=True)])
    reply = call(
        server, "RECONNECT", source_request_id="A", request_id="A", prefix_end=190
    )
    assert reply["restored_start"] == 112
    assert server.snapshot()["prefix_cache"]["cached_tokens"] == 190 - 72


def test_a_reconnect_into_itself_rebuilds_kv_of_the_restored_window_only(
    server, monkeypatch
):
    # A's cache holds [72, 190); only [112, 190) is restored (at most
    # window + block positions, so no two share a KV ring location).
    propose(server, [entry("A", 200, 200, reset=True)])
    restores = []
    restore = server.engine.restore

    def recorded(*args):
        restores.append(args)
        restore(*args)

    monkeypatch.setattr(server.engine, "restore", recorded)
    call(server, "RECONNECT", source_request_id="A", request_id="A", prefix_end=190)
    assert restores == [(0, 0, 112, 190)]


def test_cached_tokens_end_at_the_valid_end_after_a_rewind(server):
    propose(server, [entry("A", 40, 40, reset=True)])
    propose(server, [entry("A", 35, 2)])
    assert server.snapshot()["prefix_cache"]["cached_tokens"] == 35


def test_cache_capacity_counts_every_retained_request(server):
    capacity = server.snapshot()["prefix_cache"]["capacity_tokens"]
    assert capacity == LIMITS.prefix_cache_tokens * LIMITS.max_requests


def test_a_context_cache_below_window_plus_block_warns_of_refused_reconnects(caplog):
    with caplog.at_level(logging.WARNING):
        make_server()
    assert "RECONNECT" not in caplog.text
    small = dataclasses.replace(LIMITS, prefix_cache_tokens=64)
    engine = ReferenceEngine(
        small, ReferenceModelConfig(context_width=WIDTH), torch.device("cpu")
    )
    engine.load()
    with caplog.at_level(logging.WARNING):
        server = DraftServer(engine)
    assert "prefix_cache_tokens 64 is below window + block - 1 = 79" in caplog.text
    # The refusal it warns of: the restore for 100 spans [32, 100), 68 rows.
    propose(server, [entry("A", 100, 100, reset=True)])
    reply = call(
        server, "RECONNECT", source_request_id="A", request_id="B", prefix_end=100
    )
    assert "is not covered" in error_of(reply)


def test_reconnect_to_a_shorter_prefix_matches_a_request_that_stopped_there(server):
    frames = propose_message([entry("src", 90, 90, reset=True)], 3, WIDTH, seed=4)
    server.handle(frames)
    call(server, "RECONNECT", source_request_id="src", request_id="dst", prefix_end=70)
    server.handle(propose_message([entry("ref", 70, 70, reset=True)], 3, WIDTH, seed=4))
    ref = propose(server, [entry("ref", 70)])["tokens"]
    assert propose(server, [entry("dst", 70)])["tokens"] == ref


def test_reconnect_leaves_the_source_unchanged(server):
    propose(server, [entry("src", 100, 100, reset=True)])
    before = state(server)["src"]
    call(server, "RECONNECT", source_request_id="src", request_id="dst", prefix_end=80)
    assert state(server)["src"] == before and state(server)["dst"][1:] == (16, 80, 80)


def test_reconnect_before_the_source_origin_is_refused(server):
    propose(server, [entry("src", 150, 50, reset=True, reset_position=100)])
    before = full_state(server)
    reply = call(
        server, "RECONNECT", source_request_id="src", request_id="dst", prefix_end=99
    )
    assert "outside the source's history [100, 150]" in error_of(reply)
    assert full_state(server) == before


def test_reconnect_of_an_uncovered_prefix_is_an_error(server):
    for start in range(0, 250, 50):
        propose(server, [entry("src", start + 50, 50, reset=start == 0)])
    reply = call(
        server, "RECONNECT", source_request_id="src", request_id="d", prefix_end=150
    )
    assert "not covered" in error_of(reply) and "d" not in server.requests


@pytest.mark.parametrize("target", ["new", "existing"])
def test_a_failed_restore_drops_the_target_and_frees_its_slot(
    server, monkeypatch, target
):
    propose(server, [entry("src", 100, 100, reset=True)])
    if target == "existing":
        propose(server, [entry("dst", 40, 40, reset=True)])
    free_before = server.allocator.num_free + (target == "existing")

    def fault(*args):
        raise RuntimeError("copy fault")

    monkeypatch.setattr(server.engine, "restore", fault)
    reply = call(
        server, "RECONNECT", source_request_id="src", request_id="dst", prefix_end=100
    )
    # The target's K/V may be half written: it is gone, so only a reset
    # brings it back, and the source is untouched.
    assert "copy fault" in error_of(reply)
    assert list(state(server)) == ["src"]
    assert server.allocator.num_free == free_before
    assert "unknown request" in error_of(propose(server, [entry("dst", 100)]))


def test_reconnect_carrying_a_frame_counts_as_a_reconnect_failure(server):
    propose(server, [entry("src", 100, 100, reset=True)])
    before = state(server)
    header = protocol.request_header(
        "RECONNECT", source_request_id="src", request_id="dst", prefix_end=80
    )
    reply = server.handle([protocol.encode_header(header), b"\0" * 8])
    assert "carries 1 tensor frames" in error_of(json.loads(reply[0]))
    assert server.snapshot()["reconnect_failures"] == 1
    assert state(server) == before


def test_stats_count_requests_and_errors_by_op(server):
    call(server, "PING")
    call(server, "NOPE")
    snapshot = server.snapshot()
    assert snapshot["requests_by_op"] == {"PING": 1, "INVALID": 1}
    assert snapshot["errors_by_op"] == {"INVALID": 1}


def test_proposals_count_only_the_proposes_served(server):
    propose(server, [entry("a", 4, 4, reset=True)])
    propose(server, [entry("b", 4)])  # unknown request: refused
    assert server.snapshot()["proposals"] == 1


def test_a_latency_on_a_bucket_bound_counts_in_that_bucket():
    stats = ServerStats()
    stats.observe_propose(1.0, {})
    assert stats.latency_bucket_counts[2] == 1  # the bucket of 1.0 ms
