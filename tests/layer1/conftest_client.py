# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the client tests (imported by their test modules).

* ``tp_world`` (session): vLLM's distributed state, one gloo rank, so that the
  speculator's TP group is the real ``GroupCoordinator`` (world size 1).
* ``vllm_config_factory`` (session): ``factory(**kwargs)`` -> a real
  ``VllmConfig`` (``toy_target.make_vllm_config``), cached per arguments.
* ``oracle`` (session): the in-process ``DraftOracle``.
* ``make_speculator``: ``make(address, config=None, timeout_ms=2000,
  device="cpu")`` -> ``(speculator, table)``: a ``RemoteK3DSparkSpeculator``
  on ``device`` over a fresh host token table (``toy_target.TokenTable``).
* ``scripted_server``: a ``ScriptedServer`` (real ZeroMQ REP on loopback)
  whose replies each test scripts, for failure kinds a real server never
  produces.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
import zmq
from k3_layer1_server import free_tcp_port  # sibling module
from toy_target import (
    MAX_MODEL_LEN,
    DraftOracle,
    TokenTable,
    init_single_rank_world,
    make_vllm_config,
)

from vllm.k3_draft import protocol


@pytest.fixture(scope="session")
def vllm_config_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., Any]:
    cache: dict[tuple[tuple[str, Any], ...], Any] = {}

    def factory(**kwargs: Any) -> Any:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = make_vllm_config(tmp_path_factory.mktemp("config"), **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tp_world(vllm_config_factory: Callable[..., Any]) -> Iterator[None]:
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    init_single_rank_world(vllm_config_factory())
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.fixture(scope="session")
def oracle() -> DraftOracle:
    return DraftOracle()


@pytest.fixture
def make_speculator(
    tp_world: None,
    vllm_config_factory: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., Any]]:
    from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
        RemoteK3DSparkSpeculator,
    )

    built: list[Any] = []

    def make(
        address: str, config: Any = None, timeout_ms: int = 2000, device: str = "cpu"
    ) -> Any:
        monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", str(timeout_ms))
        config = config or vllm_config_factory()
        table = TokenTable(
            torch.full(
                (config.scheduler_config.max_num_seqs, MAX_MODEL_LEN),
                -7,
                dtype=torch.int32,
            )
        )
        speculator = RemoteK3DSparkSpeculator(
            config,
            torch.device(device),
            cast(Any, table),
            address,
        )
        built.append(speculator)
        return speculator, table

    yield make
    for speculator in built:
        if speculator.plan is not None:
            speculator.plan.client.close()


class ScriptedServer:
    """A REP socket on loopback TCP answering from ``handlers`` (op ->
    ``handler(header, frames) -> reply frames``), in a thread. Defaults answer
    like a healthy server whose PONG is ``pong``; ``log`` records the
    ``(op, header)`` of every request."""

    def __init__(self) -> None:
        self.address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.pong: dict[str, Any] = {
            "method": "dflash",
            "capabilities": [protocol.CAPABILITY_REPLY_SERVER_ID],
            "max_requests": 16,
            "max_batch_size": 8,
            "max_speculative_tokens": 4,
            "max_context_tokens": 1024,
            "context_width": 192,
            "vocab_size": 1024,
            "max_model_len": MAX_MODEL_LEN,
            "block_size": 16,
            "window_size": 64,
            "prefix_cache_tokens": 128,
            "cuda_graph_shapes": [],
            "active_requests": 0,
            "server_id": "scripted-1",
        }
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.handlers: dict[str, Callable[[dict[str, Any], list[bytes]], list]] = {}
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def ops(self) -> list[str]:
        return [op for op, _ in self.log]

    def reply(self, op: str, **fields: Any) -> list[bytes]:
        """A success reply to ``op`` naming this server (``pong``'s id)."""
        server_id = self.pong["server_id"]
        return [
            protocol.encode_header(protocol.ok_reply(op, server_id=server_id, **fields))
        ]

    def default(self, header: dict[str, Any], frames: list[bytes]) -> list:
        op = header["op"]
        if op == protocol.OP_PING:
            return [protocol.encode_header(protocol.ok_reply("PONG", **self.pong))]
        if op == protocol.OP_PROPOSE:
            k = header["num_speculative_tokens"]
            return self.reply(
                op,
                tokens=[[5] * k for _ in header["requests"]],
                latency_ms=0.1,
                timing_ms=dict.fromkeys(protocol.TIMING_FIELDS, 0.0),
            )
        if op == protocol.OP_RECONNECT:
            return self.reply(
                op, restored_start=0, prefix_end=header["prefix_end"], latency_ms=0.1
            )
        return self.reply(op, active_requests=0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self._socket.recv_multipart()
            header = json.loads(frames[0])
            self.log.append((header["op"], header))
            handler = self.handlers.get(header["op"], self.default)
            self._socket.send_multipart(handler(header, frames[1:]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()


@pytest.fixture
def scripted_server() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.close()
