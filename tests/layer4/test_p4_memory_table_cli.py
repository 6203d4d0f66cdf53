# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench/p4_memory_table.py`` (the draft memory tables of
``docs/p4-replicated-draft-kv.md``), run as the docs run it: a count that is
not positive is a one-line usage error, not a traceback or a table of
negative requests."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "p4_memory_table.py"


@pytest.mark.parametrize(
    "flag, value",
    [("--draft-block-size", "0"), ("--pool-gib", "-1"), ("--draft-layers", "0")],
)
def test_a_count_that_is_not_positive_is_a_usage_error(flag, value):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), flag, value],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert f"argument {flag}: {value!r} is not a positive integer" in result.stderr
