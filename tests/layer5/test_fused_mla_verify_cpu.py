# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of the fused MLA verification kernel module: argument
validation, workspace sizing, split choice and the DCP length formula. The
kernel's arithmetic is proven on the GPU (test_fused_mla_verify_gpu.py)."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch

triton = pytest.importorskip("triton", reason="the layer-5 kernel module needs triton")

from k3_reference import owner_rank  # noqa: E402  (sibling module)

INTERPRETED_CHECK = Path(__file__).with_name("k3_interpreted_check.py")

H200_SMS = 132


def _args(ops, **overrides):
    """Valid CPU arguments for 2 requests x 4 rows x 16 heads, page 16."""
    num_reqs, query_len, heads, splits = 2, 4, 16, 3
    rows = num_reqs * query_len
    args = {
        "q": torch.zeros(rows, heads, 576, dtype=torch.bfloat16),
        "kv_cache": torch.zeros(8, 16, 576, dtype=torch.bfloat16),
        "block_table": torch.zeros(num_reqs, 4, dtype=torch.int32),
        "seq_lens": torch.zeros(num_reqs, dtype=torch.int32),
        "o": torch.zeros(rows, heads, 512, dtype=torch.bfloat16),
        "lse": torch.zeros(rows, heads),
        "workspace": torch.zeros(ops.workspace_numel(rows, heads, splits)),
        "query_len": query_len,
        "sm_scale": 0.07,
        "num_kv_splits": splits,
    }
    args.update(overrides)
    return args


def _call(ops, **overrides):
    args = _args(ops, **overrides)
    tensors = [args.pop(k) for k in ("q", "kv_cache", "block_table", "seq_lens")]
    tensors += [args.pop(k) for k in ("o", "lse", "workspace")]
    ops.fused_mla_verify_decode(*tensors, **args)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"q": torch.zeros(8, 16, 512, dtype=torch.bfloat16)}, "q must be"),
        ({"q": torch.zeros(8, 16, 576)}, "bfloat16 or float16"),
        ({"q": torch.zeros(6, 16, 576, dtype=torch.bfloat16)}, "q has 6 rows"),
        (
            {"q": torch.zeros(8, 16, 1152, dtype=torch.bfloat16)[:, :, ::2]},
            "contiguous in its last",
        ),
        ({"q": torch.zeros(8, 0, 576, dtype=torch.bfloat16)}, "at least one head"),
        ({"query_len": 0}, "query_len must be"),
        ({"query_len": 17}, "query_len must be"),
        ({"kv_cache": torch.zeros(8, 16, 1, 576, dtype=torch.bfloat16)}, "kv_cache"),
        ({"kv_cache": torch.zeros(8, 16, 576, dtype=torch.float16)}, "must match q"),
        ({"kv_cache": torch.zeros(8, 16, 576, dtype=torch.float8_e4m3fn)}, "k_scale"),
        (
            {
                "kv_cache": torch.zeros(8, 16, 576, dtype=torch.float8_e4m3fn),
                "k_scale": torch.ones(2),
            },
            "k_scale",
        ),
        ({"kv_cache": torch.zeros(8, 0, 576, dtype=torch.bfloat16)}, "kv_cache"),
        ({"block_table": torch.zeros(2, 4, dtype=torch.int64)}, "block_table"),
        ({"block_table": torch.zeros(1, 4, dtype=torch.int32)}, "block_table"),
        # Every other page: the kernel reads a row's pages at stride 1.
        ({"block_table": torch.zeros(2, 8, dtype=torch.int32)[:, ::2]}, "columns"),
        ({"seq_lens": torch.zeros(2, dtype=torch.int64)}, "seq_lens"),
        # Every other length: the kernel reads seq_lens[req] at stride 1.
        ({"seq_lens": torch.zeros(4, dtype=torch.int32)[::2]}, "seq_lens"),
        ({"o": torch.zeros(8, 16, 576, dtype=torch.bfloat16)}, "o must be"),
        ({"o": torch.zeros(8, 16, 512, dtype=torch.int32)}, "floating dtype"),
        ({"lse": torch.zeros(8, 16, dtype=torch.bfloat16)}, "lse must be"),
        ({"lse": torch.zeros(8, 15)}, "lse must be"),
        ({"workspace": torch.zeros(10)}, "workspace"),
        ({"workspace": torch.zeros(2 * 8 * 16 * 3 * 513)[::2]}, "workspace"),
        (
            {"workspace": torch.zeros(8 * 16 * 3 * 513, dtype=torch.float64)},
            "workspace",
        ),
        ({"num_kv_splits": 0}, "num_kv_splits"),
        ({"num_kv_splits": 1025}, "num_kv_splits"),
        ({"sm_scale": float("nan")}, "sm_scale"),
        ({"sm_scale": 0.0}, "sm_scale"),
        ({"dcp_size": 2, "dcp_rank": 2}, "dcp_rank"),
        ({"cp_interleave": 0}, "cp_interleave"),
        ({"num_valid_reqs": torch.tensor([1, 2], dtype=torch.int32)}, "num_valid"),
        ({"num_valid_reqs": torch.tensor([1], dtype=torch.int64)}, "num_valid"),
        ({"o": torch.zeros(8, 16, 512, device="meta")}, "one device"),
    ],
)
def test_invalid_argument_raises_value_error(fused_verify, overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(fused_verify, **overrides)


def test_workspace_one_element_short_is_rejected(fused_verify):
    need = fused_verify.workspace_numel(8, 16, 3)
    with pytest.raises(ValueError, match=f">= {need} elements"):
        _call(fused_verify, workspace=torch.zeros(need - 1))


@pytest.mark.parametrize(("num_reqs", "ok"), [(65535, True), (65536, False)])
def test_one_call_takes_up_to_65535_requests(fused_verify, num_reqs, ok):
    # Meta tensors: shapes without memory. 65535 is CUDA's grid z limit.
    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    args = {
        "q": empty(num_reqs, 1, 576),
        "kv_cache": empty(8, 16, 576),
        "block_table": empty(num_reqs, 4, dtype=torch.int32),
        "seq_lens": empty(num_reqs, dtype=torch.int32),
        "o": empty(num_reqs, 1, 512),
        "lse": empty(num_reqs, 1, dtype=torch.float32),
        "workspace": empty(
            fused_verify.workspace_numel(num_reqs, 1, 1), dtype=torch.float32
        ),
    }
    kwargs = {
        "query_len": 1,
        "sm_scale": 0.1,
        "num_kv_splits": 1,
        "k_scale": None,
        "dcp_size": 1,
        "dcp_rank": 0,
        "cp_interleave": 1,
        "num_valid_reqs": None,
    }
    if ok:
        assert fused_verify._validate(**args, **kwargs) == num_reqs
    else:
        with pytest.raises(ValueError, match="at most 65535"):
            fused_verify._validate(**args, **kwargs)


def test_workspace_numel_counts_partial_outputs_and_lses(fused_verify):
    assert fused_verify.workspace_numel(32, 128, 4) == 32 * 128 * 4 * (512 + 1)


def test_fp8_cache_with_float64_scale_is_rejected(fused_verify):
    with pytest.raises(ValueError, match="k_scale"):
        _call(
            fused_verify,
            kv_cache=torch.zeros(8, 16, 576, dtype=torch.float8_e4m3fn),
            k_scale=torch.tensor([1.0], dtype=torch.float64),
        )


@pytest.mark.parametrize("heads_per_tile", [32, 0])
def test_config_folding_too_many_rows_is_rejected(fused_verify, heads_per_tile):
    config = fused_verify.VerifyKernelConfig(
        heads_per_tile=heads_per_tile, block_n=32, num_warps=8, num_stages=3
    )
    with pytest.raises(ValueError, match="heads_per_tile"):
        _call(fused_verify, config=config)


@pytest.mark.parametrize(
    ("block_n", "num_warps", "num_stages", "use_gluon", "message"),
    [
        (48, 4, 2, False, "block_n"),
        (0, 4, 2, False, "block_n"),
        (32, 4, 0, False, "num_stages"),
        (32, 3, 2, False, "num_warps"),
        (64, 8, 1, True, "buffers"),
        (64, 8, 3, True, "buffers"),
        (32, 8, 5, True, "buffers"),
    ],
)
def test_tiling_the_kernels_cannot_run_is_rejected(
    fused_verify, block_n, num_warps, num_stages, use_gluon, message
):
    config = fused_verify.VerifyKernelConfig(
        heads_per_tile=16,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        use_gluon=use_gluon,
    )
    with pytest.raises(ValueError, match=message):
        _call(fused_verify, config=config)


def test_gluon_tiling_needs_32_or_64_token_tiles(fused_verify):
    config = fused_verify.VerifyKernelConfig(
        heads_per_tile=16, block_n=128, num_warps=8, num_stages=2, use_gluon=True
    )
    with pytest.raises(ValueError, match="Gluon kernel needs block_n 32 or 64"):
        _call(fused_verify, config=config)


@pytest.mark.parametrize(("query_len", "heads"), [(4, 16), (8, 16), (4, 128), (3, 12)])
def test_default_config_takes_the_gluon_kernel_for_64_row_tiles(
    fused_verify, query_len, heads
):
    assert fused_verify.default_config(query_len, heads).use_gluon


@pytest.mark.parametrize(("query_len", "heads"), [(2, 16), (1, 16), (4, 4)])
def test_default_config_keeps_triton_for_fewer_rows(fused_verify, query_len, heads):
    assert not fused_verify.default_config(query_len, heads).use_gluon


def test_gluon_kernel_runs_only_on_gpus(fused_verify):
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert not fused_verify.runs_gluon_kernel(cache, torch.bfloat16, 64)


@pytest.mark.parametrize(("hip", "gluon"), [(None, True), ("6.4", False)])
def test_gluon_kernel_runs_on_hopper_but_not_on_rocm(
    fused_verify, monkeypatch, hip, gluon
):
    """ROCm reports its MI200/MI300 GPUs as capability 9.x, like Hopper."""
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    on_gpu = SimpleNamespace(
        device=torch.device("cuda", 0),
        dtype=cache.dtype,
        shape=cache.shape,
        stride=cache.stride,
        element_size=cache.element_size,
        data_ptr=lambda: 0,
    )
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 4))
    assert fused_verify.runs_gluon_kernel(on_gpu, torch.bfloat16, 64) is gluon


def _on_hopper(monkeypatch, cache, **fields):
    """``cache`` as a Hopper CUDA tensor to the module's dispatch checks."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    view = {
        "device": torch.device("cuda", 0),
        "dtype": cache.dtype,
        "shape": cache.shape,
        "stride": cache.stride,
        "element_size": cache.element_size,
        "data_ptr": lambda: 0,
    }
    return SimpleNamespace(**{**view, **fields})


@pytest.mark.parametrize(
    ("kv_dtype", "block_m", "gluon"),
    [
        (torch.bfloat16, 64, True),
        (torch.float8_e4m3fn, 64, True),
        (torch.float16, 64, False),  # neither the query's dtype nor fp8
        (torch.bfloat16, 32, False),  # fewer than 64 folded rows
    ],
)
def test_gluon_kernel_needs_query_or_fp8_cache_and_64_rows(
    fused_verify, monkeypatch, kv_dtype, block_m, gluon
):
    cache = _on_hopper(monkeypatch, torch.zeros(4, 64, 576, dtype=kv_dtype))
    assert fused_verify.runs_gluon_kernel(cache, torch.bfloat16, block_m) is gluon


@pytest.mark.parametrize(("pages", "addressable"), [(2**25 - 1, True), (2**25, False)])
def test_tma_addresses_fewer_than_2_31_token_rows(
    fused_verify, monkeypatch, pages, addressable
):
    # 2^25 pages of 64 tokens are 2^31 rows, past TMA's int32 coordinates.
    small = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    cache = _on_hopper(monkeypatch, small, shape=torch.Size((pages, 64, 576)))
    assert (fused_verify._tma_box_rows(cache, 64) is not None) is addressable


def test_tma_addresses_a_single_page_of_any_page_stride(fused_verify):
    # One page: its distance to a next page is never used.
    cache = torch.zeros(1, 80, 576, dtype=torch.bfloat16)[:, :64]
    assert fused_verify._tma_box_rows(cache, 64) == 64


@pytest.mark.parametrize(
    ("page_size", "rows"), [(64, 64), (128, 64), (256, 64), (16, 16), (32, 32), (8, 8)]
)
def test_tma_copies_a_tile_or_a_page_whichever_is_shorter(
    fused_verify, page_size, rows
):
    cache = torch.zeros(3, page_size, 576, dtype=torch.bfloat16)
    assert fused_verify._tma_box_rows(cache, 64) == rows


@pytest.mark.parametrize(
    "cache",
    [
        torch.zeros(3, 4, 576, dtype=torch.bfloat16),  # pages under 8 tokens
        torch.zeros(3, 48, 576, dtype=torch.bfloat16),  # 48 does not tile 64
        torch.zeros(3, 96, 576, dtype=torch.bfloat16),  # nor 64 tile 96
        torch.zeros(3, 64, 580, dtype=torch.bfloat16)[:, :, :576],  # 1160 B rows
        torch.zeros(3, 80, 576, dtype=torch.bfloat16)[:, :64],  # pages 80 apart
        torch.zeros(3 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(3, 64, 576),
    ],
    ids=["page4", "page48", "page96", "row-stride", "page-stride", "unaligned"],
)
def test_caches_tma_cannot_address_take_the_triton_kernel(fused_verify, cache):
    assert fused_verify._tma_box_rows(cache, 64) is None
    assert not fused_verify.runs_gluon_kernel(cache, torch.bfloat16, 64)


def test_both_split_kernels_take_the_same_runtime_arguments(fused_verify):
    """One argument tuple feeds either kernel (fused_mla_verify_decode) after
    the query and how each addresses the KV cache: pointer and strides, or
    TMA descriptors."""

    def runtime(kernel) -> list[str]:
        return [
            name
            for i, name in enumerate(kernel.arg_names)
            if i not in kernel.constexprs
        ]

    gluon_args = runtime(fused_verify._gl_verify_split_kernel)
    triton_args = runtime(fused_verify._verify_split_kernel)
    assert gluon_args[:3] == ["q_ptr", "kv_lat_desc", "kv_rope_desc"]
    assert triton_args[:4] == ["q_ptr", "kv_ptr", "stride_kv_page", "stride_kv_token"]
    assert gluon_args[3:] == triton_args[4:]
    assert gluon_args[-1] == "stride_bt_req"


@pytest.mark.parametrize("kv", ["*bf16", "*fp8e4nv"])
@pytest.mark.parametrize(("block_n", "num_buf"), [(64, 2), (32, 4)])
@pytest.mark.parametrize("page_size", [64, 16])
def test_gluon_kernel_compiles_for_hopper(
    fused_verify, block_n, num_buf, kv, page_size
):
    """The installed Triton lowers the Gluon kernel to sm_90 code (offline, no
    GPU needed) within Hopper's shared memory, its tiles copied by TMA a tile
    or a page at a time: Gluon is experimental and its API changes between
    Triton releases."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = fused_verify._gl_verify_split_kernel
    constexprs = {
        "QUERY_LEN": 4,
        "HEADS_PER_TILE": 16,
        "BLOCK_N": block_n,
        "NUM_BUF": num_buf,
        "PAGE_SIZE": page_size,
        "CAUSAL": True,
        "HAS_NUM_VALID": True,
        "IS_FP8": kv == "*fp8e4nv",
        "LATENT": 512,
        "ROPE": 64,
    }
    rows = min(block_n, page_size)
    kv_dtype = gl.float8e4nv if kv == "*fp8e4nv" else gl.bfloat16
    descriptors = {}
    for name, cols in (("kv_lat_desc", 512), ("kv_rope_desc", 64)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], kv_dtype)
        descriptors[name] = f"tensordesc<{kv[1:]}[{rows},{cols}],{layout!r}>"
    pointers = {"q_ptr": "*bf16", "k_scale_ptr": "*fp32"}
    pointers |= {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in descriptors:
            signature[name] = descriptors[name]
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i32")
        else:
            signature[name] = "fp32" if name == "sm_scale_log2" else "i32"
    aligned = [["tt.divisibility", 16]]
    attrs = {
        (i,): aligned
        for i, name in enumerate(kernel.arg_names)
        if name.endswith("_ptr") or name.startswith("stride")
    }
    compiled = triton.compile(
        GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 64),
        options={"num_warps": 4},
    )
    assert 0 < compiled.metadata.shared <= 227 * 1024
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]


@pytest.mark.parametrize("dcp_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("interleave", [1, 2, 16, 64])
def test_local_kv_len_counts_the_tokens_a_rank_owns(fused_verify, dcp_size, interleave):
    positions = torch.arange(3 * dcp_size * interleave + 5)
    owners = owner_rank(positions, dcp_size, interleave)
    for rank in range(dcp_size):
        owned_before = torch.cumsum(owners == rank, 0)
        for length in range(len(positions) + 1):
            expected = int(owned_before[length - 1]) if length else 0
            got = fused_verify.local_kv_len(length, dcp_size, rank, interleave)
            assert got == expected, (length, dcp_size, rank, interleave)


@pytest.mark.parametrize("query_len", range(1, 17))
@pytest.mark.parametrize("heads", [1, 5, 12, 16, 96, 128])
def test_default_config_covers_heads_within_the_row_budget(
    fused_verify, query_len, heads
):
    config = fused_verify.default_config(query_len, heads)
    tiles = fused_verify.num_head_tiles(heads, config)
    assert tiles * config.heads_per_tile >= heads
    assert (tiles - 1) * config.heads_per_tile < heads
    assert query_len * config.heads_per_tile <= 64


@pytest.mark.parametrize("query_len", range(1, 17))
@pytest.mark.parametrize("heads", [12, 16, 96, 128])
def test_default_config_balances_the_head_tiles(fused_verify, query_len, heads):
    # The last tile is at most one head short of the others: no tile of
    # mostly masked rows.
    config = fused_verify.default_config(query_len, heads)
    tiles = fused_verify.num_head_tiles(heads, config)
    assert tiles * config.heads_per_tile - heads < tiles


@pytest.mark.parametrize("num_reqs", [1, 2, 8, 32, 256])
@pytest.mark.parametrize("heads", [16, 128])
def test_split_choice_fills_at_most_one_wave(fused_verify, num_reqs, heads):
    splits = fused_verify.choose_num_kv_splits(num_reqs, heads, 4, 131_072, H200_SMS)
    config = fused_verify.default_config(4, heads)
    programs = num_reqs * fused_verify.num_head_tiles(heads, config)
    assert splits >= 1
    assert programs * splits <= max(programs, H200_SMS)
    assert programs * (splits + 1) > H200_SMS


def test_short_contexts_get_fewer_splits(fused_verify):
    assert fused_verify.choose_num_kv_splits(1, 16, 4, 1024, H200_SMS) == 4
    # No split of fewer than 256 tokens: 1023 tokens take 3.
    assert fused_verify.choose_num_kv_splits(1, 16, 4, 1023, H200_SMS) == 3
    assert fused_verify.choose_num_kv_splits(1, 16, 4, 100, H200_SMS) == 1


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


# Triton < 3.8's interpreter turns loop bounds into int(ndarray), which NumPy
# >= 2.5 refuses for the 1-element arrays that loaded scalars are.
_interpreter_works = pytest.mark.skipif(
    _release(triton.__version__) < (3, 8) and _release(numpy.__version__) >= (2, 5),
    reason="Triton < 3.8's interpreter cannot run with NumPy >= 2.5",
)


def _interpreted_check(*args: str) -> subprocess.CompletedProcess:
    """``k3_interpreted_check.py ARGS`` in a fresh process: the interpreter
    must be switched on before triton is imported."""
    return subprocess.run(
        [sys.executable, str(INTERPRETED_CHECK), *args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


@_interpreter_works
@pytest.mark.parametrize("splits", [3, 20])
@pytest.mark.parametrize("kv_dtype", ["float16", "float8_e4m3fn"])
def test_interpreted_kernel_matches_float64_reference(kv_dtype, splits):
    """The kernels' index and mask logic under Triton's CPU interpreter.
    20 splits: the merge runs in column blocks, most splits see nothing."""
    result = _interpreted_check(kv_dtype, str(splits))
    assert result.returncode == 0, result.stdout + result.stderr


@_interpreter_works
@pytest.mark.parametrize("splits", [1, 3, 20])
def test_interpreted_kernel_propagates_nan_in_visible_kv(splits):
    """A NaN in a request's visible KV gives NaN outputs and LSEs for its rows,
    not an empty or finite result (fp16 KV: the interpreter reads e4m3's NaN
    byte as 480; the GPU tests cover fp8)."""
    result = _interpreted_check("float16", str(splits), "nan")
    assert result.returncode == 0, result.stdout + result.stderr
