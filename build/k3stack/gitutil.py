# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run git with a fixed identity and dates, independent of the user's config."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from k3stack import StackError

IDENTITY = ("vLLM K3 overlay", "k3-overlay@localhost")
EPOCH = "1980-01-01T00:00:00+0000"
# The caller's variables that would choose another repository or bring in
# configuration, diff options, or (for the repositories apply creates) an
# object format and a template (hooks, config) of their own.
SCRUBBED = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_COMMON_DIR",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_NAMESPACE",
    "GIT_CONFIG",
    "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT",
    "GIT_DIFF_OPTS",
    "GIT_EXTERNAL_DIFF",
    "GIT_DEFAULT_HASH",
    "GIT_TEMPLATE_DIR",
)


def git(
    cwd: Path,
    *args: str,
    date: str = EPOCH,
    check: bool = True,
    stdin: bytes | None = None,
) -> str:
    """Run ``git args`` in ``cwd`` and return its stdout (stripped of one \\n)."""
    return (
        git_bytes(cwd, *args, date=date, check=check, stdin=stdin)
        .decode("utf-8", "replace")
        .removesuffix("\n")
    )


def git_bytes(
    cwd: Path,
    *args: str,
    date: str = EPOCH,
    check: bool = True,
    stdin: bytes | None = None,
) -> bytes:
    proc = _run(cwd, args, date, stdin)
    if check and proc.returncode != 0:
        message = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise StackError(
            f"git {' '.join(args[:3])} failed in {cwd}: "
            f"{message[-1] if message else proc.returncode}"
        )
    return proc.stdout


def merge_file(cwd: Path, current: bytes, base: bytes, other: bytes) -> bytes | None:
    """``current`` with the change from ``base`` to ``other`` merged in (git's
    three-way file merge), or None where they conflict."""
    with tempfile.TemporaryDirectory(prefix="k3stack-merge-") as tmp:
        paths = []
        for name, data in (("current", current), ("base", base), ("other", other)):
            (Path(tmp) / name).write_bytes(data)
            paths.append(str(Path(tmp) / name))
        proc = _run(cwd, ("merge-file", "-p", "-q", *paths), EPOCH, None)
    return proc.stdout if proc.returncode == 0 else None


def _run(
    cwd: Path, args: tuple[str, ...], date: str, stdin: bytes | None
) -> subprocess.CompletedProcess[bytes]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SCRUBBED
        and not k.startswith(("GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"))
    }
    env |= {
        "GIT_CONFIG_NOSYSTEM": "1",
        # The system's gitattributes (text=auto, eol, ident) would rewrite
        # the upstream files apply commits; the user's file is set aside below.
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_AUTHOR_NAME": IDENTITY[0],
        "GIT_AUTHOR_EMAIL": IDENTITY[1],
        "GIT_COMMITTER_NAME": IDENTITY[0],
        "GIT_COMMITTER_EMAIL": IDENTITY[1],
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_DATE": date,
    }
    cmd = [
        "git",
        "-c",
        "safe.directory=*",
        "-c",
        "core.autocrlf=false",
        "-c",
        "commit.gpgsign=false",
        "-c",
        "tag.gpgsign=false",
        "-c",
        f"core.attributesFile={os.devnull}",
        *args,
    ]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, input=stdin, capture_output=True)
    except FileNotFoundError:
        if shutil.which("git") is not None:
            raise  # the working directory, not git, is missing
        raise StackError("git is not on PATH; the tooling needs git") from None
    return proc


@dataclass(frozen=True)
class Change:
    """A file that differs between two commits."""

    status: str  # A, M, D or T (type change)
    path: str
    old_mode: str  # git's octal modes: 000000 absent, 120000 a symlink
    new_mode: str


def changes(tree: Path, old: str, new: str, *pathspec: str) -> list[Change]:
    """The files that differ between commits ``old`` and ``new``, under their
    real names (``-z``: git quotes none, whatever characters they hold)."""
    out = git(tree, "diff-tree", "-r", "-z", "--no-renames", old, new, "--", *pathspec)
    fields = out.split("\0")
    found = []
    for meta, path in zip(fields[0:-1:2], fields[1::2], strict=True):
        old_mode, new_mode, _, _, status = meta.removeprefix(":").split()
        found.append(Change(status, path, old_mode, new_mode))
    return found


def is_work_tree(path: Path) -> bool:
    if not (path / ".git").exists():
        return False
    return git(path, "rev-parse", "--is-inside-work-tree", check=False) == "true"


def dirty_paths(path: Path, *pathspec: str) -> list[str]:
    """Uncommitted paths in a work tree: staged, unstaged, untracked, and new
    files under ``vllm/`` that its .gitignore matches (a plain ``git add``
    skips those, so they would be lost), but not Python's bytecode caches nor
    dot-files (editor and tool state)."""
    out = git(
        path,
        "status",
        "--porcelain",
        "-z",
        "--no-renames",
        "--ignored=matching",
        "--untracked-files=all",
        "--",
        *pathspec,
    )
    paths = []
    for entry in filter(None, out.split("\0")):
        state, rel = entry[:2], entry[3:]
        if _bytecode(rel) or (state == "!!" and not _overlay_source(rel)):
            continue
        paths.append(rel)
    return paths


def _overlay_source(rel: str) -> bool:
    """Whether an ignored path could be a maintainer's new source file: under
    ``vllm/`` (the only place a layer's new files live) and no dot-file."""
    parts = rel.rstrip("/").split("/")
    return parts[0] == "vllm" and not any(part.startswith(".") for part in parts)


def _bytecode(path: str) -> bool:
    return path.endswith(".pyc") or "__pycache__" in path.rstrip("/").split("/")
