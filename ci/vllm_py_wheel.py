# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pack the Python of an applied work tree's ``vllm`` package as a pure-Python
wheel, for a GPU box that has no vllm and no network (``ci/gpu-carry.sh``).

The wheel holds every ``.py`` and ``.json`` file under ``TREE/vllm`` and no
compiled extension: on that box ``vllm._C`` is missing, which vLLM reports with
a warning, and whatever calls its ops fails there. vLLM's CUDA platform module
imports compiled extensions unconditionally, so the wheel also carries a vLLM
platform plugin (``k3_neutral_platform``) that keeps every process importing it
on vLLM's platform-neutral code (``UnspecifiedPlatform``), as the CPU
qualification runs: tensors still live on the GPU. Files are stored in sorted order
with fixed timestamps, so the same tree gives the same bytes.

Usage: ``python3 ci/vllm_py_wheel.py TREE OUTDIR``
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path

NAME = "vllm"
VERSION = "0.33.0+stack.py"
SUFFIXES = (".py", ".json")
EPOCH = (1980, 1, 1, 0, 0, 0)
PLUGIN = "k3_neutral_platform"
PLUGIN_SOURCE = b'''"""vLLM platform plugin of the GPU-test wheel (ci/vllm_py_wheel.py):
the wheel has no compiled extensions, so vLLM stays on its platform-neutral
code."""


def neutral() -> str:
    return "vllm.platforms.interface.UnspecifiedPlatform"
'''


def _record_row(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return [name, f"sha256={digest.decode()}", str(len(data))]


def build(tree: Path, outdir: Path) -> Path:
    package = tree / NAME
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"vllm_py_wheel: {package} is not an applied vllm tree")
    files = sorted(
        p for p in package.rglob("*") if p.is_file() and p.suffix in SUFFIXES
    )
    dist_info = f"{NAME}-{VERSION}.dist-info"
    meta = {
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: ci/vllm_py_wheel.py\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{dist_info}/entry_points.txt": (
            f"[vllm.platform_plugins]\n{PLUGIN} = {PLUGIN}:neutral\n".encode()
        ),
    }
    outdir.mkdir(parents=True, exist_ok=True)
    wheel = outdir / f"{NAME}-{VERSION}-py3-none-any.whl"
    record: list[list[str]] = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:

        def add(name: str, data: bytes) -> None:
            info = zipfile.ZipInfo(name, EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)
            record.append(_record_row(name, data))

        for path in files:
            add(path.relative_to(tree).as_posix(), path.read_bytes())
        add(f"{PLUGIN}.py", PLUGIN_SOURCE)
        for name, data in meta.items():
            add(name, data)
        record_name = f"{dist_info}/RECORD"
        record.append([record_name, "", ""])
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(record)
        info = zipfile.ZipInfo(record_name, EPOCH)
        info.external_attr = 0o644 << 16
        zf.writestr(info, text.getvalue(), zipfile.ZIP_DEFLATED)
    return wheel


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python3 ci/vllm_py_wheel.py TREE OUTDIR")
    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
