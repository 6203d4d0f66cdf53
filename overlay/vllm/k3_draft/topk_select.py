# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exact top-k of bf16 rows on a GPU, by Triton (the draft server's top-k
logits frames).

``topk_rows(x, k)`` returns each row's ``k`` largest values of a contiguous
bf16 ``x [N, V]`` and their column ids (int32), in column order. Order: bf16
values as floats, NaN (any sign) above +inf as ``torch.topk`` ranks it, -0.0
just below +0.0; ties at the k-th value go to the smaller columns. The values
are ``x``'s own bits.

Two launches, no host synchronisation (CUDA-graph capturable). Stage 1, one
program per (row, chunk of ``CHUNK`` columns): the chunk's k largest, written
in column order; a row's k largest are among its chunks' (a value with fewer
than k larger ones in its row has fewer in its chunk). Stage 2, one program
per row: the same selection over the row's candidates. A selection finds the
k-th largest 16-bit key by a bitwise search (16 counts over the block), then
takes every larger key and the first equal ones, placed by one cumulative sum
that counts both. Callers use ``torch.topk`` where ``supports`` is false: k
above 64 (measured on the H200 at k = 16 and 64 faster than ``torch.topk``,
at 256 slower; ``docs/p2-draft-logits.md``), or more candidates per row than
one program takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per stage-1 program, the largest k served and the most candidates
# per row stage 2 takes.
CHUNK = 4096
MAX_K = 64
MAX_CANDIDATES = 16384


def supports(vocab_size: int, k: int) -> bool:
    """Whether ``topk_rows`` serves rows of ``vocab_size`` columns and ``k``."""
    return 1 <= k <= min(vocab_size, MAX_K) and (
        triton.cdiv(vocab_size, CHUNK) * k <= MAX_CANDIDATES
    )


@triton.jit
def _keys(x):
    """Sortable 16-bit keys (0..65535, as int32) of bf16 ``x``."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32)
    keys = (bits ^ ((bits >> 15) & 0x7FFF)) + 32768
    return tl.where((bits & 0x7FFF) > 0x7F80, 65535, keys)


@triton.jit
def _select(keys, K: tl.constexpr):
    """Where each of the K largest of ``keys`` goes among them, in column
    order (ties: the first ones), -1 for the others; -1 is padding and never
    taken while K others exist. At most 65,535 keys."""
    kth = 0
    for bit in tl.static_range(15, -1, -1):
        probe = kth | (1 << bit)
        count = tl.sum((keys >= probe).to(tl.int32), 0)
        kth = tl.where(count >= K, probe, kth)
    above = keys > kth
    equal = keys == kth
    room = K - tl.sum(above.to(tl.int32), 0)
    # One scan counts both: larger keys in the low 16 bits, equal ones above.
    seen = tl.cumsum(above.to(tl.int32) + (equal.to(tl.int32) << 16), 0)
    seen_equal = seen >> 16
    take = above | (equal & (seen_equal <= room))
    return tl.where(take, (seen & 0xFFFF) + tl.minimum(seen_equal, room) - 1, -1)


@triton.jit
def _chunk_stage(
    x_ptr,
    row_stride,
    num_cols,
    cand_keys_ptr,
    cand_cols_ptr,
    num_chunks,
    CHUNK: tl.constexpr,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < num_cols
    x = tl.load(x_ptr + row.to(tl.int64) * row_stride + cols, mask=valid, other=0.0)
    keys = tl.where(valid, _keys(x), -1)
    slot = _select(keys, K)
    base = (row * num_chunks + chunk) * K
    tl.store(cand_keys_ptr + base + slot, keys, mask=slot >= 0)
    tl.store(cand_cols_ptr + base + slot, cols, mask=slot >= 0)
    # A chunk with fewer than K columns takes them all and pads the rest.
    taken = tl.minimum(num_cols - chunk * CHUNK, K)
    rest = tl.arange(0, K_POW2)
    tl.store(
        cand_keys_ptr + base + rest,
        tl.full([K_POW2], -1, tl.int32),
        mask=(rest >= taken) & (rest < K),
    )


@triton.jit
def _row_stage(
    x_ptr,
    row_stride,
    cand_keys_ptr,
    cand_cols_ptr,
    num_cand,
    values_ptr,
    ids_ptr,
    CAND: tl.constexpr,
    K: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, CAND)
    present = offs < num_cand
    keys = tl.load(cand_keys_ptr + row * num_cand + offs, mask=present, other=-1)
    cols = tl.load(cand_cols_ptr + row * num_cand + offs, mask=present, other=0)
    slot = _select(keys, K)
    take = slot >= 0
    values = tl.load(x_ptr + row.to(tl.int64) * row_stride + cols, mask=take)
    tl.store(values_ptr + row * K + slot, values, mask=take)
    tl.store(ids_ptr + row * K + slot, cols, mask=take)


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of contiguous bf16 CUDA ``x [N, V]``
    and their int32 column ids, both ``[N, k]`` in column order (see the
    module docstring); ``ValueError`` unless ``supports(V, k)``."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError("topk_rows needs a contiguous bf16 [N, V] tensor")
    rows, cols = x.shape
    if not supports(cols, k):
        raise ValueError(f"topk_rows does not serve k={k} of {cols} columns")
    num_chunks = triton.cdiv(cols, CHUNK)
    cand_keys = torch.empty(rows, num_chunks * k, dtype=torch.int32, device=x.device)
    cand_cols = torch.empty_like(cand_keys)
    values = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    ids = torch.empty(rows, k, dtype=torch.int32, device=x.device)
    if rows == 0:
        return values, ids
    _chunk_stage[(rows, num_chunks)](
        x,
        x.stride(0),
        cols,
        cand_keys,
        cand_cols,
        num_chunks,
        CHUNK=CHUNK,
        K=k,
        K_POW2=triton.next_power_of_2(k),
        num_warps=4,
    )
    _row_stage[(rows,)](
        x,
        x.stride(0),
        cand_keys,
        cand_cols,
        num_chunks * k,
        values,
        ids,
        CAND=triton.next_power_of_2(num_chunks * k),
        K=k,
        num_warps=8,
    )
    return values, ids
