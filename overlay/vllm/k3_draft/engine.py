# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The draft engine interface behind the draft server.

The server owns the request table (id -> slot, valid positions) and validates
every message; an engine owns the device state: weights, the slot KV cache
(``kv_slots``), the projected-context cache (``context_cache``), staging and
CUDA graphs. A request's device state is a pure function of its slot and its
valid positions ``[start, end)``: KV for the last ``window`` positions, cached
rows for the last ``budget`` positions. Engines are used under the server's
lock only.

Lifecycle: construct (cheap, no allocation) -> ``memory_plan()`` checked
against the device -> ``load()`` -> ``capture_cuda_graphs()`` -> serve.
"""

from __future__ import annotations

import abc
import bisect
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.k3_draft.kv_slots import SlotGeometry

GiB = 1 << 30


@dataclass(frozen=True)
class DraftLimits:
    """Server bounds advertised in PONG; every rule is checked on creation."""

    max_requests: int
    max_batch_size: int
    max_speculative_tokens: int
    max_context_tokens: int
    max_model_len: int
    block_size: int
    window_size: int
    prefix_cache_tokens: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if self.window_size % self.block_size:
            raise ValueError(
                f"window_size {self.window_size} is not a multiple of "
                f"block_size {self.block_size}"
            )
        if self.max_requests < self.max_batch_size:
            raise ValueError(
                f"max_requests {self.max_requests} (retained requests) is below "
                f"max_batch_size {self.max_batch_size} (max sequences)"
            )
        if self.prefix_cache_tokens < self.window_size:
            raise ValueError(
                f"prefix_cache_tokens {self.prefix_cache_tokens} is below "
                f"window_size {self.window_size}"
            )

    @property
    def kv_reach(self) -> int:
        """Consecutive positions a request's KV ring holds at once."""
        return self.window_size + self.block_size

    @property
    def geometry(self) -> SlotGeometry:
        return SlotGeometry(self.block_size, self.window_size, self.max_requests)


@dataclass(frozen=True)
class EngineSpec:
    """Static facts of a loaded engine (the model half of PONG).

    ``query_kv_overhang``: positions at or past a request's end whose K/V the
    query pass writes into the slot (0: query K/V never enters the cache). A
    PROPOSE may rewind at most ``block_size - query_kv_overhang`` positions
    without corrupting the window.
    """

    method: str
    vocab_size: int
    context_width: int
    hidden_size: int
    supports_logits: bool
    query_kv_overhang: int


@dataclass
class ProposeBatch:
    """One validated PROPOSE, request order preserved.

    Per request: ``slots``, valid positions ``[starts, ends)`` after this
    PROPOSE's context (``ends`` are the anchor positions), ``anchor_token_ids``
    and ``counts`` of context rows. ``positions`` (int64 ``[T]``) and ``rows``
    (bf16 ``[T, width]``) are CPU tensors that may alias received frames: read
    them, never keep them.
    """

    num_speculative_tokens: int
    slots: list[int]
    starts: list[int]
    ends: list[int]
    anchor_token_ids: list[int]
    counts: list[int]
    positions: torch.Tensor
    rows: torch.Tensor
    want_logits: bool


@dataclass
class ProposeOutput:
    """``tokens`` int64 ``[R, K]`` on CPU; ``logits`` ``[R, K, V]`` (device)
    when asked and supported; ``timings`` ms for context, query, device_wait,
    copy_back."""

    tokens: torch.Tensor
    logits: torch.Tensor | None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ContextPlan:
    """Which context rows of a batch reach the device (host tensors).

    ``keep``: indices of rows to transfer (the last ``budget`` positions of
    each request), ``None`` when all are kept. ``positions``/``slots``: per kept
    row. ``kv_select``: indices into the kept rows whose K/V is written (the
    last ``reach`` positions: a later PROPOSE may rewind into them; all kept
    rows when ``reach`` exceeds ``budget``), ``None`` when all.
    """

    keep: torch.Tensor | None
    positions: torch.Tensor
    slots: torch.Tensor
    kv_select: torch.Tensor | None


def plan_context(batch: ProposeBatch, reach: int, budget: int) -> ContextPlan:
    """Drop rows that neither the KV window nor the context cache can hold, so
    no two written rows of a request share a ring location. ``batch``'s
    positions must be contiguous up to each request's end (validated)."""
    counts = np.asarray(batch.counts, dtype=np.int64)
    slots = np.repeat(np.asarray(batch.slots, dtype=np.int64), counts)
    if max(batch.counts) <= reach <= budget:
        # Positions are contiguous up to each end: every row fits.
        return ContextPlan(None, batch.positions, torch.from_numpy(slots), None)
    ends = np.repeat(np.asarray(batch.ends, dtype=np.int64), counts)
    positions = batch.positions.numpy()
    keep_mask = positions >= ends - budget
    keep = None
    if not keep_mask.all():
        keep_idx = np.flatnonzero(keep_mask)
        keep = torch.from_numpy(keep_idx)
        positions, ends, slots = positions[keep_idx], ends[keep_idx], slots[keep_idx]
    kv_mask = positions >= ends - reach
    kv_select = None if kv_mask.all() else torch.from_numpy(np.flatnonzero(kv_mask))
    return ContextPlan(
        keep=keep,
        positions=torch.from_numpy(np.ascontiguousarray(positions)),
        slots=torch.from_numpy(slots),
        kv_select=kv_select,
    )


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Captured batch sizes: powers of two below the maximum, and the maximum."""
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch_size)
    return sizes


def padded_batch_size(sizes: list[int], batch_size: int) -> int:
    """The smallest captured batch size holding ``batch_size`` rows."""
    return sizes[bisect.bisect_left(sizes, batch_size)]


@dataclass(frozen=True)
class MemoryPlan:
    """Device bytes an engine needs at most, checked before allocation."""

    kv_bytes: int
    prefix_cache_bytes: int
    weight_bytes: int
    staging_bytes: int

    @property
    def total(self) -> int:
        return (
            self.kv_bytes + self.prefix_cache_bytes + self.weight_bytes
        ) + self.staging_bytes

    def describe(self) -> str:
        return (
            f"KV {self.kv_bytes / GiB:.3f} GiB + prefix cache (worst case) "
            f"{self.prefix_cache_bytes / GiB:.3f} GiB + weights "
            f"{self.weight_bytes / GiB:.3f} GiB + staging "
            f"{self.staging_bytes / GiB:.3f} GiB = {self.total / GiB:.3f} GiB"
        )


def available_memory(device: torch.device) -> int:
    """Free bytes of ``device`` now (CUDA: free device memory; CPU:
    MemAvailable of the host)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class StepTimer:
    """Milliseconds between marks, synchronising CUDA only at ``device_wait``."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.timings: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = (now - self._last) * 1e3
        self._last = now


class DraftEngine(abc.ABC):
    """A draft model serving rolling-window slots; see the module docstring."""

    spec: EngineSpec
    limits: DraftLimits
    device: torch.device

    @abc.abstractmethod
    def memory_plan(self) -> MemoryPlan:
        """Device bytes ``load`` and serving need at most (no allocation)."""

    @abc.abstractmethod
    def load(self) -> None:
        """Allocate weights, KV slots, context cache and staging."""

    @abc.abstractmethod
    def capture_cuda_graphs(self) -> list[tuple[int, int]]:
        """Capture one graph per accepted (batch, depth) shape; returns the
        captured shapes (empty when graphs are off). Either way, afterwards
        the device allocator holds the working memory of the largest query,
        so that the free-memory check after it sees what serving needs."""

    @abc.abstractmethod
    def propose(self, batch: ProposeBatch) -> ProposeOutput:
        """Store the batch's context (KV + cached rows), draft K tokens per
        request from ``[anchor, mask...]`` and return them."""

    @abc.abstractmethod
    def restore(self, src_slot: int, dst_slot: int, start: int, end: int) -> None:
        """RECONNECT: copy cached rows ``[start, end)`` (at most ``kv_reach``)
        from ``src_slot`` to ``dst_slot`` and rebuild ``dst_slot``'s KV for
        them."""
