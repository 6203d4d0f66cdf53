# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The applied work tree: pristine upstream commit plus one commit per layer.

Tags: ``upstream`` on the pristine commit, ``layer-N`` on layer N's commit. A
marker in ``.git`` records the HEAD the tooling last wrote or read back, so
commits a maintainer made since are never thrown away.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath

from k3stack import StackError
from k3stack.gitutil import dirty_paths, git, is_work_tree
from k3stack.patchfile import HunkMismatch, LayerPatch, apply_exact
from k3stack.series import Layer, Stack
from k3stack.upstream import source_ok

MARKER = "k3stack-applied.json"
# apply builds the tree in ``.<tree name><STAGING_MARK><random>`` beside it.
STAGING_MARK = ".k3stack-apply-"
# The commands that read or write a tree hold ``.<tree name><LOCK_MARK>``
# beside it locked while they run.
LOCK_MARK = ".k3stack-lock"
# ... and moves the tree it replaces to ``.<tree name><ASIDE_MARK><random>``.
ASIDE_MARK = ".k3stack-aside-"
UPSTREAM_TAG = "upstream"
# A diff's extended header line naming the blobs (hunk lines start otherwise).
_INDEX_LINE = re.compile(rb"^index .*\n", re.MULTILINE)


def layer_tag(n: int) -> str:
    return f"layer-{n}"


def read_marker(tree: Path) -> dict:
    path = tree / ".git" / MARKER
    if not path.is_file():
        raise StackError(f"{tree} was not made by `nox -s apply`")
    try:
        marker = json.loads(path.read_bytes())
    except ValueError:
        marker = None
    if not (
        isinstance(marker, dict)
        and isinstance(marker.get("head"), str)
        and isinstance(marker.get("layers"), int)
        and _digests_ok(marker.get("digests"), marker["layers"])
        and (marker.get("source") is None or source_ok(marker["source"]))
    ):
        raise StackError(
            f"{path} is empty or corrupt; refused: {tree} may hold work, move it "
            "aside and run `nox -s apply`"
        )
    return marker


def _digests_ok(digests: object, layers: int) -> bool:
    """None or empty (not recorded), or one digest (or None) per layer."""
    if digests is None or digests == []:
        return True
    return (
        isinstance(digests, list)
        and len(digests) == layers
        and all(d is None or isinstance(d, str) for d in digests)
    )


def write_marker(
    tree: Path, layers: int, digests: Sequence[str | None], source: dict | None
) -> None:
    """Record HEAD, each layer's digest as this tree holds them now and the
    upstream input its pristine commit was laid out from (``sdist_source``,
    ``checkout_source``; None: not known). Written beside and moved into
    place: never half a marker."""
    head = git(tree, "rev-parse", "HEAD")
    path = tree / ".git" / MARKER
    partial = path.with_name(f"{MARKER}.partial")
    marker = {"head": head, "layers": layers, "digests": digests, "source": source}
    partial.write_text(json.dumps(marker))
    os.replace(partial, path)


def applied_source(tree: Path) -> dict:
    """The upstream input ``tree``'s pristine commit was laid out from;
    ``StackError`` if its marker (written by older tooling) does not say."""
    source = read_marker(tree).get("source")
    if source is None:
        raise StackError(
            f"{tree} does not record the upstream input (sdist or checkout) it "
            "was applied from; refused: run `nox -s apply` again"
        )
    return source


def layer_digest(patch: LayerPatch, overlay: dict[str, bytes]) -> str:
    """A layer's content: its patch (Last-Update and the diff's ``index``
    lines aside: their blob ids, abbreviated or not, follow from upstream and
    the hunks) and its overlay files."""
    fields = dict(patch.fields, **{"Last-Update": "1970-01-01"})
    fields["Overlay"] = "\n".join(sorted(patch.overlay))
    diff = _INDEX_LINE.sub(b"", patch.diff)
    digest = hashlib.sha256(LayerPatch(patch.subject, fields, diff).render())
    for rel, data in sorted(overlay.items()):
        digest.update(b"\0" + rel.encode() + b"\0" + data)
    return digest.hexdigest()


def disk_digest(stack: Stack, layer: Layer) -> str:
    overlay = {
        rel: (stack.overlay_dir / rel).read_bytes() for rel in layer.patch.overlay
    }
    return layer_digest(layer.patch, overlay)


def digests_of(stack: Stack, layers: int) -> list[str]:
    return [disk_digest(stack, layer) for layer in stack.upto(layers)]


def refreshed_marker(tree: Path) -> dict:
    """The marker of ``tree``; ``StackError`` if its HEAD has commits that
    refresh has not taken into patches/ yet."""
    marker = read_marker(tree)
    if git(tree, "rev-parse", "HEAD") != marker["head"]:
        raise StackError(
            f"{tree} has commits that are not in patches/ yet; refused: "
            "run `nox -s refresh` first"
        )
    return marker


def current_marker(stack: Stack, tree: Path) -> dict:
    """The marker of ``tree`` if it holds every applied layer as patches/ and
    overlay/ hold it now, with nothing uncommitted; ``StackError`` naming the
    first that differs."""
    marker = refreshed_marker(tree)
    refuse_uncommitted(tree)
    layers = applied_layers(stack, tree, marker)
    digests = marker.get("digests") or [None] * len(layers)
    for layer, digest in zip(layers, digests, strict=False):
        if disk_digest(stack, layer) != digest:
            raise StackError(
                f"{tree} holds layer {layer.number} ({layer.name}) as it was "
                "applied, not as patches/ and overlay/ hold it now; refused: "
                "run `nox -s apply` again"
            )
    return marker


def applied_layers(stack: Stack, tree: Path, marker: dict) -> list[Layer]:
    """The layers ``tree`` holds (by its marker); ``StackError`` if
    patches/series lists fewer."""
    applied = marker["layers"]
    if applied > len(stack.layers):
        raise StackError(
            f"{tree} holds {applied} layers, patches/series lists "
            f"{len(stack.layers)}; refused: restore the series or run "
            "`nox -s apply` again"
        )
    return stack.layers[:applied]


def refuse_uncommitted(tree: Path) -> None:
    """``StackError`` if the work tree ``tree`` has uncommitted edits."""
    dirty = dirty_paths(tree)
    if dirty:
        raise StackError(
            f"{tree} has uncommitted edits ({len(dirty)} paths, e.g. {dirty[0]}); "
            "refused: commit them into their layer (`git add --force` for files "
            "its .gitignore matches) and run `nox -s refresh`"
        )


def guard_existing(tree: Path, shown: Path | None = None) -> None:
    """Refuse to replace ``tree`` if it holds work the patches do not
    (``shown``: the name the errors give it, if not ``tree``)."""
    try:
        _guard_existing(tree)
    except StackError as e:
        if shown is None:
            raise
        raise StackError(str(e).replace(str(tree), str(shown))) from None


def _guard_existing(tree: Path) -> None:
    if not tree.exists():
        return
    if not tree.is_dir():
        raise StackError(f"{tree} exists and is not a directory; refused")
    if not is_work_tree(tree):
        if any(tree.iterdir()):
            raise StackError(f"{tree} exists and is not a stack work tree; refused")
        return
    refuse_uncommitted(tree)
    marker = refreshed_marker(tree)
    own = {"refs/heads/main", f"refs/tags/{UPSTREAM_TAG}"}
    own |= {f"refs/tags/{layer_tag(n)}" for n in range(1, marker["layers"] + 1)}
    other = sorted(set(git(tree, "for-each-ref", "--format=%(refname)").split()) - own)
    if other:
        raise StackError(
            f"{tree} holds {other[0]} (a stash, branch or tag apply did not make); "
            "refused: apply it to its layer or drop it first"
        )


def commit_all(tree: Path, message: str, date: str) -> None:
    # --force: every file of the sdist and of each layer, whatever the sdist's
    # .gitignore says (its ignored files are part of the release too).
    git(tree, "add", "-A", "--force")
    git(
        tree,
        "commit",
        "-q",
        "--allow-empty",
        "--no-verify",
        "-F",
        "-",
        date=date,
        stdin=message.encode(),
    )


def apply_layer(tree: Path, stack: Stack, layer: Layer) -> None:
    """Apply one layer's diff exactly and copy its overlay files."""
    for fp in layer.patch.files:
        target = tree / fp.path
        if not target.is_file():
            raise StackError(
                f"layer {layer.number} ({layer.name}) does not apply: "
                f"{fp.path} does not exist upstream"
            )
        try:
            patched = apply_exact(target.read_bytes(), fp)
        except HunkMismatch as e:
            raise StackError(
                f"layer {layer.number} ({layer.name}) does not apply: {e}"
            ) from e
        if fp.deleted:
            target.unlink()
        else:
            target.write_bytes(patched)
    for rel in layer.patch.overlay:
        target = tree / rel
        if target.is_file():
            raise StackError(
                f"layer {layer.number} ({layer.name}): overlay file {rel} exists "
                "upstream; changes to upstream files belong in the diff"
            )
        blocker = overlay_blocker(tree, rel)
        if blocker is not None:
            kind = "folder" if (tree / blocker).is_dir() else "file"
            raise StackError(
                f"layer {layer.number} ({layer.name}) does not apply: overlay file "
                f"{rel} goes where upstream has the {kind} {blocker}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stack.overlay_dir / rel, target)


def overlay_blocker(tree: Path, rel: str) -> str | None:
    """What stands in ``tree`` where overlay file ``rel`` goes: ``rel``
    itself, or a parent of it that is not a folder; None if nothing does."""
    path = PurePosixPath(rel)
    for part in [*reversed(path.parents[:-1]), path]:
        target = tree / part
        if target.exists() and (part == path or not target.is_dir()):
            return part.as_posix()
    return None


def build_tree(
    stack: Stack,
    dest: Path,
    lay_out_pristine: Callable[[Path], dict],
    pristine_message: str,
    upto: int | None = None,
) -> None:
    """Create ``dest`` as the applied work tree of layers ``1..upto``.

    ``lay_out_pristine`` lays the upstream files out in the folder it is
    given and returns the record of that input (``sdist_source``,
    ``checkout_source``), which the marker keeps for build's lock.

    The tree is built beside ``dest`` and moved into place only when every
    layer applied; an existing ``dest`` is replaced only if it holds nothing
    that the patches do not. What a killed apply was building there goes.
    """
    layers = stack.upto(upto)
    guard_existing(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tree_lock(dest, "apply"):
            _build_tree(stack, dest, lay_out_pristine, pristine_message, layers)
    except OSError as e:
        raise StackError(f"apply into {dest} failed: {e}") from e


def _build_tree(
    stack: Stack,
    dest: Path,
    lay_out_pristine: Callable[[Path], dict],
    pristine_message: str,
    layers: list[Layer],
) -> None:
    prefix = f".{dest.name}{STAGING_MARK}"
    aside = f".{dest.name}{ASIDE_MARK}"
    put_back_aside(dest, aside)
    guard_existing(dest)  # again: another run may have changed it meanwhile
    remove_stale_staging(dest.parent, prefix)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=dest.parent))
    lock = lock_folder(staging)
    try:
        # mkdtemp's 0700, not what the umask gives the tree's files.
        staging.chmod(0o777 & ~_umask())
        source = lay_out_pristine(staging)
        git(staging, "init", "-q", "-b", "main")
        commit_all(staging, pristine_message, date="1980-01-01T00:00:00+0000")
        git(staging, "tag", UPSTREAM_TAG)
        for layer in layers:
            apply_layer(staging, stack, layer)
            date = f"{layer.patch.fields['Last-Update']}T00:00:00+0000"
            commit_all(staging, layer.patch.commit_message(), date=date)
            git(staging, "tag", layer_tag(layer.number))
        write_marker(staging, len(layers), digests_of(stack, len(layers)), source)
        # The old tree is renamed aside before it is removed: an interrupt
        # never leaves ``dest`` half removed. It is guarded again once aside:
        # a maintainer may have edited or committed in it while this apply
        # laid out upstream, and an edit made after that check has no ``dest``
        # left to land in. A run killed before ``dest`` is back leaves the old
        # tree aside, and the next run puts it back.
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=aside, dir=dest.parent))
            dest.rename(old)
            try:
                guard_existing(old, shown=dest)
            except BaseException:
                old.rename(dest)
                raise
        staging.rename(dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
        os.close(lock)


def put_back_aside(dest: Path, aside: str) -> None:
    """Finish what a killed apply left of the tree it was replacing: with no
    ``dest``, its old tree goes back in place (it may hold work made while
    that apply ran); beside a new ``dest`` it had been checked and goes.
    Beside a ``dest`` no apply made (a folder made again since), it may
    never have been checked: refused, it stays."""
    for old in sorted(dest.parent.glob(f"{glob.escape(aside)}*")):
        if old.is_symlink() or not old.is_dir():
            continue
        if not dest.exists():
            old.rename(dest)
        elif (dest / ".git" / MARKER).is_file():
            shutil.rmtree(old, ignore_errors=True)
        else:
            raise StackError(
                f"apply: {old} holds the tree a killed apply moved aside, and "
                f"{dest} is no tree apply made; refused: move {dest} out of the "
                f"way and run `nox -s apply` again to put it back"
            )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def tree_lock(tree: Path, command: str) -> Iterator[None]:
    """Hold the lock of work tree ``tree`` (a file beside it) while ``command``
    reads or writes it; ``StackError`` at once if another run holds it. Where
    the folder is read-only nothing can write the tree: no lock is needed."""
    path = tree.parent / f".{tree.name}{LOCK_MARK}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
            yield
            return
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackError(
                f"{command}: another run of the tooling (apply, refresh, build, "
                f"site or rebase --port) is using {tree}; refused: wait for it to "
                "finish"
            ) from None
        yield
    finally:
        os.close(fd)


def lock_folder(folder: Path) -> int:
    """An open descriptor of ``folder`` holding an exclusive lock on it
    (released when closed or when the process dies, however it dies);
    ``BlockingIOError`` if another one holds it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def remove_stale_staging(parent: Path, prefix: str) -> None:
    """Remove the staging trees that killed runs (apply, build) left in
    ``parent``: the folders named ``prefix*`` that no running one holds
    locked."""
    for stale in parent.glob(f"{glob.escape(prefix)}*"):
        if stale.is_symlink() or not stale.is_dir():
            continue
        try:
            fd = lock_folder(stale)
        except BlockingIOError:
            continue  # a run building it now
        try:
            shutil.rmtree(stale, ignore_errors=True)
        finally:
            os.close(fd)
