# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The model runner's hook of layer 2: the real ``GPUModelRunner`` (built
and loaded on CPU, layer 1's ``k3_runner_init``) hands its sampler's host
temperatures to the remote speculator's draft logits once the sampler exists,
so that a step whose requests are all greedy asks the server for no logits."""

from __future__ import annotations

import copy

import numpy as np
import torch
from k3_runner_init import build_runner, close_runner, load_runner
from toy_target import make_input_batch

from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
    RemoteDraftLogits,
)

pytest_plugins = ("conftest_client",)

K = 3
ROWS = np.array([2, 5], dtype=np.int32)


def _batch() -> object:
    return make_input_batch(
        ["a", "b"],
        ROWS,
        np.array([0, 1, 2], dtype=np.int32),
        torch.zeros(2, dtype=torch.int64),
        2,
    )


def test_a_loaded_runner_s_draft_logits_follow_its_sampler_s_temperatures(
    monkeypatch, tp_world, vllm_config_factory, reference_server
):
    monkeypatch.delenv("VLLM_K3_DRAFT_LOGITS_TOPK", raising=False)
    monkeypatch.delenv("VLLM_K3_DSPARK_REMOTE_ADDRESS", raising=False)
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", reference_server.address)
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", "5000")
    config = copy.copy(vllm_config_factory())
    config.speculative_config = copy.copy(config.speculative_config)
    config.speculative_config.draft_sample_method = "probabilistic"
    runner = build_runner(config, monkeypatch)
    try:
        load_runner(runner, config, monkeypatch)
        (draft_logits,) = (
            extension
            for extension in runner.speculator.extensions
            if isinstance(extension, RemoteDraftLogits)
        )
        temperature = runner.sampler.sampling_states.temperature.np
        temperature[ROWS] = 0.0
        assert not draft_logits.wanted(_batch(), K)
        temperature[ROWS[1]] = 0.7
        assert draft_logits.wanted(_batch(), K)
    finally:
        close_runner(runner)
