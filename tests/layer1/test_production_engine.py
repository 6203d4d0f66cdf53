# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The production engine on tiny checkpoints in the upstream draft format."""

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from k3_layer1_server import free_tcp_port
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from vllm.entrypoints.k3_dspark_standalone import build_engine, parse_args, run
from vllm.k3_draft.engine import DraftLimits, ProposeBatch
from vllm.k3_draft.production_engine import (
    CheckpointError,
    DraftCheckpoint,
    ProductionEngine,
    SafetensorsCheckpoint,
    _layer_attention,
    confined_path,
)
from vllm.k3_draft.reference_engine import ReferenceEngine, ReferenceModelConfig

LIMITS = DraftLimits(4, 2, 3, 256, 4096, 16, 32, 64)
TARGET_HIDDEN = 16
AUX_LAYERS = [1, 3, 5]
REFERENCE = {
    "dflash": ReferenceModelConfig(
        "dflash",
        vocab_size=256,
        context_width=TARGET_HIDDEN * 3,
        hidden_size=16,
        num_heads=2,
        seed=3,
    ),
    "dspark": ReferenceModelConfig(
        "dspark",
        vocab_size=256,
        context_width=TARGET_HIDDEN * 3,
        hidden_size=16,
        num_heads=2,
        seed=4,
    ),
    # Kimi-K3's MLA DSpark draft.
    "mla": ReferenceModelConfig(
        "dspark",
        vocab_size=256,
        context_width=TARGET_HIDDEN * 3,
        hidden_size=16,
        num_heads=2,
        seed=5,
        latent_attention=True,
    ),
}
_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "fc": "fc.weight",
    "hidden_norm": "hidden_norm.weight",
    "final_norm": "norm.weight",
    "markov_w1": "markov_head.markov_w1.weight",
    "markov_w2": "markov_head.markov_w2.weight",
}
_MLA_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "wq_a": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "wq_b": "self_attn.q_b_proj.weight",
    "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "wkv_b": "self_attn.kv_b_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_MLA_GLOBAL_NAMES = {
    "fc": "context_proj.weight",
    "hidden_norm": "context_norm.weight",
    "final_norm": "final_norm.weight",
    "markov_w1": "markov_head.markov_w1.weight",
    "markov_w2": "markov_head.markov_w2.weight",
}


class BF16HeadsReference(ReferenceEngine):
    """The reference draft with bf16-rounded embedding and LM head (as the
    production engine reads them from the target)."""

    def host_weights(self):
        weights = super().host_weights()
        for name in ("embed", "lm_head"):
            weights[name] = weights[name].bfloat16().float()
        return weights


def write_checkpoints(root: Path, method: str, **config_overrides) -> tuple[Path, Path]:
    """Draft (single file) and target (two shards + index) checkpoints holding
    the reference draft's weights in upstream's names; ``method`` "dflash",
    "dspark" (Qwen3) or "mla" (Kimi-K3's MLA DSpark)."""
    model = REFERENCE[method]
    weights = BF16HeadsReference(LIMITS, model, torch.device("cpu")).host_weights()
    draft, target = root / "draft", root / "target"
    draft.mkdir()
    target.mkdir()
    layer_names, global_names = (
        (_MLA_LAYER_NAMES, _MLA_GLOBAL_NAMES)
        if method == "mla"
        else (_LAYER_NAMES, _GLOBAL_NAMES)
    )
    tensors = {}
    for name, value in weights.items():
        if name in layer_names:
            for layer in range(model.num_layers):
                tensors[f"layers.{layer}.{layer_names[name]}"] = value[
                    layer
                ].contiguous()
        elif name in global_names:
            tensors[global_names[name]] = value.contiguous()
    save_file(tensors, str(draft / "model.safetensors"))
    architecture = "DFlashDraftModel" if method == "dflash" else "Qwen3DSparkModel"
    config: dict[str, object] = {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_heads,
        "intermediate_size": 2 * model.hidden_size,
        "vocab_size": model.vocab_size,
        "target_hidden_size": TARGET_HIDDEN,
        "head_dim": model.hidden_size // model.num_heads,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "dflash_config": {
            "mask_token_id": model.vocab_size - 1,
            "target_layer_ids": [i - 1 for i in AUX_LAYERS],
        },
        **({"markov_rank": 16} if method == "dspark" else {}),
        **config_overrides,
    }
    if method == "mla":
        head = model.hidden_size // model.num_heads
        config = {
            "architectures": ["K3DSparkModel"],
            "model_type": "k3_dspark",
            "hidden_size": model.hidden_size,
            "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_heads,
            "q_lora_rank": model.hidden_size // 2,
            "kv_lora_rank": model.hidden_size // 2,
            "qk_nope_head_dim": head,
            "qk_rope_head_dim": head // 2,
            "v_head_dim": head,
            "intermediate_size": 2 * model.hidden_size,
            "vocab_size": model.vocab_size,
            "target_hidden_size": TARGET_HIDDEN,
            "num_target_layers": len(AUX_LAYERS),
            "target_layer_ids": [i - 1 for i in AUX_LAYERS],
            "mask_token_id": model.vocab_size - 1,
            "markov_rank": 16,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            **config_overrides,
        }
    (draft / "config.json").write_text(json.dumps(config))
    save_file(
        {"model.embed_tokens.weight": weights["embed"].bfloat16()},
        str(target / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"lm_head.weight": weights["lm_head"].bfloat16()},
        str(target / "model-00002-of-00002.safetensors"),
    )
    index = {
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        }
    }
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return draft, target


def proposal(engine) -> torch.Tensor:
    engine.load()
    rows = torch.randn(
        30, TARGET_HIDDEN * 3, generator=torch.Generator().manual_seed(0)
    )
    batch = ProposeBatch(
        3,
        [1],
        [0],
        [30],
        [17],
        [30],
        torch.arange(30),
        rows.bfloat16(),
        want_logits=True,
    )
    return engine.propose(batch).logits


def cpu_engine(draft: Path, target: Path) -> ProductionEngine:
    """The production engine of the checkpoints on CPU, not loaded."""
    return ProductionEngine.from_checkpoints(
        LIMITS, str(draft), str(target), torch.device("cpu")
    )


@pytest.mark.parametrize("method", ["dflash", "dspark", "mla"])
def test_checkpoint_config_gives_the_draft_shape(tmp_path, method):
    draft, _ = write_checkpoints(tmp_path, method)
    checkpoint = DraftCheckpoint.from_dir(draft)
    assert checkpoint.shape == REFERENCE[method].shape()
    assert checkpoint.aux_layer_ids == tuple(AUX_LAYERS)


def assert_drafts_as_the_reference(draft: Path, target: Path, method: str) -> None:
    production = cpu_engine(draft, target)
    reference = BF16HeadsReference(LIMITS, REFERENCE[method], torch.device("cpu"))
    torch.testing.assert_close(proposal(production), proposal(reference))


@pytest.mark.parametrize("method", ["dflash", "dspark", "mla"])
def test_production_engine_matches_the_same_weights_in_the_reference(tmp_path, method):
    assert_drafts_as_the_reference(*write_checkpoints(tmp_path, method), method)


def test_draft_names_upstream_aliases_load_as_their_targets(tmp_path):
    # Upstream's DFlash loader maps midlayer., encoder.fc. and
    # encoder.output_norm_enc. onto layers.0., fc. and hidden_norm.
    draft, target = write_checkpoints(tmp_path, "dflash")
    tensors = load_file(str(draft / "model.safetensors"))
    renamed = {}
    for name, value in tensors.items():
        name = name.replace("layers.0.", "midlayer.")
        name = name.replace("fc.", "encoder.fc.")
        name = name.replace("hidden_norm.", "encoder.output_norm_enc.")
        renamed[name] = value
    save_file(renamed, str(draft / "model.safetensors"))
    assert_drafts_as_the_reference(draft, target, "dflash")


def test_safetensors_shards_without_an_index_are_all_read(tmp_path):
    """A draft shipped as several ``*.safetensors`` files and no index (any
    names), as upstream's loader reads such a directory."""
    draft, target = write_checkpoints(tmp_path, "dflash")
    tensors = load_file(str(draft / "model.safetensors"))
    (draft / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, draft / "a-00001.safetensors")
    save_file({n: tensors[n] for n in names[half:]}, draft / "b-00002.safetensors")
    assert_drafts_as_the_reference(draft, target, "dflash")


def test_hidden_safetensors_files_without_an_index_are_ignored_as_upstream(
    tmp_path,
):
    """The ``._model.safetensors`` AppleDouble companion that a copy or tar
    from macOS leaves beside each file: upstream's ``glob.glob`` skips hidden
    files, so the draft is served from ``model.safetensors`` alone."""
    draft, target = write_checkpoints(tmp_path, "dflash")
    apple_double = bytes.fromhex("0005160700020000") + b"Mac OS X        "
    (draft / "._model.safetensors").write_bytes(apple_double + bytes(64))
    assert_drafts_as_the_reference(draft, target, "dflash")


def test_a_tensor_in_two_unindexed_shards_is_refused_in_one_line(tmp_path, caplog):
    draft, target = write_checkpoints(tmp_path, "dflash")
    tensors = load_file(str(draft / "model.safetensors"))
    save_file({"fc.weight": tensors["fc.weight"]}, draft / "extra.safetensors")
    assert re.search(
        "Refusing to serve: fc.weight is in both extra.safetensors and "
        "model.safetensors of .*draft",
        refusal(caplog, draft, target),
    )


def test_float64_weights_are_served_cast(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash")
    tensors = load_file(str(draft / "model.safetensors"))
    save_file({n: t.double() for n, t in tensors.items()}, draft / "model.safetensors")
    assert_drafts_as_the_reference(draft, target, "dflash")


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__delitem__(name)


def _narrow(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:, 1:].contiguous()

    return edit


@pytest.mark.parametrize(
    ("method", "edit", "error"),
    [
        (
            "dflash",
            _drop("layers.1.mlp.up_proj.weight"),
            "lacks ['layers.1.mlp.up_proj.weight']",
        ),
        ("dflash", _narrow("fc.weight"), "fc.weight has shape [16, 47]"),
        ("mla", _drop("context_proj.weight"), "lacks ['context_proj.weight']"),
        (
            "mla",
            _drop("layers.1.self_attn.kv_a_layernorm.weight"),
            "lacks ['layers.1.self_attn.kv_a_layernorm.weight']",
        ),
        (
            "mla",
            _narrow("context_proj.weight"),
            "context_proj.weight has shape [16, 47]",
        ),
    ],
)
def test_draft_weights_that_do_not_fit_are_refused_by_their_checkpoint_names(
    tmp_path, method, edit, error
):
    draft, target = write_checkpoints(tmp_path, method)
    tensors = load_file(str(draft / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(draft / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(error)):
        cpu_engine(draft, target).load()


def test_a_target_without_an_lm_head_ties_it_to_the_embedding(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash")
    index = {
        "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    }
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    engine = cpu_engine(draft, target)
    heads = engine.host_weights()
    assert torch.equal(heads["lm_head"], heads["embed"])


def test_qwen3_omni_target_heads_are_read_from_the_thinker(tmp_path):
    draft, target = write_checkpoints(
        tmp_path, "dspark", architectures=["Qwen3OmniDSparkModel"]
    )
    index_path = target / "model.safetensors.index.json"
    weight_map = json.loads(index_path.read_text())["weight_map"]
    for name, file in weight_map.items():
        tensor = load_file(str(target / file))[name]
        save_file({f"thinker.{name}": tensor}, str(target / file))
    index = {"weight_map": {f"thinker.{n}": f for n, f in weight_map.items()}}
    index_path.write_text(json.dumps(index))
    assert_drafts_as_the_reference(draft, target, "dspark")


def test_a_dspark_confidence_head_is_loaded_without_changing_the_drafts(tmp_path):
    """Upstream loads it (or skips it) and drafts without it."""
    draft, target = write_checkpoints(tmp_path, "dspark", enable_confidence_head=True)
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["confidence_head.proj.weight"] = torch.ones(1, 16)
    tensors["confidence_head.proj.bias"] = torch.ones(1)
    save_file(tensors, str(draft / "model.safetensors"))
    assert_drafts_as_the_reference(draft, target, "dspark")


@pytest.mark.parametrize(
    "override, reason",
    [
        # Upstream's embeddings that do not apply a plain cos/sin table.
        (
            {"rope_parameters": {"rope_theta": 1e4, "mrope_section": [2, 1, 1]}},
            r"RoPE 'default' \(MRotaryEmbedding\)",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "deepseek_yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 1024,
                }
            },
            r"RoPE 'deepseek_yarn' \(DeepseekScalingRotaryEmbedding\)",
        ),
        # Upstream's own checks of the RoPE parameters.
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
            "upstream cannot read .*config.json: KeyError: .*'factor'",
        ),
        ({"model_type": None}, "upstream cannot read .*model type `None`"),
        # Upstream's LongRoPE reads the served model's length: not a table.
        (
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 4,
                    "long_factor": [2.0] * 4,
                    "original_max_position_embeddings": 1024,
                }
            },
            "unsupported draft checkpoint: RoPE 'longrope'",
        ),
        ({"architectures": ["LlamaForCausalLM"]}, "no supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (
            {"dflash_config": {"sample_from_anchor": True, "target_layer_ids": [0]}},
            "sample_from_anchor",
        ),
        (
            {"architectures": ["Qwen3DSparkModel"], "markov_head_type": "gated"},
            "unsupported DSpark head: markov_head_type 'gated'",
        ),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "without aux hidden"),
        ({"use_aux_hidden_state": None}, "without aux hidden"),
        # Config classes default these differently: the checkpoint must say.
        ({"rope_theta": None}, "no rope_theta"),
        ({"head_dim": None}, "no head_dim"),
    ],
)
def test_unsupported_checkpoints_are_refused_with_the_reason(
    tmp_path, override, reason
):
    draft, _ = write_checkpoints(tmp_path, "dflash", **override)
    with pytest.raises(CheckpointError, match=reason):
        DraftCheckpoint.from_dir(draft)


@pytest.mark.parametrize(
    "override, reason",
    [
        ({"logit_scale": 0}, "logit_scale must be a positive finite number"),
        ({"logit_scale": None}, "logit_scale must be a positive finite number"),
        (
            {
                "dflash_config": {
                    "attention_value_scale": -1,
                    "mask_token_id": 255,
                    "target_layer_ids": [0],
                }
            },
            "attention_value_scale must be a positive finite number",
        ),
        ({"is_neox_style": "no"}, "is_neox_style must be true or false"),
        ({"is_neox_style": 2}, "is_neox_style must be true or false"),
    ],
)
def test_malformed_scales_and_rope_style_are_refused(tmp_path, override, reason):
    draft, _ = write_checkpoints(tmp_path, "dflash", **override)
    with pytest.raises(CheckpointError, match=reason):
        DraftCheckpoint.from_dir(draft)


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"not a pickle", "cannot read"),
        (b"hello world\n", "cannot read"),
        (b"\x80", "cannot read"),
        (bytes(2 << 20), "bytes, more than an embedding of 16 values takes"),
        ({"embedding": torch.zeros(16), "mask_token_id": 3}, "is for mask token 3"),
        (
            {"embedding": torch.zeros(16), "mask_token_id": torch.tensor([255, 255])},
            "is for mask token tensor",
        ),
        (torch.zeros(16).to_sparse(), "holds no floating-point embedding"),
        (torch.full((16,), float("nan")), "not finite"),
        ({"mask_token_id": 255}, "holds no floating-point embedding of 16"),
        (torch.zeros(15), "holds no floating-point embedding of 16"),
        (torch.zeros(16, dtype=torch.int64), "holds no floating-point embedding"),
    ],
)
def test_a_bad_mask_embedding_file_is_refused_before_loading(tmp_path, content, reason):
    draft, target = write_checkpoints(tmp_path, "dflash")
    path = draft / "mask_embedding.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    engine = cpu_engine(draft, target)
    with pytest.raises(CheckpointError, match=reason):
        engine.load()
    assert not hasattr(engine, "w")


@pytest.mark.parametrize("value, neox", [(1, True), (0, False)])
def test_a_rope_style_written_as_one_or_zero_is_read_as_true_or_false(
    tmp_path, value, neox
):
    draft, _ = write_checkpoints(tmp_path, "dflash", is_neox_style=value)
    assert DraftCheckpoint.from_dir(draft).shape.neox_rope is neox


def test_attention_biases_the_checkpoint_lacks_are_refused_by_name(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash", attention_bias=True)
    engine = cpu_engine(draft, target)
    lacking = "lacks ['layers.<i>.self_attn.k_proj.bias', 'layers.<i>.self_attn.o_proj"
    with pytest.raises(CheckpointError, match=re.escape(lacking)):
        engine.load()


def test_attention_sinks_the_checkpoint_lacks_are_refused_by_name(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash")
    path = draft / "config.json"
    config = json.loads(path.read_text())
    config["dflash_config"]["attention_sink_bias"] = True
    path.write_text(json.dumps(config))
    engine = cpu_engine(draft, target)
    assert engine.shape.attention_sinks
    with pytest.raises(
        CheckpointError,
        match=re.escape("lacks ['layers.<i>.self_attn.attention_sink_bias']"),
    ):
        engine.load()


def test_context_width_is_the_target_hidden_size_per_aux_layer(tmp_path):
    # A target hidden size (24) other than the draft's (16).
    draft, _ = write_checkpoints(tmp_path, "dflash", target_hidden_size=24)
    assert DraftCheckpoint.from_dir(draft).shape.context_width == 24 * 3


def test_rms_norm_eps_defaults_as_qwen3_config_does(tmp_path):
    draft, _ = write_checkpoints(tmp_path, "dflash")
    config = json.loads((draft / "config.json").read_text())
    del config["rms_norm_eps"]
    (draft / "config.json").write_text(json.dumps(config))
    shape = DraftCheckpoint.from_dir(draft).shape
    assert shape.rms_norm_eps == Qwen3Config.from_dict(config).rms_norm_eps


@pytest.mark.parametrize("absent", [True, False])
def test_kv_heads_default_as_qwen3_config_does(tmp_path, absent):
    """32 KV heads when num_key_value_heads is absent, as many as attention
    heads when it is null."""
    draft, _ = write_checkpoints(
        tmp_path, "dflash", num_attention_heads=64, num_key_value_heads=None
    )
    path = draft / "config.json"
    config = json.loads(path.read_text())
    if absent:
        del config["num_key_value_heads"]
        path.write_text(json.dumps(config))
    expected = Qwen3Config.from_dict(config).num_key_value_heads
    assert expected == (32 if absent else 64)
    assert DraftCheckpoint.from_dir(draft).shape.num_kv_heads == expected


@pytest.mark.parametrize(
    "override, windows",
    [
        (
            {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
            (64, 64),
        ),
        ({"use_sliding_window": True, "max_window_layers": 1}, (None, 4096)),
        # From layer 2 of 2 on: no layer slides.
        ({"use_sliding_window": True, "max_window_layers": 2}, ()),
        ({"use_sliding_window": True, "sliding_window": 64}, ()),
        (
            {
                "use_sliding_window": True,
                "sliding_window": None,
                "max_window_layers": 0,
            },
            (),
        ),
        (
            {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 0},
            (),
        ),
        (
            {
                "layer_types": ["full_attention", "sliding_attention"],
                "use_sliding_window": True,
                "sliding_window": 48,
            },
            (None, 48),
        ),
        # DFlash's own switch slides every layer, at its own window.
        (
            {"dflash_config": {"use_swa": True, "swa_window_size": 40}},
            (40, 40),
        ),
    ],
)
def test_sliding_window_layers_are_resolved_as_upstream_does(
    tmp_path, override, windows
):
    """Layers slide where Qwen3Config's layer types and upstream's DFlash
    resolution make them slide; by ``layer_types`` a sliding layer is also
    causal."""
    dflash = override.pop("dflash_config", None)
    draft, _ = write_checkpoints(tmp_path, "dflash", **override)
    if dflash is not None:
        path = draft / "config.json"
        config = json.loads(path.read_text())
        config["dflash_config"] |= dflash
        path.write_text(json.dumps(config))
    shape = DraftCheckpoint.from_dir(draft).shape
    assert shape.sliding_windows == windows
    by_layer_types = dflash is None and windows
    assert shape.causal_layers == (
        tuple(w is not None for w in windows) if by_layer_types else ()
    )


def test_layer_attention_resolves_as_upstreams_dflash_layers(monkeypatch):
    """Every combination of the keys upstream's resolution reads, through
    ``Qwen3Config`` as vLLM reads it, against upstream's own
    ``_resolve_layer_attention`` (a refusal where it raises; its V1-runner
    guard on mixed layers is no concern of a draft server)."""
    from vllm.model_executor.models import qwen3_dflash

    monkeypatch.setattr(
        qwen3_dflash,
        "get_current_vllm_config",
        lambda: SimpleNamespace(use_v2_model_runner=True),
    )
    absent = object()
    keys: dict[str, list[Any]] = {
        "layer_types": [
            absent,
            ["sliding_attention", "full_attention"],
            ["full_attention"] * 2,
            ["sliding_attention"] * 2,
        ],
        "use_sliding_window": [True, False],
        "sliding_window": [absent, 48],
        "is_causal": [absent, True, False],
    }
    dflash_keys: dict[str, list[Any]] = {
        "use_swa": [absent, True, False],
        "swa_window_size": [absent, 40],
        "causal": [absent, True, False],
    }
    names = [*keys, *dflash_keys]
    checked = 0
    for values in itertools.product(*keys.values(), *dflash_keys.values()):
        chosen = {n: v for n, v in zip(names, values) if v is not absent}
        dflash = {n: chosen.pop(n) for n in dflash_keys if n in chosen}
        config = Qwen3Config(num_hidden_layers=2, dflash_config=dflash, **chosen)
        try:
            expected = [
                qwen3_dflash._resolve_layer_attention(config, i) for i in range(2)
            ]
        except ValueError:
            with pytest.raises(CheckpointError, match="sliding attention needs"):
                _layer_attention(config, 2)
            continue
        windows, causal = _layer_attention(config, 2)
        assert list(zip(windows, causal)) == expected, (chosen, dflash)
        checked += 1
    assert checked > 200


def test_a_sliding_layer_without_a_window_is_refused(tmp_path):
    """Upstream raises for it too: Qwen3Config drops the window unless
    ``use_sliding_window``."""
    draft, _ = write_checkpoints(
        tmp_path, "dflash", layer_types=["full_attention", "sliding_attention"]
    )
    with pytest.raises(CheckpointError, match="sliding attention needs"):
        DraftCheckpoint.from_dir(draft)


@pytest.mark.parametrize(
    "extra",
    [
        "layers.0.self_attn.q_proj.bias",
        "layers.9.mlp.up_proj.weight",
        "layers.2.mlp.up_proj.weight",  # the draft has layers 0 and 1
        "x.y",
        # DFlash has neither a Markov nor a confidence head.
        "markov_head.markov_w1.weight",
        "confidence_head.proj.weight",
    ],
)
def test_a_draft_tensor_the_engine_cannot_place_is_refused(tmp_path, extra):
    draft, target = write_checkpoints(tmp_path, "dflash")
    tensors = load_file(str(draft / "model.safetensors"))
    tensors[extra] = torch.ones(4)
    save_file(tensors, str(draft / "model.safetensors"))
    engine = cpu_engine(draft, target)
    with pytest.raises(CheckpointError, match="cannot place"):
        engine.load()


def test_index_file_linked_from_outside_the_root_is_refused(tmp_path):
    _, target = write_checkpoints(tmp_path, "dflash")
    outside = tmp_path / "elsewhere.json"
    index = target / "model.safetensors.index.json"
    outside.write_bytes(index.read_bytes())
    index.unlink()
    index.symlink_to(outside)
    with pytest.raises(CheckpointError, match="escapes"):
        SafetensorsCheckpoint(target)


def test_target_index_entry_outside_the_root_is_refused(tmp_path):
    _, target = write_checkpoints(tmp_path, "dflash")
    index = {"weight_map": {"lm_head.weight": "../draft/model.safetensors"}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="escapes the checkpoint root"):
        SafetensorsCheckpoint(target)


def test_symlink_out_of_the_root_is_refused(tmp_path):
    _, target = write_checkpoints(tmp_path, "dflash")
    (target / "link.safetensors").symlink_to(tmp_path / "draft" / "model.safetensors")
    with pytest.raises(CheckpointError, match="escapes"):
        confined_path(target.resolve(), "link.safetensors")


@pytest.mark.parametrize(
    "entry, reason",
    [
        ("loop.safetensors", "Symlink loop|many levels of symbolic links"),
        ("a\x00b.safetensors", "embedded null byte"),
    ],
    ids=["symlink-loop", "nul-byte"],
)
def test_an_index_entry_that_cannot_be_resolved_is_refused_in_one_line(
    tmp_path, caplog, entry, reason
):
    draft, target = write_checkpoints(tmp_path, "dflash")
    (target / "loop.safetensors").symlink_to(target / "loop.safetensors")
    index = {"weight_map": {"lm_head.weight": entry}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    assert re.search(
        f"Refusing to serve: cannot resolve {re.escape(repr(entry))} in .*({reason})",
        refusal(caplog, draft, target),
    )


def as_hub_snapshot(folder: Path, repo: Path) -> Path:
    """The files of ``folder`` as huggingface_hub caches a repository:
    ``repo/blobs/<sha256>`` and links to them in ``repo/snapshots/<rev>``."""
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in folder.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(repo / "blobs" / blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.mark.parametrize("method", ["dflash", "mla"])
def test_checkpoints_in_the_huggingface_hub_cache_are_served(tmp_path, method):
    """Where vLLM reads a checkpoint downloaded by huggingface_hub."""
    draft, target = write_checkpoints(tmp_path, method)
    hub = tmp_path / "hub"
    draft = as_hub_snapshot(draft, hub / "models--org--draft")
    target = as_hub_snapshot(target, hub / "models--org--target")
    assert_drafts_as_the_reference(draft, target, method)


def test_checkpoints_in_a_subfolder_of_a_huggingface_hub_snapshot_are_served(
    tmp_path,
):
    """A repository that keeps the checkpoint in a folder of its own
    (``<repo>/snapshots/<rev>/draft``): its files link to the repository's
    blobs as well."""
    draft, target = write_checkpoints(tmp_path, "dflash")
    hub = tmp_path / "hub"
    snapshot = as_hub_snapshot(draft, hub / "models--org--drafts")
    nested = snapshot / "dflash"
    nested.mkdir()
    for link in list(snapshot.iterdir()):
        if link.is_symlink():
            (nested / link.name).symlink_to(Path("..", os.readlink(link)))
            link.unlink()
    assert_drafts_as_the_reference(nested, target, "dflash")


@pytest.mark.parametrize("outside", ["elsewhere", "hub/models--org--target/refs"])
def test_a_hub_snapshot_file_linked_outside_its_repository_blobs_is_refused(
    tmp_path, outside
):
    """Outside the cache, or in another folder of the repository."""
    draft, target = write_checkpoints(tmp_path, "dflash")
    target = as_hub_snapshot(target, tmp_path / "hub" / "models--org--target")
    (tmp_path / outside).mkdir(exist_ok=True)
    elsewhere = tmp_path / outside / "elsewhere.safetensors"
    (target / "model-00002-of-00002.safetensors").resolve().rename(elsewhere)
    (target / "model-00002-of-00002.safetensors").unlink()
    (target / "model-00002-of-00002.safetensors").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="escapes the checkpoint root"):
        SafetensorsCheckpoint(target)


def test_absolute_index_path_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="is an absolute path"):
        confined_path(tmp_path, "/etc/passwd")


def test_target_heads_are_read_as_bf16_from_the_index(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash")
    engine = cpu_engine(draft, target)
    heads = engine._target_heads({"embed", "lm_head"})
    assert {name: t.dtype for name, t in heads.items()} == {
        "embed": torch.bfloat16,
        "lm_head": torch.bfloat16,
    }


def test_truncated_safetensors_file_is_refused(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash")
    shard = target / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsCheckpoint(target).load("lm_head.weight")


def test_a_tensor_of_no_elements_loads_as_an_empty_tensor(tmp_path):
    save_file({"empty": torch.zeros(0, 4)}, tmp_path / "model.safetensors")
    empty = SafetensorsCheckpoint(tmp_path).load("empty")
    assert empty.shape == (0, 4) and empty.dtype == torch.float32


def test_production_memory_plan_counts_gqa_kv_heads(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash", num_key_value_heads=1)
    engine = cpu_engine(draft, target)
    blocks = 1 + 4 * (32 // 16 + 1)
    assert engine.memory_plan().kv_bytes == 2 * 2 * blocks * 16 * 1 * 8 * 4


def production_args(draft: Path, target: Path, *extra: str):
    """Parsed CLI arguments of a CPU production engine on these checkpoints."""
    return parse_args(
        [
            "--engine",
            "production",
            "--device",
            "cpu",
            "--window-size",
            "64",
            "--draft-model",
            str(draft),
            "--target-model",
            str(target),
            *extra,
        ]
    )


def test_cli_builds_the_production_engine(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dspark")
    engine = build_engine(production_args(draft, target))
    assert engine.spec.method == "dspark" and engine.spec.context_width == 48


def refusal(caplog, draft: Path, target: Path) -> str:
    """The one error line of a start-up of these checkpoints that must exit 1
    (no traceback attached); one that serves instead is stopped after 60 s."""
    args = production_args(
        draft, target, "--status-port", str(free_tcp_port()), "--address", "inproc://x"
    )
    stop = threading.Event()
    timer = threading.Timer(60, stop.set)
    timer.start()
    try:
        with caplog.at_level(logging.ERROR):
            assert run(args, stop) == 1
    finally:
        timer.cancel()
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is None
    return record.getMessage()


def test_cli_refuses_an_unsupported_checkpoint_in_one_line(tmp_path, caplog):
    draft, target = write_checkpoints(tmp_path, "dflash", hidden_act="gelu")
    assert refusal(caplog, draft, target) == (
        "Refusing to serve: unsupported draft checkpoint: hidden_act 'gelu'"
    )


def test_cli_refuses_a_sliding_window_a_query_block_would_outgrow_in_one_line(
    tmp_path, caplog
):
    """Backends disagree on a window narrower than the query block (the CLI
    serves up to 8 draft tokens a request)."""
    draft, target = write_checkpoints(tmp_path, "dflash")
    path = draft / "config.json"
    config = json.loads(path.read_text())
    config["dflash_config"] |= {"use_swa": True, "swa_window_size": 8}
    path.write_text(json.dumps(config))
    assert refusal(caplog, draft, target) == (
        "Refusing to serve: the draft's sliding window 8 must cover its query "
        "block of 9 rows (max_speculative_tokens 8)"
    )


def test_a_dspark_window_as_wide_as_its_query_block_is_served(tmp_path):
    """DSpark queries K rows (DFlash K + 1): a window of K cuts none."""
    draft, target = write_checkpoints(tmp_path, "dspark")
    path = draft / "config.json"
    config = json.loads(path.read_text())
    config["dflash_config"] |= {"use_swa": True, "swa_window_size": 3}
    path.write_text(json.dumps(config))
    assert LIMITS.max_speculative_tokens == 3
    assert cpu_engine(draft, target).shape.sliding_windows == (3, 3)


@pytest.mark.parametrize(
    "dflash, top, sinks",
    [
        ({"attention_sink_bias": None}, {}, False),
        ({"attention_sink_bias": False}, {"add_swa_attention_sink_bias": True}, False),
        # The top-level flag is read only without dflash_config's.
        ({"attention_sink_bias": True}, {"add_swa_attention_sink_bias": "x"}, True),
        ({}, {"add_swa_attention_sink_bias": True}, True),
        ({}, {"add_swa_attention_sink_bias": None}, False),
    ],
)
def test_the_sink_flag_is_read_as_upstream_reads_it(tmp_path, dflash, top, sinks):
    draft, _ = write_checkpoints(tmp_path, "dflash")
    path = draft / "config.json"
    config = json.loads(path.read_text())
    config["dflash_config"] |= dflash
    config |= top
    path.write_text(json.dumps(config))
    assert DraftCheckpoint.from_dir(draft).shape.attention_sinks == sinks


def _remove(path: Path) -> None:
    path.unlink()


def _write(text: str):
    return lambda path: path.write_text(text)


def _safetensors(header: str, data: bytes = b""):
    """Writes a safetensors file of this header text and data."""
    raw = header.encode()
    return lambda path: path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _alias_second_layer_norm(path: Path) -> None:
    """Points layer 1's input norm at layer 0's bytes (same size)."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    norm = "layers.{}.input_layernorm.weight"
    header[norm.format(1)]["data_offsets"] = header[norm.format(0)]["data_offsets"]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size :])


def _append(data: bytes):
    return lambda path: path.write_bytes(path.read_bytes() + data)


_DEEP_JSON = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "relative, damage, reason",
    [
        ("draft/config.json", _remove, "cannot read .*config.json"),
        ("draft/config.json", _write("[1]"), "config.json is not a JSON object"),
        ("draft/config.json", _write("{"), "cannot read .*config.json"),
        ("draft/config.json", _write(_DEEP_JSON), "cannot read .*config.json"),
        (
            "draft/model.safetensors",
            _remove,
            r"draft holds neither model.safetensors.index.json nor a \*.safetensors",
        ),
        (
            "draft/model.safetensors",
            lambda path: path.write_bytes(b"\x02" + bytes(7) + b"[]"),
            "model.safetensors is not a safetensors file",
        ),
        (
            "draft/model.safetensors",
            _safetensors(_DEEP_JSON),
            "model.safetensors is not a safetensors file",
        ),
        (
            "draft/model.safetensors",
            lambda path: path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}"),
            "model.safetensors has a 1099511627776-byte header",
        ),
        (
            "draft/model.safetensors",
            _safetensors(
                '{"fc.weight": {"dtype": "F32", "shape": [-4, -4], '
                '"data_offsets": [0, 64]}}',
                bytes(64),
            ),
            r"fc.weight: negative shape \[-4, -4\]",
        ),
        (
            "draft/model.safetensors",
            _safetensors(
                '{"fc.weight": {"dtype": "F32", "shape": [4, 4], '
                '"data_offsets": [-64, 0]}}',
                bytes(64),
            ),
            r"fc.weight: data offsets \[-64, 0\] in .* are not a byte range",
        ),
        # The byte ranges must tile the data, as the safetensors library
        # requires; a range past the end is refused before it is read.
        (
            "draft/model.safetensors",
            _safetensors(
                '{"fc.weight": {"dtype": "BF16", "shape": [1099511627776, '
                '1099511627776], "data_offsets": [0, 2417851639229258349412352]}}',
                bytes(16),
            ),
            "model.safetensors is truncated: its tensors end at data byte "
            "2417851639229258349412352, the file holds 16",
        ),
        (
            "draft/model.safetensors",
            _alias_second_layer_norm,
            r"layers.1.input_layernorm.weight: data offsets \[\d+, \d+\] in "
            ".* overlap the tensor before",
        ),
        (
            "draft/model.safetensors",
            _safetensors(
                '{"fc.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                '"final_norm.weight": {"dtype": "F32", "shape": [1], '
                '"data_offsets": [8, 12]}}',
                bytes(12),
            ),
            r"final_norm.weight: data offsets \[8, 12\] in .* leave a gap",
        ),
        (
            "draft/model.safetensors",
            _append(bytes(4)),
            "model.safetensors is not a safetensors file: 4 bytes after its last",
        ),
        (
            "draft/model.safetensors",
            _safetensors(
                '{"fc.weight": {"dtype": "F32", "shape": [1180591620717411303424, '
                '0], "data_offsets": [0, 0]}}'
            ),
            r"fc.weight: shape \[1180591620717411303424, 0\] in .* is too large",
        ),
        (
            "target/model-00002-of-00002.safetensors",
            _remove,
            "cannot read .*model-00002-of-00002.safetensors",
        ),
        (
            "target/model.safetensors.index.json",
            _write("{"),
            "cannot read .*model.safetensors.index.json",
        ),
    ],
)
def test_unreadable_checkpoint_files_are_refused_in_one_line(
    tmp_path, caplog, relative, damage, reason
):
    draft, target = write_checkpoints(tmp_path, "dflash")
    damage(tmp_path / relative)
    assert re.search("Refusing to serve: .*" + reason, refusal(caplog, draft, target))


def test_a_target_directory_without_search_permission_is_refused_in_one_line(
    tmp_path,
):
    """The server program, as an operator runs it (root reads through file
    permissions unless it drops the capabilities that let it)."""
    draft, target = write_checkpoints(tmp_path, "dflash")
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    if os.geteuid() != 0:
        drop = []
    elif shutil.which("setpriv") is None:
        pytest.skip("root without setpriv reads any directory")
    command = [
        *drop,
        sys.executable,
        "-m",
        "vllm.entrypoints.k3_dspark_standalone",
        *("--engine", "production", "--device", "cpu", "--window-size", "64"),
        *("--draft-model", str(draft), "--target-model", str(target)),
        *("--address", f"ipc://{tmp_path}/draft.ipc"),
        *("--status-port", str(free_tcp_port())),
    ]
    target.chmod(0)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    finally:
        target.chmod(0o755)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "ERROR" in line]
    index = target / "model.safetensors.index.json"
    assert line.endswith(f"Refusing to serve: cannot read {index}: Permission denied")


@pytest.mark.parametrize(
    "override, reason",
    [
        ({"hidden_size": None}, "hidden_size must be a positive integer, not None"),
        ({"vocab_size": "1024"}, "vocab_size must be a positive integer, not '1024'"),
        ({"intermediate_size": 0}, "intermediate_size must be a positive integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer"),
        ({"num_key_value_heads": 1.5}, "num_key_value_heads must be a positive"),
        ({"rms_norm_eps": None}, "rms_norm_eps must be a positive finite number"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive finite number"),
        ({"rms_norm_eps": True}, "rms_norm_eps must be a positive finite number"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive finite"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive finite number"),
        ({"rope_theta": "1e4"}, "rope_theta must be a positive finite number"),
        ({"rope_theta": float("inf")}, "rope_theta must be a positive finite"),
        (
            {"rope_parameters": {"rope_theta": -1.0}},
            "rope_theta must be a positive finite number, not -1.0",
        ),
        (
            {"architectures": ["Qwen3DSparkModel"], "markov_rank": 16.0},
            "markov_rank must be a positive integer, not 16.0",
        ),
        (
            {
                "architectures": ["Qwen3DSparkModel"],
                "markov_rank": 16,
                "dspark_draft_topk": 0,
            },
            "dspark_draft_topk must be a positive integer, not 0",
        ),
        (
            {
                "architectures": ["Qwen3DSparkModel"],
                "markov_rank": 16,
                "dspark_draft_topk": 257,
            },
            "draft_topk 257 needs a DSpark draft and must be positive and at most",
        ),
        ({"dflash_config": [1]}, "config.json"),
        ({"dflash_config": {"target_layer_ids": ["a"]}}, "config.json"),
    ],
)
def test_malformed_config_values_are_refused_in_one_line(
    tmp_path, caplog, override, reason
):
    draft, target = write_checkpoints(tmp_path, "dflash", **override)
    message = refusal(caplog, draft, target)
    assert message.startswith("Refusing to serve: ") and reason in message


def test_a_layer_tensor_of_another_shape_is_refused_in_one_line(tmp_path, caplog):
    draft, target = write_checkpoints(tmp_path, "dflash")
    tensors = load_file(str(draft / "model.safetensors"))
    name = "layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(draft / "model.safetensors"))
    assert refusal(caplog, draft, target) == (
        f"Refusing to serve: {name} has shape [15, 16], expected [16, 16]"
    )


@pytest.mark.parametrize(
    "override",
    [
        {"partial_rotary_factor": 0.5},
        {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    ],
)
def test_partial_rotary_embeddings_rotate_the_fraction_upstream_rotates(
    tmp_path, override
):
    draft, _ = write_checkpoints(tmp_path, "dflash", **override)
    shape = DraftCheckpoint.from_dir(draft).shape
    assert shape.rotary_dim == shape.head_dim // 2


def test_unscaled_rope_is_made_longer_than_the_configs_max_positions(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash", max_position_embeddings=64)
    checkpoint = DraftCheckpoint.from_dir(draft)
    table = checkpoint.rope_table(LIMITS.max_model_len)
    assert table.shape == (LIMITS.max_model_len, checkpoint.shape.head_dim)
    # The same function of the position: upstream's own rows first.
    assert torch.equal(table[:64], checkpoint.rope.cos_sin_cache)
    assert not torch.equal(table[64:128], table[:64])


def test_scaled_rope_shorter_than_the_model_length_is_refused(tmp_path):
    scaling = {"rope_type": "linear", "factor": 2.0}
    draft, target = write_checkpoints(
        tmp_path, "dflash", rope_scaling=scaling, max_position_embeddings=64
    )
    # Linear scaling's table covers factor x max_position_embeddings.
    with pytest.raises(CheckpointError, match="covers 128 positions.* 4096"):
        cpu_engine(draft, target)


def write_reduced_vocabulary(draft: Path, ids: torch.Tensor) -> None:
    """Give the draft an LM head of ``len(ids)`` rows drafting vocabulary
    ``ids`` (as upstream's d2t offsets) and say so in its config."""
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn(len(ids), REFERENCE["dflash"].hidden_size)
    tensors["d2t"] = ids - torch.arange(len(ids))
    save_file(tensors, str(draft / "model.safetensors"))
    config = json.loads((draft / "config.json").read_text())
    config["draft_vocab_size"] = len(ids)
    (draft / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "ids, reason",
    [
        (torch.tensor([3, 1, 256]), "outside the vocabulary of 256"),
        (torch.tensor([3, -1, 5]), "outside the vocabulary"),
        (torch.tensor([3, 7, 3]), "two draft ids to one vocabulary id"),
    ],
)
def test_a_draft_to_target_map_off_the_vocabulary_is_refused(tmp_path, ids, reason):
    draft, target = write_checkpoints(tmp_path, "dflash")
    write_reduced_vocabulary(draft, ids)
    engine = cpu_engine(draft, target)
    with pytest.raises(CheckpointError, match=reason):
        engine.load()


def test_a_reduced_vocabulary_without_d2t_drafts_the_first_ids_as_upstream(
    tmp_path,
):
    draft, target = write_checkpoints(tmp_path, "dflash")
    write_reduced_vocabulary(draft, torch.arange(5))
    tensors = load_file(str(draft / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(draft / "model.safetensors"))
    engine = cpu_engine(draft, target)
    engine.load()
    assert torch.equal(engine.w["draft_to_target"], torch.arange(5))


def test_a_d2t_of_another_length_is_refused_by_its_name(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash")
    write_reduced_vocabulary(draft, torch.arange(5))
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"][:4].contiguous()
    save_file(tensors, str(draft / "model.safetensors"))
    engine = cpu_engine(draft, target)
    with pytest.raises(CheckpointError, match=r"d2t must hold one integer per draft"):
        engine.load()


def test_a_reduced_vocabulary_draft_without_its_lm_head_is_refused(tmp_path):
    draft, target = write_checkpoints(tmp_path, "dflash", draft_vocab_size=3)
    engine = cpu_engine(draft, target)
    with pytest.raises(CheckpointError, match="must ship its lm_head"):
        engine.load()


def test_a_draft_vocabulary_above_the_vocabulary_is_refused(tmp_path):
    draft, _ = write_checkpoints(tmp_path, "dflash", draft_vocab_size=257)
    with pytest.raises(CheckpointError, match="draft_vocab_size 257 is above"):
        DraftCheckpoint.from_dir(draft)


def test_dflash_ignores_a_dspark_top_k_as_upstream_does(tmp_path):
    draft, _ = write_checkpoints(tmp_path, "dflash", dspark_draft_topk=4)
    assert DraftCheckpoint.from_dir(draft).shape.draft_topk is None


def test_an_mla_draft_drafts_with_the_targets_heads_though_it_ships_its_own(
    tmp_path,
):
    # Upstream's MLA loader drops the draft's embedding and LM head and
    # shares the target's.
    draft, target = write_checkpoints(tmp_path, "mla")
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.ones(256, 16)
    tensors["lm_head.weight"] = torch.ones(256, 16)
    save_file(tensors, str(draft / "model.safetensors"))
    assert_drafts_as_the_reference(draft, target, "mla")


def test_mla_draft_names_take_no_model_prefix_as_upstreams_loader(tmp_path):
    # Upstream's mapper prefixes every name with "model.": a prefixed name
    # would not load there.
    draft, target = write_checkpoints(tmp_path, "mla")
    tensors = load_file(str(draft / "model.safetensors"))
    save_file(
        {f"model.{name}": value for name, value in tensors.items()},
        str(draft / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match="cannot place"):
        cpu_engine(draft, target).load()


def test_an_mla_config_is_read_with_upstreams_defaults(tmp_path):
    # K3DSparkConfig's RoPE base when the file has none.
    draft, _ = write_checkpoints(tmp_path, "mla", rope_theta=None)
    config = json.loads((draft / "config.json").read_text())
    del config["rope_theta"]
    (draft / "config.json").write_text(json.dumps(config))
    assert DraftCheckpoint.from_dir(draft).shape.rope_theta == 50000.0


@pytest.mark.parametrize(
    "override, reason",
    [
        # Upstream's MLA draft has no gathered Markov bias.
        ({"dspark_draft_topk": 8}, "MLA DSpark draft checkpoint: dspark_draft_topk"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"sample_from_anchor": False}, "DSpark head: sample_from_anchor false"),
        # Upstream's MLA draft rotates all of qk_rope_head_dim.
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        # A context width other than the one upstream's context_proj reads.
        (
            {"eagle_aux_hidden_state_layer_ids": [1, 3]},
            r"aux layers \[1, 3\], its context_proj reads num_target_layers 3",
        ),
        ({"target_hidden_size": None}, "target_hidden_size must be a positive"),
        # K3DSparkConfig's own refusals.
        ({"mla_use_nope": True}, "upstream cannot read .*mla_use_nope"),
        ({"q_lora_rank": None}, "upstream cannot read .*q_lora_rank=None"),
        ({"draft_vocab_size": 128}, "upstream cannot read .*draft_vocab_size"),
        ({"num_target_layers": 2}, "upstream cannot read .*num_target_layers"),
    ],
)
def test_unsupported_mla_checkpoints_are_refused_with_the_reason(
    tmp_path, override, reason
):
    draft, _ = write_checkpoints(tmp_path, "mla", **override)
    with pytest.raises(CheckpointError, match=reason):
        DraftCheckpoint.from_dir(draft)


def test_an_mla_draft_ignores_the_markov_head_type_as_upstream_does(tmp_path):
    # Upstream's MLA draft builds the vanilla head whatever the config says.
    draft, target = write_checkpoints(tmp_path, "mla", markov_head_type="gated")
    assert_drafts_as_the_reference(draft, target, "mla")


@pytest.mark.parametrize("method", ["dflash", "mla"])
def test_rotary_buffers_in_a_draft_checkpoint_are_dropped_as_upstream_does(
    tmp_path, method
):
    draft, target = write_checkpoints(tmp_path, method)
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, str(draft / "model.safetensors"))
    assert_drafts_as_the_reference(draft, target, method)


def test_a_config_error_upstream_words_over_two_lines_is_refused_with_its_reason(
    tmp_path,
):
    # Upstream's message is "Validation error for field 'kv_lora_rank':"
    # and the reason on the next line.
    draft, _ = write_checkpoints(tmp_path, "mla", kv_lora_rank=None)
    with pytest.raises(CheckpointError) as refused:
        DraftCheckpoint.from_dir(draft)
    message = str(refused.value)
    assert "\n" not in message, message
    assert message.endswith("expected int, got NoneType (value: None)"), message
