# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Install the stack's payload over an installed upstream vLLM, then verify it.

Standard library only: this file runs inside the production image build
(``build/Dockerfile``) and in ``nox -s qualify``, the same way in both.

The payload folder holds ``stack.lock.json`` and ``site/`` (changed files and
the patched wheel's dist-info, laid out relative to site-packages). Every
payload file is checked against the lock before anything is written; files are
replaced atomically; afterwards the install is verified against the new RECORD
(``verify`` states the rule).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import posixpath
import shutil
import sys
from pathlib import Path


class InstallError(Exception):
    pass


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _record_sha256(path: Path) -> str:
    digest = bytes.fromhex(_sha256(path))
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def matches_record(path: Path, digest: str, size: str) -> bool:
    """Whether the file ``path`` has a RECORD row's size and hash."""
    return path.stat().st_size == int(size) and _record_sha256(path) == digest


def find_site(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InstallError(f"{package} is not installed in {sys.executable}")
    return Path(next(iter(spec.submodule_search_locations))).parent


def check_payload(payload: Path, lock: dict) -> None:
    for rel, sha in lock["payload"]["files"].items():
        path = payload / "site" / rel
        if not path.is_file():
            raise InstallError(f"payload file {rel} is missing")
        actual = _sha256(path)
        if actual != sha:
            raise InstallError(f"payload file {rel}: sha256 {actual} != lock {sha}")


def install(payload: Path, site: Path) -> None:
    """Replace the changed files and the dist-info under ``site``."""
    lock = json.loads((payload / "stack.lock.json").read_text())
    spec = lock["payload"]
    old_dist = site / spec["replaces_dist_info"]
    new_dist = site / spec["dist_info"]
    if not old_dist.is_dir() and not new_dist.is_dir():
        raise InstallError(
            f"{site} has neither {old_dist.name} nor {new_dist.name}: "
            "not the pinned upstream release"
        )
    check_payload(payload, lock)
    record = (payload / "site" / spec["dist_info"] / "RECORD").read_text()
    kept = _kept_rows(site, (old_dist, new_dist), _rows(record), spec["removed"])
    for rel in spec["files"]:
        if rel.startswith(spec["dist_info"] + "/"):
            continue
        target = site / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.k3-stack-tmp")
        shutil.copyfile(payload / "site" / rel, partial)
        os.replace(partial, target)
    for rel in spec["removed"]:
        (site / rel).unlink(missing_ok=True)
    staged = site / f".{spec['dist_info']}.k3-stack-tmp"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(payload / "site" / spec["dist_info"], staged)
    if kept:
        rows = io.StringIO()
        csv.writer(rows, lineterminator="\n").writerows(kept)
        text = record if record.endswith("\n") else record + "\n"
        (staged / "RECORD").write_text(text + rows.getvalue())
    for stale in (old_dist, new_dist):
        if stale.is_dir():
            shutil.rmtree(stale)
    os.replace(staged, new_dist)


def _kept_rows(
    site: Path,
    dist_infos: tuple[Path, ...],
    payload_rows: list[list[str]],
    removed: list[str],
) -> list[list[str]]:
    """The rows of the installed RECORD (``dist_infos``: the upstream's, or
    the stack's of an earlier install) that the payload's RECORD rows lack
    and whose files stay: what the installer that installed upstream wrote
    itself, such as the console script ``bin/vllm``. They are appended to
    the new RECORD, hashes and all, so that uninstalling vllm removes them
    too."""
    listed, owned = _listed_and_owned(payload_rows)
    owned |= {d.name for d in dist_infos}
    kept: dict[str, list[str]] = {}
    for dist in dist_infos:
        path = dist / "RECORD"
        if not path.is_file():
            continue
        for row in _rows(path.read_text()):
            if (
                len(row) == 3
                and row[0] not in removed
                and _installer_row(row[0], listed, owned)
                and (site / row[0]).is_file()
            ):
                kept.setdefault(row[0], row)
    return list(kept.values())


def _rows(record: str) -> list[list[str]]:
    """The non-empty rows of a RECORD's text."""
    return [row for row in csv.reader(io.StringIO(record)) if row]


def _listed_and_owned(rows: list[list[str]]) -> tuple[set[str], set[str]]:
    """A RECORD's paths, and their top folders (the package and the
    dist-info)."""
    listed = {row[0] for row in rows}
    return listed, {rel.split("/", 1)[0] for rel in listed}


def _installer_row(rel: str, listed: set[str], owned: set[str]) -> bool:
    """Whether a RECORD path not ``listed`` in the payload's RECORD lies
    outside the folders it ``owned`` (bytecode caches aside): an installer's
    own file, such as a console script, which the stack leaves as it is."""
    norm = posixpath.normpath(rel)
    if rel in listed or norm in listed:
        return False
    return norm.split("/", 1)[0] not in owned or _bytecode_cache(Path(norm))


def _added_rows(installed: Path, record: str) -> list[list[str]] | None:
    """The rows ``install`` appended to the payload's ``record`` text in the
    ``installed`` RECORD, or None when that does not begin with it."""
    text = installed.read_text()
    if text == record:
        return []
    ours = record if record.endswith("\n") else record + "\n"
    if not text.startswith(ours):
        return None
    return _rows(text[len(ours) :])


def _only_installer_rows(
    added: list[list[str]] | None, payload_rows: list[list[str]]
) -> bool:
    """Whether what ``install`` appended to the payload's RECORD is only
    installer rows (``_installer_row``) of the upstream install."""
    if added is None:
        return False
    listed, owned = _listed_and_owned(payload_rows)
    return all(
        len(row) == 3 and row[0] and _installer_row(row[0], listed, owned)
        for row in added
    )


def verify(payload: Path, site: Path) -> list[str]:
    """Check the install under ``site`` against the payload; return the
    problems found.

    Every file the payload's RECORD (checked against the lock) lists must be
    on disk with its RECORD hash, the RECORD itself as the lock has it (and
    after it only the rows ``install`` kept of the upstream install's own
    files outside the package, such as ``bin/vllm``), and the payload's
    removed files must be gone. The folders the RECORD owns
    (the package, ``vllm/``, and the dist-info) may hold nothing else: a file
    there that the RECORD does not list is a problem, bytecode caches
    (``__pycache__/*.pyc``) aside, which imports and compiling installers
    write and Python uses only beside their source. The base image's vllm
    files are no exception: it installed the upstream wheel this RECORD was
    made from, so the RECORD lists every one of them.
    """
    lock = json.loads((payload / "stack.lock.json").read_text())
    spec = lock["payload"]
    check_payload(payload, lock)
    record = (payload / "site" / spec["dist_info"] / "RECORD").read_text()
    payload_rows = _rows(record)
    record_rel = f"{spec['dist_info']}/RECORD"
    problems = []
    listed = set()
    for row in payload_rows:
        rel, digest, size = row
        if rel.startswith("../"):
            continue
        listed.add(rel)
        path = site / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif rel == record_rel:
            if not _only_installer_rows(_added_rows(path, record), payload_rows):
                problems.append(f"{rel}: content differs from the lock")
        elif not digest:
            if rel in spec["files"] and _sha256(path) != spec["files"][rel]:
                problems.append(f"{rel}: content differs from the lock")
        elif not matches_record(path, digest, size):
            problems.append(f"{rel}: content differs from RECORD")
    for top in sorted({rel.split("/", 1)[0] for rel in listed}):
        if (site / top).is_dir():
            for path in sorted((site / top).rglob("*")):
                rel = path.relative_to(site).as_posix()
                if path.is_dir() and not path.is_symlink():
                    continue
                if rel not in listed and not _bytecode_cache(path):
                    problems.append(f"{rel}: not in RECORD")
    for rel in spec["removed"]:
        if (site / rel).exists():
            problems.append(f"{rel}: should have been removed")
    return problems


def _bytecode_cache(path: Path) -> bool:
    return path.parent.name == "__pycache__" and path.suffix == ".pyc"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload", type=Path, default=Path(__file__).parent)
    parser.add_argument("--site", type=Path, help="default: where vllm is installed")
    parser.add_argument("--verify-only", action="store_true")
    args = parser.parse_args(argv)
    try:
        site = args.site or find_site("vllm")
        if not args.verify_only:
            install(args.payload, site)
        problems = verify(args.payload, site)
    except (InstallError, OSError, KeyError, ValueError) as e:
        print(f"k3-stack install: {e}", file=sys.stderr)
        return 1
    if problems:
        for problem in problems[:20]:
            print(f"k3-stack self-check: {problem}", file=sys.stderr)
        print(f"k3-stack self-check: {len(problems)} problems", file=sys.stderr)
        return 1
    lock = json.loads((args.payload / "stack.lock.json").read_text())
    print(f"k3-stack self-check: {lock['payload']['dist_info']} verified in {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
