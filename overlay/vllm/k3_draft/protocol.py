# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Wire protocol version 2 of the remote draft transport.

Transport: ZeroMQ; the draft server binds a REP socket, the verifier connects a
REQ socket. Every message is multipart:

* frame 0: a UTF-8 JSON object (the *header*). Every header carries
  ``"protocol": 2`` and ``"op"``. A request's op is one of ``REQUEST_OPS``. A
  reply is ``{"ok": true, "protocol": 2, "op": <op>, "server_id": <id>, ...}``
  (op ``"PONG"`` for PING, else the request's op) or ``{"ok": false,
  "protocol": 2, "op": "ERROR", "server_id": <id>, "error": "<Type>:
  <message>"}``. Every reply names the server process that wrote it (the id
  changes when the process restarts), so a client sees a restart in the first
  reply of the new process; PONG's ``capabilities`` lists
  ``CAPABILITY_REPLY_SERVER_ID`` to say so. A version mismatch is an error on
  both sides. NaN and infinities are not valid JSON here.
* frames 1..n: raw little-endian tensor bytes, C order, no padding; their dtype
  and shape follow from the header. A frame's byte length must match exactly.

PROPOSE request: ``num_speculative_tokens`` (K) and ``requests``, a list of
objects with ``PROPOSE_REQUEST_FIELDS``. When the total ``context_count`` is
positive, frame 1 holds the positions (int64 ``[total]``) and frame 2 the
context rows (bf16 ``[total, width]``), in request order. The reply carries
``tokens`` (``[R][K]`` ints), ``latency_ms`` and ``timing_ms`` (keys
``TIMING_FIELDS``).

Extension point (layering rule): a higher layer adds a *capability* by
registering a ``ReplyExtension`` in ``CAPABILITIES``, from its own module placed
in the ``vllm.k3_draft.capabilities`` package (``load_capability_plugins``
imports every module there). The server advertises the offered capabilities in
PONG, accepts the PROPOSE header fields the extension declares, and appends the
extension's frames to the PROPOSE reply only when the header asks for them:
the reply header then lists, in frame order, one entry per active extension in
``"extensions"``: ``{"capability": name, "num_frames": n, ...metadata}``. A
client that asks for nothing receives exactly one frame, as before.
"""

from __future__ import annotations

import abc
import importlib
import json
import json.encoder
import math
import pkgutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in use
    raise ImportError("the k3 draft wire protocol needs a little-endian host")

PROTOCOL_VERSION = 2

OP_PING = "PING"
OP_PONG = "PONG"
OP_PROPOSE = "PROPOSE"
OP_RESET = "RESET"
OP_FREE = "FREE"
OP_CLEAR = "CLEAR"
OP_RECONNECT = "RECONNECT"
OP_ERROR = "ERROR"
REQUEST_OPS = frozenset(
    {OP_PING, OP_PROPOSE, OP_RESET, OP_FREE, OP_CLEAR, OP_RECONNECT}
)

# Fields of a PONG reply besides ok/protocol/op, in the spec's order.
PONG_FIELDS = (
    "method",
    "capabilities",
    "max_requests",
    "max_batch_size",
    "max_speculative_tokens",
    "max_context_tokens",
    "context_width",
    "vocab_size",
    "max_model_len",
    "block_size",
    "window_size",
    "prefix_cache_tokens",
    "cuda_graph_shapes",
    "active_requests",
    "server_id",
)
# Fields of one entry of a PROPOSE request's "requests" list.
PROPOSE_REQUEST_FIELDS = (
    "request_id",
    "reset",
    "reset_position",
    "context_count",
    "anchor_token_id",
    "anchor_position",
)
# Keys of a PROPOSE reply's "timing_ms" object (milliseconds, floats).
TIMING_FIELDS = (
    "decode",
    "lock_wait",
    "context",
    "query",
    "device_wait",
    "copy_back",
    "total",
)
METHODS = ("dspark", "dflash")
# Capability every server of this release advertises in PONG: all its replies
# carry server_id (a server of the previous release names itself in PONG only).
CAPABILITY_REPLY_SERVER_ID = "reply_server_id"
# Longest request id (in characters) a server accepts.
MAX_REQUEST_ID_CHARS = 512

# Wire dtype names -> torch dtypes (all little-endian on the wire).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
}


class ProtocolError(ValueError):
    """A message violates the wire contract (either direction)."""


class ForeignProtocolError(ProtocolError):
    """A header names another protocol version (``version``): a peer of
    another release."""

    def __init__(self, version: int) -> None:
        super().__init__(f"protocol version {version!r} is not {PROTOCOL_VERSION}")
        self.version = version


class RemoteError(RuntimeError):
    """The peer answered ``ok: false``; ``str()`` is its ``"<Type>: <msg>"``."""


def format_error(exc: BaseException) -> str:
    """The ``error`` string of a reply: ``"<Type>: <message>"``."""
    return f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------- headers


def request_header(op: str, **fields: Any) -> dict[str, Any]:
    """A request header for ``op`` with ``fields``."""
    return {"protocol": PROTOCOL_VERSION, "op": op, **fields}


def ok_reply(op: str, **fields: Any) -> dict[str, Any]:
    """A success reply header; ``op`` is ``OP_PONG`` for PING, else the op."""
    return {"ok": True, "protocol": PROTOCOL_VERSION, "op": op, **fields}


def error_reply(exc: BaseException, server_id: str) -> dict[str, Any]:
    """A failure reply header for ``exc`` from the server ``server_id``."""
    return {
        "ok": False,
        "protocol": PROTOCOL_VERSION,
        "op": OP_ERROR,
        "server_id": server_id,
        "error": format_error(exc),
    }


# A JSON string literal of a str (ASCII, escaped).
_quote = json.encoder.encode_basestring_ascii
# One encoder: json.dumps with keywords builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def encode_header(header: Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON of ``header`` (NaN/inf refused)."""
    try:
        text = _ENCODER.encode(header)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"header is not encodable JSON: {exc}") from exc
    return text.encode()


_PROPOSE_REPLY_TIMINGS = (
    b',"timing_ms":{'
    + b",".join(b'"%s":%%.4f' % name.encode() for name in TIMING_FIELDS)
    + b'},"latency_ms":%.4f}'
)


def propose_reply_head(server_id: str) -> bytes:
    """The constant start of the PROPOSE reply headers of the server
    ``server_id`` (its id JSON-escaped once), for ``propose_reply_body``."""
    return b'{"ok":true,"protocol":%d,"op":"%s","server_id":%s,"tokens":' % (
        PROTOCOL_VERSION,
        OP_PROPOSE.encode(),
        _quote(server_id).encode(),
    )


def propose_reply_body(
    head: bytes,
    tokens: list[list[int]],
    extensions: list[dict[str, Any]] | None = None,
) -> bytes:
    """A successful PROPOSE reply's header up to its timings, formatted
    without a JSON encoder (the server's hot path): ``head`` (the server's
    ``propose_reply_head``), ``tokens`` and, when given, the ``extensions``
    entries. ``encode_propose_reply`` completes it."""
    body = head + str(tokens).replace(" ", "").encode()
    if extensions is not None:
        body += b',"extensions":' + _ENCODER.encode(extensions).encode()
    return body


def encode_propose_reply(body: bytes, timing_ms: Mapping[str, float]) -> bytes:
    """The header of a successful PROPOSE reply: ``body``
    (``propose_reply_body``), ``timing_ms`` (every ``TIMING_FIELDS`` key;
    finite values, written to 0.1 us) and ``latency_ms`` (its ``total``).
    Decodes to ``ok_reply(OP_PROPOSE, server_id=<id>, ...)`` of the fields."""
    values = [timing_ms[name] for name in TIMING_FIELDS]
    return body + _PROPOSE_REPLY_TIMINGS % (*values, timing_ms["total"])


# One PROPOSE request entry: request_id JSON-quoted, reset "true"/"false",
# the ints by str(): a float, bool or None is not truncated or converted but
# reaches the server as a non-int or as invalid JSON, which it refuses.
_PROPOSE_REQUEST_ENTRY = (
    "{" + ",".join(f'"{name}":%s' for name in PROPOSE_REQUEST_FIELDS) + "}"
)


def encode_propose_request(
    num_speculative_tokens: int,
    entries: Sequence[tuple[str, bool, int, int, int, int]],
    fields: Mapping[str, Any],
) -> bytes:
    """The header of a PROPOSE request, formatted without a JSON encoder for
    its entries (the verifier's hot path). ``entries`` hold the values of
    ``PROPOSE_REQUEST_FIELDS`` in that order; ``fields`` are further header
    fields (JSON-encoded). Decodes to ``request_header(OP_PROPOSE, ...)``."""
    requests = ",".join(
        _PROPOSE_REQUEST_ENTRY
        % (_quote(rid), "true" if reset else "false", start, count, token, anchor)
        for rid, reset, start, count, token, anchor in entries
    )
    head = (
        f'{{"protocol":{PROTOCOL_VERSION},"op":"{OP_PROPOSE}",'
        f'"num_speculative_tokens":{num_speculative_tokens},"requests":[{requests}]'
    )
    # The further fields' object, its opening brace dropped, closes the header.
    tail = "," + _ENCODER.encode(fields)[1:] if fields else "}"
    return (head + tail).encode()


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"header holds the non-JSON constant {name}")


# One decoder: json.loads with a keyword builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def decode_header(frame: Any, max_bytes: int) -> dict[str, Any]:
    """Parse frame 0 (any buffer) and check ``protocol`` and ``op``.

    Raises ``ProtocolError`` for more than ``max_bytes`` bytes, invalid UTF-8
    or JSON, a non-object, a wrong or missing protocol (another integer
    version: ``ForeignProtocolError``), or a missing op.
    """
    view = memoryview(frame)
    if view.nbytes > max_bytes:
        raise ProtocolError(f"header has {view.nbytes} bytes, limit {max_bytes}")
    try:
        # Decoded here: json.loads of bytes would also take UTF-16 and UTF-32.
        text = str(view, "utf-8")
        # An object that fills the frame (every header of this release) is
        # decoded without the whitespace scans; anything else takes the whole
        # decoder, which skips surrounding whitespace and refuses the rest.
        header, end = _DECODER.raw_decode(text) if text[:1] == "{" else (None, -1)
        if end != len(text):
            header = _DECODER.decode(text)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as exc:
        # ValueError: bad UTF-8, bad JSON, or an integer over Python's digit
        # limit.
        raise ProtocolError(f"header is not UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    version = header.get("protocol")
    if type(version) is int and version != PROTOCOL_VERSION:
        raise ForeignProtocolError(version)
    if type(version) is not int:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION}")
    op = header.get("op")
    if not isinstance(op, str) or not op:
        raise ProtocolError("header has no op")
    return header


def check_reply(header: dict[str, Any], op: str) -> dict[str, Any]:
    """Client side: accept a decoded reply to ``op`` or raise.

    ``RemoteError`` for ``ok: false``; ``ProtocolError`` for a reply that is
    neither a well-formed error nor a success for ``op``.
    """
    ok = header.get("ok")
    if ok is False:
        error = header.get("error")
        if not isinstance(error, str):
            raise ProtocolError("error reply without an error string")
        raise RemoteError(error)
    expected = OP_PONG if op == OP_PING else op
    if ok is not True or header["op"] != expected:
        raise ProtocolError(f"reply ok={ok!r} op={header['op']!r} does not answer {op}")
    return header


# ----------------------------------------------------------- tensor frames


def tensor_frame(tensor: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU tensor, for ``send(copy=False)``.

    The view aliases ``tensor``'s storage: keep the tensor unchanged until the
    message is sent.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ProtocolError("tensor frames need contiguous CPU tensors")
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data


def frame_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Exact byte length of a frame holding ``shape`` of ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def frame_tensor(
    frame: Any, dtype: torch.dtype, shape: Sequence[int], name: str
) -> torch.Tensor:
    """View a received frame as a tensor of exactly ``shape`` and ``dtype``.

    Raises ``ProtocolError`` (naming the frame ``name``) unless the frame's byte
    length is exactly ``frame_nbytes(dtype, shape)``. A writable buffer (a
    pyzmq frame received with ``copy=False``) is aliased, not copied: the
    caller must not keep the tensor past the frame's lifetime nor write to it.
    A read-only buffer (``bytes``) is copied once.
    """
    view = memoryview(frame)
    expected = frame_nbytes(dtype, shape)
    if view.nbytes != expected:
        raise ProtocolError(
            f"{name} frame has {view.nbytes} bytes, expected {expected} "
            f"for {list(shape)} {dtype}"
        )
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if view.readonly:
        view = memoryview(bytearray(view))
    tensor = torch.frombuffer(view, dtype=dtype)
    return tensor if len(shape) == 1 else tensor.view(tuple(shape))


# ------------------------------------------------------ capability registry


@dataclass(frozen=True)
class ReplyContext:
    """What a PROPOSE produced, as seen by reply extensions.

    ``tokens`` is ``[R, K]`` int64 on CPU. ``logits`` is the engine's optional
    pre-temperature ``[R, K, V]`` per drafted position (any float dtype, on the
    engine's device), ``None`` when no active extension asked for logits or the
    engine has none. ``anchor_positions[r]`` is request r's anchor position;
    drafted slot j of request r is the token at ``anchor_positions[r] + 1 + j``.
    """

    request_ids: tuple[str, ...]
    anchor_positions: tuple[int, ...]
    num_speculative_tokens: int
    tokens: torch.Tensor
    logits: torch.Tensor | None


class ReplyExtension(abc.ABC):
    """A server-side capability that may append frames to a PROPOSE reply.

    Subclasses set ``capability`` (the string advertised in PONG),
    ``request_fields`` (the PROPOSE header fields they own; fields may be
    shared by several extensions) and ``needs_logits``. The server calls
    ``parse_request`` for every offered extension on every PROPOSE before any
    state changes, asks the engine for logits when an active extension
    ``needs_logits``, and after the proposal calls ``build_reply`` under its
    lock, so the returned frames may alias staging buffers that stay unchanged
    until the reply has been sent.
    """

    capability: str
    request_fields: tuple[str, ...]
    needs_logits: bool

    @abc.abstractmethod
    def is_offered(self, server_info: Mapping[str, Any], engine_logits: bool) -> bool:
        """Whether a server with these PONG fields offers the capability.

        ``engine_logits``: the engine can return per-position logits.
        """

    @abc.abstractmethod
    def parse_request(
        self, header: Mapping[str, Any], server_info: Mapping[str, Any]
    ) -> Any | None:
        """Validate this extension's fields of a PROPOSE ``header``.

        Returns ``None`` when the header does not ask for this capability, else
        the parsed options handed to ``build_reply``. Raises ``ProtocolError``
        for malformed or out-of-bounds fields.
        """

    @abc.abstractmethod
    def build_reply(
        self, options: Any, context: ReplyContext
    ) -> tuple[dict[str, Any], list[memoryview]]:
        """The reply metadata (JSON-able, no ``capability``/``num_frames``
        keys) and the frames (see ``tensor_frame``) for one PROPOSE. The
        frames' bytes may still be written by device work this queued: the
        server reads them only after ``wait_frames``."""

    def wait_frames(self) -> None:
        """Block until the frames of the last ``build_reply`` hold their
        bytes. The server formats the rest of the reply between the two
        calls (so queued device work overlaps it) and calls this under the
        same lock, before the reply leaves; a failure here fails the PROPOSE
        as one in ``build_reply`` does. By default nothing is queued."""
        return None


class CapabilityRegistry:
    """Capability name -> ``ReplyExtension``, in registration order."""

    def __init__(self) -> None:
        self._extensions: dict[str, ReplyExtension] = {}

    def register(self, extension: ReplyExtension) -> None:
        """Add ``extension``; a second extension of the same name is an error."""
        name = extension.capability
        if not isinstance(name, str) or not name:
            raise ValueError("a capability needs a non-empty name")
        if name in self._extensions:
            raise ValueError(f"capability {name!r} is already registered")
        self._extensions[name] = extension

    def __iter__(self) -> Iterator[ReplyExtension]:
        return iter(tuple(self._extensions.values()))

    def __len__(self) -> int:
        return len(self._extensions)


CAPABILITIES = CapabilityRegistry()
PLUGIN_PACKAGE = "vllm.k3_draft.capabilities"


def load_capability_plugins() -> None:
    """Import every module of ``PLUGIN_PACKAGE`` (idempotent).

    Each plugin module registers its extensions in ``CAPABILITIES`` at import.
    """
    package = importlib.import_module(PLUGIN_PACKAGE)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        importlib.import_module(f"{PLUGIN_PACKAGE}.{info.name}")


def extension_frames(
    reply: Mapping[str, Any], frames: Sequence[Any]
) -> dict[str, tuple[dict[str, Any], list[Any]]]:
    """Client side: split a PROPOSE reply's frames by capability.

    ``frames`` are the frames after frame 0. Returns capability ->
    (metadata, frames). Raises ``ProtocolError`` unless the ``extensions``
    entries are well formed and account for every frame exactly.
    """
    entries = reply.get("extensions", [])
    if not isinstance(entries, list):
        raise ProtocolError("reply extensions is not a list")
    result: dict[str, tuple[dict[str, Any], list[Any]]] = {}
    start = 0
    for entry in entries:
        if not isinstance(entry, dict):
            raise ProtocolError("reply extension entry is not an object")
        name = entry.get("capability")
        count = entry.get("num_frames")
        if not isinstance(name, str) or name in result:
            raise ProtocolError(f"bad or repeated reply capability {name!r}")
        if type(count) is not int or count < 0:
            raise ProtocolError(f"bad num_frames {count!r} for {name}")
        result[name] = (entry, list(frames[start : start + count]))
        start += count
    if start != len(frames):
        raise ProtocolError(
            f"reply has {len(frames)} extension frames, entries account for {start}"
        )
    return result
