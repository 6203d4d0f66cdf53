# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The model runner's construction hooks (spec p1): the real
``GPUModelRunner.__init__`` (on CPU, ``k3_runner_init``) with a remote
address drafts through ``RemoteK3DSparkSpeculator`` against a real draft
server and hides empty draft slots from the target; without one it is
upstream's and hides nothing."""

from __future__ import annotations

import pytest
from k3_runner_init import build_runner, close_runner

from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_module
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    NoDraftIds,
    RemoteK3DSparkSpeculator,
)

pytest_plugins = ("conftest_client",)


@pytest.fixture(autouse=True)
def no_address(monkeypatch):
    for name in ("VLLM_K3_DRAFT_REMOTE_ADDRESS", "VLLM_K3_DSPARK_REMOTE_ADDRESS"):
        monkeypatch.delenv(name, raising=False)


def test_a_remote_address_builds_a_runner_that_drafts_remotely_and_hides_empty_slots(
    monkeypatch, tp_world, vllm_config_factory, draft_server
):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", draft_server.address)
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", "5000")
    runner = build_runner(vllm_config_factory(), monkeypatch)
    try:
        assert isinstance(runner.speculator, RemoteK3DSparkSpeculator)
        assert isinstance(runner.k3_no_draft_ids, NoDraftIds)
    finally:
        close_runner(runner)


def test_without_a_remote_address_the_runner_hides_no_draft_ids(
    monkeypatch, tp_world, vllm_config_factory
):
    # The local DFlash speculator needs a GPU: a recorder stands in for it.
    monkeypatch.setattr(dflash_module, "DFlashSpeculator", lambda c, d: "dflash")
    runner = build_runner(vllm_config_factory(), monkeypatch)
    assert runner.speculator == "dflash"
    assert runner.k3_no_draft_ids is None
