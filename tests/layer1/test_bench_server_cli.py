# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmarks that start layer 1's draft server (``bench/``), run as an
operator runs them: a value the server would refuse is a one-line usage
error before anything starts, a refusal of the server itself is its one line
and exit status 1, and Ctrl-C is one line: no traceback, no JSON written, no
process left behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "script",
    [
        "bench_remote_rpc.py",
        "bench_client_plan.py",
        "bench_draft_server_gpu.py",
    ],
)
def test_a_device_torch_cannot_parse_is_a_usage_error(script, tmp_path):
    out = tmp_path / "out.json"
    result = _run(script, "--device", "bogus", "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith(
        "error: argument --device: 'bogus' is not a device"
    )
    assert not out.exists()


def test_a_busy_poll_the_server_refuses_is_a_usage_error():
    result = _run("bench_remote_rpc.py", "--server-busy-poll-us", "2000000")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--server-busy-poll-us: 2000000 is above 1000000" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, error",
    [
        (["--device", "cpu"], "CUDA graphs against eager need a CUDA device"),
        (["--log-dir", "/nonexistent/logs"], "'/nonexistent/logs' is not a directory"),
    ],
)
def test_the_gpu_benchmark_refuses_what_it_cannot_honour_at_once(args, error):
    result = _run("bench_draft_server_gpu.py", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert error in result.stderr.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the server refuses no CUDA")
def test_the_draft_servers_refusal_is_one_line_and_exit_1(tmp_path):
    out = tmp_path / "out.json"
    result = _run(
        "bench_remote_rpc.py", "--device", "cuda", "--iters", "1", "--out", str(out)
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "the draft server did not start: python -m "
        "vllm.entrypoints.k3_dspark_standalone: error: --device cuda: no such "
        "CUDA device (0 present)"
    ]
    assert not out.exists()


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the parenthesised name (state
    first, then the parent's pid), or None once the process is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        stat = _stat(entry.name) if entry.name.isdigit() else None
        if stat is not None and int(stat[1]) == pid:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_ctrl_c_is_one_line_and_leaves_no_process(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "bench_remote_rpc.py"), "--iters", "1000000"]
        + ["--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # As a terminal runs it: SIGINT is not ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        # Both of its processes (the raw echo and the draft server) started:
        # the run is under way.
        while len(_children(proc.pid)) < 2 and proc.poll() is None:
            time.sleep(0.01)
        children = _children(proc.pid)
        # A terminal's Ctrl-C goes to the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stdout + stderr
    assert stderr.splitlines() == ["interrupted"]
    assert not out.exists()
    # The draft server shares the group, so the Ctrl-C stops it too, once
    # its imports are done; the raw echo, in a session of its own, only the
    # benchmark stops. None may stay running.
    deadline = time.monotonic() + 120
    while any(map(_running, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _running(pid)]
