# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the layer-1 tests: a real draft server process and a raw client.

``DraftServerProcess`` runs the draft server (``vllm.entrypoints.
k3_dspark_standalone --engine reference --device cpu``) with
``DEFAULT_OPTIONS`` (overridable) on an ipc path or a free loopback TCP port,
waits for ``/readyz`` and stops the process on ``stop()``. The process is
forked from a warm process that has imported the entry module once (torch and
vllm take seconds to import, per process); it then runs the module's ``main``
with the same arguments, environment and working directory as ``command()``,
which tests of the program's own start-up and shut-down run instead
(``as_program``). ``RawClient``
sends arbitrary frames over a REQ socket and renews the socket after a
timeout. ``propose_message`` builds a PROPOSE.
"""

from __future__ import annotations

import http.client
import itertools
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.auth

from vllm.k3_draft import protocol

# A small reference draft and bounds that the layer-1 tests rely on.
DEFAULT_OPTIONS: dict[str, Any] = {
    "method": "dflash",
    "vocab_size": 1024,
    "context_width": 192,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "seed": 0,
    "max_requests": 16,
    "max_num_seqs": 8,
    "max_speculative_tokens": 4,
    "max_context_tokens": 1024,
    "max_model_len": 4096,
    "block_size": 16,
    "window_size": 64,
    "prefix_cache_tokens": 128,
}
_START_TIMEOUT_S = 180.0
_PORT_ATTEMPTS = 3
# The server's refusal when its status port is taken (standalone entrypoint).
_STATUS_PORT_TAKEN = "cannot serve status on"
# free_tcp_port's blocks: 12 of 1,000 ports from 20000, below the ephemeral
# range (32768-60999 by default) from which the kernel picks ports itself.
_PORT_BASE = 20_000
_PORTS_PER_WORKER = 1_000
_PORT_BLOCKS = 12
_port_draws = itertools.count(os.getpid())


def create_certificates(
    directory: str | os.PathLike[str], name: str
) -> tuple[str, str]:
    """``zmq.auth.create_certificates``, with the secret file's mode 0600 as
    the server and the verifier require (pyzmq leaves it to the umask)."""
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret


def free_tcp_port() -> int:
    """A loopback TCP port, free a moment ago, that neither another
    pytest-xdist worker nor the kernel (outgoing connections, binds to port 0)
    hands out before the caller binds it: each worker draws from its own block
    below the ephemeral range, each process from its own place in the block,
    and a port comes round again only after 1,000 draws."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    block = _PORT_BASE + (int(worker) % _PORT_BLOCKS) * _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = block + next(_port_draws) % _PORTS_PER_WORKER
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    last = block + _PORTS_PER_WORKER - 1
    raise RuntimeError(f"no free loopback port in {block}..{last}")


# What the warm process imports before it forks server processes.
_WARM_PRELOAD = ["vllm.entrypoints.k3_dspark_standalone", "k3_layer1_server"]


def warm_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context whose server process has imported the draft
    server's entry module (and this one): processes it starts skip those
    imports. One server per test process, started on first use."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_WARM_PRELOAD)
    return context


def _run_logged(
    log_path: str,
    env: dict[str, str],
    cwd: str,
    target: Callable[..., object],
    args: tuple[Any, ...],
) -> None:
    """The body of a warm process: ``target(*args)`` in ``env`` and ``cwd``,
    standard output and error to ``log_path``."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


def _run_server(argv: list[str]) -> None:
    """The entry module's ``main(argv)``, as ``python -m`` runs it."""
    from vllm.entrypoints import k3_dspark_standalone

    sys.argv = [k3_dspark_standalone.__file__, *argv]
    k3_dspark_standalone.main(argv)


class WarmProcess:
    """``target(*args)`` in a process forked from ``warm_context``, in this
    process's environment and working directory, its output appended to
    ``log_path``; with the part of ``subprocess.Popen``'s surface the tests
    use (``SystemExit`` sets the exit status as in a program). It is
    daemonic: a test process that exits stops it."""

    def __init__(
        self,
        target: Callable[..., object],
        args: tuple[Any, ...],
        log_path: Path,
    ) -> None:
        self.args = [getattr(target, "__name__", repr(target)), *map(str, args)]
        self._process = warm_context().Process(
            target=_run_logged,
            args=(str(log_path), dict(os.environ), os.getcwd(), target, args),
            daemon=True,
        )
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def cli_args(options: dict[str, Any]) -> list[str]:
    """``--name value`` pairs (``True`` -> bare flag, ``None`` -> omitted)."""
    args: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not None and value is not False:
            args += [flag, str(value)]
    return args


class DraftServerProcess:
    """A reference-engine draft server process on loopback."""

    def __init__(
        self,
        workdir: Path,
        address: str | None = None,
        as_program: bool = False,
        **options: Any,
    ):
        """``as_program``: run ``command()`` rather than fork a warm process
        (for tests of the program's own start-up and shut-down)."""
        self.workdir = workdir
        self.as_program = as_program
        workdir.mkdir(parents=True, exist_ok=True)
        self.address = address or f"ipc://{workdir}/draft.ipc"
        self.options = {**DEFAULT_OPTIONS, **options}
        self.status_port = free_tcp_port()
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | WarmProcess | None = None

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.status_port}"

    def arguments(self) -> list[str]:
        """The server's command-line arguments."""
        options = {
            "engine": "reference",
            "device": "cpu",
            "address": self.address,
            "status_port": self.status_port,
            **self.options,
        }
        return cli_args(options)

    def command(self) -> list[str]:
        """The server run as a program."""
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.k3_dspark_standalone",
            *self.arguments(),
        ]

    def launch(self) -> subprocess.Popen[bytes] | WarmProcess:
        """Start the process, logging to ``log_path``; do not wait."""
        proc: subprocess.Popen[bytes] | WarmProcess
        if self.as_program:
            with open(self.log_path, "ab") as log:
                proc = subprocess.Popen(
                    self.command(), stdout=log, stderr=subprocess.STDOUT
                )
        else:
            proc = WarmProcess(_run_server, (self.arguments(),), self.log_path)
        self.proc = proc
        return proc

    def start(self) -> DraftServerProcess:
        """Start and wait until ``/readyz`` answers 200. A status port that
        another process took between ``free_tcp_port`` and the bind is
        replaced by a fresh one (twice at most)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        for attempt in range(_PORT_ATTEMPTS):
            self.proc = self.launch()
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    if attempt + 1 < _PORT_ATTEMPTS and _STATUS_PORT_TAKEN in (
                        self.log_tail()
                    ):
                        self.status_port = free_tcp_port()
                        break
                    raise RuntimeError(f"draft server exited:\n{self.log_tail()}")
                if self.http("/readyz")[0] == 200:
                    return self
                time.sleep(0.1)
            else:
                break
        self.stop()
        raise RuntimeError(f"draft server not ready:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """Terminate (then kill) the process; returns its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def restart(self) -> DraftServerProcess:
        self.stop()
        self.status_port = free_tcp_port()
        return self.start()

    def http(self, path: str) -> tuple[int, bytes]:
        """(status code, body) of ``GET path``; (0, b"") when unreachable."""
        try:
            with urllib.request.urlopen(self.status_url + path, timeout=5) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (OSError, http.client.HTTPException):
            # Nothing there yet, or another process's socket on the port.
            return 0, b""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(
            self.log_path.read_text(errors="replace").splitlines()[-lines:]
        )


class RawClient:
    """A REQ socket that sends any frames and renews itself after a timeout."""

    def __init__(
        self,
        address: str,
        timeout_ms: int = 10000,
        curve: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        """``curve``: (client public, client secret, server public) keys."""
        self.address = address
        self.timeout_ms = timeout_ms
        self.curve = curve
        self.context = zmq.Context()
        self.socket = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        if self.curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = (
                self.curve
            )
        sock.connect(self.address)
        return sock

    def send_frames(self, frames: Sequence[Any]) -> list[bytes]:
        """Reply frames; raises ``zmq.Again`` (socket renewed) on timeout."""
        try:
            self.socket.send_multipart(list(frames))
            return self.socket.recv_multipart()
        except zmq.Again:
            self.socket.close(linger=0)
            self.socket = self._connect()
            raise

    def call(
        self, op: str, frames: Sequence[Any] = (), **fields: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        """(reply header, reply tensor frames) of a request ``op``."""
        header = protocol.encode_header(protocol.request_header(op, **fields))
        reply = self.send_frames([header, *frames])
        return json.loads(reply[0]), reply[1:]

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def entry(
    request_id: str,
    anchor_position: int,
    count: int = 0,
    reset: bool = False,
    reset_position: int = 0,
    anchor_token_id: int = 7,
) -> dict[str, Any]:
    """One PROPOSE request entry."""
    return {
        "request_id": request_id,
        "reset": reset,
        "reset_position": reset_position,
        "context_count": count,
        "anchor_token_id": anchor_token_id,
        "anchor_position": anchor_position,
    }


def context_frames(
    starts_counts: Sequence[tuple[int, int]], width: int, seed: int = 0
) -> list[memoryview]:
    """Positions and deterministic bf16 rows for runs of ``(start, count)``."""
    positions = torch.cat(
        [torch.arange(start, start + count) for start, count in starts_counts]
    )
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(positions.numel(), width, generator=generator)
    rows = rows.to(torch.bfloat16)
    return [protocol.tensor_frame(positions), protocol.tensor_frame(rows)]


def propose_message(
    entries: Sequence[dict[str, Any]],
    k: int,
    width: int,
    seed: int = 0,
    **fields: Any,
) -> list[Any]:
    """Frames of a PROPOSE whose context rows follow the entries' counts,
    each run ending at its anchor position."""
    runs = [
        (e["anchor_position"] - e["context_count"], e["context_count"])
        for e in entries
        if e["context_count"]
    ]
    header = protocol.request_header(
        protocol.OP_PROPOSE, num_speculative_tokens=k, requests=list(entries), **fields
    )
    frames = context_frames(runs, width, seed) if runs else []
    return [protocol.encode_header(header), *frames]
