# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Production artifacts of an applied tree: wheel, image context, lock."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from k3stack import StackError
from k3stack.fetch import sha256_file
from k3stack.gitutil import changes, git, git_bytes
from k3stack.pin import Pin
from k3stack.series import PACKAGE_ROOTS, Stack
from k3stack.wheel import WheelChanges, build_wheel
from k3stack.worktree import (
    UPSTREAM_TAG,
    applied_source,
    layer_tag,
    lock_folder,
    remove_stale_staging,
)

BUILD_DIR = Path(__file__).resolve().parent.parent
INSTALLER = Path(__file__).resolve().parent / "install.py"
LOCK_NAME = "stack.lock.json"
STAGING_PREFIX = ".k3stack-build-"
# The wheel's entry timestamp (1980-01-01T00:00:00Z), for the context too.
CONTEXT_MTIME = 315532800


@dataclass(frozen=True)
class BuildResult:
    wheel: Path
    context: Path
    lock: Path
    version: str


def tree_changes(tree: Path, rev: str) -> WheelChanges:
    """The package files that ``rev`` changes relative to pristine upstream."""
    files: dict[str, bytes] = {}
    removed = set()
    added = set()
    for change in changes(tree, UPSTREAM_TAG, rev, *PACKAGE_ROOTS):
        path = change.path
        if change.status == "D":
            removed.add(path)
            continue
        files[path] = git_bytes(tree, "show", f"{rev}:{path}")
        if change.status == "A":
            added.add(path)
    return WheelChanges(files, frozenset(removed), frozenset(added))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build(
    stack: Stack,
    pin: Pin,
    tree: Path,
    upstream_wheel: Path,
    out_dir: Path,
    layers: int,
) -> BuildResult:
    """Build the wheel, the image context and the lock for layers 1..layers.

    They are built in a staging folder inside ``out_dir`` and replace the
    previous build only once complete: a failed build leaves ``out_dir`` as
    it was (and the staging folder of a killed one goes at the next build).
    """
    context = out_dir / "image"
    source = applied_source(tree)
    if out_dir.exists() and not out_dir.is_dir():
        raise StackError(f"build: {out_dir} exists and is not a directory; refused")
    if context.is_symlink() or (context.exists() and not context.is_dir()):
        raise StackError(
            f"build: {context} exists and is not a folder a build made; refused: "
            "move it out of the way"
        )
    if context.is_dir():
        foreign = _foreign_files(context)
        if foreign:
            raise StackError(
                f"build: {context} holds files a build does not make "
                f"({', '.join(foreign[:3])}); refused: move them out of it"
            )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # Only the staging folders no running build holds locked.
        remove_stale_staging(out_dir, STAGING_PREFIX)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir))
        lock = lock_folder(staging)
        try:
            staged = _build_in(
                stack, pin, tree, source, upstream_wheel, staging, layers
            )
            return _publish(staged, out_dir, pin)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            os.close(lock)
    except OSError as e:
        raise StackError(f"build into {out_dir} failed: {e}") from e


def _foreign_files(context: Path) -> list[str]:
    """The files (and links) in an image context that no build made: all but
    the Dockerfile, the installer, the lock and the payload that lock lists."""
    made = {"Dockerfile", "stack/install.py", f"stack/{LOCK_NAME}"}
    try:
        lock = json.loads((context / "stack" / LOCK_NAME).read_bytes())
        made |= {f"stack/site/{rel}" for rel in lock["payload"]["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no lock of a build here: only the fixed entries are a build's
    found = (
        p.relative_to(context).as_posix()
        for p in context.rglob("*")
        if p.is_symlink() or not p.is_dir()
    )
    return sorted(rel for rel in found if rel not in made)


def _publish(staged: BuildResult, out_dir: Path, pin: Pin) -> BuildResult:
    """Move a staged build into ``out_dir`` in place of the previous one.

    The old context is first moved into the staging folder (which goes with
    the build, or with the next one if this one is killed): a context that
    cannot be moved changes nothing, an interrupt leaves none half removed.
    The old lock goes next and the new one comes last, so a lock in
    ``out_dir`` sits beside the complete set of artifacts it names.
    """
    context = out_dir / "image"
    if context.exists():
        context.rename(staged.context.with_name("image.old"))
    lock = out_dir / LOCK_NAME
    lock.unlink(missing_ok=True)
    for old in out_dir.glob(f"{pin.name}-{pin.version}+stack.*.whl"):
        old.unlink()
    wheel = staged.wheel.replace(out_dir / staged.wheel.name)
    staged.context.rename(context)
    staged.lock.replace(lock)
    return BuildResult(wheel, context, lock, staged.version)


def _build_in(
    stack: Stack,
    pin: Pin,
    tree: Path,
    source: dict,
    upstream_wheel: Path,
    out_dir: Path,
    layers: int,
) -> BuildResult:
    rev = layer_tag(layers) if layers else UPSTREAM_TAG
    stack_hash = stack.stack_hash(layers)
    local = f"stack.{stack_hash[:12]}"
    changes = tree_changes(tree, rev)
    wheel = build_wheel(upstream_wheel, changes, local, out_dir)
    version = f"{pin.version}+{local}"

    context = out_dir / "image"
    site = context / "stack" / "site"
    payload_files: dict[str, str] = {}
    for rel, data in sorted(changes.files.items()):
        _write(site / rel, data)
        payload_files[rel] = _sha(data)
    dist_info = f"{pin.name}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(dist_info + "/"):
                data = zf.read(name)
                _write(site / name, data)
                payload_files[name] = _sha(data)
    shutil.copyfile(INSTALLER, context / "stack" / "install.py")

    applied = stack.upto(layers)
    dockerfile = (BUILD_DIR / "Dockerfile").read_text()
    for key, value in {
        "@BASE_IMAGE@": pin.base_image,
        "@VERSION@": version,
        "@UPSTREAM_COMMIT@": pin.commit,
        "@STACK_HASH@": stack_hash,
        "@LAYERS@": ",".join(layer.name for layer in applied),
    }.items():
        dockerfile = dockerfile.replace(key, value)
    (context / "Dockerfile").write_text(dockerfile)
    lock = {
        "schema": 1,
        "upstream": {
            "name": pin.name,
            "version": pin.version,
            "commit": pin.commit,
            # The input apply laid the tree out from: "sdist" (file name and
            # sha256) or "checkout" (the full commit id; not its path).
            **source,
            "wheel": {
                "filename": upstream_wheel.name,
                "sha256": sha256_file(upstream_wheel),
            },
            "base_image": pin.base_image,
        },
        "stack": {
            "hash": stack_hash,
            "layers": [
                {
                    "number": layer.number,
                    "patch": layer.name,
                    "sha256": sha256_file(layer.patch_file),
                    "overlay": {
                        rel: sha256_file(stack.overlay_dir / rel)
                        for rel in layer.patch.overlay
                    },
                }
                for layer in applied
            ],
        },
        "tree": {
            "rev": rev,
            "package_trees": {
                root.rstrip("/"): git(tree, "rev-parse", f"{rev}:{root.rstrip('/')}")
                for root in PACKAGE_ROOTS
            },
        },
        "payload": {
            "dist_info": dist_info,
            "replaces_dist_info": f"{pin.name}-{pin.version}.dist-info",
            "files": payload_files,
            "removed": sorted(changes.removed),
        },
        "artifacts": {
            "wheel": {"filename": wheel.name, "sha256": sha256_file(wheel)},
        },
        "image": {
            "dockerfile": _sha(dockerfile.encode()),
            "installer": sha256_file(INSTALLER),
        },
    }
    lock_text = json.dumps(lock, indent=2, sort_keys=True) + "\n"
    (context / "stack" / LOCK_NAME).write_text(lock_text)
    _normalise(context)
    lock_path = out_dir / LOCK_NAME
    lock_path.write_text(lock_text)
    return BuildResult(wheel, context, lock_path, version)


def _normalise(root: Path) -> None:
    """Fixed modes and mtimes under ``root`` (children before their folder),
    so the context archives the same whatever the umask and the hour."""
    for path in [*sorted(root.rglob("*"), reverse=True), root]:
        path.chmod(0o755 if path.is_dir() else 0o644)
        os.utime(path, (CONTEXT_MTIME, CONTEXT_MTIME))


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def docker_build(context: Path, tag: str) -> str:
    """Build the image when a Docker engine answers; say so in one line if not."""
    try:
        probe = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return (
            f"docker: no engine answered ({type(e).__name__}); context ready: {context}"
        )
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no answer"])[-1]
        return f"docker: no engine answered ({reason[:120]}); context ready: {context}"
    build = subprocess.run(["docker", "build", "-t", tag, str(context)])
    if build.returncode != 0:
        raise StackError(f"docker build of {context} failed (exit {build.returncode})")
    return f"docker: built {tag}"
