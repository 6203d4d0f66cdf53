# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared fixtures of the layer-1 tests: real draft server processes.

* ``draft_server`` (session scope): one reference-engine server (DFlash, the
  bounds of ``k3_layer1_server.DEFAULT_OPTIONS``) on an ipc path, ready. It is
  shared: a test that depends on the retained requests sends CLEAR first.
* ``draft_server_factory`` (function scope): ``factory(address=None,
  start=True, **options)`` returns a ``DraftServerProcess`` with
  ``DEFAULT_OPTIONS`` overridden by ``options`` (CLI option names with
  underscores; ``True`` for flags); every process it made is stopped at
  teardown.
* ``raw_client``: a ``RawClient`` connected to ``draft_server``.

The servers run ``python -m vllm.entrypoints.k3_dspark_standalone --engine
reference --device cpu`` on loopback only.
"""

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The real-scheduler harness, imported by test modules of layers 1 to 3 before
# pytest loads it as their plugin: rewrite its asserts.
pytest.register_assert_rewrite("k3_sched_loop")

from k3_layer1_server import DraftServerProcess, RawClient  # noqa: E402


@pytest.fixture(scope="session")
def draft_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[DraftServerProcess]:
    server = DraftServerProcess(tmp_path_factory.mktemp("draft")).start()
    yield server
    server.stop()


@pytest.fixture
def draft_server_factory(
    tmp_path: Path,
) -> Iterator[Callable[..., DraftServerProcess]]:
    servers: list[DraftServerProcess] = []

    def factory(
        address: str | None = None, start: bool = True, **options: Any
    ) -> DraftServerProcess:
        server = DraftServerProcess(
            tmp_path / f"server{len(servers)}", address, **options
        )
        servers.append(server)
        return server.start() if start else server

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture
def raw_client(draft_server: DraftServerProcess) -> Iterator[RawClient]:
    client = RawClient(draft_server.address)
    yield client
    client.close()
