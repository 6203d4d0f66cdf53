# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stream gate: park a CUDA stream until a host thread releases it.

``park()`` (the thread that owns the stream) enqueues ``cudaLaunchHostFunc``
of ``pthread_barrier_wait`` on a two-party barrier and returns at once; work
enqueued afterwards runs only once another host thread has called
``release()``, which itself returns when the stream reached the gate. Every
``park`` must be paired with exactly one ``release``; a gate is reusable once
both parties passed.

CUDA loads modules lazily: a kernel whose module was never loaded, launched
behind a parked stream, hangs the process. Run every kernel that may run
behind a gate once before the first ``park`` (see ``warm``).

Imports only the standard library and torch, so that it runs where vLLM's
compiled extensions cannot be loaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading
from collections.abc import Callable

import torch

# sizeof(pthread_barrier_t) is 32 on x86_64 and aarch64 glibc; keep headroom.
_BARRIER_BYTES = 128


class _Runtime:
    """libc's barrier functions and torch's bundled CUDA runtime."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        self.barrier_init = libc.pthread_barrier_init
        self.barrier_init.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self.barrier_wait = libc.pthread_barrier_wait
        self.barrier_wait.argtypes = [ctypes.c_void_p]
        self.barrier_destroy = libc.pthread_barrier_destroy
        self.barrier_destroy.argtypes = [ctypes.c_void_p]
        # The host function is pthread_barrier_wait itself: a C address, so the
        # CUDA callback thread never needs the GIL.
        self.barrier_wait_address = ctypes.cast(self.barrier_wait, ctypes.c_void_p)
        cudart = ctypes.CDLL(_find_cudart())
        self.launch_host_func = cudart.cudaLaunchHostFunc
        self.launch_host_func.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self.launch_host_func.restype = ctypes.c_int


def _find_cudart() -> str:
    """The bundled libcudart of torch (``torch/lib`` or the nvidia wheels beside
    torch), else the system's."""
    torch_dir = os.path.dirname(torch.__file__)
    patterns = (
        os.path.join(torch_dir, "lib", "libcudart.so*"),
        os.path.join(os.path.dirname(torch_dir), "nvidia", "*", "lib", "libcudart.so*"),
    )
    candidates = sorted(path for p in patterns for path in glob.glob(p))
    if candidates:
        return candidates[-1]
    found = ctypes.util.find_library("cudart")
    if found is None:
        raise OSError("libcudart not found (torch's bundled runtime or the system's)")
    return found


_runtime: _Runtime | None = None
_runtime_lock = threading.Lock()


def _get_runtime() -> _Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = _Runtime()
        return _runtime


def require_runtime() -> None:
    """Raise ``OSError`` where no gate can be made (no CUDA runtime to load,
    as on ROCm)."""
    _get_runtime()


class StreamGate:
    """A two-party barrier between a CUDA stream and a host thread."""

    def __init__(self) -> None:
        self._rt = _get_runtime()
        self._barrier = ctypes.create_string_buffer(_BARRIER_BYTES)
        if self._rt.barrier_init(self._barrier, None, 2) != 0:
            raise OSError("pthread_barrier_init failed")

    def park(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue the gate on ``stream`` (default: the current stream)."""
        stream = stream or torch.cuda.current_stream()
        err = self._rt.launch_host_func(
            ctypes.c_void_p(stream.cuda_stream),
            self._rt.barrier_wait_address,
            ctypes.cast(self._barrier, ctypes.c_void_p),
        )
        if err != 0:
            raise RuntimeError(f"cudaLaunchHostFunc failed with CUDA error {err}")

    def release(self) -> None:
        """Let the parked stream run; returns once the stream reached the gate."""
        self._rt.barrier_wait(self._barrier)

    def __del__(self) -> None:
        rt = getattr(self, "_rt", None)
        if rt is not None:
            rt.barrier_destroy(self._barrier)


def warm(*kernels: Callable[[], object]) -> None:
    """Run each callable once and synchronize, so that its CUDA modules are
    loaded before any stream is parked."""
    for kernel in kernels:
        kernel()
    torch.cuda.synchronize()


class ReplyGate:
    """One host-side reply that a stream waits for.

    The reply thread calls ``deliver``; the stream's owner calls ``wait``
    (enqueue-only with a ``StreamGate``; blocking without one, for host-only
    devices). The gate is parked only if the reply is still outstanding when
    ``wait`` runs, and ``deliver`` releases it whatever ``fill`` did, so a
    parked stream always resumes. ``wait_sent`` returns once the reply thread
    called ``mark_sent`` (its request left) or ``deliver`` finished. Use each
    instance for one reply; ``reset`` makes it ready for the next (only after
    ``deliver`` returned).
    """

    def __init__(self, gate: StreamGate | None) -> None:
        self._gate = gate
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._sent = threading.Event()
        self._parked = False

    def reset(self) -> None:
        assert self._done.is_set() or not self._parked
        self._done.clear()
        self._sent.clear()
        self._parked = False

    def mark_sent(self) -> None:
        """Reply thread: the reply's request is on its way."""
        self._sent.set()

    def wait_sent(self) -> None:
        """Until ``mark_sent`` was called or ``deliver`` finished."""
        self._sent.wait()

    @property
    def delivered(self) -> bool:
        """Whether ``deliver`` finished (staging final, ``fail`` ran if any)."""
        return self._done.is_set()

    def deliver(
        self,
        fill: Callable[[], None],
        fail: Callable[[BaseException], None],
    ) -> None:
        """Reply thread: ``fill`` the staging memory (``fail(exc)`` stages the
        empty reply if it raises), then let the waiting stream run."""
        try:
            try:
                fill()
            except BaseException as exc:
                fail(exc)
        finally:
            self._sent.set()
            with self._lock:
                self._done.set()
                parked = self._parked
            if parked and self._gate is not None:
                self._gate.release()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Stream owner: order the stream's next work after the reply. If
        parking raises, the gate counts as not parked: ``deliver`` then
        releases nothing."""
        with self._lock:
            if self._done.is_set():
                return
            if self._gate is not None:
                # Enqueue-only; under the lock, so that ``deliver`` sees the
                # gate parked exactly when a stream will reach it.
                self._gate.park(stream)
                self._parked = True
                return
        self._done.wait()
