# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Standalone remote draft server (DSpark / DFlash) for speculative decoding.

    python -m vllm.entrypoints.k3_dspark_standalone --engine production \\
        --draft-model /ckpt/draft --target-model /ckpt/target \\
        --address tcp://10.0.0.5:5555 --curve-secret-key server.key_secret \\
        --curve-authorized-keys clients/ --enable-cuda-graph

Start-up order: the HTTP status server (``/healthz`` answers at once), then the
engine's memory plan is checked against the device (KV, worst-case prefix
cache, weights, staging), the model is loaded, CUDA graphs are captured and
the free device memory left is checked; only then does the RPC socket bind and
``/readyz`` turn 200. Every CLI value is validated at parse time. A transport
failure after start-up stops the process with the error (exit status 1);
SIGTERM/SIGINT stop it cleanly (exit status 0), during start-up at once. Run
as a program, the module installs the handlers before its own imports (torch);
only the import of the ``vllm`` package before it (which, with upstream vLLM
installed, imports torch too) keeps Python's default handling.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import re
import resource
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Set by SIGTERM/SIGINT from the moment the handlers are in: a stop during the
# imports or the parsing ends start-up cleanly as soon as ``run`` begins.
_stop = threading.Event()


def _request_stop(signum: int, frame: object) -> None:
    _stop.set()


def _install_stop_handlers() -> None:
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _request_stop)


if __name__ == "__main__":
    # Before the imports below, which take seconds (torch).
    _install_stop_handlers()

# The imports below come after the signal handlers on purpose.
# ruff: noqa: E402
import torch
import zmq

from vllm.entrypoints.k3_dspark_rpc import MAX_BUSY_POLL_US, RpcTransport
from vllm.k3_draft.engine import (
    DraftEngine,
    DraftLimits,
    GiB,
    available_memory,
)
from vllm.k3_draft.log import configure_process_logging, init_logger, logging_level
from vllm.k3_draft.protocol import load_capability_plugins
from vllm.k3_draft.reference_engine import ReferenceEngine, ReferenceModelConfig
from vllm.k3_draft.security import (
    BindRefused,
    CurveConfig,
    check_bind,
    check_bindable,
    probe_bind,
    warn_if_unsafe,
)
from vllm.k3_draft.server import DraftServer
from vllm.k3_draft.status import StatusServer, StatusState

logger = init_logger(__name__)

_REFERENCE_ONLY = (
    "method",
    "vocab_size",
    "context_width",
    "hidden_size",
    "num_layers",
    "num_heads",
    "seed",
    "latent_attention",
)
_PRODUCTION_ONLY = ("draft_model", "target_model")
# Counts, sizes and the seed end up in int64 tensors and torch's arguments.
_INT64_MAX = 2**63 - 1
# The soft limit of open files the server raises its own to (vLLM's).
_OPEN_FILES = 65535


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        if value > _INT64_MAX:
            raise argparse.ArgumentTypeError(f"{value} is above {_INT64_MAX}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range 1-65535")
    return value


def _busy_poll_us(text: str) -> int:
    value = _non_negative_int(text)
    if value > MAX_BUSY_POLL_US:
        raise argparse.ArgumentTypeError(f"{value} is above {MAX_BUSY_POLL_US}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{value} is not a positive finite number")
    return value


def _existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


def _existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return text


def parse_device(text: str) -> torch.device:
    """``--device``: ``cpu`` or ``cuda[:N]`` with ``N`` as written."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device type {device.type} unsupported")
    _, sep, index = text.partition(":")
    # torch wraps an index past its range around (cuda:4096 is cuda:0).
    if sep and str(device.index) != index:
        raise argparse.ArgumentTypeError(f"{text!r}: device index out of range")
    return device


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.entrypoints.k3_dspark_standalone",
        description=__doc__.split("\n\n")[0],
    )
    net = parser.add_argument_group("transport and status")
    net.add_argument(
        "--address",
        default="tcp://127.0.0.1:5555",
        help="ZeroMQ bind address of the RPC socket (ipc://, inproc:// or "
        "tcp://) (default: %(default)s)",
    )
    net.add_argument(
        "--status-host",
        default="127.0.0.1",
        help="HTTP status server host (default: %(default)s)",
    )
    net.add_argument(
        "--status-port",
        type=_port,
        default=8101,
        help="HTTP status server port (default: %(default)s)",
    )
    net.add_argument(
        "--curve-secret-key",
        type=_existing_file,
        help="certificate file with the server's CURVE key pair, readable by "
        "no other user (mode 0600; 0640 if root owns it)",
    )
    net.add_argument(
        "--curve-authorized-keys",
        type=_existing_dir,
        help="directory of authorized client public certificates (*.key), "
        "writable by no other user, read once at start-up: adding or removing "
        "one takes effect at the next start",
    )
    net.add_argument(
        "--allow-unsafe-remote-rpc",
        action="store_true",
        help="allow a non-loopback bind without CURVE (warned at every start); "
        "a bind on all interfaces (*, 0.0.0.0, ::) always needs the keys",
    )
    net.add_argument(
        "--busy-poll-us",
        type=_busy_poll_us,
        default=0,
        help="after each reply, poll the RPC socket without sleeping for this "
        f"many microseconds (at most {MAX_BUSY_POLL_US}) before sleeping in a "
        "receive: set it above the verifier's step time to answer PROPOSEs "
        "without a thread wake-up, for one host core busy while requests keep "
        "coming (default: %(default)s)",
    )

    limits = parser.add_argument_group("server bounds")
    limits.add_argument(
        "--max-requests",
        type=_positive_int,
        default=256,
        help="retained requests (KV slots) (default: %(default)s)",
    )
    limits.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=64,
        help="most requests in one PROPOSE (batch size) (default: %(default)s)",
    )
    limits.add_argument(
        "--max-speculative-tokens",
        type=_positive_int,
        default=8,
        help="most draft tokens per request and step (default: %(default)s)",
    )
    limits.add_argument(
        "--max-context-tokens",
        type=_positive_int,
        default=8192,
        help="most context rows in one PROPOSE (default: %(default)s)",
    )
    limits.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=131072,
        help="the verifier's max_model_len (default: %(default)s)",
    )
    limits.add_argument(
        "--block-size",
        type=_positive_int,
        default=16,
        help="draft KV block size in tokens (default: %(default)s)",
    )
    limits.add_argument(
        "--window-size",
        type=_positive_int,
        default=2048,
        help="draft attention window, a multiple of the block size "
        "(default: %(default)s)",
    )
    limits.add_argument(
        "--prefix-cache-tokens",
        type=_positive_int,
        help="projected-context rows cached per request (default: 2 x window)",
    )

    device = parser.add_argument_group("engine and device")
    device.add_argument(
        "--engine",
        choices=("reference", "production"),
        default="production",
        help="production: the draft checkpoint; reference: a small random "
        "draft for tests (default: %(default)s)",
    )
    device.add_argument(
        "--device",
        type=parse_device,
        default=torch.device("cuda"),
        help="cpu, cuda or cuda:N (default: %(default)s)",
    )
    device.add_argument(
        "--enable-cuda-graph",
        action="store_true",
        help="capture CUDA graphs of the draft pass at start-up",
    )
    device.add_argument(
        "--memory-limit-gib",
        type=_positive_float,
        help="device memory the server may use, at most the free memory at "
        "start (default: all of that): the memory plan is checked before "
        "loading and, on CUDA, the memory torch reserved by the end of start-up "
        "(loading, CUDA graphs, the largest query's warm-up)",
    )
    device.add_argument(
        "--min-free-memory-gib",
        type=_positive_float,
        default=1.0,
        help="free CUDA device memory required after CUDA graph capture (or, "
        "without graphs, after the largest query ran once); not checked on the "
        "CPU (default: %(default)s)",
    )

    prod = parser.add_argument_group("production engine")
    prod.add_argument(
        "--draft-model",
        type=_existing_dir,
        help="DFlash/DSpark draft checkpoint directory",
    )
    prod.add_argument(
        "--target-model",
        type=_existing_dir,
        help="target checkpoint (embedding and LM head)",
    )

    ref = parser.add_argument_group("reference engine (tests, qualification)")
    # Unset (None) unless given, so that the production engine can refuse them.
    model = ReferenceModelConfig()
    ref.add_argument(
        "--method",
        choices=("dflash", "dspark"),
        help=f"draft method (default: {model.method})",
    )
    for flag, parse, what in (
        ("--vocab-size", _positive_int, "vocabulary size"),
        ("--context-width", _positive_int, "width of a context row"),
        ("--hidden-size", _positive_int, "hidden size"),
        ("--num-layers", _positive_int, "decoder layers"),
        ("--num-heads", _positive_int, "attention heads"),
        ("--seed", _non_negative_int, "seed of the random weights"),
    ):
        default = getattr(model, flag[2:].replace("-", "_"))
        ref.add_argument(flag, type=parse, help=f"{what} (default: {default})")
    ref.add_argument(
        "--latent-attention",
        action="store_const",
        const=True,
        help="multi-head latent attention (MLA, as Kimi-K3's DSpark draft) "
        "instead of grouped-query attention",
    )
    return parser


# DraftLimits fields -> the flags that set them, for its refusals.
_LIMIT_FLAGS = {
    "max_requests": "--max-requests",
    "max_batch_size": "--max-num-seqs",
    "max_speculative_tokens": "--max-speculative-tokens",
    "max_context_tokens": "--max-context-tokens",
    "max_model_len": "--max-model-len",
    "block_size": "--block-size",
    "window_size": "--window-size",
    "prefix_cache_tokens": "--prefix-cache-tokens",
}
_LIMIT_FIELD = re.compile(r"\b(" + "|".join(_LIMIT_FLAGS) + r")\b")


def check_apart_from_status(address: str, status_host: str, status_port: int) -> None:
    """Refuse (``BindRefused``) a TCP ``address`` that the status server's own
    bind on ``status_host:status_port`` would take (the same port on an
    overlapping host): the status server binds first and keeps the port, so
    the RPC bind would fail only after loading. Tried by holding the status
    address and binding ``address`` next to it; when the status address is
    in use now, that is found when the status server binds."""
    transport, _, endpoint = address.partition("://")
    port = endpoint.rpartition(":")[2]
    if transport != "tcp" or not port.isdigit() or int(port) != status_port:
        return
    family = socket.getaddrinfo(
        status_host, status_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as held:
        # As the status server binds (http.server sets SO_REUSEADDR).
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind((status_host, status_port))
            held.listen()
        except OSError:
            return
        error = probe_bind(address)
    if error is not None and error.errno == zmq.EADDRINUSE:
        raise BindRefused(
            f"{address} takes port {status_port}, which the status "
            f"server binds first on {status_host} (--status-port)"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; any invalid value is a usage error (exit 2)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.prefix_cache_tokens is None:
        args.prefix_cache_tokens = 2 * args.window_size
    try:
        args.limits = DraftLimits(
            max_requests=args.max_requests,
            max_batch_size=args.max_num_seqs,
            max_speculative_tokens=args.max_speculative_tokens,
            max_context_tokens=args.max_context_tokens,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            window_size=args.window_size,
            prefix_cache_tokens=args.prefix_cache_tokens,
        )
    except ValueError as exc:
        parser.error(_LIMIT_FIELD.sub(lambda m: _LIMIT_FLAGS[m[1]], str(exc)))
    try:
        socket.getaddrinfo(args.status_host, args.status_port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        parser.error(
            f"argument --status-host: cannot resolve {args.status_host!r}: {exc}"
        )
    if (args.curve_secret_key is None) != (args.curve_authorized_keys is None):
        parser.error("--curve-secret-key and --curve-authorized-keys go together")
    args.curve = None
    if args.curve_secret_key is not None:
        args.curve = CurveConfig(args.curve_secret_key, args.curve_authorized_keys)
        try:
            args.curve.check()
        except ValueError as exc:
            parser.error(str(exc))
    try:
        check_bind(args.address, args.curve, args.allow_unsafe_remote_rpc)
        check_bindable(args.address)
        check_apart_from_status(args.address, args.status_host, args.status_port)
    except BindRefused as exc:
        parser.error(f"argument --address: {exc}")
    if args.enable_cuda_graph and args.device.type != "cuda":
        parser.error("--enable-cuda-graph needs a CUDA --device")
    unused = _REFERENCE_ONLY if args.engine == "production" else _PRODUCTION_ONLY
    given = [name for name in unused if getattr(args, name) is not None]
    if given:
        parser.error(
            f"--engine {args.engine} does not use "
            + ", ".join("--" + name.replace("_", "-") for name in given)
        )
    if args.engine == "reference":
        defaults = ReferenceModelConfig()
        try:
            args.reference = ReferenceModelConfig(
                **{
                    name: getattr(defaults, name)
                    if getattr(args, name) is None
                    else getattr(args, name)
                    for name in _REFERENCE_ONLY
                }
            )
        except ValueError as exc:
            shown = ", ".join(
                f"--{name.replace('_', '-')} {getattr(args, name)}"
                for name in _REFERENCE_ONLY
                if getattr(args, name) is not None
            )
            parser.error(f"reference draft ({shown}): {exc}")
    elif args.draft_model is None or args.target_model is None:
        parser.error("--engine production needs --draft-model and --target-model")
    try:
        args.log_level = logging_level()
    except ValueError as exc:
        parser.error(str(exc))
    if args.device.type == "cuda":
        present = torch.cuda.device_count()
        index = args.device.index or 0
        if index >= present:
            parser.error(
                f"--device {args.device}: no such CUDA device ({present} present)"
            )
    return args


def build_engine(args: argparse.Namespace) -> DraftEngine:
    if args.engine == "reference":
        return ReferenceEngine(
            args.limits, args.reference, args.device, args.enable_cuda_graph
        )
    from vllm.k3_draft.production_engine import ProductionEngine

    return ProductionEngine.from_checkpoints(
        args.limits,
        args.draft_model,
        args.target_model,
        args.device,
        args.enable_cuda_graph,
    )


def check_memory_plan(engine: DraftEngine, limit_gib: float | None) -> None:
    """Refuse, before allocating, a configuration that cannot fit in the free
    memory of the device, or in ``limit_gib`` if that is less."""
    plan = engine.memory_plan()
    limit = available_memory(engine.device)
    if limit_gib is not None:
        limit = min(limit, limit_gib * GiB)  # a float: 1e300 GiB is no cap
    logger.info("Draft memory plan: %s", plan.describe())
    if plan.total > limit:
        raise MemoryError(
            f"the configuration needs {plan.describe()}, more than the "
            f"{limit / GiB:.3f} GiB available on {engine.device}"
        )


def check_free_after_capture(device: torch.device, min_free_gib: float) -> None:
    if device.type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    if free < min_free_gib * GiB:
        raise MemoryError(
            f"only {free / GiB:.3f} GiB free on {device} after the largest "
            f"query's warm-up, below --min-free-memory-gib {min_free_gib}"
        )


def check_memory_used(device: torch.device, limit_gib: float | None) -> None:
    """Refuse a CUDA server that reserved more than ``limit_gib`` by the end of
    start-up: the plan leaves out the working memory of a query pass and the
    CUDA graphs' pools, which the warm-up and the capture have reserved."""
    if limit_gib is None or device.type != "cuda":
        return
    used = torch.cuda.max_memory_reserved(device)
    if used > limit_gib * GiB:
        raise MemoryError(
            f"start-up reserved {used / GiB:.3f} GiB on {device}, above "
            f"--memory-limit-gib {limit_gib}"
        )


class StartUpInterrupted(BaseException):
    """SIGTERM/SIGINT before the transport serves (a BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` in loading code
    swallows it)."""


@contextlib.contextmanager
def _interruptible_start_up(stop: threading.Event) -> Iterator[None]:
    """Run start-up so that a stop request ends it: loading can take minutes,
    so in the main thread SIGTERM/SIGINT set ``stop`` and raise
    ``StartUpInterrupted`` at once; a stop requested before (or, from another
    thread, during) start-up raises when it begins (ends)."""
    if stop.is_set():
        raise StartUpInterrupted
    previous = {}
    if threading.current_thread() is threading.main_thread():

        def interrupt(signum: int, frame: object) -> None:
            stop.set()
            raise StartUpInterrupted

        previous = {
            signum: signal.signal(signum, interrupt) for signum in _STOP_SIGNALS
        }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stop.is_set():
        raise StartUpInterrupted


def run(args: argparse.Namespace, stop: threading.Event) -> int:
    """Serve until ``stop`` is set; returns the process exit status."""
    state = StatusState()
    try:
        status = StatusServer(state, args.status_host, args.status_port)
    except (OSError, ValueError) as exc:  # ValueError: a host IDNA refuses
        logger.error(
            "Refusing to serve: cannot serve status on %s port %d: %s",
            args.status_host,
            args.status_port,
            exc,
        )
        return 1
    status.start()
    warn_if_unsafe(args.address, args.curve)
    try:
        with _interruptible_start_up(stop):
            engine = build_engine(args)
            check_memory_plan(engine, args.memory_limit_gib)
            engine.load()
            shapes = engine.capture_cuda_graphs()
            check_free_after_capture(engine.device, args.min_free_memory_gib)
            check_memory_used(engine.device, args.memory_limit_gib)
            load_capability_plugins()
            server = DraftServer(engine, shapes)
            # Long-lived start-up objects need no further cyclic GC passes.
            gc.collect()
            gc.freeze()
    except StartUpInterrupted:
        logger.info("Stopped during start-up")
        status.stop()
        return 0
    except torch.OutOfMemoryError as exc:
        # Loading, capture or the warm-up asked for more than the device had
        # (another process took memory after the plan was checked).
        logger.error("Refusing to serve: out of device memory: %s", exc)
        status.stop()
        return 1
    except (MemoryError, ValueError) as exc:
        # A configuration that cannot fit, or a checkpoint or configuration
        # the engine refuses (CheckpointError and the other ValueErrors).
        logger.error("Refusing to serve: %s", exc)
        status.stop()
        return 1
    state.server = server
    transport = RpcTransport(
        server,
        args.address,
        args.curve,
        args.allow_unsafe_remote_rpc,
        busy_poll_us=args.busy_poll_us,
    )
    try:
        transport.bind()
    except (zmq.ZMQError, ValueError, OSError) as exc:
        # The address, or CURVE keys that no longer load (changed on disk
        # since start-up read them).
        logger.error("Refusing to serve: cannot bind %s: %s", args.address, exc)
        transport.close()
        status.stop()
        return 1
    try:
        transport.serve(stop, lambda: state.set_ready(True))
    except Exception:
        state.set_ready(False)
        state.phase = "failed"
        logger.exception("Draft RPC transport failed; stopping")
        return 1
    finally:
        transport.close()
        status.stop()
    logger.info("Draft server stopped")
    return 0


def raise_open_file_limit() -> None:
    """Raise the soft limit of open files to the hard one, at most 65,535 (as
    vLLM's API server does): each client connection, and each handshake in
    progress, holds a descriptor, and a distribution's default soft limit of
    1,024 lets a burst of connections keep new clients and the status server
    out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, _OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: Sequence[str] | None = None) -> None:
    # Installed already when run as a program, not when called.
    _install_stop_handlers()
    args = parse_args(argv)
    configure_process_logging(args.log_level)
    raise_open_file_limit()
    sys.exit(run(args, _stop))


if __name__ == "__main__":
    main()
