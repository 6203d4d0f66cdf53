# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Validation of draft-server requests, done whole before any state changes.

``ProposeParser`` and the other parsers check what a message says by itself
(fields, types, bounds, frame counts and exact byte lengths, contiguous
positions);
``check_propose`` and ``plan_reconnect`` check it against the request table.
Every violation raises ``ProtocolError``.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm.k3_draft.context_cache import covered_start
from vllm.k3_draft.engine import DraftLimits
from vllm.k3_draft.protocol import (
    MAX_REQUEST_ID_CHARS,
    PROPOSE_REQUEST_FIELDS,
    ProtocolError,
    ReplyExtension,
    frame_tensor,
)

_ENVELOPE = frozenset({"protocol", "op"})


@dataclass
class RequestState:
    """A retained request: its slot, valid positions ``[start, end)``, the
    high-water mark ``high`` of positions written (``high >= end``), the
    ``origin`` of its history (its reset position; a reconnected request
    inherits its source's) and ``rows_start``, the first position whose
    context-cache row it holds (``origin <= rows_start <= start``; the ring
    keeps fewer, see ``context_cache.covered_start``). A PROPOSE attends the
    window before its anchor from ``start`` on: ``start > origin`` (a
    RECONNECT restored the window only) means the positions in
    ``[origin, start)`` exist but hold no K/V; a RECONNECT into the request
    itself keeps the rows it held before ``start``."""

    slot: int
    start: int
    end: int
    high: int
    origin: int
    rows_start: int


@dataclass(slots=True)
class ProposeEntry:
    request_id: str
    reset: bool
    reset_position: int
    context_count: int
    anchor_token_id: int
    anchor_position: int
    # First context position: anchor_position - context_count.
    first_position: int


@dataclass
class ParsedPropose:
    num_speculative_tokens: int
    entries: list[ProposeEntry]
    positions: torch.Tensor
    rows: torch.Tensor
    extensions: list[tuple[ReplyExtension, Any]]


def check_fields(header: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """Refuse header fields outside ``allowed`` (besides protocol and op)."""
    # One pass over the few keys, no set built: this runs on every request.
    unknown = [key for key in header if key not in allowed and key not in _ENVELOPE]
    if unknown:
        raise ProtocolError(f"unknown header fields {sorted(unknown)}")


def check_frame_count(frames: Sequence[Any], expected: int, op: str) -> None:
    if len(frames) != expected:
        raise ProtocolError(
            f"{op} carries {len(frames)} tensor frames, expected {expected}"
        )


def _int(value: Any, name: str, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high)`` (bools are not ints here)."""
    if type(value) is not int or not low <= value < high:
        raise ProtocolError(
            f"{name} must be an integer in [{low}, {high}), got {value!r}"
        )
    return value


def request_id(value: Any, name: str = "request_id") -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_REQUEST_ID_CHARS:
        raise ProtocolError(
            f"{name} must be a non-empty string of at most "
            f"{MAX_REQUEST_ID_CHARS} characters"
        )
    return value


def request_ids(header: Mapping[str, Any]) -> list[str]:
    """The ``request_ids`` list of RESET/FREE (distinct ids)."""
    ids = header.get("request_ids")
    if not isinstance(ids, list):
        raise ProtocolError("request_ids must be a list")
    parsed = [request_id(value, "request_ids entry") for value in ids]
    if len(set(parsed)) != len(parsed):
        raise ProtocolError("request_ids holds duplicates")
    return parsed


class ProposeParser:
    """Stateless checks of a PROPOSE (see the module docstring), with the
    server's bounds and offered reply extensions bound once."""

    def __init__(
        self,
        limits: DraftLimits,
        vocab_size: int,
        context_width: int,
        extensions: Sequence[ReplyExtension],
        server_info: Mapping[str, Any],
    ) -> None:
        self.limits = limits
        self.vocab_size = vocab_size
        self.context_width = context_width
        self.extensions = list(extensions)
        self.server_info = server_info
        allowed = {"num_speculative_tokens", "requests"}
        for extension in extensions:
            allowed.update(extension.request_fields)
        self.allowed = frozenset(allowed)
        self.entry_fields = set(PROPOSE_REQUEST_FIELDS)
        # The frames of a PROPOSE without context rows (empty, never written).
        self._no_positions = torch.empty(0, dtype=torch.int64)
        self._no_rows = torch.empty(0, context_width, dtype=torch.bfloat16)

    def parse(self, header: Mapping[str, Any], frames: Sequence[Any]) -> ParsedPropose:
        limits = self.limits
        check_fields(header, self.allowed)
        k = _int(
            header.get("num_speculative_tokens"),
            "num_speculative_tokens",
            1,
            limits.max_speculative_tokens + 1,
        )
        requests = header.get("requests")
        if not isinstance(requests, list) or not (
            0 < len(requests) <= limits.max_batch_size
        ):
            raise ProtocolError(
                f"requests must be a list of 1 to {limits.max_batch_size} entries"
            )
        entries = [self._entry(item) for item in requests]
        if len({e.request_id for e in entries}) != len(entries):
            raise ProtocolError("a request id appears twice")
        total = sum(e.context_count for e in entries)
        if total > limits.max_context_tokens:
            raise ProtocolError(
                f"{total} context rows exceed max_context_tokens "
                f"{limits.max_context_tokens}"
            )
        check_frame_count(frames, 2 if total else 0, "PROPOSE")
        if total:
            positions = frame_tensor(frames[0], torch.int64, (total,), "positions")
            rows = frame_tensor(
                frames[1], torch.bfloat16, (total, self.context_width), "context rows"
            )
            self._check_positions(frames[0], entries)
        else:
            positions, rows = self._no_positions, self._no_rows
        active = []
        for extension in self.extensions:
            options = extension.parse_request(header, self.server_info)
            if options is not None:
                active.append((extension, options))
        return ParsedPropose(k, entries, positions, rows, active)

    def _entry(self, item: Any) -> ProposeEntry:
        limits = self.limits
        if not isinstance(item, dict) or item.keys() != self.entry_fields:
            raise ProtocolError(
                f"each request needs exactly the fields {list(PROPOSE_REQUEST_FIELDS)}"
            )
        rid = request_id(item["request_id"])
        reset = item["reset"]
        if type(reset) is not bool:
            raise ProtocolError(f"reset of {rid!r} must be a boolean")
        count = _int(
            item["context_count"], "context_count", 0, limits.max_context_tokens + 1
        )
        anchor_position = _int(
            item["anchor_position"], "anchor_position", 0, limits.max_model_len
        )
        first = anchor_position - count
        if first < 0:
            raise ProtocolError(f"context of {rid!r} would start at {first}")
        return ProposeEntry(
            rid,
            reset,
            _int(item["reset_position"], "reset_position", 0, limits.max_model_len),
            count,
            _int(item["anchor_token_id"], "anchor_token_id", 0, self.vocab_size),
            anchor_position,
            first,
        )

    @staticmethod
    def _check_positions(frame: Any, entries: list[ProposeEntry]) -> None:
        """Each request's rows must hold the positions ``[first, anchor)``."""
        expected = array("q")
        for entry in entries:
            expected.extend(range(entry.first_position, entry.anchor_position))
        if memoryview(frame).tobytes() != expected.tobytes():
            raise ProtocolError(
                "context positions are not contiguous up to each request's "
                "anchor position"
            )


def check_propose(
    parsed: ParsedPropose,
    requests: Mapping[str, RequestState],
    num_free_slots: int,
    max_rewind: int,
    window_size: int,
) -> None:
    """Check a parsed PROPOSE against the request table."""
    new = 0
    for entry in parsed.entries:
        rid = entry.request_id
        state = requests.get(rid)
        if entry.reset:
            new += state is None
            if entry.first_position != entry.reset_position:
                raise ProtocolError(
                    f"request {rid!r} resets at {entry.reset_position} but its "
                    f"context starts at {entry.first_position}"
                )
            continue
        if state is None:
            raise ProtocolError(f"unknown request {rid!r} (reset it first)")
        if entry.context_count == 0:
            if entry.anchor_position != state.end:
                raise ProtocolError(
                    f"anchor_position {entry.anchor_position} of {rid!r} is not "
                    f"its committed end {state.end}"
                )
            continue
        first = entry.first_position
        if first > state.end:
            raise ProtocolError(
                f"context of {rid!r} starts at {first}, after its committed end "
                f"{state.end}"
            )
        # The KV ring holds what was written up to the high-water mark: an
        # earlier rewind does not bring back what later positions overwrote.
        if first < state.start or state.high - first > max_rewind:
            raise ProtocolError(
                f"context of {rid!r} rewinds to {first}: allowed back to "
                f"{max(state.start, state.high - max_rewind)} (reset instead)"
            )
        # A restored request has no K/V before its restored start: an anchor
        # whose window reaches there would draft from less than its history.
        window_start = entry.anchor_position - window_size
        if state.start > state.origin and window_start < state.start:
            raise ProtocolError(
                f"context of {rid!r} rewinds to {first}: the window of anchor "
                f"{entry.anchor_position} reaches {window_start}, before the "
                f"restored start {state.start} (reset instead)"
            )
    if new > num_free_slots:
        raise ProtocolError(
            f"{new} new requests but {num_free_slots} free slots (FREE some first)"
        )


@dataclass(frozen=True)
class ReconnectPlan:
    source: RequestState
    request_id: str
    prefix_end: int
    # Restored valid positions are [restored_start, prefix_end), K/V rebuilt
    # for all of them (a later PROPOSE may rewind into the window's start).
    restored_start: int
    # The target's first cached row: restored_start, or into the source
    # itself the first row it still holds (nothing is copied there).
    rows_start: int


def plan_reconnect(
    header: Mapping[str, Any],
    requests: Mapping[str, RequestState],
    num_free_slots: int,
    limits: DraftLimits,
) -> ReconnectPlan:
    """Validate a RECONNECT against the request table.

    The restore starts at the block-aligned window start before
    ``prefix_end``, or at the source's origin if that is later; the source's
    context cache must hold rows for all of it (from its ``rows_start``, the
    last ``prefix_cache_tokens`` written), else the reply is an error: a
    source that was itself restored from another request later than that has
    no rows to give."""
    check_fields(header, frozenset({"source_request_id", "request_id", "prefix_end"}))
    source_id = request_id(header.get("source_request_id"), "source_request_id")
    rid = request_id(header.get("request_id"))
    prefix_end = _int(header.get("prefix_end"), "prefix_end", 0, limits.max_model_len)
    source = requests.get(source_id)
    if source is None:
        raise ProtocolError(f"unknown source request {source_id!r}")
    if not source.origin <= prefix_end <= source.end:
        raise ProtocolError(
            f"prefix_end {prefix_end} is outside the source's history "
            f"[{source.origin}, {source.end}]"
        )
    if rid not in requests and num_free_slots == 0:
        raise ProtocolError("no free slot for the reconnected request")
    window_start = max(0, prefix_end - limits.window_size)
    aligned = window_start // limits.block_size * limits.block_size
    restored_start = max(aligned, source.origin)
    cached = covered_start(source.rows_start, source.high, limits.prefix_cache_tokens)
    if restored_start < cached:
        raise ProtocolError(
            f"restore from {restored_start} is not covered: the source's context "
            f"cache holds positions [{cached}, {source.end})"
        )
    return ReconnectPlan(
        source=source,
        request_id=rid,
        prefix_end=prefix_end,
        restored_start=restored_start,
        # Into itself the rows up to prefix_end stay; the high-water mark
        # drops to prefix_end, so the ring's bound is folded in here.
        rows_start=cached if rid == source_id else restored_start,
    )
