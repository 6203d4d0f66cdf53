# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bind rules and CurveZMQ for the draft server's RPC socket.

* ``ipc://``, ``inproc://`` and loopback TCP (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104,
  localhost)
  binds are allowed as they are.
* Any other TCP bind needs CurveZMQ: the server's key pair (a certificate file
  as written by ``zmq.auth.create_certificates``) and a directory of the
  authorized clients' public certificates, enforced by a ZAP handler
  (``zmq.auth.thread.ThreadAuthenticator``). Clients configure the server's
  public key.
* Without keys, a non-loopback bind is refused unless
  ``allow_unsafe_remote_rpc`` is set, which logs a warning at every start. A
  wildcard bind (``*`` or any spelling of the unspecified address that the
  resolver accepts: ``0.0.0.0``, ``0``, ``0x0``, ``::``, ``::ffff:0.0.0.0``,
  each also with a zone, ``0.0.0.0%lo``, which ZeroMQ drops) without CURVE is
  always refused.
* Keys given for a local bind enable CURVE there too.
* Other transports are refused, and so are an IPv6 literal without brackets
  (``tcp://[::1]:5555``) and a port in other than ASCII digits.
* An ipc path must fit a Unix socket address, lie in an existing directory
  this process may write and not name anything but a socket (ZeroMQ unlinks
  the path before it binds); an abstract name (``@name``) must fit too;
  at bind time, a socket on which a server accepts connections is in use.
* A TCP host must be bindable on this machine (an address of it, an interface
  or a name ZeroMQ resolves to one), tried before anything is loaded.
"""

from __future__ import annotations

import errno
import glob
import ipaddress
import os
import socket as _socket
import stat
import struct
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from vllm.k3_draft.log import init_logger

logger = init_logger(__name__)


def _read_certificate(path: str) -> tuple[bytes, bytes | None]:
    """``zmq.auth.load_certificate``, with a key line lacking ``=`` (on
    which it raises IndexError) a ``ValueError``."""
    try:
        return zmq.auth.load_certificate(path)
    except IndexError:
        raise ValueError("a public-key or secret-key line has no '='") from None


def check_secret_file_mode(path: str) -> None:
    """``ValueError`` naming ``path`` when the secret key file (a link
    followed) is open to other users, as ssh refuses a private key: any
    access by group or others, but for a group read of a file that root
    owns (a key shared with a service group, as PostgreSQL allows)."""
    status = os.stat(path)
    mode = stat.S_IMODE(status.st_mode)
    owned_by_root = status.st_uid == 0
    if mode & (0o037 if owned_by_root else 0o077):
        raise ValueError(
            f"{path}: secret key file has mode {mode:04o}, open to other "
            "users (chmod 600 it)"
        )


def check_not_writable_by_others(path: str, what: str) -> None:
    """``ValueError`` naming ``path`` when group or others may write it (a
    link followed), as ssh refuses such an authorized_keys: whoever may add a
    certificate there authorizes a client of their own. On a file system
    mounted read-only (a Kubernetes secret or ConfigMap volume, whose folder
    has mode 1777) nobody may, whatever the mode says."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from exc
    if mode & 0o022 and not read_only:
        raise ValueError(
            f"{what} {path} has mode {mode:04o}, writable by other users "
            "(chmod go-w it)"
        )


def load_certificate(path: str, what: str, secret: bool) -> tuple[bytes, bytes]:
    """(public, secret) keys of a ZeroMQ certificate file; ``ValueError``
    naming ``what`` or the file when it cannot be read, when a key in it is
    malformed, when ``secret`` is required and the file holds only a public
    key or is open to other users (``check_secret_file_mode``), or when its
    secret key is not its public key's."""
    try:
        public_key, secret_key = _read_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load {what} {path}: {exc}") from exc
    check_z85_key(public_key, path, "public key")
    if secret and not secret_key:
        raise ValueError(f"{path} holds no secret key")
    if secret:
        check_secret_file_mode(path)
    if secret_key:
        check_z85_key(secret_key, path, "secret key")
        if zmq.curve_public(secret_key) != public_key:
            raise ValueError(f"{path}: the public key is not its secret key's")
    return public_key, secret_key or b""


# A CURVE key as a certificate writes it: 32 bytes in 40 Z85 characters.
_Z85_KEY_CHARS = 40


def check_z85_key(key: bytes, path: str, what: str) -> None:
    """``ValueError`` naming ``path`` unless ``key`` is 40 Z85 characters that
    decode to 32 bytes (libzmq refuses any other with a bare EINVAL)."""
    try:
        valid = len(key) == _Z85_KEY_CHARS and len(z85.decode(key)) == 32
    except (KeyError, ValueError, struct.error):
        valid = False
    if not valid:
        raise ValueError(f"{path}: malformed {what} (not 40 Z85 characters)")


class BindRefused(ValueError):
    """A bind address is not allowed with the given security settings."""


@dataclass(frozen=True)
class CurveConfig:
    """``secret_key_file``: the server's certificate with its secret key;
    ``authorized_keys_dir``: public certificates of authorized clients."""

    secret_key_file: str
    authorized_keys_dir: str

    def load_server_keys(self) -> tuple[bytes, bytes]:
        """(public, secret) key of the server; ``ValueError`` if unusable."""
        return load_certificate(self.secret_key_file, "the CURVE key", secret=True)

    def check_authorized_keys(self) -> None:
        """``ValueError`` unless the authorized clients' directory holds
        ``*.key`` certificates that all load, each with a well-formed public
        key (pyzmq's authenticator, which loads them again, only logs a file
        it cannot load and takes a malformed key that matches no client:
        either way it refuses every client)."""
        folder = self.authorized_keys_dir
        if not os.path.isdir(folder):
            raise ValueError(f"authorized keys directory {folder} is missing")
        check_not_writable_by_others(folder, "authorized keys directory")
        # The files the authenticator reads (zmq.auth.load_certificates).
        files = sorted(glob.glob(os.path.join(folder, "*.key")))
        if not files:
            raise ValueError(f"no client certificate (*.key) in {folder}")
        for path in files:
            check_not_writable_by_others(path, "authorized client certificate")
            try:
                public_key, _ = _read_certificate(path)
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"cannot load the authorized keys in {folder}: {exc}"
                ) from exc
            check_z85_key(public_key, path, "public key")

    def check(self) -> None:
        """Refuse missing, unreadable or inconsistent key material."""
        self.load_server_keys()
        self.check_authorized_keys()


def bind_scope(address: str) -> str:
    """``"local"`` (ipc/inproc/loopback TCP), ``"wildcard"`` or ``"remote"``.

    Raises ``BindRefused`` for malformed addresses and other transports.
    """
    transport, sep, endpoint = address.partition("://")
    if not sep or not endpoint:
        raise BindRefused(f"malformed bind address {address!r}")
    if transport in ("ipc", "inproc"):
        return "local"
    if transport != "tcp":
        raise BindRefused(f"transport {transport!r} is not supported ({address})")
    host, sep, port = endpoint.rpartition(":")
    numeric_port = port.isascii() and port.isdigit()
    if not sep or not host or not (port == "*" or numeric_port):
        raise BindRefused(f"malformed TCP address {address!r}")
    if numeric_port and not 0 < int(port) < 65536:
        raise BindRefused(f"port {port} out of range in {address!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise BindRefused(
            f"IPv6 address without brackets in {address!r} (write tcp://[::1]:N)"
        )
    host = host.removeprefix("[").removesuffix("]")
    # ZeroMQ drops a zone (``%eth0``, ``%2``) from any host, not only from an
    # IPv6 one, and binds what is left: ``0.0.0.0%lo`` is all interfaces.
    if "%" in host:
        host = host.rpartition("%")[0]
    if host == "*":
        return "wildcard"
    if host == "localhost":
        return "local"
    ip = _numeric_host(host)
    if ip is None:
        # An interface or host name: treated as reachable from outside.
        return "remote"
    mapped = getattr(ip, "ipv4_mapped", None)
    if ip.is_unspecified or (mapped is not None and mapped.is_unspecified):
        return "wildcard"
    if ip.is_loopback or (mapped is not None and mapped.is_loopback):
        return "local"
    return "remote"


def ipc_path(address: str) -> str | None:
    """The socket file an ``ipc://`` address binds; None for other transports,
    for ``ipc://*`` (a path chosen at bind) and for Linux's abstract
    names (``ipc://@name``), which have no file."""
    transport, _, path = address.partition("://")
    if transport != "ipc" or path == "*" or path.startswith("@"):
        return None
    return path


# The longest path a Unix socket address holds on Linux (108 bytes of
# sun_path, the terminating NUL included).
IPC_PATH_MAX_BYTES = 107


def check_ipc_path(address: str) -> None:
    """Refuse an ipc address that cannot be bound, or whose bind would delete
    a file: a path or abstract name (``@name``) longer than a Unix socket
    address holds, an empty abstract name, a path in a directory that does
    not exist or in which this process may not create a socket, or naming an
    existing file other than a socket. Other addresses pass. Raises
    ``BindRefused``."""
    transport, _, path = address.partition("://")
    if transport != "ipc" or path == "*":
        return
    size = len(os.fsencode(path))
    if size > IPC_PATH_MAX_BYTES:
        what = "abstract ipc name" if path.startswith("@") else "ipc path"
        raise BindRefused(
            f"{what} {path} is {size} bytes, more than the "
            f"{IPC_PATH_MAX_BYTES} a Unix socket address holds"
        )
    if path == "@":
        raise BindRefused("the abstract ipc name after '@' is empty")
    if path.startswith("@"):
        return
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise BindRefused(f"ipc path {path}: no directory {directory}")
    # ZeroMQ creates (and first unlinks) the socket file there.
    if not os.access(directory, os.W_OK | os.X_OK):
        raise BindRefused(
            f"ipc path {path}: directory {directory} is not writable by this process"
        )
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BindRefused(f"ipc path {path}: {exc.strerror}") from exc
    if not stat.S_ISSOCK(mode):
        raise BindRefused(f"ipc path {path} exists and is not a socket")


# Why ZeroMQ cannot bind a TCP host, in the operator's terms.
_TCP_BIND_REASONS = {
    errno.ENODEV: "names no interface and no host that resolves",
    errno.EADDRNOTAVAIL: "is not an address of this machine",
}


def check_bindable(address: str) -> None:
    """Refuse an address this machine cannot bind, before anything is loaded:
    an ipc path as ``check_ipc_path`` does; a TCP host that ZeroMQ cannot bind
    (a name that does not resolve, an address not on this machine, an
    interface without an address), tried by binding it on a port the system
    picks with ZeroMQ's own resolver (which also takes interface names). The
    port is not tried: one in use may be freed by the time the server binds.
    Call after ``bind_scope`` accepted the address. Raises ``BindRefused``."""
    check_ipc_path(address)
    transport, _, endpoint = address.partition("://")
    if transport != "tcp":
        return
    host = endpoint.rpartition(":")[0]
    error = probe_bind(f"tcp://{host}:*")
    if error is not None:
        code = error.errno or 0
        reason = _TCP_BIND_REASONS.get(code)
        why = f"{host!r} {reason}" if reason else f"{host!r}: {zmq.strerror(code)}"
        raise BindRefused(f"cannot bind {address!r}: {why}")


def probe_bind(address: str) -> zmq.ZMQError | None:
    """Bind ``address`` with a throwaway ZeroMQ socket and release it at
    once: the error ZeroMQ raised, None when the bind succeeded."""
    context = zmq.Context()
    try:
        probe = context.socket(zmq.PAIR)
        probe.setsockopt(zmq.LINGER, 0)
        if needs_ipv6(address):
            probe.setsockopt(zmq.IPV6, 1)
        try:
            probe.bind(address)
        except zmq.ZMQError as exc:
            return exc
        finally:
            probe.close()
    finally:
        context.term()
    return None


def claim_ipc_path(address: str) -> None:
    """Just before binding ``address``: ``check_ipc_path`` again (loading may
    have taken minutes), then refuse a socket on which a server accepts
    connections with ``zmq.ZMQError`` EADDRINUSE, as a TCP port in use is:
    ZeroMQ would unlink it and bind over it, taking that server's clients. A
    socket file nobody listens on (its server died) may be bound over."""
    check_ipc_path(address)
    path = ipc_path(address)
    if path is None:
        return
    with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return
    raise zmq.ZMQError(zmq.EADDRINUSE)


def needs_ipv6(address: str) -> bool:
    """Whether ``address`` is TCP to an IPv6 literal (``tcp://[::1]:N``), which
    a ZeroMQ socket binds or reaches only with ``zmq.IPV6`` set."""
    transport, _, endpoint = address.partition("://")
    return transport == "tcp" and endpoint.startswith("[")


def _numeric_host(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as the address the resolver reads it as (also the short and
    hex IPv4 forms ``inet_aton`` takes, e.g. ``0``, ``0x0``, ``127.1``), or
    None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(_socket.inet_aton(host))
    except (OSError, UnicodeError):  # UnicodeError: bytes argv could not decode
        return None


def check_bind(
    address: str, curve: CurveConfig | None, allow_unsafe_remote_rpc: bool
) -> None:
    """Apply the bind rules of the module docstring; raises ``BindRefused``."""
    scope = bind_scope(address)
    if scope == "local" or curve is not None:
        return
    if scope == "wildcard":
        raise BindRefused(
            f"refusing to bind {address} on all interfaces without CURVE keys"
        )
    if not allow_unsafe_remote_rpc:
        raise BindRefused(
            f"refusing to bind the non-loopback address {address} without CURVE "
            "keys (give --curve-secret-key and --curve-authorized-keys, or "
            "--allow-unsafe-remote-rpc)"
        )


def warn_if_unsafe(address: str, curve: CurveConfig | None) -> None:
    """Log the start-up warning of an unauthenticated remote bind."""
    if curve is None and bind_scope(address) == "remote":
        logger.warning(
            "UNSAFE: the draft RPC socket %s accepts unauthenticated, "
            "unencrypted requests from the network (--allow-unsafe-remote-rpc)",
            address,
        )


def secure_socket(
    context: zmq.Context,
    socket: zmq.Socket,
    curve: CurveConfig,
    keys: tuple[bytes, bytes],
) -> ThreadAuthenticator:
    """Make ``socket`` a CURVE server (before bind) with the server's
    ``keys`` (public, secret: ``curve.load_server_keys()``) and a running
    ZAP authenticator; returns it (stop it at shutdown)."""
    curve.check_authorized_keys()
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    try:
        authenticator.configure_curve(domain="*", location=curve.authorized_keys_dir)
        make_curve_server(socket, keys)
    except BaseException:
        authenticator.stop()
        raise
    return authenticator


def make_curve_server(socket: zmq.Socket, keys: tuple[bytes, bytes]) -> None:
    """Give ``socket`` (before bind) the server's CURVE ``keys`` (public,
    secret); the context's running authenticator (``secure_socket``) checks
    its clients."""
    public, secret = keys
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
