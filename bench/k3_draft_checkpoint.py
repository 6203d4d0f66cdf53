# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Writes a Kimi-K3-shaped MLA DSpark draft (``K3DSparkModel``, upstream's
checkpoint names) with random weights, and a target checkpoint holding only
the embedding and LM head, for timing the production engine at the product's
geometry where no real checkpoint can be fetched.

The geometry is DeepSeek-V3's MLA (q-LoRA 1536, KV-LoRA 512, 128 NoPE + 64
RoPE dimensions per head, 128 value dimensions, SiLU MLP of 18,432) at
Kimi's 7,168 hidden size, 64 heads and 163,840-token vocabulary, reading 3
target layers (context width 3 x 7168); the layer count and the Markov rank
are flags. Weights are bf16, drawn with a standard deviation of 0.02 (norms
1).

Usage::

    python bench/k3_draft_checkpoint.py /tmp/k3 --num-layers 2
    # then /tmp/k3/draft and /tmp/k3/target
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from cli_types import positive_int
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layer1"))
from k3_mla_layout import is_norm, mla_draft_weight_shapes  # noqa: E402

HIDDEN = 7168
HEADS = 64
Q_LORA, KV_LORA = 1536, 512
NOPE, ROPE, VALUE = 128, 64, 128
INTERMEDIATE = 18432
VOCAB = 163840
TARGET_LAYER_IDS = [1, 30, 58]


def draft_tensors(
    num_layers: int, markov_rank: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """The draft's weights in upstream's names, bf16 on the CPU."""

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02
        return x.cpu()

    shapes = mla_draft_weight_shapes(draft_config(num_layers, markov_rank))
    return {
        name: torch.ones(shape, dtype=torch.bfloat16) if is_norm(name) else rand(*shape)
        for name, shape in shapes.items()
    }


def draft_config(num_layers: int, markov_rank: int) -> dict[str, object]:
    return {
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": num_layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "q_lora_rank": Q_LORA,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": VALUE,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "target_hidden_size": HIDDEN,
        "num_target_layers": len(TARGET_LAYER_IDS),
        "target_layer_ids": TARGET_LAYER_IDS,
        "markov_rank": markov_rank,
        "mask_token_id": VOCAB - 1,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "torch_dtype": "bfloat16",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="writes ROOT/draft and ROOT/target")
    parser.add_argument("--num-layers", type=positive_int, default=2)
    parser.add_argument("--markov-rank", type=positive_int, default=256)
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the random weights are drawn (default: cuda if present)",
    )
    args = parser.parse_args()
    draft, target = args.root / "draft", args.root / "target"
    for folder in (draft, target):
        if folder.exists():
            parser.error(f"{folder} exists: give an empty or new ROOT")
    device = torch.device(args.device)
    draft.mkdir(parents=True)
    save_file(
        draft_tensors(args.num_layers, args.markov_rank, device),
        draft / "model.safetensors",
    )
    config = draft_config(args.num_layers, args.markov_rank)
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    target.mkdir()
    heads = {
        name: (
            torch.randn(VOCAB, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02
        ).cpu()
        for name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    save_file(heads, target / "model.safetensors")
    print(f"wrote {draft} and {target}")


if __name__ == "__main__":
    main()
