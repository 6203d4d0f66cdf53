# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache specs of the layer-4 tests: every attention spec class that can
hold a draft, sharded (the target under DCP) or replicated (a DCP1 draft)."""

from collections.abc import Callable

import torch

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

DTYPE = torch.bfloat16
# A GQA draft layer (2 KV heads x 64) and an MLA latent (576): 8 KiB and
# 18 KiB pages at 16 tokens, so their page sizes never coincide by accident.
GQA = {"num_kv_heads": 2, "head_size": 64, "dtype": DTYPE}
LATENT = {"num_kv_heads": 1, "head_size": 576, "dtype": DTYPE}
WINDOW = 128


def full(block_size: int = 16, sharded: bool = True) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, dcp_sharded=sharded, **GQA)


def mla(block_size: int = 16, sharded: bool = True) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=block_size, dcp_sharded=sharded, **LATENT)


def sliding(block_size: int = 16, sharded: bool = True) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, dcp_sharded=sharded, sliding_window=WINDOW, **GQA
    )


def sliding_mla(block_size: int = 16, sharded: bool = True) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=block_size, dcp_sharded=sharded, sliding_window=WINDOW, **LATENT
    )


def rswa(block_size: int = 16, sharded: bool = True) -> RSWASpec:
    return RSWASpec(
        block_size=block_size, dcp_sharded=sharded, rswa_window=WINDOW, **GQA
    )


def sink(block_size: int = 16, sharded: bool = True) -> SinkFullAttentionSpec:
    return SinkFullAttentionSpec(
        block_size=block_size, dcp_sharded=sharded, sink_len=4, **GQA
    )


DRAFT_CAPABLE: dict[str, Callable[..., AttentionSpec]] = {
    "full": full,
    "mla": mla,
    "sliding": sliding,
    "sliding_mla": sliding_mla,
    "rswa": rswa,
    "sink": sink,
}
