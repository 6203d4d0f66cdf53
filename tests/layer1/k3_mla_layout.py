# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tensors of an MLA DSpark draft checkpoint (upstream's
``K3DSparkModel`` names) and their shapes, from its config.json fields.

Shared by the upstream comparison's checkpoints
(``test_production_engine_upstream_mla.py``) and
``bench/k3_draft_checkpoint.py``; imports nothing, so the benchmark can use it
where vllm is absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def mla_draft_weight_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every weight a ``k3_dspark`` draft of
    ``config`` holds (no draft heads, no confidence head), in a fixed order."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    v_dim, inter = config["v_head_dim"], config["intermediate_size"]
    vocab, rank = config["vocab_size"], config["markov_rank"]
    context = config["target_hidden_size"] * config["num_target_layers"]
    shapes: dict[str, tuple[int, ...]] = {
        "context_proj.weight": (hidden, context),
        "context_norm.weight": (hidden,),
        "final_norm.weight": (hidden,),
        "markov_head.markov_w1.weight": (vocab, rank),
        "markov_head.markov_w2.weight": (vocab, rank),
    }
    for i in range(config["num_hidden_layers"]):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        shapes |= {
            f"layers.{i}.input_layernorm.weight": (hidden,),
            f"layers.{i}.post_attention_layernorm.weight": (hidden,),
            f"{attn}.q_a_proj.weight": (q_lora, hidden),
            f"{attn}.q_a_layernorm.weight": (q_lora,),
            f"{attn}.q_b_proj.weight": (heads * (nope + rope), q_lora),
            f"{attn}.kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden),
            f"{attn}.kv_a_layernorm.weight": (kv_lora,),
            f"{attn}.kv_b_proj.weight": (heads * (nope + v_dim), kv_lora),
            f"{attn}.o_proj.weight": (hidden, heads * v_dim),
            f"{mlp}.gate_proj.weight": (inter, hidden),
            f"{mlp}.up_proj.weight": (inter, hidden),
            f"{mlp}.down_proj.weight": (hidden, inter),
        }
    return shapes


def is_norm(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is an RMSNorm weight."""
    return name.endswith("norm.weight")
