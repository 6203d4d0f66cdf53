# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of layer 4: real ``VllmConfig`` objects of a tiny local model (no
model hub), with decode/prefill context parallel sizes set as the engine sets
them."""

import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TINY_QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-qwen3")
    (root / "config.json").write_text(json.dumps(TINY_QWEN3))
    return root


@pytest.fixture
def make_config(model_dir: Path) -> Callable[..., Any]:
    """``make_config(dcp=1, pcp=1, max_model_len=4096, block_size=16,
    prefix_caching=False, hybrid=True)``: a ``VllmConfig`` of the tiny model."""

    def make(
        dcp: int = 1,
        pcp: int = 1,
        max_model_len: int = 4096,
        block_size: int = 16,
        prefix_caching: bool = False,
        hybrid: bool = True,
    ) -> Any:
        from vllm.config import DeviceConfig, ModelConfig, VllmConfig

        model_config = ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            dtype="bfloat16",
        )
        config = VllmConfig(
            model_config=model_config, device_config=DeviceConfig(device="cpu")
        )
        config.parallel_config.decode_context_parallel_size = dcp
        config.parallel_config.prefill_context_parallel_size = pcp
        config.cache_config.block_size = block_size
        config.cache_config.enable_prefix_caching = prefix_caching
        config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
        return config

    return make


@pytest.fixture(scope="session")
def dflash_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target and a one-layer DFlash draft (GQA attention)."""
    root = tmp_path_factory.mktemp("dflash")
    draft = {
        **TINY_QWEN3,
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 1,
        "block_size": 4,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 1023},
    }
    for name, config in (("target", TINY_QWEN3), ("draft", draft)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def make_dflash_config(dflash_dir: Path) -> Callable[..., Any]:
    """``make_dflash_config(dcp=1, pcp=1)``: a target ``VllmConfig`` with a
    DFlash speculative config (3 speculative tokens)."""

    def make(dcp: int = 1, pcp: int = 1) -> Any:
        from vllm.config import (
            DeviceConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )

        model_config = ModelConfig(
            model=str(dflash_dir / "target"),
            skip_tokenizer_init=True,
            max_model_len=4096,
            dtype="bfloat16",
        )
        parallel_config = ParallelConfig()
        config = VllmConfig(
            model_config=model_config,
            parallel_config=parallel_config,
            speculative_config=SpeculativeConfig(
                method="dflash",
                model=str(dflash_dir / "draft"),
                num_speculative_tokens=3,
                target_model_config=model_config,
                target_parallel_config=parallel_config,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=512,
                max_model_len=4096,
                is_encoder_decoder=False,
            ),
            device_config=DeviceConfig(device="cpu"),
        )
        config.parallel_config.decode_context_parallel_size = dcp
        config.parallel_config.prefill_context_parallel_size = pcp
        return config

    return make


@pytest.fixture(scope="session")
def interpreted_kernels() -> types.ModuleType:
    """The installed slot-mapping kernel module, executed under Triton's CPU
    interpreter (``TRITON_INTERPRET=1`` while its kernels are defined)."""
    pytest.importorskip("triton", reason="the slot-mapping kernel is Triton")
    from k3l4_slots import load_kernel_module  # sibling module

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        module = load_kernel_module("_k3l4_interpreted_slot_mapping")
    kernel = module._compute_slot_mappings_kernel
    assert type(kernel).__name__ == "InterpretedFunction"
    return module
