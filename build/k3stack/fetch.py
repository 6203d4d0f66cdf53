# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fetch upstream files from the package index pip is configured to use.

Files land in a cache outside the work tree and are verified against their
pinned sha256 every time they are used.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from k3stack import StackError
from k3stack.pin import Artifact

_JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"
_HTML_ACCEPT = "application/vnd.pypi.simple.v1+html;q=0.5, text/html;q=0.1"
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """``$K3_STACK_CACHE``, else ``$XDG_CACHE_HOME/k3-overlay`` (``~/.cache``)."""
    if explicit := os.environ.get("K3_STACK_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k3-overlay"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(path: Path, artifact: Artifact) -> None:
    """Refuse ``path`` unless its sha256 is the pinned one."""
    actual = sha256_file(path)
    if actual != artifact.sha256:
        raise StackError(
            f"{path.name}: sha256 {actual} differs from the pin {artifact.sha256}; "
            "refused"
        )


def pip_index_url() -> str:
    """The index URL pip uses here (PIP_INDEX_URL, pip.conf, or pip's default)."""
    if env := os.environ.get("PIP_INDEX_URL"):
        return env
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    found: dict[str, str] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if name == "index-url":
            found[section] = value.strip().strip("'\"")
    for section in (":env:", "download", "global"):
        if section in found:
            return found[section]
    default = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pip._internal.models.index import PyPI; print(PyPI.simple_url)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return default.stdout.strip()


class _LinkParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.links.append(href)


def project_files(index_url: str, project: str) -> dict[str, str]:
    """Map file name -> absolute URL for ``project`` on a PEP 691/503 index."""
    page = index_url.rstrip("/") + f"/{project}/"
    request = urllib.request.Request(
        page, headers={"Accept": f"{_JSON_ACCEPT}, {_HTML_ACCEPT}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            content_type = response.headers.get("Content-Type", "")
            body = response.read()
    except OSError as e:
        raise StackError(f"cannot read the index page {page}: {e}") from e
    if content_type.startswith(_JSON_ACCEPT):
        files = json.loads(body)["files"]
        return {f["filename"]: urllib.parse.urljoin(page, f["url"]) for f in files}
    parser = _LinkParser()
    parser.feed(body.decode("utf-8", "replace"))
    result = {}
    for href in parser.links:
        url = urllib.parse.urljoin(page, href)
        name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/")[-1])
        result[name] = url
    return result


def fetch(artifact: Artifact, project: str, index_url: str | None = None) -> Path:
    """Return the verified cached copy of ``artifact``, downloading it once."""
    target = cache_dir() / artifact.filename
    if target.exists():
        try:
            verify_file(target, artifact)
        except StackError as e:
            # Kept for inspection: a cached file is never deleted silently.
            raise StackError(
                f"{e} (cached copy {target}: delete it to fetch again)"
            ) from None
        return target
    index = index_url or pip_index_url()
    files = project_files(index, project)
    if artifact.filename not in files:
        raise StackError(f"{artifact.filename} is not on the index {index}")
    download(files[artifact.filename], target)
    try:
        verify_file(target, artifact)
    except StackError:
        target.unlink()
        raise
    return target


def download(url: str, target: Path) -> None:
    """Stream ``url`` to ``target`` through a temporary file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    try:
        with (
            urllib.request.urlopen(url, timeout=120) as response,
            partial.open("wb") as out,
        ):
            while chunk := response.read(_CHUNK):
                out.write(chunk)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise StackError(f"download of {url} failed: {e}") from e
    partial.replace(target)
