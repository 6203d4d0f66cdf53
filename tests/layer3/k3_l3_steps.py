# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The steps of layer 3's two-verifier tests (``test_deferred_draft_logits``
on CPU, ``test_deferred_resolve_gpu`` on CUDA): two requests in slots
``SLOTS``, ``K + 1`` rows each, aux hidden states seeded by the step, the
batch's device tensors and the sampling state on one device. The runner's
``sample_tokens`` (``k3_l3_runner.sample_tokens``) seeded by the same step
makes the same step as ``propose``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from toy_target import HIDDEN, NUM_AUX, make_input_batch

K = 3
SLOTS = [3, 5]
TEMPERATURES = (0.7, 1.3)
NUM_SLOTS = 8


def step_batch(req_ids: list[str], start: int, device: str = "cpu") -> Any:
    """The batch of a step at positions from ``start``; its device tensors on
    ``device`` (host copies stay on the host)."""
    n, per = len(req_ids), K + 1
    positions = torch.cat(
        [torch.arange(start + 10 * i, start + 10 * i + per) for i in range(n)]
    )
    batch = make_input_batch(
        req_ids,
        np.array(SLOTS),
        np.arange(n + 1, dtype=np.int32) * per,
        positions,
        n * per,
    )
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
        and "cpu" not in f.name
        and not f.name.endswith("_upper_bound")
    }
    return dataclasses.replace(batch, **moved)


def temperatures(device: str = "cpu", greedy: bool = False) -> torch.Tensor:
    """Per-slot temperatures: ``TEMPERATURES`` in ``SLOTS`` (all 0: greedy)."""
    temperature = torch.zeros(NUM_SLOTS, device=device)
    if not greedy:
        temperature[SLOTS] = torch.tensor(TEMPERATURES, device=device)
    return temperature


def seeds(device: str = "cpu") -> torch.Tensor:
    return torch.arange(NUM_SLOTS, dtype=torch.int64, device=device) * 7919 + 13


def last_sampled(step: int, device: str = "cpu") -> torch.Tensor:
    slots = torch.arange(NUM_SLOTS, dtype=torch.int64, device=device)
    return slots.reshape(NUM_SLOTS, 1) + 40 + step


def propose(
    speculator: Any, batch: Any, step: int, temperature: torch.Tensor
) -> torch.Tensor:
    """``speculator.propose`` of the step ``step`` of ``batch``."""
    device = batch.positions.device
    n, rows = batch.num_reqs, batch.num_tokens
    gen = torch.Generator().manual_seed(step)
    aux = [torch.randn(rows, HIDDEN, generator=gen).to(device) for _ in range(NUM_AUX)]
    return speculator.propose(
        batch,
        {},
        {},
        aux[0],
        aux,
        torch.ones(n, dtype=torch.int32, device=device),
        torch.zeros(n, dtype=torch.int32, device=device),
        last_sampled(step, str(device)),
        torch.zeros(1, NUM_SLOTS, dtype=torch.int32, device=device),
        temperature,
        seeds(str(device)),
        num_speculative_tokens=K,
    )
