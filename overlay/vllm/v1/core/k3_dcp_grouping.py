# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Group order of a DCP target with a replicated draft.

Under decode context parallelism the target's KV is sharded across the DCP
ranks while a draft that attends as DCP1 (e.g. DFlash) keeps a replicated
cache (``dcp_sharded=False``). The two never share a KV cache group: their
specs differ in ``dcp_sharded``, which every ``merge`` and uniformity check of
``vllm.v1.kv_cache_interface`` compares. What is left to fix is the order of
the groups, which follows the order the layers are listed in.
"""

from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def sharded_layers_first(
    kv_cache_spec: dict[str, KVCacheSpec], vllm_config: "VllmConfig"
) -> dict[str, KVCacheSpec]:
    """The layers in grouping order: under DCP the target's layers come before
    the replicated, slot-mapped attention layers (the draft), each part in its
    original order. Self-addressed replicated rings (``uses_slot_mapping``
    False, e.g. the kpool tail) are per-request state of the target, like Mamba
    state, and stay with it.

    Grouping keeps the order in which layers are listed, so the target's groups
    get the low group ids (group 0 is the target's, whatever order the model
    runner collected the layers in). Without DCP, or without replicated
    layers, the order is unchanged and the config is not read.
    """
    replicated = {
        name: spec
        for name, spec in kv_cache_spec.items()
        if isinstance(spec, AttentionSpec)
        and spec.uses_slot_mapping
        and not spec.dcp_sharded
    }
    if not replicated or vllm_config.parallel_config.decode_context_parallel_size == 1:
        return kv_cache_spec
    target = {
        name: spec for name, spec in kv_cache_spec.items() if name not in replicated
    }
    return target | replicated
