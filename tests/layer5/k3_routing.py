# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real ``TritonMLAMetadataBuilder`` of a tiny local MLA model and the
steps it builds, for layer 5's routing tests (CPU and GPU)."""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

TINY_MLA = {
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 1024,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 64,
    "v_head_dim": 16,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
LAYER = "model.layers.0.self_attn.attn"


def write_model_dir(root: Path) -> Path:
    """``root`` holding the tiny MLA model's ``config.json``."""
    (root / "config.json").write_text(json.dumps(TINY_MLA))
    return root


class _Prefill:
    def clone(self) -> "_Prefill":
        return self


def make_builder(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    spec_tokens: int | None = 3,
    dcp: int = 1,
    interleave: int = 1,
    block_size: int = 16,
    max_model_len: int = 4096,
    max_num_seqs: int = 12,
    kv_lora_rank: int = 512,
    capability: tuple[int, int] | None = (9, 0),
    device: str = "cpu",
    non_causal: bool = False,
    qk_rope_head_dim: int = 64,
    is_cuda: bool = True,
    adaptive_verification: bool = False,
) -> Any:
    """The builder of a tiny MLA model on a CUDA device of ``capability``
    (None: a platform other than CUDA), its tensors on ``device``;
    ``non_causal``: the layer drafts non-causal multi-token blocks;
    ``is_cuda=False``: a platform other than CUDA reporting ``capability``
    (ROCm); ``adaptive_verification``: the speculative config's
    ``enable_adaptive_verification``."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAMetadataBuilder
    from vllm.v1.attention.ops.dcp import MLADCPManager
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            dtype="bfloat16",
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    config.scheduler_config.max_num_seqs = max_num_seqs
    config.parallel_config.decode_context_parallel_size = dcp
    config.parallel_config.cp_kv_cache_interleave_size = interleave
    if spec_tokens is not None:
        config.speculative_config = SimpleNamespace(
            num_speculative_tokens=spec_tokens,
            parallel_drafting=False,
            method="x",
            enable_adaptive_verification=adaptive_verification,
        )
    manager = object.__new__(MLADCPManager)
    manager.init_kv_gather = lambda *a, **k: None
    config.compilation_config.static_forward_context[LAYER] = SimpleNamespace(
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=16,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=16,
        prefill_backend=_Prefill(),
        dcp_manager=manager,
        non_causal_multi_token_decode=non_causal,
    )
    monkeypatch.setattr(
        mla_attention,
        "get_dcp_group",
        lambda: SimpleNamespace(world_size=dcp, rank_in_group=0),
    )
    monkeypatch.setattr(
        type(current_platform), "num_compute_units", classmethod(lambda c, d=0: 132)
    )
    monkeypatch.setattr(
        type(current_platform),
        "is_cuda",
        lambda self: is_cuda and capability is not None,
    )
    monkeypatch.setattr(
        type(current_platform),
        "get_device_capability",
        classmethod(
            lambda cls, device_id=0: capability and DeviceCapability(*capability)
        ),
    )
    spec = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.bfloat16,
    )
    return TritonMLAMetadataBuilder(spec, [LAYER], config, torch.device(device))


def make_common(
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    *,
    local_seq_lens: list[int] | None = None,
    pages: int | None = None,
    device: str = "cpu",
) -> Any:
    """A step of global ``seq_lens``; ``local_seq_lens``: this DCP rank's
    shares (default: the global lengths); ``pages``: the block-table width
    (default: the pages of the longest sequence); device tensors on
    ``device``."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    local = seq.clone()
    if local_seq_lens is not None:
        local = torch.tensor(local_seq_lens, dtype=torch.int32)
    if pages is None:
        pages = -(-max(seq_lens) // block_size)
    table = torch.arange(len(seq_lens) * pages, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq.to(device),
        seq_lens_cpu_upper_bound=seq.clone(),
        num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table.view(len(seq_lens), pages).to(device),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=device),
        causal=True,
        dcp_local_seq_lens=local.to(device),
    )
