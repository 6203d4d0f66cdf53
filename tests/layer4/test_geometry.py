# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Geometry of a replicated group under DCP size D: its shard count is 1, a
sharded group's is D. That count drives the block-table width, the effective
block size of the scheduler and the single-type managers, the scheduler/hash
block sizes of mixed groups, memory sizing and admission. Upstream 0.33.0
behaviour, pinned against the real classes."""

import math
from collections.abc import Callable
from typing import Any

import pytest
from k3l4_specs import DRAFT_CAPABLE, WINDOW, full, mla, sliding

from vllm.sampling_params import SamplingParams
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import (
    get_max_concurrency_for_kv_cache_config,
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request

DCP_SIZES = [1, 2, 4, 8]
MAX_LEN = 1000  # not a multiple of any block span, so every cdiv rounds up
FULL_KINDS = ["full", "mla", "rswa", "sink"]


def shard_count(sharded: bool, dcp: int) -> int:
    return dcp if sharded else 1


def manager_for(spec: KVCacheSpec, dcp: int, in_flight: int = 64) -> Any:
    return get_manager_for_kv_cache_spec(
        spec,
        max_in_flight_tokens=in_flight,
        max_model_len=MAX_LEN,
        block_pool=BlockPool(16, enable_caching=False, hash_block_size=16),
        enable_caching=False,
        kv_cache_group_id=0,
        scheduler_block_size=spec.block_size * dcp,
        dcp_world_size=dcp,
    )


def two_groups(target: KVCacheSpec, draft: KVCacheSpec) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["target"], target),
            KVCacheGroupSpec(["draft"], draft),
        ],
    )


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("dcp", DCP_SIZES)
@pytest.mark.parametrize("kind", sorted(DRAFT_CAPABLE))
def test_block_table_width_divides_by_the_shard_count(
    make_config: Callable[..., Any], kind: str, dcp: int, sharded: bool
) -> None:
    spec = DRAFT_CAPABLE[kind](block_size=16, sharded=sharded)
    width = spec.max_num_blocks_per_req(make_config(dcp=dcp), MAX_LEN)
    assert width == cdiv(MAX_LEN, 16 * shard_count(sharded, dcp))


@pytest.mark.parametrize("sharded", [True, False])
def test_uniform_collection_width_follows_its_layers(
    make_config: Callable[..., Any], sharded: bool
) -> None:
    collection = UniformTypeKVCacheSpecs.from_specs(
        {"a": full(sharded=sharded), "b": full(sharded=sharded)}
    )
    assert collection is not None
    width = collection.max_num_blocks_per_req(make_config(dcp=4), MAX_LEN)
    assert width == cdiv(MAX_LEN, 16 * shard_count(sharded, 4))


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("dcp", DCP_SIZES)
def test_effective_block_size_is_block_times_shard_count(
    dcp: int, sharded: bool
) -> None:
    spec = full(block_size=16, sharded=sharded)
    effective = 16 * shard_count(sharded, dcp)
    assert resolve_dcp_kv_block_size(spec, dcp) == effective
    assert manager_for(spec, dcp).block_size == effective


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_groups_schedule_on_the_lcm_and_hash_on_the_gcd(
    make_config: Callable[..., Any], prefix_caching: bool
) -> None:
    """Target block 16 x DCP4 = 64 tokens, replicated draft block 48: the
    scheduler needs a multiple of both (192); hashes must divide both (16)."""
    config = make_config(dcp=4, prefix_caching=prefix_caching)
    kv_config = two_groups(full(16), full(48, sharded=False))
    scheduler, hashing = resolve_kv_cache_block_sizes(kv_config, config)
    assert scheduler == math.lcm(64, 48) == 192
    assert hashing == (math.gcd(64, 48) if prefix_caching else scheduler)


@pytest.mark.parametrize("sharded", [True, False])
def test_single_group_block_size_scales_only_when_sharded(
    make_config: Callable[..., Any], sharded: bool
) -> None:
    config = make_config(dcp=4, block_size=16)
    kv_config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], full(16, sharded=sharded))],
    )
    expected = 16 * shard_count(sharded, 4)
    assert resolve_kv_cache_block_sizes(kv_config, config) == (expected, expected)


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("dcp", DCP_SIZES)
@pytest.mark.parametrize("kind", FULL_KINDS)
def test_full_attention_memory_divides_the_model_length_only_when_sharded(
    make_config: Callable[..., Any], kind: str, dcp: int, sharded: bool
) -> None:
    spec = DRAFT_CAPABLE[kind](block_size=16, sharded=sharded)
    config = make_config(dcp=dcp, max_model_len=MAX_LEN)
    tokens = cdiv(MAX_LEN, shard_count(sharded, dcp))
    assert (
        spec.max_memory_usage_bytes(config) == cdiv(tokens, 16) * spec.page_size_bytes
    )


@pytest.mark.parametrize("kind", ["sliding", "sliding_mla"])
@pytest.mark.parametrize("dcp", DCP_SIZES)
def test_replicated_sliding_window_admission_uses_its_own_shard_count(
    make_config: Callable[..., Any], kind: str, dcp: int
) -> None:
    """A replicated sliding-window draft holds its whole window on every rank:
    the startup sizing, the spec's cap and the manager's runtime cap agree."""
    spec = DRAFT_CAPABLE[kind](block_size=16, sharded=False)
    config = make_config(dcp=dcp, max_model_len=MAX_LEN)
    in_flight = config.max_in_flight_tokens
    cap = cdiv(min(WINDOW - 1 + in_flight, MAX_LEN), 16) + 1
    assert spec.max_admission_blocks_per_request(in_flight, MAX_LEN) == cap
    assert spec.max_memory_usage_bytes(config) == cap * spec.page_size_bytes
    manager = manager_for(spec, dcp, in_flight)
    assert (manager.block_size, manager.max_admission_blocks_per_request) == (16, cap)


def test_sharded_sliding_window_is_refused_under_dcp(
    make_config: Callable[..., Any],
) -> None:
    with pytest.raises(AssertionError, match="DCP not support sliding window"):
        sliding(sharded=True).max_memory_usage_bytes(make_config(dcp=4))


def request(request_id: str, num_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=[7] * num_tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )


@pytest.mark.parametrize("dcp", [2, 4, 8])
def test_admission_agrees_with_startup_sizing(
    make_config: Callable[..., Any], dcp: int
) -> None:
    """A pool sized for N full-length requests of a DCP target plus its
    replicated draft admits exactly N of them at runtime."""
    config = make_config(dcp=dcp, max_model_len=MAX_LEN)
    config.cache_config.kv_cache_layout = "BLHNC"
    groups = [
        KVCacheGroupSpec(["target"], mla(16)),
        KVCacheGroupSpec(["draft"], full(16, sharded=False)),
    ]
    per_request = cdiv(MAX_LEN, 16 * dcp) + cdiv(MAX_LEN, 16)
    bytes_per_block = mla(16).page_size_bytes
    num_requests = 3
    kv_config = get_kv_cache_config_from_groups(
        config, groups, bytes_per_block * (num_requests * per_request + 1)
    )
    assert int(get_max_concurrency_for_kv_cache_config(config, kv_config)) == 3
    manager = KVCacheManager(
        kv_config,
        max_model_len=MAX_LEN,
        scheduler_block_size=16 * dcp,
        hash_block_size=16,
        enable_caching=False,
        dcp_world_size=dcp,
    )
    for i in range(num_requests):
        blocks = manager.allocate_slots(request(f"r{i}", MAX_LEN), MAX_LEN)
        assert blocks is not None
        assert [len(b) for b in blocks.blocks] == [
            cdiv(MAX_LEN, 16 * dcp),
            cdiv(MAX_LEN, 16),
        ]
    assert manager.allocate_slots(request("one-too-many", MAX_LEN), MAX_LEN) is None
