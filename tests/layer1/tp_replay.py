# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tensor-parallel group of two ranks in one process, for the surface the
speculator and its extensions use (``rank_in_group``, ``world_size``,
``broadcast`` from rank 0): ``RecordingRank0`` keeps what rank 0
broadcasts, ``ReplayingRank1`` hands it out to rank 1 in order."""

from __future__ import annotations

import torch


class RecordingRank0:
    """Rank 0: keeps a copy of each tensor it broadcasts."""

    rank_in_group, world_size = 0, 2

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        assert src == 0
        self.sent.append(tensor.clone())
        return tensor


class ReplayingRank1:
    """Rank 1: receives rank 0's broadcasts in order (``sent`` keeps those
    not received yet)."""

    rank_in_group, world_size = 1, 2

    def __init__(self, sent: list[torch.Tensor]) -> None:
        self.sent = list(sent)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        assert src == 0
        tensor.copy_(self.sent.pop(0))
        return tensor
