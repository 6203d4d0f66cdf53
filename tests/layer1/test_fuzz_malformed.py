# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Thousands of malformed messages against a real server process: each gets an
error reply, the server keeps serving, and retained requests stay intact."""

import json
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq
from k3_layer1_server import DEFAULT_OPTIONS, RawClient, entry, propose_message

from vllm.k3_draft import protocol

NUM_MESSAGES = 3000
CHECK_EVERY = 250
WIDTH = DEFAULT_OPTIONS["context_width"]
VOCAB = DEFAULT_OPTIONS["vocab_size"]
MAX_K = DEFAULT_OPTIONS["max_speculative_tokens"]
MAX_BATCH = DEFAULT_OPTIONS["max_num_seqs"]
MAX_LEN = DEFAULT_OPTIONS["max_model_len"]
KEEP_END = 40

Frames = list[Any]


def header(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def valid_propose(rng: random.Random, serial: int) -> tuple[list[dict], Frames]:
    count = rng.randint(1, 6)
    entries = [entry(f"fz-{serial}-{i}", count, count, reset=True) for i in range(2)]
    return entries, propose_message(entries, rng.randint(1, MAX_K), WIDTH, serial)


def raw_bytes(rng: random.Random, serial: int) -> Frames:
    return [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))]


def truncated_json(rng: random.Random, serial: int) -> Frames:
    frame = valid_propose(rng, serial)[1][0]
    return [frame[: rng.randint(0, len(frame) - 1)]]


def not_an_object(rng: random.Random, serial: int) -> Frames:
    return [json.dumps(rng.choice([[], [2, "PING"], 2, "PING", None, 1.5])).encode()]


def wrong_protocol(rng: random.Random, serial: int) -> Frames:
    fields: dict[str, Any] = {"op": "PING"}
    version = rng.choice([1, 3, "2", None, True, 2.5, -2, "missing"])
    if version != "missing":
        fields["protocol"] = version
    return [header(**fields)]


def bad_op(rng: random.Random, serial: int) -> Frames:
    op = rng.choice(["", "ping", "PONG", "ERROR", 5, None, "PROPOSE2", "missing"])
    fields: dict[str, Any] = {"protocol": 2}
    if op != "missing":
        fields["op"] = op
    return [header(**fields)]


ENTRY_MUTATIONS: dict[str, list[Any]] = {
    "request_id": ["", 5, None, "x" * 513, ["a"]],
    "reset": [1, "true", None, 0],
    "reset_position": [-1, MAX_LEN, "0", 1.5, None],
    "context_count": [-1, "2", 1.0, None],
    "anchor_token_id": [-1, VOCAB, "7", None, 7.5],
    "anchor_position": [-1, MAX_LEN, None, "3"],
}


def bad_propose_field(rng: random.Random, serial: int) -> Frames:
    entries, frames = valid_propose(rng, serial)
    fields = json.loads(frames[0])
    choice = rng.randrange(6)
    if choice == 0:
        fields["num_speculative_tokens"] = rng.choice(
            [0, -1, MAX_K + 1, "3", None, 3.0, True]
        )
    elif choice == 1:
        too_many = [
            entry(f"fz-{serial}-m{i}", 0, reset=True) for i in range(MAX_BATCH + 1)
        ]
        fields["requests"] = rng.choice([None, {}, [], "x", [1], too_many])
    elif choice == 2:
        name = rng.choice(list(ENTRY_MUTATIONS))
        fields["requests"][rng.randrange(2)][name] = rng.choice(ENTRY_MUTATIONS[name])
    elif choice == 3:
        victim = fields["requests"][rng.randrange(2)]
        if rng.random() < 0.5:
            del victim[rng.choice(list(ENTRY_MUTATIONS))]
        else:
            victim["extra"] = 1
    elif choice == 4:
        fields["requests"][rng.randrange(2)]["anchor_position"] += rng.choice(
            [-2, -1, 1, 3]
        )
    else:
        # Wrong under every layer: unknown names, or a capability field
        # (layer 2's return_logits / logits_topk) with a value of no valid type.
        name = rng.choice(["return_logits", "logits_topk", "x", "requests_"])
        fields[name] = {"malformed": True}
    return [json.dumps(fields).encode(), *frames[1:]]


def bad_frames(rng: random.Random, serial: int) -> Frames:
    entries, frames = valid_propose(rng, serial)
    positions, rows = bytes(frames[1]), bytes(frames[2])
    choice = rng.randrange(7)
    if choice == 0:
        return frames[: rng.randrange(2) + 1]
    if choice == 1:
        return [*frames, rng.choice([b"", positions, b"x"])]
    if choice == 2:
        return [frames[0], positions[: -rng.randint(1, 7)], rows]
    if choice == 3:
        return [frames[0], positions, rows + b"\0" * rng.randint(1, 100000)]
    if choice == 4:
        return [frames[0], rows, positions]
    if choice == 5:
        values = torch.frombuffer(bytearray(positions), dtype=torch.int64).clone()
        values[0] += rng.choice([-1, 1, 5])
        return [frames[0], protocol.tensor_frame(values), rows]
    return [frames[0], positions, rows[: -rng.randint(1, len(rows))]]


def negative_positions(rng: random.Random, serial: int) -> Frames:
    count = rng.randint(6, 10)
    entries = [entry(f"fz-{serial}", count - 5, count, reset=True)]
    return propose_message(entries, 2, WIDTH, serial)


def stateful(rng: random.Random, serial: int) -> Frames:
    new = entry(f"fz-{serial}", 3, 3, reset=True)
    choice = rng.randrange(10)
    if choice == 0:
        return propose_message(
            [new, entry("keep", KEEP_END + rng.choice([-1, 1, 7]))], 3, WIDTH
        )
    if choice == 1:
        return propose_message([entry(f"fz-unknown-{serial}", 4, 4)], 3, WIDTH)
    if choice == 2:
        return propose_message([entry("keep", KEEP_END - 20, 1), new], 3, WIDTH)
    if choice == 3:
        return [header(protocol=2, op="RESET", request_ids=["keep", f"fz-{serial}"])]
    if choice == 4:
        return [
            header(
                protocol=2,
                op="RECONNECT",
                source_request_id=f"fz-{serial}",
                request_id=f"fz-x{serial}",
                prefix_end=3,
            )
        ]
    if choice == 5:
        return [
            header(
                protocol=2,
                op="RECONNECT",
                source_request_id="keep",
                request_id=f"fz-x{serial}",
                prefix_end=KEEP_END + rng.randint(1, 9),
            )
        ]
    if choice == 6:
        return [header(protocol=2, op="RECONNECT", source_request_id="keep")]
    if choice == 7:
        ids = rng.choice([None, "keep", [1], ["keep", "keep"], [""], {"a": 1}])
        return [header(protocol=2, op="FREE", request_ids=ids)]
    if choice == 8:
        return [header(protocol=2, op=rng.choice(["PING", "CLEAR"])), b"extra"]
    return [header(protocol=2, op=rng.choice(["PING", "CLEAR", "FREE"]), bogus=1)]


def oversized_header(rng: random.Random, serial: int) -> Frames:
    return [header(protocol=2, op="PING", pad="x" * rng.randint(200_000, 300_000))]


GENERATORS: list[Callable[[random.Random, int], Frames]] = [
    raw_bytes,
    truncated_json,
    not_an_object,
    wrong_protocol,
    bad_op,
    bad_propose_field,
    bad_frames,
    negative_positions,
    stateful,
    oversized_header,
]


def malformed(seed: int, count: int) -> Iterator[tuple[str, Frames]]:
    rng = random.Random(seed)
    for serial in range(count):
        generator = rng.choice(GENERATORS)
        yield generator.__name__, generator(rng, serial)


def keep_tokens(client: RawClient) -> list[list[int]]:
    reply = client.send_frames(propose_message([entry("keep", KEEP_END)], 3, WIDTH))
    decoded = json.loads(reply[0])
    assert decoded["ok"], decoded
    return decoded["tokens"]


def continuation(request_id: str) -> Frames:
    rows = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(9))
    fields = protocol.request_header(
        "PROPOSE",
        num_speculative_tokens=3,
        requests=[entry(request_id, KEEP_END + 4, 4)],
    )
    return [
        protocol.encode_header(fields),
        protocol.tensor_frame(torch.arange(KEEP_END, KEEP_END + 4)),
        protocol.tensor_frame(rows.bfloat16()),
    ]


@pytest.fixture
def fuzz_client(draft_server):
    server = draft_server
    client = RawClient(server.address)
    client.call("CLEAR")
    for rid in ("keep", "control"):
        reply = client.send_frames(
            propose_message([entry(rid, KEEP_END, KEEP_END, reset=True)], 3, WIDTH, 3)
        )
        assert json.loads(reply[0])["ok"]
    yield server, client
    client.close()


def test_every_malformed_message_gets_an_error_and_state_survives(fuzz_client):
    server, client = fuzz_client
    baseline = keep_tokens(client)
    expected_next = json.loads(client.send_frames(continuation("control"))[0])["tokens"]
    kinds: Counter[str] = Counter()
    for index, (kind, frames) in enumerate(malformed(seed=1234, count=NUM_MESSAGES)):
        reply = client.send_frames(frames)
        decoded = json.loads(reply[0])
        assert len(reply) == 1 and decoded["ok"] is False, (kind, decoded)
        assert decoded["protocol"] == 2 and ": " in decoded["error"]
        kinds[kind] += 1
        if index % CHECK_EVERY == 0:
            assert keep_tokens(client) == baseline
    assert len(kinds) == len(GENERATORS)
    assert client.call("PING")[0]["active_requests"] == 2
    assert keep_tokens(client) == baseline
    after = json.loads(client.send_frames(continuation("keep"))[0])
    assert after["tokens"] == expected_next
    assert server.proc is not None and server.proc.poll() is None


def test_message_beyond_the_size_limit_drops_only_that_connection(draft_server):
    limit_bytes = (DEFAULT_OPTIONS["max_context_tokens"] * WIDTH * 2) + (2 << 20)
    victim = RawClient(draft_server.address, timeout_ms=1500)
    with pytest.raises(zmq.Again):
        victim.send_frames([header(protocol=2, op="PING"), b"\0" * limit_bytes])
    victim.close()
    other = RawClient(draft_server.address)
    assert other.call("PING")[0]["op"] == "PONG"
    other.close()
