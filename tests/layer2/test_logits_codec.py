# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The draft-logits wire format: bit-exact round trips and every refusal."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
import torch

from vllm.k3_draft.logits_codec import (
    CAPABILITY_FULL,
    CAPABILITY_TOPK,
    LogitsFormat,
    decode_logits,
    encode_logits,
    requested_format,
    sample_positions,
)
from vllm.k3_draft.protocol import ProtocolError, tensor_frame

V, K = 48, 3
MAX_LEN = 64
ANCHORS = np.array([5, 61, 20])  # the second request runs past MAX_LEN
NEG_INF, POS_INF, NAN = -128, 0x7F80, 0x7FC0  # bf16 bit patterns (int16)
LARGEST = 2**16 - 2**8  # the largest bf16 magnitude below the 2**16 bound


def _logits(seed: int = 0) -> torch.Tensor:
    """bf16 logits with every kind of finite value and a masked -inf."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(ANCHORS), K, V, generator=generator) * 8).bfloat16()
    logits[0, 0, 3] = float("-inf")
    logits[1, 2, 7] = 1e-40  # subnormal
    logits[2, 1, 9] = -LARGEST
    return logits


def _reply(fmt: LogitsFormat, logits: torch.Tensor) -> tuple[dict[str, Any], bytes]:
    positions = sample_positions(ANCHORS, K, MAX_LEN)
    meta, frame = encode_logits(logits, fmt, positions)
    meta.update(capability=fmt.capability, num_frames=1)
    return meta, bytes(tensor_frame(frame))


def _decode(fmt: LogitsFormat, meta: dict[str, Any], frames: list[Any]):
    return decode_logits(meta, frames, fmt, ANCHORS, K, MAX_LEN)


def _bits(logits: torch.Tensor) -> np.ndarray:
    return logits.contiguous().view(torch.int16).numpy()


def test_full_vocabulary_round_trips_bit_for_bit():
    fmt = LogitsFormat(V, 0)
    logits = _logits()
    meta, frame = _reply(fmt, logits)
    assert meta["capability"] == CAPABILITY_FULL
    assert meta["shape"] == [3, K, V] and meta["nbytes"] == 3 * K * V * 2
    assert len(frame) == meta["nbytes"]
    decoded = _decode(fmt, meta, [frame])
    assert np.array_equal(decoded.values, _bits(logits)) and decoded.ids is None
    assert decoded.positions.tolist() == [[6, 7, 8], [62, 63, -1], [21, 22, 23]]


def test_float32_engine_logits_are_rounded_to_bf16_once():
    fmt = LogitsFormat(V, 0)
    logits = torch.randn(3, K, V, generator=torch.Generator().manual_seed(1))
    meta, frame = _reply(fmt, logits)
    decoded = _decode(fmt, meta, [frame])
    assert np.array_equal(decoded.values, _bits(logits.bfloat16()))


@pytest.mark.parametrize("topk", [1, 5, V])
def test_topk_round_trips_bit_for_bit(topk):
    fmt = LogitsFormat(V, topk)
    logits = _logits(topk)
    meta, frame = _reply(fmt, logits)
    assert meta["capability"] == CAPABILITY_TOPK
    assert meta["shape"] == [3, K, topk] and meta["ids_dtype"] == "int32"
    count = 3 * K * topk
    assert (meta["values_nbytes"], meta["ids_nbytes"]) == (count * 2, count * 4)
    assert len(frame) == meta["nbytes"] == count * 6
    decoded = _decode(fmt, meta, [frame])
    assert decoded.ids is not None
    ids = torch.from_numpy(decoded.ids.astype(np.int64))
    # The values are the logits at the ids, bit for bit, and the largest ones.
    assert np.array_equal(decoded.values, _bits(logits.gather(-1, ids)))
    kth = logits.float().topk(topk, dim=-1).values[..., -1:]
    assert (logits.float().gather(-1, ids) >= kth).all()


def test_odd_sized_topk_frame_is_unaligned_and_still_decodes():
    anchors = np.array([3])
    fmt = LogitsFormat(V, 3)
    logits = _logits()[:1, :1]
    meta, frame = encode_logits(logits, fmt, sample_positions(anchors, 1, MAX_LEN))
    meta.update(capability=fmt.capability, num_frames=1)
    decoded = decode_logits(
        meta, [bytes(tensor_frame(frame))], fmt, anchors, 1, MAX_LEN
    )
    assert meta["values_nbytes"] == 6  # ids start at an offset of 6 bytes
    assert decoded.ids is not None and sorted(decoded.ids.ravel()) == sorted(
        logits[0, 0].float().topk(3).indices.tolist()
    )


@pytest.mark.parametrize("topk", [0, 5])
def test_reply_entry_names_requests_then_slots_then_width(topk):
    # Two requests of three slots: the shape's first two entries cannot be
    # told apart when R == K.
    logits = _logits()[:2]
    positions = sample_positions(np.array([5, 61]), K, MAX_LEN)
    meta, _ = encode_logits(logits, LogitsFormat(V, topk), positions)
    count = 2 * K * (topk or V)
    expected: dict[str, Any] = {
        "dtype": "bf16",
        "shape": [2, K, topk or V],
        "nbytes": count * (6 if topk else 2),
        "sample_positions": [[6, 7, 8], [62, 63, None]],
    }
    if topk:
        expected.update(
            ids_dtype="int32", values_nbytes=count * 2, ids_nbytes=count * 4
        )
    assert meta == expected


def test_strided_engine_logits_are_sent_in_c_order():
    wide = _logits().repeat_interleave(2, dim=-1)
    wide[..., 1::2] = 0
    logits = wide[..., ::2]  # every other column: the last stride is 2
    assert not logits.is_contiguous()
    fmt = LogitsFormat(V, 0)
    meta, frame = _reply(fmt, logits)
    assert np.array_equal(_decode(fmt, meta, [frame]).values, _bits(logits))


# ---------------------------------------------------------------- refusals


def _full_case() -> tuple[LogitsFormat, dict[str, Any], bytes]:
    fmt = LogitsFormat(V, 0)
    return (fmt, *_reply(fmt, _logits()))


def _topk_case() -> tuple[LogitsFormat, dict[str, Any], bytes]:
    fmt = LogitsFormat(V, 4)
    return (fmt, *_reply(fmt, _logits()))


def _set_value(frame: bytes, index: int, bits: int) -> bytes:
    values = np.frombuffer(frame, dtype="<i2").copy()
    values[index] = np.int16(np.uint16(bits).view(np.int16))
    return values.tobytes()


def _bf16_bits(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF


def _set_id(frame: bytes, values_nbytes: int, index: int, token: int) -> bytes:
    ids = np.frombuffer(frame, dtype="<i4", offset=values_nbytes).copy()
    ids[index] = token
    return frame[:values_nbytes] + ids.tobytes()


def test_truncated_frame_is_refused():
    fmt, meta, frame = _full_case()
    with pytest.raises(ProtocolError, match="frame has .* bytes, expected"):
        _decode(fmt, meta, [frame[:-2]])


def test_oversized_frame_is_refused():
    fmt, meta, frame = _topk_case()
    with pytest.raises(ProtocolError, match="frame has .* bytes, expected"):
        _decode(fmt, meta, [frame + b"\0\0"])


@pytest.mark.parametrize(
    "field, value",
    [("dtype", "float32"), ("dtype", "fp16"), ("ids_dtype", "int64")],
)
def test_wrong_dtype_is_refused(field, value):
    fmt, meta, frame = _topk_case()
    meta[field] = value
    with pytest.raises(ProtocolError, match=field):
        _decode(fmt, meta, [frame])


@pytest.mark.parametrize("bits", [NAN, 0xFFC1, 0x7F81])
def test_nan_is_refused(bits):
    fmt, meta, frame = _full_case()
    with pytest.raises(ProtocolError, match="NaN"):
        _decode(fmt, meta, [_set_value(frame, 100, bits)])


def test_positive_infinity_is_refused():
    fmt, meta, frame = _topk_case()
    with pytest.raises(ProtocolError, match=r"\+inf"):
        _decode(fmt, meta, [_set_value(frame, 2, POS_INF)])


def test_slot_without_a_finite_logit_is_refused():
    fmt, meta, frame = _topk_case()
    for index in range(4, 8):  # every value of slot [0, 1]
        frame = _set_value(frame, index, NEG_INF & 0xFFFF)
    with pytest.raises(ProtocolError, match=r"without a logit of magnitude below"):
        _decode(fmt, meta, [frame])


@pytest.mark.parametrize("value", [2.0**16, 3e38])
def test_value_of_2_16_or_more_is_refused(value):
    fmt, meta, frame = _full_case()
    with pytest.raises(ProtocolError, match=r"holds a value >= 2\*\*16"):
        _decode(fmt, meta, [_set_value(frame, 100, _bf16_bits(value))])


@pytest.mark.parametrize("value", [-(2.0**16), -1e9, -3.3895e38])
def test_large_negative_value_is_a_masked_token(value):
    fmt, meta, frame = _full_case()
    decoded = _decode(fmt, meta, [_set_value(frame, 100, _bf16_bits(value))])
    values = torch.from_numpy(decoded.values.copy()).view(torch.bfloat16)
    assert values.reshape(-1)[100] == torch.tensor(value).bfloat16()


@pytest.mark.parametrize("value", [LARGEST, -LARGEST])
def test_largest_magnitude_below_2_16_is_accepted(value):
    fmt, meta, frame = _topk_case()
    decoded = _decode(fmt, meta, [_set_value(frame, 2, _bf16_bits(value))])
    values = torch.from_numpy(decoded.values.copy()).view(torch.bfloat16)
    assert values[0, 0, 2] == value


def test_slot_whose_only_finite_logit_is_too_large_is_refused():
    fmt, meta, frame = _topk_case()
    for index in range(4, 7):  # all but the last value of slot [0, 1]
        frame = _set_value(frame, index, NEG_INF & 0xFFFF)
    frame = _set_value(frame, 7, _bf16_bits(-3e38))
    with pytest.raises(ProtocolError, match=r"without a logit of magnitude below"):
        _decode(fmt, meta, [frame])


@pytest.mark.parametrize("token", [-1, V, 1 << 30])
def test_out_of_vocabulary_id_is_refused(token):
    fmt, meta, frame = _topk_case()
    frame = _set_id(frame, meta["values_nbytes"], 5, token)
    with pytest.raises(ProtocolError, match="outside the vocabulary"):
        _decode(fmt, meta, [frame])


@pytest.mark.parametrize("other", [9, 11])  # next to it, or the slot's last
def test_repeated_id_in_a_slot_is_refused(other):
    fmt, meta, frame = _topk_case()
    first = int(np.frombuffer(frame, dtype="<i4", offset=meta["values_nbytes"])[8])
    frame = _set_id(frame, meta["values_nbytes"], other, first)
    with pytest.raises(ProtocolError, match="repeat"):
        _decode(fmt, meta, [frame])


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(shape=[3, K, V - 1]), "shape"),
        (lambda m: m.update(shape=[3, K + 1, V]), "shape"),
        (lambda m: m.update(shape=[3.0, K, V]), "shape"),
        (lambda m: m.update(nbytes=m["nbytes"] + 2), "nbytes"),
        (lambda m: m.update(nbytes=float(m["nbytes"])), "nbytes"),
        (lambda m: m.update(capability=CAPABILITY_TOPK), "entry is"),
        (lambda m: m.update(num_frames=2), "frames"),
        (lambda m: m.update(extra=1), "fields"),
        (lambda m: m.pop("sample_positions"), "fields"),
        (lambda m: m["sample_positions"][1].__setitem__(2, 64), "sample_positions"),
        (lambda m: m["sample_positions"][0].__setitem__(0, 7), "sample_positions"),
        (lambda m: m["sample_positions"].pop(), "sample_positions"),
    ],
)
def test_metadata_that_does_not_match_the_request_is_refused(edit, match):
    fmt, meta, frame = _full_case()
    meta = copy.deepcopy(meta)
    edit(meta)
    with pytest.raises(ProtocolError, match=match):
        _decode(fmt, meta, [frame])


def test_boolean_sample_position_is_refused():
    fmt = LogitsFormat(V, 0)
    anchors = np.array([0])
    meta, frame = encode_logits(_logits()[:1], fmt, sample_positions(anchors, K, 8))
    meta.update(capability=fmt.capability, num_frames=1)
    meta["sample_positions"] = [[True, 2, 3]]
    with pytest.raises(ProtocolError, match="sample_positions"):
        decode_logits(meta, [bytes(tensor_frame(frame))], fmt, anchors, K, 8)


def test_float_sample_position_is_refused():
    fmt, meta, frame = _full_case()
    meta["sample_positions"] = [[6.0, 7, 8], [62, 63, None], [21, 22, 23]]
    with pytest.raises(ProtocolError, match="sample_positions"):
        _decode(fmt, meta, [frame])


def test_sample_positions_are_json_ints_and_none_past_the_model_length():
    positions = sample_positions(np.array([3, 6], dtype=np.int64), K, 9)
    assert positions == [[4, 5, 6], [7, 8, None]]
    assert json.loads(json.dumps(positions)) == positions


@pytest.mark.parametrize("topk", [0, 5])
@pytest.mark.parametrize("columns", [V + 8, V - 8])
def test_engine_logits_of_another_vocabulary_width_are_refused(topk, columns):
    logits = torch.zeros(len(ANCHORS), K, columns, dtype=torch.bfloat16)
    positions = sample_positions(ANCHORS, K, MAX_LEN)
    with pytest.raises(ValueError, match=f"have {columns} columns, not {V}"):
        encode_logits(logits, LogitsFormat(V, topk), positions)


def test_missing_frame_is_refused():
    fmt, meta, _ = _full_case()
    with pytest.raises(ProtocolError, match="carries 0 frames"):
        _decode(fmt, meta, [])


# ------------------------------------------------------------ the request


@pytest.mark.parametrize(
    "header, expected",
    [
        ({}, None),
        ({"return_logits": False}, None),
        ({"return_logits": True}, LogitsFormat(V, 0)),
        ({"return_logits": True, "logits_topk": 7}, LogitsFormat(V, 7)),
        ({"return_logits": True, "logits_topk": V}, LogitsFormat(V, V)),
    ],
)
def test_requested_format(header, expected):
    assert requested_format(header, V) == expected


@pytest.mark.parametrize(
    "header",
    [
        {"return_logits": 1},
        {"return_logits": "yes"},
        {"logits_topk": 4},
        {"return_logits": False, "logits_topk": 4},
        {"return_logits": True, "logits_topk": 0},
        {"return_logits": True, "logits_topk": V + 1},
        {"return_logits": True, "logits_topk": True},
        {"return_logits": True, "logits_topk": 2.0},
        {"return_logits": True, "logits_topk": None},
        {"logits_topk": None},
    ],
)
def test_malformed_request_fields_are_refused(header):
    with pytest.raises(ProtocolError):
        requested_format(header, V)


@pytest.mark.parametrize("vocab_size, topk", [(V, V + 1), (V, -1), (0, 0), (-1, 0)])
def test_format_outside_its_bounds_is_refused(vocab_size, topk):
    with pytest.raises(ValueError, match="top-k"):
        LogitsFormat(vocab_size, topk)


def test_format_request_fields():
    assert LogitsFormat(V, 0).request_fields() == {"return_logits": True}
    assert LogitsFormat(V, 9).request_fields() == {
        "return_logits": True,
        "logits_topk": 9,
    }
