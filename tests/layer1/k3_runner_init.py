# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real ``GPUModelRunner.__init__`` and ``load_model`` on CPU (layers 1
to 3): what needs a CUDA driver is replaced, nothing else. The UVA buffers
of its request state live in host memory (``HostUvaBuffer``), its
output-copy stream is inert, and ``load_model`` is given a target without
weights and measures no device memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.model_executor.models.interfaces import SupportsEagle3
from vllm.v1.worker.gpu import buffer_utils, model_runner
from vllm.v1.worker.gpu.model_runner import GPUModelRunner


class HostUvaBuffer:
    """A UVA buffer whose device view is its host tensor."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()

    def uva(self, n: int | None = None) -> torch.Tensor:
        return self.cpu[:n] if n is not None else self.cpu


class InertStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class WeightlessTarget(torch.nn.Module, SupportsEagle3):
    """A target model as far as ``load_model`` looks at one: DFlash reads the
    aux hidden states of its layers."""

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.aux_layers = layers

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return (0, 1, 2)


class NoDeviceMemory:
    consumed_memory = 0

    def __enter__(self) -> NoDeviceMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def build_runner(config: Any, monkeypatch: pytest.MonkeyPatch) -> GPUModelRunner:
    """``GPUModelRunner(config)`` on CPU (vLLM's distributed state, e.g.
    ``conftest_client``'s ``tp_world``, must exist). Close a remote
    speculator's client with ``close_runner``."""
    monkeypatch.setattr(buffer_utils, "UvaBuffer", HostUvaBuffer)
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", InertStream)
    with set_current_vllm_config(config):
        return GPUModelRunner(config, torch.device("cpu"))


def close_runner(runner: GPUModelRunner) -> None:
    plan = getattr(runner.speculator, "plan", None)
    if plan is not None:
        plan.client.close()


def load_runner(
    runner: GPUModelRunner, config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``runner.load_model`` with a ``WeightlessTarget``: the sampler and what
    the runner builds around the model exist afterwards."""
    monkeypatch.setattr(model_runner, "DeviceMemoryProfiler", NoDeviceMemory)
    with set_current_vllm_config(config):
        runner.load_model(model=WeightlessTarget())
