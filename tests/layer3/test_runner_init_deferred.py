# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The model runner's construction hook of layer 3: the real
``GPUModelRunner.__init__`` (on CPU, layer 1's ``k3_runner_init``) with a
remote address installs deferred resolution on its speculator, the strategy
its steps consume; with ``VLLM_K3_DRAFT_DEFERRED_RESOLVE=0`` replies resolve
synchronously."""

from __future__ import annotations

import pytest
from k3_runner_init import build_runner, close_runner

from vllm.k3_draft.deferred import DeferredResolution
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    ImmediateResolution,
)

pytest_plugins = ("conftest_client",)


@pytest.fixture
def remote_address(monkeypatch, reference_server):
    monkeypatch.delenv("VLLM_K3_DSPARK_REMOTE_ADDRESS", raising=False)
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", reference_server.address)
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", "5000")


@pytest.mark.parametrize("switch", ["1", None])
def test_the_runner_of_a_remote_speculator_consumes_its_deferred_replies(
    monkeypatch, tp_world, vllm_config_factory, remote_address, switch
):
    if switch is None:
        monkeypatch.delenv("VLLM_K3_DRAFT_DEFERRED_RESOLVE", raising=False)
    else:
        monkeypatch.setenv("VLLM_K3_DRAFT_DEFERRED_RESOLVE", switch)
    runner = build_runner(vllm_config_factory(), monkeypatch)
    try:
        assert isinstance(runner.k3_deferred, DeferredResolution)
        assert runner.speculator.resolution is runner.k3_deferred
    finally:
        close_runner(runner)


def test_with_the_switch_off_the_runner_resolves_synchronously(
    monkeypatch, tp_world, vllm_config_factory, remote_address
):
    monkeypatch.setenv("VLLM_K3_DRAFT_DEFERRED_RESOLVE", "0")
    runner = build_runner(vllm_config_factory(), monkeypatch)
    try:
        assert runner.k3_deferred is None
        assert type(runner.speculator.resolution) is ImmediateResolution
    finally:
        close_runner(runner)
