# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused MLA verify benchmarks (``bench/``) on a machine without CUDA:
one line and exit status 1, not a traceback out of ``torch.cuda``, and no
report written; a missing upstream kernel is a usage error."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "script, args",
    [
        ("bench_fused_mla_verify.py", ["--upstream-kernel", __file__]),
        ("compare_fused_mla_verify.py", [f"mine={__file__}"]),
    ],
)
def test_without_cuda_it_refuses_in_one_line(script, args, tmp_path):
    out = tmp_path / "out.json"
    result = _run(str(ROOT / "bench" / script), *args, "--out", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"{Path(script).stem} needs a CUDA GPU"]
    assert not out.exists()


def test_a_missing_upstream_kernel_is_a_usage_error(tmp_path):
    result = _run(
        str(ROOT / "bench" / "bench_fused_mla_verify.py"),
        *("--upstream-kernel", str(tmp_path / "missing.py")),
        *("--out", str(tmp_path / "out.json")),
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "argument --upstream-kernel" in result.stderr.splitlines()[-1]
