# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CLI validation at parse time and the start-up memory checks."""

import contextlib
import ctypes
import io
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.auth
from k3_layer1_server import RawClient, create_certificates, free_tcp_port
from zmq.auth.thread import AuthenticationThread

from vllm.entrypoints.k3_dspark_standalone import (
    check_free_after_capture,
    check_memory_plan,
    check_memory_used,
    parse_args,
    run,
)
from vllm.k3_draft.engine import GiB, available_memory
from vllm.k3_draft.reference_engine import ReferenceEngine

BASE = ["--engine", "reference", "--device", "cpu", "--window-size", "64"]


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_valid_reference_arguments_parse():
    args = parse_args(BASE + ["--max-requests", "8", "--max-num-seqs", "8"])
    assert args.limits.max_requests == 8 and args.prefix_cache_tokens == 128
    assert args.reference.method == "dflash"


@pytest.mark.parametrize(
    "flag, default",
    [
        ("--window-size", "2048"),
        ("--max-speculative-tokens", "8"),
        ("--max-requests", "256"),
        ("--max-num-seqs", "64"),
        ("--max-context-tokens", "8192"),
        ("--max-model-len", "131072"),
        ("--block-size", "16"),
        ("--min-free-memory-gib", "1.0"),
        ("--status-port", "8101"),
        ("--busy-poll-us", "0"),
        ("--device", "cuda"),
        ("--hidden-size", "64"),
    ],
)
def test_help_states_the_default_of_each_flag(flag, default, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out)
    (entry,) = [e for e in entries if e.startswith(flag + " ")]
    assert f"(default: {default})" in " ".join(entry.split())


def test_help_says_authorized_keys_take_effect_at_the_next_start(capsys):
    """The authenticator reads the directory once: changes need a restart."""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out)
    (entry,) = [e for e in entries if e.startswith("--curve-authorized-keys ")]
    assert "takes effect at the next start" in " ".join(entry.split())


@pytest.mark.parametrize(
    "flag",
    [
        "--max-requests",
        "--max-num-seqs",
        "--max-speculative-tokens",
        "--max-context-tokens",
        "--max-model-len",
        "--block-size",
        "--hidden-size",
        "--vocab-size",
    ],
)
@pytest.mark.parametrize("value", ["0", "-3", "x", "1.5"])
def test_counts_must_be_positive_integers(flag, value, capsys):
    assert flag in refused([flag, value], capsys)


@pytest.mark.parametrize("value", ["-1", "1000001", "x", "0.5"])
def test_busy_poll_must_be_an_integer_within_its_bounds(value, capsys):
    assert "--busy-poll-us" in refused(["--busy-poll-us", value], capsys)


def test_the_smallest_count_is_accepted():
    args = parse_args(BASE + ["--max-speculative-tokens", "1"])
    assert args.limits.max_speculative_tokens == 1


def test_the_largest_int64_seed_is_accepted():
    args = parse_args(BASE + ["--seed", str(2**63 - 1)])
    assert args.reference.seed == 2**63 - 1


@pytest.mark.parametrize(
    "flag",
    [
        "--seed",
        "--vocab-size",
        "--hidden-size",
        "--num-layers",
        "--context-width",
        "--max-model-len",
    ],
)
def test_integers_beyond_int64_are_refused(flag, capsys):
    err = refused([flag, str(2**63)], capsys)
    assert f"argument {flag}: {2**63} is above {2**63 - 1}" in err


@pytest.mark.parametrize("flag", ["--memory-limit-gib", "--min-free-memory-gib"])
@pytest.mark.parametrize("value", ["0", "-1", "x", "inf", "nan"])
def test_memory_sizes_must_be_positive_finite_numbers(flag, value, capsys):
    assert flag in refused([flag, value], capsys)


@pytest.mark.parametrize("window", ["24", "8"])
def test_window_must_be_a_multiple_of_the_block_size(window, capsys):
    assert "multiple" in refused(
        ["--window-size", window, "--block-size", "16"], capsys
    )


def test_retained_requests_must_cover_max_sequences(capsys):
    err = refused(["--max-requests", "4", "--max-num-seqs", "8"], capsys)
    assert "--max-requests 4 (retained requests) is below --max-num-seqs 8" in err


@pytest.mark.parametrize("port", ["0", "65536", "-1"])
def test_status_port_must_be_in_range(port, capsys):
    assert "--status-port" in refused(["--status-port", port], capsys)


def test_prefix_cache_must_hold_a_window(capsys):
    err = refused(["--prefix-cache-tokens", "32"], capsys)
    assert "--prefix-cache-tokens 32 is below --window-size 64" in err


def test_cuda_graphs_need_a_cuda_device(capsys):
    assert "CUDA" in refused(["--enable-cuda-graph"], capsys)


@pytest.mark.parametrize(
    "device", ["cuda:64", *([] if torch.cuda.is_available() else ["cuda"])]
)
def test_a_cuda_device_that_is_not_there_is_refused(device, capsys):
    assert f"--device {device}: no such CUDA device" in refused(
        ["--device", device], capsys
    )


@pytest.mark.parametrize("device", ["cuda:4096", "cuda:200"])
def test_a_device_index_torch_would_wrap_around_is_refused(device, capsys):
    assert f"'{device}': device index out of range" in refused(
        ["--device", device], capsys
    )


def test_a_device_type_other_than_cpu_or_cuda_is_refused(capsys):
    assert "device type meta unsupported" in refused(["--device", "meta"], capsys)


def test_reference_engine_refuses_production_flags(tmp_path, capsys):
    assert "--draft-model" in refused(["--draft-model", str(tmp_path)], capsys)


def test_production_engine_needs_both_checkpoints(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--engine", "production", "--draft-model", str(tmp_path)])
    assert "needs --draft-model and --target-model" in capsys.readouterr().err


def test_production_engine_refuses_reference_flags(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(
            [
                "--engine",
                "production",
                "--draft-model",
                str(tmp_path),
                "--target-model",
                str(tmp_path),
                "--hidden-size",
                "64",
            ]
        )
    assert "does not use --hidden-size" in capsys.readouterr().err


def test_the_reference_engine_runs_latent_attention_on_request():
    assert parse_args(BASE).reference.latent_attention is False
    args = parse_args(BASE + ["--latent-attention"])
    assert args.reference.shape().latent is not None


def test_curve_key_needs_the_authorized_keys_directory(tmp_path, capsys):
    _, secret = create_certificates(tmp_path, "server")
    assert "go together" in refused(["--curve-secret-key", secret], capsys)


def test_curve_key_file_without_a_secret_is_refused(tmp_path, capsys):
    public, _ = create_certificates(tmp_path, "server")
    err = refused(
        ["--curve-secret-key", public, "--curve-authorized-keys", str(tmp_path)], capsys
    )
    assert "holds no secret key" in err


def _secret(certificate: str | Path) -> str:
    secret = zmq.auth.load_certificate(certificate)[1]
    assert secret is not None
    return secret.decode()


def _curve_flags(tmp_path: Path) -> list[str]:
    """A server certificate and one authorized client's, in ``tmp_path``."""
    (tmp_path / "clients").mkdir()
    _, secret = create_certificates(tmp_path, "server")
    create_certificates(tmp_path / "clients", "client")
    return [
        "--curve-secret-key",
        secret,
        "--curve-authorized-keys",
        str(tmp_path / "clients"),
    ]


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620], ids=oct)
def test_a_curve_secret_key_open_to_other_users_is_refused_in_one_line(
    tmp_path, capsys, mode
):
    """As ssh refuses a private key: anyone who reads it can pose as the
    server (the certificate itself says not to change its permissions)."""
    flags = _curve_flags(tmp_path)
    os.chmod(flags[1], mode)
    err = refused(flags, capsys)
    assert err.splitlines()[-1].endswith(
        f"error: {flags[1]}: secret key file has mode {mode:04o}, open to other "
        "users (chmod 600 it)"
    )


def test_a_group_readable_curve_secret_key_is_refused_unless_root_owns_it(
    tmp_path, capsys
):
    """As PostgreSQL takes a root-owned key shared with a service group, and
    no other. Run as root, both owners are built; otherwise only the user's."""
    flags = _curve_flags(tmp_path)
    os.chmod(flags[1], 0o640)
    if os.geteuid() == 0:
        assert parse_args(BASE + flags).curve is not None
        os.chown(flags[1], 65534, 65534)
    assert "mode 0640, open to other users" in refused(flags, capsys)


def _owned_by(path: str, uid: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``path`` owned by ``uid``: chown as root; otherwise, without the
    privilege to, the owner ``os.stat`` reports for it is emulated."""
    if os.geteuid() == 0:
        os.chown(path, uid, uid)
        return
    real = os.stat
    file = real(path)

    def stat(target: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(target, *args, **kwargs)
        if (result.st_dev, result.st_ino) != (file.st_dev, file.st_ino):
            return result
        fields = list(result[:10])
        fields[4] = uid  # st_uid
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", stat)


@pytest.mark.parametrize("owner", [0, 65534], ids=["root", "another-user"])
@pytest.mark.parametrize("mode", [0o604, 0o620, 0o601], ids=oct)
def test_a_curve_secret_key_open_to_others_is_refused_whoever_owns_it(
    tmp_path, capsys, monkeypatch, owner, mode
):
    """Only a group read of a root-owned key is allowed: whoever owns it,
    any access by others and a group write are refused (run as root, the
    files the other tests write are root's; run as a user, they are not)."""
    flags = _curve_flags(tmp_path)
    os.chmod(flags[1], mode)
    _owned_by(flags[1], owner, monkeypatch)
    assert f"mode {mode:04o}, open to other users" in refused(flags, capsys)


def test_a_root_owned_curve_secret_key_may_be_read_by_its_group(tmp_path, monkeypatch):
    flags = _curve_flags(tmp_path)
    os.chmod(flags[1], 0o640)
    _owned_by(flags[1], 0, monkeypatch)
    assert parse_args(BASE + flags).curve is not None


def test_a_curve_secret_key_reached_through_a_link_is_checked_as_its_file(
    tmp_path, capsys
):
    flags = _curve_flags(tmp_path)
    link = tmp_path / "current.key_secret"
    link.symlink_to(flags[1])
    assert parse_args(BASE + ["--curve-secret-key", str(link), *flags[2:]]).curve
    os.chmod(flags[1], 0o644)
    assert "mode 0644, open to other users" in refused(
        ["--curve-secret-key", str(link), *flags[2:]], capsys
    )


def test_curve_keys_that_load_and_match_parse(tmp_path):
    assert parse_args(BASE + _curve_flags(tmp_path)).curve is not None


def test_curve_key_whose_public_key_is_not_its_secret_keys_is_refused(tmp_path, capsys):
    flags = _curve_flags(tmp_path)
    _, other = create_certificates(tmp_path, "other")
    server = Path(flags[1])
    server.write_text(server.read_text().replace(_secret(server), _secret(other)))
    assert "is not its secret key's" in refused(flags, capsys)


def test_malformed_curve_secret_key_is_refused(tmp_path, capsys):
    flags = _curve_flags(tmp_path)
    server = Path(flags[1])
    secret = _secret(server)
    server.write_text(server.read_text().replace(secret, secret + "xy"))
    assert "malformed secret key" in refused(flags, capsys)


def test_curve_secret_key_that_is_not_z85_is_refused_in_one_line(tmp_path, capsys):
    """40 characters, but '~' is not a Z85 digit (libzmq refuses it)."""
    flags = _curve_flags(tmp_path)
    server = Path(flags[1])
    secret = _secret(server)
    server.write_text(server.read_text().replace(secret, "~" + secret[1:]))
    err = refused(flags, capsys)
    assert err.splitlines()[-1].endswith(
        f"error: {server}: malformed secret key (not 40 Z85 characters)"
    )


def test_a_client_certificate_that_cannot_be_loaded_is_refused(tmp_path, capsys):
    """pyzmq's authenticator would log it and then refuse every client."""
    flags = _curve_flags(tmp_path)
    (tmp_path / "clients" / "notes.key").write_text("# not a certificate\n")
    assert "cannot load the authorized keys" in refused(flags, capsys)


@pytest.mark.parametrize(
    "garble", [lambda key: key[:10], lambda key: "~" + key[1:]], ids=["short", "~"]
)
def test_authorized_client_key_that_is_not_z85_is_refused_in_one_line(
    tmp_path, capsys, garble
):
    """pyzmq's authenticator would take it, match no client with it and
    refuse every client without a word."""
    flags = _curve_flags(tmp_path)
    client = tmp_path / "clients" / "client.key"
    public = zmq.auth.load_certificate(client)[0].decode()
    client.write_text(client.read_text().replace(public, garble(public)))
    err = refused(flags, capsys)
    assert err.splitlines()[-1].endswith(
        f"error: {client}: malformed public key (not 40 Z85 characters)"
    )


@pytest.mark.parametrize("key_file", ["server", "client"])
def test_a_key_line_without_an_equals_sign_is_refused_in_one_line(
    tmp_path, capsys, key_file
):
    """pyzmq's reader raises IndexError on it."""
    flags = _curve_flags(tmp_path)
    path = Path(flags[1]) if key_file == "server" else tmp_path / "clients/client.key"
    path.write_text(re.sub(r'public-key = ".*"', "public-key", path.read_text()))
    assert "a public-key or secret-key line has no '='" in refused(flags, capsys)


@pytest.mark.parametrize("what", ["directory", "certificate"])
@pytest.mark.parametrize("mode", [0o775, 0o757], ids=oct)
def test_authorized_keys_writable_by_other_users_are_refused_in_one_line(
    tmp_path, capsys, what, mode
):
    """Whoever may write there may authorize a client key of their own."""
    flags = _curve_flags(tmp_path)
    if what == "directory":
        path, name = tmp_path / "clients", "authorized keys directory"
    else:
        path, name = (
            tmp_path / "clients" / "client.key",
            "authorized client certificate",
        )
    os.chmod(path, mode)
    err = refused(flags, capsys)
    assert err.splitlines()[-1].endswith(
        f"error: {name} {path} has mode {mode:04o}, writable by other users "
        "(chmod go-w it)"
    )


def test_authorized_certificates_reached_through_links_are_checked_as_their_files(
    tmp_path, capsys
):
    """A folder of links to certificates kept elsewhere (a link's own mode
    is 0777): each is accepted or refused by the mode of its file."""
    flags = _curve_flags(tmp_path)
    client = tmp_path / "clients" / "client.key"
    kept = tmp_path / "client.key"
    client.rename(kept)
    client.symlink_to(kept)
    assert parse_args(BASE + flags).curve is not None
    os.chmod(kept, 0o666)
    assert f"authorized client certificate {client} has mode 0666" in refused(
        flags, capsys
    )


def test_an_authorized_keys_directory_on_a_read_only_mount_is_accepted(
    tmp_path, monkeypatch
):
    """A Kubernetes secret or ConfigMap volume: a folder of mode 1777 on a
    read-only mount, which nobody may write (the mount is emulated: making
    one needs privileges the test may not have)."""
    flags = _curve_flags(tmp_path)
    os.chmod(tmp_path / "clients", 0o1777)
    real = os.statvfs

    def read_only_clients(path: Any) -> Any:
        result = real(path)
        if os.path.realpath(path) != str((tmp_path / "clients").resolve()):
            return result
        fields = list(result)
        fields[8] |= os.ST_RDONLY  # f_flag
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", read_only_clients)
    assert parse_args(BASE + flags).curve is not None


def test_authorized_keys_directory_without_certificates_is_refused(tmp_path, capsys):
    flags = _curve_flags(tmp_path)
    (tmp_path / "clients" / "client.key").unlink()
    assert "no client certificate" in refused(flags, capsys)


def test_reference_model_shape_is_validated(capsys):
    err = refused(["--hidden-size", "60", "--num-heads", "4"], capsys)
    assert "reference draft (--hidden-size 60, --num-heads 4): " in err
    assert "num_heads" in err


def test_a_latent_reference_draft_needs_heads_whose_half_is_even(capsys):
    # Head 6 (24 / 4): RoPE on half a head, 3 dimensions, cannot rotate.
    err = refused(
        ["--latent-attention", "--hidden-size", "24", "--num-heads", "4"], capsys
    )
    assert "multiple of 4 * num_heads with latent attention" in err


def test_a_reference_weight_beyond_int64_elements_is_refused_naming_the_flags(capsys):
    size = str(2**63 - 8)
    err = refused(["--hidden-size", size, "--num-heads", "4"], capsys)
    assert f"reference draft (--hidden-size {size}, --num-heads 4): weight " in err
    assert "holds more than 2**63 - 1 elements" in err


def test_memory_plan_that_fits_passes():
    args = parse_args(BASE)
    check_memory_plan(ReferenceEngine(args.limits, args.reference, args.device), 1.0)


def _reserved(monkeypatch: pytest.MonkeyPatch, gib: float) -> None:
    """What torch reports as the peak reserved CUDA memory (no GPU here)."""
    monkeypatch.setattr(
        torch.cuda, "max_memory_reserved", lambda device=None: int(gib * GiB)
    )


def test_cuda_memory_reserved_beyond_the_limit_by_start_up_is_refused(monkeypatch):
    _reserved(monkeypatch, 2.5)
    with pytest.raises(MemoryError, match="reserved 2.500 GiB .* 2.0"):
        check_memory_used(torch.device("cuda", 0), 2.0)


def test_cuda_memory_reserved_within_the_limit_passes(monkeypatch):
    _reserved(monkeypatch, 2.5)
    check_memory_used(torch.device("cuda", 0), 3.0)


def test_memory_plan_one_byte_over_the_limit_is_refused():
    args = parse_args(BASE)
    engine = ReferenceEngine(args.limits, args.reference, args.device)
    needed = engine.memory_plan().total
    with pytest.raises(MemoryError):
        check_memory_plan(engine, (needed - 1) / GiB)


def _free(monkeypatch: pytest.MonkeyPatch, gib: float) -> None:
    """What torch reports as the free CUDA memory (no GPU here)."""
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (int(gib * GiB), 80 * GiB)
    )


def test_cuda_free_memory_below_the_minimum_after_capture_is_refused(monkeypatch):
    _free(monkeypatch, 0.5)
    with pytest.raises(MemoryError, match="only 0.500 GiB free .* 1.0"):
        check_free_after_capture(torch.device("cuda", 0), 1.0)


def test_cuda_free_memory_above_the_minimum_after_capture_passes(monkeypatch):
    _free(monkeypatch, 1.5)
    check_free_after_capture(torch.device("cuda", 0), 1.0)


def test_memory_plan_over_the_limit_is_refused():
    args = parse_args(
        BASE
        + ["--max-requests", "4096", "--window-size", "4096", "--hidden-size", "1024"]
    )
    engine = ReferenceEngine(args.limits, args.reference, args.device)
    with pytest.raises(MemoryError, match="KV .* GiB"):
        check_memory_plan(engine, 2.0)


@pytest.mark.parametrize("times_needed", [2.0, None], ids=["twice", "1e300 GiB"])
def test_memory_limit_above_the_free_memory_does_not_pass_a_plan_that_cannot_fit(
    times_needed,
):
    args = parse_args(
        BASE
        + ["--max-requests", "65536", "--window-size", "8192", "--hidden-size", "4096"]
    )
    engine = ReferenceEngine(args.limits, args.reference, args.device)
    needed = engine.memory_plan().total
    assert needed > available_memory(engine.device)
    # 1e300 GiB: more bytes than a float holds.
    limit_gib = 1e300 if times_needed is None else times_needed * needed / GiB
    with pytest.raises(MemoryError, match="available on cpu"):
        check_memory_plan(engine, limit_gib)


@pytest.mark.parametrize("host", ["host..example", "999.1.1.1"])
def test_a_status_host_that_does_not_resolve_is_a_usage_error(host, capsys):
    err = refused(["--status-host", host], capsys)
    assert f"argument --status-host: cannot resolve {host!r}" in err


def test_a_status_port_in_use_is_refused_in_one_line_before_loading(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = parse_args(
            BASE + ["--status-port", str(port), "--address", "inproc://never"]
        )
        with caplog.at_level(logging.INFO):
            assert run(args, threading.Event()) == 1
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage().startswith(
        f"Refusing to serve: cannot serve status on 127.0.0.1 port {port}: "
    )
    # Nothing was planned or loaded.
    assert not [r for r in caplog.records if "Draft memory plan" in r.getMessage()]


def test_server_that_cannot_fit_exits_before_serving(caplog):
    args = parse_args(
        BASE
        + [
            "--status-port",
            str(free_tcp_port()),
            "--memory-limit-gib",
            "0.0001",
            "--address",
            "inproc://never",
        ]
    )
    with caplog.at_level(logging.ERROR):
        assert run(args, threading.Event()) == 1
    assert "Refusing to serve" in caplog.text


def test_device_out_of_memory_during_start_up_is_refused_in_one_line(
    caplog, monkeypatch
):
    def load(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(ReferenceEngine, "load", load)
    args = parse_args(
        BASE + ["--status-port", str(free_tcp_port()), "--address", "inproc://never"]
    )
    with caplog.at_level(logging.ERROR):
        assert run(args, threading.Event()) == 1
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == (
        "Refusing to serve: out of device memory: CUDA out of memory. "
        "Tried to allocate 2.00 GiB"
    )
    assert record.exc_info is None


def test_a_checkpoint_the_engine_refuses_at_start_up_is_refused_in_one_line(
    caplog, monkeypatch
):
    def load(self):
        raise ValueError("draft checkpoint has no lm_head")

    monkeypatch.setattr(ReferenceEngine, "load", load)
    args = parse_args(
        BASE + ["--status-port", str(free_tcp_port()), "--address", "inproc://never"]
    )
    with caplog.at_level(logging.ERROR):
        assert run(args, threading.Event()) == 1
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == "Refusing to serve: draft checkpoint has no lm_head"


def test_a_transport_failure_after_start_up_ends_the_server_with_status_1(
    tmp_path,
):
    path = tmp_path / "draft.ipc"
    args = parse_args(
        BASE + ["--status-port", str(free_tcp_port()), "--address", f"ipc://{path}"]
    )
    result: list[int] = []
    server = threading.Thread(
        target=lambda: result.append(run(args, threading.Event())), daemon=True
    )
    server.start()
    while not path.exists() and server.is_alive():
        time.sleep(0.05)
    path.unlink()  # the socket file lost: no client can connect
    server.join(timeout=60)
    assert result == [1]


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read()


def test_captured_graph_shapes_are_advertised_in_pong_status_and_metrics(
    monkeypatch,
):
    # The engine's captured shapes, as a GPU engine would report them.
    monkeypatch.setattr(
        ReferenceEngine, "capture_cuda_graphs", lambda self: [(1, 1), (2, 4)]
    )
    port, address = free_tcp_port(), f"tcp://127.0.0.1:{free_tcp_port()}"
    args = parse_args(BASE + ["--status-port", str(port), "--address", address])
    stop = threading.Event()
    server = threading.Thread(target=run, args=(args, stop), daemon=True)
    server.start()
    deadline = time.monotonic() + 120
    while True:
        try:
            _get(port, "/readyz")
            break
        except OSError:  # not up yet, or 503 while loading
            assert server.is_alive() and time.monotonic() < deadline
            time.sleep(0.1)
    client = RawClient(address)
    try:
        pong, _ = client.call("PING")
        assert pong["cuda_graph_shapes"] == [[1, 1], [2, 4]]
        status = json.loads(_get(port, "/v1/status"))
        assert status["cuda_graph_shapes"] == [[1, 1], [2, 4]]
        metrics = _get(port, "/metrics").decode()
        assert re.search(r"^k3_draft_cuda_graphs 2(\.0)?$", metrics, re.M), metrics
    finally:
        client.close()
        stop.set()
        server.join(timeout=60)


def test_status_port_in_use_is_refused_in_one_line(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = parse_args(BASE + ["--status-port", str(port)])
        with caplog.at_level(logging.ERROR):
            assert run(args, threading.Event()) == 1
    assert f"Refusing to serve: cannot serve status on 127.0.0.1 port {port}" in (
        caplog.text
    )
    assert "Traceback" not in caplog.text


def test_rpc_address_in_use_is_refused_in_one_line(caplog):
    context = zmq.Context()
    taken = context.socket(zmq.REP)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    args = parse_args(
        BASE + ["--status-port", str(free_tcp_port()), "--address", address]
    )
    try:
        with caplog.at_level(logging.ERROR):
            assert run(args, threading.Event()) == 1
    finally:
        taken.close(linger=0)
        context.term()
    assert f"Refusing to serve: cannot bind {address}: Address already in use" in (
        caplog.text
    )
    assert "Traceback" not in caplog.text


def test_an_ipc_path_naming_an_existing_file_is_refused(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("kept\n")
    err = refused(["--address", f"ipc://{notes}"], capsys)
    assert f"ipc path {notes} exists and is not a socket" in err


def test_an_ipc_path_in_a_missing_directory_is_refused(tmp_path, capsys):
    path = tmp_path / "gone" / "draft.ipc"
    err = refused(["--address", f"ipc://{path}"], capsys)
    assert f"ipc path {path}: no directory {path.parent}" in err


def test_an_ipc_path_too_long_for_a_unix_socket_address_is_refused(tmp_path, capsys):
    path = tmp_path / ("x" * 120)
    err = refused(["--address", f"ipc://{path}"], capsys)
    assert "more than the 107 a Unix socket address holds" in err


@pytest.mark.parametrize(
    "name, reason",
    [
        ("@", "the abstract ipc name after '@' is empty"),
        ("@" + "x" * 107, "is 108 bytes, more than the 107 a Unix socket"),
    ],
)
def test_an_abstract_ipc_name_zeromq_cannot_bind_is_refused(name, reason, capsys):
    err = refused(["--address", f"ipc://{name}"], capsys)
    assert reason in err


def test_an_abstract_ipc_name_as_long_as_a_unix_socket_address_holds_parses():
    address = "ipc://@" + "x" * 106
    assert parse_args(BASE + ["--address", address]).address == address


def _drop_capabilities() -> None:
    """Clear this process's capabilities (root's too: no CAP_DAC_OVERRIDE),
    so that file permissions apply to it as to any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # version 3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: none
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def test_an_ipc_path_in_a_directory_the_server_cannot_write_is_refused(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    path = folder / "draft.ipc"
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # parse in a process without the right to write there
        code = 3
        try:
            os.close(read)
            _drop_capabilities()
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr):
                parse_args(BASE + ["--address", f"ipc://{path}"])
            code = 0
        except SystemExit as exc:
            os.write(write, stderr.getvalue().encode())
            code = exc.code if isinstance(exc.code, int) else 4
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        err = pipe.read().decode()
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    folder.chmod(0o755)
    assert code == 2, err
    assert f"directory {folder} is not writable by this process" in err
    assert not path.exists()


@pytest.mark.parametrize("status_host", ["127.0.0.1", "0.0.0.0"])
def test_an_rpc_address_on_the_status_servers_port_is_refused_before_loading(
    status_host, capsys
):
    port = free_tcp_port()
    address = f"tcp://127.0.0.1:{port}"
    argv = ["--address", address, "--status-host", status_host]
    err = refused([*argv, "--status-port", str(port)], capsys)
    assert f"{address} takes port {port}, which the status server binds" in err


def test_the_status_port_on_another_loopback_address_parses():
    port = free_tcp_port()
    address = f"tcp://127.0.0.2:{port}"
    args = parse_args(BASE + ["--address", address, "--status-port", str(port)])
    assert args.address == address


def test_an_ipv6_loopback_address_parses():
    address = f"tcp://[::1]:{free_tcp_port()}"
    assert parse_args(BASE + ["--address", address]).address == address


def test_an_ipc_path_as_long_as_a_unix_socket_address_holds_binds(tmp_path):
    path = tmp_path / ("x" * (107 - len(str(tmp_path)) - 1))
    assert len(str(path)) == 107
    args = parse_args(BASE + ["--address", f"ipc://{path}"])
    context = zmq.Context()
    try:
        with context.socket(zmq.REP) as server:
            server.bind(args.address)
    finally:
        context.term()


@pytest.mark.parametrize(
    "address, reason",
    [
        # .invalid never resolves (RFC 6761); 203.0.113.0/24 is for documentation.
        ("tcp://draft-host.invalid:5555", "names no interface and no host that"),
        ("tcp://203.0.113.7:5597", "is not an address of this machine"),
    ],
)
def test_a_tcp_host_this_machine_cannot_bind_is_refused_at_parse_time(
    address, reason, capsys
):
    err = refused(["--address", address, "--allow-unsafe-remote-rpc"], capsys)
    (error,) = [line for line in err.splitlines() if "error:" in line]
    assert f"error: argument --address: cannot bind {address!r}: " in error
    assert reason in error


def test_an_address_with_a_newline_is_refused_in_one_line(capsys):
    address = "tcp://draft\nhost:5555"
    err = refused(["--address", address, "--allow-unsafe-remote-rpc"], capsys)
    assert err.splitlines()[-1].endswith(
        "error: argument --address: cannot bind 'tcp://draft\\nhost:5555': "
        "'draft\\nhost' names no interface and no host that resolves"
    )


def test_curve_key_gone_before_bind_is_refused_in_one_line(tmp_path, caplog):
    (tmp_path / "clients").mkdir()
    _, secret = create_certificates(str(tmp_path), "server")
    create_certificates(str(tmp_path / "clients"), "client")
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    args = parse_args(
        BASE
        + ["--status-port", str(free_tcp_port()), "--address", address]
        + ["--curve-secret-key", secret]
        + ["--curve-authorized-keys", str(tmp_path / "clients")]
    )
    Path(secret).unlink()
    with caplog.at_level(logging.ERROR):
        assert run(args, threading.Event()) == 1
    assert f"Refusing to serve: cannot bind {address}: " in caplog.text
    assert "Traceback" not in caplog.text
    # The ZAP authenticator started for the socket was stopped with it.
    assert not [t for t in threading.enumerate() if isinstance(t, AuthenticationThread)]


def test_a_stop_requested_before_start_up_ends_it_before_loading(monkeypatch):
    loaded = []
    monkeypatch.setattr(ReferenceEngine, "load", lambda self: loaded.append(self))
    args = parse_args(
        BASE + ["--status-port", str(free_tcp_port()), "--address", "inproc://never"]
    )
    stop = threading.Event()
    stop.set()
    assert run(args, stop) == 0
    assert loaded == []


def test_a_server_stopped_during_start_up_releases_its_status_port():
    port = free_tcp_port()
    args = parse_args(
        BASE + ["--status-port", str(port), "--address", "inproc://never"]
    )
    stop = threading.Event()
    stop.set()
    assert run(args, stop) == 0
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))
