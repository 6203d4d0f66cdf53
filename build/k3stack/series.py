# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ordered stack: ``patches/series`` and the overlay files it owns."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from k3stack import StackError
from k3stack.patchfile import LayerPatch, decode_utf8, load, plain_path

# The sdist folders the wheel ships; a layer's diff changes files under them
# or upstream tests (never packaged), nothing else (the build would drop it).
PACKAGE_ROOTS = ("vllm/",)
UPSTREAM_TESTS_ROOT = "tests/"


@dataclass
class Layer:
    number: int
    patch_file: Path
    patch: LayerPatch

    @property
    def name(self) -> str:
        return self.patch_file.name


@dataclass
class Stack:
    """The layers of a repository checkout, validated."""

    root: Path
    layers: list[Layer]

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "overlay"

    def upto(self, n: int | None) -> list[Layer]:
        if n is None:
            return self.layers
        if not 0 <= n <= len(self.layers):
            raise StackError(f"--upto {n}: the series has {len(self.layers)} layers")
        return self.layers[:n]

    def layer(self, n: int) -> Layer:
        if not 1 <= n <= len(self.layers):
            raise StackError(f"layer {n}: the series has {len(self.layers)} layers")
        return self.layers[n - 1]

    def stack_hash(self, n: int | None = None) -> str:
        """sha256 over the series prefix: patch bytes and owned overlay files."""
        digest = hashlib.sha256()
        for layer in self.upto(n):
            digest.update(b"patch\0" + layer.name.encode() + b"\0")
            digest.update(layer.patch_file.read_bytes())
            for rel in layer.patch.overlay:
                digest.update(b"file\0" + rel.encode() + b"\0")
                digest.update((self.overlay_dir / rel).read_bytes())
        return digest.hexdigest()


def read_series(patches_dir: Path) -> list[str]:
    series = patches_dir / "series"
    if not series.is_file():
        raise StackError(f"{series} does not exist")
    entries = []
    for line in decode_utf8(series.read_bytes(), "patches/series").splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry)
    return entries


def load_stack(root: Path) -> Stack:
    """Load and validate the stack of the checkout at ``root``.

    Refused: a series entry without a file, a patch file (``*.patch`` or
    ``*.diff``, in any folder of ``patches/``) not in the series, an entry
    listed twice, an overlay file claimed by two layers or by none, a
    claimed file that is missing or a symlink, an overlay path outside
    ``vllm/``, an ``Overlay``/``Upstream-Tests``/``Suite`` path not spelled
    plainly, a diff of a file that is neither packaged nor an upstream test,
    a diff of an overlay file (any layer's: a diff changes upstream files).
    """
    patches_dir = root / "patches"
    entries = read_series(patches_dir)
    seen: set[str] = set()
    for entry in entries:
        if entry in seen:
            raise StackError(f"patches/series lists {entry} twice")
        seen.add(entry)
        if not (patches_dir / entry).is_file():
            raise StackError(f"patches/series lists {entry}, which does not exist")
    unlisted = sorted(
        rel
        for p in patches_dir.rglob("*")
        if p.suffix in (".patch", ".diff")
        and (rel := p.relative_to(patches_dir).as_posix()) not in seen
    )
    if unlisted:
        raise StackError(f"patch files not in patches/series: {', '.join(unlisted)}")
    layers = [
        Layer(i, patches_dir / entry, load(patches_dir / entry))
        for i, entry in enumerate(entries, start=1)
    ]
    for layer in layers:
        for name in ("Overlay", "Upstream-Tests", "Suite"):
            for rel in layer.patch.values(name):
                if not plain_path(rel):
                    raise StackError(
                        f"{layer.name}: {name} path {rel!r} is not a plain relative "
                        f"path (write it as {PurePosixPath(rel).as_posix()!r}, "
                        "without '..')"
                    )
        for fp in layer.patch.files:
            if not fp.path.startswith((*PACKAGE_ROOTS, UPSTREAM_TESTS_ROOT)):
                raise StackError(
                    f"{layer.name}: the diff changes {fp.path}, which is neither "
                    f"packaged ({', '.join(PACKAGE_ROOTS)}) nor an upstream test "
                    f"({UPSTREAM_TESTS_ROOT}); refused: the build would leave it out"
                )
    owner: dict[str, str] = {}
    overlay_dir = root / "overlay"
    for layer in layers:
        for rel in layer.patch.overlay:
            if not rel.startswith("vllm/"):  # plain (checked above): no ".."
                raise StackError(f"{layer.name}: overlay path {rel} is not under vllm/")
            if rel in owner:
                raise StackError(
                    f"overlay file {rel} is claimed by {owner[rel]} and {layer.name}"
                )
            owner[rel] = layer.name
            if (overlay_dir / rel).is_symlink():
                raise StackError(
                    f"{layer.name}: overlay file {rel} is a symlink; refused: the "
                    "stack carries regular files only"
                )
            if not (overlay_dir / rel).is_file():
                raise StackError(f"{layer.name}: overlay file {rel} does not exist")
    on_disk = sorted(
        p.relative_to(overlay_dir).as_posix()
        for p in overlay_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    for layer in layers:
        for fp in layer.patch.files:
            if fp.path in owner:
                raise StackError(
                    f"{layer.name}: the diff changes {fp.path}, an overlay file of "
                    f"{owner[fp.path]}; refused: a diff changes upstream files "
                    "only (a layer never edits a lower layer's files)"
                )
    unclaimed = [rel for rel in on_disk if rel not in owner]
    if unclaimed:
        raise StackError(
            f"overlay files claimed by no layer: {', '.join(unclaimed[:5])}"
            + (" ..." if len(unclaimed) > 5 else "")
        )
    return Stack(root, layers)


def check_suites(stack: Stack) -> None:
    """Every ``Suite`` path of every layer exists in the checkout (qualify
    runs only these; a missing one would pass unseen)."""
    for layer in stack.layers:
        for path in layer.patch.suite:
            if not (stack.root / path).exists():
                raise StackError(f"{layer.name}: Suite path {path} does not exist")


def check_layering(stack: Stack) -> None:
    """No layer names a module that a higher layer adds, in the lines its diff
    adds or in its overlay files: such a layer is no prefix of the stack (its
    prefix refers to a file it lacks). It is what a hunk that leaked into a
    lower layer's patch looks like, as when a rebase conflict of a lower layer
    is resolved with a file holding the higher layers' hooks too, and git then
    drops the higher layer's hunk as already applied."""
    for layer in stack.layers:
        sources: list[tuple[str, str]] = []
        for fp in layer.patch.files:
            for index, hunk in enumerate(fp.hunks, start=1):
                added = b"".join(text for op, text in hunk.lines if op == b"+")
                where = f"{fp.path} hunk {index} ({hunk.header})"
                sources.append((where, added.decode("utf-8", "replace")))
        for rel in layer.patch.overlay:
            data = (stack.overlay_dir / rel).read_bytes()
            sources.append((f"overlay file {rel}", data.decode("utf-8", "replace")))
        for higher in stack.layers[layer.number :]:
            for rel in higher.patch.overlay:
                pattern = _module_pattern(rel)
                if pattern is None:
                    continue
                for where, text in sources:
                    if pattern.search(text):
                        raise StackError(
                            f"{layer.name}: {where} uses {rel}, which layer "
                            f"{higher.number} ({higher.name}) adds: a lower layer "
                            "cannot use a higher one's file (a hunk of the higher "
                            "layer in the lower one's patch?)"
                        )


def _module_pattern(rel: str) -> re.Pattern[str] | None:
    """How Python code names overlay file ``rel``'s module: its dotted name,
    or its parent package's ``from ... import`` of it."""
    if not rel.endswith(".py"):
        return None
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    dotted = re.escape(".".join(parts))
    parent, name = re.escape(".".join(parts[:-1])), re.escape(parts[-1])
    return re.compile(
        rf"(?<![\w.]){dotted}(?!\w)"
        rf"|\bfrom\s+{parent}\s+import\s+(?:\([^)]*|[^\n]*)(?<![\w.]){name}(?!\w)"
    )
