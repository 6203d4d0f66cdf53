# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused MLA decode attention for speculative verification blocks.

Verification runs ``query_len`` (K + 1) query rows per request against the same
paged latent KV cache. Upstream's decode kernel flattens them into separate
rows, so every row re-reads the whole KV. Here one program owns a
(request, head tile, KV split) triple, loads each KV tile once and feeds it to
every row and head of its tile: rows x heads are folded into the M dimension of
the tensor-core products. A second kernel merges the KV splits by their
log-sum-exp.

Two implementations of the split kernel compute the same thing: a Triton
kernel for every supported case, and on Hopper (sm_90) with 64 folded rows a
warp-specialised Gluon kernel: TMA copies into two buffers, one warpgroup for
the score product and softmax of a tile while two others run the P.V
product of the previous one.

Contracts (``fused_mla_verify_decode``):

- ``q``: ``[num_reqs * query_len, H, 576]`` (512 latent + 64 rope), bf16 or
  fp16; the rows of request ``b`` are ``b*query_len .. b*query_len+query_len-1``
  in token order.
- ``kv_cache``: ``[num_blocks, page_size, 576]``, the query dtype or fp8 e4m3
  with a scalar ``k_scale`` (dequantised value = stored value * k_scale).
- ``block_table``: ``[>= num_reqs, max_pages]`` int32, pages of the rank-local
  KV; ``seq_lens``: ``[num_reqs]`` int32, global KV length of each request
  including its ``query_len`` new tokens.
- Row ``t`` of a request sees the global prefix ``seq_len - (query_len-1-t)``
  when causal, ``seq_len`` otherwise. Under decode context parallelism (DCP
  size D, rank r, interleave I) the rank holds global token ``p`` iff
  ``(p // I) % D == r``, and the row's rank-local visible length is
  ``local_kv_len(L, D, r, I)``.
- Outputs: ``o`` ``[rows, H, 512]`` (any float dtype) and ``lse`` ``[rows, H]``
  float32, natural log. A row with no visible KV gets a zero output and
  ``lse = -inf`` (zero weight in a DCP merge); a NaN in the KV a row sees
  makes its output and LSE NaN. Requests at or beyond
  ``num_valid_reqs`` (a device scalar, for padded CUDA-graph batches) are
  skipped: their rows of ``o`` and ``lse`` are not written.
- The launch geometry depends only on tensor shapes, ``query_len`` and
  ``num_kv_splits``, never on tensor contents, so the call can be captured in a
  CUDA graph; ``workspace`` must then be preallocated with
  ``workspace_numel`` elements.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
MAX_QUERY_LEN = 16
# Requests of one call: the split kernels' grid has one program per request
# along its third dimension, which CUDA caps at 65535.
MAX_NUM_REQS = 65535
# Rows x heads that one program folds into the M dimension of its dots: the
# fp32 accumulator is BLOCK_M x 512, which must stay in registers.
_MAX_BLOCK_M = 64
_MIN_BLOCK_M = 16
# A split shorter than this spends more on its partial result than on its KV.
_MIN_TOKENS_PER_SPLIT = 256
_LOG2E = math.log2(math.e)
# Partial-output elements (splits x columns) a merge program adds up per
# step: 16 splits of all 512 columns. With more splits (only when few
# (row, head) pairs share the device) each pair's merge is spread over four
# programs of 128 columns.
_MERGE_CHUNK = 16 * 512
# Registers a thread of the Gluon kernel's P.V partition (setmaxnreg): its
# share of the 64 x 512 fp32 accumulator (two warpgroups) is 128 of them.
_PV_REGISTERS = gl.constexpr(168)
# Register layouts of the Gluon kernel's 4-warp loads and stores of shared
# memory: 128-column chunks of 64 rows (the whole 512 would take 128
# registers a thread), and the 64 rope columns.
_CHUNK_COLS = gl.constexpr(128)
_LD_CHUNK = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
_LD_ROPE = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
# Gluon renamed these between Triton 3.6 and 3.8 (getattr: neither name exists
# in both).
_cta_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier")  # noqa: B009
_async_load = getattr(async_copy, "async_load", None) or getattr(  # noqa: B009
    async_copy, "async_copy_global_to_shared"
)
_tma_load = getattr(tma, "async_load", None) or getattr(  # noqa: B009
    tma, "async_copy_global_to_shared"
)


@dataclass(frozen=True)
class VerifyKernelConfig:
    """Tiling of the split-KV kernel.

    ``heads_per_tile`` heads x ``query_len`` rows form the M dimension of one
    program; ``block_n`` KV tokens are loaded per step. ``use_gluon`` runs the
    Hopper kernel where it applies (``runs_gluon_kernel``; it keeps
    ``num_stages`` KV tiles in shared memory and runs its own three
    warpgroups), the Triton kernel with ``num_warps`` elsewhere.
    """

    heads_per_tile: int
    block_n: int
    num_warps: int
    num_stages: int
    use_gluon: bool = False


def local_kv_len(
    global_len: int, dcp_size: int, dcp_rank: int, cp_interleave: int
) -> int:
    """Tokens of a global prefix of ``global_len`` held by ``dcp_rank``.

    Ownership is interleaved in runs of ``cp_interleave`` tokens:
    ``floor(L/(D*I))*I + clamp(L mod (D*I) - r*I, 0, I)``.
    """
    span = dcp_size * cp_interleave
    rest = global_len % span - dcp_rank * cp_interleave
    return (global_len // span) * cp_interleave + min(max(rest, 0), cp_interleave)


def default_config(query_len: int, num_heads: int) -> VerifyKernelConfig:
    """Tiling used when the caller passes none (measured on H200, sm_90).

    64 folded rows: 64-token tiles, two buffers (query 72 KiB + 2 x 72 KiB of
    shared memory), the Gluon kernel where it applies, else the Triton kernel
    on 8 warps (the 64 x 512 fp32 accumulator is 128 registers a thread);
    this beat 16- and 32-token tiles with deeper buffering for bf16 and fp8.
    Fewer rows: 4 warps, 32-token tiles, three stages.
    """
    per_tile = min(num_heads, max(1, _MAX_BLOCK_M // query_len))
    num_tiles = triton.cdiv(num_heads, per_tile)
    per_tile = triton.cdiv(num_heads, num_tiles)
    if _block_m(query_len, per_tile) >= _MAX_BLOCK_M:
        return VerifyKernelConfig(
            per_tile, block_n=64, num_warps=8, num_stages=2, use_gluon=True
        )
    return VerifyKernelConfig(per_tile, block_n=32, num_warps=4, num_stages=3)


def num_head_tiles(num_heads: int, config: VerifyKernelConfig) -> int:
    """Programs per (request, split) along the head axis."""
    return triton.cdiv(num_heads, config.heads_per_tile)


def choose_num_kv_splits(
    num_reqs: int,
    num_heads: int,
    query_len: int,
    max_seq_len: int,
    sm_count: int,
) -> int:
    """KV splits that fill ``sm_count`` multiprocessors in about one wave.

    Pass capacities (largest batch, longest context the model allows) when the
    call is captured in a CUDA graph: the result must not follow the data.
    """
    config = default_config(query_len, num_heads)
    programs = num_reqs * num_head_tiles(num_heads, config)
    by_sms = max(1, sm_count // programs)
    by_len = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    return min(by_sms, by_len)


def workspace_numel(num_rows: int, num_heads: int, num_kv_splits: int) -> int:
    """float32 elements of the split-KV scratch: a 512-wide partial output and
    one LSE per (row, head, split)."""
    return num_rows * num_heads * num_kv_splits * (KV_LORA_RANK + 1)


def _block_m(query_len: int, heads_per_tile: int) -> int:
    return max(_MIN_BLOCK_M, triton.next_power_of_2(query_len * heads_per_tile))


def runs_gluon_kernel(
    kv_cache: torch.Tensor, q_dtype: torch.dtype, block_m: int, block_n: int = 64
) -> bool:
    """Whether a ``use_gluon`` tiling runs the Gluon kernel on this cache: a
    Hopper (sm_90) device, a KV cache in the query's dtype or fp8 e4m3 whose
    token rows TMA can address (``_tma_box_rows``), 64 folded rows."""
    return _gluon_box_rows(kv_cache, q_dtype, block_m, block_n) is not None


def _gluon_box_rows(
    kv_cache: torch.Tensor, q_dtype: torch.dtype, block_m: int, block_n: int
) -> int | None:
    """``_tma_box_rows`` where ``runs_gluon_kernel`` holds, else None."""
    if not (
        kv_cache.device.type == "cuda"
        # ROCm reports gfx90a/gfx94x as capability 9.x as well.
        and torch.version.hip is None
        and torch.cuda.get_device_capability(kv_cache.device)[0] == 9
        and kv_cache.dtype in (q_dtype, torch.float8_e4m3fn)
        and block_m == _MAX_BLOCK_M
    ):
        return None
    return _tma_box_rows(kv_cache, block_n)


@triton.jit
def _verify_split_kernel(
    q_ptr,
    kv_ptr,
    stride_kv_page,
    stride_kv_token,
    block_table_ptr,
    seq_lens_ptr,
    num_valid_ptr,
    k_scale_ptr,
    part_o_ptr,
    part_lse_ptr,
    sm_scale_log2,
    num_heads,
    dcp_size,
    dcp_rank,
    cp_interleave,
    stride_q_row,
    stride_q_head,
    stride_bt_req,
    QUERY_LEN: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_NUM_VALID: tl.constexpr,
    IS_FP8: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
):
    # Head tiles vary fastest so the tiles sharing a KV split run together and
    # read it from L2.
    head_tile = tl.program_id(0)
    split = tl.program_id(1)
    req = tl.program_id(2)
    num_splits = tl.num_programs(1)
    if HAS_NUM_VALID and req >= tl.load(num_valid_ptr):
        return

    # M index -> (query row t of the request, head h).
    offs_m = tl.arange(0, BLOCK_M)
    t = offs_m // HEADS_PER_TILE
    head = head_tile * HEADS_PER_TILE + offs_m % HEADS_PER_TILE
    valid = (t < QUERY_LEN) & (head < num_heads)
    row = req * QUERY_LEN + t

    # Visible rank-local KV length of every M row.
    seq_len = tl.load(seq_lens_ptr + req)
    glob = seq_len - (QUERY_LEN - 1 - t) if CAUSAL else seq_len + 0 * t
    glob = tl.maximum(glob, 0)
    span = dcp_size * cp_interleave
    rest = glob % span - dcp_rank * cp_interleave
    local = (glob // span) * cp_interleave + tl.minimum(
        tl.maximum(rest, 0), cp_interleave
    )
    local = tl.where(valid, local, 0)
    kv_len = tl.max(local, axis=0)

    # Split geometry: num_splits contiguous runs of whole BLOCK_N tiles.
    tiles_per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, kv_len)

    offs_l = tl.arange(0, LATENT)
    offs_r = tl.arange(0, ROPE)
    q_off = row.to(tl.int64) * stride_q_row + head * stride_q_head
    q_lat = tl.load(
        q_ptr + q_off[:, None] + offs_l[None, :], mask=valid[:, None], other=0.0
    )
    q_rope = tl.load(
        q_ptr + q_off[:, None] + LATENT + offs_r[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    k_scale = tl.load(k_scale_ptr).to(tl.float32) if IS_FP8 else 1.0
    qk_scale = sm_scale_log2 * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    # The page ids of the next tile are loaded one step ahead: with the KV load
    # no longer behind a load of the same iteration, the software pipeliner
    # keeps num_stages - 1 KV tiles in flight instead of one.
    offs_next = start + tl.arange(0, BLOCK_N)
    page_next = tl.load(bt_row + offs_next // PAGE_SIZE, mask=offs_next < end, other=0)
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_split = offs_n < end
        page = page_next
        offs_next = offs_n + BLOCK_N
        page_next = tl.load(
            bt_row + offs_next // PAGE_SIZE, mask=offs_next < end, other=0
        )
        tok = (
            page.to(tl.int64) * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_token
        )
        k_lat = tl.load(
            kv_ptr + tok[:, None] + offs_l[None, :], mask=in_split[:, None], other=0.0
        )
        k_rope = tl.load(
            kv_ptr + tok[:, None] + LATENT + offs_r[None, :],
            mask=in_split[:, None],
            other=0.0,
        )
        if IS_FP8:
            k_lat = k_lat.to(q_lat.dtype)
            k_rope = k_rope.to(q_lat.dtype)
        # Triton gives all 8 warps to M for a product that feeds another, so
        # with M = 64 both warpgroups compute this score tile; scoring one tile
        # ahead avoids that but measured slower (docs/p5-fused-verify-notes.md).
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_rope, tl.trans(k_rope), s)
        s = tl.where(offs_n[None, :] < local[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; subtract 0 instead so
        # exp2 gives 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None])
        m_i = m_new

    seen = l_i != 0.0
    inv = tl.where(seen, k_scale / l_i, 0.0)
    # Scores are in log2 units; ln(2) turns the LSE into natural log.
    lse = tl.where(seen, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))
    part = (row.to(tl.int64) * num_heads + head) * num_splits + split
    tl.store(part_lse_ptr + part, lse, mask=valid)
    tl.store(
        part_o_ptr + part[:, None] * LATENT + offs_l[None, :],
        acc * inv[:, None],
        mask=(valid & seen)[:, None],
    )


@triton.jit
def _verify_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    o_ptr,
    lse_ptr,
    num_valid_ptr,
    num_heads,
    num_splits,
    stride_o_row,
    stride_o_head,
    stride_lse_row,
    stride_lse_head,
    QUERY_LEN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    HAS_NUM_VALID: tl.constexpr,
    LATENT: tl.constexpr,
    COLS: tl.constexpr,
):
    """Merge the splits of (row, head) = program ids (0, 1), output columns
    ``COLS * program_id(2) ..``; the first column block writes the LSE."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    col0 = tl.program_id(2) * COLS
    if HAS_NUM_VALID and row // QUERY_LEN >= tl.load(num_valid_ptr):
        return

    base = (row.to(tl.int64) * num_heads + head) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(
        part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf")
    )
    m = tl.max(lse_s, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp(lse_s - m_safe), axis=0)

    offs_l = col0 + tl.arange(0, COLS)
    acc = tl.zeros([COLS], tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        offs_c = s0 + tl.arange(0, CHUNK_S)
        lse_c = tl.load(
            part_lse_ptr + base + offs_c,
            mask=offs_c < num_splits,
            other=float("-inf"),
        )
        # Splits with no visible KV left their partial output unwritten: read
        # it (not behind the LSE load) and drop it.
        part = tl.load(
            part_o_ptr + (base + offs_c)[:, None] * LATENT + offs_l[None, :],
            mask=(offs_c < num_splits)[:, None],
            other=0.0,
        )
        part = tl.where((lse_c > float("-inf"))[:, None], part, 0.0)
        acc += tl.sum(tl.exp(lse_c - m_safe)[:, None] * part, axis=0)

    seen = denom != 0.0
    inv = tl.where(seen, 1.0 / denom, 0.0)
    out_off = row.to(tl.int64) * stride_o_row + head * stride_o_head
    tl.store(o_ptr + out_off + offs_l, (acc * inv).to(o_ptr.dtype.element_ty))
    if col0 == 0:
        tl.store(
            lse_ptr + row.to(tl.int64) * stride_lse_row + head * stride_lse_head,
            tl.where(seen, m_safe + tl.log(denom), float("-inf")),
        )


@gluon.jit
def _gl_issue_tile(
    lat_desc,
    rope_desc,
    bt_row,
    first_page,
    n0,
    end,
    bar,
    lat_buf,
    rope_buf,
    BLOCK_N: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    LATENT: gl.constexpr,
):
    """Start the TMA copy of the tile at ``n0`` (nothing if ``n0 >= end``);
    ``bar`` completes when all of it has landed. ``first_page`` is the page of
    its first row (``_gl_first_page``, loaded ahead by the caller where that
    saves a wait). Rows at or past ``end`` hold whatever the cache holds there
    (page 0 where no page is mapped)."""
    ROWS: gl.constexpr = lat_desc.block_type.shape[0]
    live = n0 < end
    NBYTES: gl.constexpr = (BLOCK_N // ROWS) * (
        lat_desc.block_type.nbytes + rope_desc.block_type.nbytes
    )
    mbarrier.expect(bar, NBYTES, pred=live)
    for j in gl.static_range(BLOCK_N // ROWS):
        n = n0 + j * ROWS
        if j == 0:
            page = first_page
        else:
            page = gl.load(bt_row + n // PAGE_SIZE, mask=live & (n < end), other=0)
        row = page * PAGE_SIZE + n % PAGE_SIZE
        _tma_load(lat_desc, [row, 0], bar, lat_buf.slice(j * ROWS, ROWS), pred=live)
        _tma_load(
            rope_desc, [row, LATENT], bar, rope_buf.slice(j * ROWS, ROWS), pred=live
        )


@gluon.jit
def _gl_first_page(bt_row, n0, end, PAGE_SIZE: gl.constexpr):
    """The page of the tile at ``n0`` (0 if ``n0 >= end``)."""
    return gl.load(bt_row + n0 // PAGE_SIZE, mask=n0 < end, other=0)


@gluon.jit
def _gl_convert_in_place(lat8, rope8, lat16, rope16, n0, end, BLOCK_N: gl.constexpr):
    """Rewrite the fp8 tile at ``n0`` that landed in the first half of its
    fp16 buffer (``lat8``, ``rope8``) as fp16 over the whole buffer
    (``lat16``, ``rope16``), rows at tokens ``>= end`` zero. The whole tile
    is read before any of it is written; the result is fenced for the
    products. Selects only in a tile that has rows past the end: on every
    tile they cost as much as the rest of the conversion."""
    LD_LAT: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    a = lat8.load(LD_LAT)
    r = rope8.load(_LD_ROPE)
    _cta_barrier()
    if n0 + BLOCK_N > end:
        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD_LAT))
        lat16.store(gl.where(gl.expand_dims(rows < end, 1), a.to(gl.float16), 0.0))
        rows_r = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _LD_ROPE))
        rope16.store(gl.where(gl.expand_dims(rows_r < end, 1), r.to(gl.float16), 0.0))
    else:
        lat16.store(a.to(gl.float16))
        rope16.store(r.to(gl.float16))
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _gl_zero_rows_from(buf, first, n0, LD: gl.constexpr, BLOCK_N: gl.constexpr):
    """Zero the rows of a landed tile at tokens ``>= first``."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    x = buf.load(LD)
    buf.store(gl.where(gl.expand_dims(offs_n < first, 1), x, gl.zeros_like(x)))


@gluon.jit
def _gl_verify_split_kernel(
    q_ptr,
    kv_lat_desc,
    kv_rope_desc,
    block_table_ptr,
    seq_lens_ptr,
    num_valid_ptr,
    k_scale_ptr,
    part_o_ptr,
    part_lse_ptr,
    sm_scale_log2,
    num_heads,
    dcp_size,
    dcp_rank,
    cp_interleave,
    stride_q_row,
    stride_q_head,
    stride_bt_req,
    QUERY_LEN: gl.constexpr,
    HEADS_PER_TILE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_NUM_VALID: gl.constexpr,
    IS_FP8: gl.constexpr,
    LATENT: gl.constexpr,
    ROPE: gl.constexpr,
):
    """``_verify_split_kernel`` for sm_90, 64 rows, KV tiles by TMA, three
    warp-specialised warpgroups (launch with 4 warps: 12 run).

    The first (this kernel's own 4 warps) copies the queries (``cp.async``,
    issued before any other load) and the first ``NUM_BUF`` tiles, computes
    the score product of a tile (all 64 columns: the query is read once) and
    its softmax (rows within one warpgroup), and hands P and the rescale
    factors over in shared memory. The other two form one 8-warp partition,
    each warpgroup holding half of the 512 output columns, and run the P.V
    product, so the score product of tile i overlaps the P.V product of tile
    i-1. A tile's buffer is refilled by the P.V partition as soon as its
    product is done (up to ``NUM_BUF`` copies in flight). An fp8 tile lands
    in the first half of the fp16 buffer that the first partition rewrites
    it into, in place (exact: one conversion per pair of values, where bf16
    takes three); the products then run in fp16, the queries rewritten as
    fp16 once (``_gl_queries_to_fp16``) and P stored as fp16; ``k_scale``
    scales the scores and the output. mbarriers: ``full[b]`` (tile landed),
    ``empty[b]`` (P.V of the tile in buffer b done: P and the buffer are
    free), ``p_ready``, ``l_ready``.
    """
    BLOCK_M: gl.constexpr = 64
    DT: gl.constexpr = q_ptr.dtype.element_ty
    KV_DT: gl.constexpr = kv_lat_desc.dtype
    # The products' operand type.
    MMA_DT: gl.constexpr = gl.float16 if IS_FP8 else DT

    head_tile = gl.program_id(0)
    split = gl.program_id(1)
    req = gl.program_id(2)
    num_splits = gl.num_programs(1)
    if HAS_NUM_VALID and req >= gl.load(num_valid_ptr):
        return

    # The queries' copies first: nothing they need waits on another load.
    q_lat_s = gl.allocate_shared_memory(
        DT,
        [BLOCK_M, LATENT],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, LATENT], DT),
    )
    q_rope_s = gl.allocate_shared_memory(
        DT, [BLOCK_M, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE], DT)
    )
    for c in gl.static_range(LATENT // _CHUNK_COLS):
        _gl_copy_queries(
            q_lat_s.slice(c * _CHUNK_COLS, _CHUNK_COLS, dim=1),
            q_ptr,
            req,
            head_tile,
            num_heads,
            stride_q_row,
            stride_q_head,
            c * _CHUNK_COLS,
            QUERY_LEN,
            HEADS_PER_TILE,
            BLOCK_M,
            _CHUNK_COLS,
            _LD_CHUNK,
        )
    _gl_copy_queries(
        q_rope_s,
        q_ptr,
        req,
        head_tile,
        num_heads,
        stride_q_row,
        stride_q_head,
        LATENT,
        QUERY_LEN,
        HEADS_PER_TILE,
        BLOCK_M,
        ROPE,
        _LD_ROPE,
    )
    async_copy.commit_group()

    # Each row's visible rank-local length; the split's token range.
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    t = offs_m // HEADS_PER_TILE
    head = head_tile * HEADS_PER_TILE + offs_m % HEADS_PER_TILE
    valid = (t < QUERY_LEN) & (head < num_heads)
    seq_len = gl.load(seq_lens_ptr + req)
    glob = seq_len - (QUERY_LEN - 1 - t) if CAUSAL else seq_len + 0 * t
    glob = gl.maximum(glob, 0)
    span = dcp_size * cp_interleave
    rest = glob % span - dcp_rank * cp_interleave
    local = (glob // span) * cp_interleave + gl.minimum(
        gl.maximum(rest, 0), cp_interleave
    )
    local = gl.where(valid, local, 0)
    kv_len = gl.max(local, axis=0)
    tiles_per_split = gl.cdiv(gl.cdiv(kv_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = gl.minimum(start + tiles_per_split * BLOCK_N, kv_len)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)

    if IS_FP8:
        # Each fp8 tile lands in the fp16 buffer it is converted into, in
        # place (all of it read before any of it is written).
        k16_lat = gl.allocate_shared_memory(
            MMA_DT,
            [NUM_BUF, BLOCK_N, LATENT],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], MMA_DT),
        )
        k16_rope = gl.allocate_shared_memory(
            MMA_DT,
            [NUM_BUF, BLOCK_N, ROPE],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], MMA_DT),
        )
        # Each buffer's first BLOCK_N rows of the fp8 view: the tile lands
        # there.
        kv_lat_s = k16_lat._reinterpret(
            KV_DT, [NUM_BUF, 2 * BLOCK_N, LATENT], kv_lat_desc.layout
        )
        kv_rope_s = k16_rope._reinterpret(
            KV_DT, [NUM_BUF, 2 * BLOCK_N, ROPE], kv_rope_desc.layout
        )
    else:
        kv_lat_s = gl.allocate_shared_memory(
            KV_DT, [NUM_BUF, BLOCK_N, LATENT], kv_lat_desc.layout
        )
        kv_rope_s = gl.allocate_shared_memory(
            KV_DT, [NUM_BUF, BLOCK_N, ROPE], kv_rope_desc.layout
        )
        k16_lat = kv_lat_s
        k16_rope = kv_rope_s
    full = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_BUF):
        mbarrier.init(full.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(l_ready, count=1)
    p_s = gl.allocate_shared_memory(
        MMA_DT,
        [BLOCK_M, BLOCK_N],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], MMA_DT),
    )
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    alpha_s = gl.allocate_shared_memory(gl.float32, [BLOCK_M], FLAT)
    l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_M], FLAT)
    _cta_barrier()

    # Every buffer's first tile in flight, then wait for the queries.
    bt_row = block_table_ptr + req.to(gl.int64) * stride_bt_req
    for j in gl.static_range(NUM_BUF):
        _gl_issue_tile(
            kv_lat_desc,
            kv_rope_desc,
            bt_row,
            _gl_first_page(bt_row, start + j * BLOCK_N, end, PAGE_SIZE),
            start + j * BLOCK_N,
            end,
            full.index(j),
            kv_lat_s.index(j),
            kv_rope_s.index(j),
            BLOCK_N,
            PAGE_SIZE,
            LATENT,
        )
    async_copy.wait_group(0)
    k_scale = gl.load(k_scale_ptr).to(gl.float32) if IS_FP8 else 1.0
    qk_scale = sm_scale_log2 * k_scale
    if DT != MMA_DT:
        # Every thread's queries have landed before any is rewritten.
        _cta_barrier()
        qk_scale = qk_scale * _gl_queries_to_fp16(q_lat_s, q_rope_s, LATENT)
        q_lat_s = q_lat_s._reinterpret(MMA_DT, [BLOCK_M, LATENT], q_lat_s.layout)
        q_rope_s = q_rope_s._reinterpret(MMA_DT, [BLOCK_M, ROPE], q_rope_s.layout)
    fence_async_shared()
    _cta_barrier()

    part_base = (req * QUERY_LEN).to(gl.int64) * num_heads
    gl.warp_specialize(
        [
            (
                _gl_softmax_partition,
                (
                    q_lat_s,
                    q_rope_s,
                    kv_lat_s,
                    kv_rope_s,
                    k16_lat,
                    k16_rope,
                    p_s,
                    alpha_s,
                    l_s,
                    full,
                    empty,
                    p_ready,
                    l_ready,
                    local,
                    valid,
                    start,
                    end,
                    num_tiles,
                    qk_scale,
                    part_lse_ptr,
                    part_base,
                    num_heads,
                    head_tile,
                    split,
                    num_splits,
                    HEADS_PER_TILE,
                    BLOCK_N,
                    NUM_BUF,
                    IS_FP8,
                    LATENT,
                ),
            ),
            (
                _gl_pv_partition,
                (
                    kv_lat_desc,
                    kv_rope_desc,
                    bt_row,
                    full,
                    start,
                    end,
                    PAGE_SIZE,
                    kv_rope_s,
                    kv_lat_s,
                    k16_lat,
                    p_s,
                    alpha_s,
                    l_s,
                    empty,
                    p_ready,
                    l_ready,
                    num_tiles,
                    k_scale,
                    part_o_ptr,
                    part_base,
                    num_heads,
                    head_tile,
                    split,
                    num_splits,
                    QUERY_LEN,
                    HEADS_PER_TILE,
                    BLOCK_N,
                    NUM_BUF,
                    LATENT,
                ),
            ),
        ],
        [8],
        [_PV_REGISTERS],
    )


@gluon.jit
def _gl_finite_abs_max(x):
    """The largest finite magnitude in the 2-D tensor ``x`` (0 if none), as
    float32."""
    x = gl.abs(x.to(gl.float32))
    return gl.max(gl.max(gl.where(x < float("inf"), x, 0.0), 1), 0)


@gluon.jit
def _gl_queries_to_fp16(q_lat_s, q_rope_s, LATENT: gl.constexpr):
    """Rewrite the 16-bit queries in shared memory (one warpgroup, each
    thread its own elements) as fp16 values times ``2^-e``, with ``e`` such
    that the largest finite magnitude lands in [2^14, 2^15) (below 2^-112:
    scaled by 2^126), exact for every value down to 2^-24 of it (below
    that, fp16's subnormals round). Infinities and NaN stay what they are
    and do not set ``e``; rows past the tile's queries hold zeros
    (``_gl_copy_queries``). Returns ``2^e`` (1 when no finite value is
    normal: nothing is scaled)."""
    amax = _gl_finite_abs_max(q_rope_s.load(_LD_ROPE))
    for c in gl.static_range(LATENT // _CHUNK_COLS):
        part = q_lat_s.slice(c * _CHUNK_COLS, _CHUNK_COLS, dim=1)
        amax = gl.maximum(amax, _gl_finite_abs_max(part.load(_LD_CHUNK)))
    biased = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    e = gl.where(biased > 0, biased - (127 + 14), 0)
    # 2^-e stays a normal float32.
    e = gl.maximum(e, -126)
    down = ((127 - e) << 23).to(gl.float32, bitcast=True)
    lat16 = q_lat_s._reinterpret(gl.float16, q_lat_s.shape, q_lat_s.layout)
    for c in gl.static_range(LATENT // _CHUNK_COLS):
        part = q_lat_s.slice(c * _CHUNK_COLS, _CHUNK_COLS, dim=1)
        x = part.load(_LD_CHUNK).to(gl.float32) * down
        lat16.slice(c * _CHUNK_COLS, _CHUNK_COLS, dim=1).store(x.to(gl.float16))
    x = q_rope_s.load(_LD_ROPE).to(gl.float32) * down
    q_rope_s._reinterpret(gl.float16, q_rope_s.shape, q_rope_s.layout).store(
        x.to(gl.float16)
    )
    return ((127 + e) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _gl_softmax_partition(
    q_lat_s,
    q_rope_s,
    kv_lat_s,
    kv_rope_s,
    k16_lat,
    k16_rope,
    p_s,
    alpha_s,
    l_s,
    full,
    empty,
    p_ready,
    l_ready,
    local,
    valid,
    start,
    end,
    num_tiles,
    qk_scale,
    part_lse_ptr,
    part_base,
    num_heads,
    head_tile,
    split,
    num_splits,
    HEADS_PER_TILE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr,
    IS_FP8: gl.constexpr,
    LATENT: gl.constexpr,
):
    """Score products, softmax, and fp8 tiles' conversion (see the
    kernel)."""
    BLOCK_M: gl.constexpr = 64
    DT: gl.constexpr = p_s.dtype
    # fp16 P holds every weight times 2^15, so that weights down to 2^-39 of
    # a row's largest stay normal fp16 numbers (bf16 needs no such room);
    # the row sums carry the same factor, taken out of the LSE.
    P_LOG2: gl.constexpr = 15.0 if p_s.dtype == gl.float16 else 0.0
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW_S)
    for it in range(num_tiles):
        buf = it % NUM_BUF
        n0 = start + it * BLOCK_N
        mbarrier.wait(full.index(buf), (it // NUM_BUF) & 1)
        if IS_FP8:
            # The tile landed as fp8 in its fp16 buffer: rewritten as fp16,
            # rows past the end zero.
            _gl_convert_in_place(
                kv_lat_s.index(buf).slice(0, BLOCK_N),
                kv_rope_s.index(buf).slice(0, BLOCK_N),
                k16_lat.index(buf),
                k16_rope.index(buf),
                n0,
                end,
                BLOCK_N,
            )
        # The score product of tile it runs while the P.V products of tile
        # it-1 end.
        s_tok = warpgroup_mma(
            q_lat_s,
            k16_lat.index(buf).permute((1, 0)),
            gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L),
            use_acc=False,
            is_async=True,
        )
        s_tok = warpgroup_mma(
            q_rope_s, k16_rope.index(buf).permute((1, 0)), s_tok, is_async=True
        )
        if it > 0:
            # P is free once the P.V products of tile it-1 are done.
            prev = (it - 1) % NUM_BUF
            mbarrier.wait(empty.index(prev), ((it - 1) // NUM_BUF) & 1)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        if not IS_FP8 and n0 + BLOCK_N > end:
            # TMA copies whole rows: what the cache holds past the end (even
            # NaN) must not reach the P.V products.
            for c in gl.static_range(LATENT // _CHUNK_COLS):
                _gl_zero_rows_from(
                    k16_lat.index(buf).slice(c * _CHUNK_COLS, _CHUNK_COLS, dim=1),
                    end,
                    n0,
                    _LD_CHUNK,
                    BLOCK_N,
                )
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        s = gl.where(
            gl.expand_dims(offs_n, 0) < gl.expand_dims(local, 1),
            s * qk_scale,
            float("-inf"),
        )
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; subtract 0 instead.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        if P_LOG2 != 0.0:
            m_safe = m_safe - P_LOG2
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_s.store(p.to(DT))
        alpha_s.store(alpha)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(p_ready, count=1)

    seen = l_i != 0.0
    log2_l = gl.log2(l_i)
    if P_LOG2 != 0.0:
        log2_l = log2_l - P_LOG2
    # Scores are in log2 units; ln(2) turns the LSE into natural log.
    lse = gl.where(seen, (m_i + log2_l) * 0.6931471805599453, float("-inf"))
    offs_m = gl.arange(0, BLOCK_M, layout=ROW_S)
    t = offs_m // HEADS_PER_TILE
    head = head_tile * HEADS_PER_TILE + offs_m % HEADS_PER_TILE
    part = (part_base + t * num_heads + head) * num_splits + split
    gl.store(part_lse_ptr + part, lse, mask=valid)
    l_s.store(l_i)
    _cta_barrier()
    mbarrier.arrive(l_ready, count=1)


@gluon.jit
def _gl_pv_partition(
    kv_lat_desc,
    kv_rope_desc,
    bt_row,
    full,
    start,
    end,
    PAGE_SIZE: gl.constexpr,
    kv_rope_s,
    kv_lat_s,
    k16_lat,
    p_s,
    alpha_s,
    l_s,
    empty,
    p_ready,
    l_ready,
    num_tiles,
    k_scale,
    part_o_ptr,
    part_base,
    num_heads,
    head_tile,
    split,
    num_splits,
    QUERY_LEN: gl.constexpr,
    HEADS_PER_TILE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr,
    LATENT: gl.constexpr,
):
    """P.V products, the refill of the tiles' buffers and the partial
    output; each of the partition's two warpgroups holds half of the 512
    output columns (see the kernel)."""
    BLOCK_M: gl.constexpr = 64
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, LATENT // 2, 16]
    )
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    acc = gl.zeros([BLOCK_M, LATENT], gl.float32, O_L)
    for it in range(num_tiles):
        buf = it % NUM_BUF
        nxt = start + (it + NUM_BUF) * BLOCK_N
        # Loaded ahead: the copy of tile it + NUM_BUF starts right after
        # the product without waiting for the block table.
        page = _gl_first_page(bt_row, nxt, end, PAGE_SIZE)
        mbarrier.wait(p_ready, it & 1)
        acc = acc * gl.expand_dims(alpha_s.load(ROW_O), 1)
        acc = warpgroup_mma(p_s, k16_lat.index(buf), acc)
        _cta_barrier()
        # The buffer is free: its next tile's copy starts now.
        _gl_issue_tile(
            kv_lat_desc,
            kv_rope_desc,
            bt_row,
            page,
            nxt,
            end,
            full.index(buf),
            kv_lat_s.index(buf),
            kv_rope_s.index(buf),
            BLOCK_N,
            PAGE_SIZE,
            LATENT,
        )
        mbarrier.arrive(empty.index(buf), count=1)

    mbarrier.wait(l_ready, 0)
    l_i = l_s.load(ROW_O)
    seen = l_i != 0.0
    offs_m = gl.arange(0, BLOCK_M, layout=ROW_O)
    t = offs_m // HEADS_PER_TILE
    head = head_tile * HEADS_PER_TILE + offs_m % HEADS_PER_TILE
    written = (t < QUERY_LEN) & (head < num_heads) & seen
    inv = gl.where(seen, k_scale / l_i, 0.0)
    part = (part_base + t * num_heads + head) * num_splits + split
    offs_l = gl.arange(0, LATENT, layout=gl.SliceLayout(0, O_L))
    gl.store(
        part_o_ptr + gl.expand_dims(part, 1) * LATENT + gl.expand_dims(offs_l, 0),
        acc * gl.expand_dims(inv, 1),
        mask=gl.expand_dims(written, 1),
    )


@gluon.jit
def _gl_copy_queries(
    dst,
    q_ptr,
    req,
    head_tile,
    num_heads,
    stride_q_row,
    stride_q_head,
    col0,
    QUERY_LEN: gl.constexpr,
    HEADS_PER_TILE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    WIDTH: gl.constexpr,
    LD: gl.constexpr,
):
    """Start copying the tile's folded query rows, columns ``col0 .. col0 +
    WIDTH``, into ``dst``; rows past the tile's queries are not read but
    zero-filled (a masked ``cp.async`` copies no source bytes and fills its
    destination with zeros), which ``_gl_queries_to_fp16`` relies on."""
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
    t = offs_m // HEADS_PER_TILE
    head = head_tile * HEADS_PER_TILE + offs_m % HEADS_PER_TILE
    valid = (t < QUERY_LEN) & (head < num_heads)
    row_off = (req * QUERY_LEN + t).to(gl.int64) * stride_q_row + head * stride_q_head
    offs_c = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LD))
    _async_load(
        dst,
        q_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(offs_c, 0),
        mask=gl.expand_dims(valid, 1),
    )


def fused_mla_verify_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    workspace: torch.Tensor,
    *,
    query_len: int,
    sm_scale: float,
    num_kv_splits: int,
    k_scale: torch.Tensor | None = None,
    causal: bool = True,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    cp_interleave: int = 1,
    num_valid_reqs: torch.Tensor | None = None,
    config: VerifyKernelConfig | None = None,
) -> None:
    """Attention of ``query_len`` verify rows per request over paged MLA KV.

    Writes ``o`` and ``lse`` in place (see the module docstring for the
    layouts and the meaning of each argument). ``k_scale`` is required for an
    fp8 cache and ignored for a 16-bit one. Raises ``ValueError`` on a shape,
    dtype, device or argument mismatch; tensor contents are not inspected.
    """
    num_reqs = _validate(
        q,
        kv_cache,
        block_table,
        seq_lens,
        o,
        lse,
        workspace,
        query_len=query_len,
        sm_scale=sm_scale,
        num_kv_splits=num_kv_splits,
        k_scale=k_scale,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        cp_interleave=cp_interleave,
        num_valid_reqs=num_valid_reqs,
    )
    num_rows, num_heads = q.shape[0], q.shape[1]
    if num_rows == 0:
        return
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    cfg = config or default_config(query_len, num_heads)
    if cfg.heads_per_tile < 1 or query_len * cfg.heads_per_tile > _MAX_BLOCK_M:
        raise ValueError(
            f"config.heads_per_tile={cfg.heads_per_tile} must be >= 1 and fold "
            f"with query_len={query_len} into at most {_MAX_BLOCK_M} rows"
        )
    if cfg.block_n not in (16, 32, 64, 128) or cfg.num_stages < 1:
        raise ValueError(
            f"config.block_n must be 16, 32, 64 or 128 and num_stages >= 1, got "
            f"{cfg.block_n} and {cfg.num_stages}"
        )
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(
            f"config.num_warps must be 1..16, a power of two, got {cfg.num_warps}"
        )
    if cfg.use_gluon and cfg.block_n not in (32, 64):
        raise ValueError(f"the Gluon kernel needs block_n 32 or 64, got {cfg.block_n}")
    if cfg.use_gluon and not 2 <= cfg.num_stages <= 128 // cfg.block_n:
        # One buffer would wait for a tile it has not yet issued; more than
        # 128 tokens of buffers do not fit in shared memory beside the query.
        raise ValueError(
            f"the Gluon kernel needs 2..{128 // cfg.block_n} buffers of "
            f"{cfg.block_n} tokens, got num_stages={cfg.num_stages}"
        )
    parts = num_rows * num_heads * num_kv_splits
    part_o = workspace[: parts * KV_LORA_RANK]
    part_lse = workspace[parts * KV_LORA_RANK : parts * (KV_LORA_RANK + 1)]
    # Placeholders for pointer arguments the kernels do not read.
    num_valid_arg = seq_lens if num_valid_reqs is None else num_valid_reqs
    k_scale_arg = k_scale if is_fp8 else workspace

    grid = (num_head_tiles(num_heads, cfg), num_kv_splits, num_reqs)
    block_m = _block_m(query_len, cfg.heads_per_tile)
    # The two split kernels take the same arguments but how they address the
    # KV cache (pointer and strides, or TMA descriptors) and their tilings.
    args = (
        block_table,
        seq_lens,
        num_valid_arg,
        k_scale_arg,
        part_o,
        part_lse,
        sm_scale * _LOG2E,
        num_heads,
        dcp_size,
        dcp_rank,
        cp_interleave,
        q.stride(0),
        q.stride(1),
        block_table.stride(0),
    )
    constants = {
        "QUERY_LEN": query_len,
        "HEADS_PER_TILE": cfg.heads_per_tile,
        "BLOCK_N": cfg.block_n,
        "PAGE_SIZE": kv_cache.shape[1],
        "CAUSAL": causal,
        "HAS_NUM_VALID": num_valid_reqs is not None,
        "IS_FP8": is_fp8,
        "LATENT": KV_LORA_RANK,
        "ROPE": ROPE_DIM,
    }
    box_rows = (
        _gluon_box_rows(kv_cache, q.dtype, block_m, cfg.block_n)
        if cfg.use_gluon
        else None
    )
    if box_rows is not None:
        _gl_verify_split_kernel[grid](
            q,
            *_kv_descriptors(kv_cache, box_rows),
            *args,
            **constants,
            NUM_BUF=cfg.num_stages,
            num_warps=4,
        )
    else:
        _verify_split_kernel[grid](
            q,
            kv_cache,
            kv_cache.stride(0),
            kv_cache.stride(1),
            *args,
            **constants,
            BLOCK_M=block_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    block_s = triton.next_power_of_2(num_kv_splits)
    cols = KV_LORA_RANK if block_s * KV_LORA_RANK <= _MERGE_CHUNK else 128
    _verify_merge_kernel[(num_rows, num_heads, KV_LORA_RANK // cols)](
        part_o,
        part_lse,
        o,
        lse,
        num_valid_arg,
        num_heads,
        num_kv_splits,
        o.stride(0),
        o.stride(1),
        lse.stride(0),
        lse.stride(1),
        QUERY_LEN=query_len,
        BLOCK_S=block_s,
        CHUNK_S=min(block_s, _MERGE_CHUNK // cols),
        HAS_NUM_VALID=num_valid_reqs is not None,
        LATENT=KV_LORA_RANK,
        COLS=cols,
        num_warps=4,
    )


_GL_DTYPES = {
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float8_e4m3fn: gl.float8e4nv,
}


def _tma_box_rows(kv_cache: torch.Tensor, block_n: int) -> int | None:
    """Token rows of one TMA copy of a ``block_n``-token tile (a tile, or a
    page when pages are shorter), or None when TMA cannot address the cache:
    pages that neither hold whole tiles nor tile them by a power of two of at
    least 8 tokens, pages not evenly strided, unaligned rows or base, more
    than 2^31 token rows."""
    num_blocks, page_size, _ = kv_cache.shape
    rows = min(block_n, page_size)
    token_stride = kv_cache.stride(1)
    if (
        rows < 8
        or rows & (rows - 1)
        or max(block_n, page_size) % rows
        or (num_blocks > 1 and kv_cache.stride(0) != page_size * token_stride)
        or token_stride * kv_cache.element_size() % 16
        or kv_cache.data_ptr() % 16
        or num_blocks * page_size >= 2**31
    ):
        return None
    return rows


def _kv_descriptors(
    kv_cache: torch.Tensor, rows: int
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the latent and the rope columns of the cache's token
    rows, ``rows`` (``_tma_box_rows``) a copy."""
    num_blocks, page_size, width = kv_cache.shape
    dtype = _GL_DTYPES[kv_cache.dtype]
    lat, rope = (
        TensorDescriptor(
            kv_cache,
            [num_blocks * page_size, width],
            [kv_cache.stride(1), 1],
            [rows, cols],
            gl.NVMMASharedLayout.get_default_for([rows, cols], dtype),
        )
        for cols in (KV_LORA_RANK, ROPE_DIM)
    )
    return lat, rope


def _validate(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    workspace: torch.Tensor,
    *,
    query_len: int,
    sm_scale: float,
    num_kv_splits: int,
    k_scale: torch.Tensor | None,
    dcp_size: int,
    dcp_rank: int,
    cp_interleave: int,
    num_valid_reqs: torch.Tensor | None,
) -> int:
    """Check every argument; return the number of requests."""
    if not 1 <= query_len <= MAX_QUERY_LEN:
        raise ValueError(f"query_len must be in 1..{MAX_QUERY_LEN}, got {query_len}")
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [rows, heads, {HEAD_DIM}], got {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    num_rows, num_heads = q.shape[0], q.shape[1]
    if num_heads < 1:
        raise ValueError("q must have at least one head")
    if (
        seq_lens.dim() != 1
        or seq_lens.dtype != torch.int32
        or not seq_lens.is_contiguous()
    ):
        raise ValueError(
            f"seq_lens must be contiguous 1-D int32, got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)} strides {seq_lens.stride()}"
        )
    num_reqs = seq_lens.shape[0]
    if num_reqs > MAX_NUM_REQS:
        raise ValueError(f"{num_reqs} requests in one call, at most {MAX_NUM_REQS}")
    if num_rows != num_reqs * query_len:
        raise ValueError(
            f"q has {num_rows} rows, expected num_reqs * query_len = "
            f"{num_reqs} * {query_len}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[2] != HEAD_DIM:
        raise ValueError(
            f"kv_cache must be [num_blocks, page_size, {HEAD_DIM}], "
            f"got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} must match q ({q.dtype}) "
            "or be float8_e4m3fn"
        )
    if kv_cache.stride(2) != 1 or kv_cache.shape[1] < 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    if kv_cache.dtype == torch.float8_e4m3fn and (
        k_scale is None or k_scale.numel() != 1 or k_scale.dtype != torch.float32
    ):
        raise ValueError("an fp8 kv_cache needs k_scale, a 1-element float32 tensor")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table must be 2-D int32, got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    if block_table.shape[0] < num_reqs or block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must have >= {num_reqs} rows and contiguous columns"
        )
    if o.shape != (num_rows, num_heads, KV_LORA_RANK) or o.stride(2) != 1:
        raise ValueError(
            f"o must be [{num_rows}, {num_heads}, {KV_LORA_RANK}] contiguous in "
            f"its last dimension, got {tuple(o.shape)}"
        )
    if not o.dtype.is_floating_point:
        raise ValueError(f"o must be a floating dtype, got {o.dtype}")
    if lse.shape != (num_rows, num_heads) or lse.dtype != torch.float32:
        raise ValueError(
            f"lse must be float32 [{num_rows}, {num_heads}], "
            f"got {lse.dtype} {tuple(lse.shape)}"
        )
    if not 1 <= num_kv_splits <= 1024:
        raise ValueError(f"num_kv_splits must be in 1..1024, got {num_kv_splits}")
    need = workspace_numel(num_rows, num_heads, num_kv_splits)
    if (
        workspace.dtype != torch.float32
        or not workspace.is_contiguous()
        or workspace.dim() != 1
        or workspace.numel() < need
    ):
        raise ValueError(
            f"workspace must be a contiguous 1-D float32 tensor of >= {need} "
            f"elements, got {workspace.dtype} {tuple(workspace.shape)}"
        )
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale}")
    if dcp_size < 1 or not 0 <= dcp_rank < dcp_size or cp_interleave < 1:
        raise ValueError(
            f"need dcp_size >= 1, 0 <= dcp_rank < dcp_size, cp_interleave >= 1; "
            f"got {dcp_size}, {dcp_rank}, {cp_interleave}"
        )
    if num_valid_reqs is not None and (
        num_valid_reqs.numel() != 1 or num_valid_reqs.dtype != torch.int32
    ):
        raise ValueError("num_valid_reqs must be a 1-element int32 tensor")
    tensors = [q, kv_cache, block_table, seq_lens, o, lse, workspace]
    if kv_cache.dtype == torch.float8_e4m3fn and k_scale is not None:
        tensors.append(k_scale)
    if num_valid_reqs is not None:
        tensors.append(num_valid_reqs)
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(
            f"all tensors must be on one device, got {sorted(map(str, devices))}"
        )
    return num_reqs
