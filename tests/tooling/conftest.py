# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A small synthetic upstream (sdist, wheel) and stack checkout for the tooling."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))

from k3stack.gitutil import git  # noqa: E402
from k3stack.pin import Artifact, Pin  # noqa: E402
from k3stack.series import Stack, load_stack  # noqa: E402
from k3stack.upstream import from_sdist  # noqa: E402
from k3stack.worktree import build_tree  # noqa: E402

UPSTREAM_FILES = {
    "vllm/__init__.py": "VERSION = '1.0'\n",
    "vllm/envs.py": "".join(f"SETTING_{i} = {i}\n" for i in range(40)),
    "vllm/model.py": "".join(f"def step_{i}():\n    return {i}\n\n" for i in range(30)),
    "tests/test_model.py": (
        "from vllm.model import step_1\n\n\ndef test_step_one():\n"
        "    assert step_1() == 1\n"
    ),
    "pyproject.toml": "[project]\nname = 'vllm'\n",
    # Released in the sdist but matched by its .gitignore, as in vLLM's
    # (whose patterns also match new files a maintainer may add, like *.csv).
    ".gitignore": "vllm/_version.py\n*.csv\n*.swp\n.pytest_cache/\nbuild/\n",
    "vllm/_version.py": "__version__ = '1.0'\n",
}


def make_sdist(path: Path, files: dict[str, str], top: str = "vllm-1.0") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            info.uid = 4242
            tar.addfile(info, io.BytesIO(data))
    return path


def make_wheel(path: Path) -> Path:
    files = {
        "vllm/__init__.py": UPSTREAM_FILES["vllm/__init__.py"].encode(),
        "vllm/envs.py": UPSTREAM_FILES["vllm/envs.py"].encode(),
        "vllm/model.py": UPSTREAM_FILES["vllm/model.py"].encode(),
        "vllm/_C.abi3.so": bytes(range(256)) * 64,
        "vllm-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: vllm\n"
        b"Version: 1.0\n\nThe engine.\n",
        "vllm-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
        b"Tag: cp38-abi3-manylinux_2_28_x86_64\n",
        # Installers write bin/vllm from it, as for upstream's wheel.
        "vllm-1.0.dist-info/entry_points.txt": b"[console_scripts]\n"
        b"vllm = vllm.model:step_1\n",
    }
    import base64

    rows = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        rows.append(f"{name},sha256={digest.decode()},{len(data)}")
    rows.append("vllm-1.0.dist-info/RECORD,,")
    files["vllm-1.0.dist-info/RECORD"] = ("\n".join(rows) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def artifact(path: Path) -> Artifact:
    data = path.read_bytes()
    return Artifact(path.name, len(data), hashlib.sha256(data).hexdigest())


PATCH_TEMPLATE = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: vLLM K3 overlay maintainers <k3-overlay@localhost>
Date: Sun, 01 Nov 2026 00:00:00 +0000
Subject: [PATCH] {subject}

Description: {subject}.
Origin: vendor
Forwarded: not-needed
Last-Update: 2026-11-01
Overlay:
Upstream-Tests:
 tests/test_model.py
Suite:
 tests/layer{n}
---
"""


@dataclass
class Synthetic:
    """A stack checkout, its synthetic upstream and an applied work tree."""

    root: Path
    sdist: Path
    wheel: Path
    pin: Pin
    tree: Path

    def stack(self) -> Stack:
        return load_stack(self.root)

    def apply(self, upto: int | None = None, sdist: Path | None = None) -> None:
        source = sdist or self.sdist
        build_tree(
            self.stack(),
            self.tree,
            from_sdist(source),
            "vllm 1.0 pristine\n",
            upto,
        )

    def take_back(self, message: str, today: dt.date | None = None) -> None:
        """Refresh the work tree's layers into the checkout and commit them
        there with ``message`` (``today``: the Last-Update date refresh
        writes)."""
        from k3stack.refresh import refresh

        refresh(self.stack(), self.tree, today=today)
        git(self.root, "add", "-A")
        git(self.root, "commit", "-q", "-m", message)

    def amend(self, n: int, edit: dict[str, str], delete: tuple[str, ...] = ()) -> None:
        """Change layer ``n``'s commit in the work tree, as a maintainer would."""
        git(self.tree, "checkout", "-q", f"layer-{n}")
        for rel, text in edit.items():
            (self.tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.tree / rel).write_text(text)
        for rel in delete:
            (self.tree / rel).unlink()
        git(self.tree, "add", "-A")
        git(self.tree, "commit", "-q", "--amend", "--no-edit")
        amended = git(self.tree, "rev-parse", "HEAD")
        git(self.tree, "checkout", "-q", "main")
        git(self.tree, "rebase", "-q", "--onto", amended, f"layer-{n}", "main")
        commits = git(self.tree, "rev-list", "--reverse", "upstream..main").split()
        for number, commit in enumerate(commits, start=1):
            git(self.tree, "tag", "-f", f"layer-{number}", commit)


def write_stack(root: Path, layers: int) -> None:
    (root / "patches").mkdir(parents=True)
    (root / "overlay" / "vllm").mkdir(parents=True)
    names = [f"{n:04d}-layer-{n}.patch" for n in range(1, layers + 1)]
    (root / "patches" / "series").write_text(
        "# test series\n" + "\n".join(names) + "\n"
    )
    for n, name in enumerate(names, start=1):
        (root / "patches" / name).write_text(
            PATCH_TEMPLATE.format(subject=f"Layer {n}", n=n)
        )


@pytest.fixture
def synthetic(tmp_path: Path) -> Synthetic:
    """Three empty layers on a synthetic upstream, applied in ``tree``."""
    root = tmp_path / "checkout"
    write_stack(root, 3)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "stack")
    sdist = make_sdist(tmp_path / "vllm-1.0.tar.gz", UPSTREAM_FILES)
    wheel = make_wheel(tmp_path / "vllm-1.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    pin = Pin(
        "vllm",
        "1.0",
        "abc1234",
        artifact(sdist),
        {"x86_64": artifact(wheel)},
        "vllm/vllm-openai:v1.0",
    )
    syn = Synthetic(root, sdist, wheel, pin, tmp_path / "tree")
    syn.apply()
    return syn


@pytest.fixture
def filled(synthetic: Synthetic) -> Synthetic:
    """Layers with real content: diffs of upstream files and overlay files,
    written by a maintainer's amend and taken back by refresh."""

    envs = UPSTREAM_FILES["vllm/envs.py"].replace("SETTING_5 = 5\n", "SETTING_5 = 55\n")
    synthetic.amend(1, {"vllm/envs.py": envs, "vllm/remote/__init__.py": "PORT = 1\n"})
    model = UPSTREAM_FILES["vllm/model.py"].replace(
        "def step_20():\n    return 20\n",
        "def step_20():\n    return 2000\n",
    )
    synthetic.amend(2, {"vllm/model.py": model, "vllm/logits.py": "TOPK = 64\n"})
    # A fixed date: a later refresh's Last-Update bump must not depend on
    # the day the tests run.
    synthetic.take_back("fill layers", today=dt.date(2026, 11, 2))
    return synthetic
