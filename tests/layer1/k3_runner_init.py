# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real ``GPUModelRunner.__init__`` on CPU (layers 1 and 3): what needs
a CUDA driver is replaced, nothing else. The UVA buffers of its request
state live in host memory (as in ``test_request_state_exposes_the_host_token
_table``) and its output-copy stream is inert."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.v1.worker.gpu import buffer_utils
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
