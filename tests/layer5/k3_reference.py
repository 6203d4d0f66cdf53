# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Inputs and a float64 reference for the fused MLA verification kernel.

KV is generated densely per request (global token order) and then paged into
a cache with randomly permuted pages; the reference works on the dense KV, so
it shares no indexing code with the kernel. Visibility is decided by brute
force: a token is visible to a row if its global position is below the row's
causal extent and the token's interleaved owner is the rank.
"""

import torch

LATENT = 512
HEAD_DIM = 576


def owner_rank(positions: torch.Tensor, dcp_size: int, cp_interleave: int):
    """DCP rank holding each global token position (interleaved ownership)."""
    return (positions // cp_interleave) % dcp_size


def visible_mask(
    seq_len: int,
    query_len: int,
    *,
    causal: bool = True,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    cp_interleave: int = 1,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """bool [query_len, seq_len]: row t sees global token p."""
    pos = torch.arange(seq_len, device=device)
    rows = torch.arange(query_len, device=device)
    extent = (
        seq_len - (query_len - 1 - rows) if causal else torch.full_like(rows, seq_len)
    )
    mask = pos[None, :] < extent[:, None]
    return mask & (owner_rank(pos, dcp_size, cp_interleave) == dcp_rank)[None, :]


def random_kv(
    n: int, dtype: torch.dtype, k_scale: float, device: torch.device | str
) -> torch.Tensor:
    """Stored KV values [n, 576] whose dequantised values are about N(0, 1)."""
    values = torch.randn(n, HEAD_DIM, device=device)
    if dtype == torch.float8_e4m3fn:
        return (values / k_scale).to(dtype)
    return values.to(dtype)


def dequant(stored: torch.Tensor, k_scale: float) -> torch.Tensor:
    """float64 value of stored KV (fp8 is scaled, 16-bit is exact)."""
    if stored.dtype == torch.float8_e4m3fn:
        return stored.double() * k_scale
    return stored.double()


def paged_cache(
    stored: list[torch.Tensor], page_size: int, max_pages: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page per-request KV into ``[num_blocks, page_size, 576]``.

    Pages are assigned in a random order. Every unused slot, and one spare
    page that every unused block-table entry points at, holds NaN: a read of
    a token outside the visible KV poisons the result.
    """
    device = stored[0].device
    dtype = stored[0].dtype
    pages_per_req = [-(-len(kv) // page_size) for kv in stored]
    width = max([1, *pages_per_req]) if max_pages is None else max_pages
    num_blocks = sum(pages_per_req) + 1
    cache = torch.full(
        (num_blocks, page_size, HEAD_DIM), float("nan"), device=device
    ).to(dtype)
    poison_page = num_blocks - 1
    order = torch.randperm(num_blocks - 1, device="cpu").tolist()
    table = torch.full((len(stored), width), poison_page, dtype=torch.int32)
    for b, kv in enumerate(stored):
        for j in range(pages_per_req[b]):
            page = order.pop()
            table[b, j] = page
            chunk = kv[j * page_size : (j + 1) * page_size]
            cache[page, : len(chunk)] = chunk
    return cache, table.to(device)


def reference_attention(
    q: torch.Tensor,
    kv: list[torch.Tensor],
    masks: list[torch.Tensor],
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of ``q`` [B*R, H, 576] over dense dequantised ``kv``.

    ``masks[b]`` is [R, len(kv[b])]. Returns o [B*R, H, 512] and the
    natural-log LSE [B*R, H]; rows that see nothing get 0 and -inf.
    """
    query_len = masks[0].shape[0]
    q64 = q.double()
    o = torch.zeros(
        q.shape[0], q.shape[1], LATENT, dtype=torch.float64, device=q.device
    )
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    for b, (kv_b, mask_b) in enumerate(zip(kv, masks)):
        rows = slice(b * query_len, (b + 1) * query_len)
        if kv_b.shape[0] == 0:
            continue
        scores = torch.einsum("rhd,nd->rhn", q64[rows], kv_b) * sm_scale
        scores = scores.masked_fill(~mask_b[:, None, :], float("-inf"))
        lse_b = torch.logsumexp(scores, dim=-1)
        seen = mask_b.any(dim=-1)
        probs = torch.exp(scores - lse_b[..., None]).nan_to_num(nan=0.0)
        o[rows] = torch.einsum("rhn,nd->rhd", probs, kv_b[:, :LATENT])
        lse[rows] = torch.where(seen[:, None], lse_b, float("-inf"))
    return o, lse
