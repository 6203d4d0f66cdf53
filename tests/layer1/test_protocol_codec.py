# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Wire protocol v2: header and tensor-frame codecs."""

import pytest
import torch

from vllm.k3_draft import protocol
from vllm.k3_draft.protocol import ProtocolError, RemoteError


def test_header_round_trip_keeps_protocol_and_op():
    header = protocol.request_header("PROPOSE", num_speculative_tokens=3)
    decoded = protocol.decode_header(protocol.encode_header(header), 1024)
    assert decoded == {"protocol": 2, "op": "PROPOSE", "num_speculative_tokens": 3}


@pytest.mark.parametrize("version", [1, 3, "2", True, None, 2.0])
def test_header_with_another_protocol_version_is_refused(version):
    frame = protocol.encode_header({"protocol": version, "op": "PING"})
    with pytest.raises(ProtocolError, match="protocol version"):
        protocol.decode_header(frame, 1024)


def test_header_without_protocol_is_refused():
    with pytest.raises(ProtocolError, match="protocol version"):
        protocol.decode_header(b'{"op":"PING"}', 1024)


@pytest.mark.parametrize(
    "frame", [b'{"protocol":2}', b'{"protocol":2,"op":""}', b'{"protocol":2,"op":5}']
)
def test_header_without_op_string_is_refused(frame):
    with pytest.raises(ProtocolError, match="no op"):
        protocol.decode_header(frame, 1024)


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xff\xfe", b"{", b'{"protocol":2,"op":"PING"', b'{"protocol":2,"op":}'],
)
def test_header_that_is_not_utf8_json_is_refused(frame):
    with pytest.raises(ProtocolError, match="not UTF-8 JSON"):
        protocol.decode_header(frame, 1024)


def test_header_with_surrounding_whitespace_is_accepted():
    frame = b' \n{"protocol":2,"op":"PING"}\r\n\t'
    assert protocol.decode_header(frame, 1024) == {"protocol": 2, "op": "PING"}


@pytest.mark.parametrize("tail", [b"x", b"{}", b' {"protocol":2,"op":"PING"}', b"\0"])
def test_header_followed_by_more_data_is_refused(tail):
    frame = b'{"protocol":2,"op":"PING"}' + tail
    with pytest.raises(ProtocolError, match="not UTF-8 JSON"):
        protocol.decode_header(frame, 1024)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_header_in_another_unicode_encoding_is_refused(encoding):
    frame = '{"protocol":2,"op":"CLEAR"}'.encode(encoding)
    with pytest.raises(ProtocolError, match="not UTF-8 JSON"):
        protocol.decode_header(frame, 1024)


def test_integer_over_the_digit_limit_is_a_protocol_error():
    frame = b'{"protocol":2,"op":"PING","x":' + b"9" * 5000 + b"}"
    with pytest.raises(ProtocolError, match="not UTF-8 JSON"):
        protocol.decode_header(frame, 10_000)


@pytest.mark.parametrize("frame", [b"[]", b"2", b'"PING"', b"null"])
def test_header_that_is_not_an_object_is_refused(frame):
    with pytest.raises(ProtocolError, match="not a JSON object"):
        protocol.decode_header(frame, 1024)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_header_with_non_json_constant_is_refused(constant):
    frame = f'{{"protocol":2,"op":"PING","x":{constant}}}'.encode()
    with pytest.raises(ProtocolError, match="non-JSON constant"):
        protocol.decode_header(frame, 1024)


def test_nan_is_not_encoded():
    with pytest.raises(ProtocolError):
        protocol.encode_header({"x": float("nan")})


def test_header_over_the_byte_limit_is_refused():
    frame = protocol.encode_header(protocol.request_header("PING", pad="x" * 100))
    with pytest.raises(ProtocolError, match="limit"):
        protocol.decode_header(frame, len(frame) - 1)


def _timings(scale: float) -> dict[str, float]:
    return {name: scale * (i + 1) for i, name in enumerate(protocol.TIMING_FIELDS)}


def test_propose_reply_decodes_to_the_ok_reply_of_its_fields():
    timing = _timings(1.23456789)
    head = protocol.propose_reply_head('s"1\\é')
    body = protocol.propose_reply_body(head, [[5, 6, 7], [8, 9, 10]])
    frame = protocol.encode_propose_reply(body, timing)
    decoded = protocol.check_reply(protocol.decode_header(frame, 4096), "PROPOSE")
    rounded = {name: round(value, 4) for name, value in timing.items()}
    assert decoded == protocol.ok_reply(
        "PROPOSE",
        server_id='s"1\\é',
        tokens=[[5, 6, 7], [8, 9, 10]],
        timing_ms=rounded,
        latency_ms=rounded["total"],
    )


def test_propose_reply_carries_the_extension_entries():
    entries = [{"capability": "c", "num_frames": 1, "shape": [1, 3, 4]}]
    head = protocol.propose_reply_head("s1")
    body = protocol.propose_reply_body(head, [[1, 2, 3]], entries)
    frame = protocol.encode_propose_reply(body, _timings(0.5))
    assert protocol.decode_header(frame, 4096)["extensions"] == entries


@pytest.mark.parametrize("fields", [{}, {"return_logits": True, "logits_topk": 64}])
def test_propose_request_decodes_to_the_request_header_of_its_fields(fields):
    entries = [("plain", True, 4, 2, 11, 6), ('q"uote\\é', False, 0, 0, 7, 9)]
    frame = protocol.encode_propose_request(3, entries, fields)
    requests = [dict(zip(protocol.PROPOSE_REQUEST_FIELDS, e)) for e in entries]
    assert protocol.decode_header(frame, 4096) == protocol.request_header(
        "PROPOSE", num_speculative_tokens=3, requests=requests, **fields
    )


def test_propose_request_does_not_truncate_a_float_count():
    frame = protocol.encode_propose_request(3, [("a", True, 0, 1.5, 2, 3)], {})
    entry = protocol.decode_header(frame, 4096)["requests"][0]
    assert entry["context_count"] == 1.5


def test_error_reply_names_type_message_and_server():
    reply = protocol.error_reply(ProtocolError("bad thing"), "s1")
    assert reply == {
        "ok": False,
        "protocol": 2,
        "op": "ERROR",
        "server_id": "s1",
        "error": "ProtocolError: bad thing",
    }


def test_check_reply_raises_remote_error_for_error_reply():
    with pytest.raises(RemoteError, match="^ValueError: nope$"):
        protocol.check_reply(protocol.error_reply(ValueError("nope"), "s1"), "RESET")


def test_check_reply_accepts_pong_for_ping():
    reply = protocol.ok_reply("PONG", method="dflash")
    assert protocol.check_reply(reply, "PING") is reply


def test_check_reply_refuses_a_reply_to_another_op():
    with pytest.raises(ProtocolError, match="does not answer"):
        protocol.check_reply(protocol.ok_reply("FREE"), "RESET")


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.int32, torch.int64]
)
def test_tensor_frame_round_trips_bit_for_bit(dtype):
    source = (torch.randn(5, 7) * 1000).to(dtype)
    frame = bytearray(protocol.tensor_frame(source))
    decoded = protocol.frame_tensor(frame, dtype, (5, 7), "x")
    assert torch.equal(decoded.view(torch.uint8), source.view(torch.uint8))


def test_tensor_frame_is_little_endian_c_order():
    frame = bytes(
        protocol.tensor_frame(torch.tensor([[1, 2], [3, 256]], dtype=torch.int32))
    )
    assert frame == b"\x01\0\0\0\x02\0\0\0\x03\0\0\0\x00\x01\0\0"


def test_tensor_frame_aliases_a_writable_buffer():
    buffer = bytearray(protocol.tensor_frame(torch.arange(4, dtype=torch.int64)))
    decoded = protocol.frame_tensor(buffer, torch.int64, (4,), "x")
    buffer[0] = 9
    assert decoded[0].item() == 9


def test_tensor_frame_copies_a_read_only_buffer():
    frame = bytes(protocol.tensor_frame(torch.arange(4, dtype=torch.int64)))
    decoded = protocol.frame_tensor(frame, torch.int64, (4,), "x")
    assert decoded.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("delta", [-1, 1, -8, 8])
def test_tensor_frame_with_wrong_byte_length_is_refused(delta):
    frame = bytes(protocol.tensor_frame(torch.zeros(3, 4, dtype=torch.bfloat16)))
    frame = frame[:delta] if delta < 0 else frame + b"\0" * delta
    with pytest.raises(ProtocolError, match="rows frame has"):
        protocol.frame_tensor(frame, torch.bfloat16, (3, 4), "rows")


def test_empty_tensor_frame_round_trips():
    decoded = protocol.frame_tensor(b"", torch.bfloat16, (0, 4), "rows")
    assert decoded.shape == (0, 4)


def test_tensor_frame_refuses_non_contiguous_tensors():
    with pytest.raises(ProtocolError, match="contiguous"):
        protocol.tensor_frame(torch.zeros(4, 4).T)
