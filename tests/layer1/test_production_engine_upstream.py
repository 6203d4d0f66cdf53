# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The production engine drafts what upstream's own DFlash/DSpark model code
computes for the same checkpoint.

Upstream's ``DFlashQwen3ForCausalLM`` / ``Qwen3DSparkForCausalLM`` are built
on CPU from a real ``VllmConfig`` of the tiny checkpoints and loaded through
their own ``load_weights``; the target's embedding and LM head are shared
into them as upstream's speculators do. Every layer runs its native torch
implementation (``custom_ops=["none"]``); what needs a GPU is replaced by
its contract: the two fused ops of ``precompute_and_store_context_kv``
(RMSNorm, with one weight row per layer for the grouped K norm, and in-place
RoPE) by upstream's native implementations, and the attention backend by
the attention it computes for one request's query block over the context K/V
stored by ``precompute_and_store_context_kv`` and the block's own K/V, with
FlashAttention's masks and sinks (``OneRequestAttention``). A rebase that
changes upstream's draft math fails here.
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from k3_devices import DEVICES
from safetensors.torch import save_file
from toy_target import init_single_rank_world

from vllm.k3_draft.engine import DraftLimits, ProposeBatch, ProposeOutput
from vllm.k3_draft.production_engine import ProductionEngine

# Up to 4 requests a batch: with CUDA graphs, a batch of 3 runs padded to 4.
LIMITS = DraftLimits(4, 4, 3, 256, 4096, 16, 32, 64)
K = 3
TARGET_HIDDEN = 16
AUX_LAYERS = [1, 3, 5]
VOCAB = 256
MASK_TOKEN = VOCAB - 1
DRAFT_VOCAB = 96
# GQA (4 query heads over 2 KV heads), two layers.
DRAFT = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
}


# Checkpoint variants upstream serves (config keys; "mask_embedding" writes
# mask_embedding.pt).
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logit_scale": {"logit_scale": 0.7},
    "value_scale": {"dflash_config": {"attention_value_scale": 1.7}},
    "interleaved_rope": {"is_neox_style": False},
    # With a value scale: it scales V's bias too.
    "attention_bias": {
        "attention_bias": True,
        "dflash_config": {"attention_value_scale": 1.3},
    },
    "mask_embedding": {"mask_embedding": True},
    # The drafting mask token named only as pard_token: the model has no
    # mask_token_id of its own, and upstream does not read the file.
    "mask_embedding_unused": {"mask_embedding": True, "pard_token": MASK_TOKEN},
    "partial_rotary": {"partial_rotary_factor": 0.5},
    # RoPE scaling, as configs write it (transformers standardises it).
    "linear_rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    # Upstream's static NTK scaling changes the base only when trained on
    # fewer positions than the config's maximum.
    "dynamic_rope": {
        "rope_scaling": {
            "rope_type": "dynamic",
            "factor": 2.0,
            "max_trained_positions": 1024,
        }
    },
    "yarn_rope": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
    },
    # Drafts over 96 ids, mapped (out of order) onto vocabulary ids by d2t;
    # the draft ships its LM head.
    "reduced_vocab": {"draft_vocab_size": DRAFT_VOCAB},
    # DSpark's Markov bias on each position's 8 best base logits (DFlash
    # ignores the key, as upstream does).
    "draft_topk": {"dspark_draft_topk": 8},
    # Per-layer attention as upstream resolves it: the first layer slides
    # (window 10, shorter than most contexts here) and, by its layer type,
    # attends causally; the second is full and non-causal.
    "mixed_layers": {
        "layer_types": ["sliding_attention", "full_attention"],
        "use_sliding_window": True,
        "sliding_window": 10,
    },
    # DFlash's switch: every layer slides at its own window, non-causal.
    "swa_every_layer": {"dflash_config": {"use_swa": True, "swa_window_size": 12}},
    "causal": {"dflash_config": {"causal": True}},
    # A learned sink logit per head and layer ("sinks" writes the weights).
    "sinks": {"dflash_config": {"attention_sink_bias": True}, "sinks": True},
    "llama3_rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
    },
}


def write_target(target: Path, rand: Callable[..., torch.Tensor], hidden: int) -> None:
    """The target checkpoint the drafts share their embedding and LM head
    with (bf16), and its config.json; ``rand(*shape, scale=)`` draws the
    weights."""
    target.mkdir()
    save_file(
        {
            "model.embed_tokens.weight": rand(VOCAB, hidden, scale=1.0).bfloat16(),
            "lm_head.weight": rand(VOCAB, hidden).bfloat16(),
        },
        target / "model.safetensors",
    )
    target_config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": TARGET_HIDDEN,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 32,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }
    (target / "config.json").write_text(json.dumps(target_config))


def write_checkpoints(root: Path, method: str, variant: str) -> tuple[Path, Path]:
    """A draft with random weights in upstream's names and a target holding
    the embedding and LM head (bf16), both with their config.json;
    ``variant`` names an entry of ``VARIANTS``."""
    gen = torch.Generator().manual_seed(11)
    hidden, layers = DRAFT["hidden_size"], DRAFT["num_hidden_layers"]
    q_size = DRAFT["num_attention_heads"] * DRAFT["head_dim"]
    kv_size = DRAFT["num_key_value_heads"] * DRAFT["head_dim"]
    inter = DRAFT["intermediate_size"]

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(size: int) -> torch.Tensor:
        return 1 + rand(size, scale=0.1)

    tensors = {
        "fc.weight": rand(hidden, TARGET_HIDDEN * len(AUX_LAYERS)),
        "hidden_norm.weight": norm(hidden),
        "norm.weight": norm(hidden),
    }
    for i in range(layers):
        tensors |= {
            f"layers.{i}.input_layernorm.weight": norm(hidden),
            f"layers.{i}.post_attention_layernorm.weight": norm(hidden),
            f"layers.{i}.self_attn.q_proj.weight": rand(q_size, hidden),
            f"layers.{i}.self_attn.k_proj.weight": rand(kv_size, hidden),
            f"layers.{i}.self_attn.v_proj.weight": rand(kv_size, hidden),
            f"layers.{i}.self_attn.o_proj.weight": rand(hidden, q_size),
            f"layers.{i}.self_attn.q_norm.weight": norm(DRAFT["head_dim"]),
            f"layers.{i}.self_attn.k_norm.weight": norm(DRAFT["head_dim"]),
            f"layers.{i}.mlp.gate_proj.weight": rand(inter, hidden),
            f"layers.{i}.mlp.up_proj.weight": rand(inter, hidden),
            f"layers.{i}.mlp.down_proj.weight": rand(hidden, inter),
        }
    overrides = dict(VARIANTS[variant])
    # The rows the LM head and the Markov bias score.
    draft_vocab = overrides.get("draft_vocab_size", VOCAB)
    if draft_vocab < VOCAB:
        tensors["lm_head.weight"] = rand(draft_vocab, hidden)
        ids = torch.randperm(VOCAB, generator=gen)[:draft_vocab]
        tensors["d2t"] = ids - torch.arange(draft_vocab)
    config: dict[str, Any] = {
        "model_type": "qwen3",
        **DRAFT,
        "vocab_size": VOCAB,
        "target_hidden_size": TARGET_HIDDEN,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
    }
    if method == "dflash":
        config["architectures"] = ["DFlashDraftModel"]
        config["dflash_config"] = {
            "mask_token_id": MASK_TOKEN,
            "target_layer_ids": [i - 1 for i in AUX_LAYERS],
        }
    else:
        config["architectures"] = ["Qwen3DSparkModel"]
        config["target_layer_ids"] = [i - 1 for i in AUX_LAYERS]
        config["mask_token_id"] = MASK_TOKEN
        config["markov_rank"] = 8
        tensors["markov_head.markov_w1.weight"] = rand(VOCAB, 8)
        tensors["markov_head.markov_w2.weight"] = rand(draft_vocab, 8)
    if overrides.pop("sinks", False):
        for i in range(layers):
            tensors[f"layers.{i}.self_attn.attention_sink_bias"] = rand(
                DRAFT["num_attention_heads"], scale=2.0
            )
    if overrides.get("attention_bias"):
        for i in range(layers):
            for proj, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                tensors[f"layers.{i}.self_attn.{proj}_proj.bias"] = rand(size)
            tensors[f"layers.{i}.self_attn.o_proj.bias"] = rand(hidden)
    if "dflash_config" in overrides:
        config["dflash_config"] = {
            **config.get("dflash_config", {}),
            **overrides.pop("dflash_config"),
        }
    draft, target = root / "draft", root / "target"
    draft.mkdir()
    if overrides.pop("mask_embedding", False):
        # The dict form upstream accepts (DSpark ignores the file).
        embedding = {"embedding": rand(hidden, scale=1.0), "mask_token_id": MASK_TOKEN}
        torch.save(embedding, draft / "mask_embedding.pt")
    if "pard_token" in overrides:
        config.get("dflash_config", {}).pop("mask_token_id", None)
        config.pop("mask_token_id", None)
    config |= overrides
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, draft / "model.safetensors"
    )
    (draft / "config.json").write_text(json.dumps(config))
    write_target(target, rand, hidden)
    return draft, target


class OneRequestAttention(torch.nn.Module):
    """Stands in for ``Attention``: keeps the context K/V that
    ``precompute_and_store_context_kv`` writes (slot = position of one
    request) and attends a query block to it and to itself, the block's keys
    cut at ``query_keys`` as the backend cuts the sequence at its
    ``seq_lens``. Masks and sinks as FlashAttention applies them: a query at
    position p sees keys up to p when ``causal`` (which the speculator's
    metadata carries; set from the layer), with a sliding window W only keys
    above p - W (and, non-causal, below p + W: its symmetric window), and
    a head's sink logit joins its softmax's denominator."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        per_layer_sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        **_: object,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = per_layer_sliding_window
        self.sinks = sinks
        self.causal = False
        self.kv_cache = None
        self.impl = SimpleNamespace(do_kv_cache_update=self._store)
        self.context: tuple[torch.Tensor, torch.Tensor] | None = None
        self.query_keys: int | None = None

    def _store(self, layer, key, value, kv_cache, slot_mapping) -> None:
        assert slot_mapping.cpu().tolist() == list(range(len(slot_mapping)))
        self.context = (key.clone(), value.clone())

    def forward(self, q, k, v):
        assert self.context is not None
        tokens = q.shape[0]
        heads = (tokens, self.num_kv_heads, self.head_size)
        keys = torch.cat((self.context[0], k.view(heads)[: self.query_keys]))
        values = torch.cat((self.context[1], v.view(heads)[: self.query_keys]))
        group = self.num_heads // self.num_kv_heads
        scores = (
            torch.einsum(
                "qhd,khd->hqk",
                q.view(tokens, self.num_heads, self.head_size),
                keys.repeat_interleave(group, 1),
            )
            * self.scale
        )
        # Positions relative to the context's first: its rows, then the block.
        # FlashAttention aligns queries bottom-right: row i at key index
        # seqlen_k - seqlen_q + i (seqlen_k cut at the model length).
        query_pos = keys.shape[0] - tokens + torch.arange(tokens)[:, None]
        key_pos = torch.arange(keys.shape[0])[None, :]
        hidden = torch.zeros(tokens, keys.shape[0], dtype=torch.bool)
        if self.causal:
            hidden |= key_pos > query_pos
        if self.sliding_window is not None:
            hidden |= key_pos <= query_pos - self.sliding_window
            if not self.causal:
                hidden |= key_pos >= query_pos + self.sliding_window
        scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.to(scores.dtype)[:, None, None].expand(-1, tokens, 1)
            weights = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        # A row that sees no key gets a zero output.
        weights = weights.masked_fill(hidden.all(-1).to(weights.device)[:, None], 0.0)
        out = torch.einsum("hqk,khd->qhd", weights, values.repeat_interleave(group, 1))
        return out.reshape(tokens, -1)


def _rms_norm(out, x, weight, eps) -> None:
    """``ops.rms_norm``: a 2-D weight holds one row per outermost index."""
    from vllm import ir

    native = ir.ops.rms_norm.impls["native"].impl_fn
    if weight.dim() == 1:
        out.copy_(native(x, weight, eps))
    else:
        for i in range(weight.shape[0]):
            out[i].copy_(native(x[i], weight[i], eps))


def _rotary_embedding(positions, query, key, head_size, cache, is_neox) -> None:
    """``ops.rotary_embedding``: in place, rotating the cache's width of each
    head."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    q, k = RotaryEmbedding.forward_static(
        positions, query, key, head_size, cache.shape[-1], cache, is_neox
    )
    query.copy_(q)
    if key is not None:
        key.copy_(k)


def upstream_vllm_config(draft: Path, target: Path, method: str) -> Any:
    """The ``VllmConfig`` upstream builds the draft model from: the target
    (float32, eager, ``LIMITS.max_model_len``) with the draft as its
    speculative model, on CPU with every layer's native torch code
    (``custom_ops=["none"]``)."""
    from vllm.config import (
        CompilationConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(target),
        skip_tokenizer_init=True,
        max_model_len=LIMITS.max_model_len,
        dtype="float32",
        enforce_eager=True,
    )
    return VllmConfig(
        model_config=model_config,
        speculative_config=SpeculativeConfig(
            method=method,
            model=str(draft),
            num_speculative_tokens=K,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        ),
        device_config=DeviceConfig(device="cpu"),
        compilation_config=CompilationConfig(custom_ops=["none"]),
    )


@pytest.fixture
def upstream_model(tmp_path, monkeypatch):
    """``make(method, variant, device)`` -> (draft dir, target dir, upstream
    model in float32 on ``device``, and in bf16 on CUDA)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.model_executor.models import qwen3_dflash

    monkeypatch.setattr(qwen3_dflash, "Attention", OneRequestAttention)
    monkeypatch.setattr(
        qwen3_dflash,
        "ops",
        SimpleNamespace(rms_norm=_rms_norm, rotary_embedding=_rotary_embedding),
    )
    # Whether this fixture made the one-rank world (another test's
    # session-wide one serves as well).
    owned = []

    def make(method: str, variant: str, device: str):
        from safetensors.torch import load_file

        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

        draft, target = write_checkpoints(tmp_path, method, variant)
        config = upstream_vllm_config(draft, target, method)
        if not model_parallel_is_initialized():
            init_single_rank_world(config)
            owned.append(True)
        model_cls = (
            qwen3_dflash.DFlashQwen3ForCausalLM
            if method == "dflash"
            else Qwen3DSparkForCausalLM
        )
        weights = load_file(draft / "model.safetensors")
        heads = load_file(target / "model.safetensors")

        def load(dtype: torch.dtype):
            with set_current_vllm_config(config):
                # On the device before loading, as upstream's loader has it:
                # load_weights builds the fused context-KV buffers from the
                # loaded parameters.
                model = model_cls(vllm_config=config).to(device, dtype)
                model.load_weights(weights.items())
            for layer in model.model.layers:
                layer.self_attn.attn.causal = layer.self_attn.causal
            # Its LM head in the model's dtype too, as a model of that dtype
            # has it (the config's is float32).
            model.logits_processor.head_dtype = dtype
            # The target's heads the draft lacks, shared as upstream's
            # speculators share them.
            model.model.embed_tokens.weight.data.copy_(
                heads["model.embed_tokens.weight"]
            )
            if "lm_head.weight" not in weights:
                model.lm_head.weight.data.copy_(heads["lm_head.weight"])
            return model

        # On CUDA also in bf16, the engine's dtype there.
        bf16 = load(torch.bfloat16) if device == "cuda" else None
        return draft, target, load(torch.float32), bf16

    yield make
    if owned:
        destroy_model_parallel()
        destroy_distributed_environment()


@torch.no_grad()
def upstream_logits(
    model,
    method: str,
    rows: torch.Tensor,
    anchor: int,
    start: int,
    drafted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draft logits ``[K, V]`` of one request whose context is ``rows`` at
    positions ``start``..n-1 and whose anchor sits at position n, laid out as
    upstream's speculators lay the query block out. DSpark's Markov head
    follows the greedy tokens, or ``drafted`` when given."""
    device = model.lm_head.weight.device
    n = start + rows.shape[0]
    positions = torch.arange(start, n, device=device)
    slots = torch.arange(rows.shape[0], device=device)
    combined = model.combine_hidden_states(rows.to(device, model.lm_head.weight.dtype))
    model.precompute_and_store_context_kv(combined, positions, slots)
    # DFlash: anchor + K masks, drafts at the masks. DSpark (anchor as the
    # first prediction): anchor + K-1 masks, a draft at every query row.
    query = K + 1 if method == "dflash" else K
    ids = torch.tensor([anchor] + [MASK_TOKEN] * (query - 1), device=device)
    # Past the model length, as upstream's speculators lay the block out
    # (dflash/speculator.py): clamped to the last position, and beyond the
    # sequence length they give the attention, so no key.
    query_positions = n + torch.arange(query, device=device)
    for layer in model.model.layers:
        layer.self_attn.attn.query_keys = min(query, LIMITS.max_model_len - n)
    hidden = model(ids, query_positions.clamp(max=LIMITS.max_model_len - 1))
    if method == "dflash":
        return model.compute_logits(hidden[1:])
    base = model.compute_draft_logits(hidden)
    topk = getattr(model.config, "dspark_draft_topk", None)
    if topk is not None:
        values, candidates = base.topk(topk, dim=-1)
    prev = torch.tensor([anchor], device=device)
    steps = []
    for i in range(K):
        embed = model.markov_embed(prev)
        if topk is None:
            logits = base[i : i + 1] + model.markov_bias(embed)
        else:
            # As upstream's speculator runs a top-k head: -inf but the
            # candidates, which the Markov bias corrects.
            logits = model.apply_markov_bias_gathered(
                embed,
                torch.full_like(base[i : i + 1], float("-inf")),
                values[i : i + 1],
                candidates[i : i + 1],
            )
        prev = (
            model.map_draft_to_target(logits.argmax(-1))
            if drafted is None
            else drafted[i : i + 1]
        )
        steps.append(logits[0])
    logits = torch.stack(steps)
    if model.draft_id_to_target_id is None:
        return logits
    # A reduced vocabulary scattered into the vocabulary over -inf, as
    # upstream's DSpark speculator scatters it for sampling.
    index = torch.arange(logits.shape[-1], device=device) + model.draft_id_to_target_id
    full = logits.new_full((K, VOCAB), float("-inf"))
    return full.index_copy_(1, index, logits)


def context(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, TARGET_HIDDEN * len(AUX_LAYERS), generator=gen).bfloat16()


def assert_drafts_as_upstream(
    ours: torch.Tensor,
    tokens: torch.Tensor,
    models,
    method,
    rows,
    anchor,
    start,
    topk: bool = False,
) -> None:
    """On CPU (float32 both) logits within 1e-5 and the same greedy tokens.
    On CUDA the engine runs bf16 (and its CUDA graphs): its logits must be
    as close to upstream's float32 model as upstream's own model in bf16 is
    (within twice its error in norm), and its tokens their argmax. DSpark's
    Markov head follows the engine's tokens in both upstream runs, so that a
    near tie does not make the chains diverge; with a ``topk`` head, bf16
    may swap a position's last candidate for another near it (one in, one
    out), and the logits are compared where all three score."""
    exact, bf16 = models
    if bf16 is None:
        expected = upstream_logits(exact, method, rows, anchor, start)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, expected.argmax(-1))
        return
    drafted = tokens.to(ours.device)
    expected = upstream_logits(exact, method, rows, anchor, start, drafted)
    upstream = upstream_logits(bf16, method, rows, anchor, start, drafted).float()
    assert torch.equal(drafted, ours.argmax(-1))
    # Ids a reduced vocabulary or a top-k head does not draft are -inf.
    scored = expected.isfinite()
    swapped = (ours.isfinite() != scored).sum(-1)
    assert (swapped <= (2 if topk else 0)).all(), swapped
    scored &= ours.isfinite() & upstream.isfinite()
    error = (ours.float() - expected)[scored].norm()
    upstream_error = (upstream - expected)[scored].norm()
    assert error <= 2 * upstream_error, (error, upstream_error)


def loaded_engine(draft: Path, target: Path, device: str) -> ProductionEngine:
    """The production engine of the checkpoints, loaded; with its CUDA
    graphs on CUDA."""
    engine = ProductionEngine.from_checkpoints(
        LIMITS,
        str(draft),
        str(target),
        torch.device(device),
        enable_cuda_graph=device == "cuda",
    )
    engine.load()
    engine.capture_cuda_graphs()
    return engine


def drafts_over_two_proposes(
    engine: ProductionEngine,
) -> Iterator[tuple[ProposeOutput, int, torch.Tensor, int, int]]:
    """Three requests in two PROPOSEs; the second sends each request's new
    rows only, so the drafts depend on the context the engine kept, and the
    third request's context starts at position 6 (as after a RECONNECT that
    restored a later window). Yields, per request and PROPOSE, the engine's
    output, the request's index, its context rows so far, its anchor and its
    valid start."""
    valid = [0, 0, 6]
    first = [context(20, 1), context(9, 2), context(25, 5)]
    later = [context(5, 3), context(2, 4), context(1, 6)]
    anchors = [[40, 7], [123, 200], [0, 254]]
    requests = range(len(first))
    for step, sent in enumerate((first, later)):
        start = [valid[r] + (first[r].shape[0] if step else 0) for r in requests]
        counts = [sent[r].shape[0] for r in requests]
        ends = [s + c for s, c in zip(start, counts)]
        batch = ProposeBatch(
            K,
            list(requests),
            valid,
            ends,
            [anchors[r][step] for r in requests],
            counts,
            torch.cat([torch.arange(s, e) for s, e in zip(start, ends)]),
            torch.cat(sent),
            want_logits=True,
        )
        out = engine.propose(batch)
        assert out.logits is not None
        for r in requests:
            rows = torch.cat([first[r], later[r]]) if step else first[r]
            yield out, r, rows, anchors[r][step], valid[r]


def draft_past_the_model_length(
    engine: ProductionEngine,
) -> tuple[ProposeOutput, torch.Tensor, int, int]:
    """One request whose anchor is one position before the last, so the
    query block's later rows fall past max_model_len: the output, the
    context rows, the anchor and the valid start."""
    rows = context(4, 7)
    end = LIMITS.max_model_len - 2
    start = end - rows.shape[0]
    anchor = 17
    batch = ProposeBatch(
        K,
        [0],
        [start],
        [end],
        [anchor],
        [rows.shape[0]],
        torch.arange(start, end),
        rows,
        want_logits=True,
    )
    out = engine.propose(batch)
    assert out.logits is not None
    return out, rows, anchor, start


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_production_engine_drafts_as_upstreams_model(
    upstream_model, method, variant, device
):
    draft, target, *models = upstream_model(method, variant, device)
    engine = loaded_engine(draft, target, device)
    for out, r, rows, anchor, start in drafts_over_two_proposes(engine):
        assert out.logits is not None
        assert_drafts_as_upstream(
            out.logits[r],
            out.tokens[r],
            models,
            method,
            rows,
            anchor,
            start,
            topk=variant == "draft_topk",
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "variant", ["plain", "causal", "swa_every_layer", "mixed_layers"]
)
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_query_block_past_the_model_length_drafts_as_upstreams(
    upstream_model, method, variant, device
):
    draft, target, *models = upstream_model(method, variant, device)
    engine = loaded_engine(draft, target, device)
    out, rows, anchor, start = draft_past_the_model_length(engine)
    assert out.logits is not None
    assert_drafts_as_upstream(
        out.logits[0], out.tokens[0], models, method, rows, anchor, start
    )
