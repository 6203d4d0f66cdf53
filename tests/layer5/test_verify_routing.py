# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routing of verify batches through the real ``TritonMLAMetadataBuilder``
(real ``VllmConfig`` of a tiny local MLA model, CPU): routing, plan bucketing,
construction and per-step page-table checks, DCP on and off, and the routed
``forward_mqa`` against the fused kernel called directly (Triton interpreter)."""

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.config")

from k3_routing import LAYER, make_builder, make_common, write_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-mla"))


@pytest.mark.parametrize("dcp", [1, 2])
def test_uniform_verify_batch_is_routed_with_smallest_plan(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, dcp: int
) -> None:
    builder = make_builder(model_dir, monkeypatch, dcp=dcp)
    assert builder.reorder_batch_threshold == 4
    planner = builder.k3_verify
    assert planner.capacities == [1, 2, 4, 8, 12]
    for n, cap in [(1, 1), (3, 4), (5, 8), (9, 12), (12, 12)]:
        meta = builder.build(0, make_common([100] * n, [4] * n, 16))
        plan = meta.decode.verify_plan
        assert plan is not None and plan.capacity == cap and plan.query_len == 4
        assert plan.dcp_size == dcp
        assert plan is planner.plan_for(n, 4)
        assert meta.decode.block_table.shape[0] == n


def test_other_batches_keep_upstream_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = make_builder(model_dir, monkeypatch)
    # single-token decode
    meta = builder.build(0, make_common([50, 60], [1, 1], 16))
    assert getattr(meta.decode, "verify_plan", None) is None
    # a shorter uniform block has its own plans (query_len 2..threshold)
    meta = builder.build(0, make_common([50, 60], [2, 2], 16))
    assert meta.decode.verify_plan.query_len == 2
    # plans exist only for query_len 2..threshold
    assert builder.k3_verify.plan_for(2, 9) is None
    assert builder.k3_verify.plan_for(13, 4) is None
    assert builder.k3_verify.plan_for(0, 4) is None


def test_batch_with_zero_length_padding_keeps_upstream_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A verify request of 4 rows and a zero-length (graph padding) request:
    # 4 tokens over 2 decodes are not 2 rows each.
    builder = make_builder(model_dir, monkeypatch)
    meta = builder.build(0, make_common([100, 100], [4, 0], 16))
    assert meta.num_decodes == 2
    assert getattr(meta.decode, "verify_plan", None) is None


def test_step_page_table_narrower_than_its_kv_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 100 tokens of 16-token pages need 7 pages; the step's table has 6.
    builder = make_builder(model_dir, monkeypatch)
    with pytest.raises(ValueError, match="page table of 6 pages cannot hold"):
        builder.build(0, make_common([100, 100], [4, 4], 16, pages=6))


def test_step_whose_kv_fills_its_page_table_exactly_is_routed(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 96 tokens of 16-token pages fill the step's 6 pages.
    builder = make_builder(model_dir, monkeypatch)
    meta = builder.build(0, make_common([96, 96], [4, 4], 16, pages=6))
    assert meta.decode.verify_plan is not None


def test_step_page_table_narrower_than_its_rank_local_kv_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under DCP 2 rank 0 holds 50 tokens of 100: 4 pages; the step's table has 3.
    builder = make_builder(model_dir, monkeypatch, dcp=2)
    with pytest.raises(ValueError, match="page table of 3 pages cannot hold"):
        builder.build(0, make_common([100, 100], [4, 4], 16, pages=3))


def test_step_at_the_longest_length_under_dcp_is_routed(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP 8, interleave 256: rank 0 owns 1,032 of 8,200 tokens (65 pages of
    # 16; the table has 72), while the common builder bounds a rank's share by
    # ceil(8200 / 2048) x 256 = 1,280 tokens (80 pages).
    builder = make_builder(
        model_dir, monkeypatch, dcp=8, interleave=256, max_model_len=8200
    )
    assert builder.k3_verify.max_pages == 65
    meta = builder.build(0, make_common([8200], [4], 16, pages=72))
    assert meta.decode.verify_plan is not None


def test_not_eligible_without_spec_decode_or_other_dims(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert make_builder(model_dir, monkeypatch, spec_tokens=None).k3_verify is None
    assert make_builder(model_dir, monkeypatch, spec_tokens=8).k3_verify is None
    assert make_builder(model_dir, monkeypatch, kv_lora_rank=256).k3_verify is None
    # DCP without the fused path keeps upstream's threshold of one.
    b = make_builder(model_dir, monkeypatch, spec_tokens=None, dcp=2)
    assert b.reorder_batch_threshold == 1


def test_query_len_8_takes_the_fused_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 7 speculative tokens verify 8 rows a request, the top of 2..8.
    builder = make_builder(model_dir, monkeypatch, spec_tokens=7)
    assert builder.k3_verify is not None
    meta = builder.build(0, make_common([100, 100], [8, 8], 16))
    assert meta.decode.verify_plan.query_len == 8


def test_non_causal_layer_keeps_the_upstream_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A layer drafting non-causal blocks (DFlash-style) gets no planner, and
    # its non-causal steps never take the causal fused kernel.
    from vllm.v1.attention.backends.mla import k3_fused_verify

    builder = make_builder(model_dir, monkeypatch, non_causal=True)
    assert builder.k3_verify is None
    common = make_common([100, 100], [4, 4], 16)
    common.causal = False
    assert k3_fused_verify.verify_plan_of(builder.build(0, common)) is None


def test_adaptive_verification_keeps_the_upstream_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Adaptive verification trims drafts on the device: a step whose host
    # query lengths are even ([3, 3]) runs rows [2, 4], which the fused
    # kernel would give to the wrong requests. Under DCP verify rows stay
    # prefills (threshold 1), as upstream runs them.
    from vllm.v1.attention.backends.mla import k3_fused_verify

    builder = make_builder(model_dir, monkeypatch, adaptive_verification=True)
    assert builder.k3_verify is None
    common = make_common([100, 100], [3, 3], 16)
    common.query_start_loc = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert k3_fused_verify.verify_plan_of(builder.build(0, common)) is None
    builder = make_builder(model_dir, monkeypatch, dcp=2, adaptive_verification=True)
    assert builder.k3_verify is None and builder.reorder_batch_threshold == 1


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0), None])
def test_devices_other_than_hopper_keep_the_upstream_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capability: Any
) -> None:
    # Ampere/Ada shared memory does not hold the default tilings; other
    # architectures and platforms (ROCm, XPU, CPU) are not proven.
    builder = make_builder(model_dir, monkeypatch, capability=capability)
    assert builder.k3_verify is None
    meta = builder.build(0, make_common([100, 100], [4, 4], 16))
    assert getattr(meta.decode, "verify_plan", None) is None


@pytest.mark.parametrize(
    "env", [{"VLLM_K3_FUSED_MLA_VERIFY": "0"}, {"VLLM_BATCH_INVARIANT": "1"}]
)
def test_switch_off_and_batch_invariance_keep_the_upstream_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert make_builder(model_dir, monkeypatch).k3_verify is None


def test_the_switch_does_not_change_compile_factors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel the attention op runs for verify rows is not traced: turning
    the fused path off recompiles nothing."""
    from vllm import envs

    monkeypatch.delenv("VLLM_K3_FUSED_MLA_VERIFY", raising=False)
    before = envs.compile_factors()
    monkeypatch.setenv("VLLM_K3_FUSED_MLA_VERIFY", "0")
    assert envs.compile_factors() == before


def test_a_malformed_switch_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_K3_FUSED_MLA_VERIFY", "yes")
    with pytest.raises(ValueError, match="VLLM_K3_FUSED_MLA_VERIFY"):
        make_builder(model_dir, monkeypatch)


def test_dcp_verify_batches_are_decodes_on_the_fused_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = make_builder(model_dir, monkeypatch, dcp=4, interleave=16)
    meta = builder.build(0, make_common([100, 200], [4, 4], 16))
    assert meta.num_decodes == 2 and meta.decode.verify_plan is not None
    assert meta.decode.dcp_tot_seq_lens.tolist() == [100, 200]


@pytest.mark.parametrize(
    ("max_model_len", "needs"),
    [
        # Rank 0 owns 128 + 76 tokens of 1100: 13 pages of 16.
        (1100, 13),
        # Rank 0 owns 128 + 20 tokens of 1044: 10 pages, one more than the table.
        (1044, 10),
    ],
)
def test_page_table_narrower_than_local_span_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, max_model_len: int, needs: int
) -> None:
    # DCP 8, interleave 128 > page 16 with no alignment slack: the table has
    # cdiv(max_model_len, 128) = 9 pages.
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    monkeypatch.setattr(
        MLAAttentionSpec, "block_table_token_alignment", property(lambda s: None)
    )
    with pytest.raises(ValueError, match=f"page table holds 9 pages.*needs {needs}"):
        make_builder(
            model_dir, monkeypatch, dcp=8, interleave=128, max_model_len=max_model_len
        )


def test_long_context_with_many_sequences_builds(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's default 256 sequences at 128K under DCP 4: every plan's workspace
    # is small (few splits at large capacities).
    planner = make_builder(
        model_dir, monkeypatch, dcp=4, max_model_len=131072, max_num_seqs=256
    ).k3_verify
    assert planner is not None and planner.capacities[-1] == 256
    assert planner.plans[4][-1].num_kv_splits == 1


@pytest.mark.parametrize("max_num_seqs", [1, 12])
def test_every_plan_fits_the_workspace_the_backend_reserves(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, max_num_seqs: int
) -> None:
    # One sequence of up to 4096 tokens: the kernel's own split choice would
    # take 16 splits; the backend reserves for 8. The reservation is locked
    # as after warmup, so a plan needing more raises.
    from vllm.v1.attention.backends.mla import triton_mla
    from vllm.v1.attention.ops import k3_fused_mla_verify as kernel
    from vllm.v1.worker import workspace

    # Without a GPU driver vllm sees Triton's placeholder; the reservation's
    # split count needs the real module, as on the GPU machine.
    monkeypatch.setattr(triton_mla, "triton", kernel.triton)
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        builder = make_builder(model_dir, monkeypatch, max_num_seqs=max_num_seqs)
        workspace.lock_workspace()
        heads = builder.num_heads * builder.dcp_world_size
        for plans in builder.k3_verify.plans.values():
            for plan in plans:
                rows = plan.capacity * plan.query_len
                numel = kernel.workspace_numel(rows, heads, plan.num_kv_splits)
                workspace.current_workspace_manager().get_simultaneous(
                    ((numel,), torch.float32)
                )
    finally:
        workspace.reset_workspace_manager()


def test_row_capacity_is_checked_at_construction(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.attention.backends.mla import k3_fused_verify

    planner = make_builder(model_dir, monkeypatch).k3_verify
    assert planner.max_num_seqs * planner.max_query_len == 48
    with pytest.raises(ValueError, match="max_num_seqs 65536 exceeds"):
        k3_fused_verify.FusedVerifyPlanner(
            SimpleNamespace(
                scheduler_config=SimpleNamespace(max_num_seqs=1 << 16),
                model_config=SimpleNamespace(max_model_len=4096),
            ),
            SimpleNamespace(block_size=16),
            num_heads=128,
            max_query_len=8,
            dcp_size=1,
            cp_interleave=1,
            sm_count=132,
            max_splits=8,
        )


def test_rocm_reporting_hopper_capability_keeps_the_upstream_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MI300 reports capability 9.4 but is no CUDA device.
    builder = make_builder(model_dir, monkeypatch, capability=(9, 4), is_cuda=False)
    assert builder.k3_verify is None


def test_eligibility_reads_the_builders_own_device(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Hopper device 0 beside an Ampere device 1: device 1's builder is not
    # eligible.
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla import k3_fused_verify

    config = make_builder(model_dir, monkeypatch).vllm_config
    monkeypatch.setattr(
        type(current_platform),
        "get_device_capability",
        classmethod(
            lambda cls, device_id=0: DeviceCapability(9 if device_id == 0 else 8, 0)
        ),
    )
    eligible = k3_fused_verify.fused_verify_eligible
    assert eligible(config, [LAYER], torch.device("cuda", 0))
    assert not eligible(config, [LAYER], torch.device("cuda", 1))


def test_other_rope_dim_keeps_the_upstream_path(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert make_builder(model_dir, monkeypatch, qk_rope_head_dim=32).k3_verify is None


def test_every_layer_of_the_builder_must_be_eligible(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.attention.backends.mla import k3_fused_verify

    config = make_builder(model_dir, monkeypatch).vllm_config
    ctx = config.compilation_config.static_forward_context
    ctx["other"] = SimpleNamespace(kv_lora_rank=256, qk_rope_head_dim=64)
    device = torch.device("cpu")
    assert k3_fused_verify.fused_verify_eligible(config, [LAYER], device)
    assert not k3_fused_verify.fused_verify_eligible(config, [LAYER, "other"], device)


def _planner(builder: Any, **overrides: Any) -> Any:
    """A planner of ``builder``'s config and spec, 128 heads, no DCP."""
    from vllm.v1.attention.backends.mla import k3_fused_verify

    kwargs = {
        "num_heads": 128,
        "max_query_len": 4,
        "dcp_size": 1,
        "cp_interleave": 1,
        "sm_count": 132,
        "max_splits": 256,
        **overrides,
    }
    return k3_fused_verify.FusedVerifyPlanner(
        builder.vllm_config, builder.kv_cache_spec, **kwargs
    )


@pytest.mark.parametrize("query_len", [1, 9])
def test_planner_for_a_query_len_outside_2_to_8_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, query_len: int
) -> None:
    builder = make_builder(model_dir, monkeypatch)
    with pytest.raises(ValueError, match=f"query_len {query_len} is outside 2..8"):
        _planner(builder, max_query_len=query_len)


def test_max_num_seqs_at_the_kernel_limit_builds(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = make_builder(model_dir, monkeypatch)
    builder.vllm_config.scheduler_config.max_num_seqs = 65535
    assert _planner(builder).capacities[-1] == 65535


def test_power_of_two_max_num_seqs_is_one_capacity(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planner = make_builder(model_dir, monkeypatch, max_num_seqs=8).k3_verify
    assert planner.capacities == [1, 2, 4, 8]


@pytest.mark.parametrize(("dcp", "interleave"), [(1, 1), (4, 16)])
def test_each_plan_splits_the_rank_local_span_for_its_own_geometry(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, dcp: int, interleave: int
) -> None:
    # 128 heads, 16K tokens: the split count differs per capacity and per
    # query_len (heads a tile), and under DCP the rank's span is shorter.
    from vllm.v1.attention.ops import k3_fused_mla_verify as kernel

    builder = make_builder(model_dir, monkeypatch, max_model_len=16384)
    planner = _planner(builder, dcp_size=dcp, cp_interleave=interleave)
    span = kernel.local_kv_len(16384, dcp, 0, interleave)
    for query_len, plans in planner.plans.items():
        for plan in plans:
            want = kernel.choose_num_kv_splits(plan.capacity, 128, query_len, span, 132)
            assert plan.num_kv_splits == want, plan
            assert (plan.dcp_size, plan.cp_interleave) == (dcp, interleave)
    # The checks above tell the geometries apart: the splits differ per
    # capacity, per query_len, and between the local and the global span.
    first = planner.plans[2][0]
    assert len({p.num_kv_splits for p in planner.plans[2]}) > 1
    if dcp == 1:
        assert first.num_kv_splits != planner.plans[4][0].num_kv_splits
    else:
        assert first.num_kv_splits != kernel.choose_num_kv_splits(1, 128, 2, 16384, 132)


def test_builder_plans_count_the_heads_gathered_under_dcp(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 heads a rank x DCP 8 = 32 heads: two head tiles of 16 at query_len 4,
    # which halves the splits that fill the device.
    from vllm.v1.attention.ops import k3_fused_mla_verify as kernel

    planner = make_builder(
        model_dir, monkeypatch, dcp=8, max_model_len=131072
    ).k3_verify
    span = kernel.local_kv_len(131072, 8, 0, 1)
    plan = planner.plan_for(2, 4)
    assert plan.num_kv_splits == kernel.choose_num_kv_splits(2, 32, 4, span, 132)
    assert plan.num_kv_splits != kernel.choose_num_kv_splits(2, 4, 4, span, 132)


@pytest.mark.subprocess_only
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 (set by the next test's subprocess)",
)
def test_routed_forward_equals_direct_kernel_call_interpreted(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl
    from vllm.v1.attention.ops import k3_fused_mla_verify as kernel

    # fp16 stands in for bf16, which the interpreter (numpy) cannot compute.
    # The fp8 e4m3 cache carries a scale other than one: the routed call must
    # hand the kernel the layer's k_scale.
    # The DCP 2 interleave 2 case owns the same counts as interleave 1 but
    # other tokens: the routed call must hand the kernel the interleave.
    cases = [
        (1, torch.float16, 1.0, 1),
        (2, torch.float16, 1.0, 1),
        (2, torch.float16, 1.0, 2),
        (2, torch.float8_e4m3fn, 0.05, 1),
    ]
    for dcp, kv_dtype, k_scale, interleave in cases:
        builder = make_builder(
            model_dir, monkeypatch, dcp=dcp, interleave=interleave, max_num_seqs=4
        )
        seq_lens, qlen = [5, 40], 3
        # Under DCP the step carries this rank's shares as well (the kernel
        # must be given the global lengths).
        local = [kernel.local_kv_len(n, dcp, dcp - 1, interleave) for n in seq_lens]
        assert dcp == 1 or local == [2, 20]
        common = make_common(seq_lens, [qlen] * 2, 16, local_seq_lens=local)
        meta = builder.build(0, common)
        plan = meta.decode.verify_plan
        gen = torch.Generator().manual_seed(dcp)
        heads = 2 * dcp
        q = torch.randn(6, heads, 576, generator=gen).half()
        kv = torch.randn(8, 16, 576, generator=gen).to(kv_dtype)
        impl = object.__new__(TritonMLAImpl)
        impl.scale, impl.dcp_rank, impl.kv_lora_rank = 0.05, dcp - 1, 512
        impl.dcp_world_size = dcp
        layer = SimpleNamespace(_k_scale=torch.tensor([k_scale]))
        # Without DCP the query comes as (latent, rope) halves, as upstream's
        # forward passes it.
        q_in = (q[..., :512], q[..., 512:]) if dcp == 1 else q
        o, lse = impl.forward_mqa(q_in, kv, meta, layer)
        ref_o = torch.empty_like(o)
        ref_lse = torch.empty_like(lse)
        is_fp8 = kv_dtype == torch.float8_e4m3fn
        ws = torch.empty(kernel.workspace_numel(6, heads, plan.num_kv_splits))
        kernel.fused_mla_verify_decode(
            q,
            kv,
            meta.decode.block_table,
            torch.tensor(seq_lens, dtype=torch.int32),
            ref_o,
            ref_lse,
            ws,
            query_len=qlen,
            sm_scale=0.05,
            num_kv_splits=plan.num_kv_splits,
            k_scale=torch.tensor([k_scale]) if is_fp8 else None,
            dcp_size=dcp,
            dcp_rank=dcp - 1,
            cp_interleave=interleave,
        )
        torch.testing.assert_close(o, ref_o, rtol=0, atol=0)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_routed_forward_under_interpreter(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_routed_forward_equals_direct_kernel_call_interpreted",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # Exit code 0 also means "skipped": the routed test must have run.
    assert "1 passed" in proc.stdout, proc.stdout[-3000:]
