# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU references the other layer-2 tests sample with are upstream's
Triton kernels, bit for bit on tokens and caches, and ``publish`` drives the
real ``gumbel_sample``: ``k3_l2_interpreted.py`` runs them under Triton's
interpreter in a fresh process (the interpreter must be chosen before triton
is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "k3_l2_interpreted.py"


def test_references_match_upstream_kernels_under_the_interpreter():
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
        [sys.executable, str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all interpreted checks passed" in proc.stdout
