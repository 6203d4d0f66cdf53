# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Qwen3-style DFlash/DSpark drafts in plain torch (CPU and any CUDA GPU).

``TorchDraftEngine`` runs a ``DraftShape``: the target's aux context rows are
combined (``fc``) into the draft's hidden size, cached, and turned into
per-layer K/V (``hidden_norm``, K/V projections, K norm, RoPE) in the
request's slot blocks; the query block ``[anchor, mask x K]`` (DFlash, K+1
rows, the masks predict) or ``[anchor, mask x (K-1)]`` (DSpark, K rows, each
predicting the next token, then the sequential low-rank Markov head) attends
non-causally to the last ``window`` context positions and to itself. Float32
on CPU, bf16 on CUDA. With CUDA graphs, the query pass of every (batch
bucket, depth) shape is captured (batches padded to the bucket with rows that
attend to no context), and the context pass of every row bucket (rows padded
with rows that write only the context cache's scratch row and the reserved
KV block 0); a RECONNECT's restore runs eagerly.

The attention is grouped-query (Qwen3: per-layer K/V cached per position)
or, for a ``DraftShape`` with ``latent`` geometry, DeepSeek's multi-head latent
attention (Kimi-K3's MLA DSpark draft): per layer and position one latent
``[norm(kv_c) | rope(k_pe)]`` is cached, and the query block attends in latent
space (``q_nope`` absorbed by ``kv_b_proj``'s key half, the output expanded by
its value half), as upstream's MLA decode path runs it.

``ReferenceEngine`` is a small such draft with random weights, deterministic
given the seed: what tests and the GPU qualification drive. The production
engine (``production_engine``) loads real checkpoints into the same code.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vllm.k3_draft.context_cache import ContextCache
from vllm.k3_draft.engine import (
    DraftEngine,
    DraftLimits,
    EngineSpec,
    MemoryPlan,
    ProposeBatch,
    ProposeOutput,
    StepTimer,
    graph_batch_sizes,
    padded_batch_size,
    plan_context,
)
from vllm.k3_draft.log import init_logger

logger = init_logger(__name__)

# Valid-start of padding rows: no context position is attended.
_NO_CONTEXT = 1 << 62
# The most elements a torch tensor counts.
_MAX_NUMEL = 2**63 - 1
# The weight mapping draft ids to vocabulary ids (int64).
_ID_MAP = "draft_to_target"


@dataclass(frozen=True)
class LatentAttention:
    """Geometry of multi-head latent attention (DeepSeek MLA with a q-LoRA):
    queries ``q_b(norm(q_a(h)))`` of ``qk_nope_head_dim + qk_rope_head_dim``
    per head; keys and values from one latent ``kv_c`` (``kv_lora_rank``,
    normed) and one shared RoPE key ``k_pe`` (``qk_rope_head_dim``), expanded
    per head by ``kv_b`` into ``qk_nope_head_dim`` key and ``v_head_dim``
    value dimensions. The softmax scale is ``(qk_nope_head_dim +
    qk_rope_head_dim) ** -0.5`` times ``softmax_scale_factor`` (DeepSeek
    YaRN's ``mscale`` squared)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.qk_nope_head_dim < 0:
            raise ValueError(
                f"qk_nope_head_dim must be non-negative, not {self.qk_nope_head_dim}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even, not {self.qk_rope_head_dim}"
            )
        if not 0 < self.softmax_scale_factor < math.inf:
            raise ValueError("softmax_scale_factor must be positive and finite")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per layer and position: ``[kv_c | k_pe]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DraftShape:
    """Architecture of a DFlash/DSpark draft as the torch engine runs it:
    Qwen3-style grouped-query attention, or multi-head latent attention
    (``latent``). A query row at position p sees the context positions its
    request has in the window, and of its own block every row (non-causal)
    or the rows up to p (causal); a layer with sliding window W sees only
    positions above p - W, as vLLM's attention backends count a window. A
    block that runs e rows past the model length is aligned to end there, as
    the backends align it: for these masks its rows sit e positions earlier."""

    method: str
    vocab_size: int
    context_width: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mask_token_id: int
    # DSpark's low-rank Markov head (0 for DFlash).
    markov_rank: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Neox RoPE (rotated halves); False: interleaved (rotated pairs).
    neox_rope: bool = True
    # Leading dimensions of a head that RoPE rotates (None: the whole head).
    rotary_dim: int | None = None
    # Rows of the LM head and of DSpark's Markov bias when the draft drafts
    # over a subset of the vocabulary, its ids mapped to the vocabulary's by
    # the ``draft_to_target`` weight (None: the whole vocabulary).
    draft_vocab_size: int | None = None
    # DSpark: the Markov bias corrects only each position's top-k base
    # logits, the rest are -inf (None: every logit).
    draft_topk: int | None = None
    # Biases on the Q/K/V and output projections.
    attention_bias: bool = False
    # Multi-head latent attention instead of grouped-query attention: then
    # ``head_dim`` is its ``qk_head_dim``, ``num_kv_heads`` is ``num_heads``
    # and RoPE (interleaved) rotates the ``qk_rope_head_dim`` dimensions.
    latent: LatentAttention | None = None
    # The MLP's gate: "silu", or "situ" (Kimi's tanh(g) * sigmoid(g), in
    # float32, as upstream's SituAndMul at beta 1).
    hidden_act: str = "silu"
    # Per layer, grouped-query attention only: the sliding window (None: the
    # whole window the server keeps) and whether the query block attends
    # causally; empty: every layer full and non-causal.
    sliding_windows: tuple[int | None, ...] = ()
    causal_layers: tuple[bool, ...] = ()
    # A learned sink logit per layer and head (the ``sinks`` weight): one
    # more term of each softmax's denominator, as vLLM's backends add it.
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        if self.method not in ("dflash", "dspark"):
            raise ValueError(f"unknown draft method {self.method!r}")
        for name in (
            "vocab_size",
            "context_width",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.head_dim % 2 or self.num_heads % self.num_kv_heads:
            raise ValueError("head_dim must be even, num_heads a multiple of kv heads")
        if self.draft_vocab_size is not None and not (
            0 < self.draft_vocab_size < self.vocab_size
        ):
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} must be positive and "
                f"below vocab_size {self.vocab_size}"
            )
        if self.draft_topk is not None and (
            self.method != "dspark" or not 0 < self.draft_topk <= self.draft_vocab
        ):
            raise ValueError(
                f"draft_topk {self.draft_topk} needs a DSpark draft and must be "
                "positive and at most the draft vocabulary"
            )
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary_dim {self.rotary_dim} must be even and within head_dim"
            )
        latent = self.latent
        if latent is not None and (
            self.head_dim != latent.qk_head_dim
            or self.num_kv_heads != self.num_heads
            or self.rotary_width != latent.qk_rope_head_dim
            or self.neox_rope
            or self.attention_bias
        ):
            raise ValueError(
                "a latent-attention draft has head_dim qk_head_dim, a KV head "
                "per head, interleaved RoPE on qk_rope_head_dim and no biases"
            )
        for name in ("sliding_windows", "causal_layers"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{name} must have one entry per layer")
        if any(w is not None and w <= 0 for w in self.sliding_windows):
            raise ValueError("a sliding window must be positive")
        if latent is not None and (self.attends_per_row or self.attention_sinks):
            raise ValueError(
                "a latent-attention draft attends full and non-causal, without sinks"
            )
        if (self.method == "dspark") != (self.markov_rank > 0):
            raise ValueError("a DSpark draft (only) has a Markov head rank")
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask token {self.mask_token_id} outside the vocabulary")
        for weight, size in self.weight_shapes().items():
            if math.prod(size) > _MAX_NUMEL:
                raise ValueError(
                    f"weight {weight} {size} holds more than 2**63 - 1 elements"
                )

    @property
    def draft_vocab(self) -> int:
        """Ids the LM head scores."""
        return (
            self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size
        )

    @property
    def attends_per_row(self) -> bool:
        """Whether a layer's rows see different keys (causal or sliding)."""
        return any(self.causal_layers) or any(
            w is not None for w in self.sliding_windows
        )

    def layer_attention(self, layer: int) -> tuple[int | None, bool]:
        """``(sliding window, causal)`` of ``layer``."""
        return (
            self.sliding_windows[layer] if self.sliding_windows else None,
            bool(self.causal_layers and self.causal_layers[layer]),
        )

    @property
    def rotary_width(self) -> int:
        """Dimensions of a head that RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kv_width(self) -> int:
        """Values cached per layer and position."""
        if self.latent is not None:
            return self.latent.cache_width
        return 2 * self.num_kv_heads * self.head_dim

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Engine weight names -> shapes (per-layer weights stacked). All are
        floating point but ``draft_to_target`` (int64: the vocabulary id of
        each draft id)."""
        h, v, layers = self.hidden_size, self.vocab_size, self.num_layers
        draft_v = self.draft_vocab
        inter = self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (v, h),
            "fc": (h, self.context_width),
            "hidden_norm": (h,),
            "final_norm": (h,),
            "lm_head": (draft_v, h),
        }
        if self.draft_vocab_size is not None:
            shapes["draft_to_target"] = (draft_v,)
        if self.markov_rank:
            shapes["markov_w1"] = (v, self.markov_rank)
            shapes["markov_w2"] = (draft_v, self.markov_rank)
        for name, shape in (
            *self._attention_weight_shapes().items(),
            ("w_gate", (inter, h)),
            ("w_up", (inter, h)),
            ("w_down", (h, inter)),
            ("input_norm", (h,)),
            ("post_norm", (h,)),
        ):
            shapes[name] = (layers, *shape)
        return shapes

    def _attention_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one layer's attention weights."""
        h, heads, latent = self.hidden_size, self.num_heads, self.latent
        if latent is not None:
            return {
                "wq_a": (latent.q_lora_rank, h),
                "q_a_norm": (latent.q_lora_rank,),
                "wq_b": (heads * latent.qk_head_dim, latent.q_lora_rank),
                "wkv_a": (latent.cache_width, h),
                "kv_a_norm": (latent.kv_lora_rank,),
                "wkv_b": (
                    heads * (latent.qk_nope_head_dim + latent.v_head_dim),
                    latent.kv_lora_rank,
                ),
                "wo": (h, heads * latent.v_head_dim),
            }
        q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "wq": (q, h),
            "wk": (kv, h),
            "wv": (kv, h),
            "wo": (h, q),
            "q_norm": (self.head_dim,),
            "k_norm": (self.head_dim,),
        }
        if self.attention_bias:
            for name, size in (("wq", q), ("wk", kv), ("wv", kv), ("wo", h)):
                shapes[f"{name}_bias"] = (size,)
        if self.attention_sinks:
            shapes["sinks"] = (heads,)
        return shapes


@dataclass(frozen=True)
class ReferenceModelConfig:
    """The reference draft: random weights from ``seed``; ``mask_token_id`` is
    the last vocabulary id. With ``latent_attention``, multi-head latent attention of
    ranks ``hidden_size / 2``, per head ``hidden_size / num_heads`` key (no
    RoPE) and value dimensions and half that many RoPE dimensions."""

    method: str = "dflash"
    vocab_size: int = 1024
    context_width: int = 192
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    seed: int = 0
    latent_attention: bool = False

    def __post_init__(self) -> None:
        # Latent attention rotates half a head: an even count.
        multiple = 4 if self.latent_attention else 2
        if self.num_heads <= 0 or self.hidden_size % (multiple * self.num_heads):
            raise ValueError(
                f"hidden_size must be a multiple of {multiple} * num_heads"
                + (" with latent attention" if self.latent_attention else "")
            )
        self.shape()

    def shape(self) -> DraftShape:
        head = self.hidden_size // self.num_heads
        latent = None
        if self.latent_attention:
            latent = LatentAttention(
                q_lora_rank=self.hidden_size // 2,
                kv_lora_rank=self.hidden_size // 2,
                qk_nope_head_dim=head,
                qk_rope_head_dim=head // 2,
                v_head_dim=head,
            )
        return DraftShape(
            method=self.method,
            vocab_size=self.vocab_size,
            context_width=self.context_width,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            head_dim=head if latent is None else latent.qk_head_dim,
            intermediate_size=2 * self.hidden_size,
            mask_token_id=self.vocab_size - 1,
            markov_rank=16 if self.method == "dspark" else 0,
            neox_rope=latent is None,
            rotary_dim=None if latent is None else latent.qk_rope_head_dim,
            latent=latent,
        )


class _Window(NamedTuple):
    """What a query block attends besides itself: per request, the flat KV
    index of each window position and whether it holds the request's
    context, and the attention mask over the window and the block ``[batch,
    1, 1 or rows, window + rows]``."""

    index: torch.Tensor
    seen: torch.Tensor
    mask: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def rope_table(theta: float, rotary_dim: int, positions: int) -> torch.Tensor:
    """Unscaled RoPE at positions ``0..positions-1``: float32 ``[positions,
    rotary_dim]``, cosines then sines, as upstream's ``cos_sin_cache``."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    )
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def _rope(x: torch.Tensor, cos_sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """``x`` ``[..., heads, head_dim]`` with its leading ``rotary_dim``
    dimensions rotated by ``cos_sin`` ``[..., rotary_dim]`` (the table rows at
    its positions): neox (rotated halves) or interleaved (rotated pairs)."""
    rotary_dim = cos_sin.shape[-1]
    cos, sin = cos_sin.unsqueeze(-2).chunk(2, dim=-1)
    rotated = x[..., :rotary_dim]
    if neox:
        x1, x2 = rotated.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        out = out.flatten(-2)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


class TorchDraftEngine(DraftEngine):
    """A ``DraftShape`` draft in plain torch; subclasses provide the weights
    (see the module docstring)."""

    def __init__(
        self,
        limits: DraftLimits,
        shape: DraftShape,
        device: torch.device,
        enable_cuda_graph: bool = False,
    ) -> None:
        if enable_cuda_graph and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        narrowest = min(
            (w for w in shape.sliding_windows if w is not None), default=None
        )
        # DFlash queries K + 1 rows, DSpark K.
        block = limits.max_speculative_tokens + (shape.method == "dflash")
        if narrowest is not None and narrowest < block:
            # A window would then cut a query block, where backends differ.
            raise ValueError(
                f"the draft's sliding window {narrowest} must cover its query "
                f"block of {block} rows (max_speculative_tokens "
                f"{limits.max_speculative_tokens})"
            )
        self.limits = limits
        self.shape = shape
        self.device = device
        self.enable_cuda_graph = enable_cuda_graph
        self.geometry = limits.geometry
        self.dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        # Upstream's MLA keeps its RoPE table in float32 and rotates in
        # float32; its Qwen3 drafts keep the table in the model's dtype.
        self._rope_dtype = torch.float32 if shape.latent else self.dtype
        self.spec = EngineSpec(
            method=shape.method,
            vocab_size=shape.vocab_size,
            context_width=shape.context_width,
            hidden_size=shape.hidden_size,
            supports_logits=True,
            query_kv_overhang=0,
        )
        self._graphs: dict[
            tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        # The context pass per padded row count.
        self._context_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._context_sizes = graph_batch_sizes(limits.max_context_tokens)
        self._graph_sizes = graph_batch_sizes(limits.max_batch_size)

    @abc.abstractmethod
    def host_weights(self) -> dict[str, torch.Tensor]:
        """CPU tensors of ``shape.weight_shapes()`` (any float dtype;
        ``draft_to_target`` integral, every value a vocabulary id, no two
        alike)."""

    def rope_table(self) -> torch.Tensor:
        """RoPE cosines and sines of positions ``0..max_model_len-1``:
        float32 ``[max_model_len, shape.rotary_width]`` on CPU. Unscaled
        RoPE of ``shape.rope_theta``; a subclass serving scaled RoPE returns
        its own."""
        shape = self.shape
        return rope_table(
            shape.rope_theta, shape.rotary_width, self.limits.max_model_len
        )

    # ------------------------------------------------------------ lifecycle

    def memory_plan(self) -> MemoryPlan:
        itemsize = self.dtype.itemsize
        limits, shape = self.limits, self.shape
        kv = (shape.num_layers * self.geometry.num_blocks * limits.block_size) * (
            shape.kv_width
        )
        # The RoPE table counts with the weights; the id map is int64.
        sizes = {n: torch.Size(s).numel() for n, s in shape.weight_shapes().items()}
        ids = sizes.pop(_ID_MAP, 0)
        table = limits.max_model_len * shape.rotary_width * self._rope_dtype.itemsize
        logits = (
            limits.max_batch_size * limits.max_speculative_tokens * shape.vocab_size
        )
        # Context rows (bf16) and, per row, three int64 indices.
        staging = limits.max_context_tokens * (shape.context_width * 2 + 24)
        return MemoryPlan(
            kv_bytes=kv * itemsize,
            prefix_cache_bytes=ContextCache.bytes_needed(
                limits.max_requests,
                limits.prefix_cache_tokens,
                shape.hidden_size,
                self.dtype,
            ),
            weight_bytes=sum(sizes.values()) * itemsize + table + ids * 8,
            staging_bytes=staging + logits * itemsize,
        )

    def load(self) -> None:
        shape, limits = self.shape, self.limits
        weights = self.host_weights()
        expected = shape.weight_shapes()
        if {name: tuple(t.shape) for name, t in weights.items()} != expected:
            raise ValueError("draft weights do not match the draft shape")
        # Copies: the engine owns its weights (a subclass may adjust them).
        self.w = {
            name: value.to(
                device=self.device,
                dtype=torch.int64 if name == _ID_MAP else self.dtype,
                copy=True,
            )
            for name, value in weights.items()
        }
        table = self.rope_table()
        if tuple(table.shape) != (limits.max_model_len, shape.rotary_width):
            raise ValueError("the RoPE table does not match the draft shape")
        self.rope = table.to(device=self.device, dtype=self._rope_dtype)
        # Per layer and flat cache position (layout: kv_slots).
        positions = self.geometry.num_blocks * limits.block_size
        if shape.latent is not None:
            # [layer, position, latent]
            size: tuple[int, ...] = (
                shape.num_layers,
                positions,
                shape.latent.cache_width,
            )
        else:
            # [layer, K/V, position, kv head, dim]
            size = (shape.num_layers, 2, positions, shape.num_kv_heads, shape.head_dim)
        self.kv = torch.zeros(size, dtype=self.dtype, device=self.device)
        self.cache = ContextCache(
            limits.max_requests,
            limits.prefix_cache_tokens,
            shape.hidden_size,
            self.dtype,
            self.device,
        )
        pin = self.device.type == "cuda"
        # Query inputs: anchor ids, anchor positions, slots, valid starts.
        self._host_query = torch.zeros(
            4, limits.max_batch_size, dtype=torch.int64, pin_memory=pin
        )
        self._query_in = torch.zeros(
            4, limits.max_batch_size, dtype=torch.int64, device=self.device
        )
        if pin:
            self._host_rows = torch.empty(
                limits.max_context_tokens,
                shape.context_width,
                dtype=torch.bfloat16,
                pin_memory=True,
            )
        # Context inputs: the rows and, per row, its position, its row of the
        # context cache and its flat KV index. Padding rows, and rows the KV
        # window does not keep, write the cache's scratch row and reserved
        # block 0, which nothing reads.
        self._rows_in = torch.zeros(
            limits.max_context_tokens,
            shape.context_width,
            dtype=torch.bfloat16,
            device=self.device,
        )
        self._host_context = torch.zeros(
            3, limits.max_context_tokens, dtype=torch.int64, pin_memory=pin
        )
        self._context_in = torch.zeros(
            3, limits.max_context_tokens, dtype=torch.int64, device=self.device
        )

    def capture_cuda_graphs(self) -> list[tuple[int, int]]:
        if not self.enable_cuda_graph:
            if self.device.type == "cuda":
                # Eager: run the largest query once (no context: padding).
                self._query_in[3].fill_(_NO_CONTEXT)
                self._query(
                    self.limits.max_batch_size, self.limits.max_speculative_tokens
                )
                torch.cuda.synchronize(self.device)
            return []
        pool = torch.cuda.graph_pool_handle()
        shapes = [
            (batch, depth)
            for batch in reversed(self._graph_sizes)
            for depth in range(self.limits.max_speculative_tokens, 0, -1)
        ]
        self._query_in[3].fill_(_NO_CONTEXT)
        # Every context row a padding row: captures write nothing read.
        self._pad_context(0)
        self._context_in.copy_(self._host_context)
        sizes = list(reversed(self._context_sizes))
        # Capture on the engine's own stream, under its device (torch's
        # default capture stream is process-wide, made on whichever device
        # was current at the first capture).
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for batch, depth in shapes:
                    self._query(batch, depth)
                for size in sizes:
                    self._context(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for batch, depth in shapes:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits, tokens = self._query(batch, depth)
                self._graphs[(batch, depth)] = (graph, logits, tokens)
            for size in sizes:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._context(size)
                self._context_graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "Captured %d draft CUDA graphs (and %d of the context pass)",
            len(shapes),
            len(sizes),
        )
        return sorted(self._graphs)

    # ------------------------------------------------------------- compute

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, weight, self.shape.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., heads, head_dim]`` rotated at ``positions``, in the
        table's dtype, and returned in ``x``'s."""
        return _rope(x, self.rope[positions], self.shape.neox_rope).to(x.dtype)

    def _linear(self, x: torch.Tensor, name: str, layer: int) -> torch.Tensor:
        """``x`` through projection ``name`` of ``layer`` (and its bias)."""
        y = x @ self.w[name][layer].T
        bias = self.w.get(f"{name}_bias")
        return y if bias is None else y + bias[layer]

    def _combine(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.dtype) @ self.w["fc"].T

    def _write_kv(
        self, combined: torch.Tensor, positions: torch.Tensor, index: torch.Tensor
    ) -> None:
        """Context K/V (or latents) of ``combined`` rows at ``positions`` into
        flat cache ``index`` for every layer."""
        shape, w = self.shape, self.w
        x = self._norm(combined, w["hidden_norm"])
        if shape.latent is not None:
            for layer in range(shape.num_layers):
                self.kv[layer].index_copy_(0, index, self._latent(x, layer, positions))
            return
        kv_shape = (x.shape[0], shape.num_kv_heads, shape.head_dim)
        for layer in range(shape.num_layers):
            k = self._norm(
                self._linear(x, "wk", layer).view(kv_shape), w["k_norm"][layer]
            )
            v = self._linear(x, "wv", layer).view(kv_shape)
            self.kv[layer, 0].index_copy_(0, index, self._rope(k, positions))
            self.kv[layer, 1].index_copy_(0, index, v)

    def _latent(
        self, x: torch.Tensor, layer: int, positions: torch.Tensor
    ) -> torch.Tensor:
        """The latent ``[norm(kv_c) | rope(k_pe)]`` of rows ``x`` at
        ``positions`` in ``layer``."""
        latent, w = self.shape.latent, self.w
        assert latent is not None
        rank = latent.kv_lora_rank
        kv = x @ w["wkv_a"][layer].T
        kv_c = self._norm(kv[..., :rank], w["kv_a_norm"][layer])
        k_pe = self._rope(kv[..., None, rank:], positions).squeeze(-2)
        return torch.cat((kv_c, k_pe), -1)

    def _grouped_attention(
        self, h: torch.Tensor, layer: int, positions: torch.Tensor, window: _Window
    ) -> torch.Tensor:
        """Grouped-query attention of the normed block ``h`` ``[batch, rows,
        hidden]`` over its window and itself, through the output projection."""
        shape, w = self.shape, self.w
        batch, rows = h.shape[:2]
        q_shape = (batch, rows, shape.num_heads, shape.head_dim)
        kv_shape = (batch, rows, shape.num_kv_heads, shape.head_dim)
        q = self._norm(self._linear(h, "wq", layer).view(q_shape), w["q_norm"][layer])
        k = self._norm(self._linear(h, "wk", layer).view(kv_shape), w["k_norm"][layer])
        v = self._linear(h, "wv", layer).view(kv_shape)
        q, k = self._rope(q, positions), self._rope(k, positions)
        seen = window.seen[:, :, None, None]
        ctx_k = torch.where(seen, self.kv[layer, 0][window.index], 0.0)
        ctx_v = torch.where(seen, self.kv[layer, 1][window.index], 0.0)
        keys = torch.cat((ctx_k, k), 1)
        values = torch.cat((ctx_v, v), 1)
        mask = window.mask
        if shape.attention_sinks:
            # The sink as one more key: zero K and V, its logit the head's
            # sink (an additive mask), so it adds to the denominator only.
            zero = keys.new_zeros(batch, 1, shape.num_kv_heads, shape.head_dim)
            keys, values = torch.cat((keys, zero), 1), torch.cat((values, zero), 1)
            bias = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, -math.inf)
            sinks = w["sinks"][layer].to(q.dtype)[None, :, None, None]
            bias = bias.expand(batch, shape.num_heads, rows, -1)
            mask = torch.cat((bias, sinks.expand(batch, -1, rows, 1)), -1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            enable_gqa=shape.num_heads != shape.num_kv_heads,
        )
        return self._linear(out.transpose(1, 2).flatten(2), "wo", layer)

    def _latent_attention(
        self, h: torch.Tensor, layer: int, positions: torch.Tensor, window: _Window
    ) -> torch.Tensor:
        """Multi-head latent attention of the normed block ``h`` over its
        window and itself, through the output projection: one latent key
        (and its ``kv_c`` part as the value) shared by every head, each
        head's ``q_nope`` absorbed by ``kv_b``'s key half and its output
        expanded by the value half."""
        shape, w = self.shape, self.w
        latent = shape.latent
        assert latent is not None
        batch, rows = h.shape[:2]
        nope, rank = latent.qk_nope_head_dim, latent.kv_lora_rank
        q_c = self._norm(h @ w["wq_a"][layer].T, w["q_a_norm"][layer])
        q = (q_c @ w["wq_b"][layer].T).view(
            batch, rows, shape.num_heads, latent.qk_head_dim
        )
        kv_b = w["wkv_b"][layer].view(shape.num_heads, nope + latent.v_head_dim, rank)
        query = torch.cat(
            (
                torch.einsum("brhn,hnl->brhl", q[..., :nope], kv_b[:, :nope]),
                self._rope(q[..., nope:], positions),
            ),
            -1,
        )
        context = torch.where(
            window.seen[:, :, None], self.kv[layer][window.index], 0.0
        )
        keys = torch.cat((context, self._latent(h, layer, positions)), 1)[:, None]
        # Every head reads the one latent key: one attention head whose
        # queries are the block's rows x heads (no per-head copy of the keys).
        out = F.scaled_dot_product_attention(
            query.view(batch, 1, rows * shape.num_heads, -1),
            keys,
            keys[..., :rank],
            attn_mask=window.mask,
            scale=latent.qk_head_dim**-0.5 * latent.softmax_scale_factor,
        ).view(batch, rows, shape.num_heads, rank)
        out = torch.einsum("brhl,hvl->brhv", out, kv_b[:, nope:])
        return out.flatten(2) @ w["wo"][layer].T

    def _mlp(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """The gated MLP of ``layer`` on the normed ``h``."""
        w = self.w
        gate, up = h @ w["w_gate"][layer].T, h @ w["w_up"][layer].T
        if self.shape.hidden_act == "situ":
            g = gate.float()
            act = (torch.tanh(g) * torch.sigmoid(g) * up.float()).to(h.dtype)
        else:
            act = F.silu(gate) * up
        return act @ w["w_down"][layer].T

    def _query(self, batch: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits ``[batch, depth, V]`` and greedy tokens ``[batch,
        depth]`` from the query inputs' first ``batch`` rows (fixed shapes:
        capturable). With a reduced draft vocabulary the logits are
        scattered into the vocabulary over -inf, as upstream scatters them;
        DFlash's tokens are their argmax, DSpark's the vocabulary ids of the
        draft ids its Markov chain picks (upstream's orders)."""
        shape, w, window = self.shape, self.w, self.limits.window_size
        anchors, anchor_pos, slots, starts = self._query_in[:, :batch]
        dflash = shape.method == "dflash"
        rows = depth + 1 if dflash else depth
        offsets = torch.arange(rows, device=self.device)
        ids = torch.full(
            (batch, rows), shape.mask_token_id, dtype=torch.int64, device=self.device
        )
        ids[:, 0] = anchors
        # Rows past the model length, as upstream's speculators lay them out:
        # rotated at the last position, and no key (the attention's sequence
        # ends at the model length).
        positions = anchor_pos[:, None] + offsets
        in_model = positions < self.limits.max_model_len
        positions = positions.clamp(max=self.limits.max_model_len - 1)
        ctx_pos = (
            anchor_pos[:, None] - window + torch.arange(window, device=self.device)
        )
        ctx_seen = ctx_pos >= starts[:, None]
        # Window rows before the request's start hold whatever the slot's
        # previous owner left (even NaN or inf): the attentions zero them,
        # since a masked weight of 0 times NaN is still NaN.
        index = self.geometry.slot_mapping(slots[:, None], ctx_pos.clamp(min=0))
        # As FlashAttention aligns a block whose sequence is cut at the model
        # length: bottom-right, every row `shift` positions earlier.
        shift = (anchor_pos + rows - self.limits.max_model_len).clamp(min=0)
        query_pos = anchor_pos[:, None] + offsets - shift[:, None]
        windows: dict[tuple[int | None, bool], _Window] = {}
        for sliding, causal in map(shape.layer_attention, range(shape.num_layers)):
            if (sliding, causal) in windows:
                continue
            if sliding is None and not causal:
                mask = torch.cat((ctx_seen, in_model), 1)[:, None, None, :]
            else:
                seen = ctx_seen[:, None, :].expand(-1, rows, -1)
                if sliding is not None:
                    # Block rows are never that far apart (checked at load).
                    seen = seen & (
                        ctx_pos[:, None, :] > query_pos[:, :, None] - sliding
                    )
                block = in_model[:, None, :].expand(-1, rows, -1)
                if causal:
                    seen = seen & (ctx_pos[:, None, :] <= query_pos[:, :, None])
                    block = block & (
                        (anchor_pos[:, None, None] + offsets) <= query_pos[:, :, None]
                    )
                mask = torch.cat((seen, block), 2)[:, None]
            windows[sliding, causal] = _Window(index, ctx_seen, mask)
        attention = (
            self._latent_attention
            if shape.latent is not None
            else self._grouped_attention
        )
        x = w["embed"][ids]
        for layer in range(shape.num_layers):
            h = self._norm(x, w["input_norm"][layer])
            attend = windows[shape.layer_attention(layer)]
            x = x + attention(h, layer, positions, attend)
            x = x + self._mlp(self._norm(x, w["post_norm"][layer]), layer)
        hidden = self._norm(x[:, 1:] if dflash else x, w["final_norm"])
        logits = hidden @ w["lm_head"].T
        to_target = w.get(_ID_MAP)
        if not dflash:
            # DSpark: sequential Markov bias from the previously drafted token.
            topk = shape.draft_topk
            if topk is not None:
                values, candidates = logits.topk(topk, dim=-1)
            steps, drafted = [], []
            prev = anchors
            for step in range(depth):
                embed = w["markov_w1"][prev]
                if topk is None:
                    step_logits = logits[:, step] + embed @ w["markov_w2"].T
                else:
                    # Upstream's truncated proposal: the bias on the top-k
                    # base logits only, -inf elsewhere.
                    picked = candidates[:, step]
                    corrected = values[:, step] + (
                        w["markov_w2"][picked] @ embed[:, :, None]
                    ).squeeze(-1)
                    step_logits = torch.full_like(logits[:, step], -math.inf).scatter_(
                        1, picked, corrected
                    )
                prev = step_logits.argmax(-1)
                if to_target is not None:
                    prev = to_target[prev]
                steps.append(step_logits)
                drafted.append(prev)
            logits = torch.stack(steps, 1)
        if to_target is not None:
            logits = torch.full(
                (batch, depth, shape.vocab_size),
                -math.inf,
                dtype=logits.dtype,
                device=self.device,
            ).index_copy_(2, to_target, logits)
        return logits, logits.argmax(-1) if dflash else torch.stack(drafted, 1)

    # -------------------------------------------------------------- serving

    def propose(self, batch: ProposeBatch) -> ProposeOutput:
        timer = StepTimer()
        if batch.positions.numel():
            self._store_context(batch)
        timer.mark("context")
        num_reqs, depth = len(batch.slots), batch.num_speculative_tokens
        host = self._host_query
        padded = (
            padded_batch_size(self._graph_sizes, num_reqs) if self._graphs else num_reqs
        )
        host[:, num_reqs:padded] = 0
        host[3, num_reqs:padded] = _NO_CONTEXT
        host[:, :num_reqs] = torch.tensor(
            (batch.anchor_token_ids, batch.ends, batch.slots, batch.starts)
        )
        self._query_in[:, :padded].copy_(host[:, :padded], non_blocking=True)
        if self._graphs:
            graph, graph_logits, graph_tokens = self._graphs[(padded, depth)]
            graph.replay()
            logits, tokens = graph_logits[:num_reqs], graph_tokens[:num_reqs]
        else:
            logits, tokens = self._query(num_reqs, depth)
        timer.mark("query")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        timer.mark("device_wait")
        tokens = tokens.cpu()
        timer.mark("copy_back")
        return ProposeOutput(
            tokens=tokens,
            logits=logits if batch.want_logits else None,
            timings=timer.timings,
        )

    def _store_context(self, batch: ProposeBatch) -> None:
        """The batch's context rows into the context cache and the KV slots:
        indices made on the host, then the context pass (its graph for the
        padded row count, if captured)."""
        plan = plan_context(batch, self.limits.kv_reach, self.cache.budget)
        rows = batch.rows if plan.keep is None else batch.rows[plan.keep]
        count = rows.shape[0]
        positions, slots = plan.positions, plan.slots
        kv_index = self.geometry.slot_mapping(slots, positions)
        if plan.kv_select is not None:
            # Rows past the KV window's reach: cached, their K/V discarded.
            kept = torch.zeros(count, dtype=torch.bool)
            kept[plan.kv_select] = True
            kv_index[~kept] = 0
        host = self._host_context
        host[0, :count] = positions
        host[1, :count] = self.cache.index(slots, positions)
        host[2, :count] = kv_index
        # The pass runs over ``size`` rows: ``count`` and padding rows.
        size, graph = count, None
        if self._context_graphs:
            size = padded_batch_size(self._context_sizes, count)
            self._pad_context(count, size)
            graph = self._context_graphs[size]
        self._context_in[:, :size].copy_(host[:, :size], non_blocking=True)
        if self.device.type == "cuda":
            staged = self._host_rows[:count]
            staged.copy_(rows)
            rows = staged
        self._rows_in[:count].copy_(rows, non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            self._context(size)

    def _pad_context(self, start: int, end: int | None = None) -> None:
        """Host context rows ``[start, end)`` made padding rows."""
        host = self._host_context[:, start:end]
        host[0] = 0
        host[1] = self.cache.scratch_row
        host[2] = 0

    def _context(self, count: int) -> None:
        """The context pass over the first ``count`` context inputs (fixed
        shapes: capturable): combine, cache the combined rows, write K/V."""
        positions, cache_index, kv_index = self._context_in[:, :count]
        combined = self._combine(self._rows_in[:count])
        self.cache.write(cache_index, combined)
        self._write_kv(combined, positions, kv_index)

    def restore(self, src_slot: int, dst_slot: int, start: int, end: int) -> None:
        self.cache.copy(src_slot, dst_slot, start, end)
        if start < end:
            combined = self.cache.read(dst_slot, start, end)
            positions = torch.arange(start, end, device=self.device)
            slots = torch.full_like(positions, dst_slot)
            self._write_kv(
                combined, positions, self.geometry.slot_mapping(slots, positions)
            )


class ReferenceEngine(TorchDraftEngine):
    """The reference draft: random weights, deterministic given the seed."""

    def __init__(
        self,
        limits: DraftLimits,
        model: ReferenceModelConfig,
        device: torch.device,
        enable_cuda_graph: bool = False,
    ) -> None:
        super().__init__(limits, model.shape(), device, enable_cuda_graph)
        self.seed = model.seed

    def host_weights(self) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        weights = {}
        for name, size in self.shape.weight_shapes().items():
            if "norm" in name:
                value = 1.0 + 0.1 * torch.randn(size, generator=generator)
            else:
                value = torch.randn(size, generator=generator) / size[-1] ** 0.5
            weights[name] = value
        return weights
