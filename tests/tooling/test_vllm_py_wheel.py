# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``ci/vllm_py_wheel.py``: the pure-Python wheel of an applied tree's vllm
that ``ci/gpu-carry.sh`` carries to a GPU box without vllm."""

from __future__ import annotations

import csv
import importlib.util
import io
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "vllm_py_wheel.py"
# vLLM's tuned-kernel configs have commas in their names.
CONFIG = "vllm/configs/E=1,N=128,device_name=X.json"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_py_wheel", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    for rel, text in {
        "vllm/__init__.py": "VERSION = 1\n",
        "vllm/ops/kernel.py": "X = 2\n",
        CONFIG: "{}\n",
        "csrc/ops.cu": "// not packaged\n",
        # Python of the tree outside vllm/ is not vllm's.
        "setup.py": "raise SystemExit\n",
        "tests/test_ops.py": "X = 3\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF")
    return root


def test_the_wheel_holds_the_python_and_json_and_no_compiled_extension(
    tree: Path, tmp_path: Path
) -> None:
    wheel = _module().build(tree, tmp_path / "out")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"vllm/__init__.py", "vllm/ops/kernel.py", CONFIG} <= names
    assert not any(name.endswith(".so") or name.startswith("csrc") for name in names)


def test_only_the_vllm_package_the_plugin_and_the_metadata_are_packed(
    tree: Path, tmp_path: Path
) -> None:
    module = _module()
    wheel = module.build(tree, tmp_path / "out")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = f"vllm-{module.VERSION}.dist-info/"
    assert [
        n
        for n in names
        if not n.startswith(("vllm/", dist_info)) and n != "k3_neutral_platform.py"
    ] == []


def test_the_package_files_are_stored_in_sorted_order(
    tree: Path, tmp_path: Path
) -> None:
    # Created out of order, so the file system's listing is not sorted.
    for rel in ("vllm/zz.py", "vllm/aa/b.py", "vllm/mm.py"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("\n")
    wheel = _module().build(tree, tmp_path / "out")
    package = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("vllm/")]
    assert package == sorted(package)


def test_the_wheel_declares_itself_pure_python_for_any_platform(
    tree: Path, tmp_path: Path
) -> None:
    module = _module()
    wheel = zipfile.ZipFile(module.build(tree, tmp_path / "out"))
    meta = wheel.read(f"vllm-{module.VERSION}.dist-info/WHEEL").decode()
    assert {"Root-Is-Purelib: true", "Tag: py3-none-any"} <= set(meta.splitlines())
    assert wheel.filename is not None
    assert wheel.filename.endswith("-py3-none-any.whl")


def test_two_builds_of_one_tree_give_the_same_bytes(tree: Path, tmp_path: Path) -> None:
    build = _module().build
    first = build(tree, tmp_path / "a").read_bytes()
    assert build(tree, tmp_path / "b").read_bytes() == first


def test_the_record_lists_every_file_with_its_hash_commas_included(
    tree: Path, tmp_path: Path
) -> None:
    import base64
    import hashlib

    wheel = zipfile.ZipFile(_module().build(tree, tmp_path / "out"))
    (record_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    rows = {
        row[0]: row for row in csv.reader(io.StringIO(wheel.read(record_name).decode()))
    }
    assert set(rows) == set(wheel.namelist())
    for name, (_, digest, size) in rows.items():
        if name == record_name:
            continue
        data = wheel.read(name)
        want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        assert (digest, size) == (f"sha256={want.decode()}", str(len(data)))


def test_installed_vllm_is_found_with_its_platform_plugin(
    tree: Path, tmp_path: Path
) -> None:
    wheel = _module().build(tree, tmp_path / "out")
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
    )
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from importlib.metadata import entry_points, version;"
        "(ep,) = entry_points(group='vllm.platform_plugins');"
        "print(version('vllm'), ep.load()())"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(site)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == ["0.33.0+stack.py", "vllm.platforms.interface.UnspecifiedPlatform"]
    assert (site / CONFIG).read_text() == "{}\n"


def test_a_folder_that_is_not_an_applied_tree_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not an applied vllm tree"):
        _module().build(tmp_path, tmp_path / "out")
