# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``bench/bench_draft_logits.py``, run as an operator runs it: a value its
table server would refuse is a one-line usage error before the server
starts, and the server's own refusal is one line and exit status 1, not a
traceback of each process, as is a server that stops answering mid-run;
``--curve`` runs the server and the client over CurveZMQ."""

import json
import os
import signal
import subprocess
import sys
import time
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
        (
            "--reply-timeout-s",
            "1e12",
            "'1e12' is not from 0.001 to 2.14748e+06 seconds",
        ),
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


def _established(port: int) -> bool:
    """Whether a TCP connection to loopback ``port`` is established."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _, state = line.split()[1:4]
        if int(local.split(":")[1], 16) == port and state == "01":
            return True
    return False


def test_a_table_server_that_stops_answering_ends_the_run_in_one_line(tmp_path):
    out = tmp_path / "out.json"
    bench = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--iters", "1000000", "--no-consume"]
        + ["--reply-timeout-s", "2", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        server = None
        # The client connects once the server said it serves.
        while bench.poll() is None and server is None:
            for child in Path(f"/proc/{bench.pid}/task").glob("*/children"):
                for pid in child.read_text().split():
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    # A child forked but not yet executed shows our command.
                    if b"--address" in argv:
                        address = argv[argv.index(b"--address") + 1]
                        if _established(int(address.rsplit(b":", 1)[1])):
                            server = int(pid)
            time.sleep(0.05)
        assert server is not None, bench.communicate()
        os.kill(server, signal.SIGKILL)
        stdout, stderr = bench.communicate(timeout=120)
    finally:
        bench.kill()
    assert bench.returncode == 1, stdout + stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].endswith("timed out after 2000 ms; the table server exited (-9)")
    assert not out.exists()
