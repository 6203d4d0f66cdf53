# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Turn the work tree's layer commits back into patches/ and overlay/."""

from __future__ import annotations

import datetime as dt
import glob
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from k3stack import StackError
from k3stack.gitutil import changes, dirty_paths, git, git_bytes, is_work_tree
from k3stack.patchfile import (
    HunkMismatch,
    LayerPatch,
    apply_exact,
    parse_commit_message,
    parse_diff,
)
from k3stack.series import Layer, Stack, check_layering, load_stack
from k3stack.worktree import (
    UPSTREAM_TAG,
    applied_layers,
    digests_of,
    disk_digest,
    layer_digest,
    layer_tag,
    lock_folder,
    read_marker,
    tree_lock,
    write_marker,
)

EXECUTABLE_MODE = "100755"
SYMLINK_MODE = "120000"
# The checkout's files a refresh writes are staged in a folder named so in
# its (git-ignored) .work/, then moved into place as its journal lists them.
STAGING_PREFIX = "refresh-staging-"
JOURNAL = "journal.json"


def _tree_files(tree: Path, rev: str) -> set[str]:
    return set(
        filter(None, git(tree, "ls-tree", "-r", "-z", "--name-only", rev).split("\0"))
    )


def read_layer(
    tree: Path, commit: str, upstream: set[str], lower_overlay: set[str], where: str
) -> tuple[LayerPatch, dict[str, bytes]]:
    """One layer commit as a patch plus the overlay files it owns."""
    parent = f"{commit}^"
    upstream_paths: list[str] = []
    owned: dict[str, bytes] = {}
    for change in changes(tree, parent, commit):
        path = change.path
        if change.new_mode == SYMLINK_MODE:
            raise StackError(
                f"{where} makes {path} a symlink; refused: the stack carries "
                "regular files only (commit a copy or import the target instead)"
            )
        if path in upstream:
            if change.status != "D" and change.new_mode != change.old_mode:
                raise StackError(
                    f"{where} changes the mode of upstream file {path} "
                    f"({change.old_mode} -> {change.new_mode}); refused: the stack "
                    "carries no mode changes (the wheel keeps upstream's modes)"
                )
            upstream_paths.append(path)
        elif path in lower_overlay:
            raise StackError(
                f"{where} changes {path}, which a lower layer owns: extend it "
                "through that layer's extension point instead"
            )
        elif not path.startswith("vllm/"):
            raise StackError(
                f"{where} adds {path}: only new files under vllm/ can be overlay"
            )
        elif any(char.isspace() for char in path):
            raise StackError(
                f"{where} adds {path!r}: the Overlay field cannot list a name "
                "with whitespace; refused: rename the file"
            )
        elif change.status != "D":
            if change.new_mode == EXECUTABLE_MODE:
                raise StackError(
                    f"{where} makes {path} executable; refused: the wheel and the "
                    "image install overlay files without it (git update-index "
                    f"--chmod=-x {path}, then amend the layer)"
                )
            owned[path] = git_bytes(tree, "show", f"{commit}:{path}")
    patch = parse_commit_message(git(tree, "log", "-1", "--format=%B", commit), where)
    diff = b""
    if upstream_paths:
        # Every option the work tree's own git config could change is given.
        diff = git_bytes(
            tree,
            "-c",
            "diff.suppressBlankEmpty=false",
            "-c",
            "core.quotePath=true",
            "diff",
            "--full-index",
            "--no-renames",
            "--no-color",
            "--no-ext-diff",
            "--no-textconv",
            "--no-relative",
            "--src-prefix=a/",
            "--dst-prefix=b/",
            "--diff-algorithm=myers",
            "--indent-heuristic",
            "--inter-hunk-context=0",
            f"-O{os.devnull}",
            "-U3",
            parent,
            commit,
            "--",
            *upstream_paths,
        )
    patch.diff = diff
    patch.files = parse_diff(diff, where)
    patch.fields["Overlay"] = "\n".join(sorted(owned))
    return patch, owned


def refresh(stack: Stack, tree: Path, today: dt.date | None = None) -> list[str]:
    """Write the work tree's layers back; return one line per changed file.

    Refused when the work tree or the checkout's patches/ and overlay/ hold
    uncommitted edits, when HEAD does not descend from the pristine commit, or
    when the commits on top of it are not one per applied layer. What an
    interrupted refresh left half written is finished first.
    """
    if not is_work_tree(tree):
        raise StackError(f"{tree} is not a work tree; run `nox -s apply` first")
    with tree_lock(tree, "refresh"):
        finished = finish_write_back(stack.root)
        if finished:
            stack = load_stack(stack.root)
        return finished + _refresh(stack, tree, today)


def _refresh(stack: Stack, tree: Path, today: dt.date | None) -> list[str]:
    marker = read_marker(tree)
    layers = applied_layers(stack, tree, marker)
    dirty = dirty_paths(tree)
    if dirty:
        raise StackError(
            f"{tree} has uncommitted edits ({dirty[0]} ...); refused: commit "
            "them into their layer first (git commit --fixup, rebase --autosquash; "
            "`git add --force` for files its .gitignore matches)"
        )
    _refuse_rewritten_pristine(tree)
    commits = git(tree, "rev-list", "--reverse", f"{UPSTREAM_TAG}..HEAD").splitlines()
    if git(tree, "rev-list", "--merges", f"{UPSTREAM_TAG}..HEAD"):
        raise StackError(f"{tree}: merge commits on top of upstream; refused")
    applied = marker["layers"]
    if len(commits) != applied:
        raise StackError(_count_mismatch(tree, len(commits), applied))
    upstream = _tree_files(tree, UPSTREAM_TAG)
    applied_digests = marker.get("digests") or [None] * applied
    pending = []
    synced: set[int] = set()
    disk_digests: dict[int, str] = {}  # layer number -> patches/, overlay/ now
    lower_overlay: set[str] = set()
    for layer, commit, applied_digest in zip(
        layers, commits, applied_digests, strict=True
    ):
        where = f"layer {layer.number} ({layer.name})"
        patch, owned = read_layer(tree, commit, upstream, lower_overlay, where)
        other = next(
            (
                o
                for o in stack.layers
                if o is not layer and o.patch.subject == patch.subject
            ),
            None,
        )
        if other is not None and patch.subject != layer.patch.subject:
            raise StackError(
                f"commit {layer.number} on top of upstream is layer {other.number} "
                f"({other.name}): the commits are in another order than "
                "patches/series; refused: restore their order (reordering layers "
                "means editing patches/series and the patch names)"
            )
        lower_overlay |= set(owned)
        digest = layer_digest(patch, owned)
        if digest == applied_digest:
            continue
        disk_digests[layer.number] = disk_digest(stack, layer)
        if digest == disk_digests[layer.number]:
            # Already written back (a refresh that failed before its marker).
            synced.add(layer.number)
            continue
        pending.append((layer, patch, owned, applied_digest))
    targets = {f"patches/{layer.name}" for layer, *_ in pending}
    for layer, _, owned, _ in pending:
        targets |= {f"overlay/{rel}" for rel in [*owned, *layer.patch.overlay]}
    if is_work_tree(stack.root):
        clash = sorted(set(dirty_paths(stack.root, "patches", "overlay")) & targets)
        if clash:
            raise StackError(
                f"uncommitted edits in this checkout ({clash[0]} ...); refused: "
                "commit or stash them before refresh"
            )
    for layer, _, _, applied_digest in pending:
        if applied_digest is not None and disk_digests[layer.number] != applied_digest:
            raise StackError(
                f"layer {layer.number} ({layer.name}): patches/{layer.name} changed "
                f"since {tree} was applied and the tree changes the layer too; "
                "refused: re-apply and redo the edit"
            )
    today = today or dt.date.today()
    # Written to a scratch copy first: a result that does not validate (or a
    # failure half-way) leaves the checkout as it was.
    with tempfile.TemporaryDirectory(prefix="k3-refresh-") as scratch:
        for part in ("patches", "overlay"):
            shutil.copytree(stack.root / part, Path(scratch) / part)
        changed = _write_back(load_stack(Path(scratch)), pending, today)
        refreshed = load_stack(Path(scratch))
        check_layering(refreshed)
        if pending:
            _refuse_unappliable_upper_layers(tree, refreshed.layers[applied:])
        _put_in_place(stack.root, Path(scratch), targets, changed)
    for number, commit in enumerate(commits, start=1):
        git(tree, "tag", "-f", layer_tag(number), commit)
    # What the tree holds: the layers written back are now on disk as they
    # are in the tree; the others keep the digest they were applied with (a
    # change on disk since then is not in the tree, and a later refresh must
    # not write the tree's older form back over it).
    written = {layer.number for layer, *_ in pending} | synced
    on_disk = digests_of(load_stack(stack.root), applied)
    write_marker(
        tree,
        applied,
        [
            on_disk[i] if layer.number in written else applied_digests[i]
            for i, layer in enumerate(layers)
        ],
        marker.get("source"),
    )
    return changed


def _refuse_unappliable_upper_layers(tree: Path, upper: list[Layer]) -> None:
    """``StackError`` unless the layers above the applied ones still apply
    exactly, in order, on the tree: a change to a layer below may move the
    lines they change, and refresh cannot write them again."""
    files: dict[str, bytes | None] = {}
    for layer in upper:
        where = f"layer {layer.number} ({layer.name})"
        for fp in layer.patch.files:
            if fp.path not in files:
                # The work tree is HEAD: refresh refused uncommitted edits.
                target = tree / fp.path
                files[fp.path] = target.read_bytes() if target.is_file() else None
            source = files[fp.path]
            if source is None:
                raise StackError(
                    f"{where} would no longer apply on the refreshed layers below "
                    f"it: {fp.path} does not exist; refused: apply every layer "
                    "(`nox -s apply`) and make the change there"
                )
            try:
                patched = apply_exact(source, fp)
            except HunkMismatch as e:
                raise StackError(
                    f"{where} would no longer apply on the refreshed layers below "
                    f"it: {e}; refused: apply every layer (`nox -s apply`) and make "
                    "the change there"
                ) from e
            files[fp.path] = None if fp.deleted else patched


def _refuse_rewritten_pristine(tree: Path) -> None:
    """``StackError`` unless HEAD descends from the pristine commit apply made."""
    pristine = git(tree, "rev-parse", f"{UPSTREAM_TAG}^{{commit}}")
    if git(tree, "merge-base", pristine, "HEAD", check=False) != pristine:
        roots = git(tree, "rev-list", "--max-parents=0", "HEAD").split()
        root = roots[0][:12] if roots else "ROOT"
        raise StackError(
            f"{tree}: HEAD does not descend from the pristine upstream commit (tag "
            f"{UPSTREAM_TAG}): it was rewritten; refused: edits to upstream belong "
            f"in a layer commit (`git diff {UPSTREAM_TAG} {root}` shows them; "
            f"`git rebase --onto {UPSTREAM_TAG} {root}` puts the layers back on "
            "the pristine commit)"
        )


def _count_mismatch(tree: Path, count: int, applied: int) -> str:
    """Why ``count`` commits on top of upstream are not one per applied
    layer, and what to do."""
    where = f"{tree} has {count} commits on top of upstream for {applied} layers"
    if not git(tree, "symbolic-ref", "-q", "HEAD", check=False):
        return (
            f"{where}: HEAD is detached; refused: return to branch main "
            "(git checkout main, or finish the rebase in progress)"
        )
    if count < applied:
        return (
            f"{where}: layer commits are missing; refused: restore them (git "
            "reflog) or drop the layers from patches/series and apply again"
        )
    return (
        f"{where}: squash extra commits into their layers first "
        f"(git rebase -i --autosquash {UPSTREAM_TAG})"
    )


def _write_back(
    stack: Stack,
    pending: list[tuple[Layer, LayerPatch, dict[str, bytes], str | None]],
    today: dt.date,
) -> list[str]:
    """Write the pending layers' patches and overlay files into ``stack``'s
    checkout; one line per changed file."""
    changed: list[str] = []
    # A file may move between pending layers: only what none owns goes.
    kept = {rel for _, _, owned, _ in pending for rel in owned}
    for pending_layer, patch, owned, _ in pending:
        layer = stack.layers[pending_layer.number - 1]
        overlay_changes = _write_overlay(stack, layer.patch.overlay, owned, kept)
        changed += overlay_changes
        old = layer.patch_file.read_bytes()
        patch.fields["Last-Update"] = layer.patch.fields["Last-Update"]
        if overlay_changes or patch.render() != old:
            patch.fields["Last-Update"] = today.isoformat()
        new = patch.render()
        if new != old:
            layer.patch_file.write_bytes(new)
            changed.append(f"patches/{layer.name}: updated")
    return changed


def _write_overlay(
    stack: Stack, before: list[str], owned: dict[str, bytes], kept: set[str]
) -> list[str]:
    changed = []
    for rel, data in sorted(owned.items()):
        target = stack.overlay_dir / rel
        if target.is_file() and target.read_bytes() == data:
            continue
        state = "updated" if target.exists() else "added"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        changed.append(f"overlay/{rel}: {state}")
    for rel in before:
        if rel not in kept:
            (stack.overlay_dir / rel).unlink(missing_ok=True)
            changed.append(f"overlay/{rel}: removed")
    return changed


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _put_in_place(
    root: Path, scratch: Path, paths: set[str], changed: list[str]
) -> None:
    """Give the checkout at ``root`` the files ``paths`` as ``scratch`` holds
    them. Each is staged whole first, then a journal, then the moves: a run
    stopped at any point (SIGKILL, Ctrl-C) leaves no file torn, and the next
    refresh finishes what the journal lists (``finish_write_back``)."""
    files = [
        (rel, scratch / rel if (scratch / rel).is_file() else None)
        for rel in sorted(paths)
        if _sha(scratch / rel) != _sha(root / rel)
    ]
    if not files:
        return
    (root / ".work").mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root / ".work"))
    lock = lock_folder(staging)  # no other run takes it for a killed one's
    try:
        journal = []
        for i, (rel, source) in enumerate(files):
            staged = None
            if source is not None:
                staged = str(i)
                shutil.copyfile(source, staging / staged)
                if (root / rel).is_file():
                    shutil.copymode(root / rel, staging / staged)
            journal.append([rel, staged, _sha(root / rel), _sha(scratch / rel)])
        partial = staging / f"{JOURNAL}.partial"
        partial.write_text(json.dumps({"files": journal, "changed": changed}))
        os.replace(partial, staging / JOURNAL)
        _move_into_place(root, staging, journal)
        shutil.rmtree(staging)
    except BaseException:
        if not (staging / JOURNAL).is_file():  # nothing moved yet
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(lock)


def _move_into_place(root: Path, staging: Path, journal: list) -> None:
    for rel, staged, _, after in journal:
        target = root / rel
        if _sha(target) == after:
            continue  # moved by the run that staged it
        if staged is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / staged, target)


def finish_write_back(root: Path) -> list[str]:
    """Finish the moves of the refreshes that were stopped while writing into
    the checkout at ``root`` (their staging folders that no running refresh
    holds); return their lines of changed files. A staging folder without
    journal (stopped before any move), or whose files are all back as they
    were (`git checkout`: the tree still holds the layers), just goes;
    ``StackError`` if a file was changed otherwise since."""
    changed: list[str] = []
    for staging in _staging_folders(root):
        try:
            lock = lock_folder(staging)
        except BlockingIOError:
            continue  # a refresh writing now
        try:
            if (staging / JOURNAL).is_file():
                changed += _finish(root, staging)
            shutil.rmtree(staging, ignore_errors=True)
        finally:
            os.close(lock)
    return changed


def refuse_stopped_refresh(root: Path, command: str) -> None:
    """``StackError`` if a refresh stopped (or running) after it began moving
    files into the checkout at ``root`` has not put every file in place: the
    series there may mix new and old patches and overlay files."""
    for staging in _staging_folders(root):
        if not (staging / JOURNAL).is_file():
            continue
        journal = _read_journal(staging)["files"]
        if all(_sha(root / rel) == after for rel, _, _, after in journal):
            continue  # every file moved; only the folder's removal was left
        try:
            os.close(lock_folder(staging))
        except BlockingIOError:
            raise StackError(
                f"a refresh is writing patches/ and overlay/ now ({staging}): "
                f"run {command} again once it is done"
            ) from None
        raise StackError(
            "a refresh was stopped half-way writing patches/ and overlay/ "
            f"({staging}): run refresh to finish it, then {command} again"
        )


def _staging_folders(root: Path) -> list[Path]:
    """The refresh staging folders in the checkout at ``root``."""
    found = (root / ".work").glob(f"{glob.escape(STAGING_PREFIX)}*")
    return sorted(p for p in found if p.is_dir() and not p.is_symlink())


def _read_journal(staging: Path) -> dict:
    return json.loads((staging / JOURNAL).read_text())


def _finish(root: Path, staging: Path) -> list[str]:
    fields = _read_journal(staging)
    journal = fields["files"]
    now = {rel: _sha(root / rel) for rel, *_ in journal}
    unfinished = [
        rel
        for rel, staged, before, after in journal
        if now[rel] != after
        and (now[rel] != before or (staged and not (staging / staged).is_file()))
    ]
    if not unfinished:
        _move_into_place(root, staging, journal)
        return list(fields["changed"])
    if all(now[rel] == before for rel, _, before, _ in journal):
        return []
    raise StackError(
        f"{root}/{unfinished[0]} changed since a refresh was stopped half-way "
        "writing it and other files; refused: stash the changes (git stash -u "
        "-- patches overlay), then run refresh again"
    )
