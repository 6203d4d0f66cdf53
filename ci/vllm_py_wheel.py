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
qualification runs: tensors still live on the GPU. Files are written in sorted
order with fixed timestamps, so the same tree gives the same bytes (with the
same zlib library: they are deflated).

Usage: ``PYTHONPATH=build python3 ci/vllm_py_wheel.py TREE OUTDIR`` (the
wheel is written by the stack's own deterministic zip writer,
``k3stack.wheel``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from k3stack.wheel import ZipWriter, record_hash

NAME = "vllm"
VERSION = "0.33.0+stack.py"
SUFFIXES = (".py", ".json")
PLUGIN = "k3_neutral_platform"
PLUGIN_SOURCE = b'''"""vLLM platform plugin of the GPU-test wheel (ci/vllm_py_wheel.py):
the wheel has no compiled extensions, so vLLM stays on its platform-neutral
code."""


def neutral() -> str:
    return "vllm.platforms.interface.UnspecifiedPlatform"
'''


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
    entries = [(path.relative_to(tree).as_posix(), path.read_bytes()) for path in files]
    entries += [(f"{PLUGIN}.py", PLUGIN_SOURCE), *meta.items()]
    outdir.mkdir(parents=True, exist_ok=True)
    wheel = outdir / f"{NAME}-{VERSION}-py3-none-any.whl"
    # Deflated: the wheel is carried to the GPU box within a size limit; its
    # bytes are the same for the same tree on one machine's zlib.
    writer = ZipWriter(wheel, deflate=True)
    record: list[list[str]] = []
    for name, data in entries:
        writer.add_bytes(name, data)
        record.append([name, record_hash(data), str(len(data))])
    writer.add_record(f"{dist_info}/RECORD", record)
    writer.close()
    return wheel


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(
            "usage: PYTHONPATH=build python3 ci/vllm_py_wheel.py TREE OUTDIR"
        )
    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
