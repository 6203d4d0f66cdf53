# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-group DCP geometry of model runner V2's block tables.

Under decode context parallelism (DCP size D, rank r, interleave I) a KV cache
group is either sharded (token ``p`` lives on rank ``(p // I) % D`` only) or
replicated (every rank keeps every token, e.g. a DFlash draft that attends as
DCP1). ``BlockTables`` (``block_table.py``) takes both from here.

This module imports only torch and triton, so the kernel can be checked on a
machine without vllm (and under ``TRITON_INTERPRET=1`` on a CPU). Where Triton
is not installed (vLLM's CPU backend off x86_64) it takes vLLM's placeholders,
as upstream's ``block_table`` does.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    from vllm.triton_utils import tl, triton


def sliding_window_reach_under_cp(
    sliding_window_reach: list[int], dcp_sharded: list[bool], cp_size: int
) -> list[int]:
    """Per group, the sliding-window reach the block-table gather may mask.

    The gather nulls block-table entries wholly below ``first position -
    reach``, which assumes column ``j`` holds tokens ``[j * B, (j + 1) * B)``.
    Under context parallelism that holds only for replicated groups, so the
    reach of every sharded group is dropped to 0 (no masking).
    """
    if len(sliding_window_reach) != len(dcp_sharded):
        raise ValueError(
            f"sliding_window_reach has {len(sliding_window_reach)} groups but "
            f"dcp_sharded has {len(dcp_sharded)}; pass one entry per KV cache group."
        )
    if cp_size == 1:
        return list(sliding_window_reach)
    return [
        0 if sharded else reach
        for reach, sharded in zip(sliding_window_reach, dcp_sharded)
    ]


def compute_slot_mappings(
    slot_mappings: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table_ptrs: torch.Tensor,
    block_table_strides: torch.Tensor,
    block_sizes: torch.Tensor,
    slot_mapping_enabled: torch.Tensor,
    dcp_sharded: torch.Tensor,
    cp_rank: int,
    cp_size: int,
    cp_interleave: int,
    pad_id: int,
) -> None:
    """Write the KV slot of every scheduled token, per KV cache group.

    - ``slot_mappings``: ``[num_groups >= 1, max_num_tokens]`` int64, written in
      full: token ``t`` of group ``g`` gets its slot or ``pad_id``, and every
      column from ``query_start_loc[num_reqs]`` on gets ``pad_id``.
    - ``idx_mapping``: ``[num_reqs]``, the block-table row of each batch
      request; ``-1`` marks a padding request (all its tokens get ``pad_id``).
    - ``query_start_loc``: ``[num_reqs + 1]``; ``positions``: ``[num_tokens]``.
    - ``block_table_ptrs``: ``[num_groups]`` uint64 addresses of the groups'
      int32 ``[max_num_reqs, width]`` tables; ``block_table_strides``: their
      row strides; ``block_sizes``: tokens per block of each group.
    - ``slot_mapping_enabled``: groups that address their pages themselves get
      ``pad_id`` for every token.
    - ``dcp_sharded``: a sharded group under ``cp_size > 1`` maps position
      ``p`` only on its owner rank ``(p // cp_interleave) % cp_size`` (slot
      ``block_table[p // (B * cp_size)] * B`` + the rank-local offset; the
      interleave divides ``B``) and pads it elsewhere; a replicated group maps
      every position on every rank as ``block_table[p // B] * B + p % B``.
    """
    num_groups = block_sizes.shape[0]
    num_reqs = idx_mapping.shape[0]
    _compute_slot_mappings_kernel[(num_groups, num_reqs + 1)](
        slot_mappings.shape[1],
        idx_mapping,
        query_start_loc,
        positions,
        block_table_ptrs,
        block_table_strides,
        block_sizes,
        slot_mapping_enabled,
        dcp_sharded,
        slot_mappings,
        slot_mappings.stride(0),
        cp_rank,
        CP_SIZE=cp_size,
        CP_INTERLEAVE=cp_interleave,
        PAD_ID=pad_id,
        TRITON_BLOCK_SIZE=1024,
    )


@triton.jit
def _compute_slot_mappings_kernel(
    max_num_tokens,
    idx_mapping,  # [num_reqs]
    query_start_loc,  # [num_reqs + 1]
    pos,  # [num_tokens]
    block_table_ptrs,  # [num_kv_cache_groups]
    block_table_strides,  # [num_kv_cache_groups]
    block_sizes,  # [num_kv_cache_groups]
    slot_mapping_enabled,  # [num_kv_cache_groups]
    dcp_sharded,  # [num_kv_cache_groups]
    slot_mappings_ptr,  # [num_kv_cache_groups, max_num_tokens]
    slot_mappings_stride,
    cp_rank,
    CP_SIZE: tl.constexpr,
    CP_INTERLEAVE: tl.constexpr,
    PAD_ID: tl.constexpr,
    TRITON_BLOCK_SIZE: tl.constexpr,
):
    # kv cache group id
    group_id = tl.program_id(0)
    batch_idx = tl.program_id(1)
    slot_mapping_ptr = slot_mappings_ptr + group_id * slot_mappings_stride

    if batch_idx == tl.num_programs(1) - 1:
        # Pad remaining slots to -1. This is needed for CUDA graphs.
        # Start from actual token count (not padded) to cover the gap
        # between actual tokens and padded tokens that can contain stale
        # valid slot IDs from previous chunks during chunked prefill.
        actual_num_tokens = tl.load(query_start_loc + batch_idx)
        for i in range(actual_num_tokens, max_num_tokens, TRITON_BLOCK_SIZE):
            offset = i + tl.arange(0, TRITON_BLOCK_SIZE)
            tl.store(slot_mapping_ptr + offset, PAD_ID, mask=offset < max_num_tokens)
        return

    block_table_ptr = tl.load(block_table_ptrs + group_id).to(tl.pointer_type(tl.int32))
    block_table_ptr = tl.multiple_of(block_table_ptr, 16)
    block_table_stride = tl.load(block_table_strides + group_id)
    kv_block_size = tl.load(block_sizes + group_id)
    mapping_enabled = tl.load(slot_mapping_enabled + group_id)
    if CP_SIZE != 1:
        sharded = tl.load(dcp_sharded + group_id)

    req_state_idx = tl.load(idx_mapping + batch_idx)
    # idx_mapping == -1 marks a dummy (or CUDA-graph padding) request that owns
    # no blocks: never read its block-table row and emit PAD for its tokens.
    is_real_req = req_state_idx >= 0
    start_idx = tl.load(query_start_loc + batch_idx)
    end_idx = tl.load(query_start_loc + batch_idx + 1)
    for i in range(start_idx, end_idx, TRITON_BLOCK_SIZE):
        offset = i + tl.arange(0, TRITON_BLOCK_SIZE)
        positions = tl.load(pos + offset, mask=offset < end_idx, other=0)

        if CP_SIZE == 1:
            # Common case: Context parallelism is not used.
            local_positions = positions
            is_local = True
        else:
            # Context parallelism is used.
            virtual_block_size = kv_block_size * CP_SIZE
            virtual_block_indices = positions // virtual_block_size
            virtual_block_offsets = positions % virtual_block_size
            is_local = virtual_block_offsets // CP_INTERLEAVE % CP_SIZE == cp_rank
            rounds = virtual_block_offsets // (CP_INTERLEAVE * CP_SIZE)
            remainder = virtual_block_offsets % CP_INTERLEAVE
            local_offsets = rounds * CP_INTERLEAVE + remainder
            local_positions = virtual_block_indices * kv_block_size + local_offsets
            # A replicated group keeps every position on every rank.
            local_positions = tl.where(sharded, local_positions, positions)
            is_local = ~sharded | is_local

        block_indices = tl.where(mapping_enabled, local_positions // kv_block_size, 0)
        block_offsets = local_positions % kv_block_size
        block_numbers = tl.load(
            block_table_ptr + req_state_idx * block_table_stride + block_indices,
            mask=is_local & is_real_req,
            other=0,
        )
        slot_ids = block_numbers * kv_block_size + block_offsets
        if CP_SIZE != 1:
            slot_ids = tl.where(is_local, slot_ids, PAD_ID)

        slot_ids = tl.where(mapping_enabled & is_real_req, slot_ids, PAD_ID)
        tl.store(slot_mapping_ptr + offset, slot_ids, mask=offset < end_idx)
