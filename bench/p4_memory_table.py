# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draft KV memory under DCP, sharded vs replicated (layer 4), as markdown.

Every figure comes from vLLM's own sizing code on the installed stack (no GPU,
no model hub: a tiny local config.json stands in for the model):

* Table 1, one draft attention layer on one rank: tokens per block (block x
  shard count, the shard count being D when sharded and 1 when replicated),
  draft blocks per token, draft blocks per request at ``--max-model-len``
  (``max_num_blocks_per_req``) and its bytes (``max_memory_usage_bytes``).
* Table 2, the whole KV pool of one rank (``--pool-gib``): requests of
  ``--max-model-len`` tokens that fit (``get_max_concurrency_for_kv_cache_config``
  on the groups ``get_kv_cache_groups`` makes) for an MLA target alone and with
  its replicated draft, against the draft paying only its own pages.

Usage::

    PYTHONPATH=.work/site python bench/p4_memory_table.py [--max-model-len 131072]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from cli_types import positive_int

from vllm.config import DeviceConfig, ModelConfig, VllmConfig
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.kv_cache_utils import (
    get_max_concurrency_for_kv_cache_config,
    resolve_dcp_kv_block_size,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

DCP_SIZES = (1, 2, 4, 8)
GIB = 1 << 30


def make_config(model_dir: Path, max_model_len: int, dcp: int) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="bfloat16",
    )
    config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig(device="cpu")
    )
    config.parallel_config.decode_context_parallel_size = dcp
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def write_tiny_model(root: Path, max_model_len: int) -> None:
    (root / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "architectures": ["Qwen3ForCausalLM"],
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "num_hidden_layers": 2,
                "vocab_size": 1024,
                "max_position_embeddings": max_model_len,
                "rms_norm_eps": 1e-6,
                "torch_dtype": "bfloat16",
            }
        )
    )


def draft_spec(args: argparse.Namespace, sharded: bool) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=args.draft_block_size,
        num_kv_heads=args.draft_kv_heads,
        head_size=args.draft_head_size,
        dtype=torch.bfloat16,
        dcp_sharded=sharded,
    )


def per_layer_table(args: argparse.Namespace, model_dir: Path) -> list[str]:
    rows = [
        "| D | draft cache | tokens per block | draft blocks per token "
        "| draft blocks per request | draft KV per request (MiB) |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for dcp in DCP_SIZES:
        config = make_config(model_dir, args.max_model_len, dcp)
        for sharded in (True, False):
            spec = draft_spec(args, sharded)
            tokens_per_block = resolve_dcp_kv_block_size(spec, dcp)
            rows.append(
                f"| {dcp} | {'sharded' if sharded else 'replicated'} "
                f"| {tokens_per_block} | {Fraction(1, tokens_per_block)} "
                f"| {spec.max_num_blocks_per_req(config, args.max_model_len)} "
                f"| {spec.max_memory_usage_bytes(config) / (1 << 20):.2f} |"
            )
    return rows


def requests_that_fit(config: VllmConfig, specs: dict[str, Any], pool: int) -> float:
    config.cache_config.kv_cache_layout = None
    resolve_kv_cache_layout(config, [["LBHNC", "BLHNC"]], specs.values())
    groups = get_kv_cache_groups(config, dict(specs))
    kv_config = get_kv_cache_config_from_groups(config, groups, pool)
    return get_max_concurrency_for_kv_cache_config(config, kv_config)


def pool_table(args: argparse.Namespace, model_dir: Path) -> list[str]:
    rows = [
        "| D | target alone | target + replicated draft, as planned "
        "| target + draft at its own page cost | capacity lost to the pool |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    pool = args.pool_gib * GIB
    target = {
        f"target.{i}": MLAAttentionSpec(
            block_size=args.target_block_size,
            num_kv_heads=1,
            head_size=576,
            dtype=torch.bfloat16,
        )
        for i in range(args.target_layers)
    }
    for dcp in DCP_SIZES:
        config = make_config(model_dir, args.max_model_len, dcp)
        # Model runner V2 marks the draft replicated only when D > 1.
        draft = {
            f"draft.{i}": draft_spec(args, sharded=dcp == 1)
            for i in range(args.draft_layers)
        }
        alone = requests_that_fit(config, target, pool)
        planned = requests_that_fit(config, target | draft, pool)
        per_request = sum(
            spec.max_memory_usage_bytes(config) for spec in (target | draft).values()
        )
        own_pages = pool / per_request
        rows.append(
            f"| {dcp} | {alone:.2f} | {planned:.2f} | {own_pages:.2f} "
            f"| {1 - planned / own_pages:.0%} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-model-len", type=positive_int, default=131072)
    parser.add_argument("--draft-block-size", type=positive_int, default=16)
    parser.add_argument("--draft-kv-heads", type=positive_int, default=1)
    parser.add_argument("--draft-head-size", type=positive_int, default=128)
    parser.add_argument("--draft-layers", type=positive_int, default=1)
    parser.add_argument("--target-layers", type=positive_int, default=61)
    parser.add_argument("--target-block-size", type=positive_int, default=64)
    parser.add_argument("--pool-gib", type=positive_int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_tiny_model(model_dir, args.max_model_len)
        print(
            f"Draft layer: {args.draft_kv_heads} KV head(s) x {args.draft_head_size}"
            f" bf16 per rank, block {args.draft_block_size}; max_model_len "
            f"{args.max_model_len}.\n"
        )
        print("\n".join(per_layer_table(args, model_dir)))
        print(
            f"\nRequests of {args.max_model_len} tokens in a {args.pool_gib} GiB "
            f"pool per rank: {args.target_layers} MLA target layers (576 bf16, "
            f"block {args.target_block_size}) + {args.draft_layers} draft "
            "layer(s).\n"
        )
        print("\n".join(pool_table(args, model_dir)))


if __name__ == "__main__":
    main()
