# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU correctness of the fused MLA verification kernel (layer 5).

Every check draws fresh random inputs and poisons ``o`` and ``lse`` with NaN
before the call; the KV cache holds NaN in every slot that no request owns and
in the page that unused block-table entries point at, so a read outside the
visible KV shows up as NaN.

Tolerances. q and KV are bf16 (or fp8 e4m3 with a scale; both dequantise
exactly in float64), so q.k products are exact and are accumulated in fp32:
the LSE matches float64 to about 1e-5 and is checked to 2e-3 absolute. The
output path rounds the softmax weights to bf16 (on the Gluon kernel with fp8
KV: to fp16, scaled so that weights down to 2^-39 of a row's largest stay
normal) before the P.V product and rounds the result to bf16, each a relative
error of at most 2^-9 per element, about 3e-3 in norm: outputs are checked to
1e-2 relative in norm over all rows and 3e-2 per (row, head). A wrong mask,
page, split or row mapping gives errors of order one.
"""

import dataclasses
import math
import types

import pytest
import torch

pytest.importorskip("triton", reason="the kernel under test is a Triton kernel")

from k3_reference import (  # noqa: E402  (sibling modules, after the skip)
    LATENT,
    dequant,
    owner_rank,
    paged_cache,
    random_kv,
    reference_attention,
    visible_mask,
)
from k3_standalone import make_upstream_verify, upstream_num_kv_splits  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: the kernel under test is a Triton GPU kernel",
    ),
]

DEVICE = "cuda"
# Kimi-K3 / DeepSeek MLA softmax scale: 1/sqrt(128 nope + 64 rope).
SM_SCALE = 192**-0.5
K_SCALE = 0.05
O_NORM_TOL = 1e-2
O_ROW_TOL = 3e-2
LSE_TOL = 2e-3
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _queries(num_reqs: int, query_len: int, heads: int) -> torch.Tensor:
    return torch.randn(num_reqs * query_len, heads, 576, device=DEVICE).to(BF16)


def _run(
    ops: types.ModuleType,
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: list[int],
    *,
    query_len: int,
    num_kv_splits: int | None = None,
    k_scale: float = K_SCALE,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel call on NaN-poisoned outputs (``k_scale`` for fp8 KV)."""
    rows, heads = q.shape[0], q.shape[1]
    splits = num_kv_splits or ops.choose_num_kv_splits(
        len(seq_lens), heads, query_len, max(seq_lens), _sm_count()
    )
    o = torch.full((rows, heads, LATENT), float("nan"), dtype=BF16, device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), device=DEVICE)
    workspace = torch.empty(ops.workspace_numel(rows, heads, splits), device=DEVICE)
    scale = torch.tensor([k_scale], device=DEVICE) if cache.dtype == FP8 else None
    ops.fused_mla_verify_decode(
        q,
        cache,
        table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        o,
        lse,
        workspace,
        query_len=query_len,
        sm_scale=SM_SCALE,
        num_kv_splits=splits,
        k_scale=scale,
        **kwargs,
    )
    return o, lse


def _reference(
    q: torch.Tensor,
    stored: list[torch.Tensor],
    query_len: int,
    k_scale: float = K_SCALE,
    **mask_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    masks = [
        visible_mask(len(kv), query_len, device=DEVICE, **mask_kwargs) for kv in stored
    ]
    return reference_attention(
        q, [dequant(kv, k_scale) for kv in stored], masks, SM_SCALE
    )


def _assert_matches(
    o: torch.Tensor,
    lse: torch.Tensor,
    ref_o: torch.Tensor,
    ref_lse: torch.Tensor,
    o_norm_tol: float = O_NORM_TOL,
) -> None:
    """Every row written; empty rows exact; the rest within tolerance."""
    assert not o.isnan().any(), "an output row was not written"
    assert not lse.isnan().any(), "an LSE was not written"
    empty = torch.isinf(ref_lse)
    assert torch.equal(lse[empty], ref_lse[empty].float())
    assert torch.equal(o[empty], torch.zeros_like(o[empty]))
    seen = ~empty
    if not seen.any():
        return
    diff = o.double()[seen] - ref_o[seen]
    norm_err = (diff.norm() / ref_o[seen].norm()).item()
    assert norm_err < o_norm_tol, f"relative error {norm_err:.3e}"
    row_err = (diff.norm(dim=-1) / ref_o[seen].norm(dim=-1)).max().item()
    assert row_err < O_ROW_TOL, f"worst (row, head) relative error {row_err:.3e}"
    lse_err = (lse.double()[seen] - ref_lse[seen]).abs().max().item()
    assert lse_err < LSE_TOL, f"LSE error {lse_err:.3e}"


def _default_tiling_on(
    ops: types.ModuleType,
    cache: torch.Tensor,
    query_len: int,
    heads: int,
    use_gluon: bool,
):
    """The default 64-row tiling on the Gluon or the Triton kernel; skips the
    test where the Gluon kernel does not run on ``cache``."""
    if use_gluon and not ops.runs_gluon_kernel(cache, BF16, 64):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) GPUs only")
    return dataclasses.replace(
        ops.default_config(query_len, heads), use_gluon=use_gluon
    )


def _random_lens(query_len: int, longest: int) -> list[int]:
    """A context of 1 (rows with no KV), exactly query_len, and two random."""
    mid = int(torch.randint(query_len + 1, 4096, ()).item())
    long = int(torch.randint(4096, longest + 1, ()).item())
    return [1, query_len, mid, long]


@pytest.mark.parametrize(
    ("query_len", "heads", "page_size"),
    [
        # 4 and 12 folded rows: tiles padded to the 16-row minimum of tl.dot.
        (2, 2, 16),
        (3, 4, 64),
        (2, 16, 16),
        (3, 12, 64),
        (4, 16, 64),
        (4, 96, 16),
        (5, 12, 16),
        (6, 16, 64),
        (7, 96, 64),
        (8, 16, 16),
        (8, 12, 64),
    ],
)
def test_bf16_kv_matches_float64_reference(fused_verify, query_len, heads, page_size):
    seq_lens = _random_lens(query_len, 20_000)
    stored = [random_kv(n, BF16, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, page_size)
    q = _queries(len(seq_lens), query_len, heads)
    o, lse = _run(fused_verify, q, cache, table, seq_lens, query_len=query_len)
    _assert_matches(o, lse, *_reference(q, stored, query_len))


@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("use_gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize(
    ("query_len", "heads", "page_size"),
    [(4, 16, 64), (3, 12, 16), (8, 16, 32), (4, 96, 64)],
)
def test_both_kernels_of_64_row_tiles_match_float64_reference(
    fused_verify, use_gluon, kv_dtype, query_len, heads, page_size
):
    """The Gluon kernel (the default on Hopper) and the Triton kernel (the
    default elsewhere) on the same 64-row tiling."""
    seq_lens = _random_lens(query_len, 20_000)
    stored = [random_kv(n, kv_dtype, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, page_size)
    config = _default_tiling_on(fused_verify, cache, query_len, heads, use_gluon)
    q = _queries(len(seq_lens), query_len, heads)
    o, lse = _run(
        fused_verify, q, cache, table, seq_lens, query_len=query_len, config=config
    )
    _assert_matches(o, lse, *_reference(q, stored, query_len))


@pytest.mark.parametrize(
    ("query_len", "heads", "page_size"),
    [(2, 16, 64), (4, 12, 16), (4, 96, 64), (8, 16, 64)],
)
def test_fp8_kv_matches_float64_reference(fused_verify, query_len, heads, page_size):
    seq_lens = _random_lens(query_len, 20_000)
    stored = [random_kv(n, FP8, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, page_size)
    q = _queries(len(seq_lens), query_len, heads)
    o, lse = _run(fused_verify, q, cache, table, seq_lens, query_len=query_len)
    _assert_matches(o, lse, *_reference(q, stored, query_len))


def _fp8_run_with_scaled_queries(
    fused_verify, query_len, heads, use_gluon, q_scale, poison=None
):
    """bf16 queries times ``q_scale`` (``poison(q)`` then edits them) through
    fp8 KV whose ``k_scale`` is divided by it, so that the scores are those
    of ordinary inputs; returns the outputs and the float64 reference."""
    k_scale = K_SCALE / q_scale
    seq_lens = _random_lens(query_len, 20_000)
    stored = [random_kv(n, FP8, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, 64)
    config = _default_tiling_on(fused_verify, cache, query_len, heads, use_gluon)
    q = (_queries(len(seq_lens), query_len, heads).float() * q_scale).to(BF16)
    if poison is not None:
        poison(q)
    o, lse = _run(
        fused_verify,
        q,
        cache,
        table,
        seq_lens,
        query_len=query_len,
        config=config,
        k_scale=k_scale,
    )
    return o, lse, _reference(q, stored, query_len, k_scale=k_scale)


@pytest.mark.parametrize("use_gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize(
    "q_scale", [2.0**20, 2.0**-20], ids=["above-fp16-max", "below-fp16-normals"]
)
@pytest.mark.parametrize(("query_len", "heads"), [(4, 16), (3, 12)])
def test_fp8_kv_with_queries_outside_fp16s_range_matches_float64_reference(
    fused_verify, use_gluon, q_scale, query_len, heads
):
    """With fp8 KV the Gluon kernel's products run in fp16: bf16 queries that
    fp16 cannot hold (above 65504, or below its normals, where it keeps few
    bits) must be scaled into its range first (3 x 12 rows leave padding
    rows in the 64-row tile)."""
    o, lse, ref = _fp8_run_with_scaled_queries(
        fused_verify, query_len, heads, use_gluon, q_scale
    )
    _assert_matches(o, lse, *ref)


@pytest.mark.parametrize("use_gluon", [True, False], ids=["gluon", "triton"])
def test_fp8_kv_with_an_infinite_query_value_keeps_the_other_heads_exact(
    fused_verify, use_gluon
):
    """One infinite query value (its head's scores are not finite) must not
    stop the scaling of the other values in its tile, which fp16 cannot hold
    unscaled."""

    def poison(q: torch.Tensor) -> None:
        q[0, 0, 5] = float("inf")

    o, lse, (ref_o, ref_lse) = _fp8_run_with_scaled_queries(
        fused_verify, 4, 16, use_gluon, 2.0**20, poison
    )
    _assert_matches(o[:, 1:], lse[:, 1:], ref_o[:, 1:], ref_lse[:, 1:])
    _assert_matches(o[1:, :1], lse[1:, :1], ref_o[1:, :1], ref_lse[1:, :1])


@pytest.mark.parametrize("use_gluon", [True, False], ids=["gluon", "triton"])
def test_fp8_kv_weights_far_below_a_rows_largest_still_count(fused_verify, use_gluon):
    """One key outscores 65,535 others by 18 (weights of 2^-26 against it,
    below fp16's smallest subnormal) and has a zero value, the others a value
    of 1: the output is the sum of those small weights, about 1e-3, which
    fp16 weights without headroom would round to zero. One split, so that
    every tile's weights are taken against the largest."""
    query_len, heads, n = 4, 16, 65_536
    values = torch.zeros(n, LATENT + 64, device=DEVICE)
    values[1:, :LATENT] = 1.0 / K_SCALE
    values[0, LATENT] = 448.0
    stored = [values.to(FP8)]
    cache, table = paged_cache(stored, 64)
    config = _default_tiling_on(fused_verify, cache, query_len, heads, use_gluon)
    q = torch.zeros(query_len, heads, LATENT + 64, device=DEVICE, dtype=BF16)
    # 11.125 * 448 * K_SCALE * SM_SCALE = 17.99
    q[..., LATENT] = 11.125
    o, lse = _run(
        fused_verify,
        q,
        cache,
        table,
        [n],
        query_len=query_len,
        num_kv_splits=1,
        config=config,
    )
    _assert_matches(o, lse, *_reference(q, stored, query_len))


@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("use_gluon", [True, False], ids=["gluon", "triton"])
def test_nan_in_visible_kv_poisons_the_rows_that_see_it(
    fused_verify, use_gluon, kv_dtype
):
    """A NaN key makes the output and LSE of exactly the rows whose causal
    prefix holds it NaN (never a finite result or an empty row); a NaN
    latent (key and value) every row of its request. For fp8 both NaN
    encodings, at different places of a packed word."""
    query_len, heads, n = 4, 16, 3000
    first = random_kv(n, kv_dtype, K_SCALE, DEVICE)
    second = random_kv(n, kv_dtype, K_SCALE, DEVICE)
    clean = first.clone()
    if kv_dtype == FP8:
        first.view(torch.uint8)[n - 1, 561] = 0x7F  # rope: seen by row 3 only
        first.view(torch.uint8)[n - 1, 575] = 0xFF
        first.view(torch.uint8)[n - 2, 542] = 0xFF  # rope: seen by rows 2, 3
        second.view(torch.uint8)[5, 6] = 0x7F  # latent: seen by every row
    else:
        first[n - 1, 561] = float("nan")
        first[n - 2, 542] = float("nan")
        second[5, 6] = float("nan")
    cache, table = paged_cache([first, second], 64)
    config = _default_tiling_on(fused_verify, cache, query_len, heads, use_gluon)
    q = _queries(2, query_len, heads)
    o, lse = _run(
        fused_verify, q, cache, table, [n, n], query_len=query_len, config=config
    )
    assert o[2:].isnan().all(), "a row that sees a NaN has a non-NaN output"
    assert lse[2:].isnan().all(), "a row that sees a NaN has a non-NaN LSE"
    ref_o, ref_lse = _reference(q[:query_len], [clean], query_len)
    _assert_matches(o[:2], lse[:2], ref_o[:2], ref_lse[:2])


@pytest.mark.parametrize(
    ("heads", "page_size", "kv_dtype"), [(16, 64, BF16), (96, 16, FP8)]
)
def test_128k_context_matches_float64_reference(
    fused_verify, heads, page_size, kv_dtype
):
    query_len = 4
    seq_lens = [131_072, int(torch.randint(100_000, 131_072, ()).item())]
    stored = [random_kv(n, kv_dtype, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, page_size)
    q = _queries(len(seq_lens), query_len, heads)
    o, lse = _run(fused_verify, q, cache, table, seq_lens, query_len=query_len)
    _assert_matches(o, lse, *_reference(q, stored, query_len))


def test_result_does_not_depend_on_split_count(fused_verify):
    query_len, heads = 4, 16
    seq_lens = [3, 900, 5000]
    stored = [random_kv(n, BF16, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, 64)
    q = _queries(len(seq_lens), query_len, heads)
    ref = _reference(q, stored, query_len)
    for splits in (1, 5, 64):
        o, lse = _run(
            fused_verify,
            q,
            cache,
            table,
            seq_lens,
            query_len=query_len,
            num_kv_splits=splits,
        )
        _assert_matches(o, lse, *ref)


def test_non_causal_rows_see_the_whole_prefix(fused_verify):
    query_len, heads = 4, 16
    seq_lens = [1, 700, 3000]
    stored = [random_kv(n, BF16, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, 16)
    q = _queries(len(seq_lens), query_len, heads)
    o, lse = _run(
        fused_verify, q, cache, table, seq_lens, query_len=query_len, causal=False
    )
    _assert_matches(o, lse, *_reference(q, stored, query_len, causal=False))


def test_rows_before_the_first_token_get_zero_output_and_neg_inf_lse(fused_verify):
    query_len, heads = 4, 16
    # seq_len 0: a padded request; 1 and 2: the first rows see no token.
    seq_lens = [0, 1, 2, 300]
    stored = [random_kv(n, BF16, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, 16)
    q = _queries(len(seq_lens), query_len, heads)
    o, lse = _run(fused_verify, q, cache, table, seq_lens, query_len=query_len)
    empty_rows = [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert torch.isneginf(lse[empty_rows]).all()
    assert (o[empty_rows] == 0).all()
    _assert_matches(o, lse, *_reference(q, stored, query_len))


def test_dcp_rank_owning_no_token_returns_neg_inf_lse(fused_verify):
    query_len, heads, dcp_size, interleave, rank = 4, 16, 8, 16, 3
    seq_lens = [40]  # rank 3 owns positions 48..63 onwards: none of them
    stored = [random_kv(0, BF16, K_SCALE, DEVICE)]
    cache, table = paged_cache(stored, 16)
    q = _queries(1, query_len, heads)
    o, lse = _run(
        fused_verify,
        q,
        cache,
        table,
        seq_lens,
        query_len=query_len,
        dcp_size=dcp_size,
        dcp_rank=rank,
        cp_interleave=interleave,
    )
    assert torch.isneginf(lse).all()
    assert (o == 0).all()


def test_requests_beyond_num_valid_reqs_are_not_written(fused_verify):
    query_len, heads = 4, 16
    seq_lens = [500, 64, 2000, 3]
    stored = [random_kv(n, BF16, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, 64)
    q = _queries(len(seq_lens), query_len, heads)
    num_valid = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    o, lse = _run(
        fused_verify,
        q,
        cache,
        table,
        seq_lens,
        query_len=query_len,
        num_valid_reqs=num_valid,
    )
    valid_rows = 2 * query_len
    assert o[valid_rows:].isnan().all() and lse[valid_rows:].isnan().all()
    ref_o, ref_lse = _reference(q[:valid_rows], stored[:2], query_len)
    _assert_matches(o[:valid_rows], lse[:valid_rows], ref_o, ref_lse)


def _merge_by_lse(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 LSE merge of per-rank (o, lse), as the DCP all-reduce does."""
    lses = torch.stack([lse.double() for _, lse in parts])
    outs = torch.stack([o.double() for o, _ in parts])
    top = lses.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    merged = (weights[..., None] * outs).sum(dim=0) / total[..., None]
    merged = torch.nan_to_num(merged, nan=0.0)
    return merged, torch.where(total > 0, top + torch.log(total), float("-inf"))


@pytest.mark.parametrize(
    ("dcp_size", "interleave"), [(1, 1), (2, 1), (4, 16), (8, 1), (8, 64)]
)
def test_dcp_ranks_merged_by_lse_equal_the_single_rank_result(
    fused_verify, dcp_size, interleave
):
    query_len, heads, page_size = 4, 16, 16
    seq_lens = [1, 5, int(torch.randint(6, 600, ()).item()), 9000]
    stored = [random_kv(n, BF16, K_SCALE, DEVICE) for n in seq_lens]
    q = _queries(len(seq_lens), query_len, heads)
    cache, table = paged_cache(stored, page_size)
    single = _run(fused_verify, q, cache, table, seq_lens, query_len=query_len)
    parts = []
    for rank in range(dcp_size):
        local = [
            kv[
                owner_rank(torch.arange(len(kv), device=DEVICE), dcp_size, interleave)
                == rank
            ]
            for kv in stored
        ]
        rank_cache, rank_table = paged_cache(local, page_size)
        o, lse = _run(
            fused_verify,
            q,
            rank_cache,
            rank_table,
            seq_lens,
            query_len=query_len,
            dcp_size=dcp_size,
            dcp_rank=rank,
            cp_interleave=interleave,
        )
        ref = _reference(
            q,
            stored,
            query_len,
            dcp_size=dcp_size,
            dcp_rank=rank,
            cp_interleave=interleave,
        )
        _assert_matches(o, lse, *ref)
        parts.append((o, lse))
    merged_o, merged_lse = _merge_by_lse(parts)
    _assert_matches(single[0], single[1], merged_o, merged_lse)
    _assert_matches(merged_o, merged_lse, *_reference(q, stored, query_len))


@pytest.mark.parametrize(
    ("kv_dtype", "o_norm_tol", "lse_atol"), [(BF16, 1e-2, 1e-3), (FP8, 2e-2, 2e-2)]
)
def test_matches_upstream_unfused_decode(
    fused_verify, upstream_decode, kv_dtype, o_norm_tol, lse_atol
):
    """Same inputs through upstream's flattened path. Upstream returns its LSE
    in bf16 (rtol of one bf16 step) and, for fp8, rounds the dequantised KV to
    bf16 before the products: a relative error of up to 2^-9 per element,
    about 2e-3 per score here (sm_scale * 2^-9/sqrt(3) * sqrt(576)), hence
    the looser output tolerance and an LSE tolerance of ten times that. Seen
    on the H200: at most 5.6e-3."""
    query_len, heads, page_size = 4, 16, 64
    seq_lens = [query_len, 777, 12_000]
    stored = [random_kv(n, kv_dtype, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, page_size)
    q = _queries(len(seq_lens), query_len, heads)
    o, lse = _run(fused_verify, q, cache, table, seq_lens, query_len=query_len)
    unfused = make_upstream_verify(
        upstream_decode,
        q,
        cache,
        table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_len=query_len,
        sm_scale=SM_SCALE,
        k_scale=torch.tensor([K_SCALE if kv_dtype == FP8 else 1.0], device=DEVICE),
        num_kv_splits=upstream_num_kv_splits(max(seq_lens), _sm_count()),
    )
    up_o, up_lse = unfused()
    err = ((o.double() - up_o.double()).norm() / up_o.double().norm()).item()
    assert err < o_norm_tol, f"relative difference {err:.3e}"
    torch.testing.assert_close(lse, up_lse.float(), rtol=2**-7, atol=lse_atol)


def test_cuda_graph_replay_follows_new_lengths(fused_verify):
    """Captured once at full capacity, replayed with other lengths and fewer
    valid requests: the launch geometry must not follow the data."""
    query_len, heads, capacity, longest = 4, 16, 4, 3000
    stored = [random_kv(longest, BF16, K_SCALE, DEVICE) for _ in range(capacity)]
    cache, table = paged_cache(stored, 64)
    q = _queries(capacity, query_len, heads)
    rows = capacity * query_len
    splits = fused_verify.choose_num_kv_splits(
        capacity, heads, query_len, longest, _sm_count()
    )
    seq_lens = torch.full((capacity,), longest, dtype=torch.int32, device=DEVICE)
    num_valid = torch.tensor([capacity], dtype=torch.int32, device=DEVICE)
    o = torch.empty(rows, heads, LATENT, dtype=BF16, device=DEVICE)
    lse = torch.empty(rows, heads, device=DEVICE)
    workspace = torch.empty(
        fused_verify.workspace_numel(rows, heads, splits), device=DEVICE
    )

    def call() -> None:
        fused_verify.fused_mla_verify_decode(
            q,
            cache,
            table,
            seq_lens,
            o,
            lse,
            workspace,
            query_len=query_len,
            sm_scale=SM_SCALE,
            num_kv_splits=splits,
            num_valid_reqs=num_valid,
        )

    call()  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()

    new_lens = [5, 2999, 130]
    seq_lens.copy_(torch.tensor([*new_lens, longest], dtype=torch.int32))
    num_valid.fill_(len(new_lens))
    o.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    valid_rows = len(new_lens) * query_len
    assert o[valid_rows:].isnan().all() and lse[valid_rows:].isnan().all()
    prefixes = [kv[:n] for kv, n in zip(stored, new_lens)]
    ref_o, ref_lse = _reference(q[:valid_rows], prefixes, query_len)
    _assert_matches(o[:valid_rows], lse[:valid_rows], ref_o, ref_lse)


def test_workspace_beyond_workspace_numel_is_untouched(fused_verify):
    query_len, heads, splits = 4, 16, 6
    seq_lens = [100, 4000]
    stored = [random_kv(n, BF16, K_SCALE, DEVICE) for n in seq_lens]
    cache, table = paged_cache(stored, 64)
    q = _queries(len(seq_lens), query_len, heads)
    rows = len(seq_lens) * query_len
    need = fused_verify.workspace_numel(rows, heads, splits)
    workspace = torch.full((need + 4096,), 12345.0, device=DEVICE)
    o = torch.empty(rows, heads, LATENT, dtype=BF16, device=DEVICE)
    lse = torch.empty(rows, heads, device=DEVICE)
    fused_verify.fused_mla_verify_decode(
        q,
        cache,
        table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        o,
        lse,
        workspace,
        query_len=query_len,
        sm_scale=SM_SCALE,
        num_kv_splits=splits,
    )
    assert (workspace[need:] == 12345.0).all()
    assert math.isfinite(lse.sum().item())
