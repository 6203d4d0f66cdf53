# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""rebase classifies every layer on another upstream."""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import pytest
from conftest import UPSTREAM_FILES, Synthetic, make_sdist

from k3stack import StackError
from k3stack.gitutil import git
from k3stack.pin import Artifact, Pin
from k3stack.rebase import (
    LayerResult,
    check_portable,
    classify,
    port_tree,
    rebase_command,
    refuse_landed_layers,
    retagged_image,
    select_wheels,
)
from k3stack.upstream import export_checkout, extract_sdist, sdist_source
from k3stack.worktree import MARKER, read_marker


def new_upstream(tmp_path: Path, files: dict[str, str]) -> Path:
    sdist = make_sdist(tmp_path / "vllm-2.0.tar.gz", files, top="vllm-2.0")
    dest = tmp_path / "new"
    extract_sdist(sdist, dest)
    return dest


def v2(tmp_path: Path) -> dict:
    """The input record of ``new_upstream``'s tree."""
    return sdist_source(tmp_path / "vllm-2.0.tar.gz")


def envs_conflicting_with_layer_1() -> dict[str, str]:
    """Upstream files whose envs.py changed the line layer 1 changes."""
    files = dict(UPSTREAM_FILES)
    files["vllm/envs.py"] = files["vllm/envs.py"].replace(
        "SETTING_5 = 5\n", "SETTING_5 = 6\n"
    )
    return files


def layer_1_upstream() -> dict[str, str]:
    """Upstream files that hold layer 1's whole change."""
    files = dict(UPSTREAM_FILES)
    files["vllm/envs.py"] = files["vllm/envs.py"].replace(
        "SETTING_5 = 5\n", "SETTING_5 = 55\n"
    )
    files["vllm/remote/__init__.py"] = "PORT = 1\n"
    return files


def test_rebase_tells_clean_three_way_and_already_upstream_apart(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    files = dict(UPSTREAM_FILES)
    # Layer 2's file moved down: only a three-way merge lands it.
    files["vllm/model.py"] = "# moved\n" * 5 + files["vllm/model.py"]
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert [(r.number, r.status) for r in results] == [
        (1, "clean"),
        (2, "3-way"),
        (3, "clean"),
    ]
    assert results[1].hunks[0].startswith("vllm/model.py hunk 1")


def test_rebase_reports_the_conflicting_files_and_hunks(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    results = classify(
        filled.stack(),
        filled.tree,
        new_upstream(tmp_path, envs_conflicting_with_layer_1()),
        "v2\n",
    )
    assert results[0].status == "conflict"
    assert results[0].files == ["vllm/envs.py"]
    assert any(h.startswith("vllm/envs.py hunk 1") for h in results[0].hunks)
    assert any(h.startswith("vllm/envs.py:") for h in results[0].hunks)
    assert [r.status for r in results[1:]] == ["clean", "clean"]


def test_rebase_counts_conflict_lines_as_git_does_past_a_bare_cr(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    files = envs_conflicting_with_layer_1()
    files["vllm/envs.py"] = "S = 'x\ry'\n" + files["vllm/envs.py"]
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    # Line 7 is SETTING_5's: the "\r" inside line 1 ends no line.
    assert "vllm/envs.py:7-11" in results[0].hunks


def test_rebase_recognises_a_layer_that_is_already_upstream(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, layer_1_upstream()), "v2\n"
    )
    assert results[0].status == "already-upstream"
    assert [r.status for r in results[1:]] == ["clean", "clean"]


@pytest.mark.parametrize(
    "image, expected",
    [
        ("vllm/vllm-openai:v0.33.0", "vllm/vllm-openai:v0.34.0"),
        ("vllm/vllm-openai", "vllm/vllm-openai:v0.34.0"),
        (
            "reg.example:5000/vllm/vllm-openai",
            "reg.example:5000/vllm/vllm-openai:v0.34.0",
        ),
        (
            "reg.example:5000/vllm/vllm-openai:v0.33.0@sha256:" + "ab" * 32,
            "reg.example:5000/vllm/vllm-openai:v0.34.0",
        ),
    ],
)
def test_a_new_pin_retags_the_base_image_and_drops_its_digest(
    image: str, expected: str
) -> None:
    assert retagged_image(image, "0.34.0") == expected


# A pin of the shape of build/pin.toml (not the file: re-pinning it would
# change what these tests mean).
PINNED = Pin(
    name="vllm",
    version="0.33.0",
    commit="4ba787ec9",
    sdist=Artifact("vllm-0.33.0.tar.gz", 1, "00"),
    wheels={
        arch: Artifact(f"vllm-0.33.0-cp38-abi3-manylinux_2_28_{arch}.whl", 1, "00")
        for arch in ("x86_64", "aarch64")
    },
    base_image="vllm/vllm-openai:v0.33.0",
)


def test_a_new_pin_takes_one_wheel_per_pinned_architecture() -> None:
    names = [
        "vllm-0.34.0-cp38-abi3-manylinux_2_31_x86_64.whl",
        "vllm-0.34.0-cp38-abi3-manylinux_2_31_aarch64.whl",
        "vllm-0.34.0-cp38-abi3-macosx_11_0_arm64.whl",
    ]
    assert select_wheels(PINNED, "0.34.0", names) == {
        "aarch64": names[1],
        "x86_64": names[0],
    }


def test_a_release_without_a_pinned_architecture_s_wheel_is_not_pinned() -> None:
    names = ["vllm-0.34.0-cp38-abi3-manylinux_2_31_x86_64.whl"]
    with pytest.raises(StackError, match="no aarch64 wheel of vllm 0.34.0"):
        select_wheels(PINNED, "0.34.0", names)


def test_of_several_wheels_the_pinned_platform_tag_wins() -> None:
    x86 = [
        "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "vllm-0.34.0-cp38-abi3-manylinux_2_31_x86_64.whl",
    ]
    arm = "vllm-0.34.0-cp38-abi3-manylinux_2_28_aarch64.whl"
    assert select_wheels(PINNED, "0.34.0", [*x86, arm])["x86_64"] == x86[0]
    other = "vllm-0.34.0-cp38-abi3-manylinux_2_34_x86_64.whl"
    with pytest.raises(StackError, match="2 x86_64 wheels .* pin by hand"):
        select_wheels(PINNED, "0.34.0", [x86[1], other, arm])


def rebase_args(tmp_path: Path, **given: object) -> argparse.Namespace:
    """The rebase command's arguments: no target, report and tree under
    ``tmp_path``, no re-pin, no port, unless ``given``."""
    args = argparse.Namespace(
        to=None,
        checkout=None,
        report=tmp_path / "report",
        write_pin=False,
        port=False,
        tree=tmp_path / "tree",
    )
    vars(args).update(given)
    return args


def test_write_pin_with_a_checkout_is_refused_before_any_work(tmp_path: Path) -> None:
    args = rebase_args(tmp_path, checkout=tmp_path, write_pin=True)
    # No stack and no pin: refused before either is used.
    with pytest.raises(StackError, match="--write-pin needs --to VERSION"):
        rebase_command(None, None, args)  # type: ignore[arg-type]
    assert not (tmp_path / "report").exists()


def test_port_with_a_checkout_is_refused_before_any_work(tmp_path: Path) -> None:
    args = rebase_args(tmp_path, checkout=tmp_path, port=True)
    with pytest.raises(StackError, match="--port needs --to VERSION"):
        rebase_command(None, None, args)  # type: ignore[arg-type]
    assert not (tmp_path / "report").exists()


def refill(syn: Synthetic, n: int, edit: dict[str, str]) -> None:
    """Amend layer ``n`` with ``edit`` and take it back into the checkout."""
    syn.amend(n, edit)
    syn.take_back(f"amend layer {n}", today=dt.date(2026, 11, 3))


def test_a_layer_whose_overlay_is_partly_upstream_already_lands_clean(
    filled: Synthetic, tmp_path: Path
) -> None:
    refill(filled, 1, {"vllm/remote/client.py": "TIMEOUT = 5\n"})
    filled.apply()
    files = dict(UPSTREAM_FILES)
    # Upstream took one of layer 1's two new files, byte for byte: git's
    # cherry-pick lands the layer without a conflict.
    files["vllm/remote/__init__.py"] = "PORT = 1\n"
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert [r.status for r in results] == ["clean", "clean", "clean"]
    assert "vllm/remote/__init__.py" in results[0].note
    assert results[0].files == []


def test_a_partly_upstream_overlay_with_a_moved_diff_is_a_three_way_merge(
    filled: Synthetic, tmp_path: Path
) -> None:
    refill(filled, 1, {"vllm/remote/client.py": "TIMEOUT = 5\n"})
    filled.apply()
    files = dict(UPSTREAM_FILES)
    files["vllm/remote/__init__.py"] = "PORT = 1\n"
    files["vllm/envs.py"] = "# moved\n" * 5 + files["vllm/envs.py"]
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert [r.status for r in results] == ["3-way", "clean", "clean"]
    assert results[0].files == ["vllm/envs.py"]


def envs_with(**settings: int) -> str:
    """Upstream's envs.py with ``SETTING_n`` set to other values."""
    text = UPSTREAM_FILES["vllm/envs.py"]
    for name, value in settings.items():
        number = name.removeprefix("SETTING_")
        text = text.replace(f"{name} = {number}\n", f"{name} = {value}\n")
    return text


def classify_envs(
    filled: Synthetic,
    tmp_path: Path,
    layers: dict[int, dict[str, int]],
    upstream: dict[str, int],
) -> list[LayerResult]:
    """``classify`` after each layer ``n`` of ``layers`` sets ``layers[n]`` in
    envs.py (layer 1 sets ``SETTING_5`` unless given), against an upstream
    that sets ``upstream`` there."""
    for n, settings in sorted(layers.items()):
        refill(filled, n, {"vllm/envs.py": envs_with(**settings)})
    filled.apply()
    files = dict(UPSTREAM_FILES, **{"vllm/envs.py": envs_with(**upstream)})
    return classify(filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n")


def test_a_later_layer_s_conflict_with_a_skipped_layer_is_not_blamed_on_upstream(
    filled: Synthetic, tmp_path: Path
) -> None:
    # Layer 2 edits the line after layer 1's; upstream conflicts with layer 1
    # only. Without layer 1, layer 2's merge conflicts too: layer 1's doing.
    results = classify_envs(
        filled, tmp_path, {2: dict(SETTING_5=55, SETTING_6=66)}, dict(SETTING_5=6)
    )
    assert [r.status for r in results] == ["conflict", "conflict", "clean"]
    assert results[1].tried_without == [1]
    assert results[1].skipped_conflicts == ["vllm/envs.py"]
    assert "tried without layer 1" in results[1].note
    assert "from layer 1 missing" in results[1].note
    assert "not from upstream" in results[1].note


def test_a_later_layer_s_own_conflict_with_upstream_is_upstream_s(
    filled: Synthetic, tmp_path: Path
) -> None:
    results = classify_envs(
        filled,
        tmp_path,
        {2: dict(SETTING_5=55, SETTING_30=3000)},
        dict(SETTING_5=6, SETTING_30=31),
    )
    assert [r.status for r in results] == ["conflict", "conflict", "clean"]
    assert results[1].tried_without == [1]
    assert results[1].skipped_conflicts == []
    assert "tried without layer 1" in results[1].note
    assert "the conflicts in vllm/envs.py are upstream's" in results[1].note


def test_a_layer_that_lands_after_a_skipped_one_says_what_it_was_tried_without(
    filled: Synthetic, tmp_path: Path
) -> None:
    results = classify_envs(
        filled, tmp_path, {2: dict(SETTING_5=55, SETTING_30=3000)}, dict(SETTING_5=6)
    )
    assert [r.status for r in results] == ["conflict", "clean", "clean"]
    assert results[1].tried_without == [1]
    assert "tried without layer 1" in results[1].note
    assert results[2].tried_without == []
    assert results[2].note == ""


def test_a_conflict_undoing_a_skipped_layer_is_blamed_on_that_layer(
    filled: Synthetic, tmp_path: Path
) -> None:
    # Upstream has layer 1's SETTING_5 but not its SETTING_30: layer 1 is
    # skipped. Layer 2 edits the line after SETTING_5 and lands. On the old
    # stack, undoing layer 1 under layer 2 already conflicts: layer 3's
    # conflict cannot be told from layer 1 missing, and is blamed on it.
    results = classify_envs(
        filled,
        tmp_path,
        {
            1: dict(SETTING_5=55, SETTING_30=3000),
            2: dict(SETTING_5=55, SETTING_6=66, SETTING_30=3000),
            3: dict(SETTING_5=55, SETTING_6=66, SETTING_30=30000),
        },
        dict(SETTING_5=55, SETTING_30=31),
    )
    assert [r.status for r in results] == ["conflict", "clean", "conflict"]
    assert results[2].tried_without == [1]
    assert results[2].skipped_conflicts == ["vllm/envs.py"]


def test_skipped_layers_are_undone_latest_first(
    filled: Synthetic, tmp_path: Path
) -> None:
    # Layers 1 and 2 change SETTING_5 in turn and both conflict with
    # upstream's. Undone latest first, the old stack is upstream's, where
    # layer 3's SETTING_30 merges: its conflict there is upstream's. (Undoing
    # layer 1 first, under layer 2's line, would conflict.)
    results = classify_envs(
        filled,
        tmp_path,
        {2: dict(SETTING_5=555), 3: dict(SETTING_5=555, SETTING_30=3000)},
        dict(SETTING_5=6, SETTING_30=31),
    )
    assert [r.status for r in results] == ["conflict", "conflict", "conflict"]
    assert results[2].tried_without == [1, 2]
    assert results[2].skipped_conflicts == []
    assert "the conflicts in vllm/envs.py are upstream's" in results[2].note


def test_a_checkout_without_commits_is_refused_in_one_line_before_any_work(
    tmp_path: Path,
) -> None:
    checkout = tmp_path / "empty"
    checkout.mkdir()
    git(checkout, "init", "-q")
    args = rebase_args(tmp_path, checkout=checkout)
    # No stack and no pin: refused before either is used.
    with pytest.raises(StackError, match=r"^\S+empty has no commit at HEAD") as e:
        rebase_command(None, None, args)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)
    assert not (tmp_path / "report").exists()


def test_a_conflict_in_an_upstream_file_git_quotes_is_named_plainly(
    filled: Synthetic, tmp_path: Path
) -> None:
    naive = "".join(f"X_{i} = {i}\n" for i in range(10))
    files = dict(UPSTREAM_FILES, **{"vllm/naïve.py": naive})
    filled.apply(sdist=make_sdist(tmp_path / "vllm-1.0-naive.tar.gz", files))
    refill(filled, 1, {"vllm/naïve.py": naive.replace("X_5 = 5", "X_5 = 55")})
    filled.apply(sdist=make_sdist(tmp_path / "vllm-1.0-naive.tar.gz", files))
    files["vllm/naïve.py"] = naive.replace("X_5 = 5", "X_5 = 6")
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert results[0].status == "conflict"
    assert results[0].files == ["vllm/naïve.py"]
    assert any(h.startswith("vllm/naïve.py:") for h in results[0].hunks)


@pytest.mark.parametrize("machine", ["arm64", "ARM64", "aarch64"])
def test_an_arm64_machine_gets_the_aarch64_wheel(machine: str) -> None:
    assert PINNED.wheel(machine) == PINNED.wheels["aarch64"]


def test_of_several_wheels_two_with_the_pinned_platform_tag_are_refused() -> None:
    arm = "vllm-0.34.0-cp38-abi3-manylinux_2_28_aarch64.whl"
    x86 = [
        "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "vllm-0.34.0-cp312-cp312-manylinux_2_28_x86_64.whl",
    ]
    with pytest.raises(StackError, match="2 x86_64 wheels .* pin by hand"):
        select_wheels(PINNED, "0.34.0", [*x86, arm])


def test_an_overlay_file_upstream_has_with_other_bytes_is_a_conflict(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    files = dict(UPSTREAM_FILES, **{"vllm/logits.py": "TOPK = 8\n"})
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert [r.status for r in results] == ["clean", "conflict", "clean"]
    assert results[1].files == ["vllm/logits.py"]


@pytest.mark.parametrize(
    ("upstream", "number", "overlay"),
    [
        # A file where layer 1's overlay file needs a folder.
        ({"vllm/remote": "x\n"}, 1, "vllm/remote/__init__.py"),
        # A folder where layer 2's overlay file goes.
        ({"vllm/logits.py/__init__.py": "TOPK = 32\n"}, 2, "vllm/logits.py"),
    ],
)
def test_an_overlay_file_where_upstream_has_a_folder_or_file_is_a_conflict(
    filled: Synthetic,
    tmp_path: Path,
    upstream: dict[str, str],
    number: int,
    overlay: str,
) -> None:
    filled.apply()
    files = dict(UPSTREAM_FILES, **upstream)
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert [r.status for r in results if r.number != number] == ["clean", "clean"]
    assert results[number - 1].status == "conflict"
    assert f"overlay: {overlay}" in results[number - 1].files


def test_a_layer_whose_diff_is_upstream_but_one_new_file_is_not_still_lands(
    filled: Synthetic, tmp_path: Path
) -> None:
    refill(filled, 1, {"vllm/remote/client.py": "TIMEOUT = 5\n"})
    filled.apply()
    files = dict(UPSTREAM_FILES, **{"vllm/remote/__init__.py": "PORT = 1\n"})
    files["vllm/envs.py"] = envs_with(SETTING_5=55)
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert [r.status for r in results] == ["3-way", "clean", "clean"]


def test_a_layer_whose_moved_change_is_upstream_is_already_upstream(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    files = dict(UPSTREAM_FILES, **{"vllm/remote/__init__.py": "PORT = 1\n"})
    files["vllm/envs.py"] = "# moved\n" * 5 + envs_with(SETTING_5=55)
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert [r.status for r in results] == ["already-upstream", "clean", "clean"]
    assert results[0].note == "the three-way merge comes out empty"


def read_tree_file(syn: Synthetic, rel: str) -> str:
    return (syn.tree / rel).read_text()


def test_port_puts_the_layers_on_the_new_upstream_and_refresh_makes_them_exact(
    filled: Synthetic, tmp_path: Path
) -> None:
    files = dict(UPSTREAM_FILES)
    # Layer 2's hunk moved down: git's merge lands it, apply could not.
    files["vllm/model.py"] = "# moved\n" * 5 + files["vllm/model.py"]
    new = new_upstream(tmp_path, files)
    port_tree(filled.stack(), filled.tree, new, "vllm 2.0 pristine\n", v2(tmp_path))
    assert read_marker(filled.tree)["source"] == v2(tmp_path)
    filled.take_back("port to 2.0", today=dt.date(2026, 11, 4))
    # The refreshed patches apply exactly (no fuzz, no offset) on 2.0.
    filled.apply(sdist=tmp_path / "vllm-2.0.tar.gz")
    assert read_tree_file(filled, "vllm/model.py").startswith("# moved\n")
    assert "return 2000" in read_tree_file(filled, "vllm/model.py")
    assert "SETTING_5 = 55\n" in read_tree_file(filled, "vllm/envs.py")
    assert read_tree_file(filled, "vllm/logits.py") == "TOPK = 64\n"


def test_port_stops_at_a_conflict_naming_the_layer_and_refresh_takes_the_fix(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = envs_conflicting_with_layer_1()
    new = new_upstream(tmp_path, files)
    with pytest.raises(
        StackError,
        match=r"layer 1 \(0001-layer-1\.patch\) conflicts in vllm/envs\.py: "
        r".*git rebase --continue",
    ):
        port_tree(filled.stack(), filled.tree, new, "vllm 2.0 pristine\n", v2(tmp_path))
    # The maintainer keeps the layer's value and lets git go on.
    (filled.tree / "vllm/envs.py").write_text(
        files["vllm/envs.py"].replace("SETTING_5 = 6\n", "SETTING_5 = 55\n")
    )
    git(filled.tree, "add", "vllm/envs.py")
    monkeypatch.setenv("GIT_EDITOR", "true")
    git(filled.tree, "rebase", "--continue")
    filled.take_back("port to 2.0", today=dt.date(2026, 11, 4))
    filled.apply(sdist=tmp_path / "vllm-2.0.tar.gz")
    assert "SETTING_5 = 55\n" in read_tree_file(filled, "vllm/envs.py")
    assert "return 2000" in read_tree_file(filled, "vllm/model.py")


def test_port_given_up_leaves_a_tree_that_apply_replaces(
    filled: Synthetic, tmp_path: Path
) -> None:
    files = envs_conflicting_with_layer_1()
    with pytest.raises(StackError, match="conflicts"):
        new = new_upstream(tmp_path, files)
        port_tree(filled.stack(), filled.tree, new, "v2\n", v2(tmp_path))
    git(filled.tree, "rebase", "--abort")
    filled.apply()
    assert "SETTING_5 = 55\n" in read_tree_file(filled, "vllm/envs.py")
    assert git(filled.tree, "log", "-1", "--format=%s", "upstream") == (
        "vllm 1.0 pristine"
    )


def test_port_refuses_a_tree_without_every_layer_before_any_change(
    filled: Synthetic,
) -> None:
    filled.apply(upto=2)
    head = git(filled.tree, "rev-parse", "HEAD")
    with pytest.raises(StackError, match="holds 2 of 3 layers"):
        check_portable(filled.stack(), filled.tree)
    assert git(filled.tree, "rev-parse", "HEAD") == head


def test_port_refuses_a_layer_that_is_already_upstream(
    filled: Synthetic, tmp_path: Path
) -> None:
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, layer_1_upstream()), "v2\n"
    )
    with pytest.raises(StackError, match=r"^layer 1 is already upstream in vllm 2\.0"):
        refuse_landed_layers(results, "vllm 2.0")
    refuse_landed_layers(results[1:], "vllm 2.0")


def test_a_port_that_git_cannot_start_leaves_the_tree_as_it_was(
    filled: Synthetic, tmp_path: Path
) -> None:
    upstream = git(filled.tree, "rev-parse", "upstream")
    marker = (filled.tree / ".git" / MARKER).read_bytes()
    # Another git process's lock: the rebase fails before it starts.
    (filled.tree / ".git" / "index.lock").touch()
    with pytest.raises(StackError, match="git rebase"):
        new = new_upstream(tmp_path, UPSTREAM_FILES)
        port_tree(filled.stack(), filled.tree, new, "v2\n", v2(tmp_path))
    (filled.tree / ".git" / "index.lock").unlink()
    assert git(filled.tree, "rev-parse", "upstream") == upstream
    assert (filled.tree / ".git" / MARKER).read_bytes() == marker
    check_portable(filled.stack(), filled.tree)


def test_port_during_a_stopped_port_says_to_finish_or_abort_it(
    filled: Synthetic, tmp_path: Path
) -> None:
    new = new_upstream(tmp_path, envs_conflicting_with_layer_1())
    with pytest.raises(StackError, match="conflicts"):
        port_tree(filled.stack(), filled.tree, new, "v2\n", v2(tmp_path))
    with pytest.raises(StackError, match="in the middle of a rebase"):
        check_portable(filled.stack(), filled.tree)


def checkout_of(path: Path) -> Path:
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A", "--force")
    git(path, "commit", "-q", "-m", "upstream 2.0")
    return path


def cache_sdist(syn: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The pinned sdist in a cache of its own, as `fetch` finds it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / syn.sdist.name).write_bytes(syn.sdist.read_bytes())
    monkeypatch.setenv("K3_STACK_CACHE", str(cache))
    return cache


def release_2_0(
    syn: Synthetic,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    files: dict[str, str],
) -> None:
    """Release 2.0 of ``files`` where `rebase --to 2.0` fetches it: its sdist
    and a wheel in the cache beside the pinned sdist."""
    import k3stack.rebase as rebase_mod

    cache = cache_sdist(syn, tmp_path, monkeypatch)
    sdist = make_sdist(tmp_path / "vllm-2.0.tar.gz", files, top="vllm-2.0")
    wheel_name = "vllm-2.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    (cache / wheel_name).write_bytes(syn.wheel.read_bytes())
    monkeypatch.setattr(
        rebase_mod,
        "fetch_release",
        lambda pin, version: (
            sdist,
            {"sdist": sdist.name, "wheels": {wheel_name: "http://unused/"}},
        ),
    )


def test_a_report_path_that_is_a_file_is_refused_in_one_line(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_sdist(filled, tmp_path, monkeypatch)
    checkout = checkout_of(new_upstream(tmp_path, UPSTREAM_FILES))
    report = tmp_path / "report"
    report.write_text("mine\n")
    args = rebase_args(tmp_path, checkout=checkout, report=report)
    with pytest.raises(StackError, match=f"{report}.*not a directory") as e:
        rebase_command(filled.stack(), filled.pin, args)
    assert "\n" not in str(e.value)
    assert report.read_text() == "mine\n"


def test_a_port_that_git_cannot_start_leaves_the_pin_as_it_was(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import k3stack.rebase as rebase_mod
    from k3stack.pin import load_pin

    release_2_0(
        filled,
        tmp_path,
        monkeypatch,
        dict(UPSTREAM_FILES, **{"vllm/_version.py": "commit_id = 'g2222222'\n"}),
    )
    pin_file = tmp_path / "pin.toml"
    pin_text = (
        '[upstream]\nname = "vllm"\nversion = "1.0"\ncommit = "abc1234"\n\n'
        '[upstream.sdist]\nfilename = "x.tar.gz"\nsize = 1\nsha256 = "00"\n\n'
        '[upstream.wheels.x86_64]\nfilename = "x.whl"\nsize = 1\nsha256 = "00"\n\n'
        '[image]\nbase = "vllm/vllm-openai:v1.0"\n'
    )
    pin_file.write_text(pin_text)
    monkeypatch.setattr(rebase_mod, "PIN_FILE", pin_file)
    monkeypatch.setattr(rebase_mod, "load_pin", lambda path=pin_file: load_pin(path))
    upstream = git(filled.tree, "rev-parse", "upstream")
    # Another git process's lock: the rebase fails before it starts.
    (filled.tree / ".git" / "index.lock").touch()
    args = rebase_args(tmp_path, to="2.0", port=True, tree=filled.tree)
    with pytest.raises(StackError, match="git rebase"):
        rebase_command(filled.stack(), filled.pin, args)
    assert git(filled.tree, "rev-parse", "upstream") == upstream
    assert pin_file.read_text() == pin_text


def test_an_upstream_that_holds_every_layer_has_every_layer_already_upstream(
    filled: Synthetic, tmp_path: Path
) -> None:
    # Layer 3's change borders layer 1's: with both upstream, layer 1's diff
    # reverse-applies only once layer 3's is undone.
    refill(filled, 3, {"vllm/envs.py": envs_with(SETTING_5=55, SETTING_6=66)})
    filled.apply()
    new = tmp_path / "new"
    export_checkout(filled.tree, new)
    results = classify(filled.stack(), filled.tree, new, "v2\n")
    assert [r.status for r in results] == ["already-upstream"] * 3


def test_a_layer_is_not_taken_for_upstream_under_a_later_one_that_is_not(
    filled: Synthetic, tmp_path: Path
) -> None:
    # Upstream has layer 3's setting but not layer 1's: neither is upstream.
    refill(filled, 3, {"vllm/envs.py": envs_with(SETTING_5=55, SETTING_6=66)})
    filled.apply()
    files = dict(UPSTREAM_FILES, **{"vllm/envs.py": envs_with(SETTING_6=66)})
    results = classify(
        filled.stack(), filled.tree, new_upstream(tmp_path, files), "v2\n"
    )
    assert [r.status for r in results] == ["conflict", "clean", "conflict"]


def test_a_hunk_header_with_a_pipe_keeps_the_report_table_s_columns() -> None:
    import re

    from k3stack.rebase import render_report

    # Git copies the hunk's function line: vLLM's type hints hold '|'.
    hunk = (
        "vllm/envs.py hunk 3 (@@ -617,6 +647,40 @@ def _resolve_rust_cli_path() "
        "-> str | None:): line 617 does not match exactly"
    )
    result = LayerResult(1, "0001-a.patch", "3-way", ["vllm/envs.py"], [hunk])
    result.note = "a | b"
    rows = render_report("vllm 2.0", [result]).splitlines()[2:]
    cells = [re.split(r"(?<!\\)\|", row)[1:-1] for row in rows]
    assert [len(c) for c in cells] == [6, 6, 6]
    assert cells[2][4].strip() == hunk.replace("|", "\\|")


def test_port_of_a_release_that_holds_a_layer_changes_neither_tree_nor_pin(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rebase --to 2.0 --port` where 2.0 took layer 1: refused before the
    pin or the tree moves (git would port the layer as an empty commit)."""
    import k3stack.rebase as rebase_mod

    release_2_0(
        filled,
        tmp_path,
        monkeypatch,
        dict(layer_1_upstream(), **{"vllm/_version.py": "commit_id = 'g2'\n"}),
    )
    pin_file = tmp_path / "pin.toml"
    pin_file.write_text("as pinned\n")
    monkeypatch.setattr(rebase_mod, "PIN_FILE", pin_file)
    head = git(filled.tree, "rev-parse", "HEAD")
    upstream = git(filled.tree, "rev-parse", "upstream")
    args = rebase_args(tmp_path, to="2.0", port=True, tree=filled.tree)
    with pytest.raises(StackError, match=r"^layer 1 is already upstream in vllm 2\.0"):
        rebase_command(filled.stack(), filled.pin, args)
    assert pin_file.read_text() == "as pinned\n"
    assert git(filled.tree, "rev-parse", "HEAD") == head
    assert git(filled.tree, "rev-parse", "upstream") == upstream
