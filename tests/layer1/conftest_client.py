# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the client tests (imported by their test modules).

* ``tp_world`` (session): vLLM's distributed state, one gloo rank, so that the
  speculator's TP group is the real ``GroupCoordinator`` (world size 1).
* ``vllm_config_factory`` (session): ``factory(**kwargs)`` -> a real
  ``VllmConfig`` (``toy_target.make_vllm_config``), cached per arguments.
* ``oracle`` (session): the in-process ``DraftOracle``.
* ``make_speculator``: ``make(address, config=None, timeout_ms=2000)`` ->
  ``(speculator, table)``: a ``RemoteK3DSparkSpeculator`` over a fresh host
  token table (``toy_target.TokenTable``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from k3_layer1_server import free_tcp_port  # sibling module
from toy_target import MAX_MODEL_LEN, DraftOracle, TokenTable, make_vllm_config


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
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(vllm_config_factory()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
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

    def make(address: str, config: Any = None, timeout_ms: int = 2000) -> Any:
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
            torch.device("cpu"),
            table,
            address,  # type: ignore[arg-type]
        )
        built.append(speculator)
        return speculator, table

    yield make
    for speculator in built:
        if speculator.plan is not None:
            speculator.plan.client.close()
