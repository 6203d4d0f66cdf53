# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache grouping of a DCP target with a replicated draft: the two never
share a group (upstream), and the target's groups come first whatever order
the layers are listed in (layer 4, ``vllm.v1.core.k3_dcp_grouping``)."""

from collections.abc import Callable, Iterable
from typing import Any

import pytest
from k3l4_specs import DTYPE, GQA, WINDOW, full, mla, sliding

from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.k3_dcp_grouping import sharded_layers_first
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    iter_layer_specs,
)

BOTH_LAYOUTS = [["LBHNC", "BLHNC"]]


@pytest.fixture(autouse=True)
def _no_layout_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def group(
    config: Any, specs: dict[str, KVCacheSpec], layouts: list[list[str]] = BOTH_LAYOUTS
) -> list[KVCacheGroupSpec]:
    """Resolve the layout as the engine core does, then group the layers."""
    config.cache_config.kv_cache_layout = None
    resolve_kv_cache_layout(config, layouts, specs.values())
    return get_kv_cache_groups(config, dict(specs))


def layers(prefix: str, make: Callable[..., KVCacheSpec], n: int) -> dict:
    return {f"{prefix}.{i}": make() for i in range(n)}


def target_and_draft(page: str, draft_kind: str) -> tuple[dict, dict]:
    """A 4-layer target whose page equals the draft's ("same") or not."""
    make_target = full if page == "same" else mla
    make_draft = full if draft_kind == "full" else sliding
    return (
        layers("target", make_target, 4),
        layers("draft", lambda: make_draft(sharded=False), 2),
    )


def sharding_of(groups: Iterable[KVCacheGroupSpec]) -> list[bool]:
    return [g.kv_cache_spec.dcp_sharded for g in groups]


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("draft_kind", ["full", "sliding"])
@pytest.mark.parametrize("page", ["same", "different"])
def test_replicated_draft_never_shares_a_group_with_the_target(
    make_config: Callable[..., Any], page: str, draft_kind: str, hybrid: bool
) -> None:
    target, draft = target_and_draft(page, draft_kind)
    groups = group(make_config(dcp=4, hybrid=hybrid), target | draft)
    assert sorted(n for g in groups for n in g.layer_names) == sorted(target | draft)
    for g in groups:
        names = set(g.layer_names)
        assert names <= set(target) or names <= set(draft)
        expected_sharded = names <= set(target)
        assert g.kv_cache_spec.dcp_sharded is expected_sharded
        assert all(
            s.dcp_sharded is expected_sharded for s in iter_layer_specs(g.kv_cache_spec)
        )


@pytest.mark.parametrize("draft_kind", ["full", "sliding"])
@pytest.mark.parametrize("page", ["same", "different"])
def test_target_groups_come_first_whatever_the_layer_order(
    make_config: Callable[..., Any], page: str, draft_kind: str
) -> None:
    target, draft = target_and_draft(page, draft_kind)
    config = make_config(dcp=4)
    listed_last = sharding_of(group(config, target | draft))
    listed_first = sharding_of(group(config, draft | target))
    assert listed_first == listed_last
    num_target = listed_first.count(True)
    assert listed_first == [True] * num_target + [False] * (
        len(listed_first) - num_target
    )


def test_group_order_is_the_layer_order_without_dcp(
    make_config: Callable[..., Any],
) -> None:
    target = layers("target", mla, 2)
    draft = layers("draft", lambda: full(sharded=False), 1)
    assert sharding_of(group(make_config(dcp=1), draft | target)) == [False, True]


def test_replicated_ring_stays_with_the_target(
    make_config: Callable[..., Any],
) -> None:
    """A self-addressed replicated ring (the kpool tail) is target state."""
    ring = CircularBufferSpec(block_size=4, dcp_sharded=False, **GQA)
    specs = {
        "draft.0": full(sharded=False),
        "target.ring": ring,
        "target.0": mla(),
    }
    reordered = sharded_layers_first(specs, make_config(dcp=4))
    assert list(reordered) == ["target.ring", "target.0", "draft.0"]
    assert list(sharded_layers_first(specs, make_config(dcp=1))) == list(specs)


@pytest.mark.parametrize("dcp", [2, 4, 8])
def test_each_part_keeps_its_layer_order(
    make_config: Callable[..., Any], dcp: int
) -> None:
    """Under any DCP size only the replicated layers move: the target's layers
    and the draft's keep the order they were listed in."""
    specs = {
        "draft.1": full(sharded=False),
        "target.1": mla(),
        "draft.0": full(sharded=False),
        "target.0": mla(),
    }
    reordered = sharded_layers_first(specs, make_config(dcp=dcp))
    assert list(reordered) == ["target.1", "target.0", "draft.1", "draft.0"]


def test_mamba_state_stays_with_the_target(
    make_config: Callable[..., Any],
) -> None:
    """Mamba state is never DCP-sharded and takes a slot mapping, yet it is
    the target's state, not a replicated draft cache."""
    mamba = MambaSpec(block_size=16, shapes=((2, 8),), dtypes=(DTYPE,))
    specs = {"draft.0": full(sharded=False), "target.mamba": mamba, "target.0": mla()}
    reordered = sharded_layers_first(specs, make_config(dcp=4))
    assert list(reordered) == ["target.mamba", "target.0", "draft.0"]


def test_mixed_page_sizes_need_a_block_outer_layout(
    make_config: Callable[..., Any],
) -> None:
    specs = layers("target", mla, 2) | layers("draft", lambda: full(sharded=False), 1)
    config = make_config(dcp=4)
    group(config, specs)
    assert config.cache_config.get_resolved_kv_cache_layout() == KVCacheLayout.BLHNC
    with pytest.raises(ValueError, match="block-outer"):
        group(config, specs, layouts=[["LBHNC"]])


def test_disabled_hybrid_manager_keeps_the_draft_window(
    make_config: Callable[..., Any],
) -> None:
    """Promoting sliding-window layers to full attention happens per side: a
    replicated sliding-window draft next to a full-attention target keeps its
    window allocation."""
    specs = layers("target", full, 2) | layers(
        "draft", lambda: sliding(sharded=False), 2
    )
    groups = group(make_config(dcp=4, hybrid=False), specs)
    draft_specs = [
        s
        for g in groups
        if not g.kv_cache_spec.dcp_sharded
        for s in iter_layer_specs(g.kv_cache_spec)
    ]
    assert draft_specs and all(
        isinstance(s, SlidingWindowSpec) and s.sliding_window == WINDOW
        for s in draft_specs
    )
