# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-group slot mapping (layer 4, ``vllm.v1.worker.gpu.k3_dcp_block_table``):
a replicated group maps every token on every rank, a sharded group only its
rank's tokens. The real Triton kernel runs under Triton's CPU interpreter and
is checked against the pure-Python reference of its arithmetic; the same cases
run on the GPU in test_slot_mapping_gpu.py."""

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from k3l4_slots import PAD, Case, kernel_path, random_case, run_kernel
from k3l4_slots import spec_example as example

from vllm.v1.worker.gpu import block_table
from vllm.v1.worker.gpu.k3_dcp_block_table import (
    compute_slot_mappings,
    sliding_window_reach_under_cp,
)

SPEC_SHARDED = [PAD, PAD, 320, PAD, PAD, PAD, 321, PAD]
SPEC_REPLICATED = list(range(1280, 1288))


def test_reference_reproduces_the_spec_example() -> None:
    sharded, replicated = example().expected()
    assert sharded[:8] == SPEC_SHARDED
    assert replicated[:8] == SPEC_REPLICATED
    assert set(sharded[8:]) == set(replicated[8:]) == {PAD}


def test_kernel_reproduces_the_spec_example(
    interpreted_kernels: types.ModuleType,
) -> None:
    sharded, replicated = run_kernel(interpreted_kernels, example(), "cpu")
    assert sharded[:8] == SPEC_SHARDED
    assert replicated[:8] == SPEC_REPLICATED
    assert set(sharded[8:]) == set(replicated[8:]) == {PAD}


@pytest.mark.parametrize("seed", range(40))
def test_kernel_matches_the_reference_on_random_geometries(
    interpreted_kernels: types.ModuleType, seed: int
) -> None:
    case = random_case(seed)
    assert run_kernel(interpreted_kernels, case, "cpu") == case.expected()


@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_the_reference_on_long_prefills(
    interpreted_kernels: types.ModuleType, seed: int
) -> None:
    case = random_case(seed, max_query_len=3000)
    assert run_kernel(interpreted_kernels, case, "cpu") == case.expected()


@pytest.mark.parametrize("padding_columns", [0, 5])
def test_kernel_writes_nothing_past_the_end_of_a_row(
    interpreted_kernels: types.ModuleType, padding_columns: int
) -> None:
    """The slot mappings may be a view whose rows are shorter than their
    stride: the kernel writes up to the row's end and not one column further,
    whether the batch's tokens fill the row (0 padding columns) or the
    padding does (5)."""
    case = example()
    case.max_num_tokens = len(case.positions) + padding_columns
    buffer = torch.full((2, case.max_num_tokens + 1), 12345, dtype=torch.int64)
    slots = run_kernel(
        interpreted_kernels, case, "cpu", out=buffer[:, : case.max_num_tokens]
    )
    assert slots == case.expected()
    assert buffer[:, -1].tolist() == [12345, 12345]


def test_every_rank_maps_every_replicated_token_and_one_rank_each_sharded_token(
    interpreted_kernels: types.ModuleType,
) -> None:
    case = example()
    per_rank = []
    for rank in range(case.cp_size):
        case.cp_rank = rank
        per_rank.append(run_kernel(interpreted_kernels, case, "cpu"))
    for position in range(8):
        owners = [r for r in range(case.cp_size) if per_rank[r][0][position] != PAD]
        assert owners == [position % case.cp_size]
        assert {per_rank[r][1][position] for r in range(case.cp_size)} == {
            1280 + position
        }


def test_block_tables_launch_the_layer_kernel() -> None:
    """``BlockTables.compute_slot_mappings`` launches this module's kernel (the
    one the interpreter and the GPU tests run), from the installed file."""
    assert block_table.compute_slot_mappings is compute_slot_mappings
    assert not hasattr(block_table, "_compute_slot_mappings_kernel")
    installed = Path(block_table.__file__).with_name("k3_dcp_block_table.py")
    assert kernel_path().samefile(installed)


class HostUvaBuffer:
    """UVA needs a CUDA driver: host memory stands in."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()

    def uva(self, n: int | None = None) -> torch.Tensor:
        return self.cpu[:n]


def use_host_memory_for_uva(
    monkeypatch: pytest.MonkeyPatch, buffer_utils: types.ModuleType
) -> None:
    monkeypatch.setattr(buffer_utils, "UvaBuffer", HostUvaBuffer)
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: True)


def load_module_from(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def interpreted_block_table() -> types.ModuleType:
    """The installed ``block_table`` (and the ``buffer_utils`` it takes its
    pointer loads and buffers from) executed with its ``@triton.jit`` kernels
    interpreted: on a CPU vLLM hands it Triton placeholders, so the real
    Triton is put where it imports ``tl`` and ``triton`` from."""
    import vllm.triton_utils
    from vllm.v1.worker.gpu import buffer_utils

    triton = pytest.importorskip("triton", reason="the gather kernel is Triton")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setattr(vllm.triton_utils, "triton", triton)
        patch.setattr(vllm.triton_utils, "tl", triton.language)
        buffers = load_module_from("_k3l4_interpreted_buffers", buffer_utils.__file__)
        patch.setitem(sys.modules, buffer_utils.__name__, buffers)
        module = load_module_from("_k3l4_interpreted_block_table", block_table.__file__)
    kernel = module._gather_block_tables_kernel
    assert type(kernel).__name__ == "InterpretedFunction"
    return module


@pytest.mark.parametrize(
    ("interleave", "sharded"),
    [(1, SPEC_SHARDED), (2, [PAD, PAD, PAD, PAD, 320, 321, PAD, PAD])],
)
def test_block_tables_map_slots_with_their_cp_geometry(
    interpreted_kernels: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    interleave: int,
    sharded: list[int],
) -> None:
    """The real ``BlockTables.compute_slot_mappings`` on the spec example (CP
    size 4, rank 2) hands the kernel its rank, size and interleave in order."""
    case = example()
    case.interleave = interleave
    tables = spec_block_tables(interpreted_kernels, monkeypatch, case)
    slots = tables.compute_slot_mappings(
        torch.tensor(case.idx_mapping, dtype=torch.int32),
        torch.tensor([0, len(case.positions)], dtype=torch.int32),
        torch.tensor(case.positions, dtype=torch.int64),
        case.max_num_tokens,
    )
    assert slots.tolist() == case.expected()
    assert slots[0, :8].tolist() == sharded
    assert slots[1, :8].tolist() == SPEC_REPLICATED


def test_block_tables_write_slot_mappings_into_the_given_buffer(
    interpreted_kernels: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``out`` (the PCP manager's global-batch buffer) the real
    ``BlockTables.compute_slot_mappings`` writes the slots there and returns a
    view of it; the tables' own buffer is left as it was."""
    case = example()
    tables = spec_block_tables(interpreted_kernels, monkeypatch, case)
    own = tables.slot_mappings.clone()
    out = torch.full_like(tables.slot_mappings, 12345)
    slots = tables.compute_slot_mappings(
        torch.tensor(case.idx_mapping, dtype=torch.int32),
        torch.tensor([0, len(case.positions)], dtype=torch.int32),
        torch.tensor(case.positions, dtype=torch.int64),
        case.max_num_tokens,
        out=out,
    )
    assert slots.data_ptr() == out.data_ptr()
    assert out.tolist() == case.expected()
    assert torch.equal(tables.slot_mappings, own)


def spec_block_tables(
    interpreted_kernels: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    case: Case,
) -> block_table.BlockTables:
    """The real ``BlockTables`` of a one-request ``case``, its rows written,
    launching the interpreted kernel."""
    from vllm.v1.worker.gpu import buffer_utils

    use_host_memory_for_uva(monkeypatch, buffer_utils)
    monkeypatch.setattr(
        block_table, "compute_slot_mappings", interpreted_kernels.compute_slot_mappings
    )
    tables = block_table.BlockTables(
        block_sizes=[g.block_size for g in case.groups],
        max_num_reqs=1,
        max_num_batched_tokens=case.max_num_tokens,
        max_num_blocks_per_group=[2, 2],
        device=torch.device("cpu"),
        cp_size=case.cp_size,
        cp_rank=case.cp_rank,
        cp_interleave=case.interleave,
        dcp_sharded=[g.cp_size > 1 for g in case.groups],
    )
    # The rows the kernel reads (the staged-write kernel needs a GPU).
    for table, group in zip(tables.block_tables, case.groups):
        table.gpu[0] = torch.tensor(group.rows[0], dtype=torch.int32)
    return tables


def test_block_tables_gather_nulls_stale_replicated_blocks_under_cp(
    interpreted_block_table: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DCP (size 4) the real ``BlockTables.gather_block_tables`` nulls a
    replicated sliding-window group's blocks wholly below the window (its
    column j holds tokens [16j, 16j + 16)), and leaves the sharded group's row
    whole (its column j holds tokens of [64j, 64j + 64), no window bound)."""
    buffers = sys.modules[interpreted_block_table.UvaBackedTensor.__module__]
    use_host_memory_for_uva(monkeypatch, buffers)
    tables = interpreted_block_table.BlockTables(
        block_sizes=[16, 16],
        max_num_reqs=1,
        max_num_batched_tokens=8,
        max_num_blocks_per_group=[4, 4],
        device=torch.device("cpu"),
        cp_size=4,
        cp_rank=1,
        dcp_sharded=[True, False],
        sliding_window_reach=[16, 16],
    )
    for table in tables.block_tables:
        table.gpu[0] = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    tables.num_blocks.np[:, 0] = 4
    tables.num_blocks.copy_to_uva()
    # First scheduled position 48, window reach 16: tokens below 32 are out.
    sharded, replicated = tables.gather_block_tables(
        torch.tensor([0], dtype=torch.int32),
        num_reqs_padded=1,
        num_computed_tokens=torch.tensor([48], dtype=torch.int32),
    )
    assert replicated.tolist() == [[0, 0, 13, 14]]
    assert sharded.tolist() == [[11, 12, 13, 14]]


@pytest.mark.parametrize("cp_size", [1, 4])
def test_block_tables_without_a_reach_gather_whole_rows(
    interpreted_block_table: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    cp_size: int,
) -> None:
    """``BlockTables`` built without ``sliding_window_reach`` (every group full
    attention) gathers each row whole, with or without CP, even when given
    the computed tokens."""
    buffers = sys.modules[interpreted_block_table.UvaBackedTensor.__module__]
    use_host_memory_for_uva(monkeypatch, buffers)
    tables = interpreted_block_table.BlockTables(
        block_sizes=[16],
        max_num_reqs=1,
        max_num_batched_tokens=8,
        max_num_blocks_per_group=[4],
        device=torch.device("cpu"),
        cp_size=cp_size,
        dcp_sharded=[False],
    )
    tables.block_tables[0].gpu[0] = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    tables.num_blocks.np[:, 0] = 4
    tables.num_blocks.copy_to_uva()
    (row,) = tables.gather_block_tables(
        torch.tensor([0], dtype=torch.int32),
        num_reqs_padded=1,
        num_computed_tokens=torch.tensor([48], dtype=torch.int32),
    )
    assert row.tolist() == [[11, 12, 13, 14]]


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_sliding_window_masking_is_kept_for_replicated_groups_under_cp(
    cp_size: int,
) -> None:
    reach = sliding_window_reach_under_cp([0, 127, 127], [True, True, False], cp_size)
    assert reach == [0, 0, 127]


def test_sliding_window_masking_is_unchanged_without_cp() -> None:
    assert sliding_window_reach_under_cp([0, 127], [True, True], 1) == [0, 127]


@pytest.mark.parametrize("cp_size", [1, 4])
def test_sliding_window_reach_needs_one_entry_per_group(cp_size: int) -> None:
    with pytest.raises(ValueError, match="one entry per KV cache group"):
        sliding_window_reach_under_cp([127], [True, False], cp_size)


def test_block_tables_import_where_triton_is_not_installed() -> None:
    # vLLM's CPU backend off x86_64 has no Triton; upstream's block_table
    # imports there through vllm.triton_utils' placeholders.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import vllm.v1.worker.gpu.block_table\n"
        "print('imported')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.stdout.strip() == "imported", done.stderr[-2000:]
