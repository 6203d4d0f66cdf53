# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Slot-mapping cases for layer 4: a pure-Python reference of the kernel's
arithmetic, random geometries, and a runner for the real kernel.

Imports only the standard library, torch and triton (the GPU machine has no
vllm): the kernel module is loaded by file path, from the installed vllm when
there is one, else from this checkout's ``overlay/``.
"""

import importlib.util
import random
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

PAD = -1
KERNEL_MODULE = "vllm.v1.worker.gpu.k3_dcp_block_table"
OVERLAY_PATH = (
    Path(__file__).resolve().parents[2]
    / "overlay"
    / "vllm"
    / "v1"
    / "worker"
    / "gpu"
    / "k3_dcp_block_table.py"
)


def kernel_path() -> Path:
    """The installed kernel module's file, or the overlay's without vllm."""
    try:
        spec = importlib.util.find_spec(KERNEL_MODULE)
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        return OVERLAY_PATH
    return Path(spec.origin)


def load_kernel_module(name: str) -> types.ModuleType:
    """Execute the kernel module as ``name``: its ``@triton.jit`` functions are
    interpreted when ``TRITON_INTERPRET=1`` is set at this call."""
    spec = importlib.util.spec_from_file_location(name, kernel_path())
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {kernel_path()}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def reference_slot(
    position: int,
    block_ids: list[int],
    block_size: int,
    cp_size: int,
    cp_rank: int,
    interleave: int,
) -> int:
    """Slot of ``position`` on rank ``cp_rank`` for a group whose CP size is
    ``cp_size`` (1: replicated), or ``PAD`` when another rank owns it.

    A sharded group interleaves ``interleave``-token chunks over the ranks
    (``interleave`` divides ``block_size``, as vLLM requires) and each rank
    packs its chunks densely: block ``j`` of the row covers the positions
    ``[j * B * cp_size, (j + 1) * B * cp_size)``.
    """
    if cp_size > 1 and (position // interleave) % cp_size != cp_rank:
        return PAD
    virtual_block, offset = divmod(position, block_size * cp_size)
    local_offset = (offset // (interleave * cp_size)) * interleave + offset % interleave
    local_position = virtual_block * block_size + local_offset
    return block_ids[local_position // block_size] * block_size + (
        local_position % block_size
    )


@dataclass
class Group:
    block_size: int
    cp_size: int  # 1: replicated; the DCP size: sharded
    rows: list[list[int]]  # block ids, one row per request slot
    enabled: bool = True


@dataclass
class Case:
    groups: list[Group]
    cp_size: int  # the DCP size
    cp_rank: int
    interleave: int
    idx_mapping: list[int]  # block-table row per batch request, -1: padding
    query_lens: list[int]
    positions: list[int]
    max_num_tokens: int

    def expected(self) -> list[list[int]]:
        """Reference slot mappings, ``[num_groups][max_num_tokens]``."""
        out = []
        for group in self.groups:
            slots = [PAD] * self.max_num_tokens
            start = 0
            for row, query_len in zip(self.idx_mapping, self.query_lens):
                for t in range(start, start + query_len):
                    if row >= 0 and group.enabled:
                        slots[t] = reference_slot(
                            self.positions[t],
                            group.rows[row],
                            group.block_size,
                            group.cp_size,
                            self.cp_rank,
                            self.interleave,
                        )
                start += query_len
            out.append(slots)
        return out


def spec_example() -> Case:
    """p4 spec: blocks [64, 256], D=4, rank 2, group CP sizes [4, 1], block id
    5, positions 0..7. (Its kernel blocks [64, 64] do not enter the slot
    arithmetic: a slot numbers tokens, whatever block splits them.)"""
    return Case(
        groups=[Group(64, 4, [[5, 0]]), Group(256, 1, [[5, 0]])],
        cp_size=4,
        cp_rank=2,
        interleave=1,
        idx_mapping=[0],
        query_lens=[8],
        positions=list(range(8)),
        max_num_tokens=16,
    )


def random_case(seed: int, max_query_len: int = 40) -> Case:
    """A batch over 2-4 groups without DCP (size 1: every group replicated)
    or with it (sharded and replicated mixed, any rank and interleave); some
    requests are padding (-1), some groups are disabled. Queries longer than
    1024 tokens take several kernel loop iterations."""
    rng = random.Random(seed)
    cp_size = rng.choice([1, 2, 4, 8])
    # vLLM requires the interleave to divide the block size.
    interleave = rng.choice([1, 2, 8, 16])
    max_num_reqs = rng.randint(1, 5)
    max_len = rng.choice([300, 1000, 4096]) + max_query_len
    groups = []
    for _ in range(rng.randint(2, 4)):
        block_size = rng.choice([16, 32, 64, 256])
        group_cp = rng.choice([1, cp_size])
        width = -(-max_len // (block_size * group_cp))
        rows = [
            [rng.randrange(1, 5000) for _ in range(width)] for _ in range(max_num_reqs)
        ]
        groups.append(Group(block_size, group_cp, rows, rng.random() > 0.15))
    num_reqs = rng.randint(1, max_num_reqs)
    idx_mapping = [
        -1 if rng.random() < 0.2 else rng.randrange(max_num_reqs)
        for _ in range(num_reqs)
    ]
    query_lens: list[int] = []
    positions: list[int] = []
    for _ in range(num_reqs):
        query_len = rng.randint(1, max_query_len)
        start = rng.randint(0, max_len - query_len)
        query_lens.append(query_len)
        positions.extend(range(start, start + query_len))
    return Case(
        groups=groups,
        cp_size=cp_size,
        cp_rank=rng.randrange(cp_size),
        interleave=interleave,
        idx_mapping=idx_mapping,
        query_lens=query_lens,
        positions=positions,
        max_num_tokens=len(positions) + rng.randint(0, 50),
    )


def run_kernel(
    module: types.ModuleType,
    case: Case,
    device: str,
    out: torch.Tensor | None = None,
) -> list[list[int]]:
    """Slot mappings from the real kernel, launched through the module's
    ``compute_slot_mappings`` exactly as ``BlockTables`` launches it, into
    ``out`` (``[num_groups, max_num_tokens]``) or a fresh tensor."""
    tables = []
    for group in case.groups:
        width = max(len(row) for row in group.rows)
        table = torch.zeros(len(group.rows), width, dtype=torch.int32)
        for i, row in enumerate(group.rows):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        tables.append(table.to(device))
    query_start_loc = [0]
    for query_len in case.query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    if out is None:
        out = torch.full(
            (len(case.groups), case.max_num_tokens),
            12345,
            dtype=torch.int64,
            device=device,
        )
    module.compute_slot_mappings(
        out,
        torch.tensor(case.idx_mapping, dtype=torch.int32, device=device),
        torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        torch.tensor(case.positions, dtype=torch.int64, device=device),
        torch.tensor([t.data_ptr() for t in tables], dtype=torch.uint64, device=device),
        torch.tensor([t.stride(0) for t in tables], dtype=torch.int64, device=device),
        torch.tensor(
            [g.block_size for g in case.groups], dtype=torch.int32, device=device
        ),
        torch.tensor([g.enabled for g in case.groups], dtype=torch.bool, device=device),
        torch.tensor(
            [g.cp_size > 1 for g in case.groups], dtype=torch.bool, device=device
        ),
        case.cp_rank,
        case.cp_size,
        case.interleave,
        PAD,
    )
    return out.cpu().tolist()
