# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The routed verify forward on a Hopper GPU (``-m gpu``; needs vllm
importable, e.g. the stack's Python carried by ``ci/gpu-carry.sh``).

The real ``TritonMLAMetadataBuilder`` routes a uniform verify step (16 heads,
query_len 4, bf16 and fp8 e4m3 caches, DCP 1 and 2) and the real
``TritonMLAImpl.forward_mqa`` runs it: on the fused kernel, bit for bit as
the kernel called directly with the builder's plan; without DCP, within
bf16 rounding of upstream's unfused path (the same step built with
``VLLM_K3_FUSED_MLA_VERIFY=0``), which under DCP refuses causal multi-token
decode."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from k3_routing import make_builder, make_common, write_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a Hopper GPU",
    ),
]

HEADS = 16
QUERY_LEN = 4
SEQ_LENS = [300, 2000, 4000]
BLOCK = 16
SCALE = 576**-0.5
CASES = [
    (1, torch.bfloat16, 1.0),
    (1, torch.float8_e4m3fn, 0.05),
    (2, torch.bfloat16, 1.0),
    (2, torch.float8_e4m3fn, 0.05),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-mla"))


def _impl(dcp: int) -> Any:
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    impl = object.__new__(TritonMLAImpl)
    impl.scale, impl.kv_lora_rank = SCALE, 512
    impl.dcp_rank, impl.dcp_world_size = dcp - 1, dcp
    impl._sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    return impl


def _step(
    dcp: int, kv_dtype: torch.dtype, k_scale: float
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``common`` of the step, its queries and a random paged cache whose
    values times ``k_scale`` are standard normal (scores as sharp as bf16's)."""
    from vllm.v1.attention.ops import k3_fused_mla_verify as kernel

    local = [kernel.local_kv_len(n, dcp, dcp - 1, 1) for n in SEQ_LENS]
    common = make_common(
        SEQ_LENS,
        [QUERY_LEN] * len(SEQ_LENS),
        BLOCK,
        local_seq_lens=local,
        device="cuda",
    )
    pages = common.block_table_tensor.numel()
    gen = torch.Generator(device="cuda").manual_seed(dcp)
    rows = QUERY_LEN * len(SEQ_LENS)
    q = torch.randn(rows, HEADS, 576, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(pages, BLOCK, 576, generator=gen, device="cuda") / k_scale
    kv = kv.to(kv_dtype)
    return common, q, kv


@pytest.mark.parametrize(("dcp", "kv_dtype", "k_scale"), CASES)
def test_routed_forward_equals_the_kernel_called_with_its_plan(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    dcp: int,
    kv_dtype: torch.dtype,
    k_scale: float,
) -> None:
    from vllm.v1.attention.ops import k3_fused_mla_verify as kernel

    builder = make_builder(
        model_dir, monkeypatch, dcp=dcp, max_num_seqs=4, device="cuda"
    )
    common, q, kv = _step(dcp, kv_dtype, k_scale)
    meta = builder.build(0, common)
    plan = meta.decode.verify_plan
    assert plan is not None and plan.query_len == QUERY_LEN
    scale = torch.tensor([k_scale], device="cuda")
    o, lse = _impl(dcp).forward_mqa(q, kv, meta, SimpleNamespace(_k_scale=scale))
    ref_o, ref_lse = torch.full_like(o, float("nan")), torch.full_like(lse, 7.0)
    rows = q.shape[0]
    kernel.fused_mla_verify_decode(
        q,
        kv,
        meta.decode.block_table,
        torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda"),
        ref_o,
        ref_lse,
        torch.empty(
            kernel.workspace_numel(rows, HEADS, plan.num_kv_splits), device="cuda"
        ),
        query_len=QUERY_LEN,
        sm_scale=SCALE,
        num_kv_splits=plan.num_kv_splits,
        k_scale=scale if kv_dtype == torch.float8_e4m3fn else None,
        dcp_size=dcp,
        dcp_rank=dcp - 1,
        cp_interleave=1,
    )
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, ref_o, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


@pytest.mark.parametrize(("kv_dtype", "k_scale"), [c[1:] for c in CASES if c[0] == 1])
def test_routed_forward_matches_upstream_s_unfused_path(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    kv_dtype: torch.dtype,
    k_scale: float,
) -> None:
    from vllm.v1.attention.backends.mla import k3_fused_verify

    common, q, kv = _step(1, kv_dtype, k_scale)
    layer = SimpleNamespace(_k_scale=torch.tensor([k_scale], device="cuda"))
    builder = make_builder(model_dir, monkeypatch, max_num_seqs=4, device="cuda")
    meta = builder.build(0, common)
    assert meta.decode.verify_plan is not None
    o, lse = _impl(1).forward_mqa(q, kv, meta, layer)
    monkeypatch.setenv("VLLM_K3_FUSED_MLA_VERIFY", "0")
    upstream = make_builder(model_dir, monkeypatch, max_num_seqs=4, device="cuda")
    meta_upstream = upstream.build(0, common)
    assert k3_fused_verify.verify_plan_of(meta_upstream) is None
    ref_o, ref_lse = _impl(1).forward_mqa(q, kv, meta_upstream, layer)
    # Outputs are averages over hundreds of random rows (about 0.05): compare
    # by norm, where a wrong extent or scale errs by order one.
    error = (o.float() - ref_o.float()).norm() / ref_o.float().norm()
    assert error < 1e-2, f"relative error {error:.2e} against upstream"
    torch.testing.assert_close(lse.float(), ref_lse.float(), rtol=1e-2, atol=0)
