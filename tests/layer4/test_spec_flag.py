# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The replication flag (``dcp_sharded=False``) on every attention spec that can
hold a draft: kept by every merge, refused when mixed, compared by the
uniformity checks. All of it is upstream 0.33.0 behaviour that layer 4 relies
on; these tests pin it against the real spec classes."""

import pytest
from k3l4_specs import DRAFT_CAPABLE, mla

from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

KINDS = sorted(DRAFT_CAPABLE)


@pytest.mark.parametrize("kind", KINDS)
def test_merge_keeps_replication(kind: str) -> None:
    draft = DRAFT_CAPABLE[kind](sharded=False)
    merged = type(draft).merge([draft, draft])
    assert type(merged) is type(draft)
    assert merged.dcp_sharded is False
    assert merged == draft


@pytest.mark.parametrize("kind", KINDS)
def test_merge_keeps_sharding(kind: str) -> None:
    target = DRAFT_CAPABLE[kind](sharded=True)
    assert type(target).merge([target, target]).dcp_sharded is True


@pytest.mark.parametrize("replicated_first", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_merge_refuses_mixed_replication(kind: str, replicated_first: bool) -> None:
    target = DRAFT_CAPABLE[kind](sharded=True)
    draft = DRAFT_CAPABLE[kind](sharded=False)
    specs = [draft, target] if replicated_first else [target, draft]
    with pytest.raises(AssertionError):
        type(specs[0]).merge(specs)


@pytest.mark.parametrize("kind", KINDS)
def test_replication_is_part_of_spec_identity(kind: str) -> None:
    """Grouping buckets layers by spec equality, so the flag must take part."""
    target = DRAFT_CAPABLE[kind](sharded=True)
    draft = DRAFT_CAPABLE[kind](sharded=False)
    assert target != draft
    assert len({target, draft}) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_uniform_collection_keeps_replication(kind: str) -> None:
    layers = {f"draft.{i}": DRAFT_CAPABLE[kind](sharded=False) for i in range(3)}
    collection = UniformTypeKVCacheSpecs.from_specs(layers)
    assert collection is not None
    assert collection.dcp_sharded is False
    merged = UniformTypeKVCacheSpecs.merge([collection, collection])
    assert merged.dcp_sharded is False


@pytest.mark.parametrize("kind", KINDS)
def test_uniformity_check_refuses_mixed_replication(kind: str) -> None:
    layers = {
        "target": DRAFT_CAPABLE[kind](sharded=True),
        "draft": DRAFT_CAPABLE[kind](sharded=False),
    }
    assert not UniformTypeKVCacheSpecs.is_uniform_type(layers)
    assert UniformTypeKVCacheSpecs.from_specs(layers) is None


def test_uniform_collection_merge_refuses_mixed_replication() -> None:
    sharded = UniformTypeKVCacheSpecs.from_specs({"a": mla(), "b": mla()})
    replicated = UniformTypeKVCacheSpecs.from_specs(
        {"a": mla(sharded=False), "b": mla(sharded=False)}
    )
    assert sharded is not None and replicated is not None
    with pytest.raises(AssertionError):
        UniformTypeKVCacheSpecs.merge([sharded, replicated])
