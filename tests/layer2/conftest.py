# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the layer-2 tests.

Layer 1's test helpers (``k3_layer1_server``, ``toy_target``,
``conftest_client``) are put on the import path: test modules import them and
name ``conftest_client`` (and ``k3_sched_loop``, the real-scheduler harness)
in ``pytest_plugins`` for their fixtures.

* ``reference_server`` (session): a real draft server process (layer 1's
  reference engine with ``k3_layer1_server.DEFAULT_OPTIONS``, ipc), ready.
* ``one_rank``: a tensor-parallel group of one rank (broadcasts are no-ops),
  for extensions built outside a speculator.
* ``reference_gumbel``: replaces upstream's Triton ``gumbel_sample`` in
  ``remote_draft_logits`` by the CPU reference of ``k3_l2_reference`` (this
  host has no Triton backend; ``test_upstream_kernels_interpreted`` checks
  the reference against the kernel).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

LAYER1_TESTS = Path(__file__).resolve().parent.parent / "layer1"
if str(LAYER1_TESTS) not in sys.path:
    sys.path.insert(0, str(LAYER1_TESTS))
# Layer 1's real-scheduler harness: test modules import it before pytest
# loads it as their plugin.
pytest.register_assert_rewrite("k3_sched_loop", "k3_l2_sched_loop")


@pytest.fixture(scope="session")
def reference_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from k3_layer1_server import DraftServerProcess

    server = DraftServerProcess(tmp_path_factory.mktemp("l2-draft")).start()
    yield server
    server.stop()


class OneRank:
    """The ``GroupCoordinator`` surface ``RemoteDraftLogits`` uses, one rank."""

    rank_in_group = 0
    world_size = 1

    def broadcast(self, tensor: Any, src: int = 0) -> Any:
        return tensor


@pytest.fixture
def one_rank() -> OneRank:
    return OneRank()


@pytest.fixture
def reference_gumbel(monkeypatch: pytest.MonkeyPatch) -> None:
    import k3_l2_reference

    from vllm.v1.worker.gpu.spec_decode.dspark import remote_draft_logits

    monkeypatch.setattr(
        remote_draft_logits, "gumbel_sample", k3_l2_reference.gumbel_sample
    )
