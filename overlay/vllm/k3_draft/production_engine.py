# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Production draft engine: a DFlash or DSpark checkpoint served by the torch
draft engine (``reference_engine.TorchDraftEngine``).

The draft checkpoint is a Qwen3 draft that upstream's ``qwen3_dflash.py`` /
``qwen3_dspark.py`` load, or Kimi-K3's MLA DSpark draft that
``models/kimi_k3/nvidia/dspark_mla.py`` loads (``config.json`` plus
safetensors, optionally with ``model.safetensors.index.json``). Upstream's own
config helpers resolve the parallel-drafting (mask) token id and the target's
aux layers, which set the context width (target hidden size x aux layers).
Embedding and LM head that the draft does not ship are read from the target
checkpoint through its safetensors index, as bf16; every file either
checkpoint names must resolve to a path under that checkpoint's root (or, for
a snapshot in huggingface_hub's cache, to a blob of its repository).

Supported: full or sliding-window, non-causal or causal attention per layer
over the window, with or without attention sinks, resolved from the config as
upstream's DFlash decoder layer resolves them (``_layer_attention``),
neox or interleaved RoPE, whole or partial, unscaled or with any scaling
whose upstream embedding is a plain cosine/sine table (``_upstream_rope``:
its table is the engine's), attention biases, the full or a reduced draft
vocabulary (``draft_vocab_size`` with ``d2t``; the draft ships its LM head),
``logit_scale``, ``dflash_config.attention_value_scale``, DFlash's separate
mask embedding (``mask_embedding.pt``), DSpark with ``sample_from_anchor``
and a vanilla Markov head (on every logit or on ``dspark_draft_topk``).
The MLA draft (``K3DSparkModel``) is read through upstream's
``K3DSparkConfig`` (its defaults and its own refusals) and always drafts with
the target's embedding and LM head, as upstream shares them; its RoPE is
upstream's table for any scaling, applied interleaved as upstream's fused MLA
kernels apply it, and DeepSeek YaRN scales its softmax; its MLP is SiLU or
Kimi's SiTU. Other variants are refused with the reason at start-up rather
than served wrongly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from vllm.k3_draft.engine import DraftLimits
from vllm.k3_draft.log import init_logger
from vllm.k3_draft.reference_engine import (
    DraftShape,
    LatentAttention,
    TorchDraftEngine,
)

logger = init_logger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
MASK_EMBEDDING_FILE = "mask_embedding.pt"
# Bytes a torch.save file adds to its values (zip entries, pickle).
_MASK_EMBEDDING_FILE_SLACK = 64 << 10
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
}
# Draft architectures (upstream registry names) -> method.
DRAFT_ARCHITECTURES = {
    "DFlashDraftModel": "dflash",
    "MuseGlimmerAssistantModel": "dflash",
    "DFlashMuseGlimmerAssistantModel": "dflash",
    "Qwen3DSparkModel": "dspark",
    "Qwen3OmniDSparkModel": "dspark",
    "K3DSparkModel": "dspark",
}
# Drafts with multi-head latent attention.
LATENT_ARCHITECTURES = frozenset({"K3DSparkModel"})
# The MLP activations upstream's MLA draft (``KimiMLP``) builds.
LATENT_ACTIVATIONS = ("silu", "situ")
# Qwen3-Omni targets keep their text model under ``thinker.``.
TARGET_EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "thinker.model.embed_tokens.weight",
)
TARGET_LM_HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
    "thinker.lm_head.weight",
)
# Per method, tensors upstream's loader skips (the target-to-draft
# vocabulary map) or loads without drafting with them (DSpark's confidence
# head), by substring as upstream matches them.
# Every loader drops the rotary buffers some trainers save.
_ROTARY_BUFFERS = (
    "rotary_pos_emb.inv_freq",
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)
_SKIPPED_WEIGHTS = {
    "dflash": ("t2d", *_ROTARY_BUFFERS),
    "dspark": ("t2d", "confidence_head", *_ROTARY_BUFFERS),
}
# The MLA draft's loader drops its confidence head (or loads it without
# drafting with it) and any embedding or LM head: the target's are shared.
_LATENT_SKIPPED_WEIGHTS = (
    "confidence_head",
    "embed_tokens",
    "lm_head",
    *_ROTARY_BUFFERS,
)
_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "wq_bias",
    "self_attn.k_proj.bias": "wk_bias",
    "self_attn.v_proj.bias": "wv_bias",
    "self_attn.o_proj.bias": "wo_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.attention_sink_bias": "sinks",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_GLOBAL_WEIGHTS = {
    "fc.weight": "fc",
    "hidden_norm.weight": "hidden_norm",
    "norm.weight": "final_norm",
    "embed_tokens.weight": "embed",
    "lm_head.weight": "lm_head",
    "markov_head.markov_w1.weight": "markov_w1",
    "markov_head.markov_w2.weight": "markov_w2",
    # Offsets: the vocabulary id of draft id i is i + d2t[i].
    "d2t": "draft_to_target",
}
_LATENT_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_a_proj.weight": "wq_a",
    "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "wq_b",
    "self_attn.kv_a_proj_with_mqa.weight": "wkv_a",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm",
    "self_attn.kv_b_proj.weight": "wkv_b",
    "self_attn.o_proj.weight": "wo",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_LATENT_GLOBAL_WEIGHTS = {
    "context_proj.weight": "fc",
    "context_norm.weight": "hidden_norm",
    "final_norm.weight": "final_norm",
    "markov_head.markov_w1.weight": "markov_w1",
    "markov_head.markov_w2.weight": "markov_w2",
}
# Checkpoint-name aliases upstream's DFlash loader maps as well.
_ALIASES = (
    ("midlayer.", "layers.0."),
    ("encoder.output_norm_enc.", "hidden_norm."),
    ("encoder.fc.", "fc."),
)


class CheckpointError(ValueError):
    """A checkpoint is malformed, unsupported or escapes its root."""


def confined_path(root: Path, relative: str) -> Path:
    """``root / relative`` resolved (symlinks followed); it must stay under
    ``root``, or, where ``root`` is a snapshot of huggingface_hub's cache
    (``<repo>/snapshots/<revision>``, whose files link to
    ``<repo>/blobs/<hash>``) or a folder in one, be a blob of that
    repository."""
    if os.path.isabs(relative):
        raise CheckpointError(f"{relative} is an absolute path")
    try:
        path = (root / relative).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        # A symlink loop (a RuntimeError before Python 3.13), a NUL byte.
        raise CheckpointError(f"cannot resolve {relative!r} in {root}: {exc}") from None
    if not path.is_relative_to(root) and path.parent not in _hub_blobs(root):
        raise CheckpointError(f"{relative} escapes the checkpoint root {root}")
    return path


def _hub_blobs(root: Path) -> tuple[Path, ...]:
    """``<repo>/blobs`` where ``root`` is a snapshot of huggingface_hub's
    cache or a folder in one (a checkpoint in a subfolder of its repository,
    whose files link to the repository's blobs too)."""
    for snapshot in (root, *root.parents):
        if snapshot.parent.name == "snapshots":
            return (snapshot.parent.parent / "blobs",)
    return ()


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """An ``OSError`` inside becomes a ``CheckpointError`` naming ``path``."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_json(path: Path) -> Any:
    """The JSON document in ``path``; ``CheckpointError`` naming the file if
    it cannot be read or parsed."""
    with _reading(path), open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


class SafetensorsCheckpoint:
    """Tensor name -> file of a safetensors checkpoint directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve(strict=True)
        self._headers: dict[Path, dict[str, Any]] = {}
        index = self.root / SAFETENSORS_INDEX
        with _reading(index):
            # stat() of a root without search permission raises.
            indexed = index.is_file()
        if indexed:
            index = confined_path(self.root, SAFETENSORS_INDEX)
            document = read_json(index)
            weight_map = (
                document.get("weight_map") if isinstance(document, dict) else None
            )
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            files = {name: str(file) for name, file in weight_map.items()}
        else:
            files = self._unindexed_files()
        # Each file resolved once (an index names thousands of tensors).
        paths = {
            file: confined_path(self.root, file)
            for file in dict.fromkeys(files.values())
        }
        self.files = {name: paths[file] for name, file in files.items()}

    def _unindexed_files(self) -> dict[str, str]:
        """Tensor name -> file over every ``*.safetensors`` file of a root
        without an index, as upstream's loader reads such a directory (its
        ``glob.glob`` skips hidden files, e.g. the ``._*`` companions a copy
        from macOS leaves); a name in two files is refused."""
        with _reading(self.root):
            shards = sorted(
                path.name
                for path in self.root.glob("*.safetensors")
                if not path.name.startswith(".")
            )
        if not shards:
            raise CheckpointError(
                f"{self.root} holds neither {SAFETENSORS_INDEX} nor a "
                "*.safetensors file"
            )
        files: dict[str, str] = {}
        for shard in shards:
            path = confined_path(self.root, shard)
            self._headers[path] = self._header(path)
            for name in self._headers[path]:
                if name in files:
                    raise CheckpointError(
                        f"{name} is in both {files[name]} and {shard} of {self.root}"
                    )
                files[name] = shard
        return files

    @staticmethod
    def _header(path: Path) -> dict[str, Any]:
        """Tensor entries of a safetensors file (with ``"data_start"``),
        whose byte ranges tile the data after the header as the safetensors
        library requires (no overlap, no gap, nothing past the file's end or
        after the last tensor)."""
        with _reading(path), open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size > 100 << 20:
                raise CheckpointError(f"{path} has a {size}-byte header")
            raw = f.read(size)
            data_bytes = os.fstat(f.fileno()).st_size - 8 - size
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{path} is not a safetensors file: {exc}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a safetensors file")
        header.pop("__metadata__", None)
        ranges = []
        for name, entry in header.items():
            if not isinstance(entry, dict):
                raise CheckpointError(f"{path} is not a safetensors file ({name})")
            offsets = entry.get("data_offsets")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or any(type(offset) is not int for offset in offsets)
                or not 0 <= offsets[0] <= offsets[1]
            ):
                raise CheckpointError(
                    f"{name}: data offsets {offsets!r} in {path} are not a byte range"
                )
            ranges.append((offsets[0], offsets[1], name))
            entry["data_start"] = 8 + size
        end = 0
        for begin, stop, name in sorted(ranges):
            if begin != end:
                what = "overlap the tensor before" if begin < end else "leave a gap"
                raise CheckpointError(
                    f"{name}: data offsets {[begin, stop]} in {path} {what}"
                )
            end = stop
        if end > data_bytes:
            raise CheckpointError(
                f"{path} is truncated: its tensors end at data byte {end}, "
                f"the file holds {max(data_bytes, 0)}"
            )
        if end < data_bytes:
            raise CheckpointError(
                f"{path} is not a safetensors file: {data_bytes - end} bytes "
                "after its last tensor"
            )
        return header

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return sorted(self.files)

    def load(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on CPU, as stored."""
        path = self.files[name]
        if path not in self._headers:
            self._headers[path] = self._header(path)
        entry = self._headers[path].get(name)
        if entry is None:
            raise CheckpointError(f"{name} is not in {path}")
        stored = entry.get("dtype")
        dtype = _SAFETENSORS_DTYPES.get(stored) if isinstance(stored, str) else None
        if dtype is None:
            raise CheckpointError(f"{name}: unsupported dtype {stored}")
        # ``_header`` checked the offsets: two ints, in order, within the file.
        begin, end = entry["data_offsets"]
        try:
            shape = tuple(int(size) for size in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{name}: malformed entry in {path}") from None
        if any(size < 0 for size in shape):
            raise CheckpointError(f"{name}: negative shape {list(shape)} in {path}")
        if any(size >= 1 << 63 for size in shape):
            # Beyond torch's sizes (an empty tensor has no bytes to check).
            raise CheckpointError(f"{name}: shape {list(shape)} in {path} is too large")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{name}: byte range does not match its shape")
        with _reading(path), open(path, "rb") as f:
            f.seek(entry["data_start"] + begin)
            data = bytearray(f.read(end - begin))
        if len(data) != end - begin:
            raise CheckpointError(f"{name}: {path} is truncated")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).view(shape)


_SLIDING_ATTENTION = "sliding_attention"


def _layer_attention(
    hf_config: Any, num_layers: int
) -> tuple[tuple[int | None, ...], tuple[bool, ...]]:
    """Per layer ``(sliding windows, causal)`` of the Qwen3 draft config vLLM
    reads, as upstream's ``qwen3_dflash._resolve_layer_attention`` resolves
    them: ``dflash_config.use_swa`` slides every layer unless
    ``layer_types`` names sliding ones, the window is
    ``dflash_config.swa_window_size`` or ``sliding_window``; causal is
    ``is_causal``, else ``dflash_config.causal``, else whether the layer
    slides by ``layer_types``."""
    dflash = getattr(hf_config, "dflash_config", None) or {}
    layer_types = getattr(hf_config, "layer_types", None)
    use_swa = bool(dflash.get("use_swa", False))
    if layer_types is not None and len(layer_types) != num_layers:
        raise CheckpointError(
            f"config.json: layer_types has {len(layer_types)} entries for "
            f"{num_layers} layers"
        )
    any_sliding = layer_types is not None and _SLIDING_ATTENTION in layer_types
    window = dflash.get("swa_window_size", getattr(hf_config, "sliding_window", None))
    causal = getattr(hf_config, "is_causal", None)
    if causal is None:
        causal = dflash.get("causal")
    windows: list[int | None] = []
    causal_layers: list[bool] = []
    for i in range(num_layers):
        if layer_types is None or (use_swa and not any_sliding):
            sliding = use_swa
        else:
            sliding = layer_types[i] == _SLIDING_ATTENTION
        if sliding and window is None:
            raise CheckpointError(
                "config.json: sliding attention needs dflash_config.swa_window_size "
                "or sliding_window"
            )
        if sliding and (type(window) is not int or window <= 0):
            raise CheckpointError(
                f"config.json: sliding window {window!r} is not a positive integer"
            )
        windows.append(window if sliding else None)
        if causal is not None:
            causal_layers.append(bool(causal))
        else:
            causal_layers.append(
                layer_types is not None and layer_types[i] == _SLIDING_ATTENTION
            )
    return tuple(windows), tuple(causal_layers)


def _refuse_unsupported(config: dict[str, Any]) -> None:
    dflash = config.get("dflash_config") or {}
    reasons = []
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if config.get("hidden_act", "silu") != "silu":
        reasons.append(f"hidden_act {config.get('hidden_act')!r}")
    if dflash.get("sample_from_anchor"):
        reasons.append("DFlash sample_from_anchor")
    # Defaults differ between config classes: the checkpoint must say.
    if rope.get("rope_theta") is None and config.get("rope_theta") is None:
        reasons.append("no rope_theta")
    if not config.get("head_dim"):
        reasons.append("no head_dim")
    # Upstream reads it from eagle_config updated by dflash_config.
    drafter = {**(config.get("eagle_config") or {}), **dflash}
    if not drafter.get(
        "use_aux_hidden_state", config.get("use_aux_hidden_state", True)
    ):
        reasons.append("drafting without aux hidden states")
    if reasons:
        raise CheckpointError("unsupported draft checkpoint: " + ", ".join(reasons))


def _check_dspark_head(config: dict[str, Any], latent: bool) -> None:
    """Refuses a DSpark head other than upstream's default: anchor-first,
    with a vanilla Markov head (the only one the MLA draft builds, whatever
    its ``markov_head_type``)."""
    reasons = []
    if not config.get("sample_from_anchor", True):
        reasons.append("sample_from_anchor false")
    head = config.get("markov_head_type", "vanilla")
    if not latent and head != "vanilla":
        reasons.append(f"markov_head_type {head!r}")
    if reasons:
        raise CheckpointError(
            "unsupported DSpark head: "
            + ", ".join(reasons)
            + " (anchor-first drafting with a vanilla Markov head only)"
        )


def _custom_op_context() -> contextlib.AbstractContextManager[Any]:
    """The current vLLM config that upstream's ``CustomOp`` layers read when
    they are made (a RoPE module here, on CPU)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu")))


def _upstream_config(root: Path) -> Any:
    """The draft config in ``root`` as vLLM reads it (``get_config``: its
    config class, defaults and checks)."""
    from vllm.transformers_utils.config import get_config

    try:
        return get_config(root, trust_remote_code=False)
    except Exception as exc:  # upstream's config checks, any type
        raise CheckpointError(
            f"upstream cannot read {root / 'config.json'}: {_first_line(exc)}"
        ) from None


def _get_rope(
    head_dim: int,
    max_position: int,
    rope_parameters: dict[str, Any] | None,
    neox: bool,
) -> Any:
    """Upstream's ``get_rope`` in float32 on CPU; ``CheckpointError`` if it
    cannot build the embedding."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope_type = (rope_parameters or {}).get("rope_type", "default")
    try:
        with _custom_op_context():
            return get_rope(
                head_dim,
                max_position=max_position,
                is_neox_style=neox,
                rope_parameters=rope_parameters,
                dtype=torch.float32,
            )
    except Exception as exc:  # a RoPE that needs more than a config to build
        raise CheckpointError(
            f"unsupported draft checkpoint: RoPE {rope_type!r} ({_first_line(exc)})"
        ) from None


def _upstream_rope(hf_config: Any, head_dim: int, neox: bool) -> Any:
    """Upstream's rotary embedding of the Qwen3 draft config ``hf_config``
    as vLLM reads it, built as its DFlash/DSpark attention builds it:
    ``get_rope`` (RoPE parameters standardised) at the config's
    ``max_position_embeddings``. Refused unless it applies its
    ``cos_sin_cache`` as ``RotaryEmbedding`` does (default, linear, dynamic,
    YaRN, Llama 3 scaling and the like), the form the torch engine runs."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    rope_parameters = hf_config.rope_parameters
    rope_type = (rope_parameters or {}).get("rope_type", "default")
    rope = _get_rope(head_dim, hf_config.max_position_embeddings, rope_parameters, neox)
    kind = type(rope)
    if not isinstance(rope, RotaryEmbedding) or any(
        getattr(kind, name) is not getattr(RotaryEmbedding, name)
        for name in dir(RotaryEmbedding)
        if name.startswith("forward")
    ):
        raise CheckpointError(
            f"unsupported draft checkpoint: RoPE {rope_type!r} ({kind.__name__})"
        )
    return rope


def _latent_rope(hf_config: Any) -> tuple[Any, float]:
    """Upstream's rotary embedding of an MLA draft and the factor its
    softmax scale takes, as ``MultiHeadLatentAttention`` builds them: a
    scaled RoPE becomes DeepSeek's (Llama-style where ``attention_factor``
    is 1, YaRN otherwise, whose ``mscale`` squared scales the softmax).
    Upstream's fused MLA kernels rotate by its ``cos_sin_cache`` whatever
    its class, interleaved."""
    rope_parameters = dict(hf_config.rope_parameters)
    if rope_parameters["rope_type"] != "default":
        rope_parameters["rope_type"] = (
            "deepseek_llama_scaling"
            if rope_parameters.get("attention_factor") == 1.0
            else "deepseek_yarn"
        )
    rope = _get_rope(
        hf_config.qk_rope_head_dim,
        hf_config.max_position_embeddings,
        rope_parameters,
        neox=False,
    )
    factor = 1.0
    if rope_parameters["rope_type"] == "deepseek_yarn":
        scaling = float(rope_parameters["factor"])
        if scaling > 1:
            mscale_all_dim = float(rope_parameters.get("mscale_all_dim", False))
            mscale = 0.1 * mscale_all_dim * math.log(scaling) + 1.0
            factor = mscale * mscale
    return rope, factor


def _first_line(exc: Exception) -> str:
    """``Type: message`` of ``exc`` on one line: its first (some run on with
    advice), joined with the next where the first only introduces it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = " ".join(lines[:2]) if lines[:1] and lines[0].endswith(":") else ""
    return f"{type(exc).__name__}: {message or (lines or [''])[0]}"


def _config_int(
    config: dict[str, Any], key: str, default: int | None = None, minimum: int = 1
) -> int:
    """``config[key]`` (``default`` when absent or null) as an int of at least
    ``minimum`` (1 or 0)."""
    value = config.get(key)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "positive" if minimum else "non-negative"
        raise CheckpointError(
            f"config.json: {key} must be a {kind} integer, not {value!r}"
        )
    return value


def _config_float(
    config: dict[str, Any], key: str, default: float | None = None
) -> float:
    """``config[key]`` (``default`` when absent) as a positive finite float."""
    value = config.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < math.inf
    ):
        raise CheckpointError(
            f"config.json: {key} must be a positive finite number, not {value!r}"
        )
    return float(value)


def _config_bool(config: dict[str, Any], key: str, default: bool) -> bool:
    """``config[key]`` as a bool: true/false, or 1/0 as some configs write
    it."""
    value = config.get(key, default)
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise CheckpointError(f"config.json: {key} must be true or false, not {value!r}")


@dataclasses.dataclass(frozen=True)
class DraftCheckpoint:
    """A draft checkpoint's architecture, the aux layers it consumes and the
    scales upstream applies to its logits and attention values."""

    root: Path
    architecture: str
    shape: DraftShape
    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int
    logit_scale: float = 1.0
    value_scale: float = 1.0
    # The token whose embedding upstream's DFlash model replaces by
    # mask_embedding.pt (its own mask_token_id; None: the file is unused).
    embedding_mask_token_id: Any = None
    # Upstream's rotary embedding of the draft (``_upstream_rope``).
    rope: Any = dataclasses.field(default=None, compare=False, repr=False)

    def check_rope_covers(self, positions: int) -> None:
        """``CheckpointError`` unless ``rope_table(positions)`` can be made."""
        from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

        covered = self.rope.cos_sin_cache.shape[0]
        if covered < positions and type(self.rope) is not RotaryEmbedding:
            raise CheckpointError(
                f"the draft's scaled RoPE ({type(self.rope).__name__} of its "
                "config.json's max_position_embeddings and RoPE scaling) covers "
                f"{covered} positions, fewer than --max-model-len {positions}"
            )

    def rope_table(self, positions: int) -> torch.Tensor:
        """Upstream's RoPE table of the draft for positions
        ``0..positions-1`` (float32). Beyond the config's
        ``max_position_embeddings`` only unscaled RoPE has one (the same
        function of the position, made longer); otherwise ``CheckpointError``."""
        from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

        self.check_rope_covers(positions)
        rope = self.rope
        if rope.cos_sin_cache.shape[0] < positions:
            with _custom_op_context():
                rope = RotaryEmbedding(
                    rope.head_size,
                    rope.rotary_dim,
                    positions,
                    rope.base,
                    rope.is_neox_style,
                    torch.float32,
                )
        return rope.cos_sin_cache[:positions]

    @classmethod
    def from_dir(cls, root: str | os.PathLike[str]) -> DraftCheckpoint:
        """The checkpoint in ``root``; ``CheckpointError`` naming
        ``config.json`` for a config that is unreadable, malformed or
        unsupported."""
        path = Path(root).resolve(strict=True)
        config_path = confined_path(path, "config.json")
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path} is not a JSON object")
        try:
            return cls._from_config(path, config)
        except CheckpointError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            # A value of the wrong type or range, here or in upstream's
            # config helpers.
            raise CheckpointError(
                f"malformed {config_path}: {type(exc).__name__}: {exc}"
            ) from None

    @classmethod
    def _from_config(cls, path: Path, config: dict[str, Any]) -> DraftCheckpoint:
        # Upstream's resolution of the mask token and of the aux layers.
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
            get_eagle3_aux_layers_from_config,
        )
        from vllm.v1.worker.gpu.spec_decode.utils import (
            get_parallel_drafting_token_id,
        )

        architectures = config.get("architectures") or []
        architecture = next(
            (a for a in architectures if a in DRAFT_ARCHITECTURES), None
        )
        if architecture is None:
            raise CheckpointError(
                f"architectures {architectures} name no supported DFlash/DSpark "
                f"draft ({sorted(DRAFT_ARCHITECTURES)})"
            )
        if architecture in LATENT_ARCHITECTURES:
            return cls._from_latent_config(path, architecture)
        method = DRAFT_ARCHITECTURES[architecture]
        _refuse_unsupported(config)
        if method == "dspark":
            _check_dspark_head(config, latent=False)
        hf_config = SimpleNamespace(**config)
        spec_config = SimpleNamespace(
            draft_model_config=SimpleNamespace(hf_config=hf_config)
        )
        aux_layers = get_eagle3_aux_layers_from_config(spec_config)  # type: ignore[arg-type]
        if not aux_layers:
            raise CheckpointError("the draft config names no target aux layers")
        hidden = _config_int(config, "hidden_size")
        heads = _config_int(config, "num_attention_heads")
        target_hidden = _config_int(config, "target_hidden_size", hidden)
        rope = config.get("rope_parameters") or {}
        theta = rope if rope.get("rope_theta") is not None else config
        # Qwen3Config's default: 32 when absent, the attention heads when null.
        kv_heads = (
            _config_int(config, "num_key_value_heads", heads)
            if "num_key_value_heads" in config
            else 32
        )
        vocab = _config_int(config, "vocab_size")
        draft_vocab = _config_int(config, "draft_vocab_size", vocab)
        if draft_vocab > vocab:
            raise CheckpointError(
                f"config.json: draft_vocab_size {draft_vocab} is above "
                f"vocab_size {vocab}"
            )
        shape = DraftShape(
            method=method,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab if draft_vocab < vocab else None,
            # Upstream's DSpark speculator reads it; DFlash ignores it.
            draft_topk=(
                _config_int(config, "dspark_draft_topk")
                if method == "dspark" and config.get("dspark_draft_topk") is not None
                else None
            ),
            context_width=target_hidden * len(aux_layers),
            hidden_size=hidden,
            num_layers=_config_int(config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_config_int(config, "head_dim"),
            intermediate_size=_config_int(config, "intermediate_size"),
            mask_token_id=get_parallel_drafting_token_id(hf_config),
            markov_rank=_config_int(config, "markov_rank") if method == "dspark" else 0,
            rope_theta=_config_float(theta, "rope_theta"),
            rms_norm_eps=_config_float(config, "rms_norm_eps", 1e-6),
            neox_rope=_config_bool(config, "is_neox_style", True),
            attention_bias=_config_bool(config, "attention_bias", False),
        )
        # After the checks above, which name the offending key.
        hf_config = _upstream_config(path)
        rope = _upstream_rope(hf_config, shape.head_dim, shape.neox_rope)
        if rope.rotary_dim != shape.head_dim:
            shape = dataclasses.replace(shape, rotary_dim=rope.rotary_dim)
        # Upstream's decoder layer reads the value scale, the sink flag and
        # the layers' attention from dflash_config (DSpark's too); a null
        # value scale is no scale.
        dflash = config.get("dflash_config") or {}
        windows, causal = _layer_attention(hf_config, shape.num_layers)
        # dflash_config's flag, else the top-level one; null is no sinks.
        sink_config, sink_key = (
            (dflash, "attention_sink_bias")
            if "attention_sink_bias" in dflash
            else (config, "add_swa_attention_sink_bias")
        )
        shape = dataclasses.replace(
            shape,
            sliding_windows=windows if any(w is not None for w in windows) else (),
            causal_layers=causal if any(causal) else (),
            attention_sinks=sink_config.get(sink_key) is not None
            and _config_bool(sink_config, sink_key, False),
        )
        drafter = {**(config.get("eagle_config") or {}), **dflash}
        value_scale = (
            _config_float(dflash, "attention_value_scale")
            if dflash.get("attention_value_scale") is not None
            else 1.0
        )
        return cls(
            path,
            architecture,
            shape,
            tuple(aux_layers),
            target_hidden,
            logit_scale=_config_float(config, "logit_scale", 1.0),
            value_scale=value_scale,
            embedding_mask_token_id=drafter.get(
                "mask_token_id", config.get("mask_token_id")
            ),
            rope=rope,
        )

    @classmethod
    def _from_latent_config(cls, path: Path, architecture: str) -> DraftCheckpoint:
        """An MLA DSpark draft, read through upstream's config class (its
        defaults for what the file omits, its refusals)."""
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
            get_eagle3_aux_layers_from_config,
        )
        from vllm.v1.worker.gpu.spec_decode.utils import (
            get_parallel_drafting_token_id,
        )

        hf_config = _upstream_config(path)
        config = hf_config.to_dict()
        _check_dspark_head(config, latent=True)
        reasons = []
        if config.get("dspark_draft_topk") is not None:
            # Upstream's MLA draft has no gathered Markov bias.
            reasons.append("dspark_draft_topk")
        if config.get("hidden_act") not in LATENT_ACTIVATIONS:
            reasons.append(f"hidden_act {config.get('hidden_act')!r}")
        if reasons:
            raise CheckpointError(
                "unsupported MLA DSpark draft checkpoint: " + ", ".join(reasons)
            )
        spec_config = SimpleNamespace(
            draft_model_config=SimpleNamespace(hf_config=hf_config)
        )
        aux_layers = get_eagle3_aux_layers_from_config(spec_config)  # type: ignore[arg-type]
        target_layers = _config_int(config, "num_target_layers")
        if not aux_layers or len(aux_layers) != target_layers:
            raise CheckpointError(
                "the draft config names target aux layers "
                f"{list(aux_layers or ())}, its context_proj reads "
                f"num_target_layers {target_layers}"
            )
        target_hidden = _config_int(config, "target_hidden_size")
        heads = _config_int(config, "num_attention_heads")
        geometry = {
            key: _config_int(config, key, minimum=0 if key == "qk_nope_head_dim" else 1)
            for key in (
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
            )
        }
        # After the checks above, which name the offending key.
        rope, softmax_scale_factor = _latent_rope(hf_config)
        if rope.rotary_dim != geometry["qk_rope_head_dim"]:
            raise CheckpointError(
                "unsupported MLA DSpark draft checkpoint: partial_rotary_factor "
                f"(RoPE on {rope.rotary_dim} of qk_rope_head_dim "
                f"{geometry['qk_rope_head_dim']})"
            )
        latent = LatentAttention(**geometry, softmax_scale_factor=softmax_scale_factor)
        shape = DraftShape(
            method=DRAFT_ARCHITECTURES[architecture],
            vocab_size=_config_int(config, "vocab_size"),
            context_width=target_hidden * target_layers,
            hidden_size=_config_int(config, "hidden_size"),
            num_layers=_config_int(config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=latent.qk_head_dim,
            intermediate_size=_config_int(config, "intermediate_size"),
            mask_token_id=get_parallel_drafting_token_id(hf_config),
            markov_rank=_config_int(config, "markov_rank"),
            rope_theta=_config_float(hf_config.rope_parameters, "rope_theta"),
            rms_norm_eps=_config_float(config, "rms_norm_eps"),
            neox_rope=False,
            rotary_dim=latent.qk_rope_head_dim,
            latent=latent,
            # Upstream's draft builds Kimi's SiTU without the config's betas.
            hidden_act=config["hidden_act"],
        )
        return cls(
            path,
            architecture,
            shape,
            tuple(aux_layers),
            target_hidden,
            logit_scale=_config_float(config, "logit_scale", 1.0),
            rope=rope,
        )

    def mask_embedding(self) -> torch.Tensor | None:
        """DFlash's separately trained mask embedding (``mask_embedding.pt``,
        a tensor or ``{"embedding", "mask_token_id"}``), flat; None where
        upstream does not read the file (no file, DSpark, no
        ``mask_token_id`` of the model's own). Anything else about the file
        is a ``CheckpointError``."""
        token = self.embedding_mask_token_id
        if self.shape.method != "dflash" or token is None:
            return None
        if not (self.root / MASK_EMBEDDING_FILE).exists():
            return None
        path = confined_path(self.root, MASK_EMBEDDING_FILE)
        hidden = self.shape.hidden_size
        if type(token) is not int or not 0 <= token < self.shape.vocab_size:
            raise CheckpointError(
                f"{path} is for mask_token_id {token!r}, not a token of the vocabulary"
            )
        with _reading(path):
            size = path.stat().st_size
            if size > 8 * hidden + _MASK_EMBEDDING_FILE_SLACK:
                raise CheckpointError(
                    f"{path} is {size} bytes, more than an embedding of {hidden} "
                    "values takes"
                )
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except OSError:
                raise
            except Exception as exc:  # an untrusted file: any unpickler failure
                raise CheckpointError(
                    f"cannot read {path}: {type(exc).__name__}: {exc}"
                ) from None
        if isinstance(state, dict):
            stated = state.get("mask_token_id", token)
            if type(stated) is not int or stated != token:
                raise CheckpointError(
                    f"{path} is for mask token {stated!r}, the config's is {token}"
                )
            state = state.get("embedding")
        if (
            not isinstance(state, torch.Tensor)
            or state.layout != torch.strided
            or state.device.type != "cpu"
            or not state.is_floating_point()
            or state.numel() != hidden
        ):
            raise CheckpointError(
                f"{path} holds no floating-point embedding of {hidden} values"
            )
        if not torch.isfinite(state).all():
            raise CheckpointError(f"{path} holds values that are not finite")
        return state.reshape(-1)


def _weight_names(latent: bool) -> tuple[dict[str, str], dict[str, str]]:
    """Checkpoint -> engine names of a Qwen3 or (``latent``) an MLA draft:
    the global weights' and, under ``layers.<i>.``, the per-layer ones'."""
    if latent:
        return _LATENT_GLOBAL_WEIGHTS, _LATENT_LAYER_WEIGHTS
    return _GLOBAL_WEIGHTS, _LAYER_WEIGHTS


def _engine_name(
    checkpoint_name: str, num_layers: int, latent: bool
) -> tuple[str, int] | None:
    """(engine weight name, layer or -1) of a draft checkpoint tensor name:
    a Qwen3 draft's (with upstream's aliases) or, if ``latent``, an MLA
    draft's."""
    global_weights, layer_weights = _weight_names(latent)
    name = checkpoint_name
    if not latent:
        name = name.removeprefix("model.")
        for alias, replacement in _ALIASES:
            if name.startswith(alias):
                name = replacement + name[len(alias) :]
    if name in global_weights:
        return global_weights[name], -1
    parts = name.split(".", 2)
    if (
        len(parts) == 3
        and parts[0] == "layers"
        and parts[1].isdigit()
        and parts[2] in layer_weights
    ):
        layer = int(parts[1])
        if 0 <= layer < num_layers:
            return layer_weights[parts[2]], layer
    return None


def _checkpoint_name(engine_name: str, latent: bool, layer: int | None = None) -> str:
    """The draft checkpoint's name of engine weight ``engine_name``, for
    messages: a per-layer one's of ``layer`` (``layers.<i>.`` if None)."""
    global_weights, layer_weights = _weight_names(latent)
    for name, engine in layer_weights.items():
        if engine == engine_name:
            return f"layers.{'<i>' if layer is None else layer}.{name}"
    for name, engine in global_weights.items():
        if engine == engine_name:
            return name
    return engine_name


class ProductionEngine(TorchDraftEngine):
    """A draft checkpoint plus the target's embedding and LM head."""

    def __init__(
        self,
        limits: DraftLimits,
        draft: DraftCheckpoint,
        target_root: str | os.PathLike[str],
        device: torch.device,
        enable_cuda_graph: bool = False,
    ) -> None:
        super().__init__(limits, draft.shape, device, enable_cuda_graph)
        self.draft = draft
        # Before any memory is planned.
        draft.check_rope_covers(limits.max_model_len)
        self.target_root = Path(target_root).resolve(strict=True)

    def load(self) -> None:
        # Read first: a bad file fails before any device memory is taken.
        mask = self.draft.mask_embedding()
        super().load()
        w, draft = self.w, self.draft
        if mask is not None:
            w["embed"][draft.embedding_mask_token_id] = mask
        # Upstream scales V after its projection and every logit (the Markov
        # bias's too): the same as scaling these weights.
        if draft.value_scale != 1.0:
            for name in ("wv", "wv_bias"):
                if name in w:
                    w[name].mul_(draft.value_scale)
        if draft.logit_scale != 1.0:
            for name in ("lm_head", "markov_w2"):
                if name in w:
                    w[name].mul_(draft.logit_scale)

    def rope_table(self) -> torch.Tensor:
        return self.draft.rope_table(self.limits.max_model_len)

    @classmethod
    def from_checkpoints(
        cls,
        limits: DraftLimits,
        draft_dir: str,
        target_dir: str,
        device: torch.device,
        enable_cuda_graph: bool = False,
    ) -> ProductionEngine:
        draft = DraftCheckpoint.from_dir(draft_dir)
        logger.info(
            "Draft %s (%s): %d layers, hidden %d, aux layers %s, context width %d",
            draft.root,
            draft.architecture,
            draft.shape.num_layers,
            draft.shape.hidden_size,
            list(draft.aux_layer_ids),
            draft.shape.context_width,
        )
        return cls(limits, draft, target_dir, device, enable_cuda_graph)

    def host_weights(self) -> dict[str, torch.Tensor]:
        shape = self.shape
        expected = shape.weight_shapes()
        checkpoint = SafetensorsCheckpoint(self.draft.root)
        per_layer: dict[str, list[torch.Tensor | None]] = {}
        weights: dict[str, torch.Tensor] = {}
        unknown = []
        latent = shape.latent is not None
        skipped = _LATENT_SKIPPED_WEIGHTS if latent else _SKIPPED_WEIGHTS[shape.method]
        for name in checkpoint.names():
            mapped = _engine_name(name, shape.num_layers, latent)
            if mapped is None or mapped[0] not in expected:
                if not any(part in name for part in skipped):
                    unknown.append(name)
                continue
            engine_name, layer = mapped
            tensor = checkpoint.load(name)
            if layer < 0:
                weights[engine_name] = tensor
                continue
            layer_shape = expected[engine_name][1:]
            if tuple(tensor.shape) != layer_shape:
                raise CheckpointError(
                    f"{name} has shape {list(tensor.shape)}, "
                    f"expected {list(layer_shape)}"
                )
            slots = per_layer.setdefault(engine_name, [None] * shape.num_layers)
            slots[layer] = tensor
        if unknown:
            # Dropping one (a layer past num_hidden_layers, a bias) could
            # change the draft silently. Upstream refuses most; a bias its
            # model lacks it skips, which is refused here all the same.
            raise CheckpointError(
                f"the draft checkpoint has {len(unknown)} tensors this engine "
                f"cannot place, e.g. {sorted(unknown)[:3]}"
            )
        for engine_name, tensors in per_layer.items():
            lacking = [
                _checkpoint_name(engine_name, latent, i)
                for i, tensor in enumerate(tensors)
                if tensor is None
            ]
            if lacking:
                raise CheckpointError(f"the draft checkpoint lacks {lacking}")
            weights[engine_name] = torch.stack(tensors)  # type: ignore[arg-type]
        missing = {"embed", "lm_head"} - weights.keys()
        if "lm_head" in missing and shape.draft_vocab_size is not None:
            raise CheckpointError(
                "a draft with a reduced vocabulary (draft_vocab_size "
                f"{shape.draft_vocab_size}) must ship its lm_head"
            )
        if missing:
            weights.update(self._target_heads(missing))
        if shape.draft_vocab_size is not None:
            # Without d2t upstream keeps its zero offsets: the first ids.
            offsets = weights.get(
                "draft_to_target",
                torch.zeros(shape.draft_vocab_size, dtype=torch.int64),
            )
            weights["draft_to_target"] = self._vocabulary_ids(offsets)
        absent = sorted(
            _checkpoint_name(name, latent) for name in expected.keys() - weights.keys()
        )
        if absent:
            raise CheckpointError(f"the draft checkpoint lacks {absent}")
        for name, value in weights.items():
            if tuple(value.shape) != expected[name]:
                label = (
                    f"the target's {'embedding' if name == 'embed' else 'LM head'}"
                    if name in missing
                    else _checkpoint_name(name, latent)
                )
                raise CheckpointError(
                    f"{label} has shape {list(value.shape)}, "
                    f"expected {list(expected[name])}"
                )
        return weights

    def _vocabulary_ids(self, offsets: torch.Tensor) -> torch.Tensor:
        """The vocabulary id of each draft id from the checkpoint's ``d2t``
        offsets (zeros where it has none), as upstream maps them; refused
        unless every id is in the vocabulary and no two draft ids share
        one."""
        shape = self.shape
        if offsets.is_floating_point() or offsets.shape != (shape.draft_vocab,):
            raise CheckpointError(
                f"d2t must hold one integer per draft id ({shape.draft_vocab}), "
                f"not {offsets.dtype} {list(offsets.shape)}"
            )
        ids = torch.arange(len(offsets)) + offsets.long()
        if ((ids < 0) | (ids >= shape.vocab_size)).any():
            raise CheckpointError(
                f"d2t maps draft ids outside the vocabulary of {shape.vocab_size}"
            )
        if len(ids.unique()) != len(ids):
            raise CheckpointError("d2t maps two draft ids to one vocabulary id")
        return ids

    def _target_heads(self, missing: set[str]) -> dict[str, torch.Tensor]:
        """Embedding and/or LM head from the target checkpoint, as bf16."""
        target = SafetensorsCheckpoint(self.target_root)
        embed = next((n for n in TARGET_EMBED_NAMES if n in target), None)
        head = next((n for n in TARGET_LM_HEAD_NAMES if n in target), embed)
        names = {"embed": embed, "lm_head": head}
        heads = {}
        for name in sorted(missing):
            source = names[name]
            if source is None:
                raise CheckpointError(f"the target checkpoint has no {name} tensor")
            logger.info("Draft %s from the target's %s", name, source)
            heads[name] = target.load(source).to(torch.bfloat16)
        return heads
