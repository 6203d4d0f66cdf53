# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench/bench_propose_legs.py``, run as an operator runs it: every reply
the table server sends is matched with the client's call that asked for it,
so each case's legs come from its own requests."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_propose_legs.py"
CASES = ["b1 full", "b1 top-16", "b1 top-64", "b1 top-256", "b1 greedy"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_each_case_gets_the_legs_of_its_own_requests(tmp_path):
    """Only the logits cases run the extension: a greedy case with build or
    wait time, or a logits case without, would be another case's reply."""
    out = tmp_path / "legs.json"
    result = _run(
        *("--batch", "1", "--iters", "3", "--warmup", "1"),
        *("--context-rows", "1", "--context-width", "8", "--out", str(out)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    p50 = json.loads(out.read_text())["p50_us"]
    assert list(p50) == CASES
    for name, legs in p50.items():
        assert all(value >= 0 for value in legs.values()), (name, legs)
        assert legs["engine"] > 0, name
        if name.endswith("greedy"):
            assert legs["build"] == legs["wait"] == 0, legs
        else:
            assert legs["build"] > 0, (name, legs)


def test_a_batch_the_table_server_has_no_rows_for_is_a_usage_error(tmp_path):
    out = tmp_path / "legs.json"
    result = _run("--batch", "3", "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "argument --batch: invalid choice: 3" in result.stderr.splitlines()[-1]
    assert not out.exists()
