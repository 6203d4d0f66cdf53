# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run the fused verify kernels under Triton's CPU interpreter and compare
them with the float64 reference; exits non-zero on a mismatch.

Usage: ``TRITON_INTERPRET=1 python k3_interpreted_check.py float16 3`` (or
``float8_e4m3fn`` for the KV dtype; then the KV split count; a third argument
``nan`` runs ``check_nan`` instead).
The interpreter must be on before triton is imported, so
test_fused_mla_verify_cpu.py runs this in a fresh process. fp16 stands in for
bf16 queries, which the interpreter (numpy) cannot compute. The case is a DCP
rank with causal rows, rows that see nothing and several KV splits (more
than 16: the merge runs in column blocks and most splits are empty).
"""

import os
import sys

import torch
from k3_reference import (
    dequant,
    owner_rank,
    paged_cache,
    random_kv,
    reference_attention,
    visible_mask,
)
from k3_standalone import load_fused_verify

QUERY_LEN, HEADS, DCP_SIZE, RANK, INTERLEAVE = 3, 5, 2, 1, 4
K_SCALE, SM_SCALE = 0.05, 0.07
SEQ_LENS = [0, 1, 37, 300]


def _run(
    cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: list[int],
    splits: int,
    fill: float,
    **dcp: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random fp16 queries and the kernels' ``o`` and ``lse`` (prefilled with
    ``fill``) for them; the workspace holds NaN, so a partial output the merge
    reads but no split wrote poisons the result."""
    ops = load_fused_verify()
    rows = len(seq_lens) * QUERY_LEN
    q = torch.randn(rows, HEADS, 576, dtype=torch.float16)
    o = torch.full((rows, HEADS, 512), fill, dtype=torch.float16)
    lse = torch.full((rows, HEADS), fill)
    ops.fused_mla_verify_decode(
        q,
        cache,
        table,
        torch.tensor(seq_lens, dtype=torch.int32),
        o,
        lse,
        torch.full((ops.workspace_numel(rows, HEADS, splits),), float("nan")),
        query_len=QUERY_LEN,
        sm_scale=SM_SCALE,
        num_kv_splits=splits,
        k_scale=torch.tensor([K_SCALE]),
        **dcp,
    )
    return q, o, lse


def _assert_close(
    label: str,
    o: torch.Tensor,
    lse: torch.Tensor,
    ref_o: torch.Tensor,
    ref_lse: torch.Tensor,
) -> None:
    # fp16 operands with fp32 accumulation: far inside the GPU tests' 1e-2.
    err = ((o.double() - ref_o).norm() / ref_o.norm()).item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    print(f"{label}: relative output error {err:.2e}, LSE error {lse_err:.2e}")
    assert err < 2e-3 and lse_err < 1e-4


def check(kv_dtype: torch.dtype, splits: int) -> None:
    dcp = {"dcp_size": DCP_SIZE, "dcp_rank": RANK, "cp_interleave": INTERLEAVE}
    stored = [random_kv(n, kv_dtype, K_SCALE, "cpu") for n in SEQ_LENS]
    local = [
        kv[owner_rank(torch.arange(len(kv)), DCP_SIZE, INTERLEAVE) == RANK]
        for kv in stored
    ]
    cache, table = paged_cache(local, 16)
    q, o, lse = _run(cache, table, SEQ_LENS, splits, float("nan"), **dcp)
    masks = [
        visible_mask(
            n, QUERY_LEN, dcp_size=DCP_SIZE, dcp_rank=RANK, cp_interleave=INTERLEAVE
        )
        for n in SEQ_LENS
    ]
    ref_o, ref_lse = reference_attention(
        q, [dequant(kv, K_SCALE) for kv in stored], masks, SM_SCALE
    )
    empty = torch.isinf(ref_lse)
    assert empty.any() and not empty.all(), "the case must mix empty and seen rows"
    assert torch.equal(torch.isinf(lse), empty), "empty rows differ"
    assert (o[empty] == 0).all(), "an empty row has a non-zero output"
    seen = ~empty
    _assert_close("seen rows", o[seen], lse[seen], ref_o[seen], ref_lse[seen])


def check_nan(kv_dtype: torch.dtype, splits: int) -> None:
    """A NaN in one request's visible KV makes all its rows' outputs and LSEs
    NaN (a split whose row sum is NaN must not pass for empty); the other
    request is unaffected."""
    seq_lens = [40, 300]
    stored = [random_kv(n, kv_dtype, K_SCALE, "cpu") for n in seq_lens]
    poisoned = stored[1].clone()
    poisoned.view(torch.uint8 if kv_dtype.itemsize == 1 else torch.int16)[10, 3] = (
        0x7F if kv_dtype.itemsize == 1 else 0x7E00  # NaN in e4m3 / fp16
    )
    cache, table = paged_cache([stored[0], poisoned], 16)
    # Zero-filled outputs: a row the kernels leave unwritten is not NaN.
    q, o, lse = _run(cache, table, seq_lens, splits, 0.0)
    assert o[QUERY_LEN:].isnan().all(), "a row that sees the NaN is not NaN"
    assert lse[QUERY_LEN:].isnan().all(), "an LSE of a row that sees the NaN is not NaN"
    masks = [visible_mask(n, QUERY_LEN) for n in seq_lens[:1]]
    ref_o, ref_lse = reference_attention(
        q[:QUERY_LEN], [dequant(stored[0], K_SCALE)], masks, SM_SCALE
    )
    _assert_close("clean request", o[:QUERY_LEN], lse[:QUERY_LEN], ref_o, ref_lse)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    run = check_nan if sys.argv[3:] == ["nan"] else check
    run(getattr(torch, sys.argv[1]), int(sys.argv[2]))
