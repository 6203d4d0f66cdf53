# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench/bench_deferred_resolve.py``, run as ``ci/gpu-h200.sh`` runs it: a
time it cannot run a step with (zero, negative, not a number: a period
divided by zero, ``sys.setswitchinterval`` refusing it) or too few steps for
its medians is a one-line usage error before the GPU is touched, not a
traceback after the delay servers started."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_deferred_resolve.py"


@pytest.mark.parametrize(
    "args, error",
    [
        (["--t-ms", "-1"], "argument --t-ms: '-1' is not a positive number"),
        (["--h-ms", "0"], "argument --h-ms: '0' is not a positive number"),
        (["--l-ms", "nan"], "argument --l-ms: 'nan' is not a positive number"),
        (
            ["--switch-interval-us", "0"],
            "argument --switch-interval-us: '0' is not a positive number",
        ),
        (["--steps", "2"], "--steps: give at least 3"),
        (["--gate", "/nonexistent/gate.py"], "'/nonexistent/gate.py' is not a file"),
    ],
)
def test_a_value_it_cannot_run_with_is_a_usage_error(args, error, tmp_path):
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith(error)
    assert not out.exists()
