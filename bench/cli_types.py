# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Argument types the benchmarks share: a bad value is a one-line usage
error before anything starts, not a traceback after the run."""

from __future__ import annotations

import argparse
import math
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def int_at_most(maximum: int) -> Callable[[str], int]:
    """A non-negative integer of at most ``maximum``."""

    def parse(text: str) -> int:
        value = non_negative_int(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above {maximum}")
        return value

    return parse


def positive_float(text: str) -> float:
    value = _float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


# ZeroMQ takes a socket's timeouts as a C int of milliseconds.
_MAX_TIMEOUT_S = (2**31 - 1) / 1e3


def zmq_timeout_s(text: str) -> float:
    """Seconds a ZeroMQ socket may wait: 1 ms to 2**31 - 1 ms."""
    value = _float(text)
    if not 1e-3 <= value <= _MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not from 0.001 to {_MAX_TIMEOUT_S:g} seconds"
        )
    return value


def device(text: str) -> str:
    """A ``--device`` the draft server parses (whether that CUDA device
    exists is the server's to say when it starts)."""
    from vllm.entrypoints.k3_dspark_standalone import parse_device

    parse_device(text)
    return text


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    return path


class Terminated(BaseException):
    """SIGTERM, raised in the main thread (a BaseException, like
    KeyboardInterrupt, so that the benchmark's clean-up runs)."""


# While ``popen`` starts a process, Ctrl-C and SIGTERM are noted here and
# raised once the process is recorded in ``_started``.
_held: list[type[BaseException]] | None = None
_started: list[subprocess.Popen] = []


def _raise(kind: type[BaseException]) -> None:
    if _held is None:
        raise kind
    _held.append(kind)


def _terminate(signum: int, frame: object) -> None:
    _raise(Terminated)


def _interrupt(signum: int, frame: object) -> None:
    _raise(KeyboardInterrupt)


def popen(command: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen``, with Ctrl-C and SIGTERM held until the process
    is recorded: ``run`` stops every process started so that is still
    running when the benchmark ends, so none outlives a signal that came
    while it started."""
    global _held
    _held = []
    try:
        proc = subprocess.Popen(command, **kwargs)
        _started.append(proc)
    finally:
        held, _held = _held, None
    if held:
        raise held[0]
    return proc


def refusal(proc: subprocess.Popen, log: IO[bytes]) -> str:
    """Why ``proc``, which has exited, did not start: the last line of its
    ``log`` (a usage error or the exception), else its exit status."""
    log.seek(0)
    lines = log.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def run(main: Callable[[], None]) -> None:
    """Run a benchmark's ``main``: Ctrl-C and SIGTERM end it with one line
    (exit 130, 143) after its own clean-up, not a traceback; no process it
    started through ``popen`` is left running."""
    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        print("terminated", file=sys.stderr)
        sys.exit(143)
    finally:
        for proc in _started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def output_file(text: str) -> Path:
    """A file to write at the end: its folder must exist now."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write a file at {text!r}")
    return path


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
