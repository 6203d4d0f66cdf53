# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Wire format of the draft-logits capabilities (layer 2).

Probabilistic drafting needs the draft distribution q of every drafted slot,
so a PROPOSE may ask for the engine's pre-temperature logits:

* ``dflash_logits_bf16_v1``: header ``"return_logits": true``; one reply frame
  of bf16 ``[R, K, V]`` (``R * K * V * 2`` bytes);
* ``dflash_logits_topk_bf16_v1``: header ``"return_logits": true,
  "logits_topk": k`` (``1 <= k <= V``); one reply frame holding the top-k
  values (bf16 ``[R, K, k]``) followed by their vocabulary ids (int32
  ``[R, K, k]``), ``R * K * k * 6`` bytes, no padding.

The reply's extension entry (``protocol.extension_frames``) carries ``dtype``
(``"bf16"``), ``shape`` (``[R, K, V]`` or ``[R, K, k]``), ``nbytes`` (the
frame's exact length), ``sample_positions`` and, for top-k, ``ids_dtype``
(``"int32"``), ``values_nbytes`` and ``ids_nbytes``. ``sample_positions[r][j]``
is the position of the token drafted in slot ``j`` of request ``r``
(``anchor_position + 1 + j``), or null when that position is at or past the
model length: such a slot carries no draft. Its Gumbel draw is keyed by the
position before it, as for upstream's local drafts.

A client validates every field, the frame length, the values and that top-k
ids are distinct vocabulary ids, before using anything (``decode_logits``).
A value is below ``2**16`` (-inf and large negative values are masked
tokens, as the verifier's own fill is), never NaN, and each slot has one of
magnitude below ``2**16``. The bound keeps the samplers' fp32
``logit / temperature`` finite where it matters: vLLM samples at temperature
0 (greedy, no division) or at least 1e-2 (``SamplingParams`` raises smaller
ones), so ``logit / T < 2**16 * 100``, whereas a bf16 near its maximum
(3.4e38) overflows at any T < 1, fixes the Gumbel draw and makes the
rejection sampler's q NaN; a large negative value becomes -inf at worst,
weight 0, while the slot's small value keeps its softmax defined. This module
imports only the standard library, numpy and torch (and, for CUDA logits on
the draft server, Triton): the draft server uses it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.k3_draft.protocol import ProtocolError

CAPABILITY_FULL = "dflash_logits_bf16_v1"
CAPABILITY_TOPK = "dflash_logits_topk_bf16_v1"
RETURN_LOGITS = "return_logits"
LOGITS_TOPK = "logits_topk"
REQUEST_FIELDS = (RETURN_LOGITS, LOGITS_TOPK)
VALUE_DTYPE = "bf16"
ID_DTYPE = "int32"
_ID_BYTES = 4
_VALUE_BYTES = 2
# bf16 bit fields: an all-ones exponent is an infinity (zero mantissa) or a NaN.
_EXPONENT = 0x7F80
_MANTISSA = 0x007F
# The exponent field of 2**16 (bias 127): the smallest refused finite magnitude.
_TOO_LARGE = (127 + 16) << 7
_FULL_KEYS = frozenset(
    {"capability", "num_frames", "dtype", "shape", "nbytes", "sample_positions"}
)
_TOPK_KEYS = _FULL_KEYS | {"ids_dtype", "values_nbytes", "ids_nbytes"}


@dataclass(frozen=True)
class LogitsFormat:
    """What a client asks for: the full vocabulary (``topk == 0``) or the
    top-``topk`` slice of each drafted slot's logits."""

    vocab_size: int
    topk: int

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or not 0 <= self.topk <= self.vocab_size:
            raise ValueError(
                f"logits top-k {self.topk} must be in [0, {self.vocab_size}] "
                "(0: the full vocabulary)"
            )

    @property
    def capability(self) -> str:
        return CAPABILITY_TOPK if self.topk else CAPABILITY_FULL

    @property
    def width(self) -> int:
        """Logits per drafted slot on the wire."""
        return self.topk or self.vocab_size

    def request_fields(self) -> dict[str, Any]:
        """The PROPOSE header fields that ask for this format."""
        if self.topk:
            return {RETURN_LOGITS: True, LOGITS_TOPK: self.topk}
        return {RETURN_LOGITS: True}

    def metadata(
        self, num_requests: int, num_speculative_tokens: int
    ) -> dict[str, Any]:
        """The reply entry's fields for ``R`` requests of ``K`` slots, less
        ``capability``, ``num_frames`` and ``sample_positions``."""
        count = num_requests * num_speculative_tokens * self.width
        meta: dict[str, Any] = {
            "dtype": VALUE_DTYPE,
            "shape": [num_requests, num_speculative_tokens, self.width],
            "nbytes": count * (_VALUE_BYTES + (_ID_BYTES if self.topk else 0)),
        }
        if self.topk:
            meta["ids_dtype"] = ID_DTYPE
            meta["values_nbytes"] = count * _VALUE_BYTES
            meta["ids_nbytes"] = count * _ID_BYTES
        return meta


def requested_format(header: Mapping[str, Any], vocab_size: int) -> LogitsFormat | None:
    """Server side: the logits a PROPOSE ``header`` asks for (None: none).

    ``return_logits`` must be a boolean; ``logits_topk``, when present (null
    included), an integer in ``[1, vocab_size]`` and only with
    ``return_logits: true``. Anything else raises ``ProtocolError``.
    """
    wanted = header.get(RETURN_LOGITS, False)
    if type(wanted) is not bool:
        raise ProtocolError(f"{RETURN_LOGITS} must be a boolean")
    topk = 0
    if LOGITS_TOPK in header:
        topk = header[LOGITS_TOPK]
        if not wanted:
            raise ProtocolError(f"{LOGITS_TOPK} needs {RETURN_LOGITS}: true")
        if type(topk) is not int or not 1 <= topk <= vocab_size:
            raise ProtocolError(
                f"{LOGITS_TOPK} must be an integer in [1, {vocab_size}], got {topk!r}"
            )
    return LogitsFormat(vocab_size, topk) if wanted else None


def sample_positions(
    anchor_positions: Sequence[int] | np.ndarray,
    num_speculative_tokens: int,
    max_model_len: int,
) -> list[list[int | None]]:
    """Per request and slot ``j``: ``anchor + 1 + j``, or None at or past
    ``max_model_len``."""
    # Plain Python: a few dozen ints, built on every PROPOSE.
    return [
        [
            p if p < max_model_len else None
            for p in range(anchor + 1, anchor + 1 + num_speculative_tokens)
        ]
        for anchor in map(int, anchor_positions)
    ]


def encode_logits(
    logits: torch.Tensor,
    fmt: LogitsFormat,
    positions: list[list[int | None]],
) -> tuple[dict[str, Any], torch.Tensor]:
    """Server side: the reply entry (``reply_metadata``) and the frame bytes
    (uint8, on the logits' device) of pre-temperature ``logits`` ``[R, K, V]``.

    Values are the logits rounded to bf16; top-k frames are ``topk_frame``'s.
    """
    return reply_metadata(logits, fmt, positions), logits_frame(logits, fmt)


def logits_frame(logits: torch.Tensor, fmt: LogitsFormat) -> torch.Tensor:
    """The frame bytes (uint8, on the logits' device) of ``logits``
    ``[R, K, V]`` in ``fmt``: bf16 values, or ``topk_frame``'s for top-k."""
    if fmt.topk:
        return topk_frame(logits, fmt.topk)
    return logits.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)


def reply_metadata(
    logits: torch.Tensor,
    fmt: LogitsFormat,
    positions: list[list[int | None]],
) -> dict[str, Any]:
    """The reply entry of ``logits`` ``[R, K, V]`` in ``fmt`` (less
    ``capability`` and ``num_frames``); ``ValueError`` unless V is ``fmt``'s
    vocabulary."""
    num_requests, num_tokens, vocab = logits.shape
    if vocab != fmt.vocab_size:
        raise ValueError(f"engine logits have {vocab} columns, not {fmt.vocab_size}")
    meta = fmt.metadata(num_requests, num_tokens)
    meta["sample_positions"] = positions
    return meta


def topk_frame(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k frame's bytes (uint8, on the logits' device) of ``logits``
    ``[R, K, V]``: the ``k`` largest bf16 values of each slot, then their ids
    as int32, both ``[R, K, k]``. CUDA logits are selected by
    ``topk_select.topk_rows`` where it serves ``(V, k)`` (column order, ties
    to the smaller id), others by ``torch.topk`` (its order and ties)."""
    values = logits.to(torch.bfloat16).contiguous()
    rows, vocab = values.shape[0] * values.shape[1], values.shape[2]
    selected = None
    if values.is_cuda:
        from vllm.k3_draft import topk_select

        if topk_select.supports(vocab, k):
            selected = topk_select.topk_rows(values.view(rows, vocab), k)
    if selected is None:
        top, ids = values.topk(k, dim=-1, sorted=False)
        selected = top.contiguous(), ids.to(torch.int32)
    top, ids = selected
    return torch.cat(
        (top.view(torch.uint8).reshape(-1), ids.view(torch.uint8).reshape(-1))
    )


@dataclass(frozen=True)
class DecodedLogits:
    """A validated logits frame, aliasing its buffer: ``values`` int16 bit
    patterns of the bf16 logits ``[R, K, W]``; ``ids`` int32 ``[R, K, k]``
    (None for the full vocabulary); ``positions`` int64 ``[R, K]``, -1 where
    a slot has no sample position."""

    values: np.ndarray
    ids: np.ndarray | None
    positions: np.ndarray


def _check_positions(
    got: Any, anchor_positions: np.ndarray, num_tokens: int, max_model_len: int
) -> np.ndarray:
    """``got`` must be the wire form of the slots' positions (ints or None,
    not JSON booleans or floats); returns them as int64 ``[R, K]``, -1 for
    None."""
    expected = sample_positions(anchor_positions, num_tokens, max_model_len)
    if got != expected or any(
        value is not None and type(value) is not int for row in got for value in row
    ):
        raise ProtocolError(
            "logits sample_positions are not the positions of the drafted slots"
        )
    rows = [[-1 if p is None else p for p in row] for row in expected]
    return np.array(rows, dtype=np.int64).reshape(len(expected), num_tokens)


def _check_values(values: np.ndarray) -> None:
    """No NaN, no +inf, no value of ``2**16`` or more (-inf and large negative
    values are masked tokens), and in every slot a value of magnitude below
    ``2**16``."""
    large = (values & _EXPONENT) >= _TOO_LARGE  # also every infinity and NaN
    if not large.any():
        return
    flagged = values[large]
    infinite = (flagged & _EXPONENT) == _EXPONENT
    if (flagged[infinite] & _MANTISSA).any():
        raise ProtocolError("logits frame holds NaN")
    # A negative value's sign bit makes its int16 negative.
    if (flagged[infinite] >= 0).any():
        raise ProtocolError("logits frame holds +inf")
    if (flagged >= 0).any():
        raise ProtocolError("logits frame holds a value >= 2**16")
    if large.all(axis=-1).any():
        raise ProtocolError(
            "logits frame has a slot without a logit of magnitude below 2**16"
        )


def _check_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Vocabulary ids, distinct within each slot."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ProtocolError(f"logits ids outside the vocabulary [0, {vocab_size})")
    ordered = np.sort(ids, axis=-1)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ProtocolError("logits ids repeat within a drafted slot")


def decode_logits(
    metadata: Mapping[str, Any],
    frames: Sequence[Any],
    fmt: LogitsFormat,
    anchor_positions: np.ndarray,
    num_speculative_tokens: int,
    max_model_len: int,
) -> DecodedLogits:
    """Client side: validate one reply entry and its frames against what was
    asked: ``fmt`` for the requests at ``anchor_positions`` drafting
    ``num_speculative_tokens`` slots each, on a model of ``max_model_len``
    positions. Raises ``ProtocolError`` for any deviation."""
    num_requests, num_tokens = len(anchor_positions), num_speculative_tokens
    keys = _TOPK_KEYS if fmt.topk else _FULL_KEYS
    if metadata.keys() != keys:
        raise ProtocolError(
            f"logits entry fields {sorted(metadata)} are not {sorted(keys)}"
        )
    if metadata["capability"] != fmt.capability:
        raise ProtocolError(f"logits entry is {metadata['capability']!r}")
    if metadata["num_frames"] != 1 or len(frames) != 1:
        raise ProtocolError(f"logits entry carries {len(frames)} frames, not 1")
    expected = fmt.metadata(num_requests, num_tokens)
    for name, want in expected.items():
        got = metadata[name]
        ok = (
            got == want and all(type(v) is int for v in got)
            if isinstance(want, list)
            else got == want and type(got) is type(want)
        )
        if not ok:
            raise ProtocolError(f"logits {name} is {got!r}, expected {want!r}")
    positions = _check_positions(
        metadata["sample_positions"], anchor_positions, num_tokens, max_model_len
    )
    view = memoryview(frames[0]).cast("B")
    if view.nbytes != expected["nbytes"]:
        raise ProtocolError(
            f"logits frame has {view.nbytes} bytes, expected {expected['nbytes']}"
        )
    shape = (num_requests, num_tokens, fmt.width)
    count = num_requests * num_tokens * fmt.width
    values = np.frombuffer(view, dtype="<i2", count=count).reshape(shape)
    _check_values(values)
    ids = None
    if fmt.topk:
        offset = count * _VALUE_BYTES
        ids = np.frombuffer(view, dtype="<i4", count=count, offset=offset)
        ids = ids.reshape(shape)
        _check_ids(ids, fmt.vocab_size)
    return DecodedLogits(values, ids, positions)
