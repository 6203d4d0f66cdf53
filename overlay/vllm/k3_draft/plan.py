# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-request plan of the remote draft client (rank 0 of the verifier).

``RemotePlan`` mirrors what the draft server retains for this verifier and
turns one verifier step (``StepInputs``) into RPCs, in this order:

1. handshake when none holds (first step, or after a failure). Every reply
   names its server: one from another ``server_id`` than the handshake
   accepted (the server restarted; ZeroMQ reconnected by itself) fails the
   step closed, and the handshake of the next step checks the new server
   against this engine like the first one, CLEARs what it holds and forgets
   everything retained;
2. one FREE of the stale requests and of the least recently used requests not
   in the batch that must make room (FREE of an unknown id is a no-op); a
   reply counting more requests on the server than the plan retains means a
   late PROPOSE left some there: CLEAR, and every request starts afresh;
3. per request that the server cannot simply continue: RECONNECT from a
   retained prefix whose tokens are identical, else a cold bootstrap (``reset``
   at its first context position);
4. one PROPOSE carrying each request's valid context rows (scheduled minus
   rejected).

Fail closed: a request gets -1 (no draft) whenever its step fails, and nothing
of a failed or malformed reply is used. A request whose remote state is
uncertain after a failure is marked stale and FREEd first on the next step; a
failing FREE keeps it stale. A failed call (a timeout or other transport
failure, an error or malformed reply) ends the step for every request. The
first since the last successful PROPOSE is retried with a handshake on the
next step (a late reply, a restarted server); from the second in a row the
client stays offline, with exponential backoff, until a handshake succeeds
again, and so does a handshake that fails. A retry's PING never blocks a
step for the RPC timeout; the RPCs after its PONG (the CLEAR of an earlier verifier's
requests, the step's own) are ordinary calls, which a server that dies right
after the PONG holds up for the timeout, once.

Extension point: a higher layer adds a ``ProposeExtension`` (the verifier half
of a wire capability) by registering a factory with
``register_extension_factory``, typically from its capability plugin module
(``protocol.load_capability_plugins``).
"""

from __future__ import annotations

import abc
import math
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.k3_draft.client import (
    DraftClient,
    IncompatibleServerError,
    ServerChangedError,
    ServerInfo,
    ServerRequirements,
    TransportError,
)
from vllm.k3_draft.log import init_logger
from vllm.k3_draft.protocol import (
    MAX_REQUEST_ID_CHARS,
    OP_CLEAR,
    OP_FREE,
    OP_PROPOSE,
    OP_RECONNECT,
    TIMING_FIELDS,
    ProtocolError,
    RemoteError,
    encode_propose_request,
    extension_frames,
)

logger = init_logger(__name__)

NO_DRAFT = -1
# How long the step that retries a handshake waits for the PONG; a healthy
# server answers a PING well within it.
_PROBE_WAIT_MS = 20
# A failure that no backoff paces (the next step retries at once) is logged at
# most once per this many seconds for each kind of failure.
FAILURE_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class StepRequest:
    """One batch row as the verifier committed it this step.

    ``tokens`` is the request's row of the host token table (at least
    ``anchor_position`` long) or None without a host view; its context rows are
    ``StepInputs.rows[row_offset : row_offset + num_context]``. ``decoding``:
    the request's context this step follows tokens it sampled (not a prefill
    chunk, which may belong to a new request reusing a finished one's id).
    ``prefill_len``: the tokens the runner prefills for the request in all
    (its ``prefill_len``).
    """

    request_id: str
    first_position: int
    num_context: int
    anchor_token_id: int
    row_offset: int
    tokens: np.ndarray | None
    decoding: bool = False
    prefill_len: int = 0

    @property
    def anchor_position(self) -> int:
        return self.first_position + self.num_context

    @property
    def prefill_continues(self) -> bool:
        """A prefill chunk that leaves prompt tokens for later steps (its
        anchor is the next prompt token, not a sampled one): the request's
        next step can only be its own next chunk."""
        return not self.decoding and self.anchor_position < self.prefill_len


@dataclass(frozen=True)
class StepInputs:
    """A verifier step: its requests in batch order, the number of draft
    tokens wanted per request (0 keeps the server in sync without drafts) and
    the host context rows (bf16 ``[rows, width]``); ``extensions``: those
    of the plan's extensions that this step asks for (None: all of them)."""

    requests: Sequence[StepRequest]
    num_speculative_tokens: int
    rows: torch.Tensor
    extensions: Sequence[ProposeExtension] | None = None


@dataclass(frozen=True)
class Proposal:
    """The requests one PROPOSE carried, in wire order."""

    request_ids: tuple[str, ...]
    batch_rows: np.ndarray
    anchor_positions: np.ndarray
    num_speculative_tokens: int


@dataclass
class StepResult:
    """``tokens`` int64 ``[R, num_speculative_tokens]`` in batch order, -1
    where no draft; ``payloads`` by capability, from ``ProposeExtension.consume``
    (empty when the PROPOSE failed)."""

    tokens: np.ndarray
    payloads: dict[str, Any] = field(default_factory=dict)


class ProposeExtension(abc.ABC):
    """Verifier half of a wire capability (``protocol.ReplyExtension`` is the
    server half). ``capability`` must be advertised in PONG, else the
    handshake refuses the server."""

    capability: str

    def wanted(self, input_batch: Any, num_speculative_tokens: int) -> bool:
        """Every TP rank, when the step is proposed (``num_speculative_tokens``
        drafts a request, 0 when the step skips drafts): whether this step
        asks for the capability (the same answer on every rank). A step that
        does not ask neither consumes nor publishes it. Default: every step."""
        return True

    @abc.abstractmethod
    def request_fields(self, num_speculative_tokens: int) -> dict[str, Any]:
        """PROPOSE header fields that ask for this capability."""

    @abc.abstractmethod
    def consume(
        self, metadata: dict[str, Any], frames: list[Any], proposal: Proposal
    ) -> Any:
        """Validate this capability's reply entry and frames for ``proposal``
        and return a payload owning its memory (the frames are reused by the
        next RPC). Any violation raises ``ProtocolError``: the step fails
        closed."""

    def publish(self, payload: Any | None, context: Any) -> None:  # noqa: B027
        """Every TP rank, in the same order, once the draft tokens are
        broadcast: ``payload`` is ``consume``'s result on rank 0 (None on the
        other ranks and when the step failed); ``context`` is the speculator's
        view of the step. Default: nothing."""


ExtensionFactory = Callable[[Any], "ProposeExtension | None"]
EXTENSION_FACTORIES: list[ExtensionFactory] = []


def register_extension_factory(factory: ExtensionFactory) -> None:
    """Register ``factory(speculator) -> ProposeExtension | None`` (None: not
    enabled by this engine's configuration). Factories run when a remote
    speculator is built; import vLLM-only modules inside the factory so that
    capability plugins stay importable on draft hosts."""
    if factory not in EXTENSION_FACTORIES:
        EXTENSION_FACTORIES.append(factory)


class _TokenLog:
    """A retained request's committed tokens ``[0, end)`` (grows in place)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self._buf = np.array(tokens, dtype=np.int32)
        self.length = len(tokens)

    def prefix_equals(self, tokens: np.ndarray, end: int) -> bool:
        return end <= self.length and np.array_equal(self._buf[:end], tokens[:end])

    def assign(self, tokens: np.ndarray, keep: int, end: int) -> None:
        """Keep ``[0, keep)`` and copy ``tokens[keep:end]`` after it."""
        if end > len(self._buf):
            grown = np.empty(max(end, 2 * len(self._buf)), dtype=np.int32)
            grown[:keep] = self._buf[:keep]
            self._buf = grown
        self._buf[keep:end] = tokens[keep:end]
        self.length = end


@dataclass
class _Retained:
    """What the server holds for a request: valid positions ``[start, end)``."""

    start: int
    end: int
    tokens: _TokenLog | None
    last_used: int
    stale: bool = False
    reconnectable: bool = True
    # The largest prefix end a RECONNECT from this request was refused at:
    # its context cache only drops old positions, so it covers no prefix
    # end at or below it again.
    refused_end: int = -1
    # The step whose PROPOSE brought the server to ``end`` (-1: a RECONNECT
    # did); a decode step right after it continues the same request, whose
    # id no new request can have taken in between.
    proposed_step: int = -1
    # That PROPOSE was a prefill chunk that left prompt tokens to prefill: the
    # next step of its id is its next chunk (a finished request's id, taken
    # by a new request, starts with a prefill chunk too).
    prefill_continues: bool = False


class FailureLog:
    """What the plan (and deferred resolution) logs about failures over a
    long run. A failure that no backoff paces (the next step retries at once,
    so a fault that lets every other step through would otherwise log at the
    step rate) is logged at most once per ``interval_s`` for each kind, its
    next line counting those left out. Once drafts are proposed again after a
    failure was logged, one line says so."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        # By kind: when the last line was logged, and the failures since.
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}
        # When the first failure logged since drafts last resumed was, and
        # the failed calls since (None: none logged).
        self._since: float | None = None
        self._failures = 0

    def admit(self, kind: str) -> str | None:
        """Whether to log a failure of ``kind`` now: the end of its line
        (naming those left out since the last one) or None to leave it out."""
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return None
        self._last[kind] = now
        self.logged()
        left_out = self._left_out.pop(kind, 0)
        if not left_out:
            return ""
        assert last is not None
        return f" ({left_out} more in the {now - last:.0f} s before, not logged)"

    def logged(self) -> None:
        """A failure was logged."""
        if self._since is None:
            self._since = time.monotonic()

    def failed(self) -> None:
        """A call or handshake failed (logged or not)."""
        self._failures += 1

    def failed_and_logged(self) -> None:
        """A call or handshake failed, and its caller logs it."""
        self.failed()
        self.logged()

    def resumed(self, address: str) -> None:
        """A PROPOSE succeeded: say so once after a failure was logged."""
        if self._since is None:
            return
        logger.info(
            "Remote drafting re-enabled through %s (%.1f s after the first "
            "failure logged; %d failed calls since)",
            address,
            time.monotonic() - self._since,
            self._failures,
        )
        self._since = None
        self._failures = 0


class _TimingLog:
    """Mean round trip and server timings, logged every ``interval`` PROPOSEs."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._reset()

    def _reset(self) -> None:
        self._count = 0
        self._round_trip = 0.0
        self._latency = 0.0
        self._timing = dict.fromkeys(TIMING_FIELDS, 0.0)

    def observe(
        self, round_trip_ms: float, latency_ms: float, timing: dict[str, float]
    ) -> None:
        if not self.interval:
            return
        self._count += 1
        self._round_trip += round_trip_ms
        self._latency += latency_ms
        for name in TIMING_FIELDS:
            self._timing[name] += timing[name]
        if self._count < self.interval:
            return
        n = self._count
        logger.info(
            "Remote draft over %d proposals: round trip %.3f ms, server %.3f ms (%s)",
            n,
            self._round_trip / n,
            self._latency / n,
            ", ".join(f"{k} {v / n:.3f}" for k, v in self._timing.items()),
        )
        self._reset()


def rows_frame(rows: torch.Tensor, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """The bytes of ``rows[start:end]`` for each ``(start, end)`` span, in
    order (rows of a C-contiguous CPU tensor), as a uint8 array ``[rows, row
    bytes]`` for ZeroMQ's zero-copy send.

    Adjacent spans (no row rejected or left out) are a view of ``rows``: the
    caller rewrites them only after the round trip (the synchronous path
    returns first; layer 3's device copy waits behind the gate its reply
    thread releases). After a failed round trip the socket is closed with
    LINGER 0, which drops a message not yet sent whole. Other spans are
    gathered by one ``np.take`` (no torch call: on layer 3's reply thread
    each would release the GIL and wait up to the interpreter's switch
    interval to take it back).
    """
    source = rows.view(torch.uint8).numpy()
    if all(end == start for (_, end), (start, _) in zip(spans, spans[1:])):
        return source[spans[0][0] : spans[-1][1]]
    index = np.concatenate([np.arange(start, end) for start, end in spans])
    return np.take(source, index, axis=0)


def _number(value: Any) -> bool:
    """A JSON number (not a bool) that is finite as a float."""
    if type(value) not in (int, float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range
        return False


def parse_tokens(
    header: dict[str, Any], num_requests: int, k: int, vocab_size: int
) -> np.ndarray:
    """The PROPOSE reply's ``tokens`` as int64 ``[R, K]``; ``ProtocolError``
    unless every entry is an int token id of the vocabulary, shape exact."""
    tokens = header.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != num_requests:
        raise ProtocolError(f"reply tokens are not a list of {num_requests} rows")
    out = np.empty((num_requests, k), dtype=np.int64)
    for r, row in enumerate(tokens):
        if not isinstance(row, list) or len(row) != k:
            raise ProtocolError(f"reply tokens row {r} is not a list of {k} ids")
        for j, token in enumerate(row):
            if type(token) is not int or not 0 <= token < vocab_size:
                raise ProtocolError(
                    f"reply token {token!r} at [{r}][{j}] is not a token id "
                    f"of the vocabulary (size {vocab_size})"
                )
            out[r, j] = token
    latency, timing = header.get("latency_ms"), header.get("timing_ms")
    if not _number(latency) or not isinstance(timing, dict):
        raise ProtocolError("reply lacks numeric latency_ms and timing_ms")
    if not all(_number(timing.get(name)) for name in TIMING_FIELDS):
        raise ProtocolError(f"reply timing_ms lacks numeric {list(TIMING_FIELDS)}")
    return out


class RemotePlan:
    """The client's view of the draft server's retained requests; see the
    module docstring. ``run`` is called once per verifier step."""

    def __init__(
        self,
        client: DraftClient,
        needs: ServerRequirements,
        extensions: Sequence[ProposeExtension] = (),
        timing_log_interval: int = 0,
        retry_interval_s: float = 1.0,
        max_retry_interval_s: float = 60.0,
        share_prefixes: bool = True,
    ) -> None:
        self.client = client
        # Whether equal token ids mean equal target hidden states, so that a
        # request may be reconnected from another request's prefix.
        self.share_prefixes = share_prefixes
        self.needs = needs
        self.extensions = list(extensions)
        self.retained: dict[str, _Retained] = {}
        self.server: ServerInfo | None = None
        self._server_id: str | None = None
        self._step = 0
        self._timing = _TimingLog(timing_log_interval)
        self._retry_interval_s = retry_interval_s
        self._max_retry_interval_s = max_retry_interval_s
        self._backoff_s = retry_interval_s
        self._retry_at = 0.0
        # Failed calls since the last successful PROPOSE.
        self._failed_calls = 0
        # While a PING of a retry is outstanding: when it is given up.
        self._probe_deadline: float | None = None
        self._warned_long_id = False
        self._log = FailureLog(FAILURE_LOG_INTERVAL_S)

    # ------------------------------------------------------------ server

    def connect(self) -> ServerInfo:
        """Handshake now; raises what ``DraftClient.handshake`` raises (the
        caller logs it; the step that drafts again says so)."""
        try:
            info = self.client.handshake(self.needs, self._server_id)
        except BaseException:
            self._log.failed_and_logged()
            raise
        return self._accept(info)

    def _accept(self, info: ServerInfo) -> ServerInfo:
        if self._server_id is not None and info.server_id != self._server_id:
            self._log.logged()
            logger.warning(
                "Draft server restarted (server_id %s -> %s); forgetting %d "
                "retained requests",
                self._server_id,
                info.server_id,
                len(self.retained),
            )
            self.retained.clear()
        self._server_id = info.server_id
        self.server = info
        if not self._failed_calls:
            self._backoff_s = self._retry_interval_s
        return info

    def _online(self) -> bool:
        """Whether a handshake holds. While offline, a due retry sends a PING
        and waits for it at most ``_PROBE_WAIT_MS``; later steps only look
        for its PONG until the RPC timeout, so an unreachable server never
        blocks a step for the timeout."""
        if self.server is not None:
            return True
        try:
            if self._probe_deadline is None:
                if time.monotonic() < self._retry_at:
                    return False
                self.client.start_handshake(watch=True)
                self._probe_deadline = time.monotonic() + self.client.timeout_ms / 1e3
                wait_ms = min(_PROBE_WAIT_MS, self.client.timeout_ms)
            else:
                wait_ms = 0
            info = self.client.finish_handshake(self.needs, self._server_id, wait_ms)
            if info is None:
                if time.monotonic() < self._probe_deadline:
                    return False
                raise self.client.abandon_handshake()
        except (TransportError, ProtocolError, RemoteError) as exc:
            self._probe_deadline = None
            self._go_offline(exc)
            return False
        except IncompatibleServerError as exc:
            self._probe_deadline = None
            self._log.failed_and_logged()
            logger.error("%s; proposing no drafts", exc)
            self._go_offline(None)
            return False
        self._probe_deadline = None
        self._accept(info)
        return True

    def _go_offline(self, exc: Exception | None) -> None:
        if exc is not None:
            self._log.failed_and_logged()
            logger.warning(
                "Remote draft unavailable (%s); no drafts for %.1f s, then retrying",
                exc,
                self._backoff_s,
            )
        self.server = None
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, self._max_retry_interval_s)

    def _call_failed(
        self, op: str, exc: TransportError | ProtocolError | RemoteError
    ) -> None:
        """A call that timed out or got an error or malformed reply. The
        first since the last successful PROPOSE is retried with a handshake
        next step (a late reply, a restarted server); from the second on,
        the server is treated as unreachable (backoff), so a server that
        fails every call costs one timeout or round trip and one warning per
        retry, not one per step; a first failure, which the next step
        retries at once, is logged at most once per
        ``FAILURE_LOG_INTERVAL_S``."""
        self._failed_calls += 1
        if self._failed_calls > 1:
            self._go_offline(exc)
            return
        self._log.failed()
        self.server = None
        suffix = self._log.admit("call")
        if suffix is not None:
            logger.warning(
                "Draft %s failed (%s); no drafts this step, retrying next step%s",
                op,
                exc,
                suffix,
            )

    # -------------------------------------------------------------- step

    def run(self, step: StepInputs) -> StepResult:
        """Draft tokens for ``step`` (see the module docstring)."""
        self._step += 1
        k = step.num_speculative_tokens
        result = StepResult(np.full((len(step.requests), k), NO_DRAFT, np.int64))
        batch = {r.request_id for r in step.requests}
        for rid in batch & self.retained.keys():
            self.retained[rid].last_used = self._step
        try:
            if self._online():
                self._run(step, batch, result)
        except (TransportError, ProtocolError, RemoteError) as exc:
            # A FREE, RECONNECT or CLEAR that failed, or a reply from a
            # restarted server (their requests are already stale): fail
            # closed as a failed PROPOSE does.
            self._call_failed("RPC", exc)
        return result

    def _run(self, step: StepInputs, batch: set[str], result: StepResult) -> None:
        assert self.server is not None
        limit = self.needs.max_model_len
        sendable = [
            i
            for i, r in enumerate(step.requests)
            if r.anchor_position < limit and self._wire_id(r.request_id)
        ]
        self._free(batch, {step.requests[i].request_id for i in sendable})
        free_slots = self.server.max_requests - len(self.retained)
        entries: list[tuple[int, bool]] = []
        for i in sendable:
            request = step.requests[i]
            state = self.retained.get(request.request_id)
            if state is not None and state.stale:
                continue
            if state is not None and self._continues(request, state):
                entries.append((i, False))
                continue
            if state is None:
                if free_slots == 0:
                    continue
                free_slots -= 1
            entries.append((i, not self._reconnect(request)))
        if entries:
            self._propose(step, entries, result)

    def _wire_id(self, rid: str) -> bool:
        """Whether the protocol can carry ``rid``; a request it cannot gets no
        drafts (and is never retained, so no FREE ever names it)."""
        if 0 < len(rid) <= MAX_REQUEST_ID_CHARS:
            return True
        if not self._warned_long_id:
            self._warned_long_id = True
            logger.warning(
                "Request ids of 1..%d characters only cross the draft protocol; "
                "a request with an id of %d gets no drafts",
                MAX_REQUEST_ID_CHARS,
                len(rid),
            )
        return False

    def _continues(self, request: StepRequest, state: _Retained) -> bool:
        """Whether the server's state is the committed prefix of ``request``."""
        if request.first_position != state.end:
            return False
        if state.proposed_step == self._step - 1 and (
            request.decoding or (request.tokens is None and state.prefill_continues)
        ):
            return True
        # Back after an absence or a step without a PROPOSE of it (the server
        # unreachable, a call before it failed: the verifier may have finished
        # the request and prefilled a new one under its id meanwhile), or a
        # prefill chunk: its tokens may differ from those the server holds,
        # and without a host view only a chunk after its own earlier chunk is
        # known to be the same request.
        return (
            state.tokens is not None
            and request.tokens is not None
            and state.tokens.prefix_equals(request.tokens, state.end)
        )

    def _free(self, batch: set[str], sending: set[str]) -> None:
        """FREE the stale requests and the LRU ones that must make room."""
        assert self.server is not None
        ids = [rid for rid, state in self.retained.items() if state.stale]
        live = self.retained.keys() - set(ids)
        overflow = len(live | sending) - self.server.max_requests
        if overflow > 0:
            idle = sorted(
                (state.last_used, rid)
                for rid, state in self.retained.items()
                if not state.stale and rid not in batch
            )
            ids += [rid for _, rid in idle[:overflow]]
        if not ids:
            return
        try:
            reply, _ = self.client.call(OP_FREE, request_ids=ids)
        except (TransportError, ProtocolError, RemoteError) as exc:
            for rid in ids:
                self.retained[rid].stale = True
            if isinstance(exc, (TransportError, ServerChangedError)):
                raise
            suffix = self._log.admit("free")
            if suffix is not None:
                logger.warning(
                    "Draft FREE failed (%s); retrying next step%s", exc, suffix
                )
            return
        for rid in ids:
            del self.retained[rid]
        active = reply.get("active_requests")
        if type(active) is int and active > len(self.retained):
            self._clear(active)

    def _clear(self, active: int) -> None:
        """The server holds ``active`` requests, more than this plan retains:
        a PROPOSE that reached it after the FREE of its requests (late, past a
        timeout) left some that no FREE will name, their slots taken for good.
        CLEAR the server; every request starts afresh."""
        suffix = self._log.admit("clear")
        if suffix is not None:
            logger.warning(
                "Draft server holds %d requests, this verifier knows of %d; "
                "clearing it (a late PROPOSE left them; if this recurs, another "
                "verifier uses this draft server: run one per verifier)%s",
                active,
                len(self.retained),
                suffix,
            )
        for state in self.retained.values():
            state.stale = True
        self.client.call(OP_CLEAR)
        self.retained.clear()

    def _reconnect(self, request: StepRequest) -> bool:
        """RECONNECT ``request`` from a retained identical prefix; False when
        it must cold-bootstrap instead."""
        rid, prefix_end = request.request_id, request.first_position
        source_id = self._find_source(request)
        if source_id is None:
            return False
        try:
            reply, frames = self.client.call(
                OP_RECONNECT,
                source_request_id=source_id,
                request_id=rid,
                prefix_end=prefix_end,
            )
            restored = reply.get("restored_start")
            if (
                frames
                or type(restored) is not int
                or not 0 <= restored <= prefix_end
                or reply.get("prefix_end") != prefix_end
            ):
                raise ProtocolError(f"malformed RECONNECT reply {reply}")
        except RemoteError as exc:
            logger.info("RECONNECT %s from %s refused: %s", rid, source_id, exc)
            source = self.retained[source_id]
            source.refused_end = max(source.refused_end, prefix_end)
            return False
        except (TransportError, ProtocolError):
            self.retained[source_id].reconnectable = False
            self._mark_stale(rid)
            raise
        assert request.tokens is not None
        state = self.retained.get(rid)
        if state is None or state.tokens is None:
            state = _Retained(
                restored, prefix_end, _TokenLog(request.tokens[:prefix_end]), self._step
            )
            self.retained[rid] = state
        else:
            # The source may be another request: the log is the request's
            # tokens up to prefix_end, whatever it held before.
            state.start, state.end = restored, prefix_end
            state.tokens.assign(request.tokens, 0, prefix_end)
            state.proposed_step = -1
        return True

    def _find_source(self, request: StepRequest) -> str | None:
        """A reconnectable retained request whose valid positions reach the
        request's first position with identical tokens before it; the request
        itself first, then (with ``share_prefixes``) the one whose valid
        positions start earliest (the server restores the draft's window
        from the source's positions only), the most recently used of those."""
        if request.tokens is None or request.first_position == 0:
            return None
        prefix_end = request.first_position
        if self.share_prefixes:
            candidates = sorted(
                self.retained.items(),
                key=lambda item: (
                    item[0] != request.request_id,
                    item[1].start,
                    -item[1].last_used,
                ),
            )
        else:
            own = self.retained.get(request.request_id)
            candidates = [] if own is None else [(request.request_id, own)]
        for rid, state in candidates:
            if (
                not state.stale
                and state.reconnectable
                and state.tokens is not None
                and state.start <= prefix_end <= state.end
                and prefix_end > state.refused_end
                and state.tokens.prefix_equals(request.tokens, prefix_end)
            ):
                return rid
        return None

    def _mark_stale(self, rid: str) -> None:
        state = self.retained.get(rid)
        if state is None:
            self.retained[rid] = _Retained(0, 0, None, self._step, stale=True)
        else:
            state.stale = True

    def _propose(
        self, step: StepInputs, entries: list[tuple[int, bool]], result: StepResult
    ) -> None:
        k = max(step.num_speculative_tokens, 1)
        requests = [step.requests[i] for i, _ in entries]
        spans = [
            (r.row_offset, r.row_offset + r.num_context)
            for r in requests
            if r.num_context
        ]
        frames: list[Any] = []
        if spans:
            # A few dozen ints: plain Python beats numpy calls here.
            positions = array("q")
            for r in requests:
                positions.extend(range(r.first_position, r.anchor_position))
            frames = [positions, rows_frame(step.rows, spans).data]
        proposal = Proposal(
            request_ids=tuple(r.request_id for r in requests),
            batch_rows=np.array([i for i, _ in entries], dtype=np.int64),
            anchor_positions=np.array([r.anchor_position for r in requests]),
            num_speculative_tokens=k,
        )
        extensions = self.extensions if step.extensions is None else step.extensions
        fields: dict[str, Any] = {}
        for extension in extensions:
            fields.update(extension.request_fields(k))
        wire = [
            (
                r.request_id,
                reset,
                r.first_position,
                r.num_context,
                r.anchor_token_id,
                r.anchor_position,
            )
            for r, (_, reset) in zip(requests, entries)
        ]
        sent = time.perf_counter()
        try:
            request = encode_propose_request(k, wire, fields)
            header, reply_frames = self.client.call_encoded(OP_PROPOSE, request, frames)
            round_trip_ms = (time.perf_counter() - sent) * 1e3
            tokens = parse_tokens(header, len(requests), k, self.needs.vocab_size)
            payloads = self._consume(header, reply_frames, proposal, extensions)
        except BaseException as exc:
            # The server may hold the requests whatever failed here (an
            # extension's bug too, which a deferred reply thread only logs):
            # FREE them on the next step.
            for r in requests:
                self._mark_stale(r.request_id)
            if not isinstance(exc, (TransportError, ProtocolError, RemoteError)):
                raise
            self._call_failed("PROPOSE", exc)
            return
        self._failed_calls = 0
        self._backoff_s = self._retry_interval_s
        self._log.resumed(self.client.address)
        self._timing.observe(round_trip_ms, header["latency_ms"], header["timing_ms"])
        for r, (_, reset) in zip(requests, entries):
            self._commit(r, reset)
        width = step.num_speculative_tokens
        result.tokens[proposal.batch_rows] = tokens[:, :width]
        result.payloads = payloads

    def _consume(
        self,
        header: dict[str, Any],
        frames: list[Any],
        proposal: Proposal,
        extensions: Sequence[ProposeExtension],
    ) -> dict[str, Any]:
        replies = extension_frames(header, frames)
        wanted = {extension.capability for extension in extensions}
        if replies.keys() != wanted:
            raise ProtocolError(
                f"reply extensions {sorted(replies)} do not answer {sorted(wanted)}"
            )
        payloads = {}
        for extension in extensions:
            metadata, frames = replies[extension.capability]
            payloads[extension.capability] = extension.consume(
                metadata, frames, proposal
            )
        return payloads

    def _commit(self, request: StepRequest, reset: bool) -> None:
        """Record a successful PROPOSE of ``request``."""
        rid, end = request.request_id, request.anchor_position
        state = self.retained.get(rid)
        tokens = request.tokens
        if reset or state is None:
            log = None if tokens is None else _TokenLog(tokens[:end])
            self.retained[rid] = _Retained(
                request.first_position,
                end,
                log,
                self._step,
                proposed_step=self._step,
                prefill_continues=request.prefill_continues,
            )
            return
        if state.tokens is not None and tokens is not None:
            state.tokens.assign(tokens, request.first_position, end)
        state.end = end
        state.last_used = self._step
        state.proposed_step = self._step
        state.prefill_continues = request.prefill_continues
