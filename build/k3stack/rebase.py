# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Try every layer on another upstream and classify it.

Classes: ``clean`` (applies exactly), ``3-way`` (git's three-way merge lands
it), ``already-upstream`` (its change is there already: the diff reverse-
applies, or the merge comes out empty), ``conflict`` (files and hunks listed).
Overlay files upstream already has byte for byte count as landed (as in
git's merge); one with other bytes is a conflict. Layers that land are
stacked so later layers are tried on top of them; a conflicting layer is
skipped, and a later one that changes the same files names it and tells which
of its conflicts come from that layer missing rather than from upstream.

With ``--port`` the work tree's layer commits move onto the new release
(``git rebase``): layers that land are committed, git stops at a conflict
for the maintainer to resolve, and ``refresh`` then writes the patches for
the new pin.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3stack import StackError
from k3stack.fetch import cache_dir, download, pip_index_url, project_files, sha256_file
from k3stack.gitutil import EPOCH, git, git_bytes, merge_file
from k3stack.patchfile import HunkMismatch, apply_exact, split_lines
from k3stack.pin import PIN_FILE, Pin, load_pin
from k3stack.series import Layer, Stack
from k3stack.upstream import (
    checkout_head,
    checkout_source,
    export_checkout,
    extract_sdist,
    sdist_source,
)
from k3stack.worktree import (
    UPSTREAM_TAG,
    commit_all,
    current_marker,
    layer_tag,
    overlay_blocker,
    read_marker,
    write_marker,
)

_CONFLICT_START = re.compile(rb"^<{7}( |$)")
_CONFLICT_END = re.compile(rb"^>{7}( |$)")
# What git keeps in .git while a rebase stops (merge and apply backends).
_REBASE_STATE = ("rebase-merge", "rebase-apply")


@dataclass
class LayerResult:
    number: int
    patch: str
    status: str
    files: list[str] = field(default_factory=list)
    hunks: list[str] = field(default_factory=list)
    note: str = ""
    # Skipped (conflicting) lower layers that change files this one changes:
    # its result there is relative to a stack without them.
    tried_without: list[int] = field(default_factory=list)
    # Conflicted files whose conflict arises without upstream's changes too
    # (from the skipped layers' changes being absent), not upstream's.
    skipped_conflicts: list[str] = field(default_factory=list)


def _exact_failures(tree: Path, layer: Layer, reverse: bool) -> list[str]:
    failures = []
    for fp in layer.patch.files:
        target = tree / fp.path
        if not target.is_file():
            failures.append(f"{fp.path}: missing")
            continue
        try:
            apply_exact(target.read_bytes(), fp.reversed() if reverse else fp)
        except HunkMismatch as e:
            failures.append(str(e))
    return failures


def _overlay_states(tree: Path, stack: Stack, layer: Layer) -> dict[str, str]:
    """Each overlay file of ``layer`` on ``tree``: 'absent', 'identical' (the
    same bytes) or 'clash' (other bytes, or a folder or file in its way)."""
    states = {}
    for rel in layer.patch.overlay:
        target = tree / rel
        if overlay_blocker(tree, rel) is None:
            states[rel] = "absent"
        elif target.is_file() and (
            target.read_bytes() == (stack.overlay_dir / rel).read_bytes()
        ):
            states[rel] = "identical"
        else:
            states[rel] = "clash"
    return states


def _changed(layer: Layer) -> set[str]:
    return {fp.path for fp in layer.patch.files} | set(layer.patch.overlay)


def _conflicts_without_upstream(
    tree: Path, layer: Layer, path: str, skipped: list[int]
) -> bool:
    """Whether ``layer``'s change to ``path`` conflicts on the old stack with
    the ``skipped`` layers' changes to it undone, i.e. with no change of
    upstream's involved: its conflict there is the skipped layers' doing."""

    def at(n: int) -> bytes:
        tag = UPSTREAM_TAG if n == 0 else layer_tag(n)
        return git_bytes(tree, "show", f"{tag}:{path}", check=False)

    text = at(layer.number - 1)
    for n in sorted(skipped, reverse=True):
        undone = merge_file(tree, text, at(n), at(n - 1))
        if undone is None:
            return True
        text = undone
    return merge_file(tree, text, at(layer.number - 1), at(layer.number)) is None


def _without_note(shared: dict[int, list[str]]) -> str:
    return "; ".join(
        f"tried without layer {n} (a conflict), which also changes {', '.join(paths)}"
        for n, paths in sorted(shared.items())
    )


def _landed_as_a_stack(tree: Path, stack: Stack) -> set[int]:
    """The layers whose change ``tree`` (the new upstream) holds, peeled from
    the top: a layer is there if its overlay files are, byte for byte, and
    its diff reverse-applies once the later layers found there are undone
    (their hunks may border its own, so it cannot reverse-apply alone)."""
    files: dict[str, bytes | None] = {}

    def read(path: str) -> bytes | None:
        if path not in files:
            target = tree / path
            files[path] = target.read_bytes() if target.is_file() else None
        return files[path]

    landed: set[int] = set()
    for layer in reversed(stack.layers):
        if not (layer.patch.files or layer.patch.overlay):
            continue
        if any(
            read(rel) != (stack.overlay_dir / rel).read_bytes()
            for rel in layer.patch.overlay
        ):
            continue
        undone: dict[str, bytes | None] = {}
        try:
            for fp in layer.patch.files:
                text = read(fp.path)
                if text is None:
                    raise HunkMismatch(fp.path, 0, None, "missing")
                undone[fp.path] = apply_exact(text, fp.reversed())
        except HunkMismatch:
            continue
        landed.add(layer.number)
        files.update(undone)
        files.update(dict.fromkeys(layer.patch.overlay))
    return landed


def _conflict_hunks(tree: Path, path: str) -> list[str]:
    ranges, start = [], None
    for number, line in enumerate(split_lines((tree / path).read_bytes()), start=1):
        if _CONFLICT_START.match(line):
            start = number
        elif _CONFLICT_END.match(line) and start is not None:
            ranges.append(f"{path}:{start}-{number}")
            start = None
    return ranges


def classify(
    stack: Stack, tree: Path, new_upstream: Path, message: str
) -> list[LayerResult]:
    """Classify every layer of the applied ``tree`` on ``new_upstream``."""
    git(tree, "checkout", "-q", "--orphan", "rebase-target")
    git(tree, "rm", "-rfq", "--cached", ".")
    git(tree, "clean", "-fdxq")
    for item in tree.iterdir():
        if item.name != ".git":
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    shutil.copytree(new_upstream, tree, dirs_exist_ok=True)
    commit_all(tree, message, date="1980-01-01T00:00:00+0000")
    landed = _landed_as_a_stack(tree, stack)
    results = []
    skipped: list[Layer] = []
    for layer in stack.layers:
        result = LayerResult(layer.number, layer.name, "")
        results.append(result)
        mine = _changed(layer)
        shared = {
            s.number: sorted(common) for s in skipped if (common := _changed(s) & mine)
        }
        result.tried_without = sorted(shared)
        without = _without_note(shared)
        overlay = _overlay_states(tree, stack, layer)
        present = [rel for rel, state in overlay.items() if state == "identical"]
        clash = [rel for rel, state in overlay.items() if state == "clash"]
        there = f"overlay files already upstream: {', '.join(present)}"
        exact = _exact_failures(tree, layer, reverse=False)
        whole = bool(present) and len(present) == len(overlay)
        if whole and not _exact_failures(tree, layer, reverse=True):
            result.status = "already-upstream"
            result.note = _join(
                "the diff reverse-applies and the overlay files are present", without
            )
            continue
        if layer.number in landed:
            result.status = "already-upstream"
            result.note = _join(
                "the diff reverse-applies with the later layers already upstream "
                "undone, and the overlay files are present",
                without,
            )
            continue
        if not exact and not clash:
            # Overlay files upstream has byte for byte land as no change, as
            # they do in git's merge.
            result.status = "clean"
            result.note = _join(there if present else "", without)
            _land(tree, layer, stack)
            continue
        git(tree, "cherry-pick", "--no-commit", layer_tag(layer.number), check=False)
        conflicted = _split_z(git(tree, "diff", "--name-only", "-z", "--diff-filter=U"))
        if conflicted or clash:
            result.status = "conflict"
            result.files = conflicted + [
                f"overlay: {rel}" for rel in clash if rel not in conflicted
            ]
            result.hunks = exact + [
                r for path in conflicted for r in _conflict_hunks(tree, path)
            ]
            git(tree, "cherry-pick", "--abort", check=False)
            git(tree, "reset", "-q", "--hard")
            git(tree, "clean", "-fdq")
            result.skipped_conflicts = [
                path
                for path in conflicted
                if (behind := [n for n, paths in shared.items() if path in paths])
                and _conflicts_without_upstream(tree, layer, path, behind)
            ]
            own = [p for p in conflicted if p not in result.skipped_conflicts]
            blamed = ", ".join(
                str(n)
                for n, paths in sorted(shared.items())
                if set(paths) & set(result.skipped_conflicts)
            )
            result.note = _join(
                without,
                (
                    f"the conflicts in {', '.join(result.skipped_conflicts)} come "
                    f"from layer {blamed} missing (they arise on the old upstream "
                    f"too), not from upstream: resolve layer {blamed} first"
                    if result.skipped_conflicts
                    else ""
                ),
                (
                    f"the conflicts in {', '.join(own)} are upstream's"
                    if own and shared
                    else ""
                ),
                "later layers were tried without this one",
            )
            skipped.append(layer)
            continue
        if not git(tree, "diff", "--cached", "--name-only"):
            result.status = "already-upstream"
            result.note = _join("the three-way merge comes out empty", without)
            git(tree, "cherry-pick", "--abort", check=False)
            git(tree, "reset", "-q", "--hard")
            continue
        result.status = "3-way"
        result.files = sorted({h.split(" hunk ")[0] for h in exact})
        result.hunks = exact
        result.note = _join(there if present else "", without)
        commit_all(tree, layer.patch.commit_message(), date="1980-01-01T00:00:00+0000")
    return results


def _split_z(out: str) -> list[str]:
    """Paths git listed with ``-z``: under their real names, none quoted."""
    return [path for path in out.split("\0") if path]


def _join(*parts: str) -> str:
    return "; ".join(part for part in parts if part)


def _land(tree: Path, layer: Layer, stack: Stack) -> None:
    for fp in layer.patch.files:
        target = tree / fp.path
        patched = apply_exact(target.read_bytes(), fp)
        if fp.deleted:
            target.unlink()
        else:
            target.write_bytes(patched)
    for rel in layer.patch.overlay:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stack.overlay_dir / rel, tree / rel)
    commit_all(tree, layer.patch.commit_message(), date="1980-01-01T00:00:00+0000")


def render_report(target: str, results: list[LayerResult]) -> str:
    lines = [
        f"# Rebase report: the stack on {target}",
        "",
        "| layer | patch | result | files | hunks | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        cells = [
            str(r.number),
            r.patch,
            r.status,
            "<br>".join(r.files),
            "<br>".join(r.hunks),
            r.note,
        ]
        # A '|' (git copies a hunk's function line: `-> str | None:`) would
        # end its cell.
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _rebase_stopped(tree: Path) -> bool:
    """Whether a git rebase stopped in ``tree`` waits to be continued."""
    return any((tree / ".git" / d).is_dir() for d in _REBASE_STATE)


def check_portable(stack: Stack, tree: Path) -> None:
    """``StackError`` unless ``tree`` holds every layer of the series as
    patches/ and overlay/ hold it, refreshed and with nothing uncommitted."""
    if _rebase_stopped(tree):
        raise StackError(
            f"{tree} is in the middle of a rebase; refused: finish it (`git rebase "
            "--continue` there, then `nox -s refresh`) or `git rebase --abort` it"
        )
    marker = current_marker(stack, tree)
    if marker["layers"] != len(stack.layers):
        raise StackError(
            f"{tree} holds {marker['layers']} of {len(stack.layers)} layers; "
            "refused: run `nox -s apply` (every layer) before --port"
        )


def refuse_landed_layers(results: list[LayerResult], target: str) -> None:
    """``StackError`` if a layer is already upstream in ``target``: such a
    layer leaves the series rather than being ported as an empty commit."""
    landed = [str(r.number) for r in results if r.status == "already-upstream"]
    if landed:
        raise StackError(
            f"layer {', '.join(landed)} is already upstream in {target}: drop it "
            "from patches/series (and its overlay files) before --port"
        )


def port_tree(
    stack: Stack, tree: Path, new_upstream: Path, message: str, source: dict
) -> None:
    """Rebase the layer commits of ``tree`` (one ``check_portable``
    accepted) onto a pristine commit of ``new_upstream`` (made as apply makes
    one, with ``message``; ``source``: the input it was laid out from, as
    ``build_tree``'s lay-out returns it), which becomes the tree's upstream.
    ``StackError`` naming the layer if git stops at a conflict: the tree is
    left mid-rebase for the maintainer."""
    old = git(tree, "rev-parse", f"{UPSTREAM_TAG}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="k3stack-port-") as scratch:
        pristine = Path(scratch) / "pristine"
        shutil.copytree(new_upstream, pristine)
        git(pristine, "init", "-q", "-b", "main")
        commit_all(pristine, message, date=EPOCH)
        git(tree, "fetch", "-q", "--no-tags", str(pristine), "main")
    new = git(tree, "rev-parse", "FETCH_HEAD")
    layers = len(stack.layers)
    marker = read_marker(tree)
    git(tree, "tag", "-f", UPSTREAM_TAG, new)
    # No layer is as patches/ hold it: refresh writes every one back.
    write_marker(tree, layers, [None] * layers, source)
    try:
        # One commit per layer whatever git makes of it: the series and
        # refresh count on that.
        git(
            tree,
            "rebase",
            "-q",
            "--reapply-cherry-picks",
            "--empty=keep",
            "--onto",
            new,
            old,
            "main",
        )
    except StackError:
        if not _rebase_stopped(tree):
            # Not a conflict: the tree stays as it was.
            git(tree, "tag", "-f", UPSTREAM_TAG, old)
            write_marker(
                tree,
                marker["layers"],
                marker.get("digests") or [],
                marker.get("source"),
            )
            raise
    else:
        return
    subject = git(tree, "log", "-1", "--format=%s", "REBASE_HEAD", check=False)
    layer = next((la for la in stack.layers if la.patch.subject == subject), None)
    where = f"layer {layer.number} ({layer.name})" if layer else f"commit {subject!r}"
    conflicted = _split_z(git(tree, "diff", "--name-only", "-z", "--diff-filter=U"))
    raise StackError(
        f"{where} conflicts in {', '.join(conflicted) or 'the work tree'}: resolve "
        f"them in {tree}, `git add` them and run `git rebase --continue` there "
        "(again for each later layer that stops), then `nox -s refresh`; to give "
        "up, `git rebase --abort` there, `git checkout build/pin.toml` here and "
        "`nox -s apply`"
    )


def fetch_release(pin: Pin, version: str) -> tuple[Path, dict]:
    """Download another release's sdist (hash recorded, not pinned)."""
    files = project_files(pip_index_url(), pin.name)
    sdist_name = f"{pin.name}-{version}.tar.gz"
    if sdist_name not in files:
        raise StackError(f"{sdist_name} is not on the index")
    target = cache_dir() / sdist_name
    if not target.exists():
        download(files[sdist_name], target)
    wheels = {
        name: url
        for name, url in files.items()
        if name.startswith(f"{pin.name}-{version}-") and name.endswith(".whl")
    }
    return target, {"sdist": sdist_name, "wheels": wheels}


def rebase_command(stack: Stack, pin: Pin, args: argparse.Namespace) -> None:
    from k3stack.cli import do_apply, pristine_message

    if (args.write_pin or args.port) and args.to is None:
        option = "--port" if args.port else "--write-pin"
        raise StackError(f"{option} needs --to VERSION (a release)")
    if args.port:
        check_portable(stack, args.tree)  # refused before anything is fetched
    if args.checkout is not None:
        checkout_head(args.checkout)  # refused before the stack is applied
    if args.report.exists() and not args.report.is_dir():
        raise StackError(
            f"rebase: --report {args.report} exists and is not a directory; refused"
        )
    work = Path(tempfile.mkdtemp(prefix="k3stack-rebase-"))
    try:
        tree = work / "tree"
        do_apply(stack, pin, tree, None, None)
        new = work / "new"
        if args.checkout is not None:
            head = export_checkout(args.checkout, new)
            target = f"{args.checkout} at {head[:12]}"
            info: dict = {"checkout": str(args.checkout), "commit": head}
            source = checkout_source(head)
        else:
            sdist, info = fetch_release(pin, args.to)
            extract_sdist(sdist, new)
            source = sdist_source(sdist)
            info["sdist_sha256"] = source["sdist"]["sha256"]
            target = f"{pin.name} {args.to}"
        results = classify(stack, tree, new, f"{target}\n")
        try:
            args.report.mkdir(parents=True, exist_ok=True)
            (args.report / "report.md").write_text(render_report(target, results))
            (args.report / "report.json").write_text(
                json.dumps(
                    {"target": info, "layers": [asdict(r) for r in results]},
                    indent=2,
                    sort_keys=True,
                )
                + "\n"
            )
        except OSError as e:
            raise StackError(f"rebase: cannot write the report: {e}") from e
        for r in results:
            print(f"rebase: layer {r.number} {r.patch}: {r.status}")
            for hunk in r.hunks:
                print(f"rebase:   {hunk}")
        print(f"rebase: report in {args.report}/report.md")
        if args.port:
            refuse_landed_layers(results, target)
        old_pin = PIN_FILE.read_bytes()
        if args.write_pin or args.port:
            write_pin(pin, args.to, new, sdist, info)
            print(f"rebase: pinned {pin.name} {args.to} in {PIN_FILE}")
        if args.port:
            try:
                port_tree(stack, args.tree, new, pristine_message(load_pin()), source)
            except StackError:
                if not _rebase_stopped(args.tree):
                    # Not a conflict: the tree stays as it was, so does the pin.
                    staged = PIN_FILE.with_name(PIN_FILE.name + ".old")
                    staged.write_bytes(old_pin)
                    staged.replace(PIN_FILE)
                raise
            print(
                f"rebase: the {len(stack.layers)} layer commits of {args.tree} are "
                f"on {target}; `nox -s refresh` writes their patches"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def retagged_image(image: str, version: str) -> str:
    """``image`` (``[registry[:port]/]repository[:tag][@digest]``) at tag
    ``v{version}``; its digest names another tag's image and is dropped."""
    name = image.split("@", 1)[0]
    colon = name.rfind(":")
    if colon > name.rfind("/"):
        name = name[:colon]
    return f"{name}:v{version}"


def select_wheels(pin: Pin, version: str, names: Iterable[str]) -> dict[str, str]:
    """The wheel of ``version`` for each architecture ``pin`` has: the only
    one, or among several the one with the pinned wheel's platform tag.
    Raises ``StackError`` where there is none or no single choice."""
    chosen = {}
    for arch, pinned in sorted(pin.wheels.items()):
        found = sorted(n for n in names if n.endswith(f"_{arch}.whl"))
        if not found:
            raise StackError(
                f"no {arch} wheel of {pin.name} {version} on the index: not re-pinning"
            )
        if len(found) > 1:
            tag = pinned.filename.rsplit("-", 1)[-1]
            same = [n for n in found if n.endswith(f"-{tag}")]
            if len(same) != 1:
                raise StackError(
                    f"{len(found)} {arch} wheels of {pin.name} {version} on the "
                    f"index ({', '.join(found)}) and not one with the pinned "
                    f"platform tag {tag}: pin by hand"
                )
            found = same
        chosen[arch] = found[0]
    return chosen


def write_pin(pin: Pin, version: str, tree: Path, sdist: Path, info: dict) -> None:
    """Re-pin to ``version``: hashes of its sdist and wheels (one per pinned
    architecture), commit from the sdist; the new file is checked before it
    replaces the old one."""
    version_file = tree / pin.name / "_version.py"
    match = re.search(r"commit_id = '(?:g)?([0-9a-f]+)'", version_file.read_text())
    if not match:
        raise StackError(f"{version_file}: no commit id")
    wheels = {}
    for arch, name in select_wheels(pin, version, info["wheels"]).items():
        target = cache_dir() / name
        if not target.exists():
            download(info["wheels"][name], target)
        wheels[arch] = (name, target.stat().st_size, sha256_file(target))
    lines = [
        "# The pinned upstream release the patch stack applies to. The tooling refuses",
        "# any input whose sha256 differs from these values.",
        "",
        "[upstream]",
        f'name = "{pin.name}"',
        f'version = "{version}"',
        f'commit = "{match.group(1)[:9]}"',
        "",
        "[upstream.sdist]",
        f'filename = "{sdist.name}"',
        f"size = {sdist.stat().st_size}",
        f'sha256 = "{sha256_file(sdist)}"',
    ]
    for arch, (name, size, sha) in sorted(wheels.items()):
        lines += [
            "",
            f"[upstream.wheels.{arch}]",
            f'filename = "{name}"',
            f"size = {size}",
            f'sha256 = "{sha}"',
        ]
    base = retagged_image(pin.base_image, version)
    if "@" in pin.base_image:
        print(f"rebase: the base image was pinned by digest; pin {base} by its digest")
    lines += [
        "",
        "[image]",
        "# The official image of the same release; the stack "
        "adds one small layer on it.",
        f'base = "{base}"',
        "",
    ]
    staged = PIN_FILE.with_name(PIN_FILE.name + ".new")
    staged.write_text("\n".join(lines))
    try:
        load_pin(staged)
    except StackError:
        staged.unlink()
        raise
    staged.replace(PIN_FILE)
