# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer 3 reuses layer 1's helpers (``toy_target``, ``k3_layer1_server``,
``conftest_client``, ``k3_sched_loop``) and layer 2's (``k3_l2_reference``:
the CPU reference of upstream's Gumbel sampler; ``k3_l2_sched_loop``) by
import: put their folders on the path. The
runner and worker factories of ``k3_l3_runner`` are fixtures here."""

import sys
from pathlib import Path

import pytest

for layer in ("layer1", "layer2"):
    folder = str(Path(__file__).resolve().parents[1] / layer)
    if folder not in sys.path:
        sys.path.insert(0, folder)
# The real-scheduler harnesses of layers 1 and 2: test modules import them
# before pytest loads them as their plugins.
pytest.register_assert_rewrite("k3_sched_loop", "k3_l2_sched_loop")


def _serve(tmp_path_factory: pytest.TempPathFactory, name: str):
    # Imported only when a test asks for a server (the stream-gate tests run
    # on the GPU machine need none).
    from k3_layer1_server import DraftServerProcess

    server = DraftServerProcess(tmp_path_factory.mktemp(name)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference_server(tmp_path_factory: pytest.TempPathFactory):
    """A reference-engine draft server process for the module's tests."""
    yield from _serve(tmp_path_factory, "draft")


@pytest.fixture(scope="module")
def second_reference_server(tmp_path_factory: pytest.TempPathFactory):
    """Another, for a second verifier: a draft server serves one verifier (a
    FREE reply counting another's requests clears it)."""
    yield from _serve(tmp_path_factory, "draft-second")


@pytest.fixture
def make_runner(monkeypatch: pytest.MonkeyPatch):
    """``make_runner(speculator, log, k)``: a ``GPUModelRunner`` on CPU
    (``k3_l3_runner.runner_factory``)."""
    from k3_l3_runner import runner_factory

    return runner_factory(monkeypatch)


@pytest.fixture
def make_worker(monkeypatch: pytest.MonkeyPatch):
    """``make_worker(runner, warm_up)``: its ``Worker`` on CPU
    (``k3_l3_runner.worker_factory``)."""
    from k3_l3_runner import worker_factory

    return worker_factory(monkeypatch)
