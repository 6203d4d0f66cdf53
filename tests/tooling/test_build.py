# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patched wheel, the image payload and its installer."""

from __future__ import annotations

import base64
import csv
import dataclasses
import datetime as dt
import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import Synthetic

from k3stack import StackError
from k3stack.artifacts import (
    LOCK_NAME,
    STAGING_PREFIX,
    BuildResult,
    build,
    docker_build,
)
from k3stack.fetch import sha256_file
from k3stack.gitutil import git
from k3stack.upstream import extract_sdist
from k3stack.worktree import MARKER

BUILD = Path(__file__).resolve().parents[2] / "build"
INSTALLER = BUILD / "k3stack" / "install.py"


def build_into(syn: Synthetic, out: Path):
    return build(syn.stack(), syn.pin, syn.tree, syn.wheel, out, layers=3)


# A build in a fresh interpreter: its own hash seed (set and dict order of
# strings) and its own time zone, as two maintainers' builds would have.
_CHILD_BUILD = """
import pickle, sys
from k3stack.artifacts import build
from k3stack.series import load_stack
root, pin, tree, wheel, out = pickle.loads(bytes.fromhex(sys.argv[1]))
result = build(load_stack(root), pin, tree, wheel, out, layers=3)
print(pickle.dumps(result).hex())
"""


def build_in_a_child(syn: Synthetic, out: Path, seed: str, tz: str) -> BuildResult:
    inputs = pickle.dumps((syn.root, syn.pin, syn.tree, syn.wheel, out)).hex()
    path = os.pathsep.join([str(BUILD), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": seed, "TZ": tz}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD_BUILD, inputs],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    return pickle.loads(bytes.fromhex(child.stdout.split()[-1]))


def test_two_builds_in_different_processes_give_the_same_wheel_sha256(
    filled: Synthetic, tmp_path: Path
) -> None:
    # Enough new files that two hash seeds would order a set of them apart.
    new = {f"vllm/k3_{name}.py": f"NAME = {name!r}\n" for name in "abcdefgh"}
    filled.amend(3, new)
    filled.take_back("layer 3 adds files", today=dt.date(2026, 11, 2))
    filled.apply()
    # UTC-12 and UTC+14: the two local dates differ whenever the builds run.
    first = build_in_a_child(filled, tmp_path / "a", seed="1", tz="WEST+12")
    second = build_in_a_child(filled, tmp_path / "b", seed="2", tz="EAST-14")
    assert first.wheel.name == second.wheel.name
    assert sha256_file(first.wheel) == sha256_file(second.wheel)
    assert first.lock.read_bytes() == second.lock.read_bytes()


def test_every_wheel_entry_carries_the_fixed_1980_timestamp_not_the_build_date(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    result = build_into(filled, tmp_path)
    with zipfile.ZipFile(result.wheel) as zf:
        stamps = {info.date_time for info in zf.infolist()}
    assert stamps == {(1980, 1, 1, 0, 0, 0)}


def test_the_wheel_carries_a_local_version_and_a_valid_record(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    result = build_into(filled, tmp_path)
    local = filled.stack().stack_hash(3)[:12]
    assert result.wheel.name.startswith(f"vllm-1.0+stack.{local}-cp38-abi3")
    with zipfile.ZipFile(result.wheel) as zf:
        assert zf.testzip() is None
        dist_info = f"vllm-1.0+stack.{local}.dist-info"
        assert (
            f"Version: 1.0+stack.{local}\n" in zf.read(f"{dist_info}/METADATA").decode()
        )
        rows = list(csv.reader(io.StringIO(zf.read(f"{dist_info}/RECORD").decode())))
        names = {i.filename for i in zf.infolist()}
        assert {row[0] for row in rows} == names
        for name, digest, size in rows:
            if name.endswith("RECORD"):
                continue
            data = zf.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            assert digest == "sha256=" + expected.rstrip(b"=").decode(), name
            assert int(size) == len(data)
        assert zf.read("vllm/logits.py") == b"TOPK = 64\n"
        assert b"SETTING_5 = 55" in zf.read("vllm/envs.py")
        assert zf.read("vllm/_C.abi3.so") == bytes(range(256)) * 64


def test_the_image_context_holds_only_changed_files_and_labels(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    result = build_into(filled, tmp_path)
    site = result.context / "stack" / "site"
    payload = sorted(
        p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()
    )
    code = [p for p in payload if not p.startswith("vllm-1.0+")]
    assert code == [
        "vllm/envs.py",
        "vllm/logits.py",
        "vllm/model.py",
        "vllm/remote/__init__.py",
    ]
    dockerfile = (result.context / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=vllm/vllm-openai:v1.0" in dockerfile
    assert f'ai.vllm.k3.stack-hash="{filled.stack().stack_hash(3)}"' in dockerfile
    assert "0001-layer-1.patch,0002-layer-2.patch,0003-layer-3.patch" in dockerfile
    assert "@" not in dockerfile.replace("@sha", "")


def payload_and_upstream_site(syn: Synthetic, tmp_path: Path) -> tuple[Path, Path]:
    """The built payload and a site with the upstream wheel unpacked in it."""
    syn.apply()
    result = build_into(syn, tmp_path / "dist")
    site = tmp_path / "site"
    with zipfile.ZipFile(syn.wheel) as zf:
        zf.extractall(site)
    return result.context / "stack", site


def installed(syn: Synthetic, tmp_path: Path) -> tuple[Path, Path]:
    """The payload and a site where the installer installed it."""
    from k3stack import install

    payload, site = payload_and_upstream_site(syn, tmp_path)
    install.install(payload, site)
    return payload, site


def test_the_installer_installs_and_its_self_check_passes(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = installed(filled, tmp_path)
    assert install.verify(payload, site) == []
    assert (site / "vllm/logits.py").read_text() == "TOPK = 64\n"
    assert not (site / "vllm-1.0.dist-info").exists()


def test_the_self_check_finds_a_file_that_differs_from_the_lock(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = installed(filled, tmp_path)
    (site / "vllm/_C.abi3.so").write_bytes(b"not the upstream binary")
    assert install.verify(payload, site) == [
        "vllm/_C.abi3.so: content differs from RECORD"
    ]


def test_the_self_check_finds_a_file_changed_to_other_bytes_of_the_same_size(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = installed(filled, tmp_path)
    binary = site / "vllm/_C.abi3.so"
    binary.write_bytes(bytes(len(binary.read_bytes())))
    assert install.verify(payload, site) == [
        "vllm/_C.abi3.so: content differs from RECORD"
    ]


def test_a_tampered_payload_is_refused_before_anything_changes(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = payload_and_upstream_site(filled, tmp_path)
    before = {p: p.read_bytes() for p in site.rglob("*") if p.is_file()}
    (payload / "site" / "vllm/model.py").write_text("evil\n")
    with pytest.raises(install.InstallError, match="vllm/model.py: sha256"):
        install.install(payload, site)
    assert {p: p.read_bytes() for p in site.rglob("*") if p.is_file()} == before


def test_the_lock_records_inputs_tree_and_artifacts(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    result = build_into(filled, tmp_path)
    lock = json.loads(result.lock.read_text())
    assert lock["upstream"]["sdist"]["sha256"] == filled.pin.sdist.sha256
    assert lock["upstream"]["wheel"]["sha256"] == filled.pin.wheels["x86_64"].sha256
    assert [layer["patch"] for layer in lock["stack"]["layers"]] == [
        "0001-layer-1.patch",
        "0002-layer-2.patch",
        "0003-layer-3.patch",
    ]
    assert lock["artifacts"]["wheel"]["sha256"] == sha256_file(result.wheel)
    assert len(lock["tree"]["package_trees"]["vllm"]) == 40


def test_the_lock_is_the_same_whatever_object_format_the_caller_s_git_defaults_to(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIT_DEFAULT_HASH is no configuration: scrubbing the caller's config
    # leaves it, and the tree hashes the lock records would be SHA-256 ones.
    filled.apply()
    first = build_into(filled, tmp_path / "a").lock.read_bytes()
    monkeypatch.setenv("GIT_DEFAULT_HASH", "sha256")
    filled.apply()
    second = build_into(filled, tmp_path / "b").lock.read_bytes()
    assert second == first


def test_the_lock_records_the_image_recipe(filled: Synthetic, tmp_path: Path) -> None:
    filled.apply()
    result = build_into(filled, tmp_path)
    lock = json.loads(result.lock.read_text())
    context = tmp_path / "image"
    assert lock["image"] == {
        "dockerfile": sha256_file(context / "Dockerfile"),
        "installer": sha256_file(context / "stack" / "install.py"),
    }


def test_no_docker_engine_is_said_in_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    message = docker_build(tmp_path, "tag")
    assert message.startswith("docker: no engine answered")
    assert str(tmp_path) in message and "\n" not in message
    assert os.listdir(tmp_path) == []


def shadow_a_wheel_file(synthetic: Synthetic) -> None:
    """Layer 1 adds a file at a path only the upstream wheel ships; applied."""
    synthetic.amend(1, {"vllm/_C.abi3.so": "not a binary\n"})
    synthetic.take_back("overlay shadows a wheel file")
    synthetic.apply()


def test_a_new_file_at_a_path_only_the_upstream_wheel_ships_is_refused(
    synthetic: Synthetic, tmp_path: Path
) -> None:
    shadow_a_wheel_file(synthetic)
    with pytest.raises(StackError, match="vllm/_C.abi3.so is a new file .* wheel"):
        build_into(synthetic, tmp_path / "dist")
    assert list((tmp_path / "dist").iterdir()) == []


def dist_files(dist: Path) -> dict[str, bytes]:
    return {
        p.relative_to(dist).as_posix(): p.read_bytes()
        for p in sorted(dist.rglob("*"))
        if p.is_file()
    }


def test_a_failed_build_keeps_the_previous_build_whole(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    dist = tmp_path / "dist"
    build_into(filled, dist)
    before = dist_files(dist)
    shadow_a_wheel_file(filled)
    with pytest.raises(StackError, match="vllm/_C.abi3.so is a new file"):
        build_into(filled, dist)
    assert dist_files(dist) == before
    assert sorted(os.listdir(dist)) == sorted({p.split("/")[0] for p in before})


@pytest.mark.filterwarnings(
    "error::ResourceWarning", "error::pytest.PytestUnraisableExceptionWarning"
)
def test_a_wheel_that_fails_midway_leaves_no_partial_file_and_no_open_file(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    broken = tmp_path / "up" / filled.wheel.name
    broken.parent.mkdir()
    with zipfile.ZipFile(filled.wheel) as src, zipfile.ZipFile(broken, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/RECORD"):
                data = b"".join(
                    line
                    for line in data.splitlines(keepends=True)
                    if not line.startswith(b"vllm/_C.abi3.so,")
                )
            dst.writestr(info, data)
    dist = tmp_path / "dist"
    with pytest.raises(StackError, match="vllm/_C.abi3.so is missing from the"):
        build(filled.stack(), filled.pin, filled.tree, broken, dist, layers=3)
    assert dist_files(dist) == {}


def test_the_image_context_pulls_no_image_but_the_pinned_base(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    result = build_into(filled, tmp_path)
    lines = (result.context / "Dockerfile").read_text().splitlines()
    # A ``# syntax=`` directive makes BuildKit pull that frontend image first.
    directives = [
        line for line in lines if line.replace(" ", "").startswith("#syntax=")
    ]
    assert all("@sha256:" in line for line in directives), directives
    assert [line for line in lines if line.startswith("FROM ")] == [
        "FROM ${BASE_IMAGE}"
    ]
    assert f"ARG BASE_IMAGE={filled.pin.base_image}" in lines
    assert not [line for line in lines if line.startswith(("ADD ", "COPY --from"))]


def context_stat(context: Path) -> list[tuple[str, int, int]]:
    return [
        (p.relative_to(context).as_posix(), p.stat().st_mode, p.stat().st_mtime_ns)
        for p in sorted(context.rglob("*"))
    ] + [(".", context.stat().st_mode, context.stat().st_mtime_ns)]


def test_two_image_contexts_archive_the_same_modes_and_mtimes(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    old_umask = os.umask(0o077)
    try:
        first = build_into(filled, tmp_path / "a")
    finally:
        os.umask(old_umask)
    second = build_into(filled, tmp_path / "b")
    assert context_stat(first.context) == context_stat(second.context)
    assert {mtime for _, _, mtime in context_stat(first.context)} == {315532800 * 10**9}


def test_a_build_clears_what_a_killed_build_left_behind(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    dist = tmp_path / "dist"
    first = build_into(filled, dist)
    # What SIGKILL during a build leaves: its staging folder, half written.
    leftover = dist / f"{STAGING_PREFIX}killed"
    (leftover / "image").mkdir(parents=True)
    (leftover / f"{first.wheel.name}.part").write_bytes(b"PK\x03\x04")
    second = build_into(filled, dist)
    assert sorted(os.listdir(dist)) == sorted(
        ["image", "stack.lock.json", second.wheel.name]
    )


# A build whose process is interrupted while it removes the previous image
# context, once part of it (its lock) is gone.
_CHILD_INTERRUPTED_BUILD = """
import pickle, shutil, sys
from pathlib import Path
from k3stack.artifacts import build
from k3stack.series import load_stack
root, pin, tree, wheel, out = pickle.loads(bytes.fromhex(sys.argv[1]))
remove = shutil.rmtree
def interrupted(path, *args, **kwargs):
    locks = [p for p in Path(path).rglob("stack.lock.json") if p.parent.name == "stack"]
    if not locks:
        return remove(path, *args, **kwargs)
    locks[0].unlink()
    raise KeyboardInterrupt
shutil.rmtree = interrupted
build(load_stack(root), pin, tree, wheel, out, layers=3)
"""


def test_a_build_interrupted_while_the_old_image_context_goes_can_be_run_again(
    filled: Synthetic, tmp_path: Path
) -> None:
    """Ctrl-C while the previous context is removed: what is left must not be
    refused by the next build as files a build does not make."""
    filled.apply()
    dist = tmp_path / "dist"
    first = build_into(filled, dist)
    inputs = pickle.dumps((filled.root, filled.pin, filled.tree, filled.wheel, dist))
    path = os.pathsep.join([str(BUILD), os.environ.get("PYTHONPATH", "")])
    child = subprocess.run(
        [sys.executable, "-c", _CHILD_INTERRUPTED_BUILD, inputs.hex()],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=False,
    )
    assert "KeyboardInterrupt" in child.stderr
    again = build_into(filled, dist)
    assert again.lock.read_bytes() == first.lock.read_bytes()
    assert sorted(os.listdir(dist)) == ["image", LOCK_NAME, first.wheel.name]


def test_a_build_that_cannot_replace_the_image_context_keeps_the_previous_build(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old context the build may not remove or move (files another user
    owns): refused, the previous wheel and lock still there."""
    import shutil

    filled.apply()
    dist = tmp_path / "dist"
    first = build_into(filled, dist)
    before = {p.name: p.read_bytes() for p in dist.iterdir() if p.is_file()}
    context = dist / "image"
    remove, rename = shutil.rmtree, os.rename

    def not_permitted(real):
        def guarded(path, *args, **kwargs):
            if Path(path) == context:
                raise PermissionError(13, "Permission denied", str(context))
            return real(path, *args, **kwargs)

        return guarded

    monkeypatch.setattr(shutil, "rmtree", not_permitted(remove))
    monkeypatch.setattr(os, "rename", not_permitted(rename))
    with pytest.raises(StackError, match="Permission denied") as e:
        build_into(filled, dist)
    assert "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in dist.iterdir() if p.is_file()} == before
    assert (context / "stack" / LOCK_NAME).read_bytes() == first.lock.read_bytes()


def test_a_dist_that_cannot_be_written_is_refused_in_one_line(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    dist = tmp_path / "dist"
    dist.write_text("a file where the build folder should be\n")
    with pytest.raises(StackError, match=f"{dist} exists and is not a directory") as e:
        build_into(filled, dist)
    assert "\n" not in str(e.value)
    assert dist.read_text() == "a file where the build folder should be\n"


def test_a_build_keeps_what_it_did_not_make_in_dist(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    dist = tmp_path / "dist"
    (dist / "image").mkdir(parents=True)
    (dist / "image" / "notes.txt").write_text("mine\n")
    (dist / ".build-cache").mkdir()
    (dist / ".build-cache" / "data").write_text("mine\n")
    with pytest.raises(StackError, match="holds files a build does not make"):
        build_into(filled, dist)
    (dist / "image" / "notes.txt").rename(dist / "notes.txt")
    result = build_into(filled, dist)
    assert (dist / "notes.txt").read_text() == "mine\n"
    assert (dist / ".build-cache" / "data").read_text() == "mine\n"
    assert sorted(p.name for p in result.context.iterdir()) == ["Dockerfile", "stack"]


def test_site_refuses_a_dest_holding_something_else(tmp_path: Path) -> None:
    from k3stack.cli import check_site_dest

    dest = tmp_path / "site"
    dest.mkdir()
    check_site_dest(dest)  # empty: site may fill it
    (dest / "notes.txt").write_text("mine\n")
    with pytest.raises(StackError, match="was not made by `site`"):
        check_site_dest(dest)
    (dest / ".k3stack-wheel").write_text("vllm-1.0.whl 1234")
    check_site_dest(dest)  # a site an earlier `site` made: replaced
    assert (dest / "notes.txt").read_text() == "mine\n"


def test_site_refuses_a_site_packages_the_stack_wheel_was_installed_into(
    tmp_path: Path,
) -> None:
    from k3stack.cli import check_site_dest

    dest = tmp_path / "site-packages"
    (dest / "numpy").mkdir(parents=True)
    (dest / "vllm-1.0+stack.0123456789ab.dist-info").mkdir()
    with pytest.raises(StackError, match="was not made by `site`"):
        check_site_dest(dest)


def test_the_build_ships_a_new_file_with_a_non_ascii_name(
    synthetic: Synthetic, tmp_path: Path
) -> None:
    patch = synthetic.root / "patches/0001-layer-1.patch"
    patch.write_text(
        patch.read_text().replace("Overlay:\n", "Overlay:\n vllm/café.py\n")
    )
    (synthetic.root / "overlay/vllm/café.py").write_text("MENU = 1\n")
    synthetic.apply()
    result = build_into(synthetic, tmp_path)
    assert (result.context / "stack/site/vllm/café.py").read_text() == "MENU = 1\n"
    with zipfile.ZipFile(result.wheel) as zf:
        assert zf.read("vllm/café.py") == b"MENU = 1\n"


def test_the_self_check_finds_a_module_the_record_does_not_list(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = installed(filled, tmp_path)
    (site / "vllm/remote/backdoor.py").write_text("import os\n")
    assert install.verify(payload, site) == ["vllm/remote/backdoor.py: not in RECORD"]


def test_the_self_check_finds_an_installed_record_that_differs_from_the_lock(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = installed(filled, tmp_path)
    (record,) = site.glob("vllm-1.0+stack.*.dist-info/RECORD")
    record.write_text(record.read_text() + "vllm/backdoor.py,,\n")
    assert install.verify(payload, site) == [
        f"{record.relative_to(site).as_posix()}: content differs from the lock"
    ]


def test_the_self_check_finds_an_installed_record_rewritten_ahead_of_its_rows(
    filled: Synthetic, tmp_path: Path
) -> None:
    """An installed RECORD that does not begin with the lock's RECORD (a row
    put ahead of it) is not the lock's, whatever installer rows it holds."""
    from k3stack import install

    payload, site = installed(filled, tmp_path)
    (record,) = site.glob("vllm-1.0+stack.*.dist-info/RECORD")
    record.write_text("bin/vllm,,\n" + record.read_text())
    assert install.verify(payload, site) == [
        f"{record.relative_to(site).as_posix()}: content differs from the lock"
    ]


def test_the_self_check_accepts_bytecode_caches_beside_their_sources(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = installed(filled, tmp_path)
    cache = site / "vllm/__pycache__/model.cpython-312.pyc"
    cache.parent.mkdir()
    cache.write_bytes(b"bytecode")
    assert install.verify(payload, site) == []


def delete_model_in_layer_3(syn: Synthetic) -> None:
    """Layer 3 deletes the upstream file vllm/model.py; applied."""
    syn.amend(3, {}, delete=("vllm/model.py",))
    syn.take_back("layer 3 deletes model.py", today=dt.date(2026, 11, 3))


def test_the_wheel_leaves_out_a_file_a_layer_deletes(
    filled: Synthetic, tmp_path: Path
) -> None:
    delete_model_in_layer_3(filled)
    filled.apply()
    result = build_into(filled, tmp_path)
    with zipfile.ZipFile(result.wheel) as zf:
        assert "vllm/model.py" not in zf.namelist()
    assert json.loads(result.lock.read_text())["payload"]["removed"] == [
        "vllm/model.py"
    ]


def test_the_installer_removes_a_file_a_layer_deletes(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    delete_model_in_layer_3(filled)
    payload, site = installed(filled, tmp_path)
    assert not (site / "vllm/model.py").exists()
    assert install.verify(payload, site) == []


def test_the_self_check_finds_a_deleted_file_still_installed(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    delete_model_in_layer_3(filled)
    payload, site = installed(filled, tmp_path)
    (site / "vllm/model.py").write_text("def step_1():\n    return 1\n")
    assert "vllm/model.py: should have been removed" in install.verify(payload, site)


def test_the_installer_refuses_a_site_without_the_pinned_release(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = payload_and_upstream_site(filled, tmp_path)
    empty = tmp_path / "empty-site"
    empty.mkdir()
    with pytest.raises(install.InstallError, match="has neither vllm-1.0.dist-info"):
        install.install(payload, empty)
    assert list(empty.iterdir()) == []


def test_a_payload_missing_a_file_is_refused_before_anything_changes(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = payload_and_upstream_site(filled, tmp_path)
    before = {p: p.read_bytes() for p in site.rglob("*") if p.is_file()}
    (payload / "site" / "vllm/logits.py").unlink()
    with pytest.raises(install.InstallError, match="payload file vllm/logits.py is"):
        install.install(payload, site)
    assert {p: p.read_bytes() for p in site.rglob("*") if p.is_file()} == before


def test_the_installer_exits_1_when_its_self_check_finds_a_problem(
    filled: Synthetic, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from k3stack import install

    payload, site = installed(filled, tmp_path)
    (site / "vllm/logits.py").write_text("TOPK = 1\n")
    argv = ["--payload", str(payload), "--site", str(site), "--verify-only"]
    assert install.main(argv) == 1
    assert "k3-stack self-check: 1 problems" in capsys.readouterr().err


def test_a_docker_cli_whose_engine_does_not_answer_is_said_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The docker CLI is installed, its daemon is not running.
    docker = tmp_path / "bin" / "docker"
    docker.parent.mkdir()
    docker.write_text(
        "#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n"
    )
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{docker.parent}{os.pathsep}{os.environ['PATH']}")
    context = tmp_path / "image"
    context.mkdir()
    assert docker_build(context, "tag") == (
        "docker: no engine answered (Cannot connect to the Docker daemon); "
        f"context ready: {context}"
    )


def test_a_build_replaces_the_wheel_of_the_previous_stack(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    dist = tmp_path / "dist"
    build_into(filled, dist)
    (filled.root / "overlay/vllm/logits.py").write_text("TOPK = 65\n")
    git(filled.root, "commit", "-qam", "layer 2 changed")
    filled.apply()
    second = build_into(filled, dist)
    assert sorted(p.name for p in dist.glob("*.whl")) == [second.wheel.name]


def test_site_refuses_a_dest_that_is_a_file(tmp_path: Path) -> None:
    from k3stack.cli import check_site_dest

    dest = tmp_path / "site"
    dest.write_text("mine\n")
    with pytest.raises(StackError, match="exists and is not a directory"):
        check_site_dest(dest)
    assert dest.read_text() == "mine\n"


def test_verify_only_checks_the_site_and_installs_nothing(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack import install

    payload, site = payload_and_upstream_site(filled, tmp_path)
    before = {p: p.read_bytes() for p in site.rglob("*") if p.is_file()}
    argv = ["--payload", str(payload), "--site", str(site), "--verify-only"]
    assert install.main(argv) == 1
    assert {p: p.read_bytes() for p in site.rglob("*") if p.is_file()} == before


def test_a_changed_file_keeps_the_upstream_wheel_s_executable_mode(
    filled: Synthetic, tmp_path: Path
) -> None:
    upstream = tmp_path / "up" / filled.wheel.name
    upstream.parent.mkdir()
    with zipfile.ZipFile(filled.wheel) as src, zipfile.ZipFile(upstream, "w") as dst:
        for info in src.infolist():
            if info.filename == "vllm/envs.py":
                info.external_attr = 0o100755 << 16
            dst.writestr(info, src.read(info))
    filled.apply()
    result = build(filled.stack(), filled.pin, filled.tree, upstream, tmp_path / "d", 3)
    with zipfile.ZipFile(result.wheel) as zf:
        assert zf.getinfo("vllm/envs.py").external_attr >> 16 == 0o100755


def test_a_build_refuses_files_it_did_not_make_deep_in_the_image_context(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    dist = tmp_path / "dist"
    build_into(filled, dist)
    mine = dist / "image" / "stack" / "NOTES.txt"
    mine.write_text("mine\n")
    (dist / "image" / "stack" / "site" / "extra.py").write_text("X = 1\n")
    before = dist_files(dist)
    with pytest.raises(StackError, match="holds files a build does not make"):
        build_into(filled, dist)
    assert dist_files(dist) == before
    # What the previous build made is no user's: a rebuild replaces it.
    mine.unlink()
    (dist / "image" / "stack" / "site" / "extra.py").unlink()
    build_into(filled, dist)


def test_a_build_refuses_a_user_s_file_beside_the_payload_in_the_image_context(
    filled: Synthetic, tmp_path: Path
) -> None:
    """stack/site/ holds the payload, but only the files the lock lists are a
    build's: a file a user put there is refused, not removed by the build."""
    filled.apply()
    dist = tmp_path / "dist"
    build_into(filled, dist)
    (dist / "image" / "stack" / "site" / "vllm" / "mine.py").write_text("X = 1\n")
    before = dist_files(dist)
    with pytest.raises(StackError, match="stack/site/vllm/mine.py"):
        build_into(filled, dist)
    assert dist_files(dist) == before


def test_a_build_refuses_a_link_a_user_put_in_the_image_context(
    filled: Synthetic, tmp_path: Path
) -> None:
    filled.apply()
    dist = tmp_path / "dist"
    build_into(filled, dist)
    data = tmp_path / "data"
    data.mkdir()
    link = dist / "image" / "stack" / "data"
    link.symlink_to(data, target_is_directory=True)
    with pytest.raises(StackError, match="stack/data"):
        build_into(filled, dist)
    assert link.is_symlink()


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_an_image_path_that_is_no_folder_is_refused_before_anything_changes(
    filled: Synthetic, tmp_path: Path, kind: str
) -> None:
    filled.apply()
    dist = tmp_path / "dist"
    build_into(filled, dist)
    before = sorted(p.name for p in dist.iterdir())
    context = dist / "image"
    elsewhere = tmp_path / "elsewhere"
    context.rename(elsewhere)
    if kind == "file":
        context.write_text("mine\n")
    else:
        context.symlink_to(elsewhere)
    with pytest.raises(StackError, match=f"{context} .*refused") as e:
        build_into(filled, dist)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in dist.iterdir()) == before
    assert context.is_symlink() if kind == "symlink" else context.read_text()


def test_a_build_leaves_the_staging_folder_of_a_running_build_alone(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import k3stack.artifacts as artifacts

    filled.apply()
    dist = tmp_path / "dist"
    real = artifacts.build_wheel
    started: list[bool] = []

    def wheel_then_another_build(*args, **kwargs):
        wheel = real(*args, **kwargs)
        if not started:  # a second build into the same dist starts meanwhile
            started.append(True)
            build_into(filled, dist)
        return wheel

    monkeypatch.setattr(artifacts, "build_wheel", wheel_then_another_build)
    first = build_into(filled, dist)
    assert first.wheel.is_file() and first.lock.is_file()
    assert sorted(os.listdir(dist)) == ["image", "stack.lock.json", first.wheel.name]


def rename_wheel(wheel: Path, out: Path, version: str) -> Path:
    """``wheel`` (vllm 1.0) as the wheel of vllm ``version``."""
    target = out / wheel.name.replace("-1.0-", f"-{version}-")
    old, new = "vllm-1.0.dist-info", f"vllm-{version}.dist-info"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == f"{old}/METADATA":
                data = data.replace(b"Version: 1.0\n", f"Version: {version}\n".encode())
            if info.filename == f"{old}/RECORD":
                data = data.replace(old.encode(), new.encode())
            dst.writestr(info.filename.replace(old, new), data)
    return target


def test_build_refuses_a_tree_applied_on_another_upstream_than_the_pin(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `rebase --write-pin` (or a pin checked out), the tree still holds
    the old release: its changed files over the new release's binaries would
    be neither release."""
    from conftest import artifact

    from k3stack import cli
    from k3stack.pin import Pin

    wheel2 = rename_wheel(filled.wheel, tmp_path, "2.0")
    pins = {
        "1.0": filled.pin,
        "2.0": Pin(
            "vllm",
            "2.0",
            "def5678",
            filled.pin.sdist,  # not fetched by build
            {"x86_64": artifact(wheel2)},
            "vllm/vllm-openai:v2.0",
        ),
    }
    files = {filled.sdist.name: filled.sdist, filled.wheel.name: filled.wheel}
    files[wheel2.name] = wheel2
    monkeypatch.setattr(cli, "ROOT", filled.root)
    monkeypatch.setattr(cli, "fetch", lambda a, name: files[a.filename])
    monkeypatch.setattr(cli, "load_pin", lambda: pins["1.0"])
    tree = tmp_path / "applied"
    assert cli.main(["apply", "--tree", str(tree)]) == 0
    monkeypatch.setattr(cli, "load_pin", lambda: pins["2.0"])
    dist = tmp_path / "dist"
    assert cli.main(["build", "--tree", str(tree), "--dist", str(dist)]) == 1
    assert not dist.exists()
    monkeypatch.setattr(cli, "load_pin", lambda: pins["1.0"])
    assert cli.main(["build", "--tree", str(tree), "--dist", str(dist)]) == 0


def upstream_checkout(syn: Synthetic, path: Path) -> str:
    """A maintainer's git checkout of the synthetic upstream release; its
    full commit id."""
    extract_sdist(syn.sdist, path)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A", "--force")
    git(path, "commit", "-q", "-m", "upstream 1.0")
    return git(path, "rev-parse", "HEAD")


def test_the_lock_names_the_upstream_input_apply_used_sdist_or_checkout(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree laid out from a checkout (`apply --source`) is not the sdist's
    tree: its lock names the checkout's commit, not the pinned sdist."""
    from k3stack.cli import do_apply

    checkout = tmp_path / "upstream-checkout"
    commit = upstream_checkout(filled, checkout)
    pin = dataclasses.replace(filled.pin, commit=commit[:12])
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / filled.sdist.name).write_bytes(filled.sdist.read_bytes())
    monkeypatch.setenv("K3_STACK_CACHE", str(cache))
    locks = {}
    for source in (None, checkout):
        do_apply(filled.stack(), pin, filled.tree, None, source)
        out = tmp_path / ("checkout" if source else "sdist")
        result = build(filled.stack(), pin, filled.tree, filled.wheel, out, 3)
        locks[source] = json.loads(result.lock.read_text())
    assert locks[None]["upstream"]["sdist"] == {
        "filename": filled.sdist.name,
        "sha256": sha256_file(filled.sdist),
    }
    assert "checkout" not in locks[None]["upstream"]
    assert locks[checkout]["upstream"]["checkout"] == {"commit": commit}
    assert "sdist" not in locks[checkout]["upstream"]
    # Nothing of this machine (the checkout's path) in the lock.
    assert str(tmp_path) not in json.dumps(locks[checkout])


def test_build_refuses_a_tree_whose_marker_names_no_upstream_input(
    filled: Synthetic, tmp_path: Path
) -> None:
    """A tree applied by tooling that did not record the upstream input
    apply used: the lock could not name it."""
    marker = filled.tree / ".git" / MARKER
    older = json.loads(marker.read_bytes())
    older.pop("source", None)
    marker.write_text(json.dumps(older))
    with pytest.raises(StackError, match="run `nox -s apply` again") as e:
        build_into(filled, tmp_path / "dist")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "dist" / "stack.lock.json").exists()


def test_build_refuses_a_tree_whose_marker_names_a_malformed_upstream_input(
    filled: Synthetic, tmp_path: Path
) -> None:
    """A hand-edited marker whose input record lacks the sdist's sha256: the
    lock would carry that record as the input the image was built from."""
    marker = filled.tree / ".git" / MARKER
    edited = json.loads(marker.read_bytes())
    edited["source"] = {"sdist": {"filename": filled.sdist.name}}
    marker.write_text(json.dumps(edited))
    with pytest.raises(StackError, match=f"{MARKER} is empty or corrupt"):
        build_into(filled, tmp_path / "dist")
    assert not (tmp_path / "dist" / "stack.lock.json").exists()


def test_build_of_a_tree_holding_fewer_layers_than_the_series_says_so(
    filled: Synthetic,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A tree applied with --upto, or before a pull added a layer to the
    series: its artifacts lack the layers above, which the build says."""
    from k3stack import cli

    files = {filled.sdist.name: filled.sdist, filled.wheel.name: filled.wheel}
    monkeypatch.setattr(cli, "ROOT", filled.root)
    monkeypatch.setattr(cli, "fetch", lambda a, name: files[a.filename])
    monkeypatch.setattr(cli, "load_pin", lambda: filled.pin)
    monkeypatch.setattr(cli, "docker_build", lambda context, tag: "docker: none")
    tree, dist = tmp_path / "applied", tmp_path / "dist"
    assert cli.main(["apply", "--upto", "2", "--tree", str(tree)]) == 0
    capsys.readouterr()
    assert cli.main(["build", "--tree", str(tree), "--dist", str(dist)]) == 0
    out = capsys.readouterr().out
    assert "holds layers 1..2 of the series' 3" in out
    assert "leave out layer 3 " in out
    lock = json.loads((dist / "stack.lock.json").read_text())
    assert [layer["number"] for layer in lock["stack"]["layers"]] == [1, 2]
    assert cli.main(["apply", "--tree", str(tree)]) == 0
    capsys.readouterr()
    assert cli.main(["build", "--tree", str(tree), "--dist", str(dist)]) == 0
    assert "holds layers" not in capsys.readouterr().out


def test_the_wheel_does_not_depend_on_the_zlib_library_python_links(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another deflate implementation (zlib-ng, Fedora's system zlib since
    release 40) writes other bytes for the same data; the same inputs must
    give the same wheel wherever they are built."""
    import zlib

    first = build_into(filled, tmp_path / "zlib")
    real = zlib.compressobj

    def other_deflate(level: int = -1, method: int = zlib.DEFLATED, wbits: int = 15):
        # Valid deflate streams as another library writes them: other choices
        # of matches for the same data.
        return real(level, method, wbits, 9, zlib.Z_FILTERED)

    monkeypatch.setattr(zlib, "compressobj", other_deflate)
    second = build_into(filled, tmp_path / "other")
    assert sha256_file(second.wheel) == sha256_file(first.wheel)
    with zipfile.ZipFile(second.wheel) as zf:
        assert zf.testzip() is None


def test_the_installed_record_keeps_the_console_script_pip_wrote_for_upstream(
    filled: Synthetic, tmp_path: Path
) -> None:
    """The image's path: upstream's wheel installed by an installer that
    writes bin/vllm and lists it in the RECORD, the payload installed over
    it (twice: a rebuilt image layer), then ``pip uninstall vllm``. The new
    RECORD must keep that row, hash and all: an uninstaller that goes by the
    RECORD alone (uv's) would leave the script behind."""
    import venv

    filled.apply()
    payload = build_into(filled, tmp_path / "dist").context / "stack"
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")

    def run(*argv: str) -> None:
        proc = subprocess.run([python, *argv], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def script_rows(dist_info: str) -> list[list[str]]:
        (record,) = env_dir.glob(f"lib/python*/site-packages/{dist_info}/RECORD")
        rows = csv.reader(io.StringIO(record.read_text()))
        return [row for row in rows if row and row[0].endswith("/bin/vllm")]

    run("-m", "pip", "install", "-q", "--no-deps", "--no-index", str(filled.wheel))
    upstream = script_rows("vllm-1.0.dist-info")
    assert len(upstream) == 1 and upstream[0][1].startswith("sha256=")
    run(str(payload / "install.py"), "--payload", str(payload))
    run(str(payload / "install.py"), "--payload", str(payload))
    assert script_rows("vllm-1.0+stack.*.dist-info") == upstream
    run("-m", "pip", "uninstall", "-y", "-q", "vllm")
    assert not (env_dir / "bin" / "vllm").exists()
    assert list(env_dir.glob("lib/python*/site-packages/vllm*")) == []


def test_every_file_the_installed_record_lists_is_installed(
    filled: Synthetic, tmp_path: Path
) -> None:
    """The upstream RECORD's rows for its own dist-info, which the install
    removes, do not pass into the new RECORD."""
    _, site = installed(filled, tmp_path)
    (record,) = site.glob("vllm-1.0+stack.*.dist-info/RECORD")
    rows = [row for row in csv.reader(io.StringIO(record.read_text())) if row]
    assert [row[0] for row in rows if not (site / row[0]).is_file()] == []
