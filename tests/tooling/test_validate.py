# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The validation step qualify and lint run refuses an inconsistent stack."""

from __future__ import annotations

import re

import pytest
from conftest import Synthetic

from k3stack import StackError
from k3stack.patchfile import apply_exact, parse_diff
from k3stack.series import check_layering, check_suites, load_stack


def claim(syn: Synthetic, n: int, rel: str) -> None:
    patch = syn.root / "patches" / f"{n:04d}-layer-{n}.patch"
    text = patch.read_text()
    patch.write_text(re.sub(r"Overlay:\n", f"Overlay:\n {rel}\n", text, count=1))


def test_an_overlay_file_claimed_by_two_layers_is_refused(filled: Synthetic) -> None:
    claim(filled, 3, "vllm/logits.py")
    with pytest.raises(StackError, match="claimed by 0002-layer-2.patch and 0003"):
        load_stack(filled.root)


@pytest.mark.parametrize("path", ["vllm/remote/__init__.py", "vllm/logits.py"])
def test_a_diff_that_edits_an_overlay_file_is_refused(
    filled: Synthetic, path: str
) -> None:
    # Layer 2's diff edits layer 1's overlay file, or its own: a layer's diff
    # changes upstream files only (apply would take it, refresh refuse it).
    owner = "0001-layer-1.patch" if "remote" in path else "0002-layer-2.patch"
    old = (filled.root / "overlay" / path).read_bytes()
    patch = filled.root / "patches" / "0002-layer-2.patch"
    patch.write_bytes(
        patch.read_bytes()
        + f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n".encode()
        + b"@@ -1 +1 @@\n-"
        + old
        + b"+X = 2\n"
    )
    with pytest.raises(StackError) as info:
        load_stack(filled.root)
    assert str(info.value).startswith(f"0002-layer-2.patch: the diff changes {path}")
    assert f"overlay file of {owner}" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_series_entry_without_a_file_is_refused(synthetic: Synthetic) -> None:
    (synthetic.root / "patches" / "0002-layer-2.patch").unlink()
    with pytest.raises(StackError, match="lists 0002-layer-2.patch, which does not"):
        load_stack(synthetic.root)


def test_a_patch_file_not_in_the_series_is_refused(synthetic: Synthetic) -> None:
    (synthetic.root / "patches" / "0009-stray.patch").write_text("x")
    with pytest.raises(StackError, match="not in patches/series: 0009-stray.patch"):
        load_stack(synthetic.root)


@pytest.mark.parametrize("rel", ["0009-stray.diff", "old/0009-stray.patch"])
def test_a_diff_or_a_patch_in_a_subfolder_not_in_the_series_is_refused(
    synthetic: Synthetic, rel: str
) -> None:
    stray = synthetic.root / "patches" / rel
    stray.parent.mkdir(exist_ok=True)
    stray.write_text("x")
    with pytest.raises(StackError, match=f"not in patches/series: {rel}$"):
        load_stack(synthetic.root)


def test_an_overlay_file_no_layer_claims_is_refused(synthetic: Synthetic) -> None:
    (synthetic.root / "overlay" / "vllm" / "orphan.py").write_text("")
    with pytest.raises(StackError, match="claimed by no layer: vllm/orphan.py"):
        load_stack(synthetic.root)


def test_a_claimed_overlay_file_that_is_missing_is_refused(
    synthetic: Synthetic,
) -> None:
    claim(synthetic, 1, "vllm/ghost.py")
    with pytest.raises(StackError, match="overlay file vllm/ghost.py does not exist"):
        load_stack(synthetic.root)


def test_a_patch_without_dep3_fields_is_refused(synthetic: Synthetic) -> None:
    patch = synthetic.root / "patches" / "0001-layer-1.patch"
    patch.write_text(patch.read_text().replace("Forwarded: not-needed\n", ""))
    with pytest.raises(StackError, match="missing header fields Forwarded"):
        load_stack(synthetic.root)


@pytest.mark.parametrize(
    ("before", "after", "message"),
    [
        ("Forwarded: not-needed\n", "Forwarded:\n", "missing header fields Forwarded"),
        (
            "Last-Update: 2026-11-01\n",
            "Last-Update: 2026W441\n",
            "Last-Update '2026W441' is not YYYY-MM-DD",
        ),
    ],
)
def test_a_patch_with_an_empty_field_or_odd_date_is_refused(
    synthetic: Synthetic, before: str, after: str, message: str
) -> None:
    patch = synthetic.root / "patches" / "0001-layer-1.patch"
    assert before in patch.read_text()
    patch.write_text(patch.read_text().replace(before, after))
    with pytest.raises(StackError, match=message):
        load_stack(synthetic.root)


@pytest.mark.parametrize("extra", [False, True])
def test_a_hunk_whose_body_and_header_disagree_is_refused(
    filled: Synthetic, extra: bool
) -> None:
    # One context line less, or one more, than the hunk header counts.
    patch = filled.root / "patches" / "0002-layer-2.patch"
    lines = patch.read_text().splitlines(keepends=True)
    first = next(i for i, ln in enumerate(lines) if ln.startswith("@@")) + 1
    if extra:
        lines.insert(first, lines[first])
    else:
        del lines[first]
    patch.write_text("".join(lines))
    with pytest.raises(StackError, match="vllm/model.py hunk @@"):
        load_stack(filled.root)


def test_a_suite_path_that_does_not_exist_is_refused(synthetic: Synthetic) -> None:
    for n in (1, 2, 3):
        (synthetic.root / "tests" / f"layer{n}").mkdir(parents=True)
    check_suites(load_stack(synthetic.root))
    patch = synthetic.root / "patches" / "0002-layer-2.patch"
    text = patch.read_text()
    assert "Suite:" in text
    patch.write_text(text.replace("Suite:", "Suite:\n tests/no_such_suite.py", 1))
    with pytest.raises(StackError, match="Suite path tests/no_such_suite.py"):
        check_suites(load_stack(synthetic.root))


@pytest.mark.parametrize("spelling", ["tests/", "./tests/test_model.py", "tests/../x"])
def test_an_upstream_tests_path_spelled_otherwise_is_refused(
    synthetic: Synthetic, spelling: str
) -> None:
    patch = synthetic.root / "patches" / "0002-layer-2.patch"
    text = patch.read_text()
    patch.write_text(text.replace(" tests/test_model.py", f" {spelling}", 1))
    with pytest.raises(StackError, match="Upstream-Tests path .* is not a plain"):
        load_stack(synthetic.root)


def test_a_patch_header_that_is_not_utf8_is_refused_naming_the_file(
    synthetic: Synthetic,
) -> None:
    patch = synthetic.root / "patches" / "0002-layer-2.patch"
    patch.write_bytes(patch.read_bytes().replace(b"Layer 2.", b"caf\xe9", 1))
    with pytest.raises(StackError, match="0002-layer-2.patch: line 6 is not UTF-8"):
        load_stack(synthetic.root)


def test_a_series_that_is_not_utf8_is_refused_naming_the_file(
    synthetic: Synthetic,
) -> None:
    series = synthetic.root / "patches" / "series"
    series.write_bytes(b"# caf\xe9\n" + series.read_bytes())
    with pytest.raises(StackError, match="patches/series: line 1 is not UTF-8"):
        load_stack(synthetic.root)


def test_a_claimed_overlay_file_that_is_a_symlink_is_refused(
    filled: Synthetic,
) -> None:
    claim(filled, 2, "vllm/alias.py")
    (filled.root / "overlay/vllm/alias.py").symlink_to("logits.py")
    with pytest.raises(StackError, match="overlay file vllm/alias.py is a symlink"):
        load_stack(filled.root)


def test_a_mode_change_in_a_patch_is_refused_as_such_not_sent_to_overlay() -> None:
    diff = (
        b"diff --git a/vllm/model.py b/vllm/model.py\n"
        b"old mode 100644\nnew mode 100755\n"
    )
    with pytest.raises(StackError) as info:
        parse_diff(diff, "0002-layer-2.patch")
    assert "vllm/model.py: a mode change" in str(info.value)
    assert "overlay" not in str(info.value)


def test_a_hunk_header_whose_context_is_not_utf8_is_read() -> None:
    # Git copies the hunk's function line into the header as bytes; a latin-1
    # upstream file (or a git that cuts a UTF-8 name mid-character) puts
    # other bytes there. The header is only named in messages.
    diff = (
        b"diff --git a/vllm/model.py b/vllm/model.py\n"
        b"--- a/vllm/model.py\n+++ b/vllm/model.py\n"
        b"@@ -2,1 +2,1 @@ def caf\xe9():\n-    return 1\n+    return 2\n"
    )
    (fp,) = parse_diff(diff, "0002-layer-2.patch")
    assert fp.path == "vllm/model.py"
    assert fp.hunks[0].header == "@@ -2,1 +2,1 @@ def caf\\xe9():"
    assert apply_exact(b"def caf\xe9():\n    return 1\n", fp).endswith(b"return 2\n")


@pytest.mark.parametrize(
    ("names", "path"),
    [
        (b'"a/vllm/na\\303\\257ve.py" "b/vllm/na\\303\\257ve.py"', "vllm/naïve.py"),
        (b'"a/vllm/tab\\there.py" "b/vllm/tab\\there.py"', "vllm/tab\there.py"),
        (b'"a/vllm/q\\"uote.py" "b/vllm/q\\"uote.py"', 'vllm/q"uote.py'),
        (b"a/vllm/my file.py b/vllm/my file.py", "vllm/my file.py"),
        (b"a/vllm/a b/c.py b/vllm/a b/c.py", "vllm/a b/c.py"),
    ],
)
def test_a_diff_header_names_the_file_git_quoted_or_spaced(
    names: bytes, path: str
) -> None:
    diff = b"diff --git " + names + b"\n@@ -1 +1 @@\n-a\n+b\n"
    assert [fp.path for fp in parse_diff(diff, "0001-layer-1.patch")] == [path]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (b'"a/vllm/x\\303.py" "b/vllm/x\\303.py"', "is not UTF-8"),
        (b'"a/vllm/x.py "b/vllm/x.py"', "malformed file names"),
        (b"a/vllm/x.py b/vllm/y.py", "names two files"),
        (b"a/vllm/../../x.py b/vllm/../../x.py", "not a plain relative path"),
        (b"a/vllm/./x.py b/vllm/./x.py", "not a plain relative path"),
        (b"a//etc/x.py b//etc/x.py", "not a plain relative path"),
    ],
)
def test_a_diff_header_with_odd_file_names_is_refused_in_one_line(
    names: bytes, message: str
) -> None:
    diff = b"diff --git " + names + b"\n@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(
        StackError, match=f"0001-layer-1.patch: diff line 1 .*{message}"
    ):
        parse_diff(diff, "0001-layer-1.patch")


def test_a_no_newline_marker_without_a_line_before_it_is_refused_in_one_line() -> None:
    diff = (
        b"diff --git a/vllm/x.py b/vllm/x.py\n"
        b"@@ -1 +1 @@\n\\ No newline at end of file\n-a\n+b\n"
    )
    with pytest.raises(
        StackError, match="0001-layer-1.patch: diff line 3: a '.' line with no hunk"
    ):
        parse_diff(diff, "0001-layer-1.patch")


def test_a_deletion_that_leaves_lines_of_the_file_does_not_apply() -> None:
    diff = (
        b"diff --git a/vllm/x.py b/vllm/x.py\ndeleted file mode 100644\n"
        b"--- a/vllm/x.py\n+++ /dev/null\n@@ -2 +1,0 @@\n-b\n"
    )
    (fp,) = parse_diff(diff, "0001-layer-1.patch")
    with pytest.raises(StackError, match="vllm/x.py: the deletion leaves 1 of its"):
        apply_exact(b"a\nb\n", fp)


def test_a_deletion_of_every_line_applies() -> None:
    diff = (
        b"diff --git a/vllm/x.py b/vllm/x.py\ndeleted file mode 100644\n"
        b"--- a/vllm/x.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-a\n-b\n"
    )
    (fp,) = parse_diff(diff, "0001-layer-1.patch")
    assert apply_exact(b"a\nb\n", fp) == b""


def test_a_series_entry_listed_twice_is_refused(synthetic: Synthetic) -> None:
    series = synthetic.root / "patches" / "series"
    series.write_text(series.read_text() + "0002-layer-2.patch\n")
    with pytest.raises(StackError, match="lists 0002-layer-2.patch twice"):
        load_stack(synthetic.root)


def test_an_overlay_path_outside_vllm_is_refused(synthetic: Synthetic) -> None:
    claim(synthetic, 1, "extra/tool.py")
    (synthetic.root / "overlay" / "extra").mkdir()
    (synthetic.root / "overlay" / "extra" / "tool.py").write_text("")
    with pytest.raises(StackError, match="overlay path extra/tool.py is not under"):
        load_stack(synthetic.root)


def test_a_bytecode_cache_in_overlay_is_no_unclaimed_file(filled: Synthetic) -> None:
    cache = filled.root / "overlay/vllm/__pycache__/logits.cpython-311.pyc"
    cache.parent.mkdir()
    cache.write_bytes(b"bytecode")
    assert len(load_stack(filled.root).layers) == 3


def test_a_header_field_given_twice_is_refused(synthetic: Synthetic) -> None:
    patch = synthetic.root / "patches" / "0001-layer-1.patch"
    text = patch.read_text()
    patch.write_text(text.replace("Origin: vendor\n", "Origin: vendor\nOrigin: up\n"))
    with pytest.raises(StackError, match="field Origin appears twice"):
        load_stack(synthetic.root)


def test_a_new_file_in_a_diff_is_refused_as_belonging_in_overlay() -> None:
    diff = (
        b"diff --git a/vllm/new.py b/vllm/new.py\nnew file mode 100644\n"
        b"--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1 @@\n+X = 1\n"
    )
    with pytest.raises(StackError, match="new files belong in overlay/"):
        parse_diff(diff, "0001-layer-1.patch")


@pytest.mark.parametrize(
    "edit", ["patches/0002-layer-2.patch", "overlay/vllm/logits.py"]
)
def test_the_stack_hash_changes_with_a_patch_or_an_overlay_file(
    filled: Synthetic, edit: str
) -> None:
    before = load_stack(filled.root).stack_hash()
    path = filled.root / edit
    path.write_text(path.read_text().replace("64", "65"))
    assert load_stack(filled.root).stack_hash() != before


@pytest.mark.parametrize(
    "use",
    [
        "import vllm.logits\n",
        "from vllm.logits import TOPK\n",
        "from vllm import (\n    envs,\n    logits,\n)\n",
    ],
)
def test_a_lower_layer_using_a_higher_layers_module_is_refused(
    filled: Synthetic,
    use: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 1's overlay file (or a hunk that leaked into its patch) uses
    layer 2's module: layer 1 is no prefix of the stack; validate says so."""
    from k3stack import cli

    check_layering(load_stack(filled.root))
    (filled.root / "overlay/vllm/remote/__init__.py").write_text(use + "PORT = 1\n")
    with pytest.raises(StackError) as info:
        check_layering(load_stack(filled.root))
    assert str(info.value) == (
        "0001-layer-1.patch: overlay file vllm/remote/__init__.py uses "
        "vllm/logits.py, which layer 2 (0002-layer-2.patch) adds: a lower layer "
        "cannot use a higher one's file (a hunk of the higher layer in the lower "
        "one's patch?)"
    )
    for n in (1, 2, 3):
        (filled.root / f"tests/layer{n}").mkdir(parents=True)
    monkeypatch.setattr(cli, "ROOT", filled.root)
    assert cli.main(["validate"]) == 1
    assert capsys.readouterr().err == f"error: {info.value}\n"


@pytest.mark.parametrize(
    "text",
    [
        "import vllm.logits_extra\n",
        "from vllm.remote import logits\n",
        "# vllm.logitsx\nX = 'vllm/logits'\n",
    ],
)
def test_a_lower_layer_naming_other_modules_passes(
    filled: Synthetic, text: str
) -> None:
    (filled.root / "overlay/vllm/remote/__init__.py").write_text(text)
    check_layering(load_stack(filled.root))
    # A higher layer uses a lower one's module: that is how layers extend.
    (filled.root / "overlay/vllm/logits.py").write_text("import vllm.remote\n")
    check_layering(load_stack(filled.root))


def test_a_lower_layer_importing_a_package_a_higher_layer_adds_is_refused(
    filled: Synthetic,
) -> None:
    """A package's module is its folder's name, not ``__init__``'s."""
    claim(filled, 3, "vllm/draft/__init__.py")
    (filled.root / "overlay/vllm/draft").mkdir()
    (filled.root / "overlay/vllm/draft/__init__.py").write_text("DRAFT = 1\n")
    (filled.root / "overlay/vllm/remote/__init__.py").write_text("import vllm.draft\n")
    with pytest.raises(
        StackError,
        match=r"^0001-layer-1.patch: overlay file vllm/remote/__init__.py uses "
        r"vllm/draft/__init__.py, which layer 3 \(0003-layer-3.patch\) adds",
    ):
        check_layering(load_stack(filled.root))
