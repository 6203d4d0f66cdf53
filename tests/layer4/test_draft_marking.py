# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DFlash draft under a DCP target: it runs as DCP1 (and PCP1), and model
runner V2 marks its attention caches replicated, keeping the backend-selected
block size and the sliding-window geometry. Upstream 0.33.0 behaviour, pinned
with a real ``DFlashSpeculator`` built on the CPU.

``GPUModelRunner`` itself cannot be built without a GPU, so its
``get_kv_cache_spec`` runs on an unconstructed runner holding only what the
method reads (the config, the DCP size and the real speculator), with the
per-layer spec collection replaced by the specs the draft's attention backend
would report."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from k3l4_specs import DRAFT_CAPABLE, WINDOW, mla

from vllm.v1.kv_cache_interface import KVCacheSpec, SlidingWindowSpec
from vllm.v1.worker.gpu import model_runner
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

DRAFT_LAYER = "draft_model.layers.0.self_attn.attn"


def speculator_for(config: Any) -> DFlashSpeculator:
    speculator = DFlashSpeculator(config, torch.device("cpu"))
    # Set when the draft model is loaded.
    speculator.draft_attn_layer_names = {DRAFT_LAYER}
    return speculator


def runner_specs(
    monkeypatch: pytest.MonkeyPatch, config: Any, draft: KVCacheSpec
) -> dict[str, KVCacheSpec]:
    collected = {"model.layers.0.attn": mla(), DRAFT_LAYER: draft}
    monkeypatch.setattr(model_runner, "get_kv_cache_spec", lambda _: dict(collected))
    runner = object.__new__(model_runner.GPUModelRunner)
    runner.vllm_config = config
    runner.dcp_size = config.parallel_config.decode_context_parallel_size
    runner.speculator = speculator_for(config)
    return runner.get_kv_cache_spec()


@pytest.mark.parametrize("pcp", [1, 2])
@pytest.mark.parametrize("dcp", [2, 4, 8])
def test_dflash_draft_runs_dcp1_and_pcp1_under_a_dcp_target(
    make_dflash_config: Callable[..., Any], dcp: int, pcp: int
) -> None:
    config = make_dflash_config(dcp=dcp, pcp=pcp)
    speculator = speculator_for(config)
    draft_parallel = speculator.vllm_config.parallel_config
    assert speculator.dcp_size == 1
    assert draft_parallel.decode_context_parallel_size == 1
    assert draft_parallel.prefill_context_parallel_size == 1
    assert config.parallel_config.decode_context_parallel_size == dcp
    assert config.parallel_config.prefill_context_parallel_size == pcp


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_runner_marks_dflash_caches_replicated_under_dcp(
    monkeypatch: pytest.MonkeyPatch,
    make_dflash_config: Callable[..., Any],
    kind: str,
    block_size: int,
) -> None:
    draft = DRAFT_CAPABLE[kind](block_size=block_size)
    specs = runner_specs(monkeypatch, make_dflash_config(dcp=4), draft)
    marked = specs[DRAFT_LAYER]
    assert marked.dcp_sharded is False
    assert type(marked) is type(draft)
    assert marked.block_size == block_size
    assert marked.page_size_bytes == draft.page_size_bytes
    if isinstance(marked, SlidingWindowSpec):
        assert marked.sliding_window == WINDOW


def test_runner_keeps_the_target_sharded(
    monkeypatch: pytest.MonkeyPatch, make_dflash_config: Callable[..., Any]
) -> None:
    specs = runner_specs(
        monkeypatch, make_dflash_config(dcp=4), DRAFT_CAPABLE["full"]()
    )
    assert specs["model.layers.0.attn"] == mla()


def test_runner_leaves_the_draft_alone_without_dcp(
    monkeypatch: pytest.MonkeyPatch, make_dflash_config: Callable[..., Any]
) -> None:
    draft = DRAFT_CAPABLE["sliding"]()
    specs = runner_specs(monkeypatch, make_dflash_config(dcp=1), draft)
    assert specs[DRAFT_LAYER] == draft
