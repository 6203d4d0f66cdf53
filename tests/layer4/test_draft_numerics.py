# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Why the draft's cache is replicated: draft attention over a sequence split
across D simulated DCP ranks, without the LSE merge the draft does not do,
differs from DCP1; the replicated layout is bit-identical to DCP1.

Each rank writes the draft's K/V into its paged cache at the slots the real
slot-mapping kernel (Triton CPU interpreter) gives it, reads its rank-local
sequence back through its block table and attends with the DFlash query block
(anchor + K mask rows, non-causal over the context)."""

import types

import pytest
import torch
from k3l4_slots import PAD, Case, Group, run_kernel

DCP, SEQ_LEN, QUERY_ROWS = 4, 103, 4  # K = 3 speculative tokens
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
BLOCK_SIZES = {"sharded": 16, "replicated": 32}


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal GQA attention of ``q`` [rows, H, d] over ``k``/``v`` [n, Hkv,
    d]: the output and its log-sum-exp [rows, H]."""
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(0, 1)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The DCP merge of per-rank partial attention by log-sum-exp."""
    lse = torch.stack([p[1] for p in parts])
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)
    return (torch.stack([p[0] for p in parts]) * weights).sum(dim=0)


def rank_attention(
    kernels: types.ModuleType,
    layout: str,
    rank: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention on ``rank`` as it runs there: K/V written at the kernel's slots
    (PAD: another rank owns the token), read back in rank-local order."""
    block_size = BLOCK_SIZES[layout]
    cp_size = DCP if layout == "sharded" else 1
    num_blocks = -(-SEQ_LEN // (block_size * cp_size))
    # Scattered, rank-specific physical blocks.
    block_ids = [(7 * i + 3 * rank) % 64 + 64 * rank for i in range(num_blocks)]
    case = Case(
        groups=[Group(block_size, cp_size, [block_ids])],
        cp_size=DCP,
        cp_rank=rank,
        interleave=1,
        idx_mapping=[0],
        query_lens=[SEQ_LEN],
        positions=list(range(SEQ_LEN)),
        max_num_tokens=SEQ_LEN,
    )
    slots = torch.tensor(run_kernel(kernels, case, "cpu")[0])
    owned = slots != PAD
    k_cache = torch.full((512 * block_size, KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = k_cache.clone()
    k_cache[slots[owned]] = k[owned]
    v_cache[slots[owned]] = v[owned]
    local = torch.arange(int(owned.sum()))
    read = (
        torch.tensor(block_ids)[local // block_size] * block_size + local % block_size
    )
    return attend(q, k_cache[read], v_cache[read])


@pytest.fixture(scope="module")
def draft_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(QUERY_ROWS, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(SEQ_LEN, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(SEQ_LEN, KV_HEADS, HEAD_DIM, generator=generator)
    return q, k, v


def test_replicated_layout_is_bit_identical_to_dcp1(
    interpreted_kernels: types.ModuleType, draft_inputs: tuple
) -> None:
    q, k, v = draft_inputs
    dcp1, dcp1_lse = attend(q, k, v)
    for rank in range(DCP):
        out, lse = rank_attention(interpreted_kernels, "replicated", rank, q, k, v)
        assert torch.equal(out, dcp1)
        assert torch.equal(lse, dcp1_lse)


def test_sharded_layout_without_lse_merge_differs_from_dcp1(
    interpreted_kernels: types.ModuleType, draft_inputs: tuple
) -> None:
    q, k, v = draft_inputs
    dcp1, _ = attend(q, k, v)
    for rank in range(DCP):
        out, _ = rank_attention(interpreted_kernels, "sharded", rank, q, k, v)
        assert (out - dcp1).abs().max() > 0.1


def test_sharded_layout_needs_the_lse_merge_to_match_dcp1(
    interpreted_kernels: types.ModuleType, draft_inputs: tuple
) -> None:
    """The sharded partials are right, only incomplete: merging them by their
    LSE (what the target does and the draft does not) recovers DCP1."""
    q, k, v = draft_inputs
    dcp1, _ = attend(q, k, v)
    parts = [
        rank_attention(interpreted_kernels, "sharded", rank, q, k, v)
        for rank in range(DCP)
    ]
    torch.testing.assert_close(merge(parts), dcp1, rtol=1e-5, atol=1e-5)
