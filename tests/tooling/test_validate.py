# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The validation step qualify and lint run refuses an inconsistent stack."""

from __future__ import annotations

import re

import pytest
from conftest import Synthetic

from k3stack import StackError
from k3stack.series import load_stack


def claim(syn: Synthetic, n: int, rel: str) -> None:
    patch = syn.root / "patches" / f"{n:04d}-layer-{n}.patch"
    text = patch.read_text()
    patch.write_text(re.sub(r"Overlay:\n", f"Overlay:\n {rel}\n", text, count=1))


def test_an_overlay_file_claimed_by_two_layers_is_refused(filled: Synthetic) -> None:
    claim(filled, 3, "vllm/logits.py")
    with pytest.raises(StackError, match="claimed by 0002-layer-2.patch and 0003"):
        load_stack(filled.root)


def test_a_series_entry_without_a_file_is_refused(synthetic: Synthetic) -> None:
    (synthetic.root / "patches" / "0002-layer-2.patch").unlink()
    with pytest.raises(StackError, match="lists 0002-layer-2.patch, which does not"):
        load_stack(synthetic.root)


def test_a_patch_file_not_in_the_series_is_refused(synthetic: Synthetic) -> None:
    (synthetic.root / "patches" / "0009-stray.patch").write_text("x")
    with pytest.raises(StackError, match="not in patches/series: 0009-stray.patch"):
        load_stack(synthetic.root)


def test_an_overlay_file_no_layer_claims_is_refused(synthetic: Synthetic) -> None:
    (synthetic.root / "overlay" / "vllm" / "orphan.py").write_text("")
    with pytest.raises(StackError, match="claimed by no layer: vllm/orphan.py"):
        load_stack(synthetic.root)


def test_a_claimed_overlay_file_that_is_missing_is_refused(
    synthetic: Synthetic,
) -> None:
    claim(synthetic, 1, "vllm/ghost.py")
    with pytest.raises(StackError, match="overlay file vllm/ghost.py does not exist"):
        load_stack(synthetic.root)


def test_a_patch_without_dep3_fields_is_refused(synthetic: Synthetic) -> None:
    patch = synthetic.root / "patches" / "0001-layer-1.patch"
    patch.write_text(patch.read_text().replace("Forwarded: not-needed\n", ""))
    with pytest.raises(StackError, match="missing header fields Forwarded"):
        load_stack(synthetic.root)
