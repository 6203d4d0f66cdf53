# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmarks that start layer 1's draft server (``bench/``), run as an
operator runs them: a value the server would refuse is a one-line usage
error before anything starts, a refusal of the server itself is its one line
and exit status 1, as is a server that stops answering mid-run, and Ctrl-C
and SIGTERM are one line: no traceback, no JSON written, no process left
behind (these read ``/proc``); ``--curve`` runs the server and the raw echo
over CurveZMQ."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
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


@pytest.mark.parametrize("value", ["1e12", "0.0001"])
def test_a_reply_timeout_zeromq_cannot_take_is_a_usage_error(value):
    """ZeroMQ's timeouts are C ints of milliseconds: 1e12 s overflowed its
    setsockopt, and the unclosed socket hung the run's clean-up."""
    result = _run("bench_remote_rpc.py", "--reply-timeout-s", value)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].endswith(
        f"--reply-timeout-s: '{value}' is not from 0.001 to 2.14748e+06 seconds"
    )


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


def test_a_curve_run_measures_the_server_and_the_raw_echo_over_curve(tmp_path):
    """A peer of the other mechanism never completes ZeroMQ's handshake: a run
    that gets every answer had the draft server and the raw echo on CURVE."""
    out = tmp_path / "out.json"
    result = _run(
        "bench_remote_rpc.py",
        *("--curve", "--iters", "2", "--warmup", "0"),
        *("--reply-timeout-s", "20", "--out", str(out)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["meta"]["curve"] is True
    cases = ["ping", "propose b1", "propose b8"]
    assert [case["case"] for case in report["results"]] == cases


def test_the_server_phases_with_an_engine_at_once_time_every_phase(tmp_path):
    out = tmp_path / "out.json"
    result = _run(
        "bench_server_phases.py",
        *("--engine-at-once", "--iters", "3", "--warmup", "0", "--out", str(out)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["meta"]["engine_at_once"] is True
    assert set(report["p50_us"]) == {
        *("decode", "entries", "frame tensors", "positions", "parse (all)"),
        *("table checks", "apply", "engine", "reply header", "handle"),
        "outside_engine",
    }


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


@pytest.fixture
def started():
    """Every process a test's benchmark started, killed at teardown if the
    test failed with any still running."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def _start_rpc_bench(out: Path, started: list[int], *args: str) -> subprocess.Popen:
    """``bench_remote_rpc.py`` as a terminal runs it (its own process group,
    SIGINT not ignored), once its two processes (the raw echo and the draft
    server) have started; their pids are added to ``started``."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "bench_remote_rpc.py"), "--iters", "1000000"]
        + ["--out", str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    while len(_children(proc.pid)) < 2 and proc.poll() is None:
        time.sleep(0.01)
    started.extend(_children(proc.pid))
    return proc


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _assert_stopped(children: list[int]) -> None:
    """None of ``children`` may stay running (bounded wait: a child that got
    the signal too may still be stopping)."""
    deadline = time.monotonic() + 120
    while any(map(_running, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _running(pid)]


def test_ctrl_c_is_one_line_and_leaves_no_process(tmp_path, started):
    out = tmp_path / "out.json"
    proc = _start_rpc_bench(out, started)
    # A terminal's Ctrl-C goes to the whole foreground process group: the
    # draft server stops by itself too, the raw echo (a session of its own)
    # only by the benchmark.
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 130, stdout + stderr
    assert stderr.splitlines() == ["interrupted"]
    assert not out.exists()
    _assert_stopped(started)


def test_sigterm_is_one_line_and_stops_the_processes_it_started(tmp_path, started):
    """A supervisor's SIGTERM reaches the benchmark alone: it must stop the
    draft server and the raw echo it started."""
    out = tmp_path / "out.json"
    proc = _start_rpc_bench(out, started)
    _measuring(proc)
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = _finish(proc)
    assert proc.returncode == 143, stdout + stderr
    assert stderr.splitlines() == ["terminated"]
    assert not out.exists()
    _assert_stopped(started)


def _draft_server(bench: subprocess.Popen) -> tuple[int, int]:
    """The pid and status port of the benchmark's draft server, once it runs
    as one (a child forked but not yet executed still shows the benchmark's
    command line)."""
    while bench.poll() is None:
        for pid in _children(bench.pid):
            try:
                argv = (Path("/proc") / str(pid) / "cmdline").read_bytes()
            except OSError:
                continue
            args = argv.split(b"\0")
            if b"vllm.entrypoints.k3_dspark_standalone" in args:
                return pid, int(args[args.index(b"--status-port") + 1])
        time.sleep(0.01)
    raise AssertionError(f"the benchmark ended first: {bench.communicate()}")


def _measuring(bench: subprocess.Popen) -> int:
    """The pid of the benchmark's draft server, once the benchmark's
    requests reach it (its start-up is over: it measures PINGs first)."""
    pid, port = _draft_server(bench)
    url = f"http://127.0.0.1:{port}/v1/status"
    while bench.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                # Until the model is loaded the status has no counters.
                if json.load(reply).get("requests_by_op", {}).get("PING"):
                    return pid
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the benchmark ended first: {bench.communicate()}")


def test_a_draft_server_that_stops_answering_ends_the_run_in_one_line(
    tmp_path, started
):
    out = tmp_path / "out.json"
    proc = _start_rpc_bench(out, started, "--reply-timeout-s", "2")
    try:
        os.kill(_measuring(proc), signal.SIGKILL)
    finally:
        stdout, stderr = _finish(proc)
    assert proc.returncode == 1, stdout + stderr
    assert stderr.splitlines() == [
        "no answer within 2 s: the draft server exited (status -9)"
    ]
    assert not out.exists()
    _assert_stopped(started)


_SIGNALLED_WHILE_STARTING = """
import os, signal, subprocess, sys, time
sys.path.insert(0, {bench!r})
from cli_types import popen, run

def started_child():
    # In the child, before it runs its command: the benchmark is still
    # inside popen, waiting for it.
    with open({pid_file!r}, "w") as pid_file:
        pid_file.write(str(os.getpid()))
    os.kill(os.getppid(), signal.{signal})

def main():
    popen([sys.executable, "-c", "import time; time.sleep(300)"],
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
          preexec_fn=started_child)
    time.sleep(300)

run(main)
"""


@pytest.mark.parametrize(
    "name, status, line",
    [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")],
)
def test_a_signal_while_a_process_starts_stops_that_process_too(
    tmp_path, started, name, status, line
):
    """A signal that comes while the benchmark is inside ``Popen`` (its server
    forked, not yet running its command) must not leave that server behind."""
    pid_file = tmp_path / "child.pid"
    script = _SIGNALLED_WHILE_STARTING.format(
        bench=str(BENCH), pid_file=str(pid_file), signal=name
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
    finally:
        if pid_file.exists():
            started.append(int(pid_file.read_text()))
    assert result.returncode == status, result.stdout + result.stderr
    assert result.stderr.splitlines() == [line]
    _assert_stopped(started)
