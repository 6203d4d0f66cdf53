# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Attention of a replicated group under DCP: its layers and metadata run as
DCP1 (world size 1, rank 0, no LSE for decode) while the target keeps the DCP
group; PCP with a replicated draft is supported; cascade attention does not
exist. Upstream 0.33.0 behaviour, pinned against the real classes.

A DCP group of 4 ranks cannot exist in one process, so ``parallel_state._DCP``
is replaced by the two attributes the code under test reads (world size 4,
this process being rank 2)."""

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from k3l4_specs import full, mla, sliding

import vllm
from vllm.config import set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.v1.attention.backend import AttentionImplBase, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

RANK = 2


@pytest.fixture(autouse=True)
def dcp_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        parallel_state, "_DCP", types.SimpleNamespace(world_size=4, rank_in_group=RANK)
    )


class LseCapableImpl(AttentionImplBase):
    can_return_lse_for_decode = True


def verify_batch() -> CommonAttentionMetadata:
    """Two requests verifying 4 rows each, 100 and 37 tokens long; the
    rank-local DCP lengths the target would pass along."""
    query_start_loc = torch.tensor([0, 4, 8], dtype=torch.int32)
    seq_lens = torch.tensor([100, 37], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=2,
        num_actual_tokens=8,
        max_query_len=4,
        max_seq_len=100,
        block_table_tensor=torch.zeros(2, 8, dtype=torch.int32),
        slot_mapping=torch.zeros(8, dtype=torch.int64),
        dcp_local_seq_lens=torch.tensor([25, 9], dtype=torch.int32),
    )


def flash_attn_metadata(config: Any, sharded: bool) -> Any:
    with set_current_vllm_config(config):
        builder = FlashAttentionMetadataBuilder(
            full(sharded=sharded), ["layer"], config, torch.device("cpu")
        )
        return builder, builder.build(0, verify_batch())


def test_replicated_group_metadata_is_dcp1(make_config: Callable[..., Any]) -> None:
    builder, metadata = flash_attn_metadata(make_config(dcp=4), sharded=False)
    assert (builder.dcp_world_size, builder.dcp_rank) == (1, 0)
    assert metadata.dcp_context_kv_lens is None
    assert metadata.max_dcp_context_kv_len == 0
    assert metadata.seq_lens.tolist() == [100, 37]


def test_sharded_group_metadata_keeps_the_dcp_context(
    make_config: Callable[..., Any],
) -> None:
    builder, metadata = flash_attn_metadata(make_config(dcp=4), sharded=True)
    assert (builder.dcp_world_size, builder.dcp_rank) == (4, RANK)
    # Rank 2 of 4 (interleave 1) holds context positions p with p % 4 == 2.
    assert metadata.dcp_context_kv_lens.tolist() == [
        len(range(RANK, 96, 4)),
        len(range(RANK, 33, 4)),
    ]


def test_draft_attention_runs_as_dcp1_without_lse(
    make_dflash_config: Callable[..., Any],
) -> None:
    speculator = DFlashSpeculator(make_dflash_config(dcp=4), torch.device("cpu"))
    with set_current_vllm_config(speculator.vllm_config):
        impl = LseCapableImpl()
    assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)
    assert impl.need_to_return_lse_for_decode is False


def test_target_attention_keeps_the_dcp_group_and_its_lse(
    make_dflash_config: Callable[..., Any],
) -> None:
    with set_current_vllm_config(make_dflash_config(dcp=4)):
        impl = LseCapableImpl()
    assert (impl.dcp_world_size, impl.dcp_rank) == (4, RANK)
    assert impl.need_to_return_lse_for_decode is True


@pytest.mark.parametrize("draft", [full, sliding])
def test_pcp_with_a_replicated_draft_is_supported(draft: Callable[..., Any]) -> None:
    """Upstream runs a replicated draft under PCP (the draft itself runs PCP1):
    only the target's manager sees the CP sizes."""
    kv_config = KVCacheConfig(
        num_blocks=256,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["target"], mla(16)),
            KVCacheGroupSpec(["draft"], draft(16, sharded=False)),
        ],
    )
    manager = KVCacheManager(
        kv_config,
        max_model_len=1024,
        scheduler_block_size=64,
        hash_block_size=16,
        enable_caching=False,
        dcp_world_size=4,
        pcp_world_size=4,
    )
    managers = manager.coordinator.single_type_managers
    assert [(m.block_size, m.dcp_world_size, m.pcp_world_size) for m in managers] == [
        (64, 4, 4),
        (16, 1, 1),
    ]


def test_cascade_attention_is_absent() -> None:
    """0.33.0 removed cascade attention: no attention backend or model runner V2
    module has a cascade path left to switch off."""
    root = Path(vllm.__file__).parent
    sources = [
        *(root / "v1" / "attention").rglob("*.py"),
        *(root / "v1" / "worker" / "gpu").rglob("*.py"),
    ]
    assert sources
    assert [p for p in sources if "cascade" in p.read_text()] == []
