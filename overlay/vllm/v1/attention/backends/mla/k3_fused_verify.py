# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routing of MLA verification batches to the fused verify kernel.

The Triton MLA backend flattens a request's ``query_len`` verify rows into
separate decode rows, so each row re-reads the whole KV, and refuses causal
multi-token decode under DCP. ``k3_fused_mla_verify`` reads each KV tile once
for all rows of a request and computes the rank-local causal extents itself.

Contracts:

- ``fused_verify_eligible``: the builder may take uniform causal verify
  batches of ``query_len`` in ``MIN_QUERY_LEN..MAX_QUERY_LEN`` (also under
  DCP) only on a Hopper CUDA device, with ``VLLM_K3_FUSED_MLA_VERIFY`` on and
  batch invariance off, if the MLA dims are the kernel's (512 latent + 64
  rope) and the speculative decode query length fits that range.
- ``FusedVerifyPlanner`` (one per metadata builder): graph-stable plans per
  power-of-two batch capacity (1, 2, 4, ... plus ``max_num_seqs``); the row
  capacity and the page-table width are checked at construction, errors are
  raised there (``attach`` checks each step's page table again and raises
  rather than drop pages).
- ``FusedVerifyPlanner.attach`` marks a step's decode metadata with the plan
  of the smallest covering capacity, or leaves it unmarked (upstream's path).
- ``forward_fused_verify``: the call into the kernel, ``(o, lse)`` as
  ``forward_mqa`` returns them (``lse`` float32, natural log).
"""

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import vllm.envs as envs
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.ops import k3_fused_mla_verify as kernel
from vllm.v1.worker.block_table import get_block_table_width
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    is_workspace_manager_initialized,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec

logger = init_logger(__name__)

MIN_QUERY_LEN = 2
MAX_QUERY_LEN = 8


@dataclass(frozen=True)
class VerifyPlan:
    """Launch geometry of one batch capacity; depends on no step's data."""

    capacity: int
    """Largest number of decode requests the plan serves."""
    query_len: int
    num_kv_splits: int
    dcp_size: int
    cp_interleave: int


@dataclass
class FusedVerifyDecodeMetadata(MLACommonDecodeMetadata):
    """Decode metadata of a step routed to the fused kernel."""

    verify_plan: VerifyPlan | None = None


def local_span(global_len: int, dcp_size: int, cp_interleave: int) -> int:
    """Largest rank-local share of a global prefix of ``global_len`` tokens."""
    return kernel.local_kv_len(global_len, dcp_size, 0, cp_interleave)


def fused_verify_eligible(
    vllm_config: "VllmConfig", layer_names: list[str], device: torch.device
) -> bool:
    """Whether the builder of ``layer_names`` on ``device`` routes verify
    batches here: ``VLLM_K3_FUSED_MLA_VERIFY`` on, not batch-invariant mode
    (whose verify rows must run the decode kernel), a CUDA device of
    compute capability 9.x, where the kernels are proven (elsewhere their
    tilings may not fit the shared memory, and ROCm reports CUDA devices),
    and no adaptive verification (it trims drafts on the device only, so
    the host's even query lengths that routing reads are not the rows')."""
    from vllm.platforms import current_platform

    if not envs.VLLM_K3_FUSED_MLA_VERIFY or envs.VLLM_BATCH_INVARIANT:
        return False
    device_id = device.index if device.index is not None else 0
    if not (
        current_platform.is_cuda()
        and current_platform.is_device_capability_family(90, device_id)
    ):
        return False
    spec = vllm_config.speculative_config
    if (
        spec is None
        or spec.num_speculative_tokens is None
        or spec.enable_adaptive_verification
    ):
        return False
    from vllm.v1.attention.backend import max_decode_query_len

    if not MIN_QUERY_LEN <= max_decode_query_len(vllm_config) <= MAX_QUERY_LEN:
        return False
    ctx = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        layer = ctx[name]
        if getattr(layer, "non_causal_multi_token_decode", False):
            return False
        if (layer.kv_lora_rank, layer.qk_rope_head_dim) != (
            kernel.KV_LORA_RANK,
            kernel.ROPE_DIM,
        ):
            return False
    return True


class FusedVerifyPlanner:
    """Plans and step routing of one Triton MLA metadata builder."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        kv_cache_spec: "AttentionSpec",
        *,
        num_heads: int,
        max_query_len: int,
        dcp_size: int,
        cp_interleave: int,
        sm_count: int,
        max_splits: int,
    ) -> None:
        """``num_heads`` counts the heads the kernel sees (all-gathered under
        DCP); ``max_splits`` is the split count the backend's workspace
        reservation was sized for. Raises ``ValueError`` if a plan could not
        cover every step the scheduler may produce."""
        if not MIN_QUERY_LEN <= max_query_len <= MAX_QUERY_LEN:
            raise ValueError(
                f"fused MLA verify: query_len {max_query_len} is outside "
                f"{MIN_QUERY_LEN}..{MAX_QUERY_LEN}"
            )
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        max_model_len = vllm_config.model_config.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_query_len = max_query_len
        self.dcp_size = dcp_size
        self.cp_interleave = cp_interleave
        self.page_size = kv_cache_spec.block_size

        # Row capacity: the largest plan must take every decode request the
        # scheduler can put in one step (max_num_seqs x max_query_len rows)
        # in one launch. Its workspace stays within the backend's reservation
        # (rows and splits at most those it was sized for).
        if max_num_seqs > kernel.MAX_NUM_REQS:
            raise ValueError(
                f"fused MLA verify: max_num_seqs {max_num_seqs} exceeds the "
                f"kernel's {kernel.MAX_NUM_REQS} requests per launch; lower "
                "max_num_seqs"
            )

        # Page-table coverage: the worker's row width against the pages of the
        # largest rank-local KV span the model allows.
        span = local_span(max_model_len, dcp_size, cp_interleave)
        self.max_pages = cdiv(span, self.page_size)
        width = get_block_table_width(
            kv_cache_spec.max_num_blocks_per_req(vllm_config, max_model_len),
            kv_cache_spec.block_size,
            token_alignment=kv_cache_spec.block_table_token_alignment,
        )
        if width < self.max_pages:
            raise ValueError(
                f"fused MLA verify: the page table holds {width} pages a "
                f"request, but a rank-local KV span of max_model_len "
                f"{max_model_len} (DCP {dcp_size}, interleave {cp_interleave}) "
                f"needs {self.max_pages} pages of {self.page_size}; pages "
                "would be dropped. Use cp_kv_cache_interleave_size <= "
                "block_size or a larger block size"
            )

        capacities = []
        cap = 1
        while cap < max_num_seqs:
            capacities.append(cap)
            cap *= 2
        capacities.append(max_num_seqs)
        self.capacities = capacities
        self.plans: dict[int, list[VerifyPlan]] = {}
        for qlen in range(MIN_QUERY_LEN, max_query_len + 1):
            plans = []
            for cap in capacities:
                splits = kernel.choose_num_kv_splits(
                    cap, num_heads, qlen, span, sm_count
                )
                # Stay within the workspace upstream reserves.
                splits = max(1, min(splits, max_splits))
                plans.append(
                    VerifyPlan(
                        capacity=cap,
                        query_len=qlen,
                        num_kv_splits=splits,
                        dcp_size=dcp_size,
                        cp_interleave=cp_interleave,
                    )
                )
            self.plans[qlen] = plans
        logger.info_once(
            "Fused MLA verify: query_len %d..%d, capacities %s, DCP %d",
            MIN_QUERY_LEN,
            max_query_len,
            str(capacities),
            dcp_size,
        )

    @classmethod
    def for_builder(
        cls, builder: Any, kv_cache_spec: "AttentionSpec"
    ) -> "FusedVerifyPlanner":
        """The planner of a constructed ``TritonMLAMetadataBuilder``; splits
        are capped where the backend's workspace reservation caps them."""
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.mla import triton_mla

        sm_count = current_platform.num_compute_units()
        max_len = builder.vllm_config.model_config.max_model_len
        max_splits = min(
            kernel.triton.next_power_of_2(
                max(1, max_len // triton_mla._MIN_WORK_PER_SPLIT)
            ),
            sm_count * triton_mla._SPLIT_OCCUPANCY_MULTIPLIER,
        )
        return cls(
            builder.vllm_config,
            kv_cache_spec,
            num_heads=builder.num_heads * builder.dcp_world_size,
            max_query_len=builder.reorder_batch_threshold,
            dcp_size=builder.dcp_world_size,
            cp_interleave=builder.cp_kv_cache_interleave_size,
            sm_count=sm_count,
            max_splits=max_splits,
        )

    def plan_for(self, num_decodes: int, query_len: int) -> VerifyPlan | None:
        """The plan of the smallest capacity covering ``num_decodes``."""
        plans = self.plans.get(query_len)
        if plans is None or not 1 <= num_decodes <= self.max_num_seqs:
            return None
        return plans[bisect.bisect_left(self.capacities, num_decodes)]

    def attach(
        self,
        decode: MLACommonDecodeMetadata,
        query_start_loc_cpu: torch.Tensor,
        num_decode_tokens: int,
        max_seq_len: int,
    ) -> MLACommonDecodeMetadata:
        """Route a step: return ``decode`` marked with its plan when every
        decode request has the same ``query_len`` in range, else unchanged.

        ``max_seq_len`` is the step's largest rank-local KV length (as the
        common builder passes it). Raises ``ValueError`` if the step's page
        table cannot hold it.
        """
        num_decodes = decode.seq_lens.shape[0]
        if num_decodes == 0 or num_decode_tokens % num_decodes:
            return decode
        query_len = num_decode_tokens // num_decodes
        # The common builder keeps decodes uniform, with zero-length graph
        # padding after them; a padded step (too few tokens for its first
        # length) keeps upstream's path when run eagerly. A full CUDA graph
        # captured on a uniform step replays the fused kernel for padded steps
        # too: their padded requests have seq_len 0, read no KV and get
        # zero rows and -inf LSE (defined values for the layers after), which
        # the runner drops.
        if int(query_start_loc_cpu[1] - query_start_loc_cpu[0]) != query_len:
            return decode
        plan = self.plan_for(num_decodes, query_len)
        if plan is None:
            return decode
        width = decode.block_table.shape[1]
        # max_seq_len may round a rank's share up past the largest span a
        # request can have, which construction proved the pages cover.
        if width < min(cdiv(max_seq_len, self.page_size), self.max_pages):
            raise ValueError(
                f"fused MLA verify: page table of {width} pages cannot hold "
                f"a rank-local KV span of {max_seq_len} tokens"
            )
        return FusedVerifyDecodeMetadata(
            block_table=decode.block_table,
            seq_lens=decode.seq_lens,
            dcp_tot_seq_lens=decode.dcp_tot_seq_lens,
            verify_plan=plan,
        )


def verify_plan_of(attn_metadata: Any) -> VerifyPlan | None:
    """The plan a step was routed with, or ``None`` (upstream's path)."""
    if not getattr(attn_metadata, "causal", True):
        return None
    return getattr(attn_metadata.decode, "verify_plan", None)


def forward_fused_verify(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_c_and_k_pe_cache: torch.Tensor,
    decode: MLACommonDecodeMetadata,
    plan: VerifyPlan,
    *,
    sm_scale: float,
    k_scale: torch.Tensor,
    dcp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused verify attention of a routed step: ``(o, lse)`` with ``o``
    ``[rows, heads, 512]`` in the query dtype and ``lse`` float32."""
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    rows, heads = q.shape[0], q.shape[1]
    # The kernel takes global lengths and derives rank-local extents itself.
    seq_lens = decode.seq_lens if plan.dcp_size == 1 else decode.dcp_tot_seq_lens
    assert seq_lens is not None
    o = torch.empty(rows, heads, kernel.KV_LORA_RANK, dtype=q.dtype, device=q.device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device)
    numel = kernel.workspace_numel(rows, heads, plan.num_kv_splits)
    if is_workspace_manager_initialized():
        (workspace,) = current_workspace_manager().get_simultaneous(
            ((numel,), torch.float32)
        )
    else:
        workspace = torch.empty(numel, dtype=torch.float32, device=q.device)
    is_fp8 = kv_c_and_k_pe_cache.dtype == torch.float8_e4m3fn
    kernel.fused_mla_verify_decode(
        q,
        kv_c_and_k_pe_cache,
        decode.block_table,
        seq_lens,
        o,
        lse,
        workspace,
        query_len=plan.query_len,
        sm_scale=sm_scale,
        num_kv_splits=plan.num_kv_splits,
        k_scale=k_scale.float().reshape(1) if is_fp8 else None,
        causal=True,
        dcp_size=plan.dcp_size,
        dcp_rank=dcp_rank,
        cp_interleave=plan.cp_interleave,
    )
    return o, lse
