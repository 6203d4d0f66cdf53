# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU references the other layer-2 tests sample with are upstream's
Triton kernels, bit for bit on tokens and caches, and ``publish`` drives the
real ``gumbel_sample``: ``k3_l2_interpreted.py`` runs them under Triton's
interpreter in a fresh process (the interpreter must be chosen before triton
is imported). vLLM's default rejection method, ``"standard"``, is checked
there too, on the drafts and draft-logits cache that layer 2's ``publish``
builds from codec replies, against textbook speculative sampling."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "k3_l2_interpreted.py"


def _run_interpreted(*args: str) -> str:
    pytest.importorskip("triton", reason="the interpreter check needs triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(SCRIPT.parent),
            str(SCRIPT.parent.parent / "layer1"),
            env.get("PYTHONPATH", ""),
        ]
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_references_match_upstream_kernels_under_the_interpreter():
    assert "all interpreted checks passed" in _run_interpreted()


def test_standard_method_accepts_and_resamples_topk_over_fill_exactly():
    """Top-k slices over the fill (whole vocabulary blocks of fill, T = 0.5,
    1.0, 1.7) and full-vocabulary rows: drafts, accepted lengths and emitted
    tokens equal textbook speculative sampling's with the same draws."""
    assert "standard rejection checks passed" in _run_interpreted("standard")
