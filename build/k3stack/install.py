# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Install the stack's payload over an installed upstream vLLM, then verify it.

Standard library only: this file runs inside the production image build
(``build/Dockerfile``) and in ``nox -s qualify``, the same way in both.

The payload folder holds ``stack.lock.json`` and ``site/`` (changed files and
the patched wheel's dist-info, laid out relative to site-packages). Every
payload file is checked against the lock before anything is written; files are
replaced atomically; afterwards every file the new RECORD names is verified.
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
    for stale in (old_dist, new_dist):
        if stale.is_dir():
            shutil.rmtree(stale)
    os.replace(staged, new_dist)


def verify(payload: Path, site: Path) -> list[str]:
    """Every package file of the payload's RECORD (checked against the lock),
    checked on disk under ``site``; returns the problems found."""
    lock = json.loads((payload / "stack.lock.json").read_text())
    spec = lock["payload"]
    check_payload(payload, lock)
    record = payload / "site" / spec["dist_info"] / "RECORD"
    problems = []
    for row in csv.reader(io.StringIO(record.read_text())):
        if not row:
            continue
        rel, digest, size = row
        if not digest or rel.startswith("../"):
            continue
        path = site / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != int(size) or _record_sha256(path) != digest:
            problems.append(f"{rel}: content differs from RECORD")
    for rel in spec["removed"]:
        if (site / rel).exists():
            problems.append(f"{rel}: should have been removed")
    return problems


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
