# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The torch draft engine drafts what the documented DFlash/DSpark architecture
computes: checked against a float64 oracle written here as plain per-request,
per-row, per-head loops (explicit softmax over the attended keys)."""

import dataclasses
import math
from typing import Any

import pytest
import torch
from k3_devices import DEVICES

from vllm.k3_draft.engine import DraftLimits, ProposeBatch
from vllm.k3_draft.reference_engine import (
    DraftShape,
    ReferenceEngine,
    ReferenceModelConfig,
    TorchDraftEngine,
)

LIMITS = DraftLimits(
    max_requests=2,
    max_batch_size=2,
    max_speculative_tokens=3,
    max_context_tokens=64,
    max_model_len=256,
    block_size=4,
    window_size=8,
    prefix_cache_tokens=16,
)
WIDTH = 12
K = 3
# Request 0 sees a full window [6, 14); request 1's valid start 3 cuts into
# its window [-1, 7).
SLOTS, STARTS, ENDS, COUNTS, ANCHORS = [0, 1], [0, 3], [14, 7], [14, 4], [7, 20]


# Per-layer attention: the first layer slides over 5 positions, causally.
ATTENTION: dict[str, dict[str, Any]] = {
    "full": {},
    "sliding_causal": {"sliding_windows": (5, None), "causal_layers": (True, False)},
    "sinks": {"attention_sinks": True},
}


def tiny_shape(method: str, attention: str = "full") -> DraftShape:
    # GQA: 4 query heads over 2 KV heads.
    return DraftShape(
        method=method,
        vocab_size=64,
        context_width=WIDTH,
        hidden_size=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        intermediate_size=24,
        mask_token_id=63,
        markov_rank=3 if method == "dspark" else 0,
        **ATTENTION[attention],
    )


class TinyEngine(TorchDraftEngine):
    """``tiny_shape`` (GQA, which the reference config never has) with the
    reference draft's seeded random weights."""

    seed = 3
    host_weights = ReferenceEngine.host_weights


def context_rows() -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(sum(COUNTS), WIDTH, generator=generator).bfloat16()


# ------------------------------------------------------------------ oracle


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    total = 0.0
    for value in x.tolist():
        total += value * value
    return x / math.sqrt(total / len(x) + eps) * weight


def rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    half = len(x) // 2
    out = torch.zeros_like(x)
    for i in range(half):
        angle = position * theta ** (-i / half)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def heads(x: torch.Tensor, count: int, dim: int) -> list[torch.Tensor]:
    return [x[h * dim : (h + 1) * dim] for h in range(count)]


def oracle(
    shape: DraftShape, w: dict[str, torch.Tensor], rows: torch.Tensor, depth: int
) -> torch.Tensor:
    """Draft logits ``[requests, depth, V]`` in float64, one loop at a time."""
    eps, theta, dim = shape.rms_norm_eps, shape.rope_theta, shape.head_dim
    group = shape.num_heads // shape.num_kv_heads
    window = LIMITS.window_size
    dflash = shape.method == "dflash"
    out = []
    first_row = 0
    for r in range(len(SLOTS)):
        start, end, count = STARTS[r], ENDS[r], COUNTS[r]
        # Context: fc, hidden_norm, then per layer K (k_norm, RoPE) and V.
        ctx_k: list[dict[int, list[torch.Tensor]]]
        ctx_v: list[dict[int, list[torch.Tensor]]]
        ctx_k = [{} for _ in range(shape.num_layers)]
        ctx_v = [{} for _ in range(shape.num_layers)]
        for i in range(count):
            pos = end - count + i
            if not (end - window <= pos < end and pos >= start):
                continue
            combined = w["fc"] @ rows[first_row + i]
            x = rms(combined, w["hidden_norm"], eps)
            for layer in range(shape.num_layers):
                k = heads(w["wk"][layer] @ x, shape.num_kv_heads, dim)
                v = heads(w["wv"][layer] @ x, shape.num_kv_heads, dim)
                ctx_k[layer][pos] = [
                    rope(rms(kh, w["k_norm"][layer], eps), pos, theta) for kh in k
                ]
                ctx_v[layer][pos] = v
        first_row += count
        # Query block.
        n = depth + 1 if dflash else depth
        ids = [ANCHORS[r]] + [shape.mask_token_id] * (n - 1)
        xs = [w["embed"][t].clone() for t in ids]
        for layer in range(shape.num_layers):
            qs, ks, vs = [], [], []
            for j in range(n):
                h = rms(xs[j], w["input_norm"][layer], eps)
                q = heads(w["wq"][layer] @ h, shape.num_heads, dim)
                k = heads(w["wk"][layer] @ h, shape.num_kv_heads, dim)
                pos = end + j
                qs.append(
                    [rope(rms(qh, w["q_norm"][layer], eps), pos, theta) for qh in q]
                )
                ks.append(
                    [rope(rms(kh, w["k_norm"][layer], eps), pos, theta) for kh in k]
                )
                vs.append(heads(w["wv"][layer] @ h, shape.num_kv_heads, dim))
            sliding, causal = shape.layer_attention(layer)
            new_xs = []
            for j in range(n):
                attn = []
                for head in range(shape.num_heads):
                    kv_head = head // group
                    keys, values = [], []
                    for pos in sorted(ctx_k[layer]):
                        if sliding is None or pos > end + j - sliding:
                            keys.append(ctx_k[layer][pos][kv_head])
                            values.append(ctx_v[layer][pos][kv_head])
                    for jj in range(j + 1 if causal else n):
                        keys.append(ks[jj][kv_head])
                        values.append(vs[jj][kv_head])
                    scores = [float(qs[j][head] @ key) / math.sqrt(dim) for key in keys]
                    # A sink: a logit without a value.
                    sink = (
                        [float(w["sinks"][layer][head])]
                        if shape.attention_sinks
                        else []
                    )
                    top = max(scores + sink)
                    exps = [math.exp(s - top) for s in scores]
                    total = sum(exps) + sum(math.exp(s - top) for s in sink)
                    mixed = torch.zeros(dim, dtype=torch.float64)
                    for e, value in zip(exps, values):
                        mixed = mixed + e / total * value
                    attn.append(mixed)
                x = xs[j] + w["wo"][layer] @ torch.cat(attn)
                h = rms(x, w["post_norm"][layer], eps)
                gate = w["w_gate"][layer] @ h
                up = w["w_up"][layer] @ h
                x = x + w["w_down"][layer] @ (gate * torch.sigmoid(gate) * up)
                new_xs.append(x)
            xs = new_xs
        drafting = xs[1:] if dflash else xs
        logits = [w["lm_head"] @ rms(x, w["final_norm"], eps) for x in drafting]
        if not dflash:
            prev = ANCHORS[r]
            for step in range(depth):
                bias = w["markov_w2"] @ w["markov_w1"][prev]
                logits[step] = logits[step] + bias
                prev = int(torch.argmax(logits[step]))
        out.append(torch.stack(logits))
    return torch.stack(out)


# ------------------------------------------------------------------- tests


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_drafts_match_the_documented_architecture(method, attention):
    engine = TinyEngine(LIMITS, tiny_shape(method, attention), torch.device("cpu"))
    engine.load()
    rows = context_rows()
    positions = torch.cat([torch.arange(e - c, e) for e, c in zip(ENDS, COUNTS)])
    output = engine.propose(
        ProposeBatch(
            num_speculative_tokens=K,
            slots=SLOTS,
            starts=STARTS,
            ends=ENDS,
            anchor_token_ids=ANCHORS,
            counts=COUNTS,
            positions=positions,
            rows=rows,
            want_logits=True,
        )
    )
    weights = {name: value.double() for name, value in engine.w.items()}
    expected = oracle(engine.shape, weights, rows.double(), K)
    assert output.logits is not None
    scale = float(expected.abs().max())
    torch.testing.assert_close(
        output.logits.double(), expected, atol=1e-4 * scale, rtol=0
    )
    assert torch.equal(output.tokens, expected.argmax(-1))


@pytest.mark.parametrize(
    "attention, reason",
    [
        ({"sliding_windows": (5,)}, "sliding_windows must have one entry per layer"),
        ({"causal_layers": (True,) * 3}, "causal_layers must have one entry per layer"),
        ({"sliding_windows": (0, None)}, "a sliding window must be positive"),
    ],
)
def test_per_layer_attention_that_does_not_fit_the_layers_is_refused(attention, reason):
    with pytest.raises(ValueError, match=reason):
        dataclasses.replace(tiny_shape("dflash"), **attention)


@pytest.mark.parametrize(
    "attention",
    [
        {"attention_sinks": True},
        {"causal_layers": (True, True)},
        {"sliding_windows": (5, None)},
    ],
)
def test_a_latent_attention_draft_with_sinks_or_masks_is_refused(attention):
    shape = ReferenceModelConfig(method="dspark", latent_attention=True).shape()
    with pytest.raises(ValueError, match="attends full and non-causal"):
        dataclasses.replace(shape, **attention)


@pytest.mark.parametrize("device", DEVICES)
def test_block_rows_shifted_before_the_first_position_draft_finite_logits(device):
    """A causal block cut at the model length is aligned to end there, so its
    first rows sit before a request that starts at its anchor: they see no
    key. Torch's attention gives such a row zero, as vLLM's backends do, on
    CPU and CUDA alike; NaN there would spread to every row in the next
    layer."""
    engine = TinyEngine(
        LIMITS, tiny_shape("dflash", "sliding_causal"), torch.device(device)
    )
    engine.load()
    end = LIMITS.max_model_len - 2
    output = engine.propose(
        ProposeBatch(
            num_speculative_tokens=K,
            slots=[0],
            starts=[end],
            ends=[end],
            anchor_token_ids=[5],
            counts=[0],
            positions=torch.zeros(0, dtype=torch.int64),
            rows=torch.zeros(0, WIDTH, dtype=torch.bfloat16),
            want_logits=True,
        )
    )
    assert output.logits is not None
    assert output.logits.isfinite().all()
