# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load layer 5's kernel module and upstream's decode kernel by file path.

The H200 has no vllm package, so neither file can be imported through
``vllm``. The fused kernel imports only torch and triton; upstream's
``triton_decode_attention.py`` needs ``vllm.platforms.current_platform`` and
``vllm.triton_utils``, which are shimmed for the duration of its import only
(any real ``vllm`` modules are restored afterwards).
"""

import importlib.util
import sys
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO_ROOT = Path(__file__).resolve().parents[2]
FUSED_VERIFY_PATH = (
    REPO_ROOT
    / "overlay"
    / "vllm"
    / "v1"
    / "attention"
    / "ops"
    / "k3_fused_mla_verify.py"
)
UPSTREAM_DECODE_PATH = REPO_ROOT / ".upstream" / "triton_decode_attention.py"
_SHIMMED = ("vllm", "vllm.platforms", "vllm.triton_utils")


def load_module(path: Path, name: str) -> types.ModuleType:
    """Execute ``path`` as module ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve their module through sys.modules while executing.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@cache
def load_fused_verify() -> types.ModuleType:
    """The layer-5 kernel module, under a private module name."""
    return load_module(FUSED_VERIFY_PATH, "_k3_fused_mla_verify")


class _CudaPlatform:
    """The part of ``vllm.platforms.current_platform`` the upstream file uses."""

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn


@cache
def load_upstream_decode(path: Path = UPSTREAM_DECODE_PATH) -> types.ModuleType:
    """Upstream's ``triton_decode_attention`` with a two-module vllm shim."""
    package = types.ModuleType("vllm")
    package.__path__ = []
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _CudaPlatform()  # type: ignore[attr-defined]
    triton_utils = types.ModuleType("vllm.triton_utils")
    triton_utils.tl = tl  # type: ignore[attr-defined]
    triton_utils.triton = triton  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in _SHIMMED}
    sys.modules.update(
        {
            "vllm": package,
            "vllm.platforms": platforms,
            "vllm.triton_utils": triton_utils,
        }
    )
    try:
        return load_module(path, "_upstream_triton_decode_attention")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def upstream_num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """``triton_mla._compute_num_kv_splits`` of vLLM 0.33.0 (512 tokens of work
    per split, at most two splits per multiprocessor, a power of two)."""
    ideal = triton.next_power_of_2(max(1, max_seq_len // 512))
    return min(ideal, sm_count * 2)


def make_upstream_verify(
    upstream: types.ModuleType,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_len: int,
    sm_scale: float,
    k_scale: torch.Tensor,
    num_kv_splits: int,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Upstream's unfused path for a uniform causal verify batch.

    Prepares what ``TritonMLAImpl.forward_mqa`` prepares (one decode row per
    query token: block table rows repeated ``query_len`` times, per-row causal
    extents clamped at 0, a ``[rows, H, splits, 513]`` float32 split buffer,
    ``o`` and ``lse`` in the query dtype) and returns a closure that runs only
    ``decode_attention_fwd`` as that method calls it.
    """
    rows, heads = q.shape[0], q.shape[1]
    latent = kv_cache.shape[-1] - 64
    o = torch.zeros(rows, heads, latent, dtype=q.dtype, device=q.device)
    lse = torch.zeros(rows, heads, dtype=q.dtype, device=q.device)
    attn_logits = torch.empty(
        rows, heads, num_kv_splits, latent + 1, dtype=torch.float32, device=q.device
    )
    kv = kv_cache.unsqueeze(2)
    kv_c = kv[..., :latent]
    row_table = block_table.repeat_interleave(query_len, dim=0)
    offsets = torch.arange(
        1 - query_len, 1, device=seq_lens.device, dtype=seq_lens.dtype
    )
    row_lens = (seq_lens.unsqueeze(1) + offsets).flatten().clamp(min=0)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        upstream.decode_attention_fwd(
            q,
            kv,
            kv_c,
            o,
            lse,
            row_table,
            row_lens,
            attn_logits,
            num_kv_splits,
            sm_scale,
            kv_cache.shape[1],
            k_scale=k_scale,
            v_scale=k_scale,
            is_mla=True,
        )
        return o, lse

    return run
