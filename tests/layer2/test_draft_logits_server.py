# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The server half of the draft-logits capabilities, against real draft
server processes (layer 1's reference engine, CPU): DFlash on ipc, DSpark on
loopback TCP."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from k3_l2_engines import CONTEXT_WIDTH, TableEngine, table_limits
from k3_layer1_server import (
    DEFAULT_OPTIONS,
    DraftServerProcess,
    RawClient,
    context_frames,
    entry,
    free_tcp_port,
    propose_message,
)

from vllm.k3_draft import protocol
from vllm.k3_draft.capabilities.draft_logits import TopkGraphs
from vllm.k3_draft.engine import DraftLimits, ProposeBatch, ProposeOutput
from vllm.k3_draft.logits_codec import (
    CAPABILITY_FULL,
    CAPABILITY_TOPK,
    LogitsFormat,
    decode_logits,
)
from vllm.k3_draft.reference_engine import ReferenceEngine, ReferenceModelConfig
from vllm.k3_draft.server import DraftServer

VOCAB = DEFAULT_OPTIONS["vocab_size"]
WIDTH = DEFAULT_OPTIONS["context_width"]
MAX_LEN = DEFAULT_OPTIONS["max_model_len"]
K = 3


@pytest.fixture
def client(reference_server: DraftServerProcess) -> Iterator[RawClient]:
    raw = RawClient(reference_server.address)
    raw.call(protocol.OP_CLEAR)
    yield raw
    raw.close()


@pytest.fixture(scope="module")
def dspark_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawClient]:
    """A DSpark reference server on a loopback TCP port."""
    server = DraftServerProcess(
        tmp_path_factory.mktemp("l2-dspark"),
        address=f"tcp://127.0.0.1:{free_tcp_port()}",
        method="dspark",
    ).start()
    raw = RawClient(server.address)
    yield raw
    raw.close()
    server.stop()


def _propose(
    client: RawClient, entries: list[dict], **fields
) -> tuple[dict, list[bytes]]:
    reply = client.send_frames(propose_message(entries, K, WIDTH, **fields))
    return json.loads(reply[0]), reply[1:]


def _logits_of(header: dict, frames: list[bytes], fmt: LogitsFormat, anchors):
    parts = protocol.extension_frames(header, frames)
    assert list(parts) == [fmt.capability]
    meta, ext_frames = parts[fmt.capability]
    return decode_logits(meta, ext_frames, fmt, np.array(anchors), K, MAX_LEN)


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.copy()).view(torch.bfloat16).float()


def test_pong_advertises_both_capabilities(client):
    pong, frames = client.call(protocol.OP_PING)
    assert pong["capabilities"] == [
        protocol.CAPABILITY_REPLY_SERVER_ID,
        CAPABILITY_FULL,
        CAPABILITY_TOPK,
    ]
    assert frames == []


def _table_server(engine_type: type[TableEngine] = TableEngine) -> DraftServer:
    """A draft server, in this process, around a table engine of 32 tokens."""
    protocol.load_capability_plugins()
    table = torch.randn(128, K, 32, generator=torch.Generator().manual_seed(0))
    return DraftServer(engine_type(table_limits(2, K, MAX_LEN), table))


def _handle(server: DraftServer, frames: list) -> tuple[dict, list]:
    reply = server.handle(frames)
    return json.loads(bytes(reply[0])), reply[1:]


def _ping(server: DraftServer) -> dict:
    return _handle(server, [protocol.encode_header(protocol.request_header("PING"))])[0]


class _NoLogitsEngine(TableEngine):
    """An engine that cannot return per-position logits."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spec = dataclasses.replace(self.spec, supports_logits=False)


def test_an_engine_without_logits_offers_neither_capability():
    server = _table_server(_NoLogitsEngine)
    assert _ping(server)["capabilities"] == [protocol.CAPABILITY_REPLY_SERVER_ID]


class _LogitsLostEngine(TableEngine):
    """An engine that offers logits but returns none."""

    def propose(self, batch: ProposeBatch) -> ProposeOutput:
        output = super().propose(batch)
        return ProposeOutput(output.tokens, None, output.timings)


def _logits_propose_error(engine_type: type[TableEngine]) -> str:
    """The error of one new request's PROPOSE asking for logits from a table
    server around ``engine_type``, which must keep no request."""
    server = _table_server(engine_type)
    message = propose_message(
        [entry("r", 10, count=10, reset=True)], K, CONTEXT_WIDTH, return_logits=True
    )
    header, frames = _handle(server, message)
    assert not header["ok"] and frames == []
    assert _ping(server)["active_requests"] == 0
    return header["error"]


def test_an_engine_that_returns_no_logits_fails_the_propose_and_drops_its_requests():
    error = _logits_propose_error(_LogitsLostEngine)
    assert error == "RuntimeError: the engine returned no logits"


class _ShortLogitsEngine(TableEngine):
    """An engine whose logits cover one drafted slot fewer than it drafted."""

    def propose(self, batch: ProposeBatch) -> ProposeOutput:
        output = super().propose(batch)
        assert output.logits is not None
        return ProposeOutput(output.tokens, output.logits[:, :-1], output.timings)


def test_engine_logits_of_the_wrong_shape_fail_the_propose_and_drop_its_requests():
    assert _logits_propose_error(_ShortLogitsEngine) == (
        f"RuntimeError: the engine returned logits of shape (1, {K - 1}, 32), "
        f"not [1, {K}, V]"
    )


def test_greedy_client_still_gets_one_frame(client):
    header, frames = _propose(client, [entry("g", 20, count=20, reset=True)])
    assert header["ok"] and frames == [] and "extensions" not in header


def test_full_and_topk_logits_describe_the_drafted_tokens(client):
    anchors = [20, 12]
    entries = [
        entry("a", anchors[0], count=20, reset=True),
        entry("b", anchors[1], count=12, reset=True, anchor_token_id=99),
    ]
    header, frames = _propose(client, entries, return_logits=True)
    assert header["ok"] and len(frames) == 1
    full = _logits_of(header, frames, LogitsFormat(VOCAB, 0), anchors)
    values = _bf16(full.values)
    tokens = torch.tensor(header["tokens"])
    assert full.positions.tolist() == [[21, 22, 23], [13, 14, 15]]
    _assert_drafts_and_topk_follow(client, entries, anchors, values, tokens)


def _assert_drafts_and_topk_follow(
    client: RawClient,
    entries: list[dict],
    anchors: list[int],
    values: torch.Tensor,
    tokens: torch.Tensor,
) -> None:
    """Each drafted token is its slot's maximum of the full ``values``; a
    second PROPOSE of the same state asking for the top 8 drafts the same
    tokens and slices the same logits."""
    assert torch.equal(values.gather(-1, tokens[..., None])[..., 0], values.amax(-1))
    again = [dict(e, reset=False, context_count=0) for e in entries]
    header, frames = _propose(client, again, return_logits=True, logits_topk=8)
    assert header["ok"] and header["tokens"] == tokens.tolist(), header
    topk = _logits_of(header, frames, LogitsFormat(VOCAB, 8), anchors)
    assert topk.ids is not None
    ids = torch.from_numpy(topk.ids.astype(np.int64))
    assert torch.equal(_bf16(topk.values), values.gather(-1, ids))
    assert torch.equal(
        _bf16(topk.values).sort(-1).values, values.topk(8, -1).values.sort(-1).values
    )
    assert (ids == tokens[..., None]).any(-1).all()


def test_slots_past_the_model_length_have_no_sample_position(client):
    anchor = MAX_LEN - 2
    header, frames = _propose(
        client,
        [entry("end", anchor, count=4, reset=True, reset_position=anchor - 4)],
        return_logits=True,
        logits_topk=2,
    )
    meta = header["extensions"][0]
    assert meta["sample_positions"] == [[MAX_LEN - 1, None, None]]
    decoded = _logits_of(header, frames, LogitsFormat(VOCAB, 2), [anchor])
    assert decoded.positions.tolist() == [[MAX_LEN - 1, -1, -1]]


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"return_logits": "yes"}, "return_logits must be a boolean"),
        ({"return_logits": True, "logits_topk": 0}, "logits_topk must be"),
        ({"return_logits": True, "logits_topk": VOCAB + 1}, "logits_topk must be"),
        ({"return_logits": True, "logits_topk": None}, "logits_topk must be"),
        ({"logits_topk": 4}, "needs return_logits"),
        ({"return_logits": True, "logits_top_k": 4}, "unknown header fields"),
    ],
)
def test_malformed_logits_fields_are_refused_before_any_state_changes(
    client, fields, match
):
    header, frames = _propose(
        client, [entry("bad", 10, count=10, reset=True)], **fields
    )
    assert not header["ok"] and match in header["error"] and frames == []
    assert client.call(protocol.OP_PING)[0]["active_requests"] == 0


def _dspark_oracle_logits(entries: list[dict]) -> torch.Tensor:
    """The DSpark reference draft's float32 logits ``[R, K, V]`` (its head:
    each slot's logits plus the low-rank Markov bias of the slot before's
    argmax), one request at a time, from ``propose_message``'s context rows."""
    opts = DEFAULT_OPTIONS
    limits = DraftLimits(
        max_requests=1,
        max_batch_size=1,
        max_speculative_tokens=opts["max_speculative_tokens"],
        max_context_tokens=opts["max_context_tokens"],
        max_model_len=MAX_LEN,
        block_size=opts["block_size"],
        window_size=opts["window_size"],
        prefix_cache_tokens=opts["prefix_cache_tokens"],
    )
    fields = ("vocab_size", "context_width", "hidden_size", "num_layers")
    model = ReferenceModelConfig(
        "dspark", *(opts[f] for f in fields), opts["num_heads"], opts["seed"]
    )
    engine = ReferenceEngine(limits, model, torch.device("cpu"))
    engine.load()
    runs = [
        (e["anchor_position"] - e["context_count"], e["context_count"]) for e in entries
    ]
    frames = context_frames(runs, WIDTH)
    positions = torch.frombuffer(bytearray(frames[0]), dtype=torch.int64)
    rows = torch.frombuffer(bytearray(frames[1]), dtype=torch.bfloat16)
    rows = rows.view(-1, WIDTH)
    logits, first = [], 0
    for e, (start, count) in zip(entries, runs):
        output = engine.propose(
            ProposeBatch(
                num_speculative_tokens=K,
                slots=[0],
                starts=[start],
                ends=[start + count],
                anchor_token_ids=[e["anchor_token_id"]],
                counts=[count],
                positions=positions[first : first + count],
                rows=rows[first : first + count],
                want_logits=True,
            )
        )
        assert output.logits is not None
        logits.append(output.logits[0].float())
        first += count
    return torch.stack(logits)


def test_dspark_pong_advertises_both_capabilities(dspark_client):
    pong, _ = dspark_client.call(protocol.OP_PING)
    assert pong["method"] == "dspark"
    assert pong["capabilities"] == [
        protocol.CAPABILITY_REPLY_SERVER_ID,
        CAPABILITY_FULL,
        CAPABILITY_TOPK,
    ]


def test_dspark_full_and_topk_logits_are_its_heads_and_describe_the_drafts(
    dspark_client,
):
    anchors = [20, 12]
    entries = [
        entry("da", anchors[0], count=20, reset=True),
        entry("db", anchors[1], count=12, reset=True, anchor_token_id=99),
    ]
    header, frames = _propose(dspark_client, entries, return_logits=True)
    assert header["ok"] and len(frames) == 1, header
    full = _logits_of(header, frames, LogitsFormat(VOCAB, 0), anchors)
    values = _bf16(full.values)
    tokens = torch.tensor(header["tokens"])
    # The Markov head's logits, bf16 on the wire (one ulp of rounding apart
    # from the batched server's float32), not the per-slot logits alone.
    expected = _dspark_oracle_logits(entries)
    torch.testing.assert_close(values, expected, rtol=2.0**-7, atol=2.0**-7)
    assert full.positions.tolist() == [[21, 22, 23], [13, 14, 15]]
    _assert_drafts_and_topk_follow(dspark_client, entries, anchors, values, tokens)


def test_top_k_graphs_remember_a_bounded_number_of_keys_seen_once():
    """Graphs key by the logits' address: an engine whose logits move every
    step is never captured, and what it leaves behind must stay bounded on a
    server that runs for months (the keys seen once; no CUDA needed)."""
    graphs = TopkGraphs(max_graphs=2)
    host = torch.empty(16, dtype=torch.uint8)
    logits = torch.zeros(100, 1, 1)
    for step in range(100):
        assert not graphs.write(logits[step : step + 1], 1, host)
    assert len(graphs) == 0
    assert len(graphs._seen) <= 4 * graphs.max_graphs
