# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The draft server's GPU top-k selection (``vllm.k3_draft.topk_select``):
each row's k largest bf16 values and their ids, in column order, NaN above
+inf, -0.0 below +0.0, ties to the smaller columns, the values' own bits.

On the CPU the installed module runs under Triton's interpreter in a fresh
process (``k3_l2_topk_interpreted.py``), with 64-column chunks so that rows
span several; on a GPU the compiled kernels run at the Kimi vocabulary, alone
and inside ``topk_frame``. The reference ranks every column by one combined
integer key (the order's key, then the column)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm.k3_draft import topk_select
from vllm.k3_draft.logits_codec import topk_frame

VOCAB = 163_840
SCRIPT = Path(__file__).resolve().parent / "k3_l2_topk_interpreted.py"


def _keys(x: torch.Tensor) -> torch.Tensor:
    """The documented order as int64 keys of bf16 ``x``."""
    bits = x.view(torch.int16).to(torch.int64)
    keys = (bits ^ ((bits >> 15) & 0x7FFF)) + 32768
    return torch.where((bits & 0x7FFF) > 0x7F80, 65535, keys)


def _expected(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Value bits (int16) and ids of each row's k first columns by (key
    descending, column)."""
    cols = torch.arange(x.shape[1], device=x.device)
    combined = _keys(x) * (1 << 32) + ((1 << 31) - cols)
    ids = torch.sort(torch.topk(combined, k, dim=-1).indices, dim=-1).values
    return torch.gather(x.view(torch.int16), 1, ids), ids.to(torch.int32)


def _assert_selection(
    x: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor
) -> None:
    want_values, want_ids = _expected(x, k)
    assert torch.equal(ids, want_ids)
    assert torch.equal(values.view(torch.int16), want_values)


def _random(rows: int, cols: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator) * 3).bfloat16()


def _cases() -> dict[str, tuple[torch.Tensor, int]]:
    cases = {
        f"random {cols} k={k}": (_random(3, cols, seed=cols + k), k)
        for cols, k in ((1000, 16), (777, 64), (300, 5), (64, 64))
    }
    ties = _random(2, 500, seed=1)
    ties[0, 10:300:3] = 50.0  # tied values across several chunks, above the rest
    ties[1] = 1.0  # one value everywhere
    cases["ties"] = (ties, 40)
    special = _random(1, 200, seed=2)
    bits = special.view(torch.int16)
    bits[0, 150] = 0x7FC1  # NaN with a payload
    bits[0, 20] = -0x3F  # 0xFFC1: a negative NaN
    special[0, 90] = float("inf")
    special[0, 91] = float("-inf")
    cases["special"] = (special, 3)
    # -0.0 first: the tie rule alone would take it.
    zeros = torch.full((1, 100), -1.0, dtype=torch.bfloat16)
    zeros[0, 5], zeros[0, 70] = -0.0, 0.0
    cases["signed zeros"] = (zeros, 1)
    negative = -_random(2, 300, seed=3).abs() - 1
    negative[0, ::2] = float("-inf")
    negative[1] = float("-inf")
    negative[1, 299] = 0.0
    cases["negative"] = (negative, 8)
    # 100 columns: chunks of 64 and 36; the second holds the 36 largest of
    # row 1, fewer than k.
    narrow = _random(2, 100, seed=4)
    narrow[1, 64:] += 100.0
    cases["narrow chunk"] = (narrow, 50)
    cases["k of a whole chunk"] = (narrow, 64)
    cases["no rows"] = (torch.empty(0, 100, dtype=torch.bfloat16), 4)
    return cases


@pytest.fixture(scope="module")
def interpreted(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """``{case: (x, values, ids, k)}`` of ``topk_rows`` run under Triton's
    interpreter with 64-column chunks, in a fresh process."""
    pytest.importorskip("triton", reason="the selection is a Triton kernel")
    folder = tmp_path_factory.mktemp("topk")
    cases = _cases()
    torch.save(cases, folder / "cases.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(folder / "cases.pt"), str(folder / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = torch.load(folder / "out.pt")
    return {name: (x, *out[name], k) for name, (x, k) in cases.items()}


def _assert_case(interpreted: dict[str, Any], name: str) -> torch.Tensor:
    """Check one interpreted case against ``_expected``; its ids."""
    x, values, ids, k = interpreted[name]
    _assert_selection(x, k, values, ids)
    return ids


@pytest.mark.parametrize(
    "case", ["random 1000 k=16", "random 777 k=64", "random 300 k=5", "random 64 k=64"]
)
def test_each_row_gets_its_k_largest_in_column_order(
    interpreted: dict[str, Any], case: str
) -> None:
    _assert_case(interpreted, case)


def test_ties_at_the_kth_value_go_to_the_smaller_columns(
    interpreted: dict[str, Any],
) -> None:
    ids = _assert_case(interpreted, "ties")
    assert ids[0].tolist() == list(range(10, 130, 3))
    assert ids[1].tolist() == list(range(40))


def test_nan_ranks_above_infinity_and_values_keep_their_bits(
    interpreted: dict[str, Any],
) -> None:
    ids = _assert_case(interpreted, "special")
    assert ids[0].tolist() == [20, 90, 150]
    values = interpreted["special"][1]
    assert values.view(torch.int16)[0].tolist() == [-0x3F, 0x7F80, 0x7FC1]


def test_minus_zero_ranks_below_plus_zero(interpreted: dict[str, Any]) -> None:
    assert _assert_case(interpreted, "signed zeros").tolist() == [[70]]


def test_negative_and_infinite_rows(interpreted: dict[str, Any]) -> None:
    ids = _assert_case(interpreted, "negative")
    assert ids[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 299]


def test_a_chunk_narrower_than_k_still_serves_the_row(
    interpreted: dict[str, Any],
) -> None:
    ids = _assert_case(interpreted, "narrow chunk")
    assert ids[1].tolist()[-36:] == list(range(64, 100))
    _assert_case(interpreted, "k of a whole chunk")


def test_no_rows_no_launch(interpreted: dict[str, Any]) -> None:
    _, values, ids, _ = interpreted["no rows"]
    assert values.shape == ids.shape == (0, 4)


def test_what_it_serves() -> None:
    assert topk_select.supports(VOCAB, 1)
    assert topk_select.supports(VOCAB, 64)
    assert topk_select.supports(10, 10)
    assert not topk_select.supports(10, 11)
    assert not topk_select.supports(VOCAB, 0)
    assert not topk_select.supports(VOCAB, 65)
    # As many candidates per row as one program takes, and more.
    assert topk_select.supports(4096 * topk_select.CHUNK, 4)
    assert not topk_select.supports(4097 * topk_select.CHUNK, 4)


@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(2, 100, dtype=torch.float32),
        torch.zeros(2, 100, dtype=torch.bfloat16)[:, ::2],
        torch.zeros(2, 3, 100, dtype=torch.bfloat16),
    ],
    ids=["fp32", "strided", "3d"],
)
def test_refuses_other_tensors(x: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="contiguous bf16"):
        topk_select.topk_rows(x, 4)


def test_refuses_a_k_it_does_not_serve() -> None:
    with pytest.raises(ValueError, match="does not serve k=65"):
        topk_select.topk_rows(torch.zeros(1, VOCAB, dtype=torch.bfloat16), 65)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("k", [1, 16, 64])
@pytest.mark.parametrize("rows", [3, 24])
def test_compiled_kernels_at_the_kimi_vocabulary(rows: int, k: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(rows * 1000 + k)
    x = (torch.randn(rows, VOCAB, generator=generator, device="cuda") * 3).bfloat16()
    x[0, 100:20_000:7] = x[0].max()  # ties across chunks at the top
    x[1, 5] = float("nan")
    _assert_selection(x, k, *topk_select.topk_rows(x, k))


@pytest.mark.gpu
@cuda_only
def test_cuda_top_k_frames_hold_the_selection() -> None:
    generator = torch.Generator(device="cuda").manual_seed(7)
    logits = torch.randn(8, 3, VOCAB, generator=generator, device="cuda").bfloat16()
    frame = topk_frame(logits, 64).cpu()
    values, ids = _expected(logits.view(24, VOCAB), 64)
    half = 24 * 64 * 2
    assert frame.numel() == 24 * 64 * 6
    assert torch.equal(frame[:half], values.view(torch.uint8).reshape(-1).cpu())
    assert torch.equal(frame[half:], ids.view(torch.uint8).reshape(-1).cpu())
