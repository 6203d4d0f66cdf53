# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""apply lays out the stack as commits; refresh takes them back exactly."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import UPSTREAM_FILES, Synthetic, make_sdist

from k3stack import StackError
from k3stack.gitutil import git
from k3stack.patchfile import FilePatch, HunkMismatch, apply_exact, parse_diff
from k3stack.refresh import refresh
from k3stack.worktree import MARKER, current_marker, write_marker


def snapshot(syn: Synthetic) -> dict[str, bytes]:
    return {
        p.relative_to(syn.root).as_posix(): p.read_bytes()
        for d in ("patches", "overlay")
        for p in sorted((syn.root / d).rglob("*"))
        if p.is_file()
    }


def amend_with(syn: Synthetic, n: int, edit: Callable[[Path], None]) -> None:
    """Change layer ``n``'s commit by ``edit(tree)``, every change staged
    (modes and symlinks too, which ``Synthetic.amend`` does not write)."""
    git(syn.tree, "checkout", "-q", f"layer-{n}")
    edit(syn.tree)
    git(syn.tree, "add", "-A")
    git(syn.tree, "commit", "-q", "--amend", "--no-edit")
    git(syn.tree, "rebase", "-q", "--onto", "HEAD", f"layer-{n}", "main")


def test_a_checkout_made_with_core_autocrlf_holds_the_stack_byte_for_byte(
    tmp_path: Path,
) -> None:
    """A clone under ``core.autocrlf=true`` (a Windows-style git set-up):
    the patches, overlay and image inputs must reach apply and build as
    committed, not with CRLF line ends (apply then failed on the patches'
    headers, and the wheel would differ)."""
    import shutil
    import subprocess

    from k3stack.series import load_stack

    root = Path(__file__).resolve().parents[2]
    inputs = ["patches", "overlay", "build/Dockerfile", "build/k3stack/install.py"]
    repo = tmp_path / "repo"
    for rel in [".gitattributes", *inputs]:
        source, target = root / rel, repo / rel
        if source.is_dir():
            shutil.copytree(source, target)
        elif source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "stack")
    clone = tmp_path / "clone"
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(
        ["git", "-c", "core.autocrlf=true", "clone", "-q", str(repo), str(clone)],
        env=env,
        check=True,
    )
    files = sorted(
        p.relative_to(repo)
        for p in repo.rglob("*")
        if p.is_file() and ".git" not in p.parts
    )
    assert {str(rel): (clone / rel).read_bytes() for rel in files} == {
        str(rel): (repo / rel).read_bytes() for rel in files
    }
    assert load_stack(clone).stack_hash() == load_stack(repo).stack_hash()


def test_the_tooling_on_a_python_older_than_3_11_says_so_in_one_line() -> None:
    """``python3 -m nox -s apply build`` where python3 is 3.10 (Ubuntu 22.04's):
    one line naming the Python it needs, not a traceback from an import."""
    import subprocess
    import sys

    build_dir = Path(__file__).resolve().parents[2] / "build"
    as_310 = (
        "import runpy, sys; sys.version_info = (3, 10, 13, 'final', 0); "
        "runpy.run_module('k3stack', run_name='__main__')"
    )
    # An --upto no series has: refused at once, should the check not come first.
    child = subprocess.run(
        [sys.executable, "-c", as_310, "apply", "--upto", "999"],
        env={**os.environ, "PYTHONPATH": str(build_dir)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert child.returncode == 1
    assert child.stderr.count("\n") == 1, child.stderr
    assert "Python 3.11.4 or later" in child.stderr
    assert "3.10.13" in child.stderr


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_the_applied_tree_follows_the_umask_as_its_files_do(
    filled: Synthetic, umask: int
) -> None:
    """A group's shared box (umask 002): the tree's own folder must not be
    private (its staging folder's 0700) while every file in it is shared."""
    old = os.umask(umask)
    try:
        filled.apply()
    finally:
        os.umask(old)
    modes = {
        oct(p.stat().st_mode & 0o777)
        for p in [filled.tree, filled.tree / "vllm", filled.tree / ".git"]
    }
    assert modes == {oct(0o777 & ~umask)}


def test_apply_commits_pristine_then_one_commit_per_layer(filled: Synthetic) -> None:
    filled.apply()
    log = git(filled.tree, "log", "--format=%s", "--reverse").splitlines()
    assert log == ["vllm 1.0 pristine", "Layer 1", "Layer 2", "Layer 3"]
    assert (filled.tree / "vllm/remote/__init__.py").read_text() == "PORT = 1\n"
    assert "SETTING_5 = 55\n" in (filled.tree / "vllm/envs.py").read_text()
    assert git(filled.tree, "tag", "--points-at", "HEAD~3") == "upstream"


def test_apply_upto_stops_after_that_layer(filled: Synthetic) -> None:
    filled.apply(upto=1)
    assert git(filled.tree, "log", "-1", "--format=%s") == "Layer 1"
    assert not (filled.tree / "vllm/logits.py").exists()


def test_refresh_right_after_apply_changes_nothing(filled: Synthetic) -> None:
    filled.apply()
    before = snapshot(filled)
    assert refresh(filled.stack(), filled.tree) == []
    assert snapshot(filled) == before


def test_refresh_after_an_apply_under_the_callers_git_template_changes_nothing(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A template whose hook signs off every commit message (as a company's
    # template or a `git init` wrapper's): the layer commits must still say
    # what the patches say, or refresh rewrites every patch and build refuses
    # the tree's pristine commit.
    hooks = tmp_path / "template" / "hooks"
    hooks.mkdir(parents=True)
    hook = hooks / "prepare-commit-msg"
    hook.write_text('#!/bin/sh\necho "Signed-off-by: ci <ci@example>" >> "$1"\n')
    hook.chmod(0o755)
    monkeypatch.setenv("GIT_TEMPLATE_DIR", str(tmp_path / "template"))
    filled.apply()
    before = snapshot(filled)
    assert refresh(filled.stack(), filled.tree) == []
    assert snapshot(filled) == before
    log = git(filled.tree, "log", "--format=%B", "upstream").strip()
    assert log == "vllm 1.0 pristine"


def test_refresh_after_apply_keeps_a_patch_with_git_s_short_index_lines(
    filled: Synthetic,
) -> None:
    # `git format-patch` without --full-index abbreviates the blob ids: the
    # layer is the same, so refresh leaves the file as it is.
    patch = filled.root / "patches" / "0001-layer-1.patch"
    short = re.sub(
        rb"(?m)^index ([0-9a-f]{7})[0-9a-f]{33}\.\.([0-9a-f]{7})[0-9a-f]{33}",
        rb"index \1..\2",
        patch.read_bytes(),
    )
    assert short != patch.read_bytes()
    patch.write_bytes(short)
    git(filled.root, "commit", "-qam", "short index lines")
    filled.apply()
    before = snapshot(filled)
    assert refresh(filled.stack(), filled.tree) == []
    assert snapshot(filled) == before


def test_refresh_takes_an_edit_into_its_own_layer_only(filled: Synthetic) -> None:
    filled.apply()
    before = snapshot(filled)
    filled.amend(2, {"vllm/logits.py": "TOPK = 16\n"})
    changed = refresh(filled.stack(), filled.tree, today=dt.date(2026, 12, 1))
    after = snapshot(filled)
    assert changed == [
        "overlay/vllm/logits.py: updated",
        "patches/0002-layer-2.patch: updated",
    ]
    assert after["overlay/vllm/logits.py"] == b"TOPK = 16\n"
    assert b"Last-Update: 2026-12-01" in after["patches/0002-layer-2.patch"]
    for untouched in ("patches/0001-layer-1.patch", "patches/0003-layer-3.patch"):
        assert after[untouched] == before[untouched]


def test_refresh_gives_a_new_file_to_the_layer_that_added_it(filled: Synthetic) -> None:
    filled.apply()
    filled.amend(3, {"vllm/deferred.py": "ON = True\n"})
    refresh(filled.stack(), filled.tree)
    assert filled.stack().layer(3).patch.overlay == ["vllm/deferred.py"]
    assert (filled.root / "overlay/vllm/deferred.py").read_text() == "ON = True\n"


def test_refresh_moves_an_overlay_file_to_a_lower_layer(filled: Synthetic) -> None:
    filled.apply()
    filled.amend(1, {"vllm/logits.py": "TOPK = 64\n"})
    refresh(filled.stack(), filled.tree)
    stack = filled.stack()
    assert "vllm/logits.py" in stack.layer(1).patch.overlay
    assert "vllm/logits.py" not in stack.layer(2).patch.overlay
    assert (filled.root / "overlay/vllm/logits.py").read_text() == "TOPK = 64\n"


@pytest.mark.parametrize(
    "setting",
    [
        "GIT_DIFF_OPTS=-u6",
        "GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=diff.noprefix GIT_CONFIG_VALUE_0=true",
        "GIT_CONFIG_PARAMETERS='diff.noprefix'='true'",
        "tree config diff.noprefix=true",
        "tree config diff.suppressBlankEmpty=true",
    ],
)
def test_refresh_writes_the_same_patch_whatever_the_callers_git_settings(
    synthetic: Synthetic, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    model = UPSTREAM_FILES["vllm/model.py"].replace("return 20\n", "return 2000\n")
    synthetic.amend(2, {"vllm/model.py": model})
    if setting.startswith("tree config "):
        key, value = setting.removeprefix("tree config ").split("=")
        git(synthetic.tree, "config", key, value)
    else:
        for assignment in setting.split():
            monkeypatch.setenv(*assignment.split("=", 1))
    refresh(synthetic.stack(), synthetic.tree)
    patch = (synthetic.root / "patches/0002-layer-2.patch").read_text()
    assert "--- a/vllm/model.py\n+++ b/vllm/model.py\n@@ -59,7 +59,7 @@" in patch


def test_refresh_refuses_a_layer_that_edits_a_lower_layers_file(
    filled: Synthetic,
) -> None:
    filled.apply()
    filled.amend(3, {"vllm/logits.py": "TOPK = 1\n"})
    with pytest.raises(StackError, match="lower layer owns"):
        refresh(filled.stack(), filled.tree)


def test_apply_refuses_a_tree_with_uncommitted_edits_and_keeps_them(
    filled: Synthetic,
) -> None:
    (filled.tree / "vllm/envs.py").write_text("edited\n")
    with pytest.raises(StackError, match="uncommitted edits"):
        filled.apply()
    assert (filled.tree / "vllm/envs.py").read_text() == "edited\n"


def test_build_input_is_refused_while_the_tree_has_uncommitted_edits(
    filled: Synthetic,
) -> None:
    filled.apply()
    (filled.tree / "vllm/envs.py").write_text("edited\n")
    with pytest.raises(StackError, match="uncommitted edits"):
        current_marker(filled.stack(), filled.tree)
    assert (filled.tree / "vllm/envs.py").read_text() == "edited\n"


def test_apply_refuses_a_tree_path_that_is_a_file(filled: Synthetic) -> None:
    filled.tree = filled.tree.parent / "a-file"
    filled.tree.write_text("not a tree\n")
    with pytest.raises(StackError, match="exists and is not a directory"):
        filled.apply()
    assert filled.tree.read_text() == "not a tree\n"


@pytest.mark.parametrize(
    ("upstream", "message"),
    [
        (
            {"vllm/remote": "x\n"},
            "layer 1 (0001-layer-1.patch) does not apply: overlay file "
            "vllm/remote/__init__.py goes where upstream has the file vllm/remote",
        ),
        (
            {"vllm/logits.py/__init__.py": "x\n"},
            "layer 2 (0002-layer-2.patch) does not apply: overlay file "
            "vllm/logits.py goes where upstream has the folder vllm/logits.py",
        ),
    ],
)
def test_apply_refuses_an_overlay_file_where_upstream_has_a_file_or_folder(
    filled: Synthetic, tmp_path: Path, upstream: dict[str, str], message: str
) -> None:
    sdist = make_sdist(tmp_path / "other.tar.gz", dict(UPSTREAM_FILES, **upstream))
    with pytest.raises(StackError) as info:
        filled.apply(sdist=sdist)
    assert str(info.value) == message


def test_a_binary_change_is_refused_with_its_reason() -> None:
    diff = (
        b"diff --git a/vllm/logo.png b/vllm/logo.png\n"
        b"index 1111111..2222222 100644\n"
        b"Binary files a/vllm/logo.png and b/vllm/logo.png differ\n"
    )
    with pytest.raises(StackError, match="binary changes to upstream files"):
        parse_diff(diff, "0001-x.patch")


def test_apply_refuses_a_tree_with_commits_not_yet_refreshed(filled: Synthetic) -> None:
    filled.amend(1, {"vllm/envs.py": "changed\n"})
    head = git(filled.tree, "rev-parse", "HEAD")
    with pytest.raises(StackError, match="refresh"):
        filled.apply()
    assert git(filled.tree, "rev-parse", "HEAD") == head


@pytest.mark.parametrize("kind", ["stash", "branch"])
def test_apply_refuses_a_tree_with_a_stash_or_branch_and_keeps_it(
    filled: Synthetic, kind: str
) -> None:
    (filled.tree / "vllm/envs.py").write_text("work in progress\n")
    if kind == "stash":
        git(filled.tree, "stash", "-q")
    else:
        git(filled.tree, "checkout", "-q", "-b", "experiment")
        git(filled.tree, "commit", "-qam", "experiment")
        git(filled.tree, "checkout", "-q", "main")
    with pytest.raises(StackError, match="stash, branch or tag"):
        filled.apply()
    ref = "refs/stash" if kind == "stash" else "refs/heads/experiment"
    assert git(filled.tree, "rev-parse", "--verify", "-q", ref)


def test_files_the_sdist_ignores_are_committed_and_guarded(
    filled: Synthetic,
) -> None:
    # The sdist's own .gitignore must not hide its files from the pristine
    # commit (or their edits from apply's guard).
    ignored = filled.tree / "vllm/_version.py"
    assert git(filled.tree, "ls-files", "vllm/_version.py") == "vllm/_version.py"
    ignored.write_text("edited\n")
    with pytest.raises(StackError, match="uncommitted edits"):
        filled.apply()
    assert ignored.read_text() == "edited\n"


def test_apply_refuses_a_tree_with_a_new_file_its_gitignore_matches_and_keeps_it(
    filled: Synthetic,
) -> None:
    table = filled.tree / "vllm/capabilities/h200.csv"
    table.parent.mkdir()
    table.write_text("batch,ms\n")
    with pytest.raises(StackError, match="uncommitted edits .*h200.csv"):
        filled.apply()
    assert table.read_text() == "batch,ms\n"


def test_apply_replaces_a_tree_that_holds_only_new_bytecode_caches(
    filled: Synthetic,
) -> None:
    cache = filled.tree / "vllm/__pycache__/model.cpython-312.pyc"
    cache.parent.mkdir()
    cache.write_bytes(b"bytecode")
    filled.apply()
    assert not cache.exists()


def test_apply_replaces_a_tree_that_holds_only_ignored_tool_and_editor_files(
    filled: Synthetic,
) -> None:
    state = ["build/lib/vllm/model.py", ".pytest_cache/README.md", "vllm/.model.py.swp"]
    for rel in state:
        (filled.tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (filled.tree / rel).write_text("state\n")
    filled.apply()
    assert not any((filled.tree / rel).exists() for rel in state)


def test_refresh_refuses_a_new_file_that_a_plain_git_add_skipped(
    filled: Synthetic,
) -> None:
    filled.apply()
    table = filled.tree / "vllm/remote/h200.csv"
    table.write_text("batch,ms\n")
    git(filled.tree, "add", "-A")
    before = snapshot(filled)
    with pytest.raises(StackError, match="uncommitted edits .*h200.csv"):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def test_refresh_refuses_uncommitted_edits_and_keeps_them(filled: Synthetic) -> None:
    filled.apply()
    (filled.tree / "vllm/model.py").write_text("half-done\n")
    before = snapshot(filled)
    with pytest.raises(StackError, match="uncommitted edits"):
        refresh(filled.stack(), filled.tree)
    assert (filled.tree / "vllm/model.py").read_text() == "half-done\n"
    assert snapshot(filled) == before


def test_refresh_refuses_extra_commits_until_squashed(filled: Synthetic) -> None:
    filled.apply()
    (filled.tree / "vllm/model.py").write_text("fixup\n")
    git(filled.tree, "commit", "-qam", "fixup! Layer 2")
    with pytest.raises(StackError, match="squash"):
        refresh(filled.stack(), filled.tree)


def test_a_layer_that_would_need_fuzz_names_layer_file_and_hunk(
    filled: Synthetic, tmp_path
) -> None:
    from conftest import make_sdist

    shifted = dict(UPSTREAM_FILES)
    shifted["vllm/model.py"] = "# a new first line\n" + shifted["vllm/model.py"]
    sdist = make_sdist(tmp_path / "shifted.tar.gz", shifted)
    with pytest.raises(StackError) as info:
        filled.apply(sdist=sdist)
    message = str(info.value)
    assert "layer 2 (0002-layer-2.patch) does not apply" in message
    assert "vllm/model.py hunk 1 (@@ -59,7 +59,7 @@" in message


def test_a_hand_edited_hunk_whose_new_position_drifted_is_refused_in_one_line(
    filled: Synthetic,
) -> None:
    patch = filled.root / "patches" / "0002-layer-2.patch"
    text = patch.read_text()
    assert text.count("@@ -59,7 +59,7 @@") == 1
    # The hunk still matches where it says; only the position it gives the
    # result has drifted by a line, as a careless hand edit leaves it.
    patch.write_text(text.replace("@@ -59,7 +59,7 @@", "@@ -59,7 +60,7 @@"))
    with pytest.raises(StackError) as info:
        filled.apply()
    assert str(info.value) == (
        "layer 2 (0002-layer-2.patch) does not apply: vllm/model.py hunk 1 "
        "(@@ -59,7 +60,7 @@ def step_19():): new position drifts from the old one"
    )


def test_a_hunk_made_at_end_of_file_is_refused_where_upstream_goes_on_after_it(
    synthetic: Synthetic, tmp_path
) -> None:
    from conftest import make_sdist

    envs = UPSTREAM_FILES["vllm/envs.py"] + "K3_SETTING = 1\n"
    synthetic.amend(1, {"vllm/envs.py": envs})
    refresh(synthetic.stack(), synthetic.tree)
    grown = dict(UPSTREAM_FILES)
    grown["vllm/envs.py"] += "def upstream_tail():\n    return 41\n"
    with pytest.raises(StackError) as info:
        synthetic.apply(sdist=make_sdist(tmp_path / "grown.tar.gz", grown))
    assert str(info.value) == (
        "layer 1 (0001-layer-1.patch) does not apply: vllm/envs.py hunk 1 "
        "(@@ -38,3 +38,4 @@ SETTING_36 = 36): must end at end of file; the file "
        "has 2 more lines"
    )


def test_a_hunk_for_an_empty_file_is_refused_on_a_non_empty_one() -> None:
    diff = (
        b"diff --git a/f b/f\nindex e69de29..4bcfe98 100644\n--- a/f\n+++ b/f\n"
        b"@@ -0,0 +1 @@\n+new\n"
    )
    (patch,) = parse_diff(diff, "test")
    assert apply_exact(b"", patch) == b"new\n"
    with pytest.raises(HunkMismatch, match="must end at end of file"):
        apply_exact(b"upstream code\n", patch)


def test_a_failed_apply_leaves_the_existing_tree_as_it_was(
    filled: Synthetic, tmp_path
) -> None:
    from conftest import make_sdist

    filled.apply()
    head = git(filled.tree, "rev-parse", "HEAD")
    broken = dict(UPSTREAM_FILES, **{"vllm/envs.py": "SETTING_5 = 7\n"})
    with pytest.raises(StackError, match="layer 1"):
        filled.apply(sdist=make_sdist(tmp_path / "broken.tar.gz", broken))
    assert git(filled.tree, "rev-parse", "HEAD") == head


def test_apply_on_a_python_without_tar_filters_is_refused_naming_the_version(
    filled: Synthetic, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tarfile

    head = git(filled.tree, "rev-parse", "HEAD")
    monkeypatch.delattr(tarfile, "data_filter")
    with pytest.raises(StackError, match="Python 3.11.4 or later"):
        filled.apply()
    assert git(filled.tree, "rev-parse", "HEAD") == head


def test_apply_without_git_on_path_says_git_is_needed(
    filled: Synthetic, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-git"))
    with pytest.raises(StackError, match="git is not on PATH"):
        filled.apply()


def second_tree(syn: Synthetic) -> Synthetic:
    other = Synthetic(syn.root, syn.sdist, syn.wheel, syn.pin, syn.tree.with_name("b"))
    other.apply()
    return other


def test_refresh_of_another_layer_keeps_a_refresh_made_since_apply(
    filled: Synthetic,
) -> None:
    filled.apply()
    other = second_tree(filled)
    filled.amend(1, {"vllm/remote/__init__.py": "PORT = 2\n"})
    refresh(filled.stack(), filled.tree)
    git(filled.root, "commit", "-qam", "layer 1 refreshed")
    other.amend(2, {"vllm/logits.py": "TOPK = 8\n"})
    changed = refresh(other.stack(), other.tree)
    assert "overlay/vllm/logits.py: updated" in changed
    assert not [c for c in changed if "layer-1" in c or "remote" in c]
    assert (filled.root / "overlay/vllm/remote/__init__.py").read_text() == "PORT = 2\n"


def test_a_second_refresh_keeps_a_change_committed_to_the_checkout_since_apply(
    filled: Synthetic,
) -> None:
    filled.apply()
    (filled.root / "overlay/vllm/logits.py").write_text("TOPK = 5\n")
    git(filled.root, "commit", "-qam", "edited in the checkout")
    assert refresh(filled.stack(), filled.tree) == []
    assert refresh(filled.stack(), filled.tree) == []
    assert (filled.root / "overlay/vllm/logits.py").read_text() == "TOPK = 5\n"


def test_build_input_is_refused_when_the_checkout_changed_since_apply(
    filled: Synthetic,
) -> None:
    filled.apply()
    assert current_marker(filled.stack(), filled.tree)["layers"] == 3
    (filled.root / "overlay/vllm/logits.py").write_text("TOPK = 5\n")
    git(filled.root, "commit", "-qam", "edited in the checkout")
    with pytest.raises(StackError, match="layer 2 .* as it was applied"):
        current_marker(filled.stack(), filled.tree)


def test_refresh_refuses_reordered_layer_commits_and_writes_nothing(
    filled: Synthetic, monkeypatch: pytest.MonkeyPatch
) -> None:
    filled.apply()
    before = snapshot(filled)
    monkeypatch.setenv("GIT_SEQUENCE_EDITOR", "sed -i -e '2{h;d}' -e '3G'")
    git(filled.tree, "rebase", "-q", "-i", "upstream")
    log = git(filled.tree, "log", "--format=%s", "--reverse", "upstream..")
    assert log.splitlines() == ["Layer 1", "Layer 3", "Layer 2"]
    with pytest.raises(StackError, match="commit 2 .* is layer 3 .* another order"):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def test_refresh_refuses_to_overwrite_a_layer_changed_since_apply(
    filled: Synthetic,
) -> None:
    filled.apply()
    other = second_tree(filled)
    filled.amend(1, {"vllm/remote/__init__.py": "PORT = 2\n"})
    refresh(filled.stack(), filled.tree)
    git(filled.root, "commit", "-qam", "layer 1 refreshed")
    other.amend(1, {"vllm/remote/__init__.py": "PORT = 3\n"})
    with pytest.raises(StackError, match="changed since .* was applied"):
        refresh(other.stack(), other.tree)
    assert (filled.root / "overlay/vllm/remote/__init__.py").read_text() == "PORT = 2\n"


def test_refresh_refuses_to_overwrite_uncommitted_edits_in_the_checkout(
    filled: Synthetic,
) -> None:
    filled.apply()
    (filled.root / "overlay/vllm/logits.py").write_text("TOPK = 7  # unsaved\n")
    filled.amend(2, {"vllm/logits.py": "TOPK = 16\n"})
    with pytest.raises(StackError, match="uncommitted edits in this checkout"):
        refresh(filled.stack(), filled.tree)
    assert (filled.root / "overlay/vllm/logits.py").read_text() == (
        "TOPK = 7  # unsaved\n"
    )


def test_a_fixup_squashed_into_its_layer_is_refreshed_and_tags_follow(
    filled: Synthetic, monkeypatch: pytest.MonkeyPatch
) -> None:
    filled.apply()
    (filled.tree / "vllm/logits.py").write_text("TOPK = 32\n")
    git(filled.tree, "commit", "-qam", "fixup! Layer 2")
    monkeypatch.setenv("GIT_SEQUENCE_EDITOR", "true")
    git(filled.tree, "rebase", "-q", "-i", "--autosquash", "upstream")
    changed = refresh(filled.stack(), filled.tree)
    assert "overlay/vllm/logits.py: updated" in changed
    assert git(filled.tree, "rev-parse", "layer-2") == git(
        filled.tree, "rev-parse", "HEAD~1"
    )


def test_refresh_refuses_a_series_shorter_than_the_tree_in_one_line(
    filled: Synthetic,
) -> None:
    filled.apply()
    series = filled.root / "patches/series"
    series.write_text(series.read_text().replace("0003-layer-3.patch\n", ""))
    (filled.root / "patches/0003-layer-3.patch").unlink()
    before = snapshot(filled)
    with pytest.raises(StackError, match="holds 3 layers, patches/series lists 2"):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def test_refresh_refuses_a_layer_that_changes_a_file_the_wheel_does_not_ship(
    filled: Synthetic,
) -> None:
    filled.apply()
    before = snapshot(filled)
    pyproject = UPSTREAM_FILES["pyproject.toml"] + "dependencies = ['pyzmq>=99']\n"
    filled.amend(1, {"pyproject.toml": pyproject})
    message = "0001-layer-1.patch: the diff changes pyproject.toml, which is neither"
    with pytest.raises(StackError, match=message):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def test_refresh_takes_a_new_file_with_a_non_ascii_name_under_that_name(
    filled: Synthetic,
) -> None:
    filled.apply()
    filled.amend(3, {"vllm/café.py": "MENU = 1\n"})
    assert refresh(filled.stack(), filled.tree)[0] == "overlay/vllm/café.py: added"
    assert filled.stack().layer(3).patch.overlay == ["vllm/café.py"]
    assert (filled.root / "overlay/vllm/café.py").read_text() == "MENU = 1\n"


def test_refresh_refuses_a_new_file_whose_name_has_a_space_naming_it(
    filled: Synthetic,
) -> None:
    filled.apply()
    before = snapshot(filled)
    filled.amend(3, {"vllm/my notes.py": "X = 1\n"})
    with pytest.raises(StackError, match="adds 'vllm/my notes.py': the Overlay"):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def test_refresh_refuses_a_symlink_in_a_layer_commit_and_writes_nothing(
    filled: Synthetic,
) -> None:
    filled.apply()
    before = snapshot(filled)
    amend_with(filled, 2, lambda tree: (tree / "vllm/alias.py").symlink_to("logits.py"))
    with pytest.raises(StackError, match="makes vllm/alias.py a symlink; refused"):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def test_refresh_refuses_an_overlay_file_made_executable_and_writes_nothing(
    filled: Synthetic,
) -> None:
    filled.apply()
    before = snapshot(filled)
    amend_with(filled, 2, lambda tree: (tree / "vllm/logits.py").chmod(0o755))
    with pytest.raises(StackError, match="makes vllm/logits.py executable; refused"):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def test_refresh_refuses_a_mode_change_of_an_upstream_file_naming_it(
    filled: Synthetic,
) -> None:
    filled.apply()
    amend_with(filled, 2, lambda tree: (tree / "vllm/model.py").chmod(0o755))
    with pytest.raises(StackError) as info:
        refresh(filled.stack(), filled.tree)
    assert "changes the mode of upstream file vllm/model.py" in str(info.value)
    assert "overlay" not in str(info.value)


@pytest.mark.parametrize(
    "more",
    [" More detail.  \t\n", " .\n More detail.\n"],
    ids=["line with trailing blanks", "paragraph break"],
)
def test_refresh_after_apply_keeps_the_description_as_written(
    filled: Synthetic, more: str
) -> None:
    patch = filled.root / "patches/0001-layer-1.patch"
    text = patch.read_text().replace(
        "Description: Layer 1.\n", f"Description: Layer 1.\n{more}"
    )
    patch.write_text(text)
    filled.apply()
    assert refresh(filled.stack(), filled.tree) == []
    assert patch.read_text() == text


def test_apply_upto_out_of_range_is_refused_before_fetching(
    synthetic: Synthetic,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from k3stack import cli

    def no_fetch(*args: object) -> None:
        raise AssertionError("fetched")

    monkeypatch.setattr(cli, "ROOT", synthetic.root)
    monkeypatch.setattr(cli, "load_pin", lambda: synthetic.pin)
    monkeypatch.setattr(cli, "fetch", no_fetch)
    assert cli.main(["apply", "--upto", "9", "--tree", str(synthetic.tree)]) == 1
    assert capsys.readouterr().err == "error: --upto 9: the series has 3 layers\n"


def test_apply_refuses_a_tree_whose_parent_is_a_file_in_one_line(
    filled: Synthetic,
) -> None:
    parent = filled.tree.parent / "a-file"
    parent.write_text("not a folder\n")
    filled.tree = parent / "tree"
    with pytest.raises(StackError, match=f"apply into {filled.tree} failed: .*"):
        filled.apply()
    assert parent.read_text() == "not a folder\n"


def test_apply_refuses_a_tree_with_an_empty_marker_and_keeps_it(
    filled: Synthetic,
) -> None:
    (filled.tree / ".git/k3stack-applied.json").write_text("")
    head = git(filled.tree, "rev-parse", "HEAD")
    with pytest.raises(StackError, match="k3stack-applied.json is empty or corrupt"):
        filled.apply()
    assert git(filled.tree, "rev-parse", "HEAD") == head


def refresh_failed_before_its_marker(syn: Synthetic) -> str:
    """Amend layer 1's envs.py and refresh it into the checkout, the run
    failing on a stale ref lock after its files, before its marker; the
    amended envs.py."""
    envs = (syn.tree / "vllm/envs.py").read_text().replace("= 7\n", "= 77\n")
    syn.amend(1, {"vllm/envs.py": envs})
    lock = syn.tree / ".git/refs/tags/layer-3.lock"
    lock.write_text("")
    with pytest.raises(StackError, match="git tag -f layer-3 failed"):
        refresh(syn.stack(), syn.tree)
    lock.unlink()
    return envs


def test_refresh_completes_after_a_refresh_that_failed_before_its_marker(
    filled: Synthetic,
) -> None:
    envs = refresh_failed_before_its_marker(filled)
    git(filled.root, "commit", "-qam", "what the failed refresh wrote")
    assert refresh(filled.stack(), filled.tree) == []
    filled.apply()
    assert (filled.tree / "vllm/envs.py").read_text() == envs


def test_build_input_is_accepted_once_refresh_completes_one_failed_before_its_marker(
    filled: Synthetic,
) -> None:
    """The files were written back, the marker was not: the next refresh
    records the layer as the checkout holds it, so build takes the tree."""
    refresh_failed_before_its_marker(filled)
    assert refresh(filled.stack(), filled.tree) == []
    assert current_marker(filled.stack(), filled.tree)["layers"] == 3


def test_refresh_refuses_a_change_below_that_a_layer_not_applied_no_longer_fits(
    filled: Synthetic,
) -> None:
    filled.apply(upto=1)
    model = "# a new first line\n" + (filled.tree / "vllm/model.py").read_text()
    filled.amend(1, {"vllm/model.py": model})
    with pytest.raises(
        StackError,
        match=r"layer 2 \(0002-layer-2.patch\) would no longer apply on the "
        r"refreshed layers below it: vllm/model.py hunk 1 ",
    ):
        refresh(filled.stack(), filled.tree)
    assert git(filled.root, "status", "--porcelain") == ""


def test_refresh_refuses_a_deletion_below_of_a_file_a_layer_not_applied_changes(
    filled: Synthetic,
) -> None:
    filled.apply(upto=1)
    filled.amend(1, {}, delete=("vllm/model.py",))
    with pytest.raises(
        StackError,
        match=r"^layer 2 \(0002-layer-2.patch\) would no longer apply on the "
        r"refreshed layers below it: vllm/model.py does not exist; refused",
    ):
        refresh(filled.stack(), filled.tree)
    assert git(filled.root, "status", "--porcelain") == ""


def test_refresh_refuses_a_marker_with_a_digest_short_in_one_line(
    filled: Synthetic,
) -> None:
    marker = filled.tree / ".git/k3stack-applied.json"
    fields = json.loads(marker.read_text())
    fields["digests"] = fields["digests"][:1]
    marker.write_text(json.dumps(fields))
    with pytest.raises(StackError, match="k3stack-applied.json is empty or corrupt"):
        refresh(filled.stack(), filled.tree)


def test_an_interrupted_marker_write_leaves_the_previous_marker_whole(
    filled: Synthetic, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = filled.tree / ".git/k3stack-applied.json"
    before = marker.read_bytes()

    def torn(path: Path, text: str) -> None:
        with path.open("w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(OSError, match="No space left"):
        write_marker(filled.tree, 3, ["0" * 64] * 3, None)
    assert marker.read_bytes() == before


def killed_apply_staging(syn: Synthetic) -> Path:
    """What SIGKILL during an apply leaves beside the tree: its staging tree."""
    staging = syn.tree.parent / f".{syn.tree.name}.k3stack-apply-killed"
    (staging / "vllm").mkdir(parents=True)
    (staging / "vllm/envs.py").write_text("half laid out\n")
    return staging


def test_apply_removes_the_staging_tree_a_killed_apply_left(filled: Synthetic) -> None:
    staging = killed_apply_staging(filled)
    filled.apply()
    assert not staging.exists()


def test_an_apply_interrupted_while_it_replaces_the_tree_can_be_run_again(
    filled: Synthetic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while apply removes the tree it replaces: the tree must not be
    left half removed, which the next apply refuses as uncommitted edits."""
    import shutil

    filled.apply()
    head = git(filled.tree, "rev-parse", "HEAD")
    remove = shutil.rmtree

    def interrupted(path: Path, *args: object, **kwargs: object) -> None:
        if (Path(path) / ".git" / MARKER).is_file():
            monkeypatch.undo()
            (Path(path) / "vllm" / "envs.py").unlink()  # what it removed so far
            raise KeyboardInterrupt
        remove(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        filled.apply()
    filled.apply()
    assert git(filled.tree, "rev-parse", "HEAD") == head
    assert git(filled.tree, "status", "--porcelain") == ""
    assert sorted(p.name for p in filled.tree.parent.iterdir()) == sorted(
        ["checkout", "tree", ".tree.k3stack-lock", filled.sdist.name, filled.wheel.name]
    )


@contextlib.contextmanager
def held_as_by_a_running_run(folder: Path) -> Iterator[None]:
    """``folder`` locked as the run that stages in it holds it."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_apply_keeps_a_staging_tree_that_a_running_apply_holds(
    filled: Synthetic,
) -> None:
    staging = killed_apply_staging(filled)
    with held_as_by_a_running_run(staging):
        filled.apply()
    assert (staging / "vllm/envs.py").read_text() == "half laid out\n"


def test_refresh_on_a_detached_head_says_so_rather_than_squash(
    filled: Synthetic,
) -> None:
    filled.apply()
    git(filled.tree, "checkout", "-q", "layer-2")
    with pytest.raises(StackError) as info:
        refresh(filled.stack(), filled.tree)
    assert "HEAD is detached; refused: return to branch main" in str(info.value)
    assert "squash" not in str(info.value)


def test_refresh_with_a_layer_commit_dropped_says_it_is_missing(
    filled: Synthetic,
) -> None:
    filled.apply()
    git(filled.tree, "reset", "-q", "--hard", "layer-2")
    with pytest.raises(StackError, match="2 commits .* for 3 layers: layer commits"):
        refresh(filled.stack(), filled.tree)


def test_refresh_after_the_pristine_commit_was_rewritten_says_so(
    filled: Synthetic,
) -> None:
    filled.apply()
    before = snapshot(filled)
    git(filled.tree, "checkout", "-q", "upstream")
    (filled.tree / "pyproject.toml").write_text("[project]\nname = 'edited'\n")
    git(filled.tree, "commit", "-qa", "--amend", "--no-edit")
    git(filled.tree, "rebase", "-q", "--onto", "HEAD", "upstream", "main")
    with pytest.raises(StackError, match="does not descend from the pristine"):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


NAIVE = "".join(f"X_{i} = {i}\n" for i in range(10))


def with_naive_file(syn: Synthetic, tmp_path: Path) -> Path:
    """Apply ``syn`` on an upstream that also has ``vllm/naïve.py`` (a name
    git's diff writes C-quoted: "a/vllm/na\\303\\257ve.py") and make layer 1
    change it; returns that upstream's sdist."""
    files = dict(UPSTREAM_FILES, **{"vllm/naïve.py": NAIVE})
    sdist = make_sdist(tmp_path / "vllm-1.0-naive.tar.gz", files)
    syn.apply(sdist=sdist)
    syn.amend(1, {"vllm/naïve.py": NAIVE.replace("X_5 = 5", "X_5 = 55")})
    return sdist


def test_refresh_and_apply_carry_a_change_to_an_upstream_file_git_quotes(
    filled: Synthetic, tmp_path: Path
) -> None:
    sdist = with_naive_file(filled, tmp_path)
    assert "patches/0001-layer-1.patch: updated" in refresh(
        filled.stack(), filled.tree, today=dt.date(2026, 11, 3)
    )
    assert "vllm/naïve.py" in [fp.path for fp in filled.stack().layer(1).patch.files]
    git(filled.root, "add", "-A")
    git(filled.root, "commit", "-q", "-m", "layer 1 changes naïve.py")
    filled.apply(sdist=sdist)
    assert "X_5 = 55" in git(filled.tree, "show", "layer-1:vllm/naïve.py")


def test_refresh_quotes_file_names_whatever_the_tree_s_quote_path_setting(
    filled: Synthetic, tmp_path: Path
) -> None:
    with_naive_file(filled, tmp_path)
    git(filled.tree, "config", "core.quotePath", "false")
    refresh(filled.stack(), filled.tree, today=dt.date(2026, 11, 3))
    patch = (filled.root / "patches" / "0001-layer-1.patch").read_bytes()
    assert b'diff --git "a/vllm/na\\303\\257ve.py" "b/vllm/na\\303\\257ve.py"' in patch


def test_a_layer_beside_a_line_with_a_bare_cr_round_trips_and_applies_exactly(
    filled: Synthetic, tmp_path: Path
) -> None:
    # Git ends lines at "\n" only: the "\r" inside a line is part of it.
    text = "A = 1\nS = 'x\ry'\nB = 2\n" + "".join(f"X_{i} = {i}\n" for i in range(6))
    sdist = make_sdist(
        tmp_path / "vllm-1.0-cr.tar.gz", dict(UPSTREAM_FILES, **{"vllm/cr.py": text})
    )
    filled.apply(sdist=sdist)
    changed = text.replace("B = 2\n", "B = 3\n")
    filled.amend(1, {"vllm/cr.py": changed})
    assert "patches/0001-layer-1.patch: updated" in refresh(
        filled.stack(), filled.tree, today=dt.date(2026, 11, 3)
    )
    (fp,) = [
        fp for fp in filled.stack().layer(1).patch.files if fp.path == "vllm/cr.py"
    ]
    assert fp.hunks[0].lines[1] == (b" ", b"S = 'x\ry'\n")
    git(filled.root, "add", "-A")
    git(filled.root, "commit", "-q", "-m", "layer 1 changes cr.py")
    filled.apply(sdist=sdist)
    assert (filled.tree / "vllm/cr.py").read_bytes() == changed.encode()
    before = snapshot(filled)
    assert refresh(filled.stack(), filled.tree) == []
    assert snapshot(filled) == before


def one_file(hunks: bytes) -> FilePatch:
    (fp,) = parse_diff(b"diff --git a/f b/f\n--- a/f\n+++ b/f\n" + hunks, "test")
    return fp


TWELVE = b"".join(b"%d\n" % i for i in range(1, 13))


def test_a_later_hunk_is_placed_by_the_lines_earlier_hunks_added() -> None:
    patch = one_file(
        b"@@ -1,6 +1,7 @@\n 1\n 2\n 3\n+x\n 4\n 5\n 6\n"
        b"@@ -9,3 +10,3 @@\n 9\n-10\n+ten\n 11\n"
    )
    expected = TWELVE.replace(b"3\n", b"3\nx\n", 1).replace(b"10\n", b"ten\n")
    assert apply_exact(TWELVE, patch) == expected


def test_hunks_that_overlap_are_refused() -> None:
    patch = one_file(
        b"@@ -1,3 +1,3 @@\n 1\n-2\n+two\n 3\n@@ -2,3 +2,3 @@\n 2\n-3\n+three\n 4\n"
    )
    with pytest.raises(HunkMismatch, match="hunk 2 .*out of range"):
        apply_exact(TWELVE, patch)


def test_a_context_line_that_differs_only_in_trailing_blanks_does_not_match() -> None:
    patch = one_file(b"@@ -1,3 +1,3 @@\n 1\n-2\n+two\n 3\n")
    with pytest.raises(HunkMismatch, match="line 1 does not match exactly"):
        apply_exact(TWELVE.replace(b"1\n", b"1 \n", 1), patch)


def test_a_change_to_a_last_line_without_newline_keeps_it_without() -> None:
    patch = one_file(
        b"@@ -1,2 +1,2 @@\n A = 1\n-B = 2\n\\ No newline at end of file\n"
        b"+B = 3\n\\ No newline at end of file\n"
    )
    assert apply_exact(b"A = 1\nB = 2", patch) == b"A = 1\nB = 3"


def test_a_layer_that_deletes_an_upstream_file_applies_as_that_deletion(
    filled: Synthetic,
) -> None:
    filled.amend(3, {}, delete=("vllm/model.py",))
    filled.take_back("layer 3 deletes model.py", today=dt.date(2026, 11, 3))
    filled.apply()
    assert not (filled.tree / "vllm/model.py").exists()
    assert git(filled.tree, "ls-tree", "layer-3", "vllm/model.py") == ""


def test_apply_upto_0_lays_out_pristine_upstream_only(filled: Synthetic) -> None:
    filled.apply(upto=0)
    assert git(filled.tree, "log", "--format=%s") == "vllm 1.0 pristine"


def test_apply_refuses_an_overlay_file_that_upstream_has(synthetic: Synthetic) -> None:
    patch = synthetic.root / "patches/0002-layer-2.patch"
    patch.write_text(
        patch.read_text().replace("Overlay:\n", "Overlay:\n vllm/envs.py\n")
    )
    (synthetic.root / "overlay/vllm/envs.py").write_text("MINE = 1\n")
    with pytest.raises(StackError) as info:
        synthetic.apply()
    assert str(info.value) == (
        "layer 2 (0002-layer-2.patch): overlay file vllm/envs.py exists upstream; "
        "changes to upstream files belong in the diff"
    )


def test_a_layer_changing_a_file_upstream_lacks_names_layer_and_file(
    filled: Synthetic, tmp_path: Path
) -> None:
    files = {k: v for k, v in UPSTREAM_FILES.items() if k != "vllm/model.py"}
    with pytest.raises(StackError) as info:
        filled.apply(sdist=make_sdist(tmp_path / "lacks.tar.gz", files))
    assert str(info.value) == (
        "layer 2 (0002-layer-2.patch) does not apply: vllm/model.py does not "
        "exist upstream"
    )


def test_apply_refuses_a_folder_with_files_that_is_no_work_tree_and_keeps_it(
    filled: Synthetic,
) -> None:
    filled.tree = filled.tree.parent / "notes"
    (filled.tree / "todo.txt").parent.mkdir()
    (filled.tree / "todo.txt").write_text("mine\n")
    with pytest.raises(StackError, match="exists and is not a stack work tree"):
        filled.apply()
    assert (filled.tree / "todo.txt").read_text() == "mine\n"


def test_apply_from_a_checkout_at_another_commit_is_refused(
    synthetic: Synthetic, tmp_path: Path
) -> None:
    from k3stack.cli import do_apply

    checkout = tmp_path / "upstream"
    for rel, text in UPSTREAM_FILES.items():
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkout / rel).write_text(text)
    git(checkout, "init", "-q")
    git(checkout, "add", "-A", "--force")
    git(checkout, "commit", "-q", "-m", "upstream")
    head = git(checkout, "rev-parse", "HEAD")
    assert not head.startswith(synthetic.pin.commit)
    message = f"is at {head[:12]}, not the pinned upstream commit abc1234"
    with pytest.raises(StackError, match=message):
        do_apply(synthetic.stack(), synthetic.pin, synthetic.tree, None, checkout)


def test_an_sdist_with_two_top_level_folders_is_refused(tmp_path: Path) -> None:
    import io
    import tarfile

    from k3stack.upstream import extract_sdist

    sdist = tmp_path / "two.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("vllm-1.0/pyproject.toml", "extra/notes.txt"):
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    with pytest.raises(StackError, match="two.tar.gz: expected one top-level folder"):
        extract_sdist(sdist, tmp_path / "out")
    assert not list((tmp_path / "out").iterdir())


def test_refresh_refuses_a_merge_commit_on_top_of_upstream(filled: Synthetic) -> None:
    filled.apply()
    before = snapshot(filled)
    git(filled.tree, "checkout", "-q", "-b", "side", "layer-2")
    (filled.tree / "vllm/logits.py").write_text("TOPK = 8\n")
    git(filled.tree, "commit", "-qam", "side")
    git(filled.tree, "checkout", "-q", "main")
    git(filled.tree, "merge", "-q", "--no-ff", "--no-edit", "side")
    git(filled.tree, "branch", "-q", "-D", "side")
    with pytest.raises(StackError, match="merge commits on top of upstream"):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def test_refresh_dates_a_change_to_the_diff_alone_today(filled: Synthetic) -> None:
    filled.apply()
    envs = UPSTREAM_FILES["vllm/envs.py"].replace("SETTING_5 = 5\n", "SETTING_5 = 55\n")
    filled.amend(
        1, {"vllm/envs.py": envs.replace("SETTING_9 = 9\n", "SETTING_9 = 99\n")}
    )
    changed = refresh(filled.stack(), filled.tree, today=dt.date(2026, 12, 1))
    assert changed == ["patches/0001-layer-1.patch: updated"]
    patch = (filled.root / "patches/0001-layer-1.patch").read_text()
    assert "Last-Update: 2026-12-01\n" in patch


def test_refresh_removes_an_overlay_file_its_layer_deleted(filled: Synthetic) -> None:
    filled.apply()
    filled.amend(2, {}, delete=("vllm/logits.py",))
    changed = refresh(filled.stack(), filled.tree, today=dt.date(2026, 12, 1))
    assert "overlay/vllm/logits.py: removed" in changed
    assert not (filled.root / "overlay/vllm/logits.py").exists()
    assert filled.stack().layer(2).patch.overlay == []


def test_a_second_refresh_before_the_first_is_committed_changes_nothing(
    filled: Synthetic,
) -> None:
    # The first refresh dates layer 2 today; the tree's commit keeps its date.
    filled.apply()
    filled.amend(2, {"vllm/logits.py": "TOPK = 16\n"})
    refresh(filled.stack(), filled.tree, today=dt.date(2026, 12, 1))
    before = snapshot(filled)
    assert refresh(filled.stack(), filled.tree, today=dt.date(2026, 12, 2)) == []
    assert snapshot(filled) == before


def test_refresh_after_apply_keeps_an_overlay_list_written_out_of_order(
    synthetic: Synthetic,
) -> None:
    patch = synthetic.root / "patches/0001-layer-1.patch"
    text = patch.read_text().replace("Overlay:\n", "Overlay:\n vllm/b.py\n vllm/a.py\n")
    patch.write_text(text)
    for name in ("a", "b"):
        (synthetic.root / f"overlay/vllm/{name}.py").write_text(f"{name.upper()} = 1\n")
    synthetic.apply()
    assert refresh(synthetic.stack(), synthetic.tree) == []
    assert patch.read_text() == text


def test_refresh_names_only_the_overlay_files_that_changed(filled: Synthetic) -> None:
    filled.apply()
    filled.amend(1, {"vllm/remote/client.py": "TIMEOUT = 5\n"})
    changed = refresh(filled.stack(), filled.tree, today=dt.date(2026, 12, 1))
    assert changed == [
        "overlay/vllm/remote/client.py: added",
        "patches/0001-layer-1.patch: updated",
    ]


def test_validate_refuses_a_suite_path_that_does_not_exist_with_exit_1(
    synthetic: Synthetic,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from k3stack import cli

    monkeypatch.setattr(cli, "ROOT", synthetic.root)
    assert cli.main(["validate"]) == 1
    assert capsys.readouterr().err == (
        "error: 0001-layer-1.patch: Suite path tests/layer1 does not exist\n"
    )


def test_build_refuses_a_tree_with_uncommitted_edits_before_fetching(
    filled: Synthetic,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    from k3stack import cli

    def no_fetch(*args: object) -> None:
        raise AssertionError("fetched")

    monkeypatch.setattr(cli, "ROOT", filled.root)
    monkeypatch.setattr(cli, "load_pin", lambda: filled.pin)
    monkeypatch.setattr(cli, "fetch", no_fetch)
    (filled.tree / "vllm/envs.py").write_text("edited\n")
    argv = ["build", "--tree", str(filled.tree), "--dist", str(tmp_path / "dist")]
    assert cli.main(argv) == 1
    assert "has uncommitted edits" in capsys.readouterr().err
    assert (filled.tree / "vllm/envs.py").read_text() == "edited\n"


def test_an_interrupted_command_says_so_in_one_line_and_exits_130(
    synthetic: Synthetic,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from k3stack import cli

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "ROOT", synthetic.root)
    monkeypatch.setattr(cli, "load_pin", lambda: synthetic.pin)
    monkeypatch.setattr(cli, "fetch", interrupted)
    assert cli.main(["apply", "--tree", str(synthetic.tree)]) == 130
    assert capsys.readouterr().err == "error: apply: interrupted\n"


def laying_out_while(
    syn: Synthetic, edit: Callable[[Path], None]
) -> Callable[[Path], dict]:
    """The sdist lay-out of ``syn``, run while ``edit(tree)`` changes the tree
    apply is about to replace: a maintainer saving a file or committing in a
    second terminal during an apply (tens of seconds on vLLM's sdist)."""
    from k3stack.upstream import from_sdist

    lay_out = from_sdist(syn.sdist)

    def during(folder: Path) -> dict:
        edit(syn.tree)
        return lay_out(folder)

    return during


def test_an_edit_made_in_the_tree_while_apply_runs_is_kept_and_refused(
    filled: Synthetic,
) -> None:
    from k3stack.worktree import build_tree

    head = git(filled.tree, "rev-parse", "HEAD")

    def save(tree: Path) -> None:
        (tree / "vllm/envs.py").write_text("saved during apply\n")

    with pytest.raises(StackError, match=r"tree has uncommitted edits .*vllm/envs.py"):
        build_tree(
            filled.stack(), filled.tree, laying_out_while(filled, save), "vllm 1.0\n"
        )
    assert (filled.tree / "vllm/envs.py").read_text() == "saved during apply\n"
    assert git(filled.tree, "rev-parse", "HEAD") == head
    assert sorted(p.name for p in filled.tree.parent.iterdir()) == sorted(
        ["checkout", "tree", ".tree.k3stack-lock", filled.sdist.name, filled.wheel.name]
    )


def test_a_commit_made_in_the_tree_while_apply_runs_is_kept_and_refused(
    filled: Synthetic,
) -> None:
    from k3stack.worktree import build_tree

    def commit(tree: Path) -> None:
        (tree / "vllm/envs.py").write_text("committed during apply\n")
        git(tree, "commit", "-q", "-a", "--amend", "--no-edit")

    with pytest.raises(StackError, match="commits that are not in patches/ yet"):
        build_tree(
            filled.stack(), filled.tree, laying_out_while(filled, commit), "v 1.0\n"
        )
    assert git(filled.tree, "show", "HEAD:vllm/envs.py") == "committed during apply"


def test_apply_puts_back_the_tree_a_killed_apply_had_moved_aside(
    filled: Synthetic,
) -> None:
    """SIGKILL while apply checks the tree it moved aside: the next apply
    finds no tree, puts the old one back and checks it, edits and all."""
    aside = filled.tree.parent / ".tree.k3stack-aside-killed"
    (filled.tree / "vllm/envs.py").write_text("saved during the killed apply\n")
    filled.tree.rename(aside)
    with pytest.raises(StackError, match="has uncommitted edits"):
        filled.apply()
    assert (filled.tree / "vllm/envs.py").read_text() == (
        "saved during the killed apply\n"
    )
    assert not aside.exists()


def test_apply_removes_the_old_tree_a_killed_apply_left_beside_the_new(
    filled: Synthetic,
) -> None:
    aside = filled.tree.parent / ".tree.k3stack-aside-killed"
    (aside / "vllm").mkdir(parents=True)  # what rmtree had left of it
    filled.apply()
    assert not aside.exists()
    assert git(filled.tree, "status", "--porcelain") == ""


@pytest.mark.parametrize("command", ["apply", "refresh", "build", "site"])
def test_a_second_run_on_a_tree_in_use_is_refused_in_one_line(
    filled: Synthetic,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An engineer runs apply in one terminal and apply (or refresh, build)
    in another: the second is refused at once, the tree left as it is."""
    from k3stack import cli
    from k3stack.worktree import tree_lock

    monkeypatch.setattr(cli, "ROOT", filled.root)
    monkeypatch.setattr(cli, "load_pin", lambda: filled.pin)
    cached = {filled.pin.sdist.filename: filled.sdist, filled.wheel.name: filled.wheel}
    monkeypatch.setattr(cli, "fetch", lambda artifact, _: cached[artifact.filename])
    head = git(filled.tree, "rev-parse", "HEAD")
    argv = [command, "--tree", str(filled.tree)]
    if command == "site":
        argv += ["--dest", str(filled.root / "site")]
    with tree_lock(filled.tree, "apply"):
        assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: {command}: another run of the tooling (apply, refresh, build, "
        f"site or rebase --port) is using {filled.tree}; refused: wait for it to "
        "finish\n"
    )
    assert git(filled.tree, "rev-parse", "HEAD") == head
    assert cli.main(["refresh", "--tree", str(filled.tree)]) == 0  # released


def test_refresh_refuses_a_higher_layers_hunk_that_a_rebase_left_in_a_lower_layer(
    filled: Synthetic,
) -> None:
    """A rebase conflict of layer 1 resolved with the file as the whole stack
    has it: git drops layer 2's hunk as already applied, and layer 1 would
    carry layer 2's hook, which uses layer 2's module."""
    hooked = (
        (filled.tree / "vllm/model.py")
        .read_text()
        .replace(
            "def step_10():\n", "from vllm.logits import TOPK\n\n\ndef step_10():\n"
        )
    )
    filled.amend(2, {"vllm/model.py": hooked})
    filled.take_back("layer 2 hook")
    before = snapshot(filled)
    only_hook = UPSTREAM_FILES["vllm/model.py"].replace(
        "def step_10():\n", "from vllm.logits import TOPK\n\n\ndef step_10():\n"
    )

    def hook(tree: Path) -> None:
        (tree / "vllm/model.py").write_text(only_hook)

    amend_with(filled, 1, hook)
    layer_2 = git(filled.tree, "diff", "HEAD~2", "HEAD~1", "--", "vllm/model.py")
    assert "+from vllm.logits" not in layer_2  # git dropped it: already applied
    with pytest.raises(
        StackError,
        match=r"^0001-layer-1.patch: vllm/model.py hunk 1 \(@@ -28,6 \+28,9 @@ "
        r"def step_8\(\):\) uses "
        r"vllm/logits.py, which layer 2 \(0002-layer-2.patch\) adds",
    ):
        refresh(filled.stack(), filled.tree)
    assert snapshot(filled) == before


def two_layers_changed(syn: Synthetic) -> None:
    """Work in the tree whose refresh changes five checkout files: layer 1
    updates, adds and diffs, layer 2 removes its overlay file."""
    syn.apply()
    envs = (syn.tree / "vllm/envs.py").read_text().replace("= 7\n", "= 77\n")
    syn.amend(
        1,
        {
            "vllm/envs.py": envs,
            "vllm/remote/__init__.py": "PORT = 2\n",
            "vllm/remote/client.py": "TIMEOUT = 5\n",
        },
    )
    syn.amend(2, {}, delete=("vllm/logits.py",))


def refreshed_copy(syn: Synthetic, tmp_path: Path) -> tuple[dict[str, bytes], str]:
    """The files and lines an uninterrupted refresh gives, run on a copy."""
    import shutil

    from k3stack import cli

    copy = Synthetic(
        tmp_path / "copy/checkout", syn.sdist, syn.wheel, syn.pin, syn.tree
    )
    shutil.copytree(syn.root, copy.root, symlinks=True)
    shutil.copytree(syn.tree, tmp_path / "copy/tree", symlinks=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cli, "ROOT", copy.root)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["refresh", "--tree", str(tmp_path / "copy/tree")]) == 0
    return snapshot(copy), out.getvalue()


def stop_at_change(
    m: pytest.MonkeyPatch, syn: Synthetic, k: int, torn: bool = False
) -> None:
    """Ctrl-C at the ``k``-th write into the checkout (after ``torn``: half
    of the file written), as SIGKILL there would stop the run."""
    import shutil

    seen = [0]
    replace, copyfile = os.replace, shutil.copyfile
    write_bytes, unlink = Path.write_bytes, Path.unlink

    def stop(path: object, half: Callable[[], object] | None = None) -> None:
        inside = Path(str(path)).is_relative_to(syn.root)
        if inside and (torn or "refresh-staging-" not in str(path)):
            seen[0] += 1
            if seen[0] == k:
                if torn and half is not None:
                    half()
                raise KeyboardInterrupt

    def replaced(src: str, dst: str) -> None:
        stop(dst)
        replace(src, dst)

    def copied(src: str, dst: str, **kwargs: bool) -> object:
        data = Path(src).read_bytes()
        stop(dst, lambda: write_bytes(Path(dst), data[: len(data) // 2]))
        return copyfile(src, dst, **kwargs)

    def written(path: Path, data: bytes) -> int:
        stop(path, lambda: write_bytes(path, data[: len(data) // 2]))
        return write_bytes(path, data)

    def unlinked(path: Path, missing_ok: bool = False) -> None:
        stop(path)
        unlink(path, missing_ok=missing_ok)

    m.setattr(os, "replace", replaced)
    m.setattr(shutil, "copyfile", copied)
    m.setattr(Path, "write_bytes", written)
    m.setattr(Path, "unlink", unlinked)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_refresh_run_again_after_ctrl_c_or_sigkill_gives_the_uninterrupted_result(
    filled: Synthetic,
    tmp_path: Path,
    k: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Stopped after ``k - 1`` of its five checkout changes, some overlay
    files are new and their patch old: run again, refresh writes the rest
    (no refusal of its own writes as uncommitted edits) and says all five."""
    from k3stack import cli

    two_layers_changed(filled)
    files, lines = refreshed_copy(filled, tmp_path)
    assert lines.endswith("refresh: 5 files changed\n")
    monkeypatch.setattr(cli, "ROOT", filled.root)
    with monkeypatch.context() as m:
        stop_at_change(m, filled, k)
        assert cli.main(["refresh", "--tree", str(filled.tree)]) == 130
    assert capsys.readouterr().err == "error: refresh: interrupted\n"
    assert cli.main(["refresh", "--tree", str(filled.tree)]) == 0
    assert capsys.readouterr().out == lines
    assert snapshot(filled) == files
    assert refresh(filled.stack(), filled.tree) == []


@pytest.mark.parametrize("k", [1, 2, 3])
def test_refresh_stopped_while_writing_a_file_leaves_no_checkout_file_torn(
    filled: Synthetic, tmp_path: Path, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    two_layers_changed(filled)
    before = snapshot(filled)
    files, _ = refreshed_copy(filled, tmp_path)
    with monkeypatch.context() as m:
        stop_at_change(m, filled, k, torn=True)
        with pytest.raises(KeyboardInterrupt):
            refresh(filled.stack(), filled.tree)
    for rel, data in snapshot(filled).items():
        assert data in (before.get(rel), files.get(rel)), rel


def killed_refresh_staging(syn: Synthetic) -> Path:
    """What SIGKILL while refresh stages its files leaves in the checkout."""
    staging = syn.root / ".work" / "refresh-staging-killed"
    staging.mkdir(parents=True)
    (staging / "0").write_text("PORT = ")  # torn: the kill came mid-write
    return staging


def test_refresh_removes_the_staging_folder_a_killed_refresh_left(
    filled: Synthetic,
) -> None:
    two_layers_changed(filled)
    staging = killed_refresh_staging(filled)
    assert len(refresh(filled.stack(), filled.tree)) == 5
    assert not staging.exists()
    assert (filled.root / "overlay/vllm/remote/__init__.py").read_text() == (
        "PORT = 2\n"
    )


def test_a_staging_folder_a_refresh_left_before_its_journal_keeps_no_command_out(
    filled: Synthetic,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Killed while staging, refresh moved nothing: the series is whole and
    validate runs."""
    from k3stack import cli

    killed_refresh_staging(filled)
    for n in (1, 2, 3):
        (filled.root / f"tests/layer{n}").mkdir(parents=True)
    monkeypatch.setattr(cli, "ROOT", filled.root)
    assert cli.main(["validate"]) == 0
    assert capsys.readouterr().err == ""


def test_refresh_keeps_a_staging_folder_that_a_running_refresh_holds(
    filled: Synthetic,
) -> None:
    staging = killed_refresh_staging(filled)
    with held_as_by_a_running_run(staging):
        refresh(filled.stack(), filled.tree)
    assert (staging / "0").read_text() == "PORT = "


def test_a_file_edited_after_an_interrupted_refresh_is_kept_and_refused(
    filled: Synthetic,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C half-way, then a hand edit of a file refresh had not written
    yet: the next refresh does not finish over it."""
    from k3stack import cli

    two_layers_changed(filled)
    monkeypatch.setattr(cli, "ROOT", filled.root)
    with monkeypatch.context() as m:
        stop_at_change(m, filled, 2)
        assert cli.main(["refresh", "--tree", str(filled.tree)]) == 130
    edited = filled.root / "patches/0001-layer-1.patch"
    edited.write_text(edited.read_text().replace("Layer 1.", "Layer one."))
    assert cli.main(["refresh", "--tree", str(filled.tree)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {edited} changed since a refresh was stopped half-way writing "
        "it and other files; refused: stash the changes (git stash -u -- patches "
        "overlay), then run refresh again"
    )
    assert "Description: Layer one." in edited.read_text()


def test_refresh_after_an_interrupted_one_was_reverted_gives_the_uninterrupted_result(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C half-way, then `git checkout` and `git clean` of the checkout:
    refresh writes everything again (the tree holds the layers)."""
    two_layers_changed(filled)
    files, _ = refreshed_copy(filled, tmp_path)
    with monkeypatch.context() as m:
        stop_at_change(m, filled, 3)
        with pytest.raises(KeyboardInterrupt):
            refresh(filled.stack(), filled.tree)
    git(filled.root, "checkout", "--", "patches", "overlay")
    git(filled.root, "clean", "-qfd", "overlay")
    assert len(refresh(filled.stack(), filled.tree)) == 5
    assert snapshot(filled) == files


@pytest.mark.parametrize(
    "argv",
    [
        ["apply", "--tree", "{applied}"],
        ["build", "--tree", "{tree}", "--dist", "{dist}"],
        ["validate"],
        ["qualify", "--out", "{dist}"],
        ["rebase", "--to", "1.0", "--report", "{dist}"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_command_that_reads_the_series_refuses_a_refresh_stopped_half_way(
    filled: Synthetic,
    tmp_path: Path,
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Stopped after two of its five writes, refresh leaves a series of new
    and old patches that applies (or builds) to neither layer set: every
    command but refresh says so in one line and changes nothing."""
    from k3stack import cli

    def no_fetch(*args: object) -> None:
        raise AssertionError("fetched")

    two_layers_changed(filled)
    monkeypatch.setattr(cli, "ROOT", filled.root)
    monkeypatch.setattr(cli, "load_pin", lambda: filled.pin)
    monkeypatch.setattr(cli, "fetch", no_fetch)
    with monkeypatch.context() as m:
        stop_at_change(m, filled, 3)
        assert cli.main(["refresh", "--tree", str(filled.tree)]) == 130
    capsys.readouterr()
    (staging,) = (filled.root / ".work").glob("refresh-staging-*")
    files, head = snapshot(filled), git(filled.tree, "rev-parse", "HEAD")
    paths = {"tree": filled.tree, "applied": tmp_path / "applied"}
    paths["dist"] = tmp_path / "dist"
    assert cli.main([arg.format(**paths) for arg in argv]) == 1
    assert capsys.readouterr().err == (
        f"error: a refresh was stopped half-way writing patches/ and overlay/ "
        f"({staging}): run refresh to finish it, then {argv[0]} again\n"
    )
    assert snapshot(filled) == files
    assert git(filled.tree, "rev-parse", "HEAD") == head
    assert not paths["applied"].exists() and not paths["dist"].exists()
    assert staging.is_dir()


def test_validate_waits_for_a_refresh_that_is_writing_the_series(
    filled: Synthetic,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from k3stack import cli

    two_layers_changed(filled)
    monkeypatch.setattr(cli, "ROOT", filled.root)
    with monkeypatch.context() as m:
        stop_at_change(m, filled, 3)
        assert cli.main(["refresh", "--tree", str(filled.tree)]) == 130
    capsys.readouterr()
    (staging,) = (filled.root / ".work").glob("refresh-staging-*")
    with held_as_by_a_running_run(staging):
        assert cli.main(["validate"]) == 1
    assert capsys.readouterr().err == (
        f"error: a refresh is writing patches/ and overlay/ now ({staging}): "
        "run validate again once it is done\n"
    )


def test_apply_takes_a_refresh_stopped_after_its_last_move(
    filled: Synthetic,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Only the staging folder's removal was left: the series is whole."""
    import shutil

    from k3stack import cli

    def stopped(path: object, *args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    two_layers_changed(filled)
    monkeypatch.setattr(cli, "ROOT", filled.root)
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", stopped)
        assert cli.main(["refresh", "--tree", str(filled.tree)]) == 130
    assert len(list((filled.root / ".work").glob("refresh-staging-*"))) == 1
    files = {filled.sdist.name: filled.sdist}
    monkeypatch.setattr(cli, "load_pin", lambda: filled.pin)
    monkeypatch.setattr(cli, "fetch", lambda artifact, name: files[artifact.filename])
    assert cli.main(["apply", "--tree", str(tmp_path / "applied")]) == 0
    applied = tmp_path / "applied"
    assert git(applied, "ls-files", "-s") == git(filled.tree, "ls-files", "-s")


def test_refresh_called_after_an_interrupted_one_finishes_it_and_says_so(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The function, not the command, run again after Ctrl-C half-way
    through a write-back that leaves the series loadable: it finishes the
    stopped write-back, names every file changed and refreshes from the
    finished series."""
    filled.amend(
        1, {"vllm/remote/__init__.py": "PORT = 2\n", "vllm/remote/client.py": "X = 5\n"}
    )
    files, lines = refreshed_copy(filled, tmp_path)
    with monkeypatch.context() as m:
        stop_at_change(m, filled, 2)
        with pytest.raises(KeyboardInterrupt):
            refresh(filled.stack(), filled.tree)
    changed = refresh(filled.stack(), filled.tree)
    assert [f"refresh: {line}" for line in changed] == lines.splitlines()[:-1]
    assert snapshot(filled) == files
    assert refresh(filled.stack(), filled.tree) == []


def test_apply_keeps_a_tree_moved_aside_when_the_tree_folder_was_made_again(
    filled: Synthetic,
) -> None:
    """SIGKILL after apply moved the tree aside, before it checked it, and the
    tree's folder made again, empty: the next apply refuses, naming the tree
    aside, and deletes none of the work in it."""
    aside = filled.tree.parent / ".tree.k3stack-aside-killed"
    (filled.tree / "vllm/envs.py").write_text("saved during the killed apply\n")
    filled.tree.rename(aside)
    filled.tree.mkdir()
    with pytest.raises(StackError, match=re.escape(str(aside))):
        filled.apply()
    assert (aside / "vllm/envs.py").read_text() == "saved during the killed apply\n"
