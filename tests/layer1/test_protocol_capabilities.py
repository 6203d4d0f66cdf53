# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The capability registry: how a higher layer extends PROPOSE replies."""

import json
import sys
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from k3_layer1_server import DEFAULT_OPTIONS, entry, propose_message

from vllm.k3_draft import protocol
from vllm.k3_draft.engine import DraftLimits
from vllm.k3_draft.protocol import CapabilityRegistry, ProtocolError, ReplyExtension
from vllm.k3_draft.reference_engine import ReferenceEngine, ReferenceModelConfig
from vllm.k3_draft.server import DraftServer

WIDTH = DEFAULT_OPTIONS["context_width"]
VOCAB = DEFAULT_OPTIONS["vocab_size"]


class FloatLogits(ReplyExtension):
    """A test capability: float32 logits of every drafted position."""

    capability = "test_logits_f32_v1"
    request_fields = ("return_test_logits",)
    needs_logits = True

    def __init__(self, offered: bool = True) -> None:
        self.offered = offered

    def is_offered(self, server_info: Mapping[str, Any], engine_logits: bool) -> bool:
        return self.offered and engine_logits

    def parse_request(self, header, server_info):
        value = header.get("return_test_logits", False)
        if type(value) is not bool:
            raise ProtocolError("return_test_logits must be a boolean")
        return {} if value else None

    def build_reply(self, options, context):
        logits = context.logits.float().contiguous()
        meta = {"dtype": "float32", "shape": list(logits.shape)}
        return meta, [protocol.tensor_frame(logits)]


class QueuedFrame(FloatLogits):
    """A test capability whose one frame is written only in ``wait_frames``
    (as a device copy completes), or whose ``wait_frames`` fails."""

    capability = "test_queued_v1"
    request_fields = ("return_test_logits",)

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.calls: list[str] = []
        self._frame = bytearray(4)

    def build_reply(self, options, context):
        self.calls.append("build_reply")
        self._frame[:] = bytes(4)
        return {}, [memoryview(self._frame)]

    def wait_frames(self):
        self.calls.append("wait_frames")
        if self.fail:
            raise RuntimeError("device fault")
        self._frame[:] = b"done"


def make_server(registry: CapabilityRegistry) -> DraftServer:
    limits = DraftLimits(16, 8, 4, 1024, 4096, 16, 64, 128)
    model = ReferenceModelConfig(vocab_size=VOCAB, context_width=WIDTH)
    engine = ReferenceEngine(limits, model, torch.device("cpu"))
    engine.load()
    return DraftServer(engine, capabilities=registry)


def registry_with(*extensions: ReplyExtension) -> CapabilityRegistry:
    registry = CapabilityRegistry()
    for extension in extensions:
        registry.register(extension)
    return registry


def propose(server: DraftServer, **fields: Any) -> tuple[dict, list]:
    entries = [entry("a", 10, count=10, reset=True), entry("b", 5, count=5, reset=True)]
    reply = server.handle(propose_message(entries, 3, WIDTH, **fields))
    return json.loads(bytes(reply[0])), reply[1:]


def test_pong_advertises_an_offered_capability():
    server = make_server(registry_with(FloatLogits()))
    pong = json.loads(
        server.handle([protocol.encode_header(protocol.request_header("PING"))])[0]
    )
    assert pong["capabilities"] == [
        protocol.CAPABILITY_REPLY_SERVER_ID,
        "test_logits_f32_v1",
    ]


def test_pong_omits_a_capability_that_is_not_offered():
    server = make_server(registry_with(FloatLogits(offered=False)))
    pong = json.loads(
        server.handle([protocol.encode_header(protocol.request_header("PING"))])[0]
    )
    assert pong["capabilities"] == [protocol.CAPABILITY_REPLY_SERVER_ID]


def test_greedy_client_gets_exactly_one_frame():
    header, frames = propose(make_server(registry_with(FloatLogits())))
    assert header["ok"] and frames == [] and "extensions" not in header


def test_requested_capability_appends_its_frames_and_metadata():
    header, frames = propose(
        make_server(registry_with(FloatLogits())), return_test_logits=True
    )
    parts = protocol.extension_frames(header, frames)
    meta, ext_frames = parts["test_logits_f32_v1"]
    assert meta["shape"] == [2, 3, VOCAB] and meta["num_frames"] == 1
    logits = protocol.frame_tensor(ext_frames[0], torch.float32, (2, 3, VOCAB), "x")
    assert logits.argmax(-1).tolist() == header["tokens"]


def test_field_of_an_unoffered_capability_is_refused():
    header, _ = propose(
        make_server(registry_with(FloatLogits(offered=False))),
        return_test_logits=True,
    )
    assert not header["ok"] and "unknown header fields" in header["error"]


def test_malformed_capability_field_is_refused_before_state_changes():
    server = make_server(registry_with(FloatLogits()))
    header, _ = propose(server, return_test_logits="yes")
    assert header["error"] == "ProtocolError: return_test_logits must be a boolean"
    assert server.requests == {}


def test_registry_refuses_a_second_extension_of_the_same_name():
    registry = registry_with(FloatLogits())
    with pytest.raises(ValueError, match="already registered"):
        registry.register(FloatLogits())


def test_extension_frames_refuses_unaccounted_frames():
    header = {"extensions": [{"capability": "x", "num_frames": 1}]}
    with pytest.raises(ProtocolError, match="account for 1"):
        protocol.extension_frames(header, [b"a", b"b"])


def test_extension_frames_split_the_frames_in_entry_order():
    first = {"capability": "x", "num_frames": 1, "shape": [1]}
    second = {"capability": "y", "num_frames": 2}
    empty = {"capability": "z", "num_frames": 0}
    header = {"extensions": [first, empty, second]}
    assert protocol.extension_frames(header, [b"a", b"b", b"c"]) == {
        "x": (first, [b"a"]),
        "z": (empty, []),
        "y": (second, [b"b", b"c"]),
    }


def test_extension_frames_refuses_entries_claiming_more_frames_than_sent():
    header = {"extensions": [{"capability": "x", "num_frames": 2}]}
    with pytest.raises(ProtocolError, match="entries account for 2"):
        protocol.extension_frames(header, [b"a"])


@pytest.mark.parametrize("extensions", [None, {"capability": "x"}, "x"])
def test_extension_frames_refuses_extensions_that_are_not_a_list(extensions):
    with pytest.raises(ProtocolError, match="not a list"):
        protocol.extension_frames({"extensions": extensions}, [])


@pytest.mark.parametrize("entry", [["x", 1], None])
def test_extension_frames_refuses_an_entry_that_is_not_an_object(entry):
    with pytest.raises(ProtocolError, match="not an object"):
        protocol.extension_frames({"extensions": [entry]}, [b"a"])


@pytest.mark.parametrize(
    "entries",
    [
        [{"num_frames": 1}],
        [{"capability": 7, "num_frames": 1}],
        [{"capability": "x", "num_frames": 0}, {"capability": "x", "num_frames": 1}],
    ],
)
def test_extension_frames_refuses_a_missing_or_repeated_capability(entries):
    with pytest.raises(ProtocolError, match="bad or repeated reply capability"):
        protocol.extension_frames({"extensions": entries}, [b"a"])


@pytest.mark.parametrize("count, then", [(-1, 2), (True, 0), (1.0, 0), (None, 1)])
def test_extension_frames_refuses_a_num_frames_that_is_not_a_count(count, then):
    # Each would account for the one frame: True as 1, and -1 by shifting
    # the next entry's slice (x takes frames[0:-1], y frames[-1:1]).
    entries = [
        {"capability": "x", "num_frames": count},
        {"capability": "y", "num_frames": then},
    ]
    with pytest.raises(ProtocolError, match="bad num_frames"):
        protocol.extension_frames({"extensions": entries}, [b"a"])


def test_plugins_in_the_plugin_package_register_at_load(tmp_path, monkeypatch):
    package = tmp_path / "k3_test_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "logits.py").write_text(
        "from vllm.k3_draft import protocol\n"
        "from test_protocol_capabilities import FloatLogits\n"
        "protocol.CAPABILITIES.register(FloatLogits())\n"
    )
    registry = CapabilityRegistry()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(protocol, "PLUGIN_PACKAGE", "k3_test_plugins")
    monkeypatch.setattr(protocol, "CAPABILITIES", registry)
    try:
        protocol.load_capability_plugins()
        protocol.load_capability_plugins()
    finally:
        for name in ("k3_test_plugins", "k3_test_plugins.logits"):
            sys.modules.pop(name, None)
    assert [e.capability for e in registry] == ["test_logits_f32_v1"]


def test_the_reply_carries_the_frames_as_wait_frames_left_them():
    extension = QueuedFrame()
    header, frames = propose(
        make_server(registry_with(extension)), return_test_logits=True
    )
    assert header["ok"] and [bytes(f) for f in frames] == [b"done"]
    assert extension.calls == ["build_reply", "wait_frames"]


def test_a_failing_wait_frames_fails_the_propose_and_drops_its_requests():
    server = make_server(registry_with(QueuedFrame(fail=True)))
    header, frames = propose(server, return_test_logits=True)
    assert header["error"] == "RuntimeError: device fault" and frames == []
    assert server.requests == {} and server.allocator.num_free == 16
