# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream files come from the configured index and must match the pin."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Synthetic

from k3stack import StackError
from k3stack.fetch import fetch, pip_index_url, project_files, verify_file
from k3stack.pin import Artifact


@pytest.fixture
def index(synthetic: Synthetic, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A PEP 691 index on loopback serving the synthetic sdist, reached
    directly whatever proxy the environment names."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    sdist = synthetic.sdist.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/simple/vllm/":
                body = json.dumps(
                    {
                        "files": [
                            {
                                "filename": synthetic.sdist.name,
                                "url": f"/files/{synthetic.sdist.name}",
                            }
                        ]
                    }
                ).encode()
                kind = "application/vnd.pypi.simple.v1+json"
            elif self.path == f"/files/{synthetic.sdist.name}":
                body, kind = sdist, "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()
    server.server_close()


def test_fetch_downloads_from_the_index_pip_uses_and_caches(
    synthetic: Synthetic, index: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("K3_STACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", index)
    path = fetch(synthetic.pin.sdist, "vllm")
    assert path == tmp_path / "cache" / synthetic.sdist.name
    assert path.read_bytes() == synthetic.sdist.read_bytes()


def test_a_download_with_the_wrong_sha256_is_refused_and_not_kept(
    synthetic: Synthetic, index: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("K3_STACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", index)
    pinned = Artifact(synthetic.sdist.name, 1, "0" * 64)
    with pytest.raises(StackError) as info:
        fetch(pinned, "vllm")
    assert synthetic.pin.sdist.sha256 in str(info.value)
    assert "0" * 64 in str(info.value)
    assert not (tmp_path / "cache" / synthetic.sdist.name).exists()


def test_a_cached_file_that_changed_is_refused_with_both_hashes(
    synthetic: Synthetic,
) -> None:
    synthetic.sdist.write_bytes(synthetic.sdist.read_bytes() + b"tampered")
    with pytest.raises(StackError) as info:
        verify_file(synthetic.sdist, synthetic.pin.sdist)
    message = str(info.value)
    assert f"differs from the pin {synthetic.pin.sdist.sha256}" in message
    assert message.count("sha256") == 1 and len(message.split()[2]) == 64


def test_a_changed_cached_file_is_refused_naming_where_it_is_and_kept(
    synthetic: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = cache / synthetic.sdist.name
    cached.write_bytes(synthetic.sdist.read_bytes() + b"tampered")
    monkeypatch.setenv("K3_STACK_CACHE", str(cache))
    with pytest.raises(StackError, match=f"cached copy {cached}: delete it") as info:
        fetch(synthetic.pin.sdist, "vllm")
    assert "\n" not in str(info.value)
    assert cached.exists()


def test_fetch_uses_pip_s_download_index_over_its_global_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\nindex-url = http://global.invalid/simple\n"
        "[download]\nindex-url = http://download.invalid/simple\n"
    )
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    assert pip_index_url() == "http://download.invalid/simple"


def test_an_html_index_names_files_by_their_unquoted_link_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PEP 503 (HTML only) index, as some mirrors are: its links quote '+'.
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    page = (
        b'<html><body><a href="../../files/vllm-1.0%2Bcpu.tar.gz#sha256=00">'
        b"vllm-1.0+cpu.tar.gz</a></body></html>"
    )

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        files = project_files(f"{base}/simple", "vllm")
    finally:
        server.shutdown()
        server.server_close()
    assert files == {
        "vllm-1.0+cpu.tar.gz": f"{base}/files/vllm-1.0%2Bcpu.tar.gz#sha256=00"
    }
