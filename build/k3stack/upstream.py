# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lay out a pristine upstream tree from an sdist or a git checkout."""

from __future__ import annotations

import os
import platform
import tarfile
from collections.abc import Callable
from pathlib import Path

from k3stack import StackError
from k3stack.fetch import sha256_file
from k3stack.gitutil import git, git_bytes, is_work_tree


def require_tar_filters() -> None:
    """Refuse to extract anything on a Python without tarfile's extraction
    filters (3.11.0 to 3.11.3 lack them)."""
    if not hasattr(tarfile, "data_filter"):
        raise StackError(
            f"Python {platform.python_version()} has no tarfile extraction "
            "filters; refused: run the tooling with Python 3.11.4 or later"
        )


def extract_sdist(sdist: Path, dest: Path) -> None:
    """Extract ``sdist`` into ``dest``, stripping its top-level folder."""
    require_tar_filters()
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        if len(tops) != 1:
            raise StackError(f"{sdist.name}: expected one top-level folder")
        top = tops.pop()

        def strip(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
            if member.name == top:
                return None
            member = tarfile.data_filter(member, path)
            return member.replace(
                name=member.name[len(top) + 1 :],
                uid=os.getuid(),
                gid=os.getgid(),
                uname="",
                gname="",
                deep=False,
            )

        tar.extractall(dest, members=members, filter=strip)


_SOURCE_FIELDS = {"sdist": {"filename", "sha256"}, "checkout": {"commit"}}


def sdist_source(sdist: Path) -> dict:
    """The upstream input record (apply's marker, build's lock) of a tree laid
    out from ``sdist``."""
    return {"sdist": {"filename": sdist.name, "sha256": sha256_file(sdist)}}


def checkout_source(commit: str) -> dict:
    """The upstream input record of a tree exported from a git checkout at
    ``commit`` (the full id; the checkout's path, this machine's, is not
    part of it)."""
    return {"checkout": {"commit": commit}}


def source_ok(source: object) -> bool:
    """Whether ``source`` is a record ``sdist_source`` or ``checkout_source``
    makes."""
    if not (isinstance(source, dict) and len(source) == 1):
        return False
    [(kind, fields)] = source.items()
    return (
        isinstance(fields, dict)
        and set(fields) == _SOURCE_FIELDS.get(kind)
        and all(isinstance(value, str) and value for value in fields.values())
    )


def checkout_head(checkout: Path) -> str:
    """The full hash of the commit at HEAD of the git checkout ``checkout``;
    ``StackError`` if it is no checkout or HEAD names no commit."""
    if not is_work_tree(checkout):
        raise StackError(f"{checkout} is not a git checkout")
    head = git(checkout, "rev-parse", "-q", "--verify", "HEAD^{commit}", check=False)
    if not head:
        raise StackError(
            f"{checkout} has no commit at HEAD (an empty repository or an unborn "
            "branch); refused: name a checkout of upstream"
        )
    return head


def export_checkout(checkout: Path, dest: Path, commit: str | None = None) -> str:
    """Export the tracked files of a git checkout's HEAD into ``dest``.

    With ``commit``, HEAD must be that commit (a prefix of its hash). Returns
    the full commit hash exported.
    """
    require_tar_filters()
    head = checkout_head(checkout)
    if commit is not None and not head.startswith(commit):
        raise StackError(
            f"{checkout} is at {head[:12]}, not the pinned upstream commit {commit}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    archive = git_bytes(checkout, "archive", "--format=tar", "HEAD")
    tar_path = dest / ".export.tar"
    tar_path.write_bytes(archive)
    try:
        with tarfile.open(tar_path) as tar:
            tar.extractall(dest, filter="data")
    finally:
        tar_path.unlink()
    return head


def from_sdist(sdist: Path) -> Callable[[Path], dict]:
    """A lay-out for ``worktree.build_tree``: ``sdist`` extracted, recorded
    as the input."""

    def lay_out(dest: Path) -> dict:
        extract_sdist(sdist, dest)
        return sdist_source(sdist)

    return lay_out


def from_checkout(checkout: Path, commit: str | None = None) -> Callable[[Path], dict]:
    """A lay-out for ``worktree.build_tree``: the checkout's HEAD exported
    (``commit``: as ``export_checkout``), its commit recorded as the input."""
    return lambda dest: checkout_source(export_checkout(checkout, dest, commit))
