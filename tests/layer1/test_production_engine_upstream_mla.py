# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The production engine drafts what upstream's own MLA DSpark model code
computes for the same ``K3DSparkModel`` checkpoint.

Upstream's ``K3DSparkForCausalLM`` (``vllm/models/kimi_k3/nvidia``) is built
on CPU from a real ``VllmConfig`` of a tiny ``k3_dspark`` draft, loaded
through its own ``load_weights`` and post-load hooks, and given the target's
embedding and LM head as ``load_dspark_model`` gives them. The RoPE table is
the one upstream's ``get_rope`` builds in ``MultiHeadLatentAttention``, and
the softmax scale is the layer's own (with its DeepSeek-YaRN mscale). What
needs a GPU is replaced by its contract:

* the attention backend, whose impl's ``forward_mqa`` attends each query row
  to one request's latent cache (slot == position) up to its sequence
  length, as the MLA metadata builder flattens a non-causal query block into
  decode rows of one shared sequence length;
* the prefill backend, built but never run (the block runs as decode rows);
* the fused ops: ``fused_q_kv_rmsnorm`` (two RMSNorms),
  ``fused_mla_decode_q_concat_kv_cache_insert`` (interleaved RoPE of
  ``q_pe``/``k_pe`` by the layer's cos/sin table, then the latent cache
  insert), and the context pass's ``ops.rms_norm`` (one weight row per
  layer), ``ops.rotary_embedding`` and ``ops.concat_and_cache_mla_grouped``;
* the workspace manager, and CUDA's stream-capture query on a host without
  CUDA.

A rebase that changes upstream's MLA draft math fails here.
"""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from k3_devices import DEVICES
from k3_mla_layout import is_norm, mla_draft_weight_shapes
from safetensors.torch import save_file
from test_production_engine_upstream import (
    AUX_LAYERS,
    LIMITS,
    MASK_TOKEN,
    TARGET_HIDDEN,
    VOCAB,
    K,
    _rms_norm,
    _rotary_embedding,
    draft_past_the_model_length,
    drafts_over_two_proposes,
    loaded_engine,
    upstream_vllm_config,
    write_target,
)
from toy_target import init_single_rank_world

# Four heads of a 12-wide query/key (8 NoPE + 4 RoPE) over a 16-wide latent
# (20 cache columns), two layers.
DRAFT = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "intermediate_size": 48,
}
# Slots of the stand-in latent cache, in blocks of 16: every position up to
# the model length plus a query block past it.
CACHE_BLOCK = 16
CACHE_BLOCKS = -(-(LIMITS.max_model_len + K) // CACHE_BLOCK)

# YaRN as DeepSeek configs write it; upstream's MLA serves any rope type but
# "default" as DeepSeek scaling. Its table covers 1024 * 4 = 4096 positions.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 1024,
}

# Checkpoint variants upstream serves (config keys; None drops the key;
# "draft_ships_heads" writes the draft's own embedding and LM head).
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logit_scale": {"logit_scale": 0.7},
    # K3DSparkConfig's own default base, 50000.
    "default_rope_theta": {"rope_theta": None},
    # DeepSeek YaRN: the softmax scale grows by mscale(4, 1.0)^2.
    "deepseek_yarn": {"rope_scaling": YARN},
    # attention_factor 1.0 selects deepseek_llama_scaling: the same kind of
    # table (here scaled by mscale(4, 1.0) / mscale(4, 0.5)), the softmax
    # scale as is (DeepSeek YaRN would grow it by mscale(4, 0.5)^2).
    "deepseek_llama_scaling": {
        "rope_scaling": {
            **YARN,
            "attention_factor": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        }
    },
    # A missing mscale_all_dim counts as 0: no softmax factor.
    "deepseek_yarn_no_mscale_all_dim": {
        "rope_scaling": {k: v for k, v in YARN.items() if k != "mscale_all_dim"}
    },
    # Every norm (context, q_a, kv_a, layers, final) at the config's eps.
    "rms_norm_eps": {"rms_norm_eps": 0.1},
    # Kimi's SiTU MLP (at beta 1: upstream's draft passes no beta).
    "situ": {"hidden_act": "situ", "activation_situ_beta": 2.0},
    # Upstream drops the draft's heads and shares the target's.
    "draft_ships_heads": {"draft_ships_heads": True},
    # Loaded (and kept), not used for drafting.
    "confidence_head": {"enable_confidence_head": True},
}


def write_checkpoints(root: Path, variant: str) -> tuple[Path, Path]:
    """A ``k3_dspark`` draft with random weights in upstream's checkpoint
    names and a target holding the embedding and LM head (bf16), both with
    their config.json; ``variant`` names an entry of ``VARIANTS``."""
    gen = torch.Generator().manual_seed(11)

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    overrides = dict(VARIANTS[variant])
    ships_heads = overrides.pop("draft_ships_heads", False)
    config: dict[str, Any] = {
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        **DRAFT,
        "vocab_size": VOCAB,
        "target_hidden_size": TARGET_HIDDEN,
        "num_target_layers": len(AUX_LAYERS),
        "target_layer_ids": [i - 1 for i in AUX_LAYERS],
        "markov_rank": 8,
        "mask_token_id": MASK_TOKEN,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    config |= overrides
    config = {key: value for key, value in config.items() if value is not None}
    hidden = DRAFT["hidden_size"]
    tensors = {
        name: 1 + rand(*shape, scale=0.1) if is_norm(name) else rand(*shape)
        for name, shape in mla_draft_weight_shapes(config).items()
    }
    if ships_heads:
        tensors["embed_tokens.weight"] = rand(VOCAB, hidden, scale=1.0)
        tensors["lm_head.weight"] = rand(VOCAB, hidden)
    if config.get("enable_confidence_head"):
        # Over the hidden state alone (confidence_head_with_markov unset).
        tensors["confidence_head.proj.weight"] = rand(1, hidden)
        tensors["confidence_head.proj.bias"] = rand(1)
    draft, target = root / "draft", root / "target"
    draft.mkdir()
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, draft / "model.safetensors"
    )
    (draft / "config.json").write_text(json.dumps(config))
    write_target(target, rand, hidden)
    return draft, target


class OneRequestMLAImpl:
    """Stands in for the MLA backend's impl. ``forward_mqa(q, cache,
    metadata, layer)`` attends every row of ``q`` ``[B, heads, kv_lora +
    rope]`` (the absorbed query) to the latent cache rows of one request,
    slot == position, from ``metadata.seq_start`` to ``metadata.seq_len``
    (non-causal: all rows see the same keys), at the layer's scale, and
    returns the latent output ``[B, heads, kv_lora]`` and no LSE."""

    supports_quant_query_input = False
    lse_base_on_e = True

    def __init__(self, *, scale: float, kv_lora_rank: int, **_: object) -> None:
        self.scale, self.kv_lora_rank = scale, kv_lora_rank

    def forward_mqa(self, q, kv_cache, attn_metadata, layer):
        rows = kv_cache.reshape(-1, kv_cache.shape[-1]).float()
        keys = rows[attn_metadata.seq_start : attn_metadata.seq_len]
        scores = torch.einsum("bhd,sd->bhs", q.float(), keys) * self.scale
        latent = scores.softmax(-1) @ keys[:, : self.kv_lora_rank]
        return latent.to(q.dtype), None


class OneRequestMLABackend:
    """Stands in for the backend ``get_attn_backend`` selects."""

    @staticmethod
    def get_name() -> str:
        return "ONE_REQUEST_MLA"

    @staticmethod
    def get_impl_cls() -> type[OneRequestMLAImpl]:
        return OneRequestMLAImpl


def _get_attn_backend(*_: object, **__: object) -> type[OneRequestMLABackend]:
    """``get_attn_backend``: the one-request MLA backend."""
    return OneRequestMLABackend


def _get_mla_prefill_backend(vllm_config):
    """``get_mla_prefill_backend``: a factory of an unused prefill backend
    (every query row runs as a decode row)."""
    return lambda **kwargs: SimpleNamespace(**kwargs)


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float):
    from vllm import ir

    return ir.ops.rms_norm.impls["native"].impl_fn(x, weight, eps)


def _fused_q_kv_rmsnorm(q, kv, q_weight, kv_weight, eps):
    """``fused_q_kv_rmsnorm``: the RMSNorms of ``q`` and ``kv``, as new
    tensors."""
    return _native_rms_norm(q, q_weight, eps), _native_rms_norm(kv, kv_weight, eps)


def _decode_q_concat_kv_cache_insert(
    ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, *, positions, cos_sin_cache
):
    """``fused_mla_decode_q_concat_kv_cache_insert`` (unquantized cache): the
    interleaved RoPE of ``q_pe`` ``[B, heads, rope]`` and ``k_pe`` by the
    fp32 ``cos_sin_cache`` at ``positions``, in fp32; writes ``[kv_c |
    k_pe]`` at ``slot_mapping`` of ``kv_cache`` ``[blocks, block, entry]``
    and returns ``[ql_nope | q_pe]``."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    rows, rope = q_pe.shape[0], q_pe.shape[-1]
    q_rot, k_rot = RotaryEmbedding.forward_static(
        positions,
        q_pe.float().reshape(rows, -1),
        k_pe.float().reshape(rows, -1),
        rope,
        rope,
        cos_sin_cache,
        False,
    )
    entries = torch.cat((kv_c.float(), k_rot), -1)
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping] = entries.to(kv_cache.dtype)
    return torch.cat((ql_nope, q_rot.view_as(q_pe).to(ql_nope.dtype)), -1)


class GroupedCacheInsert:
    """Stands in for ``ops.concat_and_cache_mla_grouped``: writes layer
    ``i``'s ``[kv_c[i] | k_pe[i]]`` at ``slot_mapping[i]`` of the cache whose
    address is ``kv_cache_ptrs[i]`` (one of ``caches``, by data pointer)."""

    def __init__(self) -> None:
        self.caches: dict[int, torch.Tensor] = {}

    def __call__(self, kv_c, k_pe, kv_cache_ptrs, slot_mapping, *_: object):
        for i, address in enumerate(kv_cache_ptrs.tolist()):
            cache = self.caches[address]
            entries = torch.cat((kv_c[i], k_pe[i]), -1).to(cache.dtype)
            cache.view(-1, cache.shape[-1])[slot_mapping[i]] = entries


class Workspace:
    """Stands in for ``current_workspace_manager()``: ``get_simultaneous``
    returns fresh tensors of the (shape, dtype) specs on ``device``."""

    def __init__(self, device: str) -> None:
        self.device = device

    def get_simultaneous(self, *specs):
        return tuple(torch.empty(s, dtype=d, device=self.device) for s, d in specs)


@pytest.fixture
def upstream_model(tmp_path, monkeypatch):
    """``make(variant, device)`` -> (draft dir, target dir, upstream model in
    float32 on ``device``, and in bf16 on CUDA else None)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.models.kimi_k3.nvidia import dspark_mla, mla
    from vllm.utils.torch_utils import set_default_torch_dtype

    insert = GroupedCacheInsert()
    monkeypatch.setattr(mla, "get_attn_backend", _get_attn_backend)
    monkeypatch.setattr(mla, "get_mla_prefill_backend", _get_mla_prefill_backend)
    monkeypatch.setattr(mla, "fused_q_kv_rmsnorm", _fused_q_kv_rmsnorm)
    monkeypatch.setattr(
        mla,
        "fused_mla_decode_q_concat_kv_cache_insert",
        _decode_q_concat_kv_cache_insert,
    )
    monkeypatch.setattr(
        dspark_mla,
        "ops",
        SimpleNamespace(
            rms_norm=_rms_norm,
            rotary_embedding=_rotary_embedding,
            concat_and_cache_mla_grouped=insert,
        ),
    )
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    # Whether this fixture made the one-rank world (another test's
    # session-wide one serves as well).
    owned = []

    def make(variant: str, device: str):
        from safetensors.torch import load_file

        monkeypatch.setattr(
            dspark_mla, "current_workspace_manager", lambda: Workspace(device)
        )
        draft, target = write_checkpoints(tmp_path, variant)
        config = upstream_vllm_config(draft, target, "dspark")
        if not model_parallel_is_initialized():
            init_single_rank_world(config)
            owned.append(True)
        weights = load_file(draft / "model.safetensors")
        heads = load_file(target / "model.safetensors")
        hidden = DRAFT["hidden_size"]

        def load(dtype: torch.dtype, prefix: str):
            # Built as upstream's loader builds it: in the dtype, on the
            # device (a prefix of its own per dtype: the layers register by
            # name in the config).
            with (
                set_current_vllm_config(config),
                set_default_torch_dtype(dtype),
                torch.device(device),
            ):
                model = dspark_mla.K3DSparkForCausalLM(
                    vllm_config=config, prefix=prefix
                )
                # get_rope hands out one shared module per RoPE config, which
                # an earlier test may have left on another device.
                model.to(device)
                loaded = model.load_weights(weights.items())
                unloaded = {n for n, _ in model.named_parameters()} - loaded
                assert not unloaded, unloaded
                # upstream's process_weights_after_loading: each attention
                # layer's (kv_b_proj absorbed), then the model's.
                for layer in model.model.layers:
                    layer.self_attn.process_weights_after_loading(dtype)
                model.process_weights_after_loading()
                # The target's heads, shared as load_dspark_model shares them.
                embed = VocabParallelEmbedding(VOCAB, hidden)
                embed.weight.data.copy_(heads["model.embed_tokens.weight"])
                model.model.embed_tokens = embed
                lm_head = ParallelLMHead(VOCAB, hidden)
                lm_head.weight.data.copy_(heads["lm_head.weight"])
                model.lm_head = lm_head
            # Its LM head in the model's dtype too, as a model of that dtype
            # has it (the config's is float32).
            model.logits_processor.head_dtype = dtype
            for layer in model.model.layers:
                attn = layer.self_attn
                width = attn.kv_lora_rank + attn.qk_rope_head_dim
                cache = torch.zeros(
                    CACHE_BLOCKS, 1, CACHE_BLOCK, width, dtype=dtype, device=device
                )
                attn.bind_kv_cache(cache)
                insert.caches[attn.kv_cache.data_ptr()] = attn.kv_cache
            model.harness_vllm_config = config
            return model

        # On CUDA also in bf16, the engine's dtype there.
        bf16 = load(torch.bfloat16, "bf16") if device == "cuda" else None
        return draft, target, load(torch.float32, ""), bf16

    yield make
    if owned:
        destroy_model_parallel()
        destroy_distributed_environment()


@torch.no_grad()
def upstream_logits(
    model,
    rows: torch.Tensor,
    anchor: int,
    start: int,
    drafted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draft logits ``[K, V]`` of one request whose context is ``rows`` at
    positions ``start``..n-1 and whose anchor sits at position n, laid out as
    upstream's speculator lays the query block out: anchor and K-1 masks at
    positions n.., clamped to the last position, each a decode row whose
    keys end at the sequence length ``min(n + K, max_model_len)``. The
    Markov head follows the greedy tokens, or ``drafted`` when given."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    config = model.harness_vllm_config
    layers = [layer.self_attn for layer in model.model.layers]
    device = model.lm_head.weight.device
    for attn in layers:
        attn.kv_cache.zero_()
    n = start + rows.shape[0]
    positions = torch.arange(start, n, device=device)
    with set_current_vllm_config(config):
        combined = model.combine_hidden_states(
            rows.to(device, model.lm_head.weight.dtype)
        )
        # Slot == position.
        model.precompute_and_store_context_kv(combined, positions, positions)
        ids = torch.tensor([anchor] + [MASK_TOKEN] * (K - 1), device=device)
        query_positions = n + torch.arange(K, device=device)
        metadata = SimpleNamespace(
            num_actual_tokens=K,
            num_decode_tokens=K,
            seq_start=start,
            seq_len=min(n + K, LIMITS.max_model_len),
        )
        with set_forward_context(
            {attn.layer_name: metadata for attn in layers},
            config,
            slot_mapping={attn.layer_name: query_positions for attn in layers},
        ):
            hidden = model(ids, query_positions.clamp(max=LIMITS.max_model_len - 1))
        base = model.compute_draft_logits(hidden)
        prev = torch.tensor([anchor], device=device)
        steps = []
        for i in range(K):
            logits = base[i : i + 1] + model.markov_bias(model.markov_embed(prev))
            prev = logits.argmax(-1) if drafted is None else drafted[i : i + 1]
            steps.append(logits[0])
    return torch.stack(steps)


def assert_drafts_as_upstream(
    ours: torch.Tensor, tokens: torch.Tensor, models, rows, anchor, start
) -> None:
    """On CPU (float32 both) logits within 1e-5 and the same greedy tokens.
    On CUDA the engine runs bf16 (and its CUDA graphs): its logits must be
    as close to upstream's float32 model as upstream's own model in bf16 is
    (within twice its error in norm), and its tokens their argmax; the
    Markov head follows the engine's tokens in both upstream runs, so that a
    near tie does not make the chains diverge."""
    exact, bf16 = models
    if bf16 is None:
        expected = upstream_logits(exact, rows, anchor, start)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, expected.argmax(-1))
        return
    drafted = tokens.to(ours.device)
    expected = upstream_logits(exact, rows, anchor, start, drafted)
    upstream = upstream_logits(bf16, rows, anchor, start, drafted).float()
    assert torch.equal(drafted, ours.argmax(-1))
    error = (ours.float() - expected).norm()
    upstream_error = (upstream - expected).norm()
    assert error <= 2 * upstream_error, (error, upstream_error)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_production_engine_drafts_as_upstreams_model(upstream_model, variant, device):
    draft, target, *models = upstream_model(variant, device)
    engine = loaded_engine(draft, target, device)
    for out, r, rows, anchor, start in drafts_over_two_proposes(engine):
        assert out.logits is not None
        assert_drafts_as_upstream(
            out.logits[r], out.tokens[r], models, rows, anchor, start
        )


@pytest.mark.parametrize("device", DEVICES)
def test_a_query_block_past_the_model_length_drafts_as_upstreams(
    upstream_model, device
):
    draft, target, *models = upstream_model("plain", device)
    engine = loaded_engine(draft, target, device)
    out, rows, anchor, start = draft_past_the_model_length(engine)
    assert out.logits is not None
    assert_drafts_as_upstream(out.logits[0], out.tokens[0], models, rows, anchor, start)
