# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench/bench_draft_logits.py``, run as an operator runs it: a value its
table server would refuse is a one-line usage error before the server
starts, and the server's own refusal is one line and exit status 1, not a
traceback of each process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_draft_logits.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "flag, value, error",
    [
        ("--device", "bogus", "'bogus' is not a device"),
        ("--server-busy-poll-us", "2000000", "2000000 is above 1000000"),
    ],
)
def test_a_value_the_server_refuses_is_a_usage_error(flag, value, error, tmp_path):
    out = tmp_path / "out.json"
    result = _run(flag, value, "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith(f"argument {flag}: {error}")
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the server refuses no CUDA")
def test_the_table_servers_refusal_is_one_line_and_exit_1(tmp_path):
    out = tmp_path / "out.json"
    result = _run("--device", "cuda", "--iters", "1", "--out", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("the table server did not start: RuntimeError: ")
    assert not out.exists()


def test_a_curve_run_measures_the_table_server_over_curve(tmp_path):
    """A peer of the other mechanism never completes ZeroMQ's handshake: a run
    that gets every answer had the server and the client on CURVE."""
    out = tmp_path / "out.json"
    result = _run(
        *("--curve", "--iters", "1", "--warmup", "0", "--no-consume"),
        *("--out", str(out)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["meta"]["curve"] is True
    cases = [
        f"b{b} {f}"
        for b in (1, 8)
        for f in ("full", "top-16", "top-64", "top-256", "greedy")
    ]
    assert [case["case"] for case in report["transport"]] == cases
